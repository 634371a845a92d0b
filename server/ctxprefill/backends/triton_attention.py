"""Triton flash-attention backend: ragged, non-causal (or bottom-right causal) MLA
context attention with a natural-log LSE, one launch per call (CONTRACT §3, §5).

Shapes are fixed by the model: q/k ``[T, H, 192]`` = ``[nope 128 | rope 64]``,
v ``[T, H, 128]`` (never padded to 192). 192 is not a power of two, so the q·k
product is two ``tl.dot``s (128 wide + 64 wide) into one fp32 accumulator.

Grid ``(cdiv(max_q, BLOCK_M), H, B)``: program (m, h, r) computes query rows
``m*BLOCK_M ..`` of head h of the segment b of rank r, reading the segment bounds
from the int32 cumulative lengths on the device (no host sync); programs past the end
of their segment exit at once. A program's time is proportional to its segment's key
length, and the hardware starts programs in grid order, so with 2..64 segments the
rank orders them by key length, longest first (LPT scheduling): a ragged batch then
ends with short programs instead of one long straggler. Measured on the H200, a
4-sequence ragged batch of H=16 ran 21 % below an equal-length batch of the same work
before this ordering, 6 % (bf16) and 8 % (fp8) below after it. The warp-specialized kernel
can instead take a launch order built on the host (``tile_order``: tiles packed per SM,
where that beats longest first; the engine builds it per chunk): 2-7 % below on that batch
(docs/DESIGN.md). Online softmax in fp32 with exp2 (log2(e) folded into the
scale); the returned LSE is converted back to natural log. A row that sees no key
(k_len 0, or a causal row with nothing visible) gives out = 0 and lse = -inf.

Key blocks that every row of the tile sees entirely are processed without masks;
only the trailing partial block (and, causal, the diagonal band) runs the masked
step. Loads go either through device-side TMA tensor descriptors built per
(segment, head) — their bounds are the segment's, so reads past its end give zeros
(``USE_TMA``, default) — or through plain pointers with masks. Offsets that can
exceed 2**31 (segment start × row stride) are built in int64 on the base pointer;
per-block pointers then advance by ``BLOCK_N * stride``.

fp8 (e4m3fn q/k/v, unscaled, bf16 out). q·k is an fp8 ``tl.dot`` (wgmma on sm_90;
e4m3 products are exact in fp32, Hopper's fp8 accumulation is of reduced
precision, Triton's default). For P·V two modes, per config key ``PV_FP8``:

* ``PV_FP8=False`` (default): V is widened to bf16 in registers (exact: e4m3 ⊂
  bf16) and P rounded to bf16 (relative 2**-9 per element), bf16 wgmma. Error
  against a float64 computation from the dequantized fp8 inputs is bf16-level:
  we assert ‖out−ref‖/‖ref‖ ≤ 1e-2, |Δlse| ≤ 1e-2 (measured ~2e-3).
* ``PV_FP8=True`` (FA3 style): P is quantized to e4m3 and multiplied with the fp8
  V tile directly. P ∈ [0, 1] is scaled by 2**8 before the cast (exact power of
  two, undone in the row sum, which is accumulated from the same scaled fp32 P) so
  that small probabilities stay in e4m3's normal range instead of flushing below
  2**-9. Each P element then carries a relative rounding error ≤ 2**-4 (3 mantissa
  bits); for values of random sign these errors do not cancel against the output
  (which itself averages out), so ‖out−ref‖/‖ref‖ ≈ 2.5e-2 typical on random data;
  the bound asserted by the tests is 5e-2 (LSE is unaffected: computed from fp32 P).
  Hopper's fp8 wgmma wants its B operand K-major in shared memory while v has the
  head dim contiguous: Triton 3.6 transposes the V tile through registers (byte
  permutes + shared stores; seen in the PTX) and keeps fp8 wgmma for P·V — slower
  than P·V in bf16 (274-354 vs 466-608 TFLOP/s on the H200). With V keys-last
  (``v_layout="hdt"``) no transpose is needed and P·V in fp8 wins (639-792): that is
  the default for keys-last fp8 (``KEYS_LAST_FP8``), the layout the engine's fp8 pack
  writes for this backend.

On Hopper (sm_90), with the config key ``WS`` set (the default configs), non-causal bf16
chunks and keys-last fp8 chunks whose inputs can go through TMA run a warp-specialized
kernel instead (``gluon_attention``: a TMA loader warp and two consumer warpgroups sharing
K/V), same contract, 5-28 % faster on the H200 (docs/DESIGN.md); everything else runs the
kernel below. ``mla_context_attention`` validates the inputs once for both kernels.

Two registered backends front it (``registry``): ``"triton"`` (:class:`TritonAttentionBackend`)
runs the kernel below on every chunk (``WS`` off), on any GPU from sm_80; ``"gluon"``
(:class:`GluonAttentionBackend`, Hopper only) runs the warp-specialized kernel on the chunks
it takes, in a launch order packed per SM on the host (``tile_order``), and this kernel on
the rest.

The kernel is also callable on CPU tensors under Triton's interpreter
(``TRITON_INTERPRET=1`` set before this module is imported), which is how the
CPU tests run it.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
from collections.abc import Sequence
from typing import Any, ClassVar, no_type_check

import torch

from ..ops._gluon import tma_scratch
from ..ops.pack import key_buffer
from . import gluon_attention as _ws
from . import tile_order as _tile_order
from ._triton import TRITON_ERR as _TRITON_ERR
from ._triton import tl, triton
from .base import (
    AttentionBackend,
    BackendCaps,
    HostLaunchOrder,
    LaunchOrder,
    VLayout,
    cuda_reason,
    dtype_reason,
)

D_NOPE, D_ROPE, D_V = 128, 64, 128
D_QK = D_NOPE + D_ROPE
_FP8 = torch.float8_e4m3fn
_LOG2E = 1.4426950408889634
_P_SHIFT = 8.0  # P·V in fp8: P scaled by 2**8 (≤ 256 < 448) before the e4m3 cast

#: Launch configuration per input dtype; starting points for an H200, to be tuned from
#: ``bench/bench_attention.py --sweep``. Smem: Q tile once + per stage a K tile
#: BLOCK_N×192 and a V tile BLOCK_N×128. Cross-compiled for sm_90 with Triton 3.6 (the
#: wheel's ptxas, no GPU needed), every config of the sweep gives wgmma only, no spills;
#: bf16 128/64/8 warps/3 stages: 146 regs with TMA (184 with pointer loads), 169 KiB;
#: fp8 same tiles, P·V in bf16: 174 regs, 93 KiB — capped at 128 registers (maxnreg; no
#: spill) two such programs fit on an SM (2 x 256 threads x 128 registers = the whole
#: file, 2 x 93 KiB of smem), and one's softmax overlaps the other's MMAs: measured on
#: the H200, 480-496 -> 570-617 TFLOP/s. bf16 cannot do the same: its 48 KiB q tile and
#: K/V stages need 169 KiB, and the tiles that fit twice (BLOCK_N=32) lose more than
#: the overlap gains (483 vs 535 TFLOP/s, bench_attention.py --sweep).
#:
#: ``WS`` (a dict, or True for ``gluon_attention.CONFIG``): on Hopper, non-causal chunks run
#: the warp-specialized Gluon kernel instead (``gluon_attention``: a TMA loader warp, two
#: consumer warpgroups sharing each K/V tile). Measured on the H200 (2026-12-01,
#: ``bench_attention.py --sweep ws``): bf16 568-635 TFLOP/s against this kernel's 441-554.
#: Since K slots are freed right after the scores (``EARLY_K``), FA3's
#: intra-warpgroup pipelining (PIPE) pays: 591-654 against 565-634 serial, 555-600 with K
#: freed together with V (one process, ``s7-ws-sweep``). ``PV_WAIT_LATE`` keeps P·V's wait
#: after the softmax in the machine code, where ptxas would otherwise put it before:
#: 1.00-1.04 of without over 6 shapes, median of 5 interleaved rounds each (H200, 2026-12-04,
#: ``bench_attention.py --ab ws-wait``, bench/results/attention_ab_ws-wait.json).
#: ``ARRIVE_NOSYNC`` releases a K or V slot without the warpgroup barrier before it: the
#: same bits, 1.002-1.014 of without over 6 shapes and both dtypes (H200, 2026-12-07,
#: commit 7670d01, bench/results/attention_ab_ws-arrive-nosync.json). ``LAZY_RESCALE`` skips
#: O's rescale while no row's max grew past 2**8: 0.994-1.038 of without over 6 shapes, 5
#: of 6 medians above 1, medians of 21 interleaved rounds (H100, 2026-12-07, commit 7119e53,
#: attention_ab_ws-lazy-rescale.json). ``PERSIST`` with ``PINGPONG`` (persistent programs whose
#: consumers take turns at the tensor cores, decided per launch: ``persistent_launch``): 1.056-1.074
#: of a program per tile over 4k keys, 1.007-1.064 over 16k where it persists, the same bits (H100, 2026-12-07,
#: commit 637e1eb, attention_ab_ws-persist-launch.json). Causal chunks and pointer-path inputs keep the kernel below.
CONFIGS: dict[torch.dtype, dict[str, Any]] = {
    torch.bfloat16: dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3, USE_TMA=True,
                         WS=dict(PIPE=True, BLOCK_N=128, STAGES=2, PV_WAIT_LATE=True, ARRIVE_NOSYNC=True,
                                 LAZY_RESCALE=True, PINGPONG=True, PERSIST=True)),
    _FP8: dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3, PV_FP8=False, USE_TMA=True, maxnreg=128),
}

#: fp8 with V keys-last (``v_layout="hdt"``, what the engine's fp8 pack writes): P·V in fp8
#: too, FA3's way — measured on the H200 (2026-12-01, bench_attention.py, segments on
#: 16-byte boundaries), 639-792 TFLOP/s against 466-608 for P·V in bf16 over V [Tk, H, 128]
#: (the default above), whose fp8 P·V must transpose every V tile (274-354). Error
#: bound: PV_FP8 above (5e-2 relative).
#: On Hopper the warp-specialized kernel runs it (P through shared memory, 3 stages):
#: 791-912 TFLOP/s against 638-822 (``bench_attention.py --sweep ws``); with K freed
#: early 802-879 against 757-824 in one process (``s7-ws-sweep``); a 4th stage gains nothing
#: (802-875). Pipelined, it pays only with P·V's wait kept after the softmax
#: (``PV_WAIT_LATE``) and the consumers taking turns at the tensor cores (``PINGPONG``):
#: 1.00-1.03 of serial over 6 shapes (``--ab ws-wait``, as above); with the late wait alone
#: 0.90-0.93. Serial over 256-key blocks in 2 stages (216 KiB of shared memory) beats that
#: by 1.06-1.10 over the same 6 shapes, medians of 5 interleaved rounds each (``--ab
#: ws-fp8-wide``, H200, 2026-12-04, commit f3b7d6f, attention_ab_ws-fp8-wide.json); with
#: turns 1.02-1.08. Pipelined over 256-key blocks (P staged in shared memory before the next
#: Q·Kᵀ, which keeps it within 240 registers) with the late wait and turns runs level with
#: serial. Serial with turns and P·V's operand in registers (``P_REGS``: no P through shared
#: memory) beats that pipelined kernel by 1.05-1.06 over the same 6 shapes (``--ab ws-fp8-regs``,
#: H200, 2026-12-05, commit 5d6bb38, attention_ab_ws-fp8-regs.json): the default. Where a
#: caller's K lacks the rows past its end P_REGS reads, ``ws_config`` stages P instead
#: (and keeps the barrier before a slot's release, which then orders P's stores). Persistent
#: programs (``PERSIST``): 1.046-1.052 over 4k keys, 1.030 on a ragged batch, 0.994-1.007
#: over 16k keys (attention_ab_ws-persist-launch.json, as above).
KEYS_LAST_FP8: dict[str, Any] = dict(PV_FP8=True, WS=dict(PIPE=False, BLOCK_N=256, STAGES=2, PINGPONG=True,
                                                          P_REGS=True, ARRIVE_NOSYNC=True, PERSIST=True))
#: over the warp-specialized kernel's settings, for launches recorded into a CUDA graph
#: (``captured``), where what the host spends on a launch is paid once: q's and K's TMA
#: descriptors made by the launch (``HOST_DESC``) instead of by every program
CAPTURED_WS: dict[str, Any] = dict(HOST_DESC=True)
#: the same for every other (eager) launch, where the host pays for it each time: none
#: (``ctxprefill bench --eager-variants-ab`` measures ``HOST_DESC`` there as whole requests)
EAGER_WS: dict[str, Any] = {}

if triton is not None:
    # globals read inside @triton.jit code must be constexpr
    _C_NOPE = tl.constexpr(D_NOPE)
    _C_ROPE = tl.constexpr(D_ROPE)
    _C_V = tl.constexpr(D_V)
    _C_SHIFT = tl.constexpr(_P_SHIFT)

    @triton.jit
    @no_type_check  # device code: Triton's compiler types it, not mypy
    def _mm(x, UPCAST: tl.constexpr):
        # Triton's CPU interpreter multiplies bf16 as raw uint16 bits; it gets fp32
        # operands instead (values already rounded to the operand dtype, so the numerics
        # are those of the GPU path). UPCAST is False for compiled kernels.
        if UPCAST:
            return x.to(tl.float32)
        return x

    @triton.jit
    @no_type_check
    def _rnd(x, dtype: tl.constexpr, DROP: tl.constexpr, UPCAST: tl.constexpr):
        """fp32 x rounded to nearest even in ``dtype``. Compiled: the hardware cast.
        Interpreted: the interpreter's own casts truncate (and its RTNE mis-carries), so
        drop DROP of fp32's 23 mantissa bits with integer rounding (16 → bf16, 20 → e4m3's
        3) and stay fp32; x is finite and, for e4m3, within its normal range (P·2**8)."""
        if UPCAST:
            b = x.to(tl.uint32, bitcast=True)
            half = (1 << (DROP - 1)) - 1
            b = b + half + ((b >> DROP) & 1)
            b = (b >> DROP) << DROP
            return b.to(tl.float32, bitcast=True)
        return x.to(dtype)

    @triton.jit
    @no_type_check
    def _load_kv(kn_src, kr_src, v_src, k_ptr, kr_ptr, v_ptr, start_n, k_len, stride_kt, stride_rt, stride_vt,
                 BLOCK_N: tl.constexpr, MASK: tl.constexpr, USE_TMA: tl.constexpr, V_T: tl.constexpr):
        """K (nope from ``k_ptr``, rope from ``kr_ptr``) and V tiles of keys start_n ..
        start_n+BLOCK_N of the segment.
        TMA: per-segment descriptors zero-fill past k_len, so no masks are needed.
        V_T: V is stored keys-last ([H, 128, Tv]); its tile is [128, BLOCK_N]: through the
        segment's descriptor (zero-filled past k_len), or pointers (``v_ptr`` at key
        ``start_n``, ``stride_vt`` between its 128 rows)."""
        if V_T:
            if USE_TMA:
                v = v_src.load([0, start_n])
            else:
                n = tl.arange(0, BLOCK_N)
                e = tl.arange(0, _C_V)
                vp = v_ptr + e[:, None] * stride_vt + n[None, :]
                if MASK:
                    v = tl.load(vp, mask=((start_n + n) < k_len)[None, :], other=0.0)
                else:
                    v = tl.load(vp)
        if USE_TMA:
            k_nope = kn_src.load([start_n, 0])
            k_rope = kr_src.load([start_n, 0])
            if not V_T:
                v = v_src.load([start_n, 0])
        else:
            n = tl.arange(0, BLOCK_N)
            d = tl.arange(0, _C_NOPE)
            r = tl.arange(0, _C_ROPE)
            kn_ptr = k_ptr + n[:, None] * stride_kt + d[None, :]
            kr_p = kr_ptr + n[:, None] * stride_rt + r[None, :]
            if MASK:
                ok = (start_n + n) < k_len
                k_nope = tl.load(kn_ptr, mask=ok[:, None], other=0.0)
                k_rope = tl.load(kr_p, mask=ok[:, None], other=0.0)
                if not V_T:
                    v = tl.load(v_ptr + n[:, None] * stride_vt + d[None, :], mask=ok[:, None], other=0.0)
            else:
                k_nope = tl.load(kn_ptr)
                k_rope = tl.load(kr_p)
                if not V_T:
                    v = tl.load(v_ptr + n[:, None] * stride_vt + d[None, :])
        return k_nope, k_rope, v

    @triton.jit
    @no_type_check
    def _attn_step(acc, l_i, m_i, q_nope, q_pe, k_nope, k_rope, v, offs_n, rows_vis, k_len, qk_scale,
                   MASK: tl.constexpr, CAUSAL: tl.constexpr,
                   IS_FP8: tl.constexpr, PV_FP8: tl.constexpr, UPCAST: tl.constexpr, V_T: tl.constexpr):
        """One key block: s = q·kᵀ (128 + 64 wide), online-softmax update, acc += P·V
        (``v``: [BLOCK_N, 128], or with V_T its transpose [128, BLOCK_N]).

        ``offs_n``: key indices of this block within the segment.
        ``rows_vis``: per query row, the last visible key index (causal only).
        """
        s = tl.dot(_mm(q_nope, UPCAST), _mm(tl.trans(k_nope), UPCAST))
        s = tl.dot(_mm(q_pe, UPCAST), _mm(tl.trans(k_rope), UPCAST), s)
        s = s * qk_scale  # log2 units
        if MASK:
            ok = (offs_n < k_len)[None, :]
            if CAUSAL:
                ok = ok & (offs_n[None, :] <= rows_vis[:, None])
            s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if MASK:  # a row with nothing visible so far keeps m = -inf; avoid -inf - -inf
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_use = m_new
        alpha = tl.math.exp2(m_i - m_use)
        if PV_FP8:
            m_use = m_use - _C_SHIFT  # p ∈ [0, 2**8]; row sum scaled alike, undone in lse
        p = tl.math.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if V_T:  # keys-last V: the B operand arrives keys-major (K-major), as fp8 wgmma wants it
            v = tl.trans(v)
        if PV_FP8:  # FA3 style: P rounded to e4m3, fp8 x fp8 dot
            acc = tl.dot(_rnd(p, tl.float8e4nv, 20, UPCAST), _mm(v, UPCAST), acc)
        elif IS_FP8:  # V widened to bf16 (exact), P rounded to bf16
            acc = tl.dot(_rnd(p, tl.bfloat16, 16, UPCAST), _mm(v.to(tl.bfloat16), UPCAST), acc)
        else:
            acc = tl.dot(_rnd(p, tl.bfloat16, 16, UPCAST), _mm(v, UPCAST), acc)
        return acc, l_i, m_new

    # what varies per request is not specialized (gluon_attention._mla_attn_ws_fwd says why)
    @triton.jit(do_not_specialize=["B", "stride_vt", "stride_vh", "stride_lh"],
                do_not_specialize_on_alignment=["cu_q", "cu_k", "cu_v"])
    @no_type_check
    def _mla_ctx_attn_fwd(
        Q, K, KR, V, O, LSE, cu_q, cu_k, cu_v, qk_scale, B,  # noqa: E741  (the output, as in BLAS)
        stride_qt, stride_qh, stride_kt, stride_kh, stride_rt, stride_rh, stride_vt, stride_vh,
        stride_ot, stride_oh, stride_lh,
        CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        IS_FP8: tl.constexpr, PV_FP8: tl.constexpr, USE_TMA: tl.constexpr, UPCAST: tl.constexpr,
        SORT_B: tl.constexpr, V_T: tl.constexpr = False,
    ):
        pid_m = tl.program_id(0)
        h = tl.program_id(1)
        b = tl.program_id(2)
        if b >= B:
            return
        if SORT_B > 0:
            # Longest segment first. Blocks start in grid order (x fastest, z slowest), so
            # program z = r takes the segment of rank r by key length, descending (ties by
            # index): the longest programs start first and short ones fill the tail, the
            # LPT rule. Ranks from a SORT_B x SORT_B comparison of the lengths, in-kernel:
            # no extra launch, no host sync.
            i = tl.arange(0, SORT_B)
            ok = i < B
            kl = tl.load(cu_k + i + 1, mask=ok, other=0) - tl.load(cu_k + i, mask=ok, other=0)
            kl = tl.where(ok, kl, -1)
            ahead = (kl[None, :] > kl[:, None]) | ((kl[None, :] == kl[:, None]) & (i[None, :] < i[:, None]))
            rank = tl.sum(ahead.to(tl.int32), 1)
            b = tl.sum(tl.where(rank == b, i, 0), 0)
        q_start = tl.load(cu_q + b)
        q_len = tl.load(cu_q + b + 1) - q_start
        m0 = pid_m * BLOCK_M
        if m0 >= q_len:
            return
        k_start = tl.load(cu_k + b)
        k_len = tl.load(cu_k + b + 1) - k_start

        offs_m = m0 + tl.arange(0, BLOCK_M)
        row_ok = offs_m < q_len
        rm = tl.arange(0, BLOCK_M)
        d = tl.arange(0, _C_NOPE)
        r = tl.arange(0, _C_ROPE)
        # int64 bases: segment start × row stride can pass 2**31
        q_seg = Q + q_start.to(tl.int64) * stride_qt + h.to(tl.int64) * stride_qh
        k_ptr = K + k_start.to(tl.int64) * stride_kt + h.to(tl.int64) * stride_kh
        kr_ptr = KR + k_start.to(tl.int64) * stride_rt + h.to(tl.int64) * stride_rh
        if V_T:  # V [H, 128, Tv]: keys contiguous from column cu_v[b], stride_vt between rows
            v_ptr = V + tl.load(cu_v + b).to(tl.int64) + h.to(tl.int64) * stride_vh
        else:
            v_ptr = V + k_start.to(tl.int64) * stride_vt + h.to(tl.int64) * stride_vh
        if USE_TMA:
            # descriptors over this (segment, head): [len, dim]; loads past len read zeros
            q_nope = tl.make_tensor_descriptor(q_seg, [q_len, 192], [stride_qt, 1], [BLOCK_M, _C_NOPE]).load([m0, 0])
            q_pe = tl.make_tensor_descriptor(q_seg, [q_len, 192], [stride_qt, 1], [BLOCK_M, _C_ROPE]).load(
                [m0, _C_NOPE])
            k_rows = tl.maximum(k_len, 1)  # never a 0-sized descriptor (no load happens then)
            kn_src = tl.make_tensor_descriptor(k_ptr, [k_rows, _C_NOPE], [stride_kt, 1], [BLOCK_N, _C_NOPE])
            kr_src = tl.make_tensor_descriptor(kr_ptr, [k_rows, _C_ROPE], [stride_rt, 1], [BLOCK_N, _C_ROPE])
            if V_T:  # the caller puts every segment's keys on a 16-byte boundary (cu_v)
                v_src = tl.make_tensor_descriptor(v_ptr, [_C_V, k_rows], [stride_vt, 1], [_C_V, BLOCK_N])
            else:
                v_src = tl.make_tensor_descriptor(v_ptr, [k_rows, _C_V], [stride_vt, 1], [BLOCK_N, _C_V])
        else:
            q_blk = q_seg + m0.to(tl.int64) * stride_qt
            q_nope = tl.load(q_blk + rm[:, None] * stride_qt + d[None, :], mask=row_ok[:, None], other=0.0)
            q_pe = tl.load(q_blk + rm[:, None] * stride_qt + _C_NOPE + r[None, :], mask=row_ok[:, None], other=0.0)
            kn_src = k_ptr
            kr_src = kr_ptr
            v_src = v_ptr

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, _C_V], tl.float32)

        # Key range: [0, n_full) in unmasked full blocks, [n_full, hi) masked.
        if CAUSAL:
            # bottom-right aligned: row t sees key j iff j <= t + (k_len - q_len)
            shift = k_len - q_len
            rows_vis = offs_m + shift
            hi = tl.minimum(tl.maximum(m0 + BLOCK_M + shift, 0), k_len)
            n_full = (tl.maximum(m0 + shift + 1, 0) // BLOCK_N) * BLOCK_N  # seen by every row
            n_full = tl.minimum(n_full, (k_len // BLOCK_N) * BLOCK_N)
        else:
            rows_vis = offs_m
            hi = k_len
            n_full = (k_len // BLOCK_N) * BLOCK_N

        offs_n = tl.arange(0, BLOCK_N)
        # the pointer path advances 64-bit pointers (n × stride could pass 2**31)
        for start_n in range(0, n_full, BLOCK_N):
            k_nope, k_rope, v = _load_kv(kn_src, kr_src, v_src, k_ptr, kr_ptr, v_ptr, start_n, k_len, stride_kt,
                                         stride_rt, stride_vt, BLOCK_N, False, USE_TMA, V_T)
            acc, l_i, m_i = _attn_step(acc, l_i, m_i, q_nope, q_pe, k_nope, k_rope, v, start_n + offs_n,
                                       rows_vis, k_len, qk_scale, False, CAUSAL, IS_FP8, PV_FP8, UPCAST, V_T)
            k_ptr += BLOCK_N * stride_kt
            kr_ptr += BLOCK_N * stride_rt
            v_ptr += BLOCK_N * (1 if V_T else stride_vt)
        for start_n in range(n_full, hi, BLOCK_N):
            k_nope, k_rope, v = _load_kv(kn_src, kr_src, v_src, k_ptr, kr_ptr, v_ptr, start_n, k_len, stride_kt,
                                         stride_rt, stride_vt, BLOCK_N, True, USE_TMA, V_T)
            acc, l_i, m_i = _attn_step(acc, l_i, m_i, q_nope, q_pe, k_nope, k_rope, v, start_n + offs_n,
                                       rows_vis, k_len, qk_scale, True, CAUSAL, IS_FP8, PV_FP8, UPCAST, V_T)
            k_ptr += BLOCK_N * stride_kt
            kr_ptr += BLOCK_N * stride_rt
            v_ptr += BLOCK_N * (1 if V_T else stride_vt)

        # Epilogue. l_i == 0 exactly when the row saw no key: out 0, lse -inf.
        empty = l_i == 0.0
        out = acc / tl.where(empty, 1.0, l_i)[:, None]
        lse2 = m_i + tl.math.log2(tl.where(empty, 1.0, l_i))
        if PV_FP8:
            lse2 = lse2 - _C_SHIFT
        lse = tl.where(empty, float("-inf"), lse2 * 0.6931471805599453)  # natural log
        o_base = O + (q_start + m0).to(tl.int64) * stride_ot + h.to(tl.int64) * stride_oh
        tl.store(o_base + rm[:, None] * stride_ot + d[None, :], _rnd(out, tl.bfloat16, 16, UPCAST).to(tl.bfloat16),
                 mask=row_ok[:, None])
        tl.store(LSE + h.to(tl.int64) * stride_lh + q_start + offs_m, lse, mask=row_ok)


def _interpreting() -> bool:
    """Whether the kernel was built for Triton's interpreter (decided when this module was
    imported, by TRITON_INTERPRET at that time)."""
    if triton is not None and "_mla_ctx_attn_fwd" in globals():
        return type(_mla_ctx_attn_fwd).__name__ == "InterpretedFunction"
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _fix_interpreter_for_numpy2() -> None:
    """Triton 3.6's interpreter turns a scalar into a Python int with ``int(array([x]))``,
    which NumPy >= 2.4 refuses ("only 0-dimensional arrays ..."), breaking every loop
    with a data-dependent bound. Re-patch ``__index__`` with ``.item()``. Only done when
    interpreting (tests on the CPU); compiled kernels never go through this path."""
    from triton.runtime import interpreter as _interp

    orig = getattr(_interp, "_patch_lang_tensor", None)
    if orig is None or getattr(orig, "_ctxprefill_fix", False):
        return

    def patched(tensor: Any, scope: Any) -> None:
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    patched._ctxprefill_fix = True  # type: ignore[attr-defined]
    _interp._patch_lang_tensor = patched


if triton is not None and _interpreting():
    _fix_interpreter_for_numpy2()


def mla_context_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_q: int,
    max_k: int,
    scale: float,
    out: torch.Tensor | None = None,
    causal: bool = False,
    config: dict[str, Any] | None = None,
    v_layout: VLayout | str = "thd",
    cu_seqlens_v: torch.Tensor | None = None,
    tile_order: TileOrder | None = None,
    k_rope: torch.Tensor | None = None,
    captured: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged attention, one launch. Returns ``(out [Tq,H,128] bf16, lse [H,Tq] f32, ln)``.

    ``k_rope``: the keys unpacked — their rope part here, ``k`` then the nope part alone,
    ``[Tk, H, 128]``: ``k_rope`` is ``[Tk, H, 64]`` of the same dtype, unit last stride,
    and may have a head stride of 0 — MLA's rope keys are one row per key shared by every
    head, so the engine passes the workspace's ``k_pe`` columns and the ``kv_b_proj``
    output's nope half where they lie, and no K is packed. The kernels load K in these
    two parts either way (a packed ``k`` is read as ``k[..., :128]`` and ``k[..., 128:]``),
    into the same shared-memory tiles and the same MMAs: the result is the same bits.

    ``v_layout``: ``"thd"`` — v is ``[Tk, H, 128]`` (the ``kv_b_proj`` output's half, or a row-major pack); ``"hdt"``
    — v is ``[H, 128, Tk]`` with the keys contiguous (unit last stride). Hopper's fp8 MMA
    takes its B operand K-major only, and for P·V the K dimension is the keys: with
    ``"thd"`` Triton transposes every fp8 V tile through registers, with ``"hdt"`` the
    tile is already in that order (measured on the H200: 639-792 TFLOP/s with P·V in fp8,
    against 466-608 with P·V in bf16; the engine's fp8 pack writes this layout, each
    segment from a column that is a multiple of 16: ``ops.pack``). ``cu_seqlens_v`` (int32 ``[B+1]``, default
    ``cu_seqlens_k``): the column of v where each segment's keys start. Hopper's tensor
    descriptors need a 16-byte aligned start, so only with ``cu_seqlens_v`` given (the
    caller vouches that every start is a multiple of 16 bytes, as is v's row stride) do
    keys-last tiles come through TMA; otherwise through pointer loads.

    ``tile_order`` (``device_tile_order``: the launch order of this batch's tiles packed
    per SM on the host, from the same lengths as the cumulative ones): the warp-specialized
    kernel launches one program per tile in that order (a ragged batch's tail, docs/DESIGN.md);
    the other kernel keeps its own order. An order built for other lengths is memory-safe
    (the kernel checks each code against the batch and each tile against its segment) but
    computes the tiles it names only.

    ``config`` overrides ``CONFIGS[q.dtype]`` (BLOCK_M, BLOCK_N, num_warps, num_stages,
    PV_FP8, USE_TMA, WS — None: the Triton kernel on every chunk —, and optionally maxnreg:
    a register cap per thread, e.g. 128 so that two 8-warp programs fit on one SM and one's
    softmax overlaps the other's MMAs). ``max_k`` is accepted for the interface; the kernel does not need it.
    USE_TMA loads q/k/v through per-(segment, head) device-side tensor descriptors (Hopper
    TMA); inputs whose base or strides are not 16-byte aligned silently use the pointer path.
    ``captured``: the launch is being recorded into a CUDA graph, and the warp-specialized
    kernel takes ``CAPTURED_WS`` where ``config``'s WS does not set those keys (the same bits).
    """
    if triton is None:
        raise RuntimeError(_TRITON_ERR)
    Tq, H, dq = q.shape
    Tk = k.shape[0]
    if v_layout not in ("thd", "hdt"):
        raise ValueError(f"v_layout must be 'thd' ([Tk,H,{D_V}]) or 'hdt' ([H,{D_V},Tk]); got {v_layout!r}")
    v_t = v_layout == "hdt"
    # keys-last v: [H, 128, Tv], Tv = Tk (segments where k has them) or, with cu_seqlens_v,
    # wherever those columns say (the caller's, like cu_seqlens_k: not read on the host)
    v_ok = (v.dim() == 3 and v.shape[:2] == (H, D_V) and (cu_seqlens_v is not None or v.shape[2] == Tk)) if v_t \
        else v.shape == (Tk, H, D_V)
    dk = D_QK if k_rope is None else D_NOPE
    if dq != D_QK or k.shape[1:] != (H, dk) or not v_ok:
        want = f"[H,{D_V},Tk]" if v_t else f"[Tk,H,{D_V}]"
        raise ValueError(f"expected q [Tq,H,{D_QK}], k [Tk,H,{dk}]{'' if k_rope is None else ' (with k_rope)'}, "
                         f"v {want} ({v_layout}); got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k_rope is not None and k_rope.shape != (Tk, H, D_ROPE):
        raise ValueError(f"k_rope must be [Tk,H,{D_ROPE}] = {[Tk, H, D_ROPE]} (a head stride of 0 shares one row "
                         f"per key), got {tuple(k_rope.shape)}")
    kr = k[..., D_NOPE:] if k_rope is None else k_rope  # the rope columns the kernels read
    if q.dtype not in CONFIGS or k.dtype != q.dtype or v.dtype != q.dtype or kr.dtype != q.dtype:
        raise ValueError(f"q/k/v (and k_rope) must share one dtype of {list(CONFIGS)}; got {q.dtype}, {k.dtype}, "
                         f"{v.dtype}" + ("" if k_rope is None else f", {k_rope.dtype}"))
    # each tensor's strides read once, for the checks and the launch: a request's host time
    # is mostly calls like these (docs/DESIGN.md: 16-head requests are host-bound)
    strides = (q.stride(), k.stride(), v.stride(), kr.stride())
    for name, st in zip(("q", "k", "v", "k_rope"), strides, strict=True):
        if st[-1] != 1:
            raise ValueError(f"{name} must have unit last stride, got strides {st}")
    if cu_seqlens_v is not None and not v_t:
        raise ValueError("cu_seqlens_v is for v_layout='hdt' only")
    dev = q.device
    cu = [("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)]
    for name, t in cu + ([("cu_seqlens_v", cu_seqlens_v)] if cu_seqlens_v is not None else []):
        if t.dtype != torch.int32 or t.dim() != 1 or not t.is_contiguous() or t.device != dev:
            raise ValueError(f"{name} must be a contiguous 1-D int32 tensor on {q.device}; "
                             f"got {t.dtype} {tuple(t.shape)} on {t.device}")
    B = cu_seqlens_q.numel() - 1
    if B < 0 or cu_seqlens_k.numel() != B + 1 or B > 65535 or (cu_seqlens_v is not None
                                                                 and cu_seqlens_v.numel() != B + 1):
        raise ValueError(f"cu_seqlens_q, cu_seqlens_k (and cu_seqlens_v) must have B+1 entries, 0 <= B <= 65535 "
                         f"(a grid dimension); got {cu_seqlens_q.numel()} and {cu_seqlens_k.numel()}")
    if tile_order is not None:
        t = tile_order.codes
        if t.dtype != torch.int32 or t.dim() != 1 or not t.is_contiguous() or t.device != dev \
                or (tile_order.segments, tile_order.heads) != (B, H) or not 1 <= tile_order.m_tiles \
                or B * tile_order.m_tiles * H >= 2**31 or not 1 <= t.numel() < 2**31:
            raise ValueError(f"tile_order must be built for this batch (B={B}, H={H}: device_tile_order) with "
                             f"contiguous int32 codes on {q.device}; got B={tile_order.segments}, "
                             f"H={tile_order.heads}, m_tiles={tile_order.m_tiles}, codes {t.dtype} "
                             f"{tuple(t.shape)} on {t.device}")
    if out is None:
        out = torch.empty((Tq, H, D_V), dtype=torch.bfloat16, device=q.device)
    elif out.shape != (Tq, H, D_V) or out.dtype != torch.bfloat16 or out.stride(-1) != 1:
        raise ValueError(f"out must be bf16 [{Tq},{H},{D_V}] with unit last stride; "
                         f"got {out.dtype} {tuple(out.shape)} strides {out.stride()}")
    lse = torch.empty((H, Tq), dtype=torch.float32, device=q.device)
    # Even with nothing to compute (Tq == 0, B == 0) the kernel is launched (its programs
    # exit at once), so that a call is always exactly one launch, as the metrics count.
    if H == 0:
        return out, lse

    cfg = dict(CONFIGS[q.dtype])
    if v_t and q.dtype == _FP8:
        cfg.update(KEYS_LAST_FP8)
    cfg.update(config or {})
    is_fp8 = q.dtype == _FP8
    BM, BN = cfg["BLOCK_M"], cfg["BLOCK_N"]
    pv_fp8 = bool(cfg.get("PV_FP8", False)) and is_fp8
    if any(x < 16 or x & (x - 1) for x in (BM, BN)) or (pv_fp8 and BN < 32):
        raise ValueError(f"BLOCK_M/BLOCK_N must be powers of two >= 16 (BLOCK_N >= 32 with PV_FP8: "
                         f"an fp8 dot needs K >= 32); got {cfg}")
    # (query tile, head, segment): a segment's tiles and heads run together (its K/V stay in
    # L2 across query tiles); segments longest first when 2 <= B <= _SORT_MAX (SORT_B)
    grid = (max(1, -(-int(max_q) // BM)), H, max(B, 1))  # (not triton.cdiv: a jit function, ~5 us from Python)
    sort_b = _SORT_MAX if 2 <= B <= _SORT_MAX else 0
    if cfg.get("maxnreg") and not (config or {}).get("maxnreg") and q.device.type == "cuda" \
            and grid[0] * grid[1] * grid[2] < uncapped_below(q.device):
        # The default register cap exists so that two programs share an SM; a grid too small
        # to put two on every SM only pays for the cap (fewer registers, less overlap within
        # a program): measured on the H200, fp8 H=16 1x1024q/16k keys (128 programs) ran 399
        # TFLOP/s capped and 470 uncapped. (The grid counts every segment's tiles up to
        # max_q: an upper bound, decided without a host sync.)
        cfg.pop("maxnreg")
    if q.device.type != "cuda" and not _interpreting():
        raise RuntimeError("the triton backend runs CPU tensors only under Triton's interpreter: set "
                           "TRITON_INTERPRET=1 before ctxprefill.backends.triton_attention is imported")
    use_tma = (bool(cfg.get("USE_TMA", False)) and _tma_ok(q, k, v, kr, strides=strides)
               and (not v_t or cu_seqlens_v is not None)
               and _capability(q.device) >= (9, 0)
               and grid[0] * grid[1] * grid[2] * _TMA_SCRATCH_PER_PROGRAM <= _TMA_SCRATCH_CAP)
    if use_tma and q.device.type == "cuda":
        triton.set_allocator(tma_scratch)  # a ContextVar: set in the calling thread, every call
    ws = cfg.get("WS")
    if ws and use_tma and not causal and (not is_fp8 or (v_t and pv_fp8)) and _ws.gluon is not None \
            and q.device.type == "cuda" and _capability(q.device)[0] == 9:
        # (fp8: P·V in fp8 over keys-last V only — Hopper's fp8 MMA wants V K-major)
        # warp-specialized Gluon kernel (Hopper): same semantics, FA3's structure
        ws_cfg = ws_config(ws, config, q, k, kr, v_t, captured)
        ws_grid = (max(1, -(-int(max_q) // ws_cfg["BLOCK_M"])), H, max(B, 1))
        if ws_cfg["PERSIST"] and not _asks(config, "PERSIST") and not persistent_launch(
                B, tile_order, ws_grid[0] * ws_grid[1] * ws_grid[2], _ws.sms(q.device)):
            ws_cfg["PERSIST"] = False
        ordered = tile_order is not None  # then a 1-D launch in that order, no in-kernel sort
        _ws.launch(q, k, kr, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                   cu_seqlens_k if cu_seqlens_v is None else cu_seqlens_v, float(scale) * _LOG2E, ws_grid,
                   0 if ordered else sort_b, v_t, ws_cfg, order=None if tile_order is None else tile_order.codes,
                   m_tiles=0 if tile_order is None else tile_order.m_tiles, p_regs_checked=not _asks(config, "P_REGS"))
        return out, lse
    sq, sk, sv, sr = strides
    _mla_ctx_attn_fwd[grid](
        q, k, kr, v, out, lse, cu_seqlens_q, cu_seqlens_k, cu_seqlens_k if cu_seqlens_v is None else cu_seqlens_v,
        float(scale) * _LOG2E, B,
        sq[0], sq[1], sk[0], sk[1], sr[0], sr[1],
        sv[1] if v_t else sv[0], sv[0] if v_t else sv[1],  # stride_vt, stride_vh
        out.stride(0), out.stride(1), lse.stride(0),
        CAUSAL=bool(causal), BLOCK_M=BM, BLOCK_N=BN, IS_FP8=is_fp8,
        PV_FP8=pv_fp8, USE_TMA=use_tma, UPCAST=q.device.type != "cuda", SORT_B=sort_b, V_T=v_t,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        **({"maxnreg": int(cfg["maxnreg"])} if cfg.get("maxnreg") else {}),
    )
    return out, lse


def ws_config(ws: dict | bool, config: dict | None, q: torch.Tensor, k: torch.Tensor, kr: torch.Tensor,
              v_t: bool, captured: bool = False) -> dict[str, Any]:
    """The Gluon kernel's config for a call: ``ws`` over its defaults, and ``CAPTURED_WS``
    over both where ``captured``, ``EAGER_WS`` where not (for the keys ``config``'s WS does
    not set). ``P_REGS`` where it comes from the defaults and the inputs cannot take it (K
    without the rows past its end that it reads) falls back to P staged in shared memory;
    asked for in ``config``, the launch refuses such inputs (the inputs are checked once,
    here or there)."""
    cfg = dict(_ws.CONFIG, **(ws if isinstance(ws, dict) else {}))
    extra = CAPTURED_WS if captured else EAGER_WS
    if extra:  # (an eager launch's host path: nothing to do while EAGER_WS is empty)
        cfg.update({key: val for key, val in extra.items() if not _asks(config, key)})
    if cfg["P_REGS"] and not _asks(config, "P_REGS") and _ws.p_regs_problem(q, k, kr, v_t) is not None:
        cfg["P_REGS"] = False
    # the defaults' variants these settings cannot carry (P staged, a serial consumer) are
    # dropped; asked for in ``config``, the launch refuses them
    for key in _ws.unrunnable(cfg, q.dtype.itemsize == 1):
        if not _asks(config, key):
            cfg[key] = False
    return cfg


def _default_ws(q_dtype: torch.dtype) -> dict[str, Any]:
    """The dtype's default Gluon settings (fp8: keys-last V, the only fp8 layout it runs)."""
    ws = (KEYS_LAST_FP8 if q_dtype == _FP8 else CONFIGS[q_dtype]).get("WS")
    return ws if isinstance(ws, dict) else {}


def persists(q_dtype: torch.dtype, config: dict | None = None) -> bool:
    """Whether the Gluon kernel's settings for a call with ``config`` turn ``PERSIST`` on, as
    ``ws_config`` resolves them: ``EAGER_WS`` over a key the call's WS does not set, the
    call's WS (which stands in for the dtype's defaults whole) or the defaults."""
    if not _asks(config, "PERSIST") and "PERSIST" in EAGER_WS:
        return bool(EAGER_WS["PERSIST"])
    ws = (config or {}).get("WS", _default_ws(q_dtype))
    return bool((ws if isinstance(ws, dict) else {}).get("PERSIST", _ws.CONFIG["PERSIST"]))


def _asks(config: dict | None, key: str) -> bool:
    """Whether a caller's ``config`` sets the Gluon kernel's ``key`` itself (in its ``WS``)."""
    ws = (config or {}).get("WS")
    return isinstance(ws, dict) and key in ws


@dataclasses.dataclass(frozen=True, slots=True)
class TileOrder:
    """A launch order for the warp-specialized kernel (``tile_order.tile_order``'s codes,
    on the device) and the batch it was built for."""

    codes: torch.Tensor  # int32 [programs] on the device, (b * m_tiles + m) * heads + h
    segments: int  # B
    heads: int  # H
    m_tiles: int  # query tiles per segment the codes count with
    persistent: bool = False  # laid out for a persistent launch (``tile_order(persistent=True)``)


def tile_order_codes(q_lens: Sequence[int], k_lens: Sequence[int], heads: int, q_dtype: torch.dtype,
                     device: torch.device | str, persistent: bool | None = None) -> HostLaunchOrder | None:
    """The warp-specialized kernel's launch order for segments of ``q_lens`` query rows over
    ``k_lens`` keys on ``device`` (host lists, no sync), or None where its own order serves
    (not CUDA, one segment, no tail to pack): ``tile_order``, laid out for a persistent
    launch where ``persistent`` (None: where a call without a config persists: ``persists``)."""
    if len(q_lens) < 2:  # (the engine asks for every chunk: a short request's host time)
        return None
    device = torch.device(device)
    if device.type != "cuda" or q_dtype not in CONFIGS:
        return None
    ws = _default_ws(q_dtype)
    block_m = _ws.CONFIG["BLOCK_M"]
    block_n = ws.get("BLOCK_N", _ws.CONFIG["BLOCK_N"])
    if persistent is None:  # as ws_config sets it for a call without a config
        persistent = persists(q_dtype)
    sms = _ws.sms(device)
    got = _tile_order.tile_order(q_lens, k_lens, heads, sms, block_m, block_n, True) if persistent else None
    if got is not None:
        return HostLaunchOrder(*got, persistent=True)
    # no persistent layout: the launch runs a program per tile (``persistent_launch``), in
    # the start-time order where there is one
    got = _tile_order.tile_order(q_lens, k_lens, heads, sms, block_m, block_n)
    return None if got is None else HostLaunchOrder(*got)


def device_tile_order(q_lens: Sequence[int], k_lens: Sequence[int], heads: int, q_dtype: torch.dtype,
                      device: torch.device | str, persistent: bool | None = None) -> TileOrder | None:
    """``tile_order_codes`` copied to the device (one small copy) for ``mla_context_attention``."""
    got = tile_order_codes(q_lens, k_lens, heads, q_dtype, device, persistent)
    if got is None:
        return None
    return TileOrder(torch.tensor(got.codes, dtype=torch.int32).to(device), len(q_lens), heads, got.m_tiles,
                     got.persistent)


def persistent_launch(B: int, tile_order: TileOrder | None, tiles: int, sms: int) -> bool:
    """Whether a launch whose settings turn ``PERSIST`` on (not the call's ``config``) runs
    persistent programs: in a launch order laid out for them, or over one segment of more
    ``tiles`` than the device has ``sms`` (a stride walk over tiles that cost alike; with
    no more, each program would run one tile and there is nothing to carry across tiles).
    Several segments without such an order run a program per tile, longest segment first,
    which the hardware hands to whichever SM frees first; a static walk over the grid's
    order ran a 20-wave ragged batch at 0.765 × that (docs/DESIGN.md)."""
    return (tile_order is not None and tile_order.persistent) or (B <= 1 and tiles > sms)


# Segments per call up to which programs are ordered longest-first (one compiled variant
# for every B in 2.._SORT_MAX; a 64 x 64 comparison per program is noise next to its keys).
_SORT_MAX = 64
# the largest BLOCK_M of the default configs: query rows per program
BLOCK_M_MAX = max(c["BLOCK_M"] for c in CONFIGS.values())

# Device-side descriptors live in a global scratch of 5 × 128 B per *program* (Triton
# allocates grid size × that per launch, early-exiting programs included); a huge ragged
# grid (many sequences × max_q blocks × heads) uses the pointer path instead.
_TMA_SCRATCH_PER_PROGRAM = 5 * 128
_TMA_SCRATCH_CAP = 64 << 20


@functools.cache
def uncapped_below(device: torch.device) -> int:
    """Grids with fewer programs than this run without the default register cap: two
    programs for every multiprocessor."""
    return 2 * _ws.sms(device)


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    """CUDA compute capability; CPU (the interpreter) counts as Hopper, to test every path."""
    if device.type != "cuda":
        return (9, 0)
    return torch.cuda.get_device_capability(device)


def _tma_ok(*ts: torch.Tensor, strides: Sequence[tuple[int, ...]] | None = None) -> bool:
    """TMA needs 16-byte aligned bases and row/head strides; otherwise the pointer path.
    ``strides``: the tensors' strides when the caller has read them already."""
    for t, st in zip(ts, strides or [t.stride() for t in ts], strict=True):
        e = t.element_size()
        if t.data_ptr() % 16 or any(x * e % 16 for x in st[:-1]):
            return False
    return True


#: both kernels load K's nope and rope columns as two tiles anyway: from two tensors they
#: are the same loads (unpacked keys, either dtype); fp8's P·V in fp8 wants V keys-last (no
#: tile transposes), bf16 gains nothing from it
_CAPS = BackendCaps(q_dtypes=frozenset(CONFIGS), supports_out=True, unpacked_keys=frozenset(CONFIGS),
                    v_keys_last=frozenset({_FP8}), launches_per_call=1, launch_order=False)


class TritonAttentionBackend(AttentionBackend):
    """Our own Triton flash-attention kernel (bf16 and fp8 e4m3 inputs, bf16 out) on every
    chunk: CUDA from sm_80 (fp8 from sm_89)."""

    name = "triton"
    caps = _CAPS
    #: overrides of ``CONFIGS`` for every call: the warp-specialized kernel off
    config: ClassVar[dict[str, Any] | None] = {"WS": None}

    @classmethod
    def unavailable_reason(cls, device: torch.device, q_dtype: torch.dtype) -> str | None:
        device = torch.device(device)
        why = dtype_reason(cls.caps, q_dtype)
        if why is None and triton is None:
            why = _TRITON_ERR
        why = why or cuda_reason(cls.name, device)
        if why:
            return why
        # bf16 tensor cores from sm_80, fp8 (e4m3) ones from sm_89
        need = (8, 9) if q_dtype == _FP8 else (8, 0)
        cap = _capability(device)
        if cap < need:
            return f"{q_dtype} needs sm_{need[0]}{need[1]} or later, {device} is sm_{cap[0]}{cap[1]}"
        return None

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
        order = None if launch_order is None else \
            TileOrder(launch_order.codes, cu_seqlens_q.numel() - 1, q.shape[1], launch_order.m_tiles,
                      launch_order.persistent)
        return mla_context_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, scale,
                                     out=out, causal=causal, config=self.config, v_layout=v_layout,
                                     cu_seqlens_v=cu_seqlens_v, tile_order=order, k_rope=k_rope, captured=captured)

    def warm_up(self, device: torch.device, heads: int, q_dtype: torch.dtype, captured: bool = False,
                programs: int | None = None) -> None:
        """Compile every variant of the kernel a chunk can pick: program order by segment
        length or not (1 or 2 segments), and for configs with a register cap, grids below
        and above ``programs`` (default: two programs per SM) — a variant compiled on a
        request's path costs that request seconds; bf16 also with the keys unpacked, fp8
        with both V layouts; with a launch order too where the backend builds them; and
        with ``captured`` (where ``caps.graph_variants``) each as captured launches take it
        too. Keys of length 1, zero inputs."""
        device = torch.device(device)
        if programs is None:
            if device.type != "cuda":
                return
            programs = uncapped_below(device)
        big = BLOCK_M_MAX * -(-programs // heads)  # query rows whose tiles x heads reach `programs`

        def cu(lens: list[int]) -> torch.Tensor:
            return torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=device)

        for q_lens in ([1], [1, 1], [big], [big, big]):
            n = len(q_lens)
            q = torch.zeros(sum(q_lens), heads, D_QK, dtype=q_dtype, device=device)
            k = torch.zeros(n, heads, D_QK, dtype=q_dtype, device=device)
            v = torch.zeros(n, heads, D_V, dtype=q_dtype, device=device)
            # several segments: with a launch order too (the warp-specialized kernel's 1-D
            # variant, which the engine's packed orders run): here every tile in grid order
            orders: list[TileOrder | None] = [None]
            if n > 1 and device.type == "cuda" and self.caps.launch_order:
                m_tiles = -(-max(q_lens) // _ws.CONFIG["BLOCK_M"])
                codes = torch.arange(n * m_tiles * heads, dtype=torch.int32, device=device)
                # a program per tile in that order, and persistent programs in an order laid out for them
                orders += [TileOrder(codes, n, heads, m_tiles), TileOrder(codes, n, heads, m_tiles, True)]
            for order, cap in itertools.product(orders, (False, True) if captured and self.caps.graph_variants
                                                else (False,)):
                mla_context_attention(q, k, v, cu(q_lens), cu([1] * n), max(q_lens), 1, 1.0, config=self.config,
                                      tile_order=order, captured=cap)
                if q_dtype == torch.bfloat16:  # the engine's unpacked keys: k_rope shared by the heads
                    kr = torch.zeros(n, 1, D_ROPE, dtype=q_dtype, device=device).expand(n, heads, D_ROPE)
                    mla_context_attention(q, k[..., :D_NOPE], v, cu(q_lens), cu([1] * n), max(q_lens), 1, 1.0,
                                          config=self.config, tile_order=order, k_rope=kr, captured=cap)
                if q_dtype in self.caps.v_keys_last:  # as the engine's pack gives it: segments 16 columns apart,
                    # K in the pack's buffer (its slack rows: P_REGS runs)
                    vt = torch.zeros(heads, D_V, 16 * n, dtype=q_dtype, device=device)
                    ks = key_buffer(n, heads, D_QK, device).zero_()
                    mla_context_attention(q, ks, vt, cu(q_lens), cu([1] * n), max(q_lens), 1, 1.0, config=self.config,
                                          v_layout="hdt", cu_seqlens_v=cu([16] * n), tile_order=order, captured=cap)


class GluonAttentionBackend(TritonAttentionBackend):
    """The warp-specialized Gluon kernel (``gluon_attention``) on Hopper, for the chunks it
    takes — non-causal, bf16 or fp8 with V keys-last, inputs TMA can read (the engine's) —
    in a launch order packed per SM on the host (``tile_order``); the Triton kernel for
    the rest. Same contract and caps as ``triton``, plus the launch order."""

    name = "gluon"
    caps = dataclasses.replace(_CAPS, launch_order=True, graph_variants=True)
    config = None  # CONFIGS as they are: ``WS`` on

    @classmethod
    def unavailable_reason(cls, device: torch.device, q_dtype: torch.dtype) -> str | None:
        device = torch.device(device)
        why = super().unavailable_reason(device, q_dtype)
        if why:
            return why
        if _ws.gluon is None:
            return _ws.GLUON_ERR
        cap = _capability(device)
        if cap[0] != 9:
            return f"the Gluon kernel is written for Hopper (sm_90), {device} is sm_{cap[0]}{cap[1]}"
        return None

    def launch_order(self, q_lens: Sequence[int], k_lens: Sequence[int], heads: int, q_dtype: torch.dtype,
                     device: torch.device) -> HostLaunchOrder | None:
        return tile_order_codes(q_lens, k_lens, heads, q_dtype, device)
