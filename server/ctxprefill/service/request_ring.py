"""The server's side of a request ring (``--request-ring``; the slot layout and the
reasons are in ``ctxprefill_client/request_ring.py`` and docs/TRANSPORT.md).

An :class:`AttachedRing` is a ring in a registered system shared-memory region,
checked when it is attached (region, kind, alignment, extent, a local peer). Only the
engine thread touches its slots (:meth:`take`, :meth:`answer`); the event loop asks it
to stop (:meth:`detach`) and learns when it has (``stopped``): after that nothing reads
or writes the ring again.

The slots are read and written through a descriptor of the object that the ring holds
(``os.pread`` / ``os.pwrite``), never through a mapping: a caller may shrink its object
at any moment, and a load past the end of a mapping is SIGBUS, which would kill the
server, where a read past the end of a file is only short. The object's size is
checked before every poll; a short read, or a slot the object no longer covers, stops
the ring (its call ends with FAILED_PRECONDITION naming the region).

What the caller writes is not trusted: the state word is compared, never used as an
index; the length is checked against the slot before the payload is copied out (and
the copy is what gets parsed, so that later writes cannot change it under the parser).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import struct
import uuid
from collections.abc import Callable

from ctxprefill_api.ring import (
    ANSWER,
    FREE,
    HEADER_BYTES,
    REQUEST,
    TAKEN,
    check_geometry,
    memory_fence,
)

from ..errors import AlreadyExists, FailedPrecondition, InvalidArgument, OutOfRange, ResourceExhausted
from .shared_memory import SYSTEM, Region, SharedMemoryRegistry, require_local
from .stream_order import StreamOrder

log = logging.getLogger("ctxprefill.service")

__all__ = ["AttachedRing", "RingTable", "FREE", "REQUEST", "TAKEN", "ANSWER"]

#: how long an attach waits for the engine thread to let go of a detached ring over the
#: same bytes (it does at its next poll, after the request it is running)
LET_GO_S = 5.0

_U32 = struct.Struct("<I")
_SEQ_LENGTH = struct.Struct("<IQ")  # a slot's seq and length, at byte 4 of its header


class AttachedRing:
    def __init__(self, region: Region, offset: int, num_slots: int, slot_bytes: int, peer: str):
        self.region, self.offset, self.num_slots, self.slot_bytes = region, offset, num_slots, slot_bytes
        self.peer = peer  # the caller that attached it: its requests use shared memory as that caller
        self.ring_id = uuid.uuid4().hex[:12]
        # a descriptor of its own: the region may be unregistered (its descriptor closed)
        # before the engine thread lets go of the ring
        self._fd: int | None = region.dup_descriptor()
        self._start = region.offset + offset  # the ring's first byte in the object
        self._end = self._start + num_slots * slot_bytes
        self._next = 0
        self._stop_asked = False
        #: set (with the reason, None when asked to) once the engine thread let go of the ring
        self.stopped: concurrent.futures.Future = concurrent.futures.Future()
        self.served = 0
        self.order: StreamOrder | None = None  # a stream-ordered ring's events (stream_order.py)

    @property
    def payload_bytes(self) -> int:
        return self.slot_bytes - HEADER_BYTES

    def detach(self) -> None:
        """Ask the engine thread to let go (any thread); ``stopped`` completes when it has."""
        self._stop_asked = True

    @property
    def detached(self) -> bool:
        """Its caller let go of it (the engine thread may not have yet: ``stopped``)."""
        return self._stop_asked

    def covers(self, offset: int, end: int) -> bool:
        """Whether the ring's bytes meet bytes [offset, end) of its region."""
        return offset < self.offset + self.num_slots * self.slot_bytes and self.offset < end

    def _shrank(self, size: int) -> FailedPrecondition:
        return FailedPrecondition("region", f"region {self.region.name!r}: shared-memory object "
                                            f"{self.region.key!r} shrank to {size} bytes, below the ring's bytes "
                                            f"[{self._start}, {self._end}); the ring is detached")

    def usable(self) -> bool:
        """On the engine thread: False once the ring must not be touched again (``stopped``
        is then set: asked to stop, region unregistered, or its object shrank)."""
        if self.stopped.done() or self._fd is None:
            return False
        why: Exception | None = None  # asked to stop
        if not self._stop_asked:
            if not self.region.registered:
                why = FailedPrecondition("region", f"region {self.region.name!r} was unregistered; the ring is "
                                                   f"detached")
            else:
                try:
                    size = os.fstat(self._fd).st_size
                except OSError as e:
                    why = FailedPrecondition("region", f"region {self.region.name!r}: cannot stat its object: "
                                                       f"{e.strerror}")
                else:
                    if size >= self._end:
                        return True
                    why = self._shrank(size)
        self._release(why)
        return False

    def fail(self, why: Exception) -> None:
        """On the engine thread: let go of the ring, ``why`` ending its call."""
        self._release(why)

    def _release(self, why: Exception | None) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self.order is not None:
            self.order.drain()  # the requests' regions are released once their device work is done
        if self.stopped.done():
            return
        if why is None:
            self.stopped.set_result(None)
        else:
            self.stopped.set_exception(why)

    def _pread(self, n: int, at: int) -> bytes | None:
        """``n`` bytes at ``at`` of the object; None (the ring stopped) when it no longer has them."""
        assert self._fd is not None
        try:
            data = os.pread(self._fd, n, at)
        except OSError as e:
            self._release(FailedPrecondition("region", f"region {self.region.name!r}: reading the ring failed: "
                                                       f"{e.strerror}"))
            return None
        if len(data) < n:
            self._release(self._shrank(os.fstat(self._fd).st_size))
            return None
        return data

    def _pwrite(self, data: bytes, at: int) -> bool:
        """``data`` at ``at`` of the object, if it still covers the ring (else the ring
        stops: a write past the end would grow the caller's object back)."""
        assert self._fd is not None
        try:
            size = os.fstat(self._fd).st_size
            if size < self._end:
                self._release(self._shrank(size))
                return False
            view, done = memoryview(data), 0
            while done < len(data):
                done += os.pwrite(self._fd, view[done:], at + done)
        except OSError as e:
            self._release(FailedPrecondition("region", f"region {self.region.name!r}: writing the ring failed: "
                                                       f"{e.strerror}"))
            return False
        return True

    def take(self) -> tuple[int, int, bytes | None] | None:
        """On the engine thread, after :meth:`usable`: the next slot's request, ``(slot,
        seq, payload)``; payload None when its length does not fit the slot. None when no
        request waits there (or the ring just stopped)."""
        i = self._next
        at = self._start + i * self.slot_bytes
        state = self._pread(4, at)
        if state is None or _U32.unpack(state)[0] != REQUEST:
            return None
        memory_fence()
        header = self._pread(_SEQ_LENGTH.size, at + 4)
        if header is None:
            return None
        seq, n = _SEQ_LENGTH.unpack(header)
        payload = None
        if n <= self.payload_bytes:
            payload = self._pread(n, at + HEADER_BYTES) if n else b""
            if payload is None:
                return None
        if not self._pwrite(_U32.pack(TAKEN), at):
            return None
        self._next = (i + 1) % self.num_slots
        return i, seq, payload

    def answer(self, slot: int, seq: int, data: bytes) -> None:
        """On the engine thread: the answer into the slot (it fits: the caller checked)."""
        at = self._start + slot * self.slot_bytes
        if self._fd is None or not (self._pwrite(data, at + HEADER_BYTES)
                                    and self._pwrite(_SEQ_LENGTH.pack(seq, len(data)), at + 4)):
            return
        memory_fence()
        if self._pwrite(_U32.pack(ANSWER), at):
            self.served += 1


class RingTable:
    """The rings attached to one server (event loop only), and their limit."""

    def __init__(self, registry: SharedMemoryRegistry, max_rings: int):
        self.registry, self.max_rings = registry, max_rings
        self.rings: list[AttachedRing] = []

    def attach(self, region_name: str, offset: int, num_slots: int, slot_bytes: int, peer: str,
               order: Callable[[int], StreamOrder] | None = None) -> AttachedRing:
        """Attach a ring for ``peer`` (the caller: PERMISSION_DENIED unless it is on this host);
        ``order`` opens its stream order's events for ``num_slots`` slots (a stream-ordered ring)."""
        require_local(peer, "region")
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
        if (region.offset + offset) % 64:
            raise InvalidArgument("offset", f"{offset} puts the ring at an address that is not 64-byte aligned "
                                            f"(region {region_name!r} starts at offset {region.offset} of its object)")
        region.check_backing("region", offset, end)
        self.rings = [r for r in self.rings if not r.stopped.done()]
        for r in self.rings:
            if r.region is region and r.covers(offset, end):
                raise AlreadyExists("offset", f"bytes [{offset}, {end}) of region {region_name!r} overlap ring "
                                              f"{r.ring_id}, " + ("detached, which the engine thread has not "
                                              "let go of yet" if r.detached else "attached there"))
        if len(self.rings) >= self.max_rings:
            raise ResourceExhausted("region", f"{len(self.rings)} rings are attached, the limit "
                                              f"(--request-ring-max) is {self.max_rings}")
        ring = AttachedRing(region, offset, num_slots, slot_bytes, peer)
        if order is not None:
            ring.order = order(num_slots)
        self.rings.append(ring)
        return ring

    def letting_go(self, region_name: str, offset: int, end: int) -> list[AttachedRing]:
        """Rings over bytes [offset, end) of region ``region_name`` that their callers
        detached and the engine thread still holds: until it lets go (at its next poll) it
        may take a request from their slots, so no ring is attached over them before."""
        return [r for r in self.rings if r.detached and not r.stopped.done() and r.region.name == region_name
                and r.covers(offset, end)]

    async def attach_when_free(self, region_name: str, offset: int, num_slots: int, slot_bytes: int, peer: str,
                               order: Callable[[int], StreamOrder] | None = None,
                               wait_s: float = LET_GO_S) -> AttachedRing:
        """:meth:`attach`, after waiting (up to ``wait_s``) for the engine thread to let go of
        the rings over the same bytes that their callers detached (:meth:`letting_go`): a
        caller re-attaching over its last ring's bytes must not share slots with it. Past
        the wait, :meth:`attach` refuses the overlap; a caller elsewhere, before any wait."""
        require_local(peer, "region")
        for r in self.letting_go(region_name, offset, offset + num_slots * slot_bytes):
            with contextlib.suppress(Exception):  # its reason ended its own call; a timeout: attach refuses
                await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(r.stopped)), wait_s)
        return self.attach(region_name, offset, num_slots, slot_bytes, peer, order)

    def forget(self, ring: AttachedRing) -> None:
        """Drop ``ring`` (the engine thread has let go of it: ``stopped``)."""
        assert ring.stopped.done(), "a ring the engine thread still holds keeps its bytes"
        if ring in self.rings:
            self.rings.remove(ring)
