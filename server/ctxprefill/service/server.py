"""``ctxprefill serve``: the gRPC server and the HTTP server, in one event loop.

Start-up: bind the gRPC port (PrefillContextService, ``grpc.health.v1`` and
reflection) and the metrics port (uvicorn: /metrics, /healthz, /readyz), so that
liveness answers at once; then build the engine (weights, cache, backend) and run a
warm-up request through it on the engine thread, so that kernels are built or
compiled before the first real request. Only then is the server ready: health
``ctxprefill.v1.PrefillContextService`` = SERVING, ``/readyz`` = 200. Until then the
service answers UNAVAILABLE. The overall health ("") is SERVING while the process
serves (liveness).

Shutdown (SIGTERM or SIGINT): readiness goes NOT_SERVING (health and /readyz), new
requests get UNAVAILABLE, admitted ones (running or queued) get ``--grace-seconds`` to
finish (a second signal cuts the grace short), the gRPC server stops, then the HTTP
server, and ``serve`` returns 0.

Security (``security.py``): ``--tls-cert``/``--tls-key`` make the gRPC port TLS only,
``--tls-client-ca`` requires client certificates (mutual TLS), and a bearer token
(``--auth-token-file`` or ``CTXPREFILL_AUTH_TOKEN``) is checked by the interceptor.

Logs are JSON lines on stderr; quiet by default (the CLI's ``--log-level WARNING``)
except for the lifecycle lines: listening (bound ports), serving (device, backend,
dtypes, ...), draining, stopped.
"""

from __future__ import annotations

import asyncio
import datetime
import gc
import json
import logging
import os
import signal
import sys
import time

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ctxprefill_api import pb_grpc

from .. import __version__
from ..engine.engine import Engine, SequenceSpec
from ..config import CacheConfig, EngineConfig, ModelShape
from ..errors import ConfigError
from ..ops.fp8 import FP8
from ..settings import ServeSettings, build_engine, resolve_device, shard_spec
from .http import HttpApp, bind_socket, make_uvicorn_server
from .interceptors import ServerInterceptor, request_id_var
from .metrics import Metrics
from .security import Security, load_security
from .engine_worker import EngineWorker
from .servicer import METHODS, SERVICE_NAME, PrefillContextServicer

log = logging.getLogger("ctxprefill.service")
lifecycle = logging.getLogger("ctxprefill.lifecycle")

HEALTH_SERVICE_NAME = health.SERVICE_NAME


# ------------------------------------------------------------------------------ logging

_STD_ATTRS = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, request_id (when set), the
    record's ``extra`` fields, and ``exc`` (the traceback) when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        d = {
            "ts": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc)
            .isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        rid = getattr(record, "request_id", "") or request_id_var.get()
        if rid:
            d["request_id"] = rid
        for k, v in record.__dict__.items():
            if k not in _STD_ATTRS and k not in d and not k.startswith("_"):
                d[k] = v if isinstance(v, (str, int, float, bool, type(None))) else str(v)
        if record.exc_info:
            d["exc"] = self.formatException(record.exc_info)
        return json.dumps(d, ensure_ascii=False)


def setup_logging() -> None:
    """JSON lines on the root handlers (installs one on stderr if there is none); the
    lifecycle lines are always shown, the rest follows the root level."""
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(level=logging.WARNING)
    for h in root.handlers:
        h.setFormatter(JsonFormatter())
    if lifecycle.getEffectiveLevel() > logging.INFO:
        lifecycle.setLevel(logging.INFO)


# ------------------------------------------------------------------------------ engine


def warm_up(engine: Engine) -> None:
    """Requests that run every stage once (gather, cast, kv_b_proj, pack, attention, merge
    of a continuation chunk, rows without context, and the single-chunk path) on the
    cache as it is (all zero at start: nothing is written), so that kernels are built,
    compiled or autotuned before readiness. Results and stats are discarded."""
    cfg = engine.config
    bs, nb = cfg.cache.block_size, cfg.cache.num_blocks
    H, D = cfg.shape.heads, cfg.shape.qk_head_dim
    blocks = [0, 1 % nb]
    q = torch.zeros((3, H, D), dtype=torch.bfloat16)
    if engine.q_dtype == FP8:
        q = torch.zeros((3, H, D), dtype=torch.uint8).view(FP8)
    seqs = [SequenceSpec(2, 2 * bs, blocks), SequenceSpec(1, 0, [])]
    # the first layer's cache and weights: every layer runs the same kernels
    layer = cfg.first_layer
    engine.prefill_context(q, seqs, workspace_tokens=bs, layer=layer)  # two chunks: continuation + merge
    engine.prefill_context(q[:2], seqs[:1], workspace_tokens=min(2 * bs, cfg.workspace_tokens), layer=layer)
    engine.warm_up_backend()  # kernel variants of other chunk shapes (Triton: segment order, grid size)
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def _build_and_warm(settings: ServeSettings) -> tuple[Engine, float]:
    t = time.perf_counter()
    engine = build_engine(settings)
    warm_up(engine)
    return engine, time.perf_counter() - t


# ------------------------------------------------------------------------------ serve


def _grpc_address(host: str, port: int) -> str:
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


def _check_settings(s: ServeSettings) -> None:
    if not (s.grace_seconds >= 0):
        raise ConfigError(f"--grace-seconds must be >= 0, got {s.grace_seconds}")
    if not (4 << 20 <= s.max_message_bytes <= 2**31 - 1):
        raise ConfigError(f"--max-message-bytes must be in [{4 << 20}, {2**31 - 1}], got {s.max_message_bytes}")
    if s.queue_size < 1:
        raise ConfigError(f"--queue-size must be >= 1, got {s.queue_size}")
    for name in ("port", "metrics_port"):
        v = getattr(s, name)
        if not 0 <= v <= 65535:
            raise ConfigError(f"--{name.replace('_', '-')} must be in [0, 65535], got {v}")


def _precheck_engine_settings(s: ServeSettings) -> None:
    """The engine's cheap configuration checks, before any port is bound (the full build,
    weights included, runs after binding so that liveness answers while it loads)."""
    shape = ModelShape(heads=s.heads, softmax_scale=s.softmax_scale)
    cache = CacheConfig(s.cache_dtype, s.block_size, s.num_blocks, s.k_scale)
    EngineConfig(shape=shape, cache=cache, kv_b_proj_dtype="bf16" if s.weights else s.kv_b_proj_dtype,
                 prefill_dtype=s.prefill_dtype, workspace_tokens=s.workspace_tokens, fused=not s.generic,
                 backend=s.backend)
    resolve_device(s.device)
    shard_spec(s)  # --shard-index / --num-shards against --heads
    if s.weights and not os.path.isfile(s.weights):
        raise ConfigError(f"--weights: no such file {s.weights!r}")


#: how long a thread may hold the GIL while another waits (CPython's default is 5 ms).
#: The event loop (admission, refusals, health) and the engine thread share the GIL; the
#: engine drops it around every torch op and must win it back each time, so with the
#: default a loop busy refusing an overload would add up to 5 ms per op to the engine —
#: and the engine's Python glue as much to every refusal.
GIL_SWITCH_INTERVAL_S = 0.0005


def serve(settings: ServeSettings) -> int:
    """Run the server until SIGTERM/SIGINT; 0 after a clean drain. ConfigError propagates."""
    setup_logging()
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    _check_settings(settings)
    _precheck_engine_settings(settings)
    security = load_security(settings)
    return asyncio.run(_serve(settings, security))


async def _serve(s: ServeSettings, security: Security | None = None) -> int:
    security = security or Security(None, None, "plaintext")
    loop = asyncio.get_running_loop()
    t_start = time.perf_counter()
    metrics = Metrics()
    worker = EngineWorker(metrics, ring_spin_s=s.request_ring_spin_us / 1e6, ring_poll_s=s.request_ring_poll_us / 1e6,
                          ring_overlap=s.request_ring_overlap)
    servicer = PrefillContextServicer(s, metrics, worker, s.max_message_bytes, s.queue_size)
    health_servicer = health.aio.HealthServicer()  # overall "" starts SERVING: the process is live
    await health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)

    server = grpc.aio.server(
        interceptors=[ServerInterceptor(metrics, auth_token=security.token)],
        options=[
            ("grpc.max_send_message_length", s.max_message_bytes),
            ("grpc.max_receive_message_length", s.max_message_bytes),
            ("grpc.so_reuseport", 0),  # a port in use is an error, not a silent second listener
        ],
    )
    pb_grpc.add_PrefillContextServiceServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([SERVICE_NAME, HEALTH_SERVICE_NAME, reflection.SERVICE_NAME], server)
    metrics.init_grpc_methods(SERVICE_NAME, METHODS)

    address = _grpc_address(s.host, s.port)
    try:
        if security.credentials is not None:
            grpc_port = server.add_secure_port(address, security.credentials)
        else:
            grpc_port = server.add_insecure_port(address)
    except RuntimeError as e:
        raise ConfigError(f"--port {s.port}: cannot bind gRPC to {address}: {e}") from None
    try:
        sock = bind_socket(s.host, s.metrics_port)
    except OSError as e:
        raise ConfigError(f"--metrics-port {s.metrics_port}: cannot bind {s.host}:{s.metrics_port}: {e}") from None
    metrics_port = sock.getsockname()[1]
    app = HttpApp(metrics, is_ready=lambda: servicer.state == servicer.READY, state=lambda: servicer.state)
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
    lifecycle.info("listening", extra={"grpc_port": grpc_port, "metrics_port": metrics_port, "host": s.host,
                                       "transport": security.transport, "auth_token": security.token is not None})

    try:
        # -- build the engine and warm it up, on the engine thread (it owns the device)
        build = worker.submit(lambda: _build_and_warm(s))
        stop_wait = asyncio.ensure_future(stop.wait())
        await asyncio.wait({build, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
        stop_wait.cancel()
        if not build.done():
            lifecycle.info("stopped before the engine was ready")
            build.cancel()
            return 0
        engine, build_s = build.result()  # ConfigError propagates (after the finally below)

        servicer.attach_engine(engine)
        # Everything made so far (modules, the engine, grpc) lives as long as the process:
        # out of the collector's sight, so that a full collection while serving scans only
        # what requests made (a gen-2 pass over torch's and grpc's objects stalls the event
        # loop for tens of milliseconds).
        gc.collect()
        gc.freeze()
        servicer.set_ready()
        await health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        cfg = engine.config
        lifecycle.info("serving", extra={
            "grpc_port": grpc_port, "metrics_port": metrics_port, "host": s.host, "version": __version__,
            "instance_id": engine.instance_id, "device": servicer._info.device, "backend": engine.backend.name,
            "backend_reason": engine.backend_reason, "fused_kernels": engine.fused_kernels_active,
            "unpacked_keys": engine.unpacked_keys_active, "heads": cfg.shape.heads, "cache_dtype": cfg.cache.dtype,
            "block_size": cfg.cache.block_size,
            "num_blocks": cfg.cache.num_blocks, "k_scale": cfg.cache.k_scale,
            "kv_b_proj_dtype": cfg.kv_b_proj_dtype, "prefill_dtype": cfg.prefill_dtype,
            "workspace_tokens": cfg.workspace_tokens, "weights": servicer._info.weights_source,
            "startup_s": round(time.perf_counter() - t_start, 3), "build_and_warmup_s": round(build_s, 3),
        })

        await stop.wait()
        # -- drain
        servicer.start_draining()
        await health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
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
        except (asyncio.TimeoutError, Exception):  # noqa: BLE001 - shutting down anyway
            http_task.cancel()
        worker.stop()
        for h in logging.getLogger().handlers:
            h.flush()
