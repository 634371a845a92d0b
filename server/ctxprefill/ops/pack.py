"""Pack the chunk's keys (and for fp8 prefill, k and v) for attention (CONTRACT §5, §6).

Two forms with the same results, byte for byte:
- generic: ordinary tensor ops (slice views, concat, the saturating cast), as vLLM's
  generic MLA impl does it — several kernels and intermediate copies;
- fused: ``fused_mla_kv_concat`` / ``fused_mla_kv_concat_quant_fp8``, one kernel that
  reads the strided ``kv_b_proj`` halves and the strided ``k_pe`` view directly.
For fp8 prefill V may be written keys-last (``v_keys_last``: ``[H, 128, v_cols]``,
each segment from a 16-aligned column), the layout the Triton attention's fp8 P·V
reads without transposing tiles.
On the CPU (or without the extension) the fused calls run a torch reference that
writes the output once, and note one launch, as the kernel would.
"""

from __future__ import annotations

import dataclasses

import torch

from . import _cuda, launches
from .fp8 import FP8, FP8_MAX, saturating_cast_fp8

#: rows of storage past a keys-last chunk's fp8 K: an attention kernel that loads K in whole
#: 16-key groups reads up to 15 rows past the last segment (masked out of its scores). Every
#: path allocates them: the reference, the generic ops, the fused kernel's binding
#: (``kKeySlackRows``, csrc/launchers.h)
KEY_SLACK_ROWS = 15


def key_buffer(T: int, H: int, width: int, device: torch.device) -> torch.Tensor:
    """An fp8 K ``[T, H, width]``, contiguous, with ``KEY_SLACK_ROWS`` rows of storage past its end."""
    return torch.empty((T + KEY_SLACK_ROWS, H, width), dtype=FP8, device=device)[:T]


def rows_readable(t: torch.Tensor) -> int:
    """Rows of ``t``'s first dimension that lie in its storage from its first row on: its
    own, and those past its end where ``t`` is a view of a larger buffer (``key_buffer``)."""
    elems = t.untyped_storage().nbytes() // t.element_size() - t.storage_offset()
    row = 1 + sum((n - 1) * st for n, st in zip(t.shape[1:], t.stride()[1:], strict=True))
    return max(0, (elems - row) // t.stride(0) + 1) if t.dim() and t.stride(0) > 0 else 0


def _flat_pe(k_pe: torch.Tensor) -> torch.Tensor:
    """[T, R] or [T, 1, R] -> [T, R] (a view)."""
    return k_pe.reshape(k_pe.shape[0], k_pe.shape[-1])


def _check_pack_inputs(k_nope: torch.Tensor, k_pe: torch.Tensor, v: torch.Tensor | None = None) -> None:
    if k_nope.dim() != 3 or k_pe.dim() not in (2, 3) or k_pe.shape[0] != k_nope.shape[0]:
        raise ValueError(
            f"pack: k_nope [T,H,P] and k_pe [T,R] expected, got {tuple(k_nope.shape)}, {tuple(k_pe.shape)}"
        )
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


@dataclasses.dataclass(frozen=True)
class KeysLast:
    """Where V goes keys-last (``[H, 128, v_cols]``): segment s's keys (tokens
    ``cu_k[s] .. cu_k[s+1]``) from column ``cu_v[s]``, a multiple of 16, so that each
    segment's first key is 16-byte aligned for the attention's TMA loads. Host lists and
    the same as int32 device tensors (the kernel's): the engine builds it with the chunk
    metadata, :func:`keys_last_layout` elsewhere."""

    cu_k: list[int]
    cu_v: list[int]
    cu_k_dev: torch.Tensor
    cu_v_dev: torch.Tensor

    @property
    def v_cols(self) -> int:
        """V's row length: past the last segment, rounded up to 128 columns. With rows of
        an odd multiple of 32 bytes, a pack tile's last 128-byte store and the next row's
        first share a 64-byte DRAM burst, written at different times: on the H200 the
        four-segment fp8 pack ran at 82.2-86.3 % of copy bandwidth with such rows and
        87.3-88.3 % with them padded (H=128, T=8192-32768; bench_kernels' "128-col rows",
        2026-12-01). The padding is zeros (like the gaps between segments), at most 127
        columns."""
        return -(-self.cu_v[-1] // 128) * 128


def keys_last_starts(cu_k: list[int]) -> list[int]:
    """Each segment's first column: the previous one's plus its length rounded up to 16."""
    cu_v = [0]
    for a, b in zip(cu_k, cu_k[1:]):
        cu_v.append(cu_v[-1] + -(-(b - a) // 16) * 16)
    return cu_v


def keys_last_layout(cu_k: list[int], device) -> KeysLast:
    """The layout for segments ``cu_k``, its device tensors on ``device`` (the engine builds
    its own from the request's one host-to-device copy)."""
    cu_v = keys_last_starts(cu_k)
    return KeysLast(list(cu_k), cu_v, torch.tensor(cu_k, dtype=torch.int32, device=device),
                    torch.tensor(cu_v, dtype=torch.int32, device=device))


def keys_last_copy(v: torch.Tensor, layout: KeysLast, count: bool = False) -> torch.Tensor:
    """v [T, H, D] -> [H, D, v_cols] in its dtype, zero between segments: a fill and a
    copy per segment (``count``: noted as launches, as the generic pack does)."""
    T, H, D = v.shape
    vt = torch.zeros((H, D, layout.v_cols), dtype=v.dtype, device=v.device)
    if count:
        launches.note(1 if vt.numel() else 0)
    for a, b, c in zip(layout.cu_k, layout.cu_k[1:], layout.cu_v):
        if b > a:
            if count:
                launches.note(1)
            vt[:, :, c : c + b - a].copy_(v[a:b].permute(1, 2, 0))
    return vt


def fused_mla_kv_concat_quant_fp8_reference(k_nope, k_pe, v, v_keys_last: KeysLast | None = None):
    """With ``v_keys_last`` the second result is V keys-last, ``[H, 128, v_cols]``."""
    k_pe = _flat_pe(k_pe)
    T, H, P = k_nope.shape

    def sat(x):
        return x.clamp(-FP8_MAX, FP8_MAX).to(FP8)

    if v_keys_last is None:
        k = torch.empty((T, H, P + k_pe.shape[-1]), dtype=FP8, device=k_nope.device)
    else:
        k = key_buffer(T, H, P + k_pe.shape[-1], k_nope.device)
    k[..., :P] = sat(k_nope)
    k[..., P:] = (k_pe if k_pe.dtype == FP8 else sat(k_pe))[:, None, :]
    if v_keys_last is None:
        return k, sat(v)
    return k, keys_last_copy(sat(v), v_keys_last)


# --- fused: one launch per chunk ---------------------------------------------------


def fused_mla_kv_concat(k_nope: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """k_nope [T,H,128] (strided), k_pe [T,64] or [T,1,64] (strided), same dtype -> k [T,H,192]."""
    _check_pack_inputs(k_nope, k_pe)
    if k_pe.dtype != k_nope.dtype:
        raise ValueError(f"fused_mla_kv_concat: k_pe dtype {k_pe.dtype} != k_nope dtype {k_nope.dtype}")
    if k_nope.shape[0] == 0:
        shape = (0, k_nope.shape[1], k_nope.shape[2] + k_pe.shape[-1])
        return torch.empty(shape, dtype=k_nope.dtype, device=k_nope.device)
    launches.note(1)
    if _cuda.use_cuda(k_nope):
        return _cuda.load().fused_mla_kv_concat(k_nope, _flat_pe(k_pe))
    return fused_mla_kv_concat_reference(k_nope, k_pe)


def fused_mla_kv_concat_quant_fp8(k_nope, k_pe, v, *, v_keys_last: KeysLast | None = None):
    """As ``fused_mla_kv_concat`` plus the saturating fp8 cast of k and v -> (k_fp8, v_fp8).

    ``k_pe`` may already be fp8 (raw gather of an fp8 cache): its bytes are copied.
    ``v_keys_last`` (a :class:`KeysLast` of the chunk's segments): v_fp8 is
    ``[H, 128, v_cols]``, keys contiguous, each segment from a 16-aligned column, zeros
    between — the layout in which the attention's fp8 P·V reads V without transposing
    it (docs/DESIGN.md); still one launch.
    """
    _check_pack_inputs(k_nope, k_pe, v)
    if k_pe.dtype not in (k_nope.dtype, FP8):
        raise ValueError(f"fused_mla_kv_concat_quant_fp8: k_pe dtype {k_pe.dtype} is neither {k_nope.dtype} nor fp8")
    T, H, P = k_nope.shape
    if v_keys_last is not None and (v_keys_last.cu_k[-1] != T or v_keys_last.cu_k[0] != 0):
        raise ValueError(f"fused_mla_kv_concat_quant_fp8: v_keys_last covers tokens [{v_keys_last.cu_k[0]}, "
                         f"{v_keys_last.cu_k[-1]}), the chunk has {T}")
    if T == 0:
        dev = k_nope.device
        if v_keys_last is not None:
            vt = torch.zeros((H, v.shape[-1], v_keys_last.v_cols), dtype=FP8, device=dev)
            return key_buffer(0, H, P + k_pe.shape[-1], dev), vt
        return torch.empty((0, H, P + k_pe.shape[-1]), dtype=FP8, device=dev), torch.empty(v.shape, dtype=FP8,
                                                                                          device=dev)
    launches.note(1)
    if _cuda.use_cuda(k_nope):
        ext = _cuda.load()
        if v_keys_last is not None:
            return ext.fused_mla_kv_concat_quant_fp8_vt(k_nope, _flat_pe(k_pe), v, v_keys_last.cu_k_dev,
                                                        v_keys_last.cu_v_dev, v_keys_last.v_cols)
        return ext.fused_mla_kv_concat_quant_fp8(k_nope, _flat_pe(k_pe), v)
    return fused_mla_kv_concat_quant_fp8_reference(k_nope, k_pe, v, v_keys_last)


# --- generic: what an unfused MLA impl does ---------------------------------------


def generic_kv_concat(k_nope: torch.Tensor, k_pe: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    k_pe = _flat_pe(k_pe)
    T, H, _ = k_nope.shape
    launches.note(1)  # one cat kernel; the expand is a view
    return torch.cat((k_nope, k_pe[:, None, :].expand(T, H, k_pe.shape[-1])), dim=-1, out=out)


def generic_kv_concat_quant_fp8(k_nope, k_pe, v, *, v_keys_last: KeysLast | None = None):
    k_pe = _flat_pe(k_pe)
    T, H, P = k_nope.shape
    # keys-last: K into a buffer with the rows past its end that attention may read
    out = None if v_keys_last is None else key_buffer(T, H, P + k_pe.shape[-1], k_nope.device)
    if k_pe.dtype == FP8:  # raw fp8 k_pe from the cache: quantize only the k_nope half
        k_nope = saturating_cast_fp8(k_nope)
        k = generic_kv_concat(k_nope, k_pe, out=out)
    else:
        k = saturating_cast_fp8(generic_kv_concat(k_nope, k_pe), out=out)
    v8 = saturating_cast_fp8(v)
    if v_keys_last is None:
        return k, v8
    return k, keys_last_copy(v8, v_keys_last, count=True)  # a fill, and a transposing copy per segment
