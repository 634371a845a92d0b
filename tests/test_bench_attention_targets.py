"""bench_attention.py's attention verdict lines, on the CPU: the thresholds are applied to the
right provider, dtype and shapes, and a miss reads as a miss."""

from __future__ import annotations

import functools
import json
import os
import sys
import types

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
ba = pytest.importorskip("bench_attention")


def _rec(H, case, provider, dtype, tflops, causal=False):
    return dict(H=H, case=case, provider=provider, dtype=dtype, causal=causal, tflops=tflops, ms=1.0)


def test_target_lines_pass_and_miss():
    res = [
        _rec(16, "1x8192q/16384k", "triton", "bf16", 640.0),
        _rec(16, "1x8192q/16384k", "triton", "bf16", 100.0, causal=True),  # causal rows are not the target
        _rec(16, "4x1024q/16384k", "triton", "bf16", 600.0),
        _rec(16, "ragged4", "triton", "bf16", 530.0),  # 0.883 of equal lengths: a miss
        _rec(16, "1x8192q/16384k", "triton pv_fp8 v-keys-last", "fp8", 849.0),  # a miss
        _rec(16, "1x8192q/16384k", "flashinfer fa3", "bf16", 600.0),  # another library: compared, not ours
        _rec(16, "4x1024q/16384k", "flashinfer fa3", "bf16", 580.0),  # 1.034: short of 1.05
        _rec(16, "ragged4", "flashinfer fa3", "fp8", 1.0),  # fp8 FlashInfer: no comparison line
        dict(H=16, case="ragged4", provider="triton", dtype="fp8", error="x"),  # no figure: no line
    ]
    lines = dict(ba.target_lines(res))
    assert len(lines) == 6, lines
    assert lines["H=16 bf16 1x8192q/16384k: 640.0 TFLOP/s (>= 600: True)"] is True
    assert lines["H=16 bf16 ragged4 / 4x1024q/16384k: 0.883 (>= 0.9: False)"] is False
    assert lines["H=16 fp8 1x8192q/16384k: 849.0 TFLOP/s (>= 850: False)"] is False
    assert lines["H=16 bf16 1x8192q/16384k ours / FlashInfer FA3: 1.067 (>= 1.05: True)"] is True
    assert lines["H=16 bf16 4x1024q/16384k ours / FlashInfer FA3: 1.034 (>= 1.05: False)"] is False
    assert lines["H=16 fp8 1x8192q/16384k: 849.0 TFLOP/s (>= 1000: False)"] is False


def test_interleaved_rounds_decide_the_ratio():
    """Where the interleaved rounds ran, their median ratio is the verdict, not the table's
    two rows (which here would miss)."""
    res = [
        _rec(16, "4x1024q/16384k", "triton", "bf16", 650.0),
        _rec(16, "ragged4", "triton", "bf16", 580.0),  # 0.892 from the table rows
        dict(H=16, dtype="bf16", provider="triton", verdict="ragged4 / 4x1024q/16384k", rounds=5, ratio_median=0.95,
             ratio_min=0.91, ratio_max=0.99, tflops_ragged=[1.0], tflops_equal=[1.0]),
        dict(H=128, dtype="fp8", provider="triton pv_fp8 v-keys-last", verdict="ragged4 / 4x1024q/16384k", rounds=3,
             ratio_median=0.85, ratio_min=0.8, ratio_max=0.9, tflops_ragged=[1.0], tflops_equal=[1.0]),
        # ours over FlashInfer: the table's rows say 1.083, the interleaved rounds' median 1.02 decides
        _rec(16, "4x1024q/16384k", "flashinfer fa3", "bf16", 600.0),
        dict(H=16, case="4x1024q/16384k", dtype="bf16", provider="triton", verdict="ours / flashinfer fa3", rounds=5,
             ratio_median=1.02, ratio_min=0.99, ratio_max=1.06, tflops_ours=[1.0], tflops_theirs=[1.0]),
    ]
    lines = dict(ba.target_lines(res))
    assert lines == {
        "H=16 bf16 ragged4 / 4x1024q/16384k: 0.950 (median of 5 interleaved rounds, 0.910-0.990) (>= 0.9: True)": True,
        "H=128 fp8 ragged4 / 4x1024q/16384k: 0.850 (median of 3 interleaved rounds, 0.800-0.900) (>= 0.9: False)":
            False,
        "H=16 bf16 4x1024q/16384k ours / FlashInfer FA3: 1.020 (median of 5 interleaved rounds, 0.990-1.060) "
        "(>= 1.05: False)": False,
    }


def test_recorded_verdict_recomputes():
    """The verdict recorded with the H200 run in bench/results/bench_attention.json (every
    provider) is what ``target_lines`` computes again from that run's records."""
    path = os.path.join(ROOT, "bench", "results", "bench_attention.json")
    with open(path) as f:
        d = json.load(f)
    again = [dict(line=line, met=met) for line, met in ba.target_lines(d["results"])]
    assert again == d["meta"]["targets"]
    # 2 head counts x (2 dtypes x (rate, ragged/equal) + fp8's frontier); with FlashInfer, 4 shapes each
    assert len(again) == (18 if d["meta"].get("flashinfer") else 10)


def test_interleaved_rounds_alternate_and_take_the_median_ratio(monkeypatch):
    """``_interleaved`` measures the two calls in turn, round after round, and keeps the
    median, least and largest per-round ratio (not a ratio of medians)."""
    order = []
    times = iter([1.0, 2.0, 1.0, 1.0, 2.0, 1.0])  # ms: num, den, num, den, ...

    def fake_bench_ms(fn, rep):
        order.append(fn())
        return next(times)

    monkeypatch.setattr(ba, "bench_ms", fake_bench_ms)
    rec = {}
    args = types.SimpleNamespace(verdict_rounds=3, rep=1)
    ba._interleaved(rec, "a / b", lambda: (("tflops_a", (lambda: "a", 4.0)), ("tflops_b", (lambda: "b", 4.0))), args)
    assert order == ["a", "b"] * 3
    assert rec["tflops_a"] == [4.0, 4.0, 2.0] and rec["tflops_b"] == [2.0, 4.0, 4.0]
    assert (rec["ratio_min"], rec["ratio_median"], rec["ratio_max"]) == (0.5, 1.0, 2.0) and "error" not in rec
    failed = ba._interleaved({}, "a / b", lambda: 1 / 0, args)  # a call that cannot be made: recorded
    assert failed == {"error": "ZeroDivisionError: division by zero"}


def test_a_third_call_is_measured_in_the_same_rounds_outside_the_ratio(monkeypatch):
    """A GEMM beside ours and FA3 (``tflops_gemm``) runs in every round, after the two, and
    the ratio stays the first over the second."""
    order = []
    times = iter([1.0, 2.0, 4.0, 1.0, 1.0, 2.0])  # ms: ours, theirs, gemm, ours, theirs, gemm

    def fake_bench_ms(fn, rep):
        order.append(fn())
        return next(times)

    monkeypatch.setattr(ba, "bench_ms", fake_bench_ms)
    rec: dict = {}
    args = types.SimpleNamespace(verdict_rounds=2, rep=1)
    ba._interleaved(rec, "o / t", lambda: (("tflops_ours", (lambda: "o", 4.0)), ("tflops_theirs", (lambda: "t", 4.0)),
                                           ("tflops_gemm", (lambda: "g", 8.0))), args)
    assert order == ["o", "t", "g"] * 2
    assert rec["tflops_gemm"] == [2.0, 4.0] and (rec["ratio_min"], rec["ratio_max"]) == (1.0, 2.0)


def test_the_ahead_line_says_where_the_target_stands_against_the_gemm():
    """Rounds that ran a GEMM beside ours and FA3 add 1.05 x FA3's median over the GEMM's to
    the verdict line (the line, and whether it is met, stay the ratio's); the table gets the
    two columns; without a GEMM neither changes."""
    import make_tables

    rounds = dict(H=16, case="4x1024q/16384k", dtype="bf16", provider="triton", verdict=ba.FLASHINFER_VERDICT,
                  rounds=3, ratio_median=1.02, ratio_min=0.99, ratio_max=1.06, tflops_ours=[700.0] * 3,
                  tflops_theirs=[680.0, 700.0, 720.0], tflops_gemm=[760.0, 750.0, 740.0], gemm_n=8192)
    (line, met), = ba.target_lines([rounds])
    assert met is False and line.startswith("H=16 bf16 4x1024q/16384k ours / FlashInfer FA3: 1.020 (median of 3 ")
    assert line.endswith("(>= 1.05: False); 1.05 x theirs = 735.0 TFLOP/s, 0.980 x the 8192^3 GEMM's 750.0 "
                         "in those rounds")
    bare = {k: v for k, v in rounds.items() if k not in ("tflops_gemm", "gemm_n")}
    assert ba.target_lines([bare])[0][0] == line.split("; 1.05 x")[0]
    d = dict(meta=dict(device="GPU", date="2026-12-08T00:00:00+00:00", commit="abc", flops_rule="r"), results=[rounds])
    table = make_tables.attention_table(d)
    assert "| 16 | 4x1024q/16384k | 3 | 700.0 | 700.0 | 1.020 | 0.990 | 1.060 | 750.0 | 0.980 |" in table
    assert "GEMM" not in make_tables.attention_table(dict(d, results=[bare]))
    assert make_tables._ahead_of_flashinfer(d).endswith(
        "16 heads 1.020–1.020; an 8192³ GEMM in the same rounds 750.0–750.0, 1.05 × FA3 0.980–0.980 of it")
    assert "GEMM" not in make_tables._ahead_of_flashinfer(dict(d, results=[bare]))


def test_the_key_scan_fit_carries_the_gemm_of_its_rounds():
    """The key scan's GEMM (measured in its rounds) is the median over all of them, and its
    table gives each key loop's rate over it."""
    import make_tables

    rounds = [dict(keys=k, tflops_ours=[600.0 + k / 1024] * 3, tflops_theirs=[590.0] * 3,
                   tflops_gemm=[g, g + 10.0, g + 20.0]) for k, g in zip(ba.KEY_SCAN, (700.0, 740.0, 760.0, 780.0))]
    fit = ba.key_scan_fit(rounds, 16)
    assert fit["gemm_tflops"] == 760.0  # the median of the 12 rounds' GEMMs
    d = dict(meta=dict(device="GPU", date="2026-12-08T00:00:00+00:00", commit="abc", flops_rule="r"),
             results=[dict(fit=fit)])
    table = make_tables.attention_table(d)
    assert f"| 760.0 | {fit['theirs']['rate_tflops'] / 760.0:.3f} |" in table
    assert "gemm_tflops" not in ba.key_scan_fit([{k: v for k, v in r.items() if k != "tflops_gemm"} for r in rounds],
                                                16)


def test_the_rounds_against_flashinfer_time_the_gemm_in_each_round(monkeypatch):
    """flashinfer_rounds and run_key_scan run the GEMM (made once) after ours and FA3 in
    every round, and record it beside them (the key scan's fit carries its median)."""
    made, order, keys = [], [], [1]

    class Data:
        _d: dict = {}

        def get(self, H, name, ql, kl):
            keys[0] = kl[0]  # the kernels' time grows with the keys (the scan fits a line)
            return {"bf16": (None, None, None), "cq": None, "ck": None}

    def gemm(n=ba.GEMM_CEILING_N):
        made.append(n)
        return (lambda: order.append("gemm")), 1.0

    def kernel(who):
        return lambda *a, **k: (lambda: order.append(who))

    ms = {"ours": lambda: keys[0] / 4096, "theirs": lambda: keys[0] / 4096 + 1, "gemm": lambda: 2.0}
    monkeypatch.setattr(ba, "Inputs", Data)
    monkeypatch.setattr(ba, "gemm_ceiling", functools.cache(gemm))
    monkeypatch.setattr(ba, "prov_triton", kernel("ours"))
    monkeypatch.setattr(ba, "prov_flashinfer", kernel("theirs"))
    monkeypatch.setattr(ba, "bench_ms", lambda fn, rep: (fn(), ms[order[-1]]())[1])
    args = types.SimpleNamespace(heads=[16], verdict_rounds=2, rep=1, budget_s=1e9)
    out = ba.run_key_scan(args)
    scan, fit = out[:-1], out[-1]["fit"]
    assert len(scan) == len(ba.KEY_SCAN) and all(r["tflops_gemm"] == [0.5, 0.5] for r in scan)
    assert order[-6:] == ["ours", "theirs", "gemm"] * 2 and fit["gemm_tflops"] == 0.5
    provs = [(None, "triton", "bf16", False, kernel("ours")), (None, "flashinfer fa3", "bf16", False, kernel("theirs"))]
    order.clear()
    rec, = ba.flashinfer_rounds(args, Data(), provs, [(16, ("1x1024q/16384k", [1024], [16384]))])
    assert order == ["ours", "theirs", "gemm"] * 2 and rec["tflops_gemm"] == [0.5, 0.5] and rec["gemm_n"] == 8192
    assert made == [ba.GEMM_CEILING_N]


def test_the_tables_read_the_rounds_the_bench_writes():
    """make_tables picks the FlashInfer rounds by the verdict bench_attention writes."""
    import make_tables

    assert make_tables.FLASHINFER_VERDICT == ba.FLASHINFER_VERDICT
    assert make_tables.KEY_SCAN_VERDICT == ba.KEY_SCAN_VERDICT != ba.FLASHINFER_VERDICT
    assert make_tables.AHEAD_OF_FLASHINFER == ba.AHEAD_OF_FLASHINFER


def test_the_key_scan_is_its_own_table_and_not_a_verdict():
    """--key-scan's records, after the table's: their fit is a table of its own, and their
    rounds are neither the ragged verdict nor the FlashInfer rounds of the targets."""
    import json

    import make_tables

    with open(os.path.join(ROOT, "bench", "results", "bench_attention.json")) as fh:
        d = json.load(fh)
    # the stored run without a key scan of its own, if it has one
    d["results"] = [r for r in d["results"] if "fit" not in r and r.get("verdict") != ba.KEY_SCAN_VERDICT]
    before = make_tables.attention_table(d)
    targets = ba.target_lines(d["results"])
    rounds = [dict(H=16, case=f"1x8192q/{k}k", keys=k, dtype="bf16", verdict=ba.KEY_SCAN_VERDICT, rounds=3,
                   tflops_ours=[600.0] * 3, tflops_theirs=[650.0] * 3, ratio_median=0.5, ratio_min=0.25,
                   ratio_max=0.75) for k in ba.KEY_SCAN]
    fit = ba.key_scan_fit(rounds, 16)
    d["results"] += [*rounds, dict(fit=fit)]
    table = make_tables.attention_table(d)
    assert "Where a launch's time goes" not in before and "Where a launch's time goes" in table
    assert f"| 16 | ours | {fit['ours']['rate_tflops']:.1f} | {fit['ours']['fixed_ms']:.3f} |" in table
    assert f"| 16 | FlashInfer FA3 | {fit['theirs']['rate_tflops']:.1f} |" in table
    assert "| 0.500 | 0.250 | 0.750 |" not in table and ba.target_lines(d["results"]) == targets


def test_run_ab_alternates_and_takes_the_median_ratio(monkeypatch):
    """--ab: per shape and dtype, B and A measured in turn (B first) for the given rounds,
    the median of the per-round ratios B / A recorded; one that does not run is an error
    record, not a stop."""
    calls = []
    speed = {"a": [2.0, 2.0, 2.0], "b": [1.0, 1.8, 1.5]}  # ms per round: B / A = 2.0, 1.11, 1.33

    class Data:
        def get(self, H, name, ql, kl):
            return {"bf16": (None, None, None), "fp8": (None, None, None), "cq": None, "ck": None}

    def prov(*args, config=None):
        tag = config["tag"]
        if tag == "broken":
            raise RuntimeError("no such config")
        # (out, lse) as the backend returns them: the same for A and B
        return lambda: (calls.append(tag), (torch.ones(2), torch.zeros(2)))[1]

    def bench_ms(fn, rep):
        fn()
        tag = calls[-1]
        n = sum(1 for c in calls if c == tag) - 2  # the first call of each is the untimed warm-up
        return speed[tag][n]

    monkeypatch.setattr(ba, "Inputs", Data)
    monkeypatch.setattr(ba, "prov_triton", prov)
    monkeypatch.setattr(ba, "bench_ms", bench_ms)
    monkeypatch.setitem(ba.AB, "t", ([("bf16", {"tag": "a"}, {"tag": "b"}), ("fp8", {"tag": "a"}, {"tag": "broken"})],
                                     [(16, "1x1024q/16384k")]))
    args = types.SimpleNamespace(ab="t", heads=[16], verdict_rounds=3, rep=10, budget_s=1e9)
    bf16, fp8 = ba.run_ab(args)
    assert calls[:2] == ["b", "a"] and calls[2::2] == ["b"] * 3 and calls[3::2] == ["a"] * 3
    assert bf16["ratio_median"] == pytest.approx(4 / 3) and bf16["ratio_min"] == pytest.approx(10 / 9)
    assert bf16["config_b"] == {"tag": "b"} and len(bf16["tflops_b"]) == 3 and bf16["same_bits"] is True
    assert "no such config" in fp8["error"]


def test_run_ab_records_whether_b_gives_a_s_bits(monkeypatch):
    """--ab records ``same_bits``: B's output and LSE equal to A's, compared once before the rounds."""
    lse = {"a": torch.zeros(2), "b": torch.tensor([0.0, 2.0**-20])}  # B's LSE differs in one row

    class Data:
        def get(self, H, name, ql, kl):
            return {"bf16": (None, None, None), "cq": None, "ck": None}

    monkeypatch.setattr(ba, "Inputs", Data)
    monkeypatch.setattr(ba, "prov_triton", lambda *a, config=None: lambda: (torch.ones(2), lse[config["tag"]]))
    monkeypatch.setattr(ba, "bench_ms", lambda fn, rep: 1.0)
    monkeypatch.setitem(ba.AB, "t", ([("bf16", {"tag": "a"}, {"tag": "b"}), ("bf16", {"tag": "a"}, {"tag": "a"})],
                                     [(16, "1x1024q/16384k")]))
    args = types.SimpleNamespace(ab="t", heads=[16], verdict_rounds=1, rep=10, budget_s=1e9)
    off, same = ba.run_ab(args)
    assert off["same_bits"] is False and same["same_bits"] is True and "error" not in off


def test_ab_and_sweep_configs_name_only_the_kernels_parameters():
    """Every warp-specialized config of the --ab and --sweep entries names only parameters the
    Gluon kernel has (a misspelt one would be ignored and measure the default); profile_attention
    profiles each of an entry's configs once, in order."""
    import profile_attention
    from ctxprefill.backends import gluon_attention as ga

    ws = [c["WS"] for pairs, _ in ba.AB.values() for _, a, b in pairs for c in (a, b)]
    ws += [c["WS"] for sweep, _ in ba.SWEEPS.values() for cfgs in sweep.values() for c in cfgs if "WS" in c]
    assert ws and all(set(w) <= set(ga.CONFIG) for w in ws), [sorted(set(w) - set(ga.CONFIG)) for w in ws]
    got = profile_attention.configs_of("ws-fp8-regs")
    pairs = ba.AB["ws-fp8-regs"][0]
    assert got[0] == (pairs[0][0], pairs[0][1]) and len(got) == 1 + len(pairs)
    assert [c for _, c in got[1:]] == [b for _, _, b in pairs] and all(c["WS"]["P_REGS"] for _, c in got[1:])


def test_key_scan_fit_recovers_a_line():
    """The key scan's fit gives back the fixed time and the key loop's rate of launches that
    take ms = a + b·keys, per kernel, from the median round of each length."""
    H, rounds = 16, []
    per_key_ms = {"ours": 2e-4, "theirs": 1.9e-4}
    fixed_ms = {"ours": 0.05, "theirs": 0.02}
    for kl in ba.KEY_SCAN:
        rec = dict(keys=kl)
        for who in ("ours", "theirs"):
            ms = fixed_ms[who] + per_key_ms[who] * kl
            tf = ba.gflop([8192], [kl], H) / ms
            rec[f"tflops_{who}"] = [tf * 0.5, tf, tf * 2]  # the median round is the true one
        rounds.append(rec)
    fit = ba.key_scan_fit(rounds, H)
    for who in ("ours", "theirs"):
        assert fit[who]["fixed_ms"] == pytest.approx(fixed_ms[who], abs=1e-4)
        assert fit[who]["rate_tflops"] == pytest.approx(ba.gflop([8192], [1], H) / per_key_ms[who], rel=1e-3)
        share = fixed_ms[who] / (fixed_ms[who] + per_key_ms[who] * 16384)
        assert fit[who]["fixed_share_16k"] == pytest.approx(share, abs=1e-4)


def test_the_key_scan_keeps_to_the_time_budget(monkeypatch):
    """Past ``--budget-s`` the scan measures nothing (the step's time is capped; its JSON is
    written at the end): every length is recorded as skipped, and no line is fitted."""
    monkeypatch.setattr(ba, "prov_triton", lambda *a, **k: pytest.fail("measured past the budget"))
    args = type("Args", (), dict(heads=[16], verdict_rounds=3, rep=1, budget_s=-1.0))()
    out = ba.run_key_scan(args)
    assert [r["keys"] for r in out] == list(ba.KEY_SCAN)
    assert all(r["skipped"] == "time budget" and "fit" not in r for r in out)


def test_every_ab_names_cases_and_kernel_options_that_exist():
    """``--ab``'s pairs run: each shape resolves to lengths (the table's cases, or one
    segment named "1xQq/Kk"), each warp-specialized config sets only the kernel's options."""
    from ctxprefill.backends import gluon_attention as ga

    assert ba.shape_of("1x8192q/1024k") == ([8192], [1024])
    assert ba.shape_of("ragged4") == (ba.cases()[2][1], ba.cases()[2][2])
    with pytest.raises(KeyError, match="2x8q/8k"):
        ba.shape_of("2x8q/8k")
    for name, (pairs, shapes) in ba.AB.items():
        for _, case in shapes:
            q_lens, k_lens = ba.shape_of(case)
            assert len(q_lens) == len(k_lens) >= 1, (name, case)
        for _, a, b in pairs:
            for cfg in (a, b):
                assert set(cfg["WS"]) <= set(ga.CONFIG), (name, cfg)
            assert a != b, name
    assert any(b["WS"]["HOST_DESC"] and not a["WS"]["HOST_DESC"] for _, a, b in ba.AB["ws-host-desc"][0])
    # ws-persist: each dtype's default (as triton_attention sets it) as a program per tile
    # (bf16 without turns) against the same with PERSIST; ws-persist-launch: against the
    # defaults leaving PERSIST to the launch's settings
    import torch

    from ctxprefill.backends import triton_attention as ta

    defaults = {"bf16": ta.CONFIGS[torch.bfloat16]["WS"], "fp8": ta.KEYS_LAST_FP8["WS"]}
    pairs = ba.AB["ws-persist"][0]
    assert sorted(dt for dt, _, _ in pairs) == ["bf16", "fp8"]
    for dt, a, b in pairs:
        tile = dict(defaults[dt], PERSIST=False, PINGPONG=dt == "fp8")
        assert defaults[dt]["PERSIST"] and all(a["WS"][key] == val for key, val in tile.items()), (dt, a)
        assert b["WS"]["PERSIST"] and dict(b["WS"], PERSIST=False) == a["WS"], (dt, b)
    for (dt, a, b), (_, a2, _) in zip(ba.AB["ws-persist-launch"][0], pairs, strict=True):
        assert a == a2 and "PERSIST" not in b["WS"], (dt, b)
        assert all(b["WS"][key] == val for key, val in defaults[dt].items() if key != "PERSIST"), (dt, b)


def test_captured_runs_our_launches_as_a_graph_does_and_the_table_says_so(monkeypatch):
    """``--captured``: each of our launches asks for the captured variants (``captured=True``
    reaches the backend, in both V layouts), and the table of such a run names it."""
    import torch

    import make_tables
    from ctxprefill.backends import triton_attention

    seen = []
    monkeypatch.setattr(triton_attention, "mla_context_attention", lambda *a, **kw: seen.append(kw["captured"]))
    monkeypatch.setattr(ba, "keys_last_v", lambda v, kl: (v, None))
    q = torch.zeros(4, 1, 192)
    for captured in (False, True):
        monkeypatch.setitem(ba.LAUNCH, "captured", captured)
        for cfg in (dict(order=False), dict(order=False, v_layout="hdt")):
            ba.prov_triton(q, q, q[..., :128], None, None, [4], [4], 0.1, config=cfg)()
    assert seen == [False, False, True, True]
    with open(os.path.join(ROOT, "bench", "results", "bench_attention.json")) as fh:
        d = json.load(fh)
    assert "`--captured`" not in make_tables.attention_table(d)
    d["meta"]["captured"] = True
    assert "with the variants a CUDA graph's launch takes: `--captured`" in make_tables.attention_table(d)


def test_ws_over_sets_every_launch_of_ours_and_refuses_unknown_names(monkeypatch):
    """--ws-over: the settings reach eager and captured launches' configs (over the defaults,
    the captured variants kept); a name the Gluon kernel lacks exits naming it."""
    from ctxprefill.backends import triton_attention as ta

    monkeypatch.setattr(ta, "EAGER_WS", {})
    monkeypatch.setattr(ta, "CAPTURED_WS", {"HOST_DESC": True})
    q, k = torch.zeros(4, 16, 192, dtype=torch.bfloat16), torch.zeros(4, 16, 192, dtype=torch.bfloat16)
    assert not ta.ws_config(True, None, q, k, k[..., 128:], False)["PERSIST"]
    ba.apply_ws_over({"PERSIST": True})
    eager = ta.ws_config(True, None, q, k, k[..., 128:], False)
    captured = ta.ws_config(True, None, q, k, k[..., 128:], False, captured=True)
    assert eager["PERSIST"] and not eager["HOST_DESC"] and captured["PERSIST"] and captured["HOST_DESC"]
    with pytest.raises(SystemExit, match="PERSISTENT"):
        ba.apply_ws_over({"PERSISTENT": True})
    assert ta.EAGER_WS == {"PERSIST": True}


def test_the_attention_table_names_a_run_s_ws_over():
    """A run with --ws-over says so above its table (its "triton" is not the defaults)."""
    import make_tables

    with open(os.path.join(ROOT, "bench", "results", "bench_attention.json")) as fh:
        d = json.load(fh)
    d["meta"].pop("ws_over", None)
    assert "--ws-over" not in make_tables.attention_table(d)
    d["meta"]["ws_over"] = {"PERSIST": True}
    assert 'with `--ws-over {"PERSIST":true}` over its defaults' in make_tables.attention_table(d)


def test_the_ab_table_shows_same_bits_where_the_run_recorded_them():
    """--ab runs that record ``same_bits`` get a column for it (a B that differs in bold);
    runs without keep their columns."""
    import make_tables

    with open(os.path.join(ROOT, "bench", "results", "attention_ab_ws-host-desc.json")) as fh:
        d = json.load(fh)
    for r in d["results"]:
        r.pop("same_bits", None)
    assert "same bits" not in make_tables.ab_table(d)
    for i, r in enumerate(d["results"]):
        r["same_bits"] = i != 1
    table = make_tables.ab_table(d)
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line and "shape" not in line]
    assert "| same bits |" in table and rows and all(line.count("|") == 10 for line in rows)
    assert sum(line.endswith("| **no** |") for line in rows) == 1
    assert sum(line.endswith("| yes |") for line in rows) == len(d["results"]) - 1
