"""Wall time per stage without synchronizing inside the chunk loop.

On a GPU each stage is bracketed by CUDA events and read once at the end (one sync
per request); on the CPU by ``perf_counter_ns``.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict

import torch


class StageTimer:
    def __init__(self, device: torch.device):
        self.cuda = torch.device(device).type == "cuda"
        self._events: list[tuple[str, object, object]] = []
        self._ns: dict[str, int] = defaultdict(int)
        self._t0 = time.perf_counter_ns()

    @contextlib.contextmanager
    def stage(self, name: str):
        if self.cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            yield
            b.record()
            self._events.append((name, a, b))
        else:
            t = time.perf_counter_ns()
            yield
            self._ns[name] += time.perf_counter_ns() - t

    def finish(self) -> tuple[dict[str, int], int]:
        """(nanoseconds per stage, total nanoseconds); synchronizes on a GPU."""
        if self.cuda:
            torch.cuda.synchronize()
            for name, a, b in self._events:
                self._ns[name] += int(a.elapsed_time(b) * 1e6)
        return dict(self._ns), time.perf_counter_ns() - self._t0
