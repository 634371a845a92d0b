"""Cast the gathered latent to the dtype ``kv_b_proj`` consumes (CONTRACT §5).

Done every chunk: a no-op (no launch) when the latent already has that dtype, so the
fp8-weight + fp8-prefill path pays nothing, and the bf16-weight + fp8-cache path (the
seed's crash) gets its bf16 latent.
"""

from __future__ import annotations

import torch

from . import launches


def cast_latent(latent: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if latent.dtype == dtype:
        return latent
    launches.note(1)
    return latent.to(dtype)
