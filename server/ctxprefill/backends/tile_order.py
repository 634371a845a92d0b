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

Tiles cost their key blocks plus a start-up (``STARTUP_BLOCKS``, fitted in the model).
Past ``PACK_WAVES`` waves of tiles LPT leaves no tail worth packing (H=128, the same
batch: 0.996 of balanced), and the order is plain LPT.

An order is a list of tile codes ``(b * m_tiles + m) * heads + h`` (segment, query tile,
head), one per program of a 1-D launch; tiles of segments without query rows are left
out (the 3-D grid launched empty programs up to the longest segment's tile count). The
kernel checks every code against the batch before using it.
"""

from __future__ import annotations

import functools
import heapq

import numpy as np

#: a program's start-up (queries in, descriptors, epilogue) in units of one key block
STARTUP_BLOCKS = 1.5
#: at or past this many tiles per SM, LPT order (packing gains nothing measurable)
PACK_WAVES = 8
#: segments up to which orders are built (past it the kernel's own launch order is used)
MAX_SEGMENTS = 64


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def tile_order(q_lens, k_lens, heads: int, sms: int, block_m: int = 128, block_n: int = 128) -> tuple[int, ...] | None:
    """Tile codes in launch order for segments of ``q_lens`` query rows over ``k_lens``
    keys, or None when the kernel's own order is as good (one segment, more than
    ``MAX_SEGMENTS``, or codes past int32). Cached: a request's chunks repeat shapes."""
    if len(q_lens) != len(k_lens):
        raise ValueError(f"q_lens and k_lens need one entry per segment; got {len(q_lens)} and {len(k_lens)}")
    if min(heads, sms, block_m, block_n) < 1 or min(list(q_lens) + list(k_lens), default=0) < 0:
        raise ValueError(f"tile_order: lengths must be >= 0 and heads, sms, blocks >= 1; got heads={heads} "
                         f"sms={sms} block_m={block_m} block_n={block_n}")
    return _cached(tuple(_cdiv(q, block_m) for q in q_lens), tuple(_cdiv(k, block_n) for k in k_lens), heads, sms)


@functools.lru_cache(maxsize=1024)
def _cached(q_tiles: tuple[int, ...], k_blocks: tuple[int, ...], heads: int, sms: int) -> tuple[int, ...] | None:
    B = len(q_tiles)
    m_tiles = max(q_tiles, default=0)
    if not 2 <= B <= MAX_SEGMENTS or B * m_tiles * heads >= 2**31:
        return None
    segs = sorted((b for b in range(B) if q_tiles[b] > 0), key=lambda b: (-k_blocks[b], b))  # LPT
    n_tiles = sum(q_tiles[b] * heads for b in segs)
    if n_tiles == 0:
        return None
    lpt = tuple(np.concatenate([_codes(b, np.arange(q_tiles[b] * heads), q_tiles[b], m_tiles, heads)
                                for b in segs]).tolist())
    if n_tiles >= PACK_WAVES * sms or n_tiles <= sms:  # no tail to pack, or one wave
        return lpt
    cost = np.array([k_blocks[b] + STARTUP_BLOCKS for b in segs])
    count = np.array([q_tiles[b] * heads for b in segs])
    take = _pack(cost, count, sms)  # [segments, sms]: tiles of segment i in SM list s
    # start times: each list runs its segments costliest first, back to back
    base = np.vstack([np.zeros((1, sms)), np.cumsum(take * cost[:, None], axis=0)[:-1]])
    seg_i, start = [], []
    for i in range(len(segs)):
        lists = np.repeat(np.arange(sms), take[i])
        first = np.repeat(np.cumsum(take[i]) - take[i], take[i])
        k = np.arange(count[i]) - first  # position within its list's run of this segment
        start.append(base[i][lists] + k * cost[i])
        seg_i.append(np.full(count[i], i))
    seg_i, start = np.concatenate(seg_i), np.concatenate(start)
    order = np.lexsort((seg_i, start))  # by start time; ties: the costlier segment first
    seg_i = seg_i[order]
    # the j-th program of segment i in launch order runs its j-th tile (head-major, query
    # tiles of one head together: they share K/V in L2)
    rank = np.empty(len(seg_i), dtype=np.int64)
    for i in range(len(segs)):
        where = np.nonzero(seg_i == i)[0]
        rank[where] = np.arange(len(where))
    seg_b = np.array(segs)[seg_i]
    qt = np.array(q_tiles)[seg_b]
    codes = (seg_b * m_tiles + rank % qt) * heads + rank // qt
    # A list that ends early takes, in the hardware's hands, the next program planned for
    # another list, which can undo the packing: kept only where the list-scheduling model
    # says it beats longest first (random batches: better in most, up to 4 % worse in 5 %)
    packed_span = makespan(cost[seg_i].tolist(), sms)
    lpt_span = makespan([cost[i] for i in range(len(segs)) for _ in range(count[i])], sms)
    return tuple(codes.tolist()) if packed_span < lpt_span else lpt


def makespan(costs: list[float], sms: int) -> float:
    """The list-scheduling model of a launch: programs in the given order, each to the
    SM that frees first; the time the last one ends."""
    free = [0.0] * sms
    for c in costs:
        heapq.heappush(free, heapq.heappop(free) + c)
    return max(free)


def _codes(b: int, t: np.ndarray, q_tiles: int, m_tiles: int, heads: int) -> np.ndarray:
    """Codes of segment b's tiles numbered ``t`` (head-major: t = h * q_tiles + m)."""
    return (b * m_tiles + t % q_tiles) * heads + t // q_tiles


def _pack(cost: np.ndarray, count: np.ndarray, sms: int, tol: float = 2e-3) -> np.ndarray:
    """Tiles per (segment, SM list): first fit, costliest segment first, under the least
    capacity (bisected to ``tol``) at which everything fits."""

    def fill(cap: float):
        load = np.zeros(sms)
        take = np.zeros((len(cost), sms))
        for i, (c, n) in enumerate(zip(cost.tolist(), count.tolist())):
            room = np.maximum((cap - load) // c, 0.0)
            before = np.cumsum(room) - room  # first fit: lists in order, each as full as it gets
            t = np.minimum(np.maximum(n - before, 0.0), room)
            if before[-1] + room[-1] < n:
                return None
            take[i] = t
            load += t * c
        return take

    lo = max(float((cost * count).sum()) / sms, float(cost.max()))
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
    return best.astype(np.int64)
