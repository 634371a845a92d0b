"""The attention-backend interface: ragged, non-causal attention with a natural-log LSE.

A backend computes, for one chunk, the attention of the chunk's query rows over the
chunk's packed keys and values. Sequences are ragged and given by cumulative lengths;
query segment i attends to key segment i only. A segment with no keys yields
``out = 0`` and ``lse = -inf`` for its rows (CONTRACT §3).

The ``out`` contract (CONTRACT §5): a backend whose ``supports_out()`` is True writes its
result into the ``out`` tensor it is given (same data pointer) and returns it; the
engine checks the pointer and fails loudly if a backend claims it but did not.
"""

from __future__ import annotations

import abc

import torch


class AttentionBackend(abc.ABC):
    """One attention implementation. Stateless apart from caches of compiled kernels."""

    #: registry name, e.g. "reference", "triton"
    name: str = ""

    @classmethod
    def is_available(cls, device: torch.device) -> tuple[bool, str]:
        """(available, reason when not) on this device."""
        return True, ""

    @classmethod
    def supports(cls, device: torch.device, q_dtype: torch.dtype) -> bool:
        """Whether this backend handles queries/keys of ``q_dtype`` on ``device``."""
        return True

    @abc.abstractmethod
    def supports_out(self) -> bool:
        """True when ``run_context_chunk`` writes into a caller-given ``out``."""

    @abc.abstractmethod
    def run_context_chunk(
        self,
        q: torch.Tensor,  # [Tq, H, Dqk], bf16 or fp8 e4m3
        k: torch.Tensor,  # [Tk, H, Dqk], same dtype as q
        v: torch.Tensor,  # [Tk, H, Dv], same dtype as q
        cu_seqlens_q: torch.Tensor,  # int32 [B+1] on q.device, cu[0] = 0, cu[B] = Tq
        cu_seqlens_k: torch.Tensor,  # int32 [B+1] on q.device, cu[0] = 0, cu[B] = Tk
        max_q: int,
        max_k: int,
        scale: float,
        out: torch.Tensor | None = None,  # [Tq, H, Dv] bf16, may be a strided view
        causal: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(out [Tq, H, Dv] bf16, lse [H, Tq] float32, natural log)``.

        ``causal=True`` (bottom-right aligned, as for new tokens attending to themselves)
        is only used by tests and the client-side example; context chunks are
        non-causal.
        """

    def launch_order(self, q_lens: list[int], k_lens: list[int], heads: int, q_dtype: torch.dtype,
                     device: torch.device) -> tuple[tuple[int, ...], int] | None:
        """A host-built launch order for a chunk of segments of ``q_lens`` query rows over
        ``k_lens`` keys: ``(int32 codes, extra)``, which the engine builds once the chunk's
        other work is launched (so that it runs while the device works), copies to the
        device and hands back as ``run_context_chunk(..., launch_order=(codes on the
        device, extra))``. None (the default): no such argument."""
        return None

    def v_keys_last(self, q_dtype: torch.dtype) -> bool:
        """True when, for ``q_dtype``, ``run_context_chunk`` takes ``v_layout="hdt"``: V as
        ``[H, Dv, Tk]`` with the keys contiguous (a unit-stride view of a buffer whose row
        stride is a multiple of 16 bytes), which the engine then gives it (the pack writes
        it). False by default: V ``[Tk, H, Dv]`` and no ``v_layout`` argument."""
        return False

    def takes_k_rope(self, q_dtype: torch.dtype) -> bool:
        """True when, for ``q_dtype``, ``run_context_chunk`` takes the keys in their two MLA
        parts: ``k`` = k_nope ``[Tk, H, 128]`` and ``k_rope=`` ``[Tk, H, 64]`` (one row per key
        shared by every head: a head stride of 0), each with unit last stride — so that the
        engine's fused path reads them where ``kv_b_proj`` and the gather left them and packs
        no K (bf16 prefill). The result must be bit-identical to that over the packed
        ``k = [k_nope | k_rope]``. False by default: K packed, no ``k_rope`` argument."""
        return False

    def launches_per_call(self) -> int:
        """Kernel launches one ``run_context_chunk`` makes on a GPU (for the launch metric)."""
        return 1

    def warm_up(self, device: torch.device, heads: int, q_dtype: torch.dtype) -> None:
        """Build or compile, before the server is ready, the kernel variants that chunks
        of ``heads`` heads may need beyond those the engine's warm-up requests reach.
        Nothing by default."""


def bf16_on_hopper(device: torch.device, q_dtype: torch.dtype) -> bool:
    """The cuDNN backends' ``supports``: bf16 only (on Hopper cuDNN's fp8 SDPA builds only
    with an fp8 output, GPU-NOTES, so ``auto`` leaves fp8 prefill to Triton), on sm_90
    or later (d_qk 192 and ragged THD SDPA were measured there only); off CUDA, True, so
    that the selection logic is testable on the CPU."""
    device = torch.device(device)
    if q_dtype != torch.bfloat16:
        return False
    if device.type != "cuda" or not torch.cuda.is_available():
        return True
    return torch.cuda.get_device_capability(device) >= (9, 0)
