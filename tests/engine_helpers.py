"""Shared test helpers: an engine for a dtype combination, on any device; ``ctxprefill bench``
on the CPU."""

import json

import torch

from ctxprefill.backends.reference import ReferenceBackend
from ctxprefill.config import CacheConfig, EngineConfig, ModelShape
from ctxprefill.engine.engine import Engine
from ctxprefill.weights import prepare, random_kv_b_proj


def make_engine(cache_dtype="auto", kv_b_proj_dtype="bf16", prefill_dtype="bf16", heads=2, block_size=16,
                num_blocks=64, workspace_tokens=128, k_scale=1.0, backend=None, honor_out=True,
                scale_kind="block", device="cpu", seed=0):
    shape = ModelShape(heads=heads)
    t = random_kv_b_proj(shape, kv_b_proj_dtype, seed, scale_kind)
    scale = t.get("kv_b_proj.weight_scale_inv", t.get("kv_b_proj.weight_scale"))
    weights = prepare(kv_b_proj_dtype, t["kv_b_proj.weight"], scale)
    cfg = EngineConfig(shape=shape, cache=CacheConfig(cache_dtype, block_size, num_blocks, k_scale),
                       kv_b_proj_dtype=kv_b_proj_dtype, prefill_dtype=prefill_dtype, workspace_tokens=workspace_tokens)
    return Engine(cfg, weights, device, backend=backend or ReferenceBackend(honor_out=honor_out))


def record_chunks(engine, q, seqs, fused, **kw):
    """(result, [(q, k, v, out, lse) per chunk]) with every tensor cloned to the CPU."""
    seen = []

    def observer(i, chunk, q_c, k, v, o, lse):
        seen.append(tuple(t.detach().clone().cpu() for t in (q_c, k, v, o, lse)))

    r = engine.prefill_context(q, seqs, fused=fused, observer=observer, **kw)
    return r, seen


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, for comparisons with atol = rtol = 0 that also compare NaNs and -0."""
    return t.contiguous().view(torch.uint8)


def cpu_bench(tmp_path, *args: str) -> dict:
    """``ctxprefill bench --device cpu ARGS`` into a JSON under ``tmp_path``: its exit code
    0, the JSON it wrote."""
    from ctxprefill.cli import main

    out = tmp_path / "bench.json"
    assert main(["bench", "--device", "cpu", *args, "--out", str(out)]) == 0
    return json.loads(out.read_text())
