"""The attention-backend contract: ragged, non-causal attention with a natural-log LSE.

A backend computes, for one chunk, the attention of the chunk's query rows over the
chunk's keys and values. Sequences are ragged and given by cumulative lengths; query
segment b attends to key segment b only. A segment with no keys yields ``out = 0`` and
``lse = -inf`` for its rows (CONTRACT §3).

What a backend can do is declared once, as a :class:`BackendCaps` (the class attribute
``caps``); whether it can run on a device, for a q dtype, is
:meth:`AttentionBackend.unavailable_reason`. The chunk loop (``engine/loop.py``) reads the
caps once per request and passes :meth:`AttentionBackend.run_context_chunk` only the
inputs they allow (``k_rope``, ``v_layout="hdt"``, ``launch_order``, ``captured``); every other argument
keeps its default. A backend refuses what its caps rule out
(:meth:`AttentionBackend.refuse_outside_caps`), whoever the caller.

The ``out`` contract (CONTRACT §5): a backend with ``caps.supports_out`` writes its result
into the ``out`` tensor it is given (same data pointer) and returns it; the chunk loop
checks the pointer and fails loudly if a backend claims it but did not.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence
from typing import Literal

import torch

#: fp8 e4m3 (unscaled), the fp8 prefill's q/k/v dtype
FP8 = torch.float8_e4m3fn

#: V's layout: "thd" ``[Tk, H, Dv]`` (token-major) or "hdt" ``[H, Dv, Tv]`` (keys last)
VLayout = Literal["thd", "hdt"]


@dataclasses.dataclass(frozen=True, slots=True)
class BackendCaps:
    """What a backend does, per q dtype where it differs.

    A consumer reads these facts; it never calls the backend to ask (the chunk loop reads
    them once per request, the registry before it builds an instance)."""

    #: q/k/v dtypes the backend computes with (the output is bf16 for all of them)
    q_dtypes: frozenset[torch.dtype]
    #: ``run_context_chunk(out=...)`` writes into the tensor it is given and returns it
    supports_out: bool = True
    #: q dtypes for which ``run_context_chunk`` reads the keys unpacked: ``k`` = k_nope
    #: ``[Tk, H, 128]`` and ``k_rope`` ``[Tk, H, 64]`` where they lie (no K pack), with the
    #: same bits as over the packed ``k = [k_nope | k_rope]``
    unpacked_keys: frozenset[torch.dtype] = frozenset()
    #: q dtypes for which ``run_context_chunk`` takes V keys-last (``v_layout="hdt"``)
    v_keys_last: frozenset[torch.dtype] = frozenset()
    #: kernel launches one call makes (the launch metric); 0: path-dependent, and the
    #: backend notes its own (``ops.launches.note``)
    launches_per_call: int = 1
    #: builds a launch order per chunk on the host (:meth:`AttentionBackend.launch_order`),
    #: which the chunk loop copies to the device and passes as ``launch_order=``
    launch_order: bool = False
    #: takes ``run_context_chunk(captured=True)`` for launches recorded into a CUDA graph
    #: (engine/graphs.py), where it may pick variants that cost the host more per launch
    #: (paid once, at capture) and the device less, with the same bits
    graph_variants: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class HostLaunchOrder:
    """A chunk's launch order as a backend builds it on the host (``launch_order``)."""

    codes: tuple[int, ...]  # one tile each, in launch order: (b * m_tiles + m) * heads + h (-1: none, padding)
    m_tiles: int  # query tiles per segment the codes count with
    persistent: bool = False  # laid out for a persistent launch's stride walk (else: start-time order)


@dataclasses.dataclass(frozen=True, slots=True)
class LaunchOrder:
    """A :class:`HostLaunchOrder` on the device, as ``run_context_chunk`` receives it."""

    codes: torch.Tensor  # int32 [programs] on q.device, contiguous
    m_tiles: int
    persistent: bool = False  # as HostLaunchOrder's


class AttentionBackend(abc.ABC):
    """One attention implementation. Stateless apart from caches of compiled kernels
    (and, for the cuDNN backends, built plans)."""

    #: registry name, e.g. "reference", "triton", "gluon"
    name: str = ""
    #: what it does (a subclass's class attribute; an instance built with options may
    #: narrow it in ``__init__``: the reference backend's ``honor_out``)
    caps: BackendCaps

    @classmethod
    def unavailable_reason(cls, device: torch.device, q_dtype: torch.dtype) -> str | None:
        """Why this backend cannot serve ``q_dtype`` on ``device``, or None when it can.
        The default checks the dtype only; backends add their device's requirements."""
        return dtype_reason(cls.caps, q_dtype)

    @abc.abstractmethod
    def run_context_chunk(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        max_q: int,
        max_k: int,
        scale: float,
        *,
        out: torch.Tensor | None = None,
        causal: bool = False,
        k_rope: torch.Tensor | None = None,
        v_layout: VLayout = "thd",
        cu_seqlens_v: torch.Tensor | None = None,
        launch_order: LaunchOrder | None = None,
        captured: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of one chunk: B segments, query segment b over key segment b.

        Parameters
        ----------
        q : torch.Tensor
            The query rows, shape ``[Tq, H, 192]`` (``[nope 128 | rope 64]``), dtype one of
            ``caps.q_dtypes`` (bf16 or fp8 e4m3), unit last stride; its row and head strides
            are free (a row slice of the request's q).
        k : torch.Tensor
            The keys, same dtype as q, unit last stride: packed, ``[Tk, H, 192]``
            (``[k_nope | k_rope]``); with ``k_rope`` given, k_nope alone, ``[Tk, H, 128]``
            (the ``kv_b_proj`` output's first half: a row stride of ``H * 256``).
        v : torch.Tensor
            The values, same dtype as q, unit last stride. ``v_layout="thd"``: ``[Tk, H, 128]``
            (the ``kv_b_proj`` output's second half, or the fp8 pack's V). ``"hdt"``:
            ``[H, 128, Tv]``, keys contiguous, segment b's keys from column
            ``cu_seqlens_v[b]`` (the fp8 pack's keys-last V; ``ops.pack.KeysLast``).
        cu_seqlens_q : torch.Tensor
            int32 ``[B+1]`` on q's device, contiguous, non-decreasing, ``[0] = 0``,
            ``[B] = Tq``: segment b's query rows are ``cu_seqlens_q[b] .. cu_seqlens_q[b+1]``.
        cu_seqlens_k : torch.Tensor
            int32 ``[B+1]``, the same for the keys, ``[B] = Tk``. Never read on the host.
        max_q : int
            The longest query segment (host int; grids are sized from it, no sync).
        max_k : int
            The longest key segment (host int).
        scale : float
            Softmax scale, multiplying q·k (natural units).
        out : torch.Tensor, optional
            bf16 ``[Tq, H, 128]``, unit last stride, other strides free (a row slice of
            the request's output). Written in place where ``caps.supports_out``.
        causal : bool
            Bottom-right aligned causal mask (row t of a segment of n queries over m keys
            sees keys ``j <= t + m - n``). Tests and the client example only: context
            chunks are non-causal.
        k_rope : torch.Tensor, optional
            The keys' rope part, ``[Tk, H, 64]``, q's dtype, unit last stride; its head
            stride may be 0 (MLA's rope key is one row per key shared by every head: the
            workspace's k_pe columns). Given only where ``q.dtype in caps.unpacked_keys``.
        v_layout : {"thd", "hdt"}
            V's layout (above); "hdt" only where ``q.dtype in caps.v_keys_last``.
        cu_seqlens_v : torch.Tensor, optional
            int32 ``[B+1]``, "hdt" only: the column of v where each segment's keys start,
            each a multiple of 16 elements, as is v's row stride (16-byte aligned fp8 rows).
        launch_order : LaunchOrder, optional
            This chunk's :meth:`launch_order` on the device; only where ``caps.launch_order``.
            It changes the order in which tiles run, never a result bit.
        captured : bool
            The launch is being recorded into a CUDA graph; only where
            ``caps.graph_variants``. It may change the kernel variant, never a result bit.

        Returns
        -------
        out : torch.Tensor
            bf16 ``[Tq, H, 128]`` (the given ``out`` where ``caps.supports_out``).
        lse : torch.Tensor
            float32 ``[H, Tq]``, the natural-log sum of exp of the scaled scores per row;
            ``-inf`` (and out 0) for a row that sees no key.
        """

    def launch_order(self, q_lens: Sequence[int], k_lens: Sequence[int], heads: int, q_dtype: torch.dtype,
                     device: torch.device) -> HostLaunchOrder | None:
        """The launch order for a chunk of segments of ``q_lens`` query rows over ``k_lens``
        keys (host lists), or None where the kernel's own order serves. Asked only of a
        backend with ``caps.launch_order``, after the chunk's other work is launched (so
        that it runs while the device works)."""
        return None

    def refuse_outside_caps(self, q_dtype: torch.dtype, k_rope: torch.Tensor | None, v_layout: VLayout,
                            cu_seqlens_v: torch.Tensor | None, launch_order: LaunchOrder | None,
                            captured: bool = False) -> None:
        """ValueError naming the input of :meth:`run_context_chunk` that ``caps`` rule out for
        ``q_dtype``: a caller outside the chunk loop (which passes only what they allow) is
        refused, not ignored. Each backend's ``run_context_chunk`` calls it first."""
        caps = self.caps
        if k_rope is not None and q_dtype not in caps.unpacked_keys:
            raise ValueError(f"the {self.name} backend takes packed keys for {q_dtype} (k_rope given; "
                             f"caps.unpacked_keys)")
        if (v_layout != "thd" or cu_seqlens_v is not None) and q_dtype not in caps.v_keys_last:
            raise ValueError(f"the {self.name} backend takes V [Tk, H, 128] for {q_dtype} (v_layout {v_layout!r}"
                             f"{', cu_seqlens_v' if cu_seqlens_v is not None else ''} given; caps.v_keys_last)")
        if launch_order is not None and not caps.launch_order:
            raise ValueError(f"the {self.name} backend takes no launch order (its caps.launch_order is False)")
        if captured and not caps.graph_variants:
            raise ValueError(f"the {self.name} backend has no variants for CUDA graphs (captured=True given; "
                             f"caps.graph_variants)")

    def warm_up(self, device: torch.device, heads: int, q_dtype: torch.dtype, captured: bool = False) -> None:
        """Build or compile, before the server is ready, the kernel variants that chunks
        of ``heads`` heads may need beyond those the engine's warm-up requests reach;
        ``captured``: also those of launches recorded into CUDA graphs
        (``caps.graph_variants``). Nothing by default."""
        return None


def dtype_reason(caps: BackendCaps, q_dtype: torch.dtype) -> str | None:
    """Why ``caps`` rule ``q_dtype`` out, or None."""
    if q_dtype in caps.q_dtypes:
        return None
    names = ", ".join(sorted(str(d).removeprefix("torch.") for d in caps.q_dtypes))
    return f"dtype not supported: {str(q_dtype).removeprefix('torch.')} (computes with {names})"


def cuda_reason(name: str, device: torch.device) -> str | None:
    """Why ``device`` is not a usable CUDA device for backend ``name``, or None."""
    if device.type != "cuda":
        return f"{name} backend needs a CUDA device, got {device}"
    if not torch.cuda.is_available():
        return "torch.cuda.is_available() is False"
    return None


def hopper_reason(device: torch.device) -> str | None:
    """The cuDNN backends' device requirement: sm_90 or later (d_qk 192 and ragged THD SDPA
    were measured there only), or None where it is met."""
    cap = torch.cuda.get_device_capability(device)
    if cap < (9, 0):
        return f"needs sm_90 or later (Hopper), {device} is sm_{cap[0]}{cap[1]}"
    return None
