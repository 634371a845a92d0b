"""The chunked result against one unchunked float64 computation (CONTRACT §3, §10)."""

import pytest
import torch

from ctxprefill_bench.reference64 import prefill_context_float64
from ctxprefill_bench.workload import make_request, relative_error
from engine_helpers import make_engine

TOL = {"bf16": 1e-2, "fp8": 6e-2}


def random_batch(seed):
    g = torch.Generator().manual_seed(seed)
    B = int(torch.randint(1, 7, (1,), generator=g))
    contexts = torch.randint(0, 400, (B,), generator=g).tolist()
    contexts[int(torch.randint(0, B, (1,), generator=g))] = 0 if B > 1 else contexts[0]  # an empty sequence
    queries = torch.randint(0, 9, (B,), generator=g).tolist()
    heads = int(torch.randint(1, 5, (1,), generator=g))
    block = [1, 16, 32][seed % 3]
    return contexts, queries, heads, block


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("cache_dtype,kvb,prefill", [("auto", "bf16", "bf16"), ("fp8", "bf16", "bf16"),
                                                      ("fp8_ds_mla", "fp8", "bf16"), ("fp8", "fp8", "fp8"),
                                                      ("auto", "bf16", "fp8"), ("fp8_ds_mla", "bf16", "fp8")])
def test_chunked_matches_float64_for_any_workspace(seed, cache_dtype, kvb, prefill):
    contexts, queries, heads, block = random_batch(seed)
    eng = make_engine(cache_dtype, kvb, prefill, heads=heads, block_size=block, num_blocks=(2048 // block) + 8,
                      workspace_tokens=2048)
    q, seqs = make_request(eng, contexts, queries, seed=seed)
    ref_out, ref_lse = prefill_context_float64(eng, q, seqs)
    empty = ~torch.isfinite(ref_lse)  # [H, Tq]: rows with no context
    results = []
    # workspaces of 64 rows up: each chunk's merge rounds the accumulator to bf16 (the
    # out contract), so hundreds of one-row chunks would add up rounding on purpose
    for W in (max(block, 64), 160 // block * block, 2048):
        r = eng.prefill_context(q, seqs, workspace_tokens=W)
        assert r.out.dtype == torch.bfloat16 and r.lse.dtype == torch.float32
        assert r.out.shape == (sum(queries), heads, 128) and r.lse.shape == (heads, sum(queries))
        assert not torch.isnan(r.out).any() and not torch.isnan(r.lse).any()
        assert relative_error(r.out, ref_out) <= TOL[prefill], W
        if (~empty).any():
            assert (r.lse.double()[~empty] - ref_lse[~empty]).abs().max() <= TOL[prefill], W
        assert bool((r.lse[empty] == float("-inf")).all())
        assert bool((r.out.float().permute(1, 0, 2)[empty] == 0).all())
        results.append(r)
    # the plan changes nothing beyond rounding
    for r in results[1:]:
        assert relative_error(r.out, results[0].out.float()) <= TOL[prefill]


def test_lse_is_natural_log_layout_h_t():
    """One key per row: lse = s·q·k exactly, in [H, T] layout (the base-2 and [T, H] traps)."""
    eng = make_engine(heads=3, block_size=1, num_blocks=8, workspace_tokens=8)
    q, seqs = make_request(eng, [1, 1], [2, 1])
    r = eng.prefill_context(q, seqs)
    ref_out, ref_lse = prefill_context_float64(eng, q, seqs)
    assert r.lse.shape == (3, 3)
    assert (r.lse.double() - ref_lse).abs().max() < 2e-2
    assert not torch.allclose(r.lse.double(), ref_lse / torch.log(torch.tensor(2.0)).double(), atol=1e-1)
