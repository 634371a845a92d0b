"""``kv_b_proj`` weights from safetensors (CONTRACT §8), and a writer of random ones.

Keys, with an optional prefix (a real checkpoint uses e.g.
``model.layers.0.self_attn.``):
- ``{prefix}kv_b_proj.weight`` [H*(P+V), L], bf16 or fp8 e4m3;
- for fp8, either ``{prefix}kv_b_proj.weight_scale_inv`` float32
  [ceil(N/128), ceil(L/128)] (DeepSeek-V3's 128×128 blocks: W_deq = W * s) or a scalar
  ``{prefix}kv_b_proj.weight_scale``.
A weight holding NaN or Inf (bf16, or fp8 once dequantized) is refused, naming the tensor.
Only safetensors is read: nothing is ever unpickled. A checkpoint directory: checkpoint.py.
"""

from __future__ import annotations

import dataclasses
import math
import os

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .config import ModelShape
from .errors import ConfigError
from .ops.fp8 import FP8, saturating_cast_fp8

BLOCK = 128


@dataclasses.dataclass(frozen=True)
class KvBProjWeights:
    dtype: str  # "bf16" | "fp8"
    weight: torch.Tensor  # [N, L] bf16 or fp8, as stored
    scale: torch.Tensor | None  # fp8 only: float32 scalar or [ceil(N/128), ceil(L/128)]
    compute: torch.Tensor  # [N, L] what the GEMM multiplies by: bf16, or fp32 W_deq

    def to(self, device: torch.device | str) -> KvBProjWeights:
        return KvBProjWeights(self.dtype, self.weight.to(device), None if self.scale is None else self.scale.to(device),
                              self.compute.to(device))


def dequantize(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """W_deq in float32: each 128×128 block (or the whole tensor) times its scale."""
    w = weight.float()
    if scale.dim() == 0 or scale.numel() == 1:
        return w * scale.float().reshape(())
    N, L = w.shape
    s = scale.float().repeat_interleave(BLOCK, 0)[:N].repeat_interleave(BLOCK, 1)[:, :L]
    return w * s


def exact_in_bf16(w_deq: torch.Tensor) -> bool:
    """Whether every value of the float32 ``w_deq`` is a bf16 value (then the bf16 GEMM computes it exactly)."""
    return bool(torch.equal(w_deq.to(torch.bfloat16).float(), w_deq))


def prepare(dtype: str, weight: torch.Tensor, scale: torch.Tensor | None) -> KvBProjWeights:
    """The compute form of a weight. fp8: W_deq in bf16 when exact there, else float32."""
    if dtype == "bf16":
        return KvBProjWeights("bf16", weight, None, weight)
    assert scale is not None, "an fp8 weight has a scale"
    w_deq = dequantize(weight, scale)
    return KvBProjWeights("fp8", weight, scale, w_deq.to(torch.bfloat16) if exact_in_bf16(w_deq) else w_deq)


def nonfinite(t: torch.Tensor) -> str | None:
    """None when every value of ``t`` is finite, else how many are not and where the first is."""
    bad = ~torch.isfinite(t.float() if t.dtype == FP8 else t)
    n = int(bad.sum())
    if not n:
        return None
    first = [int(i) for i in bad.nonzero()[0]]
    return f"{n} NaN/Inf value(s), the first at {first}"


def check_finite(weights: KvBProjWeights, what: str) -> None:
    """ConfigError naming ``what`` (the tensor, and its layer) when the weight the GEMM multiplies
    by (bf16, or fp8 dequantized) holds NaN or Inf."""
    bad = nonfinite(weights.compute)
    if bad:
        kind = " after dequantization with its scale" if weights.dtype == "fp8" else ""
        raise ConfigError(f"{what} holds {bad}{kind}: refusing to serve it")


def load_kv_b_proj(path: str, shape: ModelShape, prefix: str = "") -> KvBProjWeights:
    key, key_inv, key_scale = (f"{prefix}kv_b_proj.{k}" for k in ("weight", "weight_scale_inv", "weight_scale"))
    n_expected = shape.heads * (shape.qk_nope_head_dim + shape.v_head_dim)
    if not os.path.isfile(path):
        raise ConfigError(f"--weights: no such file {path!r}")
    try:
        with safe_open(path, framework="pt") as f:
            keys = set(f.keys())
            if key not in keys:
                near = sorted(k for k in keys if k.endswith("kv_b_proj.weight"))
                raise ConfigError(f"--weights: {path} has no tensor {key!r}"
                                  + (f" (it holds {near[:3]}: set --weights-prefix to the part before "
                                     f"kv_b_proj.weight)" if near else ""))
            weight = f.get_tensor(key)
            scale_inv = f.get_tensor(key_inv) if key_inv in keys else None
            scale = f.get_tensor(key_scale) if key_scale in keys else None
    except SafetensorError as e:  # not safetensors (a pickle, say): never fall back to anything else
        raise ConfigError(f"--weights: {path} is not a readable safetensors file ({e})") from None
    if tuple(weight.shape) != (n_expected, shape.kv_lora_rank):
        raise ConfigError(
            f"--weights: {key} has shape {tuple(weight.shape)}, expected [{n_expected}, {shape.kv_lora_rank}] "
            f"for {shape.heads} heads (H*(P+V), L)"
        )

    def checked(w: KvBProjWeights) -> KvBProjWeights:
        check_finite(w, f"--weights: {path}'s {key}")
        return w

    if weight.dtype == torch.bfloat16:
        return checked(prepare("bf16", weight, None))
    if weight.dtype != FP8:
        raise ConfigError(f"--weights: {key} has dtype {weight.dtype}; bf16 or float8_e4m3fn expected")
    if scale_inv is not None:
        want = (math.ceil(weight.shape[0] / BLOCK), math.ceil(weight.shape[1] / BLOCK))
        if tuple(scale_inv.shape) != want:
            raise ConfigError(f"--weights: {key_inv} has shape {tuple(scale_inv.shape)}, expected {list(want)}")
        scale = scale_inv
    elif scale is not None:
        if scale.numel() != 1:
            raise ConfigError(f"--weights: {key_scale} must be a scalar, has shape {tuple(scale.shape)}")
        scale = scale.reshape(())
    else:
        raise ConfigError(f"--weights: fp8 {key} needs {key_inv} or {key_scale}")
    scale = scale.float()
    if not bool(torch.isfinite(scale).all()) or bool((scale <= 0).any()):
        raise ConfigError("--weights: kv_b_proj weight scales must be finite and positive")
    return checked(prepare("fp8", weight, scale))


def random_kv_b_proj(shape: ModelShape, dtype: str, seed: int, scale_kind: str = "block") -> dict[str, torch.Tensor]:
    """Random weights in the checkpoint layout (unprefixed keys).

    Values ~ N(0, 1/L) so that kv_b_proj outputs are O(1). fp8: quantized per 128×128
    block (``scale_kind="block"``, arbitrary float scales as in real checkpoints) or
    per tensor (``"tensor"``, a power-of-two scale).
    """
    g = torch.Generator().manual_seed(seed)
    N = shape.heads * (shape.qk_nope_head_dim + shape.v_head_dim)
    L = shape.kv_lora_rank
    w = torch.randn((N, L), generator=g) / math.sqrt(L)
    if dtype == "bf16":
        return {"kv_b_proj.weight": w.to(torch.bfloat16)}
    if dtype != "fp8":
        raise ValueError(f"weight dtype must be bf16 or fp8, not {dtype!r}")
    if scale_kind == "tensor":  # a power of two: W_deq is then exact in bf16 (the fast GEMM)
        s = torch.tensor(2.0 ** math.ceil(math.log2(float(w.abs().amax()) / 448.0)))
        return {"kv_b_proj.weight": saturating_cast_fp8(w / s), "kv_b_proj.weight_scale": s.reshape(()).float()}
    q, s = quantize_fp8_blocks(w)
    return {"kv_b_proj.weight": q, "kv_b_proj.weight_scale_inv": s}


def quantize_fp8_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` [N, K] -> (e4m3 [N, K], float32 ``weight_scale_inv`` [ceil(N/128), ceil(K/128)]):
    each 128×128 block scaled by its amax / 448, as DeepSeek-V3's checkpoints are."""
    w = w.float()
    N, K = w.shape
    nb, kb = math.ceil(N / BLOCK), math.ceil(K / BLOCK)
    pad = torch.zeros((nb * BLOCK, kb * BLOCK))
    pad[:N, :K] = w
    amax = pad.reshape(nb, BLOCK, kb, BLOCK).abs().amax(dim=(1, 3)).clamp(min=1e-12)
    s = (amax / 448.0).float()
    return saturating_cast_fp8(w / dequantize(torch.ones_like(w), s)), s


def save_weights(path: str, tensors: dict[str, torch.Tensor], prefix: str = "") -> None:
    save_file({prefix + k: v.contiguous() for k, v in tensors.items()}, path)


def shard_kv_b_proj(weights: KvBProjWeights, total_heads: int, shard_index: int, num_shards: int,
                    head_rows: int = 256) -> KvBProjWeights:
    """The rows of one head shard of a full ``kv_b_proj`` (tensor parallelism over heads).

    Shard ``i`` of ``n`` owns heads ``[i*H/n, (i+1)*H/n)``, i.e. the contiguous rows
    ``[i*H/n*(P+V), (i+1)*H/n*(P+V))`` of the ``[H*(P+V), L]`` weight. Everything is sliced
    from the *full* prepared weights, so ``compute`` is exactly those rows of the full
    ``compute`` (same dtype too: whether W_deq is exact in bf16 is decided on the whole
    weight, never per shard). A 128×128 block scale is sliced by row blocks, which is exact
    because P+V = 256 makes every head exactly two row blocks: ``dequantize(weight, scale)``
    of the shard equals the rows of the full W_deq.
    """
    if not isinstance(num_shards, int) or num_shards < 1:
        raise ConfigError(f"--num-shards must be an integer >= 1, got {num_shards!r}")
    if not isinstance(shard_index, int) or not 0 <= shard_index < num_shards:
        raise ConfigError(f"--shard-index must be in [0, {num_shards}) for --num-shards {num_shards}, "
                          f"got {shard_index!r}")
    if total_heads % num_shards:
        raise ConfigError(
            f"--heads {total_heads} (the model's heads when sharded) is not divisible by --num-shards {num_shards}"
        )
    if weights.weight.shape[0] != total_heads * head_rows:
        raise ConfigError(f"kv_b_proj has {weights.weight.shape[0]} rows, expected {total_heads} heads × {head_rows}")
    if num_shards == 1:
        return weights
    per = total_heads // num_shards
    r0, r1 = shard_index * per * head_rows, (shard_index + 1) * per * head_rows
    scale = weights.scale
    if scale is not None and scale.dim() == 2:
        if r0 % BLOCK or (r1 - r0) % BLOCK:  # unreachable at P+V = 256; the scale format cannot say it
            raise ConfigError(f"kv_b_proj shard rows [{r0}, {r1}) do not align with the {BLOCK}-row scale blocks")
        scale = scale[r0 // BLOCK : r1 // BLOCK]
    return KvBProjWeights(weights.dtype, weights.weight[r0:r1].contiguous(),
                          None if scale is None else scale.contiguous(), weights.compute[r0:r1].contiguous())
