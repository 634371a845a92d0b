"""The same-host shared-memory transport (docs/TRANSPORT.md) on the CPU.

Against real ``ctxprefill serve`` processes (``--shared-memory system`` and the default
``off``), through the client package:
- WriteCache with slot_mapping, kv_c and k_pe in a POSIX shared-memory segment stores
  the same bytes as an in-process engine; PrefillContext with q in shared memory and
  output / LSE written into it is bit-identical to the inline path (sync and asyncio
  clients, each placement alone too);
- every refusal has its code and names its field, changes nothing, and the server
  goes on serving: shared memory off, unknown region, bad / missing / symlinked key, a
  key that is not a regular file (a FIFO), ranges past a region or an object, size and
  alignment mismatches, a result range too small or overlapping, a name registered
  twice, the limits, use after unregister, an object truncated under a registered region;
- unregister one and all, status, the metrics.
And the registry on its own: a region unregistered while a request holds it stays
open until the request ends; system regions are read through the object's descriptor
(a request's view is a ``meta`` tensor carrying its span). The peer checks and a
shrinking object under load are tests/test_shared_memory_safety.py's.
"""

from __future__ import annotations

import asyncio
import mmap
import os
import subprocess
import sys
import uuid
from types import SimpleNamespace

import grpc
import numpy as np
import pytest
import torch

from context_layout import BS, LSE_BYTES, NB, OUT_BYTES, Q_BYTES, SEQS, SLOTS, TQ, D, H, L, R
from ctxprefill.app import build_engine
from ctxprefill.engine.engine import Engine, SequenceSpec
from ctxprefill.errors import FailedPrecondition, NotFound, ResourceExhausted
from ctxprefill.service.shared_memory import Region, SharedMemoryRegistry, span_of
from ctxprefill.settings import ServeSettings
from ctxprefill_api import pb
from ctxprefill_client import (
    BF16,
    INT64,
    AsyncPrefillContextClient,
    PrefillContextClient,
    SharedMemoryRef,
    SharedMemoryTensor,
    SystemSharedMemoryRegion,
    float32_to_bf16_bits,
)
from rpc_errors import expect
from service_process import SHARED_MEMORY_MARKS, ServerProcess, env_with_sources, sample_sum

pytestmark = SHARED_MEMORY_MARKS

COMMON = {"heads": H, "block_size": BS, "num_blocks": NB, "workspace_tokens": 64, "seed": 5}
MAX_REGIONS = 6
MAX_BYTES = 64 << 20
OUT_AT = -(-Q_BYTES // 4096) * 4096  # after q
LSE_AT = OUT_AT + OUT_BYTES + 256
REGION_BYTES = LSE_AT + LSE_BYTES + 1024
RNG = np.random.default_rng(3)
KV_C = float32_to_bf16_bits(RNG.standard_normal((len(SLOTS), L), dtype=np.float32))
K_PE = float32_to_bf16_bits(RNG.standard_normal((len(SLOTS), R), dtype=np.float32))
Q = float32_to_bf16_bits(RNG.standard_normal((TQ, H, D), dtype=np.float32))


def key() -> str:
    return f"ctxprefill-test-{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="module")
def server():
    with ServerProcess({**COMMON, "shared_memory": "system", "shared_memory_max_regions": MAX_REGIONS,
                        "shared_memory_max_bytes": MAX_BYTES}) as proc:
        yield proc


@pytest.fixture()
def client(server):
    with PrefillContextClient(server.target, retries=0, timeout=60) as c:
        c.unregister_shared_memory("")
        yield c
        c.unregister_shared_memory("")


@pytest.fixture()
def region():
    """A registered-to-be segment holding q at 0, room for the output and the LSE."""
    r = SystemSharedMemoryRegion("main", REGION_BYTES)
    try:
        yield r
    finally:
        r.close()
        r.unlink()


def still_serving(c: PrefillContextClient, reference) -> None:
    """The server answers, and a valid inline request still gives the reference bits."""
    c.server_info()
    res = c.prefill_context(Q, SEQS)
    assert np.array_equal(res.output_bits, reference.output_bits)
    assert np.array_equal(res.lse.view(np.uint32), reference.lse.view(np.uint32))


def same_lse(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))  # -inf rows, bit for bit


# ----------------------------------------------------------------------------- the happy path


def test_write_cache_and_prefill_bit_identical_to_inline(client, region):
    info = client.server_info()
    assert info.shared_memory_kinds == ("system",)
    assert info.shared_memory_max_regions == MAX_REGIONS and info.shared_memory_max_bytes == MAX_BYTES
    st = client.register_system_shared_memory(region)
    assert (st.name, st.kind, st.key, st.byte_size, st.device) == ("main", "system", region.key, REGION_BYTES, "host")

    # WriteCache: slot_mapping, kv_c and k_pe all from a second segment
    T = len(SLOTS)
    with SystemSharedMemoryRegion("latents", T * (8 + 2 * L + 2 * R)) as lat:
        client.register_system_shared_memory(lat)
        slots = lat.write(SLOTS, 0, INT64, name="slot_mapping")
        kv_c = lat.write(KV_C, T * 8, BF16, name="kv_c")
        k_pe = lat.write(K_PE, T * 8 + T * L * 2, BF16, name="k_pe")
        assert client.write_cache(slots, kv_c, k_pe) == T
        assert client.unregister_shared_memory("latents") == ["latents"]
    engine = build_engine(ServeSettings(device="cpu", **COMMON))
    engine.write_cache(torch.from_numpy(SLOTS), torch.from_numpy(KV_C.view(np.int16).copy()).view(torch.bfloat16),
                       torch.from_numpy(K_PE.view(np.int16).copy()).view(torch.bfloat16))
    assert np.array_equal(client.read_cache(SLOTS), engine.read_cache(torch.from_numpy(SLOTS)).numpy())

    inline = client.prefill_context(Q, SEQS)
    ref = engine.prefill_context(torch.from_numpy(Q.view(np.int16).copy()).view(torch.bfloat16),
                                 [SequenceSpec(*s) for s in SEQS])
    assert np.array_equal(inline.output_bits, ref.out.view(torch.int16).numpy().view(np.uint16))
    assert same_lse(inline.lse, ref.lse.numpy())

    q_in = region.write(Q, 0, BF16, name="q")
    res = client.prefill_context(q_in, SEQS, output_region=region.ref(OUT_AT, OUT_BYTES),
                                 lse_region=region.ref(LSE_AT, LSE_BYTES))
    assert res.output_ref == SharedMemoryRef("main", OUT_AT, OUT_BYTES)
    assert res.lse_ref == SharedMemoryRef("main", LSE_AT, LSE_BYTES)
    assert np.array_equal(res.output_bits, inline.output_bits) and np.array_equal(res.output, inline.output)
    assert same_lse(res.lse, inline.lse)
    assert res.raw.output.data == b"" and res.raw.lse.data == b""  # nothing inline
    assert np.shares_memory(res.output_bits, region.ndarray(np.uint8, (REGION_BYTES,)))
    assert res.stats["kernel_launches"] == inline.stats["kernel_launches"]
    del res

    # each placement alone, q inline or in shared memory, float_output off
    a = client.prefill_context(Q, SEQS, output_region=region.ref(OUT_AT, OUT_BYTES + 100), float_output=False)
    assert a.output is None and np.array_equal(a.output_bits, inline.output_bits) and same_lse(a.lse, inline.lse)
    assert a.lse_ref is None and a.raw.lse.data
    b = client.prefill_context(q_in, SEQS, lse_region=region.ref(LSE_AT))
    assert np.array_equal(b.output_bits, inline.output_bits) and same_lse(b.lse, inline.lse) and b.output_ref is None
    del a, b

    # the asyncio client, both placements
    async def via_aio():
        async with AsyncPrefillContextClient(client.target, retries=0, timeout=60) as ac:
            status = await ac.shared_memory_status("main")
            r = await ac.prefill_context(q_in, SEQS, output_region=region.ref(OUT_AT, OUT_BYTES),
                                         lse_region=region.ref(LSE_AT, LSE_BYTES))
            return status, np.array(r.output_bits), np.array(r.lse)

    status, bits, lse = asyncio.run(via_aio())
    assert [s.name for s in status] == ["main"] and status[0].requests_in_flight == 0
    assert np.array_equal(bits, inline.output_bits) and same_lse(lse, inline.lse)
    assert client.shared_memory_status()[0].requests_in_flight == 0


def test_the_asyncio_client_registers_inspects_and_unregisters(client, region):
    """AsyncPrefillContextClient's shared-memory calls: register (by object and by name and
    key), status of one and of all, unregister one and all; refusals as the sync client's."""
    async def main():
        async with AsyncPrefillContextClient(client.target, retries=0, timeout=60) as ac:
            st = await ac.register_system_shared_memory(region)
            assert (st.name, st.kind, st.key, st.byte_size, st.offset) == ("main", "system", region.key,
                                                                          REGION_BYTES, 0)
            await ac.register_system_shared_memory("tail", region.key, 4096, offset=4096)
            assert sorted(s.name for s in await ac.shared_memory_status()) == ["main", "tail"]
            [tail] = await ac.shared_memory_status("tail")
            assert (tail.offset, tail.byte_size, tail.requests_in_flight) == (4096, 4096, 0)
            with expect(grpc.StatusCode.ALREADY_EXISTS, "name"):
                await ac.register_system_shared_memory("tail", region.key, 16)
            with expect(grpc.StatusCode.UNIMPLEMENTED, "--shared-memory"):
                await ac.register_cuda_shared_memory("g", b"\0" * 64, 0, 16)
            assert await ac.unregister_shared_memory("tail") == ["tail"]
            with expect(grpc.StatusCode.NOT_FOUND, "name"):
                await ac.shared_memory_status("tail")
            assert await ac.unregister_shared_memory("") == ["main"]
            assert await ac.shared_memory_status() == []

    asyncio.run(main())


def test_metrics_count_regions_and_bytes(server, client, region):
    client.register_system_shared_memory(region)
    q_in = region.write(Q, 0, BF16)
    res = client.prefill_context(q_in, SEQS, output_region=region.ref(OUT_AT, OUT_BYTES),
                                 lse_region=region.ref(LSE_AT, LSE_BYTES))
    del res
    m = server.scrape()
    assert sample_sum(m["ctxprefill_shared_memory_regions"], kind="system") == 1
    assert sample_sum(m["ctxprefill_shared_memory_region_bytes"], kind="system") == REGION_BYTES
    assert sample_sum(m["ctxprefill_shared_memory_pinned_bytes"]) == 0  # a CPU server locks nothing
    moved = m["ctxprefill_shared_memory_transfer_bytes_total"]
    assert sample_sum(moved, kind="system", direction="in") >= Q_BYTES
    assert sample_sum(moved, kind="system", direction="out") >= OUT_BYTES + LSE_BYTES
    client.unregister_shared_memory("main")
    m = server.scrape()
    assert sample_sum(m["ctxprefill_shared_memory_regions"], kind="system") == 0


# ----------------------------------------------------------------------------- refusals


def test_off_by_default():
    proc = ServerProcess(COMMON)
    try:
        proc.wait_ready()
        with PrefillContextClient(proc.target, retries=0, timeout=60) as c, \
                SystemSharedMemoryRegion("r", REGION_BYTES) as shm:
            info = c.server_info()
            assert info.shared_memory_kinds == () and info.shared_memory_max_regions == 0
            c.write_cache(SLOTS, KV_C, K_PE)
            ref = c.prefill_context(Q, SEQS)
            for call in (lambda: c.register_system_shared_memory(shm),
                         lambda: c.register_cuda_shared_memory("g", b"\0" * 64, 0, 16),
                         lambda: c.unregister_shared_memory(""), lambda: c.shared_memory_status()):
                with expect(grpc.StatusCode.UNIMPLEMENTED, "--shared-memory"):
                    call()
            q_in = shm.write(Q, 0, BF16)
            with expect(grpc.StatusCode.INVALID_ARGUMENT, "q.shared_memory", "--shared-memory"):
                c.prefill_context(q_in, SEQS)
            with expect(grpc.StatusCode.INVALID_ARGUMENT, "output_region", "--shared-memory"):
                c.prefill_context(Q, SEQS, output_region=shm.ref(OUT_AT, OUT_BYTES))
            with expect(grpc.StatusCode.INVALID_ARGUMENT, "kv_c.shared_memory"):
                c.write_cache(SLOTS, SharedMemoryTensor(BF16, KV_C.shape, SharedMemoryRef("r", 0, KV_C.nbytes)), K_PE)
            still_serving(c, ref)
    finally:
        proc.terminate(15)
        proc.kill()


def test_registration_refusals(server, client, region, tmp_path):
    client.write_cache(SLOTS, KV_C, K_PE)
    ref = client.prefill_context(Q, SEQS)
    C = grpc.StatusCode
    with expect(C.INVALID_ARGUMENT, "key"):
        client.register_system_shared_memory("x", "../x", 16)
    with expect(C.INVALID_ARGUMENT, "key"):
        client.register_system_shared_memory("x", "/a/b", 16)
    with expect(C.INVALID_ARGUMENT, "key"):
        client.register_system_shared_memory("x", ".hidden", 16)
    with expect(C.INVALID_ARGUMENT, "name"):
        client.register_system_shared_memory("bad name!", region.key, 16)
    with expect(C.INVALID_ARGUMENT, "byte_size"):
        client.register_system_shared_memory("x", region.key, 0)
    with expect(C.INVALID_ARGUMENT, "offset"):
        client.register_system_shared_memory("x", region.key, 16, offset=-1)
    with expect(C.NOT_FOUND, "key"):
        client.register_system_shared_memory("x", key(), 16)
    with expect(C.OUT_OF_RANGE, "byte_size"):
        client.register_system_shared_memory("x", region.key, REGION_BYTES + 1)
    with expect(C.OUT_OF_RANGE, "byte_size"):
        client.register_system_shared_memory("x", region.key, REGION_BYTES, offset=1)
    # a symbolic link in /dev/shm is never followed (it could point at any file)
    target = tmp_path / "victim"
    target.write_bytes(b"\0" * 4096)
    link = key()
    os.symlink(target, f"/dev/shm/{link}")
    try:
        with expect(C.FAILED_PRECONDITION, "key", "symbolic link"):
            client.register_system_shared_memory("x", link, 16)
    finally:
        os.unlink(f"/dev/shm/{link}")
    # nor anything but a regular file: a FIFO opens read-write, and a read of it would block
    fifo = key()
    os.mkfifo(f"/dev/shm/{fifo}", 0o600)
    try:
        with expect(C.FAILED_PRECONDITION, "key", "not a regular file"):
            client.register_system_shared_memory("x", fifo, 16)
    finally:
        os.unlink(f"/dev/shm/{fifo}")
    # the same name twice; a CUDA region on a CPU server with system shared memory only
    client.register_system_shared_memory(region)
    with expect(C.ALREADY_EXISTS, "name", "main"):
        client.register_system_shared_memory("main", region.key, 16)
    with expect(C.UNIMPLEMENTED, "--shared-memory"):
        client.register_cuda_shared_memory("g", b"\0" * 64, 0, 16)
    assert [s.name for s in client.shared_memory_status()] == ["main"]
    with expect(C.NOT_FOUND, "name"):
        client.shared_memory_status("nope")
    with expect(C.NOT_FOUND, "name"):
        client.unregister_shared_memory("nope")
    still_serving(client, ref)


def test_limits(client, region):
    ref = client.prefill_context(Q, SEQS)
    for i in range(MAX_REGIONS):
        client.register_system_shared_memory(f"r{i}", region.key, 64, offset=64 * i)
    with expect(grpc.StatusCode.RESOURCE_EXHAUSTED, "--shared-memory-max-regions"):
        client.register_system_shared_memory("one-more", region.key, 64)
    assert sorted(client.unregister_shared_memory("")) == [f"r{i}" for i in range(MAX_REGIONS)]
    assert client.shared_memory_status() == []
    with SystemSharedMemoryRegion("big", MAX_BYTES // 2 + 4096) as big:
        client.register_system_shared_memory(big)
        with expect(grpc.StatusCode.RESOURCE_EXHAUSTED, "--shared-memory-max-bytes"):
            client.register_system_shared_memory("big2", big.key, MAX_BYTES // 2 + 4096)
        client.unregister_shared_memory("big")
    still_serving(client, ref)


def test_reference_refusals(client, region):
    client.write_cache(SLOTS, KV_C, K_PE)
    ref = client.prefill_context(Q, SEQS)
    client.register_system_shared_memory(region)
    q_in = region.write(Q, 0, BF16)
    C = grpc.StatusCode

    def q_at(region_name="main", offset=0, byte_size=Q_BYTES, shape=(TQ, H, D), dtype=BF16):
        return SharedMemoryTensor(dtype, shape, SharedMemoryRef(region_name, offset, byte_size))

    with expect(C.NOT_FOUND, "q.shared_memory.region", "nope"):
        client.prefill_context(q_at("nope"), SEQS)
    with expect(C.INVALID_ARGUMENT, "q.shared_memory.region"):
        client.prefill_context(q_at(""), SEQS)
    with expect(C.OUT_OF_RANGE, "q.shared_memory"):
        client.prefill_context(q_at(offset=REGION_BYTES - Q_BYTES + 2), SEQS)
    with expect(C.INVALID_ARGUMENT, "q.shared_memory.byte_size"):
        client.prefill_context(q_at(byte_size=Q_BYTES - 2), SEQS)
    with expect(C.INVALID_ARGUMENT, "q.shared_memory.offset"):
        client.prefill_context(q_at(offset=1), SEQS)
    with expect(C.INVALID_ARGUMENT, "q.shared_memory.offset"):
        client.prefill_context(q_at(offset=-2), SEQS)
    with expect(C.INVALID_ARGUMENT, "q"):  # shape checks come first, as inline
        client.prefill_context(q_at(shape=(TQ, H + 1, D), byte_size=TQ * (H + 1) * D * 2), SEQS)
    both = q_in.to_proto()
    both.data = b"\0" * Q_BYTES
    req = pb.PrefillContextRequest(q=both, sequences=[pb.Sequence(query_len=a, context_len=b, block_table=t)
                                                      for a, b, t in SEQS])
    with pytest.raises(grpc.RpcError) as ei:
        client._stub.PrefillContext(req, timeout=30)
    assert ei.value.code() == C.INVALID_ARGUMENT and "q.data" in ei.value.details()

    # result placements
    with expect(C.INVALID_ARGUMENT, "output_region.byte_size"):
        client.prefill_context(q_in, SEQS, output_region=region.ref(OUT_AT, OUT_BYTES - 1))
    with expect(C.INVALID_ARGUMENT, "lse_region.byte_size"):
        client.prefill_context(q_in, SEQS, lse_region=region.ref(LSE_AT, LSE_BYTES - 4))
    with expect(C.OUT_OF_RANGE, "output_region"):
        client.prefill_context(q_in, SEQS, output_region=SharedMemoryRef("main", REGION_BYTES - 8, OUT_BYTES))
    with expect(C.NOT_FOUND, "lse_region.region"):
        client.prefill_context(q_in, SEQS, lse_region=SharedMemoryRef("gone", 0, LSE_BYTES))
    with expect(C.INVALID_ARGUMENT, "lse_region", "overlap"):
        client.prefill_context(q_in, SEQS, output_region=region.ref(OUT_AT, OUT_BYTES),
                               lse_region=region.ref(OUT_AT + 8, LSE_BYTES))
    with expect(C.INVALID_ARGUMENT, "output_region.offset"):
        client.prefill_context(q_in, SEQS, output_region=region.ref(OUT_AT + 1, OUT_BYTES))

    # a failed request writes nothing into its result ranges
    out_view = region.ndarray(np.uint8, (OUT_BYTES,), OUT_AT)
    out_view[:] = 0xAB
    with expect(C.INVALID_ARGUMENT, "sequences"):
        client.prefill_context(q_in, SEQS[:2], output_region=region.ref(OUT_AT, OUT_BYTES))
    assert (out_view == 0xAB).all()
    del out_view

    # WriteCache: bad references change nothing in the cache
    before = client.read_cache(SLOTS)
    T = len(SLOTS)
    with SystemSharedMemoryRegion("lat", T * (8 + 2 * L + 2 * R)) as lat:
        client.register_system_shared_memory(lat)
        slots = lat.write(SLOTS, 0, INT64)
        kv_c = lat.write(np.zeros_like(KV_C), T * 8, BF16)
        k_pe = lat.write(np.zeros_like(K_PE), T * 8 + T * L * 2, BF16)
        bad_slots = lat.write(np.full(T, NB * BS, np.int64), 0, INT64)
        with expect(C.OUT_OF_RANGE, "slot_mapping[0]"):
            client.write_cache(bad_slots, kv_c, k_pe)
        lat.write(SLOTS, 0, INT64)
        with expect(C.INVALID_ARGUMENT, "k_pe.shared_memory.byte_size"):
            client.write_cache(slots, kv_c, SharedMemoryTensor(BF16, (T, R), SharedMemoryRef("lat", 0, T * R * 2 - 2)))
        with expect(C.OUT_OF_RANGE, "kv_c.shared_memory"):
            past_end = SharedMemoryRef("lat", lat.byte_size - T * L * 2 + 2, T * L * 2)
            client.write_cache(slots, SharedMemoryTensor(BF16, (T, L), past_end), k_pe)
        with expect(C.NOT_FOUND, "slot_mapping.shared_memory.region"):
            client.write_cache(SharedMemoryTensor(INT64, (T,), SharedMemoryRef("none", 0, T * 8)), kv_c, k_pe)
        client.unregister_shared_memory("lat")
        with expect(C.NOT_FOUND, "kv_c.shared_memory.region", "lat"):  # used after unregister
            client.write_cache(SLOTS, kv_c, K_PE)
    assert np.array_equal(client.read_cache(SLOTS), before)

    # unregister, then use
    client.unregister_shared_memory("main")
    with expect(C.NOT_FOUND, "q.shared_memory.region", "main"):
        client.prefill_context(q_in, SEQS)
    assert client.shared_memory_status() == []
    still_serving(client, ref)


def test_truncated_object_is_refused_not_a_crash(client, region):
    """A caller that shrinks its object under a registered region gets FAILED_PRECONDITION
    (a read past the end of a mapping would be SIGBUS in the server)."""
    client.write_cache(SLOTS, KV_C, K_PE)
    ref = client.prefill_context(Q, SEQS)
    k = key()
    fd = os.open(f"/dev/shm/{k}", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, REGION_BYTES)
        client.register_system_shared_memory("t", k, REGION_BYTES)
        os.pwrite(fd, Q.tobytes(), 0)
        q_in = SharedMemoryTensor(BF16, (TQ, H, D), SharedMemoryRef("t", 0, Q_BYTES))
        res = client.prefill_context(q_in, SEQS)
        assert np.array_equal(res.output_bits, ref.output_bits)
        os.ftruncate(fd, 1024)
        with expect(grpc.StatusCode.FAILED_PRECONDITION, "q.shared_memory.region", "shrank"):
            client.prefill_context(q_in, SEQS)
        with expect(grpc.StatusCode.FAILED_PRECONDITION, "output_region.region"):
            client.prefill_context(Q, SEQS, output_region=SharedMemoryRef("t", 0, OUT_BYTES))
        client.unregister_shared_memory("t")
    finally:
        os.close(fd)
        os.unlink(f"/dev/shm/{k}")
    still_serving(client, ref)


def test_cuda_slot_mapping_is_refused_by_the_client():
    class FakeCuda:  # the client refuses before sending; the server refuses too (tests/gpu)
        pass

    from ctxprefill_client import CudaSharedMemoryRegion
    from ctxprefill_client._common import _slot_tensor

    fake = CudaSharedMemoryRegion.__new__(CudaSharedMemoryRegion)
    t = SharedMemoryTensor(INT64, (4,), SharedMemoryRef("g", 0, 32, fake))
    with pytest.raises(ValueError, match="system shared memory"):
        _slot_tensor(t)


# ----------------------------------------------------------------------------- the registry


def test_unregister_while_in_use_keeps_the_region_until_the_request_ends():
    reg = SharedMemoryRegistry(("system",), max_regions=4, max_bytes=1 << 20)
    reg.attach(torch.device("cpu"))
    with SystemSharedMemoryRegion("r", 4096) as shm:
        shm.ndarray(np.uint8, (4096,))[:] = 7
        reg.register_system("r", shm.key, 0, 4096)
        lease = reg.lease("unix:")
        region, view = lease.resolve(pb.SharedMemoryRef(region="r", offset=64, byte_size=128), "q.shared_memory", 128)
        assert view.device.type == "meta" and span_of(view) is not None  # no mapping: read through the descriptor
        assert reg.status("r")[0]["requests_in_flight"] == 1
        assert reg.unregister("r") == ["r"]
        with pytest.raises(NotFound):
            reg.lease("unix:").resolve(pb.SharedMemoryRef(region="r", offset=0, byte_size=8), "q.shared_memory", 8)
        assert region.tensor is not None  # still held by the request
        assert lease.begin()
        assert int(span_of(view).read("q.shared_memory").sum()) == 7 * 128  # readable while the request runs
        lease.finish()
        lease.abandon()  # the handler's own release after the work released: nothing more
        assert region.tensor is None and region.in_flight == 0
        with pytest.raises(NotFound, match="q.shared_memory.region"):  # its descriptor is closed
            span_of(view).read("q.shared_memory")
        del view, region

    # a request abandoned before its work started releases at once; its work then does nothing
    with SystemSharedMemoryRegion("s", 4096) as shm:
        reg.register_system("s", shm.key, 0, 4096)
        lease = reg.lease("ipv4:127.0.0.1:5000")
        lease.resolve(pb.SharedMemoryRef(region="s", offset=0, byte_size=8), "x", 8)
        lease.abandon()
        assert reg.status("s")[0]["requests_in_flight"] == 0
        assert not lease.begin()
        reg.unregister("")
        assert len(reg) == 0


def test_system_regions_are_page_locked_on_a_cuda_server_and_unlocked_when_dropped(monkeypatch):
    """cudaHostRegister over the whole mapping (from its page-aligned start to the region's
    end) at registration, cudaHostUnregister of the same address once no request holds the
    region and the device has finished its copies; a failed lock leaves a working, pageable
    region; a lost registration race unlocks again. (The CUDA runtime is faked; tests/gpu/test_transport_gpu.py runs the
    real one.)"""
    calls = []

    class FakeCudart:
        fail = False

        def cudaHostRegister(self, ptr, size, flags):
            calls.append(("register", ptr, size, flags))
            return 2 if self.fail else 0  # cudaErrorMemoryAllocation

        def cudaHostUnregister(self, ptr):
            calls.append(("unregister", ptr))
            return 0

    rt = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: rt)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(("synchronize", device)))
    gauges = []
    reg = SharedMemoryRegistry(("system",), max_regions=4, max_bytes=1 << 20, on_change=gauges.append)
    reg.attach(torch.device("cuda", 0))
    with SystemSharedMemoryRegion("r", 3 * 4096) as shm:
        shm.ndarray(np.uint8, (3 * 4096,))[:] = 5
        region = reg.register_system("a", shm.key, 4096, 8192)
        base = region.tensor.data_ptr() - 4096
        assert calls == [("register", base, 4096 + 8192, 1)] and base % mmap.PAGESIZE == 0  # portable
        assert reg.status("a")[0]["pinned"] is True
        assert gauges[-1] == {"system": (1, 8192, 4096 + 8192)}  # the whole mapping is locked
        lease = reg.lease("unix:")
        _, pinned_view = lease.resolve(pb.SharedMemoryRef(region="a", offset=0, byte_size=64), "q.shared_memory", 64)
        assert pinned_view.device.type == "cpu" and span_of(pinned_view).dma  # the device copies from the mapping
        del pinned_view
        assert lease.device_copies and not lease.uses_cuda  # its copies are queued: wait before release
        reg.unregister("a")
        assert len(calls) == 1  # a request holds it: still locked
        assert lease.begin()
        lease.finish()
        # unlocked after the device finished what it queued (a failed request's q copy)
        assert calls[1:] == [("synchronize", torch.device("cuda", 0)), ("unregister", base)]
        assert region.tensor is None
        assert gauges[-1] == {"system": (0, 0, 0)}

        rt.fail = True
        region = reg.register_system("b", shm.key, 0, 4096)
        assert reg.status("b")[0]["pinned"] is False and region.tensor.device.type == "meta"  # no mapping kept
        assert int(region.read(0, 4096, "q.shared_memory").sum()) == 5 * 4096
        pageable = reg.lease("unix:")
        pageable.resolve(pb.SharedMemoryRef(region="b", offset=0, byte_size=8), "q.shared_memory", 8)
        assert not pageable.device_copies  # its copies finish before they return
        pageable.abandon()
        n = len(calls)
        reg.unregister("b")
        assert len(calls) == n  # nothing to unlock

        rt.fail = False
        monkeypatch.setattr(reg, "_add", lambda r: (_ for _ in ()).throw(ResourceExhausted("byte_size", "full")))
        with pytest.raises(ResourceExhausted):
            reg.register_system("c", shm.key, 0, 4096)
        assert calls[-3][0] == "register" and calls[-1] == ("unregister", calls[-3][1])

    # a CPU server locks nothing
    calls.clear()
    cpu = SharedMemoryRegistry(("system",), max_regions=4, max_bytes=1 << 20)
    cpu.attach(torch.device("cpu"))
    with SystemSharedMemoryRegion("r", 4096) as shm:
        cpu.register_system("a", shm.key, 0, 4096)
        assert cpu.status("a")[0]["pinned"] is False and calls == []
        cpu.unregister("a")


def test_region_views_are_made_once_per_place_and_dropped_with_the_region():
    """Requests naming the same place get the same view object (no torch calls again);
    another place another view of the right bytes; unregistering drops every view."""
    reg = SharedMemoryRegistry(("system",), max_regions=4, max_bytes=1 << 20)
    reg.attach(torch.device("cpu"))
    with SystemSharedMemoryRegion("r", 4096) as shm:
        shm.ndarray(np.uint8, (4096,))[:] = np.arange(4096) % 251
        reg.register_system("r", shm.key, 0, 4096)
        ref = lambda off, n: pb.SharedMemoryRef(region="r", offset=off, byte_size=n)  # noqa: E731
        leases = [reg.lease("unix:") for _ in range(3)]
        region, a = leases[0].resolve(ref(64, 128), "q.shared_memory", 128)
        _, b = leases[1].resolve(ref(64, 128), "q.shared_memory", 128)
        _, c = leases[2].resolve(ref(256, 128), "q.shared_memory", 128)
        assert a is b and c is not a
        assert span_of(a).read("q").tolist() == [i % 251 for i in range(64, 192)]
        assert span_of(c).read("q").tolist() == [i % 251 for i in range(256, 384)]
        assert len(region.views) == 2
        for lease in leases:
            lease.abandon()
        del a, b, c
        reg.unregister("r")
        assert region.views == {} and region.tensor is None


def test_region_views_past_the_bound_drop_the_least_recently_used(monkeypatch):
    """A caller cycling through more places than the bound (a model's layers) keeps the
    views it uses again; the one unused longest goes."""
    monkeypatch.setattr(Region, "MAX_VIEWS", 3)
    reg = SharedMemoryRegistry(("system",), max_regions=4, max_bytes=1 << 20)
    reg.attach(torch.device("cpu"))
    with SystemSharedMemoryRegion("r", 4096) as shm:
        reg.register_system("r", shm.key, 0, 4096)
        lease = reg.lease("unix:")
        view = lambda off: lease.resolve(pb.SharedMemoryRef(region="r", offset=off, byte_size=64),  # noqa: E731
                                         "q.shared_memory", 64)[1]
        first, second, third = view(0), view(64), view(128)
        assert view(0) is first  # used again: now the most recent
        view(192)  # a fourth place: the least recently used (64) goes
        region = lease.resolve(pb.SharedMemoryRef(region="r", offset=0, byte_size=64), "q.shared_memory", 64)[0]
        assert len(region.views) == 3
        assert view(0) is first and view(128) is third and view(64) is not second
        lease.abandon()
        reg.unregister("r")


def test_registry_refuses_a_non_regular_object(tmp_path):
    reg = SharedMemoryRegistry(("system",))
    k = key()
    os.mkdir(f"/dev/shm/{k}")
    try:
        with pytest.raises(FailedPrecondition, match="key"):
            reg.register_system("d", k, 0, 16)
    finally:
        os.rmdir(f"/dev/shm/{k}")
    with pytest.raises(Exception, match="UNIMPLEMENTED|off on this server|shared memory is off"):
        SharedMemoryRegistry(()).register_system("x", k, 0, 16)


def test_cuda_registration_logic_with_a_fake_extension(monkeypatch):
    """The Python side of RegisterCudaSharedMemory, with ``ipc_open`` faked (the real one
    needs two processes on a GPU: tests/gpu/test_transport_gpu.py). The engine hands the
    registry its opener (the CUDA extension's ``ipc_open``), or why there is none."""
    from ctxprefill.errors import InvalidArgument, OutOfRange, Unimplemented
    from ctxprefill.ops import _cuda

    calls = []

    class FakeExt:
        @staticmethod
        def ipc_open(handle, device, byte_size, offset):
            calls.append((handle, device, byte_size, offset))
            if handle == b"\x02" * 64:
                raise IndexError("ipc_open: offset 0 + byte_size 9 = 9 is past the end of the allocation (8 bytes)")
            if handle == b"\x03" * 64:
                raise ValueError("ipc_open: cudaIpcOpenMemHandle failed: invalid argument")
            return torch.arange(byte_size, dtype=torch.uint8)

    monkeypatch.setattr(_cuda, "load", lambda: FakeExt)
    engine = SimpleNamespace(device=torch.device("cuda", 0))
    opener = Engine.cuda_ipc_opener(engine)  # what the servicer attaches
    assert opener == (FakeExt.ipc_open, "")
    reg = SharedMemoryRegistry(("system", "cuda"), max_regions=4, max_bytes=1 << 20)
    reg.attach(torch.device("cuda", 0), *opener)
    assert reg.kinds == ("system", "cuda") and reg.cuda_unusable == ""
    r = reg.register_cuda("g", b"\x01" * 64, 0, 16, 64)
    assert calls == [(b"\x01" * 64, 0, 64, 16)]
    assert reg.status("g") == [{"name": "g", "kind": "cuda", "key": "", "offset": 16, "byte_size": 64,
                                "device": "cuda:0", "requests_in_flight": 0, "pinned": False}]
    with pytest.raises(InvalidArgument, match="raw_handle"):
        reg.register_cuda("h", b"\x01" * 66, 0, 0, 8)  # torch's prefixed form is not a raw handle
    with pytest.raises(InvalidArgument, match="device_id"):
        reg.register_cuda("h", b"\x01" * 64, 1, 0, 8)
    with pytest.raises(OutOfRange, match="byte_size.*past the end"):
        reg.register_cuda("h", b"\x02" * 64, 0, 0, 9)
    with pytest.raises(InvalidArgument, match="raw_handle.*cudaIpcOpenMemHandle"):
        reg.register_cuda("h", b"\x03" * 64, 0, 0, 9)
    assert [d["name"] for d in reg.status()] == ["g"]  # failures registered nothing
    lease = reg.lease("unix:")
    with pytest.raises(InvalidArgument, match="slot_mapping.shared_memory.region.*CUDA memory"):
        lease.resolve(pb.SharedMemoryRef(region="g", offset=0, byte_size=8), "slot_mapping.shared_memory", 8, 8,
                      allow_cuda=False)
    region, view = lease.resolve(pb.SharedMemoryRef(region="g", offset=8, byte_size=8), "q.shared_memory", 8, 2)
    assert view.tolist() == list(range(8, 16)) and lease.uses_cuda and lease.device_copies
    lease.abandon()
    reg.unregister("g")
    assert r.tensor is None

    # CUDA configured but unusable: FAILED_PRECONDITION with the reason; off: UNIMPLEMENTED
    monkeypatch.setattr(_cuda, "load", lambda: None)
    monkeypatch.setattr(_cuda, "why_not", lambda: "no nvcc")
    broken = SharedMemoryRegistry(("cuda",))
    broken.attach(torch.device("cuda", 0), *Engine.cuda_ipc_opener(engine))
    assert broken.kinds == ()
    with pytest.raises(FailedPrecondition, match="no nvcc"):
        broken.register_cuda("g", b"\x01" * 64, 0, 0, 8)
    with pytest.raises(Unimplemented, match="--shared-memory"):
        SharedMemoryRegistry(("system",)).register_cuda("g", b"\x01" * 64, 0, 0, 8)
    # a CPU engine opens no CUDA memory, and says why
    on_cpu = SharedMemoryRegistry(("cuda",))
    on_cpu.attach(torch.device("cpu"), *Engine.cuda_ipc_opener(SimpleNamespace(device=torch.device("cpu"))))
    assert on_cpu.kinds == () and "not on a CUDA device" in on_cpu.cuda_unusable


def test_settings_validate_the_flag():
    from ctxprefill.errors import ConfigError
    from ctxprefill.settings import shared_memory_kinds

    assert shared_memory_kinds(ServeSettings(device="cpu")) == ()
    assert shared_memory_kinds(ServeSettings(device="cpu", shared_memory="all")) == ("system",)
    assert shared_memory_kinds(ServeSettings(device="cpu", shared_memory="system")) == ("system",)
    with pytest.raises(ConfigError, match="--shared-memory cuda needs a CUDA device"):
        shared_memory_kinds(ServeSettings(device="cpu", shared_memory="cuda"))
    with pytest.raises(ConfigError, match="--shared-memory must be one of"):
        shared_memory_kinds(ServeSettings(device="cpu", shared_memory="yes"))
    with pytest.raises(ConfigError, match="--shared-memory-max-regions"):
        shared_memory_kinds(ServeSettings(device="cpu", shared_memory="system", shared_memory_max_regions=0))


def test_orchestrator_example_through_shared_memory(tmp_path):
    """The example orchestrator's ``--shared-memory system`` (the deployment's fast path,
    docs/DEPLOY.md): q, output and LSE through a region; result checked against float64."""
    from ctxprefill_client.examples import orchestrator

    weights = str(tmp_path / "w.safetensors")
    orchestrator.make_random_weights(weights, 4, seed=3)
    proc = ServerProcess({"heads": 4, "block_size": 16, "num_blocks": 64, "workspace_tokens": 128,
                          "weights": weights, "shared_memory": "system"})
    try:
        proc.wait_ready()
        lines: list[str] = []
        with PrefillContextClient(proc.target, timeout=60) as c:
            report = orchestrator.run(c, orchestrator.load_kv_b_proj(weights), context_lens=[100, 0, 37],
                                      query_lens=[5, 3, 2], seed=1, shared_memory=True, log=lines.append)
            assert c.shared_memory_status() == []  # the example removed its region
        assert report["ok"], lines
        assert any("through region" in ln for ln in lines), lines
        served = proc.scrape()
        assert sample_sum(served["ctxprefill_shared_memory_transfer_bytes_total"]) > 0
        assert orchestrator.main(["--target", proc.target, "--weights", weights, "--context-lens", "30",
                                  "--query-lens", "4", "--shared-memory", "system"]) == 0
    finally:
        proc.kill()


def _as_guest(key: str, then: str) -> str:
    """Run, in another Python process, an attach to segment ``key`` followed by ``then``;
    its stderr (empty unless something warned)."""
    code = ("from ctxprefill_client import SystemSharedMemoryRegion\n"
            f"r = SystemSharedMemoryRegion('guest', key={key!r}, create=False)\n{then}\n")
    p = subprocess.run([sys.executable, "-c", code], env=env_with_sources(), capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    return p.stderr


def test_a_process_that_attaches_leaves_the_segment_to_its_creator():
    """Attaching (create=False) and exiting leaves the segment in place, without the resource
    tracker's warnings (Python's tracker would otherwise unlink it under its creator); an
    explicit unlink() by the guest removes it."""
    from multiprocessing import resource_tracker

    with SystemSharedMemoryRegion("owner", 4096) as r:
        assert _as_guest(r.key, "r.buf[0] = 7\nr.close()") == ""
        assert os.path.exists(f"/dev/shm/{r.key}") and r.buf[0] == 7
    r = SystemSharedMemoryRegion("owner", 4096)
    try:
        assert _as_guest(r.key, "r.close()\nr.unlink()") == ""
        assert not os.path.exists(f"/dev/shm/{r.key}")
    finally:
        r.close()
        if os.path.exists(f"/dev/shm/{r.key}"):  # the guest did not remove it: ours to
            r.unlink()
        else:  # gone: this process's tracker forgets it
            resource_tracker.unregister(r._shm._name, "shared_memory")
