"""The chunk loop (CONTRACT §5): gather → cast → kv_b_proj → pack → attention → accumulate.

Before each chunk the loop asks the request's ``StopSignal`` (a flag and the clock) and
stops there once its deadline passed or its caller went away. On a GPU the host, which
only queues the work, then stays at most ``STOP_AHEAD`` chunks ahead of the device, so
that a stop ends the device's work too within that many chunks.

The generic and the fused path differ only in the pack; everything else is the same
code, so a difference in results can only come from the pack. With bf16 prefill and a
backend with unpacked keys (``BackendCaps.unpacked_keys``), the fused path packs no K at
all (:func:`use_unpacked_keys`): attention reads k_nope from the ``kv_b_proj`` output and
k_pe from the workspace where they lie, loading the same tiles a packed K gives it
(docs/DESIGN.md "Unpacked keys").
The ``out`` contract:
with a backend whose ``caps.supports_out``, the output buffers exist before any chunk,
rows no direct write will reach are set to 0 / -inf, each non-continuation chunk is
computed straight into ``out[token_slice]``, and a continuation chunk computes into
scratch and is merged in. Every backend that claims ``supports_out`` is checked to
have written into the buffer it was given.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Protocol, cast

import numpy as np
import torch

from ..backends.base import AttentionBackend, LaunchOrder, VLayout
from ..ops import launches
from ..ops.cast import cast_latent
from ..ops.fp8 import FP8
from ..ops.gather import gather
from ..ops.kv_b_proj import chunk_reads_cache, kv_b_proj, kv_b_proj_paged, reads_cache
from ..ops.merge import merge
from ..ops.pack import (
    KeysLast,
    fused_mla_kv_concat,
    fused_mla_kv_concat_quant_fp8,
    generic_kv_concat,
    generic_kv_concat_quant_fp8,
    keys_last_starts,
)
from .plan import REMEMBER_SEQUENCES, ContextChunk
from .request import StopSignal
from .timing import DetailedStageTimer, StageSpan, StageTimer, Started

STAGES = ("gather", "cast", "kv_b_proj", "pack", "attention", "merge")
#: with a stop signal on a GPU: chunks queued past the last one the device finished, at
#: most (the device always has work queued; a stop ends its work within that many chunks)
STOP_AHEAD = 4


@dataclasses.dataclass(slots=True)
class LoopInputs:
    """Everything one request's chunk loop reads; tensors on the engine's device."""

    q: torch.Tensor  # [Tq, H, 192] bf16, or fp8 for fp8 prefill
    query_lens: Sequence[int]  # [B] query rows per sequence
    block_table: np.ndarray  # int32 [B, max_blocks] on the host, every used entry checked (uploaded with the metadata)
    chunks: Sequence[ContextChunk]
    cache: torch.Tensor  # uint8 [num_slots, bytes_per_slot]
    cache_dtype: str
    k_scale: float
    block_size: int
    workspace: torch.Tensor  # uint8, at least rows * 576 * 2 bytes
    weight: torch.Tensor  # kv_b_proj weight in its compute dtype [H*(P+V), L]
    kv_b_proj_bf16: bool  # bf16 weight: the latent is cast to bf16 every chunk
    gather_raw_fp8: bool
    fp8_prefill: bool
    scale: float
    heads: int
    unpacked_keys: bool = False  # fused bf16 prefill: no K pack where the backend reads the keys unpacked
    gemm: str = "cublas"  # kv_b_proj's bf16 GEMM (ops.kv_b_proj.GEMMS; EngineConfig.kv_b_proj_gemm)
    stop: StopSignal | None = None  # asked before each chunk (request.StopSignal)
    stage_places: bool = False  # keep each stage's chunk, start and duration (a traced request's timeline)
    latent: int = 512
    nope: int = 128
    v_dim: int = 128


@dataclasses.dataclass(frozen=True, slots=True)
class ChunkMeta:
    """One chunk's metadata (:func:`_chunk_metadata`): device vectors are views of the
    request's one upload (B: the chunk's sequences)."""

    cu_seqlens_k: torch.Tensor  # int32 [B+1]: the chunk's workspace rows (keys) per sequence
    context_starts: torch.Tensor  # int32 [B]: each sequence's first context token in the chunk
    cu_seqlens_q: torch.Tensor  # int32 [B+1]: the chunk's query rows per sequence, from 0
    q0: int  # the chunk's query rows are the request's [q0, q1)
    q1: int
    max_q: int  # the longest query segment of the chunk
    max_k: int  # the longest key segment of the chunk
    keys_last: KeysLast | None  # V keys-last layout of the chunk (fp8 P·V), or None


@dataclasses.dataclass(frozen=True, slots=True)
class DeviceMetadata:
    """A request's chunk metadata on the device (:func:`device_metadata`): views of its one upload."""

    block_table: torch.Tensor  # int32 [B, max_blocks]
    chunks: list[ChunkMeta]  # one per chunk of the plan


@dataclasses.dataclass(frozen=True, slots=True)
class _HostChunk:
    """A chunk's metadata on the host, and where its vectors lie in the request's upload
    (shared by the requests of a shape: read only)."""

    q0: int
    q1: int
    max_q: int
    max_k: int
    cu_k: list[int]  # [B+1]
    cu_v: list[int]  # [B+1] V keys-last column starts; empty without keys-last
    part_k: int  # indices of cu_k, the context starts, cu_q and cu_v among the uploaded parts
    part_starts: int
    part_q: int
    part_v: int  # -1 without keys-last


@dataclasses.dataclass(frozen=True, slots=True)
class _WorkspaceViews:
    """The workspace as a chunk of ``rows`` rows uses it (views shared by equal-size chunks)."""

    ws: torch.Tensor  # [rows, latent + 64] in the gather's dtype
    latent: torch.Tensor  # [rows, latent]
    k_pe: torch.Tensor  # [rows, 64]
    k_rope: torch.Tensor | None  # [rows, H, 64], k_pe with a 0 head stride (unpacked keys only)


@dataclasses.dataclass
class LoopResult:
    out: torch.Tensor  # [Tq, H, V] bf16
    lse: torch.Tensor  # [H, Tq] float32
    launches: Counter[str]
    stage_ns: dict[str, int]
    total_ns: int
    span_ns: int = 0  # first stage's start to last stage's end (engine/timing.py)
    unpacked_keys: bool = False  # attention read the keys unpacked, where they lie (no K pack)
    stages: list[StageSpan] | None = None  # with LoopInputs.stage_places: each stage's place
    replay: str = ""  # a CUDA-graph replay's mode (engine/graphs.py): "in_place" or "copying"; "" eagerly


#: observer(chunk_index, chunk, q, k, v, out, lse) — tests compare paths chunk by chunk
#: (with unpacked keys, k is packed for the observer alone, by the generic pack)
Observer = Callable[[int, ContextChunk, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


def unpacked_keys_wanted(fused: bool, unpacked_keys: bool, fp8_prefill: bool) -> bool:
    """Whether the path would hand attention the keys unpacked, given a backend that reads
    them so: the fused path with unpacked keys on and bf16 prefill (fp8's pack is also its
    quantization; with bf16 prefill the workspace's k_pe is bf16 too: only fp8 prefill
    gathers raw fp8)."""
    return fused and unpacked_keys and not fp8_prefill


def use_unpacked_keys(backend: AttentionBackend, fused: bool, unpacked_keys: bool, fp8_prefill: bool) -> bool:
    """Whether the chunk loop hands attention the keys unpacked, where they lie (no K pack)."""
    return unpacked_keys_wanted(fused, unpacked_keys, fp8_prefill) and torch.bfloat16 in backend.caps.unpacked_keys


def _upload(host: np.ndarray, device: torch.device) -> torch.Tensor:
    """``host`` (int32) on ``device`` in one copy that does not make the host wait for the
    device: from pinned memory on CUDA (torch's pinned allocator keeps the block until the
    copy is done). A copy from pageable memory waits for the work queued before it (cache
    writes, another request's tail). Inside a request this costs the H200 machine's host
    ~85-95 us, 21 us in a hot loop; a reused pinned staging buffer measured the same
    (2026-12-02): the cost is the copy's submission, not the pinning."""
    t = torch.from_numpy(host)
    if torch.device(device).type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


class Layout:
    """A hashable layout (a tuple) whose hash is computed once: a graph key is looked up
    per request, and hashing the nested tuple each time costs the host microseconds."""

    __slots__ = ("value", "_hash")

    def __init__(self, value: tuple[object, ...]):
        self.value, self._hash = value, hash(value)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other or (isinstance(other, Layout) and self._hash == other._hash and self.value == other.value)


@dataclasses.dataclass(frozen=True, slots=True)
class _ChunkVectors:
    """A request shape's chunk metadata: everything of the upload but the block table."""

    host: np.ndarray  # int32: the chunks' distinct vectors
    sizes: tuple[int, ...]  # their lengths, in order
    spans: tuple[_HostChunk, ...]  # read only, shared by the requests of the shape
    layout: Layout  # query lengths, chunk structure, sizes and places: what a captured loop bakes in


@dataclasses.dataclass(frozen=True, slots=True)
class HostMetadata:
    """A request's chunk metadata on the host (:func:`host_metadata`): what goes up in its
    one upload (:attr:`host`: the chunks' vectors, then the block table), and where each
    chunk's vectors lie in it."""

    vectors: np.ndarray  # int32 [m]: the chunks' distinct vectors (shared by the requests of a shape: read only)
    block_table: np.ndarray  # int32 [B, max_blocks], contiguous
    block_offset: int  # added to every block id on the way up (a layer's place in a shared cache)
    sizes: list[int]  # the vectors' lengths, in order (the block table's last)
    spans: Sequence[_HostChunk]
    keys_last: bool
    chunk_layout: Layout

    @property
    def size(self) -> int:
        """Elements of the upload."""
        return self.vectors.size + self.block_table.size

    @property
    def host(self) -> np.ndarray:
        """The upload, int32 ``[size]`` (a new array)."""
        out = np.empty(self.size, dtype=np.int32)
        self.fill(out)
        return out

    def fill(self, out: np.ndarray) -> None:
        """Write the upload into ``out`` (int32 ``[size]``): a replay's page-locked staging
        takes it so, with no array made in between."""
        fill_upload(out, self.vectors, self.block_table.ravel(), self.block_offset)

    def layout(self) -> tuple[object, ...]:
        """Everything of the upload but its values: equal for requests whose metadata
        lands in the same places (what a captured loop needs to replay)."""
        return (self.chunk_layout, self.block_table.shape)


class Upload(Protocol):
    """A request's metadata upload, written into a replay's page-locked staging."""

    def fill(self, out: np.ndarray) -> None: ...


@dataclasses.dataclass(frozen=True, slots=True)
class RowMetadata:
    """A one-sequence request's upload — the bytes :meth:`HostMetadata.fill` writes — from
    its shape's remembered vectors and its block ids as the caller gave them (int64 or
    int32, checked by ``request.block_row``): no int32 table made on the way."""

    vectors: np.ndarray  # int32 [m], HostMetadata.vectors of the shape
    row: np.ndarray  # int64 or int32 [need >= 1], every id in [0, num_blocks)
    block_offset: int

    def fill(self, out: np.ndarray) -> None:
        fill_upload(out, self.vectors, self.row, self.block_offset)


def fill_upload(out: np.ndarray, vectors: np.ndarray, ids: np.ndarray, block_offset: int) -> None:
    """An upload into int32 ``out``: the chunk vectors, then the block ids plus
    ``block_offset`` (int32 or int64 ids, each fitting int32 with its offset: checked)."""
    m = vectors.size
    out[:m] = vectors
    if block_offset:
        np.add(ids, block_offset, out=out[m : m + ids.size], casting="unsafe")
    else:  # an assignment casts as "unsafe" does
        out[m : m + ids.size] = ids


def uses_keys_last(backend: AttentionBackend, fp8_prefill: bool, q_dtype: torch.dtype) -> bool:
    """fp8 P·V reads V keys-last ([H, 128, columns]) where the backend takes it: the pack
    writes it so, each segment from a 16-aligned column (KeysLast)."""
    return fp8_prefill and q_dtype in backend.caps.v_keys_last


#: a request shape's chunk vectors are remembered (``_remembered_vectors``) up to
#: plan.REMEMBER_SEQUENCES sequences and this many chunks
REMEMBER_CHUNKS = 512


def host_metadata(x: LoopInputs, keys_last: bool = False) -> HostMetadata:
    """:func:`host_metadata_of` ``x``."""
    return host_metadata_of(x.query_lens, x.chunks, x.block_table, keys_last)


def host_metadata_of(query_lens: Sequence[int], chunks: Sequence[ContextChunk], block_table: np.ndarray,
                     keys_last: bool = False, block_offset: int = 0) -> HostMetadata:
    """Every chunk's metadata vectors and the block table (its ids plus ``block_offset``
    on the way up). The vectors depend on the request's shape alone (query lengths,
    plan): a shape seen recently has them remembered (for 4 chunks on the CPU machine the
    call costs ~50 µs building them, ~1 µs with them remembered)."""
    if len(query_lens) <= REMEMBER_SEQUENCES and len(chunks) <= REMEMBER_CHUNKS:
        vec = _remembered_vectors(tuple(query_lens), tuple(chunks), keys_last)
    else:
        vec = _chunk_vectors(query_lens, chunks, keys_last)
    bt = np.ascontiguousarray(block_table, dtype=np.int32)
    return HostMetadata(vec.host, bt, block_offset, [*vec.sizes, bt.size], vec.spans, keys_last, vec.layout)


@functools.lru_cache(maxsize=128)
def _remembered_vectors(query_lens: tuple[int, ...], chunks: tuple[ContextChunk, ...],
                        keys_last: bool) -> _ChunkVectors:
    return _chunk_vectors(query_lens, chunks, keys_last)


def _chunk_vectors(query_lens: Sequence[int], chunks: Sequence[ContextChunk], keys_last: bool) -> _ChunkVectors:
    """Every chunk's vectors (workspace rows, context starts, query rows, V keys-last
    columns per sequence), equal ones stored once (the chunks of one long sequence differ
    only in their starts): a device view costs the host 1-5 µs per vector."""
    q_offsets = [0]
    for n in query_lens:
        q_offsets.append(q_offsets[-1] + n)
    host: list[int] = []
    sizes: list[int] = []
    spans: list[_HostChunk] = []
    slot: dict[tuple[int, ...], int] = {}  # a vector's values -> its index among the uploaded parts

    def part(values: Sequence[int]) -> int:
        key = tuple(values)
        i = slot.get(key)
        if i is None:
            i = slot[key] = len(sizes)
            host.extend(values)
            sizes.append(len(values))
        return i

    for c in chunks:
        cu_k, cu_q = [0], [0]
        for s, n in zip(c.sequences, c.context_lens, strict=True):
            cu_k.append(cu_k[-1] + n)
            cu_q.append(cu_q[-1] + query_lens[s])
        cu_v = keys_last_starts(cu_k) if keys_last else []
        spans.append(_HostChunk(
            q0=q_offsets[c.first_sequence], q1=q_offsets[c.first_sequence + c.num_sequences],
            max_q=max((query_lens[s] for s in c.sequences), default=0), max_k=max(c.context_lens),
            cu_k=cu_k, cu_v=cu_v, part_k=part(cu_k), part_starts=part(c.context_starts), part_q=part(cu_q),
            part_v=part(cu_v) if keys_last else -1))
    layout = (tuple(query_lens), keys_last, tuple(sizes),
              tuple((c.first_sequence, c.num_sequences, c.is_continuation) for c in chunks),
              tuple((h.q0, h.q1, h.max_q, h.max_k, h.part_k, h.part_starts, h.part_q, h.part_v, tuple(h.cu_k))
                    for h in spans))
    vectors = np.asarray(host, dtype=np.int32)
    vectors.flags.writeable = False  # remembered: every request of the shape reads it
    return _ChunkVectors(vectors, tuple(sizes), tuple(spans), Layout(layout))


def device_metadata(hm: HostMetadata, dev: torch.Tensor) -> DeviceMetadata:
    """The block table and every chunk's :class:`ChunkMeta` as views of ``dev``, the upload
    of ``hm.host`` (int32 [n]), made in one call."""
    parts = dev.split_with_sizes(hm.sizes)
    meta = [
        ChunkMeta(cu_seqlens_k=parts[h.part_k], context_starts=parts[h.part_starts], cu_seqlens_q=parts[h.part_q],
                  q0=h.q0, q1=h.q1, max_q=h.max_q, max_k=h.max_k,
                  keys_last=KeysLast(h.cu_k, h.cu_v, parts[h.part_k], parts[h.part_v]) if hm.keys_last else None)
        for h in hm.spans
    ]
    return DeviceMetadata(parts[-1].view(hm.block_table.shape), meta)


def upload_metadata(hm: HostMetadata, device: torch.device | str) -> DeviceMetadata:
    """:func:`device_metadata` of ``hm`` moved to ``device`` in one copy for the whole request."""
    return device_metadata(hm, _upload(hm.host, torch.device(device)))


def _chunk_metadata(x: LoopInputs, device: torch.device | str, keys_last: bool = False) -> DeviceMetadata:
    """:class:`DeviceMetadata` of ``x``, built on the host and moved to the device in one copy."""
    return upload_metadata(host_metadata(x, keys_last), device)


def launch_orders(backend: AttentionBackend, x: LoopInputs) -> list[LaunchOrder | None]:
    """Every chunk's launch order on the device (None where the backend gives none)."""
    if not backend.caps.launch_order:
        return [None] * len(x.chunks)
    return [_launch_order(backend, x, c, x.heads, x.q.dtype, x.q.device) for c in x.chunks]


def _launch_order(backend: AttentionBackend, x: LoopInputs, c: ContextChunk, heads: int, q_dtype: torch.dtype,
                  device: torch.device) -> LaunchOrder | None:
    """The backend's launch order for chunk ``c`` on the device, or None. Built on the
    host after the chunk's gather, kv_b_proj and pack are launched, so that it runs while
    the device does them (a ragged chunk's packing, tile_order: typically 0.01-0.2 ms of host,
    at worst ~1.3 ms on the CPU machine), and copied
    without a sync from pinned memory (torch's host allocator keeps the buffer until the
    copy is done): no launch, and the attention launch right after it is ordered behind."""
    got = backend.launch_order([x.query_lens[s] for s in c.sequences], c.context_lens, heads=heads,
                               q_dtype=q_dtype, device=device)
    if got is None:
        return None
    cuda = device.type == "cuda"
    codes = torch.tensor(got.codes, dtype=torch.int32, pin_memory=cuda).to(device, non_blocking=cuda)
    return LaunchOrder(codes, got.m_tiles, got.persistent)


def _accumulate(direct: bool, copy_out: bool, out_c: torch.Tensor, lse_c: torch.Tensor, o_c: torch.Tensor,
                l_c: torch.Tensor) -> None:
    """The merge stage: a direct chunk's partial copied into the request's rows (its out
    only where ``copy_out``: the backend did not write it there), a continuation's merged."""
    if direct:
        if copy_out:
            launches.note(1)
            out_c.copy_(o_c)
        launches.note(1)
        lse_c.copy_(l_c)
    else:
        merge(out_c, lse_c, o_c, l_c)


class _Stage:
    """``with stage("gather"):`` — the launches noted inside count under that stage and its
    device time is recorded. A plain class rather than two generator-based context
    managers: a request of 4 chunks enters 24 stages, and short requests are bound by
    this host time (63 -> 19 us per request on the CPU machine)."""

    __slots__ = ("counts", "timer", "name", "token", "started")

    def __init__(self, counts: Counter[str], timer: StageTimer):
        self.counts, self.timer = counts, timer
        self.name = ""
        self.token: object = None
        self.started: Started | None = None

    def __call__(self, name: str) -> _Stage:
        self.name = name
        return self

    def __enter__(self) -> None:
        self.token = launches.enter(self.counts, self.name)
        self.started = self.timer.begin(self.name)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is None and self.started is not None:
            self.timer.end(self.started)
        launches.leave(self.token)


class PendingLoop:
    """A chunk loop whose work is queued on the device. ``out`` and ``lse`` are the
    request's result tensors (written by that queued work); :meth:`finish` waits for it
    (the request's last event, not the whole device: a request queued behind it is not
    waited for) and reads the stage timings."""

    __slots__ = ("out", "lse", "counts", "timer", "unpacked_keys", "replay")

    def __init__(self, out: torch.Tensor, lse: torch.Tensor, counts: Counter[str], timer: StageTimer,
                 unpacked_keys: bool = False, replay: str = ""):
        self.out, self.lse, self.counts, self.timer = out, lse, counts, timer
        self.unpacked_keys, self.replay = unpacked_keys, replay

    def finish(self) -> LoopResult:
        stage_ns, total_ns = self.timer.finish()
        return LoopResult(self.out, self.lse, self.counts, stage_ns, total_ns, self.timer.span_ns,
                          self.unpacked_keys, self.timer.stages, self.replay)


def run_chunk_loop(x: LoopInputs, backend: AttentionBackend, fused: bool,
                   observer: Observer | None = None) -> LoopResult:
    return start_chunk_loop(x, backend, fused, observer).finish()


class _Untimed(StageTimer):
    """Times nothing: a loop captured as a CUDA graph records no timing events."""

    def begin(self, name: str) -> Started:
        return name, 0

    def end(self, started: Started) -> None:
        pass


def start_chunk_loop(x: LoopInputs, backend: AttentionBackend, fused: bool,
                     observer: Observer | None = None, *,
                     metadata: DeviceMetadata | None = None,
                     launch_orders: Sequence[LaunchOrder | None] | None = None,
                     timed: bool = True, merge_stream: torch.cuda.Stream | None = None,
                     captured: bool = False) -> PendingLoop:
    """Queue the chunk loop's work on the device and return without waiting for it (with a
    stop signal on a GPU: for all but its last ``STOP_AHEAD`` chunks). ``metadata``: the
    request's chunk metadata already on the device (:func:`device_metadata`), else it is
    uploaded here; ``launch_orders``: each chunk's, already on the device, else the
    backend's are made per chunk; ``timed=False``: no stage timing (engine/graphs.py
    captures the loop so); ``merge_stream``: the merge stage runs there, beside the next
    chunk's gather and GEMM (joined before the next attention and at the end; used by a
    capture, whose graph then has the merges on a branch of their own); ``captured``: the
    loop is being recorded into a CUDA graph, which attention is told where its caps take it
    (``graph_variants``)."""
    q = x.q
    device = q.device
    Tq, H = q.shape[0], x.heads
    caps = backend.caps
    counts: Counter[str] = Counter()
    timer = (DetailedStageTimer if x.stage_places else StageTimer if timed else _Untimed)(device)
    stage = _Stage(counts, timer)  # stages do not nest

    keys_last = uses_keys_last(backend, x.fp8_prefill, q.dtype)
    graph_kw = {"captured": True} if captured and caps.graph_variants else {}
    v_layout: VLayout = "hdt" if keys_last else "thd"
    dm = metadata if metadata is not None else _chunk_metadata(x, device, keys_last)
    block_table, meta = dm.block_table, dm.chunks
    ws_dtype = FP8 if x.gather_raw_fp8 else torch.bfloat16
    # bf16 prefill on the fused path: K's two parts go to attention where they lie (no pack
    # stage, no K buffer) when the backend reads the keys unpacked
    unpacked = use_unpacked_keys(backend, fused, x.unpacked_keys, x.fp8_prefill)
    width = x.latent + 64
    # the gather folded into kv_b_proj's GEMM (gemm "paged"), chunk by chunk where the
    # chunk is one sequence starting on the GEMM's 64-row pages
    paged = reads_cache(x.cache, x.cache_dtype, x.weight, x.block_size, x.gemm)  # (a bf16 cache: never raw fp8)
    direct = [not c.is_continuation for c in x.chunks]
    # Rows some direct (non-continuation) chunk writes: the union of their row slices
    # (a caller's plan may list a context-less sequence in two chunks, so they can overlap)
    written, end = 0, 0
    for q0, q1 in sorted((m.q0, m.q1) for m, d in zip(meta, direct, strict=True) if d):
        written += max(0, q1 - max(q0, end))
        end = max(end, q1)
    single = len(x.chunks) == 1 and direct[0] and meta[0].q0 == 0 and meta[0].q1 == Tq

    # the request's result; a single chunk's is the backend's own
    out: torch.Tensor | None = None
    lse: torch.Tensor | None = None
    if not single:
        out = torch.empty((Tq, H, x.v_dim), dtype=torch.bfloat16, device=device)
        lse = torch.empty((H, Tq), dtype=torch.float32, device=device)
        if written < Tq:  # rows without context, or reached only by merges
            with stage("merge"):
                launches.note(2)
                out.zero_()
                lse.fill_(float("-inf"))

    # A 16-head request's host issues it in about the device's time (docs/DESIGN.md), and a
    # tensor view costs the host 2-5 us: chunks of equal size share their workspace views, and
    # a chunk whose query rows are all of the request's uses the whole tensors, not slices.
    ws_views: dict[int, _WorkspaceViews] = {}
    stop, planned = x.stop, len(x.chunks)
    ends: list[torch.cuda.Event] = []  # each chunk's last end event, with a stop signal on a GPU
    for i, (c, m) in enumerate(zip(x.chunks, meta, strict=True)):
        timer.chunk = i
        if stop is not None:
            if i >= STOP_AHEAD and ends:
                ends[i - STOP_AHEAD].synchronize()  # the device is STOP_AHEAD chunks behind at most
            stop.check(i, planned)
        rows = c.rows
        # this chunk's query rows of q, out and lse (out/lse are None only when single, and
        # then the chunk is the whole request)
        if m.q0 == 0 and m.q1 == Tq:
            q_c, out_c, lse_c = q, out, lse
        else:
            q_c = q[m.q0 : m.q1]
            out_c = None if out is None else out[m.q0 : m.q1]
            lse_c = None if lse is None else lse[:, m.q0 : m.q1]
        views = ws_views.get(rows)
        if views is None:
            ws = x.workspace[: rows * width * ws_dtype.itemsize].view(ws_dtype).view(rows, width)
            k_pe = ws[:, x.latent :]
            # unpacked keys: k_pe as every head's rope keys, a head stride of 0 (a view
            # made only where it is used: each costs the host microseconds)
            k_rope = k_pe.unsqueeze(1).expand(rows, H, k_pe.shape[1]) if unpacked else None
            views = ws_views[rows] = _WorkspaceViews(ws, ws[:, : x.latent], k_pe, k_rope)
        bt = block_table if c.num_sequences == block_table.shape[0] else \
            block_table[c.first_sequence : c.first_sequence + c.num_sequences]
        if paged and chunk_reads_cache(c.context_lens, c.context_starts):
            with stage("kv_b_proj"):  # the latent read where it lies; k_pe left in the workspace
                kv = kv_b_proj_paged(x.cache, bt, m.cu_seqlens_k, m.context_starts, x.block_size, views.ws,
                                     x.weight).view(rows, H, x.nope + x.v_dim)
        else:
            with stage("gather"):
                gather(x.cache, bt, m.cu_seqlens_k, m.context_starts, views.ws, x.cache_dtype, x.k_scale,
                       x.block_size)
            latent = views.latent
            if x.kv_b_proj_bf16 and latent.dtype != torch.bfloat16:  # else no cast, and no stage:
                with stage("cast"):  # its two events and bookkeeping were ~10 us of host per chunk
                    latent = cast_latent(latent, torch.bfloat16)
            with stage("kv_b_proj"):
                kv = kv_b_proj(latent, x.weight, x.gemm).view(rows, H, x.nope + x.v_dim)
        k_nope, v = kv[..., : x.nope], kv[..., x.nope :]
        if unpacked:
            k = k_nope
        else:
            with stage("pack"):
                if x.fp8_prefill:
                    k, v = (fused_mla_kv_concat_quant_fp8 if fused else generic_kv_concat_quant_fp8)(
                        k_nope, views.k_pe, v, v_keys_last=m.keys_last)
                else:
                    k = (fused_mla_kv_concat if fused else generic_kv_concat)(k_nope, views.k_pe)
        # the backend's launch order (gluon: tiles packed per SM), if it gives one here: host
        # work outside the stages (a device idle while it runs shows as the request's gap)
        if launch_orders is not None:
            order = launch_orders[i]
        else:
            order = _launch_order(backend, x, c, H, q.dtype, device) if caps.launch_order else None
        # a direct chunk with a backend that writes in place: straight into out[token_slice]
        dest = out_c if direct[i] and caps.supports_out else None
        if merge_stream is not None and i:
            # the merge before is done with its partial: memory freed once it is, and that
            # this attention's partial or the next GEMM's output may take
            torch.cuda.current_stream(device).wait_stream(merge_stream)
        with stage("attention"):
            launches.note(caps.launches_per_call)
            o_c, l_c = backend.run_context_chunk(
                q_c, k, v, m.cu_seqlens_q, m.cu_seqlens_k, m.max_q, m.max_k, x.scale, out=dest,
                k_rope=views.k_rope, v_layout=v_layout,
                cu_seqlens_v=None if m.keys_last is None else m.keys_last.cu_v_dev, launch_order=order,
                **graph_kw)
            if dest is not None and o_c.data_ptr() != dest.data_ptr():
                raise RuntimeError(
                    f"attention backend {backend.name!r} claims supports_out but did not write into the "
                    f"out buffer it was given (chunk {i})"
                )
        if out_c is None or lse_c is None:  # single: the backend's result is the request's
            out, lse = o_c, l_c
        else:
            with stage("merge"):
                if merge_stream is None:
                    _accumulate(direct[i], not caps.supports_out, out_c, lse_c, o_c, l_c)
                else:  # after this attention, beside the next chunk's gather and GEMM
                    merge_stream.wait_stream(torch.cuda.current_stream(device))
                    with torch.cuda.stream(merge_stream):
                        _accumulate(direct[i], not caps.supports_out, out_c, lse_c, o_c, l_c)
        if observer is not None:
            observer(i, c, q_c, generic_kv_concat(k_nope, views.k_pe) if unpacked else k, v, o_c, l_c)
        if stop is not None and timer.cuda:
            ends.append(cast(torch.cuda.Event, timer.last))

    if out is None or lse is None:  # set above: allocated, or (single) the backend's result
        raise AssertionError("the chunk loop ended without its result tensors")
    if merge_stream is not None:
        torch.cuda.current_stream(device).wait_stream(merge_stream)
    return PendingLoop(out, lse, counts, timer, unpacked)
