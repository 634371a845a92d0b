"""``ctxprefill serve``'s lifecycle: the gRPC server and the HTTP server, in one event loop
(the parts are built by the composition root, ``ctxprefill.app``).

Start-up (the weights already loaded and checked by ``app.serve``: a weights error
exits before anything listens): bind the gRPC port (PrefillContextService,
``grpc.health.v1`` and reflection) and the metrics port (uvicorn: /metrics, /healthz,
/readyz), so that liveness answers at once; then build the engine (cache, backend) and run a
warm-up request through it on the engine thread, so that kernels are built or
compiled before the first real request. Only then is the server ready: health
``ctxprefill.v1.PrefillContextService`` = SERVING, ``/readyz`` = 200. Until then the
service answers UNAVAILABLE. The overall health ("") is SERVING while the process
serves (liveness).

Shutdown (SIGTERM or SIGINT): readiness goes NOT_SERVING (health and /readyz), new
requests get UNAVAILABLE, admitted ones (running or queued) get ``--grace-seconds`` to
finish (a second signal cuts the grace short), the gRPC server stops, then the HTTP
server, and ``run`` returns 0.

Logs are JSON lines on stderr (``logs.py``); quiet by default (the CLI's ``--log-level
WARNING``) except for the lifecycle lines: listening (bound ports), serving (device,
backend, dtypes, ...), draining, stopped.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import signal
import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2

from .. import __version__
from ..engine.engine import Engine
from ..errors import ConfigError
from ..settings import ServeSettings
from .connections import ConnectionCloser
from .engine_worker import EngineWorker
from .exposure import check_exposure, describe_exposure, metrics_host
from .http import HttpApp, bind_socket, make_uvicorn_server, rate_limit_logs
from .interceptors import MemoryLimits
from .logs import lifecycle
from .metrics import Metrics
from .security import Security
from .servicer import SERVICE_NAME, PrefillContextServicer

log = logging.getLogger("ctxprefill.service")


@dataclasses.dataclass
class ServerParts:
    """What ``run`` serves with, wired by the composition root."""

    metrics: Metrics
    worker: EngineWorker
    servicer: PrefillContextServicer
    grpc_server: grpc.aio.Server
    health: health.aio.HealthServicer  # ctxprefill.v1.PrefillContextService: NOT_SERVING until ready
    closer: ConnectionCloser = dataclasses.field(default_factory=ConnectionCloser)  # told the gRPC port once bound


def memory_limits(s: ServeSettings) -> MemoryLimits:
    """What the memory interceptor enforces (``interceptors/memory.py``)."""
    answer = min(s.max_answer_bytes, s.max_message_bytes)
    return MemoryLimits(max_message_bytes=s.max_message_bytes, max_inflight_bytes=s.max_inflight_bytes,
                        max_answer_bytes=answer, receive_timeout_s=s.receive_timeout_s,
                        send_timeout_s=s.send_timeout_s)


#: streams one connection may have open at once (a client's further calls wait for one to end)
MAX_CONCURRENT_STREAMS = 256
#: seconds exit waits for the engine thread to end (after a second signal: the shorter one)
ENGINE_STOP_S, ENGINE_STOP_FORCED_S = 5.0, 0.5


def grpc_options(s: ServeSettings) -> list[tuple[str, int]]:
    """The gRPC server's channel arguments. Flow control: gRPC opens a stream's window to
    a whole message only once the message is read (``interceptors/memory.py`` decides
    when); until then a stream may send the initial window, 64 KiB with BDP probing off
    (with it on, gRPC grows the initial window of every stream to tens of MiB, which a
    client can fill on streams never read)."""
    return [
        ("grpc.max_send_message_length", s.max_message_bytes),
        ("grpc.max_receive_message_length", s.max_message_bytes),
        ("grpc.http2.bdp_probe", 0),
        ("grpc.max_concurrent_streams", MAX_CONCURRENT_STREAMS),
        ("grpc.so_reuseport", 0),  # a port in use is an error, not a silent second listener
        # keepalive: a peer that stops reading the connection stops acknowledging pings; its
        # connection is closed and its calls end, answers it never took included
        ("grpc.keepalive_time_ms", max(1, round(s.keepalive_time_s * 1000))),
        ("grpc.keepalive_timeout_ms", max(1, round(s.keepalive_timeout_s * 1000))),
        # what closes the connection in grpcio 1.85: any ping's timeout (1 min when keepalive is on)
        ("grpc.http2.ping_timeout_ms", max(1, round(s.keepalive_timeout_s * 1000))),
        ("grpc.keepalive_permit_without_calls", 1),  # idle connections too: a vanished peer's is closed
        ("grpc.http2.max_pings_without_data", 0),  # no limit while no data goes out (idle, or a closed window)
    ]


def grpc_address(host: str, port: int) -> str:
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


async def run(s: ServeSettings, security: Security, parts: ServerParts,
              build: Callable[[], tuple[Engine, float]]) -> int:
    """Serve until SIGTERM/SIGINT; 0 after a clean drain. ``build`` makes the engine (and
    warms it up) on the engine thread: ``(engine, seconds)``. ConfigError propagates."""
    loop = asyncio.get_running_loop()
    t_start = time.perf_counter()
    server, servicer, worker = parts.grpc_server, parts.servicer, parts.worker
    address = grpc_address(s.host, s.port)
    exposure = check_exposure(s, security)  # ConfigError where it needs --allow-insecure
    rate_limit_logs()  # a flood of connections must not flood the log too

    def bind(target: str) -> int:
        if security.credentials is not None:
            return server.add_secure_port(target, security.credentials)
        return server.add_insecure_port(target)

    try:
        grpc_port = bind(address)
        parts.closer.ports.add(grpc_port)
    except RuntimeError as e:
        raise ConfigError(f"--port {s.port}: cannot bind gRPC to {address}: {e}") from None
    if s.unix_socket:  # same-host callers (containers mounting it); served like the port
        try:
            bind(f"unix:{s.unix_socket}")
        except RuntimeError as e:
            raise ConfigError(f"--unix-socket {s.unix_socket}: cannot bind gRPC to it (a file that is not a socket "
                              f"is never replaced; the path must be at most 107 bytes): {e}") from None
    http_host = metrics_host(s)
    try:
        sock = bind_socket(http_host, s.metrics_port)
    except OSError as e:
        raise ConfigError(f"--metrics-port {s.metrics_port}: cannot bind {http_host}:{s.metrics_port}: {e}") from None
    metrics_port = sock.getsockname()[1]
    app = HttpApp(parts.metrics, is_ready=lambda: servicer.state == servicer.READY, state=lambda: servicer.state)
    http = make_uvicorn_server(app, sock)

    stop = asyncio.Event()
    force = asyncio.Event()

    def on_signal(signame: str) -> None:
        if stop.is_set():
            lifecycle.info("second signal: cutting the grace period short", extra={"signal": signame})
            force.set()
        else:
            lifecycle.info("signal received: draining", extra={"signal": signame})
            stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, on_signal, sig.name)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread / platform
            pass

    await server.start()
    http_task = asyncio.create_task(http.serve(sockets=[sock]), name="uvicorn")
    # one line says who can reach what; beyond loopback without credentials it is a warning
    lifecycle.log(logging.WARNING if exposure.insecure else logging.INFO, "listening", extra={
        "grpc_port": grpc_port, "metrics_port": metrics_port, "host": s.host, "metrics_host": http_host,
        "unix_socket": s.unix_socket,
        "transport": security.transport, "auth_token": security.token is not None,
        "exposure": describe_exposure(exposure, grpc_address(s.host, grpc_port), grpc_address(http_host, metrics_port)),
    })

    try:
        # -- build the engine and warm it up, on the engine thread (it owns the device)
        built = worker.submit(build)
        stop_wait = asyncio.ensure_future(stop.wait())
        await asyncio.wait({built, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
        stop_wait.cancel()
        if not built.done():
            lifecycle.info("stopped before the engine was ready")
            built.cancel()
            return 0
        engine, build_s = built.result()  # ConfigError propagates (after the finally below)

        servicer.attach_engine(engine)
        # Everything made so far (modules, the engine, grpc) lives as long as the process:
        # out of the collector's sight, so that a full collection while serving scans only
        # what requests made (a gen-2 pass over torch's and grpc's objects stalls the event
        # loop for tens of milliseconds).
        gc.collect()
        gc.freeze()
        servicer.set_ready()
        await parts.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        cfg, info = engine.config, servicer.info
        assert info is not None
        lifecycle.info("serving", extra={
            "grpc_port": grpc_port, "metrics_port": metrics_port, "host": s.host, "version": __version__,
            "instance_id": engine.instance_id, "device": info.device, "backend": engine.backend.name,
            "backend_reason": engine.backend_reason, "fused_kernels": engine.fused_kernels_active,
            "unpacked_keys": engine.unpacked_keys_active, "cuda_graphs": engine.cuda_graphs_active,
            "cuda_graphs_reason": engine.cuda_graphs_reason,
            "mps_client": info.mps_client if info.HasField("mps_client") else None,
            "heads": cfg.shape.heads, "cache_dtype": cfg.cache.dtype,
            "block_size": cfg.cache.block_size,
            "num_blocks": cfg.cache.num_blocks, "k_scale": cfg.cache.k_scale,
            "kv_b_proj_dtype": cfg.kv_b_proj_dtype, "kv_b_proj_gemm": cfg.kv_b_proj_gemm,
            "prefill_dtype": cfg.prefill_dtype, "workspace_tokens": cfg.workspace_tokens,
            "weights": info.weights_source,
            "startup_s": round(time.perf_counter() - t_start, 3), "build_and_warmup_s": round(build_s, 3),
        })

        await stop.wait()
        # -- drain
        servicer.start_draining()
        await parts.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
        lifecycle.info("draining", extra={"in_flight": servicer.in_flight, "grace_seconds": s.grace_seconds})
        t_drain = time.perf_counter()
        # New requests already get UNAVAILABLE from the servicer; wait for the admitted ones
        # (there is no await between a handler's state check and its admission, so none slips
        # through), then stop the gRPC server with a short grace so that their answers go out
        # and long-lived streams (health Watch) end instead of holding the whole grace period.
        deadline = time.monotonic() + s.grace_seconds
        while servicer.in_flight and time.monotonic() < deadline and not force.is_set():
            await asyncio.sleep(0.02)
        await server.stop(0 if force.is_set() else min(1.0, max(0.0, deadline - time.monotonic())))
        lifecycle.info("stopped", extra={"drain_s": round(time.perf_counter() - t_drain, 3),
                                         "left_running": servicer.in_flight})
        return 0
    finally:
        servicer.start_draining()
        await server.stop(0)
        http.should_exit = True
        try:
            await asyncio.wait_for(http_task, timeout=5)
        except Exception:  # noqa: BLE001 - shutting down anyway (a timeout included)
            http_task.cancel()
        # the engine thread ends before the process does (EngineWorker.stop says why)
        wait_s = ENGINE_STOP_FORCED_S if force.is_set() else ENGINE_STOP_S
        if not await asyncio.to_thread(worker.stop, wait_s):
            lifecycle.warning("engine thread still running at exit: exiting without interpreter shutdown",
                              extra={"waited_s": wait_s})
        for h in logging.getLogger().handlers:
            h.flush()
