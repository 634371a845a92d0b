"""Counting device kernel launches, op by op.

Each op notes how many kernels it launches on a GPU (its CUDA version, or the torch
ops of its generic form); the engine opens a ``stage`` around each step of the chunk
loop, so that counts land under the stage that caused them. On the CPU the same
counts are noted, so that the metric means the same everywhere; on the GPU a test
checks them against the CUDA profiler's kernel count.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from contextvars import ContextVar

_stage: ContextVar[tuple[Counter, str] | None] = ContextVar("ctxprefill_stage", default=None)


def note(n: int = 1) -> None:
    """Record ``n`` kernel launches under the current stage (no-op outside one)."""
    cur = _stage.get()
    if cur is not None and n:
        cur[0][cur[1]] += n


def enter(counts: Counter, name: str):
    """Start attributing launches to ``counts[name]``; returns the token for :func:`leave`
    (the chunk loop's stages, without a generator-based context manager per stage)."""
    return _stage.set((counts, name))


def leave(token) -> None:
    _stage.reset(token)


@contextlib.contextmanager
def stage(counts: Counter, name: str):
    """Attribute the launches noted inside this block to ``counts[name]``."""
    token = enter(counts, name)
    try:
        yield
    finally:
        leave(token)
