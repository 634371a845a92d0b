"""Merging two attention partials by their log-sum-exp (the caller's side of CONTRACT §3/§7).

A partial is the attention of the same query rows over a disjoint set of keys:
``out [T, H, V]`` and ``lse [H, T]`` (heads first, **natural** log). Two partials
merge into the attention over the union of their keys:

    m   = max(lse_a, lse_b)
    w_a = exp(lse_a - m),  w_b = exp(lse_b - m)
    out = out_a * (w_a / s) + out_b * (w_b / s),   s = w_a + w_b
    lse = m + log(w_a + w_b)

An empty partial has ``lse = -inf`` and contributes nothing (its ``out`` is ignored,
whatever it holds); a row empty on both sides gets ``out = 0`` and ``lse = -inf``. An
LSE of ``+inf`` is read as ``-inf`` (some backends mark empty rows that way). Inputs
may be strided views; everything is computed in float32.
"""

from __future__ import annotations

import numpy as np

__all__ = ["merge_partials"]


def _prep(out: np.ndarray, lse: np.ndarray, which: str) -> tuple[np.ndarray, np.ndarray]:
    out = np.asarray(out, dtype=np.float32)
    lse = np.asarray(lse, dtype=np.float32)
    if out.ndim != 3:
        raise ValueError(f"out_{which}: expected [T, H, V], got shape {list(out.shape)}")
    t, h, _ = out.shape
    if lse.shape != (h, t):
        raise ValueError(f"lse_{which}: expected [H, T] = {[h, t]}, got shape {list(lse.shape)}")
    # +inf marks an empty partial in some backends: treat it as -inf.
    lse = np.where(lse == np.inf, np.float32(-np.inf), lse)
    return out, lse


def merge_partials(
    out_a: np.ndarray, lse_a: np.ndarray, out_b: np.ndarray, lse_b: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Merge two (out ``[T, H, V]``, lse ``[H, T]``) partials; returns new float32 arrays.

    See the module docstring for the formula and the empty-row rules. Raises ValueError
    when the shapes disagree.
    """
    out_a, lse_a = _prep(out_a, lse_a, "a")
    out_b, lse_b = _prep(out_b, lse_b, "b")
    if out_a.shape != out_b.shape:
        raise ValueError(f"out_a {list(out_a.shape)} and out_b {list(out_b.shape)} differ in shape")

    empty_a = lse_a == -np.inf
    empty_b = lse_b == -np.inf
    both_empty = empty_a & empty_b
    m = np.maximum(lse_a, lse_b)
    m = np.where(both_empty, np.float32(0.0), m)  # avoid (-inf) - (-inf)
    w_a = np.where(empty_a, np.float32(0.0), np.exp(lse_a - m))
    w_b = np.where(empty_b, np.float32(0.0), np.exp(lse_b - m))
    w_sum = w_a + w_b

    # [H, T] weights -> [T, H, 1]; normalised first, as the server's merge kernel does
    # (out_a * (w_a / s) + out_b * (w_b / s)), so that both round the same way
    denom = np.where(both_empty, np.float32(1.0), w_sum)
    wa = (w_a / denom).T[:, :, None]
    wb = (w_b / denom).T[:, :, None]
    contrib_a = np.where(empty_a.T[:, :, None], np.float32(0.0), out_a * wa)
    contrib_b = np.where(empty_b.T[:, :, None], np.float32(0.0), out_b * wb)
    out = contrib_a + contrib_b
    out = np.where(both_empty.T[:, :, None], np.float32(0.0), out).astype(np.float32, copy=False)

    with np.errstate(divide="ignore"):
        lse = np.where(both_empty, np.float32(-np.inf), m + np.log(np.where(both_empty, 1, w_sum)))
    return out, lse.astype(np.float32, copy=False)
