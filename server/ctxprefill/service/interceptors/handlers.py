"""Taking an ``RpcMethodHandler`` apart and putting it together again, for the
interceptors (each replaces the behavior or a (de)serializer and keeps the rest)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

Behavior = Callable[..., Any]

#: kind (the ``grpc_type`` label) -> the handler's attribute of that kind and its factory
_KINDS: dict[str, tuple[str, Callable[..., grpc.RpcMethodHandler[Any, Any]]]] = {
    "unary": ("unary_unary", grpc.unary_unary_rpc_method_handler),
    "server_stream": ("unary_stream", grpc.unary_stream_rpc_method_handler),
    "client_stream": ("stream_unary", grpc.stream_unary_rpc_method_handler),
    "bidi_stream": ("stream_stream", grpc.stream_stream_rpc_method_handler),
}


def kind_of(handler: grpc.RpcMethodHandler[Any, Any] | None) -> str | None:
    """``unary``, ``server_stream``, ``client_stream`` or ``bidi_stream``; None for no handler."""
    if handler is None:
        return None
    for kind, (attr, _) in _KINDS.items():
        if getattr(handler, attr) is not None:
            return kind
    return None


def behavior_of(handler: grpc.RpcMethodHandler[Any, Any], kind: str) -> Behavior:
    behavior: Behavior = getattr(handler, _KINDS[kind][0])
    return behavior


def rebuild(handler: grpc.RpcMethodHandler[Any, Any], kind: str, *, behavior: Behavior | None = None,
            deserializer: Callable[[bytes], Any] | None = None,
            serializer: Callable[[Any], bytes] | None = None) -> grpc.RpcMethodHandler[Any, Any]:
    """``handler`` with what is given replaced (None: kept)."""
    attr, make = _KINDS[kind]
    return make(behavior or getattr(handler, attr),
                request_deserializer=deserializer or handler.request_deserializer,
                response_serializer=serializer or handler.response_serializer)


def split_method(full_method: str) -> tuple[str, str]:
    """``("ctxprefill.v1.PrefillContextService", "PrefillContext")`` of
    ``"/ctxprefill.v1.PrefillContextService/PrefillContext"``."""
    parts = full_method.rsplit("/", 1)
    if len(parts) != 2:
        return "unknown", full_method
    return parts[0].lstrip("/") or "unknown", parts[1]
