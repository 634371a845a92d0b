"""cuDNN dense attention for single-segment bf16 chunks; a kernel backend for everything else.

The common production chunk is one long sequence (B = 1). For it, torch's dense cuDNN
SDPA (``aten._scaled_dot_product_cudnn_attention``; d_qk 192 / d_v 128, natural-log
LSE ``[B, H, S, 1]``) measured 594–632 useful TFLOP/s on the H200 against 510–545 for
our Triton kernel. It has no ragged form that is fast (torch's varlen entry point
costs ~45 ms per call, measured on the H200), so only a chunk that is exactly one segment goes
to cuDNN; ragged batches, causal calls and empty segments go to an internal kernel
backend: ``gluon`` where it is available (Hopper), else ``triton``. bf16 only (cuDNN's
fp8 SDPA needs an fp8 output on Hopper).

The choice is made from shapes only, never from device values (no host sync):
``cu_seqlens_q`` and ``cu_seqlens_k`` of two entries (one segment; by the interface
``cu[1] = T``), ``max_q == Tq > 0``, ``max_k == Tk > 0``, non-causal, bf16.

cuDNN is called on views ``[1, H, S, D]`` of the packed ``[S, H, D]`` tensors (no
copy; cuDNN takes the strides, including v's row stride of 256 inside the
``kv_b_proj`` output). torch allocates the output "with the layout of q", i.e. as
``[S, H, 128]`` in memory, so without an ``out`` it is returned as a view; with an
``out`` (the engine's ``out[token_slice]``) it is copied there: one more launch, a
device-to-device copy of Tq·H·128 bf16 (under 1 % of the attention time at the
shapes measured on the H200). The LSE ``[1, H, Tq, 1]`` is returned as an ``[H, Tq]`` view.

Launches: the number depends on the path, so ``caps.launches_per_call`` is 0 (what
the engine notes for the call) and :meth:`run_context_chunk` notes the real count
itself (``ops.launches.note``; the engine calls it inside its "attention" stage).

cuDNN builds (and torch caches, per thread) one execution plan per shape
(Tq, Tk, H, strides): the first call of a new shape pays the build. If cuDNN refuses
a shape (raises), the call falls back to Triton, the shape is remembered, and after
``_MAX_REFUSED`` distinct refusals the cuDNN path is switched off for this instance;
both are logged once. Past ``_MAX_SHAPES`` distinct shapes, new shapes go to Triton
(torch never evicts a plan). Which path a shape takes can thus depend on the history
of the process; the two differ by rounding only.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import torch

from ..ops import launches
from .base import AttentionBackend, BackendCaps, LaunchOrder, VLayout, cuda_reason, dtype_reason, hopper_reason

log = logging.getLogger("ctxprefill.backends")

D_QK, D_V = 192, 128
_OP_NAME = "_scaled_dot_product_cudnn_attention"

#: Device kernels one dense cuDNN SDPA call launches (memsets and host copies not
#: counted, as everywhere in the launch metric). Assumed 1 (the fused SDPA kernel);
#: ``tests/test_backend_cudnn.py::test_gpu_launches_match_profiler`` measures it on
#: the GPU and prints the kernel names if it differs.
CUDNN_KERNELS = 1

#: Tensors whose element extent reaches 2**31 go to Triton (int64 offsets, tested);
#: cuDNN's behaviour there is unmeasured. Lift after a GPU test past 2**31.
_MAX_EXTENT = 2**31 - 1

#: distinct refused shapes after which the cuDNN path is switched off
_MAX_REFUSED = 8

#: distinct shapes sent to cuDNN, after which new shapes go to Triton: torch keeps
#: every built plan (per thread, no eviction), so this bounds what we add to it
_MAX_SHAPES = 4096


def _cudnn_op() -> Any:
    """The aten op, or None where this torch build does not have it."""
    try:
        return getattr(torch.ops.aten, _OP_NAME)
    except Exception:  # noqa: BLE001  AttributeError / RuntimeError depending on the torch version
        return None


def _extent(t: torch.Tensor) -> int:
    """Elements spanned from the tensor's first to its last element, plus one."""
    if t.numel() == 0:
        return 0
    return 1 + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride(), strict=True))


class _Refused(RuntimeError):
    """cuDNN returned something that breaks our contract (shape, dtype)."""


class CudnnDenseBackend(AttentionBackend):
    """Dense cuDNN SDPA for one-segment bf16 chunks; gluon or triton for the rest."""

    name = "cudnn"
    # bf16 only: on Hopper cuDNN's fp8 SDPA builds only with an fp8 output, so
    # fp8 prefill is left to the kernel backends. Launches: path-dependent, noted by the call.
    caps = BackendCaps(q_dtypes=frozenset({torch.bfloat16}), supports_out=True, launches_per_call=0)

    #: devices whose tensors may take the cuDNN path (meta: the CPU tests of the plumbing)
    _DENSE_DEVICES = ("cuda", "meta")

    def __init__(self) -> None:
        self._kernel: AttentionBackend | None = None  # the backend of the chunks cuDNN does not take
        #: "cudnn" or "triton" (a kernel backend): the path the last call took (tests read it)
        self.last_path = ""
        #: calls per path
        self.paths: Counter[str] = Counter()
        #: why the cuDNN path is off for this instance ("" while it is on)
        self.disabled_reason = ""
        self._refused: set[tuple[Any, ...]] = set()
        self._shapes: set[tuple[Any, ...]] = set()  # shapes cuDNN has run (one cached plan each)

    # -- selection ----------------------------------------------------------------------
    @classmethod
    def unavailable_reason(cls, device: torch.device, q_dtype: torch.dtype) -> str | None:
        device = torch.device(device)
        why = dtype_reason(cls.caps, q_dtype) or cuda_reason(cls.name, device) or hopper_reason(device)
        if why:
            return why
        if _cudnn_op() is None:
            return f"this torch ({torch.__version__}) has no aten.{_OP_NAME}"
        if not torch.backends.cudnn.is_available():  # type: ignore[no-untyped-call]  # (unannotated in torch)
            return "cuDNN is not available in this torch build (torch.backends.cudnn.is_available() is False)"
        if not torch.backends.cudnn.enabled:
            return "cuDNN is disabled (torch.backends.cudnn.enabled is False)"
        try:  # ragged / causal chunks are delegated: a kernel backend must work here too
            from .triton_attention import TritonAttentionBackend
        except Exception as e:  # noqa: BLE001
            return f"cudnn backend delegates ragged chunks to triton, which does not import: {e!r}"
        why = TritonAttentionBackend.unavailable_reason(device, q_dtype)
        if why:
            return f"cudnn backend delegates ragged chunks to triton, which is unavailable: {why}"
        return None

    def warm_up(self, device: torch.device, heads: int, q_dtype: torch.dtype, captured: bool = False) -> None:
        # ragged and causal chunks go to a kernel backend: its variants, not cuDNN plans
        # (those are per length pair and cannot be built ahead); never captured ones (caps)
        self._delegate(torch.device(device), q_dtype).warm_up(device, heads, q_dtype)

    # -- the call -------------------------------------------------------------------------
    def _delegate(self, device: torch.device, q_dtype: torch.dtype) -> AttentionBackend:
        """The kernel backend of the chunks cuDNN does not take: ``gluon`` where it serves
        this device and dtype, else ``triton`` (built once, for the first call's)."""
        if self._kernel is None:
            from .triton_attention import GluonAttentionBackend, TritonAttentionBackend

            gluon = device.type == "cuda" and GluonAttentionBackend.unavailable_reason(device, q_dtype) is None
            self._kernel = GluonAttentionBackend() if gluon else TritonAttentionBackend()
        return self._kernel

    def _dense_blocker(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                       cu_seqlens_k: torch.Tensor, max_q: int, max_k: int, out: torch.Tensor | None,
                       causal: bool) -> str:
        """Why this call cannot take the dense cuDNN path ("" when it can). Shapes only."""
        if self.disabled_reason:
            return "cuDNN path disabled"
        if causal:
            return "causal"
        if q.device.type not in self._DENSE_DEVICES:
            return f"device {q.device}"
        if q.dtype != torch.bfloat16 or k.dtype != q.dtype or v.dtype != q.dtype:
            return f"dtype {q.dtype}"
        if cu_seqlens_q.numel() != 2 or cu_seqlens_k.numel() != 2:
            return "not one segment"
        if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
            return "rank"
        Tq, H, Tk = q.shape[0], q.shape[1], k.shape[0]
        if Tq == 0 or Tk == 0 or H == 0:
            return "empty"
        if int(max_q) != Tq or int(max_k) != Tk:
            return "max_q/max_k do not match the lengths"
        if q.shape[2] != D_QK or tuple(k.shape) != (Tk, H, D_QK) or tuple(v.shape) != (Tk, H, D_V):
            return "shapes"
        if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
            return "last stride"
        if out is not None and (tuple(out.shape) != (Tq, H, D_V) or out.dtype != torch.bfloat16
                                or out.stride(-1) != 1 or out.device != q.device):
            return "out"  # Triton raises the proper error
        if max(_extent(q), _extent(k), _extent(v)) > _MAX_EXTENT:
            return "over 2**31 elements"
        key = self._key(q, k, v)
        if key in self._refused:
            return "shape refused before"
        if key not in self._shapes and len(self._shapes) >= _MAX_SHAPES:
            return f"over {_MAX_SHAPES} shapes"
        return ""

    @staticmethod
    def _key(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[Any, ...]:
        return (q.shape[0], k.shape[0], q.shape[1], q.stride(), k.stride(), v.stride())

    def _run_dense(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                   out: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(out, lse [H, Tq], launches) from one dense cuDNN call with B = 1."""
        Tq, H = q.shape[0], q.shape[1]
        # the exact call of bench/bench_attention.py, on [1, H, S, D] views (no copy)
        res = _cudnn_op()(q.unsqueeze(0).transpose(1, 2), k.unsqueeze(0).transpose(1, 2),
                          v.unsqueeze(0).transpose(1, 2), None, True, 0.0, False, False, scale=float(scale))
        o4, l_raw = res[0], res[1]
        n = CUDNN_KERNELS
        if tuple(o4.shape) != (1, H, Tq, D_V) or o4.dtype != torch.bfloat16:
            raise _Refused(f"cuDNN output {o4.dtype} {tuple(o4.shape)}, expected bf16 (1, {H}, {Tq}, {D_V})")
        # natural log, float32 (the GPU test compares it with a float64 reference)
        if l_raw.dtype != torch.float32 or tuple(l_raw.shape) not in ((1, H, Tq, 1), (1, H, Tq)):
            raise _Refused(f"cuDNN LSE {l_raw.dtype} {tuple(l_raw.shape)}, expected float32 (1, {H}, {Tq}, 1)")
        lse = l_raw[0]
        if lse.dim() == 3:
            lse = lse[..., 0]  # [H, Tq], a view
        if not lse.is_contiguous():
            lse = lse.contiguous()
            n += 1
        o = o4[0].transpose(0, 1)  # [Tq, H, 128]; contiguous when allocated with q's layout
        if out is not None:
            out.copy_(o)
            n += 1
            o = out
        elif not o.is_contiguous():
            o = o.contiguous()
            n += 1
        return o, lse, n

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
        self.refuse_outside_caps(q.dtype, k_rope, v_layout, cu_seqlens_v, launch_order, captured)
        if not self._dense_blocker(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, out, causal):
            try:
                o, lse, n = self._run_dense(q, k, v, scale, out)
            except torch.OutOfMemoryError:
                raise
            except Exception as e:  # cuDNN refused this shape (no plan, unsupported): use Triton
                if q.device.type == "meta":
                    raise
                if isinstance(e, _Refused):
                    launches.note(CUDNN_KERNELS)  # it ran; its result was not usable
                self._refuse(q, k, v, e)
            else:
                launches.note(n)
                self._shapes.add(self._key(q, k, v))
                self.last_path = "cudnn"
                self.paths["cudnn"] += 1
                return o, lse
        tri = self._delegate(q.device, q.dtype)
        launches.note(tri.caps.launches_per_call)
        self.last_path = "triton"
        self.paths["triton"] += 1
        return tri.run_context_chunk(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, scale, out=out,
                                     causal=causal)

    def _refuse(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, e: Exception) -> None:
        key = self._key(q, k, v)
        self._refused.add(key)
        msg = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        if isinstance(e, _Refused) or len(self._refused) >= _MAX_REFUSED:
            self.disabled_reason = f"cuDNN path off after {len(self._refused)} refused shape(s); last: {msg}"
            log.warning("attention backend cudnn: %s; using triton from now on", self.disabled_reason)
        else:
            log.warning("attention backend cudnn: cuDNN refused Tq=%d Tk=%d H=%d (%s); triton runs this shape",
                        key[0], key[1], key[2], msg)
