"""How evenly a ragged batch's attention tiles fill the GPU: a list-scheduling model of
the attention kernels' launch order (no GPU needed).

Each program is one (128-row query tile, head, segment) and costs its segment's key
blocks plus a start-up allowance; the hardware hands the next program of the launch order
to whichever SM frees first. The kernels launch segments longest-first (LPT), tiles of a
segment and head together. The model's makespan against a perfectly balanced one, for the
ragged batch and for an equal-length batch of the same work, predicts the throughput
ratio that ``bench_attention.py`` measures between them (target: within 10 %), what
per-SM work lists packed on the host could reach, and what the launch order the kernel is
now given (``ctxprefill.backends.tile_order``: those lists flattened by start time) reaches.

  python3 bench/simulate_tiles.py                      # bench_attention's ragged x4 case
  python3 bench/simulate_tiles.py --q 256 1792 640 1408 --k 27840 9280 37120 13888 --heads 16 128
"""

from __future__ import annotations

import argparse
import heapq
import math
import os
import random
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "server"))
from ctxprefill.backends.tile_order import makespan, pack_lists, tile_order  # noqa: E402  (no torch)


def tile_classes(q_lens, k_lens, heads: int, block_m: int, block_n: int, startup: float) -> list[tuple[float, int]]:
    """(cost in key blocks, number of programs) per segment, in launch order (longest
    segment first): a segment's tiles of every head cost the same."""
    order = sorted(range(len(q_lens)), key=lambda b: -k_lens[b])
    return [(math.ceil(k_lens[b] / block_n) + startup, heads * math.ceil(q_lens[b] / block_m)) for b in order]


def programs(q_lens, k_lens, heads: int, block_m: int, block_n: int, startup: float) -> list[float]:
    """Costs in key blocks, in launch order: segments longest first, then heads, then tiles."""
    return [c for c, n in tile_classes(q_lens, k_lens, heads, block_m, block_n, startup) for _ in range(n)]


def packed_makespan(costs: list[float], sms: int, rounds: int = 20000, seed: int = 0) -> float:
    """What a persistent kernel with per-program work lists could reach: longest-first into
    the least-loaded list, then ``rounds`` random moves and swaps that shrink the fullest."""
    rng = random.Random(seed)
    bins: list[list[float]] = [[] for _ in range(sms)]
    load = [0.0] * sms
    heap = [(0.0, i) for i in range(sms)]
    for c in sorted(costs, reverse=True):
        _, i = heapq.heappop(heap)
        bins[i].append(c)
        load[i] += c
        heapq.heappush(heap, (load[i], i))
    for _ in range(rounds):
        a = max(range(sms), key=load.__getitem__)
        b = rng.randrange(sms)
        if a == b or not bins[a]:
            continue
        ia = rng.randrange(len(bins[a]))
        x = bins[a][ia]
        if load[b] + x < load[a]:  # move
            bins[b].append(bins[a].pop(ia))
            load[a] -= x
            load[b] += x
        elif bins[b]:  # swap a smaller one back
            ib = rng.randrange(len(bins[b]))
            y = bins[b][ib]
            if y < x and load[b] - y + x < load[a]:
                bins[a][ia], bins[b][ib] = y, x
                load[a] += y - x
                load[b] += x - y
    return max(load)


def ffd_makespan(classes: list[tuple[float, int]], sms: int) -> float:
    """The fullest SM list of the kernel's packing (``tile_order.pack_lists``: first fit,
    class by class from the costliest, under a bisected capacity). ``classes``: (cost, count)."""
    classes = sorted(classes, key=lambda x: -x[0])
    return max(load for _, load, _ in pack_lists([c for c, _ in classes], [n for _, n in classes], sms))


def kernel_order_costs(q_lens, k_lens, heads: int, sms: int, block_m: int, block_n: int, startup: float) -> list[float]:
    """Costs in the launch order the warp-specialized kernel is given (``tile_order``:
    tiles packed per SM where that wins in this model, else longest first)."""
    got = tile_order(q_lens, k_lens, heads, sms, block_m, block_n)
    if got is None:
        return programs(q_lens, k_lens, heads, block_m, block_n, startup)
    codes, m_tiles = got
    return [math.ceil(k_lens[c // (heads * m_tiles)] / block_n) + startup for c in codes]


def efficiency(costs: list[float], sms: int, span: float | None = None) -> float:
    """Balanced time over modelled time (1.0: no tail); ``span`` defaults to the launch
    order's makespan."""
    return sum(costs) / sms / (makespan(costs, sms) if span is None else span)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--q", type=int, nargs="+", default=[256, 1792, 640, 1408], help="query rows per segment")
    p.add_argument("--k", type=int, nargs="+", default=[27840, 9280, 37120, 13888], help="keys per segment")
    p.add_argument("--heads", type=int, nargs="+", default=[16, 128])
    p.add_argument("--sms", type=int, default=132, help="streaming multiprocessors (H200: 132)")
    p.add_argument("--block-m", type=int, default=128)
    p.add_argument("--block-n", type=int, default=128)
    p.add_argument("--startup", type=float, default=1.5, help="a program's start-up, in key blocks")
    a = p.parse_args(argv)
    if len(a.q) != len(a.k):
        p.error("--q and --k need one length per segment each")
    work = sum(q * k for q, k in zip(a.q, a.k))
    n = len(a.q)
    eq_k = 16384  # the equal-length batch: n segments of work/n pairs, 16k keys each
    eq_q = max(1, math.ceil(work / n / eq_k))
    print(f"ragged q={a.q} k={a.k} against {n} x {eq_q} q over {eq_k} k (same work within "
          f"{abs(n * eq_q * eq_k - work) / work:.2%}); {a.sms} SMs, tiles {a.block_m} x {a.block_n}")
    for H in a.heads:
        classes = tile_classes(a.q, a.k, H, a.block_m, a.block_n, a.startup)
        costs = [c for c, m in classes for _ in range(m)]
        rag = efficiency(costs, a.sms)
        eq = efficiency(programs([eq_q] * n, [eq_k] * n, H, a.block_m, a.block_n, a.startup), a.sms)
        packed = efficiency(costs, a.sms, packed_makespan(costs, a.sms))
        ffd = efficiency(costs, a.sms, ffd_makespan(classes, a.sms))
        ours = kernel_order_costs(a.q, a.k, H, a.sms, a.block_m, a.block_n, a.startup)
        eq_ours = kernel_order_costs([eq_q] * n, [eq_k] * n, H, a.sms, a.block_m, a.block_n, a.startup)
        print(f"H={H:<4} longest first: ragged {rag:.3f} of balanced, equal {eq:.3f}: predicted ragged/equal "
              f"{rag / eq:.3f}; work lists packed per SM: {packed:.3f} (20,000 moves), {ffd:.3f} (first-fit by "
              f"class) of balanced; the kernel's launch order (tile_order): ragged {efficiency(ours, a.sms):.3f}, "
              f"equal {efficiency(eq_ours, a.sms):.3f}, ragged/equal "
              f"{efficiency(ours, a.sms) / efficiency(eq_ours, a.sms):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
