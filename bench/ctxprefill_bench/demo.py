"""``ctxprefill demo``: the whole computation once, checked against float64.

Without ``--target``: builds an engine in this process (CPU reference ops, or the GPU
with its kernels), writes random context into the cache, runs one multi-sequence
request through both the fused and the generic path, and prints a short table.
"""

from __future__ import annotations

import time

import torch

from ctxprefill.app import build_engine
from ctxprefill.settings import ServeSettings

from .reference64 import prefill_context_float64
from .workload import FLOAT64_TOLERANCE, make_request, relative_error

DEMO_CONTEXTS = [700, 0, 256, 1000, 33]
DEMO_QUERIES = [16, 8, 1, 24, 12]


def run_demo(s: ServeSettings, contexts=DEMO_CONTEXTS, queries=DEMO_QUERIES,
             workspace_tokens: int | None = None) -> int:
    engine = build_engine(s)
    cfg = engine.config
    need_blocks = sum(-(-n // cfg.cache.block_size) for n in contexts)
    print(
        f"ctxprefill demo: device={engine.device} backend={engine.backend.name} heads={cfg.shape.heads} "
        f"cache={cfg.cache.dtype} kv_b_proj={cfg.kv_b_proj_dtype} prefill={cfg.prefill_dtype} "
        f"block={cfg.cache.block_size} blocks used={need_blocks}/{cfg.cache.num_blocks}"
    )
    q, seqs = make_request(engine, contexts, queries, seed=s.seed)
    W = workspace_tokens or min(cfg.workspace_tokens, 512)
    ref_out, ref_lse = prefill_context_float64(engine, q, seqs)
    tol = FLOAT64_TOLERANCE[cfg.prefill_dtype]
    ok = True
    results = {}
    print(f"contexts={contexts} queries={queries} workspace_tokens={W}")
    print(f"{'path':8} {'chunks':>6} {'launches per stage':42} {'rel err out':>11} {'max |Δlse|':>10} {'ms':>8}")
    for fused in (True, False):
        t = time.perf_counter()
        r = engine.prefill_context(q, seqs, workspace_tokens=W, fused=fused)
        ms = (time.perf_counter() - t) * 1e3
        results[fused] = r
        err = relative_error(r.out, ref_out)
        fin = torch.isfinite(ref_lse)
        dl = (r.lse.double().cpu()[fin] - ref_lse[fin]).abs().max().item() if fin.any() else 0.0
        empty_ok = bool((r.lse.cpu()[~fin] == float("-inf")).all()) and bool(
            (r.out.cpu().float()[~fin.t()] == 0).all()
        )
        ok &= err <= tol and dl <= tol and empty_ok
        st = r.stats
        lau = " ".join(f"{k}={v}" for k, v in sorted(st.launches.items()))
        print(f"{st.path:8} {len(st.chunks):6d} {lau:42} {err:11.2e} {dl:10.2e} {ms:8.2f}")
    same = torch.equal(results[True].out.view(torch.int16), results[False].out.view(torch.int16)) and torch.equal(
        results[True].lse, results[False].lse
    )
    print(f"fused == generic bit for bit: {same}; error vs float64 within {tol}: {ok}")
    return 0 if (ok and same) else 1
