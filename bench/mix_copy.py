"""Plain streaming copies that write ``w`` bytes for every byte they read: the ceiling a
memory-bound kernel with that read/write mix is held to.

HBM's bus carries reads and writes in turn, so a kernel's rate depends on its mix: on the
H200 (2026-12-01, ``bench/probe_write_bandwidth.py``) a plain Triton copy ran at 94.8 % of
torch's copy writing one byte per byte read and 90.2 % writing 1.5, while writes alone
streamed at 107 % and reads alone at 102 %. The bf16 pack writes 1.5 bytes per byte read,
the fp8 pack 0.625, the dequantizing gathers 1.75-2, the merge 0.5 — each is compared
here with a copy of its own mix rather than with a model built from read-only and
write-only rates (which ``bench_kernels.py`` used before: its write-only figure was
torch's ``fill_``, 21 % below what the memory takes).

One program reads ``BLOCK`` bf16 values and writes, to separate outputs, any of: them
(``FULL``), them again (``FULL2``), and folds of them to 1/2, 1/4 and 1/8 of their length
(``HALF``, ``QUARTER``, ``EIGHTH``: sums of the block's parts, so that every loaded value
is used and no load is dropped). ``RATIOS`` lists the mixes measured.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 - callers check ``triton is None``
    triton = tl = None

BLOCK = 4096  # bf16 values a program reads: 8 KiB
# bytes written per byte read -> the stores that give it
RATIOS = {0.5: ("HALF",), 0.625: ("HALF", "EIGHTH"), 1.0: ("FULL",), 1.5: ("FULL", "HALF"),
          1.75: ("FULL", "HALF", "QUARTER"), 2.0: ("FULL", "FULL2")}
_FLAGS = ("FULL", "FULL2", "HALF", "QUARTER", "EIGHTH")

if triton is not None:

    @triton.jit
    def _fold_store(y, v, p, PARTS: tl.constexpr, BLOCK: tl.constexpr):
        part = tl.sum(tl.reshape(v, (PARTS, BLOCK // PARTS)), axis=0)
        tl.store(y + p * (BLOCK // PARTS) + tl.arange(0, BLOCK // PARTS), part.to(y.dtype.element_ty))

    @triton.jit
    def _mix_copy(x, y1, y2, yh, yq, ye, FULL: tl.constexpr, FULL2: tl.constexpr, HALF: tl.constexpr,
                  QUARTER: tl.constexpr, EIGHTH: tl.constexpr, BLOCK: tl.constexpr):
        p = tl.program_id(0).to(tl.int64)
        offs = p * BLOCK + tl.arange(0, BLOCK)
        v = tl.load(x + offs)  # the length is a multiple of BLOCK: no masks
        if FULL:
            tl.store(y1 + offs, v)
        if FULL2:
            tl.store(y2 + offs, v)
        vf = v.to(tl.float32)
        if HALF:
            _fold_store(yh, vf, p, 2, BLOCK)
        if QUARTER:
            _fold_store(yq, vf, p, 4, BLOCK)
        if EIGHTH:
            _fold_store(ye, vf, p, 8, BLOCK)


class MixCopy:
    """Buffers for copies of ``n`` bf16 values (a multiple of ``BLOCK``) at every ratio."""

    def __init__(self, n: int, device):
        import torch

        if n % BLOCK:
            raise ValueError(f"n = {n} is not a multiple of {BLOCK}")
        self.n = n
        self.x = torch.ones(n, dtype=torch.bfloat16, device=device)
        e = dict(dtype=torch.bfloat16, device=device)
        self.outs = (torch.empty(n, **e), torch.empty(n, **e), torch.empty(n // 2, **e), torch.empty(n // 4, **e),
                     torch.empty(n // 8, **e))

    def runner(self, w: float):
        """A function running the copy of ratio ``w`` (a key of ``RATIOS``) and the bytes it
        moves (read + written)."""
        stores = RATIOS[w]
        flags = {f: f in stores for f in _FLAGS}
        grid = (self.n // BLOCK,)
        return (lambda: _mix_copy[grid](self.x, *self.outs, BLOCK=BLOCK, **flags)), self.n * 2 * (1 + w)


def ceiling(table: dict, w: float) -> float:
    """The rate of a copy writing ``w`` bytes per byte read, linear between the measured
    ratios of ``table`` (ratio -> rate), the nearest one outside them."""
    ks = sorted(table)
    if w <= ks[0]:
        return table[ks[0]]
    for a, b in zip(ks, ks[1:]):
        if w <= b:
            return table[a] + (table[b] - table[a]) * (w - a) / (b - a)
    return table[ks[-1]]
