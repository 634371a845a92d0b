"""The wire format <-> the engine's types, without extra copies.

Tensors. A Tensor message is row-major, little-endian, unpadded bytes plus a dtype and
a shape (CONTRACT §7, the KServe v2 raw-content rule). Decoding wraps the message's
bytes with ``torch.frombuffer`` (no copy: the tensor is a read-only view of the
request's bytes, which the engine never writes into); bf16 and fp8 e4m3 are
byte-reinterpretations (``.view``), so their bits arrive untouched. Results leave as
``(dtype, numpy array)`` (:func:`encode_parts`): ``ctxprefill_api.wire`` appends their
bytes when gRPC serializes the response, one copy, none into the message.

Shapes are checked before anything is allocated: a dtype we know, at most
:data:`MAX_DIMS` dimensions, no negative or absurd extent, at most
:data:`MAX_ELEMENTS` elements, and ``len(data) == prod(shape) * itemsize`` — each
failure an ``InvalidArgument`` naming the field. What a tensor must be for the model
(its dtype, its shape against the model's dimensions) is the engine's to check
(``engine/request.py``).

Shared memory (``--shared-memory``, ``shared_memory.py``): a Tensor with
``shared_memory`` set is decoded, given the request's :class:`Lease`, into a view of
the region's bytes after the reference is checked (``<field>.shared_memory...``);
nothing is read then. ``from_shared`` makes what the engine uses of it on the engine
thread (system memory: one copy, read through the object's descriptor, or by DMA from
a page-locked mapping; CUDA memory: used in place), and ``write_shared`` /
``encode_shared`` put a result into a region and describe it. The CPU never loads or
stores a system region's mapping (a shrunk object would make that SIGBUS): an object
shrunk under a request fails the request (FAILED_PRECONDITION naming the region).
An index tensor (``index=True``) is copied out of shared memory at once, so that the
values checked are the values used.

Requests (:func:`decode_prefill`, :func:`decode_write`, :func:`decode_read`): a
request message becomes the engine's request type, its tensors decoded as above and
its repeated fields taken as they are (a block table is read by the engine's checks,
only the prefix it uses); the wire's own consistency (a plan chunk's lists as long as
its ``num_sequences``) and the limits that bound the decoding are checked here.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, Generic, TypeVar

import numpy as np
import torch

from ctxprefill_api import pb
from ctxprefill_api.wire import finish, place_tensor

from ..engine.engine import PrefillStats
from ..engine.plan import ContextChunk
from ..engine.request import PrefillRequest, ReadRequest, SequenceSpec, WriteRequest
from ..errors import InvalidArgument
from .inline_views import data_views
from .shared_memory import DEVICE_ALIGNMENT, Lease, off_message, span_of, with_span
from .transport import Placement

# frombuffer on an immutable `bytes` warns that writes would be undefined; we never write.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)

if sys.byteorder != "little":  # pragma: no cover - every platform we run on is little-endian
    raise ImportError("ctxprefill.service.codec assumes a little-endian host")

MAX_DIMS = 8
#: no tensor can hold more elements than a (1 GiB) message has bytes; refuse before allocating
MAX_ELEMENTS = 1 << 31
MAX_EXTENT = 1 << 40

# wire dtype -> (torch dtype of the values, torch dtype of the storage read from the buffer, name)
_WIRE: dict[int, tuple[torch.dtype, torch.dtype, str]] = {
    pb.DATA_TYPE_BF16: (torch.bfloat16, torch.int16, "BF16"),
    pb.DATA_TYPE_FP16: (torch.float16, torch.float16, "FP16"),
    pb.DATA_TYPE_FP32: (torch.float32, torch.float32, "FP32"),
    pb.DATA_TYPE_FP8_E4M3: (torch.float8_e4m3fn, torch.uint8, "FP8_E4M3"),
    pb.DATA_TYPE_INT32: (torch.int32, torch.int32, "INT32"),
    pb.DATA_TYPE_INT64: (torch.int64, torch.int64, "INT64"),
    pb.DATA_TYPE_UINT8: (torch.uint8, torch.uint8, "UINT8"),
}
_FROM_TORCH: dict[torch.dtype, int] = {v[0]: k for k, v in _WIRE.items()}


def dtype_name(wire: int) -> str:
    if wire in _WIRE:
        return _WIRE[wire][2]
    return "UNSPECIFIED" if wire == 0 else f"<{int(wire)}>"


def check_tensor(msg: pb.Tensor, field: str) -> tuple[int, tuple[int, ...]]:
    """Checks of a Tensor message that need no allocation; returns (wire dtype, shape).
    Which dtypes and shapes a field takes is the engine's to check (validation once)."""
    wire = msg.dtype
    if wire not in _WIRE:
        raise InvalidArgument(field, f"unsupported dtype {dtype_name(wire)}")
    shape = tuple(msg.shape)
    if len(shape) > MAX_DIMS:
        raise InvalidArgument(field, f"has {len(shape)} dimensions, at most {MAX_DIMS} are accepted")
    for d in shape:
        if d < 0 or d > MAX_EXTENT:
            raise InvalidArgument(field, f"shape {list(shape)} has an extent outside [0, {MAX_EXTENT}]")
    n = math.prod(shape)
    if n > MAX_ELEMENTS:
        raise InvalidArgument(field, f"shape {list(shape)} has {n} elements, more than the limit {MAX_ELEMENTS}")
    return wire, shape


def decode(msg: pb.Tensor, field: str, data: bytes | memoryview | None = None, shm: Lease | None = None,
           index: bool = False) -> torch.Tensor:
    """A CPU tensor viewing ``msg.data`` (read-only; do not write into it).

    ``data`` may pass ``msg.data`` when the caller already holds it (each access of a
    protobuf bytes field may build a new ``bytes`` object).

    With ``shared_memory`` set: a view of the region's bytes (CPU for system memory,
    the device for CUDA memory), the reference checked and its region held by ``shm``
    (the request's ``shared_memory.Lease``; None: shared memory is off, the field is
    INVALID_ARGUMENT). ``index``: the tensor holds indices; it must be in system memory
    and is copied (checks then read what the engine will use).
    """
    wire, shape = check_tensor(msg, field)
    value_dtype, storage_dtype, name = _WIRE[wire]
    if data is None:
        data = msg.data
    n = math.prod(shape)
    need = n * storage_dtype.itemsize
    if msg.HasField("shared_memory"):
        return _decode_shared(msg, field, shape, value_dtype, storage_dtype, need, len(data), shm, index)
    if len(data) != need:
        raise InvalidArgument(field, f"data has {len(data)} bytes, shape {list(shape)} of {name} needs {need}")
    if n == 0:
        return torch.empty(shape, dtype=value_dtype)
    t = torch.frombuffer(data, dtype=storage_dtype, count=n).view(shape)
    return t.view(value_dtype) if storage_dtype != value_dtype else t


def encode(t: torch.Tensor) -> pb.Tensor:
    """A Tensor message holding ``t`` (one copy into bytes). The service sends results with
    :func:`encode_parts` instead, whose bytes are not copied into the message; put a
    Tensor into another message with ``CopyFrom`` (one memcpy), not as a constructor
    argument: upb's constructor merges a submessage field by field (protobuf 7.36: 17 ms
    for a 17 MB output, against 2 ms)."""
    wire, bits = encode_parts(t)
    return pb.Tensor(dtype=wire, shape=list(bits.shape), data=bits.tobytes())


def encode_parts(t: torch.Tensor) -> tuple[int, np.ndarray]:
    """``(wire dtype, numpy array of the stored bits)`` of ``t`` (moved to the host, made
    contiguous; the array views that host memory): for ``ctxprefill_api.wire.place_tensor``,
    which sends the bytes at serialization instead of copying them into the message."""
    wire = _FROM_TORCH.get(t.dtype)
    if wire is None:
        raise TypeError(f"no wire dtype for {t.dtype}")
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    storage = _WIRE[wire][1]
    return wire, (t.view(storage) if storage != t.dtype else t).numpy()


def to_host_queued(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the host. A CUDA tensor is copied into pinned memory (torch's caching host
    allocator) on the current stream without waiting: the copy is queued behind the work
    that writes ``t``, and the caller waits for the stream (an event recorded after this
    call) before reading the result. ``Tensor.cpu()`` would instead wait for everything
    queued on the stream, a request started after this one included; a pinned copy also
    moves at the link's rate, where a pageable one is staged. A host tensor is returned
    as it is."""
    if t.device.type != "cuda":
        return t
    h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    h.copy_(t, non_blocking=True)
    return h


# ---------------------------------------------------------------------------- shared memory


def _decode_shared(msg: pb.Tensor, field: str, shape: tuple[int, ...], value_dtype: torch.dtype,
                   storage_dtype: torch.dtype, need: int, data_len: int, shm: Lease | None,
                   index: bool) -> torch.Tensor:
    where = f"{field}.shared_memory"
    if shm is None:
        raise InvalidArgument(where, off_message() + f"; or send the elements inline in {field}.data")
    if data_len:
        raise InvalidArgument(f"{field}.data", f"has {data_len} bytes; it must be empty when {where} is set")
    region, raw = shm.resolve(msg.shared_memory, where, need, storage_dtype.itemsize, allow_cuda=not index)
    shm.count(region.kind, "in", need)
    span = span_of(raw)
    if need == 0:
        return torch.empty(shape, dtype=value_dtype, device=raw.device if raw.is_cuda else "cpu")
    if index:
        # the values checked are the values used, whatever the caller writes meanwhile
        raw = span.read(where) if span is not None else raw.clone()

    def typed() -> torch.Tensor:
        t = raw.view(storage_dtype).view(shape)
        return with_span(t.view(value_dtype) if storage_dtype != value_dtype else t, None if index else span)

    if index:  # a private copy: nothing to reuse
        return typed()
    ref = msg.shared_memory
    return region.view((int(ref.offset), need, storage_dtype, value_dtype, tuple(shape)), typed)


def from_shared(t: torch.Tensor, device: torch.device, field: str = "") -> torch.Tensor:
    """What the engine uses of a tensor that views shared memory (call on the engine
    thread; ``field``: the tensor's, for errors): system memory is copied once — read
    through the object's descriptor into private host memory (page-locked on a CUDA
    server, then copied to the device), or by DMA from a page-locked mapping — so that
    the caller cannot change it under the computation; CUDA memory is used in place,
    unless its address is not 16-byte aligned (then copied on the device)."""
    if t.is_cuda:
        return t if t.numel() == 0 or t.data_ptr() % DEVICE_ALIGNMENT == 0 else t.clone()
    span = span_of(t)
    if span is not None and not (span.dma and device.type == "cuda"):
        cuda = device.type == "cuda"
        host = span.read(f"{field}.shared_memory" if field else "shared_memory", pin=cuda).view(t.dtype).view(t.shape)
        return host.to(device, non_blocking=True) if cuda else host
    if t.device.type == "meta":  # pragma: no cover - every meta view carries its span
        raise AssertionError("a shared-memory placeholder without its span")
    if device.type == "cpu":
        return t.clone()
    return t.to(device)


def write_shared(dst: torch.Tensor, src: torch.Tensor, field: str = "") -> None:
    """Copy ``src``'s bytes (row-major) into ``dst``, a uint8 view of a region of the same
    byte size (``field``: the placement's, for errors): a device copy into CUDA memory
    or a page-locked mapping, queued on the current stream without waiting (the caller
    waits for the stream before the bytes are read); into other system memory, written
    through the object's descriptor once the device has produced ``src`` (an object
    shrunk under the range: FAILED_PRECONDITION naming ``<field>.region``)."""
    src = src.detach().contiguous()
    if src.numel() == 0:
        return
    bits = src.reshape(-1).view(torch.uint8)
    span = span_of(dst)
    if span is not None and not (span.dma and bits.is_cuda):
        if bits.is_cuda:
            host = to_host_queued(bits)  # by DMA into pinned memory, then written once it is there
            torch.cuda.current_stream(bits.device).synchronize()
            bits = host
        span.write(bits, field or "shared_memory")
        return
    dst.copy_(bits, non_blocking=True)


def encode_shared(dtype: torch.dtype, shape: Sequence[int], region: str, offset: int, nbytes: int) -> pb.Tensor:
    """A Tensor message that describes a result written into a region (no data)."""
    return pb.Tensor(dtype=_FROM_TORCH[dtype], shape=list(shape),
                     shared_memory=pb.SharedMemoryRef(region=region, offset=offset, byte_size=nbytes))


# ---------------------------------------------------------------------------- requests

#: a request id is echoed in the response; longer ones are refused
MAX_REQUEST_ID = 1024
#: sequences of one PrefillContext request (decoding walks them on the event loop)
MAX_SEQUENCES = 1 << 16
#: chunks of an explicit plan
MAX_PLAN_CHUNKS = 1 << 16

R = TypeVar("R")


@dataclasses.dataclass(frozen=True)
class Decoded(Generic[R]):
    """A request in the engine's type, and which of its tensors view shared memory
    (``"q"``, ``"kv_c"``, ``"cache_write.k_pe"``, ...: :func:`from_shared` them on the
    engine thread)."""

    request: R
    shared: frozenset[str] = frozenset()


def _optional(msg: Any, name: str) -> Any:
    return getattr(msg, name) if msg.HasField(name) else None


def _latents(msg: Any, shm: Lease | None, where: str,
             inline: Mapping[str, memoryview]) -> tuple[WriteRequest, set[str]]:
    """The slot_mapping, kv_c and k_pe of a WriteCacheRequest or a CacheWrite (``where``:
    the prefix of its fields in error messages, e.g. ``cache_write.``)."""
    slots = decode(msg.slot_mapping, f"{where}slot_mapping", shm=shm, index=True, data=inline.get("slot_mapping"))
    kv_c = decode(msg.kv_c, f"{where}kv_c", shm=shm, data=inline.get("kv_c"))
    k_pe = decode(msg.k_pe, f"{where}k_pe", shm=shm, data=inline.get("k_pe"))
    shared = {where + n for n in ("kv_c", "k_pe") if getattr(msg, n).HasField("shared_memory")}
    return WriteRequest(slots, kv_c, k_pe), shared


def decode_write(msg: Any, shm: Lease | None = None) -> Decoded[WriteRequest]:
    """A ``WriteCacheRequest`` (or its ``inline_views.InlineRequest``)."""
    latents, shared = _latents(msg, shm, "", data_views(msg))
    return Decoded(dataclasses.replace(latents, layer=_optional(msg, "layer"),
                                       expected_instance_id=_optional(msg, "expected_instance_id")),
                   frozenset(shared))


def decode_read(msg: pb.ReadCacheRequest, shm: Lease | None = None) -> ReadRequest:
    """A ``ReadCacheRequest``; its slot_mapping is copied out of shared memory (nothing stays shared)."""
    slots = decode(msg.slot_mapping, "slot_mapping", shm=shm, index=True)
    return ReadRequest(slots, _optional(msg, "layer"), _optional(msg, "expected_instance_id"))


def _plan(msg: Any) -> list[ContextChunk] | None:
    if not len(msg.plan):
        return None
    plan = []
    for k, c in enumerate(msg.plan):
        where = f"plan[{k}]"
        if c.num_sequences < 1:
            raise InvalidArgument(f"{where}.num_sequences", f"must be >= 1, got {c.num_sequences}")
        for name in ("context_start", "context_len"):
            got = len(getattr(c, name))
            if got != c.num_sequences:
                raise InvalidArgument(f"{where}.{name}", f"has {got} entries, num_sequences is {c.num_sequences}")
        plan.append(ContextChunk(c.first_sequence, tuple(c.context_start), tuple(c.context_len)))
    return plan


def decode_prefill(msg: Any, shm: Lease | None = None) -> Decoded[PrefillRequest]:
    """A ``PrefillContextRequest`` (or its ``inline_views.InlineRequest``). The output
    placements (``output_region``, ``lse_region``) are the transport's (``transport.py``)."""
    if len(msg.request_id) > MAX_REQUEST_ID:
        raise InvalidArgument("request_id", f"has {len(msg.request_id)} characters, at most {MAX_REQUEST_ID}")
    nseq = len(msg.sequences)
    if nseq > MAX_SEQUENCES:
        raise InvalidArgument("sequences", f"{nseq} sequences, at most {MAX_SEQUENCES} per request; split the request")
    if len(msg.plan) > MAX_PLAN_CHUNKS:
        raise InvalidArgument("plan", f"{len(msg.plan)} chunks, at most {MAX_PLAN_CHUNKS}")
    q = decode(msg.q, "q", shm=shm, data=data_views(msg).get("q"))
    shared = {"q"} if msg.q.HasField("shared_memory") else set()
    plan = _plan(msg)
    write = None
    if msg.HasField("cache_write"):
        write, cw_shared = _latents(msg.cache_write, shm, "cache_write.", data_views(msg, "cache_write"))
        shared |= cw_shared
    request = PrefillRequest(
        q=q,
        sequences=[SequenceSpec(s.query_len, s.context_len, s.block_table) for s in msg.sequences],
        workspace_tokens=_optional(msg, "workspace_tokens"),
        plan=plan,
        layer=_optional(msg, "layer"),
        expected_instance_id=_optional(msg, "expected_instance_id"),
        cache_write=write,
    )
    return Decoded(request, frozenset(shared))


def with_inputs(request: R, names: frozenset[str], device: torch.device) -> R:
    """On the engine thread: ``request`` with its tensors named in ``names`` (those that
    view shared memory: ``Decoded.shared``) made what the engine uses (:func:`from_shared`)."""
    if not names:
        return request
    # one replace per dataclass (a replace runs its __init__): fields, then each owner's fields
    top: dict[str, Any] = {}
    inner: dict[str, dict[str, Any]] = {}
    for name in names:
        owner, _, field = name.rpartition(".")
        if owner:
            inner.setdefault(owner, {})[field] = from_shared(getattr(getattr(request, owner), field), device, name)
        else:
            top[field] = from_shared(getattr(request, field), device, name)
    for owner, fields in inner.items():
        top[owner] = dataclasses.replace(getattr(request, owner), **fields)
    out: Any = dataclasses.replace(request, **top)
    result: R = out
    return result


# ---------------------------------------------------------------------------- responses

#: a result: a Tensor message (a shared-memory reference) or ``(wire dtype, bits)`` sent inline
Result = pb.Tensor | tuple[int, np.ndarray]


@dataclasses.dataclass(frozen=True)
class PlacedResults:
    """PrefillContext's output and LSE, their copies queued: each into its region
    (described by a Tensor message, no data) or to pinned host memory (sent inline)."""

    out: pb.Tensor | torch.Tensor
    lse: pb.Tensor | torch.Tensor

    def wire(self) -> tuple[Result, Result]:
        """What the response carries (once the copies are done)."""
        return _wire(self.out), _wire(self.lse)


def _wire(t: pb.Tensor | torch.Tensor) -> Result:
    return t if isinstance(t, pb.Tensor) else encode_parts(t)


def place_results(out: torch.Tensor, lse: torch.Tensor, out_to: Placement | None, lse_to: Placement | None,
                  lease: Lease | None) -> PlacedResults:
    """On the engine thread: queue the copies of a request's results (behind the work that
    writes them) to where they go, counted on the lease."""
    placed: list[pb.Tensor | torch.Tensor] = []
    for t, to in ((out, out_to), (lse, lse_to)):
        if to is None:
            placed.append(to_host_queued(t))
            continue
        nbytes = t.numel() * t.element_size()
        write_shared(to.view, t, "output_region" if t is out else "lse_region")
        assert lease is not None  # it holds the placement's region
        lease.count(to.kind, "out", nbytes)
        placed.append(encode_shared(t.dtype, t.shape, to.region, to.offset, nbytes))
    return PlacedResults(*placed)


def prefill_response(*, out: Result, lse: Result, stats: PrefillStats, total_ns: int, phases: Sequence[int],
                     slots_written: int, instance_id: str, request_id: str) -> Any:
    """A ``PrefillContextResponse`` (an ``OutgoingMessage`` when results go inline).
    ``phases``: the five parts of ``total_nanos`` (``Stats.validate_nanos`` ... ``output_nanos``)."""
    st = stats
    msg = pb.Stats(
        num_chunks=len(st.chunks),
        chunks=[pb.ContextChunk(first_sequence=c.first_sequence, num_sequences=c.num_sequences,
                                context_start=list(c.context_starts), context_len=list(c.context_lens))
                for c in st.chunks],
        kernel_launches={k: int(v) for k, v in st.launches.items()},
        path=st.path,
        fp8_path=pb.Fp8Path(**st.fp8_path),
        stage_nanos={k: int(v) for k, v in st.stage_ns.items()},
        total_nanos=total_ns,
        context_tokens=st.context_tokens,
        query_tokens=st.query_tokens,
        validate_nanos=phases[0], queue_nanos=phases[1], input_nanos=phases[2], compute_nanos=phases[3],
        output_nanos=phases[4], unpacked_keys=st.unpacked_keys, queued=st.queued,
    )
    resp = pb.PrefillContextResponse(stats=msg, instance_id=instance_id, request_id=request_id,
                                     slots_written=slots_written)
    payloads: list[tuple[int, np.ndarray]] = []
    place_tensor(resp, "output", out, payloads)  # shared-memory references, or bytes sent at serialization
    place_tensor(resp, "lse", lse, payloads)
    return finish(resp, payloads)


def read_response(raw: torch.Tensor, instance_id: str) -> Any:
    """A ``ReadCacheResponse`` of slot bytes (uint8 ``[T, bytes_per_slot]``), sent at serialization."""
    resp = pb.ReadCacheResponse(instance_id=instance_id)
    payloads: list[tuple[int, np.ndarray]] = []
    place_tensor(resp, "slots", encode_parts(raw), payloads)
    return finish(resp, payloads)
