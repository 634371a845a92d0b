"""Stage timing on the GPU (engine/timing.py): CUDA events from a per-device pool,
recorded on the stream looked up once, read after one synchronization."""

from __future__ import annotations

import pytest
import torch

from ctxprefill.engine import timing

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="no CUDA device: the GPU timing tests run on the GPU machine")]


def test_stage_times_measure_device_work_and_events_are_reused():
    dev = torch.device("cuda", torch.cuda.current_device())
    x = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    pool = timing._POOLS[dev.index]
    pool.clear()

    def one_request():
        t = timing.StageTimer(dev)
        with t.stage("matmul"):
            for _ in range(8):
                x @ x  # ~1 TFLOP: milliseconds of device work, queued without waiting
        with t.stage("empty"):
            pass
        with t.stage("matmul"):  # a stage seen twice adds up
            x @ x
        r = t.finish()
        one_request.last_span = t.span_ns
        return r

    ns, total = one_request()
    assert set(ns) == {"matmul", "empty"}
    span = one_request.last_span
    # the span (first start to last end, device clock) holds the stages and little else here
    assert ns["matmul"] + ns["empty"] - 50_000 <= span <= total + 50_000, (ns, span, total)
    assert ns["matmul"] > 100_000, ns  # 9 products of 4096^3 take well over 0.1 ms on any GPU
    assert 0 <= ns["empty"] < ns["matmul"] / 10, ns
    assert total >= ns["matmul"] + ns["empty"] - 50_000  # wall time covers the device time (event clock slack)
    assert len(pool) == 6  # 3 stages x 2 events, returned after they were read
    first = {id(e) for e in pool}
    ns2, _ = one_request()
    assert len(pool) == 6 and {id(e) for e in pool} == first  # the same events again, no new ones
    assert ns2["matmul"] > 100_000


def test_unfinished_timer_returns_nothing_to_the_pool():
    dev = torch.device("cuda", torch.cuda.current_device())
    pool = timing._POOLS[dev.index]
    pool.clear()
    t = timing.StageTimer(dev)
    with pytest.raises(RuntimeError):
        with t.stage("fails"):
            raise RuntimeError("a stage that fails")
    assert len(pool) == 0  # its start event was recorded: not reusable until read, so dropped


def test_batched_readout_equals_torch_event_by_event():
    from ctxprefill.ops import _cuda

    ext = _cuda.load()
    if ext is None:
        pytest.skip(f"CUDA extension unavailable: {_cuda.why_not()}")
    dev = torch.device("cuda", torch.cuda.current_device())
    x = torch.randn(2048, 2048, device=dev, dtype=torch.bfloat16)
    evs = [torch.cuda.Event(enable_timing=True) for _ in range(6)]
    for i, e in enumerate(evs):
        for _ in range(i):
            x @ x
        e.record()
    torch.cuda.synchronize()
    pairs = [(evs[0], evs[5]), (evs[1], evs[2]), (evs[3], evs[4]), (evs[4], evs[3])]  # a negative one too
    got = timing._elapsed_ms(pairs)
    assert got == [a.elapsed_time(b) for a, b in pairs]  # the same cudaEventElapsedTime, bit for bit
    assert got[0] > 0 and got[3] < 0
    with pytest.raises(ValueError, match="pairs"):
        ext.events_elapsed_ms([evs[0].cuda_event])
    with pytest.raises(ValueError, match="never recorded"):
        ext.events_elapsed_ms([evs[0].cuda_event, 0])


def test_detailed_timer_places_stages_by_device_offsets():
    """DetailedStageTimer on the GPU: each stage's start is its device offset from the
    first stage's, read with the durations in the one sync; the events go back to the pool."""
    dev = torch.device("cuda", torch.cuda.current_device())
    x = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    pool = timing._POOLS[dev.index]
    pool.clear()
    t = timing.DetailedStageTimer(dev)
    with t.stage("merge"):
        pass
    for i in range(2):
        t.chunk = i
        with t.stage("gather"):
            x @ x
        with t.stage("attention"):
            for _ in range(4):
                x @ x
    ns, _ = t.finish()
    assert t.stages is not None
    assert [(s.stage, s.chunk) for s in t.stages] == [("merge", -1), ("gather", 0), ("attention", 0),
                                                      ("gather", 1), ("attention", 1)]
    for a, b in zip(t.stages, t.stages[1:]):  # one stream: each stage starts after the one before ends
        assert a.start_ns + a.duration_ns <= b.start_ns + 2_000, (a, b)
    for name, total in ns.items():
        assert sum(s.duration_ns for s in t.stages if s.stage == name) == total
    assert t.stages[2].duration_ns > t.stages[1].duration_ns  # 4 products against 1
    assert len(pool) == 10  # 5 stages x 2 events, returned after they were read
