"""``CudaSharedMemoryRegion`` on the CPU, over a stand-in for a CUDA tensor: the handle and
offset it registers, and torch's producer-side reference counter of the share, released
once by ``close`` (or a ``with`` block) and never before; a closed region is not
registered again. tests/gpu/test_transport_gpu.py checks on a GPU that torch then frees the
memory without its exit warning."""

from __future__ import annotations

import pytest
import torch

from ctxprefill_client import CudaSharedMemoryRegion, cuda_ipc_handle
from ctxprefill_client.shared_memory import register_cuda_request

RAW = bytes(range(64))


class FakeStorage:
    def __init__(self, log: list):
        self.log = log

    def _share_cuda_(self):
        self.log.append("share")
        # torch's tuple: device, handle (version and type byte, then the raw 64), storage
        # bytes, storage offset in the block, counter file, counter offset, event, sync
        return 0, b"\x01c" + RAW, 4096, 512, b"/torch_1_2", 7 + len(self.log), b"", False


class FakeCudaTensor:
    is_cuda = True

    def __init__(self, log: list):
        self.storage = FakeStorage(log)

    def is_contiguous(self) -> bool:
        return True

    def untyped_storage(self) -> FakeStorage:
        return self.storage

    def storage_offset(self) -> int:
        return 16

    def element_size(self) -> int:
        return 2

    def numel(self) -> int:
        return 100


@pytest.fixture
def released(monkeypatch) -> list:
    got: list = []
    monkeypatch.setattr(torch.UntypedStorage, "_release_ipc_counter_cuda",
                        staticmethod(lambda *a: got.append(a)), raising=False)
    return got


def test_a_region_registers_the_tensor_bytes_and_holds_its_counter_until_closed(released):
    log: list = []
    r = CudaSharedMemoryRegion("q", FakeCudaTensor(log))  # type: ignore[arg-type]
    assert (r.raw_handle, r.offset, r.byte_size, r.device_id) == (RAW, 512 + 16 * 2, 200, 0)
    req = register_cuda_request(r, None, None, None, 0)
    assert (req.name, req.raw_handle, req.offset, req.byte_size) == ("q", RAW, 544, 200)
    assert not r.closed and released == []  # registering releases nothing
    r.close()
    assert r.closed and released == [(b"/torch_1_2", 8)]  # the counter of its own share
    r.close()
    assert released == [(b"/torch_1_2", 8)]  # once
    with pytest.raises(ValueError, match="'q' is closed"):
        register_cuda_request(r, None, None, None, 0)


def test_a_with_block_closes_the_region_and_each_region_releases_its_own_share(released):
    log: list = []
    t = FakeCudaTensor(log)
    with CudaSharedMemoryRegion("a", t) as a, CudaSharedMemoryRegion("b", t) as b:  # type: ignore[arg-type]
        assert released == [] and log == ["share", "share"]
    assert a.closed and b.closed and sorted(released) == [(b"/torch_1_2", 8), (b"/torch_1_2", 9)]


def test_cuda_ipc_handle_keeps_its_four_values():
    assert cuda_ipc_handle(FakeCudaTensor([])) == (0, RAW, 544, 200)  # type: ignore[arg-type]


def test_a_refused_tensor_is_named_by_what_was_called():
    """A host tensor or a strided one is refused by the name the caller used, nothing shared."""
    for call, name in ((cuda_ipc_handle, "cuda_ipc_handle"),
                       (lambda t: CudaSharedMemoryRegion("r", t), "CudaSharedMemoryRegion")):
        with pytest.raises(ValueError, match=f"^{name}: the tensor must be a CUDA tensor"):
            call(torch.zeros(4))
        log: list = []
        strided = FakeCudaTensor(log)
        strided.is_contiguous = lambda: False  # type: ignore[method-assign]
        with pytest.raises(ValueError, match=f"^{name}: the tensor must be contiguous"):
            call(strided)
        assert log == []  # nothing shared
