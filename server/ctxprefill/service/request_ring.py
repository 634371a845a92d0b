"""The server's side of a request ring (``--request-ring``; the slot layout and the
reasons are in ``ctxprefill_client/request_ring.py`` and docs/TRANSPORT.md).

An :class:`AttachedRing` is a ring in a registered system shared-memory region,
checked when it is attached (region, kind, alignment, extent). Only the engine
thread touches its slots (:meth:`take`, :meth:`answer`); the event loop asks it to
stop (:meth:`detach`) and learns when it has (``stopped``): after that nothing reads
or writes the ring again, so the region may go.

What the caller writes is not trusted: the state word is compared, never used as an
index; the length is checked against the slot before the payload is copied out (and
the copy is what gets parsed, so that later writes cannot change it under the
parser); the object's size is checked before every access to the slots (a caller that
shrank it would turn our read into SIGBUS), as for every system region.
"""

from __future__ import annotations

import concurrent.futures
import logging
import uuid

import numpy as np

from ctxprefill_api.ring import (
    ANSWER,
    FREE,
    HEADER_BYTES,
    REQUEST,
    TAKEN,
    check_geometry,
    memory_fence,
    slot_fields,
)

from ..errors import AlreadyExists, FailedPrecondition, InvalidArgument, OutOfRange, ResourceExhausted
from .shared_memory import SYSTEM, SharedMemoryRegistry

log = logging.getLogger("ctxprefill.service")

__all__ = ["AttachedRing", "RingTable", "FREE", "REQUEST", "TAKEN", "ANSWER"]


class AttachedRing:
    def __init__(self, region, offset: int, num_slots: int, slot_bytes: int):
        self.region, self.offset, self.num_slots, self.slot_bytes = region, offset, num_slots, slot_bytes
        self.ring_id = uuid.uuid4().hex[:12]
        tensor = region.tensor
        # a view keeps the mapping alive even if the region is unregistered meanwhile
        self._buf = tensor[offset : offset + num_slots * slot_bytes].numpy()
        self._states, self._seqs, self._lengths = slot_fields(self._buf, num_slots, slot_bytes)
        self._next = 0
        self._stop_asked = False
        #: set (with the reason, None when asked to) once the engine thread let go of the ring
        self.stopped: concurrent.futures.Future = concurrent.futures.Future()
        self.served = 0

    @property
    def payload_bytes(self) -> int:
        return self.slot_bytes - HEADER_BYTES

    def detach(self) -> None:
        """Ask the engine thread to let go (any thread); ``stopped`` completes when it has."""
        self._stop_asked = True

    def usable(self) -> bool:
        """On the engine thread: False once the ring must not be touched again (``stopped``
        is then set: asked to stop, region unregistered, or its object shrank)."""
        if self.stopped.done():
            return False
        why = None  # asked to stop
        if not self._stop_asked:
            if not self.region.registered:
                why = FailedPrecondition("region", f"region {self.region.name!r} was unregistered; the ring is "
                                                   f"detached")
            else:
                try:
                    self.region.check_backing("region")
                    return True
                except FailedPrecondition as e:
                    why = e
        self._release(why)
        return False

    def _release(self, why) -> None:
        self._buf = self._states = self._seqs = self._lengths = None
        if why is None:
            self.stopped.set_result(None)
        else:
            self.stopped.set_exception(why)

    def take(self) -> tuple[int, int, bytes | None] | None:
        """On the engine thread: the next slot's request, ``(slot, seq, payload)``; payload
        None when its length does not fit the slot. None when no request waits there."""
        i = self._next
        if self._states[i] != REQUEST:
            return None
        memory_fence()
        n = int(self._lengths[i])
        seq = int(self._seqs[i])
        payload = None
        if n <= self.payload_bytes:
            base = i * self.slot_bytes + HEADER_BYTES
            payload = self._buf[base : base + n].tobytes()
        self._states[i] = TAKEN
        self._next = (i + 1) % self.num_slots
        return i, seq, payload

    def answer(self, slot: int, seq: int, data: bytes) -> None:
        """On the engine thread: the answer into the slot (it fits: the caller checked)."""
        base = slot * self.slot_bytes + HEADER_BYTES
        self._buf[base : base + len(data)] = np.frombuffer(data, np.uint8)
        self._lengths[slot] = len(data)
        self._seqs[slot] = seq
        memory_fence()
        self._states[slot] = ANSWER
        self.served += 1


class RingTable:
    """The rings attached to one server (event loop only), and their limit."""

    def __init__(self, registry: SharedMemoryRegistry, max_rings: int):
        self.registry, self.max_rings = registry, max_rings
        self.rings: list[AttachedRing] = []

    def attach(self, region_name: str, offset: int, num_slots: int, slot_bytes: int) -> AttachedRing:
        try:
            check_geometry(num_slots, slot_bytes, offset)
        except ValueError as e:
            field, _, msg = str(e).partition(": ")
            raise InvalidArgument(field, msg) from None
        region = self.registry.get(region_name, "region")
        if region.kind != SYSTEM:
            raise InvalidArgument("region", f"region {region_name!r} is {region.kind} memory; a ring lives in system "
                                            f"shared memory (the server's host thread polls it)")
        end = offset + num_slots * slot_bytes
        if end > region.byte_size:
            raise OutOfRange("slot_bytes", f"the ring [{offset}, {end}) is past the end of region {region_name!r} "
                                           f"({region.byte_size} bytes)")
        if region.tensor[offset:].data_ptr() % 64:
            raise InvalidArgument("offset", f"{offset} puts the ring at an address that is not 64-byte aligned "
                                            f"(region {region_name!r} starts at offset {region.offset} of its object)")
        region.check_backing("region")
        self.rings = [r for r in self.rings if not r.stopped.done()]
        for r in self.rings:
            if r.region is region and offset < r.offset + r.num_slots * r.slot_bytes and r.offset < end:
                raise AlreadyExists("offset", f"bytes [{offset}, {end}) of region {region_name!r} overlap ring "
                                              f"{r.ring_id}, attached there")
        if len(self.rings) >= self.max_rings:
            raise ResourceExhausted("region", f"{len(self.rings)} rings are attached, the limit "
                                              f"(--request-ring-max) is {self.max_rings}")
        ring = AttachedRing(region, offset, num_slots, slot_bytes)
        self.rings.append(ring)
        return ring

    def forget(self, ring: AttachedRing) -> None:
        if ring in self.rings:
            self.rings.remove(ring)
