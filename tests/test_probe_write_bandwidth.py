"""bench/probe_write_bandwidth.py's Triton writers, in Triton's interpreter on the CPU (a
subprocess: the interpreter is chosen when the kernels are defined): each writes every
element it should (and the plain store none past ``n``), and the Triton packs (plain and
TMA stores) equal torch's concat."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton", reason="triton is not importable")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = r"""
import sys
sys.path.insert(0, "bench")
import torch, triton
import probe_write_bandwidth as p
y = torch.zeros(1000 + 5, dtype=torch.bfloat16)
for cs in (False, True):
    y.zero_()
    p._store[(triton.cdiv(1000, p.BLOCK),)](y, 1000, CS=cs, BLOCK=p.BLOCK)
    assert (y[:1000] == 1).all() and (y[1000:] == 0).all(), cs
triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8))
y = torch.zeros(p.TMA_ROWS * p.TMA_COLS * 3, dtype=torch.bfloat16)
p._store_tma[(3,)](y, 3 * p.TMA_ROWS, ROWS=p.TMA_ROWS, COLS=p.TMA_COLS)
assert (y == 1).all()
for layout in ("interleaved", "blocked"):
    kn, pe = p.pack_inputs(70, 3, "cpu", layout)  # 70 tokens: a partial tile of 64
    assert kn.shape == (70, 3, 128) and kn.stride(1) == (256 if layout == "interleaved" else 128), kn.stride()
    ref = torch.cat([kn, pe[:, None, :].expand(70, 3, 64)], dim=-1)
    for tma in (False, True):
        k = torch.zeros(70, 3, 192, dtype=torch.bfloat16)
        assert torch.equal(p.triton_pack(kn, pe, k, tma=tma), ref), (layout, tma)
print("ok")
"""


def test_triton_writers_write_what_they_should():
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]
