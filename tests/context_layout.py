"""Where a batch's cached context lives: block tables and the slot of every context token."""

from __future__ import annotations

import numpy as np


def tables_and_slots(contexts, block_size: int, blocks=None) -> tuple[list[list[int]], np.ndarray]:
    """Each sequence gets the next ceil(n / block_size) block ids of ``blocks`` (default
    0, 1, 2, ...); returns (block tables, int64 slots of every context token in order)."""
    blocks = list(blocks) if blocks is not None else None
    tables, at = [], 0
    for n in contexts:
        k = -(-n // block_size)
        tables.append(blocks[at:at + k] if blocks is not None else list(range(at, at + k)))
        at += k
    slots = [np.asarray(bt, dtype=np.int64)[np.arange(n) // block_size] * block_size + np.arange(n) % block_size
             for n, bt in zip(contexts, tables) if n]
    return tables, (np.concatenate(slots) if slots else np.zeros(0, np.int64))
