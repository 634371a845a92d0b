"""The tile-schedule model behind DESIGN.md's ragged-batch figures (bench/simulate_tiles.py)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import simulate_tiles as st  # noqa: E402


def test_even_work_has_no_tail():
    assert st.makespan([2.0] * 264, 132) == 4.0
    assert st.efficiency([2.0] * 264, 132) == 1.0


def test_one_long_program_is_the_tail():
    # 131 SMs finish their unit programs while one runs 10 blocks: balanced time 141/132
    assert st.makespan([10.0] + [1.0] * 131, 132) == 10.0
    assert abs(st.efficiency([10.0] + [1.0] * 131, 132) - 141 / 132 / 10) < 1e-12


def test_launch_order_is_longest_segment_first():
    costs = st.programs([256, 128], [1024, 4096], heads=2, block_m=128, block_n=128, startup=0.0)
    assert costs == [32.0, 32.0, 8.0, 8.0, 8.0, 8.0]  # segment 1 (4,096 keys, 1 tile) first, per head


def test_bench_ragged_case_prediction():
    """bench_attention's ragged x4 batch at H=16 on 132 SMs: the model predicts a 5-6 % tail
    against equal lengths (measured on the H200: 0.90-0.96), none at H=128."""
    q, k = [256, 1792, 640, 1408], [27840, 9280, 37120, 13888]
    rag16 = st.efficiency(st.programs(q, k, 16, 128, 128, 1.5), 132)
    eq16 = st.efficiency(st.programs([1024] * 4, [16384] * 4, 16, 128, 128, 1.5), 132)
    rag128 = st.efficiency(st.programs(q, k, 128, 128, 128, 1.5), 132)
    eq128 = st.efficiency(st.programs([1024] * 4, [16384] * 4, 128, 128, 128, 1.5), 132)
    assert 0.93 < rag16 / eq16 < 0.96
    assert rag128 / eq128 > 1.0


def test_packing_beats_the_launch_order_on_the_ragged_case():
    """Work lists packed per SM (what a persistent kernel could run) against the hardware's
    greedy assignment in launch order, for the batch whose tail misses the ragged target at H=16."""
    costs = st.programs([256, 1792, 640, 1408], [27840, 9280, 37120, 13888], 16, 128, 128, 1.5)
    greedy, packed = st.makespan(costs, 132), st.packed_makespan(costs, 132)
    assert packed <= greedy
    assert sum(costs) / 132 / packed > 0.95 > sum(costs) / 132 / greedy


def test_first_fit_by_class_packs_the_ragged_case():
    """The cheap packer (few tile classes, a count at a time) beats the launch order at H=16."""
    q, k = [256, 1792, 640, 1408], [27840, 9280, 37120, 13888]
    costs = st.programs(q, k, 16, 128, 128, 1.5)
    classes = st.tile_classes(q, k, 16, 128, 128, 1.5)
    # ceil(k / 128) + 1.5 per head and tile: 290, 218, 109, 73 blocks; 5, 2, 11, 14 tiles x 16 heads
    assert classes == [(291.5, 80), (219.5, 32), (110.5, 176), (74.5, 224)]  # longest segment first
    assert sum(c * n for c, n in classes) == sum(costs)
    ffd = st.ffd_makespan(classes, 132)
    assert sum(costs) / 132 / ffd > 0.95 and ffd < st.makespan(costs, 132)
