"""The torch reference attention backend: exact-as-possible, any device, any dtype.

Per sequence, in float32: scores, natural-log LSE, softmax, P·V. fp8 inputs are
widened exactly (unscaled e4m3). ``honor_out`` selects the two sides of the ``out``
contract so that the engine's two accumulation modes are both exercised.
"""

from __future__ import annotations

import torch

from .base import AttentionBackend


def attention_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, scale: float, causal: bool = False):
    """(out [Tq, H, Dv] float32, lse [H, Tq] float32) of ragged attention."""
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


class ReferenceBackend(AttentionBackend):
    name = "reference"

    def __init__(self, honor_out: bool = True, k_rope_apart: bool = False):
        self.honor_out = honor_out
        self.k_rope_apart = k_rope_apart  # take K's rope part apart (the engine's unpacked keys)

    def supports_out(self) -> bool:
        return self.honor_out

    def takes_k_rope(self, q_dtype: torch.dtype) -> bool:
        return self.k_rope_apart

    def run_context_chunk(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, scale, out=None, causal=False,
                          k_rope=None):
        if k_rope is not None:
            if not self.k_rope_apart:
                raise ValueError("k_rope given to a reference backend built without k_rope_apart")
            k = torch.cat([k, k_rope], dim=-1)  # the reference computes over the packed keys
        o, lse = attention_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal)
        if out is not None and self.honor_out:
            out.copy_(o.to(out.dtype))
            return out, lse
        return o.to(torch.bfloat16), lse

    def launches_per_call(self) -> int:
        # Not a kernel: a torch loop whose launch count depends on the batch. Reported
        # as one call so that the metric stays meaningful; the GPU launch test uses a
        # single-kernel backend.
        return 1
