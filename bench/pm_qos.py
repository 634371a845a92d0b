"""Hold the CPU wake-up latency low while a benchmark runs (Linux PM QoS).

Writing a 32-bit latency in microseconds to ``/dev/cpu_dma_latency`` keeps every CPU
out of idle states slower to leave than that, for as long as the file stays open
(the request is dropped when it is closed): what the ``latency-performance`` tuned
profile does. A host whose idle cores sleep deeply wakes a thread slowly and runs it
on cold caches; the transport's fixed cost per request is mostly such wake-ups
(docs/TRANSPORT.md). Needs root; without it the benchmark says so and goes on.
"""

from __future__ import annotations

import contextlib
import os
import struct

PATH = "/dev/cpu_dma_latency"


@contextlib.contextmanager
def cpu_latency(us: int | None):
    """Yields a note: what was requested, or why not."""
    if us is None:
        yield "not requested"
        return
    try:
        fd = os.open(PATH, os.O_WRONLY)
    except OSError as e:
        yield f"cannot open {PATH}: {e.strerror}"
        return
    try:
        os.write(fd, struct.pack("i", int(us)))
        yield f"{PATH} held at {us} us"
    finally:
        os.close(fd)
