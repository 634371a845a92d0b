"""Markdown tables of the benchmark JSON files, for bench/results/README.md.

- a ``ctxprefill bench`` JSON: one row per configuration — H, new, ctx, cache, prefill,
  chunks, generic ms, fused ms, speed-up, floor ms, fused/floor, launches per chunk
  (generic → fused), bit-identical; rows that failed or were skipped (time budget)
  listed below the table;
- a ``bench/bench_concurrency.py`` JSON: one row per shape, transport (inline, system,
  cuda; files from before ``--transport`` are inline; "(stream, N in flight)" with
  ``--stream-depth``) and client count.

Each table starts with a line naming the run (date, GPU, torch, commit).

    python bench/make_tables.py bench/results/<run>/engine.json bench/results/<run>/concurrency.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from plot_engine import ctx_label, kind, run_line  # noqa: E402


def _num(x, fmt: str) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "n/a"
    return format(x, fmt)


def _per_chunk(r: dict, path: str):
    v = r.get(f"{path}_launches_per_chunk")
    if v is None and r.get(f"{path}_launches") is not None and r.get("chunks"):
        v = sum(r[f"{path}_launches"].values()) / r["chunks"]
    return v


def engine_table(d: dict, bold_speedup: float = 1.4) -> str:
    meta = d.get("meta", {})
    lines = [f"_{run_line(meta)}_", ""]
    ceil = meta.get("ceilings") or {}
    if ceil.get("matmul_flops_per_s") and ceil.get("copy_bytes_per_s"):
        lines += [f"Floor: kv_b_proj + attention FLOPs at {ceil['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s (bf16 "
                  f"GEMM) + gather/pack bytes at {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s (copy), both measured "
                  f"in the run (the pack's bytes only where the fused path packs).", ""]
    # runs with unpacked keys: the fused request with its K pack, timed beside it
    packed = any("fused_packed_s" in r for r in d.get("rows", []))
    lines += ["| H | new | ctx | cache | prefill | chunks | generic ms | " + ("fused + K pack ms | " if packed else "")
              + "fused ms | speed-up | floor ms | fused / floor | fused gap ms | launches/chunk generic→fused "
              "| bit-identical |",
              "|---|---|---|---|---|---|---|" + ("---|" if packed else "") + "---|---|---|---|---|---|---|"]
    notes = []
    for r in d.get("rows", []):
        if "speedup" not in r:
            what = f"skipped ({r['skipped']})" if "skipped" in r else f"failed: {r.get('error', '?')}"
            notes.append(f"- H={r['heads']}, {r['new']} new over {ctx_label(r['context'])}, "
                         f"{r['cache_dtype']}/{r['prefill_dtype']}: {what}")
            continue
        floor = r.get("floor_s")
        ratio = r.get("fused_over_floor")
        if ratio is None and floor:
            ratio = r["fused_s"] / floor
        sp = f"{r['speedup']:.2f}"
        if r["speedup"] >= bold_speedup:
            sp = f"**{sp}**"
        lg, lf = _per_chunk(r, "generic"), _per_chunk(r, "fused")
        gap = r.get("fused_host_gap_s")
        if gap is None and r.get("fused_stage_s") is not None:  # runs before the field existed
            gap = r["fused_s"] - sum(r["fused_stage_s"].values())
        lines.append(
            f"| {r['heads']} | {r['new']} | {ctx_label(r['context'])} | {r['cache_dtype']} | {r['prefill_dtype']} "
            f"| {r['chunks']} | {r['generic_s'] * 1e3:.2f} | "
            + (f"{_num(r['fused_packed_s'] * 1e3 if 'fused_packed_s' in r else None, '.2f')} | " if packed else "")
            + f"{r['fused_s'] * 1e3:.2f} | {sp} "
            f"| {_num(floor * 1e3 if floor else None, '.2f')} | {_num(ratio, '.2f')} "
            f"| {_num(gap * 1e3 if gap is not None else None, '.2f')} | {_num(lg, '.0f')} → {_num(lf, '.0f')} | {'yes' if r.get('bit_identical') else '**NO**'} |")
    if notes:
        lines += ["", *notes]
    return "\n".join(lines) + "\n"


def concurrency_table(d: dict) -> str:
    meta = d.get("meta", {})
    qs = meta.get("queue_size")
    lines = [f"_{run_line(meta)}_; clients: {meta.get('client_mode', 'threads')}"
             + (f"; server --queue-size {qs}" if qs else ""), "",
             "| shape | transport | clients | requests | req/s | context Mtok/s | query ktok/s | p50 ms | p90 ms "
             "| p99 ms | server p50 ms | compute p50 ms | device busy | errors |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in d.get("rows", []):
        tr = r.get("transport", "inline") + (f" (stream, {r['stream_depth']} in flight)" if r.get("stream_depth") else "")
        if "requests_per_s" not in r:
            lines.append(f"| {r['shape_label']} | {tr} | {r['clients']} | skipped ({r.get('skipped', '?')}) "
                         "| | | | | | | | | | |")
            continue
        lat, srv, cmp_ = r["latency_ms"], r["server_total_ms"], r["server_compute_ms"]
        errs = ", ".join(f"{k} {v}" for k, v in sorted(r["errors"].items())) or "0"
        if r.get("setup_errors"):
            errs += f"; set-up failed in {r['setup_errors']} clients"
        if r.get("check_matches_inline") is False:
            errs += "; check request **differs from inline**"
        lines.append(
            f"| {r['shape_label']} | {tr} | {r['clients']} | {r['requests']} | {r['requests_per_s']:.2f} "
            f"| {r['context_tokens_per_s'] / 1e6:.2f} | {r['query_tokens_per_s'] / 1e3:.1f} "
            f"| {_num(lat['p50'], '.1f')} | {_num(lat['p90'], '.1f')} | {_num(lat['p99'], '.1f')} "
            f"| {_num(srv['p50'], '.1f')} | {_num(cmp_['p50'], '.1f')} | {_num(r.get('device_busy_fraction'), '.2f')} "
            f"| {errs} |")
    for e in d.get("errors", []):
        lines.append(f"\n- server group {e.get('group')}: {e.get('error')}")
    return "\n".join(lines) + "\n"


def table(d: dict) -> str:
    return concurrency_table(d) if kind(d) == "concurrency" else engine_table(d)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", nargs="+")
    ap.add_argument("--out", default=None, help="write the tables here (default: print)")
    ns = ap.parse_args(argv)
    parts = []
    for p in ns.json:
        with open(p) as f:
            parts.append(f"<!-- {p} -->\n" + table(json.load(f)))
    text = "\n".join(parts)
    if ns.out:
        with open(ns.out, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
