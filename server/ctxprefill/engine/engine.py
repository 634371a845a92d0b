"""The engine: owns the cache, the weights, the attention backend and the workspace,
validates a request completely on the host, then runs the chunk loop.

Requests are serialized (one at a time on the device: the workspace is shared);
the service's queue decides who goes next.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
import uuid
from collections import Counter
from collections.abc import Sequence

import numpy as np
import torch

from ..backends import registry
from ..backends.base import AttentionBackend
from ..cache import PagedLatentCache
from ..config import EngineConfig
from ..errors import InvalidArgument, OutOfRange
from ..ops import _cuda
from ..ops.fp8 import FP8
from ..ops.pack import fused_mla_kv_concat
from ..weights import KvBProjWeights
from .loop import LoopInputs, Observer, PendingLoop, keys_apart, keys_apart_wanted, start_chunk_loop
from .plan import ContextChunk, plan_chunks, validate_plan


#: entries of the padded block-table matrix built per request (sequences x the longest
#: used table): 16 Mi int32 = 64 MiB; a larger request must be split by the caller
MAX_BLOCK_TABLE_ENTRIES = 1 << 24


@dataclasses.dataclass(frozen=True)
class SequenceSpec:
    query_len: int
    context_len: int
    block_table: Sequence[int] = ()


@dataclasses.dataclass
class PrefillStats:
    chunks: list[ContextChunk]
    launches: Counter
    path: str  # "fused" | "generic"
    fp8_path: dict[str, str]
    stage_ns: dict[str, int]
    total_ns: int
    context_tokens: int
    query_tokens: int
    span_ns: int = 0  # first stage's start to last stage's end, on the device's clock on a GPU
    unpacked_keys: bool = False  # fused bf16: attention read k_nope / k_pe where they lie, no pack


@dataclasses.dataclass
class PrefillResult:
    out: torch.Tensor  # [Tq, H, V] bf16
    lse: torch.Tensor  # [H, Tq] float32, natural log
    stats: PrefillStats


class PendingPrefill:
    """A request whose device work is queued (:meth:`Engine.prefill_context_start`).
    ``out`` / ``lse`` are its result tensors, final once the queued work is done:
    work queued on the same stream after this point (e.g. copying them elsewhere) sees
    them complete. :meth:`result` waits for the request only and returns its result
    with the stats; call it once."""

    def __init__(self, engine: "Engine", pending: PendingLoop, stats: dict):
        self._engine, self._pending, self._stats = engine, pending, stats
        self.out, self.lse = pending.out, pending.lse

    def result(self) -> PrefillResult:
        with self._engine._on_device():
            r = self._pending.finish()
        stats = PrefillStats(**self._stats, launches=r.launches, stage_ns=r.stage_ns, total_ns=r.total_ns,
                             span_ns=r.span_ns, unpacked_keys=r.unpacked_keys)
        return PrefillResult(r.out, r.lse, stats)


class Engine:
    """``weights``: one ``KvBProjWeights`` per layer held (``config.layers``), or a single
    one for a one-layer engine. Each layer has its own cache; the workspace, the backend
    and the lock are shared (a request runs one layer)."""

    def __init__(self, config: EngineConfig, weights: KvBProjWeights | Sequence[KvBProjWeights],
                 device: str | torch.device = "cpu", backend: AttentionBackend | None = None):
        per_layer = [weights] if isinstance(weights, KvBProjWeights) else list(weights)
        if len(per_layer) != config.num_layers:
            raise ValueError(f"{len(per_layer)} kv_b_proj weights for {config.num_layers} layers")
        dtypes = {w.dtype for w in per_layer}
        if len(dtypes) != 1:
            raise ValueError(f"the layers' kv_b_proj weights differ in dtype ({', '.join(sorted(dtypes))})")
        if per_layer[0].dtype != config.kv_b_proj_dtype:
            config = dataclasses.replace(config, kv_b_proj_dtype=per_layer[0].dtype)
        self.config = config
        self.device = torch.device(device)
        shape = config.shape
        n = shape.heads * (shape.qk_nope_head_dim + shape.v_head_dim)
        for layer, w in zip(config.layers, per_layer):
            if tuple(w.weight.shape) != (n, shape.kv_lora_rank):
                raise ValueError(f"layer {layer}: kv_b_proj weight shape {tuple(w.weight.shape)} != "
                                 f"[{n}, {shape.kv_lora_rank}]")
        self.layer_weights = [w.to(self.device) for w in per_layer]
        self.caches = [PagedLatentCache(config.cache, self.device, shape.kv_lora_rank, shape.qk_rope_head_dim)
                       for _ in per_layer]
        self.q_dtype = FP8 if config.prefill_dtype == "fp8" else torch.bfloat16
        if backend is None:
            # auto on a GPU: time the candidates on a chunk like the ones this engine will run
            # (its workspace of keys, capped at 16k to bound the probe's memory, under 1,024
            # queries); on a CPU, or with a named backend, no probe. Where the fused path reads
            # K apart (bf16 prefill), a backend that cannot is timed with the K pack it needs.
            probe = None
            if config.backend == "auto" and self.device.type == "cuda":
                apart = keys_apart_wanted(config.fused, config.unpacked_keys, config.prefill_dtype == "fp8")
                probe = registry.ProbeShape(heads=shape.heads, q_tokens=min(1024, config.workspace_tokens),
                                            k_tokens=min(16384, config.workspace_tokens),
                                            pack=fused_mla_kv_concat if apart else None)
            with self._on_device():
                backend, self.backend_reason = registry.create(config.backend, self.device, self.q_dtype,
                                                               probe=probe)
        else:
            self.backend_reason = "given"
        self.backend = backend
        width = shape.kv_lora_rank + shape.qk_rope_head_dim
        self.workspace = torch.empty(config.workspace_tokens * width * 2, dtype=torch.uint8, device=self.device)
        self.instance_id = uuid.uuid4().hex
        self._lock = threading.Lock()

    def _on_device(self):
        """Make the engine's GPU the current one: Triton launches and CUDA events use the
        current device, which on a worker serving cuda:1 is not the default cuda:0."""
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    # -- facts ----------------------------------------------------------------------
    @property
    def fused_kernels_active(self) -> bool:
        """Fused path selected and its compiled kernels in use on this device."""
        return self.config.fused and self.device.type == "cuda" and _cuda.load() is not None

    @property
    def unpacked_keys_active(self) -> bool:
        """The fused path packs no K for this engine's requests (``loop.keys_apart``, which
        the chunk loop asks per request)."""
        cfg = self.config
        return keys_apart(self.backend, cfg.fused, cfg.unpacked_keys, cfg.prefill_dtype == "fp8")

    # -- layers -----------------------------------------------------------------------
    @property
    def weights(self) -> KvBProjWeights:
        """The first layer's kv_b_proj (a one-layer engine's only one)."""
        return self.layer_weights[0]

    @property
    def cache(self) -> PagedLatentCache:
        """The first layer's cache (a one-layer engine's only one)."""
        return self.caches[0]

    @property
    def cache_slots_used(self) -> int:
        """Slots written at least once, over every layer's cache."""
        return sum(c.slots_used for c in self.caches)

    # -- cache ------------------------------------------------------------------------
    def write_cache(self, slot_mapping: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
                    layer: int | None = None) -> int:
        cache = self.caches[self.config.layer_position(layer)]
        with self._lock, self._on_device():
            return cache.write(slot_mapping, kv_c, k_pe)

    def warm_up_backend(self) -> None:
        """The attention backend's own warm-up (kernel variants no warm-up request reaches)."""
        with self._lock, self._on_device():
            self.backend.warm_up(self.device, self.config.shape.heads, self.q_dtype)

    def read_cache(self, slot_mapping: torch.Tensor, layer: int | None = None) -> torch.Tensor:
        cache = self.caches[self.config.layer_position(layer)]
        with self._lock, self._on_device():
            return cache.read(slot_mapping)

    # -- validation -------------------------------------------------------------------
    def _check_request(self, q: torch.Tensor, seqs: Sequence[SequenceSpec], workspace_tokens: int) -> np.ndarray:
        """Checks everything about a request on the host; returns the int32 block table (host)."""
        shape, cache = self.config.shape, self.config.cache
        if workspace_tokens < cache.block_size:
            raise InvalidArgument("workspace_tokens", f"{workspace_tokens} is less than one block ({cache.block_size})")
        if workspace_tokens > self.config.workspace_tokens:
            raise InvalidArgument(
                "workspace_tokens", f"{workspace_tokens} exceeds the server's workspace ({self.config.workspace_tokens})"
            )
        if q.dtype != self.q_dtype:
            raise InvalidArgument(
                "q", f"dtype {q.dtype} does not match the server's prefill dtype {self.config.prefill_dtype} "
                     f"(expects {self.q_dtype})"
            )
        if q.dim() != 3 or q.shape[1] != shape.heads or q.shape[2] != shape.qk_head_dim:
            raise InvalidArgument("q", f"shape {list(q.shape)} is not [Tq, {shape.heads}, {shape.qk_head_dim}]")
        total_q = 0
        max_blocks = 0
        for i, s in enumerate(seqs):
            if s.query_len < 0:
                raise InvalidArgument(f"sequences[{i}].query_len", f"must be >= 0, got {s.query_len}")
            if s.context_len < 0:
                raise InvalidArgument(f"sequences[{i}].context_len", f"must be >= 0, got {s.context_len}")
            need = math.ceil(s.context_len / cache.block_size)
            if len(s.block_table) < need:
                raise InvalidArgument(
                    f"sequences[{i}].block_table",
                    f"has {len(s.block_table)} blocks, context_len {s.context_len} needs {need} of {cache.block_size}",
                )
            total_q += s.query_len
            max_blocks = max(max_blocks, need)
        if total_q != q.shape[0]:
            raise InvalidArgument("sequences", f"query_len values sum to {total_q} but q has {q.shape[0]} rows")
        if len(seqs) * max_blocks > MAX_BLOCK_TABLE_ENTRIES:
            raise InvalidArgument(
                "sequences", f"{len(seqs)} sequences with up to {max_blocks} blocks each exceed "
                             f"{MAX_BLOCK_TABLE_ENTRIES} block-table entries per request; split the request")
        # numpy, not torch.as_tensor, for the Python lists: 1,024 blocks (64k tokens) took
        # ~140 µs through torch and ~25 µs this way, host time of every request
        bt = np.zeros((len(seqs), max(max_blocks, 1)), dtype=np.int32)
        for i, s in enumerate(seqs):
            need = math.ceil(s.context_len / cache.block_size)
            if need:
                table = s.block_table[:need]  # a list, tuple, numpy array (from validation) or tensor
                if isinstance(table, torch.Tensor):
                    row = table.to("cpu", torch.int64).numpy()
                else:
                    row = np.asarray(table, dtype=np.int64)
                bad = (row < 0) | (row >= cache.num_blocks)
                if bad.any():
                    j = int(np.flatnonzero(bad)[0])
                    raise OutOfRange(
                        f"sequences[{i}].block_table[{j}]", f"block {int(row[j])} is outside [0, {cache.num_blocks})"
                    )
                bt[i, :need] = row
        return bt

    # -- the request ------------------------------------------------------------------
    def prefill_context(
        self,
        q: torch.Tensor,
        sequences: Sequence[SequenceSpec],
        workspace_tokens: int | None = None,
        plan: Sequence[ContextChunk] | None = None,
        fused: bool | None = None,
        observer: Observer | None = None,
        layer: int | None = None,
        unpacked_keys: bool | None = None,
    ) -> PrefillResult:
        return self.prefill_context_start(q, sequences, workspace_tokens, plan, fused, observer, layer,
                                          unpacked_keys).result()

    def prefill_context_start(
        self,
        q: torch.Tensor,
        sequences: Sequence[SequenceSpec],
        workspace_tokens: int | None = None,
        plan: Sequence[ContextChunk] | None = None,
        fused: bool | None = None,
        observer: Observer | None = None,
        layer: int | None = None,
        unpacked_keys: bool | None = None,
    ) -> PendingPrefill:
        """Validate the request and queue its device work; return without waiting for it.
        The next request can be validated and queued before this one's result is taken
        (the workspace is reused in stream order), so that the device does not idle
        between requests while the host prepares the next one. A host ``q`` is copied to
        the device in stream order too: page-locked, it must not change until the result
        is taken. ``fused`` and ``unpacked_keys``: the config's unless given (benchmarks
        compare the paths on one engine)."""
        cfg = self.config
        li = self.config.layer_position(layer)  # checked before anything is touched
        W = cfg.workspace_tokens if workspace_tokens is None else int(workspace_tokens)
        bt = self._check_request(q, sequences, W)
        context_lens = [s.context_len for s in sequences]
        if plan is None:
            plan = plan_chunks(context_lens, W, cfg.cache.block_size)
        else:
            validate_plan(plan, context_lens, W)
        fused = cfg.fused if fused is None else fused
        inputs = LoopInputs(
            q=q.to(self.device, non_blocking=True),
            query_lens=[s.query_len for s in sequences],
            block_table=bt,
            chunks=list(plan),
            cache=self.caches[li].storage,
            cache_dtype=cfg.cache.dtype,
            k_scale=cfg.cache.k_scale,
            block_size=cfg.cache.block_size,
            workspace=self.workspace,
            weight=self.layer_weights[li].compute,
            kv_b_proj_bf16=cfg.kv_b_proj_dtype == "bf16",
            gather_raw_fp8=cfg.gather_raw_fp8,
            fp8_prefill=cfg.prefill_dtype == "fp8",
            scale=cfg.shape.scale,
            heads=cfg.shape.heads,
            unpacked_keys=cfg.unpacked_keys if unpacked_keys is None else unpacked_keys,
        )
        with self._lock, self._on_device():
            pending = start_chunk_loop(inputs, self.backend, fused, observer)
        return PendingPrefill(self, pending, dict(
            chunks=list(plan), path="fused" if fused else "generic", fp8_path=cfg.fp8_path_labels,
            context_tokens=sum(context_lens), query_tokens=int(q.shape[0])))
