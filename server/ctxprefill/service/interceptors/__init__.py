"""The server's interceptors, one concern each, in the order :func:`server_interceptors`
chains them (the first wraps all the others):

- ``tracing.py`` (with tracing on: ``--otlp-endpoint``), outside all of them: a span per
  RPC, its parent the caller's ``traceparent``;
0. ``memory.py`` (with limits): every call's messages read and its answers written under
   the server's memory budget, receive and send timeouts;
1. ``metrics.py``: the go-grpc-prometheus metrics of every RPC on the server, with the
   status each ends with (refusals included);
2. ``status.py``: exceptions -> gRPC status codes, the only place that maps them;
3. ``auth.py``: the bearer token (``grpc.health.v1.Health`` exempt), when one is set;
4. ``wire.py``: how requests and responses are (de)serialized — inline tensor bytes kept
   as views, responses that carry theirs beside the message, request bytes that do not
   parse answered INVALID_ARGUMENT.
"""

from __future__ import annotations

import grpc

from ..connections import ConnectionCloser
from ..metrics import Metrics
from ..tracing import Tracing
from .auth import OPEN_SERVICES, AuthInterceptor, check_bearer
from .memory import MemoryInterceptor, MemoryLimits, answer_room
from .metrics import MetricsInterceptor
from .status import (
    DEADLINE_SLACK_S,
    INTERNAL_MESSAGE,
    RpcStatusError,
    StatusInterceptor,
    cancel_code,
    status_for,
    status_of,
)
from .tracing import TracingInterceptor
from .wire import INLINE_PARSED, WireInterceptor

__all__ = ["DEADLINE_SLACK_S", "INLINE_PARSED", "INTERNAL_MESSAGE", "OPEN_SERVICES", "AuthInterceptor",
           "MemoryInterceptor", "MemoryLimits", "MetricsInterceptor", "RpcStatusError", "StatusInterceptor",
           "TracingInterceptor", "WireInterceptor", "answer_room", "cancel_code", "check_bearer", "server_interceptors",
           "status_for", "status_of"]


def server_interceptors(metrics: Metrics, auth_token: str | None = None,
                        limits: MemoryLimits | None = None,
                        tracing: Tracing | None = None,
                        closer: ConnectionCloser | None = None) -> list[grpc.aio.ServerInterceptor]:
    """The chain for a server: the RPC spans (with ``tracing``), the memory bounds (with
    ``limits``; ``closer`` ends the connections of answers past the send timeout),
    metrics, status mapping, the token check (with ``auth_token``), the wire format."""
    counted = MetricsInterceptor(metrics)
    chain: list[grpc.aio.ServerInterceptor] = [counted, StatusInterceptor()]
    if limits is not None:
        chain.insert(0, MemoryInterceptor(limits, counted.record, closer))
    if auth_token:
        chain.append(AuthInterceptor(auth_token, metrics))
    chain.append(WireInterceptor())
    if tracing is not None:
        chain.insert(0, TracingInterceptor(tracing))
    return chain
