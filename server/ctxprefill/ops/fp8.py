"""The one fp8 e4m3 cast of this project (CONTRACT §6).

Round to nearest even; finite overflow and ±inf saturate to ±448; NaN stays NaN.
A bare ``.to(torch.float8_e4m3fn)`` is *not* this cast everywhere: torch 2.11 turns
|x| > 464 and ±inf into NaN while torch 2.13 saturates, so we always clamp first.
On the GPU the same cast is ``__nv_cvt_*_to_fp8x2(..., __NV_SATFINITE, __NV_E4M3)``.
"""

from __future__ import annotations

import torch

from . import launches

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def saturating_cast_fp8(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x.clamp(-448, 448).to(float8_e4m3fn)``: two kernels on a GPU (clamp, convert);
    the convert into ``out`` (fp8, ``x``'s shape) where given."""
    launches.note(2)
    clamped = x.clamp(-FP8_MAX, FP8_MAX)
    return clamped.to(FP8) if out is None else out.copy_(clamped)
