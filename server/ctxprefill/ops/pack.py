"""Pack the chunk's keys (and for fp8 prefill, k and v) for attention (SPEC §5, §6).

Two forms with the same results, byte for byte:
- generic: ordinary tensor ops (slice views, concat, the saturating cast), as vLLM's
  generic MLA impl does it — several kernels and intermediate copies;
- fused: ``fused_mla_kv_concat`` / ``fused_mla_kv_concat_quant_fp8``, one kernel that
  reads the strided ``kv_b_proj`` halves and the strided ``k_pe`` view directly.
On the CPU (or without the extension) the fused calls run a torch reference that
writes the output once, and note one launch, as the kernel would.
"""

from __future__ import annotations

import torch

from . import _cuda, launches
from .fp8 import FP8, FP8_MAX, saturating_cast_fp8


def _flat_pe(k_pe: torch.Tensor) -> torch.Tensor:
    """[T, R] or [T, 1, R] -> [T, R] (a view)."""
    return k_pe.reshape(k_pe.shape[0], k_pe.shape[-1])


def _check_pack_inputs(k_nope: torch.Tensor, k_pe: torch.Tensor, v: torch.Tensor | None = None) -> None:
    if k_nope.dim() != 3 or k_pe.dim() not in (2, 3) or k_pe.shape[0] != k_nope.shape[0]:
        raise ValueError(f"pack: k_nope [T,H,P] and k_pe [T,R] expected, got {tuple(k_nope.shape)}, {tuple(k_pe.shape)}")
    if k_nope.stride(-1) != 1 or k_pe.stride(-1) != 1 or (v is not None and v.stride(-1) != 1):
        raise ValueError("pack: inputs need unit last stride")
    if v is not None and (v.shape[:2] != k_nope.shape[:2]):
        raise ValueError(f"pack: v {tuple(v.shape)} does not match k_nope {tuple(k_nope.shape)}")


# --- references (the CUDA kernels must equal these bit for bit) -------------------


def fused_mla_kv_concat_reference(k_nope: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    k_pe = _flat_pe(k_pe)
    T, H, P = k_nope.shape
    k = torch.empty((T, H, P + k_pe.shape[-1]), dtype=k_nope.dtype, device=k_nope.device)
    k[..., :P] = k_nope
    k[..., P:] = k_pe[:, None, :]
    return k


def fused_mla_kv_concat_quant_fp8_reference(k_nope, k_pe, v):
    k_pe = _flat_pe(k_pe)
    T, H, P = k_nope.shape

    def sat(x):
        return x.clamp(-FP8_MAX, FP8_MAX).to(FP8)

    k = torch.empty((T, H, P + k_pe.shape[-1]), dtype=FP8, device=k_nope.device)
    k[..., :P] = sat(k_nope)
    k[..., P:] = (k_pe if k_pe.dtype == FP8 else sat(k_pe))[:, None, :]
    return k, sat(v)


# --- fused: one launch per chunk ---------------------------------------------------


def fused_mla_kv_concat(k_nope: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """k_nope [T,H,128] (strided), k_pe [T,64] or [T,1,64] (strided), same dtype -> k [T,H,192]."""
    _check_pack_inputs(k_nope, k_pe)
    if k_pe.dtype != k_nope.dtype:
        raise ValueError(f"fused_mla_kv_concat: k_pe dtype {k_pe.dtype} != k_nope dtype {k_nope.dtype}")
    if k_nope.shape[0] == 0:
        return torch.empty((0, k_nope.shape[1], k_nope.shape[2] + k_pe.shape[-1]), dtype=k_nope.dtype, device=k_nope.device)
    launches.note(1)
    if _cuda.use_cuda(k_nope):
        return _cuda.load().fused_mla_kv_concat(k_nope, _flat_pe(k_pe))
    return fused_mla_kv_concat_reference(k_nope, k_pe)


def fused_mla_kv_concat_quant_fp8(k_nope, k_pe, v):
    """As ``fused_mla_kv_concat`` plus the saturating fp8 cast of k and v -> (k_fp8, v_fp8).

    ``k_pe`` may already be fp8 (raw gather of an fp8 cache): its bytes are copied.
    """
    _check_pack_inputs(k_nope, k_pe, v)
    if k_pe.dtype not in (k_nope.dtype, FP8):
        raise ValueError(f"fused_mla_kv_concat_quant_fp8: k_pe dtype {k_pe.dtype} is neither {k_nope.dtype} nor fp8")
    T, H, P = k_nope.shape
    if T == 0:
        dev = k_nope.device
        return torch.empty((0, H, P + k_pe.shape[-1]), dtype=FP8, device=dev), torch.empty(v.shape, dtype=FP8, device=dev)
    launches.note(1)
    if _cuda.use_cuda(k_nope):
        return _cuda.load().fused_mla_kv_concat_quant_fp8(k_nope, _flat_pe(k_pe), v)
    return fused_mla_kv_concat_quant_fp8_reference(k_nope, k_pe, v)


# --- generic: what an unfused MLA impl does ---------------------------------------


def generic_kv_concat(k_nope: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    k_pe = _flat_pe(k_pe)
    T, H, _ = k_nope.shape
    launches.note(1)  # one cat kernel; the expand is a view
    return torch.cat((k_nope, k_pe[:, None, :].expand(T, H, k_pe.shape[-1])), dim=-1)


def generic_kv_concat_quant_fp8(k_nope, k_pe, v):
    k_pe = _flat_pe(k_pe)
    if k_pe.dtype == FP8:  # raw fp8 k_pe from the cache: quantize only the k_nope half
        k_nope = saturating_cast_fp8(k_nope)
        k = generic_kv_concat(k_nope, k_pe)
    else:
        k = saturating_cast_fp8(generic_kv_concat(k_nope, k_pe))
    return k, saturating_cast_fp8(v)
