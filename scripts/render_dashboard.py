#!/usr/bin/env python3
"""Draw the Grafana dashboard's panels from captured Prometheus data, as one PNG.

    CTXPREFILL_DASHBOARD_DATA=/tmp/dash.json python -m pytest tests/test_deploy_live.py
    python scripts/render_dashboard.py /tmp/dash.json docs/dashboard.png

The input is what tests/test_deploy_live.py saves: for each panel of
deploy/grafana/ctxprefill.json its title, type and unit, and for each of its targets
the (templated) expression, the legend format and the series that Prometheus returned
(``query_range`` for time series and stats, an instant query for tables). Each panel
becomes a small plot with its title, like the dashboard's grid; legends follow
Grafana's ``{{label}}`` format; a stat panel shows each series' last value through the
value mappings of that panel in the dashboard (``--dashboard``). Needs matplotlib.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import sys

DASHBOARD = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "deploy", "grafana",
                         "ctxprefill.json")


def legend_of(fmt: str, labels: dict[str, str]) -> str:
    if fmt:
        return re.sub(r"\{\{\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt)
    shown = {k: v for k, v in labels.items() if k != "__name__"}
    return "{" + ", ".join(f'{k}="{v}"' for k, v in sorted(shown.items())) + "}" if shown else labels.get(
        "__name__", "value")


def formatter(unit: str):
    from matplotlib.ticker import EngFormatter, FuncFormatter, PercentFormatter

    if unit == "percentunit":
        return PercentFormatter(1.0)
    if unit == "s":
        return EngFormatter(unit="s")
    if unit == "reqps":
        return FuncFormatter(lambda x, _: f"{x:g}/s")
    return EngFormatter()


def draw_timeseries(ax, panel: dict, t0: float) -> int:
    from matplotlib.ticker import MaxNLocator

    n, integral = 0, True
    for target in panel["targets"]:
        for s in sorted(target["series"], key=lambda s: legend_of(target["legend"], s["labels"])):
            xs = [float(t) - t0 for t, _ in s["values"]]
            ys = [float(v) for _, v in s["values"]]
            if all(math.isnan(y) for y in ys):
                continue
            ax.plot(xs, ys, linewidth=1.2, label=legend_of(target["legend"], s["labels"]))
            integral &= all(math.isnan(y) or y == int(y) for y in ys)
            n += 1
    ax.yaxis.set_major_formatter(formatter(panel.get("unit", "")))
    if integral and panel.get("unit") in ("short", "none"):  # counts: no fractional ticks
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylim(bottom=0)
    if panel.get("unit") == "percentunit":
        ax.set_ylim(0, 1.05)
    ax.set_xlabel("seconds", fontsize=7)
    ax.grid(True, alpha=0.3)
    ax.tick_params(labelsize=7)
    if n:
        ax.legend(fontsize=5.5, loc="upper left", ncol=2 if n > 6 else 1, framealpha=0.6)
    else:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="gray")
    return n


def draw_table(ax, panel: dict) -> int:
    rows = []
    for target in panel["targets"]:
        for s in target["series"]:
            labels = {k: v for k, v in s["labels"].items() if k != "__name__"}
            rows.append(labels | {"value": s["values"][-1][1] if s["values"] else ""})
    ax.axis("off")
    if not rows:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="gray")
        return 0
    cols = [c for c in ("instance", "device", "backend", "version", "value") if any(c in r for r in rows)]
    cols += sorted({k for r in rows for k in r} - set(cols) - {"job"})
    cells = [[str(r.get(c, "")) for c in cols] for r in sorted(rows, key=lambda r: r.get("instance", ""))]
    header = ["ready" if c == "value" else c for c in cols]
    table = ax.table(cellText=cells, colLabels=header, loc="center", cellLoc="left")
    table.auto_set_font_size(False)
    table.set_fontsize(6.5)
    table.scale(1.0, 1.4)
    return len(rows)


def stat_text(value: float, panel: dict) -> str:
    """A stat panel's value as Grafana shows it: through its value mappings, else in its unit."""
    for mapping in panel.get("mappings", []):
        if mapping.get("type") == "value" and f"{value:g}" in mapping.get("options", {}):
            return mapping["options"][f"{value:g}"].get("text", f"{value:g}")
    if panel.get("unit") == "s":
        return f"{value:.0f} s" if value < 120 else f"{value / 60:.0f} min" if value < 7200 else f"{value / 3600:.1f} h"
    return formatter(panel.get("unit", ""))(value, None)


def draw_stat(ax, panel: dict) -> int:
    """One tile per series: its name (the legend) and its last value."""
    tiles = []
    for target in panel["targets"]:
        for s in target["series"]:
            values = [float(v) for _, v in s["values"] if not math.isnan(float(v))]
            if values:
                tiles.append((legend_of(target["legend"], s["labels"]), stat_text(values[-1], panel)))
    ax.axis("off")
    if not tiles:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="gray")
        return 0
    tiles.sort()
    for i, (name, text) in enumerate(tiles):
        y = 1.0 - (i + 0.5) / len(tiles)
        ax.text(0.02, y, name, ha="left", va="center", transform=ax.transAxes, fontsize=8)
        ax.text(0.98, y, text, ha="right", va="center", transform=ax.transAxes, fontsize=12, fontweight="bold")
    return len(tiles)


def with_mappings(data: dict, dashboard: dict) -> dict:
    """``data`` with each panel's value mappings taken from the dashboard (by panel id)."""
    mappings = {p["id"]: p.get("fieldConfig", {}).get("defaults", {}).get("mappings", [])
                for p in dashboard.get("panels", [])}
    return data | {"panels": [p | {"mappings": mappings.get(p.get("id"), [])} for p in data["panels"]]}


def render(data: dict, out: str, ncols: int = 3) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [p for p in data["panels"] if p.get("type") != "row"]
    nrows = max(1, math.ceil(len(panels) / ncols))
    fig, axes = plt.subplots(nrows, ncols, figsize=(6.0 * ncols, 3.3 * nrows), squeeze=False)
    t0 = float(data.get("start", 0.0))
    for ax, panel in zip(axes.flat, panels):
        if panel.get("type") == "table":
            draw_table(ax, panel)
        elif panel.get("type") == "stat":
            draw_stat(ax, panel)
        else:
            draw_timeseries(ax, panel, t0)
        ax.set_title(panel["title"], fontsize=9, loc="left", fontweight="bold")
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    when = datetime.datetime.fromtimestamp(float(data.get("end", 0.0)), datetime.UTC)
    fig.suptitle(f"Grafana dashboard \"{data.get('dashboard', '')}\" — {data.get('source', '')} "
                 f"({when:%Y-%m-%d %H:%M} UTC)", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    fig.savefig(out, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("data", help="JSON saved by tests/test_deploy_live.py (CTXPREFILL_DASHBOARD_DATA)")
    ap.add_argument("out", help="PNG to write")
    ap.add_argument("--columns", type=int, default=3)
    ap.add_argument("--dashboard", default=DASHBOARD, help="the dashboard JSON, for the stat panels' value mappings")
    args = ap.parse_args(argv)
    with open(args.data) as f:
        data = json.load(f)
    with open(args.dashboard) as f:
        data = with_mappings(data, json.load(f))
    render(data, args.out, args.columns)
    print(f"wrote {args.out} ({sum(1 for p in data['panels'] if p.get('type') != 'row')} panels)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
