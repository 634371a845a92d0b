"""Gluon (Triton's explicit-layout dialect, Triton >= 3.5) and the Hopper operations its
kernels here use, imported once for them (ops/kv_b_proj_gluon.py,
backends/gluon_attention.py). They stay importable where it is absent and report
``GLUON_ERR`` as the reason. Also the scratch allocator that every kernel creating
tensor descriptors on the device needs (``tma_scratch``)."""

from typing import Any

import torch

__all__ = ["GLUON_ERR", "TensorDescriptor", "fence_async_shared", "gl", "gluon", "mbarrier", "tma", "tma_scratch",
           "triton", "warpgroup_mma", "warpgroup_mma_wait"]


def tma_scratch(size: int, alignment: int, stream: object) -> torch.Tensor:
    """Triton's allocator (``triton.set_allocator``): global scratch for the device-side
    tensor descriptors (128 B each per program), from torch's caching allocator, so no
    extra launch."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


triton: Any
gluon: Any
gl: Any
TensorDescriptor: Any
try:
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    GLUON_ERR = ""
except Exception as e:  # noqa: BLE001 - any import failure means "not available"
    triton = gluon = gl = TensorDescriptor = None
    fence_async_shared = mbarrier = tma = warpgroup_mma = warpgroup_mma_wait = None
    GLUON_ERR = f"Gluon (triton.experimental.gluon) unavailable: {e}"
