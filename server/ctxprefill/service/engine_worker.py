"""The engine thread: one daemon thread that owns the device and runs every engine call
in submission order (:class:`EngineWorker`), between the calls the request rings it
polls, and the out-of-memory guard every call runs under (:func:`oom_guarded`: a device
OOM fails only that request, RESOURCE_EXHAUSTED, after freeing what it held)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import dataclasses
import gc
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import grpc
import torch

from ..engine.request import StopSignal
from .interceptors import DEADLINE_SLACK_S, RpcStatusError
from .metrics import Metrics
from .request_ring import AttachedRing

log = logging.getLogger("ctxprefill.service")

_OOM_TYPES = (torch.OutOfMemoryError, MemoryError)
#: how allocators word it: CUDA ("CUDA out of memory"), torch's CPU allocator
#: ("DefaultCPUAllocator: can't allocate memory: you tried to allocate ..."), cuBLAS
_OOM_MESSAGES = ("out of memory", "can't allocate memory", "cannot allocate memory", "cublas_status_alloc_failed")


def _is_oom(e: BaseException) -> bool:
    if isinstance(e, _OOM_TYPES):
        return True
    return isinstance(e, RuntimeError) and any(m in str(e).lower() for m in _OOM_MESSAGES)


T = TypeVar("T")
#: what runs a ring request: (ring, its slot, its payload or None when it did not fit, a list of
#: what may run once the answer is written) -> a function that returns the answer's bytes (the
#: request's device work queued in between)
RingHandler = Callable[[AttachedRing, int, bytes | None, list[Callable[[], None]]], Callable[[], bytes]]


@dataclasses.dataclass(eq=False)
class _Job:
    """A call queued for the engine thread."""

    future: concurrent.futures.Future[Any]
    context: contextvars.Context
    fn: Callable[[], Any]
    deadline: float | None  # time.monotonic() seconds
    # a call in two steps: ``fn`` queues its device work and returns what finishes it (or None:
    # nothing to finish, the result is None); ``quick()`` says whether that start returns
    # without waiting for the device, so that it may run before the previous call's finish
    quick: Callable[[], bool] | None = None


@dataclasses.dataclass(eq=False)
class _Started:
    """A two-step call whose device work is queued and whose finish has not run."""

    job: _Job
    finish: Callable[[], Any]  # may have ``ready()``: whether the work it waits for is done
    # a quick call: while its work runs the engine thread watches the queue for the next one
    # (a call that is not quick is finished at once, waiting in its finish: no polling)
    watch: bool = False


@dataclasses.dataclass(eq=False)
class _RingTurn:
    """A ring request started (its device work queued) and not answered yet."""

    ring: AttachedRing
    slot: int
    seq: int
    answer: Callable[[], bytes]
    after: list[Callable[[], None]]  # what runs once the answer is written


class EngineWorker:
    """One daemon thread that runs every engine call, in submission order.

    ``submit`` returns an asyncio future; cancelling it before the call starts drops
    the call at once: it leaves the queue depth right away (not when its turn would
    have come) and is counted as ``rejected{reason="deadline"}`` when its deadline had
    passed, ``rejected{reason="cancelled"}`` otherwise; cancelling it while it runs
    cancels its ``stop`` signal, which the chunk loop asks between chunks. A call whose ``deadline``
    (``time.monotonic()`` seconds) has passed when its turn comes is not run either
    (``reason="deadline"``). The thread is a daemon so that a call still running after
    the drain's grace period cannot keep the process alive.
    """

    def __init__(self, metrics: Metrics, ring_spin_s: float = 0.02, ring_poll_s: float = 100e-6,
                 ring_overlap: bool = True, request_overlap: bool = True):
        self.metrics = metrics
        self._q: queue.SimpleQueue[_Job | object | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._waiting = 0
        # request rings (request_ring.py): polled by this thread between queued calls
        self._rings: tuple[AttachedRing, ...] = ()
        self.ring_handler: RingHandler | None = None  # set by the servicer
        self.release_on_oom: Callable[[], int] | None = None  # set by the servicer (oom_guarded's release)
        self.ring_spin_s, self.ring_poll_s = float(ring_spin_s), float(ring_poll_s)
        self.ring_overlap = bool(ring_overlap)  # False: each ring request is answered before the next starts
        # two-step calls (submit's ``quick``): the next quick one is started before the previous one
        # finishes; False: each finishes before the next starts
        self.request_overlap = bool(request_overlap)
        self._thread = threading.Thread(target=self._run, name="ctxprefill-engine", daemon=True)
        self._thread.start()

    @property
    def waiting(self) -> int:
        return self._waiting

    def _leave_queue(self) -> None:
        """One job out of the waiting count: its future was cancelled while queued, or the
        engine thread started it (never both: a started future cannot be cancelled)."""
        with self._lock:
            self._waiting -= 1
            self.metrics.queue_depth.set(self._waiting)

    def submit(self, fn: Callable[[], Any], deadline: float | None = None,
               stop: StopSignal | None = None, quick: Callable[[], bool] | None = None) -> asyncio.Future[Any]:
        """Queue ``fn`` for the engine thread. With ``quick`` it is a call in two steps: ``fn``
        queues the device work and returns the function that finishes it (waits, answers),
        whose result the future gets (None where ``fn`` returns None); while one such call's
        work runs, the engine thread starts the next queued one whose ``quick()`` holds (its
        start does not wait for the device) before finishing the first, so that the device
        goes from one call's work to the next (``request_overlap``)."""
        cf: concurrent.futures.Future[Any] = concurrent.futures.Future()
        job = _Job(cf, contextvars.copy_context(), fn, deadline, quick)
        with self._lock:
            self._waiting += 1
            self.metrics.queue_depth.set(self._waiting)

        def expired() -> bool:
            # gRPC cancels a call when its deadline passes; allow for the two clocks
            return deadline is not None and time.monotonic() >= deadline - DEADLINE_SLACK_S

        def on_done(f: concurrent.futures.Future[Any]) -> None:
            # not the job: the future holds this, and an answer's tensor would wait in a
            # reference cycle for the garbage collector
            if f.cancelled():
                self._leave_queue()
                self.metrics.rejected.labels(reason="deadline" if expired() else "cancelled").inc()

        cf.add_done_callback(on_done)
        self._q.put(job)
        awaited = asyncio.wrap_future(cf)
        if stop is not None:
            def on_cancel(f: asyncio.Future[Any]) -> None:
                if f.cancelled():  # the caller went away: a running call stops at its next chunk
                    stop.cancel("deadline" if expired() else "cancelled")

            awaited.add_done_callback(on_cancel)
        return awaited

    def stop(self, wait_s: float = 0.0) -> bool:
        """End the thread after the calls queued so far; wait up to ``wait_s`` for it. True
        once it has ended. The process must not exit while it runs: interpreter shutdown
        ends a daemon thread that takes the GIL back inside torch's C++ (freeing a tensor
        does) with an unwind that C++ turns into std::terminate, and the process aborts."""
        self._q.put(None)
        if wait_s > 0:
            self._thread.join(wait_s)
        return self.ended

    @property
    def ended(self) -> bool:
        return not self._thread.is_alive()

    def add_ring(self, ring: AttachedRing) -> None:
        """Poll ``ring`` from now on (until it reports itself stopped)."""
        with self._lock:
            self._rings = (*self._rings, ring)
        self._q.put(_WAKE)  # the thread may be blocked on an empty queue

    def _run(self) -> None:
        hot_until = 0.0  # spin (no sleeping) until then: a ring had a request lately
        started: _Started | None = None  # a two-step call whose finish has not run
        while True:
            rings = self._rings
            if started is not None:  # the next call, or its finish once its work is done
                item = self._next_beside(started)
                if item is _WAKE:
                    self._finish(started)
                    started = None
            elif not rings:
                item = self._q.get()
            elif time.monotonic() < hot_until:
                try:
                    item = self._q.get_nowait()
                except queue.Empty:
                    item = _WAKE
                    os.sched_yield()  # releases the GIL between polls
            else:
                try:
                    item = self._q.get(timeout=self.ring_poll_s)
                except queue.Empty:
                    item = _WAKE
            if item is None:
                if started is not None:
                    self._finish(started)
                return
            if isinstance(item, _Job):
                quick = self.request_overlap and _quick(item)
                if started is not None and not quick:  # without request_overlap no call is quick
                    self._finish(started)
                    started = None
                if item.quick is None:
                    self._call(item)
                else:
                    nxt = self._start(item, watch=quick)
                    if started is not None:  # nxt started ahead of its finish; queued first, it finishes first
                        if nxt is not None:
                            self.metrics.overlapped_requests.inc()
                        self._finish(started)
                    started = nxt
                item = None  # its future holds the result (an answer's tensor): not until the next job
            if rings and started is not None:  # the rings pipeline their own requests
                self._finish(started)
                started = None
            if rings and self._poll_rings(rings):
                hot_until = time.monotonic() + self.ring_spin_s

    def _next_beside(self, started: _Started) -> object:
        """The next queued item, waited for while ``started``'s work runs; ``_WAKE`` once it
        is done. Watching costs a wake-up every ``_BESIDE_POLL_S`` and answers up to that
        much after the work is done, so a call that is not quick (or whose finish cannot
        say) gets only what is queued already, then is finished, waiting in its finish."""
        ready = getattr(started.finish, "ready", None)
        if not started.watch or ready is None:
            try:
                return self._q.get_nowait()
            except queue.Empty:
                return _WAKE
        while not ready():
            try:
                return self._q.get(timeout=_BESIDE_POLL_S)
            except queue.Empty:
                pass
        return _WAKE

    #: requests served per poll of the rings at most, before queued calls get a turn
    RING_BURST = 16

    def _poll_rings(self, rings: tuple[AttachedRing, ...]) -> bool:
        """Serve the rings' waiting requests, round robin, at most ``RING_BURST``; True when
        one was served. They are pipelined: the next request is started (validated, its
        device work queued) before the previous one is waited for and answered, so that
        the device goes from one request's work to the next instead of waiting for the
        host in between (one ring with two requests in flight keeps it busy). Without
        ``ring_overlap`` each request is answered before the next is started. A
        stream-ordered ring's request is answered once queued (its device work is not
        waited for), after its ring's finished requests are settled; with ``num_slots``
        of them unfinished the oldest is waited for first (stream_order.py)."""
        assert self.ring_handler is not None
        served, live = 0, list(rings)
        pending: _RingTurn | None = None
        took = True
        for ring in rings:
            if ring.order is not None:
                ring.order.settle()
        while took and served < self.RING_BURST:
            took = False
            for ring in list(live):
                if served >= self.RING_BURST:
                    break
                if not ring.usable():
                    live.remove(ring)
                    continue
                got = ring.take()
                if got is None:
                    continue
                if ring.order is not None and ring.order.in_flight >= ring.num_slots:
                    try:
                        ring.order.wait_oldest()
                    except Exception as e:  # noqa: BLE001 - a stalled caller: its ring ends, the server goes on
                        log.error("stream-ordered ring detached: %s", e, extra={"ring": ring.ring_id})
                        ring.fail(e)
                        live.remove(ring)
                        continue
                slot, seq, payload = got
                after: list[Callable[[], None]] = []
                started = _RingTurn(ring, slot, seq, self.ring_handler(ring, slot, payload, after), after)
                if ring.order is not None or not self.ring_overlap:
                    # answered now: a stream-ordered one once queued (the caller's stream waits on
                    # the device); without overlap, each before the next starts
                    self._answer_ring(started)
                else:
                    if pending is not None:
                        self._answer_ring(pending)
                    pending = started
                served += 1
                took = True
        if pending is not None:
            self._answer_ring(pending)
        if len(live) != len(rings):
            with self._lock:  # add_ring runs on the event loop
                self._rings = tuple(r for r in self._rings if r not in rings or r in live)
        return served > 0

    @staticmethod
    def _answer_ring(turn: _RingTurn) -> None:
        data = turn.answer()  # always: it waits for the request and releases what it holds
        if not turn.ring.stopped.done():  # the ring may have been let go since the request was taken
            turn.ring.answer(turn.slot, turn.seq, data)
        for fn in turn.after:  # metrics, releasing regions: while the caller reads its answer
            fn()

    def _begin(self, job: _Job) -> bool:
        """Whether queued ``job`` runs now: not when cancelled while queued (counted by
        on_done) or when its deadline passed (answered DEADLINE_EXCEEDED here)."""
        cf = job.future
        if not cf.set_running_or_notify_cancel():
            return False
        self._leave_queue()
        if job.deadline is not None and time.monotonic() >= job.deadline:
            self.metrics.rejected.labels(reason="deadline").inc()
            cf.set_exception(RpcStatusError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                            "the deadline passed while the request was queued; it was not run",
                                            "deadline"))
            return False
        return True

    def _settle(self, job: _Job, fn: Callable[[], Any]) -> tuple[bool, Any]:
        """Run ``fn`` in ``job``'s context under the out-of-memory guard: (True, its result),
        or (False, None) with its error handed to the job's future."""
        try:
            return True, job.context.run(oom_guarded, fn, self.metrics, self.release_on_oom)
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting handler
            job.future.set_exception(e)
            return False, None

    def _call(self, job: _Job) -> None:
        """Run one queued call (unless it was cancelled or its deadline passed)."""
        if self._begin(job):
            ok, result = self._settle(job, job.fn)
            if ok:
                job.future.set_result(result)
        job.fn = _done  # the request's closures (and the tensors they hold) go now, not with the job
        del job

    def _start(self, job: _Job, watch: bool = False) -> _Started | None:
        """Start a two-step call: its device work queued, its finish held (None where it
        did not start, failed or had nothing to finish: its future is then set); ``watch``:
        a quick call (:meth:`_next_beside`)."""
        started = None
        if self._begin(job):
            ok, finish = self._settle(job, job.fn)
            if ok and finish is None:
                job.future.set_result(None)
            elif ok:
                started = _Started(job, finish, watch)
        job.fn = _done
        return started

    def _finish(self, started: _Started) -> None:
        """A started call's finish: its result (or error) to its future."""
        job = started.job
        ok, result = self._settle(job, started.finish)
        if ok:
            job.future.set_result(result)
        started.finish = _done
        del job, started


def _done() -> None:
    return None


def _quick(job: _Job) -> bool:
    """Whether ``job`` is a two-step call whose start need not wait for the device. A hint:
    where asking raises, no (the call then runs after the one before it, and its start
    reports what is wrong)."""
    if job.quick is None:
        return False
    try:
        return job.quick()
    except Exception:  # noqa: BLE001 - the engine thread must outlive a bad hint
        log.debug("a call's quick() raised; it starts after the one before it", exc_info=True)
        return False


_WAKE = object()  # a queue item that only wakes the engine thread (a ring was attached)
#: while a started call's work runs, how often the engine thread checks whether it is done
_BESIDE_POLL_S = 100e-6


def oom_guarded(fn: Callable[[], T], metrics: Metrics, release: Callable[[], int] | None = None) -> T:
    """Run ``fn``; a device (or host) out-of-memory error becomes RESOURCE_EXHAUSTED after
    the memory the failed request held is freed, so that the server goes on; ``release``
    (the engine's :meth:`~ctxprefill.engine.engine.Engine.release_graphs`) drops what is
    kept only to go faster first, so that the retry finds that memory too."""
    oom = None
    try:
        return fn()
    except BaseException as e:  # noqa: BLE001
        if not _is_oom(e):
            raise
        oom = str(e).splitlines()[0] if str(e) else type(e).__name__
    # outside the except block: the traceback (and the tensors its frames hold) is gone
    dropped = release() if release is not None else 0
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    metrics.rejected.labels(reason="out_of_memory").inc()
    log.warning("request ran out of memory; dropped %d CUDA graphs, freed the allocator cache and going on: %s",
                dropped, oom)
    raise RpcStatusError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                         f"out of memory for this request ({oom}); retry smaller (fewer tokens, a smaller "
                         f"workspace_tokens) or later", "out_of_memory")
