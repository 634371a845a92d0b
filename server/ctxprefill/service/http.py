"""The HTTP side (CONTRACT §8, §9): ``/metrics``, ``/healthz``, ``/readyz``, nothing else.

A bare ASGI callable (no framework), served by uvicorn in the gRPC server's event
loop. uvicorn is imported only by :func:`make_uvicorn_server`, so that the rest of
the service imports without it.

- ``GET /metrics``: the Prometheus text page of the service's own registry.
- ``GET /healthz``: 200 while the process lives (liveness).
- ``GET /readyz``: 200 once the engine is built and warmed up, 503 while starting or
  draining (readiness).
- anything else: 404; a method other than GET/HEAD on those paths: 405.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable

from .metrics import CONTENT_TYPE, Metrics


class HttpApp:
    def __init__(self, metrics: Metrics, is_ready: Callable[[], bool], state: Callable[[], str] = lambda: ""):
        self.metrics = metrics
        self.is_ready = is_ready
        self.state = state

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":  # pragma: no cover - uvicorn runs with lifespan="off"
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        path, method = scope.get("path", ""), scope.get("method", "GET")
        if path not in ("/metrics", "/healthz", "/readyz"):
            return await _respond(send, 404, b"not found\n", method=method)
        if method not in ("GET", "HEAD"):
            return await _respond(send, 405, b"method not allowed\n", method=method, extra=[(b"allow", b"GET, HEAD")])
        if path == "/metrics":
            return await _respond(send, 200, self.metrics.render(), CONTENT_TYPE, method=method)
        if path == "/healthz":
            return await _respond(send, 200, b"ok\n", method=method)
        if self.is_ready():
            return await _respond(send, 200, b"ready\n", method=method)
        return await _respond(send, 503, f"not ready: {self.state() or 'starting'}\n".encode(), method=method)


async def _respond(send, status: int, body: bytes, content_type: str = "text/plain; charset=utf-8",
                   method: str = "GET", extra=()):
    headers = [(b"content-type", content_type.encode()), (b"content-length", str(len(body)).encode()),
               (b"cache-control", b"no-store"), *extra]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": b"" if method == "HEAD" else body})


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening-ready TCP socket bound to (host, port); port 0 picks a free one."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def make_uvicorn_server(app, sock: socket.socket):
    """A uvicorn server for ``app`` on ``sock`` that leaves signal handling to us."""
    try:
        import uvicorn
    except ImportError as e:
        from ..errors import ConfigError

        raise ConfigError(f"the HTTP server (--metrics-port) needs uvicorn, which is not importable: {e}") from None

    class _Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):  # SIGTERM/SIGINT are handled by server.py
            yield

        def install_signal_handlers(self):  # older uvicorn
            pass

    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(app, host=host, port=port, lifespan="off", access_log=False, log_level="warning",
                            log_config=None, timeout_graceful_shutdown=2)
    return _Server(config)
