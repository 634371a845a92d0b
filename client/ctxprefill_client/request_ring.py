"""Request rings: PrefillContext through slots of a shared-memory region (same host).

A gRPC call costs a same-host caller more than its bytes: on the H200 host a bare
unary round trip took 0.59 ms and a CUDA IPC request 2.4 ms more than the engine's
own 6.6 ms, most of it threads of both processes waking up to pass the request along
(docs/TRANSPORT.md). A request ring takes gRPC and those hand-offs off the per-request
path, as vLLM's shared-memory message queue does between its processes: the caller
writes the serialized request into a slot of a registered system shared-memory
region, the server's engine thread — which polls attached rings between its other
work — takes it, runs it exactly as PrefillContext, and writes the answer into the
same slot, which the caller polls. gRPC stays the control plane: ``AttachRequestRing``
attaches the ring and stays open while it is in use, so a caller that goes away
detaches its ring.

    region = SystemSharedMemoryRegion("ring", RequestRing.bytes_needed(4, 1 << 16))
    client.register_system_shared_memory(region)
    with client.attach_request_ring(region, num_slots=4, slot_bytes=1 << 16) as ring:
        res = ring.prefill_context(q_in, seqs, output_region=out_ref, lse_region=lse_ref)

Put the tensors in shared memory too (a slot holds the request and the answer
messages; inline tensors must fit in it). The server needs ``--request-ring`` and
``--shared-memory system`` (or ``all``).

The slot layout (header fields and states) is written down in :mod:`ctxprefill_api.ring`.
Each side writes the payload and length, then a memory fence, then the state; the
reader reads the state, a fence, then the rest. Requests are taken in slot order,
round robin from slot 0: write them into consecutive slots.

A caller that runs requests one after another (an engine's layers) can build the next
one while the current one runs: :meth:`RequestRing.prepare` builds and serializes a
request without taking a slot, :meth:`RequestRing.submit_prepared` writes it into the
next one. A shared-memory input is read when the server runs the request, so q may be
written after ``prepare``, before ``submit_prepared`` (an inline q is copied by ``prepare``).

Stream order (``stream_ordered=True``; torch, a CUDA server started with
``--request-ring-stream-order``): the ring carries one pair of CUDA IPC events per slot.
:meth:`RequestRing.submit` records the slot's *ready* event on the caller's current
stream before it writes the request, and the server's device work waits for that event
on the device, not the caller's host for its stream; the server answers once the work is
queued, and :meth:`RequestRing.result` makes the current stream wait for the slot's
*done* event before it returns. So neither host waits for the device: a model's layers
issue their calls as they issue kernels, and the GPU goes from the caller's work to the
server's and back. Every tensor of such a request lies in a CUDA region (q, cache_write,
output_region, lse_region); the answer's ``stats["queued"]`` is True and has no device
times. The results are read, and the request's regions written again, on the stream (or
after synchronizing it).

    with client.attach_request_ring(region, stream_ordered=True) as ring:
        q_buf.copy_(q)                                      # on the current stream
        ring.submit(q_in, seqs, output_region=out_ref, lse_region=lse_ref)
        ring.result()                                       # queued; the stream waits for it
        next_q = o_proj(out_buf)                            # runs after the server's work

Waiting: :meth:`RequestRing.result` spins on the slot's state for up to ``spin_s``
seconds, then checks every ``sleep_s``. Spinning costs a CPU while waiting and is
what makes the ring fast (a sleeping thread takes ~0.1 ms to run again on a VM).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import os
import time
from collections.abc import Iterable
from typing import Any

import grpc
import numpy as np

from ctxprefill_api import pb

from ._common import CtxPrefillError, CtxPrefillRpcError, PrefillResult, map_rpc_error
from ._trace_context import with_trace_context
from .shared_memory import SharedMemoryRef, SystemSharedMemoryRegion
from .stream import Pending, answer_to_result, prefill_request

__all__ = ["RequestRing", "PreparedRequest", "FREE", "REQUEST", "TAKEN", "ANSWER", "HEADER_BYTES", "MIN_SLOT_BYTES",
           "MAX_SLOT_BYTES", "MAX_SLOTS", "memory_fence", "slot_fields"]

from ctxprefill_api.ring import (  # noqa: F401  (re-exported: the ring's layout is part of this module's API)
    ANSWER,
    FREE,
    HEADER_BYTES,
    MAX_SLOT_BYTES,
    MAX_SLOTS,
    METHOD,
    MIN_SLOT_BYTES,
    REQUEST,
    TAKEN,
    check_geometry,
    memory_fence,
    slot_fields,
)


@dataclasses.dataclass(frozen=True)
class PreparedRequest:
    """A request built and serialized ahead (:meth:`RequestRing.prepare`), not sent yet."""

    data: bytes  # the serialized PrefillContextRequest
    pending: Pending  # what parsing its answer needs


class RequestRing:
    """A ring attached to a server (from ``PrefillContextClient.attach_request_ring``).
    Not thread-safe: one thread submits and reads. Up to ``num_slots`` requests in flight;
    answers come in request order."""

    @staticmethod
    def bytes_needed(num_slots: int, slot_bytes: int) -> int:
        return int(num_slots) * int(slot_bytes)

    def __init__(self, client: Any, region: SystemSharedMemoryRegion, *, num_slots: int = 4,
                 slot_bytes: int = 1 << 16, offset: int = 0, timeout: float | None = None, spin_s: float = 0.25,
                 sleep_s: float = 50e-6, stream_ordered: bool = False, device: Any = None) -> None:
        if not isinstance(region, SystemSharedMemoryRegion):
            raise TypeError("region: a registered SystemSharedMemoryRegion (the ring lives in host memory)")
        check_geometry(num_slots, slot_bytes, offset)
        size = self.bytes_needed(num_slots, slot_bytes)
        if offset + size > region.byte_size:
            raise ValueError(f"the ring ({num_slots} x {slot_bytes} bytes from {offset}) does not fit region "
                             f"{region.name!r} ({region.byte_size} bytes)")
        self._client = client
        self.region, self.num_slots, self.slot_bytes, self.offset = region, num_slots, slot_bytes, offset
        self.spin_s, self.sleep_s = float(spin_s), float(sleep_s)
        self._buf = region.ndarray(np.uint8, (size,), offset)
        self._states, self._seqs, self._lengths = slot_fields(self._buf, num_slots, slot_bytes)
        self._states[:] = FREE
        memory_fence()
        self._pending: collections.deque[tuple[int, int, Pending | None]] = collections.deque()  # slot, seq
        self._next = 0  # the slot of the next request
        self._seq = 0
        self.timeout = timeout
        expected = client._tracker.expected()
        req = pb.AttachRequestRingRequest(region=region.name, offset=offset, num_slots=num_slots,
                                          slot_bytes=slot_bytes)
        if expected is not None:
            req.expected_instance_id = expected
        self._ready: list[Any] = []  # stream order: the slots' ready events (ours) and done events (the server's)
        self._done: list[Any] = []
        self._stream: Any = None  # stream order: the caller's current stream on its device, when asked
        if stream_ordered:
            import torch  # stream order only

            dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
            self._stream = functools.partial(torch.cuda.current_stream, dev)
            event: Any = torch.cuda.Event  # untyped in torch's stubs
            self._ready = [event(interprocess=True) for _ in range(num_slots)]
            with torch.cuda.device(dev):
                req.ready_events.extend(bytes(e.ipc_handle()) for e in self._ready)
        # the call lives as long as the ring: its deadline (``timeout``) ends the ring
        self._call = client._stub.AttachRequestRing(req, timeout=timeout, metadata=with_trace_context(client._metadata))
        try:
            first = next(self._call)
        except grpc.RpcError as err:
            raise map_rpc_error(METHOD, err, expected) from err
        except StopIteration:
            raise CtxPrefillRpcError(METHOD, None, "the server ended the call without attaching the ring") from None
        client._tracker.observe(METHOD, first.instance_id)
        self.ring_id = first.ring_id
        self._closed = False
        if stream_ordered:
            if len(first.done_events) != num_slots:
                self._call.cancel()
                raise CtxPrefillError(f"the server sent {len(first.done_events)} done events for {num_slots} slots")
            opened: Any = torch.cuda.Event.from_ipc_handle  # untyped in torch's stubs
            self._done = [opened(dev, h) for h in first.done_events]

    @property
    def stream_ordered(self) -> bool:
        return self._stream is not None

    # ------------------------------------------------------------------ requests

    def submit(self, q: Any, sequences: Iterable[Any], *, request_id: str | None = None,
               workspace_tokens: int | None = None, plan: Iterable[Any] | None = None, q_dtype: int | None = None,
               output_region: SharedMemoryRef | None = None, lse_region: SharedMemoryRef | None = None,
               float_output: bool = True, layer: int | None = None, cache_write: Any = None) -> None:
        """Write one request (arguments as ``PrefillContextClient.prefill_context``) into the
        next slot; its answer is a later :meth:`result`."""
        self.submit_prepared(self.prepare(q, sequences, request_id=request_id, workspace_tokens=workspace_tokens,
                                          plan=plan, q_dtype=q_dtype, output_region=output_region,
                                          lse_region=lse_region, float_output=float_output, layer=layer,
                                          cache_write=cache_write))

    def prepare(self, q: Any, sequences: Iterable[Any], *, request_id: str | None = None,
                workspace_tokens: int | None = None, plan: Iterable[Any] | None = None, q_dtype: int | None = None,
                output_region: SharedMemoryRef | None = None, lse_region: SharedMemoryRef | None = None,
                float_output: bool = True, layer: int | None = None, cache_write: Any = None) -> PreparedRequest:
        """One request (arguments as :meth:`submit`) built and serialized, no slot taken: send
        it with :meth:`submit_prepared`, e.g. while the request before it runs."""
        req, pending = prefill_request(self._client, q, sequences, request_id, workspace_tokens, plan, q_dtype,
                                       output_region, lse_region, float_output, layer, cache_write)
        return PreparedRequest(req.SerializeToString(), pending)

    def submit_prepared(self, prepared: PreparedRequest) -> None:
        """Write a :meth:`prepare`-d request into the next slot; its answer is a later :meth:`result`."""
        self._write(prepared.data, prepared.pending)

    def result(self) -> PrefillResult:
        """The answer to the oldest request without one (waits for it)."""
        msg, p = self._receive()
        if p is None:
            raise CtxPrefillError("the oldest request was sent with send(): read it with receive()")
        return answer_to_result(self._client, msg, p, METHOD)

    def send(self, request: Any, _meta: Pending | None = None) -> None:
        """The raw form of :meth:`submit`: a built PrefillContextRequest (anything with
        ``SerializeToString``) into the next slot; its answer is a later :meth:`receive`."""
        self._write(request.SerializeToString(), _meta)

    def _write(self, data: bytes, meta: Pending | None) -> None:
        self._check_open()
        if len(self._pending) >= self.num_slots:
            raise CtxPrefillError(f"all {self.num_slots} slots hold requests in flight: read a result first")
        slot = self._next
        if self._states[slot] != FREE:
            raise CtxPrefillError(f"slot {slot} is not free (state {int(self._states[slot])})")
        room = self.slot_bytes - HEADER_BYTES
        if len(data) > room:
            raise ValueError(f"the request takes {len(data)} bytes, a slot holds {room}: put q in shared memory "
                             f"or attach a ring with larger slots")
        base = slot * self.slot_bytes + HEADER_BYTES
        self._buf[base : base + len(data)] = np.frombuffer(data, np.uint8)
        if self._stream is not None:  # the inputs written so far on the stream are what the server's work waits for
            self._ready[slot].record(self._stream())
        self._seq = (self._seq + 1) & 0xFFFFFFFF
        self._seqs[slot] = self._seq
        self._lengths[slot] = len(data)
        memory_fence()
        self._states[slot] = REQUEST
        self._next = (slot + 1) % self.num_slots
        self._pending.append((slot, self._seq, meta))

    def receive(self) -> pb.PrefillContextStreamResponse:
        """The raw form of :meth:`result`: the oldest request's answer as the server wrote it."""
        return self._receive()[0]

    def _receive(self) -> tuple[pb.PrefillContextStreamResponse, Pending | None]:
        if not self._pending:
            raise CtxPrefillError("no request in flight on this ring")
        slot, want, meta = self._pending[0]
        self._wait(slot)
        self._pending.popleft()
        memory_fence()
        n = int(self._lengths[slot])
        seq = int(self._seqs[slot])
        if n > self.slot_bytes - HEADER_BYTES:
            self._states[slot] = FREE
            raise CtxPrefillError(f"slot {slot}: the answer claims {n} bytes, more than a slot holds")
        base = slot * self.slot_bytes + HEADER_BYTES
        data = self._buf[base : base + n].tobytes()
        memory_fence()
        self._states[slot] = FREE
        if self._stream is not None:  # the stream goes on once the server's work for the slot is done
            self._stream().wait_event(self._done[slot])
        if seq != want:
            raise CtxPrefillError(f"slot {slot}: the answer is to request {seq}, expected {want}")
        return pb.PrefillContextStreamResponse.FromString(data), meta

    def prefill_context(self, q: Any, sequences: Iterable[Any], **kw: Any) -> PrefillResult:
        """One request, waited for: :meth:`submit` then :meth:`result`."""
        if self._pending:
            raise CtxPrefillError("requests are in flight on this ring: read their results first")
        self.submit(q, sequences, **kw)
        return self.result()

    def _wait(self, slot: int) -> None:
        """Until the slot holds an answer: spin, then sleep between checks; the call's end
        (server gone, draining, the deadline) raises once no answer can come."""
        states = self._states
        t0 = time.perf_counter()
        n = 0
        while states[slot] != ANSWER:
            n += 1
            if n & 255 == 0:
                if self._call.done():
                    if states[slot] == ANSWER:  # written just before the call ended
                        return
                    self._closed = True
                    raise self._ended()
                if time.perf_counter() - t0 > self.spin_s:
                    time.sleep(self.sleep_s)
                    continue
            os.sched_yield()  # lets the other threads of this process run (it releases the GIL)

    def _ended(self) -> CtxPrefillError:
        try:
            code, details = self._call.code(), self._call.details()
        except Exception:  # noqa: BLE001
            code, details = None, "the ring's call ended"
        return CtxPrefillRpcError(METHOD, code, f"the request ring was detached: {details}")

    # ------------------------------------------------------------------ lifetime

    def _check_open(self) -> None:
        if self._closed:
            raise CtxPrefillError("the request ring is closed")
        if self._call.done():
            self._closed = True
            raise self._ended()

    @property
    def is_open(self) -> bool:
        return not self._closed and not self._call.done()

    def close(self) -> None:
        """Detach the ring (ends the AttachRequestRing call). Requests still in flight
        are answered into their slots, unread."""
        if not self._closed:
            self._closed = True
            self._call.cancel()
        # views of the segment would keep the region's close() from unmapping it
        self._buf = self._states = self._seqs = self._lengths = np.empty(0, np.uint8)

    def __enter__(self) -> RequestRing:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"RequestRing({self.region.name!r}, num_slots={self.num_slots}, slot_bytes={self.slot_bytes}, "
                f"offset={self.offset}, in_flight={len(self._pending)})")
