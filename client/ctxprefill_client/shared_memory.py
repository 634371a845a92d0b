"""Same-host shared memory for tensors: the client side of ``serve --shared-memory``
(docs/TRANSPORT.md; modelled on Triton Inference Server's shared-memory extension).

A caller on the server's host can skip carrying q (and WriteCache's latents) inline
and getting output and LSE back inline: it registers memory once and then names byte
ranges of it in requests.

- :class:`SystemSharedMemoryRegion`: a POSIX shared-memory segment this process
  creates (``multiprocessing.shared_memory``), with numpy views into it. The server
  maps it; q is copied from it to the device once, results are written into it.
- :class:`CudaSharedMemoryRegion`: a torch CUDA tensor of this process, exported by
  its CUDA IPC handle (:func:`cuda_ipc_handle`). The server opens it on its GPU and
  uses q in place, and writes results straight into the caller's tensors. torch is
  imported lazily, only by these; the rest of the package needs no torch.

Both hand out :class:`SharedMemoryTensor` (an input that lives in the region: pass it
as ``q``, ``kv_c``, ``k_pe`` or ``slot_mapping``; slot_mapping only from system
memory) and :class:`SharedMemoryRef` (a byte range: pass it as ``output_region`` /
``lse_region`` of ``prefill_context``)::

    with SystemSharedMemoryRegion("req0", 64 << 20) as shm:
        client.register_system_shared_memory(shm)
        q_in = shm.write(q_bits, offset=0, dtype=BF16)           # q into the segment
        res = client.prefill_context(q_in, seqs, output_region=shm.ref(out_at, out_bytes),
                                     lse_region=shm.ref(lse_at, lse_bytes))
        res.output_bits, res.lse                                  # numpy views into the segment
        del res                                                   # drop views before close
        client.unregister_shared_memory("req0")

Rules (the server checks them): every range inside its region; an input's byte size
exactly its tensor's; offsets multiples of the element size; output and LSE ranges
disjoint. The caller writes inputs before the call — for CUDA memory, **synchronizes
its stream** first (e.g. ``torch.cuda.current_stream().synchronize()``) — and does not
touch the ranges until the response arrives; then the results are in place. It keeps
the memory alive until it has unregistered the region.
"""

from __future__ import annotations

import collections
import math
import sys
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from multiprocessing import resource_tracker
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from ctxprefill_api import pb

from .tensors import BF16, FP8_E4M3, FP16, FP32, INT32, INT64, UINT8, dtype_name, storage_dtype, tensor_bits

if TYPE_CHECKING:
    import torch  # CUDA regions only; imported where they need it

__all__ = [
    "CudaSharedMemoryRegion",
    "SharedMemoryRef",
    "SharedMemoryRegionStatus",
    "SharedMemoryTensor",
    "SystemSharedMemoryRegion",
    "cuda_ipc_handle",
    "raw_cuda_ipc_handle",
]

CUDA_IPC_HANDLE_SIZE = 64
SYSTEM, CUDA = "system", "cuda"
_KIND_NAMES: dict[int, str] = {pb.SHARED_MEMORY_KIND_SYSTEM: SYSTEM, pb.SHARED_MEMORY_KIND_CUDA: CUDA}


@dataclass(frozen=True)
class SharedMemoryRef:
    """``byte_size`` bytes at ``offset`` of the registered region ``region``. ``local``:
    the region object of this process it points into, if known (results placed there
    are then returned as views of it)."""

    region: str
    offset: int
    byte_size: int
    local: Any = field(default=None, compare=False, repr=False)

    def to_proto(self) -> pb.SharedMemoryRef:
        return pb.SharedMemoryRef(region=self.region, offset=int(self.offset), byte_size=int(self.byte_size))


@dataclass(frozen=True)
class SharedMemoryTensor:
    """A request tensor whose bytes are in a registered region: wire ``dtype``, ``shape``,
    and where (``ref.byte_size`` = product(shape) * element size)."""

    dtype: int
    shape: tuple[int, ...]
    ref: SharedMemoryRef

    def to_proto(self) -> pb.Tensor:
        return pb.Tensor(dtype=cast(pb.DataType, self.dtype), shape=[int(s) for s in self.shape],
                         shared_memory=self.ref.to_proto())


@dataclass(frozen=True)
class SharedMemoryRegionStatus:
    """One region as GetSharedMemoryStatus reports it (``kind``: "system" or "cuda";
    ``device``: "host" or "cuda:N"; ``pinned``: a system region the server page-locked for
    its device's DMA — False from a server that predates the field)."""

    name: str
    kind: str
    key: str
    offset: int
    byte_size: int
    device: str
    requests_in_flight: int
    pinned: bool = False

    @classmethod
    def from_proto(cls, m: pb.SharedMemoryRegion) -> SharedMemoryRegionStatus:
        return cls(m.name, _KIND_NAMES.get(m.kind, str(m.kind)), m.key, m.offset, m.byte_size, m.device,
                   m.requests_in_flight, m.pinned)


def kind_names(kinds: Iterable[int]) -> tuple[str, ...]:
    return tuple(_KIND_NAMES.get(k, str(k)) for k in kinds)


def _nbytes(dtype: int, shape: Iterable[int]) -> int:
    return math.prod(int(s) for s in shape) * storage_dtype(dtype).itemsize


# --------------------------------------------------------------------------- system memory


#: SharedMemory takes ``track=False`` (Python >= 3.13); before, an attached segment is
#: taken out of the resource tracker by hand
_TRACK_FLAG = sys.version_info >= (3, 13)


class SystemSharedMemoryRegion:
    """A POSIX shared-memory segment of ``byte_size`` bytes (``/dev/shm/<key>``), to be
    registered under ``name``. ``key`` None: a fresh random key. ``create=False``
    attaches to an existing segment ``key`` instead; the segment stays its creator's
    (this process's exit never unlinks it, only an explicit :meth:`unlink` does).

    Use as a context manager, or call :meth:`close` (and :meth:`unlink` for a segment
    this object created). Numpy views handed out (``ndarray``, results) must be
    dropped before ``close``.
    """

    def __init__(self, name: str, byte_size: int = 0, *, key: str | None = None, create: bool = True) -> None:
        from multiprocessing import shared_memory

        if create and byte_size < 1:
            raise ValueError(f"byte_size must be >= 1, got {byte_size}")
        self.name = name
        # an attached segment is not tracked: Python's resource tracker would unlink it, under
        # its creator, when this process exits
        untracked = {} if create or not _TRACK_FLAG else {"track": False}
        self._shm = shared_memory.SharedMemory(name=key, create=create, size=byte_size if create else 0, **untracked)
        if not create and not _TRACK_FLAG:
            resource_tracker.unregister(self._shm._name, "shared_memory")  # type: ignore[attr-defined]
        self._created = create
        self.key = self._shm.name.lstrip("/")
        self.byte_size = int(byte_size) if create else int(self._shm.size)

    @property
    def buf(self) -> memoryview:
        """The segment's bytes."""
        buf = self._shm.buf
        if buf is None:
            raise ValueError(f"region {self.name!r} is closed")
        return buf

    def _check(self, offset: int, nbytes: int, itemsize: int) -> None:
        if offset < 0 or offset + nbytes > self.byte_size:
            raise ValueError(f"bytes [{offset}, {offset + nbytes}) are outside region {self.name!r} "
                             f"({self.byte_size} bytes)")
        if offset % itemsize:
            raise ValueError(f"offset {offset} is not a multiple of the element size {itemsize}")

    def ndarray(self, dtype: Any, shape: Iterable[int], offset: int = 0) -> np.ndarray:
        """A writable numpy view of the segment (numpy ``dtype``) at ``offset``."""
        dt = np.dtype(dtype)
        dims = tuple(int(s) for s in shape)
        self._check(offset, math.prod(dims) * dt.itemsize, dt.itemsize)
        return np.ndarray(dims, dtype=dt, buffer=self.buf, offset=offset)

    def view(self, dtype: int, shape: Iterable[int], offset: int = 0) -> np.ndarray:
        """The bits of a tensor of wire ``dtype`` at ``offset``: uint16 for BF16, uint8 for
        FP8_E4M3, the natural numpy dtype otherwise (as :class:`~ctxprefill_client.RawTensor`)."""
        return self.ndarray(storage_dtype(dtype), shape, offset)

    def write(self, x: Any, offset: int = 0, dtype: int | None = None, *, name: str = "tensor") -> SharedMemoryTensor:
        """Copy ``x`` into the segment at ``offset`` as wire ``dtype`` (rounded and
        converted exactly as ``encode_tensor`` does) and return it as a request input."""
        wire, bits = tensor_bits(x, dtype, name=name)
        view = self.view(wire, bits.shape, offset)
        np.copyto(view, bits, casting="no")
        del view
        return self.input(wire, bits.shape, offset)

    def input(self, dtype: int, shape: Iterable[int], offset: int = 0) -> SharedMemoryTensor:
        """A request input of wire ``dtype`` and ``shape`` whose bytes are already at ``offset``."""
        dims = tuple(int(s) for s in shape)
        nbytes = _nbytes(dtype, dims)
        self._check(offset, nbytes, storage_dtype(dtype).itemsize)
        return SharedMemoryTensor(dtype, dims, SharedMemoryRef(self.name, offset, nbytes, self))

    def ref(self, offset: int = 0, byte_size: int | None = None) -> SharedMemoryRef:
        """A byte range for a result (``output_region`` / ``lse_region``); ``byte_size``
        None: to the end of the segment."""
        n = self.byte_size - offset if byte_size is None else int(byte_size)
        self._check(offset, n, 1)
        return SharedMemoryRef(self.name, offset, n, self)

    def close(self) -> None:
        """Unmap the segment here (views into it must be gone)."""
        try:
            self._shm.close()
        except BufferError:
            raise BufferError(f"region {self.name!r}: numpy views of the segment (results, ndarray()) are still "
                              f"alive; drop them before close()") from None

    def unlink(self) -> None:
        """Remove the segment's name (the memory goes when every process unmapped it)."""
        if not self._created and not _TRACK_FLAG:  # unlink() unregisters what it unlinks
            resource_tracker.register(self._shm._name, "shared_memory")  # type: ignore[attr-defined]
        self._shm.unlink()

    def __enter__(self) -> SystemSharedMemoryRegion:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
        if self._created:
            self.unlink()

    def __repr__(self) -> str:
        return f"SystemSharedMemoryRegion(name={self.name!r}, key={self.key!r}, byte_size={self.byte_size})"


# --------------------------------------------------------------------------- CUDA memory


def _torch_dtype(wire: int) -> torch.dtype:
    import torch

    table: dict[int, torch.dtype] = {
        BF16: torch.bfloat16, FP16: torch.float16, FP32: torch.float32, FP8_E4M3: torch.float8_e4m3fn,
        INT32: torch.int32, INT64: torch.int64, UINT8: torch.uint8}
    if wire not in table:
        raise ValueError(f"unsupported tensor dtype {dtype_name(wire)}")
    return table[wire]


def _wire_dtype(torch_dtype: torch.dtype) -> int:
    import torch

    table: dict[torch.dtype, int] = {
        torch.bfloat16: BF16, torch.float16: FP16, torch.float32: FP32, torch.float8_e4m3fn: FP8_E4M3,
        torch.int32: INT32, torch.int64: INT64, torch.uint8: UINT8}
    if torch_dtype not in table:
        raise ValueError(f"no wire dtype for {torch_dtype}")
    return table[torch_dtype]


def raw_cuda_ipc_handle(handle: bytes) -> bytes:
    """The 64-byte ``cudaIpcMemHandle_t`` inside a handle from ``_share_cuda_()``.

    torch up to ~2.2 returns the raw 64 bytes; later versions prefix a version byte and
    a type byte ``'c'`` (a cudaMalloc block: the 64 raw bytes follow). Type ``'e'`` is an
    expandable segment (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``), which has
    no cudaIpcMemHandle_t: refused.
    """
    h = bytes(handle)
    if len(h) == CUDA_IPC_HANDLE_SIZE:
        return h
    if len(h) == CUDA_IPC_HANDLE_SIZE + 2 and h[1:2] == b"c":
        return h[2:]
    if len(h) >= 2 and h[1:2] == b"e":
        raise ValueError("the tensor lives in an expandable segment (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True),"
                         " which cannot be shared by a cudaIpcMemHandle_t: allocate it without expandable segments")
    raise ValueError(f"unknown torch CUDA IPC handle format ({len(h)} bytes)")


def _share_cuda(tensor: torch.Tensor, caller: str) -> tuple[int, bytes, int, int, bytes, int]:
    """``cuda_ipc_handle``'s four values and torch's producer-side reference counter of the
    share (its file's name and the counter's offset in it: ``_share_cuda_``'s 5th and 6th).
    ``caller``: the public name a refusal names."""
    if not getattr(tensor, "is_cuda", False):
        raise ValueError(f"{caller}: the tensor must be a CUDA tensor")
    if not tensor.is_contiguous():
        raise ValueError(f"{caller}: the tensor must be contiguous")
    storage: Any = tensor.untyped_storage()  # _share_cuda_ is private and unannotated in torch
    device, handle, _storage_bytes, storage_offset, counter_file, counter_offset, *_ = storage._share_cuda_()
    offset = int(storage_offset) + int(tensor.storage_offset()) * tensor.element_size()
    return (int(device), raw_cuda_ipc_handle(handle), offset, tensor.numel() * tensor.element_size(),
            bytes(counter_file), int(counter_offset))


def cuda_ipc_handle(tensor: torch.Tensor) -> tuple[int, bytes, int, int]:
    """``(device index, raw_handle, offset, byte_size)`` that register ``tensor``'s bytes
    as a CUDA region (``RegisterCudaSharedMemory``).

    This is torch's own mechanism for sharing CUDA tensors between processes
    (``torch.multiprocessing`` calls the same ``untyped_storage()._share_cuda_()``). It
    returns ``(device, handle, storage size, storage offset, ...)`` where the handle is
    the ``cudaIpcMemHandle_t`` of the caching allocator's whole cudaMalloc block, not of
    the tensor; so the region starts at the storage's offset in that block plus the
    tensor's own ``storage_offset() * element_size()``. Sharing marks the storage as
    shared with another process: torch will not reuse its memory even after the tensor
    is freed (it waits for a consumer release this server does not send), and warns at
    exit about such memory. :class:`CudaSharedMemoryRegion` gives that release itself
    (``close``); with this function, register long-lived buffers, not one per request.
    ``device`` is this process's device index; the server's numbering differs when its
    CUDA_VISIBLE_DEVICES does.
    """
    return _share_cuda(tensor, "cuda_ipc_handle")[:4]


class CudaSharedMemoryRegion:
    """``tensor`` (a contiguous torch CUDA tensor of this process) as a region to be
    registered under ``name``: the region is exactly the tensor's bytes. ``device_id``
    overrides the device index sent (the server's numbering of the tensor's GPU).

    Keep the tensor alive (and do not resize it) until the region is unregistered.

    Exporting the tensor makes torch keep its memory out of reuse once the tensor is freed,
    until a consumer releases it, so that a server still writing there cannot hit a new
    tensor. The server is no torch consumer and sends no release: :meth:`close` (or leaving
    a ``with`` block) gives it, once the region is unregistered from every server that has
    it. Without it the memory stays unused after the tensor is freed, and torch warns at
    exit ("Producer process has been terminated before all shared CUDA tensors released").
    A closed region cannot be registered again.
    """

    #: views handed out, kept for the next request that asks for the same one, least recently
    #: used first (a view costs five torch calls; a caller's results usually go to the same
    #: places every time: a 61-layer model's output and LSE, 122 places)
    _VIEW_CACHE = 1024

    def __init__(self, name: str, tensor: torch.Tensor, *, device_id: int | None = None) -> None:
        self.name = name
        self.tensor = tensor
        dev, self.raw_handle, self.offset, self.byte_size, counter_file, counter_offset = \
            _share_cuda(tensor, "CudaSharedMemoryRegion")
        self._counter: tuple[bytes, int] | None = (counter_file, counter_offset)  # None once released
        self._close_lock = threading.Lock()
        self.device_id = dev if device_id is None else int(device_id)
        self._views: collections.OrderedDict[tuple[int, tuple[int, ...], int], torch.Tensor] = \
            collections.OrderedDict()

    def _bytes(self) -> torch.Tensor:
        import torch

        return self.tensor.reshape(-1).view(torch.uint8)

    def view(self, dtype: int, shape: Iterable[int], offset: int = 0) -> torch.Tensor:
        """A torch view (on the GPU) of a tensor of wire ``dtype`` and ``shape`` at ``offset``."""
        dims = tuple(int(s) for s in shape)
        key = (dtype, dims, offset)
        v = self._views.get(key)
        if v is not None:
            try:
                self._views.move_to_end(key)
            except KeyError:  # dropped by another thread meanwhile: still a valid view
                pass
            return v
        td = _torch_dtype(dtype)
        n = math.prod(dims) * td.itemsize
        if offset < 0 or offset + n > self.byte_size:
            raise ValueError(f"bytes [{offset}, {offset + n}) are outside region {self.name!r} "
                             f"({self.byte_size} bytes)")
        v = self._bytes()[offset : offset + n].view(td).view(dims)
        if len(self._views) >= self._VIEW_CACHE:
            try:
                self._views.popitem(last=False)
            except KeyError:  # emptied by another thread meanwhile
                pass
        self._views[key] = v
        return v

    def input(self, dtype: int | None = None, shape: Iterable[int] | None = None,
              offset: int = 0) -> SharedMemoryTensor:
        """A request input: by default the whole tensor, as its own dtype and shape."""
        wire = _wire_dtype(self.tensor.dtype) if dtype is None else dtype
        dims = tuple(self.tensor.shape) if shape is None else tuple(int(s) for s in shape)
        nbytes = _nbytes(wire, dims)
        if offset < 0 or offset + nbytes > self.byte_size:
            raise ValueError(f"bytes [{offset}, {offset + nbytes}) are outside region {self.name!r}")
        return SharedMemoryTensor(wire, dims, SharedMemoryRef(self.name, offset, nbytes, self))

    def ref(self, offset: int = 0, byte_size: int | None = None) -> SharedMemoryRef:
        """A byte range for a result; by default the whole tensor."""
        n = self.byte_size - offset if byte_size is None else int(byte_size)
        if offset < 0 or offset + n > self.byte_size:
            raise ValueError(f"bytes [{offset}, {offset + n}) are outside region {self.name!r}")
        return SharedMemoryRef(self.name, offset, n, self)

    @property
    def closed(self) -> bool:
        return self._counter is None

    def close(self) -> None:
        """Release torch's hold on the tensor's memory (see the class): call it after the
        region is unregistered from every server that has it. Idempotent."""
        with self._close_lock:
            counter, self._counter = self._counter, None
        if counter is None:
            return
        import torch

        torch.UntypedStorage._release_ipc_counter_cuda(*counter)

    def __enter__(self) -> CudaSharedMemoryRegion:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"CudaSharedMemoryRegion(name={self.name!r}, device_id={self.device_id}, offset={self.offset}, "
                f"byte_size={self.byte_size})")


# --------------------------------------------------------------------------- requests


def register_system_request(region: Any, key: str | None, byte_size: int | None,
                            offset: int) -> pb.RegisterSystemSharedMemoryRequest:
    if isinstance(region, SystemSharedMemoryRegion):
        name, key, byte_size = region.name, region.key, region.byte_size
    else:
        name = region
        if key is None or byte_size is None:
            raise TypeError("register_system_shared_memory(name, key, byte_size): key and byte_size are required")
    return pb.RegisterSystemSharedMemoryRequest(name=name, key=key, offset=int(offset), byte_size=int(byte_size))


def register_cuda_request(region: Any, raw_handle: bytes | None, device_id: int | None, byte_size: int | None,
                          offset: int) -> pb.RegisterCudaSharedMemoryRequest:
    if isinstance(region, CudaSharedMemoryRegion):
        if region.closed:
            raise ValueError(f"CUDA region {region.name!r} is closed: make a new CudaSharedMemoryRegion to register it")
        name, raw_handle, device_id = region.name, region.raw_handle, region.device_id
        offset, byte_size = region.offset, region.byte_size
    else:
        name = region
        if raw_handle is None or device_id is None or byte_size is None:
            raise TypeError("register_cuda_shared_memory(name, raw_handle, device_id, byte_size): all are required")
    return pb.RegisterCudaSharedMemoryRequest(name=name, raw_handle=bytes(raw_handle), device_id=int(device_id),
                                              offset=int(offset), byte_size=int(byte_size))
