"""Wall time per stage without synchronizing inside the chunk loop.

On a GPU each stage is bracketed by CUDA events and read once at the end (one sync
per request); on the CPU by ``perf_counter_ns``.

The events are cheap only when recorded cheaply: a request of 4 chunks records 48 of
them, and a short request (16 heads, 1,024 new tokens: ~2.8 ms) is bound by the host
issuing its kernels, so every microsecond of Python between launches is a microsecond
of the request. ``torch.cuda.Event.record()`` without a stream looks the current stream
up each time (~5 µs of device-index and availability checks), and a new Event is a new
``cudaEvent`` created at its first record: the stream is looked up once per request and
the events come from a per-device pool, returned once they have been read.

``span_ns`` (after :meth:`finish`): from the first stage's start to the last stage's end,
on the device's clock on a GPU. A request's wall time minus its span is host work before
and after the device's; the span minus the stages' sum is time between stages (device
work outside them, or the device waiting on the host) — how ``ctxprefill bench`` splits
the gap it reports.

:class:`DetailedStageTimer` also keeps where each stage lies — its chunk, its start and
its duration (:class:`StageSpan`), read with the durations, in the same sync: what a
request's trace shows (``ctxprefill.service.tracing``). The plain timer keeps none.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from typing import cast

import torch

from ..ops import _cuda

#: a point in time of a stage: a recorded CUDA event on a GPU, ``perf_counter_ns`` on the CPU
Mark = torch.cuda.Event | int
#: what :meth:`StageTimer.begin` returns and :meth:`StageTimer.end` takes: (stage, its start).
#: A pair, not a dataclass: 24 of them per 4-chunk request, and a frozen dataclass costs the
#: host ~1 us more each
Started = tuple[str, Mark]


@dataclasses.dataclass(frozen=True, slots=True)
class StageSpan:
    """One stage of a request's chunk loop, as :class:`DetailedStageTimer` saw it."""

    stage: str
    chunk: int  # the chunk's index in the plan; -1: before the first chunk (the output's initialisation)
    start_ns: int  # perf_counter_ns clock; on a GPU the first stage's issue time plus its device offset
    duration_ns: int  # on the device's clock on a GPU


# device index -> events ready for reuse (list append/pop are atomic under the GIL)
_POOLS: dict[int, list[torch.cuda.Event]] = defaultdict(list)


class StageTimer:
    #: set by the chunk loop to the index of the chunk it runs (DetailedStageTimer files stages under it)
    chunk = -1
    #: DetailedStageTimer: every stage's place, once finished; the plain timer keeps none
    stages: list[StageSpan] | None = None
    #: read each stage's start (from the first stage's) with the durations, on a GPU
    _offsets = False

    def __init__(self, device: torch.device | str, stream: torch.cuda.Stream | None = None):
        """``stream``: the device's current stream, where the caller knows it (looking it
        up costs the host microseconds)."""
        device = torch.device(device)
        self.cuda = device.type == "cuda"
        self._events: list[tuple[str, Mark, Mark]] = []  # (stage, start event, end event) on a GPU
        self._ns: dict[str, int] = defaultdict(int)
        self._t0 = time.perf_counter_ns()
        self._first: Mark | None = None  # the first stage's start
        self._last: Mark | None = None  # the last stage's end
        self.span_ns = 0
        if self.cuda:
            self._stream = stream if stream is not None else torch.cuda.current_stream(device)
            self._pool = _POOLS[self._stream.device_index]

    def _event(self) -> torch.cuda.Event:
        try:
            return self._pool.pop()
        except IndexError:
            return torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]  # (torch's is unannotated)

    def begin(self, name: str) -> Started:
        """Start timing stage ``name``; returns what :meth:`end` takes. A stage that raises
        is never ended: its start event is dropped, not returned to the pool."""
        a: Mark
        if self.cuda:
            a = self._event()
            a.record(self._stream)
        else:
            a = time.perf_counter_ns()
        return self._open(name, a)

    def _open(self, name: str, a: Mark) -> Started:
        if self._first is None:
            self._first = a
        return name, a

    def begin_recorded_by_caller(self, name: str) -> tuple[Started, int]:
        """:meth:`begin` for a caller that records the start itself, on this timer's
        stream (a plain CUDA timer: DetailedStageTimer keeps no place for it): (what
        :meth:`end_recorded_by_caller` takes, the start's ``cudaEvent_t`` handle)."""
        a = self._created_event()
        return self._open(name, a), a.cuda_event

    def end_recorded_by_caller(self, started: Started) -> int:
        """:meth:`end` for a caller that records the end itself: the end's ``cudaEvent_t``
        handle, to record on this timer's stream after the stage's work."""
        b = self._created_event()
        self._close(started, b)
        return b.cuda_event

    def _created_event(self) -> torch.cuda.Event:
        """An event of the pool with its ``cudaEvent_t`` made (torch makes it at the first record)."""
        e = self._event()
        if not e.cuda_event:
            e.record(self._stream)
        return e

    def end(self, started: Started) -> None:
        b: Mark
        if self.cuda:
            b = self._event()
            b.record(self._stream)
        else:
            b = time.perf_counter_ns()
        self._close(started, b)

    def _close(self, started: Started, b: Mark) -> None:
        name, a = started
        if self.cuda:
            self._events.append((name, a, b))
        else:
            self._ns[name] += cast(int, b) - cast(int, a)
        self._last = b

    @property
    def last(self) -> Mark | None:
        """The last stage's end: a recorded CUDA event on a GPU (valid until :meth:`finish`)."""
        return self._last

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        started = self.begin(name)
        yield
        self.end(started)

    def finish(self) -> tuple[dict[str, int], int]:
        """(nanoseconds per stage, total nanoseconds); synchronizes on a GPU."""
        if self.cuda:
            # the request's last stage's end event (every stage is on one stream): work queued
            # after the request (the next one's, in a pipelined server) is not waited for
            if self._last is None:
                torch.cuda.synchronize(self._stream.device)
            else:
                # on a GPU every mark is an event
                events = cast(list[tuple[str, torch.cuda.Event, torch.cuda.Event]], self._events)
                first, last = cast(torch.cuda.Event, self._first), cast(torch.cuda.Event, self._last)
                last.synchronize()
                pairs = [(first, last)] + [(a, b) for _, a, b in events]
                if self._offsets:
                    pairs += [(first, a) for _, a, _ in events]
                ms = _elapsed_ms(pairs)
                self.span_ns = int(ms[0] * 1e6)
                n = len(events)
                for (name, a, b), t in zip(events, ms[1 : n + 1], strict=True):
                    self._ns[name] += int(t * 1e6)
                    self._pool.extend((a, b))  # read: free to record again
                if self._offsets:
                    self._place([int(t * 1e6) for t in ms[n + 1 :]], [int(t * 1e6) for t in ms[1 : n + 1]])
            self._events.clear()
        elif self._last is not None:
            self.span_ns = cast(int, self._last) - cast(int, self._first)
            if self._offsets:
                self._place(*self._host_marks())
        self._first = self._last = None
        return dict(self._ns), time.perf_counter_ns() - self._t0

    def _host_marks(self) -> tuple[list[int], list[int]]:
        """(each stage's start from the first stage's, its duration) on the CPU (DetailedStageTimer)."""
        raise NotImplementedError

    def _place(self, offsets_ns: list[int], durations_ns: list[int]) -> None:
        """Keep each ended stage's place (DetailedStageTimer)."""
        raise NotImplementedError


class DetailedStageTimer(StageTimer):
    """A :class:`StageTimer` that also keeps each stage's :class:`StageSpan` (in
    :attr:`stages` after :meth:`finish`): the chunk it belongs to (``chunk``, set by the
    loop), its start and its duration. On a GPU the starts are read as device offsets
    from the first stage's start, with the durations and in the same sync, and placed
    from the host time the first stage was issued."""

    _offsets = True

    def __init__(self, device: torch.device | str):
        super().__init__(device)
        self._ended: list[tuple[str, int, int, int]] = []  # (stage, chunk, start, end); the marks on the CPU
        self._first_host_ns = 0
        self.stages: list[StageSpan] | None = None

    def begin(self, name: str) -> Started:
        if self._first is None:
            self._first_host_ns = time.perf_counter_ns()
        return super().begin(name)

    def end(self, started: Started) -> None:
        super().end(started)
        name, a = started
        if self.cuda:
            self._ended.append((name, self.chunk, 0, 0))
        else:
            self._ended.append((name, self.chunk, cast(int, a), cast(int, self._last)))

    def _host_marks(self) -> tuple[list[int], list[int]]:
        first = cast(int, self._first)
        self._first_host_ns = first
        return [a - first for _, _, a, _ in self._ended], [b - a for _, _, a, b in self._ended]

    def _place(self, offsets_ns: list[int], durations_ns: list[int]) -> None:
        self.stages = [StageSpan(name, chunk, self._first_host_ns + off, dur)
                       for (name, chunk, _, _), off, dur in zip(self._ended, offsets_ns, durations_ns, strict=True)]
        self._ended.clear()


def _elapsed_ms(pairs: Sequence[tuple[torch.cuda.Event, torch.cuda.Event]]) -> list[float]:
    """Milliseconds between each (start, end) pair of recorded events: in one call into
    the CUDA extension when it is loaded (~25 pairs per 4-chunk request; torch's
    ``Event.elapsed_time`` costs ~4 us of host each), else torch's one by one."""
    ext = _cuda.load()
    if ext is not None:
        got: list[float] = ext.events_elapsed_ms([e.cuda_event for pair in pairs for e in pair])
        return got
    return [a.elapsed_time(b) for a, b in pairs]
