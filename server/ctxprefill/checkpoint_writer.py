"""``ctxprefill make-model``: a small random DeepSeek-V3 checkpoint in the published layout.

config.json (``DeepseekV3Config``'s fields), ``model.safetensors.index.json`` and K shards
``model-0000i-of-0000K.safetensors`` holding every tensor of ``DeepseekV3ForCausalLM`` under
transformers' names and shapes (all layers dense: ``first_k_dense_replace`` = the layer
count, so no experts). Small hidden and vocabulary sizes; the MLA dims are DeepSeek-V3's.
With ``dtype="fp8"`` every linear weight of the layers is float8_e4m3fn with a float32
``weight_scale_inv`` [ceil(out/128), ceil(in/128)] and config.json has the fp8
``quantization_config``; embeddings, norms and lm_head stay bf16, as in DeepSeek-V3's release.
Layer i's kv_b_proj is ``random_kv_b_proj(heads, dtype, seed + i)``: the same weight the
server uses as random weights of ``--seed`` seed.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import torch
from safetensors.torch import save_file

from .config import ModelShape
from .errors import ConfigError
from .weights import BLOCK, quantize_fp8_blocks, random_kv_b_proj

INIT_STD = 0.02


@dataclasses.dataclass(frozen=True)
class TinyModel:
    layers: int = 4
    heads: int = 16
    dtype: str = "bf16"  # "bf16" | "fp8"
    shards: int = 2
    seed: int = 0
    yarn: bool = False
    hidden_size: int = 256
    q_lora_rank: int = 256
    intermediate_size: int = 512
    vocab_size: int = 1024

    def __post_init__(self) -> None:
        for name in ("layers", "heads", "shards", "hidden_size", "q_lora_rank", "intermediate_size", "vocab_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be an integer >= 1, got {v!r}")
        if self.dtype not in ("bf16", "fp8"):
            raise ConfigError(f"--dtype must be bf16 or fp8, got {self.dtype!r}")


#: rope_scaling of DeepSeek-V3's release (its YaRN context extension)
YARN = {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096, "type": "yarn"}
FP8_QUANTIZATION = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                    "weight_block_size": [BLOCK, BLOCK]}


def model_config(m: TinyModel) -> dict[str, Any]:
    """config.json of ``m``: DeepseekV3Config's fields, in DeepSeek-V3's release layout."""
    cfg: dict[str, Any] = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "first_k_dense_replace": m.layers,  # every layer a dense MLP: no experts to store
        "hidden_act": "silu",
        "hidden_size": m.hidden_size,
        "initializer_range": INIT_STD,
        "intermediate_size": m.intermediate_size,
        "kv_lora_rank": 512,
        "max_position_embeddings": 163840 if m.yarn else 4096,
        "moe_intermediate_size": 128,
        "n_group": 2,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "num_attention_heads": m.heads,
        "num_experts_per_tok": 2,
        "num_hidden_layers": m.layers,
        "num_key_value_heads": m.heads,
        "num_nextn_predict_layers": 0,
        "q_lora_rank": m.q_lora_rank,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "rms_norm_eps": 1e-06,
        "rope_scaling": dict(YARN) if m.yarn else None,
        "rope_theta": 10000,
        "routed_scaling_factor": 2.5,
        "tie_word_embeddings": False,
        "topk_group": 1,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "v_head_dim": 128,
        "vocab_size": m.vocab_size,
    }
    if m.dtype == "fp8":
        cfg["quantization_config"] = dict(FP8_QUANTIZATION)
    return cfg


def model_tensors(m: TinyModel) -> dict[str, torch.Tensor]:
    """Every tensor of ``DeepseekV3ForCausalLM`` for ``m``, in module order."""
    g = torch.Generator().manual_seed(m.seed)
    h, H, qr = m.hidden_size, m.heads, m.q_lora_rank
    L, P, R, V = 512, 128, 64, 128

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(shape, generator=g) * INIT_STD).to(torch.bfloat16)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=torch.bfloat16)

    out: dict[str, torch.Tensor] = {}

    def linear(name: str, out_features: int, in_features: int) -> None:
        w = torch.randn((out_features, in_features), generator=g) * INIT_STD
        if m.dtype == "fp8":
            out[f"{name}.weight"], out[f"{name}.weight_scale_inv"] = quantize_fp8_blocks(w)
        else:
            out[f"{name}.weight"] = w.to(torch.bfloat16)

    out["model.embed_tokens.weight"] = normal(m.vocab_size, h)
    for i in range(m.layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = ones(h)
        linear(p + "self_attn.q_a_proj", qr, h)
        out[p + "self_attn.q_a_layernorm.weight"] = ones(qr)
        linear(p + "self_attn.q_b_proj", H * (P + R), qr)
        linear(p + "self_attn.kv_a_proj_with_mqa", L + R, h)
        out[p + "self_attn.kv_a_layernorm.weight"] = ones(L)
        kv = random_kv_b_proj(ModelShape(heads=H), m.dtype, m.seed + i)  # [H*(P+V), L]
        for k, t in kv.items():
            out[p + "self_attn." + k] = t
        linear(p + "self_attn.o_proj", h, H * V)
        out[p + "post_attention_layernorm.weight"] = ones(h)
        linear(p + "mlp.gate_proj", m.intermediate_size, h)
        linear(p + "mlp.up_proj", m.intermediate_size, h)
        linear(p + "mlp.down_proj", h, m.intermediate_size)
    out["model.norm.weight"] = ones(h)
    out["lm_head.weight"] = normal(m.vocab_size, h)
    return out


def _split(sizes: list[int], k: int) -> list[int]:
    """Shard index of each tensor: k contiguous runs of about equal bytes, none empty."""
    total, cum, out = sum(sizes), 0, []
    for n in sizes:
        out.append(min(k - 1, cum * k // max(total, 1)))
        cum += n
    if len(set(out)) < k:  # one tensor outweighs a whole shard: runs of equal counts instead
        out = [i * k // len(sizes) for i in range(len(sizes))]
    return out


def write_model(path: str, m: TinyModel) -> dict[str, Any]:
    """Write ``m`` to the directory ``path`` (created; an existing one must be empty); its index."""
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        raise ConfigError(f"make-model: {path} exists and is not an empty directory")
    tensors = model_tensors(m)
    names = list(tensors)
    if m.shards > len(names):
        raise ConfigError(f"--shards {m.shards}: the model has only {len(names)} tensors")
    os.makedirs(path, exist_ok=True)
    shard_of = _split([t.numel() * t.element_size() for t in tensors.values()], m.shards)
    files = [f"model-{i + 1:05d}-of-{m.shards:05d}.safetensors" for i in range(m.shards)]
    weight_map: dict[str, str] = {}
    for i, file in enumerate(files):
        part = {n: tensors[n].contiguous() for n, s in zip(names, shard_of, strict=True) if s == i}
        save_file(part, os.path.join(path, file), metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
             "weight_map": dict(sorted(weight_map.items()))}
    with open(os.path.join(path, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
        json.dump(index, f, indent=2)
        f.write("\n")
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(model_config(m), f, indent=2)
        f.write("\n")
    return index
