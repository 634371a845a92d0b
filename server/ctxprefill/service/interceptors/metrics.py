"""The go-grpc-prometheus metrics of every RPC of every service on the server (health and
reflection included): ``grpc_server_started_total``,
``grpc_server_handled_total{grpc_code}``, ``grpc_server_msg_received_total``,
``grpc_server_msg_sent_total`` and ``grpc_server_handling_seconds``. Outside the status
mapping and the token check (the memory interceptor reports the calls it ends through
:meth:`MetricsInterceptor.record`), it records the status a call ends with before gRPC
sends it, so that a client reading the metrics as soon as it has its answer finds the
call counted. (Messages a streaming handler sends with ``context.write`` instead of
``yield`` are not counted.)
"""

from __future__ import annotations

import inspect
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc

from ..metrics import Metrics
from .handlers import Behavior, HandlerInterceptor, behavior_of, rebuild, split_method
from .status import code_after, code_of


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
        self._handled: dict[str, Any] = {}

    def handled(self, code: str) -> Any:
        child = self._handled.get(code)
        if child is None:
            child = self._handled[code] = self._m.grpc_handled.labels(**self._labels, grpc_code=code)
        return child


class _Call:
    """Bookkeeping of one RPC."""

    __slots__ = ("mm", "t0", "code")

    def __init__(self, mm: _MethodMetrics):
        self.mm = mm
        self.t0 = time.perf_counter()
        self.code = "OK"
        mm.started.inc()

    def finish(self) -> None:
        self.mm.handled(self.code).inc()
        self.mm.handling.observe(time.perf_counter() - self.t0)


def _counted(behavior: Behavior, mm: _MethodMetrics, request_streaming: bool) -> Behavior:
    def requests_of(request: Any) -> Any:
        if not request_streaming:
            if request is not None:  # None: refused before its message was read (auth.py)
                mm.received.inc()
            return request

        async def counted() -> AsyncIterator[Any]:
            async for r in request:
                mm.received.inc()
                yield r

        return counted()

    if inspect.isasyncgenfunction(behavior):
        async def stream(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
            call = _Call(mm)
            try:
                async for response in behavior(requests_of(request), context):
                    mm.sent.inc()
                    yield response
                call.code = code_after(context)
            except BaseException as e:
                call.code = code_of(e, context)
                raise
            finally:
                call.finish()

        return stream

    async def unary(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        call = _Call(mm)
        try:
            response = behavior(requests_of(request), context)
            if inspect.isawaitable(response):
                response = await response
            call.code = code_after(context)
            if response is not None and call.code == "OK":
                mm.sent.inc()
            return response
        except BaseException as e:
            call.code = code_of(e, context)
            raise
        finally:
            call.finish()

    return unary


class MetricsInterceptor(HandlerInterceptor):
    per_method = True

    def __init__(self, metrics: Metrics):
        super().__init__()
        self.metrics = metrics
        self._method_metrics: dict[tuple[str, str, str], _MethodMetrics] = {}

    def wrap(self, handler: grpc.RpcMethodHandler[Any, Any], kind: str,
             details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler[Any, Any]:
        mm = self._method(kind, details.method)
        return rebuild(handler, behavior=_counted(behavior_of(handler), mm, handler.request_streaming))

    def _method(self, kind: str, full_method: str) -> _MethodMetrics:
        service, method = split_method(full_method)
        key = (kind, service, method)
        mm = self._method_metrics.get(key)
        if mm is None:
            labels = {"grpc_type": kind, "grpc_service": service, "grpc_method": method}
            mm = self._method_metrics[key] = _MethodMetrics(self.metrics, labels)
        return mm

    def record(self, full_method: str, kind: str, code: grpc.StatusCode, reason: str, counted: bool) -> None:
        """A call the memory interceptor (outside this one) ended with ``code``: counted
        as refused for ``reason``, and as handled unless this interceptor saw it already."""
        self.metrics.rejected.labels(reason=reason).inc()
        if not counted:
            mm = self._method(kind, full_method)
            mm.started.inc()
            mm.handled(code.name).inc()
