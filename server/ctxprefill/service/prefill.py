"""One PrefillContext request through the service — a unary call, a stream's request or a
request ring's — as a :class:`PrefillCall`:

1. :meth:`PrefillCall.open` (event loop; the engine thread for a ring request): decode
   the message into the engine's ``PrefillRequest`` (``codec``), check what the
   transport adds (``transport``: the answer fits a message, the output placements),
   and hold the shared-memory regions it names (a ``Lease``) until its work is done;
2. :meth:`PrefillCall.start` (engine thread): bring q from shared memory, one engine
   call (``Engine.start_prefill``: the request's checks, its device work queued),
   queue the results' copies (into their regions, or to pinned host memory), then the
   ``cache_write``; it returns the function that finishes the request:
3. finish (engine thread): wait for the request and its results' copies, account the
   metrics and release the regions (or hand both to ``defer``: a ring answers first);
   a request whose ``stop`` signal fires (deadline, caller gone) ends between two chunks
   with ``errors.Stopped``, counted, its cache_write not written;
4. :meth:`PrefillCall.response`: the response message (``codec``).

A stream-ordered ring's request (``stream_order.py``) waits for the caller's event on the
device before step 2's work, and its finish does not wait: it records the slot's done
event and answers with the stats known at queueing; the metrics and the regions' release
follow once its work has run.

``Stats.validate_nanos`` ... ``output_nanos`` are the spans between those steps.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from ..engine.engine import Engine, PendingPrefill, PrefillStats
from ..engine.request import PrefillRequest, StopSignal
from ..errors import InvalidArgument, Stopped
from . import codec, tracing, transport
from .metrics import Metrics, path_label
from .shared_memory import CUDA, Lease, SharedMemoryRegistry
from .stream_order import SlotOrder

log = logging.getLogger("ctxprefill.service")

#: validate, queue, input, compute, output: the five parts of Stats.total_nanos
Phases = tuple[int, int, int, int, int]


@dataclasses.dataclass(frozen=True)
class PrefillDone:
    out: codec.Result
    lse: codec.Result
    stats: PrefillStats
    total_ns: int
    phases: Phases
    slots_written: int  # by the request's cache_write


@dataclasses.dataclass(frozen=True)
class _Started:
    """A request whose device work, results' copies and cache_write are queued."""

    pending: PendingPrefill
    results: codec.PlacedResults
    placed: torch.cuda.Event | None  # recorded after the results' copies (CUDA)
    slots_written: int
    t_start: int  # the engine thread took it
    t_in: int  # q is on the device
    defer: list[Callable[[], None]] | None
    cache_write_shared: bool  # its cache_write reads shared memory


@dataclasses.dataclass(frozen=True)
class _Finish:
    """What finishes a started request (:meth:`PrefillCall.start`), and whether the work it
    waits for is done."""

    call: PrefillCall
    started: _Started

    def __call__(self) -> PrefillDone:
        return self.call._finish(self.started)

    def ready(self) -> bool:
        placed = self.started.placed  # recorded after the request's work and its results' copies
        return placed is None or placed.query()


@dataclasses.dataclass(eq=False)
class PrefillCall:
    """One request from its decoding to its response (the module's steps)."""

    engine: Engine
    metrics: Metrics
    decoded: codec.Decoded[PrefillRequest]
    request_id: str
    lease: Lease | None  # the shared-memory regions it uses (None: shared memory off)
    output_to: transport.Placement | None  # output_region, when set
    lse_to: transport.Placement | None  # lse_region, when set
    t0: int  # perf_counter_ns at the handler's start
    t_valid: int  # ... once decoded and checked
    stop: StopSignal = dataclasses.field(default_factory=StopSignal)  # asked between chunks
    trace: tracing.RpcTrace | None = None  # the sampled RPC span its stage spans go under (tracing on)

    @classmethod
    def open(cls, engine: Engine, metrics: Metrics, msg: Any, request_id: str, shm: SharedMemoryRegistry,
             max_message_bytes: int, t0: int) -> PrefillCall:
        """Decode and check ``msg`` (a PrefillContextRequest or its ``InlineRequest``); on
        failure nothing is held."""
        lease = shm.lease() if shm.enabled else None
        try:
            decoded = codec.decode_prefill(msg, lease)
            out_to, lse_to = transport.prefill_placements(msg, decoded.request, engine.config, lease,
                                                          max_message_bytes)
        except BaseException:
            if lease is not None:
                lease.abandon()
            raise
        return cls(engine, metrics, decoded, request_id, lease, out_to, lse_to, t0, time.perf_counter_ns(),
                   trace=tracing.current())

    def abandon(self) -> None:
        """The handler is done with the request: its regions are released here if its work
        never started (else by the work)."""
        if self.lease is not None:
            self.lease.abandon()

    def _release(self) -> None:
        if self.lease is not None:
            self.lease.end(self.engine.device)

    def start(self, defer: list[Callable[[], None]] | None = None,
              order: SlotOrder | None = None) -> Callable[[], PrefillDone] | None:
        """On the engine thread: queue the request's device work, its results' copies and
        its cache_write, and return the function that waits for them (None when the
        handler gave up first). Between the two the engine thread can start the next
        request (request rings, and calls queued behind it: engine_worker), so that the
        device is not idle while the host prepares it. ``defer`` takes what may wait until
        the answer is out (metrics, releasing the regions, once the device is
        synchronized) — what a request ring does; without it that is done by the finish.
        ``order`` (a stream-ordered ring's slot): the work waits for the caller's ready
        event on the device, the slot's done event follows it, and the returned function
        does not wait (see :meth:`_queued`)."""
        engine, lease, shared = self.engine, self.lease, self.decoded.shared
        t_start = time.perf_counter_ns()
        if order is not None:
            self._require_device_resident()
        if lease is not None and not lease.begin():
            return None  # the handler gave up on this request
        fired = None
        try:
            if order is not None:
                order.wait_ready(engine.device)  # before anything reads the caller's regions
            request = codec.with_inputs(self.decoded.request, shared & {"q"}, engine.device)
            if "q" in shared and not self.decoded.request.q.is_cuda and engine.device.type == "cuda":
                torch.cuda.current_stream(engine.device).synchronize()  # input_nanos: the copy itself
            t_in = time.perf_counter_ns()
            request = codec.with_inputs(request, shared - {"q"}, engine.device)
            pending = engine.start_prefill(dataclasses.replace(request, stop=self.stop),
                                           timeline=self.trace is not None)
            results = codec.place_results(pending.out, pending.lse, self.output_to, self.lse_to, lease)
            # the copies are queued before the next ring request's work (request rings start
            # it before this one is answered): waiting for them waits for this request only
            placed = None  # a stream-ordered request's finish waits for nothing
            if engine.device.type == "cuda" and order is None:
                placed = torch.cuda.Event()
                placed.record(torch.cuda.current_stream(engine.device))
            # the cache write is queued behind the attention that reads the cache (and behind
            # the results' copies, which do not wait for it)
            written = pending.write_cache()
            if request.cache_write is not None:
                self.metrics.observe_insert(written.launches, path_label(engine.config.fused),
                                            engine.cache_slots_used)
        except BaseException as e:
            self._release()
            if isinstance(e, Stopped):
                self.metrics.observe_stopped(e.reason, e.chunks_done, path_label(engine.config.fused))
            raise
        finally:
            if order is not None:  # after whatever was queued, failed or not: the caller's stream waits for it
                fired = order.record_done(engine.device)
        started = _Started(pending, results, placed, written.slots_written, t_start, t_in, defer,
                           any(name.startswith("cache_write.") for name in shared))
        if order is not None:
            assert fired is not None
            return functools.partial(self._queued, started, order, fired)
        return _Finish(self, started)

    def quick_start(self) -> bool:
        """Whether :meth:`start` queues the request's work without waiting for the device
        (``Engine.starts_without_waiting``; q from a CUDA region), so that the engine thread
        may start it while the request before it runs (engine_worker's ``request_overlap``)."""
        return self.engine.starts_without_waiting(self.decoded.request)

    def _require_device_resident(self) -> None:
        """A stream-ordered request reads and writes device memory only: host memory would
        make the server's host wait for the caller's stream (INVALID_ARGUMENT naming the field)."""
        r = self.decoded.request
        tensors = [("q", r.q)]
        if r.cache_write is not None:
            tensors += [("cache_write.kv_c", r.cache_write.kv_c), ("cache_write.k_pe", r.cache_write.k_pe)]
        for name, t in tensors:
            if not t.is_cuda:
                raise InvalidArgument(name, f"a stream-ordered ring's request takes {name} from a CUDA region "
                                            f"(host memory would make the server wait for the caller's stream)")
        for name, to in (("output_region", self.output_to), ("lse_region", self.lse_to)):
            if to is None or to.kind != CUDA:
                raise InvalidArgument(name, f"a stream-ordered ring's request writes its results into CUDA regions: "
                                            f"set {name} to one")

    def _queued(self, s: _Started, order: SlotOrder, fired: torch.cuda.Event) -> PrefillDone:
        """A stream-ordered request's answer, without waiting for the device; metrics and the
        regions' release wait for ``fired``, recorded after its work (``order.after``)."""
        t_end = time.perf_counter_ns()
        out, lse = s.results.wire()  # region references: the data stays on the device
        phases = (self.t_valid - self.t0, s.t_start - self.t_valid, s.t_in - s.t_start, t_end - s.t_in, 0)
        order.after(fired, functools.partial(self._settle, s))
        return PrefillDone(out, lse, s.pending.queued_stats(t_end - self.t0), t_end - self.t0, phases,
                           s.slots_written)

    def _settle(self, s: _Started) -> None:
        """A stream-ordered request's work has finished: its device times into the metrics,
        its regions released."""
        try:
            r = s.pending.result()
            self._account(r.stats, (time.perf_counter_ns() - self.t0) / 1e9)
        except Exception:  # noqa: BLE001 - its answer is out; the regions go either way
            log.exception("a stream-ordered request's device work failed after its answer")
        finally:
            if self.lease is not None:
                self.lease.finish()

    def _finish(self, s: _Started) -> PrefillDone:
        done = False
        try:
            r = s.pending.result()
            t_done = time.perf_counter_ns()
            if s.placed is not None:
                s.placed.synchronize()  # the results are in place (and ready to copy)
            out, lse = s.results.wire()
            t_end = time.perf_counter_ns()
            phases = (self.t_valid - self.t0, s.t_start - self.t_valid, s.t_in - s.t_start, t_done - s.t_in,
                      t_end - t_done)
            account = functools.partial(self._account, r.stats, (t_end - self.t0) / 1e9)
            if s.defer is None:
                account()
            else:
                s.defer.append(account)
            done = True
            return PrefillDone(out, lse, r.stats, t_end - self.t0, phases, s.slots_written)
        finally:
            if done and s.defer is not None:
                if self.lease is not None:
                    # the results' copies are waited for above; a cache_write reading its
                    # latents from CUDA regions may still run (queued after them): then the
                    # release waits for the device, as a failed request's does
                    s.defer.append(functools.partial(self.lease.end, self.engine.device) if s.cache_write_shared
                                   else self.lease.finish)
            else:
                self._release()

    def _account(self, stats: PrefillStats, seconds: float) -> None:
        self.metrics.observe_prefill(stats, seconds)
        if self.lease is not None:
            self.metrics.observe_shared_memory(self.lease.transferred)

    def response(self, done: PrefillDone | None) -> Any:
        """The PrefillContextResponse of a finished request."""
        assert done is not None, "the request was given up before it ran"
        st = done.stats
        log.info("prefill done", extra={"chunks": len(st.chunks), "context_tokens": st.context_tokens,
                                        "query_tokens": st.query_tokens, "total_ms": round(done.total_ns / 1e6, 3)})
        if self.trace is not None:
            tracing.record_prefill(self.trace, request_id=self.request_id, t0=self.t0, phases=done.phases, stats=st,
                                   device_clock=self.engine.device.type == "cuda")
        return codec.prefill_response(out=done.out, lse=done.lse, stats=st, total_ns=done.total_ns,
                                      phases=done.phases, slots_written=done.slots_written,
                                      instance_id=self.engine.instance_id, request_id=self.request_id)
