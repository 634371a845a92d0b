"""The one server interceptor: exceptions -> status codes, and the gRPC metrics.

Handlers raise; this is the only place that turns an exception into a status:

| exception                                  | status                                   |
|--------------------------------------------|------------------------------------------|
| ``errors.InvalidArgument``                 | INVALID_ARGUMENT, ``"<field>: <message>"`` |
| ``errors.OutOfRange``                      | OUT_OF_RANGE                             |
| ``errors.FailedPrecondition``              | FAILED_PRECONDITION                      |
| :class:`RpcStatusError` (service states)   | its code (RESOURCE_EXHAUSTED, UNAVAILABLE, DEADLINE_EXCEEDED, ...) |
| ``context.abort(...)`` inside a handler    | as given (e.g. the health service's NOT_FOUND) |
| anything else                              | INTERNAL, generic message; traceback logged |

It also records, for every RPC of every service on the server (health and reflection
included), the go-grpc-prometheus metrics: ``grpc_server_started_total``,
``grpc_server_handled_total{grpc_code}``, ``grpc_server_msg_received_total``,
``grpc_server_msg_sent_total`` and ``grpc_server_handling_seconds``. (Messages a
streaming handler sends with ``context.write`` instead of ``yield`` are not counted.)
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import logging
import time

import grpc

from ..errors import FailedPrecondition, InvalidArgument, OutOfRange
from .metrics import Metrics

log = logging.getLogger("ctxprefill.service")

#: the request id of the RPC being handled (set by the servicer; read by the log filter)
request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("ctxprefill_request_id", default="")

INTERNAL_MESSAGE = "internal error; the server logged the details"


class RpcStatusError(Exception):
    """A request refused by the state of the service: queue full, draining, deadline, OOM."""

    def __init__(self, code: grpc.StatusCode, message: str, reason: str = ""):
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason


_CODES = (
    (InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (OutOfRange, grpc.StatusCode.OUT_OF_RANGE),
    (FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
)


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str] | None:
    """(code, details) for an exception we map on purpose; None for an unexpected one."""
    for cls, code in _CODES:
        if isinstance(exc, cls):
            return code, str(exc)
    if isinstance(exc, RpcStatusError):
        return exc.code, exc.message
    return None


def _split(full_method: str) -> tuple[str, str]:
    # "/ctxprefill.v1.PrefillContextService/PrefillContext"
    parts = full_method.rsplit("/", 1)
    if len(parts) != 2:
        return "unknown", full_method
    return parts[0].lstrip("/") or "unknown", parts[1]


class _Call:
    """Bookkeeping of one RPC for the metrics."""

    __slots__ = ("m", "labels", "t0", "code")

    def __init__(self, m: Metrics, labels: dict[str, str]):
        self.m, self.labels = m, labels
        self.t0 = time.perf_counter()
        self.code = "OK"
        m.grpc_started.labels(**labels).inc()

    def received(self) -> None:
        self.m.grpc_msg_received.labels(**self.labels).inc()

    def sent(self) -> None:
        self.m.grpc_msg_sent.labels(**self.labels).inc()

    def finish(self) -> None:
        self.m.grpc_handled.labels(**self.labels, grpc_code=self.code).inc()
        self.m.grpc_handling.labels(**self.labels).observe(time.perf_counter() - self.t0)


class ServerInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        service, method = _split(handler_call_details.method)
        if handler.unary_unary is not None:
            kind, behavior, make = "unary", handler.unary_unary, grpc.unary_unary_rpc_method_handler
        elif handler.unary_stream is not None:
            kind, behavior, make = "server_stream", handler.unary_stream, grpc.unary_stream_rpc_method_handler
        elif handler.stream_unary is not None:
            kind, behavior, make = "client_stream", handler.stream_unary, grpc.stream_unary_rpc_method_handler
        elif handler.stream_stream is not None:
            kind, behavior, make = "bidi_stream", handler.stream_stream, grpc.stream_stream_rpc_method_handler
        else:  # pragma: no cover
            return handler
        labels = {"grpc_type": kind, "grpc_service": service, "grpc_method": method}
        wrapped = self._wrap(behavior, labels, handler.request_streaming, handler_call_details.method)
        return make(wrapped, request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer)

    # ----------------------------------------------------------------------------------
    def _wrap(self, behavior, labels, request_streaming: bool, full_method: str):
        metrics = self.metrics

        def requests_of(call: _Call, request):
            if not request_streaming:
                call.received()
                return request

            async def counted():
                async for r in request:
                    call.received()
                    yield r

            return counted()

        if inspect.isasyncgenfunction(behavior):
            async def stream_wrapper(request, context):
                call = _Call(metrics, labels)
                try:
                    async for response in behavior(requests_of(call, request), context):
                        call.sent()
                        yield response
                    _code_from_context(call, context)
                except BaseException as e:  # noqa: BLE001 - mapped, recorded, re-raised
                    await _handle(call, context, e, full_method)
                finally:
                    call.finish()

            return stream_wrapper

        async def wrapper(request, context):
            call = _Call(metrics, labels)
            try:
                response = behavior(requests_of(call, request), context)
                if inspect.isawaitable(response):
                    response = await response
                _code_from_context(call, context)
                if response is not None and call.code == "OK":
                    call.sent()
                return response
            except BaseException as e:  # noqa: BLE001 - mapped, recorded, re-raised
                await _handle(call, context, e, full_method)
            finally:
                call.finish()

        return wrapper


def _code_from_context(call: _Call, context) -> None:
    code = context.code()
    if code is not None and code != grpc.StatusCode.OK:
        call.code = code.name


async def _handle(call: _Call, context, exc: BaseException, full_method: str) -> None:
    """Record the status of a failed RPC and end it with that status (always raises)."""
    if isinstance(exc, asyncio.CancelledError):
        remaining = context.time_remaining()
        call.code = "DEADLINE_EXCEEDED" if remaining is not None and remaining <= 0 else "CANCELLED"
        raise exc
    if isinstance(exc, grpc.aio.AbortError):  # context.abort() inside the handler
        code = context.code()
        call.code = code.name if code is not None else "UNKNOWN"
        raise exc
    mapped = status_of(exc)
    if mapped is None:
        if not isinstance(exc, Exception):  # KeyboardInterrupt, SystemExit, ...
            call.code = "INTERNAL"
            raise exc
        log.error("unhandled error in %s: %r", full_method, exc, exc_info=exc,
                  extra={"method": full_method})
        mapped = (grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE)
    else:
        log.info("%s -> %s: %s", full_method, mapped[0].name, mapped[1],
                 extra={"method": full_method, "code": mapped[0].name})
    code, details = mapped
    call.code = code.name
    await context.abort(code, details)
