"""Loads the compiled CUDA extension, or says why it cannot.

Placeholder until csrc/ lands: reports the extension as unavailable, so every op
falls back to its torch reference.
"""

from __future__ import annotations

import torch


def load():
    """The extension module, or None."""
    return None


def why_not() -> str:
    return "CUDA extension not built yet"


def use_cuda(t: torch.Tensor) -> bool:
    """Whether the op on tensor ``t`` should run the compiled kernel."""
    return t.is_cuda and load() is not None
