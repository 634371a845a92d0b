"""The cudnn-frontend attention backend on the GPU (nvidia-cudnn-frontend from ``.whl/``).

Skipped with the reason where there is no CUDA device or the backend is unavailable (the
frontend wheel not installed, cuDNN < 9). Against the float64 reference of
tests/test_backend_cudnn.py (‖out−ref‖/‖ref‖ ≤ 1e-2, |Δlse| ≤ 1e-2, lse natural log, the
-inf rows exact): ragged batches with empty sequences (no queries, no keys), one-token and
long ones, B not a power of two (a padded bucket), H ∈ {1, 16, 128}, both stats layouts,
causal (bottom-right, also with q_len > k_len); ``out`` written in place (same pointer) and
nothing written outside it — nor outside the stats rows; the graph cache (other lengths in
the same bucket build nothing); execution from a second thread; the launches the backend
notes against the profiler (prints the kernel names: fix ``CUDNN_KERNELS``); the engine
with this backend against the reference backend; ``auto`` with a probe shape. Build times,
the serving engine and speed are printed (and recorded as junit properties).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device (torch.cuda.is_available() is False): the cudnn-frontend GPU tests run on the GPU "
                "machine", allow_module_level=True)

from ctxprefill.backends import cudnn_frontend as cf  # noqa: E402
from ctxprefill.backends import registry  # noqa: E402
from ctxprefill.backends.cudnn_frontend import CudnnFrontendBackend  # noqa: E402

_WHY = CudnnFrontendBackend.unavailable_reason(torch.device("cuda"), torch.bfloat16)
if _WHY is not None:
    pytest.skip(f"cudnn-frontend backend unavailable: {_WHY} (install .whl/nvidia_cudnn_frontend-*.whl)",
                allow_module_level=True)

from device_profile import device_work, fail_unless_counts_match  # noqa: E402
from test_backend_cudnn import check, make_batch, reference  # noqa: E402  (the shared float64 helpers)
from test_backend_cudnn_frontend import call  # noqa: E402

pytestmark = pytest.mark.gpu
SCALE = 192**-0.5
LAYOUTS = ["packed", "padded"]


def _gpu_case(be, q_lens, k_lens, H, causal=False, scale=SCALE, seed=0, v_in_kv=True):
    q, k, v, cu_q, cu_k = make_batch(q_lens, k_lens, H, device="cuda", seed=seed, v_in_kv=v_in_kv)
    out, lse, noted = call(be, q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), causal=causal, scale=scale)
    torch.cuda.synchronize()
    assert out.shape == (q.shape[0], H, 128) and out.dtype == torch.bfloat16
    assert lse.shape == (H, q.shape[0]) and lse.dtype == torch.float32 and lse.is_contiguous()
    rel = check(out, lse, *reference(q, k, v, cu_q, cu_k, scale, causal))
    return rel, noted


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpu_ragged_against_float64(layout, causal, record_property):
    be = CudnnFrontendBackend(stats_layout=layout)
    # B = 5 (bucket 8): long, no keys, one token, q_len > k_len (causal: leading rows see nothing), no queries
    q_lens, k_lens = [1000, 9, 1, 257, 2048, 0], [4096, 0, 1, 1, 2500, 300]
    rel, noted = _gpu_case(be, q_lens, k_lens, 16, causal, seed=1)
    record_property("rel_err", rel)
    record_property("build_s", round(be.build_seconds[-1], 3))
    g = be.last_graph
    record_property("served_by", g.engine)
    print(f"[cudnn-frontend] {layout} {'causal' if causal else 'noncausal'}: rel err {rel:.2e}, graph build "
          f"{g.build_s:.2f} s, served by {g.engine}, workspace {g.workspace_bytes} B, {g.key}")
    assert noted == 2 + cf.CUDNN_KERNELS


@pytest.mark.parametrize("H", [1, 128])
def test_gpu_heads(H):
    be = CudnnFrontendBackend()
    _gpu_case(be, [300, 77, 1], [1100, 129, 64], H, seed=H)
    _gpu_case(be, [130], [4099], H, scale=0.9, seed=2, v_in_kv=False)  # a peaky softmax; v contiguous


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpu_out_in_place_nothing_written_outside(layout):
    """out as rows of a bigger buffer, and as a head/column-sliced view: cuDNN writes through
    it (same pointer), never outside it — the last sequence's padded rows (S_q bucket 1024 >
    130) would land in the sentinel rows after it. Stats: the same guard around its buffer."""
    H = 16
    q_lens, k_lens = [700, 5, 0, 130], [2000, 0, 9, 64]
    q, k, v, cu_q, cu_k = make_batch(q_lens, k_lens, H, device="cuda", seed=4)
    Tq = q.shape[0]
    stats_guard = []

    class Guarded(CudnnFrontendBackend):
        def _execute(self, entry, bufs, device):
            st = bufs["stats"]
            pad = 4096
            big_st = torch.full((st.numel() + 2 * pad,), 5.0, dtype=st.dtype, device=st.device)
            inner = big_st[pad : pad + st.numel()].view(st.shape)
            super()._execute(entry, dict(bufs, stats=inner), device)
            torch.cuda.synchronize()
            stats_guard.append(bool((big_st[:pad] == 5.0).all()) and bool((big_st[pad + st.numel():] == 5.0).all()))
            st.copy_(inner)

    be = Guarded(stats_layout=layout)
    for region_kind in ("rows", "strided"):
        if region_kind == "rows":
            big = torch.full((Tq + 1500, H, 128), 3.0, dtype=torch.bfloat16, device="cuda")
            region = (slice(100, 100 + Tq),)
        else:
            big = torch.full((Tq + 1500, H + 2, 160), 3.0, dtype=torch.bfloat16, device="cuda")
            region = (slice(4, 4 + Tq), slice(1, 1 + H), slice(16, 144))
        out = big[region]
        assert cf._addressable(out)
        ptr = out.data_ptr()
        got, lse, _ = call(be, q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), out=out)
        torch.cuda.synchronize()
        assert got is out and got.data_ptr() == ptr and be.last_copy == ""
        mask = torch.ones_like(big, dtype=torch.bool)
        mask[region] = False
        assert bool((big[mask] == 3.0).all()), f"{region_kind}: wrote outside the given out view"
        assert (out[700:705] == 0).all() and (lse[:, 700:705] == float("-inf")).all()
        check(got, lse, *reference(q, k, v, cu_q, cu_k, SCALE))
    assert stats_guard and all(stats_guard), "cuDNN wrote outside the stats rows"


def test_gpu_misaligned_out_and_input_are_copied():
    H = 16
    q, k, v, cu_q, cu_k = make_batch([200, 31], [700, 90], H, device="cuda", seed=6)
    Tq = q.shape[0]
    big = torch.zeros(Tq, H, 136, dtype=torch.bfloat16, device="cuda")
    out = big[..., 1:129]  # base 2 bytes off
    qm = torch.zeros(q.numel() + 1, dtype=q.dtype, device="cuda")[1:].view(q.shape)
    qm.copy_(q)
    be = CudnnFrontendBackend()
    got, lse, noted = call(be, qm, k, v, cu_q, cu_k, 200, 700, out=out)
    torch.cuda.synchronize()
    assert got is out and be.last_copy == "out,q" and noted == 2 + cf.CUDNN_KERNELS + 2
    check(got, lse, *reference(q, k, v, cu_q, cu_k, SCALE))


def test_gpu_graph_cache_reuse_within_a_bucket(record_property):
    be = CudnnFrontendBackend()
    t = time.perf_counter()
    _gpu_case(be, [500, 3, 900], [3000, 1, 4000], 16, seed=1)  # B 3 -> 4, S_q 1024, S_kv 4096
    first = time.perf_counter() - t
    assert be.builds == 1
    t = time.perf_counter()
    _gpu_case(be, [1024, 600, 1, 17], [2049, 3333, 4096, 5], 16, seed=2)  # other lengths, same buckets
    second = time.perf_counter() - t
    assert be.builds == 1, "a new graph for lengths inside the cached bucket"
    _gpu_case(be, [1025], [10], 16, seed=3)  # S_q bucket 2048: new
    assert be.builds == 2 and len(be.graphs()) == 2
    record_property("first_call_s", round(first, 3))
    record_property("same_bucket_call_s", round(second, 3))
    print(f"[cudnn-frontend] first call {first:.2f} s (build {be.build_seconds[0]:.2f} s), same bucket {second:.3f} s "
          f"(incl. the float64 reference)")


def test_gpu_second_thread_uses_its_own_handle():
    be = CudnnFrontendBackend()
    q, k, v, cu_q, cu_k = make_batch([300, 40], [900, 17], 16, device="cuda", seed=8)
    a, la = be.run_context_chunk(q, k, v, cu_q, cu_k, 300, 900, SCALE)
    res = {}

    def worker():
        try:
            res["r"] = be.run_context_chunk(q, k, v, cu_q, cu_k, 300, 900, SCALE)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001
            res["e"] = e

    th = threading.Thread(target=worker)
    th.start()
    th.join()
    assert "e" not in res, res.get("e")
    torch.cuda.synchronize()
    assert be.builds == 1 and torch.equal(a, res["r"][0]) and torch.equal(la, res["r"][1])


def test_gpu_stats_layouts_agree():
    q, k, v, cu_q, cu_k = make_batch([513, 64, 3], [1000, 65, 127], 16, device="cuda", seed=5)
    res = [call(CudnnFrontendBackend(stats_layout=lay), q, k, v, cu_q, cu_k, 513, 1000)[:2] for lay in LAYOUTS]
    torch.cuda.synchronize()
    assert (res[0][0].float() - res[1][0].float()).abs().max() <= 2e-2
    assert torch.equal(torch.isinf(res[0][1]), torch.isinf(res[1][1]))
    fin = torch.isfinite(res[0][1])
    assert (res[0][1][fin] - res[1][1][fin]).abs().max() <= 1e-4


@pytest.mark.parametrize("case", ["ragged", "out_rows", "no_keys"])
def test_gpu_launches_match_profiler(case, record_property):
    H = 16
    q_lens, k_lens = ([300, 0, 40], [500, 7, 0]) if case != "no_keys" else ([30, 4], [0, 0])
    q, k, v, cu_q, cu_k = make_batch(q_lens, k_lens, H, device="cuda", seed=2)
    Tq = q.shape[0]
    out = None
    if case == "out_rows":
        out = torch.empty(Tq + 64, H, 128, dtype=torch.bfloat16, device="cuda")[32 : 32 + Tq]
    be = CudnnFrontendBackend()
    run = lambda: call(be, q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), out=out)
    run()  # warm-up: graph build, Triton compiles
    (_, _, noted), kernels, dtod = device_work(run)
    seen = len(kernels) + len(dtod)
    record_property("profiler_kernels", len(kernels))
    record_property("noted_launches", noted)
    line = (f"[launches] cudnn-frontend, {case}: profiler {len(kernels)} kernels + {len(dtod)} DtoD copies, "
            f"noted {noted} (CUDNN_KERNELS = {cf.CUDNN_KERNELS})")
    print(line)
    fail_unless_counts_match(line, seen, noted, kernels + dtod)


@pytest.mark.parametrize("contexts,queries", [([700], [29]), ([3000, 500], [37, 5])],
                         ids=["one_chunk", "ragged_chunks"])
def test_gpu_engine_with_cudnn_frontend(contexts, queries):
    """The engine with this backend (out[token_slice] written in place, continuation chunks
    merged) against the reference backend, and its launch metric against the profiler."""
    from ctxprefill.backends.reference import ReferenceBackend
    from ctxprefill_bench.workload import make_request
    from engine_helpers import make_engine

    be = CudnnFrontendBackend()
    kw = {"heads": 16, "block_size": 64, "num_blocks": 64, "workspace_tokens": 1024, "device": "cuda"}
    eng = make_engine(backend=be, **kw)
    ref_eng = make_engine(backend=ReferenceBackend(), **kw)
    q, seqs = make_request(eng, contexts, queries, seed=1)
    make_request(ref_eng, contexts, queries, seed=1)
    q = q.to("cuda")
    fused = eng.fused_kernels_active
    eng.prefill_context(q, seqs, fused=fused)  # warm-up (graphs, kernels)
    r, kernels, dtod = device_work(lambda: eng.prefill_context(q, seqs, fused=fused))
    ref = ref_eng.prefill_context(q, seqs, fused=fused)
    check(r.out, r.lse, ref.out.double().cpu(), ref.lse.double().cpu())
    noted = sum(r.stats.launches.values())
    line = (f"[launches] engine + cudnn-frontend, {len(r.stats.chunks)} chunk(s): profiler {len(kernels)} kernels + "
            f"{len(dtod)} DtoD copies, stats {noted} ({dict(r.stats.launches)}); graphs built {be.builds}")
    print(line)
    fail_unless_counts_match(line, len(kernels) + len(dtod), noted, kernels + dtod)


def _first_kernel_backend() -> str:
    """The candidate ``auto`` must beat: gluon on Hopper, else triton."""
    from ctxprefill.backends.triton_attention import GluonAttentionBackend

    return "gluon" if GluonAttentionBackend.unavailable_reason(torch.device("cuda"), torch.bfloat16) is None \
        else "triton"


def test_gpu_auto_probe(record_property):
    probe = registry.ProbeShape(heads=16, q_tokens=2048, k_tokens=8192, segments=2)
    be, why = registry.create("auto", torch.device("cuda"), torch.bfloat16, probe=probe)
    print(f"[auto] {why}")
    record_property("auto_reason", why)
    first = _first_kernel_backend()
    assert be.name in (first, "cudnn-frontend") and why.startswith("auto: ")
    assert first in why and "cudnn-frontend" in why, why  # both measured (or the failure given)
    be8, why8 = registry.create("auto", torch.device("cuda"), torch.float8_e4m3fn, probe=probe)
    assert be8.name == first and "only candidate" in why8, why8


def test_gpu_auto_probe_times_the_k_pack_only_where_a_backend_needs_it():
    """With the engine's fused path reading the keys unpacked (ProbeShape.pack), the kernel
    backend (caps.unpacked_keys) is timed over the two parts with no pack, cudnn-frontend
    behind the pack on every call; and the pack's time is in cudnn-frontend's figure (a slow
    pack makes it slower)."""
    from ctxprefill.backends.triton_attention import GluonAttentionBackend, TritonAttentionBackend
    from ctxprefill.ops.pack import fused_mla_kv_concat

    packed = []

    def pack(k_nope, k_pe):
        packed.append(tuple(k_nope.shape))
        return fused_mla_kv_concat(k_nope, k_pe)

    def slow_pack(k_nope, k_pe):  # the same pack, then 20 more of it on the device
        k = pack(k_nope, k_pe)
        for _ in range(20):
            fused_mla_kv_concat(k_nope, k_pe)
        return k

    probe = registry.ProbeShape(heads=16, q_tokens=1024, k_tokens=8192, pack=pack)
    dev = torch.device("cuda")
    kernel = GluonAttentionBackend() if _first_kernel_backend() == "gluon" else TritonAttentionBackend()
    registry._measure(kernel, dev, torch.bfloat16, probe)
    assert packed == []  # the kernel reads k_nope and k_rope where they lie
    be = CudnnFrontendBackend()
    fast = registry._measure(be, dev, torch.bfloat16, probe)
    assert len(packed) == probe.warmup + probe.iters and packed[0] == (8192, 16, 128)
    slow = registry._measure(be, dev, torch.bfloat16, registry.ProbeShape(heads=16, q_tokens=1024, k_tokens=8192,
                                                                          pack=slow_pack))
    assert slow > fast * 1.2, (fast, slow)
    _, why = registry.create("auto", dev, torch.bfloat16, probe=probe)
    assert "K packed in the timing" in why, why
