"""Insert: write latents into cache slots (CONTRACT §2).

Slot -1 means skip. The caller (cache.py, or the engine's request checks) has already
rejected every other slot out of range, before this op runs: an out-of-range write on the
GPU would corrupt or kill the whole cache. The CUDA kernel also skips such slots, as a
second guard.
"""

from __future__ import annotations

import torch

from . import _cuda, launches
from .slot_format import encode_slots


def insert_reference(
    cache: torch.Tensor,  # uint8 [num_slots, bytes_per_slot]
    kv_c: torch.Tensor,  # [T, L] bf16 or float32
    k_pe: torch.Tensor,  # [T, R] bf16 or float32
    slot_mapping: torch.Tensor,  # int64 [T]
    cache_dtype: str,
    k_scale: float,
) -> None:
    keep = slot_mapping >= 0
    if not bool(keep.any()):
        return
    raw = encode_slots(kv_c[keep], k_pe[keep], cache_dtype, k_scale)
    cache[slot_mapping[keep]] = raw


def insert(cache, kv_c, k_pe, slot_mapping, cache_dtype: str, k_scale: float) -> None:
    if kv_c.shape[0] == 0:
        return
    launches.note(1)
    if _cuda.use_cuda(cache):
        _cuda.load().insert(cache, kv_c, k_pe, slot_mapping, cache_dtype, float(k_scale))
    else:
        insert_reference(cache, kv_c, k_pe, slot_mapping, cache_dtype, k_scale)
