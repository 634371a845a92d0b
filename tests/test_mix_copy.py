"""bench/mix_copy.py: the mixed-ratio streaming copies write what they should (in Triton's
CPU interpreter, a subprocess: the interpreter is chosen when the kernels are defined) and
``ceiling`` interpolates between measured ratios."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import mix_copy  # noqa: E402

SCRIPT = r"""
import sys
sys.path.insert(0, "bench")
import torch
import mix_copy as m
B = m.BLOCK
n = 3 * B
mc = m.MixCopy(n, "cpu")
# small integers: every fold is exact in float32 and in bf16, whatever the order of its sums
mc.x.copy_(torch.randint(-8, 9, (n,)).to(torch.bfloat16))
x = mc.x.float()
for w, stores in m.RATIOS.items():
    for o in mc.outs:
        o.fill_(1000)
    run, moved = mc.runner(w)
    run()
    assert moved == n * 2 * (1 + w), (w, moved)
    y1, y2, yh, yq, ye = mc.outs
    assert torch.equal(y1, mc.x) == ("FULL" in stores), w
    assert torch.equal(y2, mc.x) == ("FULL2" in stores), w
    for name, y, parts in (("HALF", yh, 2), ("QUARTER", yq, 4), ("EIGHTH", ye, 8)):
        fold = x.view(-1, parts, B // parts).sum(1).reshape(-1).to(torch.bfloat16)
        assert torch.equal(y, fold) == (name in stores), (w, name)
        if name not in stores:
            assert (y == 1000).all(), (w, name)
    written = sum(o.numel() for o, f in zip(mc.outs, m._FLAGS) if f in stores)
    assert written == w * n, (w, written)
print("ok")
"""


def test_mix_copies_write_what_they_should():
    pytest.importorskip("triton", reason="triton is not importable")
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def test_ceiling_interpolates_between_measured_ratios():
    table = {0.5: 3.0, 1.0: 4.0, 2.0: 3.5}
    assert mix_copy.ceiling(table, 1.0) == 4.0
    assert mix_copy.ceiling(table, 0.75) == pytest.approx(3.5)
    assert mix_copy.ceiling(table, 1.5) == pytest.approx(3.75)
    assert mix_copy.ceiling(table, 0.1) == 3.0 and mix_copy.ceiling(table, 9.0) == 3.5


def test_sizes_that_are_not_whole_blocks_are_refused():
    with pytest.raises(ValueError, match="multiple"):
        mix_copy.MixCopy(mix_copy.BLOCK + 1, "cpu")
