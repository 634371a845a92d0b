"""What the server says about itself: GetServerInfo's answer (built once, when the engine
is attached) and the shared-memory regions' status messages."""

from __future__ import annotations

import sys
from typing import Any

import torch

from ctxprefill_api import pb

from .. import __version__
from ..engine.engine import Engine
from ..mps import mps_client
from ..settings import ServeSettings, ShardSpec, shard_spec
from .shared_memory import CUDA, SYSTEM, SharedMemoryRegistry

_KIND_PB = {SYSTEM: pb.SHARED_MEMORY_KIND_SYSTEM, CUDA: pb.SHARED_MEMORY_KIND_CUDA}


def _cuda_index(device: torch.device) -> int:
    """A CUDA device's index (the current device for a bare ``cuda``)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        idx = _cuda_index(device)
        return f"cuda:{idx} ({torch.cuda.get_device_name(idx)})"
    return str(device)


def device_mps_client(device: torch.device) -> bool | None:
    """Whether the server's work on ``device`` runs through MPS (:func:`ctxprefill.mps.mps_client`);
    None on a CPU."""
    return mps_client(_cuda_index(device)) if device.type == "cuda" else None


def versions() -> pb.Versions:
    cudnn = ""
    try:
        if torch.backends.cudnn.is_available():
            cudnn = str(torch.backends.cudnn.version())
    except Exception:  # noqa: BLE001
        cudnn = ""
    return pb.Versions(server=__version__, torch=torch.__version__, cuda=torch.version.cuda or "", cudnn=cudnn,
                       python=".".join(map(str, sys.version_info[:3])))


def server_info(engine: Engine, settings: ServeSettings, max_message_bytes: int, shm: SharedMemoryRegistry,
                request_ring_max: int) -> pb.GetServerInfoResponse:
    cfg, s = engine.config, settings
    shard = shard_spec(s) if s.num_shards > 1 else ShardSpec(0, 1, cfg.shape.heads)
    shape, cache = cfg.shape, cfg.cache
    w = engine.weights
    scale_format = "" if w.scale is None else ("tensor" if w.scale.dim() == 0 or w.scale.numel() == 1 else "block")
    return pb.GetServerInfoResponse(
        instance_id=engine.instance_id,
        num_heads=shape.heads, kv_lora_rank=shape.kv_lora_rank, qk_nope_head_dim=shape.qk_nope_head_dim,
        qk_rope_head_dim=shape.qk_rope_head_dim, v_head_dim=shape.v_head_dim, softmax_scale=shape.scale,
        cache_dtype=cache.dtype, block_size=cache.block_size, num_blocks=cache.num_blocks,
        k_scale=cache.k_scale, bytes_per_slot=cache.bytes_per_slot,
        kv_b_proj_dtype=w.dtype, kv_b_proj_scale_format=scale_format,
        weights_source=(s.model or s.weights or f"random(seed={s.seed})") + (
            f" [heads {shard.head_start}:{shard.head_end} of {shard.total_heads}]" if shard.num_shards > 1 else ""),
        prefill_dtype=cfg.prefill_dtype,
        attention_backend=engine.backend.name, attention_backend_supports_out=bool(engine.backend.caps.supports_out),
        fused_kernels_active=bool(engine.fused_kernels_active), fused_kernels_reason=engine.fused_kernels_reason,
        workspace_tokens=cfg.workspace_tokens, device=describe_device(engine.device), versions=versions(),
        max_message_bytes=max_message_bytes,
        shard_index=shard.shard_index, num_shards=shard.num_shards, total_heads=shard.total_heads,
        shared_memory_kinds=[_KIND_PB[k] for k in shm.kinds],
        shared_memory_max_regions=shm.max_regions if shm.enabled else 0,
        shared_memory_max_bytes=shm.max_bytes if shm.enabled else 0,
        request_ring_max=request_ring_max,
        request_ring_stream_order=bool(request_ring_max) and settings.request_ring_stream_order,
        num_layers=cfg.num_layers, first_layer=cfg.first_layer, unpacked_keys=engine.unpacked_keys_active,
        mps_client=device_mps_client(engine.device),
    )


def region_pb(d: dict[str, Any]) -> pb.SharedMemoryRegion:
    return pb.SharedMemoryRegion(name=d["name"], kind=_KIND_PB[d["kind"]], key=d["key"], offset=d["offset"],
                                 byte_size=d["byte_size"], device=d["device"],
                                 requests_in_flight=d["requests_in_flight"], pinned=d["pinned"])
