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
