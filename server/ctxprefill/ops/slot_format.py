"""Byte layout of one cache slot, per cache dtype (CONTRACT §2), as pure torch functions.

``encode_slots`` is the reference for insert, ``decode_slots`` for gather: the CUDA
kernels must produce the same bytes and the same values.

| dtype        | bytes | layout                                                         |
|--------------|-------|----------------------------------------------------------------|
| auto (bf16)  | 1152  | 576 bf16: [c(512) | k_pe(64)]                                  |
| fp8          | 576   | 576 e4m3: [c | k_pe] / k_scale                                 |
| fp8_ds_mla   | 656   | c as e4m3 in 4 tiles of 128 | 4 float32 tile scales | k_pe bf16 |
"""

from __future__ import annotations

import torch

from .fp8 import FP8, FP8_MAX

CACHE_DTYPES = ("auto", "fp8", "fp8_ds_mla")
DS_TILE = 128
DS_MIN_SCALE_RATIO = 1e-4


def bytes_per_slot(cache_dtype: str, latent: int = 512, rope: int = 64) -> int:
    if cache_dtype == "auto":
        return 2 * (latent + rope)
    if cache_dtype == "fp8":
        return latent + rope
    if cache_dtype == "fp8_ds_mla":
        return latent + 4 * (latent // DS_TILE) + 2 * rope
    raise ValueError(f"unknown cache dtype {cache_dtype!r}")


def _sat_fp8(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8)


def ds_mla_tile_scales(c: torch.Tensor) -> torch.Tensor:
    """Per-tile power-of-two scales ``2**ceil(log2(max(amax/448, 1e-4)))``, float32 [T, tiles].

    Decisions the spec leaves open: amax is taken over the *finite* values of a tile
    (an inf saturates to ±448 and a NaN stays NaN instead of poisoning its whole
    tile), and ceil(log2(.)) is computed exactly with frexp rather than a rounded
    log2, so that the scale never falls below amax / 448.
    """
    t = c.float().reshape(c.shape[0], -1, DS_TILE).abs()
    t = torch.where(torch.isfinite(t), t, torch.zeros((), dtype=t.dtype))
    ratio = torch.clamp(t.amax(dim=-1) / FP8_MAX, min=DS_MIN_SCALE_RATIO)
    mant, exp = torch.frexp(ratio)  # ratio = mant * 2**exp, mant in [0.5, 1)
    ceil_log2 = torch.where(mant == 0.5, exp - 1, exp)
    return torch.ldexp(torch.ones_like(ratio), ceil_log2.to(torch.float32)).to(torch.float32)


def encode_slots(kv_c: torch.Tensor, k_pe: torch.Tensor, cache_dtype: str, k_scale: float) -> torch.Tensor:
    """[T, L] and [T, R] (bf16 or float32) -> the slot bytes, uint8 [T, bytes_per_slot]."""
    T, L = kv_c.shape
    R = k_pe.shape[1]
    if cache_dtype == "auto":
        vals = torch.cat([kv_c.to(torch.bfloat16), k_pe.to(torch.bfloat16)], dim=1)
        return vals.contiguous().view(torch.uint8).reshape(T, 2 * (L + R))
    if cache_dtype == "fp8":
        # divide by a tensor, not a Python scalar: torch's CUDA kernels turn ``x / scalar``
        # into ``x * (1 / scalar)``, which is not the exact division the spec (and the
        # insert kernel) use; tensor / tensor divides exactly on every device
        scale = torch.tensor(k_scale, dtype=torch.float32, device=kv_c.device)
        x = torch.cat([kv_c.float(), k_pe.float()], dim=1) / scale
        return _sat_fp8(x).view(torch.uint8).reshape(T, L + R)
    if cache_dtype == "fp8_ds_mla":
        scales = ds_mla_tile_scales(kv_c)  # [T, L/128]
        q = _sat_fp8(kv_c.float().reshape(T, -1, DS_TILE) / scales[..., None]).reshape(T, L)
        return torch.cat(
            [
                q.view(torch.uint8),
                scales.contiguous().view(torch.uint8).reshape(T, -1),
                k_pe.to(torch.bfloat16).contiguous().view(torch.uint8).reshape(T, 2 * R),
            ],
            dim=1,
        )
    raise ValueError(f"unknown cache dtype {cache_dtype!r}")


def decode_slots(
    raw: torch.Tensor, cache_dtype: str, k_scale: float, out_dtype: torch.dtype, latent: int = 512, rope: int = 64
) -> torch.Tensor:
    """uint8 [T, bytes_per_slot] -> [T, L+R] latents in ``out_dtype``.

    ``out_dtype`` fp8 is only defined for the ``fp8`` cache: the raw bytes, untouched.
    Otherwise values are dequantized (``e4m3 * k_scale`` or ``e4m3 * tile scale``) and
    rounded to bf16 (nearest even).
    """
    T = raw.shape[0]
    if cache_dtype == "auto":
        vals = raw.contiguous().view(torch.bfloat16).reshape(T, latent + rope)
        return vals if out_dtype == torch.bfloat16 else vals.to(out_dtype)
    if cache_dtype == "fp8":
        vals = raw.contiguous().view(FP8).reshape(T, latent + rope)
        if out_dtype == FP8:
            return vals
        return (vals.float() * k_scale).to(out_dtype)
    if cache_dtype == "fp8_ds_mla":
        if out_dtype == FP8:
            raise ValueError("fp8_ds_mla has no raw fp8 gather: its scales are per tile")
        n_tiles = latent // DS_TILE
        raw = raw.contiguous()
        q = raw[:, :latent].contiguous().view(FP8).float().reshape(T, n_tiles, DS_TILE)
        scales = raw[:, latent : latent + 4 * n_tiles].contiguous().view(torch.float32).reshape(T, n_tiles, 1)
        pe = raw[:, latent + 4 * n_tiles :].contiguous().view(torch.bfloat16).reshape(T, rope)
        c = (q * scales).reshape(T, latent)
        return torch.cat([c.to(out_dtype), pe.to(out_dtype)], dim=1)
    raise ValueError(f"unknown cache dtype {cache_dtype!r}")
