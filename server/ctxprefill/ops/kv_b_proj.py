"""``kv_b_proj``: latent [rows, L] -> [rows, H*(P+V)] in bf16 (CONTRACT §5).

Numerically always ``bf16(c · W_deqᵀ)`` accumulated in fp32, where ``W_deq`` is the
weight times its tensor or 128×128 block scale; activations are never re-quantized.
The weight arrives here already prepared by ``weights.py`` in its compute form:
- bf16 weight: a bf16 GEMM (fp32 accumulation, one rounding to bf16);
- fp8 weight whose dequantized values are exact in bf16 (power-of-two scales): the
  same bf16 GEMM on ``W_deq`` in bf16 — exact, so it computes precisely the above;
- other fp8 weights: ``W_deq`` in fp32 and an fp32 GEMM (TF32 off), then one
  rounding to bf16. Correct but slow on a GPU; see docs/DESIGN.md.
- on a CPU every weight is in fp32 (the engine widens a bf16 one once, exactly): the
  same one rounding, and torch's CPU fp32 GEMM is several times its bf16 one.
An fp8 latent (raw fp8 cache, fp8 prefill) is widened exactly (fp8 ⊂ bf16 ⊂ fp32).
"""

from __future__ import annotations

import torch

from . import launches

#: the bf16 GEMM's kernel on a Hopper GPU: "cublas" (torch's matmul) or "gluon"
#: (ops/kv_b_proj_gluon.py, persistent and warp-specialized; the same bits on the H200);
#: cuBLAS leads on the engine's 16k-row chunks (bench/probe_gemm.py, docs/DESIGN.md)
GEMM = "cublas"


def kv_b_proj(latent: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """latent [rows, L] (bf16 or fp8); weight [N, L] in its compute dtype (bf16 or fp32)."""
    x = latent
    if x.dtype != weight.dtype:
        launches.note(1)
        x = x.to(weight.dtype)
    launches.note(1)
    if GEMM == "gluon" and x.is_cuda:
        from . import kv_b_proj_gluon

        if kv_b_proj_gluon.problem(x, weight) is None:  # checked once: launch does not again
            return kv_b_proj_gluon.launch(x, weight)
    y = x @ weight.t()
    if y.dtype != torch.bfloat16:
        launches.note(1)
        y = y.to(torch.bfloat16)
    return y
