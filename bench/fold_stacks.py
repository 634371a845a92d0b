"""Where a thread's time goes, from py-spy's raw (folded) stacks: each function's share of
the samples whose stack holds a frame containing ``--within`` (e.g. ``EngineWorker._run``:
the server's engine thread; ``MainThread``: a caller's main thread), inclusive (the
function or what it calls), the largest first.

  py-spy record --subprocesses --threads --nonblocking -f raw -o stacks.txt -- python3 bench/bench_model_workload.py ...
  python3 bench/fold_stacks.py stacks.txt --within EngineWorker._run --top 40
"""

from __future__ import annotations

import argparse
import collections
import sys


def fold(lines: list[str], within: str) -> tuple[int, collections.Counter[str], collections.Counter[str]]:
    """(samples, inclusive samples per function, own samples per function) of the matching stacks."""
    inclusive: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    total = 0
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        frames = stack.split(";")
        if not count.isdigit() or not any(within in f for f in frames):
            continue
        n = int(count)
        total += n
        for f in set(frames[1:]):
            inclusive[f] += n
        own[frames[-1]] += n
    return total, inclusive, own


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("stacks", help="py-spy record -f raw output (--threads: the thread's name leads each stack)")
    p.add_argument("--within", default="EngineWorker._run", help="part of a frame the stacks must hold")
    p.add_argument("--top", type=int, default=40)
    ns = p.parse_args(argv)
    with open(ns.stacks) as f:
        total, inclusive, own = fold(f.readlines(), ns.within)
    print(f"{total} samples within {ns.within!r}")
    if total:
        print("inclusive %  own %  function")
        for name, n in inclusive.most_common(ns.top):
            print(f"{100 * n / total:11.1f} {100 * own[name] / total:6.1f}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
