"""Shared-memory regions of the same-host transport (docs/TRANSPORT.md).

Modelled on Triton Inference Server's shared-memory extension: a caller on the same
host registers a region once — a POSIX shared-memory object (``/dev/shm/<key>``) or
CUDA device memory of its own process (a ``cudaIpcMemHandle_t``) — and then places
request tensors in it (``Tensor.shared_memory``) and asks for the outputs to be
written into it (``PrefillContextRequest.output_region`` / ``lse_region``), instead
of sending megabytes inline through protobuf. Off unless ``--shared-memory``.

This host only. Registering, unregistering, listing and every use of a region (a
request naming one, a request ring) need a local peer (:func:`peer_is_local`: a
unix-domain socket, or loopback); any other is PERMISSION_DENIED naming it. A request's
:class:`Lease` carries the peer of the call it came in on (:data:`caller_peer`).

:class:`SharedMemoryRegistry` is the thread-safe table of regions (the event loop
registers and resolves; the engine thread releases). Everything a request names is
checked here before any kernel sees it: the region exists, the range lies inside it,
the byte size equals the tensor's, the start is aligned to the element size, and a
system object still covers the region. A failed check raises an error naming the
field; nothing changes.

System regions are read and written through the object's descriptor (``os.preadv`` /
``os.pwritev``), never by touching a mapping from the CPU: a caller may shrink its
object at any moment, and a load or store past the end of a mapping is SIGBUS, which
kills the process, while a read past the end of a file is short and a write is checked
first (:meth:`Region.read`, :meth:`Region.write`: FAILED_PRECONDITION naming the
region). A request's view of a system region is a ``meta`` tensor (shape and dtype,
no memory) carrying its :class:`Span`; ``codec.from_shared`` / ``write_shared`` copy
through it.

Lifetimes. A system region holds the object's descriptor (``os.open`` with
``O_NOFOLLOW``; never ``multiprocessing.shared_memory``, whose resource tracker on
Python <= 3.12 would unlink the caller's segment when the server exits); a CUDA region
the tensor ``ipc_open`` of the CUDA extension returns, whose deleter calls
``cudaIpcCloseMemHandle``. A request holds a :class:`Lease` on the regions it uses;
unregistering removes a region from the table at once (later references get
NOT_FOUND) and drops it (closes the descriptor, unlocks the mapping) when no lease
holds it. A request ring reads its slots through a descriptor of its own.

Pinned system regions. On a CUDA server a system region is also mapped and the mapping
page-locked (``cudaHostRegister``) when it is registered, so that q's copy to the
device and the results' copy into the region run as DMA at the link's rate, queued on
the stream (H200: 0.49 ms for a 25 MB q, against 3.0 ms through the descriptor). Only the
device touches that mapping: DMA to pages the driver holds locked raises no signal in
this process when the object shrinks (the copy then reads or fills pages the object
no longer has). Index tensors and everything the CPU reads still go through the
descriptor. It is unlocked (``cudaHostUnregister``) when the region is dropped. A
region that cannot be locked works through the descriptor alone: ``pinned`` in its
status says which.
"""

from __future__ import annotations

import collections
import contextvars
import dataclasses
import errno
import functools
import logging
import mmap
import os
import re
import stat
import threading
import urllib.parse
from collections import Counter
from collections.abc import Callable

import torch

from ..errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    OutOfRange,
    PermissionDenied,
    ResourceExhausted,
    Unimplemented,
)
from .exposure import is_loopback_address

log = logging.getLogger("ctxprefill.service")

SYSTEM, CUDA = "system", "cuda"
KINDS = (SYSTEM, CUDA)
SHM_DIR = "/dev/shm"
CUDA_IPC_HANDLE_SIZE = 64
#: region names: what Triton clients use, and safe in logs
_NAME_RE = re.compile(r"[A-Za-z0-9._:-]{1,128}\Z")
#: a POSIX shm name (NAME_MAX 255) that can only ever be one file directly under /dev/shm
_KEY_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,254}\Z")
#: a device tensor used in place whose address is not a multiple of this is copied first
#: (vectorized kernels load 16 bytes at a time)
DEVICE_ALIGNMENT = 16
#: opens a cudaIpcMemHandle_t of the engine's device: (raw handle, device, bytes, offset) -> uint8 tensor
IpcOpen = Callable[[bytes, int, int, int], torch.Tensor]
FLAG_HINT = "start the server with --shared-memory system, cuda or all (CTXPREFILL_SHARED_MEMORY)"


def off_message(what: str = "shared memory") -> str:
    return f"{what} is off on this server; {FLAG_HINT}"


# ---------------------------------------------------------------------------- this host only

#: the gRPC peer (``context.peer()``) of the call whose requests are being decoded; the
#: servicer sets it per call, a request ring's request gets the peer that attached the ring
caller_peer: contextvars.ContextVar[str | None] = contextvars.ContextVar("ctxprefill_shm_peer", default=None)


@functools.lru_cache(maxsize=1024)  # a connection's requests ask again and again
def peer_is_local(peer: str | None) -> bool:
    """Whether a gRPC peer is on this host: a unix-domain socket (``unix:...``,
    ``unix-abstract:...``) or a loopback address (``ipv4:127.x.y.z:port``,
    ``ipv6:[::1]:port``, ``ipv6:[::ffff:127.x.y.z]:port``; gRPC may percent-encode the
    brackets). Anything else, or nothing, is not."""
    if not peer:
        return False
    scheme, _, rest = urllib.parse.unquote(peer).partition(":")
    if scheme in ("unix", "unix-abstract"):
        return True
    if scheme == "ipv4":
        host = rest.rpartition(":")[0]
    elif scheme == "ipv6":
        if not rest.startswith("[") or "]" not in rest:
            return False
        host = rest[1 : rest.index("]")]
    else:
        return False
    try:
        return is_loopback_address(host)
    except ValueError:
        return False


def require_local(peer: str | None, field: str = "") -> None:
    """PERMISSION_DENIED naming ``peer`` unless it is on this host."""
    if not peer_is_local(peer):
        raise PermissionDenied(field, f"shared memory is for processes on this host; this call comes from "
                                      f"{(peer or 'no gRPC peer')[:200]!r}: connect over loopback or the server's "
                                      f"--unix-socket, or send tensors inline")


def _check_name(name: str, field: str = "name") -> None:
    if not _NAME_RE.match(name or ""):
        raise InvalidArgument(field, f"{name[:140]!r} is not a region name: 1 to 128 characters of [A-Za-z0-9._:-]")


def check_key(key: str) -> str:
    """The key without its optional leading "/" (InvalidArgument naming ``key`` if it
    could name anything but one file directly under /dev/shm)."""
    k = key[1:] if key.startswith("/") else key
    if not _KEY_RE.match(k):
        raise InvalidArgument(
            "key", f"{key[:300]!r} is not a shared-memory key: 1 to 255 characters of [A-Za-z0-9._-] after an optional "
                   f"leading '/', not starting with '.' and with no other '/'")
    return k


def _check_extent(offset: int, byte_size: int) -> None:
    if offset < 0:
        raise InvalidArgument("offset", f"must be >= 0, got {offset}")
    if byte_size < 1:
        raise InvalidArgument("byte_size", f"must be >= 1, got {byte_size}")


class Region:
    """One registered region. ``tensor`` is its bytes (uint8 ``[byte_size]``): CUDA memory,
    a system region's page-locked mapping (only the device copies from or into it), or,
    for a system region read through its descriptor, a ``meta`` tensor (no memory);
    None once dropped."""

    def __init__(self, name: str, kind: str, key: str, offset: int, byte_size: int, device: str,
                 tensor: torch.Tensor, fd: int | None = None, mm: mmap.mmap | None = None,
                 pinned_at: int | None = None, pinned_for: torch.device | None = None):
        self.name, self.kind, self.key = name, kind, key
        self.offset, self.byte_size, self.device = offset, byte_size, device
        self.tensor: torch.Tensor | None = tensor
        self._fd = fd  # system regions: the object's descriptor, read-write (closed when dropped)
        self._mm = mm  # the page-locked mapping (system regions on a CUDA server)
        self._pinned_at = pinned_at  # the page-locked mapping's start (system regions on a CUDA server)
        self._pinned_for = pinned_for  # the device whose copies use it
        self.in_flight = 0  # leases holding it (guarded by the registry's lock)
        self.registered = True
        #: views of its bytes already made, by (offset, bytes[, dtype, shape]), least recently
        #: used first: requests of one caller name the same places again and again (a 61-layer
        #: model's q, output and LSE: 183), and a view costs a few torch calls
        self.views: collections.OrderedDict = collections.OrderedDict()

    #: views kept per region
    MAX_VIEWS = 1024

    def view(self, key: tuple, make):
        """The view cached under ``key``, or ``make()`` (cached; the least recently used go first)."""
        v = self.views.get(key)
        if v is None:
            if len(self.views) >= self.MAX_VIEWS:
                self.views.popitem(last=False)
            v = self.views[key] = make()
        else:
            self.views.move_to_end(key)
        return v

    # -- system regions: through the descriptor ----------------------------------------
    def _descriptor(self, field: str) -> int:
        if self._fd is None:
            raise NotFound(f"{field}.region", f"shared-memory region {self.name!r} is no longer registered")
        return self._fd

    def _shrank(self, field: str, size: int, start: int, end: int) -> FailedPrecondition:
        """The error of an object that no longer covers ``[start, end)`` of the region."""
        return FailedPrecondition(
            f"{field}.region", f"region {self.name!r}: shared-memory object {self.key!r} shrank to {size} bytes, "
                               f"below the bytes [{self.offset + start}, {self.offset + end}) this request uses "
                               f"(the region is [{self.offset}, {self.offset + self.byte_size})); unregister it and "
                               f"register it again")

    def object_size(self, field: str) -> int:
        try:
            return os.fstat(self._descriptor(field)).st_size
        except OSError as e:
            raise FailedPrecondition(f"{field}.region", f"region {self.name!r}: cannot stat its object: "
                                                        f"{e.strerror}") from None

    def check_backing(self, field: str, start: int = 0, end: int | None = None) -> None:
        """System regions: the object must still cover bytes ``[start, end)`` of the region
        (all of it by default). A check, not a guarantee: reads and writes stay safe when
        the object shrinks right after it (:meth:`read`, :meth:`write`)."""
        if self.kind != SYSTEM:
            return
        end = self.byte_size if end is None else end
        size = self.object_size(field)
        if size < self.offset + end:
            raise self._shrank(field, size, start, end)

    def read(self, start: int, nbytes: int, field: str, pin: bool = False) -> torch.Tensor:
        """A private copy (uint8 ``[nbytes]``, page-locked with ``pin``) of bytes ``[start,
        start + nbytes)`` of a system region, read from the descriptor: an object shrunk
        under them makes the read short, FAILED_PRECONDITION naming ``<field>.region``."""
        fd = self._descriptor(field)
        out = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        buf = out.numpy().data
        done, at = 0, self.offset + start
        while done < nbytes:
            try:
                got = os.preadv(fd, [buf[done:]], at + done)
            except OSError as e:
                raise FailedPrecondition(f"{field}.region", f"region {self.name!r}: reading its object failed: "
                                                            f"{e.strerror}") from None
            if got == 0:
                raise self._shrank(field, self.object_size(field), start, start + nbytes)
            done += got
        return out

    def write(self, start: int, data: torch.Tensor, field: str) -> None:
        """``data`` (uint8, host, contiguous) into bytes ``[start, start + len)`` of a system
        region, through the descriptor, after checking that the object still covers them
        (FAILED_PRECONDITION naming ``<field>.region``; a write past the end would grow the
        object back). An object shrunk between the check and the write grows back to the
        written end; no signal either way."""
        n = data.numel()
        self.check_backing(field, start, start + n)
        fd = self._descriptor(field)
        buf = data.numpy().data
        done, at = 0, self.offset + start
        while done < n:
            try:
                done += os.pwritev(fd, [buf[done:]], at + done)
            except OSError as e:
                raise FailedPrecondition(f"{field}.region", f"region {self.name!r}: writing its object failed: "
                                                            f"{e.strerror}") from None

    def dup_descriptor(self) -> int:
        """A descriptor of the object for a user that may outlive the region (a request ring)."""
        return os.dup(self._descriptor("region"))

    @property
    def device_copies(self) -> bool:
        """The device copies from or into its memory on its own time (queued, not waited for)."""
        return self.kind == CUDA or self._pinned_at is not None

    def drop(self) -> None:
        """Let go of the memory: the descriptor is closed, and the mapping (or IPC handle)
        is released when the last view of it is gone. A page-locked mapping is unlocked
        first, once the device has finished every copy queued from or into it: no
        request holds the region now, but one that failed after queuing q's copy may have
        answered before the copy ran."""
        if self._pinned_at is not None:
            if self._pinned_for is not None:
                torch.cuda.synchronize(self._pinned_for)
            _host_unregister(self._pinned_at, self.name)
            self._pinned_at = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self.tensor = None
        self._mm = None
        self.views = collections.OrderedDict()

    @property
    def pinned_bytes(self) -> int:
        """Bytes page-locked for it: its mapping, from the object's start to the region's end."""
        return self.offset + self.byte_size if self._pinned_at is not None else 0

    def status(self) -> dict:
        return {"name": self.name, "kind": self.kind, "key": self.key, "offset": self.offset,
                "byte_size": self.byte_size, "device": self.device, "requests_in_flight": self.in_flight,
                "pinned": self._pinned_at is not None}


@dataclasses.dataclass(frozen=True)
class Span:
    """Bytes ``[offset, offset + nbytes)`` of a system region, as a request uses them."""

    region: Region
    offset: int
    nbytes: int

    @property
    def dma(self) -> bool:
        """The region's page-locked mapping may be the device's source or destination."""
        return self.region.device_copies

    def read(self, field: str, pin: bool = False) -> torch.Tensor:
        return self.region.read(self.offset, self.nbytes, field, pin)

    def write(self, data: torch.Tensor, field: str) -> None:
        self.region.write(self.offset, data, field)


_SPAN = "_ctxprefill_shm_span"


def with_span(t: torch.Tensor, span: Span | None) -> torch.Tensor:
    """``t`` marked as standing for ``span`` (a view of a system region; see :func:`span_of`)."""
    if span is not None:
        setattr(t, _SPAN, span)
    return t


def span_of(t: torch.Tensor) -> Span | None:
    """The system-region bytes ``t`` stands for (None: ``t`` is memory to use as it is)."""
    span: Span | None = getattr(t, _SPAN, None)
    return span


def _host_register(base: int, length: int) -> str:
    """Page-lock ``[base, base + length)`` of this process's memory for the device's DMA
    (``cudaHostRegister``, through torch's binding of the runtime); '' or why not."""
    try:
        rt = torch.cuda.cudart()
        # cudaHostRegisterPortable: pinned for every device's context, not only the one
        # current on this (worker) thread
        err = int(rt.cudaHostRegister(base, length, 1))
    except Exception as e:  # a torch without the binding, no CUDA runtime: stay pageable
        return f"cudaHostRegister is not available: {e}"
    if err != 0:
        return f"cudaHostRegister failed with CUDA error {err}"
    return ""


def _host_unregister(base: int, name: str) -> None:
    try:
        err = int(torch.cuda.cudart().cudaHostUnregister(base))
    except Exception as e:
        err, why = -1, str(e)
    else:
        why = f"CUDA error {err}"
    if err != 0:
        log.warning("cudaHostUnregister failed", extra={"region": name, "error": why})


class SharedMemoryRegistry:
    """The registered regions of one server, and the limits on them.

    ``kinds``: the kinds ``--shared-memory`` enables on this device (empty: off).
    ``device``: the engine's device (CUDA regions must be on it); ``attach`` sets it.
    ``on_change(by_kind)``: called with ``{kind: (regions, bytes, page-locked bytes)}`` after every change
    (the metrics gauges). ``pin``: page-lock system regions on a CUDA device.
    """

    def __init__(self, kinds: tuple[str, ...] = (), max_regions: int = 64, max_bytes: int = 64 << 30,
                 on_change=None, pin: bool = True):
        self.configured = tuple(kinds)
        self.pin = bool(pin)  # page-lock system regions when the device is CUDA
        self.max_regions, self.max_bytes = int(max_regions), int(max_bytes)
        self.device: torch.device | None = None
        self.cuda_unusable = "" if CUDA not in self.configured else "no CUDA device attached yet"
        self._ipc_open: IpcOpen | None = None
        self._on_change = on_change
        self._lock = threading.Lock()
        self._regions: dict[str, Region] = {}

    # -- configuration ------------------------------------------------------------------
    @property
    def enabled(self) -> bool:
        return bool(self.configured)

    @property
    def kinds(self) -> tuple[str, ...]:
        """The kinds a caller can register now (CUDA only with the extension loaded)."""
        return tuple(k for k in self.configured if k != CUDA or not self.cuda_unusable)

    def attach(self, device: torch.device, ipc_open: IpcOpen | None = None, ipc_why_not: str = "") -> None:
        """Bind to the engine's device and its opener of CUDA memory handles
        (``Engine.cuda_ipc_opener``: None, and why not, where there is none)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self._ipc_open = ipc_open
        if CUDA in self.configured:
            self.cuda_unusable = "" if ipc_open is not None else (ipc_why_not or "no CUDA IPC on this server")

    def require(self, kind: str) -> None:
        """UNIMPLEMENTED when ``kind`` is off; FAILED_PRECONDITION when it is on but
        cannot work here (no CUDA extension)."""
        if kind not in self.configured:
            what = "shared memory" if not self.configured else f"{kind} shared memory"
            raise Unimplemented("", off_message(what))
        if kind == CUDA and self.cuda_unusable:
            raise FailedPrecondition("", f"CUDA shared memory cannot be used on this server: {self.cuda_unusable}")

    # -- the table ------------------------------------------------------------------------
    def _check_room(self, name: str, byte_size: int) -> None:
        """Under the lock: the name is free and the region fits the limits."""
        if name in self._regions:
            raise AlreadyExists("name", f"a shared-memory region {name!r} is already registered; unregister it first")
        if len(self._regions) >= self.max_regions:
            raise ResourceExhausted(
                "name", f"{len(self._regions)} regions are registered, the limit (--shared-memory-max-regions) is "
                        f"{self.max_regions}; unregister some")
        used = sum(r.byte_size for r in self._regions.values())
        if used + byte_size > self.max_bytes:
            raise ResourceExhausted(
                "byte_size", f"{byte_size} more bytes would make {used + byte_size} registered, over the limit "
                             f"(--shared-memory-max-bytes) of {self.max_bytes}; unregister some")

    def _add(self, region: Region) -> Region:
        with self._lock:
            self._check_room(region.name, region.byte_size)  # again: another call may have won meanwhile
            self._regions[region.name] = region
            self._changed()
        log.info("shared-memory region registered", extra={"region": region.name, "kind": region.kind,
                                                            "byte_size": region.byte_size})
        return region

    def _changed(self) -> None:
        if self._on_change is None:
            return
        by_kind = {k: [0, 0, 0] for k in self.configured}
        for r in self._regions.values():
            by_kind.setdefault(r.kind, [0, 0, 0])
            by_kind[r.kind][0] += 1
            by_kind[r.kind][1] += r.byte_size
            by_kind[r.kind][2] += r.pinned_bytes
        self._on_change({k: tuple(v) for k, v in by_kind.items()})

    def register_system(self, name: str, key: str, offset: int, byte_size: int) -> Region:
        self.require(SYSTEM)
        _check_name(name)
        k = check_key(key)
        _check_extent(offset, byte_size)
        with self._lock:
            self._check_room(name, byte_size)
        path = os.path.join(SHM_DIR, k)
        try:
            # O_NOFOLLOW: a symbolic link planted in the world-writable /dev/shm must not
            # make the server map (and write outputs into) some other file
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            raise NotFound("key", f"no shared-memory object {k!r} ({path}); create it (shm_open) first") from None
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise FailedPrecondition("key", f"{path} is a symbolic link; refusing to follow it") from None
            if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise FailedPrecondition("key", f"the server may not open {path} read-write: {e.strerror}") from None
            raise FailedPrecondition("key", f"cannot open {path}: {e.strerror}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise FailedPrecondition("key", f"{path} is not a regular file")
            if offset + byte_size > st.st_size:
                raise OutOfRange("byte_size", f"offset {offset} + byte_size {byte_size} = {offset + byte_size} is past "
                                              f"the end of shared-memory object {k!r} ({st.st_size} bytes)")
            region = self._system_region(name, k, path, fd, offset, byte_size)
        except BaseException:
            os.close(fd)
            raise
        try:
            return self._add(region)
        except Exception:
            region.drop()  # another call took the name or the room meanwhile: unlock it again, close it
            raise

    def _system_region(self, name: str, key: str, path: str, fd: int, offset: int, byte_size: int) -> Region:
        """The region over ``fd``: read and written through it, and on a CUDA server (with
        pinning on) also mapped and page-locked for the device's copies."""
        placeholder = torch.empty(byte_size, dtype=torch.uint8, device="meta")
        if not (self.pin and self.device is not None and self.device.type == "cuda"):
            return Region(name, SYSTEM, key, offset, byte_size, "host", placeholder, fd)
        try:
            mm = mmap.mmap(fd, offset + byte_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, ValueError) as e:
            raise FailedPrecondition("key", f"cannot map {path}: {e}") from None
        tensor = torch.frombuffer(mm, dtype=torch.uint8, count=byte_size, offset=offset)
        base = tensor.data_ptr() - offset  # the mapping's start (page-aligned)
        why = _host_register(base, offset + byte_size)  # faults its pages in: a shrunk object fails here
        if why:
            log.warning("shared-memory region stays pageable", extra={"region": name, "error": why})
            return Region(name, SYSTEM, key, offset, byte_size, "host", placeholder, fd)
        return Region(name, SYSTEM, key, offset, byte_size, "host", tensor, fd, mm, base, self.device)

    def register_cuda(self, name: str, raw_handle: bytes, device_id: int, offset: int, byte_size: int) -> Region:
        """Opens the handle (cudaIpcOpenMemHandle through the CUDA extension; a blocking
        driver call: the servicer runs this off the event loop)."""
        self.require(CUDA)
        _check_name(name)
        if len(raw_handle) != CUDA_IPC_HANDLE_SIZE:
            raise InvalidArgument("raw_handle", f"has {len(raw_handle)} bytes; a cudaIpcMemHandle_t has "
                                                f"{CUDA_IPC_HANDLE_SIZE} (send the raw handle, without torch's "
                                                f"version and type prefix)")
        dev = self.device
        if dev is None or dev.type != "cuda" or device_id != dev.index:
            raise InvalidArgument("device_id", f"{device_id}: this server computes on {dev} and opens CUDA memory of "
                                               f"that device only (in the server's device numbering)")
        _check_extent(offset, byte_size)
        with self._lock:
            self._check_room(name, byte_size)
        assert self._ipc_open is not None  # require(CUDA) passed
        try:
            tensor = self._ipc_open(bytes(raw_handle), int(device_id), int(byte_size), int(offset))
        except (IndexError, ValueError, RuntimeError) as e:
            first = (str(e).splitlines() or [type(e).__name__])[0][:500]
            # std::out_of_range (IndexError): the range is past the end of the allocation
            if isinstance(e, IndexError) or "past the end of the allocation" in first or "overflows" in first:
                raise OutOfRange("byte_size", first) from None
            raise InvalidArgument("raw_handle", first) from None  # does not open here, wrong device, ...
        return self._add(Region(name, CUDA, "", offset, byte_size, f"cuda:{device_id}", tensor))

    def unregister(self, name: str) -> list[str]:
        self.require_any()
        with self._lock:
            if name:
                region = self._regions.pop(name, None)
                if region is None:
                    raise NotFound("name", f"no shared-memory region {name[:140]!r} is registered")
                gone = [region]
            else:
                gone = sorted(self._regions.values(), key=lambda r: r.name)
                self._regions.clear()
            for r in gone:
                r.registered = False
                if r.in_flight == 0:
                    r.drop()
            self._changed()
        for r in gone:
            log.info("shared-memory region unregistered", extra={"region": r.name, "in_flight": r.in_flight})
        return [r.name for r in gone]

    def get(self, name: str, field: str) -> Region:
        """The registered region ``name`` (NOT_FOUND naming ``field`` otherwise)."""
        with self._lock:
            region = self._regions.get(name)
        if region is None or region.tensor is None:
            raise NotFound(field, f"no shared-memory region {name[:140]!r} is registered")
        return region

    def status(self, name: str = "") -> list[dict]:
        self.require_any()
        with self._lock:
            if name:
                r = self._regions.get(name)
                if r is None:
                    raise NotFound("name", f"no shared-memory region {name[:140]!r} is registered")
                return [r.status()]
            return [r.status() for _, r in sorted(self._regions.items())]

    def require_any(self) -> None:
        if not self.configured:
            raise Unimplemented("", off_message())

    def __len__(self) -> int:
        return len(self._regions)

    def lease(self, peer: str | None = None) -> Lease:
        """A lease for one request of ``peer`` (default: :data:`caller_peer`, the call's)."""
        return Lease(self, caller_peer.get() if peer is None else peer)


class Lease:
    """The regions one request uses, from decoding until its work is done.

    ``resolve`` (on the event loop, while decoding) checks a reference and returns a
    view of its bytes, holding the region; it refuses every reference of a ``peer``
    that is not on this host (PERMISSION_DENIED). The work on the engine thread calls
    ``begin`` first (False: the handler gave up on the request; do nothing) and
    ``finish`` when done; the handler calls ``abandon`` when it ends, which releases
    only if the work never started. So the regions are released exactly once, after
    the last access.
    """

    IDLE, RUNNING, DONE = 0, 1, 2

    def __init__(self, registry: SharedMemoryRegistry, peer: str | None):
        self._registry = registry
        self.peer = peer
        self._regions: list[Region] = []
        self._lock = threading.Lock()
        self._state = self.IDLE
        self.transferred: Counter = Counter()  # (kind, "in" | "out") -> bytes

    @property
    def uses_cuda(self) -> bool:
        return any(r.kind == CUDA for r in self._regions)

    @property
    def device_copies(self) -> bool:
        """The device may read or write its regions on its own time: CUDA regions, and
        page-locked system regions (their copies are queued, not waited for)."""
        return any(r.device_copies for r in self._regions)

    def resolve(self, ref, field: str, nbytes: int, itemsize: int = 1, *, exact: bool = True,
                allow_cuda: bool = True) -> tuple[Region, torch.Tensor]:
        """Check ``ref`` (a ``SharedMemoryRef``) for ``nbytes`` bytes of elements of
        ``itemsize`` bytes; returns the region and a uint8 view of those bytes.
        ``exact``: ref.byte_size must equal nbytes (inputs), else be at least nbytes
        (output placements). A system region's view is a ``meta`` tensor carrying its
        :class:`Span` (:func:`span_of`), or, page-locked, its mapping with the span too."""
        require_local(self.peer, f"{field}.region")  # before anything that tells whether the region exists
        name, off, size = ref.region, int(ref.offset), int(ref.byte_size)
        if not name:
            raise InvalidArgument(f"{field}.region", "is empty: name a registered shared-memory region")
        if off < 0:
            raise InvalidArgument(f"{field}.offset", f"must be >= 0, got {off}")
        if size < 0:
            raise InvalidArgument(f"{field}.byte_size", f"must be >= 0, got {size}")
        if exact and size != nbytes:
            raise InvalidArgument(f"{field}.byte_size",
                                  f"is {size}, but the tensor's shape and dtype make {nbytes} bytes")
        if not exact and size < nbytes:
            raise InvalidArgument(f"{field}.byte_size", f"is {size} bytes, too small: the result takes {nbytes} bytes")
        if off % itemsize:
            raise InvalidArgument(f"{field}.offset", f"{off} is not a multiple of the element size {itemsize}")
        with self._registry._lock:
            region = self._registry._regions.get(name)
            if region is None or region.tensor is None:
                raise NotFound(f"{field}.region", f"no shared-memory region {name[:140]!r} is registered")
            if off + size > region.byte_size:
                raise OutOfRange(field, f"bytes [{off}, {off + size}) are outside region {name!r} "
                                        f"({region.byte_size} bytes)")
            if region.kind == CUDA and not allow_cuda:
                raise InvalidArgument(f"{field}.region",
                                      f"region {name!r} is CUDA memory; this tensor holds indices that are checked "
                                      f"on the host: send it inline or in system memory")
            region.check_backing(field, off, off + nbytes)
            tensor = region.tensor
            span = Span(region, off, nbytes) if region.kind == SYSTEM else None
            view = region.view((off, nbytes), lambda: with_span(tensor[off : off + nbytes], span))
            if view.device.type != "meta" and view.data_ptr() % itemsize:
                raise InvalidArgument(f"{field}.offset",
                                      f"{off} puts the tensor at an address that is not a multiple of its element "
                                      f"size {itemsize} (region {name!r} starts at offset {region.offset} of its "
                                      f"memory)")
            if region not in self._regions:
                region.in_flight += 1
                self._regions.append(region)
        return region, view

    def count(self, kind: str, direction: str, nbytes: int) -> None:
        self.transferred[(kind, direction)] += int(nbytes)

    # -- release -----------------------------------------------------------------------
    def begin(self) -> bool:
        with self._lock:
            if self._state == self.DONE:
                return False
            self._state = self.RUNNING
            return True

    def finish(self) -> None:
        with self._lock:
            if self._state == self.DONE:
                return
            self._state = self.DONE
        self._release()

    def end(self, device: torch.device) -> None:
        """On the engine thread, after the request's work (done or failed): wait for the
        device work that may still touch CUDA or page-locked regions, then release."""
        try:
            if self.device_copies and device.type == "cuda":
                torch.cuda.synchronize(device)
        except Exception:  # noqa: BLE001 - a failed device; the regions are released anyway
            log.exception("device synchronize before releasing shared-memory regions failed")
        finally:
            self.finish()

    def abandon(self) -> None:
        with self._lock:
            if self._state != self.IDLE:
                return  # running: its work releases; done: released
            self._state = self.DONE
        self._release()

    def _release(self) -> None:
        with self._registry._lock:
            for r in self._regions:
                r.in_flight -= 1
                if not r.registered and r.in_flight == 0:
                    r.drop()
            self._regions = []
