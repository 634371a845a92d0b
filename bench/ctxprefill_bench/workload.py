"""Random requests for the demo, the tests and the benchmarks.

Writes each sequence's context into randomly chosen (shuffled) cache blocks, so that
block tables are not the identity, and makes a matching q.
"""

from __future__ import annotations

import math

import torch

from ctxprefill.engine.engine import SequenceSpec
from ctxprefill.ops.fp8 import saturating_cast_fp8
from ctxprefill_client import slot_mapping


def make_request(engine, context_lens, query_lens, seed: int = 0, write: bool = True):
    """(q, sequences) with the contexts written into ``engine``'s cache."""
    cfg = engine.config
    bs, L, R = cfg.cache.block_size, cfg.shape.kv_lora_rank, cfg.shape.qk_rope_head_dim
    g = torch.Generator().manual_seed(seed)
    need = [math.ceil(n / bs) for n in context_lens]
    if sum(need) > cfg.cache.num_blocks:
        raise ValueError(f"request needs {sum(need)} blocks, the cache has {cfg.cache.num_blocks}")
    perm = torch.randperm(cfg.cache.num_blocks, generator=g)[: sum(need)].tolist()
    seqs, at = [], 0
    for n, nb, qn in zip(context_lens, need, query_lens):
        blocks = perm[at : at + nb]
        at += nb
        if write and n:
            slots = torch.from_numpy(slot_mapping(blocks, 0, n, bs))
            engine.write_cache(slots, torch.randn((n, L), generator=g), torch.randn((n, R), generator=g))
        seqs.append(SequenceSpec(qn, n, blocks))
    q = torch.randn((sum(query_lens), cfg.shape.heads, cfg.shape.qk_head_dim), generator=g)
    q = saturating_cast_fp8(q) if cfg.prefill_dtype == "fp8" else q.to(torch.bfloat16)
    return q, seqs


#: the engine's bound against float64 attention, per prefill dtype (output relative error, LSE difference)
FLOAT64_TOLERANCE = {"bf16": 1e-2, "fp8": 6e-2}


def relative_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    """‖x − ref‖ / ‖ref‖ over finite entries of ref."""
    x, ref = x.double().cpu(), ref.double().cpu()
    m = torch.isfinite(ref)
    den = ref[m].norm().item()
    return (x[m] - ref[m]).norm().item() / (den if den else 1.0)
