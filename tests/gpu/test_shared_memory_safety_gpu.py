"""System shared memory on a CUDA device while the caller shrinks its object
(docs/RELIABILITY.md, "Shared memory"): both paths a request takes — DMA from and into
the page-locked mapping, and the descriptor path of a pageable region — move the bytes
exactly, and with a thread shrinking the object and growing it back each round either
completes or fails with FAILED_PRECONDITION naming the region; the process survives.
The CPU tests (tests/test_shared_memory_safety.py) cover the server end to end."""

from __future__ import annotations

import os
import threading
import time
import uuid

import pytest
import torch

from conftest import HAS_CUDA, NO_CUDA_REASON

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason=NO_CUDA_REASON),
              pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")]

N = 25 << 20  # a 4,096-token x 16-head q


@pytest.mark.parametrize("pin", [True, False], ids=["page-locked", "descriptor"])
def test_a_region_shrinking_under_copies_fails_them_not_the_process(pin):
    from ctxprefill.errors import FailedPrecondition
    from ctxprefill.service import codec
    from ctxprefill.service.shared_memory import SharedMemoryRegistry, span_of
    from ctxprefill_api import pb

    dev = torch.device("cuda", torch.cuda.current_device())
    reg = SharedMemoryRegistry(("system",), max_bytes=1 << 30, pin=pin)
    reg.attach(dev)
    content = os.urandom(N)
    src = torch.randint(0, 256, (N,), dtype=torch.uint8, device=dev)
    path = f"/dev/shm/ctxprefill-gpu-{uuid.uuid4().hex[:12]}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.pwrite(fd, content, 0)
        reg.register_system("r", os.path.basename(path), 0, N)
        lease = reg.lease("unix:")
        _, view = lease.resolve(pb.SharedMemoryRef(region="r", offset=0, byte_size=N), "q.shared_memory", N)
        assert reg.status("r")[0]["pinned"] is pin and span_of(view).dma is pin
        assert view.device.type == ("cpu" if pin else "meta")
        got = codec.from_shared(view, dev, "q")
        codec.write_shared(view, src, "output_region")
        torch.cuda.synchronize(dev)
        assert got.is_cuda and torch.equal(got.cpu(), torch.frombuffer(bytearray(content), dtype=torch.uint8))
        assert os.pread(fd, N, 0) == src.cpu().numpy().tobytes()

        stop = threading.Event()

        def shrink() -> None:
            while not stop.is_set():
                os.ftruncate(fd, 0)
                time.sleep(0.0003)
                os.pwrite(fd, content, 0)
                time.sleep(0.006)

        t = threading.Thread(target=shrink, daemon=True)
        t.start()
        outcomes = {"ok": 0, "failed": 0}
        t_end = time.monotonic() + 30
        try:
            for _ in range(200):
                if time.monotonic() > t_end:
                    break
                try:
                    codec.from_shared(view, dev, "q")
                    codec.write_shared(view, src, "output_region")
                    torch.cuda.synchronize(dev)
                    outcomes["ok"] += 1
                except FailedPrecondition as e:
                    assert e.field in ("q.shared_memory.region", "output_region.region") and "shrank" in e.message
                    outcomes["failed"] += 1
        finally:
            stop.set()
            t.join(10)
        print(f"\npin={pin}: {outcomes}")
        assert sum(outcomes.values()) > 0
        if pin:
            assert outcomes["failed"] == 0  # only the device touches the mapping: DMA raises nothing
        lease.abandon()
        del view
        reg.unregister("")
    finally:
        os.close(fd)
        os.unlink(path)
