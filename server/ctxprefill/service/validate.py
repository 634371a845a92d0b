"""Every check of a request, in one place, before any work (CONTRACT §7).

Each function takes a request message and the engine's configuration and returns
what the engine takes (CPU tensors viewing the request's bytes, ``SequenceSpec``s,
``ContextChunk``s), or raises an error naming the field at fault:

- ``InvalidArgument``: dtype, shape, data length, negative lengths, sums that
  disagree, a block table too short, a malformed plan, a response that would exceed
  the message size limit;
- ``OutOfRange``: a slot or block id outside the cache;
- ``FailedPrecondition``: ``expected_instance_id`` set and not this server's.

The engine and the cache check indices again on their side (a bad index on the GPU
would kill the process and lose the whole cache), so this layer is about early,
precise answers; the engine's checks are the last line.

Shared memory: each function takes the request's ``shared_memory.Lease`` (None when
``--shared-memory`` is off). Tensors placed in regions are checked and held through
it (NOT_FOUND, OUT_OF_RANGE, INVALID_ARGUMENT naming ``<field>.shared_memory...``),
and so are PrefillContext's output placements (``output_region``, ``lse_region``).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from ctxprefill_api import pb

from ..config import EngineConfig
from ..engine.engine import MAX_BLOCK_TABLE_ENTRIES, SequenceSpec
from ..engine.plan import ContextChunk, validate_plan
from ..errors import FailedPrecondition, InvalidArgument, OutOfRange
from . import codec
from .inline_views import data_views

#: room left in a response for everything that is not tensor data (stats, ids, framing)
RESPONSE_OVERHEAD_BYTES = 1 << 20
#: request ids are logged; longer ones are cut in logs
MAX_LOGGED_REQUEST_ID = 128
#: a request id is echoed in the response; longer ones are refused
MAX_REQUEST_ID = 1024
#: sequences of one PrefillContext request (validation walks them on the event loop)
MAX_SEQUENCES = 1 << 16
#: chunks of an explicit plan
MAX_PLAN_CHUNKS = 1 << 16

_LATENT_DTYPES = (pb.DATA_TYPE_BF16, pb.DATA_TYPE_FP32)


@dataclasses.dataclass
class WriteArgs:
    slot_mapping: torch.Tensor  # int64 [T]
    kv_c: torch.Tensor  # [T, L] bf16 | fp32
    k_pe: torch.Tensor  # [T, R] bf16 | fp32
    shared: frozenset = frozenset()  # names of the tensors that view shared memory (codec.from_shared them)
    layer: int = 0  # the model layer (checked: one the server holds)

    @property
    def tokens(self) -> int:
        return int(self.slot_mapping.shape[0])


@dataclasses.dataclass
class Placement:
    """Where a result goes in shared memory: ``view`` is its bytes (uint8) in ``region``."""

    region: str
    kind: str
    offset: int
    view: torch.Tensor


@dataclasses.dataclass
class PrefillArgs:
    q: torch.Tensor  # [Tq, H, P+R]
    sequences: list[SequenceSpec]
    workspace_tokens: int
    plan: list[ContextChunk] | None
    q_shared: bool = False  # q views shared memory (codec.from_shared it on the engine thread)
    output_to: Placement | None = None  # output_region, when set
    lse_to: Placement | None = None  # lse_region, when set
    layer: int = 0  # the model layer (checked: one the server holds)
    cache_write: WriteArgs | None = None  # latents written after the attention (cache_write), when set


def layer_of(req, cfg: EngineConfig) -> int:
    """The model layer a request names (its ``layer``; absent, a one-layer server's only
    one), checked against the layers the server holds."""
    layer = req.layer if req.HasField("layer") else None
    return cfg.first_layer + cfg.layer_position(layer)


def check_instance(req, instance_id: str) -> None:
    """FAILED_PRECONDITION when the request expects another server instance."""
    if req.HasField("expected_instance_id") and req.expected_instance_id != instance_id:
        raise FailedPrecondition(
            "expected_instance_id",
            f"this server is instance {instance_id!r}, not {req.expected_instance_id!r}: it restarted and its "
            f"cache no longer holds the tokens written before; re-populate the cache",
        )


def _check_slots(slots: torch.Tensor, num_slots: int, allow_skip: bool, field: str = "slot_mapping") -> None:
    if slots.numel() == 0:
        return
    lo = -1 if allow_skip else 0
    bad = (slots < lo) | (slots >= num_slots)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise OutOfRange(
            f"{field}[{i}]",
            f"slot {int(slots[i])} is outside [{lo}, {num_slots})" + (" (-1 skips a token)" if allow_skip else ""),
        )


def _check_response_size(field: str, nbytes: int, max_message_bytes: int) -> None:
    if nbytes + RESPONSE_OVERHEAD_BYTES > max_message_bytes:
        raise InvalidArgument(
            field,
            f"the response would carry {nbytes} bytes of tensor data, over the server's message size limit "
            f"({max_message_bytes} bytes); split the request",
        )


def validate_write(req: pb.WriteCacheRequest, cfg: EngineConfig, shm=None) -> WriteArgs:
    return _write_args(req, cfg, layer_of(req, cfg), shm, inline=data_views(req))


def _write_args(msg, cfg: EngineConfig, layer: int, shm, where: str = "", inline: dict | None = None) -> WriteArgs:
    """The slot_mapping, kv_c and k_pe of a WriteCacheRequest or a CacheWrite (``where``:
    the prefix of its fields in error messages, e.g. ``cache_write.``; ``inline``: their
    bytes when the request carried them beside the message, ``inline_views``)."""
    inline = inline or {}
    L, R = cfg.shape.kv_lora_rank, cfg.shape.qk_rope_head_dim
    slots = codec.decode(msg.slot_mapping, f"{where}slot_mapping", (pb.DATA_TYPE_INT64,), ndim=1, shm=shm, index=True,
                         data=inline.get("slot_mapping"))
    T = slots.shape[0]
    tensors = {}
    for name, width in (("kv_c", L), ("k_pe", R)):
        t, field = getattr(msg, name), where + name
        _, shape = codec.check_tensor(t, field, _LATENT_DTYPES, ndim=2)
        if shape != (T, width):
            raise InvalidArgument(field, f"must have shape [{T}, {width}] (T from slot_mapping), got {list(shape)}")
        tensors[name] = codec.decode(t, field, _LATENT_DTYPES, ndim=2, shm=shm, data=inline.get(name))
    _check_slots(slots, cfg.cache.num_slots, allow_skip=True, field=f"{where}slot_mapping")
    shared = frozenset(n for n in ("kv_c", "k_pe") if getattr(msg, n).HasField("shared_memory"))
    return WriteArgs(slots, tensors["kv_c"], tensors["k_pe"], shared, layer)


def validate_read(req: pb.ReadCacheRequest, cfg: EngineConfig, max_message_bytes: int,
                  shm=None) -> tuple[torch.Tensor, int]:
    """``(slots, model layer)``."""
    layer = layer_of(req, cfg)
    slots = codec.decode(req.slot_mapping, "slot_mapping", (pb.DATA_TYPE_INT64,), ndim=1, shm=shm, index=True)
    _check_response_size("slot_mapping", slots.shape[0] * cfg.cache.bytes_per_slot, max_message_bytes)
    _check_slots(slots, cfg.cache.num_slots, allow_skip=False)
    return slots, layer


def _q_wire_dtype(cfg: EngineConfig) -> int:
    return pb.DATA_TYPE_FP8_E4M3 if cfg.prefill_dtype == "fp8" else pb.DATA_TYPE_BF16


def _placements(req: pb.PrefillContextRequest, out_bytes: int, lse_bytes: int, shm):
    """output_region / lse_region of a request: checked and held, or None each."""
    from .shared_memory import off_message

    got = []
    for field, nbytes, itemsize in (("output_region", out_bytes, 2), ("lse_region", lse_bytes, 4)):
        if not req.HasField(field):
            got.append(None)
            continue
        if shm is None:
            raise InvalidArgument(field, off_message() + "; leave it unset to get the result inline")
        ref = getattr(req, field)
        region, view = shm.resolve(ref, field, nbytes, itemsize, exact=False)
        got.append(Placement(region.name, region.kind, int(ref.offset), view))
    out_to, lse_to = got
    if out_to is not None and lse_to is not None and out_to.region == lse_to.region and out_bytes and lse_bytes:
        a, b = out_to.offset, lse_to.offset
        if a < b + lse_bytes and b < a + out_bytes:
            raise InvalidArgument("lse_region", f"bytes [{b}, {b + lse_bytes}) of region {lse_to.region!r} overlap the "
                                                f"output's [{a}, {a + out_bytes})")
    return out_to, lse_to


def validate_prefill(req: pb.PrefillContextRequest, cfg: EngineConfig, max_message_bytes: int,
                     shm=None) -> PrefillArgs:
    shape, cache = cfg.shape, cfg.cache
    H, D, V = shape.heads, shape.qk_head_dim, shape.v_head_dim
    bs, num_blocks = cache.block_size, cache.num_blocks

    if len(req.request_id) > MAX_REQUEST_ID:
        raise InvalidArgument("request_id", f"has {len(req.request_id)} characters, at most {MAX_REQUEST_ID}")
    nseq = len(req.sequences)
    if nseq > MAX_SEQUENCES:
        raise InvalidArgument("sequences", f"{nseq} sequences, at most {MAX_SEQUENCES} per request; split the request")
    if len(req.plan) > MAX_PLAN_CHUNKS:
        raise InvalidArgument("plan", f"{len(req.plan)} chunks, at most {MAX_PLAN_CHUNKS}")
    layer = layer_of(req, cfg)

    # -- q: dtype and shape before its bytes are touched
    want = _q_wire_dtype(cfg)
    wire, q_shape = codec.check_tensor(req.q, "q")
    if wire != want:
        raise InvalidArgument(
            "q", f"dtype {codec.dtype_name(wire)} does not match the server's prefill dtype {cfg.prefill_dtype} "
                 f"(send {codec.dtype_name(want)})"
        )
    if len(q_shape) != 3 or q_shape[1] != H or q_shape[2] != D:
        raise InvalidArgument("q", f"shape {list(q_shape)} is not [Tq, {H}, {D}]")
    Tq = q_shape[0]
    out_to, lse_to = _placements(req, Tq * H * V * 2, H * Tq * 4, shm)
    _check_response_size("q", (0 if out_to else Tq * H * V * 2) + (0 if lse_to else H * Tq * 4), max_message_bytes)
    q = codec.decode(req.q, "q", shm=shm, data=data_views(req).get("q"))  # its length before its rows are compared

    # -- workspace
    W = cfg.workspace_tokens
    if req.HasField("workspace_tokens"):
        W = req.workspace_tokens
        if W < bs:
            raise InvalidArgument("workspace_tokens", f"{W} is less than one block ({bs})")
        if W > cfg.workspace_tokens:
            raise InvalidArgument("workspace_tokens", f"{W} exceeds the server's workspace ({cfg.workspace_tokens})")

    # -- sequences: lengths, sums, block tables (only the used prefix matters)
    seqs: list[SequenceSpec] = []
    total_q = 0
    max_need = 0
    for i, s in enumerate(req.sequences):
        ql, cl = s.query_len, s.context_len
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
        bt = s.block_table
        if len(bt) < need:
            raise InvalidArgument(
                f"sequences[{i}].block_table",
                f"has {len(bt)} blocks; context_len {cl} needs {need} blocks of {bs}",
            )
        # the engine takes the array as it is. np.array of the whole repeated field takes its
        # fast path (2 µs for 1,024 entries; a slice first makes a list: 26 µs), unless
        # the table is much longer than what the context uses
        used = (np.array(bt, dtype=np.int64)[:need] if len(bt) <= 2 * need + 1024
                else np.asarray(bt[:need], dtype=np.int64))
        if need and (used.min() < 0 or used.max() >= num_blocks):
            j = int(np.flatnonzero((used < 0) | (used >= num_blocks))[0])
            raise OutOfRange(f"sequences[{i}].block_table[{j}]", f"block {int(used[j])} is outside [0, {num_blocks})")
        total_q += ql
        seqs.append(SequenceSpec(ql, cl, used))
    if total_q != Tq:
        raise InvalidArgument(
            "sequences", f"query_len values sum to {total_q} but q has {Tq} rows (q.shape[0] must equal the sum)"
        )

    # -- an explicit plan: structure here, coverage by the engine's plan validator
    plan = None
    if len(req.plan):
        plan = []
        for k, c in enumerate(req.plan):
            where = f"plan[{k}]"
            if c.num_sequences < 1:
                raise InvalidArgument(f"{where}.num_sequences", f"must be >= 1, got {c.num_sequences}")
            for name in ("context_start", "context_len"):
                got = len(getattr(c, name))
                if got != c.num_sequences:
                    raise InvalidArgument(
                        f"{where}.{name}", f"has {got} entries, num_sequences is {c.num_sequences}"
                    )
            plan.append(ContextChunk(c.first_sequence, tuple(c.context_start), tuple(c.context_len)))
        validate_plan(plan, [s.context_len for s in seqs], W)

    write = (_write_args(req.cache_write, cfg, layer, shm, "cache_write.", data_views(req, "cache_write"))
             if req.HasField("cache_write") else None)
    return PrefillArgs(q, seqs, W, plan, req.q.HasField("shared_memory"), out_to, lse_to, layer, write)


def request_id_for_logs(request_id: str) -> str:
    return request_id if len(request_id) <= MAX_LOGGED_REQUEST_ID else request_id[:MAX_LOGGED_REQUEST_ID] + "…"
