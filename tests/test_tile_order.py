"""The attention launch order packed per SM (``backends/tile_order.py``), on the host:
every tile once, the kernel's code layout, and (through ``bench/simulate_tiles.py``'s
list-scheduling model) a shorter makespan than longest-first where the tail matters."""

import itertools
import os
import random
import sys
import time

import pytest

from ctxprefill.backends import tile_order as tile_order_module
from ctxprefill.backends.tile_order import MAX_SEGMENTS, PACK_WAVES, STARTUP_BLOCKS, tile_order

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
from simulate_tiles import makespan, programs  # noqa: E402

SMS = 132
# bench_attention's ragged x4 case (same work as 4 x 1024 queries over 16k keys)
RQ, RK = [256, 1792, 640, 1408], [27840, 9280, 37120, 13888]


def cdiv(a, b):
    return -(-a // b)


def decode(order, q_lens, heads):
    """(segment, query tile, head) of each program of ``tile_order``'s (codes, m_tiles)."""
    codes, m_tiles = order
    assert m_tiles == max(cdiv(q, 128) for q in q_lens)  # the longest segment's query tiles
    return [(c // (heads * m_tiles), (c // heads) % m_tiles, c % heads) for c in codes]


def costs(codes, q_lens, k_lens, heads):
    return [cdiv(k_lens[b], 128) + STARTUP_BLOCKS for b, _, _ in decode(codes, q_lens, heads)]


def check_every_tile_once(codes, q_lens, heads):
    want = {(b, m, h) for b, q in enumerate(q_lens) for m in range(cdiv(q, 128)) for h in range(heads)}
    got = decode(codes, q_lens, heads)
    assert len(got) == len(want) and set(got) == want


def test_every_tile_exactly_once_and_no_empty_programs():
    q_lens, k_lens = [256, 0, 1792, 1, 640, 1408, 0], [27840, 99, 9280, 0, 37120, 13888, 0]
    codes = tile_order(q_lens, k_lens, 16, SMS)
    check_every_tile_once(codes, q_lens, 16)  # a segment with no queries has no tile
    # H=1: 33 tiles, one wave; H=128: 4,224 tiles, past PACK_WAVES: the kernel's own order
    assert tile_order(q_lens, k_lens, 1, SMS) is None and tile_order(q_lens, k_lens, 128, SMS) is None


def test_packing_beats_longest_first_on_the_ragged_case():
    """H=16: 512 tiles, under 4 waves — longest-first leaves a tail (0.914 of balanced in
    the model); the packed order fills it (>= 0.96). H=128: 31 waves, plain longest first."""
    codes = tile_order(RQ, RK, 16, SMS)
    c = costs(codes, RQ, RK, 16)
    lpt = programs(RQ, RK, 16, 128, 128, STARTUP_BLOCKS)
    balanced = sum(c) / SMS
    assert sum(lpt) == pytest.approx(sum(c))
    assert balanced / makespan(lpt, SMS) < 0.92
    assert balanced / makespan(c, SMS) >= 0.96
    assert tile_order(RQ, RK, 128, SMS) is None  # the kernel's own order: longest first


def test_tiles_of_a_head_stay_together_within_a_segment():
    """Within a segment the j-th program launched runs its j-th tile, head-major: a head's
    query tiles (which read the same K/V) start one after another."""
    codes = tile_order(RQ, RK, 16, SMS)
    tiles = decode(codes, RQ, 16)
    for b, q in enumerate(RQ):
        mine = [(h, m) for bb, m, h in tiles if bb == b]
        assert mine == [(t // cdiv(q, 128), t % cdiv(q, 128)) for t in range(len(mine))]


def test_never_worse_than_longest_first():
    """Random batches of 2-16 segments at H=16 (where packing is tried): in the model, the
    order given is never slower than longest first (a packing that does not win is not
    given: None, the kernel's own order) and
    faster by at least 3 % in some (one in twenty or more; 12 of 199 here) of the batches."""
    rng = random.Random(0)
    worse, better, n = [], 0, 0
    for _ in range(200):
        B = rng.randint(2, 16)
        q_lens = [rng.choice([0, 1, 64, 300, 1024, 2048]) for _ in range(B)]
        k_lens = [rng.randint(0, 40000) for _ in range(B)]
        codes = tile_order(q_lens, k_lens, 16, SMS)
        lpt = makespan(programs(q_lens, k_lens, 16, 128, 128, STARTUP_BLOCKS), SMS)
        if codes is None:  # the kernel's own order: longest first
            ours = lpt
        else:
            check_every_tile_once(codes, q_lens, 16)
            ours = makespan(costs(codes, q_lens, k_lens, 16), SMS)
        n += 1
        better += ours < 0.97 * lpt
        if ours > lpt:
            worse.append((q_lens, k_lens, ours / lpt))
    assert not worse, worse[:3]
    assert better >= n // 20, (better, n)


def test_when_there_is_no_order():
    assert tile_order([500], [900], 16, SMS) is None  # one segment: grid order is it
    assert tile_order([5] * (MAX_SEGMENTS + 1), [9] * (MAX_SEGMENTS + 1), 16, SMS) is None
    assert tile_order([0, 0], [5, 7], 16, SMS) is None  # nothing to run
    # one wave, or PACK_WAVES and more: the kernel's own order (longest first)
    assert tile_order([100, 100], [10, 5000], 16, SMS) is None
    assert tile_order([128 * PACK_WAVES * SMS // 32] * 2, [10, 5000], 16, SMS) is None
    # equal lengths: packing gains nothing over longest first, so none is given
    assert tile_order([1024] * 4, [16384] * 4, 16, SMS) is None


def test_bad_arguments():
    with pytest.raises(ValueError, match="one entry per segment"):
        tile_order([1, 2], [3], 16, SMS)
    with pytest.raises(ValueError, match=">= 0"):
        tile_order([1, -2], [3, 4], 16, SMS)
    with pytest.raises(ValueError, match="heads"):
        tile_order([1, 2], [3, 4], 0, SMS)


def test_cost_per_call():
    """Built on the host per chunk, cached per shape (a request's chunks repeat shapes): a
    shape seen before is answered from the cache, the same object, nothing built again. The
    cost per call, uncached and cached, is printed."""
    rng = random.Random(1)
    shapes = [([rng.randint(1, 2048) for _ in range(4)], [rng.randint(0, 40000) for _ in range(4)]) for _ in range(20)]
    t0 = time.perf_counter()
    first = [tile_order(q, k, 16, SMS) for q, k in shapes]
    uncached = (time.perf_counter() - t0) / len(shapes)
    before = tile_order_module._cached.cache_info()
    t0 = time.perf_counter()
    again = [tile_order(q, k, 16, SMS) for q, k in shapes]
    cached = (time.perf_counter() - t0) / len(shapes)
    after = tile_order_module._cached.cache_info()
    assert (after.hits - before.hits, after.misses - before.misses) == (len(shapes), 0)
    assert all(a is b for a, b in zip(first, again, strict=True)) and any(a is not None for a in first)
    print(f"\ntile_order per call: {uncached * 1e3:.2f} ms uncached, {cached * 1e6:.1f} us cached")


def test_both_layouts_share_one_packing():
    """A launch that finds no persistent layout asks for the start-time order: the batch's SM
    lists are packed once for both (the packing is most of a new shape's host time)."""
    q_lens, k_lens = [2048, 2048, 512], [15360, 9216, 4096 + 7]  # a shape no other test asks for
    tile_order(q_lens, k_lens, 16, SMS)
    tile_order_module.cache_clear()  # (what a benchmark calls to price a new shape: both caches)
    assert tile_order_module._cached.cache_info().currsize == tile_order_module._packed.cache_info().currsize == 0
    before = tile_order_module._packed.cache_info()
    assert tile_order(q_lens, k_lens, 16, SMS, persistent=True) is None
    assert tile_order(q_lens, k_lens, 16, SMS) is not None
    after = tile_order_module._packed.cache_info()
    assert (after.misses - before.misses, after.hits - before.hits) == (1, 1)


def test_start_up_is_a_time_whatever_the_key_block():
    """A program's start-up is priced in 128-key blocks: over keys that fill 256-key blocks
    the model's costs are the 128-key ones halved, so the orders are the same."""
    rng = random.Random(2)
    built = 0
    for _ in range(200):
        n = rng.randint(2, 12)
        q = [rng.randint(0, 2048) for _ in range(n)]
        k = [256 * rng.randint(0, 150) for _ in range(n)]
        narrow, wide = tile_order(q, k, 16, SMS, 128, 128), tile_order(q, k, 16, SMS, 128, 256)
        assert narrow == wide, (q, k)
        built += narrow is not None
    assert built > 20  # the batches pack: not a comparison of Nones


def test_the_engine_case_is_packed_for_both_dtypes_defaults():
    """tests/gpu/test_engine_gpu.py's packed-launch-order case (4 segments, 544 tiles at
    H=16) gets a packed order over each dtype's default key block (bf16 128, fp8 256): the
    GPU test checks the order changes no bit, so it must have one to check."""
    import torch

    from ctxprefill.backends import triton_attention as ta

    q_lens, k_lens = [256, 2048, 640, 1408], [9280, 2320, 6960, 3472]
    for ws in (ta.CONFIGS[torch.bfloat16]["WS"], ta.KEYS_LAST_FP8["WS"]):
        order = tile_order(q_lens, k_lens, 16, SMS, 128, ws["BLOCK_N"])
        assert order is not None, ws
        check_every_tile_once(order, q_lens, 16)


def walk_loads(codes, q_lens, k_lens, heads, sms):
    """Each program's work in a persistent launch: program p runs codes p, p + P, ... (P =
    min(codes, sms)); a code outside the batch (-1) costs nothing."""
    m_tiles = max(cdiv(q, 128) for q in q_lens)
    P = min(len(codes), sms)
    load = [0.0] * P
    for t, c in enumerate(codes):
        b, m = c // (heads * m_tiles), (c // heads) % m_tiles
        if c >= 0 and m < cdiv(q_lens[b], 128):
            load[t % P] += cdiv(k_lens[b], 128) + STARTUP_BLOCKS
    return load


def test_persistent_layout_walks_the_packed_lists():
    """persistent=True: the packed SM lists laid out so that program p's stride-``sms`` walk
    is list p (padding -1): every tile once, each walk's segments costliest first, and the
    longest program shorter than that walk over the dynamic order or the kernel's
    grid order (m fastest, then head, then segment)."""
    codes, m_tiles = tile_order(RQ, RK, 16, SMS, persistent=True)
    assert len(codes) % SMS == 0 and -1 in codes
    real = [c for c in codes if c >= 0]
    check_every_tile_once((real, m_tiles), RQ, 16)
    for p in range(SMS):  # each program walks one packed list: its segments costliest first
        walk = [c for c in codes[p::SMS] if c >= 0]
        keys = [RK[b] for b, _, _ in decode((walk, m_tiles), RQ, 16)]
        assert keys == sorted(keys, reverse=True)
    ours = max(walk_loads(codes, RQ, RK, 16, SMS))
    dynamic, _ = tile_order(RQ, RK, 16, SMS)
    grid = [(b * m_tiles + m) * 16 + h for b in range(len(RQ)) for h in range(16) for m in range(m_tiles)]
    assert ours < max(walk_loads(dynamic, RQ, RK, 16, SMS)) and ours < max(walk_loads(grid, RQ, RK, 16, SMS))
    balanced = sum(walk_loads(real, RQ, RK, 16, SMS)) / SMS
    assert balanced / ours >= 0.96
    # the same batch where the dynamic order is not given either: none
    assert tile_order(RQ, RK, 128, SMS, persistent=True) is None


def test_persistent_layout_only_where_it_beats_the_grid_walk():
    """Random batches at H=16: a persistent layout given is never longer than the grid
    order's walk (else None) and lists every tile once."""
    rng = random.Random(1)
    given = 0
    for _ in range(60):
        n = rng.randint(2, 12)
        q_lens = [rng.randint(1, 2048) for _ in range(n)]
        k_lens = [rng.randint(0, 40000) for _ in range(n)]
        got = tile_order(q_lens, k_lens, 16, SMS, persistent=True)
        if got is None:
            continue
        given += 1
        codes, m_tiles = got
        check_every_tile_once(([c for c in codes if c >= 0], m_tiles), q_lens, 16)
        grid = [(b * m_tiles + m) * 16 + h for b in range(n) for h in range(16) for m in range(m_tiles)]
        assert max(walk_loads(codes, q_lens, k_lens, 16, SMS)) < max(walk_loads(grid, q_lens, k_lens, 16, SMS))
    assert given >= 10


def test_the_backend_lays_the_order_out_for_a_persistent_launch(monkeypatch):
    """``tile_order_codes``: the persistent layout where asked, or (None) where the dtype's
    defaults with ``EAGER_WS`` launch persistent programs (they do); the start-time order
    otherwise."""
    import torch

    from ctxprefill.backends import gluon_attention as ga
    from ctxprefill.backends import triton_attention as ta

    monkeypatch.setattr(ga, "sms", lambda device: SMS)
    monkeypatch.setattr(ta, "EAGER_WS", {})
    want = {p: tile_order(RQ, RK, 16, SMS, 128, 128, p) for p in (False, True)}
    assert want[False] != want[True]

    def got(persistent=None, heads=16):
        o = ta.tile_order_codes(RQ, RK, heads, torch.bfloat16, "cuda", persistent)
        return None if o is None else (o.codes, o.m_tiles, o.persistent)

    assert ta.CONFIGS[torch.bfloat16]["WS"]["PERSIST"]  # the default
    assert got() == (*want[True], True) and got(False) == (*want[False], False)
    monkeypatch.setattr(ta, "EAGER_WS", {"PERSIST": False})
    assert got() == (*want[False], False) and got(True) == (*want[True], True)
    # no layout beats the grid walk (a batch whose lists the walk already balances): the
    # start-time order, marked for a program per tile (persistent_launch then says no)
    even = ([2048, 2048, 512], [15360, 9216, 4096])
    assert tile_order(*even, 16, SMS, 128, 128, True) is None and tile_order(*even, 16, SMS) is not None
    o = ta.tile_order_codes(*even, 16, torch.bfloat16, "cuda", True)
    assert (o.codes, o.m_tiles, o.persistent) == (*tile_order(*even, 16, SMS), False)


def test_a_ragged_batch_without_a_persistent_layout_runs_a_program_per_tile():
    """``persistent_launch``: one segment of more tiles than SMs, or an order laid out for a
    persistent launch; not several segments in the grid's order or in a start-time order,
    nor one segment whose tiles the SMs take in one go (a program each)."""
    import torch

    from ctxprefill.backends import triton_attention as ta

    codes = torch.zeros(4, dtype=torch.int32)
    assert ta.persistent_launch(1, None, 133, 132) and ta.persistent_launch(0, None, 1000, 132)
    assert not ta.persistent_launch(1, None, 132, 132) and not ta.persistent_launch(1, None, 128, 132)
    assert not ta.persistent_launch(0, None, 16, 132)
    assert ta.persistent_launch(3, ta.TileOrder(codes, 3, 2, 1, persistent=True), 6, 132)
    assert not ta.persistent_launch(3, None, 1000, 132)
    assert not ta.persistent_launch(3, ta.TileOrder(codes, 3, 2, 1), 1000, 132)


def test_persists_resolves_persist_as_the_launch_does(monkeypatch):
    """``persists`` (the host's choice of layout) says what ``ws_config`` gives the launch,
    for the defaults, a call's own WS (set or not), and ``EAGER_WS`` over them."""
    import torch

    from ctxprefill.backends import triton_attention as ta

    fp8 = torch.float8_e4m3fn
    configs = [None, dict(BLOCK_M=128), dict(WS=True), dict(WS=dict(PIPE=True)), dict(WS=dict(PERSIST=False)),
               dict(WS=dict(PERSIST=True))]
    seen = set()
    for eager, dtype, config in itertools.product(({}, {"PERSIST": False}, {"PERSIST": True}),
                                                  (torch.bfloat16, fp8), configs):
        monkeypatch.setattr(ta, "EAGER_WS", eager)
        cfg = {**ta.CONFIGS[dtype], **(ta.KEYS_LAST_FP8 if dtype == fp8 else {}), **(config or {})}
        q = torch.zeros(4, 2, 192, dtype=dtype)
        want = ta.ws_config(cfg["WS"], config, q, q, q[..., 128:], dtype == fp8)["PERSIST"]
        assert ta.persists(dtype, config) == want, (eager, dtype, config)
        seen.add(want)
    assert seen == {False, True}
