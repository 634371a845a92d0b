"""Plots of the benchmark JSON files, written as PNGs beside each JSON (or to --out-dir).

From a ``ctxprefill bench`` JSON (``meta.kind == "engine"``, or rows with ``speedup``):
- ``engine_speedup.png``: generic time / fused time, grouped bars per shape (H, new, context),
  one bar per (cache, prefill) dtype pair, one panel per H;
- ``engine_stages.png``: time per stage, stacked, generic | fused | floor (and marks at the
  fused request's time as a CUDA graph and at the floor at the GEMM rate held under the
  power cap, where the JSON has them), for the headline
  shape (1,024 new over 64k context when present); ``engine_stages_grid.png`` for every
  shape when the JSON has more than one (new, context) pair;
- ``engine_latency.png`` (more than one context length): request time against context
  length, log axes, one line per (H, new tokens): fused solid, generic dashed, floor dotted;
  one panel per dtype pair; ``engine_latency_new.png`` (more than one count of new tokens):
  the same against new tokens, one line per (H, context).

From a ``bench/bench_concurrency.py`` JSON (``meta.kind == "concurrency"``):
- ``concurrency.png``: requests/s, context tokens/s and latency p50/p99 against clients,
  one line per shape and transport (inline, system, cuda; inline when the file has none).

Every title carries the run's date, GPU, torch version and commit (from the JSON's meta).
Without matplotlib the script says so and exits 0 (``pip install matplotlib``).

    python bench/plot_engine.py bench/results/bench_engine.json [bench/results/bench_concurrency_ring.json]
    python bench/plot_engine.py bench/results/bench_engine_scaling.json bench/results/bench_engine_new.json \
        --only engine_latency.png engine_latency_new.png
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence

STAGES = ("gather", "cast", "kv_b_proj", "pack", "attention", "merge")
HEADLINE = (1024, 65536)  # the headline shape: 1,024 new tokens over 64k context


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


#: the PNG text key naming the run a plot was made from (its run_line), read back by png_run
RUN_KEY = "Source"


def _save(fig, out_dir: str, name: str, dpi: int, meta: dict) -> str:
    """Lay out (leaving room for the two-line suptitle), write ``out_dir/name`` with the run it
    shows (``meta``'s run_line) as a PNG text field, close."""
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.5 / fig.get_figheight()))
    path = os.path.join(out_dir, name)
    fig.savefig(path, dpi=dpi, metadata={RUN_KEY: run_line(meta)})
    _plt().close(fig)
    return path


def png_run(path: str) -> str | None:
    """The run a PNG written here was made from (its ``RUN_KEY`` text field), or None.
    Pillow reads it: matplotlib's own dependency, there wherever plots are made."""
    from PIL import Image

    with Image.open(path) as im:
        text = im.info.get(RUN_KEY)
    return text if isinstance(text, str) else None


def load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def kind(d: dict) -> str:
    k = d.get("meta", {}).get("kind")
    if k:
        return k
    rows = d.get("rows", [])
    return "concurrency" if any("clients" in r for r in rows) else "engine"


def run_line(meta: dict) -> str:
    """'2026-11-29 · NVIDIA H200 · torch 2.11.0+cu130 · commit abc1234'."""
    return (f"{str(meta.get('date') or '?')[:10]} · {meta.get('gpu') or meta.get('device') or 'cpu'} · "
            f"torch {meta.get('torch') or '?'} · commit {meta.get('commit') or '?'}")


def ctx_label(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def tokens_label(n: int, axis: str) -> str:
    """Tokens of a grid's axis as the plots and tables name them: context 64k, new 1,024."""
    return ctx_label(n) if axis == "context" else f"{n:,}"


def measured(d: dict) -> list[dict]:
    return [r for r in d.get("rows", []) if "speedup" in r and "error" not in r and "skipped" not in r]


def _shape(r):
    return r["heads"], r["new"], r["context"]


def _pairs(rows):
    seen = []
    for r in rows:
        p = (r["cache_dtype"], r["prefill_dtype"])
        if p not in seen:
            seen.append(p)
    return seen


def _floor_s(r):
    f = r.get("floor_s")
    return f if isinstance(f, (int, float)) and f == f else None


# ----------------------------------------------------------------------------- engine


def plot_speedup(d: dict, out_dir: str) -> str:
    plt = _plt()
    rows = measured(d)
    heads = sorted({r["heads"] for r in rows})
    pairs = _pairs(rows)
    by = {(_shape(r), r["cache_dtype"], r["prefill_dtype"]): r for r in rows}
    n_shapes = max(len({_shape(r) for r in rows if r["heads"] == h}) for h in heads)
    fig, axes = plt.subplots(len(heads), 1, figsize=(max(8.0, 1.2 + n_shapes * (0.22 * len(pairs) + 0.4)),
                                                     3.6 * len(heads)), squeeze=False)
    width = 0.8 / max(1, len(pairs))
    for ax, h in zip(axes[:, 0], heads):
        shapes = sorted({_shape(r) for r in rows if r["heads"] == h})
        for j, (cd, pd) in enumerate(pairs):
            xs, ys = [], []
            for i, s in enumerate(shapes):
                r = by.get((s, cd, pd))
                if r is not None:
                    xs.append(i - 0.4 + width * (j + 0.5))
                    ys.append(r["speedup"])
            bars = ax.bar(xs, ys, width, color=f"C{j}", label=f"cache {cd}, prefill {pd}")
            ax.bar_label(bars, fmt="%.2f", fontsize=5 if len(shapes) * len(pairs) > 24 else 7,
                         rotation=90 if len(shapes) * len(pairs) > 24 else 0, padding=1)
        top = max([r["speedup"] for r in rows if r["heads"] == h] + [1.4])
        ax.set_ylim(0, top * 1.45)  # room for the labels and the legend above the bars
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.axhline(1.4, color="tab:red", lw=0.8, ls="--", label="issue target 1.4×")
        ax.set_xticks(range(len(shapes)), [f"{n} new\n{ctx_label(c)} ctx" for _, n, c in shapes], fontsize=8)
        ax.set_ylabel("generic time / fused time")
        ax.set_title(f"H={h}", fontsize=9)
        ax.legend(fontsize=7, ncol=min(4 if len(shapes) > 2 else 2, len(pairs) + 1), loc="upper left")
    fig.suptitle(f"Fused over generic path by shape\n{run_line(d['meta'])}", fontsize=9)
    return _save(fig, out_dir, "engine_speedup.png", 110, d["meta"])


def _stage_panel(ax, sub: list[dict], title: str, legend: bool) -> None:
    # generic | fused with its K pack (rows with unpacked keys, where measured) | fused | floor
    packed = any("fused_packed_stage_s" in r for r in sub)
    width = 0.21 if packed else 0.28
    paths = [("generic_stage_s", -width)] + ([("fused_packed_stage_s", 0.0)] if packed else []) \
        + [("fused_stage_s", width if packed else 0.0)]
    top = 0.0
    for k, (key, off) in enumerate(paths):
        bottom = [0.0] * len(sub)
        for j, st in enumerate(STAGES):
            vals = [r.get(key, {}).get(st, 0.0) * 1e3 for r in sub]
            ax.bar([i + off for i in range(len(sub))], vals, width, bottom=bottom, color=f"C{j}",
                   label=st if k == 0 else None, edgecolor="white", lw=0.3)
            bottom = [b + v for b, v in zip(bottom, vals)]
        # the request's wall time above its stages (host work and gaps between stages)
        walls = [r.get(key.replace("_stage", ""), 0.0) * 1e3 for r in sub]
        ax.scatter([i + off for i in range(len(sub)) if walls[i]], [w for w in walls if w],
                   marker="_", s=120, color="black", zorder=3, label="request time" if k == 0 else None)
        top = max([top, *bottom, *walls])
        if key == "fused_stage_s":  # the same request with its chunk loop replayed as a CUDA graph
            graph = [(i + off, r["fused_graph_s"] * 1e3) for i, r in enumerate(sub) if r.get("fused_graph_s")]
            if graph:
                ax.scatter([x for x, _ in graph], [y for _, y in graph], marker="_", s=120, color="C9", zorder=3,
                           label="request time, CUDA graph")
    floor_at = (2 if packed else 1) * width
    floors = [_floor_s(r) for r in sub]
    if any(f is not None for f in floors):
        ax.bar([i + floor_at for i in range(len(sub))], [(f or 0.0) * 1e3 for f in floors], width,
               color="lightgrey", label="floor")
    held = [r.get("floor_sustained_s") for r in sub]  # FLOPs at the GEMM rate held under the power cap
    if any(isinstance(f, (int, float)) and f == f for f in held):
        pts = [(i + floor_at, f * 1e3) for i, f in enumerate(held) if isinstance(f, (int, float)) and f == f]
        ax.scatter([x for x, _ in pts], [y for _, y in pts], marker="_", s=120, color="dimgrey", zorder=3,
                   label="floor, held GEMM rate")
    ax.set_xticks([i + (width / 2 if packed else 0.0) for i in range(len(sub))],
                  [f"{r['cache_dtype']}\n{r['prefill_dtype']}" for r in sub], fontsize=7)
    if packed:
        ax.set_xlabel("bars: generic | fused with its K pack (bf16 rows) | fused | floor", fontsize=6)
    ax.set_ylabel("ms per request", fontsize=8)
    ax.set_title(title, fontsize=8)
    if legend:  # above the tallest bar, not over the bars
        ax.set_ylim(0, top * 1.3)
        ax.legend(fontsize=6, ncol=4, loc="upper center")


def plot_stages(d: dict, out_dir: str) -> list[str]:
    plt = _plt()
    rows = measured(d)
    paths = []
    shapes = sorted({_shape(r) for r in rows})
    nc = [(n, c) for _, n, c in shapes]
    new, ctx = HEADLINE if HEADLINE in nc else nc[0]
    heads = sorted({h for h, n, c in shapes if (n, c) == (new, ctx)})
    fig, axes = plt.subplots(1, len(heads), figsize=(7 * len(heads), 5), squeeze=False)
    for ax, h in zip(axes[0], heads):
        sub = [r for r in rows if _shape(r) == (h, new, ctx)]
        packed = any("fused_packed_stage_s" in r for r in sub)
        _stage_panel(ax, sub, f"H={h}: generic, " + ("fused with its K pack (bf16), " if packed else "")
                     + "fused, floor (left to right)", True)
    fig.suptitle(f"Time per stage, {new} new tokens over {ctx_label(ctx)} context\n{run_line(d['meta'])}",
                 fontsize=9)
    paths.append(_save(fig, out_dir, "engine_stages.png", 110, d["meta"]))
    if len(set(nc)) > 1:  # more shapes than the headline one: every shape, one panel each
        hn = sorted({(h, n) for h, n, _ in shapes})
        ctxs = sorted({c for _, _, c in shapes})
        fig, axes = plt.subplots(len(hn), len(ctxs), figsize=(5.5 * len(ctxs), 3.4 * len(hn)), squeeze=False)
        for i, (h, n) in enumerate(hn):
            for j, c in enumerate(ctxs):
                sub = [r for r in rows if _shape(r) == (h, n, c)]
                if sub:
                    _stage_panel(axes[i, j], sub, f"H={h}, {n} new over {ctx_label(c)}: generic | fused | floor",
                                 i == 0 and j == 0)
                else:
                    axes[i, j].set_axis_off()
        fig.suptitle(f"Time per stage, every shape\n{run_line(d['meta'])}", fontsize=10)
        paths.append(_save(fig, out_dir, "engine_stages_grid.png", 80, d["meta"]))
    return paths


#: per axis of a grid: (the other axis, the PNG, the title, the x label)
LATENCY_AXES = {"context": ("new", "engine_latency.png", "Latency against context length", "context tokens"),
                "new": ("context", "engine_latency_new.png", "Latency against new tokens", "new tokens")}


def plot_latency(d: dict, out_dir: str, axis: str = "context") -> str | None:
    """Request time against ``axis`` (context or new tokens), log axes; None when the JSON
    has one value of it."""
    rows = measured(d)
    if len({r[axis] for r in rows}) < 2:
        return None
    other, name, title, xlabel = LATENCY_AXES[axis]
    plt = _plt()
    pairs = _pairs(rows)
    caches = [c for c in dict.fromkeys(p[0] for p in pairs)]
    prefills = [p for p in dict.fromkeys(p[1] for p in pairs)]
    fig, axes = plt.subplots(len(prefills), len(caches), figsize=(5 * len(caches), 4 * len(prefills)),
                             squeeze=False)
    hn = sorted({(r["heads"], r[other]) for r in rows})
    for i, pd in enumerate(prefills):
        for j, cd in enumerate(caches):
            ax = axes[i, j]
            sub = [r for r in rows if (r["cache_dtype"], r["prefill_dtype"]) == (cd, pd)]
            if not sub:
                ax.set_axis_off()
                continue
            for k, (h, n) in enumerate(hn):
                line = sorted((r for r in sub if (r["heads"], r[other]) == (h, n)), key=lambda r: r[axis])
                if not line:
                    continue
                xs = [r[axis] for r in line]
                label = f"H={h}, {n} new" if other == "new" else f"H={h}, over {ctx_label(n)}"
                ax.plot(xs, [r["fused_s"] * 1e3 for r in line], "-o", color=f"C{k}", ms=3, label=label)
                ax.plot(xs, [r["generic_s"] * 1e3 for r in line], "--", color=f"C{k}", lw=1)
                fl = [(x, _floor_s(r)) for x, r in zip(xs, line) if _floor_s(r) is not None]
                if fl:
                    ax.plot([x for x, _ in fl], [f * 1e3 for _, f in fl], ":", color=f"C{k}", lw=1, alpha=0.7)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ticks = sorted({r[axis] for r in sub})
            ax.set_xticks(ticks, [tokens_label(c, axis) for c in ticks])
            ax.set_xlabel(xlabel)
            ax.set_ylabel("ms per request")
            ax.set_title(f"cache {cd}, prefill {pd}  (fused —, generic --, floor ··)", fontsize=8)
            ax.grid(True, which="both", lw=0.3, alpha=0.5)
            ax.legend(fontsize=6)
    fig.suptitle(f"{title}\n{run_line(d['meta'])}", fontsize=9)
    return _save(fig, out_dir, name, 100, d["meta"])


# ----------------------------------------------------------------------------- concurrency


def plot_concurrency(d: dict, out_dir: str) -> str:
    plt = _plt()
    rows = [r for r in d.get("rows", []) if "requests_per_s" in r]
    keys = list(dict.fromkeys((r["shape_label"], r.get("transport", "inline")) for r in rows))
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for k, key in enumerate(keys):
        lab = f"{key[0]} · {key[1]}"
        line = sorted((r for r in rows if (r["shape_label"], r.get("transport", "inline")) == key),
                      key=lambda r: r["clients"])
        xs = [r["clients"] for r in line]
        axes[0].plot(xs, [r["requests_per_s"] for r in line], "-o", color=f"C{k}", label=lab)
        axes[1].plot(xs, [r["context_tokens_per_s"] / 1e6 for r in line], "-o", color=f"C{k}", label=lab)
        axes[2].plot(xs, [r["latency_ms"]["p50"] for r in line], "-o", color=f"C{k}", label=f"{lab} p50")
        axes[2].plot(xs, [r["latency_ms"]["p99"] for r in line], "--x", color=f"C{k}", label=f"{lab} p99")
        axes[2].plot(xs, [r["server_compute_ms"]["p50"] for r in line], ":", color=f"C{k}",
                     label=f"{lab} server compute p50")
    clients = sorted({r["clients"] for r in rows})
    for ax, yl in zip(axes, ("requests / s", "context tokens / s (millions)", "ms")):
        ax.set_xscale("log", base=2)
        if clients:
            ax.set_xticks(clients, [str(c) for c in clients])
        ax.set_xlabel(f"concurrent clients ({d['meta'].get('client_mode', 'threads')})")
        ax.set_ylabel(yl)
        ax.grid(True, lw=0.3, alpha=0.5)
        ax.legend(fontsize=7)
    axes[0].set_ylim(bottom=0)
    axes[1].set_ylim(bottom=0)
    axes[0].set_title("throughput", fontsize=9)
    axes[1].set_title("context tokens processed", fontsize=9)
    axes[2].set_title("client latency; server compute time", fontsize=9)
    qs = d["meta"].get("queue_size")
    fig.suptitle(f"Throughput under concurrency (one server per shape{f', --queue-size {qs}' if qs else ''})\n"
                 f"{run_line(d['meta'])}", fontsize=9)
    return _save(fig, out_dir, "concurrency.png", 110, d["meta"])


def plot_file(path: str, out_dir: str | None = None, only: Sequence[str] = ()) -> list[str]:
    """Every plot of one JSON file (``only``: those of these names); the PNG paths written."""
    out = out_dir or os.path.dirname(os.path.abspath(path))
    if only:  # made aside, the others dropped: each file's plots share names
        with tempfile.TemporaryDirectory() as tmp:
            keep = [p for p in plot_file(path, tmp) if os.path.basename(p) in only]
            os.makedirs(out, exist_ok=True)
            return [shutil.move(p, os.path.join(out, os.path.basename(p))) for p in keep]
    d = load(path)
    os.makedirs(out, exist_ok=True)
    if kind(d) == "concurrency":
        return [plot_concurrency(d, out)] if any("requests_per_s" in r for r in d.get("rows", [])) else []
    if not measured(d):
        return []
    paths = [plot_speedup(d, out), *plot_stages(d, out)]
    return paths + [p for p in (plot_latency(d, out, axis) for axis in LATENCY_AXES) if p]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", nargs="+", help="ctxprefill bench and/or bench_concurrency.py JSON files")
    ap.add_argument("--out-dir", default=None, help="where the PNGs go (default: beside each JSON)")
    ap.add_argument("--only", nargs="+", default=(), metavar="PNG",
                    help="write only the plots of these names (e.g. engine_latency.png)")
    ns = ap.parse_args(argv)
    try:
        _plt()
    except ImportError as e:
        print(f"plot_engine: matplotlib is not installed ({e}); no plots made. pip install matplotlib",
              file=sys.stderr)
        return 0
    for p in ns.json:
        written = plot_file(p, ns.out_dir, ns.only)
        print(f"{p}: wrote {', '.join(written) if written else 'nothing (no measured rows)'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
