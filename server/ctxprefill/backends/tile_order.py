"""The order in which a ragged batch's attention tiles start: per-SM work lists packed on
the host, flattened into the order that makes the hardware run them.

A warp-specialized attention program (one 128-row query tile of one head of one segment)
fills an SM, and the hardware starts the programs of a launch in order, each on the
first SM that frees. Launched longest segment first (LPT), a ragged batch of a few
hundred tiles leaves a tail: at H=16, 4 segments of 256-1,792 rows over 9k-37k keys,
the model in ``bench/simulate_tiles.py`` runs at 0.914 of a perfectly balanced schedule
while the equal-length batch of the same work runs at 0.970 — ragged 6 % slower, and the
H200 measured 4-10 %. Packing the tiles into one list per SM first (first-fit by segment,
costliest first, under a bisected capacity: 0.970 of balanced) and launching them in the
order of their start times in that packing reproduces it: the SM that frees first is the
one whose list the next program belongs to (modelled with 3-10 % noise per tile: 0.92-0.96
against LPT's 0.91). Where a list ends early the hardware gives it a program planned for
another, so each order is checked in that model (``makespan``) and the packed one kept
only where it wins. The same persistent-kernel structure FA3 and FlashInfer build with a
device-side scheduler, with the launch order as the scheduler.

Tiles cost their key blocks plus a start-up (``STARTUP_BLOCKS`` 128-key blocks' time,
fitted in the model; fewer of a wider block).
Past ``PACK_WAVES`` waves of tiles LPT leaves no tail worth packing (H=128, the same
batch: 0.996 of balanced): no order then, the kernel's own (LPT) serves. Host cost per new
shape on the CPU machine, random batches of 2-16 segments: median 0.01-0.2 ms, the worst
~1.3 ms (SM lists that end alike are one group, so the work grows with segments and
events, not tiles); bench_attention's batch 0.18 ms; a shape seen before is a cache hit.
The engine builds it while the device runs the chunk's other stages (``engine/loop.py``).

A persistent launch (the Gluon kernel's ``PERSIST``: one program per SM, each walking the
codes with stride SMs) has no hardware assignment to follow the start-time order: its
order lays the packed lists out so that program p's walk is list p (``persistent``). In
the model, the ragged batch above at H=16: 0.966 of balanced, where the same walk over the
start-time order gives 0.724 and over the kernel's grid order 0.572.

An order is a list of tile codes ``(b * m_tiles + m) * heads + h`` (segment, query tile,
head), one per program of a 1-D launch; tiles of segments without query rows are left
out (the 3-D grid launched empty programs up to the longest segment's tile count). The
kernel checks every code against the batch before using it.
"""

from __future__ import annotations

import functools
import heapq
from collections.abc import Sequence

#: SM lists alike, as ``pack_lists`` groups them: (lists, load, ((segment, tiles), ...))
Group = tuple[int, float, tuple[tuple[int, int], ...]]

#: a program's start-up (queries in, descriptors, epilogue) in units of one 128-key block
STARTUP_BLOCKS = 1.5
#: at or past this many tiles per SM, LPT order (packing gains nothing measurable)
PACK_WAVES = 8
#: segments up to which orders are built (past it the kernel's own launch order is used)
MAX_SEGMENTS = 64


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def tile_order(q_lens: Sequence[int], k_lens: Sequence[int], heads: int, sms: int, block_m: int = 128,
               block_n: int = 128, persistent: bool = False) -> tuple[tuple[int, ...], int] | None:
    """(tile codes in launch order, the ``m_tiles`` they are coded with) for segments of
    ``q_lens`` query rows over ``k_lens`` keys, or None where the kernel's own order
    (longest segment first) is as good: one
    segment, more than ``MAX_SEGMENTS``, codes past int32, one wave of tiles or
    ``PACK_WAVES`` and more, or a packing that does not beat it in the model. Cached: a
    request's chunks repeat shapes.

    ``persistent``: for a launch of one program per SM that walks the codes with stride
    ``sms`` (the Gluon kernel's ``PERSIST``): SM list p's j-th tile at code p + j·sms, the
    shorter lists padded with -1 (a code the kernel skips); kept where its longest list is
    shorter than that walk over the kernel's own grid order."""
    if len(q_lens) != len(k_lens):
        raise ValueError(f"q_lens and k_lens need one entry per segment; got {len(q_lens)} and {len(k_lens)}")
    if min(heads, sms, block_m, block_n) < 1 or min(list(q_lens) + list(k_lens), default=0) < 0:
        raise ValueError(f"tile_order: lengths must be >= 0 and heads, sms, blocks >= 1; got heads={heads} "
                         f"sms={sms} block_m={block_m} block_n={block_n}")
    return _cached(tuple(_cdiv(q, block_m) for q in q_lens), tuple(_cdiv(k, block_n) for k in k_lens), heads, sms,
                   STARTUP_BLOCKS * 128 / block_n, persistent)


def cache_clear() -> None:
    """Forget every shape's order (a benchmark's host cost of a shape seen for the first time)."""
    _cached.cache_clear()
    _packed.cache_clear()


@functools.lru_cache(maxsize=1024)
def _packed(q_tiles: tuple[int, ...], k_blocks: tuple[int, ...], heads: int, sms: int,
            startup: float) -> tuple[list[int], list[int], list[float], list[Group]] | None:
    """(segments longest first, their tiles, a tile's cost, the packed SM lists), or None
    where nothing is packed; shared by both layouts (a launch that finds no persistent one
    asks for the other)."""
    B = len(q_tiles)
    if not 2 <= B <= MAX_SEGMENTS or B * max(q_tiles, default=0) * heads >= 2**31:
        return None
    segs = sorted((b for b in range(B) if q_tiles[b] > 0), key=lambda b: (-k_blocks[b], b))  # LPT
    count = [q_tiles[b] * heads for b in segs]
    if not sms < sum(count) < PACK_WAVES * sms:  # one wave, or no tail worth packing
        return None
    cost = [k_blocks[b] + startup for b in segs]
    return segs, count, cost, pack_lists(cost, count, sms)


@functools.lru_cache(maxsize=1024)
def _cached(q_tiles: tuple[int, ...], k_blocks: tuple[int, ...], heads: int, sms: int,
            startup: float, persistent: bool = False) -> tuple[tuple[int, ...], int] | None:
    packed = _packed(q_tiles, k_blocks, heads, sms, startup)
    if packed is None:
        return None
    segs, count, cost, groups = packed
    m_tiles = max(q_tiles)
    if persistent:
        return _persistent(groups, segs, q_tiles, heads, sms, cost, m_tiles)
    # each group of SM lists runs its segments costliest first, back to back: programs
    # planned to start together (same time, same segment) are one event of m programs
    events: dict[tuple[float, int], int] = {}
    for lists, _, runs in groups:
        t = 0.0
        for i, k in runs:
            for _ in range(k):
                events[t, i] = events.get((t, i), 0) + lists
                t += cost[i]
    order = sorted(events)  # by start time; ties: the costlier segment first
    # A list that ends early takes, in the hardware's hands, the next program planned for
    # another list, which can undo the packing: kept only where the list-scheduling model
    # says it beats longest first (random batches: better in most, up to 4 % worse in 5 %)
    if _span([(cost[i], events[t, i]) for t, i in order], sms) >= _span(list(zip(cost, count, strict=True)), sms):
        return None
    # the j-th program of a segment runs its j-th tile, head-major: the query tiles of one
    # head (the same K/V, in L2) start together
    tiles = [[(b * m_tiles + m) * heads + h for h in range(heads) for m in range(q_tiles[b])] for b in segs]
    codes: list[int] = []
    used = [0] * len(segs)
    for t, i in order:
        j = used[i]
        used[i] = j + events[t, i]
        codes += tiles[i][j : used[i]]
    return tuple(codes), m_tiles


def _persistent(groups: list[Group], segs: list[int], q_tiles: tuple[int, ...], heads: int, sms: int,
                cost: list[float], m_tiles: int) -> tuple[tuple[int, ...], int] | None:
    """``tile_order(persistent=True)``'s codes: the packed SM lists laid out for a stride-``sms``
    walk, or None where the kernel's grid order walked so runs as short (both static)."""
    # the grid order's walk: tile (b * heads + h) * m_tiles + m to program (that) % P; the
    # tiles past a segment's end cost nothing, so only the segments' own are summed
    walk = [0.0] * min(sms, len(q_tiles) * m_tiles * heads)
    for i, b in enumerate(segs):
        for g in range(b * heads * m_tiles, (b + 1) * heads * m_tiles, m_tiles):  # head h's first tile
            for m in range(q_tiles[b]):
                walk[(g + m) % len(walk)] += cost[i]
    if max(load for _, load, _ in groups) >= max(walk):
        return None
    # list entries (start time, segment rank, list) by start time, as the launch order's events;
    # a segment's tiles handed out in that order, head-major (one head's query tiles together)
    entries: list[tuple[float, int, int]] = []
    first = 0
    for lists, _, runs in groups:
        t = 0.0
        for i, k in runs:
            for _ in range(k):
                entries += [(t, i, p) for p in range(first, first + lists)]
                t += cost[i]
        first += lists
    codes_of = [[(b * m_tiles + m) * heads + h for h in range(heads) for m in range(q_tiles[b])] for b in segs]
    used = [0] * len(segs)
    per_list: list[list[int]] = [[] for _ in range(sms)]
    for _, i, p in sorted(entries):
        per_list[p].append(codes_of[i][used[i]])
        used[i] += 1
    depth = max(len(x) for x in per_list)
    return tuple(x[j] if j < len(x) else -1 for j in range(depth) for x in per_list), m_tiles


def pack_lists(cost: list[float], count: list[int], sms: int, tol: float = 2e-3) -> list[Group]:
    """SM lists packed first fit, costliest segment first, under the least capacity
    (bisected to ``tol``) at which every tile fits. Lists that end up alike are kept as one
    group: ``[(lists, load, ((segment, tiles), ...)), ...]`` (a few groups per segment)."""

    def fill(cap: float) -> list[Group] | None:
        groups: list[Group] = [(sms, 0.0, ())]
        for i, (c, n) in enumerate(zip(cost, count, strict=True)):
            nxt: list[Group] = []
            for lists, load, runs in groups:  # first fit: lists in order, each as full as it gets
                room = int((cap - load) // c)
                if n == 0 or room <= 0:
                    nxt.append((lists, load, runs))
                    continue
                full = min(lists, n // room)
                if full:
                    nxt.append((full, load + room * c, runs + ((i, room),)))
                    n -= full * room
                rest = lists - full
                if rest and n:  # one list takes what is left (less than its room)
                    nxt.append((1, load + n * c, runs + ((i, n),)))
                    n, rest = 0, rest - 1
                if rest:
                    nxt.append((rest, load, runs))
            if n:
                return None
            groups = nxt
        return groups

    lo = max(sum(c * n for c, n in zip(cost, count, strict=True)) / sms, max(cost))
    hi = lo * 1.25
    best = fill(hi)
    while best is None:
        lo, hi = hi, hi * 1.25
        best = fill(hi)
    while hi - lo > tol * lo:
        mid = (lo + hi) / 2
        got = fill(mid)
        if got is None:
            lo = mid
        else:
            hi, best = mid, got
    return best


def _span(events: list[tuple[float, int]], sms: int) -> float:
    """The list-scheduling model of a launch, ``events`` = (cost, programs) in launch order:
    each program to the SM that frees first (SMs free at the same time kept as one count).
    The time the last program ends."""
    free, times = {0.0: sms}, [0.0]  # free time -> SMs; the times, a heap
    for c, m in events:
        while m:
            t = times[0]
            take = min(free[t], m)
            free[t] -= take
            if not free[t]:
                del free[t]
                heapq.heappop(times)
            if t + c not in free:
                free[t + c] = 0
                heapq.heappush(times, t + c)
            free[t + c] += take
            m -= take
    return max(free)


def makespan(costs: list[float], sms: int) -> float:
    """``_span`` of programs given one by one (``bench/simulate_tiles.py``'s model)."""
    return _span([(c, 1) for c in costs], sms)
