"""The date and commit a benchmark's JSON records (bench/make_tables.py names each table's run by them)."""

from __future__ import annotations

import datetime
import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def utc_now() -> str:
    """'2026-12-02T08:52:02+00:00'."""
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def commit() -> str:
    """$CTXPREFILL_COMMIT (the tree the caller sent), else git's short HEAD here ('+dirty' with
    tracked files changed), else 'unknown'."""
    if os.environ.get("CTXPREFILL_COMMIT"):
        return os.environ["CTXPREFILL_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                 capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        out = changed = ""
    return out + ("+dirty" if changed else "") if out else "unknown"


def gpu_name() -> str | None:
    """The machine's first GPU by nvidia-smi (host-only benchmarks record the machine they ran on), or None."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        out = ""
    return out.splitlines()[0].strip() if out else None
