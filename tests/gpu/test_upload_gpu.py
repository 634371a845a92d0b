"""The metadata upload (engine/loop.py ``_upload``): asynchronous from pinned memory, each
upload lands intact although device work is queued ahead of it and the caller reuses its
array right away."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ctxprefill.engine import loop

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="no CUDA device: the GPU upload tests run on the GPU machine")]


def test_back_to_back_uploads_each_land_intact():
    dev = torch.device("cuda", torch.cuda.current_device())
    x = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    got, want = [], []
    host = np.empty(1 << 16, dtype=np.int32)
    for i, n in enumerate([5, 1 << 14, 3, (1 << 14) + 7, 1 << 16]):
        for _ in range(4):  # device work queued first: the copies wait behind it
            x @ x
        host[:n] = np.arange(n, dtype=np.int32) * (i + 1) - i
        got.append(loop._upload(host[:n], dev))
        want.append(host[:n].copy())
        host[:] = -1  # the caller's array is not what is copied: changing it changes nothing
    torch.cuda.synchronize()
    for g, w in zip(got, want):
        assert g.device == dev and g.dtype == torch.int32
        assert np.array_equal(g.cpu().numpy(), w)
