"""GPU tests: skipped, with the reason, where there is no CUDA device; on a CUDA
machine a CUDA extension that fails to build or load FAILS every test that needs it
(it is never silently skipped there), unless CTXPREFILL_DISABLE_CUDA_EXT is set."""

from __future__ import annotations

import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
for sub in ("server", "client"):
    path = os.path.join(ROOT, sub)
    if path not in sys.path:
        sys.path.insert(0, path)

HAS_CUDA = torch.cuda.is_available()
NO_CUDA_REASON = "no CUDA device (torch.cuda.is_available() is False): GPU tests run on the GPU machine"


@pytest.fixture(scope="session")
def cuda_ext():
    """The compiled extension module (fails the test on a CUDA machine if it did not load)."""
    if not HAS_CUDA:
        pytest.skip(NO_CUDA_REASON)
    from ctxprefill.ops import _cuda

    mod = _cuda.load()
    if mod is None:
        why = _cuda.why_not()
        if os.environ.get("CTXPREFILL_DISABLE_CUDA_EXT", "") not in ("", "0"):
            pytest.skip(f"CUDA extension disabled: {why}")
        pytest.fail(f"a CUDA device is present but the ctxprefill CUDA extension did not load: {why}", pytrace=False)
    return mod
