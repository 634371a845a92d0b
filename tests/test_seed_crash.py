"""The seed's crash: a stock checkpoint (bf16 kv_b_proj) with an fp8 cache must load and
serve — the latent is cast to bf16 every chunk instead of asserting fp8 at load."""

import pytest
import torch

from ctxprefill.app import build_engine
from ctxprefill.cli import main
from ctxprefill.settings import ServeSettings
from ctxprefill_bench.reference64 import prefill_context_float64
from ctxprefill_bench.workload import make_request, relative_error


@pytest.mark.parametrize("prefill", ["bf16", "fp8"])
@pytest.mark.parametrize("honor_out", [True, False])
def test_bf16_kv_b_proj_with_fp8_cache_loads_and_runs(tmp_path, prefill, honor_out):
    path = str(tmp_path / "w.safetensors")
    prefix = "model.layers.0.self_attn."
    assert main(["make-weights", "--out", path, "--heads", "2", "--dtype", "bf16", "--prefix", prefix]) == 0
    s = ServeSettings(device="cpu", heads=2, block_size=16, num_blocks=64, cache_dtype="fp8", prefill_dtype=prefill,
                      workspace_tokens=128, weights=path, weights_prefix=prefix, backend="reference")
    eng = build_engine(s)
    eng.backend.honor_out = honor_out
    assert eng.weights.dtype == "bf16" and eng.config.cache.dtype == "fp8"
    q, seqs = make_request(eng, [200, 48, 32, 0], [8, 4, 6, 5])
    r = eng.prefill_context(q, seqs)
    if prefill == "fp8":  # raw fp8 latent, cast to bf16 for the bf16 GEMM in every chunk
        assert r.stats.launches["cast"] == len(r.stats.chunks) == 3
    ref, _ = prefill_context_float64(eng, q, seqs)
    assert relative_error(r.out, ref) <= (6e-2 if prefill == "fp8" else 1e-2)
    assert not torch.isnan(r.out).any()
