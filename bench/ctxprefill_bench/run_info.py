"""The date and commit a benchmark's JSON records (bench/make_tables.py names each table's run by them)."""

from __future__ import annotations

import datetime
import os
import statistics
import subprocess
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def utc_now() -> str:
    """'2026-12-02T08:52:02+00:00'."""
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def _git_state() -> tuple[str, bool]:
    """(git's short HEAD here, or "" without git; whether tracked files differ from it)."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                 capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "", False
    return out, bool(changed)


def commit() -> str:
    """$CTXPREFILL_COMMIT (the tree the caller sent), else git's short HEAD here ('+dirty' with
    tracked files changed), else 'unknown'. A $CTXPREFILL_COMMIT that is this checkout's own
    HEAD while tracked files differ from it gets '+dirty' too: a command that ran ``git`` on
    the GPU machine, whose checkout can be older than the tree sent, named that older commit."""
    head, changed = _git_state()
    named = os.environ.get("CTXPREFILL_COMMIT")
    if named:
        own = bool(head) and (named.startswith(head) or head.startswith(named))
        return named + "+dirty" if own and changed and not named.endswith("+dirty") else named
    return head + ("+dirty" if changed else "") if head else "unknown"


def gpu_name() -> str | None:
    """The machine's first GPU by nvidia-smi (host-only benchmarks record the machine they ran on), or None."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        out = ""
    return out.splitlines()[0].strip() if out else None


def python_loop_ms(rounds: int = 20) -> float:
    """The host's speed as the median ms of a 100,000-step Python loop (eager rows, bounded by
    the host, compare across runs only beside it)."""
    def once() -> float:
        t = time.perf_counter()
        sum(range(100_000))
        return time.perf_counter() - t

    return statistics.median(once() for _ in range(rounds)) * 1e3
