"""The RPC handlers of ``ctxprefill.v1.PrefillContextService`` (a ``grpc.aio`` servicer).

A handler: refuses while starting or draining (UNAVAILABLE), checks
``expected_instance_id`` (FAILED_PRECONDITION), validates the whole request
(``validate.py``: INVALID_ARGUMENT / OUT_OF_RANGE naming the field), then hands the
engine call to the engine thread (``engine_worker.py``), which owns the device, behind
a bounded admission count (RESOURCE_EXHAUSTED at once when full, never after waiting).
A request whose deadline passed while it waited is not run (DEADLINE_EXCEEDED; a
cancelled one is dropped from the queue); a device out-of-memory error fails only
that request (RESOURCE_EXHAUSTED), after freeing what it held.

Shared memory (``--shared-memory``; ``shared_memory.py``, docs/TRANSPORT.md): the
four region RPCs, and tensors and outputs placed in registered regions. A request
holds a lease on the regions it uses from validation until its work on the engine
thread is done (device synchronized), so that unregistering never pulls memory from
under a running request.

Handlers raise; ``interceptors.py`` turns exceptions into status codes.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import sys
import time
import uuid
from collections import Counter

import grpc
import torch

from ctxprefill_api import pb
from ctxprefill_api import pb_grpc
from ctxprefill_api.wire import finish, nest, place_tensor

from .. import __version__
from ..engine.engine import Engine
from ..ops import _cuda, launches
from ..settings import ShardSpec, shared_memory_kinds
from . import codec, inline_views, validate
from .engine_worker import EngineWorker, oom_guarded
from .interceptors import RpcStatusError, request_id_var, status_for
from .metrics import Metrics
from .request_ring import RingTable
from .shared_memory import CUDA, SYSTEM, SharedMemoryRegistry

log = logging.getLogger("ctxprefill.service")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["PrefillContextService"].full_name
METHODS = [m.name for m in pb.DESCRIPTOR.services_by_name["PrefillContextService"].methods]
STREAM_METHOD = f"/{SERVICE_NAME}/PrefillContextStream"  # what an in-band error's log line names
RING_METHOD = f"/{SERVICE_NAME}/AttachRequestRing"

def describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        idx = device.index if device.index is not None else torch.cuda.current_device()
        return f"cuda:{idx} ({torch.cuda.get_device_name(idx)})"
    return str(device)


def versions() -> pb.Versions:
    cudnn = ""
    try:
        if torch.backends.cudnn.is_available():
            cudnn = str(torch.backends.cudnn.version())
    except Exception:  # noqa: BLE001
        cudnn = ""
    return pb.Versions(server=__version__, torch=torch.__version__, cuda=torch.version.cuda or "", cudnn=cudnn,
                       python=".".join(map(str, sys.version_info[:3])))


class PrefillContextServicer(pb_grpc.PrefillContextServiceServicer):
    """The service; owns the engine. PrefillContext and ReadCache may answer with a
    ``ctxprefill_api.wire.OutgoingMessage`` (inline tensor bytes appended at
    serialization): serve it behind :class:`~.interceptors.ServerInterceptor`, whose
    response serializer takes those."""

    STARTING, READY, DRAINING = "starting", "ready", "draining"

    def __init__(self, settings, metrics: Metrics, worker: EngineWorker, max_message_bytes: int,
                 queue_size: int):
        self.settings = settings
        self.metrics = metrics
        self.worker = worker
        self.max_message_bytes = int(max_message_bytes)
        self.queue_size = max(1, int(queue_size))
        self.state = self.STARTING
        self.engine: Engine | None = None
        self._info: pb.GetServerInfoResponse | None = None
        self._admitted = 0  # requests handed to the worker and not finished (event-loop thread only)
        self._draining = asyncio.Event()  # set with the state: open streams end (PrefillContextStream)
        kinds = shared_memory_kinds(settings) if hasattr(settings, "shared_memory") else ()  # ConfigError
        self.shm = SharedMemoryRegistry(kinds, getattr(settings, "shared_memory_max_regions", 64),
                                        getattr(settings, "shared_memory_max_bytes", 64 << 30),
                                        on_change=metrics.set_shared_memory_regions,
                                        pin=getattr(settings, "shared_memory_pin", True))
        self.rings = (RingTable(self.shm, settings.request_ring_max)
                      if getattr(settings, "request_ring", False) else None)
        worker.ring_handler = self._ring_start

    # -- lifecycle (called by server.py) ---------------------------------------------
    def attach_engine(self, engine: Engine) -> None:
        self.engine = engine
        self.shm.attach(engine.device)
        self.metrics.init_shared_memory(self.shm.kinds)
        self._info = self._server_info(engine)
        path = "fused" if engine.config.fused else "generic"
        self.metrics.init_engine(version=__version__, backend=engine.backend.name, device=self._info.device,
                                 num_slots=engine.cache.config.num_slots * engine.config.num_layers, path=path,
                                 fp8_path=engine.config.fp8_path_labels, queue_capacity=self.queue_size,
                                 fused_kernels_active=engine.fused_kernels_active)
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

    # -- helpers ---------------------------------------------------------------------
    def _refuse(self, code: grpc.StatusCode, message: str, reason: str) -> RpcStatusError:
        self.metrics.rejected.labels(reason=reason).inc()
        return RpcStatusError(code, message, reason)

    def _gate(self, admit: bool = False) -> Engine:
        """The engine, or a refusal: starting or draining (UNAVAILABLE); with ``admit``, a
        full queue too (RESOURCE_EXHAUSTED before the request is even validated, so that
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

    async def _run(self, fn, context):
        """Admit (or refuse at once), queue, await the worker's result."""
        self._check_room()
        remaining = context.time_remaining()
        deadline = None if remaining is None else time.monotonic() + remaining
        self._admitted += 1
        try:
            return await self.worker.submit(fn, deadline)
        finally:
            self._admitted -= 1

    def _server_info(self, engine: Engine) -> pb.GetServerInfoResponse:
        cfg, s = engine.config, self.settings
        shard = getattr(engine, "shard", None) or ShardSpec(0, 1, cfg.shape.heads)  # set by build_engine
        shape, cache = cfg.shape, cfg.cache
        w = engine.weights
        scale_format = "" if w.scale is None else ("tensor" if w.scale.dim() == 0 or w.scale.numel() == 1 else "block")
        if engine.fused_kernels_active:
            reason = ""
        elif not cfg.fused:
            reason = "generic path selected (--generic)"
        elif engine.device.type != "cuda":
            reason = "no CUDA device: the torch reference ops run on the CPU"
        else:
            reason = _cuda.why_not()
        return pb.GetServerInfoResponse(
            instance_id=engine.instance_id,
            num_heads=shape.heads, kv_lora_rank=shape.kv_lora_rank, qk_nope_head_dim=shape.qk_nope_head_dim,
            qk_rope_head_dim=shape.qk_rope_head_dim, v_head_dim=shape.v_head_dim, softmax_scale=shape.scale,
            cache_dtype=cache.dtype, block_size=cache.block_size, num_blocks=cache.num_blocks,
            k_scale=cache.k_scale, bytes_per_slot=cache.bytes_per_slot,
            kv_b_proj_dtype=w.dtype, kv_b_proj_scale_format=scale_format,
            weights_source=(s.weights if s.weights else f"random(seed={s.seed})") + (
                f" [heads {shard.head_start}:{shard.head_end} of {shard.total_heads}]" if shard.num_shards > 1 else ""),
            prefill_dtype=cfg.prefill_dtype,
            attention_backend=engine.backend.name, attention_backend_supports_out=bool(engine.backend.supports_out()),
            fused_kernels_active=bool(engine.fused_kernels_active), fused_kernels_reason=reason,
            workspace_tokens=cfg.workspace_tokens, device=describe_device(engine.device), versions=versions(),
            max_message_bytes=self.max_message_bytes,
            shard_index=shard.shard_index, num_shards=shard.num_shards, total_heads=shard.total_heads,
            shared_memory_kinds=[_KIND_PB[k] for k in self.shm.kinds],
            shared_memory_max_regions=self.shm.max_regions if self.shm.enabled else 0,
            shared_memory_max_bytes=self.shm.max_bytes if self.shm.enabled else 0,
            request_ring_max=self.rings.max_rings if self.rings is not None else 0,
            num_layers=cfg.num_layers, first_layer=cfg.first_layer, unpacked_keys=engine.unpacked_keys_active,
        )

    def _lease(self):
        """A lease on shared-memory regions for one request (None when shared memory is off)."""
        return self.shm.lease() if self.shm.enabled else None

    def _end_shared(self, lease, device: torch.device) -> None:
        """On the engine thread, after a request's work (done or failed): wait for the
        device work that may still touch CUDA or page-locked regions, then release the
        regions."""
        if lease is None:
            return
        try:
            if lease.device_copies and device.type == "cuda":
                torch.cuda.synchronize(device)
        except Exception:  # noqa: BLE001 - a failed device; the regions are released anyway
            log.exception("device synchronize before releasing shared-memory regions failed")
        finally:
            lease.finish()

    # -- RPCs ----------------------------------------------------------------------------
    async def GetServerInfo(self, request, context):
        self._gate()
        return self._info

    async def WriteCache(self, request, context):
        engine = self._gate(admit=True)
        validate.check_instance(request, engine.instance_id)
        lease = self._lease()
        try:
            args = validate.validate_write(request, engine.config, lease)

            def work():
                if lease is not None and not lease.begin():
                    return 0  # the handler gave up on this request
                try:
                    n = self._write(engine, args)
                    if lease is not None:
                        self.metrics.observe_shared_memory(lease.transferred)
                    return n
                finally:
                    self._end_shared(lease, engine.device)

            n = await self._run(work, context)
        finally:
            if lease is not None:
                lease.abandon()
        return pb.WriteCacheResponse(slots_written=n, instance_id=engine.instance_id)

    def _write(self, engine: Engine, args: validate.WriteArgs) -> int:
        """On the engine thread: insert checked latents (WriteCache, or a PrefillContext's
        cache_write), counting the launches; returns the slots written."""
        kv_c, k_pe = args.kv_c, args.k_pe
        if "kv_c" in args.shared:
            kv_c = codec.from_shared(kv_c, engine.device)
        if "k_pe" in args.shared:
            k_pe = codec.from_shared(k_pe, engine.device)
        counts: Counter = Counter()
        with launches.stage(counts, "insert"):
            n = engine.write_cache(args.slot_mapping, kv_c, k_pe, layer=args.layer)
        self.metrics.observe_insert(counts["insert"], "fused" if engine.config.fused else "generic",
                                    engine.cache_slots_used)
        return n

    async def ReadCache(self, request, context):
        engine = self._gate(admit=True)
        validate.check_instance(request, engine.instance_id)
        lease = self._lease()
        try:
            slots, layer = validate.validate_read(request, engine.config, self.max_message_bytes, lease)
            if lease is not None:
                self.metrics.observe_shared_memory(lease.transferred)
        finally:
            if lease is not None:  # slot_mapping was copied out of shared memory: nothing more to hold
                lease.abandon()
        bps = engine.cache.config.bytes_per_slot

        def work():
            raw = engine.read_cache(slots, layer=layer)
            if raw.shape[0] == 0:
                raw = torch.empty((0, bps), dtype=torch.uint8)
            return codec.encode_parts(raw)

        parts = await self._run(work, context)
        resp, payloads = pb.ReadCacheResponse(instance_id=engine.instance_id), []
        place_tensor(resp, "slots", parts, payloads)
        return finish(resp, payloads)  # the slot bytes go out at serialization (ctxprefill_client/wire.py)

    async def PrefillContext(self, request, context):
        return await self._prefill(request, context, request.request_id or uuid.uuid4().hex)

    async def PrefillContextStream(self, request_iterator, context):
        """Requests of one call, each run as by PrefillContext, answered in order; a failed
        request is answered in-band (``error``) and the stream goes on. Requests are read
        (and validated, queued) as they arrive, while earlier ones run. When the server
        starts draining, the stream ends with UNAVAILABLE as soon as every request read
        so far has its answer."""
        self._gate()
        pending: asyncio.Queue = asyncio.Queue()
        end = object()
        # at most queue_size requests of a stream read and not yet answered: a client that
        # sends without reading is held back by gRPC flow control, not by our memory
        room = asyncio.Semaphore(self.queue_size)

        async def read():
            try:
                while True:
                    await room.acquire()
                    msg = await anext(requests, None)
                    if msg is None:
                        break
                    request = inline_views.submessage(msg, "request")  # with its inline tensors' views
                    pending.put_nowait(asyncio.ensure_future(self._stream_one(request, context)))
            finally:
                pending.put_nowait(end)

        requests = request_iterator.__aiter__()
        reader = asyncio.ensure_future(read())
        drained = asyncio.ensure_future(self._draining.wait())
        get = None
        try:
            while True:
                if drained.done():
                    if pending.empty():
                        # every request read has its answer: end the stream now, not when the
                        # grace period runs out, so that the caller reconnects elsewhere at once
                        raise RpcStatusError(grpc.StatusCode.UNAVAILABLE,
                                             "the server is draining: this stream ends after answering every "
                                             "request it read; open a new one (to another instance)", "draining")
                    task = pending.get_nowait()
                else:
                    get = asyncio.ensure_future(pending.get())
                    await asyncio.wait((get, drained), return_when=asyncio.FIRST_COMPLETED)
                    if not get.done():
                        get.cancel()  # an item it was about to take stays in the queue
                        continue
                    task = get.result()
                if task is end:
                    break
                response = await task
                room.release()
                yield response
            await reader  # a message that did not parse ends the stream (INVALID_ARGUMENT)
        finally:
            drained.cancel()
            if get is not None:
                get.cancel()
            reader.cancel()
            while not pending.empty():
                task = pending.get_nowait()
                if task is not end:
                    task.cancel()

    async def _stream_one(self, request, context):
        request_id = request.request_id or uuid.uuid4().hex
        try:
            resp = await self._prefill(request, context, request_id)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - answered in-band, with the status a unary call would get
            return self._in_band_error(e, STREAM_METHOD, self.metrics.stream_requests, request_id)
        self.metrics.stream_requests.labels(grpc_code="OK").inc()
        return nest(pb.PrefillContextStreamResponse(request_id=request_id), "response", resp)

    async def _prefill(self, request, context, request_id: str):
        t0 = time.perf_counter_ns()
        request_id_var.set(validate.request_id_for_logs(request_id))
        engine, lease, args, t_valid = self._prefill_checked(request, t0, admit=True)
        try:
            done = await self._run(lambda: self._prefill_work(engine, lease, args, t0, t_valid), context)
        finally:
            if lease is not None:
                lease.abandon()
        return self._prefill_response(engine, done, request_id)

    def _prefill_checked(self, request, t0: int, admit: bool):
        """Gate, instance check, validation (and the lease on the shared-memory regions
        it names): ``(engine, lease, args, t_valid)``. On failure nothing is held."""
        engine = self._gate(admit=admit)
        validate.check_instance(request, engine.instance_id)
        lease = self._lease()
        try:
            args = validate.validate_prefill(request, engine.config, self.max_message_bytes, lease)
        except BaseException:
            if lease is not None:
                lease.abandon()
            raise
        return engine, lease, args, time.perf_counter_ns()

    def _prefill_work(self, engine: Engine, lease, args, t0: int, t_valid: int, defer: list | None = None):
        """On the engine thread: run the request and put its results in place.
        ``(out, lse, stats, total_ns, phases, slots written by cache_write)``; None when the
        handler gave up first.
        ``defer``: a list that takes the bookkeeping that may wait until the answer is out
        (metrics, releasing the regions; the device is synchronized already) — what a
        request ring does; otherwise it is done here."""
        finish = self._prefill_start(engine, lease, args, t0, t_valid, defer)
        return None if finish is None else finish()

    def _prefill_start(self, engine: Engine, lease, args, t0: int, t_valid: int, defer: list | None = None):
        """The first half of :meth:`_prefill_work`: queue the request's device work and the
        copies of its results into shared memory, and return a function that waits for
        them and returns what ``_prefill_work`` does (None when the handler gave up first).
        Between the two the engine thread can start the next request (request rings), so
        that the device is not idle while the host prepares it."""
        t_start = time.perf_counter_ns()
        if lease is not None and not lease.begin():
            return None  # the handler gave up on this request
        try:
            q = codec.from_shared(args.q, engine.device) if args.q_shared else args.q
            if args.q_shared and not args.q.is_cuda and engine.device.type == "cuda":
                torch.cuda.current_stream(engine.device).synchronize()  # input_nanos: the copy itself
            t_in = time.perf_counter_ns()
            pending = engine.prefill_context_start(q, args.sequences, workspace_tokens=args.workspace_tokens,
                                                   plan=args.plan, layer=args.layer)
            msgs, host = [], []
            for t, to in ((pending.out, args.output_to), (pending.lse, args.lse_to)):
                if to is None:  # inline: copied to pinned host memory, queued behind the request's work
                    msgs.append(None)
                    host.append(codec.to_host_queued(t))
                    continue
                nbytes = t.numel() * t.element_size()
                codec.write_shared(to.view, t)  # queued behind the request's work
                lease.count(to.kind, "out", nbytes)
                msgs.append(codec.encode_shared(t.dtype, t.shape, to.region, to.offset, nbytes))
                host.append(None)
            # the copies are queued before the next ring request's work (request rings start
            # it before this one is answered): waiting for them waits for this request only
            placed = None
            if engine.device.type == "cuda":
                placed = torch.cuda.Event()
                placed.record(torch.cuda.current_stream(engine.device))
            # the cache write is queued behind the attention that reads the cache (and behind
            # the results' copies, which do not wait for it)
            written = 0 if args.cache_write is None else self._write(engine, args.cache_write)
            cw_shared = args.cache_write is not None and bool(args.cache_write.shared)
        except BaseException:
            self._end_shared(lease, engine.device)
            raise

        def finish():
            done = False
            try:
                r = pending.result()
                t_done = time.perf_counter_ns()
                if placed is not None:
                    placed.synchronize()  # the results are in place (and ready to copy)
                out = msgs[0] if msgs[0] is not None else codec.encode_parts(host[0])
                lse = msgs[1] if msgs[1] is not None else codec.encode_parts(host[1])
                t_end = time.perf_counter_ns()
                # the five parts of total_nanos (Stats.validate_nanos ... output_nanos)
                phases = (t_valid - t0, t_start - t_valid, t_in - t_start, t_done - t_in, t_end - t_done)

                def account():
                    self.metrics.observe_prefill(r.stats, (t_end - t0) / 1e9)
                    if lease is not None:
                        self.metrics.observe_shared_memory(lease.transferred)

                if defer is None:
                    account()
                else:
                    defer.append(account)
                done = True
                return out, lse, r.stats, t_end - t0, phases, written
            finally:
                if done and defer is not None:
                    if lease is not None:
                        # the results' copies are waited for above; a cache_write reading its
                        # latents from CUDA regions may still run (queued after them): then the
                        # release waits for the device, as a failed request's does
                        defer.append(functools.partial(self._end_shared, lease, engine.device) if cw_shared
                                     else lease.finish)
                else:
                    self._end_shared(lease, engine.device)

        return finish

    def _prefill_response(self, engine: Engine, done, request_id: str):
        out, lse, st, total_ns, phases, written = done
        stats = pb.Stats(
            num_chunks=len(st.chunks),
            chunks=[pb.ContextChunk(first_sequence=c.first_sequence, num_sequences=c.num_sequences,
                                    context_start=list(c.context_starts), context_len=list(c.context_lens))
                    for c in st.chunks],
            kernel_launches={k: int(v) for k, v in st.launches.items()},
            path=st.path,
            fp8_path=pb.Fp8Path(**st.fp8_path),
            stage_nanos={k: int(v) for k, v in st.stage_ns.items()},
            total_nanos=total_ns,
            context_tokens=st.context_tokens,
            query_tokens=st.query_tokens,
            validate_nanos=phases[0], queue_nanos=phases[1], input_nanos=phases[2], compute_nanos=phases[3],
            output_nanos=phases[4], unpacked_keys=st.unpacked_keys,
        )
        log.info("prefill done", extra={"chunks": len(st.chunks), "context_tokens": st.context_tokens,
                                        "query_tokens": st.query_tokens, "total_ms": round(total_ns / 1e6, 3)})
        resp = pb.PrefillContextResponse(stats=stats, instance_id=engine.instance_id, request_id=request_id,
                                         slots_written=written)
        payloads: list = []
        place_tensor(resp, "output", out, payloads)  # shared-memory references, or bytes sent at serialization
        place_tensor(resp, "lse", lse, payloads)
        return finish(resp, payloads)

    # -- request rings (--request-ring; request_ring.py) ----------------------------------
    async def AttachRequestRing(self, request, context):
        """Attach, answer once, then hold the call open until the caller ends it, the
        ring stops (region unregistered or shrunk) or the server drains."""
        engine = self._gate()
        if self.rings is None:
            raise self._refuse(grpc.StatusCode.UNIMPLEMENTED,
                               "request rings are off: start the server with --request-ring (and --shared-memory "
                               "system or all)", "request_ring_off")
        validate.check_instance(request, engine.instance_id)
        ring = self.rings.attach(request.region, int(request.offset), int(request.num_slots),
                                 int(request.slot_bytes))
        self.worker.add_ring(ring)
        self.metrics.request_rings.set(len(self.rings.rings))
        log.info("request ring attached", extra={"ring": ring.ring_id, "region": request.region,
                                                 "num_slots": ring.num_slots, "slot_bytes": ring.slot_bytes})
        stopped = asyncio.wrap_future(ring.stopped)
        drained = asyncio.ensure_future(self._draining.wait())
        try:
            yield pb.AttachRequestRingResponse(instance_id=engine.instance_id, ring_id=ring.ring_id)
            await asyncio.wait((stopped, drained), return_when=asyncio.FIRST_COMPLETED)
            if not stopped.done():
                raise RpcStatusError(grpc.StatusCode.UNAVAILABLE,
                                     "the server is draining: the request ring is detached; attach one to another "
                                     "instance", "draining")
            stopped.result()  # the reason it stopped (region unregistered or shrunk) ends the call
        finally:
            # ours to end when the caller went (cancelled) or the server drains: the engine
            # thread lets go at its next poll, and the memory outlives it either way
            ring.detach()
            drained.cancel()
            self.rings.forget(ring)
            self.metrics.request_rings.set(len(self.rings.rings))
            log.info("request ring detached", extra={"ring": ring.ring_id, "served": ring.served})

    def _ring_start(self, ring, payload: bytes | None, defer: list):
        """On the engine thread: one ring request, run as PrefillContext — parsed,
        validated and its device work queued; returns a function that waits for it and
        returns the answer's bytes (a PrefillContextStreamResponse: the response, or the
        error in-band; at once for a request refused before it reached the device).
        ``defer`` takes what may run once the answer is written (the worker runs it)."""
        t0 = time.perf_counter_ns()
        request_id = ""
        try:
            if payload is None:
                raise RpcStatusError(grpc.StatusCode.INVALID_ARGUMENT,
                                     f"length: the request's length is more than a slot's {ring.payload_bytes} "
                                     f"payload bytes", "invalid")
            try:
                # the payload is this thread's own copy of the slot: q may stay a view of it
                request = inline_views.parse(pb.PrefillContextRequest, payload)
            except Exception:  # noqa: BLE001 - protobuf's DecodeError
                raise RpcStatusError(grpc.StatusCode.INVALID_ARGUMENT,
                                     "the slot does not hold a serialized PrefillContextRequest", "invalid") from None
            request_id = request.request_id or uuid.uuid4().hex
            request_id_var.set(validate.request_id_for_logs(request_id))
            engine, lease, args, t_valid = self._prefill_checked(request, t0, admit=False)
            try:
                finish = oom_guarded(lambda: self._prefill_start(engine, lease, args, t0, t_valid, defer), self.metrics)
            finally:
                if lease is not None:
                    lease.abandon()  # releases only if the work never started
        except Exception as e:  # noqa: BLE001 - answered in-band, with the status a unary call would get
            data = self._in_band_error(e, RING_METHOD, self.metrics.ring_requests, request_id).SerializeToString()
            return lambda: data

        def answer() -> bytes:
            request_id_var.set(validate.request_id_for_logs(request_id))  # the next request may have set it
            try:
                done = None if finish is None else oom_guarded(finish, self.metrics)
                answer = nest(pb.PrefillContextStreamResponse(request_id=request_id), "response",
                              self._prefill_response(engine, done, request_id))
                data = answer.SerializeToString()
                if len(data) > ring.payload_bytes:
                    raise RpcStatusError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                         f"the answer takes {len(data)} bytes, a slot holds {ring.payload_bytes}: ask "
                                         f"for output_region and lse_region, or attach a ring with larger slots",
                                         "answer_too_large")
                defer.append(lambda: self.metrics.ring_requests.labels(grpc_code="OK").inc())
                return data
            except Exception as e:  # noqa: BLE001 - answered in-band
                return self._in_band_error(e, RING_METHOD, self.metrics.ring_requests,
                                           request_id).SerializeToString()

        return answer

    @staticmethod
    def _in_band_error(e: Exception, where: str, counter, request_id: str) -> pb.PrefillContextStreamResponse:
        """The answer to a stream's or a ring's failed request: the status a unary call would
        end with (logged), counted by code; the request id as sent (cut to what validation
        allows: it may be why the request failed)."""
        code, message = status_for(e, where)
        counter.labels(grpc_code=code.name).inc()
        return pb.PrefillContextStreamResponse(error=pb.RequestError(code=code.value[0], message=message),
                                               request_id=request_id[:validate.MAX_REQUEST_ID])

    # -- shared memory -------------------------------------------------------------------
    async def RegisterSystemSharedMemory(self, request, context):
        self._gate()
        self.shm.require(SYSTEM)  # refuse cheaply on the event loop; page-locking the mapping takes a while
        r = await asyncio.to_thread(self.shm.register_system, request.name, request.key, request.offset,
                                    request.byte_size)
        return pb.RegisterSystemSharedMemoryResponse(region=_region_pb(r.status()))

    async def RegisterCudaSharedMemory(self, request, context):
        self._gate()
        self.shm.require(CUDA)  # refuse cheaply on the event loop; opening the handle is a driver call
        r = await asyncio.to_thread(self.shm.register_cuda, request.name, request.raw_handle, request.device_id,
                                    request.offset, request.byte_size)
        return pb.RegisterCudaSharedMemoryResponse(region=_region_pb(r.status()))

    async def UnregisterSharedMemory(self, request, context):
        self._gate()
        return pb.UnregisterSharedMemoryResponse(names=self.shm.unregister(request.name))

    async def GetSharedMemoryStatus(self, request, context):
        self._gate()
        return pb.GetSharedMemoryStatusResponse(regions=[_region_pb(d) for d in self.shm.status(request.name)])


_KIND_PB = {SYSTEM: pb.SHARED_MEMORY_KIND_SYSTEM, CUDA: pb.SHARED_MEMORY_KIND_CUDA}


def _region_pb(d: dict) -> pb.SharedMemoryRegion:
    return pb.SharedMemoryRegion(name=d["name"], kind=_KIND_PB[d["kind"]], key=d["key"], offset=d["offset"],
                                 byte_size=d["byte_size"], device=d["device"],
                                 requests_in_flight=d["requests_in_flight"], pinned=d["pinned"])
