"""Who may call: with a bearer token configured (``--auth-token-file`` or
``CTXPREFILL_AUTH_TOKEN``) every RPC must carry ``authorization: Bearer <token>``
metadata — none (or another scheme) is UNAUTHENTICATED, a wrong token
PERMISSION_DENIED (compared in constant time) — except the ``grpc.health.v1.Health``
service, which load balancers and orchestrators probe without credentials. The check
runs when a call's metadata arrives: a refused call is answered without its message
ever being read (``memory.py`` drives the calls), so that whatever it sends costs the
server no memory; it is counted in ``ctxprefill_rejected_requests_total{reason}``.
Reflection needs the token like any RPC.
"""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import grpc

from ..metrics import Metrics
from .handlers import HandlerInterceptor, rebuild, split_method
from .status import RpcStatusError

#: services callable without the bearer token (health probes carry no credentials)
OPEN_SERVICES = frozenset({"grpc.health.v1.Health"})


def check_bearer(metadata: Sequence[tuple[str, str | bytes]] | None, token: bytes) -> RpcStatusError | None:
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


def _discard(raw: bytes) -> None:
    """Deserializer of a refused call (its message is not read: this never runs)."""
    return None


def _refusing(err: RpcStatusError, response_streaming: bool) -> Callable[..., Any]:
    """A handler that refuses every call with ``err`` (same kind as the one it replaces)."""
    if response_streaming:
        async def refuse_stream(request: Any, context: Any) -> AsyncIterator[Any]:
            nothing: tuple[Any, ...] = ()
            for response in nothing:  # an async generator (like the handler it replaces) that yields nothing
                yield response
            raise err

        return refuse_stream

    async def refuse(request: Any, context: Any) -> Any:
        raise err

    return refuse


class AuthInterceptor(HandlerInterceptor):
    def __init__(self, token: str, metrics: Metrics):
        super().__init__()
        self.token = token.encode("utf-8")
        self.metrics = metrics

    def wrap(self, handler: grpc.RpcMethodHandler[Any, Any], kind: str,
             details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler[Any, Any]:
        if split_method(details.method)[0] in OPEN_SERVICES:
            return handler
        refusal = check_bearer(details.invocation_metadata, self.token)
        if refusal is None:
            return handler
        self.metrics.rejected.labels(reason=refusal.reason).inc()
        return rebuild(handler, behavior=_refusing(refusal, handler.response_streaming), deserializer=_discard,
                       reads=False)
