"""Prometheus metrics of the service (CONTRACT §9), in one dedicated registry.

Nothing here touches the global ``prometheus_client.REGISTRY``: a process may hold
several servers (tests do), each with its own :class:`Metrics`. Base units (seconds,
tokens), ``_total`` on counters, and no request id in any label.

Engine metrics are fed from ``PrefillStats`` after each request
(:meth:`Metrics.observe_prefill`) and from WriteCache (:meth:`Metrics.observe_insert`);
the gRPC metrics (go-grpc-prometheus names) are fed by the server interceptor.
"""

from __future__ import annotations

from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

# `_created` series only double the page; they are process-global in prometheus_client.
prometheus_client.disable_created_metrics()

STAGES = ("gather", "cast", "kv_b_proj", "pack", "attention", "merge", "insert")


def path_label(fused: bool) -> str:
    """The ``path`` label (pack path) of an engine on the fused or the generic path."""
    return "fused" if fused else "generic"


#: 100 µs … 30 s (stage times sit at the short end, whole requests at the long end)
DURATION_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)

#: the ``grpc_type`` label, indexed by client_streaming + 2 * server_streaming
GRPC_TYPES = ("unary", "client_stream", "server_stream", "bidi_stream")


def grpc_type(client_streaming: bool, server_streaming: bool) -> str:
    """The go-grpc-prometheus ``grpc_type`` of a method."""
    return GRPC_TYPES[int(client_streaming) + 2 * int(server_streaming)]


CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST


#: why a running PrefillContext stopped between chunks (ctxprefill_stopped_requests_total)
STOP_REASONS = ("deadline", "cancelled")
REJECT_REASONS = ("queue_full", "draining", "starting", "deadline", "cancelled", "out_of_memory",
                  "unauthenticated", "permission_denied", "inflight_bytes", "answer_bytes", "receive_timeout",
                  "send_timeout")


class Metrics:
    def __init__(self) -> None:
        self._children: dict = {}
        self._num_slots = 0  # the cache's slots, every layer's (init_engine)
        r = self.registry = CollectorRegistry(auto_describe=True)
        # process_cpu_seconds_total, process_resident_memory_bytes, process_open_fds, ... (Linux /proc)
        ProcessCollector(registry=r)
        # -- engine ---------------------------------------------------------------------
        self.kernel_launches = Counter(
            "ctxprefill_kernel_launches_total",
            "Device kernel launches, by chunk-loop stage and pack path (insert: WriteCache).",
            ["stage", "path"], registry=r,
        )
        self.fp8_path = Counter(
            "ctxprefill_fp8_path_total",
            "Context chunks computed, by cache dtype, kv_b_proj weight dtype and prefill dtype.",
            ["cache_dtype", "kv_b_proj_dtype", "prefill_dtype"], registry=r,
        )
        self.chunks = Counter("ctxprefill_chunks_total", "Context chunks computed, by pack path.", ["path"], registry=r)
        self.graph_replays = Counter(
            "ctxprefill_graph_replays_total",
            "PrefillContext requests whose chunk loop replayed as a CUDA graph (--cuda-graphs), by mode: in_place "
            "(q read and the output written where they are) or copying (through the graph's own buffers).",
            ["mode"], registry=r)
        for mode in ("in_place", "copying"):  # zero series from the start: rate() sees the first replay
            self.graph_replays.labels(mode)
        self.context_tokens = Counter(
            "ctxprefill_context_tokens_total", "Cached context tokens attended to (sum of context_len).", registry=r
        )
        self.query_tokens = Counter(
            "ctxprefill_query_tokens_total", "Query rows of PrefillContext requests (sum of query_len).", registry=r
        )
        self.request_duration = Histogram(
            "ctxprefill_request_duration_seconds",
            "Time of a PrefillContext request inside the server, queueing included, until its result is ready.",
            registry=r, buckets=DURATION_BUCKETS,
        )
        self.stage_duration = Histogram(
            "ctxprefill_stage_duration_seconds",
            "Time of one chunk-loop stage per PrefillContext request, summed over its chunks.",
            ["stage"], registry=r, buckets=DURATION_BUCKETS,
        )
        self.queue_depth = Gauge(
            "ctxprefill_queue_depth", "Requests admitted and waiting for the device (the running one excluded).",
            registry=r,
        )
        self.rejected = Counter(
            "ctxprefill_rejected_requests_total",
            "Requests refused without being run, by reason (queue_full, draining, starting, deadline, cancelled, "
            "out_of_memory, unauthenticated, permission_denied, inflight_bytes, answer_bytes, receive_timeout), "
            "and answers whose connection was closed at --send-timeout-s (send_timeout).",
            ["reason"], registry=r,
        )
        self.stopped = Counter(
            "ctxprefill_stopped_requests_total",
            "PrefillContext requests stopped between two chunks while they ran, by reason (deadline, cancelled); "
            "the chunks they computed count in ctxprefill_chunks_total.",
            ["reason"], registry=r,
        )
        self.cache_slots_used = Gauge(
            "ctxprefill_cache_slots_used", "Cache slots written at least once since the start.", registry=r
        )
        # A constant, but CONTRACT §9 names it `_total`, and `promtool check metrics` (which §9 also
        # requires to pass) refuses that suffix on anything but a counter ('non-counter metrics should not
        # have "_total" suffix'): so it is a counter, incremented once by the cache size when the cache
        # exists. ctxprefill_cache_capacity_slots is the same number as a gauge.
        self.cache_slots_total = Counter(
            "ctxprefill_cache_slots_total", "Cache slots (num_blocks * block_size), counted once when allocated.",
            registry=r,
        )
        self.cache_capacity = Gauge(
            "ctxprefill_cache_capacity_slots",
            "Cache slots (num_blocks * block_size, summed over layers) that ctxprefill_cache_slots_used fills; "
            "0 until the cache exists.", registry=r,
        )
        self.cache_usage = Gauge(
            "ctxprefill_cache_usage_ratio",
            "Fraction of the cache's slots written at least once since the start (ctxprefill_cache_slots_used / "
            "ctxprefill_cache_capacity_slots; 0 until the cache exists).", registry=r,
        )
        self.build_info = Gauge(
            "ctxprefill_build_info", "Constant 1, labelled with the server version, attention backend and device.",
            ["version", "backend", "device"], registry=r,
        )
        self.queue_capacity = Gauge(
            "ctxprefill_queue_capacity", "Requests that may be admitted at once (--queue-size: running + waiting).",
            registry=r,
        )
        self.fused_kernels_active = Gauge(
            "ctxprefill_fused_kernels_active",
            "1 when the fused path runs the compiled CUDA pack kernels, 0 otherwise (generic path, no GPU, or the "
            "extension failed to load).", registry=r,
        )
        self.ready = Gauge("ctxprefill_ready", "1 while the server is ready to serve (weights loaded, kernels warm).",
                           registry=r)
        # -- shared memory (--shared-memory; docs/TRANSPORT.md) -------------------------------
        self.shm_regions = Gauge(
            "ctxprefill_shared_memory_regions", "Shared-memory regions registered, by kind (system, cuda).",
            ["kind"], registry=r,
        )
        self.shm_region_bytes = Gauge(
            "ctxprefill_shared_memory_region_bytes", "Bytes in the registered shared-memory regions, by kind.",
            ["kind"], registry=r,
        )
        self.shm_pinned_bytes = Gauge(
            "ctxprefill_shared_memory_pinned_bytes",
            "Host memory page-locked (cudaHostRegister) for the registered system shared-memory regions.",
            registry=r,
        )
        self.shm_transfer = Counter(
            "ctxprefill_shared_memory_transfer_bytes_total",
            "Tensor bytes that requests read from (direction=in) or wrote to (direction=out) shared-memory regions "
            "instead of carrying them inline, by region kind.",
            ["kind", "direction"], registry=r,
        )
        # -- PrefillContextStream: each request's status travels in-band ------------------------
        self.stream_requests = Counter(
            "ctxprefill_stream_requests_total",
            "Requests answered on PrefillContextStream calls, by the status each got (a failed request does not "
            "end its stream; grpc_server_handled_total counts the streams).",
            ["grpc_code"], registry=r,
        )
        # -- --request-overlap: a request started while the one before it runs --------------
        self.overlapped_requests = Counter(
            "ctxprefill_overlapped_requests_total",
            "PrefillContext requests (calls' and streams') that the engine thread started while the request "
            "before them still ran on the device (--request-overlap).",
            registry=r,
        )
        # -- request rings (--request-ring): requests that never were gRPC calls --------------
        self.ring_requests = Counter(
            "ctxprefill_ring_requests_total",
            "Requests answered through request rings (AttachRequestRing), by the status each got.",
            ["grpc_code"], registry=r,
        )
        self.request_rings = Gauge("ctxprefill_request_rings", "Request rings attached.", registry=r)
        # -- gRPC (go-grpc-prometheus names) ---------------------------------------------
        labels = ["grpc_type", "grpc_service", "grpc_method"]
        self.grpc_started = Counter(
            "grpc_server_started_total", "Total number of RPCs started on the server.", labels, registry=r
        )
        self.grpc_handled = Counter(
            "grpc_server_handled_total",
            "Total number of RPCs completed on the server, regardless of success or failure.",
            labels + ["grpc_code"], registry=r,
        )
        self.grpc_msg_received = Counter(
            "grpc_server_msg_received_total", "Total number of RPC stream messages received on the server.",
            labels, registry=r,
        )
        self.grpc_msg_sent = Counter(
            "grpc_server_msg_sent_total", "Total number of gRPC stream messages sent by the server.", labels, registry=r
        )
        self.grpc_handling = Histogram(
            "grpc_server_handling_seconds",
            "Histogram of response latency (seconds) of gRPC that had been application-level handled by the server.",
            labels, registry=r, buckets=DURATION_BUCKETS,
        )

    # ---------------------------------------------------------------------------------
    def init_engine(self, *, version: str, backend: str, device: str, num_slots: int, path: str,
                    fp8_path: dict[str, str], queue_capacity: int = 0, fused_kernels_active: bool = False) -> None:
        """Constant facts of the engine, and zero series for the labels it will use."""
        self.build_info.labels(version=version, backend=backend, device=device).set(1)
        self.queue_capacity.set(queue_capacity)
        self.fused_kernels_active.set(1 if fused_kernels_active else 0)
        for reason in REJECT_REASONS:  # zero series, so that rate() and alerts see them from the start
            self.rejected.labels(reason=reason)
        for reason in STOP_REASONS:
            self.stopped.labels(reason=reason)
        self.cache_slots_total.inc(num_slots)
        self.cache_capacity.set(num_slots)
        self._num_slots = num_slots
        self.cache_usage.set(0)
        for stage in STAGES:
            self.kernel_launches.labels(stage=stage, path=path)
        self.chunks.labels(path=path)
        self.fp8_path.labels(**fp8_path)

    def init_shared_memory(self, kinds) -> None:
        """Zero series for the shared-memory kinds the server accepts."""
        for kind in kinds:
            self.shm_regions.labels(kind=kind).set(0)
            self.shm_region_bytes.labels(kind=kind).set(0)
            for direction in ("in", "out"):
                self.shm_transfer.labels(kind=kind, direction=direction)

    def set_shared_memory_regions(self, by_kind: dict) -> None:
        """``{kind: (regions, bytes, page-locked bytes)}`` after a region was registered or
        unregistered."""
        for kind, (n, nbytes, _) in by_kind.items():
            self.shm_regions.labels(kind=kind).set(n)
            self.shm_region_bytes.labels(kind=kind).set(nbytes)
        self.shm_pinned_bytes.set(sum(v[2] for v in by_kind.values()))

    def observe_shared_memory(self, transferred: dict) -> None:
        """``{(kind, direction): bytes}`` of one finished request."""
        for (kind, direction), n in transferred.items():
            if n:
                self.shm_transfer.labels(kind=kind, direction=direction).inc(n)

    def init_grpc_methods(self, service: Any) -> None:
        """Zero series for every method of ``service`` (a protobuf ``ServiceDescriptor``), each
        with its own ``grpc_type`` (as go-grpc-prometheus's InitializeMetrics)."""
        for m in service.methods:
            lab = {"grpc_type": grpc_type(m.client_streaming, m.server_streaming), "grpc_service": service.full_name,
                   "grpc_method": m.name}
            self.grpc_started.labels(**lab)
            self.grpc_handled.labels(**lab, grpc_code="OK")
            self.grpc_msg_received.labels(**lab)
            self.grpc_msg_sent.labels(**lab)

    def _child(self, metric, *labels):
        """``metric.labels(*labels)``, looked up once: ``labels()`` validates and locks on
        every call, a dozen times per request otherwise (the request's own host time)."""
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def observe_prefill(self, stats, total_seconds: float) -> None:
        """Account one finished PrefillContext request (an engine ``PrefillStats``)."""
        path = stats.path
        for stage, n in stats.launches.items():
            if n:
                self._child(self.kernel_launches, stage, path).inc(n)
        n_chunks = len(stats.chunks)
        if n_chunks:
            self._child(self.chunks, path).inc(n_chunks)
            fp = stats.fp8_path
            self._child(self.fp8_path, fp["cache_dtype"], fp["kv_b_proj_dtype"], fp["prefill_dtype"]).inc(n_chunks)
        if stats.replay:
            self._child(self.graph_replays, stats.replay).inc()
        self.context_tokens.inc(stats.context_tokens)
        self.query_tokens.inc(stats.query_tokens)
        for stage, ns in stats.stage_ns.items():
            self._child(self.stage_duration, stage).observe(ns / 1e9)
        self.request_duration.observe(total_seconds)

    def observe_stopped(self, reason: str, chunks_done: int, path: str) -> None:
        """A PrefillContext request stopped after ``chunks_done`` chunks (``errors.Stopped``)."""
        self._child(self.stopped, reason).inc()
        if chunks_done:
            self._child(self.chunks, path).inc(chunks_done)

    def observe_insert(self, launches: int, path: str, slots_used: int) -> None:
        if launches:
            self._child(self.kernel_launches, "insert", path).inc(launches)
        self.cache_slots_used.set(slots_used)
        if self._num_slots:
            self.cache_usage.set(slots_used / self._num_slots)

    def render(self) -> bytes:
        """The page served at /metrics (Prometheus text format 0.0.4)."""
        return prometheus_client.generate_latest(self.registry)
