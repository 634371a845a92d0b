"""The paged latent cache: ``num_blocks × block_size`` slots of raw bytes (CONTRACT §2).

Storage is one uint8 tensor ``[num_slots, bytes_per_slot]``; the slot formats live in
``ops/slot_format.py``. Every slot index is checked on the host before a kernel sees
it (a bad index on the GPU would take the whole cache down with it): by :meth:`write` and
:meth:`read`, or, for the engine, once by its request checks (``engine/request.py``, with
:func:`host_slots`) before :meth:`write_checked` / :meth:`read_checked`.
"""

from __future__ import annotations

import numpy as np
import torch

from .config import CacheConfig
from .errors import InvalidArgument, OutOfRange
from .ops.insert import insert


class PagedLatentCache:
    def __init__(self, config: CacheConfig, device: torch.device, latent: int = 512, rope: int = 64,
                 storage: torch.Tensor | None = None):
        """``storage``: uint8 ``[num_slots, bytes_per_slot]`` zeros to hold the slots (a view
        of an allocation shared by the engine's layers), else allocated here."""
        self.config = config
        self.latent, self.rope = latent, rope
        self.device = torch.device(device)
        shape = (config.num_slots, config.bytes_per_slot)
        if storage is None:
            storage = torch.zeros(shape, dtype=torch.uint8, device=self.device)
        elif tuple(storage.shape) != shape or storage.dtype != torch.uint8 or not storage.is_contiguous():
            raise ValueError(f"cache storage must be contiguous uint8 {list(shape)}, got {storage.dtype} "
                             f"{list(storage.shape)}")
        self.storage = storage
        # which slots hold a token (host side; for the slots-used gauge)
        self._used = np.zeros(config.num_slots, dtype=np.bool_)
        self.slots_used = 0  # kept up to date by write(): the gauge reads it after every write

    def check_slots(
        self, slot_mapping: torch.Tensor, field: str = "slot_mapping", allow_skip: bool = True
    ) -> torch.Tensor:
        """Validate an int64 [T] slot list (on the host); returns it on the host."""
        if slot_mapping.dim() != 1:
            raise InvalidArgument(field, f"must be 1-D, got shape {list(slot_mapping.shape)}")
        if slot_mapping.dtype != torch.int64:
            raise InvalidArgument(field, f"must be int64, got {slot_mapping.dtype}")
        return host_slots(slot_mapping, self.config.num_slots, field, allow_skip)

    def write(self, slot_mapping: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor) -> int:
        """Insert T tokens; returns the number of slots written (slot -1 skips)."""
        slots = self.check_slots(slot_mapping)
        T = slots.numel()
        for name, t, width in (("kv_c", kv_c, self.latent), ("k_pe", k_pe, self.rope)):
            if tuple(t.shape) != (T, width):
                raise InvalidArgument(
                    name, f"must have shape [{T}, {width}] (T from slot_mapping), got {list(t.shape)}"
                )
            if t.dtype not in (torch.bfloat16, torch.float32):
                raise InvalidArgument(name, f"must be bf16 or float32, got {t.dtype}")
        return self.write_checked(slots, kv_c, k_pe)

    def write_checked(self, slots: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor) -> int:
        """:meth:`write` of inputs already checked as it checks them (the engine's
        ``request.validate_write``): ``slots`` int64 [T] on the host."""
        a = slots.numpy()
        kept = a[a >= 0]  # numpy: a few torch calls on 1,024 slots cost more than the check itself
        if kept.size == 0:
            return 0
        up = self._to_device
        insert(self.storage, up(kv_c), up(k_pe), up(slots), self.config.dtype, self.config.k_scale)
        new = kept[~self._used[kept]]
        if new.size:
            self._used[new] = True
            self.slots_used += int(np.unique(new).size)
        return int(kept.size)

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` on the cache's device. A host tensor goes to a GPU from pinned memory,
        queued on the stream: a copy from pageable memory would make the host wait for
        everything queued before it (a PrefillContext's cache_write is queued behind the
        request's attention, and the engine thread goes on to the next request)."""
        if self.device.type == "cuda" and t.device.type == "cpu":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t.to(self.device)

    def read(self, slot_mapping: torch.Tensor) -> torch.Tensor:
        """The raw bytes of the given slots, uint8 [T, bytes_per_slot] on the host."""
        return self.read_checked(self.check_slots(slot_mapping, allow_skip=False))

    def read_checked(self, slots: torch.Tensor) -> torch.Tensor:
        """:meth:`read` of slots already checked (int64 [T] on the host, each in range)."""
        return self.storage[slots.to(self.device)].cpu()


def host_slots(slot_mapping: torch.Tensor, num_slots: int, field: str, allow_skip: bool) -> torch.Tensor:
    """``slot_mapping`` (int64 [T]) on the host, each slot in ``[0, num_slots)`` or, with
    ``allow_skip``, -1: else OutOfRange naming the first one that is not."""
    s = slot_mapping.cpu()
    if s.numel():
        lo = -1 if allow_skip else 0
        a = s.numpy()
        # one pass: shifted by -lo and read as unsigned, a slot below lo is past every valid one
        if int(np.maximum.reduce((a - lo).view(np.uint64), axis=None)) >= num_slots - lo:
            i = int(np.flatnonzero((a < lo) | (a >= num_slots))[0])
            raise OutOfRange(
                f"{field}[{i}]",
                f"slot {int(a[i])} is outside [{lo}, {num_slots})" + (" (-1 skips a token)" if allow_skip else ""),
            )
    return s
