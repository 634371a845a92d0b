"""ctxprefill_bench/growth.py: the lines fitted to a bench grid's rows along context."""

import pytest

from ctxprefill_bench import growth


def _row(heads, context, fused, floor, prefill="bf16", new=1024, **kw):
    return dict(heads=heads, new=new, context=context, cache_dtype="auto", prefill_dtype=prefill, fused_s=fused,
                floor_s=floor, **kw)


def test_a_line_is_recovered_and_a_step_shows_between_neighbours():
    # fused: 0.2 ms + 30 ns a token, with a 1 ms step past 64k; floor: 20 ns a token
    ctx = [8192, 32768, 65536, 131072, 262144]
    rows = [_row(16, c, 2e-4 + 30e-9 * c + (1e-3 if c > 65536 else 0.0), 20e-9 * c) for c in ctx]
    rows.append(_row(16, 8192, 1.0, 1.0, new=512))  # another group, too few lengths: no line
    (g,) = growth.growth(rows)
    assert (g["heads"], g["new"], g["tokens"]) == (16, 1024, ctx)
    assert g["floor_ns_per_token"] == pytest.approx(20.0) and g["floor_fixed_ms"] == pytest.approx(0.0, abs=1e-9)
    nb = g["fused_neighbour_ns_per_token"]
    assert nb[0] == pytest.approx(30.0) and nb[1] == pytest.approx(30.0) and nb[3] == pytest.approx(30.0)
    assert nb[2] == pytest.approx(30.0 + 1e-3 / 65536 * 1e9)  # the step, between 64k and 128k
    assert g["fused_over_floor_growth"] == pytest.approx(g["fused_ns_per_token"] / 20.0)


def test_the_graph_is_fitted_where_every_row_has_one():
    ctx = [1000, 2000, 4000]
    with_graph = [_row(128, c, 1e-6 * c, None, fused_graph_s=5e-7 * c + 1e-4) for c in ctx]
    (g,) = growth.growth(with_graph)
    assert g["graph_ns_per_token"] == pytest.approx(500.0) and g["graph_fixed_ms"] == pytest.approx(0.1)
    assert "floor_ns_per_token" not in g and "fused_over_floor_growth" not in g
    with_graph[1].pop("fused_graph_s")
    (g,) = growth.growth(with_graph)
    assert "graph_ns_per_token" not in g and g["fused_ns_per_token"] == pytest.approx(1000.0)


def test_a_line_along_new_tokens_holds_the_context():
    rows = [_row(16, 65536, 1e-3 + 2e-6 * n, 1e-6 * n, new=n) for n in (128, 1024, 4096)]
    rows.append(_row(16, 8192, 1.0, 1.0, new=128))  # another context, one point: no line
    (g,) = growth.growth(rows, "new")
    assert (g["axis"], g["context"], g["tokens"]) == ("new", 65536, [128, 1024, 4096])
    assert g["fused_ns_per_token"] == pytest.approx(2000.0) and g["fused_fixed_ms"] == pytest.approx(1.0)
    assert g["fused_over_floor_growth"] == pytest.approx(2.0)
