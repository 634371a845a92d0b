"""Request rings (``serve --request-ring``; docs/TRANSPORT.md) against real server
processes on the CPU, through the client package:

- answers through a ring are bit-identical to PrefillContext calls, inline or with q,
  output and LSE in shared memory, several requests in flight, answered in order; the
  metrics count them and the attached rings; a prepared request takes no slot until it
  is sent and reads a shared-memory q when it runs;
- a failed request is answered in-band with the unary call's status (naming the field)
  and the ring goes on: bad block ids, a wrong instance, bytes that are not a request,
  a length past the slot, an answer too big for the slot;
- attaching is refused with the right code and field: rings off, unknown region, bad
  geometry, past the region, overlapping rings, the limit;
- lifetime: closing detaches (the server goes on), unregistering the region or
  shrinking its object ends the ring's call, and draining ends it with UNAVAILABLE; a
  client waiting for an answer is released when the call ends;
- the client refuses misuse before it writes a slot, with an error that says what is wrong.
"""

from __future__ import annotations

import os
import time

import grpc
import numpy as np
import pytest

from context_layout import BS, CONTEXTS, NB, QUERIES, SEQS, SLOTS, TABLES, TQ, D, H, L, R, V
from ctxprefill.errors import ConfigError
from ctxprefill.settings import ServeSettings, shared_memory_kinds
from ctxprefill_api import pb
from ctxprefill_api.ring import HEADER_BYTES, REQUEST, slot_fields
from ctxprefill_client import (
    BF16,
    CtxPrefillError,
    PrefillContextClient,
    ServerRestartedError,
    SystemSharedMemoryRegion,
    float32_to_bf16_bits,
)
from rpc_errors import expect
from service_process import SHARED_MEMORY_MARKS, ServerProcess, sample_sum

pytestmark = SHARED_MEMORY_MARKS

COMMON = {"heads": H, "block_size": BS, "num_blocks": NB, "workspace_tokens": 64, "seed": 7,
          "shared_memory": "system"}
RNG = np.random.default_rng(11)
KV_C = RNG.standard_normal((len(SLOTS), L), dtype=np.float32)
K_PE = RNG.standard_normal((len(SLOTS), R), dtype=np.float32)
Q = float32_to_bf16_bits(RNG.standard_normal((TQ, H, D), dtype=np.float32))
SLOT_BYTES = 1 << 16
MAX_RINGS = 3


@pytest.fixture(scope="module")
def server():
    with ServerProcess({**COMMON, "request_ring": True, "request_ring_max": MAX_RINGS}) as proc:
        with PrefillContextClient(proc.target, retries=0, timeout=60) as c:
            c.write_cache(np.array(SLOTS), KV_C, K_PE)
        yield proc


@pytest.fixture()
def client(server):
    with PrefillContextClient(server.target, retries=0, timeout=60) as c:
        c.unregister_shared_memory("")
        yield c
        c.unregister_shared_memory("")


@pytest.fixture()
def region():
    r = SystemSharedMemoryRegion("ring", 4 * SLOT_BYTES + (1 << 16))
    try:
        yield r
    finally:
        r.close()
        r.unlink()


@pytest.fixture()
def reference(client):
    return client.prefill_context(Q, SEQS)


def metric(server, name, **labels) -> float:
    return sample_sum(server.scrape()[name], **labels)


def same(a, b) -> bool:
    return (np.array_equal(a.output_bits, b.output_bits)
            and np.array_equal(a.lse.view(np.uint32), b.lse.view(np.uint32)))  # -inf rows, bit for bit


def wait_for(pred, timeout=10.0) -> bool:
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        if pred():
            return True
        time.sleep(0.02)
    return False


# ----------------------------------------------------------------------------- answers


def test_ring_answers_equal_prefill_calls(server, client, region, reference):
    assert client.server_info().request_ring_max == MAX_RINGS
    assert not client.server_info().request_ring_stream_order  # rings on, stream order not allowed
    client.register_system_shared_memory(region)
    ok_before = metric(server, "ctxprefill_ring_requests_total", grpc_code="OK")
    with client.attach_request_ring(region, num_slots=4, slot_bytes=SLOT_BYTES) as ring:
        assert ring.ring_id and ring.is_open
        assert metric(server, "ctxprefill_request_rings") == 1
        res = ring.prefill_context(Q, SEQS, request_id="ring-1")
        assert same(res, reference) and res.request_id == "ring-1"
        assert res.stats["query_tokens"] == TQ and res.stats["total_nanos"] > 0
        # several in flight, answered in order (different shapes tell them apart)
        ring.submit(Q, SEQS)
        ring.submit(Q[:3], SEQS[:1])
        ring.submit(Q[3:], SEQS[1:])
        a, b, c = ring.result(), ring.result(), ring.result()
        assert same(a, reference)  # a batch's plan depends on the whole batch: compare like with like
        assert same(b, client.prefill_context(Q[:3], SEQS[:1]))
        assert same(c, client.prefill_context(Q[3:], SEQS[1:]))
        with pytest.raises(CtxPrefillError):
            ring.result()  # nothing in flight
    assert metric(server, "ctxprefill_ring_requests_total", grpc_code="OK") == ok_before + 4
    assert wait_for(lambda: metric(server, "ctxprefill_request_rings") == 0)


def test_reattaching_over_the_same_bytes_at_once_answers_every_request(server, client, region, reference):
    """A caller that closes its ring and attaches a new one over the same bytes straight away
    (a benchmark's second run, a client reconnecting) gets every request answered, end to
    end. The race this path had (the old ring taking the new one's first request) needs the
    engine thread held between two steps, so it is tested at the table, below."""
    client.register_system_shared_memory(region)
    for _ in range(8):
        with client.attach_request_ring(region, num_slots=2, slot_bytes=SLOT_BYTES, timeout=60) as ring:
            for _ in range(2):  # both slots: the old ring's next slot is the new one's first
                ring.submit(Q, SEQS)
            assert same(ring.result(), reference) and same(ring.result(), reference)
    assert wait_for(lambda: metric(server, "ctxprefill_request_rings") == 0)


def test_a_detached_ring_keeps_its_bytes_until_the_engine_thread_lets_go():
    """The ring table (no server): a ring its caller detached holds its bytes until the
    engine thread has let go of it; attaching over them is refused meanwhile, naming why."""
    import torch

    from ctxprefill.errors import AlreadyExists
    from ctxprefill.service.request_ring import RingTable
    from ctxprefill.service.shared_memory import SharedMemoryRegistry

    reg = SharedMemoryRegistry(("system",), max_regions=4, max_bytes=1 << 20)
    reg.attach(torch.device("cpu"))
    with SystemSharedMemoryRegion("r", 4 * 4096) as shm:
        reg.register_system("r", shm.key, 0, 4 * 4096)
        rings = RingTable(reg, 4)
        old = rings.attach("r", 0, 2, 4096, "unix:")
        assert old.usable()  # the engine thread's check before it takes a request
        old.detach()  # the caller went
        assert rings.letting_go("r", 4096, 8192) == [old] and rings.letting_go("r", 8192, 16384) == []
        assert rings.letting_go("other", 0, 8192) == []
        with pytest.raises(AlreadyExists, match="not let go of yet") as ei:
            rings.attach("r", 4096, 2, 4096, "unix:")
        assert ei.value.field == "offset"
        with pytest.raises(AssertionError):
            rings.forget(old)  # the bytes stay taken while the engine thread holds the ring
        beside = rings.attach("r", 8192, 2, 4096, "unix:")  # bytes it does not cover: free
        assert not old.usable() and old.stopped.result() is None  # the engine thread lets go
        rings.forget(old)
        assert rings.letting_go("r", 0, 8192) == [] and rings.rings == [beside]
        new = rings.attach("r", 0, 2, 4096, "unix:")
        assert new.usable() and not new.detached
        for r in (new, beside):
            r.detach()
            assert not r.usable()
        reg.unregister("")


def test_an_attach_over_a_detached_rings_bytes_waits_for_the_let_go():
    """``RingTable.attach_when_free`` (what AttachRequestRing calls): over a detached ring's
    bytes it attaches once the engine thread lets go of that ring, not before; past its wait
    it is refused as the table refuses; a caller elsewhere is refused without waiting."""
    import asyncio

    import torch

    from ctxprefill.errors import AlreadyExists, PermissionDenied
    from ctxprefill.service.request_ring import RingTable
    from ctxprefill.service.shared_memory import SharedMemoryRegistry

    reg = SharedMemoryRegistry(("system",), max_regions=4, max_bytes=1 << 20)
    reg.attach(torch.device("cpu"))

    async def scenario(rings: RingTable) -> None:
        old = rings.attach("r", 0, 2, 4096, "unix:")
        old.detach()
        t0 = time.monotonic()
        with pytest.raises(AlreadyExists, match="not let go of yet"):
            await rings.attach_when_free("r", 0, 2, 4096, "unix:", wait_s=0.05)
        assert time.monotonic() - t0 >= 0.05  # it waited before refusing
        t0 = time.monotonic()
        with pytest.raises(PermissionDenied):
            await rings.attach_when_free("r", 0, 2, 4096, "ipv4:192.0.2.7:41000", wait_s=5)
        assert time.monotonic() - t0 < 1
        loop = asyncio.get_running_loop()
        loop.call_later(0.1, old.usable)  # the engine thread's next poll lets go
        t0 = time.monotonic()
        new = await rings.attach_when_free("r", 0, 2, 4096, "unix:", wait_s=5)
        assert 0.1 <= time.monotonic() - t0 < 5 and old.stopped.done() and not new.detached
        new.detach()
        assert not new.usable()

    with SystemSharedMemoryRegion("r", 4 * 4096) as shm:
        reg.register_system("r", shm.key, 0, 4 * 4096)
        asyncio.run(scenario(RingTable(reg, 4)))
        reg.unregister("")


def test_ring_with_tensors_in_shared_memory(client, reference):
    q_bytes, out_bytes, lse_bytes = Q.nbytes, TQ * H * V * 2, H * TQ * 4
    data = SystemSharedMemoryRegion("data", q_bytes + out_bytes + lse_bytes + 4096)
    ring_region = SystemSharedMemoryRegion("ring", 2 * 4096)
    try:
        client.register_system_shared_memory(data)
        client.register_system_shared_memory(ring_region)
        q_in = data.write(Q, 0, BF16)
        out_ref = data.ref(q_bytes, out_bytes)
        lse_ref = data.ref(q_bytes + out_bytes, lse_bytes)
        with client.attach_request_ring(ring_region, num_slots=2, slot_bytes=4096) as ring:
            for _ in range(3):
                res = ring.prefill_context(q_in, SEQS, output_region=out_ref, lse_region=lse_ref)
                assert same(res, reference)
                assert res.output_ref.offset == q_bytes
            del res
    finally:
        client.unregister_shared_memory("")
        for r in (data, ring_region):
            r.close()
            r.unlink()


def test_a_prepared_request_takes_no_slot_and_reads_q_when_it_runs(client, reference):
    data = SystemSharedMemoryRegion("data", Q.nbytes + 4096)
    ring_region = SystemSharedMemoryRegion("ring", 2 * SLOT_BYTES)
    try:
        client.register_system_shared_memory(data)
        client.register_system_shared_memory(ring_region)
        q_in = data.write(np.zeros_like(Q), 0, BF16)
        with client.attach_request_ring(ring_region, num_slots=2, slot_bytes=SLOT_BYTES) as ring:
            inline = ring.prepare(Q, SEQS)  # an inline q is copied now
            shared = [ring.prepare(q_in, SEQS) for _ in range(3)]  # more than the slots: none taken
            ring.submit_prepared(inline)
            data.write(Q, 0, BF16)  # after its request was prepared, before it is sent
            ring.submit_prepared(shared[0])
            with pytest.raises(CtxPrefillError, match="slots hold requests in flight"):
                ring.submit_prepared(shared[1])
            assert same(ring.result(), reference) and same(ring.result(), reference)
            ring.submit_prepared(shared[2])
            assert same(ring.result(), reference)
    finally:
        client.unregister_shared_memory("")
        for r in (data, ring_region):
            r.close()
            r.unlink()


def test_the_client_refuses_misuse_before_writing_a_slot(client, region, reference):
    """The client's own checks, each an error that says what is wrong, the ring usable after:
    a region that is not system memory, a ring past its region, a request while others are in
    flight on prefill_context, result() for a request sent raw, a request on a closed ring."""
    client.register_system_shared_memory(region)
    with pytest.raises(TypeError, match="SystemSharedMemoryRegion"):
        client.attach_request_ring(object())
    with pytest.raises(ValueError, match="does not fit region 'ring'"):
        client.attach_request_ring(region, num_slots=8, slot_bytes=SLOT_BYTES)
    ring = client.attach_request_ring(region, num_slots=2, slot_bytes=SLOT_BYTES)
    assert repr(ring) == f"RequestRing('ring', num_slots=2, slot_bytes={SLOT_BYTES}, offset=0, in_flight=0)"
    ring.submit(Q, SEQS)
    with pytest.raises(CtxPrefillError, match="in flight on this ring"):
        ring.prefill_context(Q, SEQS)
    assert repr(ring).endswith("in_flight=1)")
    assert same(ring.result(), reference)
    ring.send(pb.PrefillContextRequest.FromString(ring.prepare(Q, SEQS).data))
    with pytest.raises(CtxPrefillError, match="sent with send"):
        ring.result()
    assert same(ring.prefill_context(Q, SEQS), reference)  # the raw answer was read and its slot freed
    ring.close()
    assert not ring.is_open
    with pytest.raises(CtxPrefillError, match="the request ring is closed"):
        ring.submit(Q, SEQS)


def test_a_ring_that_ends_while_an_answer_is_awaited_raises(client, region):
    """A client waiting for an answer that will not come (here: a slot it never wrote) is
    released when the ring's call ends, its deadline here, with the call's status: spinning,
    then sleeping between checks, never hanging."""
    client.register_system_shared_memory(region)
    ring = client.attach_request_ring(region, num_slots=2, slot_bytes=SLOT_BYTES, timeout=1.0, spin_s=0.05)
    ring._pending.append((0, 1, None))  # the bookkeeping of a request whose slot was never written
    with expect(grpc.StatusCode.DEADLINE_EXCEEDED, "the request ring was detached"):
        ring.receive()
    assert not ring.is_open
    ring.close()


# ----------------------------------------------------------------------------- in-band failures


def _raw_request(ring_region, slot: int, slot_bytes: int, payload: bytes, length: int | None = None,
                 seq: int = 77) -> None:
    """Write a slot by hand, as a client that does not use this package might."""
    buf = ring_region.ndarray(np.uint8, (slot_bytes * (slot + 1),), 0)
    states, seqs, lengths = slot_fields(buf, slot + 1, slot_bytes)
    base = slot * slot_bytes + HEADER_BYTES
    buf[base : base + len(payload)] = np.frombuffer(payload, np.uint8)
    seqs[slot] = seq
    lengths[slot] = len(payload) if length is None else length
    states[slot] = REQUEST
    del buf, states, seqs, lengths


def test_failures_are_answered_in_band_and_the_ring_goes_on(server, client, region, reference):
    client.register_system_shared_memory(region)
    with client.attach_request_ring(region, num_slots=4, slot_bytes=SLOT_BYTES) as ring:
        bad = [(QUERIES[0], CONTEXTS[0], [99, *TABLES[0][1:]]), *SEQS[1:]]
        with expect(grpc.StatusCode.OUT_OF_RANGE, "sequences[0].block_table"):
            ring.prefill_context(Q, bad)
        with expect(grpc.StatusCode.INVALID_ARGUMENT, "q"):
            ring.prefill_context(Q[:5], SEQS)
        assert same(ring.prefill_context(Q, SEQS), reference)
        # a wrong instance: the client's restart detection, as for a unary call
        client.reset_instance("not-this-server")
        with pytest.raises(ServerRestartedError):
            ring.prefill_context(Q, SEQS)
        client.reset_instance(None)
        assert same(ring.prefill_context(Q, SEQS), reference)
    # bytes by hand: not a request, and a length past the slot
    with client.attach_request_ring(region, num_slots=2, slot_bytes=8192) as ring:
        for slot, payload, length, field in ((0, b"\xff\xff\xff\xff garbage", None, "PrefillContextRequest"),
                                             (1, b"", 9000, "length")):
            ring._next = (slot + 1) % 2  # the client's bookkeeping skips the slot written by hand
            _raw_request(region, slot, 8192, payload, length)
            ring._pending.append((slot, 77, None))
            msg = ring.receive()
            assert msg.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and field in msg.error.message
        ring._next = 0
        assert same(ring.prefill_context(Q, SEQS), reference)
    assert metric(server, "ctxprefill_ring_requests_total", grpc_code="INVALID_ARGUMENT") >= 3
    client.server_info()  # the server goes on


def test_an_answer_too_big_for_the_slot_is_refused_in_band(client, region, reference):
    client.register_system_shared_memory(region)
    q_in = region.write(Q, 3 * 4096, BF16)  # after the ring: the request is small, its inline answer is not
    with client.attach_request_ring(region, num_slots=2, slot_bytes=4096) as ring:
        with expect(grpc.StatusCode.RESOURCE_EXHAUSTED, "output_region"):
            ring.prefill_context(q_in, SEQS)  # a 4.6 KB output inline does not fit a 4 KB slot
        with pytest.raises(ValueError, match="slot holds"):
            ring.prefill_context(Q, SEQS)  # the request itself does not fit: refused before it is written
        assert ring.is_open
        assert same(ring.prefill_context(q_in, SEQS, output_region=region.ref(8 * 4096, TQ * H * V * 2),
                                         lse_region=region.ref(12 * 4096, H * TQ * 4)), reference)


# ----------------------------------------------------------------------------- attaching


def test_attach_refusals(server, client, region):
    stub = client._stub

    def attach(**kw):
        req = pb.AttachRequestRingRequest(**{"region": "ring", "offset": 0, "num_slots": 2, "slot_bytes": 4096, **kw})
        call = stub.AttachRequestRing(req, timeout=10)
        try:
            next(call)
        except grpc.RpcError as e:
            return e.code(), e.details()
        call.cancel()
        return grpc.StatusCode.OK, ""

    code, details = attach()
    assert code == grpc.StatusCode.NOT_FOUND and "region" in details
    client.register_system_shared_memory(region)
    for kw, want, field in (({"num_slots": 0}, grpc.StatusCode.INVALID_ARGUMENT, "num_slots"),
                            ({"num_slots": 5000}, grpc.StatusCode.INVALID_ARGUMENT, "num_slots"),
                            ({"slot_bytes": 1000}, grpc.StatusCode.INVALID_ARGUMENT, "slot_bytes"),
                            ({"slot_bytes": 4096 + 8}, grpc.StatusCode.INVALID_ARGUMENT, "slot_bytes"),
                            ({"offset": 8}, grpc.StatusCode.INVALID_ARGUMENT, "offset"),
                            ({"num_slots": 1024, "slot_bytes": 1 << 16}, grpc.StatusCode.OUT_OF_RANGE, "slot_bytes"),
                            ({"expected_instance_id": "nope"}, grpc.StatusCode.FAILED_PRECONDITION, "instance"),
                            # stream order is off unless the server allows it (and needs CUDA)
                            ({"ready_events": [bytes(64)] * 2}, grpc.StatusCode.FAILED_PRECONDITION,
                             "--request-ring-stream-order")):
        code, details = attach(**kw)
        assert code == want and field in details, (kw, code, details)
    # overlapping rings, and the limit
    rings = [client.attach_request_ring(region, num_slots=2, slot_bytes=4096, offset=0)]
    try:
        code, details = attach(offset=4096)
        assert code == grpc.StatusCode.ALREADY_EXISTS and "overlap" in details
        for i in range(1, MAX_RINGS):
            rings.append(client.attach_request_ring(region, num_slots=2, slot_bytes=4096, offset=i * 8192))
        code, details = attach(offset=MAX_RINGS * 8192)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--request-ring-max" in details
    finally:
        for r in rings:
            r.close()
    assert wait_for(lambda: metric(server, "ctxprefill_request_rings") == 0)
    assert wait_for(lambda: attach(offset=4096)[0] == grpc.StatusCode.OK)  # detached: the range is free again


def test_rings_off_by_default():
    proc = ServerProcess({**COMMON})
    r = SystemSharedMemoryRegion("ring", 8192)
    try:
        proc.wait_ready()
        with PrefillContextClient(proc.target, retries=0, timeout=30) as c:
            assert c.server_info().request_ring_max == 0
            assert c.server_info().request_ring_stream_order is False
            c.register_system_shared_memory(r)
            with expect(grpc.StatusCode.UNIMPLEMENTED, "--request-ring"):
                c.attach_request_ring(r, num_slots=2, slot_bytes=4096)
            c.unregister_shared_memory("")
    finally:
        proc.terminate(15)
        proc.kill()
        r.close()
        r.unlink()


def test_settings_need_system_shared_memory():
    with pytest.raises(ConfigError, match="--request-ring needs --shared-memory"):
        shared_memory_kinds(ServeSettings(device="cpu", request_ring=True))
    with pytest.raises(ConfigError, match="--request-ring-poll-us"):
        shared_memory_kinds(ServeSettings(device="cpu", shared_memory="system", request_ring=True,
                                          request_ring_poll_us=0))
    assert shared_memory_kinds(ServeSettings(device="cpu", shared_memory="system", request_ring=True)) == ("system",)
    # stream order needs CUDA regions, so a CUDA server
    with pytest.raises(ConfigError, match="--request-ring-stream-order needs CUDA"):
        shared_memory_kinds(ServeSettings(device="cpu", shared_memory="all", request_ring=True,
                                          request_ring_stream_order=True))


# ----------------------------------------------------------------------------- lifetime


def test_unregistering_the_region_ends_the_ring(server, client, region, reference):
    client.register_system_shared_memory(region)
    ring = client.attach_request_ring(region, num_slots=2, slot_bytes=4096 * 4)
    assert same(ring.prefill_context(Q, SEQS), reference)
    client.unregister_shared_memory("ring")
    assert wait_for(lambda: not ring.is_open)
    with expect(grpc.StatusCode.FAILED_PRECONDITION, "unregistered"):
        ring.prefill_context(Q, SEQS)
    ring.close()
    assert same(client.prefill_context(Q, SEQS), reference)


def test_a_shrunk_object_ends_the_ring_not_the_server(client, reference):
    r = SystemSharedMemoryRegion("ring", 4 * 8192)
    try:
        client.register_system_shared_memory(r)
        ring = client.attach_request_ring(r, num_slots=4, slot_bytes=8192)
        assert same(ring.prefill_context(Q, SEQS), reference)
        os.truncate(os.path.join("/dev/shm", r.key), 4096)  # under the ring: reading it would be SIGBUS
        assert wait_for(lambda: not ring.is_open)
        with expect(grpc.StatusCode.FAILED_PRECONDITION, "shrank"):
            ring.prefill_context(Q, SEQS)
        ring.close()
        assert same(client.prefill_context(Q, SEQS), reference)  # the server is alive
    finally:
        client.unregister_shared_memory("")
        r.close()
        r.unlink()


def test_draining_ends_the_ring_with_unavailable():
    proc = ServerProcess({**COMMON, "request_ring": True}, grace_seconds=5)
    r = SystemSharedMemoryRegion("ring", 2 * 4096 * 4)
    try:
        proc.wait_ready()
        with PrefillContextClient(proc.target, retries=0, timeout=30) as c:
            c.register_system_shared_memory(r)
            ring = c.attach_request_ring(r, num_slots=2, slot_bytes=4096 * 4)
            ring.prefill_context(Q[:3], SEQS[:1])
            proc.terminate(15)
            assert wait_for(lambda: not ring.is_open)
            with expect(grpc.StatusCode.UNAVAILABLE, "draining"):
                ring.prefill_context(Q[:3], SEQS[:1])
            ring.close()
        assert proc.proc.wait(timeout=30) == 0
    finally:
        proc.kill()
        r.close()
        r.unlink()
