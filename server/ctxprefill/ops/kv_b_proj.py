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

import itertools
from collections.abc import Sequence

import torch

from . import launches

#: the bf16 GEMM's kernels on a Hopper GPU, an engine's choice (``serve --kv-b-proj-gemm``):
#: "cublas" (torch's matmul); "gluon" (ops/kv_b_proj_gluon.py, persistent and
#: warp-specialized; the same bits on the H100 and H200); "paged": the Gluon kernel reading
#: each chunk's latent from the paged cache, the chunk's gather folded into it, where
#: :func:`reads_cache` and :func:`chunk_reads_cache` hold, cuBLAS elsewhere (docs/DESIGN.md)
GEMMS = ("cublas", "gluon", "paged")
#: "paged" reads the cache for weights narrower than this (16 heads: 4,096 columns), where
#: it measured faster than the gather and cuBLAS; at 128 heads (32,768) it did not
PAGED_MAX_N = 16384
#: "paged" takes chunks of at most this many sequences: what was measured (the kernel's
#: loader scans the chunk's sequences for each tile's rows, one load each, in series)
PAGED_MAX_SEQUENCES = 1
#: rows of a paged GEMM tile's half: each half is read from one run of cache slots, so a
#: chunk's sequences must start on multiples of this (in its rows and in their context) and
#: the block size be one
PAGE_ROWS = 64


def kv_b_proj(latent: torch.Tensor, weight: torch.Tensor, gemm: str = "cublas") -> torch.Tensor:
    """latent [rows, L] (bf16 or fp8); weight [N, L] in its compute dtype (bf16 or fp32);
    ``gemm``: one of GEMMS ("gluon": the Gluon kernel where it takes the operands)."""
    x = latent
    if x.dtype != weight.dtype:
        launches.note(1)
        x = x.to(weight.dtype)
    launches.note(1)
    if gemm == "gluon" and x.is_cuda:
        from . import kv_b_proj_gluon

        if kv_b_proj_gluon.problem(x, weight) is None:  # checked once: launch does not again
            return kv_b_proj_gluon.launch(x, weight)
    y = x @ weight.t()
    if y.dtype != torch.bfloat16:
        launches.note(1)
        y = y.to(torch.bfloat16)
    return y


#: paged_problem's answers, by the facts of the cache and weight it reads (device, widths,
#: alignment, strides, block size): asked once per layer, looked up per request
_READABLE: dict[tuple[object, ...], bool] = {}


def reads_cache(cache: torch.Tensor, cache_dtype: str, weight: torch.Tensor, block_size: int, gemm: str) -> bool:
    """Whether chunks of ``cache`` (uint8 [num_slots, bytes_per_slot]) go through
    :func:`kv_b_proj_paged` with ``weight``: ``gemm`` "paged", a bf16 (``auto``) cache, a weight
    of fewer than PAGED_MAX_N rows, and what ``kv_b_proj_gluon.paged_problem`` checks (a
    Hopper GPU, a bf16 weight, TMA-aligned rows, a block size that is a multiple of 64)."""
    if gemm != "paged" or cache_dtype != "auto" or not cache.is_cuda or weight.shape[0] >= PAGED_MAX_N:
        return False
    key = (cache.device, cache.dtype, cache.shape[1], cache.data_ptr() % 16, weight.dtype, weight.shape[1],
           weight.stride(), weight.data_ptr() % 16, block_size)
    ok = _READABLE.get(key)
    if ok is None:
        from . import kv_b_proj_gluon

        ok = _READABLE[key] = kv_b_proj_gluon.paged_problem(cache, weight, block_size) is None
    return ok


def kv_b_proj_paged(cache: torch.Tensor, block_table: torch.Tensor, cu_rows: torch.Tensor,
                    context_starts: torch.Tensor, block_size: int, workspace: torch.Tensor,
                    weight: torch.Tensor) -> torch.Tensor:
    """A chunk's gather and kv_b_proj in one launch (``kv_b_proj_gluon.launch_paged``):
    [rows, N] bf16, with each row's k_pe left in ``workspace`` [rows, L+64] bf16 as the
    gather leaves it. Where :func:`reads_cache` and :func:`chunk_reads_cache` hold (the
    kernel itself takes any chunk :func:`chunk_pages_aligned` accepts)."""
    from . import kv_b_proj_gluon

    launches.note(1)
    return kv_b_proj_gluon.launch_paged(cache, block_table, cu_rows, context_starts, block_size, workspace, weight)


def chunk_pages_aligned(cu_rows: Sequence[int], context_starts: Sequence[int]) -> bool:
    """Whether every sequence of a chunk starts on a multiple of ``PAGE_ROWS`` in the chunk's
    rows (``cu_rows`` [B+1]) and in its context, so that each 64-row half of a tile lies in
    one cache block (rows past a sequence's end are another sequence's only for the last one,
    whose extra rows fall past the chunk)."""
    return all(r % PAGE_ROWS == 0 for r in cu_rows[:-1]) and all(j % PAGE_ROWS == 0 for j in context_starts)


def chunk_reads_cache(context_lens: Sequence[int], context_starts: Sequence[int]) -> bool:
    """Whether "paged" reads a chunk (its sequences' context rows and first context tokens)
    from the cache: at most ``PAGED_MAX_SEQUENCES`` sequences, on pages
    (:func:`chunk_pages_aligned`)."""
    return len(context_lens) <= PAGED_MAX_SEQUENCES and \
        chunk_pages_aligned([0, *itertools.accumulate(context_lens)], context_starts)
