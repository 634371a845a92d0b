"""The Triton attention backend against a float64 reference.

CPU: runs the kernel in Triton's interpreter (TRITON_INTERPRET=1, set here before
triton is imported), small ragged shapes. GPU: larger shapes, both dtypes, the `out`
pointer contract; skipped with a reason where there is no CUDA device.

Bounds: bf16 ‖out−ref‖/‖ref‖ ≤ 1e-2 and |Δlse| ≤ 1e-2. fp8 inputs are compared with a
reference computed from the same fp8 values dequantized, so input rounding is not
counted: P·V in bf16 (default) ≤ 1e-2; P·V in fp8 (P rounded to e4m3, relative 2**-4
per element, errors of random sign that do not average out against the output)
≤ 5e-2, measured ~2e-2; the LSE comes from fp32 P in both modes, ≤ 1e-2.
"""

import inspect
import itertools
import math
import os

import pytest
import torch

# Before triton / the backend are imported: interpret on a machine without a GPU;
# compile on a GPU machine (where the small tests then run on the GPU too).
os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")

triton = pytest.importorskip("triton", reason="triton is not importable; the Triton backend cannot be tested")

import cross_compile  # noqa: E402
from ctxprefill.backends import gluon_attention as ga  # noqa: E402
from ctxprefill.backends import triton_attention as ta  # noqa: E402
from ctxprefill.backends.base import LaunchOrder  # noqa: E402
from ctxprefill.backends.triton_attention import (  # noqa: E402
    GluonAttentionBackend,
    TritonAttentionBackend,
    mla_context_attention,
)
from ctxprefill.ops.pack import rows_readable  # noqa: E402

FP8 = torch.float8_e4m3fn
HAS_CUDA = torch.cuda.is_available()
INTERPRETING = ta._interpreting()
needs_cuda = pytest.mark.skipif(not HAS_CUDA or INTERPRETING,
                                reason="no CUDA device (or TRITON_INTERPRET=1): GPU test of the Triton backend skipped")
# small tests: interpreted on the CPU, compiled on the GPU when there is one
DEV = "cpu" if INTERPRETING or not HAS_CUDA else "cuda"
cpu_interp = pytest.mark.skipif(
    DEV == "cpu" and not INTERPRETING,
    reason="no GPU and TRITON_INTERPRET was not set before triton was imported: kernel tests skipped",
)
# explicit configs of the Triton kernel (WS=None: not the warp-specialized kernel that
# bf16 and keys-last fp8 default to on Hopper; that one has its own tests below)
SMALL = dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1, USE_TMA=False, WS=None)  # many blocks on tiny shapes
ODD = dict(BLOCK_M=32, BLOCK_N=16, num_warps=4, num_stages=1, USE_TMA=False, WS=None)
SMALL_TMA = dict(SMALL, USE_TMA=True)  # loads through per-segment tensor descriptors


# ----------------------------------------------------------------------------- reference
def reference(q, k, v, cu_q, cu_k, scale, causal=False):
    """float64 per-segment attention: (out [Tq,H,128] f64, lse [H,Tq] f64, natural log), on the
    inputs' device (float64 on the GPU keeps the large GPU tests quick), returned on the CPU."""
    q, k, v = q.double(), k.double(), v.double()
    cu_q, cu_k = cu_q.tolist(), cu_k.tolist()
    Tq, H, _ = q.shape
    out = torch.zeros(Tq, H, v.shape[-1], dtype=torch.float64, device=q.device)
    lse = torch.full((H, Tq), float("-inf"), dtype=torch.float64, device=q.device)
    for i in range(len(cu_q) - 1):
        a, b, c, d = cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]
        ql, kl = b - a, d - c
        if ql == 0 or kl == 0:
            continue
        s = torch.einsum("qhd,khd->hqk", q[a:b], k[c:d]) * scale
        if causal:  # bottom-right aligned
            ar = lambda n: torch.arange(n, device=q.device)
            vis = ar(kl)[None, :] <= ar(ql)[:, None] + (kl - ql)
            s = s.masked_fill(~vis, float("-inf"))
        lse_i = torch.logsumexp(s, -1)  # [H, ql]
        p = torch.exp(s - lse_i[..., None]).nan_to_num(0.0)  # rows seeing nothing: lse=-inf -> 0
        out[a:b] = torch.einsum("hqk,khd->qhd", p, v[c:d])
        lse[:, a:b] = lse_i
    return out.cpu(), lse.cpu()


def make_batch(q_lens, k_lens, H, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    Tq, Tk = sum(q_lens), sum(k_lens)

    def rnd(*shape):
        x = torch.randn(*shape, generator=g)
        if dtype == FP8:
            return x.clamp(-448, 448).to(FP8).to(device)  # saturating cast (CONTRACT §6)
        return x.to(dtype).to(device)

    q, k, v = rnd(Tq, H, 192), rnd(Tk, H, 192), rnd(Tk, H, 128)
    cu = lambda ls: torch.tensor([0] + torch.tensor(ls).cumsum(0).tolist(), dtype=torch.int32, device=device)
    return q, k, v, cu(q_lens), cu(k_lens)


def check(out, lse, ref_out, ref_lse, out_tol=1e-2, lse_tol=1e-2):
    out, lse = out.double().cpu(), lse.double().cpu()
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)), "-inf rows differ"
    fin = torch.isfinite(ref_lse)
    if fin.any():
        assert (lse[fin] - ref_lse[fin]).abs().max().item() <= lse_tol
    assert (ref_lse[~fin] == float("-inf")).all() and (lse[~fin] == float("-inf")).all()
    rel = ((out - ref_out).norm() / ref_out.norm().clamp_min(1e-30)).item()
    assert rel <= out_tol, f"relative error {rel:.3g} > {out_tol}"
    return rel


# ragged: an empty k segment, a q_len 0 segment, one-token segments, lengths off the
# block sizes, and (causal) q_len > k_len so that leading rows see nothing
Q_LENS = [5, 0, 1, 37, 3, 20, 1]
K_LENS = [9, 4, 0, 1, 50, 33, 1]


# ----------------------------------------------------------------------------- CPU tests
@cpu_interp
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("H", [1, 3])
@pytest.mark.parametrize("cfg", [SMALL, ODD, SMALL_TMA, None], ids=["bm16bn16", "bm32bn16", "bm16bn16tma", "default"])
def test_bf16_ragged(H, causal, cfg):
    q, k, v, cu_q, cu_k = make_batch(Q_LENS, K_LENS, H, torch.bfloat16, DEV, seed=H)
    scale = 192**-0.5
    out, lse = mla_context_attention(q, k, v, cu_q, cu_k, max(Q_LENS), max(K_LENS), scale, causal=causal, config=cfg)
    assert out.dtype == torch.bfloat16 and out.shape == (q.shape[0], H, 128)
    assert lse.dtype == torch.float32 and lse.shape == (H, q.shape[0]) and lse.is_contiguous()
    ref_out, ref_lse = reference(q, k, v, cu_q, cu_k, scale, causal)
    check(out, lse, ref_out, ref_lse)


@cpu_interp
@pytest.mark.parametrize("B", [ta._SORT_MAX, ta._SORT_MAX + 1], ids=["sorted", "unsorted"])
def test_many_segments_longest_first_and_past_the_sort_limit(B):
    """Up to _SORT_MAX segments the programs take segments by rank of key length (ties by
    index, empty segments last); past it, in index order. Either way every segment is
    computed exactly once: lengths with many ties, zeros and one long segment."""
    q_lens = [1 + i % 3 for i in range(B)]
    k_lens = [(0, 5, 5, 17, 1)[i % 5] for i in range(B)]
    k_lens[B // 2] = 40
    q, k, v, cu_q, cu_k = make_batch(q_lens, k_lens, 1, torch.bfloat16, DEV, seed=B)
    out, lse = mla_context_attention(q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), 0.2, config=SMALL)
    check(out, lse, *reference(q, k, v, cu_q, cu_k, 0.2))


@cpu_interp
@pytest.mark.parametrize("backend", [TritonAttentionBackend, GluonAttentionBackend], ids=["triton", "gluon"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("captured", [False, True], ids=["eager", "captured"])
def test_warm_up_runs_every_variant(dtype, backend, captured, monkeypatch):
    """The backend's warm-up runs the kernel with 1 and 2 segments (program order by
    length or not), on grids below and at least ``programs`` programs (the register
    cap applies or not), with the backend's config (triton: the warp-specialized kernel
    off), and with ``captured`` each also as a captured launch where the backend has
    variants for CUDA graphs (gluon); fp8 keys-last with K's slack rows, as the engine's
    pack gives it (P_REGS) — here in the interpreter."""
    calls = []
    real = ta.mla_context_attention

    def spy(q, k, v, cu_q, cu_k, max_q, max_k, scale, **kw):
        calls.append((cu_q.diff().tolist(), -(-max_q // ta.BLOCK_M_MAX) * q.shape[1] * (cu_q.numel() - 1),
                      "k_rope" if kw.get("k_rope") is not None else kw.get("v_layout", "thd"),
                      kw.get("tile_order") is not None, kw.get("captured", False),
                      rows_readable(k) - k.shape[0]))
        assert kw["config"] == backend.config
        return real(q, k, v, cu_q, cu_k, max_q, max_k, scale, **kw)

    monkeypatch.setattr(ta, "mla_context_attention", spy)
    backend().warm_up(torch.device(DEV), heads=2, q_dtype=dtype, captured=captured, programs=5)
    # fp8: every variant also with V keys-last (what the engine's fp8 pack gives); bf16: also
    # with the keys unpacked (the engine's unpacked keys); gluon on a GPU: the several-segment
    # ones also with a launch order (the warp-specialized kernel's 1-D variant)
    layouts = ["thd", "hdt"] if dtype == FP8 else ["thd", "k_rope"]
    # (in grid order as a program per tile runs it, and as persistent programs do)
    orders = [False, True, True] if DEV == "cuda" and backend.caps.launch_order else [False]
    caps = [False, True] if captured and backend.caps.graph_variants else [False]
    want = [(ql, lay, o, c) for ql in ([1], [1, 1], [384], [384, 384])  # 3 x 128 rows x 2 heads >= 5
            for o in (orders if len(ql) > 1 else [False]) for c in caps for lay in layouts]
    assert [(c[0], c[2], c[3], c[4]) for c in calls] == want
    assert (backend is GluonAttentionBackend) == backend.caps.graph_variants
    # keys-last as the engine's pack gives it: K with its slack rows, where P_REGS runs
    assert all(c[5] >= ga.P_REGS_SLACK_ROWS for c in calls if c[2] == "hdt") and any(c[2] == "hdt" for c in calls) \
        == (dtype == FP8)
    small = [c for c in calls if c[0] in ([1], [1, 1])]
    assert all(c[1] < 5 for c in small) and all(c[1] >= 5 for c in calls[len(small):])


@cpu_interp
@pytest.mark.parametrize("cfg", [SMALL, SMALL_TMA], ids=["ptr", "tma"])
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_empty_rows_exact(causal, cfg):
    # segment 1 has no keys; causal: 30 queries over 3 keys -> the first 27 rows see nothing
    q_lens, k_lens = [4, 6, 30], [7, 0, 3]
    q, k, v, cu_q, cu_k = make_batch(q_lens, k_lens, 2, torch.bfloat16, DEV, seed=7)
    out, lse = mla_context_attention(q, k, v, cu_q, cu_k, 30, 7, 0.1, causal=causal, config=cfg)
    assert (out[4:10] == 0).all() and (lse[:, 4:10] == float("-inf")).all()
    if causal:
        assert (out[10:37] == 0).all() and (lse[:, 10:37] == float("-inf")).all()
        assert torch.isfinite(lse[:, 37:]).all()
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    check(out, lse, *reference(q, k, v, cu_q, cu_k, 0.1, causal))


@cpu_interp
def test_all_keys_empty_and_scale():
    q, k, v, cu_q, cu_k = make_batch([3, 2], [0, 0], 3, torch.bfloat16, DEV)
    out, lse = mla_context_attention(q, k, v, cu_q, cu_k, 3, 0, 0.5)
    assert (out == 0).all() and (lse == float("-inf")).all()
    # a large scale makes the softmax peaky; the LSE must still be natural log
    q, k, v, cu_q, cu_k = make_batch([9], [21], 1, torch.bfloat16, DEV, seed=3)
    out, lse = mla_context_attention(q, k, v, cu_q, cu_k, 9, 21, 0.9, config=SMALL)
    check(out, lse, *reference(q, k, v, cu_q, cu_k, 0.9))


@cpu_interp
def test_out_strided_slice_written_in_place():
    H = 3
    q, k, v, cu_q, cu_k = make_batch(Q_LENS, K_LENS, H, torch.bfloat16, DEV, seed=11)
    Tq = q.shape[0]
    big = torch.full((Tq + 9, H + 1, 160), 7.0, dtype=torch.bfloat16, device=DEV)
    out = big[4 : 4 + Tq, 1:, 16:144]  # row slice, head slice, column slice: all strided
    assert not out.is_contiguous() and out.stride(-1) == 1
    before = big.clone()
    got, lse = mla_context_attention(q, k, v, cu_q, cu_k, max(Q_LENS), max(K_LENS), 0.07, out=out, config=ODD)
    assert got is out and got.data_ptr() == out.data_ptr()
    mask = torch.ones_like(big, dtype=torch.bool)
    mask[4 : 4 + Tq, 1:, 16:144] = False
    assert torch.equal(big[mask], before[mask]), "wrote outside the given out view"
    fresh, lse2 = mla_context_attention(q, k, v, cu_q, cu_k, max(Q_LENS), max(K_LENS), 0.07, config=ODD)
    assert torch.equal(got, fresh) and torch.equal(lse, lse2)


@cpu_interp
@pytest.mark.parametrize("cfg", [SMALL, SMALL_TMA], ids=["ptr", "tma"])
def test_strided_inputs_match_contiguous(cfg):
    H = 2
    q, k, v, cu_q, cu_k = make_batch([7, 12], [19, 5], H, torch.bfloat16, DEV, seed=5)
    qb = torch.zeros(q.shape[0], H, 256, dtype=q.dtype, device=DEV)
    qb[..., 32:224] = q
    kb = torch.zeros(k.shape[0], H + 2, 192, dtype=k.dtype, device=DEV)
    kb[:, 1 : 1 + H] = k
    vb = torch.zeros(v.shape[0], H, 320, dtype=v.dtype, device=DEV)  # v as the tail of a wider row
    vb[..., 192:] = v
    qs, ks, vs = qb[..., 32:224], kb[:, 1 : 1 + H], vb[..., 192:]
    a = mla_context_attention(q, k, v, cu_q, cu_k, 12, 19, 0.07, config=cfg)
    b = mla_context_attention(qs, ks, vs, cu_q, cu_k, 12, 19, 0.07, config=cfg)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    # not 16-byte aligned (q starts 1 element in): TMA is not usable, the pointer path runs
    qm = torch.zeros(q.numel() + 1, dtype=q.dtype, device=DEV)[1:].view(q.shape)
    qm.copy_(q)
    assert not ta._tma_ok(qm)
    c = mla_context_attention(qm, k, v, cu_q, cu_k, 12, 19, 0.07, config=cfg)
    assert torch.equal(a[0], c[0]) and torch.equal(a[1], c[1])


@cpu_interp
def test_block_config_changes_only_rounding():
    q, k, v, cu_q, cu_k = make_batch(Q_LENS, K_LENS, 2, torch.bfloat16, DEV, seed=2)
    a = mla_context_attention(q, k, v, cu_q, cu_k, 37, 50, 0.07, config=SMALL)
    b = mla_context_attention(q, k, v, cu_q, cu_k, 37, 50, 0.07, config=dict(WS=None))
    c = mla_context_attention(q, k, v, cu_q, cu_k, 37, 50, 0.07, config=dict(USE_TMA=False, WS=None))
    assert torch.equal(b[0], c[0]) and torch.equal(b[1], c[1]), "TMA and pointer loads must agree bit for bit"
    assert torch.equal(torch.isinf(a[1]), torch.isinf(b[1]))
    assert (a[0].float() - b[0].float()).abs().max() <= 2e-2
    fin = torch.isfinite(a[1])
    assert (a[1][fin] - b[1][fin]).abs().max() <= 1e-4


@cpu_interp
@pytest.mark.parametrize("pv_fp8,out_tol", [(False, 1e-2), (True, 5e-2)], ids=["pv_bf16", "pv_fp8"])
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("tma", [False, True], ids=["ptr", "tma"])
def test_fp8(pv_fp8, out_tol, causal, tma):
    H = 3
    q, k, v, cu_q, cu_k = make_batch(Q_LENS, K_LENS, H, FP8, DEV, seed=13)
    cfg = dict(SMALL, BLOCK_N=32, PV_FP8=pv_fp8, USE_TMA=tma)  # an fp8 dot needs K >= 32 on the GPU
    try:
        out, lse = mla_context_attention(q, k, v, cu_q, cu_k, 37, 50, 192**-0.5, causal=causal, config=cfg)
    except Exception as e:  # pragma: no cover - depends on the interpreter build
        if DEV == "cuda":
            raise
        pytest.skip(f"Triton interpreter cannot run fp8 tl.dot here ({e!r}); covered by the GPU tests")
    assert out.dtype == torch.bfloat16
    # reference from the dequantized fp8 values: only the kernel's own rounding counts
    check(out, lse, *reference(q.float(), k.float(), v.float(), cu_q, cu_k, 192**-0.5, causal), out_tol=out_tol)


@cpu_interp
@pytest.mark.parametrize("dtype,pv_fp8", [(torch.bfloat16, False), (FP8, False), (FP8, True)],
                         ids=["bf16", "fp8-pv_bf16", "fp8-pv_fp8"])
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("tma", [False, True], ids=["ptr", "tma"])
def test_keys_last_v_gives_the_same_bits(dtype, pv_fp8, causal, tma):
    """v as [H, 128, Tk] (keys contiguous, v_layout="hdt") computes exactly what v as
    [Tk, H, 128] does: same tiles, same products, only the layout the B operand comes from."""
    H = 2
    q, k, v, cu_q, cu_k = make_batch(Q_LENS, K_LENS, H, dtype, DEV, seed=21)
    cfg = dict(SMALL, BLOCK_N=32, PV_FP8=pv_fp8, USE_TMA=tma)
    v_t = v.permute(1, 2, 0).contiguous()  # [H, 128, Tk]
    try:
        a = mla_context_attention(q, k, v, cu_q, cu_k, 37, 50, 0.07, causal=causal, config=cfg)
        b = mla_context_attention(q, k, v_t, cu_q, cu_k, 37, 50, 0.07, causal=causal, config=cfg, v_layout="hdt")
    except Exception as e:  # pragma: no cover - depends on the interpreter build
        if DEV == "cuda" or dtype != FP8:
            raise
        pytest.skip(f"Triton interpreter cannot run fp8 tl.dot here ({e!r}); covered by the GPU tests")
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    # the keys of a wider buffer (rows padded, 16-byte aligned pitch), past them NaN: the
    # masked last block of the last segment must not pick the NaN up (0 * NaN is not 0)
    Tk = v.shape[0]
    pitch = -(-Tk * v.element_size() // 16) * 16 // v.element_size() + 16
    padded = torch.full((H, 128, pitch), float("nan"), dtype=torch.float32, device=DEV).to(v.dtype)
    padded[..., :Tk] = v_t
    c = mla_context_attention(q, k, padded[..., :Tk], cu_q, cu_k, 37, 50, 0.07, causal=causal, config=cfg,
                              v_layout="hdt")
    assert torch.equal(a[0], c[0]) and torch.equal(a[1], c[1])
    # every segment's keys on a 16-byte boundary (cu_seqlens_v): the TMA path when tma
    starts, col = [], 0
    for n in K_LENS:
        starts.append(col)
        col += -(-n // 16) * 16
    starts.append(col)
    aligned = torch.full((H, 128, col + 16), float("nan"), dtype=torch.float32, device=DEV).to(v.dtype)
    for i, n in enumerate(K_LENS):
        aligned[..., starts[i] : starts[i] + n] = v_t[..., int(cu_k[i]) : int(cu_k[i]) + n]
    cu_v = torch.tensor(starts, dtype=torch.int32, device=DEV)
    e = mla_context_attention(q, k, aligned, cu_q, cu_k, 37, 50, 0.07, causal=causal, config=cfg, v_layout="hdt",
                              cu_seqlens_v=cu_v)
    assert torch.equal(a[0], e[0]) and torch.equal(a[1], e[1])
    with pytest.raises(ValueError, match="cu_seqlens_v"):
        mla_context_attention(q, k, v, cu_q, cu_k, 37, 50, 0.07, config=cfg, cu_seqlens_v=cu_v)
    # a keys-last view that starts off 16 bytes, same bits
    wide = torch.zeros(H, 128, Tk + 8, dtype=v.dtype, device=DEV)
    wide[..., 3 : 3 + Tk] = v_t
    d = mla_context_attention(q, k, wide[..., 3 : 3 + Tk], cu_q, cu_k, 37, 50, 0.07, causal=causal,
                              config=cfg, v_layout="hdt")
    assert torch.equal(a[0], d[0]) and torch.equal(a[1], d[1])
    with pytest.raises(ValueError, match="v_layout"):
        mla_context_attention(q, k, v_t, cu_q, cu_k, 37, 50, 0.07, config=cfg, v_layout="dth")
    with pytest.raises(ValueError, match="hdt"):
        mla_context_attention(q, k, v, cu_q, cu_k, 37, 50, 0.07, config=cfg, v_layout="hdt")


def _apart(k, H, dtype, device):
    """k [Tk, H, 192] as the engine's unpacked keys hold it: k_nope the first half of a
    ``kv_b_proj``-like output [Tk, H, 256] (V's columns after it), k_rope the last 64
    columns of a workspace-like [Tk, 576] row shared by every head (a head stride of 0).
    The rope part of ``k`` is made equal across heads first (MLA's is): returns
    (packed k, k_nope view, k_rope view); NaN wherever the kernels must not read."""
    k = k.clone()
    k[..., 128:] = k[:, :1, 128:]
    Tk = k.shape[0]
    fill = float("nan")
    kv = torch.full((Tk, H, 256), fill, dtype=torch.float32, device=device).to(dtype)
    kv[..., :128] = k[..., :128]
    ws = torch.full((Tk, 576), fill, dtype=torch.float32, device=device).to(dtype)
    ws[:, 512:] = k[:, 0, 128:]
    return k, kv[..., :128], ws[:, 512:].unsqueeze(1).expand(Tk, H, 64)


@cpu_interp
@pytest.mark.parametrize("dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("tma", [False, True], ids=["ptr", "tma"])
def test_unpacked_keys_give_the_same_bits(dtype, causal, tma):
    """k as k_nope + k_rope where the engine's unpacked keys lie (the kv_b_proj output's
    nope half, the workspace's rope columns with a 0 head stride) computes exactly what
    the packed k does; a wrong shape or dtype of k_rope is a ValueError."""
    H = 3
    q, k, v, cu_q, cu_k = make_batch(Q_LENS, K_LENS, H, dtype, DEV, seed=31)
    k, k_nope, k_rope = _apart(k, H, dtype, DEV)
    assert k_rope.stride(1) == 0 and ta._tma_ok(k_nope, k_rope)
    cfg = dict(SMALL, BLOCK_N=32, USE_TMA=tma)
    try:
        a = mla_context_attention(q, k, v, cu_q, cu_k, 37, 50, 0.07, causal=causal, config=cfg)
        b = mla_context_attention(q, k_nope, v, cu_q, cu_k, 37, 50, 0.07, causal=causal, config=cfg, k_rope=k_rope)
    except Exception as e:  # pragma: no cover - depends on the interpreter build
        if DEV == "cuda" or dtype != FP8:
            raise
        pytest.skip(f"Triton interpreter cannot run fp8 tl.dot here ({e!r}); covered by the GPU tests")
    assert not torch.isnan(b[0].float()).any()
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    with pytest.raises(ValueError, match="k_rope must be"):
        mla_context_attention(q, k_nope, v, cu_q, cu_k, 37, 50, 0.07, config=cfg, k_rope=k_rope[:-1])
    with pytest.raises(ValueError, match=r"k \[Tk,H,128\] \(with k_rope\)"):
        mla_context_attention(q, k, v, cu_q, cu_k, 37, 50, 0.07, config=cfg, k_rope=k_rope)
    other = torch.float16 if dtype == torch.bfloat16 else torch.bfloat16
    with pytest.raises(ValueError, match="k_rope"):
        mla_context_attention(q, k_nope, v, cu_q, cu_k, 37, 50, 0.07, config=cfg, k_rope=k_rope.to(other))


@cpu_interp
@pytest.mark.parametrize("backend", [TritonAttentionBackend, GluonAttentionBackend], ids=["triton", "gluon"])
def test_backend_interface(backend):
    be = backend()
    caps = backend.caps
    assert be.name == {TritonAttentionBackend: "triton", GluonAttentionBackend: "gluon"}[backend]
    assert caps.supports_out and caps.launches_per_call == 1 and caps.q_dtypes == {torch.bfloat16, FP8}
    assert caps.unpacked_keys == {torch.bfloat16, FP8} and caps.v_keys_last == {FP8}
    assert caps.launch_order == (backend is GluonAttentionBackend)  # only the Gluon kernel takes one
    assert "CUDA" in backend.unavailable_reason(torch.device("cpu"), torch.bfloat16)
    assert "dtype not supported" in backend.unavailable_reason(torch.device("cuda"), torch.float16)
    q, k, v, cu_q, cu_k = make_batch([3, 4], [5, 0], 1, torch.bfloat16, DEV)
    out = torch.empty(7, 1, 128, dtype=torch.bfloat16, device=DEV)
    got, lse = be.run_context_chunk(q, k, v, cu_q, cu_k, 4, 5, 0.1, out=out)
    assert got is out
    check(got, lse, *reference(q, k, v, cu_q, cu_k, 0.1))
    order = LaunchOrder(torch.zeros(1, dtype=torch.int32, device=DEV), 1)
    if backend is TritonAttentionBackend:  # not a capability of the Triton kernel: refused
        with pytest.raises(ValueError, match="launch order"):
            be.run_context_chunk(q, k, v, cu_q, cu_k, 4, 5, 0.1, launch_order=order)


@cpu_interp
def test_nothing_to_compute():
    # still one (empty) launch per call, as caps.launches_per_call says
    q, k, v, cu_q, cu_k = make_batch([0, 0], [3, 2], 2, torch.bfloat16, DEV)
    out, lse = mla_context_attention(q, k, v, cu_q, cu_k, 0, 3, 0.1)
    assert out.shape == (0, 2, 128) and lse.shape == (2, 0)
    q, k, v, cu_q, cu_k = make_batch([], [], 3, torch.bfloat16, DEV)  # B = 0
    out, lse = mla_context_attention(q, k, v, cu_q, cu_k, 0, 0, 0.1)
    assert out.shape == (0, 3, 128) and lse.shape == (3, 0)


def test_validation():
    q, k, v, cu_q, cu_k = make_batch([2], [3], 2, torch.bfloat16)
    with pytest.raises(ValueError, match="unit last stride"):
        mla_context_attention(q.transpose(0, 2).contiguous().transpose(0, 2), k, v, cu_q, cu_k, 2, 3, 0.1)
    with pytest.raises(ValueError, match="dtype"):
        mla_context_attention(q.half(), k.half(), v.half(), cu_q, cu_k, 2, 3, 0.1)
    with pytest.raises(ValueError, match="expected q"):
        mla_context_attention(q, k, torch.zeros(3, 2, 192, dtype=torch.bfloat16), cu_q, cu_k, 2, 3, 0.1)
    with pytest.raises(ValueError, match="out must be"):
        mla_context_attention(q, k, v, cu_q, cu_k, 2, 3, 0.1, out=torch.empty(2, 2, 128))
    with pytest.raises(ValueError, match="int32"):
        mla_context_attention(q, k, v, cu_q.long(), cu_k, 2, 3, 0.1)
    with pytest.raises(ValueError, match="powers of two"):
        mla_context_attention(q, k, v, cu_q, cu_k, 2, 3, 0.1, config=dict(BLOCK_M=48))
    with pytest.raises(ValueError, match="PV_FP8"):
        q8, k8, v8 = (x.float().to(FP8) for x in (q, k, v))
        mla_context_attention(q8, k8, v8, cu_q, cu_k, 2, 3, 0.1, config=dict(BLOCK_N=16, PV_FP8=True))
    # a launch order must be for this batch (segments, heads), int32 codes on q's device
    codes = torch.zeros(4, dtype=torch.int32)
    for bad in (ta.TileOrder(codes, 2, 2, 1), ta.TileOrder(codes, 1, 3, 1), ta.TileOrder(codes.long(), 1, 2, 1),
                ta.TileOrder(codes[:0], 1, 2, 1), ta.TileOrder(codes, 1, 2, 0), ta.TileOrder(codes, 1, 2, 2**30)):
        with pytest.raises(ValueError, match="tile_order"):
            mla_context_attention(q, k, v, cu_q, cu_k, 2, 3, 0.1, tile_order=bad)



# ----------------------------------------------------------------------------- GPU tests
def _kernel_names(fn):
    """The CUDA kernels one call of ``fn`` launches, by the profiler (compiled first)."""
    fn()  # compile outside the profile
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def _gpu_case(q_lens, k_lens, H, dtype, causal, cfg=None, tol=1e-2, seed=0):
    q, k, v, cu_q, cu_k = make_batch(q_lens, k_lens, H, dtype, device="cuda", seed=seed)
    out, lse = mla_context_attention(q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), 192**-0.5, causal=causal,
                                     config=cfg)
    torch.cuda.synchronize()
    ref = reference(q.float(), k.float(), v.float(), cu_q, cu_k, 192**-0.5, causal)
    return check(out, lse, *ref, out_tol=tol)


@needs_cuda
@pytest.mark.parametrize("dtype,cfg,tol", [
    (torch.bfloat16, {}, 1e-2),
    (FP8, dict(PV_FP8=False), 1e-2),
    (FP8, dict(PV_FP8=True), 5e-2),
], ids=["bf16", "fp8_pv_bf16", "fp8_pv_fp8"])
@pytest.mark.parametrize("tma", [False, True], ids=["ptr", "tma"])
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_gpu_ragged_large(dtype, cfg, tol, tma, causal):
    _gpu_case([1000, 0, 1, 257, 2048], [4096, 300, 0, 1, 2500], 16, dtype, causal, dict(cfg, USE_TMA=tma, WS=None),
              tol)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
def test_gpu_many_heads(dtype):
    _gpu_case([300, 77], [1100, 129], 128, dtype, False)


@needs_cuda
@pytest.mark.parametrize("cfg", [
    dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=2, USE_TMA=True),
    dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=2, USE_TMA=False),
    dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3, USE_TMA=True),
], ids=["bm128bn128tma", "bm128bn128", "bm64bn64tma"])
def test_gpu_other_configs(cfg):
    _gpu_case([513, 64, 3], [1000, 65, 127], 4, torch.bfloat16, True, cfg)


@needs_cuda
@pytest.mark.parametrize("backend", [TritonAttentionBackend, GluonAttentionBackend], ids=["triton", "gluon"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
def test_gpu_out_pointer_and_untouched_rows(dtype, backend):
    why = backend.unavailable_reason(torch.device("cuda"), dtype)
    if backend is GluonAttentionBackend and why is not None:
        pytest.skip(f"gluon unavailable here: {why}")
    assert why is None, why
    H = 16
    q, k, v, cu_q, cu_k = make_batch([700, 5, 0, 130], [2000, 0, 9, 64], H, dtype, device="cuda", seed=4)
    Tq = q.shape[0]
    big = torch.full((Tq + 300, H, 128), 3.0, dtype=torch.bfloat16, device="cuda")
    out = big[100 : 100 + Tq]
    ptr = out.data_ptr()
    be = backend()
    got, lse = be.run_context_chunk(q, k, v, cu_q, cu_k, 700, 2000, 0.07, out=out)
    torch.cuda.synchronize()
    assert got is out and got.data_ptr() == ptr
    assert (big[:100] == 3.0).all() and (big[100 + Tq :] == 3.0).all()
    assert (out[700:705] == 0).all() and (lse[:, 700:705] == float("-inf")).all()
    check(got, lse, *reference(q.float(), k.float(), v.float(), cu_q, cu_k, 0.07))


@needs_cuda
@pytest.mark.parametrize("tma", [False, True], ids=["ptr", "tma"])
def test_gpu_one_launch_per_call(tma):
    q, k, v, cu_q, cu_k = make_batch([300, 0, 40], [500, 7, 0], 16, torch.bfloat16, device="cuda")
    kernels = _kernel_names(lambda: mla_context_attention(q, k, v, cu_q, cu_k, 300, 500, 0.07,
                                                          config=dict(USE_TMA=tma)))
    assert len(kernels) == TritonAttentionBackend.caps.launches_per_call == 1, kernels
    # TMA-ready bf16 on Hopper runs the warp-specialized kernel (the default WS config)
    ws = tma and ga.gluon is not None and torch.cuda.get_device_capability()[0] == 9
    assert ("_mla_attn_ws_fwd" if ws else "_mla_ctx_attn_fwd") in kernels[0], kernels


@needs_cuda
def test_gpu_each_backend_runs_its_kernel():
    """On a TMA-ready bf16 chunk, ``gluon`` (Hopper only) runs the warp-specialized kernel
    and ``triton`` the Triton kernel, one launch each."""
    q, k, v, cu_q, cu_k = make_batch([300, 0, 40], [500, 7, 0], 16, torch.bfloat16, device="cuda")
    cuda = torch.device("cuda")
    cases = [(TritonAttentionBackend(), "_mla_ctx_attn_fwd")]
    if ga.gluon is not None and torch.cuda.get_device_capability()[0] == 9:
        cases.append((GluonAttentionBackend(), "_mla_attn_ws_fwd"))
    else:
        assert GluonAttentionBackend.unavailable_reason(cuda, torch.bfloat16) is not None
    for be, kernel in cases:
        assert be.unavailable_reason(cuda, torch.bfloat16) is None
        names = _kernel_names(lambda: be.run_context_chunk(q, k, v, cu_q, cu_k, 300, 500, 0.07))  # noqa: B023
        assert len(names) == 1 and kernel in names[0], (be.name, names)


# ----------------------------------------------------------------------------- no-GPU compile check
_cross_compile, _XC_RESOURCES = cross_compile.cross_compile, cross_compile.RESOURCES


_XCOMPILE = _XC_RESOURCES + r'''
import json, re, sys
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from ctxprefill.backends import triton_attention as ta

fn = ta._mla_ctx_attn_fwd
names = fn.arg_names
out = []
for dt, cfg, causal in json.loads(sys.argv[1]):
    sig = {}
    for n in names:
        sig[n] = {"Q": "*" + dt, "K": "*" + dt, "KR": "*" + dt, "V": "*" + dt, "O": "*bf16", "LSE": "*fp32",
                  "cu_q": "*i32", "cu_k": "*i32", "cu_v": "*i32", "qk_scale": "fp32"}.get(n, "i32")
    const = dict(CAUSAL=causal, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], IS_FP8=dt != "bf16",
                 PV_FP8=cfg.get("PV_FP8", False), USE_TMA=cfg.get("USE_TMA", False), UPCAST=False,
                 SORT_B=cfg.get("SORT_B", 0), V_T=cfg.get("V_T", False))
    for n in const:
        sig[n] = "constexpr"
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if sig[n].startswith("*") or n in ("stride_qt", "stride_kt", "stride_rt", "stride_vt", "stride_ot")}
    src = ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in const.items()}, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
                                    **({"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") else {})))
    regs, stack = resources(k)
    out.append(dict(dt=dt, causal=causal, v_t=cfg.get("V_T", False), pv_fp8=cfg.get("PV_FP8", False),
                    prmt=len(re.findall(r"\bprmt\b", k.asm["ptx"])),
                    st_shared=len(re.findall(r"st\.shared", k.asm["ptx"])),
                    wgmma=len(re.findall(r"wgmma\.mma_async", k.asm["ptx"])),
                    mma_sync=len(re.findall(r"\bmma\.sync", k.asm["ptx"])), regs=regs, stack=stack,
                    smem=k.metadata.shared))
print(json.dumps(out))
'''


@pytest.mark.skipif(not triton.__version__.startswith("3.6"), reason="sm_90 cross-compile check written for Triton 3.6")
def test_default_configs_cross_compile_for_sm90():
    """Compile the default configs for an H200 (sm_90) without a GPU, with the wheel's ptxas:
    they must build, use wgmma only, and not spill; shared memory within the 227 KiB limit."""
    jobs = [("bf16", ta.CONFIGS[torch.bfloat16], c) for c in (False, True)]
    jobs += [("fp8e4nv", ta.CONFIGS[FP8], False), ("fp8e4nv", dict(ta.CONFIGS[FP8], PV_FP8=True), False)]
    # the variant that orders segments longest-first (2 <= B <= 64)
    jobs += [("bf16", dict(ta.CONFIGS[torch.bfloat16], SORT_B=ta._SORT_MAX), False),
             ("fp8e4nv", dict(ta.CONFIGS[FP8], SORT_B=ta._SORT_MAX), False)]
    # keys-last V (v_layout="hdt" through TMA) with P·V in fp8: the V tile reaches the fp8
    # wgmma without the transpose through registers that the [Tk, H, 128] layout costs
    jobs += [("fp8e4nv", dict(ta.CONFIGS[FP8], PV_FP8=True, V_T=True), False)]
    results = _cross_compile(_XCOMPILE, jobs)
    for res in results:
        print(res)
        assert res["wgmma"] > 0 and res["mma_sync"] == 0, res
        assert res["stack"] == 0, f"register spills: {res}"
        assert res["smem"] <= 232448, res
    (thd,) = [x for x in results if x["pv_fp8"] and not x["v_t"]]
    (hdt,) = [x for x in results if x["pv_fp8"] and x["v_t"]]
    # measured 2026-12-01: byte permutes 64 -> 16, shared stores 102 -> 38
    assert hdt["prmt"] * 2 <= thd["prmt"] and hdt["st_shared"] * 2 <= thd["st_shared"], (thd, hdt)


_XCOMPILE_WS = _XC_RESOURCES + r"""
import json, re, sys
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from ctxprefill.backends import gluon_attention as ga

fn = ga._mla_attn_ws_fwd
names = fn.arg_names


def sass_loops(k):
    # the body of each loop in the SASS: a conditional backward branch and what it jumps back over
    sass = cuobjdump(k, "-sass")
    ins = [(int(a, 16), t.strip()) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    for addr, text in ins:
        m = re.match(r"@!?U?P\d\s+BRA\s+(?:`\()?0x([0-9a-f]+)", text)
        if m and int(m[1], 16) < addr:
            yield [t for a, t in ins if int(m[1], 16) <= a <= addr]


def key_loops(k):
    # the consumers' key loops: loops that issue wgmma (HGMMA bf16, QGMMA fp8) and hold no
    # such loop inside (a persistent program's tile loop holds its key loop)
    loops = [body for body in sass_loops(k) if any("GMMA" in t for t in body)]
    return [b for b in loops if not any(o is not b and len(o) < len(b) and o[0] in b and o[-1] in b
                                        and "\n".join(o) in "\n".join(b) for o in loops)]


def pv_wait_order(k):
    # for each pipelined consumer loop (its body waits with one MMA group left in flight):
    # (exp2s before P·V's wait, exp2s in the body)
    loops = []
    for body in key_loops(k):
        if not any("DEPBAR.LE gsb0, 0x1" in t for t in body):
            continue
        ex2 = [i for i, t in enumerate(body) if "MUFU.EX2" in t]
        wait = next(i for i, t in enumerate(body) if "DEPBAR.LE gsb0, 0x0" in t)
        loops.append((sum(i < wait for i in ex2), len(ex2)))
    return loops


def loop_bar_syncs(k):
    # BAR.SYNCs in each of the consumers' key loops
    return [sum("BAR.SYNC" in t for t in body) for body in key_loops(k)]


def loop_spills(k):
    # local-memory loads and stores in each of the consumers' key loops
    return [sum(("STL" in t or "LDL" in t) for t in body) for body in key_loops(k)]


DESCS = ("QN_D", "QR_D", "KN_D", "KR_D")


def host_descriptors(dt, ws):
    # HOST_DESC's launch-wide descriptors as the launch makes them, over small CPU tensors:
    # their signature types (mangle_type), or None each (a constexpr None) without it
    import torch
    from triton.runtime.jit import mangle_type

    cfg = dict(ga.CONFIG, **ws)
    t = torch.float8_e4m3fn if dt != "bf16" else torch.bfloat16
    q, k = torch.zeros(256, 2, 192, dtype=t), torch.zeros(256, 2, 192, dtype=t)
    return [None if d is None else mangle_type(d)
            for d in (ga._host_descriptors(q, k, k[..., 128:], cfg) if cfg["HOST_DESC"] else [None] * 4)]


out = []
for dt, ws, sort_b, v_t, use_order in json.loads(sys.argv[1]):
    sig = {n: {"Q": "*" + dt, "K": "*" + dt, "KR": "*" + dt, "V": "*" + dt, "O": "*bf16", "LSE": "*fp32",
               "cu_q": "*i32", "cu_k": "*i32", "cu_v": "*i32", "ORDER": "*i32", "qk_scale": "fp32"}.get(n, "i32")
           for n in names}
    const = dict(BLOCK_M=128, BLOCK_N=ws["BLOCK_N"], STAGES=ws["STAGES"], PIPE=ws["PIPE"], SORT_B=sort_b,
                 IS_FP8=dt != "bf16", V_T=v_t, EARLY_K=ws.get("EARLY_K", True), USE_ORDER=use_order,
                 RESCALE_EARLY=ws.get("RESCALE_EARLY", False), PINGPONG=ws.get("PINGPONG", False),
                 PV_WAIT_LATE=ws.get("PV_WAIT_LATE", False), P_REGS=ws.get("P_REGS", False),
                 EXP2_POLY=ws.get("EXP2_POLY", 0), HOST_DESC=ws.get("HOST_DESC", ga.CONFIG["HOST_DESC"]),
                 ARRIVE_NOSYNC=ws.get("ARRIVE_NOSYNC", False), LAZY_RESCALE=ws.get("LAZY_RESCALE", False),
                 PERSIST=ws.get("PERSIST", False))
    for n, d in zip(DESCS, host_descriptors(dt, dict(ws, HOST_DESC=const["HOST_DESC"]))):
        if d is None:
            const[n] = None
        else:
            sig[n] = d
    # every compile-time parameter given (one left out would compile as a runtime value)
    assert not [n for n in names if n.isupper() and n not in const
                and n not in ("Q", "K", "KR", "V", "O", "LSE", "B", "ORDER", *DESCS)]
    for n in const:
        sig[n] = "constexpr"
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if sig[n].startswith("*") or n.startswith("stride_") and n != "stride_lh"}
    src = GluonASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in const.items()}, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, maxnreg=ga._MAXNREG))
    regs, stack = resources(k)
    ex2 = cuobjdump(k, "-sass").count("MUFU.EX2")
    out.append(dict(dt=dt, ws=ws, sort_b=sort_b, use_order=use_order, regs=regs, stack=stack, smem=k.metadata.shared,
                    ex2=ex2,
                    pv_wait=pv_wait_order(k), sts=len(re.findall(r"st\.shared", k.asm["ptx"])),
                    loop_bar_syncs=loop_bar_syncs(k), loop_spills=loop_spills(k),
                    fences=len(re.findall(r"tensormap\.cp_fenceproxy", k.asm["ptx"])),  # descriptors made per program
                    wgmma=len(re.findall(r"wgmma\.mma_async", k.asm["ptx"])),
                    setmaxnreg=sorted(set(int(x) for x in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)",
                                                                      k.asm["ptx"])))))
print(json.dumps(out))
"""


#: fp8 keys-last pipelined over 256-key blocks, P staged, with the late wait and turns
FP8_PIPE_256 = dict(PIPE=True, BLOCK_N=256, STAGES=2, PV_WAIT_LATE=True, PINGPONG=True)


@pytest.mark.skipif(not triton.__version__.startswith("3.6") or ga.gluon is None,
                    reason="sm_90 cross-compile check of the Gluon kernel written for Triton 3.6")
def test_warp_specialized_defaults_cross_compile_for_sm90():
    """The warp-specialized kernel's default configs (bf16; fp8 keys-last) as launches take
    them — persistent in grid order and in a host-given launch order, a program per tile
    longest segment first and in a launch order (``persistent_launch``) — build for an H200
    without a GPU: wgmma, no spills (a persistent program's tile loop may keep a few words
    on the stack, none inside its key loops), shared memory within 227 KiB, registers moved
    by setmaxnreg (loader 24, consumers 240); pipelined with PV_WAIT_LATE, every exp2 of the
    softmax lies before P·V's wait in each consumer's loop (without it ptxas moves the wait
    above them)."""
    assert ta.CONFIGS[torch.bfloat16]["WS"]["PERSIST"] and ta.KEYS_LAST_FP8["WS"]["PERSIST"]
    orders = [(0, False, True), (0, True, True), (ta._SORT_MAX, False, False), (0, True, False)]
    jobs = [("bf16", dict(ta.CONFIGS[torch.bfloat16]["WS"], PERSIST=p), s, False, o) for s, o, p in orders]
    jobs += [("fp8e4nv", dict(ta.KEYS_LAST_FP8["WS"], PERSIST=p), s, True, o) for s, o, p in orders]
    # neighbours: the pipelined bf16 consumers taking turns; fp8 with P staged (the default's
    # fallback for K without rows past its end), pipelined over 256-key blocks, over 128
    jobs += [("bf16", dict(ta.CONFIGS[torch.bfloat16]["WS"], PINGPONG=False, PERSIST=False), 0, False, False),
             ("fp8e4nv", dict(ta.KEYS_LAST_FP8["WS"], P_REGS=False, PERSIST=False), 0, True, False),
             ("fp8e4nv", FP8_PIPE_256, 0, True, False),
             ("fp8e4nv", dict(FP8_PIPE_256, BLOCK_N=128, STAGES=3), 0, True, False)]
    assert ta.CONFIGS[torch.bfloat16]["WS"]["PV_WAIT_LATE"] and ta.KEYS_LAST_FP8["WS"]["P_REGS"]
    for res in _cross_compile(_XCOMPILE_WS, jobs):
        print(res)
        # the pipelined bf16 consumers with turns keep one word on the stack (cuobjdump -sass:
        # stored before the main loop, loaded after it); a persistent program a few, outside
        # its key loops
        if res["ws"].get("PERSIST"):
            assert res["stack"] <= 64 and res["loop_spills"] == [0, 0], res
        else:
            assert res["stack"] <= (8 if res["ws"].get("PINGPONG") and res["dt"] == "bf16" else 0), res
        assert res["wgmma"] > 0 and res["smem"] <= 232448, res
        assert {24, 240} <= set(res["setmaxnreg"]), res
        if res["ws"]["PIPE"]:  # both consumers' loops, the softmax whole before P·V's wait
            assert len(res["pv_wait"]) == 2 and all(0 < n == total for n, total in res["pv_wait"]), res
        assert res["fences"] == 5, res  # q nope and rope, K nope and rope, V: per (segment, head)


@pytest.mark.skipif(not triton.__version__.startswith("3.6") or ga.gluon is None,
                    reason="sm_90 cross-compile check of the Gluon kernel written for Triton 3.6")
def test_warp_specialized_host_descriptors_cross_compile_for_sm90():
    """With ``HOST_DESC`` the defaults read q and K through the launch's descriptors: a
    program makes only V's (bf16, fp8 with P staged) or V's and K's 5-D ones (``P_REGS``),
    and builds as the defaults do: no spills, setmaxnreg 24/240, the late wait in place."""
    # (a program per tile: a persistent program's descriptors, test below)
    bf = dict(ta.CONFIGS[torch.bfloat16]["WS"], PERSIST=False, PINGPONG=False)
    f8 = dict(ta.KEYS_LAST_FP8["WS"], PERSIST=False)
    jobs = [("bf16", dict(bf, HOST_DESC=True), 0, False, True),
            ("bf16", dict(bf, HOST_DESC=True), ta._SORT_MAX, False, False),
            ("fp8e4nv", dict(f8, HOST_DESC=True), 0, True, True),
            ("fp8e4nv", dict(f8, HOST_DESC=True, P_REGS=False), 0, True, False)]
    for res in _cross_compile(_XCOMPILE_WS, jobs):
        print(res)
        assert res["stack"] == 0 and res["wgmma"] > 0 and res["smem"] <= 232448, res
        assert {24, 240} <= set(res["setmaxnreg"]), res
        if res["ws"]["PIPE"]:
            assert len(res["pv_wait"]) == 2 and all(0 < n == total for n, total in res["pv_wait"]), res
        assert res["fences"] == (3 if res["ws"].get("P_REGS") else 1), res


@pytest.mark.skipif(not triton.__version__.startswith("3.6") or ga.gluon is None,
                    reason="sm_90 cross-compile check of the Gluon kernel written for Triton 3.6")
def test_warp_specialized_persistent_cross_compiles_for_sm90():
    """``PERSIST`` builds for an H200 without a GPU as the defaults do, its key loops
    untouched by the tile loop around them: no local memory and no warpgroup barrier in
    them, every exp2 before P·V's wait (pipelined), setmaxnreg 24/240, the same descriptor
    call sites; what a tile leaves for the next (ring positions, its bounds) may wait on the
    stack across its key loop (a few words)."""
    bf, f8 = ta.CONFIGS[torch.bfloat16]["WS"], ta.KEYS_LAST_FP8["WS"]
    jobs = [("bf16", dict(bf, PERSIST=True), 0, False, False), ("bf16", dict(bf, PERSIST=True), 0, False, True),
            ("bf16", dict(bf, PERSIST=True, HOST_DESC=True), 0, False, True),
            ("fp8e4nv", dict(f8, PERSIST=True), 0, True, False), ("fp8e4nv", dict(f8, PERSIST=True), 0, True, True),
            ("fp8e4nv", dict(FP8_PIPE_256, PERSIST=True), 0, True, False)]
    for res in _cross_compile(_XCOMPILE_WS, jobs):
        print(res)
        ws = res["ws"]
        assert res["stack"] <= 64 and res["wgmma"] > 0 and res["smem"] <= 232448, res
        assert {24, 240} <= set(res["setmaxnreg"]), res
        assert len(res["loop_spills"]) == 2 and res["loop_spills"] == [0, 0], res
        if ws.get("ARRIVE_NOSYNC"):
            assert res["loop_bar_syncs"] == [0, 0], res
        if ws["PIPE"]:
            assert len(res["pv_wait"]) == 2 and all(0 < n == total for n, total in res["pv_wait"]), res
        assert res["fences"] == (1 if ws.get("HOST_DESC") else 5), res


_PTX_SYNCS = """\
\tbar.sync \t2, 128;
\t// begin inline asm
\t@%p21 mbarrier.arrive.shared::cta.b64 _, [%r761];
\t// end inline asm
\tbar.sync \t0, 128;
\t.loc\t1 399 46
\tadd.s32 \t%r385, %r183, 188800;
\t// begin inline asm
{
\t.reg .pred complete;
\twaitLoop:
\tmbarrier.try_wait.parity.shared.b64 complete, [%r611], %r612;
\t@!complete bra.uni waitLoop;
}
\tbar.sync \t2, 128;
\t@%p4 mbarrier.arrive.expect_tx.shared.b64 _, [%r254], 24576;
\tbar.sync \t2, 128;
\tst.shared.b32 [%r9], %r10;
\tbar.sync \t1, 32;
\t@%p21 mbarrier.arrive.shared::cta.b64 _, [%r762];
\tbarrier.sync \t1;
\twgmma.fence.sync.aligned;
"""


def test_strip_arrive_syncs_drops_only_a_warpgroups_barrier_before_an_arrive_or_wait():
    """``ARRIVE_NOSYNC``'s PTX pass drops ``bar.sync N, 128`` before a plain mbarrier arrive
    and before a wait (an address computed between), and keeps it before a TMA's
    expect-bytes arrive and before a shared store, and keeps other barriers."""
    out, n = ga.strip_arrive_syncs(_PTX_SYNCS)
    assert n == 2, out
    assert out.count("bar.sync \t2, 128;") == 2 and "bar.sync \t0, 128;" not in out
    assert "bar.sync \t1, 32;" in out and "barrier.sync \t1;" in out
    assert out.count("mbarrier") == _PTX_SYNCS.count("mbarrier")  # nothing else touched
    assert ga.strip_arrive_syncs(out) == (out, 0)


@pytest.mark.skipif(not triton.__version__.startswith("3.6") or ga.gluon is None,
                    reason="sm_90 cross-compile check of the Gluon kernel written for Triton 3.6")
def test_warp_specialized_arrive_nosync_cross_compiles_without_loop_barriers():
    """``ARRIVE_NOSYNC`` on and off (bf16 pipelined with the late wait; fp8 serial with
    turns and ``P_REGS``): no warpgroup barrier left in either consumer's key loop, where
    the kernel without it holds some, the late wait's order and registers as they were;
    and the bf16 default, which adds ``LAZY_RESCALE``, builds as they do (the two are offered
    together: with the barriers kept, ptxas moves one exp2 past the late wait)."""
    # (a program per tile, bf16 without turns: the persistent defaults' loops are checked above)
    bf = dict(ta.CONFIGS[torch.bfloat16]["WS"], PERSIST=False, PINGPONG=False)
    f8 = dict(ta.KEYS_LAST_FP8["WS"], PERSIST=False)
    assert bf["LAZY_RESCALE"] and bf["ARRIVE_NOSYNC"]
    jobs = [(dt, dict(ws, ARRIVE_NOSYNC=on), 0, dt != "bf16", False)
            for dt, ws in (("bf16", dict(bf, LAZY_RESCALE=False)), ("fp8e4nv", f8)) for on in (False, True)]
    jobs += [("bf16", bf, 0, False, False)]
    res = _cross_compile(_XCOMPILE_WS, jobs)
    for r in res:
        print(r)
        assert r["stack"] == 0 and {24, 240} <= set(r["setmaxnreg"]) and len(r["loop_bar_syncs"]) == 2, r
        if r["ws"]["PIPE"]:
            assert len(r["pv_wait"]) == 2 and all(0 < n == total for n, total in r["pv_wait"]), r
    for off, on in (res[:2], res[2:4]):
        assert min(off["loop_bar_syncs"]) > 0 and on["loop_bar_syncs"] == [0, 0], (off, on)
        assert on["regs"] == off["regs"] and on["ex2"] == off["ex2"] and on["wgmma"] == off["wgmma"], (off, on)
    lazy = res[4]  # the default: O's multiplies behind a branch, the late wait kept
    assert lazy["loop_bar_syncs"] == [0, 0] and lazy["ex2"] == res[1]["ex2"], lazy


def _launch_on_cpu(q, config):
    """The Gluon kernel's launch over 4 rows of ``q`` (as q, K and V) on the CPU: its checks
    run before anything compiles or launches."""
    cu = torch.zeros(2, dtype=torch.int32)
    ga.launch(q, q, q[..., 128:], q, torch.zeros(4, 1, 128, dtype=torch.bfloat16), torch.zeros(1, 4),
              cu, cu, cu, 1.0, (1, 1, 1), 0, True, config=config)


@pytest.mark.skipif(ga.gluon is None, reason=f"Gluon: {ga.GLUON_ERR}")
def test_persistent_launch_takes_a_program_per_sm(monkeypatch):
    """``PERSIST`` launches min(tiles, SMs) programs over the tiles (the 3-D grid's count, or
    the launch order's codes), with the in-kernel sort off (a program's tiles follow the
    grid's order); without it the grid (or one program a code) and the sort stay."""
    names = ga._mla_attn_ws_fwd.arg_names
    seen = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **kw: seen.append((grid, dict(zip(names, args, strict=False)), kw))

    monkeypatch.setattr(ga, "_mla_attn_ws_fwd", Kernel())
    monkeypatch.setattr(ga, "sms", lambda device: 132)
    q = torch.zeros(4, 16, 192, dtype=torch.bfloat16)
    cu = torch.zeros(4, dtype=torch.int32)
    order = torch.zeros(500, dtype=torch.int32)

    def launch(grid, persist, order=None):
        ga.launch(q, q, q[..., 128:], q, torch.zeros(4, 16, 128, dtype=torch.bfloat16), torch.zeros(16, 4),
                  cu, cu, cu, 1.0, grid, 64, False, config=dict(PERSIST=persist), order=order, m_tiles=7)
        return seen[-1]

    for grid, programs in (((4, 16, 3), 132), ((2, 16, 3), 96), ((1, 1, 1), 1)):
        got, args, kw = launch(grid, True)
        n = grid[0] * grid[1] * grid[2]
        assert got == (programs, 1, 1) and args["n_tiles"] == n and args["m_tiles"] == grid[0], (grid, got, args)
        assert kw["PERSIST"] and kw["SORT_B"] == 0 and not kw["USE_ORDER"]
        got, args, kw = launch(grid, False)
        assert got == grid and not kw["PERSIST"] and kw["SORT_B"] == 64 and args["n_tiles"] == n
    got, args, kw = launch((4, 16, 3), True, order)
    assert got == (132, 1, 1) and args["n_tiles"] == 500 and args["m_tiles"] == 7 and kw["USE_ORDER"]
    got, args, kw = launch((4, 16, 3), False, order)
    assert got == (500, 1, 1) and args["n_tiles"] == 500 and not kw["PERSIST"]


def test_lazy_rescale_refuses_fp8_and_the_serial_consumer():
    """``LAZY_RESCALE`` lets p reach 2**8: fp8's p, scaled by 2**8 for its e4m3 cast, has no
    room for it; the serial consumer and ``RESCALE_EARLY`` do not carry it. Refused at launch."""
    bf, f8 = torch.zeros(4, 1, 192, dtype=torch.bfloat16), torch.zeros(4, 1, 192, dtype=FP8)
    for q, cfg in ((f8, dict(PIPE=True)), (bf, dict(PIPE=False)), (bf, dict(PIPE=True, RESCALE_EARLY=True))):
        with pytest.raises(ValueError, match="LAZY_RESCALE"):
            _launch_on_cpu(q, dict(cfg, LAZY_RESCALE=True))


def test_rescale_if_asm_moves_then_multiplies_only_under_the_flag():
    """The PTX of ``_rescale_if``: every output takes its input, then a uniform branch on the
    flag skips the multiplies (each output times its alpha) where it is 0."""
    asm = ga._rescale_if_asm(2)
    assert asm == ("{ .reg .pred p; setp.ne.b32 p, $6, 0; mov.b32 $0, $2; mov.b32 $1, $3; @!p bra.uni SKIP; "
                   "mul.f32 $0, $2, $4; mul.f32 $1, $3, $5; SKIP: }")


def test_arrive_nosync_refuses_p_staged_in_shared_memory():
    """fp8 P staged in shared memory is ordered before P·V by the barriers ``ARRIVE_NOSYNC``
    drops: the launch refuses that pair before it compiles anything."""
    with pytest.raises(ValueError, match="ARRIVE_NOSYNC"):
        _launch_on_cpu(torch.zeros(4, 1, 192, dtype=FP8), dict(P_REGS=False, ARRIVE_NOSYNC=True))
    # every variant the config cannot carry is named in the one refusal
    with pytest.raises(ValueError, match=r"ARRIVE_NOSYNC .*; LAZY_RESCALE "):
        _launch_on_cpu(torch.zeros(4, 1, 192, dtype=FP8), dict(PIPE=True, ARRIVE_NOSYNC=True, LAZY_RESCALE=True))


#: fp8 keys-last with P·V's operand in registers (``P_REGS``): serial over 256-key blocks,
#: with and without turns; pipelined over 128-key blocks in 4 stages with the late wait and turns
P_REGS_WS = {"serial_bn256": dict(PIPE=False, BLOCK_N=256, STAGES=2, P_REGS=True),
             "serial_bn256_pingpong": dict(PIPE=False, BLOCK_N=256, STAGES=2, PINGPONG=True, P_REGS=True),
             "pipe_bn128_s4": dict(PIPE=True, BLOCK_N=128, STAGES=4, PV_WAIT_LATE=True, PINGPONG=True, P_REGS=True),
             "serial_bn256_exp2_poly": dict(PIPE=False, BLOCK_N=256, STAGES=2, P_REGS=True, EXP2_POLY=1)}


@pytest.mark.skipif(not triton.__version__.startswith("3.6") or ga.gluon is None,
                    reason="sm_90 cross-compile check of the Gluon kernel written for Triton 3.6")
def test_warp_specialized_p_in_registers_cross_compiles_for_sm90():
    """With ``P_REGS`` the fp8 P operand of P·V stays in registers: the scores' registers are
    relabelled, not moved (the kernel asserts the conversion trivial), so no P goes through
    shared memory (the kernel's only shared stores are its barriers' and the epilogue's:
    fewer than with P staged), no spills, less shared memory than with P staged (its 2 x 16
    KiB buffers gone at 256-key blocks), the late wait kept in the pipelined consumers."""
    staged = dict(P_REGS_WS["serial_bn256"], P_REGS=False)
    jobs = [("fp8e4nv", ws, 0, True, True) for ws in (staged, *P_REGS_WS.values())]
    base, *regs = _cross_compile(_XCOMPILE_WS, jobs)
    print(base)
    for res in regs:
        print(res)
        assert res["stack"] == 0, res
        assert res["wgmma"] > 0 and {24, 240} <= set(res["setmaxnreg"]), res
        assert res["sts"] < base["sts"], (res, base)
        if res["ws"]["BLOCK_N"] == 256:
            assert res["smem"] + 2 * 64 * 256 <= base["smem"] + 64, (res, base)  # (+ the turns' barriers)
        if res["ws"]["PIPE"]:
            assert len(res["pv_wait"]) == 2 and all(0 < n == total for n, total in res["pv_wait"]), res


@pytest.mark.skipif(not triton.__version__.startswith("3.6") or ga.gluon is None,
                    reason="sm_90 cross-compile check of the Gluon kernel written for Triton 3.6")
def test_warp_specialized_exp2_poly_cross_compiles_for_sm90():
    """``EXP2_POLY=1`` moves 1 of every 8 softmax exp2s from the SFU to the FMA pipes: fewer
    MUFU.EX2 than the same config without it, no spills, and the pipelined consumers keep
    every SFU exp2 before P·V's wait (the late wait), for bf16's default and fp8 pipelined."""
    # (bf16's default as a program per tile runs it, without turns)
    fp8, bf16 = FP8_PIPE_256, dict(ta.CONFIGS[torch.bfloat16]["WS"], PERSIST=False, PINGPONG=False)
    jobs = [(dt, dict(ws, EXP2_POLY=n), 0, dt != "bf16", True) for dt, ws in (("fp8e4nv", fp8), ("bf16", bf16))
            for n in (0, 1)]
    f0, f1, b0, b1 = _cross_compile(_XCOMPILE_WS, jobs)
    for base, res in ((f0, f1), (b0, b1)):
        print(base["ex2"], res)
        assert res["stack"] == 0 and res["ex2"] < base["ex2"], (base, res)
        assert len(res["pv_wait"]) == 2 and all(0 < n == total for n, total in res["pv_wait"]), res
        # each pipelined loop: 1 in 8 of its exp2s (all but the two rescale factors) moved
        assert [t for _, t in res["pv_wait"]] == [t - (t - 2) // 8 for _, t in base["pv_wait"]], (base, res)


def test_p_regs_wants_slack_past_the_keys():
    """``P_REGS`` reads K in whole 16-key groups: up to 15 rows past the last segment must lie
    in K's storage, fp8 only, V keys-last; anything else is a ValueError before any launch."""
    buf = torch.zeros(100 + ga.P_REGS_SLACK_ROWS, 2, 192, dtype=FP8)
    k = buf[:100]
    assert ga.rows_readable(k) == 100 + ga.P_REGS_SLACK_ROWS and ga.rows_readable(buf[:40]) == buf.shape[0]
    assert ga.rows_readable(buf[10:20]) == buf.shape[0] - 10
    assert ga.rows_readable(buf[5:9, :1, 128:]) == buf.shape[0] - 5
    q = torch.zeros(4, 2, 192, dtype=FP8)
    ga.check_p_regs(q, k, k[..., 128:], True)  # enough rows past the view
    tight = torch.zeros(100, 2, 192, dtype=FP8)
    with pytest.raises(ValueError, match=r"k \(100 rows readable, 115 needed\), kr"):
        ga.check_p_regs(q, tight, tight[..., 128:], True)
    with pytest.raises(ValueError, match="keys-last False"):
        ga.check_p_regs(q, k, k[..., 128:], False)
    with pytest.raises(ValueError, match="q torch.bfloat16"):
        ga.check_p_regs(q.to(torch.bfloat16), k, k[..., 128:], True)
    # the defaults' P_REGS falls back to P staged where K has no rows past its end; asked for, it stays
    # (and the launch refuses)
    regs = dict(PIPE=False, BLOCK_N=256, P_REGS=True)
    assert ta.ws_config(regs, None, q, k, k[..., 128:], True)["P_REGS"]
    assert not ta.ws_config(regs, None, q, tight, tight[..., 128:], True)["P_REGS"]
    assert not ta.ws_config(regs, dict(WS=dict(STAGES=2)), q, tight, tight[..., 128:], True)["P_REGS"]
    assert ta.ws_config(regs, dict(WS=regs), q, tight, tight[..., 128:], True)["P_REGS"]
    assert ta.ws_config(True, None, q, tight, tight[..., 128:], True) == ga.CONFIG
    # the fp8 default's release without a barrier goes with P staged (its stores need the
    # barrier); a lazy rescale in defaults, with a serial consumer; asked for, both stay
    f8 = ta.KEYS_LAST_FP8["WS"]
    assert ta.ws_config(f8, None, q, k, k[..., 128:], True)["ARRIVE_NOSYNC"]
    staged = ta.ws_config(f8, None, q, tight, tight[..., 128:], True)
    assert not staged["P_REGS"] and not staged["ARRIVE_NOSYNC"]
    assert ta.ws_config(f8, dict(WS=dict(ARRIVE_NOSYNC=True)), q, tight, tight[..., 128:], True)["ARRIVE_NOSYNC"]
    bf, qb = dict(ta.CONFIGS[torch.bfloat16]["WS"], LAZY_RESCALE=True), q.to(torch.bfloat16)
    assert ta.ws_config(bf, None, qb, k, k, False)["LAZY_RESCALE"]
    assert not ta.ws_config(dict(bf, PIPE=False), None, qb, k, k, False)["LAZY_RESCALE"]
    assert ta.ws_config(dict(bf, PIPE=False), dict(WS=dict(LAZY_RESCALE=True)), qb, k, k, False)["LAZY_RESCALE"]
    # launch checks before it compiles or launches anything
    cu = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="P_REGS"):
        ga.launch(q, tight, tight[..., 128:], torch.zeros(2, 128, 16, dtype=FP8), torch.zeros(4, 2, 128),
                  torch.zeros(2, 4), cu, cu, cu, 1.0, (1, 2, 1), 0, True, dict(P_REGS=True))
    with pytest.raises(ValueError, match="EXP2_POLY"):
        ga.launch(q, k, k[..., 128:], torch.zeros(2, 128, 16, dtype=FP8), torch.zeros(4, 2, 128),
                  torch.zeros(2, 4), cu, cu, cu, 1.0, (1, 2, 1), 0, True, dict(EXP2_POLY=3))


def test_ws_config_of_captured_and_eager_launches(monkeypatch):
    """A captured launch takes ``CAPTURED_WS`` over the Gluon kernel's defaults and an eager one
    ``EAGER_WS`` (empty by default; ``ctxprefill bench --eager-variants-ab`` sets it), except
    for what the caller's WS sets."""
    k = torch.zeros(100 + ga.P_REGS_SLACK_ROWS, 2, 192, dtype=FP8)[:100]
    q = torch.zeros(4, 2, 192, dtype=FP8)
    regs = dict(PIPE=False, BLOCK_N=256, P_REGS=True)
    assert ta.CAPTURED_WS == dict(HOST_DESC=True) and not ga.CONFIG["HOST_DESC"]
    assert ta.ws_config(regs, None, q, k, k[..., 128:], True, captured=True) == \
        dict(ga.CONFIG, **regs, **ta.CAPTURED_WS)
    assert not ta.ws_config(regs, dict(WS=dict(HOST_DESC=False)), q, k, k[..., 128:], True,
                            captured=True)["HOST_DESC"]
    assert not ta.ws_config(regs, None, q, k, k[..., 128:], True)["HOST_DESC"]
    assert ta.EAGER_WS == {}
    monkeypatch.setattr(ta, "EAGER_WS", dict(HOST_DESC=True))
    assert ta.ws_config(regs, None, q, k, k[..., 128:], True)["HOST_DESC"]
    assert not ta.ws_config(regs, dict(WS=dict(HOST_DESC=False)), q, k, k[..., 128:], True)["HOST_DESC"]


# ----------------------------------------------------------------------------- warp-specialized kernel (Gluon)

WS_CFGS = {
    "ws_pipe": dict(WS=dict(PIPE=True)),
    "ws_pipe_rescale_early": dict(WS=dict(PIPE=True, RESCALE_EARLY=True)),
    "ws_pipe_bn64": dict(WS=dict(PIPE=True, BLOCK_N=64, STAGES=4)),
    "ws_serial": dict(WS=dict(PIPE=False)),
    "ws_serial_late_k": dict(WS=dict(PIPE=False, EARLY_K=False)),  # the bench's baseline: K freed with V
    "ws_pipe_pingpong": dict(WS=dict(PIPE=True, PINGPONG=True)),
    "ws_pipe_wait_late": dict(WS=dict(PIPE=True, PV_WAIT_LATE=True)),
    "ws_serial_pingpong": dict(WS=dict(PIPE=False, PINGPONG=True)),
    "ws_pipe_wait_late_exp2_poly": dict(WS=dict(PIPE=True, PV_WAIT_LATE=True, EXP2_POLY=1)),  # 1 in 8 exp2s on FMAs
    "ws_pipe_host_desc": dict(WS=dict(PIPE=True, PV_WAIT_LATE=True, HOST_DESC=True)),  # q, K: the launch's
    "ws_pipe_device_desc": dict(WS=dict(PIPE=True, PV_WAIT_LATE=True, HOST_DESC=False)),  # all made per program
    # a row's max kept until it grows by 2**8, O's rescale skipped where no row moved; no barrier before a release
    "ws_pipe_lazy_nosync": dict(WS=dict(PIPE=True, PV_WAIT_LATE=True, LAZY_RESCALE=True, ARRIVE_NOSYNC=True)),
    # one program per SM taking tile after tile: rings, queries' and turns' phases carried across tiles
    "ws_pipe_persist": dict(WS=dict(PIPE=True, PV_WAIT_LATE=True, PERSIST=True)),
    "ws_serial_pingpong_persist": dict(WS=dict(PIPE=False, PINGPONG=True, PERSIST=True)),
}
needs_ws = pytest.mark.skipif(
    not HAS_CUDA or INTERPRETING or ga.gluon is None or torch.cuda.get_device_capability()[0] != 9,
    reason=f"the warp-specialized kernel needs a Hopper GPU (sm_90) and Gluon: {ga.GLUON_ERR or 'no sm_90 device'}")


@needs_ws
@pytest.mark.parametrize("dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("ws", [True, "persist", False], ids=["gluon", "gluon_persist", "triton"])
def test_gpu_empty_batch_reads_nothing_past_its_metadata(ws, dtype):
    """B == 0 still launches one program a head: past the one-entry cu_seqlens lie another
    tensor's values (here a 64-row segment over 4,096 keys), which no program may take for
    the batch's. Nothing is computed or stored: an ``out`` inside a larger buffer keeps
    every byte around it."""
    H = 2
    cu = torch.tensor([0, 64, 0, 4096], dtype=torch.int32, device="cuda")  # views cu[0:1], cu[2:3]
    q_all, k, _, _, _ = make_batch([64], [4096], H, dtype, device="cuda", seed=5)
    v = torch.randn(4096, H, 128, device="cuda").to(dtype)
    kw: dict = {}
    if dtype == FP8:  # the fp8 path the Gluon kernel runs: V keys-last
        v, kw = v.permute(1, 2, 0).contiguous(), dict(v_layout="hdt", cu_seqlens_v=cu[2:3])
    out_all = torch.full((64, H, 128), 7.0, dtype=torch.bfloat16, device="cuda")
    cfg = dict(WS=dict(PERSIST=True)) if ws == "persist" else None if ws else dict(WS=None)
    call = lambda: mla_context_attention(q_all[:0], k, v, cu[0:1], cu[2:3], 0, 0, 0.1,  # noqa: E731
                                         out=out_all[:0], config=cfg, **kw)
    names = _kernel_names(call)
    assert len(names) == 1 and ("_mla_attn_ws_fwd" in names[0]) == bool(ws), names
    out, lse = call()
    torch.cuda.synchronize()
    assert out.shape == (0, H, 128) and lse.shape == (H, 0)
    assert (out_all == 7.0).all()


@needs_ws
@pytest.mark.parametrize("ws", list(WS_CFGS))
def test_gpu_warp_specialized_ragged(ws):
    """Against float64: empty q and k segments, one-token ones, lengths off the tiles, long
    ones (sorted longest first: B <= 64), many heads; one launch of the Gluon kernel."""
    cfg = WS_CFGS[ws]
    _gpu_case([1000, 0, 1, 257, 2048], [4096, 300, 0, 1, 2500], 16, torch.bfloat16, False, cfg)
    _gpu_case([300, 77], [1100, 129], 128, torch.bfloat16, False, cfg, seed=1)
    _gpu_case([64, 200], [65, 16385], 2, torch.bfloat16, False, cfg, seed=2)
    q, k, v, cu_q, cu_k = make_batch([300, 0, 40], [500, 7, 0], 16, torch.bfloat16, device="cuda")
    names = _kernel_names(lambda: mla_context_attention(q, k, v, cu_q, cu_k, 300, 500, 0.07, config=cfg))
    assert len(names) == 1 and "_mla_attn_ws_fwd" in names[0], names


@needs_ws
@pytest.mark.parametrize("ws", ["ws_pipe", "ws_serial"])
def test_gpu_warp_specialized_unpacked_keys(ws):
    """The Gluon kernel over the unpacked keys (k_nope in a kv_b_proj-like output, k_rope
    in a workspace-like row with a 0 head stride): the same bits as over the packed k,
    NaN in every column it must not read; fp8 keys-last too."""
    cfg = WS_CFGS[ws]
    q_lens, k_lens = [1000, 0, 1, 257, 2048], [4096, 300, 0, 1, 2500]
    for H, dtype in ((16, torch.bfloat16), (128, torch.bfloat16), (16, FP8)):
        q, k, v, cu_q, cu_k = make_batch(q_lens, k_lens, H, dtype, device="cuda", seed=H)
        k, k_nope, k_rope = _apart(k, H, dtype, "cuda")
        kw = {}
        if dtype == FP8:
            v, cv = _keys_last(v, k_lens)
            kw = dict(v_layout="hdt", cu_seqlens_v=cv)
        a = mla_context_attention(q, k, v, cu_q, cu_k, 2048, 4096, 0.07, config=cfg, **kw)
        names = _kernel_names(lambda: mla_context_attention(q, k_nope, v, cu_q, cu_k, 2048, 4096, 0.07, config=cfg,
                                                            k_rope=k_rope, **kw))
        assert len(names) == 1 and "_mla_attn_ws_fwd" in names[0], names
        b = mla_context_attention(q, k_nope, v, cu_q, cu_k, 2048, 4096, 0.07, config=cfg, k_rope=k_rope, **kw)
        torch.cuda.synchronize()
        assert not torch.isnan(b[0].float()).any(), (H, dtype)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), (H, dtype)


@needs_ws
@pytest.mark.parametrize("pipe,key", [(True, "PINGPONG"), (False, "PINGPONG"), (True, "PV_WAIT_LATE")],
                         ids=["pipe_pingpong", "serial_pingpong", "pipe_wait_late"])
def test_gpu_warp_specialized_schedule_same_bits(pipe, key):
    """Consumers taking turns at the tensor cores (PINGPONG) or P·V's wait held after the
    softmax (PV_WAIT_LATE) change when instructions run, not what they compute: the same
    bits as without, bf16 and fp8 keys-last, ragged with empty segments and a segment of
    one block (a loop's first and last)."""
    q_lens, k_lens = [1000, 0, 1, 257, 2048], [4096, 300, 0, 128, 2500]
    for H, dtype in ((16, torch.bfloat16), (128, torch.bfloat16), (16, FP8)):
        q, k, v, cu_q, cu_k = make_batch(q_lens, k_lens, H, dtype, device="cuda", seed=H + 7)
        kw: dict = {}
        if dtype == FP8:
            v, cv = _keys_last(v, k_lens)
            kw = dict(v_layout="hdt", cu_seqlens_v=cv)
        base = dict(PV_FP8=True) if dtype == FP8 else {}
        cfgs = [dict(base, WS={"PIPE": pipe, "STAGES": 3 if dtype == FP8 else 2, key: on}) for on in (False, True)]
        runs = [mla_context_attention(q, k, v, cu_q, cu_k, 2048, 4096, 0.07, **kw, config=c) for c in cfgs]
        torch.cuda.synchronize()
        (a, la), (b, lb) = runs
        assert torch.isfinite(la[:, :1000]).all(), (H, dtype)
        assert torch.equal(a, b) and torch.equal(la, lb), (H, dtype)
        for c in cfgs:  # both sides ran the Gluon kernel, not the Triton fallback
            names = _kernel_names(lambda: mla_context_attention(q, k, v, cu_q, cu_k, 2048, 4096, 0.07, **kw,  # noqa: B023
                                                                config=c))
            assert len(names) == 1 and "_mla_attn_ws_fwd" in names[0], (H, dtype, names)


@needs_ws
@pytest.mark.parametrize("dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8_p_regs"])
def test_gpu_warp_specialized_arrive_nosync_same_bits(dtype):
    """K and V slots released by one thread of each consumer warpgroup without the
    warpgroup barrier before it (``ARRIVE_NOSYNC``, the defaults') give the bits of the
    kernel with the barrier: a slot is refilled only after every warp's MMA read it.
    Ragged with empty and one-key segments and a 1 × 8,192-query segment over 16k keys,
    16 and 128 heads, each launch three times."""
    from ctxprefill.ops.pack import key_buffer

    base = dict(PV_FP8=True) if dtype == FP8 else {}
    ws = dict(ta.KEYS_LAST_FP8["WS"] if dtype == FP8 else ta.CONFIGS[torch.bfloat16]["WS"])
    for (q_lens, k_lens), H in itertools.product((([1000, 0, 1, 257, 2048, 64], [4096, 300, 0, 1, 2500, 129]),
                                                  ([8192], [16384])), (16, 128)):
        q, k, v, cu_q, cu_k = make_batch(q_lens, k_lens, H, dtype, device="cuda", seed=H + 5)
        kw: dict = {}
        if dtype == FP8:
            v, cv = _keys_last(v, k_lens)
            k = key_buffer(*k.shape, k.device).copy_(k)  # rows past the end for P_REGS
            kw = dict(v_layout="hdt", cu_seqlens_v=cv)
        runs = [mla_context_attention(q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), 0.07, **kw,
                                      config=dict(base, WS=dict(ws, ARRIVE_NOSYNC=on)))
                for on in (False, True, True, True)]
        torch.cuda.synchronize()
        (a, la), *rest = runs
        assert torch.isfinite(la[:, : q_lens[0]]).all(), (H, q_lens)
        for b, lb in rest:
            assert torch.equal(a, b) and torch.equal(la, lb), (H, q_lens)
    names = _kernel_names(lambda: mla_context_attention(q, k, v, cu_q, cu_k, 8192, 16384, 0.07, **kw,
                                                        config=dict(base, WS=dict(ws, ARRIVE_NOSYNC=True))))
    assert len(names) == 1 and "_mla_attn_ws_fwd" in names[0], names


@needs_ws
def test_gpu_warp_specialized_lazy_rescale_against_float64():
    """``LAZY_RESCALE`` where the max moves: keys whose scores grow block after block (each
    step under 2**8, so O is rescaled only where the growth adds up), a segment whose
    scores jump from very negative to very positive (O's old terms must vanish: alpha
    ~2**-150) and one that falls after its first block (the max never moves):
    against float64 and beside O rescaled every block, both within the same tolerance."""
    torch.manual_seed(0)
    H, d = 16, 192
    u = torch.randn(H, d, device="cuda")
    lens = [3000, 2500, 1500]
    # scores ~ 0.07 · a · |u|² (|u|² ~ 192): the ramp's max grows ~0.9 a block in log2 units
    # (past 2**8 every ~9 blocks); the jump's, ~150 at once (alpha ~2**-150: O's old terms vanish)
    ramp = torch.linspace(0.0, 1.0, lens[0], device="cuda")
    jump = torch.where(torch.arange(lens[1], device="cuda") < 1000, -4.0, 4.0)
    fall = torch.linspace(1.0, -2.0, lens[2], device="cuda")
    noise = lambda n: 0.5 * torch.randn(n, H, d, device="cuda")  # noqa: E731
    k = torch.cat([a[:, None, None] * u + noise(a.numel()) for a in (ramp, jump, fall)]).to(torch.bfloat16)
    q = (u + 0.3 * torch.randn(3 * 300, H, d, device="cuda")).to(torch.bfloat16)
    v = torch.randn(sum(lens), H, 128, device="cuda").to(torch.bfloat16)
    cu_q = torch.tensor([0, 300, 600, 900], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, lens[0], lens[0] + lens[1], sum(lens)], dtype=torch.int32, device="cuda")
    ref_out, ref_lse = reference(q, k, v, cu_q, cu_k, 0.07)
    assert (ref_lse[:, 300:600] > 30).all()  # the jump's scores: past e**30 after its first 1,000 keys
    for cfg in (WS_CFGS["ws_pipe_lazy_nosync"], dict(WS=dict(PIPE=True, PV_WAIT_LATE=True))):
        out, lse = mla_context_attention(q, k, v, cu_q, cu_k, 300, max(lens), 0.07, config=cfg)
        check(out, lse, ref_out, ref_lse)


@needs_ws
@pytest.mark.parametrize("dtype,block_n,stages", [(torch.bfloat16, 128, 2), (FP8, 128, 3), (FP8, 256, 2)],
                         ids=["bf16", "fp8", "fp8_bn256"])
def test_gpu_warp_specialized_pipelined_same_bits_as_serial(dtype, block_n, stages):
    """Pipelined consumers (block j's Q·Kᵀ beside block j-1's P·V; fp8 P staged in shared
    memory before the next Q·Kᵀ) run the serial consumer's arithmetic in another order of
    issue: O rescaled between the same two P·V's, the same P. The same bits, with and
    without the late wait and turns, ragged with empty and one-block segments."""
    q_lens, k_lens = [1000, 0, 1, 257, 2048], [4096, 300, 0, 256, 2500]
    kw: dict = {}
    q, k, v, cu_q, cu_k = make_batch(q_lens, k_lens, 16, dtype, device="cuda", seed=11)
    if dtype == FP8:
        v, cv = _keys_last(v, k_lens)
        kw = dict(v_layout="hdt", cu_seqlens_v=cv)
    base = dict(PV_FP8=True) if dtype == FP8 else {}
    ws = dict(BLOCK_N=block_n, STAGES=stages)
    cfgs = [dict(base, WS=dict(ws, **c))
            for c in (dict(PIPE=False), dict(PIPE=True), dict(PIPE=True, PV_WAIT_LATE=True, PINGPONG=True))]
    runs = [mla_context_attention(q, k, v, cu_q, cu_k, 2048, 4096, 0.07, **kw, config=c) for c in cfgs]
    torch.cuda.synchronize()
    (a, la), *rest = runs
    assert torch.isfinite(la[:, :1000]).all()
    for b, lb in rest:
        assert torch.equal(a, b) and torch.equal(la, lb)
    for c in cfgs:  # every schedule ran the Gluon kernel, not the Triton fallback
        names = _kernel_names(lambda: mla_context_attention(q, k, v, cu_q, cu_k, 2048, 4096, 0.07, **kw,  # noqa: B023
                                                            config=c))
        assert len(names) == 1 and "_mla_attn_ws_fwd" in names[0], (c, names)


@needs_ws
@pytest.mark.parametrize("dtype,ws", [(torch.bfloat16, {}), (FP8, dict(P_REGS=True)), (FP8, dict(P_REGS=False))],
                         ids=["bf16", "fp8_p_regs", "fp8_p_staged"])
def test_gpu_warp_specialized_host_descriptors_same_bits(dtype, ws):
    """q and K read through the launch's descriptors (``HOST_DESC``: a tile's rows past its
    segment come from the next segment, masked out of the scores or never stored) give the
    same bits as through descriptors made per (segment, head): packed and unpacked keys
    (rope shared by the heads), ragged with empty and one-key segments, grid order and the
    host's launch order; a launch of the Gluon kernel either way. Under ``P_REGS`` K keeps
    its descriptors made per segment, so only q's change: packed keys, with the rows it
    reads past their end."""
    from ctxprefill.ops.pack import key_buffer

    q_lens, k_lens = [1000, 0, 1, 257, 2048, 64], [4096, 300, 0, 1, 2500, 129]
    for H in (16, 128):
        q, k, v, cu_q, cu_k = make_batch(q_lens, k_lens, H, dtype, device="cuda", seed=H + 3)
        k, k_nope, k_rope = _apart(k, H, dtype, "cuda")
        kw: dict = {}
        base: dict = {}
        if dtype == FP8:
            v, cv = _keys_last(v, k_lens)
            kw, base = dict(v_layout="hdt", cu_seqlens_v=cv), dict(PV_FP8=True)
        order = ta.device_tile_order(q_lens, k_lens, H, q.dtype, q.device)
        cases = [(k, {}), (k_nope, dict(k_rope=k_rope)), (k, dict(tile_order=order))]
        if ws.get("P_REGS"):
            k = key_buffer(*k.shape, k.device).copy_(k)
            cases = [(k, {}), (k, dict(tile_order=order))]
        for keys, extra in cases:
            runs = [mla_context_attention(q, keys, v, cu_q, cu_k, 2048, 4096, 0.07, **kw, **extra,
                                          config=dict(base, WS=dict(ws, HOST_DESC=host)))
                    for host in (False, True)]
            torch.cuda.synchronize()
            (a, la), (b, lb) = runs
            assert torch.isfinite(la[:, :1000]).all() and not torch.isnan(b.float()).any(), (H, list(extra))
            assert torch.equal(a, b) and torch.equal(la, lb), (H, list(extra))
        names = _kernel_names(lambda: mla_context_attention(q, k, v, cu_q, cu_k, 2048, 4096, 0.07, **kw,  # noqa: B023
                                                            config=dict(base, WS=dict(ws, HOST_DESC=True))))
        assert len(names) == 1 and "_mla_attn_ws_fwd" in names[0], (H, names)


@needs_ws
@pytest.mark.parametrize("dtype,ws", [(torch.bfloat16, ta.CONFIGS[torch.bfloat16]["WS"]), (FP8, ta.KEYS_LAST_FP8["WS"]),
                                      (FP8, FP8_PIPE_256)], ids=["bf16", "fp8_p_regs", "fp8_pipe_turns"])
def test_gpu_warp_specialized_persistent_same_bits(dtype, ws):
    """``PERSIST`` (one program per SM taking every 132nd tile or so, the rings, the
    queries' and the turns' phases running on across its tiles, descriptors rewritten per
    tile) gives the bits of one program per tile: the defaults and fp8 pipelined with
    turns; ragged with empty and one-key segments, at 16 and 128 heads (about 12 and 93
    tiles a program over 132 SMs in grid order, empty tiles included), grid order and the
    host's launch order laid out for it (16 heads: 9-10 codes a program, padding included),
    q and K through the launch's descriptors or made per tile, packed and unpacked keys;
    and fewer tiles than SMs. One launch of the Gluon kernel (its
    program count: ``test_persistent_launch_takes_a_program_per_sm``)."""
    from ctxprefill.ops.pack import key_buffer

    q_lens, k_lens = [1000, 0, 1, 257, 2048, 64], [4096, 300, 0, 1, 2500, 129]
    base = dict(PV_FP8=True) if dtype == FP8 else {}
    for H in (16, 128):
        q, k, v, cu_q, cu_k = make_batch(q_lens, k_lens, H, dtype, device="cuda", seed=H + 7)
        k, k_nope, k_rope = _apart(k, H, dtype, "cuda")
        kw: dict = {}
        if dtype == FP8:
            v, cv = _keys_last(v, k_lens)
            kw = dict(v_layout="hdt", cu_seqlens_v=cv)
            k = key_buffer(*k.shape, k.device).copy_(k)  # the rows P_REGS reads past the end
        # the host's order laid out for a persistent launch (its packed lists, padded with -1),
        # which the program-per-tile launch runs too (a padding code: an empty program)
        order = ta.device_tile_order(q_lens, k_lens, H, q.dtype, q.device, persistent=True)
        assert (order is not None) == (H == 16) and (order is None or -1 in order.codes.tolist()), H
        cases = [(k, {}), (k, dict(tile_order=order))] + ([] if dtype == FP8 else [(k_nope, dict(k_rope=k_rope))])
        for (keys, extra), host in itertools.product(cases, (False, True)):
            runs = [mla_context_attention(q, keys, v, cu_q, cu_k, 2048, 4096, 0.07, **kw, **extra,
                                          config=dict(base, WS=dict(ws, HOST_DESC=host, PERSIST=persist)))
                    for persist in (False, True)]
            torch.cuda.synchronize()
            (a, la), (b, lb) = runs
            assert torch.isfinite(la[:, :1000]).all() and not torch.isnan(b.float()).any(), (H, host, list(extra))
            assert torch.equal(a, b) and torch.equal(la, lb), (H, host, list(extra))
        kernels = _kernel_names(lambda: mla_context_attention(  # noqa: B023
            q, k, v, cu_q, cu_k, 2048, 4096, 0.07, **kw, config=dict(base, WS=dict(ws, PERSIST=True))))
        assert len(kernels) == 1 and "_mla_attn_ws_fwd" in kernels[0], (H, kernels)
    # fewer tiles than SMs (2): a program each
    q, k, v, cu_q, cu_k = make_batch([130], [300], 1, torch.bfloat16, device="cuda", seed=3)
    a, la = mla_context_attention(q, k, v, cu_q, cu_k, 130, 300, 0.07, config=dict(WS=dict(PERSIST=False)))
    b, lb = mla_context_attention(q, k, v, cu_q, cu_k, 130, 300, 0.07, config=dict(WS=dict(PERSIST=True)))
    torch.cuda.synchronize()
    assert torch.equal(a, b) and torch.equal(la, lb)


@needs_ws
def test_gpu_persist_from_the_defaults_follows_the_launch_order(monkeypatch):
    """``PERSIST`` from the defaults (here through ``EAGER_WS``) runs persistent programs for
    one segment of more tiles than SMs and for an order laid out for them, a program per
    tile for a ragged batch without one and for one segment whose tiles the SMs take in
    one go (``persistent_launch``); asked for in ``config``, always. The same bits every
    way."""
    seen: list[tuple[bool, int]] = []  # (PERSIST, the launch's tiles)
    launch = ga.launch

    def spy(*a, **kw):
        args = inspect.signature(launch).bind(*a, **kw).arguments
        seen.append((bool(args["config"]["PERSIST"]), math.prod(args["grid"])))
        return launch(*a, **kw)

    monkeypatch.setattr(ga, "launch", spy)
    monkeypatch.setattr(ta, "EAGER_WS", {"PERSIST": True})
    H, q_lens, k_lens = 16, [1000, 257, 2048, 64], [4096, 1, 2500, 129]
    q, k, v, cu_q, cu_k = make_batch(q_lens, k_lens, H, torch.bfloat16, device="cuda", seed=11)
    laid = ta.device_tile_order(q_lens, k_lens, H, q.dtype, q.device)
    assert laid is not None and laid.persistent
    ws = ta.CONFIGS[torch.bfloat16]["WS"]
    ref = mla_context_attention(q, k, v, cu_q, cu_k, 2048, 4096, 0.07, config=dict(WS=dict(ws, PERSIST=False)))
    runs = [mla_context_attention(q, k, v, cu_q, cu_k, 2048, 4096, 0.07),  # ragged, no order
            mla_context_attention(q, k, v, cu_q, cu_k, 2048, 4096, 0.07, tile_order=laid),
            mla_context_attention(q, k, v, cu_q, cu_k, 2048, 4096, 0.07, config=dict(WS=dict(ws, PERSIST=True)))]
    # one segment of one query tile a head more than the SMs take at once, and one of no more
    sms, bm = ga.sms(q.device), ga.CONFIG["BLOCK_M"]
    one = []
    for n in (bm * (sms // H + 1), bm * (sms // H)):
        q1, k1, v1, cq1, ck1 = make_batch([n], [2500], H, torch.bfloat16, device="cuda", seed=n)
        one += [mla_context_attention(q1, k1, v1, cq1, ck1, n, 2500, 0.07, config=c)
                for c in (dict(WS=dict(ws, PERSIST=False)), None)]
    torch.cuda.synchronize()
    assert [persist for persist, _ in seen] == [False, False, True, True, False, True, False, False]
    assert seen[7][1] <= sms < seen[5][1], (seen, sms)  # the two segments' tiles lie either side of the SMs
    for out, lse in runs:
        assert torch.equal(out, ref[0]) and torch.equal(lse, ref[1])
    for (a, la), (b, lb) in (one[:2], one[2:]):
        assert torch.equal(a, b) and torch.equal(la, lb)


@needs_ws
def test_gpu_warp_specialized_unsorted_many_segments():
    lens = [(i * 37) % 150 for i in range(ta._SORT_MAX + 3)]
    _gpu_case(lens, [(i * 53) % 333 for i in range(len(lens))], 3, torch.bfloat16, False, WS_CFGS["ws_pipe"])


@needs_ws
@pytest.mark.parametrize("ws", ["ws_pipe", "ws_pipe_bn64", "ws_serial", "ws_pipe_host_desc", "ws_pipe_device_desc",
                                "ws_pipe_persist"])
def test_gpu_warp_specialized_neighbours_do_not_leak(ws):
    """A tile reads past its segment's end; those rows must be zeros, not the next
    segment's values: an inf in the next segment's k/v leaves this segment's result equal
    (bit for bit) to a run where the next segment is finite."""
    cfg = WS_CFGS[ws]
    H = 4
    q, k, v, cu_q, cu_k = make_batch([100, 50], [70, 200], H, torch.bfloat16, device="cuda", seed=5)
    a, la = mla_context_attention(q, k, v, cu_q, cu_k, 100, 200, 0.07, config=cfg)
    k2, v2 = k.clone(), v.clone()
    k2[70:] = float("inf")
    v2[70:] = float("inf")
    b, lb = mla_context_attention(q, k2, v2, cu_q, cu_k, 100, 200, 0.07, config=cfg)
    torch.cuda.synchronize()
    assert torch.isfinite(b[:100].float()).all() and torch.isfinite(lb[:, :100]).all()
    assert torch.equal(a[:100], b[:100]) and torch.equal(la[:, :100], lb[:, :100])


@needs_ws
def test_gpu_warp_specialized_out_pointer_and_untouched_rows():
    H = 16
    cfg = WS_CFGS["ws_pipe"]
    q, k, v, cu_q, cu_k = make_batch([700, 5, 0, 130], [2000, 0, 9, 64], H, torch.bfloat16, device="cuda", seed=4)
    Tq = q.shape[0]
    big = torch.full((Tq + 300, H, 128), 3.0, dtype=torch.bfloat16, device="cuda")
    out = big[100 : 100 + Tq]
    got, lse = mla_context_attention(q, k, v, cu_q, cu_k, 700, 2000, 0.07, out=out, config=cfg)
    torch.cuda.synchronize()
    assert got.data_ptr() == out.data_ptr()
    assert (big[:100] == 3.0).all() and (big[100 + Tq :] == 3.0).all()
    assert (out[700:705] == 0).all() and (lse[:, 700:705] == float("-inf")).all()
    check(got, lse, *reference(q.float(), k.float(), v.float(), cu_q, cu_k, 0.07))


@needs_ws
@pytest.mark.parametrize("dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8_keys_last"])
def test_gpu_warp_specialized_launch_order(dtype):
    """With the host's launch order (528 tiles packed per SM; tiles of segments without
    queries left out) the kernel computes every tile exactly as in grid order:
    bit-identical output and LSE, against float64 too, one launch of the Gluon kernel."""
    H = 16
    q_lens, k_lens = [256, 0, 1792, 640, 1, 1408], [6960, 50, 2320, 9280, 0, 3472]
    if dtype == FP8:  # 256-key blocks: the same tiles (and a packed order) over twice the keys
        k_lens = [2 * n for n in k_lens]
    got = ta.tile_order_codes(q_lens, k_lens, H, dtype, "cuda")
    assert got is not None
    order = ta.device_tile_order(q_lens, k_lens, H, dtype, "cuda")
    assert order.codes.tolist() == list(got.codes) and order.m_tiles == got.m_tiles == 14
    assert GluonAttentionBackend().launch_order(q_lens, k_lens, H, dtype, torch.device("cuda")) == got
    assert order.codes.numel() == H * sum(-(-n // 128) for n in q_lens)  # no empty programs
    q, k, v, cu_q, cu_k = make_batch(q_lens, k_lens, H, dtype, device="cuda", seed=H)
    kw = {}
    if dtype == FP8:
        vt, cv = _keys_last(v, k_lens)
        kw = dict(v_layout="hdt", cu_seqlens_v=cv)
    else:
        vt = v
    run = lambda o: mla_context_attention(q, k, vt, cu_q, cu_k, max(q_lens), max(k_lens), 192**-0.5, tile_order=o,
                                          **kw)
    a, la = run(None)
    b, lb = run(order)
    torch.cuda.synchronize()
    assert torch.equal(a, b) and torch.equal(la, lb)
    check(b, lb, *reference(q.float(), k.float(), v.float(), cu_q, cu_k, 192**-0.5),
          out_tol=5e-2 if dtype == FP8 else 1e-2)
    names = _kernel_names(lambda: run(order))
    assert len(names) == 1 and "_mla_attn_ws_fwd" in names[0], names


@needs_ws
def test_gpu_warp_specialized_launch_order_codes_are_checked():
    """Codes outside the batch (negative, past B·m_tiles·H) run nothing and write nothing;
    an order that names only some tiles computes those, bit for bit, and leaves the rest."""
    H = 4
    q_lens, k_lens = [300, 40], [500, 70]
    q, k, v, cu_q, cu_k = make_batch(q_lens, k_lens, H, torch.bfloat16, device="cuda", seed=7)
    full, lse_full = mla_context_attention(q, k, v, cu_q, cu_k, 300, 500, 0.07)
    m_tiles = 3
    # tile (b=0, m=1, h=2) and (b=1, m=0, h=3), then codes that name nothing
    codes = [(0 * m_tiles + 1) * H + 2, (1 * m_tiles + 0) * H + 3, -1, 2 * m_tiles * H, 2**31 - 1,
             (1 * m_tiles + 2) * H + 0]  # the last: a tile past segment 1's rows
    order = ta.TileOrder(torch.tensor(codes, dtype=torch.int32, device="cuda"), 2, H, m_tiles)
    out = torch.full_like(full, 5.0)
    got, lse = mla_context_attention(q, k, v, cu_q, cu_k, 300, 500, 0.07, out=out, tile_order=order)
    torch.cuda.synchronize()
    done = torch.zeros(out.shape[:2], dtype=torch.bool, device="cuda")
    done[128:256, 2] = True
    done[300:340, 3] = True
    assert torch.equal(got[done], full[done]) and torch.equal(lse.T[done], lse_full.T[done])
    assert (got[~done] == 5.0).all()


def _keys_last(v, k_lens):
    """v [Tk, H, 128] -> [H, 128, Tv], each segment from a multiple of 16 columns (what the
    engine's fp8 pack writes), and the starts."""
    from ctxprefill.ops.pack import keys_last_copy, keys_last_layout

    layout = keys_last_layout([0, *itertools.accumulate(k_lens)], v.device)
    return keys_last_copy(v, layout), layout.cu_v_dev


@needs_ws
@pytest.mark.parametrize("ws", [dict(PIPE=True, STAGES=2), dict(PIPE=True, STAGES=3), dict(PIPE=False, STAGES=3),
                                dict(PIPE=True, STAGES=3, PV_WAIT_LATE=True), dict(PIPE=False, BLOCK_N=256, STAGES=2),
                                dict(PIPE=False, BLOCK_N=256, STAGES=2, PINGPONG=True),
                                dict(PIPE=True, BLOCK_N=256, STAGES=2, PV_WAIT_LATE=True, PINGPONG=True),
                                dict(PIPE=True, BLOCK_N=256, STAGES=2, PV_WAIT_LATE=True, PINGPONG=True, EXP2_POLY=1)],
                         ids=["pipe_s2", "pipe_s3", "serial_s3", "pipe_s3_wait_late", "serial_bn256",
                              "serial_bn256_pingpong", "pipe_bn256_wait_late_pingpong", "pipe_bn256_exp2_poly"])
def test_gpu_warp_specialized_fp8_keys_last(ws):
    """fp8 q/k/v, V keys-last, P·V in fp8 (P through shared memory): against float64 from
    the dequantized inputs within the P·V-in-fp8 bound (5e-2), ragged with empty segments."""
    cfg = dict(PV_FP8=True, WS=ws)
    for q_lens, k_lens, H, seed in (([1000, 0, 1, 257, 2048], [4096, 300, 0, 1, 2500], 16, 0),
                                    ([300, 77], [1100, 129], 128, 1)):
        q, k, v, cu_q, cu_k = make_batch(q_lens, k_lens, H, FP8, device="cuda", seed=seed)
        vt, cv = _keys_last(v, k_lens)
        run = lambda: mla_context_attention(q, k, vt, cu_q, cu_k, max(q_lens), max(k_lens), 192**-0.5,
                                            config=cfg, v_layout="hdt", cu_seqlens_v=cv)
        out, lse = run()
        torch.cuda.synchronize()
        check(out, lse, *reference(q.float(), k.float(), v.float(), cu_q, cu_k, 192**-0.5), out_tol=5e-2)
    names = _kernel_names(run)
    assert len(names) == 1 and "_mla_attn_ws_fwd" in names[0], names


def _with_slack(k):
    """``k`` as a view of a buffer ``P_REGS_SLACK_ROWS`` rows longer, those rows NaN (a key
    read past the segments that reached the output would show)."""
    buf = torch.full((k.shape[0] + ga.P_REGS_SLACK_ROWS, *k.shape[1:]), float("nan"), dtype=torch.float32,
                     device=k.device).to(k.dtype)
    buf[: k.shape[0]] = k
    return buf[: k.shape[0]]


@needs_ws
@pytest.mark.parametrize("ws", list(P_REGS_WS))
def test_gpu_warp_specialized_fp8_p_in_registers(ws):
    """fp8 keys-last with P·V's operand in registers (K's rows loaded permuted in 16-key
    groups): against float64 within the fp8 bound, ragged with empty and one-key segments,
    segments ending inside a 16-key group and NaN in the rows past the last one; a NaN in
    the next segment's keys leaves a segment's result bit for bit."""
    cfg = dict(PV_FP8=True, WS=P_REGS_WS[ws])
    for q_lens, k_lens, H, seed in (([1000, 0, 1, 257, 2048], [4096, 300, 0, 1, 2500], 16, 0),
                                    ([300, 77], [1100, 129], 128, 1), ([64, 200], [65, 16385], 2, 2)):
        q, k, v, cu_q, cu_k = make_batch(q_lens, k_lens, H, FP8, device="cuda", seed=seed)
        vt, cv = _keys_last(v, k_lens)
        k = _with_slack(k)
        out, lse = mla_context_attention(q, k, vt, cu_q, cu_k, max(q_lens), max(k_lens), 192**-0.5, config=cfg,
                                         v_layout="hdt", cu_seqlens_v=cv)
        torch.cuda.synchronize()
        check(out, lse, *reference(q.float(), k.float(), v.float(), cu_q, cu_k, 192**-0.5), out_tol=5e-2)
    # neighbours: segment 0 ends 6 keys into a 16-key group whose rest is segment 1's
    q, k, v, cu_q, cu_k = make_batch([100, 50], [70, 200], 4, FP8, device="cuda", seed=5)
    vt, cv = _keys_last(v, [70, 200])
    run = lambda kk: mla_context_attention(q, kk, vt, cu_q, cu_k, 100, 200, 0.07, config=cfg, v_layout="hdt",
                                           cu_seqlens_v=cv)
    a, la = run(_with_slack(k))
    k2 = k.clone()
    k2[70:] = float("nan")
    b, lb = run(_with_slack(k2))
    torch.cuda.synchronize()
    assert torch.isfinite(b[:100].float()).all() and torch.isfinite(lb[:, :100]).all()
    assert torch.equal(a[:100], b[:100]) and torch.equal(la[:, :100], lb[:, :100])
    with pytest.raises(ValueError, match="P_REGS"):
        run(k)  # no rows past the keys



@needs_ws
def test_gpu_p_regs_inputs_checked_once_a_launch(monkeypatch):
    """The default fp8 keys-last config (P_REGS) checks K's rows past its end once a launch
    (``ws_config``), not again in ``launch``; asked for in ``config``, once too (``launch``)."""
    calls = []
    real = ga.p_regs_problem
    monkeypatch.setattr(ga, "p_regs_problem", lambda *a: calls.append(1) or real(*a))
    q, k, v, cu_q, cu_k = make_batch([100, 50], [70, 200], 4, FP8, device="cuda", seed=7)
    vt, cv = _keys_last(v, [70, 200])
    k = _with_slack(k)
    assert ta.KEYS_LAST_FP8["WS"]["P_REGS"]
    for config in (None, dict(PV_FP8=True, WS=dict(ta.KEYS_LAST_FP8["WS"]))):
        calls.clear()
        mla_context_attention(q, k, vt, cu_q, cu_k, 100, 200, 0.07, config=config, v_layout="hdt", cu_seqlens_v=cv)
        assert len(calls) == 1, config
    torch.cuda.synchronize()


def test_exp2_polynomial_ptx_within_its_bound():
    """``EXP2_POLY``'s PTX, step by step in float32 from its own constants: within 7.5e-5
    of 2^x over [-125, 8] (fp8 P is scaled by 2^8), and a positive float below 2^-124 for
    -inf and anything under -125 (a masked key adds nothing: its weight is below 2^-132 of
    the row's largest)."""
    import re

    import numpy as np

    ptx = ga._EXP2_POLY_PTX
    hexes = re.findall(r"0f([0-9A-F]{8})", ptx)
    lo, magic, _, c3, c2, c1, c0 = (np.array([int(h, 16)], dtype=np.uint32).view(np.float32)[0] for h in hexes)
    assert (lo, magic) == (np.float32(-126), np.float32(1.5 * 2**23))

    def emulate(x):
        x = np.maximum(x.astype(np.float32), lo)
        t = x + magic
        f = x - (t - magic)
        p = ((f * c3 + c2) * f + c1) * f + c0  # (fma vs mul+add: below this test's bound)
        return ((p.view(np.int32) + (t.view(np.int32) << 23)).astype(np.int32)).view(np.float32)

    x = np.linspace(-125, 8, 2_000_001, dtype=np.float32)
    got = emulate(x)
    assert np.all(got > 0) and np.max(np.abs(got / np.exp2(x.astype(np.float64)) - 1)) < 7.5e-5
    tiny = emulate(np.array([-np.inf, -1e30, -127.9, -126.4, -125.6, -125.1], dtype=np.float32))
    assert np.all(tiny > 0) and np.all(tiny < 2.0**-124)
    asm = ga._exp2_mixed_asm(2)
    assert asm.count("ex2.approx.ftz.f32") == 6 and asm.count("fma.rn.f32") == 6 and "$15" in asm
