"""The server's interceptors, one concern each, in the order :func:`server_interceptors`
chains them (the first wraps all the others):

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

from ..metrics import Metrics
from .auth import OPEN_SERVICES, AuthInterceptor, check_bearer
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
from .wire import INLINE_PARSED, WireInterceptor

__all__ = ["DEADLINE_SLACK_S", "INLINE_PARSED", "INTERNAL_MESSAGE", "OPEN_SERVICES", "AuthInterceptor",
           "MetricsInterceptor", "RpcStatusError", "StatusInterceptor", "WireInterceptor", "cancel_code",
           "check_bearer", "server_interceptors", "status_for", "status_of"]


def server_interceptors(metrics: Metrics, auth_token: str | None = None) -> list[grpc.aio.ServerInterceptor]:
    """The chain for a server: metrics, status mapping, the token check (with
    ``auth_token``), the wire format."""
    chain: list[grpc.aio.ServerInterceptor] = [MetricsInterceptor(metrics), StatusInterceptor()]
    if auth_token:
        chain.append(AuthInterceptor(auth_token, metrics))
    chain.append(WireInterceptor())
    return chain
