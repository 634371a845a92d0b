"""Taking an ``RpcMethodHandler`` apart and putting it together again, for the
interceptors (each replaces the behavior or a (de)serializer and keeps the rest), and
their common base, :class:`HandlerInterceptor`.

A handler has two kinds: the method's own (``grpc_type``: unary, server_stream, ...;
what the metrics label and the inner interceptors see) and the shape gRPC drives it in
(its ``request_streaming`` / ``response_streaming``). They differ only for the handler
the memory interceptor hands to gRPC (``memory.py``): every method is driven as a
bidirectional stream there, so that messages are read and written under its limits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import grpc

Behavior = Callable[..., Any]

#: kind (the ``grpc_type`` label) -> (request streaming, response streaming, the handler's attribute of that kind)
_KINDS: dict[str, tuple[bool, bool, str]] = {
    "unary": (False, False, "unary_unary"),
    "server_stream": (False, True, "unary_stream"),
    "client_stream": (True, False, "stream_unary"),
    "bidi_stream": (True, True, "stream_stream"),
}


class _Fields(NamedTuple):
    request_streaming: bool
    response_streaming: bool
    request_deserializer: Callable[[bytes], Any] | None
    response_serializer: Callable[[Any], bytes] | None
    unary_unary: Behavior | None
    unary_stream: Behavior | None
    stream_unary: Behavior | None
    stream_stream: Behavior | None
    grpc_type: str  # the method's own kind, whatever shape it is driven in
    reads_request: bool  # False: the behavior refuses without its request, which is then never read


class MethodHandler(_Fields, grpc.RpcMethodHandler):  # type: ignore[type-arg]
    """An ``RpcMethodHandler`` (what gRPC reads of one) that also carries the method's
    own kind and whether its behavior reads the request."""


def shape_of(handler: grpc.RpcMethodHandler[Any, Any]) -> str:
    """The kind gRPC drives ``handler`` as."""
    for kind, (_, _, attr) in _KINDS.items():
        if getattr(handler, attr) is not None:
            return kind
    raise ValueError("a method handler without a behavior")


def kind_of(handler: grpc.RpcMethodHandler[Any, Any] | None) -> str | None:
    """The method's own kind: ``unary``, ``server_stream``, ``client_stream`` or
    ``bidi_stream``; None for no handler."""
    if handler is None:
        return None
    own: str | None = getattr(handler, "grpc_type", None)
    if own is not None:
        return own
    try:
        return shape_of(handler)
    except ValueError:
        return None


def reads_request(handler: grpc.RpcMethodHandler[Any, Any]) -> bool:
    return bool(getattr(handler, "reads_request", True))


def behavior_of(handler: grpc.RpcMethodHandler[Any, Any]) -> Behavior:
    behavior: Behavior = getattr(handler, _KINDS[shape_of(handler)][2])
    return behavior


def rebuild(handler: grpc.RpcMethodHandler[Any, Any], *, behavior: Behavior | None = None,
            deserializer: Callable[[bytes], Any] | None = None, serializer: Callable[[Any], bytes] | None = None,
            shape: str | None = None, reads: bool | None = None) -> MethodHandler:
    """``handler`` with what is given replaced (None: kept); ``shape``: driven as that
    kind (the method's own kind is kept); ``reads=False``: its behavior needs no request."""
    own = kind_of(handler)
    assert own is not None
    shape = shape or shape_of(handler)
    request_streaming, response_streaming, attr = _KINDS[shape]
    behaviors: dict[str, Behavior | None] = {a: None for _, _, a in _KINDS.values()}
    behaviors[attr] = behavior or behavior_of(handler)
    return MethodHandler(request_streaming=request_streaming, response_streaming=response_streaming,
                         request_deserializer=deserializer or handler.request_deserializer,
                         response_serializer=serializer or handler.response_serializer,
                         unary_unary=behaviors["unary_unary"], unary_stream=behaviors["unary_stream"],
                         stream_unary=behaviors["stream_unary"], stream_stream=behaviors["stream_stream"],
                         grpc_type=own, reads_request=reads_request(handler) if reads is None else reads)


class HandlerInterceptor(grpc.aio.ServerInterceptor):
    """An interceptor that rebuilds each call's method handler (:meth:`wrap`); a call
    without a handler, or with one without a behavior, passes untouched.

    ``per_method``: what :meth:`wrap` makes depends on the method and its handler only
    (no per-call state), so it is made once and reused while the handler it was made
    from comes back (the servicer's handlers are built once: every call of a method
    then costs a dict lookup here instead of a rebuild)."""

    per_method = False

    def __init__(self) -> None:
        self._made: dict[str, tuple[grpc.RpcMethodHandler[Any, Any], grpc.RpcMethodHandler[Any, Any]]] = {}

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Any], handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler: grpc.RpcMethodHandler[Any, Any] | None = await continuation(handler_call_details)
        if handler is None:
            return None
        made = self._made.get(handler_call_details.method) if self.per_method else None
        if made is not None and made[0] is handler:
            return made[1]
        kind = kind_of(handler)
        if kind is None:
            return handler
        wrapped = self.wrap(handler, kind, handler_call_details)
        if self.per_method:  # one entry per registered method
            self._made[handler_call_details.method] = (handler, wrapped)
        return wrapped

    def wrap(self, handler: grpc.RpcMethodHandler[Any, Any], kind: str,
             details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler[Any, Any]:
        """The handler the call runs with (``kind``: the method's own, ``kind_of``)."""
        raise NotImplementedError


def split_method(full_method: str) -> tuple[str, str]:
    """``("ctxprefill.v1.PrefillContextService", "PrefillContext")`` of
    ``"/ctxprefill.v1.PrefillContextService/PrefillContext"``."""
    parts = full_method.rsplit("/", 1)
    if len(parts) != 2:
        return "unknown", full_method
    return parts[0].lstrip("/") or "unknown", parts[1]
