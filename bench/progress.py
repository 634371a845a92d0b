"""Progress lines of the benchmark scripts: ``[  12.3s] message``, seconds since the
script started (since this module was imported, at the script's top).

Plain lines, not a tqdm/rich bar: the runs' output is a log file (no terminal), where a bar's
redraws are noise; ``elapsed()`` is also the scripts' budget clock."""

from __future__ import annotations

import time

T0 = time.monotonic()


def elapsed() -> float:
    """Seconds since the script started."""
    return time.monotonic() - T0


def log(msg: str) -> None:
    print(f"[{elapsed():6.1f}s] {msg}", flush=True)
