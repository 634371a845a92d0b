"""bench/bench_concurrency.py against a CPU server (tiny shape, ~2 s of clients), and the
tables and plots of bench/make_tables.py and bench/plot_engine.py on small JSON files."""

import itertools
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def bench_mods(monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "bench"))
    import bench_concurrency
    import make_tables
    import plot_engine

    return bench_concurrency, make_tables, plot_engine


def _engine_json(path):
    """A small synthetic ``ctxprefill bench`` JSON: 2 H x 2 contexts x 2 dtype pairs, one skipped row."""
    rows = []
    for i, (h, ctx, cd, pd) in enumerate(itertools.product([16, 128], [8192, 65536], ["auto", "fp8"], ["bf16", "fp8"])):
        if i == 5:
            rows.append({"heads": h, "new": 1024, "context": ctx, "cache_dtype": cd, "prefill_dtype": pd,
                         "skipped": "budget: 1.0 s left, row predicted 3.0 s", "predicted_s": 3.0})
            continue
        tf = 1e-3 * (1 + i)
        # 0.1 tf outside the stages
        st = {"gather": 0.1 * tf, "kv_b_proj": 0.3 * tf, "pack": 0.1 * tf, "attention": 0.35 * tf,
              "merge": 0.05 * tf}
        rows.append({"heads": h, "new": 1024, "context": ctx, "cache_dtype": cd, "prefill_dtype": pd,
                     "chunks": ctx // 16384 or 1, "generic_s": 1.5 * tf, "fused_s": tf, "speedup": 1.5,
                     "floor_s": tf / 2, "fused_over_floor": 2.0, "generic_stage_s": {k: 1.5 * v for k, v in st.items()},
                     "fused_stage_s": st, "generic_launches": {"pack": 5, "gather": 1},
                     "fused_launches": {"pack": 1, "gather": 1}, "generic_launches_per_chunk": 9.0,
                     "fused_launches_per_chunk": 5.0, "bit_identical": i != 3})
    meta = {"kind": "engine", "date": "2026-11-30T12:00:00+00:00", "gpu": "NVIDIA H200", "torch": "2.11.0+cu130",
            "commit": "abc1234", "ceilings": {"copy_bytes_per_s": 4.2e12, "matmul_flops_per_s": 8e14}}
    path.write_text(json.dumps({"meta": meta, "rows": rows}))
    return path


def test_concurrency_smoke_cpu(tmp_path, bench_mods, capsys):
    bc, mt, _ = bench_mods
    out = tmp_path / "conc.json"
    rc = bc.main(["--device", "cpu", "--shape", "2:4:200", "--clients", "1", "2", "--seconds", "0.8",
                  "--warmup-s", "0.2", "--workspace-tokens", "128", "--out", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    d = json.loads(out.read_text())
    m = d["meta"]
    assert m["kind"] == "concurrency" and m["spawned_servers"] and m["queue_size"] == 64 and m["torch"]
    assert m["device"] == "cpu" and m["client_mode"] == "threads" and m["date"] and "commit" in m
    (srv,) = m["servers"]
    assert srv["flags"]["queue_size"] == 64 and srv["heads"] == 2 and srv["num_blocks"] >= 4
    assert [r["clients"] for r in d["rows"]] == [1, 2]
    for r in d["rows"]:
        assert r["requests"] > 0 and r["errors"] == {} and r["requests_per_s"] > 0
        assert r["context_tokens_per_s"] == pytest.approx(r["requests_per_s"] * 200)
        assert r["query_tokens_per_s"] == pytest.approx(r["requests_per_s"] * 4)
        assert r["chunks"] == 2 and r["path"] in ("fused", "generic")
        for k in ("latency_ms", "server_total_ms", "server_compute_ms"):
            assert 0 < r[k]["p50"] <= r[k]["p90"] <= r[k]["p99"] <= r[k]["max"]
        assert r["server_compute_ms"]["p50"] <= r["server_total_ms"]["p50"] <= r["latency_ms"]["max"]
    assert "req/s" in printed and "H=2 4/200 auto/bf16" in printed
    assert m["transports"] == ["inline"] and "shared_memory" not in srv["flags"]
    assert all(r["transport"] == "inline" for r in d["rows"])
    table = mt.table(d)
    assert "| H=2 4/200 auto/bf16 | inline | 2 |" in table and "cpu" in table.splitlines()[0]


def _shm_files() -> set:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def test_concurrency_transports_inline_and_system_cpu(tmp_path, bench_mods, capsys):
    """--transport inline system: the server gets --shared-memory system; every client
    registers its own segment, q goes in by reference and output/LSE come back in it;
    each row names its transport; the segments are gone afterwards."""
    bc, mt, _ = bench_mods
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    before = _shm_files()
    out = tmp_path / "conc.json"
    rc = bc.main(["--device", "cpu", "--shape", "2:4:200", "--clients", "1", "2", "--seconds", "0.7",
                  "--warmup-s", "0.2", "--workspace-tokens", "128", "--transport", "inline", "system",
                  "--out", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    d = json.loads(out.read_text())
    m = d["meta"]
    assert m["transports"] == ["inline", "system"] and m["transport_skipped"] == {} and m["shared_memory"] == "system"
    (srv,) = m["servers"]
    assert srv["flags"]["shared_memory"] == "system" and srv["shared_memory_kinds"] == ["system"]
    by = {(r["transport"], r["clients"]): r for r in d["rows"]}
    assert sorted(by) == [("inline", 1), ("inline", 2), ("system", 1), ("system", 2)] and len(d["rows"]) == 4
    for (tr, _n), r in by.items():
        assert "skipped" not in r, r
        assert r["requests"] > 0 and r["requests_per_s"] > 0 and r["errors"] == {} and r["setup_errors"] == 0
        assert r["context_tokens_per_s"] == pytest.approx(r["requests_per_s"] * 200)
        assert r["server_compute_ms"]["p50"] > 0 and r["chunks"] == 2
        assert r["float_output"] is (tr == "inline")
        assert r["client_setup_s_max"] is not None
    assert all(by[("system", n)]["check_matches_inline"] is True for n in (1, 2))
    assert "check_matches_inline" not in by[("inline", 1)]
    lines = printed.splitlines()
    assert any("H=2 4/200 auto/bf16" in x and " system " in x for x in lines)
    assert any("H=2 4/200 auto/bf16" in x and " inline " in x for x in lines)
    table = mt.table(d)
    assert "| H=2 4/200 auto/bf16 | system | 2 |" in table and "| H=2 4/200 auto/bf16 | inline | 1 |" in table
    assert _shm_files() <= before  # every client's segment unlinked


@pytest.mark.parametrize("flag,key,tag", [("--stream-depth", "stream_depth", "s"), ("--ring-depth", "ring_depth", "r")],
                         ids=["stream", "ring"])
def test_concurrency_two_in_flight_cpu(tmp_path, bench_mods, capsys, flag, key, tag):
    """--stream-depth 2: every client keeps two requests in flight on one
    PrefillContextStream; --ring-depth 2: through a request ring of two slots (started
    servers get --request-ring and system shared memory; inline q fits its slots too).
    The rows say so and count answers, not calls."""
    bc, _, _ = bench_mods
    out = tmp_path / "conc.json"
    rc = bc.main(["--device", "cpu", "--shape", "2:4:200", "--clients", "1", "2", "--seconds", "0.7",
                  "--warmup-s", "0.2", "--workspace-tokens", "128", "--transport", "inline", "system",
                  flag, "2", "--out", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    d = json.loads(out.read_text())
    assert d["meta"]["shared_memory"] == "system"
    rows = d["rows"]
    assert len(rows) == 4
    for r in rows:
        assert "skipped" not in r, r
        assert r[key] == 2 and r["requests"] > 0 and r["errors"] == {} and r["setup_errors"] == 0
        assert r["server_compute_ms"]["p50"] > 0
    assert any(f" system/{tag}2 " in x for x in printed.splitlines())
    assert any(f" inline/{tag}2 " in x for x in printed.splitlines())


def test_concurrency_cuda_transport_skipped_without_cuda(tmp_path, bench_mods):
    """cuda cannot run against a CPU server: skipped with the reason, no server started."""
    bc, mt, _ = bench_mods
    out = tmp_path / "conc.json"
    rc = bc.main(["--device", "cpu", "--shape", "2:4:64", "--clients", "1", "2", "--seconds", "0.5",
                  "--workspace-tokens", "128", "--transport", "cuda", "--out", str(out)])
    d = json.loads(out.read_text())
    assert rc == 0 and d["meta"]["servers"] == [] and d["meta"]["shared_memory"] is None
    assert d["meta"]["transport_skipped"] == {"cuda": "started servers run on --device cpu"}
    assert [(r["transport"], r["clients"], r["skipped"]) for r in d["rows"]] == [
        ("cuda", 1, "started servers run on --device cpu"), ("cuda", 2, "started servers run on --device cpu")]
    assert "| H=2 4/64 auto/bf16 | cuda | 1 | skipped (started servers run on --device cpu) |" in mt.table(d)


def test_cuda_index(bench_mods):
    bc, _, _ = bench_mods
    assert bc.cuda_index("cuda:1 (NVIDIA H200)") == 1 and bc.cuda_index("cuda (NVIDIA H200)") == 0
    assert bc.cuda_index("cpu") is None


def test_concurrency_budget_skips_levels(tmp_path, bench_mods):
    bc, _, _ = bench_mods
    out = tmp_path / "conc.json"
    rc = bc.main(["--device", "cpu", "--shape", "2:4:64", "--clients", "1", "4", "--seconds", "30",
                  "--workspace-tokens", "128", "--budget-s", "25", "--out", str(out)])
    d = json.loads(out.read_text())
    assert rc == 0  # skipped is not failed; no server was started for nothing
    assert [r.get("skipped", "")[:7] for r in d["rows"]] == ["budget:", "budget:"] and d["meta"]["servers"] == []


def test_summarize_window_and_errors(bench_mods):
    bc, _, _ = bench_mods
    recs = [(0.0, 0.5, "", 4e8, 3e8, 100, 4),  # before the window: not counted
            (0.5, 1.5, "", 9e8, 5e8, 100, 4), (1.5, 2.0, "", 4e8, 3e8, 100, 4),
            (2.0, 2.1, "RESOURCE_EXHAUSTED", 0, 0, 0, 0), (2.1, 3.5, "", 4e8, 3e8, 100, 4)]  # last: after the end
    s = bc.summarize([{"records": recs, "first_errors": ["x"]}], 1.0, 3.0)
    assert s["requests"] == 2 and s["requests_per_s"] == 1.0 and s["context_tokens_per_s"] == 100.0
    assert s["errors"] == {"RESOURCE_EXHAUSTED": 1} and s["errors_in_window"] == 1
    assert s["latency_ms"]["p50"] == pytest.approx(500.0) and s["latency_ms"]["p99"] == pytest.approx(1000.0)
    assert s["device_busy_fraction"] == pytest.approx(0.4)


def test_engine_table(tmp_path, bench_mods):
    _, mt, _ = bench_mods
    d = json.loads(_engine_json(tmp_path / "engine.json").read_text())
    t = mt.engine_table(d)
    lines = t.splitlines()
    assert lines[0] == "_2026-11-30 · NVIDIA H200 · torch 2.11.0+cu130 · commit abc1234_"
    assert "800 TFLOP/s" in t and "4.20 TB/s" in t
    rows = [x for x in lines if x.startswith("| 16") or x.startswith("| 128")]
    assert len(rows) == 15
    assert rows[0] == "| 16 | 1024 | 8k | auto | bf16 | 1 | 1.50 | 1.00 | **1.50** | 0.50 | 2.00 | 0.10 | 9 → 5 | yes |"
    assert "**NO**" in rows[3]
    assert any("H=16, 1024 new over 64k, auto/fp8: skipped (budget" in x for x in lines)


def test_engine_table_with_unpacked_keys(bench_mods):
    """A run with unpacked keys gets a "fused + K pack" column (n/a on rows that pack);
    the recorded headline run (bench/results/bench_engine.json) makes that table, its figures as recorded."""
    _, mt, _ = bench_mods
    path = os.path.join(ROOT, "bench", "results", "bench_engine.json")
    with open(path) as fh:
        run = json.load(fh)
    t = mt.table(run)
    assert "| generic ms | fused + K pack ms | fused ms |" in t
    by_key = {(r["heads"], r["cache_dtype"], r["prefill_dtype"]): r for r in run["rows"]}
    for (h, cache, prefill), r in by_key.items():
        packed = f"{r['fused_packed_s'] * 1e3:.2f}" if r.get("fused_packed_s") else "n/a"
        cells = f"| {h} | 1024 | 64k | {cache} | {prefill} | {r['chunks']} | {r['generic_s'] * 1e3:.2f} | {packed} | "
        assert cells + f"{r['fused_s'] * 1e3:.2f} |" in t, cells
    assert any(r.get("fused_packed_s") for r in run["rows"]) and not all(r.get("fused_packed_s") for r in run["rows"])


def test_engine_table_of_the_recorded_run(bench_mods):
    """The recorded 108-row grid (bench/results/bench_engine_full.json) has no ``fused_host_gap_s``:
    its table takes the gap as the request time above the sum of the stages."""
    _, mt, _ = bench_mods
    path = os.path.join(ROOT, "bench", "results", "bench_engine_full.json")
    with open(path) as fh:
        d = json.load(fh)
    assert not any("fused_host_gap_s" in r for r in d["rows"])
    t = mt.table(d)
    assert "| 128 | 1024 | 64k | fp8 | fp8 | 4 | 26.14 | 16.08 | **1.63** | 11.34 | 1.42 | 1.31 | 10 → 6 | yes |" in t


def test_plots(tmp_path, bench_mods):
    pytest.importorskip("matplotlib")
    bc, _, pe = bench_mods
    eng = _engine_json(tmp_path / "engine.json")
    written = pe.plot_file(str(eng), str(tmp_path / "png"))
    names = sorted(os.path.basename(p) for p in written)
    assert names == ["engine_latency.png", "engine_speedup.png", "engine_stages.png", "engine_stages_grid.png"]
    conc = {"meta": {"kind": "concurrency", "date": "2026-11-30", "gpu": None, "device": "cpu", "torch": "2.13",
                     "commit": "abc", "client_mode": "threads", "queue_size": 64},
            "rows": [{"shape_label": "H=16 1024/65536 auto/bf16", "clients": c, "requests_per_s": 10.0 * c,
                      "context_tokens_per_s": 6.5e5 * c, "latency_ms": {"p50": 5.0 * c, "p99": 9.0 * c},
                      "server_compute_ms": {"p50": 3.0}} for c in (1, 2, 4)]
            + [{"shape_label": "H=16 1024/65536 auto/bf16", "transport": "cuda", "clients": c,
                "requests_per_s": 40.0 * c, "context_tokens_per_s": 2.6e6 * c,
                "latency_ms": {"p50": 2.0 * c, "p99": 3.0 * c}, "server_compute_ms": {"p50": 3.0}} for c in (1, 2, 4)]}
    (tmp_path / "conc.json").write_text(json.dumps(conc))
    written = pe.plot_file(str(tmp_path / "conc.json"), str(tmp_path / "png"))
    assert [os.path.basename(p) for p in written] == ["concurrency.png"]
    assert pe.png_run(written[0]) == "2026-11-30 · cpu · torch 2.13 · commit abc"  # the run, in the PNG
    # new tokens as the grid's axis: latency against them; --only keeps the one asked for
    d = json.loads(eng.read_text())
    d["rows"] = [{**r, "new": 128 if r["context"] == 8192 else 1024, "context": 65536} for r in d["rows"]]
    (tmp_path / "new.json").write_text(json.dumps(d))
    written = pe.plot_file(str(tmp_path / "new.json"), str(tmp_path / "only"), ["engine_latency_new.png"])
    assert written == [str(tmp_path / "only" / "engine_latency_new.png")]
    assert os.listdir(tmp_path / "only") == ["engine_latency_new.png"]
    for p in os.listdir(tmp_path / "png"):
        assert os.path.getsize(tmp_path / "png" / p) > 10_000
    assert pe.run_line(conc["meta"]) == "2026-11-30 · cpu · torch 2.13 · commit abc"


def test_plot_without_matplotlib_skips(tmp_path, bench_mods, monkeypatch, capsys):
    _, _, pe = bench_mods
    eng = _engine_json(tmp_path / "engine.json")
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert pe.main([str(eng), "--out-dir", str(tmp_path / "png")]) == 0
    assert "matplotlib is not installed" in capsys.readouterr().err
    assert not (tmp_path / "png").exists()
