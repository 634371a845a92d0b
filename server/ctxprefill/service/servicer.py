"""The RPC handlers of ``ctxprefill.v1.PrefillContextService`` (a ``grpc.aio`` servicer).

Each handler reads: refuse while starting or draining (UNAVAILABLE) or when the queue is
full (RESOURCE_EXHAUSTED, at once, never after waiting) -> decode the request into the
engine's type and check what the transport adds (``codec``, ``transport``) -> one
engine call on the engine thread (``engine_worker.py``, which owns the device), where
the engine checks the request itself (``engine/request.py``) -> encode the answer. A
request whose deadline passed while it waited is not run (DEADLINE_EXCEEDED; a
cancelled one is dropped from the queue); a device out-of-memory error fails only that
request (RESOURCE_EXHAUSTED), after freeing what it held. PrefillContext's steps are
``prefill.py``'s; its stream and request rings answer in-band (``streams.py``).

Shared memory (``--shared-memory``; ``shared_memory.py``, docs/TRANSPORT.md): the four
region RPCs, and tensors and outputs placed in registered regions, for callers on this
host only (``context.peer()`` a unix-domain socket or loopback; else PERMISSION_DENIED). A request holds a
lease on the regions it uses from decoding until its work on the engine thread is done
(device synchronized), so that unregistering never pulls memory from under it.

Handlers raise; the interceptors (``interceptors/``) turn exceptions into status codes.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from ctxprefill_api import SERVICE_NAME, pb, pb_grpc

from .. import __version__
from ..engine.engine import Engine
from ..engine.request import StopSignal, WriteRequest, check_instance
from ..errors import FailedPrecondition
from ..settings import ServeSettings, shared_memory_kinds
from . import codec, streams, transport
from .engine_worker import EngineWorker
from .info import region_pb, server_info
from .interceptors import RpcStatusError
from .logs import request_id_for_logs, request_id_var
from .metrics import Metrics, path_label
from .prefill import PrefillCall
from .request_ring import AttachedRing, RingTable
from .shared_memory import CUDA, SYSTEM, Lease, SharedMemoryRegistry, caller_peer, require_local
from .stream_order import StreamOrder

log = logging.getLogger("ctxprefill.service")

__all__ = ["SERVICE_NAME", "PrefillContextServicer"]
Context = grpc.aio.ServicerContext[Any, Any]


class PrefillContextServicer(pb_grpc.PrefillContextServiceServicer):
    """The service; owns the engine. PrefillContext and ReadCache may answer with a
    ``ctxprefill_api.wire.OutgoingMessage``: serve it behind the interceptors
    (``interceptors.server_interceptors``), whose serializer takes those."""

    STARTING, READY, DRAINING = "starting", "ready", "draining"

    def __init__(self, settings: ServeSettings, metrics: Metrics, worker: EngineWorker, max_message_bytes: int,
                 queue_size: int):
        self.settings = settings
        self.metrics = metrics
        self.worker = worker
        self.max_message_bytes = int(max_message_bytes)
        self.queue_size = max(1, int(queue_size))
        self.state = self.STARTING
        self.engine: Engine | None = None
        self.info: pb.GetServerInfoResponse | None = None
        self._admitted = 0  # requests handed to the worker and not finished (event-loop thread only)
        self._draining = asyncio.Event()  # set with the state: open streams end (PrefillContextStream)
        self.shm = SharedMemoryRegistry(shared_memory_kinds(settings), settings.shared_memory_max_regions,
                                        settings.shared_memory_max_bytes, on_change=metrics.set_shared_memory_regions,
                                        pin=settings.shared_memory_pin)
        self.rings = RingTable(self.shm, settings.request_ring_max) if settings.request_ring else None
        worker.ring_handler = functools.partial(streams.start_ring_request, open_call=self._open_ring_request,
                                                metrics=metrics, release=self._release_memory)
        worker.release_on_oom = self._release_memory

    def _release_memory(self) -> int:
        """On the engine thread, after an out-of-memory error: the engine's CUDA graphs go."""
        return self.engine.release_graphs() if self.engine is not None else 0

    # -- lifecycle (called by server.py) ---------------------------------------------
    def attach_engine(self, engine: Engine) -> None:
        self.engine = engine
        self.shm.attach(engine.device, *engine.cuda_ipc_opener())
        self.metrics.init_shared_memory(self.shm.kinds)
        self.info = server_info(engine, self.settings, self.max_message_bytes, self.shm,
                                self.rings.max_rings if self.rings is not None else 0)
        self.metrics.init_engine(version=__version__, backend=engine.backend.name, device=self.info.device,
                                 num_slots=engine.cache.config.num_slots * engine.config.num_layers,
                                 path=path_label(engine.config.fused), fp8_path=engine.config.fp8_path_labels,
                                 queue_capacity=self.queue_size, fused_kernels_active=engine.fused_kernels_active)
        self.metrics.cache_slots_used.set(engine.cache_slots_used)

    def set_ready(self) -> None:
        self.state = self.READY
        self.metrics.ready.set(1)

    def start_draining(self) -> None:
        """Refuse new requests (UNAVAILABLE); open streams end once their requests are
        answered. Call on the event loop."""
        self.state = self.DRAINING
        self.metrics.ready.set(0)
        self._draining.set()

    @property
    def in_flight(self) -> int:
        return self._admitted

    # -- admission ---------------------------------------------------------------------
    def _refuse(self, code: grpc.StatusCode, message: str, reason: str) -> RpcStatusError:
        self.metrics.rejected.labels(reason=reason).inc()
        return RpcStatusError(code, message, reason)

    def _gate(self, admit: bool = False) -> Engine:
        """The engine, or a refusal: starting or draining (UNAVAILABLE); with ``admit``, a
        full queue too (RESOURCE_EXHAUSTED before the request is even decoded, so that
        refusing under overload stays cheap; admission itself is decided in ``_run``)."""
        if self.state == self.DRAINING:
            raise self._refuse(grpc.StatusCode.UNAVAILABLE, "server is shutting down; retry on another instance",
                               "draining")
        if self.state != self.READY or self.engine is None:
            raise self._refuse(grpc.StatusCode.UNAVAILABLE,
                               "server is starting (loading weights, warming up kernels); retry shortly", "starting")
        if admit:
            self._check_room()
        return self.engine

    def _check_room(self) -> None:
        if self._admitted >= self.queue_size:
            raise self._refuse(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"queue full ({self._admitted} requests admitted, limit {self.queue_size}); retry later",
                               "queue_full")

    async def _run(self, fn: Callable[[], Any], context: Context, stop: StopSignal | None = None,
                   quick: Callable[[], bool] | None = None) -> Any:
        """Admit (or refuse at once), queue, await the worker's result. ``stop`` gets the
        call's deadline, and is cancelled when the call is (the work stops between chunks);
        ``quick``: ``fn`` is a two-step call (``EngineWorker.submit``)."""
        self._check_room()
        remaining = context.time_remaining()
        deadline = None if remaining is None else time.monotonic() + remaining
        if stop is not None:
            stop.deadline = deadline
        self._admitted += 1
        try:
            return await self.worker.submit(fn, deadline, stop, quick)
        finally:
            self._admitted -= 1

    def _lease(self, context: Context) -> Lease | None:
        """A lease on shared-memory regions for one request of this call's peer (None when
        shared memory is off)."""
        return self.shm.lease(context.peer()) if self.shm.enabled else None

    # -- RPCs ----------------------------------------------------------------------------
    async def GetServerInfo(self, request: pb.GetServerInfoRequest, context: Context) -> pb.GetServerInfoResponse:
        self._gate()
        assert self.info is not None  # set with the engine
        return self.info

    async def WriteCache(self, request: Any, context: Context) -> pb.WriteCacheResponse:
        engine = self._gate(admit=True)
        lease = self._lease(context)
        try:
            decoded = codec.decode_write(request, lease)
            n = await self._run(functools.partial(self._write, engine, decoded, lease), context)
        finally:
            if lease is not None:
                lease.abandon()
        return pb.WriteCacheResponse(slots_written=n, instance_id=engine.instance_id)

    def _write(self, engine: Engine, decoded: codec.Decoded[WriteRequest], lease: Lease | None) -> int:
        """On the engine thread: the engine's write, counted."""
        if lease is not None and not lease.begin():
            return 0  # the handler gave up on this request
        try:
            written = engine.write(codec.with_inputs(decoded.request, decoded.shared, engine.device))
            self.metrics.observe_insert(written.launches, path_label(engine.config.fused), engine.cache_slots_used)
            if lease is not None:
                self.metrics.observe_shared_memory(lease.transferred)
            return written.slots_written
        finally:
            if lease is not None:
                lease.end(engine.device)

    async def ReadCache(self, request: pb.ReadCacheRequest, context: Context) -> Any:
        engine = self._gate(admit=True)
        lease = self._lease(context)
        try:
            read = codec.decode_read(request, lease)
            transport.check_read(read, engine.config, self.max_message_bytes)
            if lease is not None:
                self.metrics.observe_shared_memory(lease.transferred)
        finally:
            if lease is not None:  # slot_mapping was copied out of shared memory: nothing more to hold
                lease.abandon()
        raw = await self._run(functools.partial(engine.read, read), context)
        return codec.read_response(raw, engine.instance_id)  # the slot bytes go out at serialization

    async def PrefillContext(self, request: Any, context: Context) -> Any:
        return await self._prefill(request, request.request_id or uuid.uuid4().hex, context)

    async def _prefill(self, request: Any, request_id: str, context: Context) -> Any:
        t0 = time.perf_counter_ns()
        request_id_var.set(request_id_for_logs(request_id))
        engine = self._gate(admit=True)
        caller_peer.set(context.peer())  # the regions it names are used as this peer's
        call = PrefillCall.open(engine, self.metrics, request, request_id, self.shm, self.max_message_bytes, t0)
        try:
            # two steps: the engine thread may start it while the request before it runs
            done = await self._run(call.start, context, call.stop, call.quick_start)
        finally:
            call.abandon()
        return call.response(done)

    async def PrefillContextStream(self, request_iterator: AsyncIterator[Any], context: Context) -> AsyncIterator[Any]:
        """Requests of one call, each run as by PrefillContext, answered in order, a failed
        one in-band (``streams.py``); the stream ends with UNAVAILABLE once the server
        drains and every request read has its answer."""
        self._gate()

        def answer(msg: Any) -> Any:
            return streams.answer_one(lambda m, rid: self._prefill(m, rid, context), msg, self.metrics)

        async for response in streams.answer_stream(request_iterator, answer, self.queue_size, self._draining):
            yield response

    # -- request rings (--request-ring; request_ring.py) ----------------------------------
    def _open_ring_request(self, request: Any, request_id: str, t0: int) -> PrefillCall:
        """A ring request's PrefillCall (on the engine thread: no admission, it is running)."""
        return PrefillCall.open(self._gate(), self.metrics, request, request_id, self.shm, self.max_message_bytes,
                                t0)

    async def AttachRequestRing(self, request: pb.AttachRequestRingRequest,
                                context: Context) -> AsyncIterator[pb.AttachRequestRingResponse]:
        """Attach, answer once, then hold the call open until the caller ends it, the
        ring stops (region unregistered or shrunk) or the server drains."""
        engine = self._gate()
        if self.rings is None:
            raise self._refuse(grpc.StatusCode.UNIMPLEMENTED,
                               "request rings are off: start the server with --request-ring (and --shared-memory "
                               "system or all)", "request_ring_off")
        check_instance(request.expected_instance_id if request.HasField("expected_instance_id") else None,
                       engine.instance_id)
        order = None
        if request.ready_events:
            if not self.settings.request_ring_stream_order:
                raise FailedPrecondition("ready_events", "stream-ordered rings are off: start the server with "
                                                         "--request-ring-stream-order")
            order = functools.partial(StreamOrder.open, list(request.ready_events), device=engine.device,
                                      timeout_s=self.settings.request_ring_stream_order_timeout_s)
        ring = await self.rings.attach_when_free(request.region, int(request.offset), int(request.num_slots),
                                                 int(request.slot_bytes), context.peer(), order)
        self.worker.add_ring(ring)
        self.metrics.request_rings.set(len(self.rings.rings))
        log.info("request ring attached", extra={"ring": ring.ring_id, "region": request.region,
                                                 "num_slots": ring.num_slots, "slot_bytes": ring.slot_bytes,
                                                 "stream_order": ring.order is not None})
        stopped = asyncio.wrap_future(ring.stopped)
        drained = asyncio.ensure_future(self._draining.wait())
        try:
            yield pb.AttachRequestRingResponse(instance_id=engine.instance_id, ring_id=ring.ring_id,
                                               done_events=ring.order.handles if ring.order is not None else ())
            await asyncio.wait((stopped, drained), return_when=asyncio.FIRST_COMPLETED)
            if not stopped.done():
                raise RpcStatusError(grpc.StatusCode.UNAVAILABLE,
                                     "the server is draining: the request ring is detached; attach one to another "
                                     "instance", "draining")
            stopped.result()  # the reason it stopped (region unregistered or shrunk) ends the call
        finally:
            # ours to end when the caller went (cancelled) or the server drains: the engine
            # thread lets go at its next poll; the table keeps the ring's bytes until then
            ring.detach()
            drained.cancel()
            stopped.add_done_callback(lambda _: self._ring_let_go(ring))

    def _ring_let_go(self, ring: AttachedRing) -> None:
        """The engine thread let go of a detached ring (event loop): its bytes are free."""
        self.rings.forget(ring)
        self.metrics.request_rings.set(len(self.rings.rings))
        log.info("request ring detached", extra={"ring": ring.ring_id, "served": ring.served})

    # -- shared memory -------------------------------------------------------------------
    async def RegisterSystemSharedMemory(self, request: pb.RegisterSystemSharedMemoryRequest,
                                         context: Context) -> pb.RegisterSystemSharedMemoryResponse:
        self._gate()
        self.shm.require(SYSTEM)  # refuse cheaply on the event loop; page-locking the mapping takes a while
        require_local(context.peer())
        r = await asyncio.to_thread(self.shm.register_system, request.name, request.key, request.offset,
                                    request.byte_size)
        return pb.RegisterSystemSharedMemoryResponse(region=region_pb(r.status()))

    async def RegisterCudaSharedMemory(self, request: pb.RegisterCudaSharedMemoryRequest,
                                       context: Context) -> pb.RegisterCudaSharedMemoryResponse:
        self._gate()
        self.shm.require(CUDA)  # refuse cheaply on the event loop; opening the handle is a driver call
        require_local(context.peer())
        r = await asyncio.to_thread(self.shm.register_cuda, request.name, request.raw_handle, request.device_id,
                                    request.offset, request.byte_size)
        return pb.RegisterCudaSharedMemoryResponse(region=region_pb(r.status()))

    async def UnregisterSharedMemory(self, request: pb.UnregisterSharedMemoryRequest,
                                     context: Context) -> pb.UnregisterSharedMemoryResponse:
        self._gate()
        self.shm.require_any()
        require_local(context.peer())
        return pb.UnregisterSharedMemoryResponse(names=self.shm.unregister(request.name))

    async def GetSharedMemoryStatus(self, request: pb.GetSharedMemoryStatusRequest,
                                    context: Context) -> pb.GetSharedMemoryStatusResponse:
        self._gate()
        self.shm.require_any()
        require_local(context.peer())
        return pb.GetSharedMemoryStatusResponse(regions=[region_pb(d) for d in self.shm.status(request.name)])
