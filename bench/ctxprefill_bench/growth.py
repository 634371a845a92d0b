"""How a request's cost grows with its work: least-squares lines over a bench grid's rows.

For each group of rows that differ only along ``axis`` ("context": context tokens, or
"new": new tokens), with three or more values of it, ``t = a + b · x`` is fitted to the
fused request, to its CUDA-graph replay (where the rows have one) and to the floor.
Linear growth shows as neighbouring points' slopes near the fitted one; a step (a
workspace re-allocated, a plan rebuilt past some size) as one pair far above the rest.
Pure Python: ``bench/make_tables.py`` and ``ctxprefill bench`` both use it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

AXES = {"context": "new", "new": "context"}  # the fitted axis -> the one held in a group
#: what is fitted: a row's field -> the name of its growth in the result
SERIES = {"fused_s": "fused", "fused_graph_s": "graph", "floor_s": "floor"}


def _value(row: dict[str, Any], field: str) -> float | None:
    """A row's time, None where it has none (absent, null, or NaN: a CPU run's floor)."""
    v = row.get(field)
    return float(v) if v is not None and math.isfinite(v) else None


def line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """(a, b) of the least-squares line ``y = a + b · x``."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def growth(rows: Sequence[dict[str, Any]], axis: str = "context") -> list[dict[str, Any]]:
    """One record per group with three or more values of ``axis``, in (heads, held axis,
    cache, prefill) order. Per series s (fused, graph, floor: each where every row of the
    group has it; a CPU run has no floor): ``s_ns_per_token`` (the slope, ns per token of
    ``axis``), ``s_fixed_ms`` (the line at no tokens) and ``s_neighbour_ns_per_token`` (the
    slope between each pair of neighbouring points); ``fused_over_floor_growth`` the
    slopes' ratio, where there is a floor."""
    held = AXES[axis]
    groups: dict[tuple[int, int, str, str], list[dict[str, Any]]] = {}
    for r in rows:
        if _value(r, "fused_s") is not None:
            groups.setdefault((r["heads"], r[held], r["cache_dtype"], r["prefill_dtype"]), []).append(r)
    out = []
    for (h, other, cache, prefill), group in sorted(groups.items()):
        group = sorted(group, key=lambda r: r[axis])
        xs = [float(r[axis]) for r in group]
        if len(set(xs)) < 3:
            continue
        rec: dict[str, Any] = {"heads": h, held: other, "cache_dtype": cache, "prefill_dtype": prefill,
                               "axis": axis, "tokens": [int(x) for x in xs]}
        for field, name in SERIES.items():
            if any(_value(r, field) is None for r in group):
                continue
            ys = [float(r[field]) for r in group]
            a, b = line(xs, ys)
            rec[f"{name}_ns_per_token"] = b * 1e9
            rec[f"{name}_fixed_ms"] = a * 1e3
            rec[f"{name}_neighbour_ns_per_token"] = [(y1 - y0) / (x1 - x0) * 1e9 for x0, x1, y0, y1
                                                     in zip(xs, xs[1:], ys, ys[1:]) if x1 > x0]
        if rec.get("floor_ns_per_token"):
            rec["fused_over_floor_growth"] = rec["fused_ns_per_token"] / rec["floor_ns_per_token"]
        out.append(rec)
    return out
