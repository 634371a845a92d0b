"""A random transformers DeepSeek-V3 model of the real architecture (q LoRA, the kv_a latent
and its norm, kv_b_proj, YaRN RoPE with mscale_all_dim; every layer dense) at the latent
shapes ctxprefill serves, and the measures taken of it: tests/test_hf_integration.py and
bench/bench_model_prefill.py build and compare it the same way. torch and transformers are
imported when called."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

L, P, R, V = 512, 128, 64, 128  # kv_lora_rank, qk_nope, qk_rope, v_head_dim: what ctxprefill serves


def make_config(*, layers: int, heads: int, hidden: int, q_lora_rank: int, intermediate: int, vocab: int,
                original_max_positions: int) -> Any:
    """A bf16 ``DeepseekV3Config``, YaRN (factor 40) over ``original_max_positions``."""
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
        q_lora_rank=q_lora_rank, kv_lora_rank=L, qk_nope_head_dim=P, qk_rope_head_dim=R, v_head_dim=V,
        first_k_dense_replace=layers,  # every layer dense: no MoE
        num_mtp_layers=0, max_position_embeddings=40 * original_max_positions,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                         "original_max_position_embeddings": original_max_positions, "beta_fast": 32,
                         "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
        dtype="bfloat16",
    )


def make_model(config: Any, seed: int = 0, device: Any = "cpu") -> Any:
    """A ``DeepseekV3ForCausalLM`` of ``config`` with random bf16 weights on ``device``, scaled so
    that q, k_pe, k_nope and v are ~N(0, 1) per element: attention is sharp (logits of std ~2)
    and carries the residual stream, so a wrong context, position or merge shows far above the
    tolerances. The same ``seed`` gives the same weights."""
    import torch
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = DeepseekV3ForCausalLM(config).to(torch.bfloat16).eval()
    g = torch.Generator(device=device).manual_seed(seed + 1)
    hidden, q_lora, heads = config.hidden_size, config.q_lora_rank, config.num_attention_heads

    def normal(p: torch.nn.Parameter, std: float) -> None:
        p.data = (torch.randn(p.shape, generator=g, device=device) * std).to(torch.bfloat16)

    def around_one(n: int) -> torch.Tensor:  # a norm's weight, in [0.5, 1.5)
        return (0.5 + torch.rand(n, generator=g, device=device)).to(torch.bfloat16)

    normal(model.model.embed_tokens.weight, 1.0)
    normal(model.lm_head.weight, hidden ** -0.5)
    for layer in model.model.layers:
        a = layer.self_attn
        normal(a.q_a_proj.weight, hidden ** -0.5)
        normal(a.q_b_proj.weight, q_lora ** -0.5)  # q ~ N(0, 1)
        normal(a.kv_a_proj_with_mqa.weight, hidden ** -0.5)  # k_pe ~ N(0, 1)
        normal(a.kv_b_proj.weight, L ** -0.5)  # k_nope, v ~ N(0, 1)
        normal(a.o_proj.weight, (heads * V) ** -0.5)
        a.kv_a_layernorm.weight.data = around_one(L)
        a.q_a_layernorm.weight.data = around_one(q_lora)
    return model


def capture(model: Any, run: Callable[[], Any]) -> tuple[list[list[Any]], Any]:
    """``run()`` (without grad) with every layer's self_attn output recorded in float32:
    ``(per layer: the output of each call, run()'s result)``."""
    import torch

    outs: list[list[torch.Tensor]] = [[] for _ in model.model.layers]
    hooks = [layer.self_attn.register_forward_hook(lambda mod, args, out, i=i: outs[i].append(out[0].float()))
             for i, layer in enumerate(model.model.layers)]
    try:
        with torch.no_grad():
            result = run()
    finally:
        for h in hooks:
            h.remove()
    return outs, result


def rel(a: Any, b: Any) -> float:
    """``‖a − b‖ / ‖b‖`` of two tensors (Frobenius, float32)."""
    import torch

    return float(torch.linalg.norm((a.float() - b.float()).flatten()) / torch.linalg.norm(b.float().flatten()))
