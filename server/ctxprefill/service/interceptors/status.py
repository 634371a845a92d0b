"""Exceptions -> gRPC status codes: handlers raise, this is the only place that turns an
exception into a status.

| exception                                  | status                                   |
|--------------------------------------------|------------------------------------------|
| ``errors.InvalidArgument``                 | INVALID_ARGUMENT, ``"<field>: <message>"`` |
| ``errors.OutOfRange``                      | OUT_OF_RANGE                             |
| ``errors.FailedPrecondition``              | FAILED_PRECONDITION                      |
| ``errors.NotFound`` / ``AlreadyExists``    | NOT_FOUND / ALREADY_EXISTS               |
| ``errors.ResourceExhausted``               | RESOURCE_EXHAUSTED                       |
| ``errors.Unimplemented``                   | UNIMPLEMENTED                            |
| ``errors.PermissionDenied``                | PERMISSION_DENIED (shared memory from a non-local peer) |
| ``errors.DeadlineExceeded`` / ``Cancelled`` | DEADLINE_EXCEEDED / CANCELLED (work stopped between chunks) |
| :class:`RpcStatusError` (service states)   | its code (RESOURCE_EXHAUSTED, UNAVAILABLE, DEADLINE_EXCEEDED, ...) |
| ``context.abort(...)`` inside a handler    | as given (e.g. the health service's NOT_FOUND) |
| anything else                              | INTERNAL, generic message; traceback logged |

The status is set on the call (``set_code`` / ``set_details``) and the handler ends,
rather than aborted: gRPC sends it when the call returns, after the interceptors
around this one (the metrics) have recorded it.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc

from ...errors import (
    AlreadyExists,
    Cancelled,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    OutOfRange,
    PermissionDenied,
    ResourceExhausted,
    Unimplemented,
)
from .handlers import Behavior, HandlerInterceptor, behavior_of, rebuild

log = logging.getLogger("ctxprefill.service")

INTERNAL_MESSAGE = "internal error; the server logged the details"

#: a call cancelled this close to its deadline counts as expired: a client whose deadline
#: passes resets the stream before the server's copy of that deadline (timed from when the
#: server read the call's headers) passes: 7-8 ms before it on a loaded 2-core host
DEADLINE_SLACK_S = 0.05


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
    (PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    (DeadlineExceeded, grpc.StatusCode.DEADLINE_EXCEEDED),
    (Cancelled, grpc.StatusCode.CANCELLED),
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


def cancel_code(remaining: float | None) -> str:
    """The status of a cancelled call with ``remaining`` seconds to its deadline (None:
    no deadline): DEADLINE_EXCEEDED when the deadline is (about) past, else CANCELLED."""
    return "DEADLINE_EXCEEDED" if remaining is not None and remaining <= DEADLINE_SLACK_S else "CANCELLED"


def code_of(exc: BaseException, context: grpc.aio.ServicerContext[Any, Any]) -> str:
    """The status (its name) a call whose handler left with ``exc`` ends with, as the
    interceptors outside this one see it."""
    if isinstance(exc, asyncio.CancelledError):
        return cancel_code(context.time_remaining())
    if isinstance(exc, grpc.aio.AbortError):  # context.abort() inside the handler
        code = context.code()
        return code.name if code is not None else "UNKNOWN"
    # KeyboardInterrupt, ... (this interceptor maps every Exception)
    mapped = status_of(exc) if isinstance(exc, Exception) else None
    return mapped[0].name if mapped is not None else "INTERNAL"


def code_after(context: grpc.aio.ServicerContext[Any, Any]) -> str:
    """The status (its name) a call whose handler returned ends with: set on the
    context, or OK."""
    code = context.code()
    return "OK" if code is None else code.name


def _set_status(context: grpc.aio.ServicerContext[Any, Any], exc: Exception, where: str) -> None:
    if isinstance(exc, grpc.aio.AbortError):  # context.abort() inside the handler: its status is sent
        raise exc
    code, details = status_for(exc, where)
    context.set_code(code)
    context.set_details(details)


def _mapped(behavior: Behavior, where: str) -> Behavior:
    if inspect.isasyncgenfunction(behavior):
        async def stream(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
            try:
                async for response in behavior(request, context):
                    yield response
            except Exception as e:  # noqa: BLE001 - mapped to the call's status
                _set_status(context, e, where)

        return stream

    async def call(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        try:
            response = behavior(request, context)
            if inspect.isawaitable(response):
                response = await response
            return response
        except Exception as e:  # noqa: BLE001 - mapped to the call's status
            _set_status(context, e, where)
            return None

    return call


class StatusInterceptor(HandlerInterceptor):
    """Every exception a handler raises becomes the call's status (the table above)."""

    per_method = True

    def wrap(self, handler: grpc.RpcMethodHandler[Any, Any], kind: str,
             details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler[Any, Any]:
        return rebuild(handler, behavior=_mapped(behavior_of(handler), details.method))
