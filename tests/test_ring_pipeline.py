"""The engine thread pipelines ring requests (service/engine_worker.py ``EngineWorker._poll_rings``):
the next request is started before the previous one is answered, every request is
answered once and in the order taken, at most ``RING_BURST`` per poll, and a ring let go
meanwhile gets no answer written, though its request is still finished. A stream-ordered
ring's request is answered once queued, its settling waits for its device event, and a
ring with ``num_slots`` unfinished requests waits for the oldest before taking another —
or is let go when that outlives the timeout (``service/stream_order.py``, events faked)."""

from __future__ import annotations

import concurrent.futures
import contextvars

import pytest

from ctxprefill.errors import FailedPrecondition
from ctxprefill.service.engine_worker import EngineWorker
from ctxprefill.service.metrics import Metrics
from ctxprefill.service.stream_order import StreamOrder


class FakeRing:
    def __init__(self, name: str, requests: int, log: list):
        self.name, self.left, self.log = name, requests, log
        self.stopped: concurrent.futures.Future = concurrent.futures.Future()
        self.slot = 0
        self.answers = []
        self.usable_calls = 0
        self.stop_after_usable = None  # stop (as unregistering does) at this call of usable()
        self.order = None  # a stream-ordered ring's StreamOrder
        self.ring_id = name
        self.num_slots = 4

    def usable(self) -> bool:
        self.usable_calls += 1
        if self.stop_after_usable is not None and self.usable_calls > self.stop_after_usable:
            if not self.stopped.done():
                self.stopped.set_result(None)
            return False
        return not self.stopped.done()

    def take(self):
        if self.left == 0:
            return None
        self.left -= 1
        slot, self.slot = self.slot, self.slot + 1
        return slot, 100 + slot, f"{self.name}{slot}".encode()

    def answer(self, slot, seq, data):
        assert seq == 100 + slot
        self.answers.append(data)
        self.log.append(("written", data.decode()))


def worker_with(log: list) -> EngineWorker:
    w = EngineWorker(Metrics())

    def handler(ring, slot, payload, after):
        name = payload.decode()
        log.append(("start", name))
        after.append(lambda: log.append(("after", name)))

        def answer():
            log.append(("answer", name))
            return payload

        return answer

    w.ring_handler = handler
    return w


def test_the_next_request_starts_before_the_previous_is_answered():
    log: list = []
    w = worker_with(log)
    try:
        ring = FakeRing("a", 3, log)
        assert w._poll_rings((ring,))
        assert log == [("start", "a0"), ("start", "a1"), ("answer", "a0"), ("written", "a0"), ("after", "a0"),
                       ("start", "a2"), ("answer", "a1"), ("written", "a1"), ("after", "a1"),
                       ("answer", "a2"), ("written", "a2"), ("after", "a2")]
        assert not w._poll_rings((ring,))  # nothing waits: nothing served
    finally:
        w.stop()


def test_rings_round_robin_and_the_burst_bound():
    log: list = []
    w = worker_with(log)
    try:
        a, b = FakeRing("a", 20, log), FakeRing("b", 2, log)
        assert w._poll_rings((a, b))
        started = [n for k, n in log if k == "start"]
        assert len(started) == EngineWorker.RING_BURST
        assert started[:4] == ["a0", "b0", "a1", "b1"]
        assert [n for k, n in log if k == "written"] == started  # each answered once, in the order taken
        assert a.left == 20 - (EngineWorker.RING_BURST - 2)  # the rest waits for the next poll
    finally:
        w.stop()


def test_a_ring_let_go_meanwhile_gets_no_answer_but_its_request_is_finished():
    log: list = []
    w = worker_with(log)
    try:
        ring = FakeRing("a", 2, log)
        ring.stop_after_usable = 1  # usable for the first take only
        assert w._poll_rings((ring,))
        assert ("answer", "a0") in log and ("after", "a0") in log  # finished, its regions released
        assert ring.answers == []  # nothing written into a ring the engine let go
        assert ring.left == 1  # and nothing more taken from it
    finally:
        w.stop()


def test_without_overlap_each_request_is_answered_before_the_next_starts():
    log: list = []
    w = worker_with(log)
    w.ring_overlap = False  # --no-request-ring-overlap
    try:
        ring = FakeRing("a", 2, log)
        assert w._poll_rings((ring,))
        assert log == [("start", "a0"), ("answer", "a0"), ("written", "a0"), ("after", "a0"),
                       ("start", "a1"), ("answer", "a1"), ("written", "a1"), ("after", "a1")]
    finally:
        w.stop()


class FakeEvent:
    """What StreamOrder asks of an event: query(); fires at the given query."""

    def __init__(self, fires_at: int | None = 1):
        self.fires_at, self.queries = fires_at, 0

    def query(self) -> bool:
        self.queries += 1
        return self.fires_at is not None and self.queries >= self.fires_at


def ordered_worker(log: list, fires_at: int | None = 1):
    """A worker whose handler, for a stream-ordered ring, registers each request's settling
    behind a fake event (as PrefillCall._queued does)."""
    w = EngineWorker(Metrics())

    def handler(ring, slot, payload, after):
        name = payload.decode()
        log.append(("start", name))
        ring.order.after(FakeEvent(fires_at), lambda: log.append(("settled", name)))
        return lambda: (log.append(("answer", name)), payload)[1]

    w.ring_handler = handler
    return w


def test_a_stream_ordered_request_is_answered_at_once_and_settled_once_its_event_fires():
    log: list = []
    w = ordered_worker(log, fires_at=2)  # each event fires at its second query
    try:
        ring = FakeRing("s", 2, log)
        ring.order = StreamOrder([], [], timeout_s=1.0)
        assert w._poll_rings((ring,))
        # answered one by one, no request held back for the next (the overlap of plain rings)
        assert log == [("start", "s0"), ("answer", "s0"), ("written", "s0"),
                       ("start", "s1"), ("answer", "s1"), ("written", "s1")]
        assert ring.order.in_flight == 2
        ring.order.settle()  # s0's first query: not fired, and nothing after it is settled first
        assert ring.order.in_flight == 2
        ring.order.settle()
        assert log[-1] == ("settled", "s0") and ring.order.in_flight == 1
        ring.order.settle()
        assert log[-1] == ("settled", "s1") and ring.order.in_flight == 0
    finally:
        w.stop()


def test_a_stream_ordered_ring_with_every_slot_unfinished_waits_for_the_oldest():
    log: list = []
    w = ordered_worker(log, fires_at=3)
    try:
        ring = FakeRing("s", 3, log)
        ring.num_slots = 2
        ring.order = StreamOrder([], [], timeout_s=5.0)
        w._poll_rings((ring,))
        starts = [i for i, e in enumerate(log) if e[0] == "start"]
        settled = [i for i, e in enumerate(log) if e == ("settled", "s0")]
        # s2 is taken only after s0 (the oldest of two unfinished) has settled
        assert settled and settled[0] < starts[2]
        assert ("settled", "s1") not in log[:starts[2]]
    finally:
        w.stop()


def test_a_stalled_stream_ordered_ring_is_let_go_and_keeps_its_requests_regions():
    log: list = []
    w = ordered_worker(log, fires_at=None)  # never fires
    try:
        ring = FakeRing("s", 3, log)
        ring.num_slots = 2
        ring.order = StreamOrder([], [], timeout_s=0.05)
        failed: list = []

        def fail(why):
            failed.append(why)
            ring.order.drain()  # as AttachedRing._release does
            ring.stopped.set_exception(why)

        ring.fail = fail
        w._poll_rings((ring,))
        assert [e for e in log if e[0] == "start"] == [("start", "s0"), ("start", "s1")]
        assert len(failed) == 1 and isinstance(failed[0], FailedPrecondition)
        assert failed[0].field == "ready_events" and "not finished within 0.05 s" in str(failed[0])
        assert ring.order.stalled and ring.order.in_flight == 0
        assert not any(e[0] == "settled" for e in log)  # unfinished: their regions stay held
        with pytest.raises(FailedPrecondition):
            ring.stopped.result()
    finally:
        w.stop()


def test_a_ring_request_out_of_memory_releases_the_graphs_before_its_answer():
    """A ring request that runs out of memory is answered RESOURCE_EXHAUSTED in-band, after
    the servicer's release (the engine's CUDA graphs) ran, as a unary call's would."""
    import torch

    from ctxprefill.service import streams
    from ctxprefill_api import pb

    released: list[int] = []

    class Call:
        stop = type("Stop", (), {"gone": None})()

        def start(self, defer, order):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.88 GiB")

        def abandon(self):
            pass

    ring = type("Ring", (), dict(payload_bytes=1 << 16, peer="ipv4:127.0.0.1:1", order=None,
                                 stopped=concurrent.futures.Future()))()
    payload = pb.PrefillContextRequest(request_id="r1").SerializeToString()
    ctx = contextvars.copy_context()  # the engine thread's: the request's peer and id stay in it
    answer = ctx.run(streams.start_ring_request, ring, 0, payload, [], open_call=lambda msg, rid, t0: Call(),
                     metrics=Metrics(), release=lambda: released.append(1) or 2)
    got = pb.PrefillContextStreamResponse.FromString(ctx.run(answer))
    assert released == [1] and got.request_id == "r1"
    assert got.error.code == 8 and "out of memory" in got.error.message  # RESOURCE_EXHAUSTED
