"""How requests and responses cross the wire:

- requests of :data:`INLINE_PARSED` methods are parsed by ``inline_views.parse`` (their
  inline tensor bytes stay views of the received buffer);
- a request whose bytes do not parse is INVALID_ARGUMENT, ``"request: ..."``, when the
  handler would read it (gRPC itself would answer UNKNOWN), for every method of every
  service, health and reflection included;
- a response may be a ``ctxprefill_api.wire.OutgoingMessage`` / ``NestedMessage``
  (tensor bytes appended at serialization instead of copied into the message);
- each response is charged to its call's memory (``memory.charge_answer``: refused
  with RESOURCE_EXHAUSTED when the server's budget has no room for it).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from ctxprefill_api import SERVICE_NAME, pb
from ctxprefill_api.wire import NestedMessage, OutgoingMessage

from ...errors import InvalidArgument
from .. import inline_views
from .handlers import Behavior, HandlerInterceptor, behavior_of, rebuild
from .memory import charge_answer

#: methods whose inline tensor bytes are kept as views of the received buffer, not
#: copied into the message (service/inline_views.py): their request type
_SERVICE = "/" + SERVICE_NAME
INLINE_PARSED = {f"{_SERVICE}/PrefillContext": pb.PrefillContextRequest,
                 f"{_SERVICE}/WriteCache": pb.WriteCacheRequest,
                 f"{_SERVICE}/PrefillContextStream": pb.PrefillContextStreamRequest}


class _Undecodable:
    """Stands in for a request whose bytes did not parse (the handler refuses it)."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException):
        self.error = error


def _safe(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    """``deserialize`` that returns :class:`_Undecodable` instead of raising."""
    if deserialize is None:
        return None

    def safe(raw: bytes) -> Any:
        try:
            return deserialize(raw)
        except Exception as e:  # noqa: BLE001 - DecodeError, and anything a parser may raise
            return _Undecodable(e)

    return safe


def _outgoing_aware(serialize: Callable[[Any], bytes] | None) -> Callable[[Any], bytes] | None:
    if serialize is None:
        return None

    def serialize_response(response: Any) -> bytes:
        if isinstance(response, (OutgoingMessage, NestedMessage)):
            return response.SerializeToString()
        return serialize(response)

    return serialize_response


def _decoded(request: Any) -> Any:
    if isinstance(request, _Undecodable):
        msg = str(request.error).splitlines()[0] if str(request.error) else type(request.error).__name__
        raise InvalidArgument("request", f"the message does not parse ({msg[:200]})")
    return request


def _checked(behavior: Behavior, request_streaming: bool) -> Behavior:
    """``behavior`` given only requests that parsed."""
    def requests_of(request: Any) -> Any:
        if not request_streaming:
            return _decoded(request)

        async def checked() -> AsyncIterator[Any]:
            async for r in request:
                yield _decoded(r)

        return checked()

    if inspect.isasyncgenfunction(behavior):
        async def stream(request: Any, context: Any) -> AsyncIterator[Any]:
            async for response in behavior(requests_of(request), context):
                charge_answer(response)
                yield response

        return stream

    async def call(request: Any, context: Any) -> Any:
        response = behavior(requests_of(request), context)
        if inspect.isawaitable(response):
            response = await response
        charge_answer(response)
        return response

    return call


class WireInterceptor(HandlerInterceptor):
    per_method = True

    def wrap(self, handler: grpc.RpcMethodHandler[Any, Any], kind: str,
             details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler[Any, Any]:
        parse_inline = INLINE_PARSED.get(details.method)
        deserialize = (handler.request_deserializer if parse_inline is None
                       else functools.partial(inline_views.parse, parse_inline))
        return rebuild(handler, behavior=_checked(behavior_of(handler), handler.request_streaming),
                       deserializer=_safe(deserialize), serializer=_outgoing_aware(handler.response_serializer))
