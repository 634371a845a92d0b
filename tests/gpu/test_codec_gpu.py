"""An inline result's copy to the host waits for its own request only (service/codec.py
``to_host_queued``). With request rings the engine thread queues the next request's work
before it answers the previous one (``--request-ring-overlap``); ``Tensor.cpu()`` there
would wait for that next request too. Here a spin kernel queued after the copy stands
for the next request: the copy's event completes long before the spin does."""

from __future__ import annotations

import time

import pytest
import torch

from ctxprefill.service import codec

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="no CUDA device: the queued host copy is tested on the GPU")]

SPIN_CYCLES = 2_000_000_000  # ~1 s at the H200's clock: far longer than the copy


@pytest.mark.parametrize("dtype,shape", [(torch.bfloat16, (1024, 16, 128)), (torch.float32, (16, 1024))])
def test_the_copy_does_not_wait_for_work_queued_after_it(dtype, shape):
    t = torch.randn(shape, device="cuda").to(dtype)
    torch.cuda.synchronize()
    h = codec.to_host_queued(t)
    placed = torch.cuda.Event()
    placed.record()
    torch.cuda._sleep(SPIN_CYCLES)  # the next request's work
    t0 = time.perf_counter()
    placed.synchronize()
    waited = time.perf_counter() - t0
    spun = time.perf_counter()
    torch.cuda.synchronize()
    spun = time.perf_counter() - spun
    assert h.device.type == "cpu" and h.is_pinned() and h.dtype == dtype and tuple(h.shape) == shape
    assert torch.equal(h, t.cpu())
    assert spun > 0.1, f"the spin kernel ran only {spun * 1e3:.1f} ms after the copy: the test measures nothing"
    assert waited < spun / 4, f"waiting for the copy took {waited * 1e3:.1f} ms, the spin after it {spun * 1e3:.1f}"


def test_a_strided_result_arrives_contiguous_and_equal():
    t = torch.randn(64, 8, 128, device="cuda", dtype=torch.bfloat16).transpose(0, 1)
    h = codec.to_host_queued(t)
    torch.cuda.synchronize()
    assert h.is_contiguous() and torch.equal(h, t.cpu())
