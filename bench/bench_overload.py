#!/usr/bin/env python3
"""Latency under overload: runs ``scripts/loadtest.py`` (a CPU server with ``--queue-size 8``;
8 closed-loop clients, then 64) and prints each phase's answered and refused latencies.
The refusals' p99 has a target, 50 ms (docs/RELIABILITY.md "Overload"); the exit code is
the script's (non-zero when a criterion, that target included, fails). tests/test_overload.py
judges the behaviour of the same run, not its latencies.

    python bench/bench_overload.py                  # 60 s per phase (docs/RELIABILITY.md's figure)
    python bench/bench_overload.py --duration 4     # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=60.0, help="seconds per phase")
    p.add_argument("--max-reject-p99-ms", type=float, default=50.0, help="the refusals' p99 target")
    ns, rest = p.parse_known_args(argv)  # anything else goes to scripts/loadtest.py
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "report.json")
        rc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "loadtest.py"),
                             "--duration", str(ns.duration), "--max-reject-p99-ms", str(ns.max_reject_p99_ms),
                             "--json", out, *rest], stdout=subprocess.DEVNULL).returncode
        if not os.path.exists(out):
            print(f"bench_overload: scripts/loadtest.py wrote no report (exit {rc})", file=sys.stderr)
            return rc or 1
        with open(out) as f:
            report = json.load(f)
    print(f"{'phase':6} {'clients':>7} {'answered/s':>10} {'answered p50/p99 ms':>20} {'refused/s':>9} "
          f"{'refused p50/p99/max ms':>23}")
    for name, ph in report["phases"].items():
        ok = f"{ph['ok_p50_ms']} / {ph['ok_p99_ms']}"
        rej = f"{ph['rejected_p50_ms']} / {ph['rejected_p99_ms']} / {ph['rejected_max_ms']}"
        print(f"{name:6} {ph['clients']:>7} {ph['ok_per_s']:>10} {ok:>20} {ph['rejected_per_s']:>9} {rej:>23}")
    for failure in report["failures"]:
        print(f"FAIL: {failure}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
