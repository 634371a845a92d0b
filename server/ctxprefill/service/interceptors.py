"""The one server interceptor: exceptions -> status codes, and the gRPC metrics.

Handlers raise; this is the only place that turns an exception into a status:

| exception                                  | status                                   |
|--------------------------------------------|------------------------------------------|
| ``errors.InvalidArgument``                 | INVALID_ARGUMENT, ``"<field>: <message>"`` |
| ``errors.OutOfRange``                      | OUT_OF_RANGE                             |
| ``errors.FailedPrecondition``              | FAILED_PRECONDITION                      |
| ``errors.NotFound`` / ``AlreadyExists``    | NOT_FOUND / ALREADY_EXISTS               |
| ``errors.ResourceExhausted``               | RESOURCE_EXHAUSTED                       |
| ``errors.Unimplemented``                   | UNIMPLEMENTED                            |
| :class:`RpcStatusError` (service states)   | its code (RESOURCE_EXHAUSTED, UNAVAILABLE, DEADLINE_EXCEEDED, ...) |
| ``context.abort(...)`` inside a handler    | as given (e.g. the health service's NOT_FOUND) |
| a request whose bytes do not parse         | INVALID_ARGUMENT, ``"request: ..."`` (the handler never runs) |
| anything else                              | INTERNAL, generic message; traceback logged |

With a bearer token configured (``--auth-token-file`` or ``CTXPREFILL_AUTH_TOKEN``) it
also decides who may call: every RPC must carry ``authorization: Bearer <token>``
metadata — none (or another scheme) is UNAUTHENTICATED, a wrong token
PERMISSION_DENIED (compared in constant time) — except the ``grpc.health.v1.Health``
service, which load balancers and orchestrators probe without credentials. A refused
call's request bytes are not even parsed. Reflection needs the token like any RPC.

It also records, for every RPC of every service on the server (health and reflection
included), the go-grpc-prometheus metrics: ``grpc_server_started_total``,
``grpc_server_handled_total{grpc_code}``, ``grpc_server_msg_received_total``,
``grpc_server_msg_sent_total`` and ``grpc_server_handling_seconds``. (Messages a
streaming handler sends with ``context.write`` instead of ``yield`` are not counted.)
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import hmac
import inspect
import logging
import time

import grpc

from ctxprefill_api import pb
from ctxprefill_api.wire import NestedMessage, OutgoingMessage

from ..errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    OutOfRange,
    ResourceExhausted,
    Unimplemented,
)
from . import inline_views
from .metrics import Metrics

log = logging.getLogger("ctxprefill.service")

#: the request id of the RPC being handled (set by the servicer; read by the log filter)
request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("ctxprefill_request_id", default="")

INTERNAL_MESSAGE = "internal error; the server logged the details"

#: services callable without the bearer token (health probes carry no credentials)
OPEN_SERVICES = frozenset({"grpc.health.v1.Health"})

#: methods whose inline tensor bytes are kept as views of the received buffer, not
#: copied into the message (service/inline_views.py): their request type
_SERVICE = "/" + pb.DESCRIPTOR.services_by_name["PrefillContextService"].full_name
INLINE_PARSED = {f"{_SERVICE}/PrefillContext": pb.PrefillContextRequest,
                 f"{_SERVICE}/WriteCache": pb.WriteCacheRequest,
                 f"{_SERVICE}/PrefillContextStream": pb.PrefillContextStreamRequest}


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
    (NotFound, grpc.StatusCode.NOT_FOUND),
    (AlreadyExists, grpc.StatusCode.ALREADY_EXISTS),
    (ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (Unimplemented, grpc.StatusCode.UNIMPLEMENTED),
)


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str] | None:
    """(code, details) for an exception we map on purpose; None for an unexpected one."""
    for cls, code in _CODES:
        if isinstance(exc, cls):
            return code, str(exc)
    if isinstance(exc, RpcStatusError):
        return exc.code, exc.message
    return None


def status_for(exc: Exception, where: str) -> tuple[grpc.StatusCode, str]:
    """(code, details) a call (or a stream's request, answered in-band) ends with for
    ``exc``, logged: an unexpected exception is INTERNAL with a generic message, its
    traceback in the log."""
    mapped = status_of(exc)
    if mapped is None:
        log.error("unhandled error in %s: %r", where, exc, exc_info=exc, extra={"method": where})
        return grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE
    log.info("%s -> %s: %s", where, mapped[0].name, mapped[1], extra={"method": where, "code": mapped[0].name})
    return mapped


class _Undecodable:
    """Stands in for a request whose bytes did not parse (the handler refuses it)."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException):
        self.error = error


def _safe_deserializer(deserialize):
    """``deserialize`` that returns :class:`_Undecodable` instead of raising: grpc would
    answer a parse error with UNKNOWN; the wrapper turns it into INVALID_ARGUMENT."""
    if deserialize is None:
        return None

    def safe(raw: bytes):
        try:
            return deserialize(raw)
        except Exception as e:  # noqa: BLE001 - DecodeError, and anything a parser may raise
            return _Undecodable(e)

    return safe


def _outgoing_aware(serialize):
    """``serialize`` that also takes a ``ctxprefill_api.wire.OutgoingMessage`` (a response
    whose tensor bytes are appended at serialization instead of copied into it)."""
    if serialize is None:
        return None

    def serialize_response(response) -> bytes:
        if isinstance(response, (OutgoingMessage, NestedMessage)):
            return response.SerializeToString()
        return serialize(response)

    return serialize_response


def _check_decoded(request) -> None:
    if isinstance(request, _Undecodable):
        msg = str(request.error).splitlines()[0] if str(request.error) else type(request.error).__name__
        raise InvalidArgument("request", f"the message does not parse ({msg[:200]})")


def _discard(raw: bytes) -> None:
    """Deserializer of a refused call: its bytes are never parsed."""
    return None


def check_bearer(metadata, token: bytes) -> RpcStatusError | None:
    """None if ``metadata`` carries ``authorization: Bearer <token>``; else the refusal."""
    values = [v for k, v in (metadata or ()) if k.lower() == "authorization"]
    if not values:
        return RpcStatusError(grpc.StatusCode.UNAUTHENTICATED,
                              "missing credentials: send metadata 'authorization: Bearer <token>'", "unauthenticated")
    value = values[0]
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    scheme, _, presented = value.strip().partition(" ")
    if scheme.lower() != "bearer" or not presented.strip():
        return RpcStatusError(grpc.StatusCode.UNAUTHENTICATED,
                              "credentials must be 'authorization: Bearer <token>'", "unauthenticated")
    if len(values) > 1 or not hmac.compare_digest(presented.strip().encode("utf-8", "surrogateescape"), token):
        return RpcStatusError(grpc.StatusCode.PERMISSION_DENIED, "the bearer token is not accepted",
                              "permission_denied")
    return None


def _split(full_method: str) -> tuple[str, str]:
    # "/ctxprefill.v1.PrefillContextService/PrefillContext"
    parts = full_method.rsplit("/", 1)
    if len(parts) != 2:
        return "unknown", full_method
    return parts[0].lstrip("/") or "unknown", parts[1]


class _MethodMetrics:
    """One method's labelled metric children, looked up once: ``labels(**...)`` takes a
    lock and a dict lookup per call, four times per RPC otherwise."""

    __slots__ = ("started", "received", "sent", "handling", "_handled", "_m", "_labels")

    def __init__(self, m: Metrics, labels: dict[str, str]):
        self._m, self._labels = m, labels
        self.started = m.grpc_started.labels(**labels)
        self.received = m.grpc_msg_received.labels(**labels)
        self.sent = m.grpc_msg_sent.labels(**labels)
        self.handling = m.grpc_handling.labels(**labels)
        self._handled: dict[str, object] = {}

    def handled(self, code: str):
        child = self._handled.get(code)
        if child is None:
            child = self._handled[code] = self._m.grpc_handled.labels(**self._labels, grpc_code=code)
        return child


class _Call:
    """Bookkeeping of one RPC for the metrics."""

    __slots__ = ("mm", "t0", "code", "done")

    def __init__(self, mm: _MethodMetrics):
        self.mm = mm
        self.t0 = time.perf_counter()
        self.code = "OK"
        self.done = False
        mm.started.inc()

    def received(self) -> None:
        self.mm.received.inc()

    def sent(self) -> None:
        self.mm.sent.inc()

    def finish(self) -> None:
        """Count the call as handled, once (a refusal is counted before its status goes out)."""
        if self.done:
            return
        self.done = True
        self.mm.handled(self.code).inc()
        self.mm.handling.observe(time.perf_counter() - self.t0)


class ServerInterceptor(grpc.aio.ServerInterceptor):
    """Status mapping and gRPC metrics for every RPC; the bearer-token check when
    ``auth_token`` is set."""

    def __init__(self, metrics: Metrics, auth_token: str | None = None):
        self.metrics = metrics
        self.auth_token = auth_token.encode("utf-8") if auth_token else None
        self._method_metrics: dict[tuple, _MethodMetrics] = {}

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        service, method = _split(handler_call_details.method)
        refusal = None
        if self.auth_token is not None and service not in OPEN_SERVICES:
            refusal = check_bearer(handler_call_details.invocation_metadata, self.auth_token)
            if refusal is not None:
                self.metrics.rejected.labels(reason=refusal.reason).inc()
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
        parse_inline = INLINE_PARSED.get(handler_call_details.method)
        deserializer = _safe_deserializer(handler.request_deserializer if parse_inline is None
                                          else functools.partial(inline_views.parse, parse_inline))
        if refusal is not None:
            behavior, deserializer = _refuse(refusal, handler.response_streaming), _discard
        wrapped = self._wrap(behavior, labels, handler.request_streaming, handler_call_details.method)
        return make(wrapped, request_deserializer=deserializer,
                    response_serializer=_outgoing_aware(handler.response_serializer))

    # ----------------------------------------------------------------------------------
    def _wrap(self, behavior, labels, request_streaming: bool, full_method: str):
        key = tuple(labels.values())
        metrics = self._method_metrics.get(key)
        if metrics is None:
            metrics = self._method_metrics[key] = _MethodMetrics(self.metrics, labels)

        def requests_of(call: _Call, request):
            if not request_streaming:
                call.received()
                _check_decoded(request)
                return request

            async def counted():
                async for r in request:
                    call.received()
                    _check_decoded(r)
                    yield r

            return counted()

        if inspect.isasyncgenfunction(behavior):
            async def stream_wrapper(request, context):
                call = _Call(metrics)
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
            call = _Call(metrics)
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


def _refuse(err: RpcStatusError, response_streaming: bool):
    """A handler that refuses every call with ``err`` (same kind as the one it replaces)."""
    if response_streaming:
        async def refuse_stream(request, context):
            raise err
            yield  # pragma: no cover - makes this an async generator

        return refuse_stream

    async def refuse(request, context):
        raise err

    return refuse


def _code_from_context(call: _Call, context) -> None:
    code = context.code()
    if code is not None and code != grpc.StatusCode.OK:
        call.code = code.name


#: a call cancelled this close to its deadline counts as expired: gRPC cancels it when
#: its C-core deadline passes, and Python's clock may still see a sliver of time left
DEADLINE_SLACK_S = 0.005


def cancel_code(remaining: float | None) -> str:
    """The status of a cancelled call with ``remaining`` seconds to its deadline (None:
    no deadline): DEADLINE_EXCEEDED when the deadline is (about) past, else CANCELLED."""
    return "DEADLINE_EXCEEDED" if remaining is not None and remaining <= DEADLINE_SLACK_S else "CANCELLED"


async def _handle(call: _Call, context, exc: BaseException, full_method: str) -> None:
    """Record the status of a failed RPC and end it with that status (always raises)."""
    if isinstance(exc, asyncio.CancelledError):
        call.code = cancel_code(context.time_remaining())
        raise exc
    if isinstance(exc, grpc.aio.AbortError):  # context.abort() inside the handler
        code = context.code()
        call.code = code.name if code is not None else "UNKNOWN"
        raise exc
    if not isinstance(exc, Exception):  # KeyboardInterrupt, SystemExit, ...
        call.code = "INTERNAL"
        raise exc
    code, details = status_for(exc, full_method)
    call.code = code.name
    # counted before the status leaves: a client that reads the metrics as soon as it has
    # the error finds it there (the wrapper's own finish() is then a no-op)
    call.finish()
    await context.abort(code, details)
