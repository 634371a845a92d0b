"""The torch reference ops on their own: pack, the fp8 cast, merge, attention."""

import pytest
import torch

from ctxprefill.backends.reference import ReferenceBackend, attention_reference
from ctxprefill.ops.fp8 import saturating_cast_fp8
from ctxprefill.ops.merge import merge_reference
from ctxprefill.ops.pack import (
    fused_mla_kv_concat,
    fused_mla_kv_concat_quant_fp8,
    generic_kv_concat,
    generic_kv_concat_quant_fp8,
)
from engine_helpers import bits

FP8 = torch.float8_e4m3fn


def all_patterns(dtype):
    return torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_saturating_cast_on_every_bit_pattern(dtype):
    x = all_patterns(dtype)
    got = saturating_cast_fp8(x).float()
    f = x.float()
    nan = torch.isnan(f)
    assert bool(torch.isnan(got[nan]).all())
    # saturation: overflow and ±inf go to ±448, never NaN
    big = ~nan & (f.abs() >= 464)
    assert bool((got[big].abs() == 448).all())
    # everything else is round-to-nearest-even of the value: compare against float64 rounding
    every_fp8 = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8).float().tolist()
    grid = torch.tensor(sorted({float(v) for v in every_fp8 if v == v}), dtype=torch.float64)
    ok = ~nan & ~big
    fv = f[ok].double().clamp(-448, 448)
    idx = torch.searchsorted(grid, fv).clamp(1, grid.numel() - 1)
    lo, hi = grid[idx - 1], grid[idx]
    nearest = torch.where((fv - lo) < (hi - fv), lo, hi)
    tie = (fv - lo) == (hi - fv)
    assert bool((got[ok].double()[~tie] == nearest[~tie]).all())


def kv_view(T, H, dtype, g):
    """Strided k_nope, v halves of a real kv_b_proj output and a strided k_pe view."""
    kv = (torch.randn((T, H * 256), generator=g) * 200).to(dtype).view(T, H, 256)
    ws = (torch.randn((T, 576), generator=g) * 200).to(dtype)
    return kv[..., :128], ws[:, 512:], kv[..., 128:]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T,H", [(0, 2), (1, 1), (3, 3), (37, 4), (5, 16), (2, 128)])
def test_fused_pack_reference_equals_generic(T, H, dtype):
    g = torch.Generator().manual_seed(T * 131 + H)
    k_nope, k_pe, v = kv_view(T, H, dtype, g)
    assert k_nope.stride(0) == H * 256 and k_pe.stride(0) == 576  # strided views
    k = fused_mla_kv_concat(k_nope, k_pe)
    assert k.shape == (T, H, 192) and k.is_contiguous()
    assert torch.equal(bits(k), bits(generic_kv_concat(k_nope, k_pe)))
    for pe in (k_pe, saturating_cast_fp8(k_pe), k_pe[:, None, :]):
        k8, v8 = fused_mla_kv_concat_quant_fp8(k_nope, pe, v)
        gk8, gv8 = generic_kv_concat_quant_fp8(k_nope, pe, v)
        assert k8.dtype == v8.dtype == FP8 and k8.is_contiguous() and v8.is_contiguous()
        assert torch.equal(bits(k8), bits(gk8)) and torch.equal(bits(v8), bits(gv8))


@pytest.mark.parametrize("T,cu", [(0, [0, 0]), (1, [0, 1]), (37, [0, 5, 5, 37]), (300, [0, 17, 300])])
def test_keys_last_pack_leaves_rows_past_k(T, cu):
    """fp8 with V keys-last: the reference and the generic ops give the same K and V, K with
    KEY_SLACK_ROWS rows of its storage past its end (attention that reads K in whole 16-key
    groups reads them), the same count as the fused kernel's binding and P_REGS's."""
    import re
    from pathlib import Path

    from ctxprefill.backends import gluon_attention as ga
    from ctxprefill.ops.pack import KEY_SLACK_ROWS, keys_last_layout, rows_readable

    g = torch.Generator().manual_seed(T)
    k_nope, k_pe, v = kv_view(T, 3, torch.bfloat16, g)
    layout = keys_last_layout(cu, "cpu")
    for pe in (k_pe, saturating_cast_fp8(k_pe)):
        k8, vt = fused_mla_kv_concat_quant_fp8(k_nope, pe, v, v_keys_last=layout)
        gk8, gvt = generic_kv_concat_quant_fp8(k_nope, pe, v, v_keys_last=layout)
        assert k8.shape == gk8.shape == (T, 3, 192) and k8.is_contiguous() and gk8.is_contiguous()
        assert torch.equal(bits(k8), bits(gk8)) and torch.equal(bits(vt), bits(gvt))
        for k in (k8, gk8):
            assert rows_readable(k) == T + KEY_SLACK_ROWS and rows_readable(k[..., 128:]) == T + KEY_SLACK_ROWS
        k8_rows, _ = fused_mla_kv_concat_quant_fp8(k_nope, pe, v)  # row-major V: no rows past K needed
        assert torch.equal(bits(k8_rows), bits(k8))
    launchers = (Path(__file__).resolve().parents[1] / "csrc" / "launchers.h").read_text()
    assert int(re.search(r"kKeySlackRows = (\d+);", launchers)[1]) == KEY_SLACK_ROWS == ga.P_REGS_SLACK_ROWS


def test_fused_pack_on_every_bit_pattern_equals_generic():
    x = all_patterns(torch.bfloat16)  # 65,536 values = 512 tokens x 128
    k_nope = x.view(512, 1, 128)
    k_pe = x.view(1024, 64)[:512]
    k8, v8 = fused_mla_kv_concat_quant_fp8(k_nope, k_pe, k_nope)
    gk8, gv8 = generic_kv_concat_quant_fp8(k_nope, k_pe, k_nope)
    nan = torch.isnan(gk8.float())
    assert torch.equal(torch.isnan(k8.float()), nan)
    assert torch.equal(bits(k8)[~nan.view(-1).reshape(bits(k8).shape)],
                       bits(gk8)[~nan.view(-1).reshape(bits(gk8).shape)])


def test_pack_rejects_bad_inputs():
    k_nope = torch.zeros(2, 1, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="dtype"):
        fused_mla_kv_concat(k_nope, torch.zeros(2, 64, dtype=torch.float16))
    with pytest.raises(ValueError, match="unit last stride"):
        fused_mla_kv_concat(k_nope, torch.zeros(2, 128, dtype=torch.bfloat16)[:, ::2])


def ref_merge64(o1, l1, o2, l2):
    l1 = torch.where(l1 == float("inf"), float("-inf"), l1.double())
    l2 = torch.where(l2 == float("inf"), float("-inf"), l2.double())
    lse = torch.logaddexp(l1, l2)
    w1 = torch.nan_to_num(torch.exp(l1 - lse)).t()[..., None]
    w2 = torch.nan_to_num(torch.exp(l2 - lse)).t()[..., None]
    return o1.double() * w1 + o2.double() * w2, lse


def test_merge_rules_and_strides():
    g = torch.Generator().manual_seed(0)
    T, H = 6, 3
    out = torch.randn((T, H, 128), generator=g).to(torch.bfloat16)
    part = torch.randn((T, H, 128), generator=g).to(torch.bfloat16)
    lse_store = torch.randn((T, H), generator=g)  # [H, T] as a transposed view: strided
    lse = lse_store.t()
    plse = torch.randn((H, T), generator=g) * 3
    inf = float("inf")
    lse[:, 0], plse[:, 0] = -inf, -inf  # both empty -> 0 / -inf
    lse[:, 1] = -inf  # only the partial
    plse[:, 2] = -inf  # only the accumulator
    plse[:, 3] = inf  # +inf reads as -inf: an empty partial never wins
    want_o, want_l = ref_merge64(out, lse.clone(), part, plse)
    o0 = out.clone()
    merge_reference(out, lse, part, plse)
    assert bool((out[0] == 0).all()) and bool((lse[:, 0] == -inf).all())
    assert torch.equal(out[1], part[1]) and torch.equal(out[2], o0[2]) and torch.equal(out[3], o0[3])
    fin = torch.isfinite(want_l)
    assert (lse.double()[fin] - want_l[fin]).abs().max() < 1e-5
    assert (out.double() - torch.nan_to_num(want_o)).abs().max() < 2e-2


@pytest.mark.parametrize("causal", [False, True])
def test_reference_attention_against_float64(causal):
    g = torch.Generator().manual_seed(1)
    cu_q, cu_k = torch.tensor([0, 3, 3, 7, 8]), torch.tensor([0, 5, 9, 9, 12])
    q = torch.randn((8, 2, 192), generator=g).to(torch.bfloat16)
    k = torch.randn((12, 2, 192), generator=g).to(torch.bfloat16)
    v = torch.randn((12, 2, 128), generator=g).to(torch.bfloat16)
    out, lse = attention_reference(q, k, v, cu_q, cu_k, 0.1, causal)
    for b in range(4):
        q0, q1, k0, k1 = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        if q1 == q0:
            continue
        if k1 == k0:  # segment 2: no keys
            assert bool((out[q0:q1] == 0).all()) and bool((lse[:, q0:q1] == float("-inf")).all())
            continue
        s = torch.einsum("thd,jhd->htj", q[q0:q1].double(), k[k0:k1].double()) * 0.1
        if causal:
            nq, nk = q1 - q0, k1 - k0
            s = s.masked_fill(torch.arange(nk)[None, :] > torch.arange(nq)[:, None] + (nk - nq), float("-inf"))
        ref_l = torch.logsumexp(s, -1)
        ref_o = torch.einsum("htj,jhd->thd", torch.softmax(s, -1), v[k0:k1].double())
        assert (lse[:, q0:q1].double() - ref_l).abs().max() < 1e-4
        assert (out[q0:q1].double() - ref_o).abs().max() < 1e-4


def test_reference_backend_out_modes():
    q = torch.randn(4, 2, 192).to(torch.bfloat16)
    k = torch.randn(5, 2, 192).to(torch.bfloat16)
    v = torch.randn(5, 2, 128).to(torch.bfloat16)
    cu_q, cu_k = torch.tensor([0, 4], dtype=torch.int32), torch.tensor([0, 5], dtype=torch.int32)
    big = torch.zeros(10, 2, 128, dtype=torch.bfloat16)
    o, _ = ReferenceBackend(honor_out=True).run_context_chunk(q, k, v, cu_q, cu_k, 4, 5, 0.1, out=big[3:7])
    assert o.data_ptr() == big[3:7].data_ptr() and bool((big[:3] == 0).all()) and bool((big[7:] == 0).all())
    o2, _ = ReferenceBackend(honor_out=False).run_context_chunk(q, k, v, cu_q, cu_k, 4, 5, 0.1, out=big[3:7])
    assert o2.data_ptr() != big.data_ptr() and torch.equal(o2, big[3:7])
