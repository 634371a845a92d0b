"""ctxprefill_client.merge_partials against a float64 formula, and against the ground
truth (attention over a union of keys = merge of the attentions over each part)."""

from __future__ import annotations

import numpy as np
import pytest

from ctxprefill_client import merge_partials

NEG_INF = -np.inf


def _merge_f64(out_a, lse_a, out_b, lse_b):
    """The reference: float64, empty partials (lse -inf, or +inf read as -inf) ignored."""
    out_a, out_b = np.asarray(out_a, np.float64), np.asarray(out_b, np.float64)
    lse_a = np.where(np.asarray(lse_a, np.float64) == np.inf, -np.inf, np.asarray(lse_a, np.float64))
    lse_b = np.where(np.asarray(lse_b, np.float64) == np.inf, -np.inf, np.asarray(lse_b, np.float64))
    t, h, v = out_a.shape
    out = np.zeros((t, h, v))
    lse = np.full((h, t), -np.inf)
    for hi in range(h):
        for ti in range(t):
            a, b = lse_a[hi, ti], lse_b[hi, ti]
            if a == -np.inf and b == -np.inf:
                continue
            m = max(a, b)
            wa = 0.0 if a == -np.inf else np.exp(a - m)
            wb = 0.0 if b == -np.inf else np.exp(b - m)
            oa = out_a[ti, hi] * wa if wa else 0.0
            ob = out_b[ti, hi] * wb if wb else 0.0
            out[ti, hi] = (oa + ob) / (wa + wb)
            lse[hi, ti] = m + np.log(wa + wb)
    return out, lse


def _attn_f64(q, k, v, scale):
    """q [T,H,D], k [S,H,D], v [S,H,Dv] -> out [T,H,Dv], lse [H,T]; no keys: 0 / -inf."""
    if k.shape[0] == 0:
        return np.zeros((q.shape[0], q.shape[1], v.shape[2])), np.full((q.shape[1], q.shape[0]), -np.inf)
    z = np.einsum("thd,shd->hts", q, k) * scale
    m = z.max(-1, keepdims=True)
    p = np.exp(z - m)
    s = p.sum(-1, keepdims=True)
    return np.einsum("hts,shv->thv", p / s, v), (m + np.log(s))[..., 0]


def _rand_partials(rng, t, h, v):
    out_a = rng.standard_normal((t, h, v)).astype(np.float32)
    out_b = rng.standard_normal((t, h, v)).astype(np.float32)
    lse_a = (rng.standard_normal((h, t)) * 4).astype(np.float32)
    lse_b = (rng.standard_normal((h, t)) * 4).astype(np.float32)
    return out_a, lse_a, out_b, lse_b


def _check(out_a, lse_a, out_b, lse_b, *, rtol=2e-6, atol=2e-6):
    out, lse = merge_partials(out_a, lse_a, out_b, lse_b)
    ref_out, ref_lse = _merge_f64(out_a, lse_a, out_b, lse_b)
    assert out.dtype == np.float32 and lse.dtype == np.float32
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    np.testing.assert_allclose(out, ref_out, rtol=rtol, atol=atol)
    assert np.array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[fin], ref_lse[fin], rtol=rtol, atol=atol)
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    return out, lse


@pytest.mark.parametrize("t,h,v", [(1, 1, 1), (7, 3, 5), (33, 16, 128)])
def test_random_against_float64(t, h, v):
    _check(*_rand_partials(np.random.default_rng(t * 100 + h), t, h, v))


def test_empty_rows_both_one_and_plus_inf():
    rng = np.random.default_rng(1)
    out_a, lse_a, out_b, lse_b = _rand_partials(rng, 6, 2, 4)
    # row 0 head 0: both empty -> out 0, lse -inf, even with garbage (NaN) in the partials
    lse_a[0, 0] = lse_b[0, 0] = NEG_INF
    out_a[0, 0] = np.nan
    out_b[0, 0] = 123.0
    # row 1: a empty -> exactly b
    lse_a[:, 1] = NEG_INF
    out_a[1] = np.nan
    # row 2: b empty -> exactly a
    lse_b[:, 2] = NEG_INF
    # row 3: a is +inf (an empty-row marker some backends use) -> exactly b
    lse_a[:, 3] = np.inf
    # row 4: both +inf -> 0 / -inf
    lse_a[:, 4] = lse_b[:, 4] = np.inf
    # row 5: +inf on one side, -inf on the other -> 0 / -inf
    lse_a[:, 5], lse_b[:, 5] = np.inf, NEG_INF
    out, lse = _check(out_a, lse_a, out_b, lse_b)
    assert np.all(out[0, 0] == 0) and lse[0, 0] == NEG_INF
    np.testing.assert_array_equal(out[1], out_b[1])
    np.testing.assert_array_equal(lse[:, 1], lse_b[:, 1])
    np.testing.assert_array_equal(out[2], out_a[2])
    np.testing.assert_array_equal(lse[:, 2], lse_a[:, 2])
    np.testing.assert_array_equal(out[3], out_b[3])
    np.testing.assert_array_equal(lse[:, 3], lse_b[:, 3])
    assert np.all(out[4:] == 0) and np.all(lse[:, 4:] == NEG_INF)
    assert not np.any(lse == np.inf)


def test_equal_lse_and_extreme_differences():
    out_a = np.full((3, 1, 2), 2.0, np.float32)
    out_b = np.full((3, 1, 2), 4.0, np.float32)
    lse_a = np.array([[5.0, 0.0, -1e30]], np.float32)
    lse_b = np.array([[5.0, 200.0, 1e30]], np.float32)
    out, lse = _check(out_a, lse_a, out_b, lse_b)
    np.testing.assert_allclose(out[0], 3.0)
    np.testing.assert_allclose(lse[0, 0], 5.0 + np.log(2.0), rtol=1e-6)
    np.testing.assert_array_equal(out[1:], 4.0)  # a's weight underflows to 0
    assert lse[0, 1] == np.float32(200.0) and lse[0, 2] == np.float32(1e30)


def test_strided_inputs():
    rng = np.random.default_rng(7)
    t, h, v = 9, 4, 16
    # out as [H, T, V] transposed, and every other V column; lse as [T, H] transposed
    out_a = rng.standard_normal((h, t, 2 * v)).astype(np.float32).transpose(1, 0, 2)[:, :, ::2]
    out_b = rng.standard_normal((t, 2, h, v)).astype(np.float32)[:, 1]
    lse_a = (rng.standard_normal((t, h)) * 3).astype(np.float32).T
    lse_b = (rng.standard_normal((h, 2 * t)) * 3).astype(np.float32)[:, ::2]
    lse_b[1, 3] = NEG_INF
    assert not out_a.flags.c_contiguous and not lse_a.flags.c_contiguous and not lse_b.flags.c_contiguous
    out, lse = _check(out_a, lse_a, out_b, lse_b)
    out_c, lse_c = merge_partials(
        np.ascontiguousarray(out_a), np.ascontiguousarray(lse_a),
        np.ascontiguousarray(out_b), np.ascontiguousarray(lse_b),
    )
    np.testing.assert_array_equal(out, out_c)
    np.testing.assert_array_equal(lse, lse_c)


def test_inputs_not_modified_and_float64_inputs_accepted():
    rng = np.random.default_rng(3)
    parts = _rand_partials(rng, 4, 2, 3)
    parts[1][0, 0] = np.inf
    copies = [p.copy() for p in parts]
    merge_partials(*parts)
    for p, c in zip(parts, copies):
        np.testing.assert_array_equal(p, c)
    out, lse = merge_partials(*(p.astype(np.float64) for p in parts))
    assert out.dtype == np.float32 and lse.dtype == np.float32


def test_shape_errors():
    z = np.zeros((4, 2, 3), np.float32)
    with pytest.raises(ValueError, match="lse_a"):
        merge_partials(z, np.zeros((4, 2), np.float32), z, np.zeros((2, 4), np.float32))  # [T,H] not [H,T]
    with pytest.raises(ValueError, match="out_b"):
        merge_partials(z, np.zeros((2, 4), np.float32), z[:, :, :2], np.zeros((2, 4), np.float32))
    with pytest.raises(ValueError, match="out_a"):
        merge_partials(z[0], np.zeros((2, 4)), z, np.zeros((2, 4)))


@pytest.mark.parametrize("split", [0, 1, 17, 40])
def test_merge_of_partials_equals_attention_over_union(split):
    """The ground truth the API relies on: attention over keys [0, S) equals the LSE merge
    of the attentions over [0, split) and [split, S) — natural-log LSE, [H, T] layout."""
    rng = np.random.default_rng(split)
    t, h, s, d, dv = 5, 3, 40, 24, 8
    scale = d**-0.5
    q = rng.standard_normal((t, h, d))
    k = rng.standard_normal((s, h, d))
    v = rng.standard_normal((s, h, dv))
    full_out, full_lse = _attn_f64(q, k, v, scale)
    oa, la = _attn_f64(q, k[:split], v[:split], scale)
    ob, lb = _attn_f64(q, k[split:], v[split:], scale)
    out, lse = merge_partials(
        oa.astype(np.float32), la.astype(np.float32), ob.astype(np.float32), lb.astype(np.float32)
    )
    np.testing.assert_allclose(out, full_out, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse, full_lse, rtol=1e-6, atol=1e-6)
    # a base-2 LSE fed to this natural-log merge would be wrong: guard the convention
    if 0 < split < s:
        bad, _ = merge_partials(
            oa.astype(np.float32), (la / np.log(2)).astype(np.float32),
            ob.astype(np.float32), (lb / np.log(2)).astype(np.float32),
        )
        assert np.abs(bad - full_out).max() > 1e-3
