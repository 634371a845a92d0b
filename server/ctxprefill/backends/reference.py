"""The torch reference attention backend: exact-as-possible, any device, any dtype.

Per sequence, in float32: scores, natural-log LSE, softmax, P·V. fp8 inputs are
widened exactly (unscaled e4m3). ``honor_out`` selects the two sides of the ``out``
contract so that the engine's two accumulation modes are both exercised;
``unpacked_keys`` makes it read the keys unpacked (``k_rope``), as the engine's fused
path hands them to a kernel backend that does.
"""

from __future__ import annotations

import dataclasses

import torch

from .base import FP8, AttentionBackend, BackendCaps, LaunchOrder, VLayout


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                        cu_seqlens_k: torch.Tensor, scale: float,
                        causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [Tq, H, Dv] float32, lse [H, Tq] float32) of ragged attention; q [Tq, H, D],
    k [Tk, H, D], v [Tk, H, Dv]."""
    Tq, H, _ = q.shape
    out = torch.zeros((Tq, H, v.shape[-1]), dtype=torch.float32, device=q.device)
    lse = torch.full((H, Tq), float("-inf"), dtype=torch.float32, device=q.device)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cq) - 1):
        q0, q1, k0, k1 = cq[b], cq[b + 1], ck[b], ck[b + 1]
        if q1 == q0 or k1 == k0:
            continue
        qs = q[q0:q1].float().transpose(0, 1)  # [H, q, D]
        ks = k[k0:k1].float().transpose(0, 1)
        vs = v[k0:k1].float().transpose(0, 1)
        s = (qs @ ks.transpose(1, 2)) * scale  # [H, q, k]
        if causal:
            nq, nk = q1 - q0, k1 - k0
            t = torch.arange(nq, device=q.device)[:, None]
            j = torch.arange(nk, device=q.device)[None, :]
            s = s.masked_fill(j > t + (nk - nq), float("-inf"))
        l_b = torch.logsumexp(s, dim=-1)  # [H, q]
        finite = torch.isfinite(l_b)
        p = torch.where(finite[..., None], torch.exp(s - torch.where(finite, l_b, 0.0)[..., None]), 0.0)
        out[q0:q1] = (p @ vs).transpose(0, 1)
        lse[:, q0:q1] = l_b
    return out, lse


_DTYPES = frozenset({torch.bfloat16, FP8, torch.float16, torch.float32, torch.float64})


class ReferenceBackend(AttentionBackend):
    name = "reference"
    # Not a kernel: a torch loop whose launch count depends on the batch. Counted as one
    # call so that the metric stays meaningful; the GPU launch test uses a one-kernel backend.
    caps = BackendCaps(q_dtypes=_DTYPES, supports_out=True, launches_per_call=1)

    def __init__(self, honor_out: bool = True, unpacked_keys: bool = False):
        self.caps = dataclasses.replace(type(self).caps, supports_out=honor_out,
                                        unpacked_keys=_DTYPES if unpacked_keys else frozenset())

    def run_context_chunk(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        max_q: int,
        max_k: int,
        scale: float,
        *,
        out: torch.Tensor | None = None,
        causal: bool = False,
        k_rope: torch.Tensor | None = None,
        v_layout: VLayout = "thd",
        cu_seqlens_v: torch.Tensor | None = None,
        launch_order: LaunchOrder | None = None,
        captured: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.refuse_outside_caps(q.dtype, k_rope, v_layout, cu_seqlens_v, launch_order, captured)
        if k_rope is not None:
            k = torch.cat([k, k_rope], dim=-1)  # the reference computes over the packed keys
        o, lse = attention_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal)
        if out is not None and self.caps.supports_out:
            out.copy_(o.to(out.dtype))
            return out, lse
        return o.to(torch.bfloat16), lse
