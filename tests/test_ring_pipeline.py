"""The engine thread pipelines ring requests (service/engine_worker.py ``EngineWorker._poll_rings``):
the next request is started before the previous one is answered, every request is
answered once and in the order taken, at most ``RING_BURST`` per poll, and a ring let go
meanwhile gets no answer written, though its request is still finished."""

from __future__ import annotations

import concurrent.futures

from ctxprefill.service.engine_worker import EngineWorker
from ctxprefill.service.metrics import Metrics


class FakeRing:
    def __init__(self, name: str, requests: int, log: list):
        self.name, self.left, self.log = name, requests, log
        self.stopped: concurrent.futures.Future = concurrent.futures.Future()
        self.slot = 0
        self.answers = []
        self.usable_calls = 0
        self.stop_after_usable = None  # stop (as unregistering does) at this call of usable()

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

    def handler(ring, payload, after):
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
