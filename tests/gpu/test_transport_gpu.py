"""The shared-memory transport on the GPU (docs/TRANSPORT.md): CUDA IPC.

A ``ctxprefill serve --device cuda --shared-memory all`` subprocess; this test process
is the client (``cudaIpcOpenMemHandle`` refuses a handle made in its own process, so
client and server must be two processes). The client allocates q, out and lse as torch
CUDA tensors, registers them by their IPC handles (``CudaSharedMemoryRegion``), and the
server reads q in place and writes out and lse straight into them: bit-identical to the
inline path, for separate tensors (which the caching allocator puts in one segment: one
handle opened three times), for views at offsets inside one buffer, for WriteCache
latents in CUDA memory, and for system shared memory on the same server. Refusals: a
range past the allocation (OUT_OF_RANGE), another device id, a garbage handle, a CUDA
slot_mapping (INVALID_ARGUMENT); afterwards the server still serves.
"""

from __future__ import annotations

import os
import subprocess
import sys

import grpc
import numpy as np
import pytest
import torch

# tests/: service_process, context_layout
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from context_layout import tables_and_slots  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="no CUDA device: the GPU transport tests run on the GPU machine")]

BS, NB, H, D, V, L, R = 16, 64, 4, 192, 128, 512, 64
CONTEXTS, QUERIES = [100, 0, 37, 64], [5, 3, 7, 1]
TQ = sum(QUERIES)
CONFIGS = {"bf16": {"cache_dtype": "auto", "prefill_dtype": "bf16"},
           "fp8": {"cache_dtype": "fp8_ds_mla", "prefill_dtype": "fp8"}}


def _workload():
    return tables_and_slots(CONTEXTS, BS)


TABLES, SLOTS = _workload()
SEQS = list(zip(QUERIES, CONTEXTS, TABLES))


@pytest.fixture(scope="module", params=list(CONFIGS))
def served(request, cuda_ext):  # cuda_ext: the extension is built (and cached) before the server needs it
    from ctxprefill_client import PrefillContextClient
    from service_process import ServerProcess

    flags = {"device": f"cuda:{torch.cuda.current_device()}", "heads": H, "block_size": BS, "num_blocks": NB,
             "workspace_tokens": 64, "seed": 9, "shared_memory": "all", **CONFIGS[request.param]}
    proc = ServerProcess(flags)
    try:
        proc.wait_ready(timeout=600)
        with PrefillContextClient(proc.target, retries=0, timeout=120) as c:
            yield request.param, proc, c
    finally:
        proc.terminate(30)
        proc.kill()


def _bits(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu().contiguous()
    return t.view({2: torch.int16, 4: torch.int32, 1: torch.uint8}[t.element_size()]).numpy()


def test_cuda_ipc_bit_identical_to_inline(served):
    import ctxprefill_client as cc

    name, proc, c = served
    info = c.server_info()
    assert info.shared_memory_kinds == ("system", "cuda"), info
    rng = np.random.default_rng(1)
    T = len(SLOTS)
    kv_c = rng.standard_normal((T, L), dtype=np.float32)
    k_pe = rng.standard_normal((T, R), dtype=np.float32)
    c.write_cache(SLOTS, kv_c, k_pe)
    cache_bytes = c.read_cache(SLOTS)
    qf = rng.standard_normal((TQ, H, D), dtype=np.float32)
    fp8 = CONFIGS[name]["prefill_dtype"] == "fp8"
    q_bits = cc.float32_to_fp8_e4m3_bits(qf) if fp8 else cc.float32_to_bf16_bits(qf)
    q_wire = cc.FP8_E4M3 if fp8 else cc.BF16
    ref = c.prefill_context(q_bits, SEQS, q_dtype=q_wire)
    ref_out, ref_lse = ref.output_bits.view(np.int16), ref.lse.view(np.int32)

    dev = torch.device("cuda", torch.cuda.current_device())
    q_dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    q_src = torch.from_numpy(q_bits.view(np.uint8 if fp8 else np.int16).copy()).view(q_dtype).to(dev)

    # 1. three separate tensors (one caching-allocator segment: the same handle, three regions)
    q = q_src.clone()
    out = torch.full((TQ, H, V), float("nan"), dtype=torch.bfloat16, device=dev)
    lse = torch.full((H, TQ), float("nan"), dtype=torch.float32, device=dev)
    regions = [cc.CudaSharedMemoryRegion(n, t) for n, t in (("q", q), ("out", out), ("lse", lse))]
    for r in regions:
        st = c.register_cuda_shared_memory(r)
        assert st.kind == "cuda" and st.device == f"cuda:{dev.index}" and st.byte_size == r.byte_size
    torch.cuda.current_stream().synchronize()  # q written before the server reads it
    for _ in range(2):
        res = c.prefill_context(regions[0].input(), SEQS, output_region=regions[1].ref(),
                                lse_region=regions[2].ref())
        assert res.output is None and res.output_bits is None and res.lse is None
        assert res.output_tensor.data_ptr() == out.data_ptr() and res.lse_tensor.data_ptr() == lse.data_ptr()
        assert np.array_equal(_bits(out), ref_out) and np.array_equal(_bits(lse), ref_lse)
        assert res.stats["kernel_launches"] == ref.stats["kernel_launches"]
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        torch.cuda.synchronize()

    # 2. one buffer, q / out / lse at offsets, registered as one region and as a view with a storage offset
    q_b, o_b, l_b = q.numel() * q.element_size(), out.numel() * 2, lse.numel() * 4
    buf = torch.zeros(8192 + q_b + o_b + l_b, dtype=torch.uint8, device=dev)
    buf[4096 : 4096 + q_b].view(q_dtype).copy_(q_src.reshape(-1))
    whole = cc.CudaSharedMemoryRegion("buf", buf)
    tail = cc.CudaSharedMemoryRegion("tail", buf[4096:])
    assert tail.offset == whole.offset + 4096
    c.register_cuda_shared_memory(whole)
    c.register_cuda_shared_memory(tail)
    torch.cuda.synchronize()
    o_at, l_at = 4096 + q_b + 256, 4096 + q_b + 256 + o_b + 256
    res = c.prefill_context(whole.input(q_wire, (TQ, H, D), 4096), SEQS, output_region=whole.ref(o_at, o_b),
                            lse_region=tail.ref(l_at - 4096, l_b))
    assert np.array_equal(_bits(res.output_tensor), ref_out) and np.array_equal(_bits(res.lse_tensor), ref_lse)
    assert res.output_tensor.data_ptr() == buf.data_ptr() + o_at
    res = c.prefill_context(tail.input(q_wire, (TQ, H, D), 0), SEQS)  # q in place, results inline
    assert np.array_equal(res.output_bits.view(np.int16), ref_out)
    assert np.array_equal(res.lse.view(np.int32), ref_lse)

    # 3. WriteCache latents in CUDA memory (slot_mapping stays inline): the same bytes
    kv_t = torch.from_numpy(kv_c).to(dev)
    pe_t = torch.from_numpy(k_pe).to(dev)
    rk, rp = cc.CudaSharedMemoryRegion("kv_c", kv_t), cc.CudaSharedMemoryRegion("k_pe", pe_t)
    c.register_cuda_shared_memory(rk)
    c.register_cuda_shared_memory(rp)
    torch.cuda.synchronize()
    assert c.write_cache(SLOTS, rk.input(), rp.input()) == T
    assert np.array_equal(c.read_cache(SLOTS), cache_bytes)

    # 4. system shared memory on the same (CUDA) server: q copied to the device once, results D2H
    with cc.SystemSharedMemoryRegion("sys", 8192 + q_b + o_b + l_b) as shm:
        c.register_system_shared_memory(shm)
        assert c.shared_memory_status("sys")[0].pinned  # page-locked: q and the results move by DMA
        r = c.prefill_context(shm.write(q_bits, 0, q_wire), SEQS, output_region=shm.ref(q_b + 64, o_b),
                              lse_region=shm.ref(q_b + 128 + o_b, l_b))
        assert np.array_equal(r.output_bits.view(np.int16), ref_out) and np.array_equal(r.lse.view(np.int32), ref_lse)
        del r
        c.unregister_shared_memory("sys")

    # refusals; the server goes on
    C = grpc.StatusCode
    with pytest.raises(cc.CtxPrefillRpcError) as e:
        # past the end of the allocation, but within --shared-memory-max-bytes (a region over
        # that limit is RESOURCE_EXHAUSTED before the handle is even opened)
        c.register_cuda_shared_memory("huge", whole.raw_handle, whole.device_id, 1 << 34, offset=whole.offset)
    assert e.value.code == C.OUT_OF_RANGE and "byte_size" in e.value.details
    with pytest.raises(cc.CtxPrefillRpcError) as e:
        c.register_cuda_shared_memory("dev", whole.raw_handle, whole.device_id + 1, 16)
    assert e.value.code == C.INVALID_ARGUMENT and "device_id" in e.value.details
    with pytest.raises(cc.CtxPrefillRpcError) as e:
        c.register_cuda_shared_memory("junk", b"\x01" * 64, whole.device_id, 16)
    assert e.value.code == C.INVALID_ARGUMENT and "raw_handle" in e.value.details
    with pytest.raises(cc.CtxPrefillRpcError) as e:
        c.register_cuda_shared_memory("short", b"\x01" * 66, whole.device_id, 16)
    assert e.value.code == C.INVALID_ARGUMENT and "raw_handle" in e.value.details
    slots_t = torch.from_numpy(SLOTS).to(dev)
    rs = cc.CudaSharedMemoryRegion("slots", slots_t)
    c.register_cuda_shared_memory(rs)
    from ctxprefill_api import pb

    req = pb.WriteCacheRequest(slot_mapping=rs.input().to_proto(), kv_c=rk.input().to_proto(),
                               k_pe=rp.input().to_proto())
    with pytest.raises(grpc.RpcError) as ge:
        c._stub.WriteCache(req, timeout=60)
    assert ge.value.code() == C.INVALID_ARGUMENT and "slot_mapping.shared_memory.region" in ge.value.details()

    assert sorted(s.name for s in c.shared_memory_status()) == ["buf", "k_pe", "kv_c", "lse", "out", "q", "slots",
                                                                 "tail"]
    assert all(s.requests_in_flight == 0 for s in c.shared_memory_status())
    assert len(c.unregister_shared_memory("")) == 8
    again = c.prefill_context(q_bits, SEQS, q_dtype=q_wire)
    assert np.array_equal(again.output_bits.view(np.int16), ref_out)
    assert proc.proc.poll() is None
    assert "ipc_close" not in proc.log(), proc.log()[-4000:]  # every cudaIpcCloseMemHandle succeeded


def test_system_region_is_page_locked_by_the_cuda_runtime_and_unlocked_when_dropped():
    """The registry's cudaHostRegister through the real runtime: the region's memory reports
    pinned (cudaPointerGetAttributes), copies both ways through it are exact, and after
    unregistering a view still held reports pageable memory again."""
    from ctxprefill.service.shared_memory import SharedMemoryRegistry
    from ctxprefill_client import SystemSharedMemoryRegion

    dev = torch.device("cuda", torch.cuda.current_device())
    reg = SharedMemoryRegistry(("system",), max_regions=4, max_bytes=1 << 30)
    reg.attach(dev)
    n = 4 << 20
    with SystemSharedMemoryRegion("pin", n + 4096) as shm:
        region = reg.register_system("pin", shm.key, 4096, n)
        view = region.tensor
        assert reg.status("pin")[0]["pinned"] and view.is_pinned()
        src = torch.randint(0, 256, (n,), dtype=torch.uint8, device=dev)
        view.copy_(src, non_blocking=True)  # queued: the device writes the mapping by DMA
        torch.cuda.current_stream(dev).synchronize()
        assert torch.equal(view.to(dev, non_blocking=True), src)
        assert np.array_equal(shm.ndarray(np.uint8, (n,), offset=4096), src.cpu().numpy())
        reg.unregister("pin")
        assert region.tensor is None and not view.is_pinned()
        del view, region


_SHARE_AND_FREE = """
import sys, torch
from ctxprefill_client import CudaSharedMemoryRegion
t = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
r = CudaSharedMemoryRegion("x", t)
if sys.argv[1] == "close":
    r.close()
del r, t
print(torch.cuda.memory_allocated())
"""


@pytest.mark.parametrize("close", [True, False])
def test_a_closed_region_gives_its_memory_back_when_the_tensor_is_freed(close):
    """torch keeps an exported tensor's memory out of reuse after it is freed until the
    share's counter is released, and warns at exit; ``close`` releases it. Both ways are run,
    so the check can tell them apart (a process of its own: the warning comes at its exit)."""
    from service_process import env_with_sources

    p = subprocess.run([sys.executable, "-c", _SHARE_AND_FREE, "close" if close else "keep"], capture_output=True,
                       text=True, env=env_with_sources(), timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    allocated = int(p.stdout.split()[-1])
    warned = "before all shared CUDA tensors released" in p.stderr
    if close:
        assert allocated == 0 and not warned, p.stderr[-2000:]
    else:
        assert allocated >= 1 << 20 and warned, (allocated, p.stderr[-2000:])
