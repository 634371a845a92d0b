"""Where a batch's cached context lives: block tables and the slot of every context token;
and the small batch the shared-memory tests send (test_shared_memory, test_request_ring,
test_shared_memory_safety)."""

from __future__ import annotations

import numpy as np

from ctxprefill_client import slot_mapping


def tables_and_slots(contexts, block_size: int, blocks=None) -> tuple[list[list[int]], np.ndarray]:
    """Each sequence gets the next ceil(n / block_size) block ids of ``blocks`` (default
    0, 1, 2, ...); returns (block tables, int64 slots of every context token in order)."""
    blocks = list(blocks) if blocks is not None else None
    tables, at = [], 0
    for n in contexts:
        k = -(-n // block_size)
        tables.append(blocks[at:at + k] if blocks is not None else list(range(at, at + k)))
        at += k
    slots = [slot_mapping(bt, 0, n, block_size) for n, bt in zip(contexts, tables) if n]
    return tables, (np.concatenate(slots) if slots else np.zeros(0, np.int64))


#: the shared-memory tests' cache (block size, blocks) and model (heads, q, v, latent and rope
#: dims), and their batch: three sequences, one without context
BS, NB, H, D, V, L, R = 16, 64, 2, 192, 128, 512, 64
CONTEXTS, QUERIES = [100, 0, 37], [3, 2, 4]
TQ = sum(QUERIES)
TABLES, SLOTS = tables_and_slots(CONTEXTS, BS)
SEQS = list(zip(QUERIES, CONTEXTS, TABLES))
#: bytes of the batch's q (bf16), output (bf16) and LSE (float32)
Q_BYTES, OUT_BYTES, LSE_BYTES = TQ * H * D * 2, TQ * H * V * 2, H * TQ * 4
