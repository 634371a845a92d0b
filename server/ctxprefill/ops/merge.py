"""Merge two attention partials by their LSE, in place (CONTRACT §3, §5).

``out`` [T, H, V] and ``lse`` [H, T] (any strides, unit last stride for ``out``) are
updated with the partial ``(part_out, part_lse)``:

    m   = max(lse, part_lse)
    w_a = exp(lse - m),  w_b = exp(part_lse - m)
    out = (out * w_a + part_out * w_b) / (w_a + w_b),   lse = m + log(w_a + w_b)

in float32, ``out`` rounded back to its dtype. Rows where both LSEs are -inf give
out = 0 and lse = -inf. An LSE of +inf is read as -inf: some backends mark rows
without keys that way, and it must never win a merge.
"""

from __future__ import annotations

import torch

from . import _cuda, launches


def merge_reference(out, lse, part_out, part_lse) -> None:
    ninf = torch.tensor(float("-inf"), device=lse.device)
    a = torch.where(lse == float("inf"), ninf, lse.float())
    b = torch.where(part_lse == float("inf"), ninf, part_lse.float())
    m = torch.maximum(a, b)
    empty = m == float("-inf")
    m_safe = torch.where(empty, torch.zeros_like(m), m)
    wa = torch.exp(a - m_safe)
    wb = torch.exp(b - m_safe)
    s = wa + wb
    s_safe = torch.where(empty, torch.ones_like(s), s)
    # weights are [H, T]; outputs [T, H, V]
    wa_t = (wa / s_safe).t()[..., None]
    wb_t = (wb / s_safe).t()[..., None]
    merged = out.float() * wa_t + part_out.float() * wb_t
    merged = torch.where(empty.t()[..., None], torch.zeros_like(merged), merged)
    out.copy_(merged.to(out.dtype))
    lse.copy_(torch.where(empty, ninf, m_safe + torch.log(s_safe)))


def merge(out, lse, part_out, part_lse) -> None:
    if out.shape[0] == 0:
        return
    launches.note(1)
    if _cuda.use_cuda(out):
        _cuda.load().merge(out, lse, part_out, part_lse)
    else:
        merge_reference(out, lse, part_out, part_lse)
