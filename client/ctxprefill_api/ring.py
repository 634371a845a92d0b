"""The request ring's slot layout, shared by the client that writes requests and the
server that answers them (docs/TRANSPORT.md, "Request rings").

Slot layout (little-endian; ``slot_bytes`` apart from the ring's start):

    0   u32  state   FREE 0 -> REQUEST 1 (caller) -> TAKEN 2 (server) -> ANSWER 3 (server) -> FREE (caller)
    4   u32  seq     the caller's request number; the server copies it into the answer
    8   u64  length  bytes of the payload that follows the header
    64  ...  payload: a serialized PrefillContextRequest (REQUEST) or
             PrefillContextStreamResponse (ANSWER: a response, or an in-band error)
"""

from __future__ import annotations

import threading

import numpy as np

__all__ = ["METHOD", "FREE", "REQUEST", "TAKEN", "ANSWER", "HEADER_BYTES", "MIN_SLOT_BYTES",
           "MAX_SLOT_BYTES", "MAX_SLOTS", "memory_fence", "slot_fields", "check_geometry"]

METHOD = "AttachRequestRing"
FREE, REQUEST, TAKEN, ANSWER = 0, 1, 2, 3
HEADER_BYTES = 64
MIN_SLOT_BYTES = 4096
MAX_SLOT_BYTES = 64 << 20
MAX_SLOTS = 1024

_fence_lock = threading.Lock()


def memory_fence() -> None:
    """A full memory barrier: taking and releasing a lock is one on every platform
    Python runs on (x86's stores are ordered anyway; ARM's are not)."""
    _fence_lock.acquire()
    _fence_lock.release()


def slot_fields(buf: np.ndarray, num_slots: int, slot_bytes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Strided views of every slot's state, seq (uint32) and length (uint64) in ``buf``
    (uint8, the ring's bytes; its start 8-byte aligned)."""
    states = np.ndarray((num_slots,), np.uint32, buffer=buf, offset=0, strides=(slot_bytes,))
    seqs = np.ndarray((num_slots,), np.uint32, buffer=buf, offset=4, strides=(slot_bytes,))
    lengths = np.ndarray((num_slots,), np.uint64, buffer=buf, offset=8, strides=(slot_bytes,))
    return states, seqs, lengths


def check_geometry(num_slots: int, slot_bytes: int, offset: int = 0) -> None:
    """The ring's shape as the server accepts it (ValueError naming the argument)."""
    if not 1 <= num_slots <= MAX_SLOTS:
        raise ValueError(f"num_slots: must be in [1, {MAX_SLOTS}], got {num_slots}")
    if not MIN_SLOT_BYTES <= slot_bytes <= MAX_SLOT_BYTES or slot_bytes % 64:
        raise ValueError(f"slot_bytes: must be a multiple of 64 in [{MIN_SLOT_BYTES}, {MAX_SLOT_BYTES}], "
                         f"got {slot_bytes}")
    if offset < 0 or offset % 64:
        raise ValueError(f"offset: must be a multiple of 64, >= 0, got {offset}")
