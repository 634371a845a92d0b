"""A span per RPC (OpenTelemetry, ``--otlp-endpoint``; ``..tracing``): the outermost
interceptor when tracing is on, absent when it is off.

The span's parent is the caller's, from the call's W3C ``traceparent`` (and
``tracestate``, baggage) metadata; it is named ``<service>/<method>`` (SERVER kind) with
the ``rpc.*`` attributes and ``rpc.grpc.status_code``, an error status for the codes that
mean the server failed. While the handler runs it is the current span and, when it is
sampled, ``tracing.current()`` hands it to what the handler does (PrefillContext's
stage spans: ``tracing.record_prefill``).
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator
from typing import Any

import grpc

from .. import tracing
from .handlers import Behavior, HandlerInterceptor, behavior_of, rebuild, split_method
from .status import code_after, code_of

#: codes that mark a server span as failed (OpenTelemetry's gRPC semantic conventions)
SERVER_ERRORS = frozenset({"UNKNOWN", "DEADLINE_EXCEEDED", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS"})


def _carrier(context: grpc.aio.ServicerContext[Any, Any]) -> dict[str, str]:
    """The call's text metadata (what the propagators read)."""
    return {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}


class _Call:
    """One RPC's span, current while its handler runs."""

    __slots__ = ("span", "token", "otel_token")

    def __init__(self, t: tracing.Tracing, name: str, attributes: dict[str, Any],
                 context: grpc.aio.ServicerContext[Any, Any], streaming: bool):
        parent = t.propagate.extract(_carrier(context))
        self.span = t.tracer.start_span(name, context=parent, kind=t.SpanKind.SERVER, attributes=attributes)
        self.otel_token = t.context.attach(t.trace.set_span_in_context(self.span, parent))
        rpc = tracing.RpcTrace(t, self.span, streaming) if self.span.is_recording() else None
        self.token = tracing.rpc_var.set(rpc)

    def end(self, code: str, t: tracing.Tracing) -> None:
        span = self.span
        span.set_attribute("rpc.grpc.status_code", grpc.StatusCode[code].value[0])
        if code in SERVER_ERRORS:
            span.set_status(t.Status(t.StatusCode.ERROR, code))
        try:
            tracing.rpc_var.reset(self.token)
        except ValueError:  # a stream closed from another context (its task gone): nothing to restore there
            pass
        else:
            t.context.detach(self.otel_token)
        span.end()


def _traced(behavior: Behavior, t: tracing.Tracing, name: str, attributes: dict[str, Any],
            streaming: bool) -> Behavior:
    if inspect.isasyncgenfunction(behavior):
        async def stream(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
            call = _Call(t, name, attributes, context, streaming)
            code = "OK"
            try:
                async for response in behavior(request, context):
                    yield response
                code = code_after(context)
            except BaseException as e:
                code = code_of(e, context)
                raise
            finally:
                call.end(code, t)

        return stream

    async def unary(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        call = _Call(t, name, attributes, context, streaming)
        code = "OK"
        try:
            response = behavior(request, context)
            if inspect.isawaitable(response):
                response = await response
            code = code_after(context)
            return response
        except BaseException as e:
            code = code_of(e, context)
            raise
        finally:
            call.end(code, t)

    return unary


class TracingInterceptor(HandlerInterceptor):
    per_method = True

    def __init__(self, t: tracing.Tracing):
        super().__init__()
        self.tracing = t

    def wrap(self, handler: grpc.RpcMethodHandler[Any, Any], kind: str,
             details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler[Any, Any]:
        service, method = split_method(details.method)
        attributes = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": method}
        behavior = _traced(behavior_of(handler), self.tracing, f"{service}/{method}", attributes,
                           streaming=kind in ("client_stream", "bidi_stream"))
        return rebuild(handler, behavior=behavior)
