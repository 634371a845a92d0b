"""The cudnn attention backend: dense cuDNN SDPA for one-segment bf16 chunks, the
Triton backend for everything else (ragged, causal, empty segments, fp8).

CPU: availability and selection (auto on a CPU still picks reference; fp8 is never
cudnn's), the shape-only path decision, and the plumbing of the cuDNN path on meta
tensors — torch's meta kernel of the op gives the shapes, strides and dtypes, and a
meta ``cu_seqlens`` proves that no device value is read (no host sync). Where
Triton's interpreter runs, delegation is checked bit for bit against the Triton
backend.

GPU (skipped with the reason where there is no CUDA device): one segment against a
float64 reference (‖out−ref‖/‖ref‖ ≤ 1e-2, |Δlse| ≤ 1e-2) for H ∈ {1, 16, 128} and
q lengths 1, 7, 1024, with the path taken asserted separately; ``out`` as slices of
a bigger buffer (same pointer, nothing outside written); delegation bit-equal to
Triton; the launches the backend notes against the CUDA profiler's kernel count
(prints the kernel names on a mismatch: fix ``CUDNN_KERNELS``); the engine with this
backend against the reference backend, with its launch count; and, as a warning
(never a failure), the first-call cost of a new shape and speed against Triton.
"""

from __future__ import annotations

import time
import warnings
from collections import Counter

import pytest
import torch

from ctxprefill.backends import registry
from ctxprefill.backends.cudnn_dense import CUDNN_KERNELS, CudnnDenseBackend
from ctxprefill.backends.reference import ReferenceBackend
from ctxprefill.ops import launches
from device_profile import device_work, fail_unless_counts_match

FP8 = torch.float8_e4m3fn
HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device (torch.cuda.is_available() is False): "
                                                      "GPU tests of the cudnn backend run on the GPU machine")
SCALE = 192**-0.5


# ----------------------------------------------------------------------------- helpers
def make_batch(q_lens, k_lens, H, dtype=torch.bfloat16, device="cpu", seed=0, v_in_kv=True):
    """Packed ragged q [Tq,H,192], k [Tk,H,192], v [Tk,H,128], int32 cumulative lengths.
    ``v_in_kv``: v is the tail of a [Tk, H, 256] buffer, as the engine's kv_b_proj output
    hands it over (row stride H·256, head stride 256)."""
    g = torch.Generator().manual_seed(seed)
    Tq, Tk = sum(q_lens), sum(k_lens)

    def rnd(*shape):
        x = torch.randn(*shape, generator=g)
        if dtype == FP8:
            return x.clamp(-448, 448).to(FP8).to(device)
        return x.to(dtype).to(device)

    q, k = rnd(Tq, H, 192), rnd(Tk, H, 192)
    if v_in_kv:
        v = rnd(Tk, H, 256)[..., 128:]
    else:
        v = rnd(Tk, H, 128)
    cu = lambda ls: torch.tensor([0] + torch.tensor(ls, dtype=torch.int64).cumsum(0).tolist(), dtype=torch.int32,
                                 device=device)
    return q, k, v, cu(q_lens), cu(k_lens)


def reference(q, k, v, cu_q, cu_k, scale, causal=False):
    """float64 per-segment attention on the inputs' device: (out [Tq,H,128], lse [H,Tq]) on the CPU."""
    q, k, v = q.double(), k.double(), v.double()
    cq, ck = cu_q.tolist(), cu_k.tolist()
    Tq, H, _ = q.shape
    out = torch.zeros(Tq, H, v.shape[-1], dtype=torch.float64, device=q.device)
    lse = torch.full((H, Tq), float("-inf"), dtype=torch.float64, device=q.device)
    for i in range(len(cq) - 1):
        a, b, c, d = cq[i], cq[i + 1], ck[i], ck[i + 1]
        if a == b or c == d:
            continue
        s = torch.einsum("qhd,khd->hqk", q[a:b], k[c:d]) * scale
        if causal:
            ar = lambda n: torch.arange(n, device=q.device)
            s = s.masked_fill(~(ar(d - c)[None, :] <= ar(b - a)[:, None] + (d - c) - (b - a)), float("-inf"))
        lse_i = torch.logsumexp(s, -1)
        out[a:b] = torch.einsum("hqk,khd->qhd", torch.exp(s - lse_i[..., None]).nan_to_num(0.0), v[c:d])
        lse[:, a:b] = lse_i
    return out.cpu(), lse.cpu()


def check(out, lse, ref_out, ref_lse, out_tol=1e-2, lse_tol=1e-2):
    out, lse = out.double().cpu(), lse.double().cpu()
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), "-inf rows differ"
    fin = torch.isfinite(ref_lse)
    if fin.any():
        err = (lse[fin] - ref_lse[fin]).abs().max().item()
        assert err <= lse_tol, f"LSE max abs error {err:.3g} > {lse_tol} (natural log expected)"
    rel = ((out - ref_out).norm() / ref_out.norm().clamp_min(1e-30)).item()
    assert rel <= out_tol, f"relative error {rel:.3g} > {out_tol}"
    return rel


def call(be, q, k, v, cu_q, cu_k, max_q, max_k, out=None, causal=False, scale=SCALE):
    """(out, lse, launches the backend noted) of one call."""
    counts = Counter()
    with launches.stage(counts, "attention"):
        launches.note(be.caps.launches_per_call)  # as the engine does
        o, lse = be.run_context_chunk(q, k, v, cu_q, cu_k, max_q, max_k, scale, out=out, causal=causal)
    return o, lse, counts["attention"]


def _triton_module():
    """ctxprefill.backends.triton_attention, or a skip with the reason."""
    try:
        from ctxprefill.backends import triton_attention as ta
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"the Triton backend does not import here: {e!r}")
    if ta.triton is None:
        pytest.skip(ta._TRITON_ERR)
    return ta


def _kernel_backend(ta, dtype=torch.bfloat16):
    """The kernel backend the cudnn backend hands its other chunks to on this GPU: gluon
    on Hopper, else triton (``CudnnDenseBackend._delegate``)."""
    cuda = torch.device("cuda")
    gluon = ta.GluonAttentionBackend.unavailable_reason(cuda, dtype) is None
    return ta.GluonAttentionBackend() if gluon else ta.TritonAttentionBackend()


# ----------------------------------------------------------------------------- CPU
def test_interface_and_registry_order():
    be = CudnnDenseBackend()
    assert be.name == "cudnn" and be.caps.supports_out and not be.caps.unpacked_keys and not be.caps.launch_order
    assert be.caps.launches_per_call == 0, "the backend notes its own launches per path"
    assert CUDNN_KERNELS >= 1
    assert "cudnn" in registry.names()
    assert "cudnn" not in registry._AUTO_ORDER  # opt-in: a plan build per new shape (DESIGN.md)
    assert registry.backend_class("cudnn") is CudnnDenseBackend


def test_not_available_on_cpu():
    why = CudnnDenseBackend.unavailable_reason(torch.device("cpu"), torch.bfloat16)
    assert why and "CUDA" in why, why
    with pytest.raises(ValueError, match="not available"):
        registry.create("cudnn", torch.device("cpu"), torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
def test_auto_on_cpu_still_picks_reference(dtype):
    be, why = registry.create("auto", torch.device("cpu"), dtype)
    assert isinstance(be, ReferenceBackend), (type(be), why)
    assert "triton" in why, why  # it was considered and skipped, with its reason


def test_supports_bf16_only():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert CudnnDenseBackend.caps.q_dtypes == {torch.bfloat16}
    for dev in (cpu, cuda):  # the dtype is refused before the device is looked at
        assert "dtype not supported" in CudnnDenseBackend.unavailable_reason(dev, FP8)
        assert "dtype not supported" in CudnnDenseBackend.unavailable_reason(dev, torch.float16)
    assert "dtype" not in CudnnDenseBackend.unavailable_reason(cpu, torch.bfloat16)


def _meta(q_lens, k_lens, H, dtype=torch.bfloat16):
    Tq, Tk = sum(q_lens), sum(k_lens)
    q = torch.empty(Tq, H, 192, dtype=dtype, device="meta")
    k = torch.empty(Tk, H, 192, dtype=dtype, device="meta")
    v = torch.empty(Tk, H, 256, dtype=dtype, device="meta")[..., 128:]
    cu_q = torch.empty(len(q_lens) + 1, dtype=torch.int32, device="meta")  # values unreadable: no sync possible
    cu_k = torch.empty(len(k_lens) + 1, dtype=torch.int32, device="meta")
    return q, k, v, cu_q, cu_k


@pytest.mark.parametrize("H,Tq,Tk", [(1, 1, 9), (3, 5, 9), (16, 7, 1)])
def test_dense_path_plumbing_on_meta(H, Tq, Tk):
    """The cuDNN path through torch's meta kernel of the op: views, shapes, dtypes, the
    out copy, the noted launches; cu_seqlens on meta, so reading a value would raise."""
    q, k, v, cu_q, cu_k = _meta([Tq], [Tk], H)
    be = CudnnDenseBackend()
    o, lse, n = call(be, q, k, v, cu_q, cu_k, Tq, Tk)
    assert be.last_path == "cudnn" and be.paths == Counter(cudnn=1)
    assert o.shape == (Tq, H, 128) and o.dtype == torch.bfloat16 and o.is_contiguous()
    assert lse.shape == (H, Tq) and lse.dtype == torch.float32 and lse.is_contiguous()
    assert n == CUDNN_KERNELS
    big = torch.empty(Tq + 4, H + 1, 160, dtype=torch.bfloat16, device="meta")
    out = big[2 : 2 + Tq, 1:, 16:144]
    got, lse2, n2 = call(be, q, k, v, cu_q, cu_k, Tq, Tk, out=out)
    assert got is out and lse2.shape == (H, Tq)
    assert n2 == CUDNN_KERNELS + 1  # the copy into out


def test_path_decision_is_shape_only():
    be = CudnnDenseBackend()
    ok = _meta([5], [9], 2)
    assert be._dense_blocker(*ok, 5, 9, None, False) == ""
    cases = {
        "causal": (ok, 5, 9, None, True),
        "ragged": (_meta([2, 3], [4, 5], 2), 3, 5, None, False),
        "one ragged side": ((*ok[:4], torch.empty(3, dtype=torch.int32, device="meta")), 5, 9, None, False),
        "fp8": (_meta([5], [9], 2, FP8), 5, 9, None, False),
        "no keys": (_meta([5], [0], 2), 5, 0, None, False),
        "no queries": (_meta([0], [9], 2), 0, 9, None, False),
        "max_q off": (ok, 4, 9, None, False),
        "max_k off": (ok, 5, 10, None, False),
        "fp32 out": (ok, 5, 9, torch.empty(5, 2, 128, device="meta"), False),
        "cpu": (tuple(torch.empty_like(t, device="cpu") for t in ok), 5, 9, None, False),
    }
    for name, (ts, mq, mk, out, causal) in cases.items():
        assert be._dense_blocker(*ts, mq, mk, out, causal) != "", name
    be.disabled_reason = "test"
    assert be._dense_blocker(*ok, 5, 9, None, False) != ""


def test_shape_cap_bounds_new_plans(monkeypatch):
    """Past _MAX_SHAPES distinct shapes, shapes cuDNN already ran still go to it; new ones do not."""
    from ctxprefill.backends import cudnn_dense

    monkeypatch.setattr(cudnn_dense, "_MAX_SHAPES", 2)
    be = CudnnDenseBackend()
    for Tk in (9, 10, 9):
        call(be, *_meta([5], [Tk], 2), 5, Tk)
        assert be.last_path == "cudnn"
    assert len(be._shapes) == 2
    assert "shapes" in be._dense_blocker(*_meta([5], [11], 2), 5, 11, None, False)
    assert be._dense_blocker(*_meta([5], [10], 2), 5, 10, None, False) == ""


def test_cpu_tensors_delegate_to_triton_bit_equal():
    """Off CUDA the cuDNN path is never taken: ragged and one-segment batches both go to
    Triton (here in its interpreter), identical to calling the Triton backend."""
    ta = _triton_module()
    if HAS_CUDA or not ta._interpreting():
        pytest.skip("needs Triton's CPU interpreter (TRITON_INTERPRET=1, no CUDA); the GPU tests cover delegation")
    tri = ta.TritonAttentionBackend()
    be = CudnnDenseBackend()
    for q_lens, k_lens in (([3, 4], [5, 0]), ([6], [11])):
        q, k, v, cu_q, cu_k = make_batch(q_lens, k_lens, 2, seed=3)
        o, lse, n = call(be, q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), scale=0.1)
        assert be.last_path == "triton" and n == 1
        o2, lse2 = tri.run_context_chunk(q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), 0.1)
        assert torch.equal(o, o2) and torch.equal(lse, lse2)


def test_cudnn_refusal_falls_back_to_triton(monkeypatch):
    """A cuDNN error on a shape: that call runs on Triton (same result), the shape is
    remembered, the path stays on for other shapes; a result breaking the contract (or
    too many refused shapes) switches the path off. OOM is not swallowed."""
    ta = _triton_module()
    if HAS_CUDA or not ta._interpreting():
        pytest.skip("needs Triton's CPU interpreter (TRITON_INTERPRET=1, no CUDA)")
    from ctxprefill.backends import cudnn_dense

    monkeypatch.setattr(CudnnDenseBackend, "_DENSE_DEVICES", ("cpu",))  # CPU tensors reach the (fake) op
    seen = []

    def refusing(*a, **kw):
        seen.append(tuple(a[0].shape))
        raise RuntimeError("cuDNN Frontend error: No valid execution plans built.")

    monkeypatch.setattr(cudnn_dense, "_cudnn_op", lambda: refusing)
    tri = ta.TritonAttentionBackend()
    be = CudnnDenseBackend()
    q, k, v, cu_q, cu_k = make_batch([6], [11], 2, seed=4)
    ref = tri.run_context_chunk(q, k, v, cu_q, cu_k, 6, 11, 0.1)
    for _attempt in range(2):
        o, lse, n = call(be, q, k, v, cu_q, cu_k, 6, 11, scale=0.1)
        assert be.last_path == "triton" and n == 1
        assert torch.equal(o, ref[0]) and torch.equal(lse, ref[1])
    assert len(seen) == 1, "a refused shape must not be retried"
    assert len(be._refused) == 1 and be.disabled_reason == ""
    # another shape is tried again; after _MAX_REFUSED distinct refusals the path is off
    for i in range(cudnn_dense._MAX_REFUSED - 1):
        q2, k2, v2, cq2, ck2 = make_batch([1], [2 + i], 1, seed=i)
        call(be, q2, k2, v2, cq2, ck2, 1, 2 + i, scale=0.1)
    assert be.disabled_reason and len(seen) == cudnn_dense._MAX_REFUSED

    # a result of the wrong shape: its kernel ran (noted), Triton's result returned, path off
    be = CudnnDenseBackend()
    wrong = lambda *a, **kw: (torch.zeros(1, 2, 6, 64, dtype=torch.bfloat16), torch.zeros(1, 2, 6, 1))
    monkeypatch.setattr(cudnn_dense, "_cudnn_op", lambda: wrong)
    o, lse, n = call(be, q, k, v, cu_q, cu_k, 6, 11, scale=0.1)
    assert be.last_path == "triton" and n == cudnn_dense.CUDNN_KERNELS + 1 and be.disabled_reason
    assert torch.equal(o, ref[0])

    be = CudnnDenseBackend()

    def oom(*a, **kw):
        raise torch.OutOfMemoryError("CUDA out of memory (test)")

    monkeypatch.setattr(cudnn_dense, "_cudnn_op", lambda: oom)
    with pytest.raises(torch.OutOfMemoryError):
        be.run_context_chunk(q, k, v, cu_q, cu_k, 6, 11, 0.1)


# ----------------------------------------------------------------------------- GPU
def gpu_backend() -> CudnnDenseBackend:
    why = CudnnDenseBackend.unavailable_reason(torch.device("cuda"), torch.bfloat16)
    assert why is None, f"cudnn backend unavailable on this CUDA machine: {why}"
    return CudnnDenseBackend()


def assert_cudnn_path(be: CudnnDenseBackend, what: str):
    assert be.last_path == "cudnn", (f"{what}: cuDNN was not used (fell back to Triton). disabled: "
                                     f"{be.disabled_reason or '-'}; refused shapes: {sorted(map(str, be._refused))}")


@needs_cuda
@pytest.mark.parametrize("H", [1, 16, 128])
@pytest.mark.parametrize("Tq,Tk", [(1, 4096), (7, 77), (1024, 2048)], ids=["q1", "q7", "q1024"])
def test_gpu_single_segment_matches_reference(H, Tq, Tk):
    be = gpu_backend()
    q, k, v, cu_q, cu_k = make_batch([Tq], [Tk], H, device="cuda", seed=H + Tq)
    o, lse, _ = call(be, q, k, v, cu_q, cu_k, Tq, Tk)
    torch.cuda.synchronize()
    assert o.shape == (Tq, H, 128) and o.dtype == torch.bfloat16
    assert lse.shape == (H, Tq) and lse.dtype == torch.float32 and lse.is_contiguous()
    check(o, lse, *reference(q, k, v, cu_q, cu_k, SCALE))
    assert_cudnn_path(be, f"H={H} Tq={Tq} Tk={Tk}")


@needs_cuda
@pytest.mark.parametrize("Tq,Tk,v_in_kv", [(5, 1, True), (300, 1000, False), (33, 4099, True)],
                         ids=["k1", "v_contiguous", "k4099"])
def test_gpu_single_segment_edges(Tq, Tk, v_in_kv):
    be = gpu_backend()
    q, k, v, cu_q, cu_k = make_batch([Tq], [Tk], 16, device="cuda", seed=5, v_in_kv=v_in_kv)
    o, lse, _ = call(be, q, k, v, cu_q, cu_k, Tq, Tk, scale=0.9)  # a peaky softmax
    torch.cuda.synchronize()
    check(o, lse, *reference(q, k, v, cu_q, cu_k, 0.9))
    assert_cudnn_path(be, f"Tq={Tq} Tk={Tk} v_in_kv={v_in_kv}")


@needs_cuda
@pytest.mark.parametrize("layout", ["rows", "strided"])
def test_gpu_out_slice_written_in_place(layout):
    H, Tq, Tk = 16, 700, 2000
    be = gpu_backend()
    q, k, v, cu_q, cu_k = make_batch([Tq], [Tk], H, device="cuda", seed=4)
    if layout == "rows":  # the engine's out[token_slice]: contiguous
        big = torch.full((Tq + 300, H, 128), 3.0, dtype=torch.bfloat16, device="cuda")
        region = (slice(100, 100 + Tq),)
    else:  # rows, heads and columns sliced: a strided view
        big = torch.full((Tq + 9, H + 2, 160), 3.0, dtype=torch.bfloat16, device="cuda")
        region = (slice(4, 4 + Tq), slice(1, 1 + H), slice(16, 144))
    out = big[region]
    ptr = out.data_ptr()
    got, lse, _ = call(be, q, k, v, cu_q, cu_k, Tq, Tk, out=out)
    torch.cuda.synchronize()
    assert got is out and got.data_ptr() == ptr
    assert_cudnn_path(be, "out given")
    mask = torch.ones_like(big, dtype=torch.bool)
    mask[region] = False
    assert bool((big[mask] == 3.0).all()), "wrote outside the given out view"
    fresh, lse2, _ = call(be, q, k, v, cu_q, cu_k, Tq, Tk)
    assert torch.equal(got, fresh) and torch.equal(lse, lse2)
    check(got, lse, *reference(q, k, v, cu_q, cu_k, SCALE))


@needs_cuda
@pytest.mark.parametrize("case", ["ragged", "causal", "no_keys", "no_queries", "fp8", "ragged_one_empty"])
def test_gpu_delegates_to_triton_bit_equal(case):
    ta = _triton_module()
    dtype, causal = (FP8 if case == "fp8" else torch.bfloat16), case == "causal"
    be, tri = gpu_backend(), _kernel_backend(ta, dtype)
    q_lens, k_lens = {"ragged": ([300, 0, 40], [500, 7, 0]), "causal": ([200], [450]), "no_keys": ([9], [0]),
                      "no_queries": ([0], [64]), "fp8": ([130], [513]),
                      "ragged_one_empty": ([17, 4], [0, 33])}[case]
    q, k, v, cu_q, cu_k = make_batch(q_lens, k_lens, 16, dtype, device="cuda", seed=9)
    mq, mk = max(q_lens), max(k_lens)
    o, lse, n = call(be, q, k, v, cu_q, cu_k, mq, mk, causal=causal)
    assert be.last_path == "triton" and n == 1
    o2, lse2 = tri.run_context_chunk(q, k, v, cu_q, cu_k, mq, mk, SCALE, causal=causal)
    torch.cuda.synchronize()
    assert torch.equal(o, o2) and torch.equal(lse, lse2)


@needs_cuda
@pytest.mark.parametrize("case", ["cudnn", "cudnn_out_rows", "cudnn_out_strided", "triton_ragged"])
def test_gpu_launches_match_profiler(case, record_property):
    be = gpu_backend()
    H = 16
    q_lens, k_lens = ([300, 0, 40], [500, 7, 0]) if case == "triton_ragged" else ([512], [1536])
    q, k, v, cu_q, cu_k = make_batch(q_lens, k_lens, H, device="cuda", seed=2)
    Tq = q.shape[0]
    out = None
    if case == "cudnn_out_rows":
        out = torch.empty(Tq + 64, H, 128, dtype=torch.bfloat16, device="cuda")[32 : 32 + Tq]
    elif case == "cudnn_out_strided":
        out = torch.empty(Tq, H + 1, 160, dtype=torch.bfloat16, device="cuda")[:, 1:, 16:144]
    run = lambda: call(be, q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), out=out)
    run()  # warm-up: cuDNN plan build, Triton compile, allocator
    (_, _, noted), kernels, dtod = device_work(run)
    seen = len(kernels) + len(dtod)
    record_property("profiler_kernels", len(kernels))
    record_property("profiler_dtod_copies", len(dtod))
    record_property("noted_launches", noted)
    line = (f"[launches] cudnn backend, {case}: path {be.last_path}, profiler {len(kernels)} kernels + "
            f"{len(dtod)} DtoD copies, noted {noted} (CUDNN_KERNELS = {CUDNN_KERNELS})")
    print(line)
    fail_unless_counts_match(line, seen, noted, kernels + dtod)
    if case.startswith("cudnn"):
        assert_cudnn_path(be, case)


@needs_cuda
@pytest.mark.parametrize("contexts,queries", [([700], [29]), ([3000], [37])], ids=["one_chunk", "three_chunks"])
def test_gpu_engine_with_cudnn_backend(contexts, queries):
    """The engine with this backend (one sequence: every chunk dense cuDNN; the first
    written into out[token_slice], continuations merged) against the reference backend,
    and its launch metric against the profiler. Auto picks the kernel backend (gluon on
    Hopper, else triton) for both dtypes: cudnn is opt-in."""
    from ctxprefill_bench.workload import make_request
    from engine_helpers import make_engine

    be = gpu_backend()
    assert isinstance(registry.create("cudnn", torch.device("cuda"), torch.bfloat16)[0], CudnnDenseBackend)
    kernel = _kernel_backend(_triton_module()).name  # gluon on Hopper, else triton
    assert registry.create("auto", torch.device("cuda"), torch.bfloat16)[0].name == kernel
    assert registry.create("auto", torch.device("cuda"), FP8)[0].name == kernel
    kw = {"heads": 16, "block_size": 64, "num_blocks": 64, "workspace_tokens": 1024, "device": "cuda"}
    eng = make_engine(backend=be, **kw)
    ref_eng = make_engine(backend=ReferenceBackend(), **kw)
    q, seqs = make_request(eng, contexts, queries, seed=1)
    make_request(ref_eng, contexts, queries, seed=1)
    q = q.to("cuda")
    fused = eng.fused_kernels_active
    eng.prefill_context(q, seqs, fused=fused)  # warm-up (plans, kernels)
    calls_before = be.paths["cudnn"]
    r, kernels, dtod = device_work(lambda: eng.prefill_context(q, seqs, fused=fused))
    n_chunks = len(r.stats.chunks)
    assert n_chunks == (1 if contexts == [700] else 3)
    assert be.paths["cudnn"] - calls_before == n_chunks and be.paths["triton"] == 0, (be.paths, be.disabled_reason)
    ref = ref_eng.prefill_context(q, seqs, fused=fused)
    check(r.out, r.lse, ref.out.double().cpu(), ref.lse.double().cpu())
    noted = sum(r.stats.launches.values())
    line = (f"[launches] engine + cudnn backend, {n_chunks} chunk(s): profiler {len(kernels)} kernels + "
            f"{len(dtod)} DtoD copies, stats {noted} ({dict(r.stats.launches)})")
    print(line)
    fail_unless_counts_match(line, len(kernels) + len(dtod), noted, kernels + dtod)


def _ms(fn, iters=10):
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / iters


@needs_cuda
def test_gpu_new_shape_cost_and_speed(record_property):
    """Informative (a warning, never a failure): the first call of a shape this process
    has not seen (cuDNN builds a plan per shape: does changing only Tq or only Tk by one
    cost a full build?), and the speed against Triton in the engine's layout (v inside
    the kv_b_proj output), 1 × 8192 queries over 16384 keys."""
    ta = _triton_module()
    be, tri = gpu_backend(), _kernel_backend(ta)
    H = 16
    cold = {}
    for Tq, Tk in ((1531, 6007), (1532, 6007), (1531, 6008)):  # shapes no other test uses; then Tq, Tk + 1
        q, k, v, cu_q, cu_k = make_batch([Tq], [Tk], H, device="cuda", seed=8)
        torch.cuda.synchronize()
        t = time.perf_counter()
        be.run_context_chunk(q, k, v, cu_q, cu_k, Tq, Tk, SCALE)
        torch.cuda.synchronize()
        cold[f"{Tq}q/{Tk}k"] = (time.perf_counter() - t) * 1e3
        record_property(f"first_call_ms_{Tq}q_{Tk}k", round(cold[f"{Tq}q/{Tk}k"], 2))
    warm = _ms(lambda: be.run_context_chunk(q, k, v, cu_q, cu_k, 1531, 6008, SCALE))
    q, k, v, cu_q, cu_k = make_batch([8192], [16384], H, device="cuda", seed=8)
    out = torch.empty(8192, H, 128, dtype=torch.bfloat16, device="cuda")
    flop = 2 * 8192 * 16384 * H * 320
    res = {}
    for name, fn in (("cudnn", lambda: be.run_context_chunk(q, k, v, cu_q, cu_k, 8192, 16384, SCALE)),
                     ("cudnn+out", lambda: be.run_context_chunk(q, k, v, cu_q, cu_k, 8192, 16384, SCALE, out=out)),
                     (f"{tri.name}+out", lambda: tri.run_context_chunk(q, k, v, cu_q, cu_k, 8192, 16384, SCALE,
                                                                       out=out))):
        ms = _ms(fn)
        res[name] = (ms, flop / ms / 1e9)
        record_property(f"{name}_ms", round(ms, 4))
    msg = (f"cudnn backend: first call of a new shape (H={H}) "
           + ", ".join(f"{s} {ms:.1f} ms" for s, ms in cold.items()) + f", warm {warm:.3f} ms; "
           f"1x8192q/16384k H={H}: " + ", ".join(f"{n} {ms:.3f} ms {tf:.0f} TFLOP/s" for n, (ms, tf) in res.items())
           + f"; path {be.last_path}")
    print(msg)
    warnings.warn(msg, stacklevel=1)
