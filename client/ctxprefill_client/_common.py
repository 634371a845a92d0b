"""What the sync and asyncio clients share: types, errors, request building, response
decoding, retry policy and instance-id tracking. No I/O here."""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Mapping
from collections.abc import Sequence as _SeqABC
from dataclasses import dataclass, field, fields
from typing import Any

import grpc
import numpy as np

from ctxprefill_api import pb
from ctxprefill_api.wire import finish, place_tensor

from .shared_memory import (
    CudaSharedMemoryRegion,
    SharedMemoryRef,
    SharedMemoryTensor,
    SystemSharedMemoryRegion,
    kind_names,
)
from .tensors import (
    BF16,
    FP8_E4M3,
    FP32,
    INT64,
    UINT8,
    RawTensor,
    bf16_bits_to_float32,
    decode_tensor,
    dtype_name,
    encode_tensor,
    storage_dtype,
    tensor_bits,
)

DEFAULT_TIMEOUT_S = 60.0
DEFAULT_MAX_MESSAGE_BYTES = 512 * 1024 * 1024
DEFAULT_RETRIES = 3
DEFAULT_BACKOFF_BASE_S = 0.1
DEFAULT_BACKOFF_MAX_S = 5.0

# The only status code retried as is: the server is draining, restarting or not reachable.
RETRYABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE})


# --------------------------------------------------------------------------- errors


class CtxPrefillError(Exception):
    """Base class of every error this client raises."""


class CtxPrefillRpcError(CtxPrefillError):
    """An RPC failed with a gRPC status. ``code`` is a ``grpc.StatusCode``."""

    def __init__(self, method: str, code: grpc.StatusCode | None, details: str) -> None:
        self.method = method
        self.code = code
        self.details = details
        name = code.name if code is not None else "?"
        super().__init__(f"{method} failed: {name}: {details}")


class ServerRestartedError(CtxPrefillRpcError):
    """The server is not the instance this client saw first: it restarted and its
    cache (in GPU memory) is gone, so block tables and slots written before now point
    at nothing. Re-populate the cache, then call ``reset_instance()`` on the client.

    Raised for FAILED_PRECONDITION on a request that carried ``expected_instance_id``,
    and when a response reports an instance id other than the remembered one.
    """

    def __init__(
        self,
        method: str,
        expected_instance_id: str | None,
        actual_instance_id: str | None,
        details: str = "",
        code: grpc.StatusCode | None = grpc.StatusCode.FAILED_PRECONDITION,
    ) -> None:
        self.expected_instance_id = expected_instance_id
        self.actual_instance_id = actual_instance_id
        msg = (
            f"server instance changed (expected {expected_instance_id!r}, "
            f"got {actual_instance_id if actual_instance_id is not None else 'another'}); "
            "its cache is gone"
        )
        if details:
            msg += f": {details}"
        super().__init__(method, code, msg)


class ResponseDecodeError(CtxPrefillError):
    """A response did not have the shape or dtype the API promises."""


# --------------------------------------------------------------------------- types


@dataclass(frozen=True)
class Sequence:
    """One sequence of a PrefillContext batch (see the proto's ``Sequence``)."""

    query_len: int
    context_len: int
    block_table: tuple[int, ...] = ()

    def to_proto(self) -> pb.Sequence:
        return pb.Sequence(
            query_len=int(self.query_len),
            context_len=int(self.context_len),
            block_table=_int_list(self.block_table),
        )


def _int_list(xs: Any) -> list[int]:
    """Python ints of a block table: through numpy when it holds integers (a 1,024-block
    table: ~190 µs by ``int()`` one by one, ~35 µs this way), else ``int()`` each."""
    a = np.asarray(xs)
    if a.dtype.kind in "iu" and a.ndim == 1:
        ints: list[int] = a.tolist()
        return ints
    return [int(b) for b in xs]


@dataclass(frozen=True)
class ContextChunk:
    """One chunk of a context plan (see the proto's ``ContextChunk``)."""

    first_sequence: int
    num_sequences: int
    context_start: tuple[int, ...]
    context_len: tuple[int, ...]

    def to_proto(self) -> pb.ContextChunk:
        return pb.ContextChunk(
            first_sequence=int(self.first_sequence),
            num_sequences=int(self.num_sequences),
            context_start=[int(x) for x in self.context_start],
            context_len=[int(x) for x in self.context_len],
        )

    @classmethod
    def from_proto(cls, m: pb.ContextChunk) -> ContextChunk:
        return cls(m.first_sequence, m.num_sequences, tuple(m.context_start), tuple(m.context_len))


@dataclass(frozen=True)
class ServerInfo:
    """GetServerInfo's answer as plain Python values (``versions`` as a dict)."""

    instance_id: str
    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    softmax_scale: float
    cache_dtype: str
    block_size: int
    num_blocks: int
    k_scale: float
    bytes_per_slot: int
    kv_b_proj_dtype: str
    kv_b_proj_scale_format: str
    weights_source: str
    prefill_dtype: str
    attention_backend: str
    attention_backend_supports_out: bool
    fused_kernels_active: bool
    fused_kernels_reason: str
    workspace_tokens: int
    device: str
    versions: dict[str, str]
    max_message_bytes: int
    # head sharding (docs/SHARDING.md): heads [shard_index * num_heads, + num_heads) of total_heads
    shard_index: int = 0
    num_shards: int = 1
    total_heads: int = 0
    # shared memory (serve --shared-memory; docs/TRANSPORT.md): "system" and/or "cuda", () when off
    shared_memory_kinds: tuple[str, ...] = ()
    shared_memory_max_regions: int = 0
    shared_memory_max_bytes: int = 0
    # request rings (serve --request-ring): rings attachable at once, 0 when off
    request_ring_max: int = 0
    # model layers held (serve --layers, --first-layer): [first_layer, first_layer + num_layers)
    num_layers: int = 1
    first_layer: int = 0
    # the fused path packs no K (bf16 prefill, a backend reading the keys unpacked; serve --no-unpacked-keys)
    unpacked_keys: bool = False
    # request rings may be stream-ordered (serve --request-ring-stream-order)
    request_ring_stream_order: bool = False
    # the server's CUDA work runs as a client of an MPS daemon (docs/DEPLOY.md); None: a CPU
    # server, a driver that cannot say, or a server predating the field
    mps_client: bool | None = None

    @property
    def head_start(self) -> int:
        """First model head this worker serves."""
        return self.shard_index * self.num_heads

    @property
    def head_end(self) -> int:
        """One past the last model head this worker serves."""
        return self.head_start + self.num_heads

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def layers(self) -> range:
        """The model indices of the layers held."""
        return range(self.first_layer, self.first_layer + self.num_layers)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @classmethod
    def from_proto(cls, m: pb.GetServerInfoResponse) -> ServerInfo:
        """Each field from the message field of its name, those below converted."""
        special: dict[str, Any] = {
            "versions": {f.name: getattr(m.versions, f.name) for f in m.versions.DESCRIPTOR.fields},
            "num_shards": m.num_shards or 1,  # 0: a server predating sharding (unsharded)
            "total_heads": m.total_heads or m.num_heads,
            "shared_memory_kinds": kind_names(m.shared_memory_kinds),
            "num_layers": m.num_layers or 1,  # 0: a server predating layers (one layer, 0)
            "mps_client": m.mps_client if m.HasField("mps_client") else None,
        }
        return cls(**{f.name: special[f.name] if f.name in special else getattr(m, f.name) for f in fields(cls)})


@dataclass
class PrefillResult:
    """PrefillContext's answer.

    - ``output``: float32 ``[Tq, H, V]``, the exact values of the bf16 output;
    - ``output_bits``: the bf16 bits (``uint16`` ``[Tq, H, V]``, a read-only view of the
      response bytes), or None if the server sent FP32;
    - ``lse``: float32 ``[H, Tq]``, natural log, ``-inf`` on rows without context;
    - ``stats``: a dict — ``num_chunks``, ``chunks`` (list of :class:`ContextChunk`),
      ``kernel_launches`` and ``stage_nanos`` (dicts by stage), ``path``, ``fp8_path``
      (dict: cache_dtype, kv_b_proj_dtype, prefill_dtype), ``total_nanos``,
      ``phase_nanos`` (its parts: ``validate``, ``queue``, ``input``, ``compute``,
      ``output``), ``context_tokens``, ``query_tokens``.

    With ``output_region`` / ``lse_region`` (shared memory), the result was written
    there and ``output_ref`` / ``lse_ref`` say where (a :class:`SharedMemoryRef`). In a
    :class:`SystemSharedMemoryRegion`, ``output_bits`` and ``lse`` are numpy views of
    the segment (``output`` their float32 copy, unless ``float_output=False``); in a
    :class:`CudaSharedMemoryRegion`, ``output_tensor`` / ``lse_tensor`` are torch views
    of the caller's own CUDA tensor and ``output`` / ``output_bits`` / ``lse`` are None.
    ``float_output=False`` leaves ``output`` None in every case (``output_bits`` holds it).
    ``slots_written``: the slots the request's ``cache_write`` wrote (0 without one).
    """

    output: np.ndarray | None
    output_bits: np.ndarray | None
    lse: np.ndarray | None
    stats: dict[str, Any]
    instance_id: str
    request_id: str = ""
    raw: Any = field(default=None, repr=False)
    output_ref: SharedMemoryRef | None = None
    lse_ref: SharedMemoryRef | None = None
    slots_written: int = 0
    output_tensor: Any = field(default=None, repr=False)
    lse_tensor: Any = field(default=None, repr=False)


# --------------------------------------------------------------------------- requests


def channel_options(max_message_bytes: int, extra: Iterable[tuple[str, Any]] = ()) -> list[tuple[str, Any]]:
    opts = [
        ("grpc.max_send_message_length", int(max_message_bytes)),
        ("grpc.max_receive_message_length", int(max_message_bytes)),
    ]
    opts.extend(extra)
    return opts


def call_metadata(token: str | None, extra: Iterable[tuple[str, str]] = ()) -> tuple[tuple[str, str], ...]:
    md: list[tuple[str, str]] = []
    if token:
        md.append(("authorization", f"Bearer {token}"))
    md.extend(extra)
    return tuple(md)


def _pem(x: bytes | str | None, name: str) -> bytes | None:
    """PEM bytes, or the contents of the file a ``str`` names."""
    if x is None or isinstance(x, bytes):
        return x
    if isinstance(x, str):
        with open(x, "rb") as f:
            return f.read()
    raise TypeError(f"{name}: expected PEM bytes or a file path, got {type(x).__name__}")


def channel_credentials(
    credentials: grpc.ChannelCredentials | None,
    tls: bool,
    root_certificates: bytes | str | None,
    client_certificate: bytes | str | None = None,
    client_key: bytes | str | None = None,
) -> grpc.ChannelCredentials | None:
    """The channel's credentials: ``credentials`` as given; else TLS when ``tls`` or any
    PEM is given (``root_certificates``: CA bundle to verify the server, default the
    system roots; ``client_certificate`` + ``client_key``: the client's certificate for
    mutual TLS). PEM arguments are bytes or a file path."""
    if credentials is not None:
        return credentials
    if (client_certificate is None) != (client_key is None):
        raise ValueError("client_certificate and client_key go together")
    if tls or root_certificates is not None or client_certificate is not None:
        return grpc.ssl_channel_credentials(
            root_certificates=_pem(root_certificates, "root_certificates"),
            private_key=_pem(client_key, "client_key"),
            certificate_chain=_pem(client_certificate, "client_certificate"),
        )
    return None


def tls_channel_options(tls_server_name: str | None) -> list[tuple[str, Any]]:
    """Check the server's certificate against ``tls_server_name`` instead of the target host."""
    return [("grpc.ssl_target_name_override", tls_server_name)] if tls_server_name else []


def _add_sequence(field: Any, s: Any, i: int) -> None:
    """Append sequence ``s`` (a :class:`Sequence`, a ``pb.Sequence``, a dict or a
    ``(query_len, context_len[, block_table])`` tuple) to a repeated Sequence field, built
    in place: a Sequence message built apart and then handed to the request is copied
    field by field (upb), a second pass over the block table."""
    if isinstance(s, pb.Sequence):
        field.append(s)
        return
    bt: Any  # a block table: a tuple, list, array or any iterable of ints
    if isinstance(s, Sequence):
        q, c, bt = s.query_len, s.context_len, s.block_table
    elif isinstance(s, Mapping):
        q, c, bt = s["query_len"], s["context_len"], tuple(s.get("block_table", ()))
    elif isinstance(s, _SeqABC) and len(s) in (2, 3):
        q, c, bt = s[0], s[1], (s[2] if len(s) == 3 else ())
    else:
        raise TypeError(f"sequences[{i}]: expected Sequence, (query_len, context_len, block_table) or dict")
    m = field.add()
    m.query_len, m.context_len = int(q), int(c)
    if type(bt) is list:
        # a list of ints goes in as it is: protobuf checks each entry, and the trip through
        # numpy and back (np.asarray of 1,024 Python ints alone: ~30 µs) was a third of a
        # shared-memory request's client time (docs/TRANSPORT.md)
        try:
            m.block_table.extend(bt)
            return
        except TypeError:  # e.g. floats or bools: the general path below, as before
            del m.block_table[:]
    m.block_table.extend(_int_list(np.asarray(bt).ravel()))


def _as_chunk(c: Any, i: int) -> pb.ContextChunk:
    if isinstance(c, ContextChunk):
        return c.to_proto()
    if isinstance(c, pb.ContextChunk):
        return c
    if isinstance(c, Mapping):
        return ContextChunk(
            int(c["first_sequence"]), int(c["num_sequences"]), tuple(c["context_start"]), tuple(c["context_len"])
        ).to_proto()
    if isinstance(c, _SeqABC) and len(c) == 4:
        return ContextChunk(int(c[0]), int(c[1]), tuple(c[2]), tuple(c[3])).to_proto()
    raise TypeError(f"plan[{i}]: expected ContextChunk, (first, num, starts, lens) or dict")


def _latent_tensor(x: Any, name: str) -> Any:
    """kv_c / k_pe: RawTensor (BF16/FP32) as is; uint16 -> BF16 bits; floats -> FP32 (exact);
    a SharedMemoryTensor (BF16/FP32) by reference. A Tensor message (a reference) or
    ``(wire dtype, bits)`` for :func:`~ctxprefill_api.wire.place_tensor`."""
    if isinstance(x, SharedMemoryTensor):
        if x.dtype not in (BF16, FP32):
            raise ValueError(f"{name}: must be BF16 or FP32")
        return x.to_proto()
    if isinstance(x, RawTensor):
        if x.dtype not in (BF16, FP32):
            raise ValueError(f"{name}: must be BF16 or FP32, got {x.dtype_name}")
        return tensor_bits(x, name=name)
    arr = np.asarray(x)
    if arr.dtype == np.uint16:
        return tensor_bits(arr, BF16, name=name)
    if np.issubdtype(arr.dtype, np.floating):
        return tensor_bits(arr.astype(np.float32, copy=False), FP32, name=name)
    raise ValueError(f"{name}: expected a float array, uint16 bf16 bits or a RawTensor, got {arr.dtype}")


def _slot_tensor(slot_mapping: Any) -> pb.Tensor:
    if isinstance(slot_mapping, SharedMemoryTensor):
        if slot_mapping.dtype != INT64 or len(slot_mapping.shape) != 1:
            raise ValueError("slot_mapping: a shared-memory slot_mapping must be INT64 [T]")
        if isinstance(slot_mapping.ref.local, CudaSharedMemoryRegion):
            raise ValueError("slot_mapping: must be inline or in system shared memory "
                             "(the server checks it on the host)")
        return slot_mapping.to_proto()
    arr = np.asarray(slot_mapping)
    if arr.ndim != 1 or not (np.issubdtype(arr.dtype, np.integer) or arr.size == 0):
        raise ValueError(f"slot_mapping: expected a 1-D integer array, got {arr.dtype} {list(arr.shape)}")
    return encode_tensor(arr.astype(np.int64, copy=False), INT64, name="slot_mapping")


# Tensor submessages are put in place with CopyFrom, never passed to a message's
# constructor: upb's constructor merges a submessage field by field (protobuf 7.36: 56 ms
# for a 25 MB q, against 3 ms for CopyFrom, one memcpy). The big inline tensors (q, the
# latents) do not enter the message at all: wire.OutgoingMessage appends their bytes
# when gRPC serializes the request.


def build_write_request(slot_mapping: Any, kv_c: Any, k_pe: Any, expected: str | None,
                        layer: int | None = None) -> Any:
    """A WriteCacheRequest (an :class:`~ctxprefill_api.wire.OutgoingMessage` when the
    latents are inline)."""
    req = pb.WriteCacheRequest()
    if layer is not None:
        req.layer = int(layer)
    req.slot_mapping.CopyFrom(_slot_tensor(slot_mapping))
    payloads: list[tuple[int, np.ndarray]] = []
    place_tensor(req, "kv_c", _latent_tensor(kv_c, "kv_c"), payloads)
    place_tensor(req, "k_pe", _latent_tensor(k_pe, "k_pe"), payloads)
    if expected is not None:
        req.expected_instance_id = expected
    return finish(req, payloads)


def _cache_write(msg: Any, cache_write: Any) -> None:
    """Fill a CacheWrite from ``(slot_mapping, kv_c, k_pe)``, as WriteCache takes them. Its
    inline latents are copied into the message (a submessage's bytes cannot be appended at
    serialization as a top-level tensor's are; a new token's latents are small)."""
    try:
        slot_mapping, kv_c, k_pe = cache_write
    except (TypeError, ValueError):
        raise ValueError("cache_write: expected (slot_mapping, kv_c, k_pe)") from None
    msg.slot_mapping.CopyFrom(_slot_tensor(slot_mapping))
    for name, x in (("kv_c", kv_c), ("k_pe", k_pe)):
        t = _latent_tensor(x, f"cache_write.{name}")
        if isinstance(t, pb.Tensor):
            getattr(msg, name).CopyFrom(t)
        else:
            wire, bits = t
            getattr(msg, name).CopyFrom(pb.Tensor(dtype=wire, shape=[int(d) for d in bits.shape],
                                                  data=np.ascontiguousarray(bits).tobytes()))


def build_read_request(slot_mapping: Any, expected: str | None, layer: int | None = None) -> pb.ReadCacheRequest:
    req = pb.ReadCacheRequest()
    if layer is not None:
        req.layer = int(layer)
    req.slot_mapping.CopyFrom(_slot_tensor(slot_mapping))
    if expected is not None:
        req.expected_instance_id = expected
    return req


def _q_tensor(q: Any, q_dtype: int | None, server_prefill_dtype: str | None) -> Any:
    """A Tensor message (shared memory) or ``(wire dtype, bits)`` (inline)."""
    if isinstance(q, SharedMemoryTensor):
        if q_dtype is not None and q_dtype != q.dtype:
            raise ValueError(f"q: the shared-memory tensor is {dtype_name(q.dtype)}, q_dtype asks for "
                             f"{dtype_name(q_dtype)}")
        return q.to_proto()
    if isinstance(q, RawTensor):
        return tensor_bits(q, q_dtype, name="q")
    arr = np.asarray(q)
    if q_dtype is None:
        if arr.dtype == np.uint16:
            q_dtype = BF16
        elif arr.dtype == np.uint8:
            q_dtype = FP8_E4M3
        elif server_prefill_dtype == "fp8":
            q_dtype = FP8_E4M3
        else:
            q_dtype = BF16
    return tensor_bits(arr, q_dtype, name="q")


def build_prefill_request(
    q: Any,
    sequences: Iterable[Any],
    *,
    request_id: str | None,
    workspace_tokens: int | None,
    plan: Iterable[Any] | None,
    expected: str | None,
    q_dtype: int | None,
    server_prefill_dtype: str | None,
    output_region: SharedMemoryRef | None = None,
    lse_region: SharedMemoryRef | None = None,
    layer: int | None = None,
    cache_write: Any = None,
) -> Any:
    """A PrefillContextRequest (an :class:`~ctxprefill_api.wire.OutgoingMessage` when q is
    inline: its bytes are appended at serialization, not copied into the message)."""
    req = pb.PrefillContextRequest(request_id=request_id or "")
    if layer is not None:
        req.layer = int(layer)
    for i, s in enumerate(sequences):
        _add_sequence(req.sequences, s, i)
    payloads: list[tuple[int, np.ndarray]] = []
    place_tensor(req, "q", _q_tensor(q, q_dtype, server_prefill_dtype), payloads)
    if workspace_tokens is not None:
        req.workspace_tokens = int(workspace_tokens)
    if expected is not None:
        req.expected_instance_id = expected
    if plan is not None:
        req.plan.extend(_as_chunk(c, i) for i, c in enumerate(plan))
    if output_region is not None:
        req.output_region.CopyFrom(output_region.to_proto())
    if lse_region is not None:
        req.lse_region.CopyFrom(lse_region.to_proto())
    if cache_write is not None:
        _cache_write(req.cache_write, cache_write)
    return finish(req, payloads)


# --------------------------------------------------------------------------- responses


def _decode(msg: pb.Tensor, name: str, **checks: Any) -> RawTensor:
    try:
        return decode_tensor(msg, name=name, **checks)
    except ValueError as e:
        raise ResponseDecodeError(str(e)) from None


def stats_to_dict(s: pb.Stats) -> dict[str, Any]:
    return {
        "num_chunks": s.num_chunks,
        "chunks": [ContextChunk.from_proto(c) for c in s.chunks],
        "kernel_launches": dict(s.kernel_launches),
        "path": s.path,
        "fp8_path": {
            "cache_dtype": s.fp8_path.cache_dtype,
            "kv_b_proj_dtype": s.fp8_path.kv_b_proj_dtype,
            "prefill_dtype": s.fp8_path.prefill_dtype,
        },
        "stage_nanos": dict(s.stage_nanos),
        "total_nanos": s.total_nanos,
        "phase_nanos": {"validate": s.validate_nanos, "queue": s.queue_nanos, "input": s.input_nanos,
                        "compute": s.compute_nanos, "output": s.output_nanos},
        "context_tokens": s.context_tokens,
        "query_tokens": s.query_tokens,
        "unpacked_keys": s.unpacked_keys,
        "queued": s.queued,  # answered before its device work ran (a stream-ordered ring): no device times
    }


class _Placed:
    """A response tensor the server wrote into shared memory."""

    def __init__(self, msg: pb.Tensor, name: str, dtypes: tuple[int, ...], ndim: int, asked: SharedMemoryRef | None):
        sm = msg.shared_memory
        if asked is None:
            raise ResponseDecodeError(f"{name}: the server placed it in shared memory, "
                                      "the request did not ask for that")
        if sm.region != asked.region or sm.offset != asked.offset:
            raise ResponseDecodeError(f"{name}: written to {sm.region!r} at {sm.offset}, asked for "
                                      f"{asked.region!r} at {asked.offset}")
        if msg.dtype not in dtypes or len(msg.shape) != ndim or any(d < 0 for d in msg.shape):
            raise ResponseDecodeError(f"{name}: unexpected dtype {msg.dtype} or shape {list(msg.shape)}")
        self.dtype, self.shape = msg.dtype, tuple(int(d) for d in msg.shape)
        nbytes = math.prod(self.shape) * storage_dtype(self.dtype).itemsize  # exact ints (np.prod: 5 µs)
        if sm.byte_size != nbytes or nbytes > asked.byte_size:
            raise ResponseDecodeError(f"{name}: {sm.byte_size} bytes written, shape {list(self.shape)} makes {nbytes} "
                                      f"and {asked.byte_size} were offered")
        self.ref = SharedMemoryRef(sm.region, sm.offset, sm.byte_size, asked.local)

    def system_view(self) -> np.ndarray | None:
        local = self.ref.local
        if not isinstance(local, SystemSharedMemoryRegion):
            return None
        return local.view(self.dtype, self.shape, self.ref.offset)

    def cuda_view(self) -> Any:
        local = self.ref.local
        if not isinstance(local, CudaSharedMemoryRegion):
            return None
        return local.view(self.dtype, self.shape, self.ref.offset)


def parse_prefill_response(resp: pb.PrefillContextResponse, num_query_rows: int,
                           output_region: SharedMemoryRef | None = None, lse_region: SharedMemoryRef | None = None,
                           float_output: bool = True) -> PrefillResult:
    res = PrefillResult(output=None, output_bits=None, lse=None, stats=stats_to_dict(resp.stats),
                        instance_id=resp.instance_id, request_id=resp.request_id, raw=resp,
                        slots_written=int(resp.slots_written))
    if resp.output.HasField("shared_memory"):
        p = _Placed(resp.output, "output", (BF16,), 3, output_region)
        out_shape, res.output_ref = p.shape, p.ref
        res.output_bits, res.output_tensor = p.system_view(), p.cuda_view()
        if float_output and res.output_bits is not None:
            res.output = bf16_bits_to_float32(res.output_bits)
    else:
        out = _decode(resp.output, "output", dtypes=(BF16, FP32), ndim=3)
        out_shape = out.shape
        res.output_bits = out.bits if out.dtype == BF16 else None
        if float_output or out.dtype != BF16:
            res.output = out.to_numpy().astype(np.float32, copy=False)
    if resp.lse.HasField("shared_memory"):
        p = _Placed(resp.lse, "lse", (FP32,), 2, lse_region)
        lse_shape, res.lse_ref = p.shape, p.ref
        res.lse, res.lse_tensor = p.system_view(), p.cuda_view()
    else:
        lse = _decode(resp.lse, "lse", dtypes=(FP32,), ndim=2)
        lse_shape, res.lse = lse.shape, lse.bits
    tq, h, _ = out_shape
    if tq != num_query_rows:
        raise ResponseDecodeError(f"output: {tq} rows, the request had {num_query_rows}")
    if tuple(lse_shape) != (h, tq):
        raise ResponseDecodeError(f"lse: shape {list(lse_shape)}, expected [H, Tq] = {[h, tq]}")
    return res


def parse_read_response(resp: pb.ReadCacheResponse, num_slots: int) -> np.ndarray:
    slots = _decode(resp.slots, "slots", dtypes=(UINT8,), ndim=2)
    if slots.shape[0] != num_slots:
        raise ResponseDecodeError(f"slots: {slots.shape[0]} rows, asked for {num_slots}")
    return slots.bits


# --------------------------------------------------------------------------- policy


def backoff_delay(attempt: int, base: float, cap: float, rng: random.Random | None = None) -> float:
    """Full-jitter exponential backoff: uniform in [0, min(cap, base * 2**attempt)]."""
    r = rng.random() if rng is not None else random.random()
    return r * min(cap, base * (2.0**attempt))


class InstanceTracker:
    """Remembers the first instance id seen and flags any other one."""

    def __init__(self, expected: str | None = None, enabled: bool = True) -> None:
        self.enabled = enabled
        self.instance_id: str | None = expected

    def expected(self) -> str | None:
        return self.instance_id if self.enabled else None

    def observe(self, method: str, instance_id: str) -> None:
        if not self.enabled or not instance_id:
            return
        if self.instance_id is None:
            self.instance_id = instance_id
        elif instance_id != self.instance_id:
            raise ServerRestartedError(method, self.instance_id, instance_id, code=None)

    def reset(self, instance_id: str | None = None) -> None:
        self.instance_id = instance_id


_STATUS_BY_NUMBER = {c.value[0]: c for c in grpc.StatusCode}


def status_error(method: str, code: grpc.StatusCode | None, details: str,
                 expected_sent: str | None) -> CtxPrefillError:
    """The exception for a call of ``method`` that ended with status ``code``:
    FAILED_PRECONDITION after a request that named an instance is a restart."""
    if code == grpc.StatusCode.FAILED_PRECONDITION and expected_sent is not None:
        return ServerRestartedError(method, expected_sent, None, details)
    return CtxPrefillRpcError(method, code, details)


def in_band_error(method: str, err: pb.RequestError, expected_sent: str | None) -> CtxPrefillError:
    """The exception for a stream request's in-band error: what :func:`map_rpc_error`
    gives for the same status on a unary call."""
    return status_error(method, _STATUS_BY_NUMBER.get(err.code, grpc.StatusCode.UNKNOWN), err.message, expected_sent)


def map_rpc_error(method: str, err: grpc.RpcError, expected_sent: str | None) -> CtxPrefillError:
    code = err.code() if hasattr(err, "code") else None
    details = (err.details() if hasattr(err, "details") else str(err)) or ""
    return status_error(method, code, details, expected_sent)
