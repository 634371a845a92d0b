"""The HTTP side (CONTRACT §8, §9): ``/metrics``, ``/healthz``, ``/readyz``, nothing else.

A bare ASGI callable (no framework), served by uvicorn in the gRPC server's event
loop. uvicorn is imported only by :func:`make_uvicorn_server`, so that the rest of
the service imports without it.

- ``GET /metrics``: the service's own registry through ``prometheus_client``'s ASGI app
  (text format or OpenMetrics by the ``Accept`` header, gzip by ``Accept-Encoding``).
- ``GET /healthz``: 200 while the process lives (liveness).
- ``GET /readyz``: 200 once the engine is built and warmed up, 503 while starting or
  draining (readiness).
- anything else: 404; a method other than GET/HEAD on those paths: 405.

The port shares the process (its file descriptors, its event loop) with the gRPC port,
so it is bounded (docs/RELIABILITY.md, "Threat model"): at most :data:`MAX_CONNECTIONS`
open connections (:data:`MAX_CONNECTIONS_PER_PEER` from one address, and
:data:`RESERVED_FOR_NEW_PEERS` more for addresses holding none), more are closed inside
accept() (:class:`GatedSocket`); a request's head must arrive within :data:`HEADER_TIMEOUT_S` and be at
most :data:`MAX_HEADER_BYTES`; a response must be taken within :data:`RESPONSE_TIMEOUT_S`;
an idle keep-alive connection closes after :data:`KEEP_ALIVE_S`. Log lines that a flood
repeats (asyncio's accept errors, uvicorn's bad-request warnings, refused connections)
pass at most once a second each, with the count of those held back
(:class:`RateLimitFilter`).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import socket
import struct
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import prometheus_client

from .metrics import Metrics

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

#: open HTTP connections at once: more are closed inside accept(), before asyncio makes a
#: transport of them, so that this port never holds more of the process's file descriptors
#: (the gRPC port needs the rest)
MAX_CONNECTIONS = 256
#: of those, from one client address
MAX_CONNECTIONS_PER_PEER = 64
#: past MAX_CONNECTIONS, for an address that holds none: the kubelet's probe or Prometheus's
#: scrape still gets in while a flood from fewer than 4 + this many addresses fills the rest
RESERVED_FOR_NEW_PEERS = 32
#: seconds from a connection's opening (or its previous response) to the end of a request's head
HEADER_TIMEOUT_S = 5.0
#: seconds from a request's head to the end of its response (a client that does not read it)
RESPONSE_TIMEOUT_S = 30.0
#: seconds an idle keep-alive connection stays open
KEEP_ALIVE_S = 5.0
#: bytes of a request's head (request line and headers); more: 400
MAX_HEADER_BYTES = 8192
#: the kernel's queue of connections not yet accepted (holds no descriptor of ours)
ACCEPT_BACKLOG = 1024
#: connections one accept() call may close before it lets the event loop run again
REFUSALS_PER_ACCEPT = 64

log = logging.getLogger("ctxprefill.http")


class HttpApp:
    def __init__(self, metrics: Metrics, is_ready: Callable[[], bool], state: Callable[[], str] = lambda: ""):
        self.metrics = metrics
        self.is_ready = is_ready
        self.state = state
        self.metrics_app = prometheus_client.make_asgi_app(metrics.registry)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # lifespan: uvicorn runs with lifespan="off"
            return
        path, method = scope.get("path", ""), scope.get("method", "GET")
        if path not in ("/metrics", "/healthz", "/readyz"):
            return await _respond(send, 404, b"not found\n", method=method)
        if method not in ("GET", "HEAD"):
            return await _respond(send, 405, b"method not allowed\n", method=method, extra=[(b"allow", b"GET, HEAD")])
        if path == "/metrics":
            await self.metrics_app(scope, receive, _metrics_send(send, head=method == "HEAD"))
            return None
        if path == "/healthz":
            return await _respond(send, 200, b"ok\n", method=method)
        if self.is_ready():
            return await _respond(send, 200, b"ready\n", method=method)
        return await _respond(send, 503, f"not ready: {self.state() or 'starting'}\n".encode(), method=method)


def _metrics_send(send: Send, head: bool) -> Send:
    """prometheus_client's messages as ASGI has them (header names in lower case); no body for HEAD."""

    async def metrics_send(msg: MutableMapping[str, Any]) -> None:
        if msg["type"] == "http.response.start":
            msg = {**msg, "headers": [(k.lower(), v) for k, v in msg.get("headers", [])]}
        elif head and msg["type"] == "http.response.body":
            msg = {**msg, "body": b""}
        await send(msg)

    return metrics_send


async def _respond(send: Send, status: int, body: bytes, content_type: str = "text/plain; charset=utf-8",
                   method: str = "GET", extra: list[tuple[bytes, bytes]] | tuple[()] = ()) -> None:
    headers = [(b"content-type", content_type.encode()), (b"content-length", str(len(body)).encode()),
               (b"cache-control", b"no-store"), *extra]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": b"" if method == "HEAD" else body})


class ConnectionGate:
    """The HTTP connections open, in all and by client address, against the caps."""

    def __init__(self) -> None:
        self.open = 0
        self.per_peer: dict[str, int] = {}
        self.refused = 0  # since the start

    def admit(self, peer: str) -> bool:
        n_peer = self.per_peer.get(peer, 0)
        cap = MAX_CONNECTIONS + (RESERVED_FOR_NEW_PEERS if n_peer == 0 else 0)
        if self.open >= cap or n_peer >= MAX_CONNECTIONS_PER_PEER:
            self.refused += 1
            log.warning("HTTP connection refused: too many open", extra={
                "open": self.open, "from_peer": n_peer, "peer": peer, "max_connections": MAX_CONNECTIONS,
                "max_per_peer": MAX_CONNECTIONS_PER_PEER, "refused_total": self.refused})
            return False
        self.open += 1
        self.per_peer[peer] = n_peer + 1
        return True

    def release(self, peer: str) -> None:
        self.open -= 1
        n = self.per_peer.get(peer, 1) - 1
        if n > 0:
            self.per_peer[peer] = n
        else:
            self.per_peer.pop(peer, None)


def _peer(addr: Any) -> str:
    return str(addr[0]) if isinstance(addr, tuple) and addr else str(addr)


class GatedSocket(socket.socket):
    """A listening socket whose accept() closes (RST) the connections over the caps at
    once: asyncio accepts up to its backlog per wake-up and makes each a transport a loop
    turn later, so a cap checked in ``connection_made`` would let a flood hold several
    backlogs of descriptors first. An admitted connection is released by its protocol."""

    gate: ConnectionGate

    def accept(self) -> tuple[socket.socket, Any]:
        for _ in range(REFUSALS_PER_ACCEPT):
            conn, addr = super().accept()  # BlockingIOError when none is waiting: asyncio's end of the burst
            if self.gate.admit(_peer(addr)):
                return conn, addr
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST, no TIME_WAIT
            conn.close()
        raise BlockingIOError  # the rest at the next loop turn: gRPC's callbacks run in between


def bind_socket(host: str, port: int) -> GatedSocket:
    """A listening-ready TCP socket bound to (host, port), its connections capped (port 0
    picks a free one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = GatedSocket(family, socket.SOCK_STREAM)
    sock.gate = ConnectionGate()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


# ------------------------------------------------------------------------------ log floods


class RateLimitFilter(logging.Filter):
    """Passes each message (its logger, level and first line) at most once per ``interval``
    seconds; the next one that passes carries ``suppressed``: how many were held back. A
    burst that stops is summed up by one line at the end of its interval (on the event
    loop, where there is one)."""

    MAX_KEYS = 1024

    def __init__(self, interval: float = 1.0):
        super().__init__()
        self.interval = interval
        self._windows: dict[tuple[str, int, str], list[Any]] = {}  # key -> [start, held back, last held, armed]

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "_rate_limit_summary", False):
            return True
        key = (record.name, record.levelno, str(record.msg).split("\n", 1)[0][:200])
        now = time.monotonic()
        w = self._windows.get(key)
        if w is None or now - w[0] >= self.interval:
            if len(self._windows) >= self.MAX_KEYS:
                self._windows.clear()
            held = w[1] if w is not None else 0
            self._windows[key] = [now, 0, None, False]
            if held:
                record.suppressed = held
            return True
        w[1] += 1
        w[2] = record
        if not w[3]:
            with contextlib.suppress(RuntimeError):  # no running loop in this thread: the next line reports
                asyncio.get_running_loop().call_later(w[0] + self.interval - now, self._summary, key)
                w[3] = True
        return False

    def _summary(self, key: tuple[str, int, str]) -> None:
        w = self._windows.get(key)
        if w is None or not w[1] or w[2] is None:
            return
        record = copy.copy(w[2])
        record.suppressed, record._rate_limit_summary = w[1], True
        self._windows[key] = [time.monotonic(), 0, None, False]
        logging.getLogger(record.name).handle(record)


#: loggers that a flood of connections makes repeat themselves: asyncio's accept errors
#: (``socket.accept() out of system resource``, one per accept attempt, traceback included),
#: uvicorn's per-request warnings, our refused connections
RATE_LIMITED_LOGGERS = ("asyncio", "uvicorn.error", "ctxprefill.http")


def rate_limit_logs(interval: float = 1.0) -> None:
    """Install :class:`RateLimitFilter` on :data:`RATE_LIMITED_LOGGERS` (once)."""
    for name in RATE_LIMITED_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, RateLimitFilter) for f in logger.filters):
            logger.addFilter(RateLimitFilter(interval))


# ------------------------------------------------------------------------------ uvicorn


def _limited_protocol(base: type[asyncio.Protocol], gate: ConnectionGate) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol that releases its place at the gate, with deadlines for a
    request's head and its response (uvicorn has none for a head that never completes: its
    keep-alive timer is armed only after a response and cancelled by any byte received)."""

    class LimitedProtocol(base):  # type: ignore[valid-type, misc]
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self._peer = _peer(transport.get_extra_info("peername"))
            self._deadline: asyncio.TimerHandle | None = None
            super().connection_made(transport)
            self._arm(HEADER_TIMEOUT_S)

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            gate.release(self._peer)
            super().connection_lost(exc)

        def handle_events(self) -> None:
            cycle = self.cycle
            super().handle_events()
            if self.cycle is not cycle and self.cycle is not None and not self.cycle.response_complete:
                self._arm(RESPONSE_TIMEOUT_S)  # a request's head arrived: its response has this long

        def on_response_complete(self) -> None:
            self._arm(HEADER_TIMEOUT_S)  # before: a pipelined request found by the base class re-arms
            super().on_response_complete()

        def _arm(self, seconds: float) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(seconds, self._expire)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self) -> None:
            self._deadline = None
            if not self.transport.is_closing():
                self.transport.abort()

    return LimitedProtocol


def make_uvicorn_server(app: HttpApp, sock: GatedSocket) -> Any:
    """A uvicorn server for ``app`` on ``sock``, bounded as the module says, that leaves
    signal handling to us."""
    try:
        import uvicorn
        from uvicorn.protocols.http.h11_impl import H11Protocol
    except ImportError as e:
        from ..errors import ConfigError

        raise ConfigError(f"the HTTP server (--metrics-port) needs uvicorn, which is not importable: {e}") from None

    class _Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):  # type: ignore[no-untyped-def]  # SIGTERM/SIGINT are handled by server.py
            yield

        def install_signal_handlers(self) -> None:  # older uvicorn
            pass

    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(
        app, host=host, port=port, lifespan="off", access_log=False, log_level="warning", log_config=None,
        timeout_graceful_shutdown=2, http=_limited_protocol(H11Protocol, sock.gate), ws="none", backlog=ACCEPT_BACKLOG,
        # a backstop behind the connection cap: requests running at once (more get 503)
        limit_concurrency=MAX_CONNECTIONS + RESERVED_FOR_NEW_PEERS + 1, timeout_keep_alive=int(KEEP_ALIVE_S),
        h11_max_incomplete_event_size=MAX_HEADER_BYTES)
    return _Server(config)
