"""Gather: copy one chunk's context latents from the paged cache into the workspace.

Row r of the chunk belongs to the chunk's sequence b with ``cu_seq_lens[b] <= r <
cu_seq_lens[b+1]``; it is context token ``j = seq_starts[b] + r - cu_seq_lens[b]`` of
that sequence, stored in slot ``block_table[b, j // block_size] * block_size + j %
block_size``. The engine checked every block id before this runs.

Output dtype decides the conversion (CONTRACT §5): bf16 dequantizes (``auto`` copies,
``fp8`` multiplies by ``k_scale``, ``fp8_ds_mla`` by its tile scales); fp8 copies the
raw bytes of an ``fp8`` cache.
"""

from __future__ import annotations

import torch

from . import _cuda, launches
from .slot_format import decode_slots


def chunk_slots(block_table, cu_seq_lens, seq_starts, block_size: int) -> torch.Tensor:
    """int64 [rows]: the slot of every row of the chunk (host-synchronizing; reference only)."""
    lens = (cu_seq_lens[1:] - cu_seq_lens[:-1]).long()
    rows = int(cu_seq_lens[-1])
    seq = torch.repeat_interleave(torch.arange(lens.numel(), device=lens.device), lens, output_size=rows)
    j = seq_starts.long()[seq] + torch.arange(rows, device=lens.device) - cu_seq_lens.long()[seq]
    blocks = block_table.long()[seq, j // block_size]
    return blocks * block_size + j % block_size


def gather_reference(
    cache: torch.Tensor,  # uint8 [num_slots, bytes_per_slot]
    block_table: torch.Tensor,  # int32 [n, max_blocks]
    cu_seq_lens: torch.Tensor,  # int32 [n+1]
    seq_starts: torch.Tensor,  # int32 [n]
    out: torch.Tensor,  # [rows, L+R], bf16 or fp8 (raw, fp8 cache only)
    cache_dtype: str,
    k_scale: float,
    block_size: int,
) -> torch.Tensor:
    slots = chunk_slots(block_table, cu_seq_lens, seq_starts, block_size)
    out.copy_(decode_slots(cache[slots], cache_dtype, k_scale, out.dtype, out.shape[1] - 64, 64))
    return out


def gather(cache, block_table, cu_seq_lens, seq_starts, out, cache_dtype: str, k_scale: float, block_size: int):
    if out.shape[0] == 0:
        return out
    launches.note(1)
    if _cuda.use_cuda(cache):
        _cuda.load().gather(cache, block_table, cu_seq_lens, seq_starts, out, cache_dtype, float(k_scale), block_size)
        return out
    return gather_reference(cache, block_table, cu_seq_lens, seq_starts, out, cache_dtype, k_scale, block_size)
