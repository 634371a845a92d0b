"""OpenTelemetry traces of the RPCs, off by default (docs/DEPLOY.md "Tracing").

On with ``--otlp-endpoint URL`` (``CTXPREFILL_OTLP_ENDPOINT``), or the standard
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_ENDPOINT`` or
``OTEL_TRACES_EXPORTER=otlp``; ``OTEL_SDK_DISABLED=true`` or ``OTEL_TRACES_EXPORTER=none``
keep it off. Spans go in batches to an OTLP/gRPC collector; the SDK reads the other
``OTEL_*`` variables itself (``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``,
``OTEL_TRACES_SAMPLER`` / ``_ARG``, ``OTEL_EXPORTER_OTLP_HEADERS``, ``_CERTIFICATE``,
``_INSECURE``, ``OTEL_BSP_*``). The packages are the ``tracing`` extra
(``pip install 'ctxprefill[tracing]'``): imported only when tracing is on.

What is recorded: a span per RPC (``interceptors/tracing.py``), its parent the caller's
(W3C ``traceparent`` metadata). A PrefillContext request adds, once it is done, from the
timings it took anyway (no extra device sync; :func:`record_prefill`):
``validate`` (decoding and the transport's checks), ``queue`` (waiting for the engine
thread), ``input`` (q from shared memory), ``plan`` (the engine's checks and chunk plan),
one ``chunk`` span per chunk with an event per stage (gather, cast, kv_b_proj, pack,
attention, merge: its start and ``ctxprefill.stage.duration_ns``; on a GPU the device's
times from the CUDA events, placed from the host time the first stage was issued), and
``output`` (the results' copies). On a PrefillContextStream call each request gets a
``request`` span under the call's, with those under it.

Off, nothing of this runs: no interceptor, no span, the engine keeps no stage places
(``current()`` is None and ``PrefillCall`` asks for no timeline). A sampled-out call
records nothing either.
"""

from __future__ import annotations

import contextvars
import dataclasses
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import ConfigError

#: the resource's service.name unless OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES name one
SERVICE_NAME = "ctxprefill"


class Tracing:
    """The server's tracer provider and tracer, with the OpenTelemetry API pieces the
    interceptor uses (imported here: only a server with tracing on imports them)."""

    def __init__(self, provider: Any, version: str = ""):
        from opentelemetry import context, propagate, trace
        from opentelemetry.trace import SpanKind, Status, StatusCode

        self.provider = provider
        self.tracer = provider.get_tracer("ctxprefill", version)
        self.context, self.propagate, self.trace = context, propagate, trace
        self.SpanKind, self.Status, self.StatusCode = SpanKind, Status, StatusCode

    def shutdown(self) -> None:
        """Export what is batched and stop."""
        self.provider.shutdown()


@dataclasses.dataclass(frozen=True, slots=True)
class RpcTrace:
    """The sampled span of the RPC being handled."""

    tracing: Tracing
    span: Any  # opentelemetry.trace.Span
    streaming: bool  # a call of many requests (PrefillContextStream): each gets a span of its own


#: the RPC being handled, while its span records (set by the tracing interceptor)
rpc_var: contextvars.ContextVar[RpcTrace | None] = contextvars.ContextVar("ctxprefill_rpc_trace", default=None)


def current() -> RpcTrace | None:
    """The sampled RPC span being handled; None when tracing is off or the call is not sampled."""
    return rpc_var.get()


def current_ids() -> tuple[str, str] | None:
    """(trace id, span id) in hex of the RPC being handled, for the log lines."""
    rpc = rpc_var.get()
    if rpc is None:
        return None
    ctx = rpc.span.get_span_context()
    return format(ctx.trace_id, "032x"), format(ctx.span_id, "016x")


def otlp_endpoint(flag: str | None, env: Mapping[str, str] = os.environ) -> str | None:
    """Where spans go, or None: tracing off (the module's rules). ``""``: the exporter's
    own choice (its OTEL_* variables, else http://localhost:4317)."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    if flag:
        return flag
    exporter = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter == "none":
        return None
    if env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or exporter == "otlp":
        return ""
    return None


def make_tracing(span_processor: Any, version: str = "") -> Tracing:
    """A tracer provider (the SDK: sampler from OTEL_TRACES_SAMPLER, resource from the
    OTEL_* variables) whose spans go to ``span_processor``."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider

    resource = Resource.create({"service.version": version})
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": SERVICE_NAME}))
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(span_processor)
    return Tracing(provider, version)


def from_settings(flag: str | None, version: str = "") -> Tracing | None:
    """The server's tracing (spans batched to the OTLP/gRPC endpoint), or None when it is
    off. ConfigError naming the flag when the packages are missing."""
    endpoint = otlp_endpoint(flag)
    if endpoint is None:
        return None
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as e:
        raise ConfigError(f"--otlp-endpoint (or OTEL_EXPORTER_OTLP_*): tracing needs the OpenTelemetry packages "
                          f"(pip install 'ctxprefill[tracing]'): {e}") from None
    return make_tracing(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint or None)), version)


def record_prefill(rpc: RpcTrace, *, request_id: str, t0: int, phases: Sequence[int], stats: Any,
                   device_clock: bool) -> None:
    """A finished PrefillContext request's spans under ``rpc`` (the module's list), from
    ``t0`` (perf_counter_ns at the handler's start), its ``phases`` (validate, queue,
    input, compute, output nanoseconds) and its engine ``stats`` (``PrefillStats`` of a
    ``start_prefill(timeline=True)``)."""
    t = rpc.tracing
    trace, tracer = t.trace, t.tracer
    wall = time.time_ns() - time.perf_counter_ns()  # perf_counter_ns -> ns since the epoch
    t_valid = t0 + phases[0]
    t_start = t_valid + phases[1]
    t_in = t_start + phases[2]
    t_done = t_in + phases[3]
    t_end = t_done + phases[4]
    attributes = {"ctxprefill.request_id": request_id, "ctxprefill.chunks": len(stats.chunks),
                  "ctxprefill.context_tokens": stats.context_tokens, "ctxprefill.query_tokens": stats.query_tokens,
                  "ctxprefill.path": stats.path, "ctxprefill.stage_clock": "cuda_events" if device_clock else "host"}
    if rpc.streaming:
        parent = tracer.start_span("request", context=trace.set_span_in_context(rpc.span), start_time=t0 + wall,
                                   attributes=attributes)
    else:
        parent = rpc.span
        parent.set_attributes(attributes)
    ctx = trace.set_span_in_context(parent)

    def span(name: str, a: int, b: int, attrs: dict[str, Any] | None = None) -> Any:
        s = tracer.start_span(name, context=ctx, start_time=a + wall, attributes=attrs)
        s.end(end_time=b + wall)
        return s

    span("validate", t0, t_valid)
    span("queue", t_valid, t_start)
    span("input", t_start, t_in)
    if stats.checked_ns is not None:
        span("plan", *stats.checked_ns, {"ctxprefill.chunks": len(stats.chunks)})
    by_chunk: dict[int, list[Any]] = {}
    for st in stats.stages or ():
        by_chunk.setdefault(st.chunk, []).append(st)
    for st in by_chunk.pop(-1, ()):  # before the first chunk: the output's initialisation
        parent.add_event(st.stage, {"ctxprefill.stage.duration_ns": st.duration_ns}, timestamp=st.start_ns + wall)
    for i, stages in sorted(by_chunk.items()):
        c = stats.chunks[i]
        s = tracer.start_span("chunk", context=ctx, start_time=stages[0].start_ns + wall, attributes={
            "ctxprefill.chunk.index": i, "ctxprefill.chunk.sequences": c.num_sequences,
            "ctxprefill.chunk.context_tokens": c.rows, "ctxprefill.chunk.continuation": c.is_continuation})
        for st in stages:
            s.add_event(st.stage, {"ctxprefill.stage.duration_ns": st.duration_ns}, timestamp=st.start_ns + wall)
        s.end(end_time=max(st.start_ns + st.duration_ns for st in stages) + wall)
    span("output", t_done, t_end)
    if rpc.streaming:
        parent.end(end_time=t_end + wall)
