"""``ctxprefill bench`` runs end to end on the CPU and records both paths (tiny grid);
``--grid``, ``--budget-s`` and the iteration rule."""

import json

import pytest

from ctxprefill_bench import engine_bench as bench
from engine_helpers import cpu_bench


def test_bench_tiny_grid(tmp_path):
    rows = cpu_bench(tmp_path, "--heads", "2", "--new", "4", "--context", "300", "--cache-dtype", "fp8",
                     "--prefill-dtype", "bf16", "fp8", "--workspace-tokens", "128", "--iters", "1")["rows"]
    assert len(rows) == 2 and all(r["bit_identical"] and r["chunks"] == 3 for r in rows)
    fp8 = [r for r in rows if r["prefill_dtype"] == "fp8"][0]
    assert fp8["fused_launches"]["pack"] == 3 and fp8["generic_launches"]["pack"] == 15


def test_full_grid_is_the_issue_grid():
    g = bench.GRIDS["full"]
    assert g["heads"] == [16, 128] and g["new"] == [512, 1024, 8192] and g["context"] == [8192, 65536, 262144]
    assert g["cache_dtype"] == ["auto", "fp8", "fp8_ds_mla"] and g["prefill_dtype"] == ["bf16", "fp8"]


def test_bench_grid_full_narrowed_by_flags(tmp_path):
    """An axis flag overrides that axis of --grid full; the others keep the grid's values."""
    d = cpu_bench(tmp_path, "--grid", "full", "--heads", "2", "--new", "4", "--context", "200", "--cache-dtype", "auto",
                  "--prefill-dtype", "bf16", "--workspace-tokens", "128", "--iters", "3", "--min-iters", "2",
                  "--target-s", "0")
    assert d["meta"]["grid"] == "full" and d["meta"]["axes"]["heads"] == [2] and d["meta"]["rows_planned"] == 1
    assert d["meta"]["kind"] == "engine" and d["meta"]["rows_done"] == 1 and d["meta"]["torch"]
    # the host's speed beside the rows it bounds: both figures measured (positive, finite)
    assert set(d["meta"]["host"]) == {"op_issue_us", "python_loop_ms"}
    assert all(0 < v < 1e6 for v in d["meta"]["host"].values()), d["meta"]["host"]
    (r,) = d["rows"]
    # --target-s 0: the minimum of timed calls per path; floor is n/a (null) on the CPU
    assert r["generic_iters"] == r["fused_iters"] == 2 and r["bit_identical"] and r["floor_s"] is None
    assert set(r["fused_stage_s"]) >= {"gather", "kv_b_proj", "pack", "attention"}
    assert r["fused_launches_per_chunk"] == sum(r["fused_launches"].values()) / r["chunks"]
    # the speedup with a pack of zero time: the fused request less its pack stage
    assert r["speedup_free_pack"] == pytest.approx(r["generic_s"] / (r["fused_s"] - r["fused_stage_s"]["pack"]))
    assert r["speedup_free_pack"] > r["speedup"]
    # the time outside the stages: request time minus the stages' (medians: may dip below 0)
    for path in ("generic", "fused"):
        gap = r[f"{path}_host_gap_s"]
        assert gap == pytest.approx(r[f"{path}_s"] - sum(r[f"{path}_stage_s"].values()))
        assert -0.5 * r[f"{path}_s"] < gap < r[f"{path}_s"]
        # split: within the span of the stages (first start to last end) and outside it
        span = r[f"{path}_span_s"]
        assert 0 < span <= r[f"{path}_s"]
        assert r[f"{path}_gap_in_span_s"] == pytest.approx(span - sum(r[f"{path}_stage_s"].values()))


def test_bench_budget_zero_skips_everything(tmp_path):
    d = cpu_bench(tmp_path, "--heads", "2", "--new", "4", "--context", "300", "600", "--cache-dtype", "auto",
                  "--prefill-dtype", "bf16", "--budget-s", "0")
    assert d["meta"]["rows_skipped"] == 2 and d["meta"]["rows_done"] == 0
    assert all(r["skipped"].startswith("budget") for r in d["rows"])


def test_bench_budget_skips_rows_predicted_not_to_fit(tmp_path, monkeypatch):
    """The first row runs (nothing to predict from); a later row predicted past the deadline
    is skipped and recorded, and the grid goes on with the rows that fit."""
    calls = []

    def predict(work, history, *a, **k):
        calls.append(len(history))
        if not history:
            return None  # first row: nothing measured yet, so it runs
        return 1e9 if len(calls) == 2 else 0.0  # second row: too long; third: fits

    monkeypatch.setattr(bench, "predict_row_s", predict)
    rows = cpu_bench(tmp_path, "--heads", "2", "--new", "4", "--context", "100", "200", "300", "--cache-dtype", "auto",
                     "--prefill-dtype", "bf16", "--workspace-tokens", "128", "--iters", "1",
                     "--budget-s", "600")["rows"]
    assert [("skipped" in r, r["context"]) for r in rows] == [(False, 100), (True, 200), (False, 300)]
    assert rows[1]["predicted_s"] == 1e9 and "speedup" in rows[2] and calls == [0, 1, 1]


def test_predict_row_s_scales_with_work():
    assert bench.predict_row_s(1e12, [], 0.3, 2, 20) is None
    hist = [{"work": 1e12, "t_s": 0.01, "setup_s": 0.5}, {"work": 1e14, "t_s": 0.2, "setup_s": 0.7}]
    # from the 1e14 row: 0.4 s x 1.5 = 0.6 s per call, 1 warm-up + 2 timed, both paths, + median setup
    assert bench.predict_row_s(2e14, hist, 0.3, 2, 20) == pytest.approx(0.6 + 2 * 3 * 0.6)
    # below every measured row: the smallest row's time, not scaled down
    small = bench.predict_row_s(1e9, hist, 0.3, 2, 20)
    assert small == pytest.approx(0.6 + 2 * (2 + 20) * 0.015)


def test_time_request_iterations_scale_with_work():
    """Cheap calls: two warm-ups, then timed calls until target_s (at most max_iters)."""
    import types

    import torch

    class FakeEngine:
        def __init__(self, t):
            self.t, self.calls = t, 0

        def prefill_context(self, q, seqs, fused):
            self.calls += 1
            return types.SimpleNamespace(stats=types.SimpleNamespace(stage_ns={"attention": int(self.t * 1e9)},
                                                                     span_ns=int(self.t * 1e9)))

    dev = torch.device("cpu")
    e = FakeEngine(0.001)
    r = bench.time_request(e, None, [], True, dev, max_iters=7, min_iters=2, target_s=10.0)
    assert r["iters"] == 7 and r["warmup"] == 2 and e.calls == 9
    r = bench.time_request(e, None, [], True, dev, max_iters=1, min_iters=2, target_s=10.0)
    assert r["iters"] == 1


def test_profile_engine_on_the_cpu(capsys):
    """bench/profile_engine.py: request time, stages and gap, then the profile's table."""
    import re

    assert _profile_engine().main(["--device", "cpu", "--heads", "2", "--new", "8", "--context", "512",
                                   "--block-size", "16", "--workspace-tokens", "128", "--iters", "3",
                                   "--top", "5"]) == 0
    out = capsys.readouterr().out
    m = re.search(r"request ([\d.]+) ms \(median of 3\); device stages ([\d.]+) ms; gap (-?[\d.]+) ms", out)
    assert m, out
    req, stages, gap = map(float, m.groups())
    assert 0 < stages and abs(req - stages - gap) < 0.002  # printed to 3 decimals
    m = re.search(r"(-?[\d.]+) ms between the stages \(first stage's start to last one's end ([\d.]+) ms\), "
                  r"(-?[\d.]+) ms before and after them", out)
    assert m, out
    between, span, outside = map(float, m.groups())
    # span >= each request's stages; against the sum of per-stage medians, only roughly
    assert abs(between + outside - gap) < 0.003 and 0.8 * stages <= span <= req + 0.002
    assert "4 chunks" in out and "ncalls" in out
    # the profile's top rows by own time (which functions lead depends on the host's load)
    rows = re.findall(r"^\s*[\d/]+\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+[\d.]+ \S", out, re.M)
    assert len(rows) == 5, out


@pytest.mark.parametrize("switch", ["merges_beside", "graph_variants"])
def test_graphs_ab_interleaves_its_rounds_and_checks_every_replays_bits(switch):
    """bench --merges-ab / --graph-variants-ab: the switch off first in the 1st and 3rd
    rounds, on first in the 2nd, each captured anew (graphs released), the switch set back
    after; every replay is held to the given result's bits, so one that differs marks the row."""
    import types

    import torch

    class FakeEngine:
        def __init__(self, odd_one: int | None = None):
            self.graphs = types.SimpleNamespace(merges_beside=False, graph_variants=True)
            self.order, self.released, self.odd_one = [], 0, odd_one

        def release_graphs(self):
            self.released += 1

        def prefill_context(self, q, seqs, fused, graphs_on):
            assert graphs_on
            self.order.append(getattr(self.graphs, switch))
            bad = self.odd_one is not None and len(self.order) == self.odd_one
            return types.SimpleNamespace(out=torch.full((2,), 1.0 if bad else 0.0, dtype=torch.bfloat16),
                                         lse=torch.zeros(2), stats=types.SimpleNamespace(
                                             stage_ns={"graph": 1000 if getattr(self.graphs, switch) else 2000},
                                             span_ns=1000))

    want = types.SimpleNamespace(out=torch.zeros(2, dtype=torch.bfloat16), lse=torch.zeros(2))
    it = dict(max_iters=1, min_iters=1, target_s=0.0)
    e = FakeEngine()
    was = getattr(e.graphs, switch)
    got = bench._graphs_ab(e, None, [], torch.device("cpu"), switch, 3, it, want)
    per_round = [e.order[i * 3] for i in range(6)]  # 2 warm-ups and 1 timed call each
    assert per_round == [False, True, True, False, False, True] and e.released == 7
    assert got["same"] and got["rounds"] == 3
    assert got["on_replay_s"] == pytest.approx(1e-6) and got["off_replay_s"] == pytest.approx(2e-6)
    assert getattr(e.graphs, switch) is was
    e = FakeEngine(odd_one=9)  # the timed replay of the 2nd round's first capture differs
    assert not bench._graphs_ab(e, None, [], torch.device("cpu"), switch, 3, it, want)["same"]


def test_eager_variants_ab_interleaves_its_rounds_and_restores_the_knob():
    """bench --eager-variants-ab: triton_attention.EAGER_WS without and with HOST_DESC, the
    order alternating by round, set back after (also when a request fails); every request
    is held to the given result's bits, and the attention stage is reported per setting."""
    import types

    import torch

    from ctxprefill.backends import triton_attention as ta

    class FakeEngine:
        def __init__(self, odd_one: int | None = None, fail_at: int | None = None):
            self.order, self.odd_one, self.fail_at = [], odd_one, fail_at

        def prefill_context(self, q, seqs, fused):
            on = bool(ta.EAGER_WS.get("HOST_DESC"))
            self.order.append(on)
            if len(self.order) == self.fail_at:
                raise RuntimeError("a failed request")
            bad = self.odd_one is not None and len(self.order) == self.odd_one
            return types.SimpleNamespace(out=torch.full((2,), 1.0 if bad else 0.0, dtype=torch.bfloat16),
                                         lse=torch.zeros(2), stats=types.SimpleNamespace(
                                             stage_ns={"attention": 1000 if on else 3000}, span_ns=1000))

    want = types.SimpleNamespace(out=torch.zeros(2, dtype=torch.bfloat16), lse=torch.zeros(2))
    it = dict(max_iters=1, min_iters=1, target_s=0.0)
    was = ta.EAGER_WS
    e = FakeEngine()
    got = bench._eager_variants_ab(e, None, [], torch.device("cpu"), 3, it, want)
    assert [e.order[i * 3] for i in range(6)] == [False, True, True, False, False, True]  # 2 warm-ups, 1 timed
    assert got["same"] and got["rounds"] == 3 and ta.EAGER_WS is was
    assert got["on_attention_s"] == pytest.approx(1e-6) and got["off_attention_s"] == pytest.approx(3e-6)
    assert not bench._eager_variants_ab(FakeEngine(odd_one=6), None, [], torch.device("cpu"), 3, it, want)["same"]
    with pytest.raises(RuntimeError, match="failed"):
        bench._eager_variants_ab(FakeEngine(fail_at=4), None, [], torch.device("cpu"), 3, it, want)
    assert ta.EAGER_WS is was
    import make_tables  # bench/ is on the path (conftest.py): its columns are the row's fields

    fields = bench._ab_fields(*bench.EAGER_AB, got, "attention")
    ((off, on, _),) = make_tables.EAGER_AB_COLUMNS
    assert (fields[off], fields[on]) == (got["off_s"], got["on_s"]) and fields["eager_variants_ab_bit_identical"]
    assert fields["eager_variants_on_attention_s"] == got["on_attention_s"] and len(fields) == 6
    note = bench._ab_note(*bench.EAGER_AB, got, "attention")
    assert note.startswith("  (eager variants off | on: attention 0.003 | 0.001 ms"), note


def test_graph_abs_note_fields_and_table_columns_agree():
    """A row's graph A/B result (_graphs_ab: off and on) is printed and stored under the names
    make_tables reads: the progress note of each switch present, and its fields, whose
    replay fields are make_tables' columns, in the same order."""
    import make_tables  # bench/ is on the path (conftest.py)

    ab = {"rounds": 3, "off_s": 2e-3, "off_replay_s": 1.5e-3, "on_s": 1.9e-3, "on_replay_s": 1.4e-3, "same": True}
    note = bench._graphs_ab_note({"merges_beside": ab, "graph_variants": dict(ab, on_replay_s=1.6e-3)})
    assert note == ("  (merges in line | beside: replay 1.500 | 1.400 ms, request 2.000 | 1.900 ms)"
                    "  (graph variants off | on: replay 1.500 | 1.600 ms, request 2.000 | 1.900 ms)")
    assert bench._graphs_ab_note({}) == ""
    assert len(bench.GRAPH_ABS) == len(make_tables.GRAPH_AB_COLUMNS)
    for (switch, opt, *names), (off, on, _) in zip(bench.GRAPH_ABS, make_tables.GRAPH_AB_COLUMNS, strict=True):
        fields = bench._ab_fields(*names, ab)
        assert (fields[off], fields[on]) == (1.5e-3, 1.4e-3), switch
        assert fields[f"{names[0]}_ab_rounds"] == 3 and fields[f"{names[0]}_ab_bit_identical"] is True
        assert len(fields) == 6 and opt.replace("_", "-") in ("merges-ab", "graph-variants-ab")


def _profile_engine():
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "profile_engine.py")
    spec = importlib.util.spec_from_file_location("profile_engine", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_profile_engine_device_gaps():
    """profile_engine --timeline's split of a request: the host before its first kernel, the
    device idle between its kernels (work overlapping on two streams is no idle), after its
    last; a kernel of the next request is not this one's."""
    gaps = _profile_engine().device_gaps(
        [(0.0, 100.0), (200.0, 300.0)],
        [(10.0, 30.0, "gemm"), (30.0, 60.0, "attention"), (55.0, 58.0, "merge"), (70.0, 90.0, "gemm"),
         (230.0, 240.0, "gemm"), (240.0, 290.0, "attention")])
    assert gaps["before"] == [10.0, 30.0] and gaps["after"] == [10.0, 10.0]
    assert gaps["between"] == [10.0, 0.0] and gaps["idles"] == [(10.0, "gemm")]
    assert gaps["kernels"] == [4, 2] and gaps["busy"] == [73.0, 60.0]
    assert gaps["last"] == [(0.0, 10.0, "gemm"), (0.0, 50.0, "attention")]


def test_bench_ragged_sequences(tmp_path):
    """--sequences splits a request's new and context tokens unevenly over that many
    sequences (every token kept); both paths still agree bit for bit. (The launch-order
    comparison needs the Triton backend on a GPU: none here, so no such column.)"""
    assert bench.split_ragged(1000, 4, bench.RAGGED_CONTEXT_WEIGHTS) == [315, 105, 421, 159]
    assert sum(bench.split_ragged(7, 3, (1.0, 7.0))) == 7
    (row,) = cpu_bench(tmp_path, "--heads", "2", "--new", "16", "--context", "600", "--sequences", "3",
                       "--cache-dtype", "auto", "--prefill-dtype", "bf16", "--workspace-tokens", "256",
                       "--iters", "1")["rows"]
    assert row["sequences"] == 3 and sum(row["context_lens"]) == 600 and sum(row["new_lens"]) == 16
    assert len(set(row["context_lens"])) == 3 and row["bit_identical"] and row["chunks"] >= 3
    assert "fused_no_launch_order_s" not in row


def test_without_launch_order_times_the_fused_path_with_the_order_off():
    """The comparison column: the backend's launch order is asked once (to see whether it
    gives one), then turned off for the timed calls, and its method restored after."""
    import dataclasses

    import torch

    from ctxprefill.backends.base import HostLaunchOrder
    from ctxprefill.backends.reference import ReferenceBackend
    from ctxprefill_bench.workload import make_request
    from engine_helpers import make_engine

    class Ordered(ReferenceBackend):
        calls = 0

        def launch_order(self, q_lens, k_lens, heads, q_dtype, device):
            Ordered.calls += 1
            return HostLaunchOrder((1, 2, 3), 1) if len(q_lens) > 1 else None

        def run_context_chunk(self, *a, launch_order=None, **kw):
            assert launch_order is None or launch_order.codes.tolist() == [1, 2, 3]
            return super().run_context_chunk(*a, **kw)

    be = Ordered(honor_out=True)
    be.caps = dataclasses.replace(be.caps, launch_order=True)
    eng = make_engine(heads=2, workspace_tokens=512, backend=be)
    q, seqs = make_request(eng, [100, 60, 0], [3, 4, 2], seed=1)
    got = bench._without_launch_order(eng, q, seqs, torch.device("cpu"), dict(max_iters=1, min_iters=1, target_s=0))
    assert got is not None and got["iters"] == 1 and Ordered.calls >= 1
    assert "launch_order" not in vars(be)  # the method is the class's again
    asked = Ordered.calls
    eng.prefill_context(q, seqs)
    assert Ordered.calls > asked
    one = make_request(eng, [100], [3], seed=2)
    assert bench._without_launch_order(eng, *one, torch.device("cpu"), dict(max_iters=1, min_iters=1,
                                                                            target_s=0)) is None


def test_floor_at_the_held_gemm_rate():
    """The floor at another matrix rate (the rate held under the power cap) scales only
    the FLOP terms; the CPU reports no rates (NaN), including the held one when asked."""
    from ctxprefill.config import EngineConfig

    cfg = EngineConfig()
    ceil = {"copy_bytes_per_s": 4e12, "matmul_flops_per_s": 8e14, "matmul_sustained_flops_per_s": 4e14}
    burst = bench.floor_seconds(cfg, [65536], [1024], ceil)
    held = bench.floor_seconds(cfg, [65536], [1024], ceil, rate="matmul_sustained_flops_per_s")
    assert held["glue_s"] == burst["glue_s"] > 0
    assert held["kv_b_proj_s"] == pytest.approx(2 * burst["kv_b_proj_s"])
    assert held["attention_s"] == pytest.approx(2 * burst["attention_s"])
    assert burst["total_s"] == pytest.approx(burst["kv_b_proj_s"] + burst["attention_s"] + burst["glue_s"])
    import torch

    got = bench.measure_ceilings(torch.device("cpu"), sustained_s=1.0)
    assert set(got) == {"copy_bytes_per_s", "matmul_flops_per_s", "matmul_sustained_flops_per_s"}
    assert "matmul_sustained_flops_per_s" not in bench.measure_ceilings(torch.device("cpu"))


def test_floor_of_unpacked_keys_drops_the_pack_bytes_for_bf16_only():
    """A path that packs no K (bf16 prefill, unpacked keys) has no pack bytes in its
    floor: the gather's remain; fp8 prefill quantizes K and V in its pack either way."""
    import dataclasses

    from ctxprefill.config import EngineConfig, ModelShape

    ceil = {"copy_bytes_per_s": 4e12, "matmul_flops_per_s": 8e14}
    H, ctx = 16, 65536
    bf16 = EngineConfig(shape=ModelShape(heads=H))
    packed = bench.floor_seconds(bf16, [ctx], [1024], ceil)
    unpacked = bench.floor_seconds(bf16, [ctx], [1024], ceil, pack=False)
    pack_bytes = ctx * H * 128 * 2 + ctx * 64 * 2 + ctx * H * 192 * 2
    assert packed["glue_bytes"] - unpacked["glue_bytes"] == pack_bytes
    assert unpacked["glue_bytes"] == ctx * (bf16.cache.bytes_per_slot + 576 * 2) > 0
    assert unpacked["kv_b_proj_s"] == packed["kv_b_proj_s"] and unpacked["attention_s"] == packed["attention_s"]
    fp8 = dataclasses.replace(bf16, prefill_dtype="fp8")
    assert bench.floor_seconds(fp8, [ctx], [1024], ceil, pack=False) == bench.floor_seconds(fp8, [ctx], [1024], ceil)


def test_probe_host_issue_needs_cuda(capsys):
    """bench/probe_host_issue.py holds the device with a spin kernel: without CUDA it says
    so and exits 2 instead of measuring the CPU."""
    import importlib.util
    import os

    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the probe would run (tests/gpu territory)")
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "probe_host_issue.py")
    spec = importlib.util.spec_from_file_location("probe_host_issue", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main([]) == 2
    assert "needs a CUDA device" in capsys.readouterr().out


def test_bench_kernels_targets_cover_the_stated_regime():
    """bench/bench_kernels.py's targets: every fused pack (keys-last too) at T·H >= 2**20,
    gathers of >= 2**18 rows, merges at T·H >= 2**20; smaller rows and the baselines none.
    The recorded GPU run (bench/results/bench_kernels.json) holds the verdicts these give."""
    import importlib.util
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("bench_kernels", os.path.join(root, "bench", "bench_kernels.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    t = mod.target_pct
    assert t({"op": "pack", "variant": "fused bf16", "H": 128, "T": 8192}) == 90.0
    assert t({"op": "pack", "variant": "fused fp8 v-keys-last 4 segs", "H": 16, "T": 65536}) == 90.0
    assert t({"op": "pack", "variant": "fused bf16", "H": 128, "T": 2048}) is None
    assert t({"op": "pack", "variant": "generic bf16", "H": 128, "T": 32768}) is None
    assert t({"op": "gather", "variant": "kernel fp8->bf16", "rows": 262144}) == 85.0
    assert t({"op": "gather", "variant": "kernel fp8->bf16", "rows": 65536}) is None
    assert t({"op": "gather", "variant": "torch fp8->bf16", "rows": 262144}) is None
    assert t({"op": "merge", "variant": "kernel", "H": 16, "T": 65536}) == 85.0
    assert t({"op": "merge", "variant": "kernel", "H": 16, "T": 8192}) is None
    with open(os.path.join(root, "bench", "results", "bench_kernels.json")) as fh:
        run = json.load(fh)
    rows = run["results"]
    # the recorded run's verdicts are what target_pct gives again from its rows
    assert [(r["variant"], r.get("target_pct")) for r in rows] == [(r["variant"], t(r)) for r in rows]
    missed = {r["variant"] for r in rows if t(r) is not None and r["pct_copy"] < t(r)}
    assert missed == {r["variant"] for r in rows if r.get("meets_target") is False}
    assert run["targets_met"] is (not missed)
    assert sum(t(r) is not None for r in rows) == 3 * 4 + 4 + 2  # 4 fused packs at 3 shapes, 256k gathers, large merges


@pytest.mark.parametrize("named,head,changed,want", [
    ("abc1234", "abc1234", True, "abc1234+dirty"),  # the checkout's own HEAD, but not its tree
    ("abc1234", "abc1234", False, "abc1234"),
    ("abc1234def", "abc1234", True, "abc1234def+dirty"),  # a longer form of the same commit
    ("fff0000", "abc1234", True, "fff0000"),  # a commit this checkout does not hold: taken as named
    ("abc1234+dirty", "abc1234", True, "abc1234+dirty"),
    (None, "abc1234", True, "abc1234+dirty"),
    (None, "", False, "unknown"),
])
def test_a_named_commit_that_is_the_checkouts_older_head_is_marked_dirty(monkeypatch, named, head, changed, want):
    """run_info.commit: $CTXPREFILL_COMMIT labels a run, unless it is the checkout's own HEAD
    while tracked files differ from it (a command that ran git on the GPU machine, whose
    checkout can be older than the tree it was sent)."""
    from ctxprefill_bench import run_info

    monkeypatch.setattr(run_info, "_git_state", lambda: (head, changed))
    if named is None:
        monkeypatch.delenv("CTXPREFILL_COMMIT", raising=False)
    else:
        monkeypatch.setenv("CTXPREFILL_COMMIT", named)
    assert run_info.commit() == want


def test_bench_records_its_growth_with_context(tmp_path):
    """Three context lengths or more: the run records the fused request's line along
    context (growth.py) beside its rows; no floor on the CPU, so no floor's line."""
    d = cpu_bench(tmp_path, "--heads", "2", "--new", "4", "--context", "128", "256", "512", "--cache-dtype", "auto",
                  "--prefill-dtype", "bf16", "--workspace-tokens", "128", "--iters", "1")
    (g,) = d["growth"]
    assert (g["heads"], g["new"], g["axis"], g["tokens"]) == (2, 4, "context", [128, 256, 512])
    ys = {r["context"]: r["fused_s"] for r in d["rows"]}
    assert g["fused_neighbour_ns_per_token"] == pytest.approx([(ys[256] - ys[128]) / 128 * 1e9,
                                                               (ys[512] - ys[256]) / 256 * 1e9])
    assert "floor_ns_per_token" not in g and "fused_over_floor_growth" not in g
