"""``ctxprefill bench``: the fused and the generic path side by side, in one process.

For each configuration of a grid, one request (one sequence of ``new`` query tokens
over ``context`` cached tokens, or a ragged batch) runs through the in-process engine
on both paths; we report the median request time, time per stage, launches per
chunk, and the floor: kv_b_proj and attention FLOPs at the measured matrix rate plus
the memory-bound stages' bytes at the measured copy bandwidth.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from .settings import ServeSettings, build_engine
from .workload import make_request


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def measure_ceilings(dev) -> dict:
    """Device copy bandwidth (bytes read + written) and bf16 GEMM rate, measured now."""
    if dev.type != "cuda":
        return {"copy_bytes_per_s": float("nan"), "matmul_flops_per_s": float("nan")}
    x = torch.empty(1 << 30, dtype=torch.bfloat16, device=dev)  # 2 GiB
    y = torch.empty_like(x)
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=dev)
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=dev)

    def t(fn, n=10):
        for _ in range(3):
            fn()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(n):
            fn()
        e.record()
        torch.cuda.synchronize()
        return s.elapsed_time(e) / 1e3 / n

    copy = 2 * x.numel() * 2 / t(lambda: y.copy_(x))
    mm = 2 * 8192**3 / t(lambda: a @ b)
    del x, y, a, b
    torch.cuda.empty_cache()
    return {"copy_bytes_per_s": copy, "matmul_flops_per_s": mm}


def floor_seconds(cfg, contexts, queries, ceil) -> dict:
    """Lower bound of one request: FLOPs at the matrix rate + glue bytes at copy bandwidth."""
    H, L, P, V, R = cfg.shape.heads, 512, 128, 128, 64
    ctx, nq = sum(contexts), sum(queries)
    kvb_flops = 2 * ctx * L * H * (P + V)
    att_flops = 2 * sum(q * c for q, c in zip(queries, contexts)) * H * (P + R + V)
    fp8 = cfg.prefill_dtype == "fp8"
    e = 1 if fp8 else 2
    slot = cfg.cache.bytes_per_slot
    glue = (
        ctx * (slot + (L + R) * 2)  # gather: read slots, write bf16 workspace
        + ctx * H * P * 2 + ctx * R * 2 + ctx * H * (P + R) * e  # pack: read k_nope, k_pe; write k
        + (ctx * H * V * (2 + e) if fp8 else 0)  # fp8: read v, write v8
    )
    return {
        "kv_b_proj_s": kvb_flops / ceil["matmul_flops_per_s"],
        "attention_s": att_flops / ceil["matmul_flops_per_s"],
        "glue_s": glue / ceil["copy_bytes_per_s"],
        "attention_flops": att_flops,
        "kv_b_proj_flops": kvb_flops,
    }


def time_request(engine, q, seqs, fused, iters, dev):
    for _ in range(2):
        engine.prefill_context(q, seqs, fused=fused)
    times, stages = [], []
    for _ in range(iters):
        _sync(dev)
        t = time.perf_counter()
        r = engine.prefill_context(q, seqs, fused=fused)
        _sync(dev)
        times.append(time.perf_counter() - t)
        stages.append(r.stats.stage_ns)
    stage_med = {k: statistics.median(s.get(k, 0) for s in stages) / 1e9 for k in stages[0]}
    return statistics.median(times), stage_med, r


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="ctxprefill bench", description=__doc__)
    p.add_argument("--device", default="auto")
    p.add_argument("--heads", type=int, nargs="+", default=[16, 128])
    p.add_argument("--new", type=int, nargs="+", default=[1024], help="new (query) tokens per request")
    p.add_argument("--context", type=int, nargs="+", default=[65536], help="cached context tokens per request")
    p.add_argument("--cache-dtype", nargs="+", default=["auto", "fp8", "fp8_ds_mla"])
    p.add_argument("--prefill-dtype", nargs="+", default=["bf16", "fp8"])
    p.add_argument("--kv-b-proj-dtype", default="bf16")
    p.add_argument("--workspace-tokens", type=int, default=16384)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--backend", default="auto")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--out", default=None, help="write JSON results here")
    ns = p.parse_args(argv)

    from .settings import resolve_device

    dev = resolve_device(ns.device)
    ceil = measure_ceilings(dev)
    print(f"device {dev} ({torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'cpu'}); torch {torch.__version__}; "
          f"copy {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s, bf16 GEMM {ceil['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s",
          flush=True)
    rows = []
    hdr = (f"{'H':>4} {'new':>5} {'ctx':>7} {'cache':>10} {'prefill':>7} {'chunks':>6} {'generic ms':>10} {'fused ms':>9} "
           f"{'speedup':>7} {'floor ms':>8} {'fused/floor':>11} {'launch/chunk g|f':>16}")
    print(hdr, flush=True)
    for H, new, ctx, cd, pd in itertools.product(ns.heads, ns.new, ns.context, ns.cache_dtype, ns.prefill_dtype):
        s = ServeSettings(device=str(dev), heads=H, block_size=ns.block_size,
                          num_blocks=-(-ctx // ns.block_size) + 1, cache_dtype=cd, prefill_dtype=pd,
                          kv_b_proj_dtype=ns.kv_b_proj_dtype, workspace_tokens=ns.workspace_tokens, backend=ns.backend)
        try:
            engine = build_engine(s)
            q, seqs = make_request(engine, [ctx], [new], seed=0)
            q = q.to(dev)  # as the service hands it over: the host-to-device copy of q is not the engine's
            tg, sg, rg = time_request(engine, q, seqs, False, ns.iters, dev)
            tf, sf, rf = time_request(engine, q, seqs, True, ns.iters, dev)
        except Exception as e:  # keep the grid going; record the failure
            print(f"{H:4d} {new:5d} {ctx:7d} {cd:>10} {pd:>7} failed: {type(e).__name__}: {e}", flush=True)
            rows.append({"heads": H, "new": new, "context": ctx, "cache_dtype": cd, "prefill_dtype": pd, "error": str(e)})
            continue
        fl = floor_seconds(engine.config, [ctx], [new], ceil)
        floor = fl["kv_b_proj_s"] + fl["attention_s"] + fl["glue_s"]
        n = len(rf.stats.chunks)
        lg, lf = sum(rg.stats.launches.values()) / n, sum(rf.stats.launches.values()) / n
        same = torch.equal(rf.out.view(torch.int16), rg.out.view(torch.int16)) and torch.equal(rf.lse, rg.lse)
        print(f"{H:4d} {new:5d} {ctx:7d} {cd:>10} {pd:>7} {n:6d} {tg * 1e3:10.3f} {tf * 1e3:9.3f} {tg / tf:7.2f} "
              f"{floor * 1e3:8.3f} {tf / floor:11.2f} {lg:7.1f} | {lf:5.1f}{'' if same else '  MISMATCH'}", flush=True)
        rows.append({
            "heads": H, "new": new, "context": ctx, "cache_dtype": cd, "prefill_dtype": pd,
            "kv_b_proj_dtype": ns.kv_b_proj_dtype, "workspace_tokens": ns.workspace_tokens, "chunks": n,
            "backend": engine.backend.name, "fused_kernels_active": engine.fused_kernels_active,
            "generic_s": tg, "fused_s": tf, "speedup": tg / tf, "floor_s": floor, "floor": fl,
            "generic_stage_s": sg, "fused_stage_s": sf, "generic_launches": dict(rg.stats.launches),
            "fused_launches": dict(rf.stats.launches), "bit_identical": same,
        })
        del engine
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    if ns.out:
        try:
            commit = os.environ.get("CTXPREFILL_COMMIT") or subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        except OSError:
            commit = ""
        meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "device": str(dev),
                "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None, "torch": torch.__version__,
                "commit": commit, "ceilings": ceil, "args": vars(ns)}
        with open(ns.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0 if all("error" not in r and r["bit_identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
