"""Plots of a ``ctxprefill bench`` JSON: speed-up of the fused path by shape, and time per
stage of both paths next to the floor. Writes PNGs beside the JSON (or to --out-dir).

    python bench/plot_engine.py bench/results/2026-11-29-h200/engine.json
"""

from __future__ import annotations

import argparse
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

STAGES = ("gather", "cast", "kv_b_proj", "pack", "attention", "merge")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("json")
    ap.add_argument("--out-dir", default=None)
    ns = ap.parse_args()
    d = json.load(open(ns.json))
    rows = [r for r in d["rows"] if "error" not in r]
    meta = d["meta"]
    out = ns.out_dir or os.path.dirname(os.path.abspath(ns.json))
    title = f"{meta.get('gpu')} · torch {meta['torch']} · commit {meta['commit']} · {meta['date'][:10]}"
    labels = [f"H={r['heads']}\n{r['cache_dtype']}\n{r['prefill_dtype']}" for r in rows]

    fig, ax = plt.subplots(figsize=(max(8, len(rows) * 0.9), 4.5))
    ax.bar(range(len(rows)), [r["speedup"] for r in rows], color="tab:blue")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.axhline(1.4, color="tab:red", lw=0.8, ls="--", label="issue target 1.4×")
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylabel("generic time / fused time")
    ax.set_title(f"Fused over generic, {rows[0]['new']} new tokens over {rows[0]['context']} context\n{title}",
                 fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "engine_speedup.png"), dpi=110)

    heads = sorted({r["heads"] for r in rows})
    fig, axes = plt.subplots(1, len(heads), figsize=(7 * len(heads), 5), squeeze=False)
    width = 0.28
    for ax, h in zip(axes[0], heads):
        sub = [r for r in rows if r["heads"] == h]
        for k, (key, off) in enumerate((("generic_stage_s", -width), ("fused_stage_s", 0.0))):
            bottom = [0.0] * len(sub)
            for j, st in enumerate(STAGES):
                vals = [r[key].get(st, 0.0) * 1e3 for r in sub]
                ax.bar([i + off for i in range(len(sub))], vals, width, bottom=bottom, color=f"C{j}",
                       label=st if k == 0 else None, edgecolor="white", lw=0.3)
                bottom = [b + v for b, v in zip(bottom, vals)]
        ax.bar([i + width for i in range(len(sub))], [r["floor_s"] * 1e3 for r in sub], width, color="lightgrey",
               label="floor")
        ax.set_xticks(range(len(sub)), [f"{r['cache_dtype']}\n{r['prefill_dtype']}" for r in sub], fontsize=8)
        ax.set_ylabel("ms per request")
        ax.set_title(f"H={h}: generic (left), fused (middle), floor (right)", fontsize=9)
        ax.legend(fontsize=7, ncol=4)
    fig.suptitle(f"Time per stage, {rows[0]['new']} new tokens over {rows[0]['context']} context — {title}", fontsize=9)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "engine_stages.png"), dpi=110)
    print(f"wrote {out}/engine_speedup.png, {out}/engine_stages.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
