"""The engine: owns the cache, the weights, the attention backend and the workspace,
validates a request completely on the host, then runs the chunk loop.

Requests are serialized (one at a time on the device: the workspace is shared);
the service's queue decides who goes next.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import numpy as np
import torch

from ..backends import registry
from ..backends.base import AttentionBackend
from ..cache import PagedLatentCache
from ..config import EngineConfig
from ..errors import CtxPrefillError
from ..ops import _cuda, launches
from ..ops.fp8 import FP8
from ..ops.pack import fused_mla_kv_concat
from ..weights import KvBProjWeights
from .graphs import LoopGraphs
from .loop import (
    STOP_AHEAD,
    HostMetadata,
    LoopInputs,
    Observer,
    PendingLoop,
    RowMetadata,
    start_chunk_loop,
    unpacked_keys_wanted,
    use_unpacked_keys,
    uses_keys_last,
)
from .plan import ContextChunk, plan_chunks
from .request import (
    MAX_BLOCK_TABLE_ENTRIES,
    CheckedPrefill,
    CheckedWrite,
    PrefillRequest,
    ReadRequest,
    SequenceSpec,
    WriteRequest,
    block_row,
    checked_cache_write,
    shape_of,
    validate_prefill,
    validate_read,
    validate_write,
)
from .timing import StageSpan

__all__ = ["MAX_BLOCK_TABLE_ENTRIES", "Engine", "PendingPrefill", "PrefillResult", "PrefillStats", "SequenceSpec",
           "WriteResult"]

#: opens a cudaIpcMemHandle_t of the engine's device: (raw handle, device, bytes, offset) -> uint8 tensor
IpcOpen = Callable[[bytes, int, int, int], torch.Tensor]


@dataclasses.dataclass(frozen=True)
class WriteResult:
    slots_written: int
    launches: int  # device kernels the insert launched (the ``insert`` stage)


@dataclasses.dataclass
class PrefillStats:
    chunks: list[ContextChunk]
    launches: Counter[str]
    path: str  # "fused" | "generic"
    fp8_path: dict[str, str]
    stage_ns: dict[str, int]
    total_ns: int
    context_tokens: int
    query_tokens: int
    span_ns: int = 0  # first stage's start to last stage's end, on the device's clock on a GPU
    unpacked_keys: bool = False  # fused bf16: attention read k_nope / k_pe where they lie, no pack
    # start_prefill(timeline=True): when the request's checks and plan ran (perf_counter_ns), and each stage
    checked_ns: tuple[int, int] | None = None
    stages: list[StageSpan] | None = None
    queued: bool = False  # taken before the device work ran (PendingPrefill.queued_stats): no device times
    replay: str = ""  # replayed as a CUDA graph: "in_place" (q read, output written where they are) or "copying"


@dataclasses.dataclass(frozen=True, slots=True)
class _KnownShape:
    """A one-sequence request shape that replayed: what its checks, plan and metadata gave."""

    need: int  # block-table entries its context uses (>= 1)
    chunks: tuple[ContextChunk, ...]
    context_tokens: int
    graph: Hashable  # its key among the engine's captured loops
    vectors: np.ndarray  # int32: its chunk metadata (HostMetadata.vectors; read only)


@dataclasses.dataclass(slots=True)  # not frozen: a frozen one costs the quick path ~0.2 us more
class _KnownRequest:
    """A request of a remembered shape whose layer and block ids passed their checks."""

    known: _KnownShape
    position: int  # its layer's position in the cache
    row: np.ndarray  # its block ids (request.block_row), int64 or int32 [known.need]


@dataclasses.dataclass
class PrefillResult:
    out: torch.Tensor  # [Tq, H, V] bf16
    lse: torch.Tensor  # [H, Tq] float32, natural log
    stats: PrefillStats


class PendingPrefill:
    """A request whose device work is queued (:meth:`Engine.start_prefill`).
    ``out`` / ``lse`` are its result tensors, final once the queued work is done:
    work queued on the same stream after this point (e.g. copying them elsewhere) sees
    them complete. :meth:`write_cache` queues the request's ``cache_write`` behind
    that (the caller's copies of the results first, then the write: the copies do not
    wait for it); :meth:`result` does it when the caller did not, waits for the request
    only and returns its result with the stats; call it once."""

    def __init__(self, engine: Engine, pending: PendingLoop, stats: dict[str, Any],
                 write: CheckedWrite | None = None):
        self._engine, self._pending, self._stats = engine, pending, stats
        self._write = write
        self.out, self.lse = pending.out, pending.lse
        self.written: WriteResult | None = None if write is not None else WriteResult(0, 0)

    def write_cache(self) -> WriteResult:
        """The request's ``cache_write``, queued now (once; 0 slots without one)."""
        if self.written is None:
            assert self._write is not None
            self.written = self._engine._write_checked(self._write)
        return self.written

    def queued_stats(self, total_ns: int) -> PrefillStats:
        """The stats known while the work is queued (no stage times; ``total_ns`` the host's)."""
        return PrefillStats(**self._stats, launches=self._pending.counts, stage_ns={}, total_ns=total_ns,
                            unpacked_keys=self._pending.unpacked_keys, queued=True, replay=self._pending.replay)

    def result(self) -> PrefillResult:
        self.write_cache()
        with self._engine._on_device():
            r = self._pending.finish()
        stats = PrefillStats(**self._stats, launches=r.launches, stage_ns=r.stage_ns, total_ns=r.total_ns,
                             span_ns=r.span_ns, unpacked_keys=r.unpacked_keys, stages=r.stages, replay=r.replay)
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
        # (before any _on_device) Tensor.get_device() of a tensor on the engine's device (-1: the CPU)
        self._device_index = self.device.index if self.device.index is not None else (
            torch.cuda.current_device() if self.device.type == "cuda" else -1)
        shape = config.shape
        n = shape.heads * (shape.qk_nope_head_dim + shape.v_head_dim)
        for layer, w in zip(config.layers, per_layer):
            if tuple(w.weight.shape) != (n, shape.kv_lora_rank):
                raise ValueError(f"layer {layer}: kv_b_proj weight shape {tuple(w.weight.shape)} != "
                                 f"[{n}, {shape.kv_lora_rank}]")
        self.layer_weights = [w.to(self.device) for w in per_layer]
        # what kv_b_proj multiplies by, per layer: the prepared form; a CPU widens a bf16 one to
        # fp32 (exactly): the same one rounding of an fp32-accumulated product (CONTRACT §5),
        # several times faster than torch's CPU bf16 GEMM
        self._gemm_weights = [w.compute.float() if self.device.type == "cpu" else w.compute
                              for w in self.layer_weights]
        # every layer's cache in one allocation, [layers * num_slots, bytes_per_slot]: layer i's
        # block b is block i * num_blocks + b of the whole (one CUDA graph serves every layer)
        slots = config.cache.num_slots
        self.cache_storage = torch.zeros((len(per_layer) * slots, config.cache.bytes_per_slot), dtype=torch.uint8,
                                         device=self.device)
        self.caches = [PagedLatentCache(config.cache, self.device, shape.kv_lora_rank, shape.qk_rope_head_dim,
                                        storage=self.cache_storage[i * slots:(i + 1) * slots])
                       for i in range(len(per_layer))]
        self.q_dtype = FP8 if config.prefill_dtype == "fp8" else torch.bfloat16
        if backend is None:
            # auto on a GPU: time the candidates on a chunk like the ones this engine will run
            # (its workspace of keys, capped at 16k to bound the probe's memory, under 1,024
            # queries); on a CPU, or with a named backend, no probe. Where the fused path reads
            # the keys unpacked (bf16 prefill), a backend that cannot is timed with the K pack it needs.
            probe = None
            if config.backend == "auto" and self.device.type == "cuda":
                unpacked = unpacked_keys_wanted(config.fused, config.unpacked_keys, config.prefill_dtype == "fp8")
                probe = registry.ProbeShape(heads=shape.heads, q_tokens=min(1024, config.workspace_tokens),
                                            k_tokens=min(16384, config.workspace_tokens),
                                            pack=fused_mla_kv_concat if unpacked else None)
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
        # (used per config.cuda_graphs) one graph per shape serves every layer where the whole
        # cache's block ids fit the int32 block table
        shared = self.cache_storage if len(per_layer) * config.cache.num_blocks < 2**31 else None
        self.graphs = LoopGraphs(shared, config.cache.num_blocks) if self.device.type == "cuda" else None
        # one-sequence shapes that replayed, and what their checks and metadata gave (_quick_replay)
        self._known: collections.OrderedDict[Hashable, _KnownShape] = collections.OrderedDict()
        self.quick_replays = 0

    def _on_device(self) -> contextlib.AbstractContextManager[Any]:
        """Make the engine's GPU the current one: Triton launches and CUDA events use the
        current device, which on a worker serving cuda:1 is not the default cuda:0. Where
        it is already current (one GPU), nothing to switch: torch's switch and restore cost
        the host ~3 µs a request."""
        if self.device.type != "cuda" or torch.cuda.current_device() == self._device_index:
            return contextlib.nullcontext()
        return torch.cuda.device(self.device)

    # -- facts ----------------------------------------------------------------------
    @property
    def fused_kernels_active(self) -> bool:
        """Fused path selected and its compiled kernels in use on this device."""
        return self.config.fused and self.device.type == "cuda" and _cuda.load() is not None

    @property
    def cuda_graphs_active(self) -> bool:
        """``--cuda-graphs`` asked for and possible: the engine is on a CUDA device (elsewhere
        every request runs the eager loop)."""
        return self.config.cuda_graphs and self.graphs is not None

    def release_graphs(self) -> int:
        """Drop every captured loop and their memory pool (out of memory: the graphs are a
        cache that gives way to requests); how many were dropped."""
        return self.graphs.clear() if self.graphs is not None else 0

    @property
    def cuda_graphs_reason(self) -> str:
        """Why the chunk loop is not replayed as CUDA graphs ("" when it is)."""
        if self.cuda_graphs_active:
            return ""
        if not self.config.cuda_graphs:
            return "not asked for (--cuda-graphs)"
        return f"CUDA graphs need a CUDA device, got {self.device.type}: every request runs eagerly"

    @property
    def unpacked_keys_active(self) -> bool:
        """The fused path packs no K for this engine's requests (``loop.use_unpacked_keys``,
        which the chunk loop asks per request)."""
        cfg = self.config
        return use_unpacked_keys(self.backend, cfg.fused, cfg.unpacked_keys, cfg.prefill_dtype == "fp8")

    @property
    def fused_kernels_reason(self) -> str:
        """Why the fused kernels are not in use ("" when they are)."""
        if self.fused_kernels_active:
            return ""
        if not self.config.fused:
            return "generic path selected (--generic)"
        if self.device.type != "cuda":
            return "no CUDA device: the torch reference ops run on the CPU"
        return _cuda.why_not()

    def cuda_ipc_opener(self) -> tuple[IpcOpen | None, str]:
        """``(open, "")`` where CUDA memory of another process can be opened on this
        engine's device (the CUDA extension's ``ipc_open``), else ``(None, why not)``."""
        if self.device.type != "cuda":
            return None, f"the server computes on {self.device}, not on a CUDA device"
        ext = _cuda.load()
        if ext is None:
            return None, f"the ctxprefill CUDA extension is not loaded: {_cuda.why_not()}"
        if not hasattr(ext, "ipc_open"):
            return None, "the loaded ctxprefill CUDA extension predates ipc_open (a stale build)"
        opener: IpcOpen = ext.ipc_open
        return opener, ""

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
    def write(self, request: WriteRequest) -> WriteResult:
        """Check (``request.validate_write``) and insert the latents; the slots written
        and the kernels launched."""
        return self._write_checked(validate_write(request, self.config, self.instance_id))

    def _write_checked(self, w: CheckedWrite) -> WriteResult:
        counts: Counter[str] = Counter()
        with self._lock, self._on_device(), launches.stage(counts, "insert"):
            n = self.caches[w.layer_position].write_checked(w.slot_mapping, w.kv_c, w.k_pe)
        launches.note(counts["insert"])  # the caller's stage, when it opened one, counts them too
        return WriteResult(n, counts["insert"])

    def read(self, request: ReadRequest) -> torch.Tensor:
        """Check (``request.validate_read``) and read the slots: uint8 ``[T, bytes_per_slot]`` on the host."""
        position, slots = validate_read(request, self.config, self.instance_id)
        with self._lock, self._on_device():
            return self.caches[position].read_checked(slots)

    def write_cache(self, slot_mapping: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
                    layer: int | None = None) -> int:
        return self.write(WriteRequest(slot_mapping, kv_c, k_pe, layer)).slots_written

    def read_cache(self, slot_mapping: torch.Tensor, layer: int | None = None) -> torch.Tensor:
        return self.read(ReadRequest(slot_mapping, layer))

    def warm_up_backend(self) -> None:
        """The attention backend's own warm-up (kernel variants no warm-up request reaches;
        with CUDA graphs on, those of captured launches too)."""
        with self._lock, self._on_device():
            self.backend.warm_up(self.device, self.config.shape.heads, self.q_dtype, captured=self.cuda_graphs_active)

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
        graphs_on: bool | None = None,
    ) -> PrefillResult:
        return self.prefill_context_start(q, sequences, workspace_tokens, plan, fused, observer, layer,
                                          unpacked_keys, graphs_on).result()

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
        graphs_on: bool | None = None,
    ) -> PendingPrefill:
        """:meth:`start_prefill` of the request these arguments make."""
        request = PrefillRequest(q, sequences, workspace_tokens, plan, layer)
        return self.start_prefill(request, fused=fused, observer=observer, unpacked_keys=unpacked_keys,
                                  graphs_on=graphs_on)

    def starts_without_waiting(self, request: PrefillRequest) -> bool:
        """Whether :meth:`start_prefill` would queue ``request``'s device work without the
        host waiting for the device, judged from its fields alone (unchecked: a request
        misjudged is still right, only its start waits): a GPU engine, q already on it, no
        ``cache_write`` (its latents' copy from the host waits for the work queued before
        it) and no more chunks than the loop queues before it waits for one
        (``STOP_AHEAD``). The service starts such a request while the one before it runs."""
        q = request.q
        if self.device.type != "cuda" or q.get_device() != self._device_index or request.cache_write is not None:
            return False
        if request.plan is not None:
            return len(request.plan) <= STOP_AHEAD
        try:
            w = self.config.workspace_tokens if request.workspace_tokens is None else int(request.workspace_tokens)
            chunks = plan_chunks([int(s.context_len) for s in request.sequences], w, self.config.cache.block_size)
        except (CtxPrefillError, TypeError, ValueError, AttributeError):
            return False  # what the request's checks will name
        return len(chunks) <= STOP_AHEAD

    def start_prefill(self, request: PrefillRequest, *, fused: bool | None = None, observer: Observer | None = None,
                      unpacked_keys: bool | None = None, timeline: bool = False,
                      graphs_on: bool | None = None) -> PendingPrefill:
        """Check the request (``request.validate_prefill``) and queue its device work;
        return without waiting for it. The next request can be checked and queued before
        this one's result is taken (the workspace is reused in stream order), so that the
        device does not idle between requests while the host prepares the next one. A
        host ``q`` is copied to the device in stream order too: page-locked, it must not
        change until the result is taken. ``fused`` and ``unpacked_keys``: the config's
        unless given (benchmarks compare the paths on one engine). ``timeline``: keep when
        its checks and plan ran and each stage's place (``PrefillStats.checked_ns`` and
        ``stages``: what a traced request's spans show). ``graphs_on``: replay the shape's
        CUDA graph where it can (engine/graphs.py), ``config.cuda_graphs`` unless given; a
        one-sequence request of a shape that replayed before then checks only its layer and
        block ids (:meth:`_quick_replay`)."""
        cfg = self.config
        fused = cfg.fused if fused is None else fused
        unpacked = cfg.unpacked_keys if unpacked_keys is None else unpacked_keys
        graphs = self.graphs if (cfg.cuda_graphs if graphs_on is None else graphs_on) else None
        shape = None
        if graphs is not None and observer is None and not timeline:
            shape = self.shape_key(request, graphs, fused, unpacked)
            if shape is not None:
                quick = self._quick_replay(request, shape, graphs, fused)
                if quick is not None:
                    return quick
        t_check = time.perf_counter_ns() if timeline else 0
        checked = validate_prefill(request, cfg, self.instance_id)
        checked_ns = (t_check, time.perf_counter_ns()) if timeline else None
        if graphs is None or observer is not None or not graphs.eligible(timeline, checked.stop, len(checked.chunks)):
            with self._lock, self._on_device():
                pending = start_chunk_loop(self.loop_inputs(checked, unpacked, timeline), self.backend, fused,
                                           observer)
        else:
            # a replay needs the request's shape and metadata alone (no loop inputs): made
            # here, before the lock, while the device may still run the request before
            q = self._on_engine_device(checked.q)
            weight = self._gemm_weights[checked.layer_position]
            key, hm = self.graph_shape(graphs, checked, fused, unpacked, q)
            with self._lock, self._on_device():
                replayed = graphs.replay(key, hm, q, weight, checked.stop, len(checked.chunks))
                pending = replayed if replayed is not None else graphs.start_eager(
                    self.loop_inputs(checked, unpacked, timeline, q), self.backend, fused, key, hm)
            if shape is not None:  # the shape's next request may take the quick path
                self.remember_shape(shape, checked, key, hm)
        return PendingPrefill(self, pending, self._stats(checked.chunks, fused, sum(checked.context_lens), checked.q,
                                                         checked_ns), checked.cache_write)

    def _stats(self, chunks: list[ContextChunk], fused: bool, context_tokens: int, q: torch.Tensor,
               checked_ns: tuple[int, int] | None) -> dict[str, Any]:
        """A request's PrefillStats known before its work runs."""
        return dict(chunks=chunks, path="fused" if fused else "generic", fp8_path=self.config.fp8_path_labels,
                    context_tokens=context_tokens, query_tokens=int(q.shape[0]), checked_ns=checked_ns)

    def graph_shape(self, graphs: LoopGraphs, checked: CheckedPrefill, fused: bool, unpacked: bool,
                    q: torch.Tensor) -> tuple[Hashable, HostMetadata]:
        """A checked request's key among ``graphs``' captured loops and the metadata its replay
        stages (``LoopGraphs.shape``); ``q``: its q on the engine's device."""
        position = checked.layer_position
        return graphs.shape(position, fused, unpacked, q, self._gemm_weights[position], checked.query_lens,
                            checked.chunks, checked.block_table,
                            uses_keys_last(self.backend, self.config.prefill_dtype == "fp8", q.dtype))

    #: one-sequence shapes remembered (_known), the oldest forgotten first
    MAX_KNOWN = 4096

    def shape_key(self, request: PrefillRequest, graphs: LoopGraphs, fused: bool, unpacked: bool) -> Hashable | None:
        """A one-sequence request's shape (``request.shape_of``) with the path it takes, and
        its layer where each layer has its own graphs; None: not one (checked in full)."""
        shape = shape_of(request, self.instance_id)
        if shape is None:
            return None
        return shape, fused, unpacked, None if graphs.cache is not None else request.layer

    def remember_shape(self, shape: Hashable, checked: CheckedPrefill, graph: Hashable, hm: HostMetadata) -> None:
        """Remember what a one-sequence request of ``shape`` (with context) was checked and
        planned to, its key among the captured loops and its chunk vectors."""
        need = -(-checked.context_lens[0] // self.config.cache.block_size)
        if need and shape not in self._known:
            self._known[shape] = _KnownShape(need, tuple(checked.chunks), checked.context_lens[0], graph, hm.vectors)
            while len(self._known) > self.MAX_KNOWN:
                self._known.popitem(last=False)

    def known_shape(self, request: PrefillRequest, shape: Hashable) -> _KnownRequest | None:
        """What a request of ``shape`` (a one-sequence shape that replayed before) was checked
        and planned to, with the request's layer position and block ids, checked; None where
        its shape is not remembered or its layer or block table fails (the full checks then
        name the field)."""
        known = self._known.get(shape)
        if known is None:
            return None
        try:
            position = self.config.layer_position(request.layer)
        except CtxPrefillError:
            return None
        row = block_row(request.sequences[0].block_table, known.need, self.config.cache.num_blocks)
        return None if row is None else _KnownRequest(known, position, row)

    def _quick_replay(self, request: PrefillRequest, shape: Hashable, graphs: LoopGraphs,
                      fused: bool) -> PendingPrefill | None:
        """A request of a remembered shape replayed with only what differs between such
        requests checked: its layer, its block ids (and its cache_write). Every other check of
        ``validate_prefill`` has one outcome per shape, and this shape passed them; its plan,
        chunk vectors and graph are the shape's. None where the request needs the full path
        (the shape unknown, a block table that fails, a stop signal that rules out a replay,
        its graph dropped since)."""
        got = self.known_shape(request, shape)
        if got is None:
            return None
        known, position = got.known, got.position
        if known.graph not in graphs or not graphs.eligible(False, request.stop, len(known.chunks)):
            return None
        write = None
        if request.cache_write is not None:
            write = checked_cache_write(request.cache_write, self.config, position)
        q = self._on_engine_device(request.q)
        # the layer's place in the shared cache (LoopGraphs.shape); 0 where each layer has its graphs
        offset = position * graphs.blocks_per_layer if graphs.cache is not None else 0
        with self._lock, self._on_device():
            pending = graphs.replay(known.graph, RowMetadata(known.vectors, got.row, offset), q,
                                    self._gemm_weights[position], request.stop, len(known.chunks))
        if pending is None:
            return None
        self.quick_replays += 1
        return PendingPrefill(self, pending, self._stats(list(known.chunks), fused, known.context_tokens, q, None),
                              write)

    def _on_engine_device(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` on the engine's device: itself where it is there, else copied in stream order."""
        return t if t.get_device() == self._device_index else t.to(self.device, non_blocking=True)

    def loop_inputs(self, checked: CheckedPrefill, unpacked_keys: bool | None = None,
                    timeline: bool = False, q: torch.Tensor | None = None) -> LoopInputs:
        """What the chunk loop reads for a checked request: its q on the engine's device
        (copied in stream order, unless given so), its layer's cache and weight, the
        engine's workspace."""
        cfg = self.config
        li = checked.layer_position
        return LoopInputs(
            q=self._on_engine_device(checked.q) if q is None else q,
            query_lens=checked.query_lens,
            block_table=checked.block_table,
            chunks=checked.chunks,
            cache=self.caches[li].storage,
            cache_dtype=cfg.cache.dtype,
            k_scale=cfg.cache.k_scale,
            block_size=cfg.cache.block_size,
            workspace=self.workspace,
            weight=self._gemm_weights[li],
            kv_b_proj_bf16=cfg.kv_b_proj_dtype == "bf16",
            gather_raw_fp8=cfg.gather_raw_fp8,
            fp8_prefill=cfg.prefill_dtype == "fp8",
            scale=cfg.shape.scale,
            heads=cfg.shape.heads,
            unpacked_keys=cfg.unpacked_keys if unpacked_keys is None else unpacked_keys,
            gemm=cfg.kv_b_proj_gemm,
            stop=checked.stop,
            stage_places=timeline,
        )
