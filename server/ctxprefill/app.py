"""The composition root: settings -> the engine (:func:`build_engine`), and the server
around it (:func:`serve`, ``ctxprefill serve``). Nothing else builds either: the
service takes the engine it is given, the settings only describe."""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
from typing import TYPE_CHECKING

import psutil
import torch

from . import __version__
from .checkpoint import load_model_kv_b_proj
from .config import CacheConfig, EngineConfig, ModelShape, check_layers
from .engine.engine import Engine, SequenceSpec
from .engine.request import q_dtype
from .errors import ConfigError
from .settings import (
    ServeSettings,
    check_engine_settings,
    check_serve_settings,
    ineffective_settings,
    layer_prefix,
    resolve_device,
    shard_spec,
)
from .weights import KvBProjWeights, load_kv_b_proj, prepare, random_kv_b_proj, shard_kv_b_proj

if TYPE_CHECKING:  # the server's modules load with the server (an engine alone needs no gRPC)
    from .service.security import Security
    from .service.server import ServerParts
    from .service.tracing import Tracing

log = logging.getLogger("ctxprefill")
#: the weights' loading, shown by default (a child of the lifecycle logger, as the checkpoint loader's)
weights_log = logging.getLogger("ctxprefill.lifecycle.model")

# ------------------------------------------------------------------------------ engine


def layer_weights(s: ServeSettings, shape: ModelShape, layer: int) -> KvBProjWeights:
    """Model layer ``layer``'s prepared kv_b_proj (all of the model's heads)."""
    if s.weights:
        return load_kv_b_proj(s.weights, shape, layer_prefix(s.weights_prefix, layer, s.layers))
    t = random_kv_b_proj(shape, s.kv_b_proj_dtype, s.seed + layer)
    return prepare(s.kv_b_proj_dtype, t["kv_b_proj.weight"], t.get("kv_b_proj.weight_scale_inv"))


def memory_bytes(config: EngineConfig) -> tuple[int, int]:
    """Bytes of the caches (every layer's) and of the workspace."""
    c = config.cache
    return (config.num_layers * c.num_slots * c.bytes_per_slot,
            config.workspace_tokens * (config.shape.kv_lora_rank + config.shape.qk_rope_head_dim) * 2)


def memory_needs(config: EngineConfig) -> str:
    """What the caches and the workspace take, in words, with the flags that size them."""
    c = config.cache
    cache, ws = memory_bytes(config)
    return (f"the cache takes {cache / 2**30:.2f} GiB ({config.num_layers} layer(s) x --num-blocks {c.num_blocks} x "
            f"--block-size {c.block_size} x {c.bytes_per_slot} B) and the workspace {ws / 2**30:.2f} GiB "
            f"(--workspace-tokens {config.workspace_tokens})")


def available_bytes(device: torch.device) -> int | None:
    """Memory free for the caches: the GPU's free memory, or the host's available memory
    (psutil: MemAvailable on Linux)."""
    if device.type == "cuda":
        free: int = torch.cuda.mem_get_info(device)[0]
        return free
    available: int = psutil.virtual_memory().available
    return available


def check_memory(config: EngineConfig, device: torch.device) -> None:
    """Refuse to start (ConfigError naming the flags) when the caches and the workspace
    cannot fit in what the device has free: a clear message instead of an allocator's
    error halfway through the layers, or the kernel's OOM killer on the host."""
    need = sum(memory_bytes(config))
    free = available_bytes(device)
    if free is not None and need > free:
        raise ConfigError(f"{memory_needs(config)}: {need / 2**30:.2f} GiB, and {device} has {free / 2**30:.2f} GiB "
                          f"free; lower --num-blocks, --layers or --workspace-tokens")


def load_weights(s: ServeSettings) -> list[KvBProjWeights]:
    """Each held layer's kv_b_proj, this shard's heads, prepared and checked on the host
    (ConfigError naming the flag or tensor at fault); logged with the time it took."""
    t0 = time.perf_counter()
    shard = shard_spec(s)
    shape = ModelShape(heads=s.heads, softmax_scale=s.softmax_scale)  # the whole model's heads
    check_layers(s.layers, s.first_layer)  # before loading a weight per layer
    if s.model:  # this shard's heads' rows of each layer, read from the checkpoint directory
        weights = load_model_kv_b_proj(s.model, s.first_layer, s.layers, shard.total_heads, shard.shard_index,
                                       shard.num_shards)
    else:
        weights = [layer_weights(s, shape, layer) for layer in range(s.first_layer, s.first_layer + s.layers)]
    if shard.num_shards > 1 and not s.model:  # rows of the full prepared weights: the unsharded worker's, head by head
        weights = [shard_kv_b_proj(w, shard.total_heads, shard.shard_index, shard.num_shards,
                                   shape.qk_nope_head_dim + shape.v_head_dim) for w in weights]
    dtypes = sorted({w.dtype for w in weights})
    if len(dtypes) > 1:
        raise ConfigError(f"--weights: the layers' kv_b_proj weights differ in dtype ({', '.join(dtypes)}); one dtype "
                          f"for all layers")
    if not s.model:  # the checkpoint's loader logs its own ("model loaded")
        weights_log.info("weights loaded", extra={
            "weights": s.weights or f"random(seed={s.seed})", "layers": s.layers, "kv_b_proj_dtype": dtypes[0],
            "seconds": round(time.perf_counter() - t0, 3)})
    return weights


def build_engine(s: ServeSettings, weights: list[KvBProjWeights] | None = None) -> Engine:
    """Validated config + weights (``load_weights``' when not given) -> Engine (raises
    ConfigError with the flag at fault)."""
    shard = shard_spec(s)
    shape = ModelShape(heads=s.heads, softmax_scale=s.softmax_scale)  # the whole model's heads
    if weights is None:
        weights = load_weights(s)
    if shard.num_shards > 1:
        shape = dataclasses.replace(shape, heads=shard.heads)
    config = EngineConfig(
        shape=shape,
        cache=CacheConfig(s.cache_dtype, s.block_size, s.num_blocks, s.k_scale),
        kv_b_proj_dtype=weights[0].dtype,
        prefill_dtype=s.prefill_dtype,
        workspace_tokens=s.workspace_tokens,
        fused=not s.generic,
        unpacked_keys=s.unpacked_keys,
        backend=s.backend,
        num_layers=s.layers,
        first_layer=s.first_layer,
        max_context_token_heads=s.max_context_token_heads,
        cuda_graphs=s.cuda_graphs,
        kv_b_proj_gemm=s.kv_b_proj_gemm,
    )
    device = resolve_device(s.device)
    check_memory(config, device)
    try:
        engine = Engine(config, weights, device)
    except ValueError as e:  # backend selection
        raise ConfigError(f"--backend {s.backend}: {e}") from None
    except (torch.OutOfMemoryError, MemoryError) as e:
        raise ConfigError(f"{memory_needs(config)}: allocating it failed on {device} ({str(e)[:200]})") from None
    log.info(
        "engine ready",
        extra={"device": str(device), "backend": engine.backend.name, "backend_reason": engine.backend_reason,
               "fused_kernels": engine.fused_kernels_active, "cache_dtype": s.cache_dtype,
               "kv_b_proj_dtype": config.kv_b_proj_dtype, "kv_b_proj_gemm": config.kv_b_proj_gemm,
               "prefill_dtype": s.prefill_dtype,
               "layers": f"[{s.first_layer}, {s.first_layer + s.layers})",
               "cache_bytes": config.cache.num_slots * config.cache.bytes_per_slot * s.layers},
    )
    return engine


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
    if q_dtype(cfg) != torch.bfloat16:
        q = torch.zeros((3, H, D), dtype=torch.uint8).view(q_dtype(cfg))
    seqs = [SequenceSpec(2, 2 * bs, blocks), SequenceSpec(1, 0, [])]
    # the first layer's cache and weights: every layer runs the same kernels
    layer = cfg.first_layer
    engine.prefill_context(q, seqs, workspace_tokens=bs, layer=layer)  # two chunks: continuation + merge
    engine.prefill_context(q[:2], seqs[:1], workspace_tokens=min(2 * bs, cfg.workspace_tokens), layer=layer)
    engine.warm_up_backend()  # kernel variants of other chunk shapes (Triton: segment order, grid size)
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def build_and_warm(s: ServeSettings, weights: list[KvBProjWeights] | None = None) -> tuple[Engine, float]:
    t = time.perf_counter()
    engine = build_engine(s, weights)
    warm_up(engine)
    return engine, time.perf_counter() - t


# ------------------------------------------------------------------------------ server

#: how long a thread may hold the GIL while another waits (CPython's default is 5 ms).
#: The event loop (admission, refusals, health) and the engine thread share the GIL; the
#: engine drops it around every torch op and must win it back each time, so with the
#: default a loop busy refusing an overload would add up to 5 ms per op to the engine —
#: and the engine's Python glue as much to every refusal.
GIL_SWITCH_INTERVAL_S = 0.0005


async def build_server(s: ServeSettings, security: Security, tracing: Tracing | None = None) -> ServerParts:
    """The service's parts, wired: metrics, the engine thread, the servicer, the gRPC
    server (interceptors — the RPC spans with ``tracing`` —, PrefillContextService,
    health, reflection). Call on the loop that will serve."""
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection

    from ctxprefill_api import pb, pb_grpc

    from .service.connections import ConnectionCloser
    from .service.engine_worker import EngineWorker
    from .service.interceptors import server_interceptors
    from .service.metrics import Metrics
    from .service.server import ServerParts, grpc_options, memory_limits
    from .service.servicer import SERVICE_NAME, PrefillContextServicer

    metrics = Metrics()
    worker = EngineWorker(metrics, ring_spin_s=s.request_ring_spin_us / 1e6, ring_poll_s=s.request_ring_poll_us / 1e6,
                          ring_overlap=s.request_ring_overlap, request_overlap=s.request_overlap)
    servicer = PrefillContextServicer(s, metrics, worker, s.max_message_bytes, s.queue_size)
    closer = ConnectionCloser()  # the gRPC ports are added once bound
    health_servicer = health.aio.HealthServicer()  # overall "" starts SERVING: the process is live
    await health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
    grpc_server = grpc.aio.server(
        interceptors=server_interceptors(metrics, auth_token=security.token, limits=memory_limits(s), tracing=tracing,
                                         closer=closer),
        options=grpc_options(s),
    )
    pb_grpc.add_PrefillContextServiceServicer_to_server(servicer, grpc_server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, grpc_server)
    reflection.enable_server_reflection([SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], grpc_server)
    metrics.init_grpc_methods(pb.DESCRIPTOR.services_by_name["PrefillContextService"])
    return ServerParts(metrics, worker, servicer, grpc_server, health_servicer, closer)


@dataclasses.dataclass(frozen=True)
class _Served:
    code: int  # the exit code
    engine_ended: bool  # False: a call outlived the wait for the engine thread (EngineWorker.stop)


async def _serve(s: ServeSettings, security: Security, weights: list[KvBProjWeights],
                 tracing: Tracing | None) -> _Served:
    from .service import server

    parts = await build_server(s, security, tracing)
    code = await server.run(s, security, parts, build=lambda: build_and_warm(s, weights))
    return _Served(code, parts.worker.ended)


def serve(settings: ServeSettings) -> int:
    """Run the server until SIGTERM/SIGINT; 0 after a clean drain. ConfigError propagates,
    and every one the settings and the weights can raise comes before a port is bound:
    the weights are loaded (and checked) first; the engine (device memory, kernels) is
    built and warmed up after, while liveness answers."""
    import asyncio

    from .service.exposure import check_exposure
    from .service.logs import lifecycle, setup_logging
    from .service.security import load_security
    from .service.tracing import from_settings

    setup_logging()
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    check_serve_settings(settings)
    check_engine_settings(settings)
    ignored = ineffective_settings(settings)
    if ignored:
        lifecycle.warning("settings without effect", extra={"settings": ignored})
    security = load_security(settings)
    check_exposure(settings, security)  # beyond loopback: a credential or --allow-insecure, before anything starts
    tracing = from_settings(settings.otlp_endpoint, __version__)
    try:
        weights = load_weights(settings)
        served = asyncio.run(_serve(settings, security, weights, tracing))
    finally:
        if tracing is not None:
            tracing.shutdown()  # the spans still batched go out
    if not served.engine_ended:
        # a call outlived the wait (a warm-up's compiles): interpreter shutdown would end the
        # engine thread inside torch's C++ and abort the process (EngineWorker.stop)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(served.code)
    return served.code
