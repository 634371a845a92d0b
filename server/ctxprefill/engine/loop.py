"""The chunk loop (CONTRACT §5): gather → cast → kv_b_proj → pack → attention → accumulate.

The generic and the fused path differ only in the pack; everything else is the same
code, so a difference in results can only come from the pack. With bf16 prefill and a
backend that ``takes_k_rope``, the fused path packs no K at all (``unpacked_keys``):
attention reads k_nope from the ``kv_b_proj`` output and k_pe from the workspace where
they lie, loading the same tiles a packed K gives it (docs/DESIGN.md "Unpacked keys").
The ``out`` contract:
with a backend that ``supports_out()``, the output buffers exist before any chunk,
rows no direct write will reach are set to 0 / -inf, each non-continuation chunk is
computed straight into ``out[token_slice]``, and a continuation chunk computes into
scratch and is merged in. Every backend that claims ``supports_out`` is checked to
have written into the buffer it was given.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np
import torch

from ..backends.base import AttentionBackend
from ..ops import launches
from ..ops.cast import cast_latent
from ..ops.fp8 import FP8
from ..ops.gather import gather
from ..ops.kv_b_proj import kv_b_proj
from ..ops.merge import merge
from ..ops.pack import (
    fused_mla_kv_concat,
    fused_mla_kv_concat_quant_fp8,
    generic_kv_concat,
    generic_kv_concat_quant_fp8,
    KeysLast,
    keys_last_starts,
)
from .plan import ContextChunk
from .timing import StageTimer

STAGES = ("gather", "cast", "kv_b_proj", "pack", "attention", "merge")


@dataclasses.dataclass
class LoopInputs:
    """Everything one request's chunk loop reads; tensors on the engine's device."""

    q: torch.Tensor  # [Tq, H, 192] bf16, or fp8 for fp8 prefill
    query_lens: Sequence[int]
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
    unpacked_keys: bool = False  # fused bf16 prefill: no K pack where the backend takes k_rope apart
    latent: int = 512
    nope: int = 128
    v_dim: int = 128


@dataclasses.dataclass
class LoopResult:
    out: torch.Tensor  # [Tq, H, V] bf16
    lse: torch.Tensor  # [H, Tq] float32
    launches: Counter
    stage_ns: dict[str, int]
    total_ns: int
    span_ns: int = 0  # first stage's start to last stage's end (engine/timing.py)
    unpacked_keys: bool = False  # attention read K's two parts where they lie (no pack)


#: observer(chunk_index, chunk, q, k, v, out, lse) — tests compare paths chunk by chunk
#: (with unpacked keys, k is packed for the observer alone, by the generic pack)
Observer = Callable[[int, ContextChunk, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


def keys_apart_wanted(fused: bool, unpacked_keys: bool, fp8_prefill: bool) -> bool:
    """Whether the path would hand attention K's two parts where they lie, given a backend
    that takes k_rope: the fused path with unpacked keys on and bf16 prefill (fp8's pack
    is also its quantization; with bf16 prefill the workspace's k_pe is bf16 too: only fp8
    prefill gathers raw fp8)."""
    return fused and unpacked_keys and not fp8_prefill


def keys_apart(backend: AttentionBackend, fused: bool, unpacked_keys: bool, fp8_prefill: bool) -> bool:
    """Whether the chunk loop hands attention K's two parts where they lie (no K pack)."""
    return keys_apart_wanted(fused, unpacked_keys, fp8_prefill) and backend.takes_k_rope(torch.bfloat16)


def _upload(host: np.ndarray, device) -> torch.Tensor:
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


def _chunk_metadata(x: LoopInputs, device, keys_last: bool = False) -> tuple[torch.Tensor, list[tuple]]:
    """(the block table on the device, and per chunk: (cu_seq_lens, seq_starts, cu_seqlens_q,
    q0, q1, max_q, V keys-last layout or None)), built on the host and moved to the device
    in one copy for the whole request. Equal metadata vectors are uploaded once and shared
    (the chunks of one long sequence differ only in their starts): a view costs the host
    1-5 us, and host time before the first stage adds to the request's latency."""
    q_offsets = [0]
    for n in x.query_lens:
        q_offsets.append(q_offsets[-1] + n)
    host, sizes, spans = [], [], []
    slot: dict[tuple, int] = {}  # a vector's values -> its index among the uploaded parts

    def part(values: list) -> int:
        key = tuple(values)
        i = slot.get(key)
        if i is None:
            i = slot[key] = len(sizes)
            host.extend(values)
            sizes.append(len(values))
        return i

    for c in x.chunks:
        cu_k, cu_q = [0], [0]
        for s, n in zip(c.sequences, c.context_lens):
            cu_k.append(cu_k[-1] + n)
            cu_q.append(cu_q[-1] + x.query_lens[s])
        cu_v = keys_last_starts(cu_k) if keys_last else []
        idx = (part(cu_k), part(list(c.context_starts)), part(cu_q), part(cu_v) if keys_last else -1)
        n = c.num_sequences
        spans.append((q_offsets[c.first_sequence], q_offsets[c.first_sequence + n],
                      max((x.query_lens[s] for s in c.sequences), default=0), cu_k, cu_v, idx))
    bt = np.ascontiguousarray(x.block_table, dtype=np.int32)
    dev = _upload(np.concatenate([np.asarray(host, dtype=np.int32), bt.ravel()]), device)
    # the per-chunk tensors as views of the one upload, made in one call
    parts = dev.split_with_sizes(sizes + [bt.size])
    meta = []
    for q0, q1, max_q, cu_k_host, cu_v_host, (ik, i_s, iq, iv) in spans:
        layout = KeysLast(cu_k_host, cu_v_host, parts[ik], parts[iv]) if keys_last else None
        meta.append((parts[ik], parts[i_s], parts[iq], q0, q1, max_q, layout))
    block_table = parts[-1].view(bt.shape)
    return block_table, meta


def _launch_order(backend: AttentionBackend, x: LoopInputs, c: ContextChunk, heads: int, q_dtype, device):
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
    codes, extra = got
    cuda = torch.device(device).type == "cuda"
    return torch.tensor(codes, dtype=torch.int32, pin_memory=cuda).to(device, non_blocking=cuda), extra


class _Stage:
    """``with stage("gather"):`` — the launches noted inside count under that stage and its
    device time is recorded. A plain class rather than two generator-based context
    managers: a request of 4 chunks enters 24 stages, and short requests are bound by
    this host time (63 -> 19 us per request on the CPU machine)."""

    __slots__ = ("counts", "timer", "name", "token", "started")

    def __init__(self, counts: Counter, timer: StageTimer):
        self.counts, self.timer = counts, timer

    def __call__(self, name: str) -> "_Stage":
        self.name = name
        return self

    def __enter__(self) -> None:
        self.token = launches.enter(self.counts, self.name)
        self.started = self.timer.begin(self.name)

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.timer.end(self.started)
        launches.leave(self.token)


class PendingLoop:
    """A chunk loop whose work is queued on the device. ``out`` and ``lse`` are the
    request's result tensors (written by that queued work); :meth:`finish` waits for it
    (the request's last event, not the whole device: a request queued behind it is not
    waited for) and reads the stage timings."""

    __slots__ = ("out", "lse", "counts", "timer", "unpacked_keys")

    def __init__(self, out, lse, counts: Counter, timer: StageTimer, unpacked_keys: bool = False):
        self.out, self.lse, self.counts, self.timer = out, lse, counts, timer
        self.unpacked_keys = unpacked_keys

    def finish(self) -> LoopResult:
        stage_ns, total_ns = self.timer.finish()
        return LoopResult(self.out, self.lse, self.counts, stage_ns, total_ns, self.timer.span_ns,
                          self.unpacked_keys)


def run_chunk_loop(x: LoopInputs, backend: AttentionBackend, fused: bool, observer: Observer | None = None) -> LoopResult:
    return start_chunk_loop(x, backend, fused, observer).finish()


def start_chunk_loop(x: LoopInputs, backend: AttentionBackend, fused: bool,
                     observer: Observer | None = None) -> PendingLoop:
    """Queue the chunk loop's work on the device and return without waiting for it."""
    q = x.q
    device = q.device
    Tq, H = q.shape[0], x.heads
    counts: Counter = Counter()
    timer = StageTimer(device)
    stage = _Stage(counts, timer)  # stages do not nest

    # fp8 P·V reads V keys-last ([H, 128, columns]) when the backend takes it: the pack
    # writes it so, each segment from a 16-aligned column (KeysLast)
    keys_last = x.fp8_prefill and backend.v_keys_last(q.dtype)
    block_table, meta = _chunk_metadata(x, device, keys_last)
    ws_dtype = FP8 if x.gather_raw_fp8 else torch.bfloat16
    # bf16 prefill on the fused path: K's two parts go to attention where they lie (no pack
    # stage, no K buffer) when the backend reads them apart
    unpacked = keys_apart(backend, fused, x.unpacked_keys, x.fp8_prefill)
    width = x.latent + 64
    direct = [not c.is_continuation for c in x.chunks]
    # Rows some direct (non-continuation) chunk writes: the union of their row slices
    # (a caller's plan may list a context-less sequence in two chunks, so they can overlap)
    written, end = 0, 0
    for q0, q1 in sorted((m[3], m[4]) for m, d in zip(meta, direct) if d):
        written += max(0, q1 - max(q0, end))
        end = max(end, q1)
    single = len(x.chunks) == 1 and direct[0] and meta[0][3] == 0 and meta[0][4] == Tq

    out = lse = None
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
    ws_views: dict[int, tuple[torch.Tensor, ...]] = {}
    for i, (c, (cu_k, starts, cu_q, q0, q1, max_q, layout)) in enumerate(zip(x.chunks, meta)):
        kw = {} if layout is None else {"v_layout": "hdt", "cu_seqlens_v": layout.cu_v_dev}
        rows = c.rows
        # this chunk's query rows of q, out and lse (out/lse are None only when single, and
        # then the chunk is the whole request)
        q_c, out_c, lse_c = (q, out, lse) if q0 == 0 and q1 == Tq else (q[q0:q1], out[q0:q1], lse[:, q0:q1])
        with stage("gather"):
            if rows not in ws_views:
                ws = x.workspace[: rows * width * ws_dtype.itemsize].view(ws_dtype).view(rows, width)
                k_pe = ws[:, x.latent :]
                # unpacked keys: k_pe as every head's rope keys, a head stride of 0 (a view
                # made only where it is used: each costs the host microseconds)
                k_rope = k_pe.unsqueeze(1).expand(rows, H, k_pe.shape[1]) if unpacked else None
                ws_views[rows] = ws, ws[:, : x.latent], k_pe, k_rope
            ws, latent, k_pe, k_rope = ws_views[rows]
            bt = block_table if c.num_sequences == block_table.shape[0] else \
                block_table[c.first_sequence : c.first_sequence + c.num_sequences]
            gather(x.cache, bt, cu_k, starts, ws, x.cache_dtype, x.k_scale, x.block_size)
        if x.kv_b_proj_bf16 and latent.dtype != torch.bfloat16:  # else no cast, and no stage:
            with stage("cast"):  # its two events and bookkeeping were ~10 us of host per chunk
                latent = cast_latent(latent, torch.bfloat16)
        with stage("kv_b_proj"):
            kv = kv_b_proj(latent, x.weight).view(rows, H, x.nope + x.v_dim)
        k_nope, v = kv[..., : x.nope], kv[..., x.nope :]
        if unpacked:
            k = k_nope
            kw["k_rope"] = k_rope
        else:
            with stage("pack"):
                if x.fp8_prefill:
                    k, v = (fused_mla_kv_concat_quant_fp8 if fused else generic_kv_concat_quant_fp8)(
                        k_nope, k_pe, v, v_keys_last=layout)
                else:
                    k = (fused_mla_kv_concat if fused else generic_kv_concat)(k_nope, k_pe)
        max_k = max(c.context_lens)
        # the backend's launch order (triton: tiles packed per SM), if it gives one here: host
        # work outside the stages (a device idle while it runs shows as the request's gap)
        order = _launch_order(backend, x, c, H, q.dtype, device)
        if order is not None:
            kw["launch_order"] = order
        with stage("attention"):
            launches.note(backend.launches_per_call())
            if single:
                out, lse = backend.run_context_chunk(q_c, k, v, cu_q, cu_k, max_q, max_k, x.scale, **kw)
                o_c, l_c = out, lse
            elif direct[i] and backend.supports_out():
                o_c, l_c = backend.run_context_chunk(q_c, k, v, cu_q, cu_k, max_q, max_k, x.scale, out=out_c,
                                                     **kw)
                if o_c.data_ptr() != out_c.data_ptr():
                    raise RuntimeError(
                        f"attention backend {backend.name!r} claims supports_out() but did not write into the "
                        f"out buffer it was given (chunk {i})"
                    )
            else:
                o_c, l_c = backend.run_context_chunk(q_c, k, v, cu_q, cu_k, max_q, max_k, x.scale, **kw)
        if not single:
            with stage("merge"):
                if direct[i]:
                    if not backend.supports_out():
                        launches.note(1)
                        out_c.copy_(o_c)
                    launches.note(1)
                    lse_c.copy_(l_c)
                else:
                    merge(out_c, lse_c, o_c, l_c)
        if observer is not None:
            observer(i, c, q_c, generic_kv_concat(k_nope, k_pe) if unpacked else k, v, o_c, l_c)

    return PendingLoop(out, lse, counts, timer, unpacked)
