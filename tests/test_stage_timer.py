"""Stage timing on the CPU (engine/timing.py): per-stage wall time, and the span from the
first stage's start to the last one's end, which ``ctxprefill bench`` uses to split a
request's time outside its stages into host work before/after and time between stages."""

import time
from types import SimpleNamespace

import torch

from ctxprefill.engine import timing


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_span_covers_the_stages_and_the_time_between_them():
    t = timing.StageTimer(torch.device("cpu"))
    _busy(0.02)  # before the first stage: outside the span
    with t.stage("a"):
        _busy(0.01)
    _busy(0.03)  # between stages: inside the span, in no stage
    with t.stage("b"):
        _busy(0.01)
    _busy(0.02)  # after the last stage: outside the span
    ns, total = t.finish()
    stages = ns["a"] + ns["b"]
    assert ns["a"] >= 10_000_000 and ns["b"] >= 10_000_000
    assert t.span_ns >= stages + 30_000_000  # the 30 ms between the stages
    assert total >= t.span_ns + 40_000_000  # the 20 ms before and the 20 ms after


def test_span_is_exactly_the_first_start_to_the_last_end(monkeypatch):
    """The same sequence on a clock the test moves: the span holds the stages and the time
    between them, and nothing of the time before the first or after the last."""
    clock = SimpleNamespace(ns=0)
    clock.perf_counter_ns = lambda: clock.ns
    monkeypatch.setattr(timing, "time", clock)
    t = timing.StageTimer(torch.device("cpu"))
    for name, before, inside in (("a", 20, 10), ("b", 30, 10)):
        clock.ns += before * 1_000_000
        with t.stage(name):
            clock.ns += inside * 1_000_000
    clock.ns += 20_000_000  # after the last stage
    ns, total = t.finish()
    assert ns == {"a": 10_000_000, "b": 10_000_000}
    assert t.span_ns == 50_000_000 and total == 90_000_000


def test_no_stage_no_span():
    t = timing.StageTimer(torch.device("cpu"))
    ns, total = t.finish()
    assert ns == {} and t.span_ns == 0 and total >= 0


def test_the_engine_reports_the_span():
    from ctxprefill.app import build_engine
    from ctxprefill.settings import ServeSettings
    from ctxprefill_bench.engine_bench import make_device_request

    eng = build_engine(ServeSettings(device="cpu", heads=2, block_size=16, num_blocks=64, workspace_tokens=128))
    q, seqs = make_device_request(eng, [300], [4], seed=0)
    st = eng.prefill_context(q, seqs).stats
    assert 0 < sum(st.stage_ns.values()) <= st.span_ns <= st.total_ns
