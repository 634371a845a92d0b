"""Model layers on the GPU (docs/DESIGN.md "Model layers"): each layer of a two-layer
engine computes, through the compiled kernels and the default backend, exactly what a
one-layer engine of that layer computes, fused and generic alike; writes to one layer
leave the other's cache as it was."""

from __future__ import annotations

import dataclasses
import os
import sys

import pytest
import torch

from ctxprefill.app import build_engine
from ctxprefill.engine.engine import SequenceSpec
from ctxprefill.settings import ServeSettings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: context_layout
from context_layout import tables_and_slots  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="no CUDA device: the GPU layer tests run on the GPU machine")]

# one named backend: "auto" times its candidates when each engine is built, and two engines
# may pick different ones (different summation orders, different bits; it failed so once).
# gluon: the warp-specialized kernel, auto's pick on the H200
BASE = ServeSettings(device="cuda", heads=16, block_size=64, num_blocks=64, workspace_tokens=1024, seed=6,
                     backend="gluon")
CONTEXTS, QUERIES = [1500, 0, 300], [64, 8, 40]


def _workload(seed: int):
    g = torch.Generator().manual_seed(seed)
    tables, slots = tables_and_slots(CONTEXTS, 64)
    slots = torch.from_numpy(slots)
    return tables, slots, torch.randn((len(slots), 512), generator=g), torch.randn((len(slots), 64), generator=g)


@pytest.mark.parametrize("cache_dtype,prefill_dtype", [("auto", "bf16"), ("fp8_ds_mla", "fp8")])
def test_each_layer_equals_a_one_layer_engine(cuda_ext, cache_dtype, prefill_dtype):
    s = dataclasses.replace(BASE, cache_dtype=cache_dtype, prefill_dtype=prefill_dtype)
    two = build_engine(dataclasses.replace(s, layers=2, first_layer=7))
    tables, slots, _, _ = _workload(0)
    seqs = [SequenceSpec(q, c, t) for q, c, t in zip(QUERIES, CONTEXTS, tables)]
    g = torch.Generator().manual_seed(1)
    q = torch.randn((sum(QUERIES), 16, 192), generator=g)
    q = (q.clamp(-448, 448).to(torch.float8_e4m3fn) if prefill_dtype == "fp8" else q.to(torch.bfloat16)).cuda()
    for layer in (7, 8):
        two.write_cache(slots, *_workload(layer)[2:], layer=layer)
    before8 = two.read_cache(slots, layer=8)
    two.write_cache(slots, *_workload(99)[2:], layer=7)  # rewrite layer 7: layer 8 keeps its bytes
    assert torch.equal(two.read_cache(slots, layer=8), before8)
    two.write_cache(slots, *_workload(7)[2:], layer=7)
    for layer in (7, 8):
        one = build_engine(dataclasses.replace(s, first_layer=layer))
        one.write_cache(slots, *_workload(layer)[2:])
        assert torch.equal(one.read_cache(slots), two.read_cache(slots, layer=layer))
        for fused in (True, False):
            a = two.prefill_context(q, seqs, fused=fused, layer=layer)
            b = one.prefill_context(q, seqs, fused=fused)
            assert torch.equal(a.out.view(torch.uint16), b.out.view(torch.uint16))
            assert torch.equal(a.lse.view(torch.int32), b.lse.view(torch.int32))
        del one
        torch.cuda.empty_cache()
