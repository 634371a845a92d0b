"""The answer without chunks: float64 attention from the dequantized cache (CONTRACT §10).

The yardstick for the chunked engine: every sequence's whole context is decoded from
its slots, projected with the dequantized ``kv_b_proj`` weight and attended to in
float64, in one piece.
"""

from __future__ import annotations

import torch

from ctxprefill.ops.slot_format import decode_slots
from ctxprefill.weights import dequantize


def prefill_context_float64(engine, q: torch.Tensor, sequences) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [Tq, H, V] float64, lse [H, Tq] float64) for the request, on the CPU."""
    cfg = engine.config
    shape, cache = cfg.shape, cfg.cache
    H, P, V = shape.heads, shape.qk_nope_head_dim, shape.v_head_dim
    w = engine.weights
    W = (w.weight.double() if w.dtype == "bf16" else dequantize(w.weight.cpu(), w.scale.cpu()).double()).cpu()
    storage = engine.cache.storage.cpu()
    qd = q.cpu().double()
    Tq = q.shape[0]
    out = torch.zeros((Tq, H, V), dtype=torch.float64)
    lse = torch.full((H, Tq), float("-inf"), dtype=torch.float64)
    row = 0
    for s in sequences:
        q0, q1 = row, row + s.query_len
        row = q1
        n = s.context_len
        if n == 0 or q1 == q0:
            continue
        j = torch.arange(n)
        bt = torch.as_tensor(list(s.block_table), dtype=torch.int64)
        slots = bt[j // cache.block_size] * cache.block_size + j % cache.block_size
        lat = decode_slots(storage[slots], cache.dtype, cache.k_scale, torch.float32).double()
        c, k_pe = lat[:, : shape.kv_lora_rank], lat[:, shape.kv_lora_rank :]
        kv = (c @ W.t()).view(n, H, P + V)
        k = torch.cat([kv[..., :P], k_pe[:, None, :].expand(n, H, k_pe.shape[1])], dim=-1)
        v = kv[..., P:]
        scores = torch.einsum("thd,jhd->htj", qd[q0:q1], k) * shape.scale
        l_b = torch.logsumexp(scores, dim=-1)
        out[q0:q1] = torch.einsum("htj,jhd->thd", torch.softmax(scores, dim=-1), v)
        lse[:, q0:q1] = l_b
    return out, lse
