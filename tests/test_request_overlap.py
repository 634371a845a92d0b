"""The engine thread pipelines queued two-step calls (service/engine_worker.py, ``submit(...,
quick=...)``): while one call's device work runs, the next queued call whose start need not
wait for the device is started before the first one's finish, every call is finished once
and in the order started; a call that is not quick, ``--no-request-overlap``, a failure or a
cancellation each keep that order. ``Engine.starts_without_waiting`` is the hint the
service gives (a GPU, q on it, no cache_write, at most ``STOP_AHEAD`` chunks)."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from ctxprefill import settings
from ctxprefill.engine.loop import STOP_AHEAD
from ctxprefill.engine.plan import ContextChunk
from ctxprefill.engine.request import PrefillRequest, SequenceSpec, WriteRequest
from ctxprefill.service.engine_worker import EngineWorker
from ctxprefill.service.metrics import Metrics
from engine_helpers import make_engine


class Call:
    """A two-step call: its start logs, its finish logs and returns its name; ``ready``
    (the device work done) is a flag the test sets."""

    def __init__(self, name: str, log: list, quick: bool = True, start_error: Exception | None = None,
                 finish_error: Exception | None = None, nothing: bool = False):
        self.name, self.log, self.is_quick = name, log, quick
        self.start_error, self.finish_error, self.nothing = start_error, finish_error, nothing
        self.done = threading.Event()

    def quick(self) -> bool:
        return self.is_quick

    def start(self):
        self.log.append(("start", self.name))
        if self.start_error is not None:
            raise self.start_error
        if self.nothing:
            return None
        call = self

        class Finish:
            def __call__(self):
                call.log.append(("finish", call.name))
                if call.finish_error is not None:
                    raise call.finish_error
                return call.name

            def ready(self) -> bool:
                return call.done.is_set()

        return Finish()


async def run_calls(worker: EngineWorker, calls: list[Call]) -> list:
    """Submit every call while the engine thread is held by a plain call, release it, and
    gather the results (exceptions in place). Their device work 'runs' until 50 ms after
    the release: a call with nothing queued behind it waits for that to finish."""
    gate = threading.Event()
    hold = worker.submit(gate.wait)
    futs = [worker.submit(c.start, quick=c.quick) for c in calls]
    gate.set()
    await hold
    timer = threading.Timer(0.05, lambda: [c.done.set() for c in calls])
    timer.start()
    try:
        return await asyncio.gather(*futs, return_exceptions=True)
    finally:
        timer.cancel()


async def until_started(log: list) -> None:
    """Until the engine thread has started the first call (its start logged)."""
    for _ in range(2000):
        if log:
            return
        await asyncio.sleep(0.001)
    raise AssertionError("the call was not started")


@pytest.fixture
def worker():
    w = EngineWorker(Metrics())
    yield w
    w.stop()


def overlapped(worker: EngineWorker) -> float:
    return worker.metrics.registry.get_sample_value("ctxprefill_overlapped_requests_total")


def test_the_next_quick_call_starts_before_the_previous_one_finishes(worker):
    log: list = []
    calls = [Call(n, log) for n in "abc"]
    assert asyncio.run(run_calls(worker, calls)) == ["a", "b", "c"]
    assert log == [("start", "a"), ("start", "b"), ("finish", "a"), ("start", "c"), ("finish", "b"),
                   ("finish", "c")]
    assert overlapped(worker) == 2  # b and c, each started while the one before ran


def test_a_call_that_is_not_quick_starts_after_the_previous_one_finished(worker):
    log: list = []
    calls = [Call("a", log), Call("b", log, quick=False), Call("c", log)]
    assert asyncio.run(run_calls(worker, calls)) == ["a", "b", "c"]
    assert log == [("start", "a"), ("finish", "a"), ("start", "b"), ("start", "c"), ("finish", "b"),
                   ("finish", "c")]


def test_a_plain_call_runs_after_the_started_one_finished(worker):
    log: list = []

    async def go():
        gate = threading.Event()
        hold = worker.submit(gate.wait)
        a, b = Call("a", log), Call("b", log)
        a.done.set()
        b.done.set()
        futs = [worker.submit(a.start, quick=a.quick), worker.submit(lambda: log.append(("plain",)) or "p"),
                worker.submit(b.start, quick=b.quick)]
        gate.set()
        await hold
        return await asyncio.gather(*futs)

    assert asyncio.run(go()) == ["a", "p", "b"]
    assert log == [("start", "a"), ("finish", "a"), ("plain",), ("start", "b"), ("finish", "b")]


def test_without_overlap_each_call_finishes_before_the_next_starts(worker):
    worker.request_overlap = False  # --no-request-overlap
    log: list = []
    assert asyncio.run(run_calls(worker, [Call(n, log) for n in "ab"])) == ["a", "b"]
    assert log == [("start", "a"), ("finish", "a"), ("start", "b"), ("finish", "b")]
    assert overlapped(worker) == 0


def test_a_lone_call_finishes_once_its_work_is_done(worker):
    """Nothing queued behind it: the engine thread finishes it when ``ready()`` says its
    work is done, not before."""
    log: list = []
    a = Call("a", log)

    async def go():
        fut = worker.submit(a.start, quick=a.quick)
        await until_started(log)
        await asyncio.sleep(0.02)
        assert log == [("start", "a")] and not fut.done()  # its work runs: not finished
        a.done.set()
        return await asyncio.wait_for(fut, 5)

    assert asyncio.run(go()) == "a"
    assert log == [("start", "a"), ("finish", "a")]


def test_a_lone_call_that_is_not_quick_is_finished_at_once(worker):
    """Nothing queued and not quick: no watching (a wake-up every 100 µs, an answer up to
    that late) — the engine thread goes straight to its finish, which does the waiting."""
    log: list = []
    a = Call("a", log, quick=False)

    async def go():
        return await asyncio.wait_for(worker.submit(a.start, quick=a.quick), 5)

    assert asyncio.run(go()) == "a"
    assert log == [("start", "a"), ("finish", "a")] and not a.done.is_set()  # finished before 'ready'


def test_failures_and_empty_starts_go_to_their_own_calls(worker):
    log: list = []
    calls = [Call("a", log), Call("b", log, start_error=ValueError("b's start")),
             Call("c", log, finish_error=RuntimeError("c's finish")), Call("d", log, nothing=True), Call("e", log)]
    got = asyncio.run(run_calls(worker, calls))
    assert got[0] == "a" and got[3] is None and got[4] == "e"
    assert isinstance(got[1], ValueError) and isinstance(got[2], RuntimeError)
    # every started call finished once, in the order started
    assert [n for k, n in log if k == "finish"] == ["a", "c", "e"]
    assert [n for k, n in log if k == "start"] == list("abcde")


def test_a_hint_that_raises_runs_its_call_after_the_one_before(worker):
    """``quick()`` raising must not end the engine thread: the call runs, not ahead."""
    log: list = []
    a, b, c = Call("a", log), Call("b", log), Call("c", log)

    def broken() -> bool:
        raise RuntimeError("a bad hint")

    b.quick = broken  # type: ignore[method-assign]
    assert asyncio.run(asyncio.wait_for(run_calls(worker, [a, b, c]), 10)) == ["a", "b", "c"]
    assert log == [("start", "a"), ("finish", "a"), ("start", "b"), ("start", "c"), ("finish", "b"),
                   ("finish", "c")]
    assert overlapped(worker) == 1  # c alone
    assert worker._thread.is_alive()


def test_a_call_cancelled_while_queued_never_starts(worker):
    log: list = []

    async def go():
        gate = threading.Event()
        hold = worker.submit(gate.wait)
        a, b, c = Call("a", log), Call("b", log), Call("c", log)
        for x in (a, b, c):
            x.done.set()
        fa, fb, fc = (worker.submit(x.start, quick=x.quick) for x in (a, b, c))
        fb.cancel()  # reaches the worker's future through a loop callback: let it run first
        for _ in range(2):
            await asyncio.sleep(0)
        gate.set()
        await hold
        return await fa, await fc, fb.cancelled()

    assert asyncio.run(go()) == ("a", "c", True)
    assert ("start", "b") not in log and [n for k, n in log if k == "finish"] == ["a", "c"]


def test_a_started_call_finishes_before_the_worker_stops():
    log: list = []
    w = EngineWorker(Metrics())
    a = Call("a", log)

    async def go():
        fut = w.submit(a.start, quick=a.quick)
        await until_started(log)
        w.stop()  # queued behind it: the worker finishes the started call first
        a.done.set()
        return await asyncio.wait_for(fut, 5)

    assert asyncio.run(go()) == "a"
    w._thread.join(5)
    assert not w._thread.is_alive()


# ---- the hint: Engine.starts_without_waiting --------------------------------------------------


def test_starts_without_waiting_only_where_the_start_queues_work_alone():
    """On a CPU the start computes: never. With the engine's device taken for a GPU (q's
    device is then 'the engine's'), the hint follows q, cache_write and the planned chunks."""
    eng = make_engine()
    bs, W = eng.config.cache.block_size, eng.config.workspace_tokens
    q = torch.zeros((2, eng.config.shape.heads, 192), dtype=torch.bfloat16)

    def req(*contexts, **kw):
        return PrefillRequest(q, [SequenceSpec(1, n, list(range(-(-n // bs)))) for n in contexts], **kw)

    assert not eng.starts_without_waiting(req(bs, bs))  # a CPU engine
    eng.device, eng._device_index = torch.device("cuda"), -1  # as a GPU engine sees a q on its own device
    assert eng.starts_without_waiting(req(bs, bs))
    assert eng.starts_without_waiting(req(STOP_AHEAD * W, 0))  # STOP_AHEAD chunks: all queued at once
    assert not eng.starts_without_waiting(req(STOP_AHEAD * W + bs, 0))  # one more: the loop waits for the first
    assert not eng.starts_without_waiting(req(2 * W, 0, workspace_tokens=W // 4))  # 8 chunks of W / 4
    assert not eng.starts_without_waiting(req(bs, bs, workspace_tokens=1))  # less than a block: its checks say so
    plan = [ContextChunk(0, (0,), (bs,))] * (STOP_AHEAD + 1)
    assert not eng.starts_without_waiting(req(bs, bs, plan=plan))
    assert eng.starts_without_waiting(req(bs, bs, plan=plan[:2]))
    w = WriteRequest(torch.zeros(1, dtype=torch.int64), torch.zeros((1, 512)), torch.zeros((1, 64)))
    assert not eng.starts_without_waiting(req(bs, bs, cache_write=w))
    eng._device_index = 0  # q on another device than the engine's
    assert not eng.starts_without_waiting(req(bs, bs))
    # the flag's help names the same bound
    assert f"at most {STOP_AHEAD} chunks" in settings._HELP["request_overlap"]
