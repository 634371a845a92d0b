"""The engine's request types and their checks: every semantic check of a request, once
(CONTRACT §7).

A caller (the service, a benchmark, a test) builds a :class:`PrefillRequest`,
:class:`WriteRequest` or :class:`ReadRequest` and hands it to the engine, which runs
the matching ``validate_*`` before it touches the device: shapes against the model's
dimensions, lengths, sums, block ids and slots against the cache, the workspace, an
explicit plan, the layer, the expected instance. Each failure raises the
``ctxprefill.errors`` exception naming the field (``sequences[2].block_table[5]``):

- ``InvalidArgument``: dtype, shape, negative lengths, sums that disagree, a block
  table too short, a workspace outside ``[block_size, the engine's]``, a plan that does
  not cover the context once and in order;
- ``OutOfRange``: a slot, block id or layer outside what the engine holds;
- ``FailedPrecondition``: ``expected_instance_id`` set and not this engine's;
- ``ResourceExhausted``: more context tokens × heads than ``max_context_token_heads``
  (the work of one request: CONTRACT §8, ``--max-context-token-heads``).

A request may carry a :class:`StopSignal`: the chunk loop asks it between chunks and
stops (``DeadlineExceeded`` / ``Cancelled``) once its deadline passed or its caller went
away; nothing is written then.

A one-sequence request's checks but its layer and block ids have one outcome per
:func:`shape_of`; the engine remembers a shape that replayed and checks the next such
request's layer and block ids alone (:func:`block_row`), running ``validate_prefill``
where they fail.

What the wire adds (a tensor's byte length, message size limits, shared-memory
placement) is the service's to check before it builds these.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from ..cache import host_slots
from ..config import EngineConfig
from ..errors import Cancelled, DeadlineExceeded, FailedPrecondition, InvalidArgument, OutOfRange, ResourceExhausted
from .plan import ContextChunk, plan_chunks, validate_plan

#: entries of the padded block-table matrix built per request (sequences x the longest
#: used table): 16 Mi int32 = 64 MiB; a larger request must be split by the caller
MAX_BLOCK_TABLE_ENTRIES = 1 << 24

#: dtypes by the names the wire gives them (what a caller sends, what an error names)
DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.bfloat16: "BF16", torch.float16: "FP16", torch.float32: "FP32", torch.float8_e4m3fn: "FP8_E4M3",
    torch.int32: "INT32", torch.int64: "INT64", torch.uint8: "UINT8",
}
_LATENT_DTYPES = (torch.bfloat16, torch.float32)
# numpy's dtypes of the native byte order, compared by identity (block_row: a request's host time)
_INT64, _INT32, _UINT64, _UINT32 = (np.dtype(t) for t in (np.int64, np.int32, np.uint64, np.uint32))


def dtype_name(dtype: torch.dtype) -> str:
    return DTYPE_NAMES.get(dtype, str(dtype))


class StopSignal:
    """Whether a request's work should stop, asked by the chunk loop before each chunk:
    its ``deadline`` (``time.monotonic()`` seconds) passed, :meth:`cancel` was called (from
    any thread: the caller went away), or ``gone()`` says the caller went away. It reads a
    flag and the clock: no device sync."""

    __slots__ = ("deadline", "gone", "_reason")

    def __init__(self, deadline: float | None = None, gone: Callable[[], bool] | None = None):
        self.deadline = deadline
        self.gone = gone
        self._reason: str | None = None

    def cancel(self, reason: str = "cancelled") -> None:
        """Stop at the next chunk; ``reason``: "cancelled", or "deadline" where the caller
        knows its deadline passed (gRPC cancels a call whose deadline passes)."""
        if self._reason is None:
            self._reason = reason

    def reason(self) -> str | None:
        """"deadline", "cancelled", or None while the work goes on."""
        if self._reason is not None:
            return self._reason
        if self.deadline is not None and time.monotonic() >= self.deadline:
            return "deadline"
        if self.gone is not None and self.gone():
            return "cancelled"
        return None

    def check(self, done: int, planned: int) -> None:
        """Raise ``DeadlineExceeded`` / ``Cancelled`` when the work should stop, ``done`` of
        ``planned`` chunks queued."""
        why = self.reason()
        if why is None:
            return
        if why == "deadline":
            raise DeadlineExceeded(f"the deadline passed after {done} of {planned} chunks; the request was stopped "
                                   f"and wrote nothing", done, planned)
        raise Cancelled(f"the caller went away after {done} of {planned} chunks; the request was stopped and "
                        f"wrote nothing", done, planned)


@dataclasses.dataclass(frozen=True)
class SequenceSpec:
    """One sequence of a PrefillContext request.

    query_len: its rows of q (>= 0).
    context_len: its cached context tokens (>= 0).
    block_table: cache block ids (int); the first ``ceil(context_len / block_size)`` are
        used. Any sequence of ints: a list, a protobuf repeated field, an int64 numpy
        array or a tensor.
    """

    query_len: int
    context_len: int
    block_table: Sequence[int] | np.ndarray | torch.Tensor = ()


@dataclasses.dataclass(frozen=True)
class WriteRequest:
    """Latents of ``T`` tokens into one layer's cache (WriteCache, or a PrefillContext's
    ``cache_write``).

    slot_mapping: int64 ``[T]``; slot ``-1`` skips the token. Read on the host.
    kv_c: bf16 or float32 ``[T, L]`` (L = kv_lora_rank, 512).
    k_pe: bf16 or float32 ``[T, R]`` (R = qk_rope_head_dim, 64).
    layer: the model layer; None names a one-layer engine's only one.
    expected_instance_id: when set, the engine's ``instance_id`` it must be.
    """

    slot_mapping: torch.Tensor
    kv_c: torch.Tensor
    k_pe: torch.Tensor
    layer: int | None = None
    expected_instance_id: str | None = None


@dataclasses.dataclass(frozen=True)
class ReadRequest:
    """Raw bytes of cache slots.

    slot_mapping: int64 ``[T]``, each in ``[0, num_slots)``. Read on the host.
    layer, expected_instance_id: as for :class:`WriteRequest`.
    """

    slot_mapping: torch.Tensor
    layer: int | None = None
    expected_instance_id: str | None = None


@dataclasses.dataclass(frozen=True)
class PrefillRequest:
    """New tokens' attention over their sequences' cached context (CONTRACT §1, §3).

    q: ``[Tq, H, P + R]`` (H heads, P + R = 192): bf16, or float8_e4m3fn where the
        engine's prefill dtype is fp8. Host or device memory.
    sequences: S sequences; their ``query_len`` values sum to ``Tq`` (q's rows are
        the sequences' queries, in order).
    workspace_tokens: the largest chunk, in ``[block_size, the engine's]``; None: the
        engine's.
    plan: the chunks to compute, covering every context token once and in order;
        None: the engine plans them (CONTRACT §4).
    layer: the model layer; None names a one-layer engine's only one.
    expected_instance_id: when set, the engine's ``instance_id`` it must be.
    cache_write: latents written into the same layer's cache after the attention
        (which never sees them); its ``layer`` and ``expected_instance_id`` are unused.
    stop: asked between chunks; when it says stop, the request ends with
        ``DeadlineExceeded`` / ``Cancelled`` and its ``cache_write`` is not written.

    The result (``PrefillResult``): out bf16 ``[Tq, H, V]`` (V = 128) and lse float32
    ``[H, Tq]``, natural log; a row without context is 0 / -inf.
    """

    q: torch.Tensor
    sequences: Sequence[SequenceSpec]
    workspace_tokens: int | None = None
    plan: Sequence[ContextChunk] | None = None
    layer: int | None = None
    expected_instance_id: str | None = None
    cache_write: WriteRequest | None = None
    stop: StopSignal | None = None


@dataclasses.dataclass(frozen=True)
class CheckedWrite:
    """A :class:`WriteRequest` that passed :func:`validate_write`; ``slot_mapping`` on the host."""

    layer_position: int  # among the layers the engine holds (0: the first)
    slot_mapping: torch.Tensor  # int64 [T], host
    kv_c: torch.Tensor
    k_pe: torch.Tensor


@dataclasses.dataclass(slots=True)
class CheckedPrefill:
    """A :class:`PrefillRequest` that passed :func:`validate_prefill`: what the chunk loop
    reads. Not frozen: built per request, and a frozen dataclass costs the host ~2.5 µs more."""

    q: torch.Tensor
    layer_position: int
    workspace_tokens: int
    query_lens: list[int]
    context_lens: list[int]
    block_table: np.ndarray  # int32 [S, max(1, longest used table)], every used entry in range
    chunks: list[ContextChunk]
    cache_write: CheckedWrite | None
    stop: StopSignal | None = None


def check_instance(expected: str | None, instance_id: str) -> None:
    """FAILED_PRECONDITION when the caller expects another engine instance."""
    if expected is not None and expected != instance_id:
        raise FailedPrecondition(
            "expected_instance_id",
            f"this server is instance {instance_id!r}, not {expected!r}: it restarted and its "
            f"cache no longer holds the tokens written before; re-populate the cache",
        )


def q_dtype(config: EngineConfig) -> torch.dtype:
    """The dtype of q the engine computes with (its prefill dtype)."""
    return torch.float8_e4m3fn if config.prefill_dtype == "fp8" else torch.bfloat16


def _check_dtype(t: torch.Tensor, field: str, allowed: tuple[torch.dtype, ...]) -> None:
    if t.dtype not in allowed:
        names = " or ".join(dtype_name(d) for d in allowed)
        raise InvalidArgument(field, f"dtype {dtype_name(t.dtype)} not allowed here (expected {names})")


def _check_ndim(t: torch.Tensor, field: str, ndim: int) -> None:
    if t.dim() != ndim:
        raise InvalidArgument(field, f"must have {ndim} dimensions, got shape {list(t.shape)}")


def _host_slots(slots: torch.Tensor, num_slots: int, allow_skip: bool, field: str) -> torch.Tensor:
    """``slots`` (int64 ``[T]``) on the host, each in ``[0, num_slots)`` (or -1 with ``allow_skip``)."""
    _check_dtype(slots, field, (torch.int64,))
    _check_ndim(slots, field, 1)
    return host_slots(slots, num_slots, field, allow_skip)


def validate_write(request: WriteRequest, config: EngineConfig, instance_id: str) -> CheckedWrite:
    check_instance(request.expected_instance_id, instance_id)
    return _checked_write(request, config, config.layer_position(request.layer), "")


def checked_cache_write(request: WriteRequest, config: EngineConfig, layer_position: int) -> CheckedWrite:
    """A PrefillContext's ``cache_write`` checked as :func:`validate_prefill` checks it."""
    return _checked_write(request, config, layer_position, "cache_write.")


def _checked_write(request: WriteRequest, config: EngineConfig, layer_position: int, where: str) -> CheckedWrite:
    """``where``: the prefix of the request's fields in error messages (``cache_write.``)."""
    slots = _host_slots(request.slot_mapping, config.cache.num_slots, True, f"{where}slot_mapping")
    T = slots.shape[0]
    for name, t, width in (("kv_c", request.kv_c, config.shape.kv_lora_rank),
                           ("k_pe", request.k_pe, config.shape.qk_rope_head_dim)):
        field = where + name
        _check_dtype(t, field, _LATENT_DTYPES)
        _check_ndim(t, field, 2)
        if tuple(t.shape) != (T, width):
            raise InvalidArgument(field, f"must have shape [{T}, {width}] (T from slot_mapping), got {list(t.shape)}")
    return CheckedWrite(layer_position, slots, request.kv_c, request.k_pe)


def validate_read(request: ReadRequest, config: EngineConfig, instance_id: str) -> tuple[int, torch.Tensor]:
    """``(layer position, host slots)``."""
    check_instance(request.expected_instance_id, instance_id)
    position = config.layer_position(request.layer)
    return position, _host_slots(request.slot_mapping, config.cache.num_slots, False, "slot_mapping")


def _used_blocks(table: Sequence[int] | np.ndarray | torch.Tensor, need: int) -> np.ndarray:
    """The first ``need`` entries of a block table as int64. np.array of a whole protobuf
    repeated field takes its fast path (2 µs for 1,024 entries; a slice first makes a
    list: 26 µs), unless the table is much longer than what the context uses."""
    if isinstance(table, torch.Tensor):
        return table[:need].to("cpu", torch.int64).numpy()
    if isinstance(table, np.ndarray):
        return table[:need].astype(np.int64, copy=False)
    if len(table) <= 2 * need + 1024:
        return np.array(table, dtype=np.int64)[:need]
    return np.asarray(table[:need], dtype=np.int64)


def shape_of(request: PrefillRequest, instance_id: str) -> tuple[object, ...] | None:
    """What :func:`validate_prefill` checks of a one-sequence request but its layer and block
    ids — q's dtype and shape, the sequence's query and context lengths — as a key (requests
    equal in it pass or fail those checks alike), or None for a request with more
    sequences, a plan, a workspace or another instance expected (checked in full)."""
    if request.plan is not None or request.workspace_tokens is not None or len(request.sequences) != 1 \
            or (request.expected_instance_id is not None and request.expected_instance_id != instance_id):
        return None
    s = request.sequences[0]
    q = request.q
    return q.dtype, q.shape, s.query_len, s.context_len


def block_row(table: Sequence[int] | np.ndarray | torch.Tensor, need: int, num_blocks: int) -> np.ndarray | None:
    """A block table's first ``need`` ids, int64 or int32 (as given), where it has them all
    in ``[0, num_blocks)``; None otherwise (:func:`validate_prefill` names what is wrong).
    The check of a request whose :func:`shape_of` passed before."""
    if isinstance(table, np.ndarray):
        if table.dtype is not _INT64 and table.dtype is not _INT32:  # (another byte order: the full checks)
            return None
        row = table[:need]
    elif isinstance(table, torch.Tensor):
        return None
    else:
        try:
            row = _used_blocks(table, need)
        except (OverflowError, TypeError, ValueError):
            return None
    if row.shape != (need,) or (need and _largest_id(row) >= num_blocks):  # short, or an id out of range
        return None
    return row


def _largest_id(ids: np.ndarray) -> int:
    """The largest of int64 or int32 ``ids`` read as unsigned, so that a negative id is past
    every valid one: one pass for both ends of the range. argmax, not a max reduction: less
    of numpy's code to run where the request finds the caches cold (bench/probe_host_cold.py)."""
    unsigned = ids.view(_UINT64 if ids.itemsize == 8 else _UINT32)
    return int(unsigned.item(unsigned.argmax()))


def validate_prefill(request: PrefillRequest, config: EngineConfig, instance_id: str) -> CheckedPrefill:
    check_instance(request.expected_instance_id, instance_id)
    position = config.layer_position(request.layer)
    shape, cache = config.shape, config.cache
    H, D = shape.heads, shape.qk_head_dim
    bs, num_blocks = cache.block_size, cache.num_blocks

    q, want = request.q, q_dtype(config)
    if q.dtype != want:
        raise InvalidArgument("q", f"dtype {dtype_name(q.dtype)} does not match the server's prefill dtype "
                                   f"{config.prefill_dtype} (send {dtype_name(want)})")
    q_shape = q.shape
    if len(q_shape) != 3 or q_shape[1] != H or q_shape[2] != D:
        raise InvalidArgument("q", f"shape {list(q_shape)} is not [Tq, {H}, {D}]")

    W = config.workspace_tokens
    if request.workspace_tokens is not None:
        W = int(request.workspace_tokens)
        if W < bs:
            raise InvalidArgument("workspace_tokens", f"{W} is less than one block ({bs})")
        if W > config.workspace_tokens:
            raise InvalidArgument("workspace_tokens", f"{W} exceeds the server's workspace ({config.workspace_tokens})")

    # sequences: lengths, sums, block tables (only the used prefix matters)
    seqs = request.sequences
    nseq = len(seqs)
    rows: list[np.ndarray] = []
    query_lens: list[int] = []
    context_lens: list[int] = []
    max_need = 0
    total_context, max_work = 0, config.max_context_token_heads
    for i, s in enumerate(seqs):
        ql, cl = int(s.query_len), int(s.context_len)
        if ql < 0:
            raise InvalidArgument(f"sequences[{i}].query_len", f"must be >= 0, got {ql}")
        if cl < 0:
            raise InvalidArgument(f"sequences[{i}].context_len", f"must be >= 0, got {cl}")
        need = -(-cl // bs)
        max_need = max(max_need, need)
        if nseq * max_need > MAX_BLOCK_TABLE_ENTRIES:
            raise InvalidArgument(
                f"sequences[{i}].context_len",
                f"{nseq} sequences with up to {max_need} blocks each exceed {MAX_BLOCK_TABLE_ENTRIES} block-table "
                f"entries per request; split the request",
            )
        if len(s.block_table) < need:
            raise InvalidArgument(f"sequences[{i}].block_table",
                                  f"has {len(s.block_table)} blocks; context_len {cl} needs {need} blocks of {bs}")
        total_context += cl
        if total_context * H > max_work:  # a well-formed request's work; before its table is read
            raise ResourceExhausted(
                f"sequences[{i}].context_len",
                f"sequences[0..{i}] hold {total_context} context tokens: x {H} heads = {total_context * H} "
                f"context-token-heads, over this server's --max-context-token-heads {max_work}; split the request "
                f"(at most {max_work // H} context tokens each here)",
            )
        rows.append(_used_blocks(s.block_table, need))
        query_lens.append(ql)
        context_lens.append(cl)
    total_q = sum(query_lens)
    if total_q != q_shape[0]:
        raise InvalidArgument("sequences", f"query_len values sum to {total_q} but q has {q_shape[0]} rows "
                                           f"(q.shape[0] must equal the sum)")
    # every used block id in [0, num_blocks) (_largest_id), then int32; numpy, not torch:
    # 1,024 blocks (64k tokens) took ~140 µs through torch, host time of every request
    if nseq == 1 and max_need:
        table = rows[0].reshape(1, -1)
    else:
        table = np.zeros((nseq, max(max_need, 1)), dtype=np.int64)
        for i, used in enumerate(rows):
            table[i, : used.shape[0]] = used
    if max_need and _largest_id(table) >= num_blocks:
        i, j = (int(k[0]) for k in np.nonzero((table < 0) | (table >= num_blocks)))
        raise OutOfRange(f"sequences[{i}].block_table[{j}]", f"block {int(table[i, j])} is outside [0, {num_blocks})")
    block_table = table.astype(np.int32)

    if request.plan is None:
        chunks = plan_chunks(context_lens, W, bs)
    else:
        chunks = list(request.plan)
        validate_plan(chunks, context_lens, W)

    write = None
    if request.cache_write is not None:
        write = checked_cache_write(request.cache_write, config, position)
    return CheckedPrefill(q, position, W, query_lens, context_lens, block_table, chunks, write, request.stop)
