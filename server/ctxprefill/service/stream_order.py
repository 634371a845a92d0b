"""Stream order for a request ring (``--request-ring-stream-order``; docs/TRANSPORT.md).

A stream-ordered ring hands CUDA events across the two processes instead of waits on
the host: the caller records a slot's *ready* event on its stream after writing the
request's inputs, the server makes its device work wait for it (``cudaStreamWaitEvent``)
and records the slot's *done* event after the results' copies and the cache_write, and
answers as soon as that is queued. Neither host waits for the device, so both run
ahead of it and the device goes from the caller's work to the server's and back.

:class:`StreamOrder` holds a ring's events and the requests whose device work has not
finished: each has a private event (the slot's done event is recorded again by the
slot's next request) and what runs once it has fired (metrics, releasing its regions).
At most ``num_slots`` such requests per ring: the engine thread waits for the oldest
before it starts another, up to ``timeout_s``; past that the caller's stream is taken
as stalled and the ring is detached (the server's stream still waits for the event:
only the caller can release it) and the unfinished requests keep their regions held.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import time
from collections.abc import Callable, Sequence

import torch

from ..errors import FailedPrecondition, InvalidArgument

log = logging.getLogger("ctxprefill.service")

EVENT_HANDLE_BYTES = 64  # sizeof(cudaIpcEventHandle_t)


@dataclasses.dataclass(frozen=True)
class SlotOrder:
    """One slot's two events, as a request taken from it uses them."""

    ready: torch.cuda.Event  # the caller's: recorded once the request's inputs are written
    done: torch.cuda.Event  # ours: recorded once its results and cache_write are written
    after: Callable[[torch.cuda.Event, Callable[[], None]], None]  # StreamOrder.after

    def wait_ready(self, device: torch.device) -> None:
        """The engine's stream waits (on the device) for the caller's inputs."""
        torch.cuda.current_stream(device).wait_event(self.ready)

    def record_done(self, device: torch.device) -> torch.cuda.Event:
        """Record the slot's done event and a private one after what is queued; the
        private one is returned (the slot's is recorded again by its next request)."""
        stream = torch.cuda.current_stream(device)
        self.done.record(stream)
        fired = torch.cuda.Event()
        fired.record(stream)
        return fired


class StreamOrder:
    """A stream-ordered ring's events (one ready and one done per slot) and its requests
    whose device work is queued and not known to be finished."""

    def __init__(self, ready: list[torch.cuda.Event], done: list[torch.cuda.Event], timeout_s: float,
                 handles: list[bytes] | None = None):
        self.ready, self.done, self.timeout_s = ready, done, float(timeout_s)
        self.handles = handles or []  # our done events' IPC handles (``done_events``)
        self.stalled = False  # a request outlived timeout_s
        self._in_flight: collections.deque[tuple[torch.cuda.Event, Callable[[], None]]] = collections.deque()

    @classmethod
    def open(cls, handles: Sequence[bytes], num_slots: int, device: torch.device, timeout_s: float) -> StreamOrder:
        """The caller's events from their IPC handles (``ready_events``) and ours; a bad
        handle is INVALID_ARGUMENT naming ``ready_events``."""
        if device.type != "cuda":
            raise FailedPrecondition("ready_events", "stream order needs a CUDA server (this one runs on "
                                                     f"{device.type})")
        if len(handles) != num_slots:
            raise InvalidArgument("ready_events", f"{len(handles)} event handles for {num_slots} slots: one per slot")
        ready = []
        for i, h in enumerate(handles):
            if len(h) != EVENT_HANDLE_BYTES:
                raise InvalidArgument("ready_events", f"handle {i} has {len(h)} bytes, a cudaIpcEventHandle_t "
                                                      f"{EVENT_HANDLE_BYTES}")
            try:
                ready.append(torch.cuda.Event.from_ipc_handle(device, bytes(h)))
            except RuntimeError as e:
                raise InvalidArgument("ready_events", f"handle {i} does not open as a CUDA IPC event on this "
                                                      f"server's GPU: {str(e).splitlines()[0]}") from None
        done = [torch.cuda.Event(interprocess=True) for _ in range(num_slots)]
        with torch.cuda.device(device):  # torch creates an event at its first use, on the current device
            handles = [bytes(e.ipc_handle()) for e in done]
        return cls(ready, done, timeout_s, handles)

    def slot(self, i: int) -> SlotOrder:
        return SlotOrder(self.ready[i], self.done[i], self.after)

    def after(self, fired: torch.cuda.Event, fn: Callable[[], None]) -> None:
        """Run ``fn`` (on the engine thread) once ``fired`` has."""
        self._in_flight.append((fired, fn))

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def settle(self) -> None:
        """Run what waits for the requests that have finished, oldest first (no waiting)."""
        q = self._in_flight
        while q and q[0][0].query():
            q.popleft()[1]()

    def wait_oldest(self) -> None:
        """Wait for the oldest request in flight (polling, ``timeout_s`` at most) and
        settle it; FAILED_PRECONDITION naming ``ready_events`` when it has not finished
        by then (the ring is then taken as stalled: :meth:`drain` does not wait)."""
        if self._in_flight and not self._settle_oldest(time.monotonic() + self.timeout_s):
            self.stalled = True
            raise FailedPrecondition("ready_events", f"a request has not finished within {self.timeout_s:g} s: "
                                                     f"the caller's ready event has not fired (its stream is "
                                                     f"stalled); the ring is detached")

    def _settle_oldest(self, deadline: float) -> bool:
        """Wait for the oldest request until ``deadline`` and settle it; False if it has not finished."""
        fired, fn = self._in_flight[0]
        if not self._wait(fired, deadline):
            return False
        self._in_flight.popleft()
        fn()
        return True

    #: how long a wait polls without sleeping (a sleeping thread wakes ~0.1 ms late on a VM,
    #: and the next request's host work waits for this one)
    SPIN_S = 0.005

    @classmethod
    def _wait(cls, fired: torch.cuda.Event, deadline: float) -> bool:
        spin_until = time.monotonic() + cls.SPIN_S
        pause = 50e-6
        while not fired.query():
            now = time.monotonic()
            if now > deadline:
                return False
            if now < spin_until:
                os.sched_yield()  # releases the GIL
                continue
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
        return True

    def drain(self) -> None:
        """Settle every request in flight (the ring is let go), waiting ``timeout_s`` in all
        (not at all for a stalled ring). What has not finished by then keeps its regions
        held — its work may still write them once the caller's event fires — and is logged."""
        deadline = time.monotonic() + (0.0 if self.stalled else self.timeout_s)
        while self._in_flight:
            if not self._settle_oldest(deadline):
                log.error("stream-ordered ring let go with requests unfinished on the device: their shared-memory "
                          "regions stay held", extra={"requests": len(self._in_flight)})
                self._in_flight.clear()
                return
