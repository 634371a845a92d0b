"""The Triton and Gluon kernels a request launches specialize only on what is fixed for a
server (its heads, its workspace's layout), never on what varies per request: Triton
compiles another variant for each integer that is 1 or a multiple of 16 and each pointer
that is 16-byte aligned or not, so a per-request value left specialized compiles on a
request's path (tests/gpu/test_warm_up_gpu.py catches that on a GPU). Here every runtime
parameter of each kernel is one or the other, by name — a name in ``do_not_specialize``
that matches no parameter is ignored by Triton, and a new parameter needs a decision."""

from __future__ import annotations

import inspect

import pytest

triton = pytest.importorskip("triton", reason="triton is not importable")

from ctxprefill.backends import gluon_attention as ga  # noqa: E402
from ctxprefill.backends import triton_attention as ta  # noqa: E402
from ctxprefill.ops import kv_b_proj_gluon as kg  # noqa: E402

# kernel: (integers that vary per request, pointers whose alignment does, everything else
# at run time: fixed for a server, or a tensor/descriptor the engine aligns)
ATTENTION_FIXED = {"Q", "K", "KR", "V", "O", "LSE", "qk_scale", "stride_qt", "stride_qh", "stride_kt", "stride_kh",
                   "stride_rt", "stride_rh", "stride_ot", "stride_oh"}
KERNELS = {
    "gluon attention": (lambda: ga._mla_attn_ws_fwd,
                        {"B", "stride_vt", "stride_vh", "stride_lh", "n_heads", "m_tiles", "n_tiles", "Tq", "Tk"},
                        {"cu_q", "cu_k", "cu_v", "ORDER"},
                        ATTENTION_FIXED | {"QN_D", "QR_D", "KN_D", "KR_D"}),
    "triton attention": (lambda: ta._mla_ctx_attn_fwd,
                         {"B", "stride_vt", "stride_vh", "stride_lh"},
                         {"cu_q", "cu_k", "cu_v"},
                         ATTENTION_FIXED),
    "gemm": (lambda: kg._kv_b_proj_ws, {"M"}, set(), {"A", "B", "Y", "N", "K", "stride_am", "stride_bn", "stride_ym"}),
    "paged gemm": (lambda: kg._kv_b_proj_paged_ws, {"M", "n_seqs", "stride_bt"}, {"BT", "CU", "ST"},
                   {"A", "KIN", "B", "Y", "KOUT", "N", "K", "num_slots", "block_size", "stride_slot", "stride_bn",
                    "stride_ym", "stride_ws"}),
}


def _flags(fn) -> tuple[set[str], set[str], set[str]]:
    """(runtime parameters, those not specialized, those not specialized on alignment) of a
    jitted kernel, or of its interpreted stand-in (Triton's CPU interpreter keeps the
    decorator's lists as given)."""
    if hasattr(fn, "params"):  # a JITFunction
        runtime = [p for p in fn.params if not p.is_constexpr]
        return ({p.name for p in runtime}, {p.name for p in runtime if p.do_not_specialize},
                {p.name for p in runtime if p.do_not_specialize_on_alignment})
    names = inspect.signature(fn.fn).parameters
    runtime = {n for n, p in names.items() if "constexpr" not in str(p.annotation)}
    return runtime, set(fn.kwargs.get("do_not_specialize") or ()), set(fn.kwargs.get("do_not_specialize_on_alignment")
                                                                       or ())


@pytest.mark.parametrize("name", list(KERNELS))
def test_per_request_values_are_not_specialized(name):
    get, ints, pointers, fixed = KERNELS[name]
    fn = get()
    if fn is None:
        pytest.skip(f"{name}: the kernel is not defined here (Triton or Gluon unavailable)")
    runtime, dns, dns_align = _flags(fn)
    assert dns == ints and dns <= runtime
    assert dns_align == pointers and dns_align <= runtime
    assert runtime == ints | pointers | fixed, "a runtime parameter needs a decision"
