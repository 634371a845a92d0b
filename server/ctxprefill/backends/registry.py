"""Attention backends by name, and ``auto``: the best one this device supports."""

from __future__ import annotations

import importlib

import torch

from .base import AttentionBackend

# name -> "module:Class"; imported lazily so that a CPU machine never imports triton.
_BACKENDS: dict[str, str] = {
    "cudnn": "ctxprefill.backends.cudnn_dense:CudnnDenseBackend",
    "triton": "ctxprefill.backends.triton_attention:TritonAttentionBackend",
    "reference": "ctxprefill.backends.reference:ReferenceBackend",
}
# best first; ``auto`` takes the first that is available and handles the dtype; a CPU
# device gets reference. cudnn is NOT in it: measured on the H200 it runs one-segment
# bf16 chunks at 672 TFLOP/s against Triton's 552, but every new (q, k) length pair
# costs a 60-75 ms cuDNN plan build, and a serving workload's lengths rarely repeat.
# Ask for it with --backend cudnn where chunk shapes do repeat (docs/DESIGN.md).
_AUTO_ORDER = ("triton", "reference")


def names() -> list[str]:
    return list(_BACKENDS)


def backend_class(name: str) -> type[AttentionBackend]:
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; known: auto, {', '.join(_BACKENDS)}")
    mod, cls = _BACKENDS[name].split(":")
    return getattr(importlib.import_module(mod), cls)


def create(name: str, device: torch.device, q_dtype: torch.dtype) -> tuple[AttentionBackend, str]:
    """(backend, why it was chosen). ``name="auto"`` picks the first usable one."""
    device = torch.device(device)
    if name != "auto":
        cls = backend_class(name)
        ok, why = cls.is_available(device)
        if not ok:
            raise ValueError(f"attention backend {name!r} is not available on {device}: {why}")
        if not cls.supports(device, q_dtype):
            raise ValueError(f"attention backend {name!r} does not support {q_dtype} on {device}")
        return cls(), "requested"
    skipped = []
    for candidate in _AUTO_ORDER:
        try:
            cls = backend_class(candidate)
        except ImportError as e:  # e.g. triton not installed
            skipped.append(f"{candidate}: {e}")
            continue
        ok, why = cls.is_available(device)
        if ok and cls.supports(device, q_dtype):
            return cls(), "auto" + (f" (skipped {'; '.join(skipped)})" if skipped else "")
        skipped.append(f"{candidate}: {why or 'dtype not supported'}")
    raise ValueError(f"no attention backend for {q_dtype} on {device}: {'; '.join(skipped)}")
