"""``ctxprefill.v1.Tensor`` <-> torch tensors, without extra copies.

A Tensor message is row-major, little-endian, unpadded bytes plus a dtype and a shape
(CONTRACT §7, the KServe v2 raw-content rule). Decoding wraps the message's bytes with
``torch.frombuffer`` (no copy: the tensor is a read-only view of the request's bytes,
which the engine never writes into); bf16 and fp8 e4m3 are byte-reinterpretations
(``.view``), so their bits arrive untouched. Results leave as ``(dtype, numpy array)``
(:func:`encode_parts`): ``ctxprefill_api.wire`` appends their bytes when gRPC
serializes the response, one copy, none into the message.

Shapes are checked before anything is allocated: a dtype we know, at most
:data:`MAX_DIMS` dimensions, no negative or absurd extent, at most
:data:`MAX_ELEMENTS` elements, and ``len(data) == prod(shape) * itemsize`` — each
failure an ``InvalidArgument`` naming the field.

Shared memory (``--shared-memory``, ``shared_memory.py``): a Tensor with
``shared_memory`` set is decoded, given the request's :class:`Lease`, into a view of
the region's bytes after the reference is checked (``<field>.shared_memory...``);
nothing is read then. ``from_shared`` makes what the engine uses of it on the engine
thread (system memory: one copy to the device; CUDA memory: used in place), and
``write_shared`` / ``encode_shared`` put a result into a region and describe it.
An index tensor (``index=True``) is copied out of shared memory at once, so that the
values checked are the values used.
"""

from __future__ import annotations

import math
import sys
import warnings

import numpy as np
import torch

from ctxprefill_api import pb

from ..errors import InvalidArgument
from ..ops.fp8 import FP8

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
    pb.DATA_TYPE_FP8_E4M3: (FP8, torch.uint8, "FP8_E4M3"),
    pb.DATA_TYPE_INT32: (torch.int32, torch.int32, "INT32"),
    pb.DATA_TYPE_INT64: (torch.int64, torch.int64, "INT64"),
    pb.DATA_TYPE_UINT8: (torch.uint8, torch.uint8, "UINT8"),
}
_FROM_TORCH: dict[torch.dtype, int] = {v[0]: k for k, v in _WIRE.items()}


def dtype_name(wire: int) -> str:
    if wire in _WIRE:
        return _WIRE[wire][2]
    return "UNSPECIFIED" if wire == 0 else f"<{int(wire)}>"


def torch_dtype(wire: int) -> torch.dtype:
    return _WIRE[wire][0]


def check_tensor(msg: pb.Tensor, field: str, dtypes: tuple[int, ...] | None = None,
                 ndim: int | None = None) -> tuple[int, tuple[int, ...]]:
    """Checks of a Tensor message that need no allocation; returns (wire dtype, shape)."""
    wire = msg.dtype
    if wire not in _WIRE:
        raise InvalidArgument(field, f"unsupported dtype {dtype_name(wire)}")
    if dtypes is not None and wire not in dtypes:
        allowed = " or ".join(dtype_name(d) for d in dtypes)
        raise InvalidArgument(field, f"dtype {dtype_name(wire)} not allowed here (expected {allowed})")
    shape = tuple(msg.shape)
    if len(shape) > MAX_DIMS:
        raise InvalidArgument(field, f"has {len(shape)} dimensions, at most {MAX_DIMS} are accepted")
    if ndim is not None and len(shape) != ndim:
        raise InvalidArgument(field, f"must have {ndim} dimensions, got shape {list(shape)}")
    for d in shape:
        if d < 0 or d > MAX_EXTENT:
            raise InvalidArgument(field, f"shape {list(shape)} has an extent outside [0, {MAX_EXTENT}]")
    n = math.prod(shape)
    if n > MAX_ELEMENTS:
        raise InvalidArgument(field, f"shape {list(shape)} has {n} elements, more than the limit {MAX_ELEMENTS}")
    return wire, shape


def decode(msg: pb.Tensor, field: str, dtypes: tuple[int, ...] | None = None, ndim: int | None = None,
           data: bytes | None = None, shm=None, index: bool = False) -> torch.Tensor:
    """A CPU tensor viewing ``msg.data`` (read-only; do not write into it).

    ``data`` may pass ``msg.data`` when the caller already holds it (each access of a
    protobuf bytes field may build a new ``bytes`` object).

    With ``shared_memory`` set: a view of the region's bytes (CPU for system memory,
    the device for CUDA memory), the reference checked and its region held by ``shm``
    (the request's ``shared_memory.Lease``; None: shared memory is off, the field is
    INVALID_ARGUMENT). ``index``: the tensor holds indices; it must be in system memory
    and is copied (checks then read what the engine will use).
    """
    wire, shape = check_tensor(msg, field, dtypes, ndim)
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


def _decode_shared(msg, field, shape, value_dtype, storage_dtype, need, data_len, shm, index) -> torch.Tensor:
    from .shared_memory import off_message

    where = f"{field}.shared_memory"
    if shm is None:
        raise InvalidArgument(where, off_message() + f"; or send the elements inline in {field}.data")
    if data_len:
        raise InvalidArgument(f"{field}.data", f"has {data_len} bytes; it must be empty when {where} is set")
    region, raw = shm.resolve(msg.shared_memory, where, need, storage_dtype.itemsize, allow_cuda=not index)
    shm.count(region.kind, "in", need)
    if index:
        raw = raw.clone()  # the values checked are the values used, whatever the caller writes meanwhile
    if need == 0:
        return torch.empty(shape, dtype=value_dtype, device=raw.device)

    def typed():
        t = raw.view(storage_dtype).view(shape)
        return t.view(value_dtype) if storage_dtype != value_dtype else t

    if index:  # a private copy: nothing to reuse
        return typed()
    ref = msg.shared_memory
    return region.view((int(ref.offset), need, storage_dtype, value_dtype, tuple(shape)), typed)


def from_shared(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """What the engine uses of a tensor that views shared memory (call on the engine
    thread): system memory is copied once (to the device, or to private host memory on
    a CPU server, so that the caller cannot change it under the computation); CUDA
    memory is used in place, unless its address is not 16-byte aligned (then copied
    on the device)."""
    from .shared_memory import DEVICE_ALIGNMENT

    if t.is_cuda:
        return t if t.numel() == 0 or t.data_ptr() % DEVICE_ALIGNMENT == 0 else t.clone()
    if device.type == "cpu":
        return t.clone()
    return t.to(device)


def write_shared(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy ``src``'s bytes (row-major) into ``dst``, a uint8 view of a region of the same
    byte size: a device copy into CUDA memory, one device-to-host copy (or a memcpy on a
    CPU server) into system memory. Queued on the current stream without waiting when
    ``dst`` is device or page-locked memory (CUDA makes a copy into pageable memory wait
    by itself); the caller waits for the stream before the bytes are read."""
    src = src.detach().contiguous()
    if src.numel() == 0:
        return
    dst.copy_(src.reshape(-1).view(torch.uint8), non_blocking=True)


def encode_shared(dtype: torch.dtype, shape, region: str, offset: int, nbytes: int) -> pb.Tensor:
    """A Tensor message that describes a result written into a region (no data)."""
    return pb.Tensor(dtype=_FROM_TORCH[dtype], shape=list(shape),
                     shared_memory=pb.SharedMemoryRef(region=region, offset=offset, byte_size=nbytes))
