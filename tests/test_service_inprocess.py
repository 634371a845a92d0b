"""The service layer in-process (CPU, a small real Engine): what is hard to provoke in
a separate process — a full queue, a deadline that passes while queued, a device
out-of-memory error, starting and draining, an unexpected exception — plus the
codec, the request checks (decoding, the transport's, the engine's) and the HTTP app on
their own."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import grpc
import numpy as np
import pytest
import torch

from ctxprefill.engine.request import validate_prefill, validate_read, validate_write
from ctxprefill.errors import InvalidArgument, OutOfRange
from ctxprefill.ops.fp8 import FP8
from ctxprefill.service import codec, transport
from ctxprefill.service.engine_worker import EngineWorker
from ctxprefill.service.http import HttpApp
from ctxprefill.service.interceptors import INTERNAL_MESSAGE, RpcStatusError
from ctxprefill.service.metrics import Metrics
from ctxprefill_api import pb
from ctxprefill_client import encode_tensor, float32_to_bf16_bits
from inprocess_service import Harness, prefill_req, read_req, small_engine
from service_process import parse_metrics, sample_sum

# torch warns (once) that a tensor over an immutable `bytes` is writable; the codec never writes
pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")

@pytest.fixture(scope="module")
def engine():
    return small_engine()


async def wait_until(cond, timeout=10.0):
    t_end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < t_end, "condition not met in time"
        await asyncio.sleep(0.01)


async def code_of(coro) -> grpc.StatusCode:
    try:
        await coro
    except grpc.aio.AioRpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def blocking_read(engine, monkeypatch, gate: threading.Event, ran: list):
    orig = engine.read  # what the service calls

    def read(request):
        slot = int(request.slot_mapping[0])
        ran.append(slot)
        if slot == 0:
            assert gate.wait(20)
        return orig(request)

    monkeypatch.setattr(engine, "read", read)


def test_queue_full_is_refused_at_once(engine, monkeypatch):
    gate, ran = threading.Event(), []
    blocking_read(engine, monkeypatch, gate, ran)

    async def main():
        async with Harness(engine, queue_size=2) as h:
            a = asyncio.ensure_future(h.stub.ReadCache(read_req(0), timeout=30))
            await wait_until(lambda: ran == [0])  # A runs (and blocks) on the engine thread
            b = asyncio.ensure_future(h.stub.ReadCache(read_req(1), timeout=30))
            await wait_until(lambda: h.servicer.in_flight == 2)
            assert h.worker.waiting == 1
            assert await code_of(h.stub.ReadCache(read_req(2), timeout=30)) == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert not a.done() and not b.done() and ran == [0]  # refused while A still blocks: at once
            page = parse_metrics(h.metrics.render().decode())
            assert sample_sum(page["ctxprefill_queue_depth"]) == 1
            gate.set()
            assert (await a).slots.shape == [1, engine.cache.config.bytes_per_slot]
            await b
            assert h.handled("ReadCache", "RESOURCE_EXHAUSTED") == 1 and h.handled("ReadCache", "OK") == 2
            assert ran == [0, 1]

    asyncio.run(main())


def test_a_request_whose_deadline_passed_in_the_queue_is_not_run(engine, monkeypatch):
    gate, ran = threading.Event(), []
    blocking_read(engine, monkeypatch, gate, ran)

    async def main():
        async with Harness(engine) as h:
            a = asyncio.ensure_future(h.stub.ReadCache(read_req(0), timeout=30))
            await wait_until(lambda: ran == [0])
            assert await code_of(h.stub.ReadCache(read_req(5), timeout=0.3)) == grpc.StatusCode.DEADLINE_EXCEEDED
            gate.set()
            await a
            await h.stub.ReadCache(read_req(6), timeout=30)
            assert ran == [0, 6]  # slot 5's read never ran
            assert h.handled("ReadCache", "DEADLINE_EXCEEDED") == 1

    asyncio.run(main())


def test_worker_skips_an_expired_deadline():
    async def main():
        w = EngineWorker(Metrics())
        gate, ran = threading.Event(), []
        first = w.submit(lambda: gate.wait(20))
        second = w.submit(lambda: ran.append(1), deadline=time.monotonic() + 0.05)
        await asyncio.sleep(0.2)
        gate.set()
        assert await first
        with pytest.raises(RpcStatusError) as ei:
            await second
        assert ei.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and not ran
        w.stop()

    asyncio.run(main())


def test_out_of_memory_is_resource_exhausted_and_the_server_goes_on(engine, monkeypatch):
    orig = engine.start_prefill  # what the service calls
    calls = []

    def start_prefill(*a, **kw):
        calls.append(1)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return orig(*a, **kw)

    monkeypatch.setattr(engine, "start_prefill", start_prefill)
    released = []  # the engine's CUDA graphs dropped before the answer (their pool's memory back)
    monkeypatch.setattr(engine, "release_graphs", lambda: released.append(len(calls)) or 3)

    async def main():
        async with Harness(engine) as h:
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await h.stub.PrefillContext(prefill_req(), timeout=30)
            assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "out of memory" in ei.value.details()
            assert released == [1]
            r = await h.stub.PrefillContext(prefill_req(), timeout=30)
            assert list(r.output.shape) == [2, 1, 128] and r.stats.num_chunks == 1
            page = parse_metrics(h.metrics.render().decode())
            assert sample_sum(page["ctxprefill_rejected_requests_total"], reason="out_of_memory") == 1

    asyncio.run(main())


def test_unexpected_errors_are_internal_with_a_generic_message(engine, monkeypatch, caplog):
    def boom(request):
        raise ValueError("secret detail")

    monkeypatch.setattr(engine, "read", boom)

    async def main():
        async with Harness(engine) as h:
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await h.stub.ReadCache(read_req(0), timeout=30)
            assert ei.value.code() == grpc.StatusCode.INTERNAL
            assert ei.value.details() == INTERNAL_MESSAGE
            assert h.handled("ReadCache", "INTERNAL") == 1

    with caplog.at_level(logging.ERROR, logger="ctxprefill.service"):
        asyncio.run(main())
    rec = [r for r in caplog.records if r.exc_info and "secret detail" in str(r.exc_info[1])]
    assert rec and rec[0].exc_info is not None


def test_starting_and_draining_are_unavailable(engine):
    async def main():
        async with Harness(engine, ready=False) as h:
            assert await code_of(h.stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)) == \
                grpc.StatusCode.UNAVAILABLE
            h.servicer.attach_engine(engine)
            h.servicer.set_ready()
            info = await h.stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
            assert info.instance_id == engine.instance_id and info.bytes_per_slot == 1152
            h.servicer.start_draining()
            for call in (h.stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10),
                         h.stub.PrefillContext(prefill_req(), timeout=10)):
                assert await code_of(call) == grpc.StatusCode.UNAVAILABLE
            assert h.handled("GetServerInfo", "UNAVAILABLE") == 2

    asyncio.run(main())


def test_instance_and_validation_errors_name_the_field(engine):
    async def main():
        async with Harness(engine) as h:
            req = prefill_req()
            req.expected_instance_id = "not-this-one"
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await h.stub.PrefillContext(req, timeout=10)
            assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert ei.value.details().startswith("expected_instance_id:")
            req.expected_instance_id = engine.instance_id
            r = await h.stub.PrefillContext(req, timeout=10)
            assert r.instance_id == engine.instance_id and r.request_id

    asyncio.run(main())


# ------------------------------------------------------------------------------- codec


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, FP8, torch.int32, torch.int64,
                                   torch.uint8])
def test_codec_round_trip_keeps_the_bits(dtype):
    x = torch.randn(3, 5, 7) * 100
    x = x.clamp(-448, 448).to(dtype) if dtype == FP8 else x.to(dtype)
    msg = codec.encode(x)
    y = codec.decode(msg, "t")
    assert y.dtype == dtype and tuple(y.shape) == (3, 5, 7)
    assert torch.equal(x.view(torch.uint8) if dtype == FP8 else x, y.view(torch.uint8) if dtype == FP8 else y)
    empty = codec.decode(codec.encode(x[:0]), "t")
    assert empty.shape == (0, 5, 7) and empty.dtype == dtype


def test_codec_views_the_message_bytes_without_copying():
    data = np.arange(12, dtype=np.float32).tobytes()
    msg = pb.Tensor(dtype=pb.DATA_TYPE_FP32, shape=[3, 4], data=data)
    held = msg.data
    t = codec.decode(msg, "t", data=held)
    assert t.data_ptr() == np.frombuffer(held, dtype=np.uint8).ctypes.data


@pytest.mark.parametrize("shape,data,needle", [
    ([2**40, 2**40], b"", "elements"),
    ([-1, 4], b"", "extent"),
    ([1] * 9, b"\0\0", "dimensions"),
    ([3], b"\0" * 5, "data has 5 bytes"),
])
def test_codec_refuses_bad_shapes_before_allocating(shape, data, needle):
    with pytest.raises(InvalidArgument) as ei:
        codec.decode(pb.Tensor(dtype=pb.DATA_TYPE_BF16, shape=shape, data=data), "kv_c")
    assert ei.value.field == "kv_c" and needle in ei.value.message


def test_codec_refuses_unknown_dtypes_and_the_engine_unwanted_ones(engine):
    with pytest.raises(InvalidArgument, match="UNSPECIFIED"):
        codec.decode(pb.Tensor(dtype=0, shape=[1], data=b"\0"), "q")
    # a known dtype a field does not take: the engine's one check names it
    msg = pb.ReadCacheRequest(slot_mapping=pb.Tensor(dtype=pb.DATA_TYPE_INT32, shape=[1], data=b"\0" * 4))
    with pytest.raises(InvalidArgument, match="INT64") as ei:
        validate_read(codec.decode_read(msg), engine.config, "this-instance")
    assert ei.value.field == "slot_mapping"


# ------------------------------------------------------------------------ request checks


def _checked_prefill(msg, cfg, max_bytes=64 << 20):
    """A PrefillContext message the way the service takes it to the device: decoded (the
    codec's checks), the transport's checks, then the engine's."""
    request = codec.decode_prefill(msg).request
    transport.prefill_placements(msg, request, cfg, None, max_bytes)
    return validate_prefill(request, cfg, "this-instance")


def test_prefill_checks_name_the_field(engine):
    cfg = engine.config
    ok = prefill_req()
    assert codec.decode_prefill(ok).request.plan is None
    checked = _checked_prefill(ok, cfg)
    assert checked.q.dtype == torch.bfloat16 and checked.block_table[0].tolist() == [3, 4]
    assert [(c.context_starts, c.context_lens) for c in checked.chunks] == [((0,), (20,))]  # planned

    def fails(mutate, exc=InvalidArgument, max_bytes=64 << 20):
        r = pb.PrefillContextRequest()
        r.CopyFrom(ok)
        mutate(r)
        with pytest.raises(exc) as ei:
            _checked_prefill(r, cfg, max_bytes)
        return ei.value.field

    assert fails(lambda r: r.sequences[0].block_table.__setitem__(1, 8), OutOfRange) == "sequences[0].block_table[1]"
    assert fails(lambda r: r.sequences[0].block_table.__setitem__(0, -1), OutOfRange) == "sequences[0].block_table[0]"
    assert fails(lambda r: setattr(r.sequences[0], "query_len", -2)) == "sequences[0].query_len"
    assert fails(lambda r: r.sequences.add(query_len=1)) == "sequences"
    assert fails(lambda r: setattr(r, "workspace_tokens", 65)) == "workspace_tokens"
    assert fails(lambda r: r.plan.add(first_sequence=0, num_sequences=0)) == "plan[0].num_sequences"
    assert fails(lambda r: r.plan.add(first_sequence=0, num_sequences=1, context_start=[0],
                                      context_len=[])) == "plan[0].context_len"
    assert fails(lambda r: r.plan.add(first_sequence=0, num_sequences=1, context_start=[0],
                                      context_len=[70])) == "plan[0]"
    assert fails(lambda r: None, max_bytes=1 << 20) == "q"  # the response would not fit a message
    # the request's own bounds, checked before anything of it is built
    assert fails(lambda r: setattr(r, "request_id", "r" * (codec.MAX_REQUEST_ID + 1))) == "request_id"
    assert fails(lambda r: r.plan.extend([pb.ContextChunk()] * (codec.MAX_PLAN_CHUNKS + 1))) == "plan"
    # a valid explicit plan comes through as ContextChunks
    r = pb.PrefillContextRequest()
    r.CopyFrom(ok)
    r.plan.add(first_sequence=0, num_sequences=1, context_start=[0], context_len=[16])
    r.plan.add(first_sequence=0, num_sequences=1, context_start=[16], context_len=[4])
    plan = _checked_prefill(r, cfg).chunks
    assert [(c.context_starts, c.context_lens) for c in plan] == [((0,), (16,)), ((16,), (4,))]


@pytest.mark.parametrize("bad", [-1, "num_blocks", 2**32 + 3, -(2**63)])
def test_a_block_id_out_of_range_is_named_wherever_it_lies(engine, bad):
    """The engine checks every used block id of every sequence in one pass: the first bad
    one is named, by sequence and position; an int64 id past int32 is refused, not
    wrapped into range; unused entries past a table's need are not read."""
    from ctxprefill.engine.request import PrefillRequest, SequenceSpec

    cfg = engine.config
    bs, nb = cfg.cache.block_size, cfg.cache.num_blocks
    bad = nb if bad == "num_blocks" else bad
    q = torch.zeros((3, cfg.shape.heads, cfg.shape.qk_head_dim), dtype=torch.bfloat16)
    seqs = [SequenceSpec(1, 2 * bs, np.array([0, 1], dtype=np.int64)),
            SequenceSpec(1, 3 * bs - 1, np.array([nb - 1, 2, 3], dtype=np.int64)),
            SequenceSpec(1, bs, np.array([4, 5, bad], dtype=np.int64))]
    checked = validate_prefill(PrefillRequest(q, seqs), cfg, "x")  # seq 2 uses 1 block: bad is unused
    assert checked.block_table.dtype == np.int32
    assert checked.block_table.tolist() == [[0, 1, 0], [nb - 1, 2, 3], [4, 0, 0]]
    seqs[1].block_table[2] = bad
    with pytest.raises(OutOfRange) as ei:
        validate_prefill(PrefillRequest(q, seqs), cfg, "x")
    assert ei.value.field == "sequences[1].block_table[2]" and f"block {bad} is outside [0, {nb})" in str(ei.value)


def test_write_and_read_checks(engine):
    cfg = engine.config
    n = cfg.cache.num_slots

    def checked_write(req):
        return validate_write(codec.decode_write(req).request, cfg, "this-instance")

    req = pb.WriteCacheRequest(slot_mapping=encode_tensor(np.array([-1, n - 1], np.int64)),
                               kv_c=encode_tensor(np.zeros((2, 512), np.float32)),
                               k_pe=encode_tensor(float32_to_bf16_bits(np.zeros((2, 64), np.float32)),
                                                  pb.DATA_TYPE_BF16))
    a = checked_write(req)
    assert a.slot_mapping.shape[0] == 2 and a.kv_c.dtype == torch.float32 and a.k_pe.dtype == torch.bfloat16
    req.slot_mapping.CopyFrom(encode_tensor(np.array([0, n], np.int64)))
    with pytest.raises(OutOfRange) as ei:
        checked_write(req)
    assert ei.value.field == "slot_mapping[1]"
    req.slot_mapping.CopyFrom(encode_tensor(np.array([0], np.int64)))
    with pytest.raises(InvalidArgument) as ei:
        checked_write(req)
    assert ei.value.field == "kv_c"
    with pytest.raises(OutOfRange):
        validate_read(codec.decode_read(read_req(-1)), cfg, "this-instance")


# -------------------------------------------------------------------------------- http


async def _get(app, path, method="GET"):
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(msg):
        sent.append(msg)

    await app({"type": "http", "path": path, "method": method, "headers": []}, receive, send)
    return sent[0]["status"], dict(sent[0]["headers"]), sent[1]["body"]


def test_http_app_routes():
    m = Metrics()
    state = {"ready": False}
    app = HttpApp(m, is_ready=lambda: state["ready"], state=lambda: "starting")

    async def main():
        assert (await _get(app, "/healthz"))[0] == 200
        status, _, body = await _get(app, "/readyz")
        assert status == 503 and b"starting" in body
        state["ready"] = True
        assert (await _get(app, "/readyz"))[0] == 200
        status, headers, body = await _get(app, "/metrics")
        assert status == 200 and headers[b"content-type"].startswith(b"text/plain")
        assert b"ctxprefill_queue_depth" in body
        assert (await _get(app, "/"))[0] == 404
        assert (await _get(app, "/metrics/x"))[0] == 404
        assert (await _get(app, "/metrics", "POST"))[0] == 405
        assert (await _get(app, "/healthz", "HEAD"))[2] == b""

    asyncio.run(main())


def test_empty_requests(engine):
    async def main():
        async with Harness(engine) as h:
            r = await h.stub.WriteCache(pb.WriteCacheRequest(
                slot_mapping=encode_tensor(np.zeros(0, np.int64)), kv_c=encode_tensor(np.zeros((0, 512), np.float32)),
                k_pe=encode_tensor(np.zeros((0, 64), np.float32))), timeout=10)
            assert r.slots_written == 0
            r = await h.stub.ReadCache(pb.ReadCacheRequest(slot_mapping=encode_tensor(np.zeros(0, np.int64))),
                                       timeout=10)
            assert list(r.slots.shape) == [0, 1152] and r.slots.data == b""
            q = pb.Tensor(dtype=pb.DATA_TYPE_BF16, shape=[0, 1, 192])
            r = await h.stub.PrefillContext(pb.PrefillContextRequest(q=q), timeout=10)
            assert list(r.output.shape) == [0, 1, 128] and list(r.lse.shape) == [1, 0]
            assert r.stats.num_chunks == 0
            # rows without context only: 0 / -inf
            r = await h.stub.PrefillContext(prefill_req(context=0), timeout=10)
            out = np.frombuffer(r.output.data, np.uint16)
            lse = np.frombuffer(r.lse.data, np.float32)
            assert not out.any() and np.all(lse == -np.inf) and r.stats.num_chunks == 0

    asyncio.run(main())



def test_cancel_code_counts_a_call_cancelled_at_its_deadline_as_expired():
    """gRPC cancels a call when its C-core deadline passes; Python may still see a sliver
    of time left. Within the slack the call is DEADLINE_EXCEEDED (as the engine queue
    counts it, rejected{reason="deadline"}), else CANCELLED."""
    from ctxprefill.service.interceptors import DEADLINE_SLACK_S, cancel_code

    assert cancel_code(None) == "CANCELLED" and cancel_code(0.5) == "CANCELLED"
    assert cancel_code(2 * DEADLINE_SLACK_S) == "CANCELLED"
    for remaining in (-1.0, 0.0, DEADLINE_SLACK_S / 2, DEADLINE_SLACK_S):
        assert cancel_code(remaining) == "DEADLINE_EXCEEDED", remaining


def test_unpacked_keys_in_server_info_and_stats():
    """GetServerInfo says whether the fused path packs K; each response's Stats says
    whether its request did (no "pack" launches then), and the result is the packed
    path's bit for bit. The CPU's reference backend packs; one built to read the keys
    unpacked does not."""
    from ctxprefill.backends.reference import ReferenceBackend

    async def run(eng):
        async with Harness(eng) as h:
            info = await h.stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=30)
            r = await h.stub.PrefillContext(prefill_req(), timeout=60)
            return info, r

    g = torch.Generator().manual_seed(5)
    slots, kv_c, k_pe = torch.arange(48, 80), torch.randn(32, 512, generator=g), torch.randn(32, 64, generator=g)
    packed_engine = small_engine()
    packed_engine.write_cache(slots, kv_c, k_pe)  # blocks 3 and 4: prefill_req's context
    info, r = asyncio.run(run(packed_engine))
    assert not info.unpacked_keys and not r.stats.unpacked_keys and r.stats.kernel_launches["pack"] >= 1
    unpacked_engine = small_engine()
    unpacked_engine.backend = ReferenceBackend(unpacked_keys=True)
    unpacked_engine.write_cache(slots, kv_c, k_pe)
    info2, r2 = asyncio.run(run(unpacked_engine))
    assert info2.unpacked_keys and r2.stats.unpacked_keys and "pack" not in r2.stats.kernel_launches
    assert r2.stats.path == "fused" and r2.output.data == r.output.data and r2.lse.data == r.lse.data
    assert any(r.output.data)  # a result of the written context, not zeros
