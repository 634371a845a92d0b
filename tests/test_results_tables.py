"""bench/results/: one JSON per benchmark, and the tables made from them (bench/make_tables.py).

The checked-in bench/results/README.md and the top-level README's results block are what the
JSON gives; every figure in that block is a field of its JSON; the folder holds exactly the
files make_tables lists, and scripts/gpu_run.sh writes them under those names."""

import json
import os
import re
import shutil
from pathlib import Path

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")


@pytest.fixture(scope="module")
def mt():
    import make_tables  # bench/ is on the path (conftest.py)

    return make_tables


def _readme() -> str:
    with open(os.path.join(ROOT, "README.md")) as f:
        return f.read()


def _block(text: str) -> str:
    return text.split("<!-- results:begin -->\n", 1)[1].split("<!-- results:end -->", 1)[0]


def test_results_readme_is_made_from_the_json(mt):
    with open(os.path.join(RESULTS, "README.md")) as f:
        assert f.read() == mt.results_readme(), "bench/results/README.md is stale: run python bench/make_tables.py"


def test_readme_block_is_made_from_the_json(mt):
    text = _readme()
    if "<!-- results:begin -->" not in text:
        pytest.skip("README.md has no <!-- results:begin --> / <!-- results:end --> lines yet")
    assert _block(text) == mt.readme_block(ROOT), "README.md's results block is stale: run " \
        "python bench/make_tables.py --readme README.md"
    assert mt.replace_block(text, mt.readme_block(ROOT)) == text


def _numbers(d) -> list[float]:
    if isinstance(d, dict):
        return [x for v in d.values() for x in _numbers(v)]
    if isinstance(d, list):
        return [x for v in d for x in _numbers(v)]
    return [float(d)] if isinstance(d, (int, float)) and not isinstance(d, bool) else []


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _check_figures(block: str, base: str) -> None:
    """Each result cell's numbers, parsed back, are fields of the row's JSON (seconds shown as ms,
    rates in M/s, rounded as printed); its GPU, date and commit are the JSON's. ``base``: the
    directory the block's links are relative to."""
    lines = [x for x in block.splitlines() if x.startswith("| ")]
    assert _cells(lines[0]) == ["measured", "result", "GPU", "date", "commit", "data"]
    rows = lines[1:]  # the separator line starts "|-"
    assert 5 <= len(rows) <= 14
    for line in rows:
        measure, result, gpu, date, commit, data = _cells(line)
        (path,) = re.findall(r"\]\(((?:bench/)?results/[\w.-]+\.json)\)", data)
        with open(os.path.join(base, path)) as f:
            raw = f.read()
        values = _numbers(json.loads(raw))
        figures = re.findall(r"(?<![\w.])(\d+)(?:\.(\d+))?(?![\w.])", result)
        assert figures, line
        for whole, frac in figures:
            x, tol = float(f"{whole}.{frac or 0}"), 0.5 * 10.0 ** -len(frac) + 1e-9
            assert any(abs(v * s - x) <= tol for v in values for s in (1.0, 1e3, 1e-6)), \
                f"{x} ({measure}) is no field of {path}"
        assert gpu in raw and commit in raw and date in raw, line


def test_every_figure_in_the_readme_block_is_in_its_json(mt):
    text = _readme()
    for block in [mt.readme_block(ROOT)] + ([_block(text)] if "<!-- results:begin -->" in text else []):
        _check_figures(block, ROOT)


def test_cost_row_shows_the_growth_the_run_recorded(mt, tmp_path):
    """A scaling run that recorded its lines along context (``ctxprefill bench`` does): the
    README's cost row gives the fused and floor growth per token and the neighbours' range,
    each a field of the file; without them, the ends alone."""
    from ctxprefill_bench import growth

    res = tmp_path / "results"
    shutil.copytree(RESULTS, res)
    d = json.loads((res / "bench_engine_scaling.json").read_text())
    d.pop("growth", None)  # a file written without the fit
    (res / "bench_engine_scaling.json").write_text(json.dumps(d))
    row = next(x for x in mt.readme_block(str(tmp_path), results=str(res)).splitlines()
               if "bench_engine_scaling.json" in x)
    assert "ns a token" not in row
    d["growth"] = growth.growth(d["rows"])
    (res / "bench_engine_scaling.json").write_text(json.dumps(d))
    block = mt.readme_block(str(tmp_path), results=str(res))
    row = next(x for x in block.splitlines() if "bench_engine_scaling.json" in x)
    g = next(g for g in d["growth"] if g["heads"] == 16 and g["prefill_dtype"] == "bf16")
    nb = g["fused_neighbour_ns_per_token"]
    assert (f"{g['fused_ns_per_token']:.2f} against {g['floor_ns_per_token']:.2f} ns a token "
            f"({min(nb):.2f}–{max(nb):.2f} between neighbours)") in row
    _check_figures(block, str(tmp_path))


def test_results_folder_is_flat_and_listed(mt):
    names = set(os.listdir(RESULTS))
    assert all(os.path.isfile(os.path.join(RESULTS, n)) for n in names)
    plots = {p for b in mt.BENCHMARKS for p in b.plots}
    assert names == {f"{f}.json" for f in mt.files()} | plots | {"README.md"}
    assert len(names) <= 55
    for f in mt.files():  # every table can name its run
        run = mt.run_of(mt.load(f))
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", run["date"]) and run["commit"] != "?", f
        assert re.search(r"H100|H200", run["gpu"]), f  # a Hopper card the GPU machine lends


def test_gpu_run_writes_the_listed_files(mt):
    """Every step's JSON lands in $OUT under its name in bench/results, and every file there
    has a step that writes it."""
    with open(os.path.join(ROOT, "scripts", "gpu_run.sh")) as f:
        script = f.read()
    outs = re.findall(r'--out "\$OUT/([^"]+)\.json"', script)
    patterns = [re.compile(re.sub(r"\\\$\\\{[^}]*\\\}|\\\$\w+", ".+", re.escape(o)) + r"\Z") for o in outs]
    for f in mt.files():
        assert any(p.match(f) for p in patterns), f"gpu_run.sh writes no $OUT/{f}.json"
    for o, p in zip(outs, patterns):
        assert any(p.match(f) for f in mt.files()), f"gpu_run.sh writes $OUT/{o}.json, which make_tables lacks"
    for b in mt.BENCHMARKS:
        assert f"want {b.step} " in script or f"want {b.step};" in script, b.step


def test_check_fails_on_a_changed_figure(mt, tmp_path, capsys):
    res = tmp_path / "results"
    shutil.copytree(RESULTS, res)
    readme = tmp_path / "README.md"
    readme.write_text("# x\n\n<!-- results:begin -->\nold\n<!-- results:end -->\n\ntail\n")
    assert mt.main(["--check", "--results", str(res), "--readme", str(readme)]) == 1
    assert mt.main(["--results", str(res), "--readme", str(readme)]) == 0  # rewrites the block only
    text = readme.read_text()
    assert text.startswith("# x\n\n<!-- results:begin -->\n| measured |")
    assert text.endswith("<!-- results:end -->\n\ntail\n")
    assert "](results/bench_engine.json)" in text  # links relative to that README
    assert mt.main(["--check", "--results", str(res), "--readme", str(readme)]) == 0
    d = json.loads((res / "bench_engine.json").read_text())
    d["rows"][0]["fused_s"] *= 1.1
    (res / "bench_engine.json").write_text(json.dumps(d))
    capsys.readouterr()
    assert mt.main(["--check", "--results", str(res), "--readme", str(readme)]) == 1
    err = capsys.readouterr().err
    assert "README.md differs from the JSON" in err and str(readme) in err and str(res / "README.md") in err


def test_replace_block_needs_both_markers(mt):
    with pytest.raises(ValueError, match="results:begin"):
        mt.replace_block("# no markers\n", "x\n")
    with pytest.raises(ValueError, match="results:begin"):
        mt.replace_block("<!-- results:end -->\n<!-- results:begin -->\n", "x\n")


def test_first_copy_label_follows_the_probe(mt, tmp_path):
    """The extension path's first copy is labelled an upper bound only where the probe marked
    it at the end of the call that also launches the graph (files without the mark: older
    extensions), not where graph_launch returned the time the copies were queued."""
    res = tmp_path / "results"
    shutil.copytree(RESULTS, res)
    probe = json.loads((res / "probe_host.json").read_text())
    for mark, bound in (("the call's end, an upper bound", True), ("the copies queued", False), (None, True)):
        probe["meta"].pop("graph_first_copy", None)
        if mark is not None:
            probe["meta"]["graph_first_copy"] = mark
        (res / "probe_host.json").write_text(json.dumps(probe))
        block = mt.readme_block(str(tmp_path), results=str(res))
        row = next(line for line in block.splitlines() if line.startswith("| Host time of a request"))
        assert ("at most" in row) is bound, (mark, row)
        assert ("an upper bound" in mt.host_table(probe)) is bound, mark


def test_first_copy_comes_from_the_interleaved_rounds_where_recorded(mt, tmp_path):
    """The README's first copy is the median of the probe's interleaved in-place rounds where
    every row recorded them there (its first pass otherwise), and the host table gives them
    against the copying rounds."""
    res = tmp_path / "results"
    shutil.copytree(RESULTS, res)
    probe = json.loads((res / "probe_host.json").read_text())

    def row() -> str:
        (res / "probe_host.json").write_text(json.dumps(probe))
        block = mt.readme_block(str(tmp_path), results=str(res))
        return next(line for line in block.splitlines() if line.startswith("| Host time of a request"))

    first_pass = " / ".join(f"{r['graph_host_steps_us']['first copy']:.0f}" for r in probe["rows"])
    for r in probe["rows"]:
        r["replay_launch_rounds"].pop("in_place_first_copy_us", None)
    assert first_pass in row() and "median of the interleaved rounds" not in row()
    for i, r in enumerate(probe["rows"]):
        x = r["replay_launch_rounds"]
        x["in_place_first_copy_us"] = [900.0 + i, 11.0 + i, 12.0 + i]  # median 12 + i: one slow round left out
        x["copies_first_copy_us"] = [20.0, 21.0, 22.0]
        x["in_place_validate_us"] = x["copies_validate_us"] = [5.0, 6.0, 7.0]
    got = row()
    assert "median of the interleaved rounds in place" in got
    assert " / ".join(f"{12 + i}" for i in range(len(probe["rows"]))) in got
    assert "the call to its first copy 12.0 against 21.0 (validation 6.0 against 6.0)" in mt.host_table(probe)


def test_whole_request_rows_give_every_dtypes_graph_against_its_floor(mt, tmp_path):
    """The whole-request rows give the range of the CUDA graph's ratio to its floor over every
    cache and prefill dtype of that head count, and at the held GEMM rate where the run
    recorded it."""
    res = tmp_path / "results"
    shutil.copytree(RESULTS, res)
    d = json.loads((res / "bench_engine.json").read_text())
    at64k = [r for r in d["rows"] if r["heads"] == 16 and r["new"] == 1024 and r["context"] == 65536]
    ratios = [r["fused_graph_over_floor"] for r in at64k]
    for r in at64k:  # a run that did not record the held rate's ratio
        r.pop("fused_graph_over_sustained_floor", None)
    (res / "bench_engine.json").write_text(json.dumps(d))

    def row() -> str:
        return next(x for x in mt.readme_block(str(tmp_path), results=str(res)).splitlines()
                    if x.startswith("| Whole request, 16 heads"))

    assert f"as a CUDA graph {min(ratios):.2f}–{max(ratios):.2f}× the floor |" in row()
    for i, r in enumerate(at64k):
        r["fused_graph_over_sustained_floor"] = 0.5 + 0.1 * i
    (res / "bench_engine.json").write_text(json.dumps(d))
    assert f"× the floor (0.50–{0.5 + 0.1 * (len(at64k) - 1):.2f}× at the held GEMM rate)" in row()
    _check_figures(mt.readme_block(str(tmp_path), results=str(res)), str(tmp_path))


def test_host_row_and_tables_give_the_in_place_rounds_and_replay_modes(mt):
    """probe_host's interleaved rounds of in-place and copying replays reach the README's
    host row (their medians, ms) and its table; a graphs workload whose servers recorded
    their replays by mode says how many went in place."""
    import statistics

    probe = json.loads(Path(RESULTS, "probe_host.json").read_text())
    rounds = [r["replay_launch_rounds"] for r in probe["rows"]]
    row = next(x for x in mt.readme_block(ROOT, results=RESULTS).splitlines() if x.startswith("| Host time"))
    for x in rounds:
        assert (f"{statistics.median(x['in_place_outside_s']) * 1e3:.3f} against "
                f"{statistics.median(x['copies_outside_s']) * 1e3:.3f}") in row
    assert "A replay in place against one copying" in mt.host_table(probe)
    wl = json.loads(Path(RESULTS, "bench_model_workload_graphs.json").read_text())
    for r in wl["runs"]:  # a run that did not record them
        r["server"].pop("graph_replays", None)
    assert "replayed as CUDA graphs, per server" not in mt.model_workload_table(wl)
    for r in wl["runs"]:
        r["server"]["graph_replays"] = {"in_place": 976.0, "copying": 0.0}
    assert f"{wl['runs'][0]['heads']} heads" in mt.model_workload_table(wl).split("per server")[1]
    assert "976 / 0" in mt.model_workload_table(wl)
    # a configuration that failed is a row of its own, with its error
    assert "failed:" not in mt.model_workload_table(wl)
    wl["meta"]["failed"] = [{"heads": 128, "prefill_dtype": "bf16", "error": "RuntimeError: out of memory"}]
    assert "| 128 | bf16 | failed: RuntimeError: out of memory |" in mt.model_workload_table(wl)


def test_every_plot_shows_its_benchmarks_current_run(mt):
    """Each listed plot names, in its PNG text, the run it was drawn from: one of its
    benchmark's JSON files as they are now (a plot left from an earlier run fails)."""
    import plot_engine

    for b in (b for b in mt.BENCHMARKS if b.plots):
        runs = {plot_engine.run_line(mt.load(f)["meta"]) for f in b.files}
        for p in b.plots:
            got = plot_engine.png_run(os.path.join(RESULTS, p))
            assert got in runs, f"{p} shows {got!r}, not a current run of {b.files}: remake it (results README)"


def test_docs_cite_runs_that_bench_results_holds():
    """A benchmark figure in the docs names its commit, and that run is in bench/results (its
    JSON replaced, the figure must follow). RELIABILITY.md's figures are tests' output, not
    benchmarks'."""
    held = "".join(p.read_text() for p in Path(RESULTS).glob("*.json"))
    docs = ["README.md"] + [os.path.join("docs", n) for n in os.listdir(os.path.join(ROOT, "docs"))
                            if n.endswith(".md") and n != "RELIABILITY.md"]
    for doc in docs:
        with open(os.path.join(ROOT, doc)) as f:
            text = f.read()
        for m in re.finditer(r"commit[ `]*([0-9a-f]{7,40})\b", text):
            assert f'"{m.group(1)}' in held, f"{doc} cites commit {m.group(1)}, a run bench/results no longer holds"


def test_gemm_table_gives_every_tuning_configuration_where_kept(mt):
    """probe_gemm's rows with every Gluon configuration's rate: the table lists them by their
    changes to CONFIG (the A/B of a knob such as STORE_UNDER_MMA); rows without them, none."""
    d = mt.load("probe_gemm")
    bare = [{k: v for k, v in row.items() if k != "gluon_configs"} for row in d["rows"]]
    assert "Each configuration" not in mt.gemm_table(dict(d, rows=bare))
    r = dict(bare[0], gluon_tflops=600.0, gluon_configs=[
        {"change": {}, "s": 1e-4, "tflops": 600.04}, {"change": {"STORE_UNDER_MMA": True}, "s": 9e-5, "tflops": 640.0},
        {"change": {"BN": 128, "STAGES": 5}, "s": 1.1e-4, "tflops": 560.0}])
    text = mt.gemm_table(dict(d, rows=[r]))
    line = next(x for x in text.splitlines() if x.startswith("Each configuration"))
    assert f"H={r['heads']} {r['rows']:,} rows: defaults 600.0, STORE_UNDER_MMA=True 640.0, BN=128 STAGES=5 560.0" \
        in line, line
