"""Warp-specialized MLA context attention for Hopper, written in Gluon (Triton's
explicit-layout dialect): FA3's structure, which Triton's automatic pass does not
produce for this kernel (docs/DESIGN.md).

One program = one (query tile of ``BLOCK_M`` rows, head, segment), three partitions:

* a loader warp issues TMA copies — the tile's queries once, then for every key block
  K (nope 128 + rope 64) and V into rings of ``STAGES`` shared-memory slots, the next
  block's K before this block's V — and waits only for a slot to be freed;
* two consumer warpgroups, each owning half of the query rows (64), read the *same* K/V
  slots: S = Q·Kᵀ (wgmma from shared memory), online softmax in registers, O += P·V
  (P from registers; fp8 P through shared memory). While one is in its softmax, the
  other's MMAs run, as two programs per SM would, but with one copy of K/V in shared
  memory (bf16's 192-wide K does not fit twice otherwise). With ``PIPE`` each consumer
  also overlaps within itself (FA3's intra-warpgroup pipelining): block j's Q·Kᵀ and
  block j-1's P·V are in flight together, and block j's softmax runs while P·V finishes
  (in the machine code only with ``PV_WAIT_LATE``).

K and V slots are freed apart (``EARLY_K``): a consumer frees K as soon as its scores are
in registers, V after P·V, so the next K streams in during the softmax. Measured on the
H200 (``bench_attention.py --sweep ws``, one process, 2026-12-01): bf16 serial -2 to +6 %, and
pipelining, which lost with one release per slot (its next K waited for the previous
P·V), wins (591-654 TFLOP/s against 555-600 with K freed with V); fp8 +6-7 %,
serial. (EARLY_K=False keeps that release for comparison, the loader's order unchanged.)
``RESCALE_EARLY`` moves the pipelined consumer's rescale of O from after P·V to right after
the next block's Q·Kᵀ is issued (FA3's order): slower on 5 of 6 shapes by 0.6-4.6 %, faster
on 4 × 1,024 rows by 3.9-7.9 % (two rounds each; H200, 2026-12-04, commit 58e912f,
``--sweep ws-rescale``); off. ``PV_WAIT_LATE`` keeps P·V's wait after the softmax in the
machine code (ptxas moves it above the softmax otherwise, which undoes the pipelining);
``PINGPONG`` makes the two consumers take turns issuing their MMAs (FA3's ping-pong). The
backend's defaults (``triton_attention``): bf16 pipelined with the late wait; fp8 serial
over 256-key blocks with turns and ``P_REGS``; both with ``ARRIVE_NOSYNC`` (docs/DESIGN.md).

``P_REGS`` (fp8) keeps P·V's operand in registers, as bf16 does, instead of staging P in
shared memory (2 × 16 KiB at 256-key blocks, and each block's P written and read there):
the loader lands K's rows permuted within 16-key groups (a 5-D TMA box, ``_key_of``) so
that the registers holding a thread's scores are those of its fp8 operand with V in key
order, a relabelling the kernel asserts moves nothing. It reads whole 16-key groups, up
to ``P_REGS_SLACK_ROWS`` rows past a segment (masked out of the scores), which must lie in
K's storage (``check_p_regs``). ``EXP2_POLY`` computes 1 (or 2) of every 8 of the
softmax's exp2s on the FMA pipes (``_exp2``), FA4's offload of the SFU; measured slower or
level, it is no default. ``ARRIVE_NOSYNC`` drops the warpgroup barrier Triton puts before
each of the consumers' mbarrier arrives and waits (``strip_arrive_syncs``): a slot is
released by one thread of the warpgroup once its wgmma wait returns, as FA3's pipelines
do; for consumers that write no shared memory themselves (bf16, ``P_REGS``).
``LAZY_RESCALE`` (bf16, pipelined) keeps a row's max until it grows by 2**8 and skips O's
rescale where no row of the warpgroup moved; on in the bf16 default (``triton_attention.CONFIGS``).
``PERSIST`` launches one program per SM, each taking every P-th tile (P programs) in the
3-D grid's order or the host's launch order: the rings' positions and the queries' and
turns' phases run on across a program's tiles, a consumer releases its queries
(``q_free``) after its last scores (serial: its last P·V) so that the loader loads the
next tile's queries and first keys during the tile's end, and q and K come through descriptors over
the whole tensors (as ``HOST_DESC``'s: the launch's, or made by the program once), so that
V's (and ``P_REGS``'s K) are the only ones a tile makes, rewritten in place once every copy
through them has landed. ``test_gpu_warp_specialized_persistent_same_bits`` holds it to a
program per tile's bits; ``bench_attention.py --ab ws-persist`` measures it; in both dtypes'
defaults, where ``triton_attention.persistent_launch`` decides it per launch.

Registers: the loader warp gives its budget to the consumers (``setmaxnreg``: 24 for
it, 240 for each consumer). Shared memory, bf16 with 128×128 tiles and 2 stages: Q 48 KiB +
2 × (K 48 + V 32) = 208 KiB; fp8 with 128×256 tiles and 2 stages: Q 24 + 2 × (K 48 + V 32)
= 184 KiB with ``P_REGS``, + P 2 × 16 = 216 KiB with P staged.

Semantics are those of ``triton_attention.mla_context_attention`` (non-causal): ragged
segments through per-(segment, head) device-side tensor descriptors, so a tile's rows
past its segment's end read zeros, not the next segment (whose values, inf included,
must not leak into this one); rows with no keys give out 0 and lse -inf; the LSE is a
natural log. Each descriptor a program makes costs a GPU-scope fence before the loads
it serves: the loader makes V's after issuing the copies of q and the first K.
``HOST_DESC`` reads q and K through descriptors the launch passes over the whole tensors
(safe: q rows past a segment only feed rows that are never stored, and keys past it are
masked out of the scores; V keeps its own, as 0 · inf is not 0); launches recorded into
a CUDA graph take it (``triton_attention.CAPTURED_WS``), eager ones do not, since making
the descriptors and passing them through Triton's launcher costs the host every launch
(docs/DESIGN.md). ``triton_attention.mla_context_attention`` validates
the inputs and picks this kernel for the chunks it takes; the registry serves it as the
``"gluon"`` backend (``triton_attention.GluonAttentionBackend``).
"""

from __future__ import annotations

import functools
import re
import zlib
from typing import Any, no_type_check

import torch

from ..ops._gluon import (
    GLUON_ERR,
    TensorDescriptor,
    fence_async_shared,
    gl,
    gluon,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from ..ops.pack import KEY_SLACK_ROWS, rows_readable

__all__ = ["CONFIG", "GLUON_ERR", "gluon", "launch", "rows_readable"]

_P_SHIFT = 8.0  # fp8 P·V: P scaled by 2**8 before its e4m3 cast (as triton_attention)

# exp2 on the FMA pipes (``EXP2_POLY``): x clamped to -126 (the result stays a positive
# float), 2^x = 2^round(x) · p(x - round(x)), p a degree-3 fit of 2^f on [-0.5, 0.5]
# (relative error < 7.5e-5, far below fp8's and bf16's rounding of P): round(x) read from
# the low bits of x + 1.5·2^23, its power of two added to p's exponent
_EXP2_POLY_PTX = ("{{ .reg .f32 x, t, j, f, p; .reg .b32 tb, pb; max.f32 x, ${i}, 0fC2FC0000; "
                  "add.rn.f32 t, x, 0f4B400000; sub.rn.f32 j, t, 0f4B400000; sub.rn.f32 f, x, j; "
                  "fma.rn.f32 p, f, 0f3D61FB53, 0f3E786EE6; fma.rn.f32 p, p, f, 0f3F31798D; "
                  "fma.rn.f32 p, p, f, 0f3F7FFB4A; mov.b32 tb, t; mov.b32 pb, p; shl.b32 tb, tb, 23; "
                  "add.s32 pb, pb, tb; mov.b32 ${o}, pb; }}")


def _exp2_mixed_asm(poly: int) -> str:
    """PTX for 8 elements: the first ``poly`` through the polynomial, the rest on the SFU."""
    return " ".join(_EXP2_POLY_PTX.format(o=i, i=8 + i) if i < poly else f"ex2.approx.ftz.f32 ${i}, ${8 + i};"
                    for i in range(8))


# ``ARRIVE_NOSYNC``: a kernel whose PTX holds this mark loses each consumer warpgroup's
# ``bar.sync N, 128`` right before an mbarrier arrive (no byte count) or wait, in Triton's
# PTX stage (``_install_ptx_hook``)
_BAR_SYNC_128 = re.compile(r"bar\.sync\s+\d+,\s*128;")
_MBARRIER_OP = re.compile(r"(@!?%\w+\s+)?mbarrier\.(arrive\.shared::cta\.b64\s+_,\s*\[[^\]]+\];|try_wait)")
_REGISTER_OP = re.compile(r"(add|sub|mul|mad|shl|shr|and|or|xor|not|mov|cvt|bfe|selp|setp)(\.\w+)*\s")
# the patterns' checksum in the mark: Triton's cache key covers the mark, so a kernel
# compiled under other patterns is not reused
_NOSYNC_SUM = zlib.crc32("".join(p.pattern for p in (_BAR_SYNC_128, _MBARRIER_OP, _REGISTER_OP)).encode())
_NOSYNC_MARK = f"/* ctxprefill:arrive-nosync {_NOSYNC_SUM:08x} */"


def _next_instruction(lines: list[str], i: int) -> str:
    """The first PTX instruction at or after line ``i`` that is more than register
    arithmetic (comments, labels, ``.loc``, ``.reg``, braces and such arithmetic, as an
    address computed for the arrive, skipped)."""
    for line in lines[i:]:
        s = line.strip()
        if (not s or s.startswith(("//", ".loc", ".reg")) or s in ("{", "}") or s.endswith(":")
                or _REGISTER_OP.match(s)):
            continue
        return s
    return ""


def strip_arrive_syncs(ptx: str) -> tuple[str, int]:
    """``ptx`` without every ``bar.sync N, 128`` whose next instruction is an mbarrier
    arrive without a byte count or an mbarrier wait, and how many were dropped. Each
    such barrier lines up a warpgroup before one of its threads arrives: the release of a
    K or V slot after a wgmma wait, or the turn; a wait needs none before it."""
    lines = ptx.split("\n")
    keep = [line for i, line in enumerate(lines)
            if not (_BAR_SYNC_128.fullmatch(line.strip()) and _MBARRIER_OP.match(_next_instruction(lines, i + 1)))]
    return "\n".join(keep), len(lines) - len(keep)


def _install_ptx_hook() -> None:
    """Wrap the PTX stage of every Triton compile in this process (Triton's
    ``knobs.runtime.add_stages_inspection_hook``, chained after any hook already there):
    PTX holding ``_NOSYNC_MARK`` goes through :func:`strip_arrive_syncs`, any other PTX
    is left as it is. The mark is a constexpr's code, so the two kernels differ in
    Triton's cache key."""
    from triton import knobs

    prev = knobs.runtime.add_stages_inspection_hook
    if getattr(prev, "ctxprefill", False):
        return

    def hook(*args: Any) -> None:  # (backend,) stages, options, language, capability
        if prev is not None:
            prev(*args)
        stages = args[-4]
        make_ptx = stages.get("ptx")
        if make_ptx is None:
            return

        def ptx(src: Any, metadata: Any) -> Any:
            text = make_ptx(src, metadata)
            return strip_arrive_syncs(text)[0] if isinstance(text, str) and _NOSYNC_MARK in text else text

        stages["ptx"] = ptx

    hook.ctxprefill = True  # type: ignore[attr-defined]
    knobs.runtime.add_stages_inspection_hook = hook


# ``LAZY_RESCALE`` (bf16): a row's max moves only when it grows by more than this (log2
# units), so p stays within 2**8 and most blocks leave O's scale alone; a block where no
# row of a warpgroup moved skips O's rescale (``_rescale_if``, per 16 accumulators)
_LAZY_TAU = 8.0
_RESCALE_N = 16


def _rescale_if_asm(n: int) -> str:
    """PTX for ``n`` accumulators: $0.. out, $n.. in, $2n.. the alphas, $3n.. the flag;
    the outputs take the inputs, and are multiplied only where the flag is set."""
    moves = " ".join(f"mov.b32 ${i}, ${n + i};" for i in range(n))
    muls = " ".join(f"mul.f32 ${i}, ${n + i}, ${2 * n + i};" for i in range(n))
    return (f"{{ .reg .pred p; setp.ne.b32 p, ${3 * n}, 0; {moves} @!p bra.uni SKIP; {muls} SKIP: }}")


#: Tiles, stages, pipelining. 2 consumers x 64 query rows = BLOCK_M 128 (fixed). The
#: caller's defaults per dtype are in ``triton_attention`` (measured there).
# (HOST_DESC: q and K through the launch's descriptors, ``_host_descriptors``)
CONFIG: dict[str, Any] = dict(BLOCK_M=128, BLOCK_N=128, STAGES=2, PIPE=False, EARLY_K=True, RESCALE_EARLY=False,
                              PINGPONG=False, PV_WAIT_LATE=False, P_REGS=False, EXP2_POLY=0, HOST_DESC=False,
                              ARRIVE_NOSYNC=False, LAZY_RESCALE=False, PERSIST=False)
#: rows a key tensor must hold past the last segment's end for ``P_REGS`` (its K loads
#: read whole 16-key groups: up to 15 rows past a segment, masked out of the scores): what
#: every keys-last K the engine packs leaves (``ops.pack.KEY_SLACK_ROWS``)
P_REGS_SLACK_ROWS = KEY_SLACK_ROWS
#: Warps: 4 (consumer 0, the default partition) + 4 (consumer 1) + 1 (loader): 3
#: warpgroups at launch with 168 registers a thread (3 x 128 x 168 <= 65,536, an SM's
#: file); ``setmaxnreg`` then moves them: loader 24, consumers 240.
_MAXNREG = 168

if gluon is not None:
    _P_SHIFT_C = gl.constexpr(_P_SHIFT)  # globals read inside jit code must be constexpr
    _EXP2_POLY1 = gl.constexpr(_exp2_mixed_asm(1))
    _EXP2_POLY2 = gl.constexpr(_exp2_mixed_asm(2))
    _EXP2_CONSTRAINTS = gl.constexpr(",".join(["=f"] * 8 + ["f"] * 8))
    _NOSYNC_ASM = gl.constexpr(_NOSYNC_MARK + " mov.b32 $0, $1;")
    _LAZY_TAU_C = gl.constexpr(_LAZY_TAU)
    _RESCALE_PACK = gl.constexpr(_RESCALE_N)
    _RESCALE_IF_ASM = gl.constexpr(_rescale_if_asm(_RESCALE_N))
    _RESCALE_IF_CONSTRAINTS = gl.constexpr(",".join(["=f"] * _RESCALE_N + ["f"] * (2 * _RESCALE_N)
                                                    + ["r"] * _RESCALE_N))
    _install_ptx_hook()

    @gluon.jit
    @no_type_check
    def _mark_nosync(x):
        """``x`` unchanged, through an asm statement carrying ``_NOSYNC_MARK`` into the PTX."""
        return gl.inline_asm_elementwise(_NOSYNC_ASM, "=r,r", [x], dtype=gl.float32, is_pure=False, pack=1)

    @gluon.jit
    @no_type_check
    def _exp2(x, POLY: gl.constexpr):
        """exp2 of fp32 ``x``: on the SFU (MUFU.EX2), or with ``POLY`` (1 or 2) that many of
        every 8 elements on the FMA pipes (FA4's split: the SFU's 16 results a clock per SM
        bound a softmax whose exp2s outnumber what the tensor cores leave time for)."""
        if POLY == 0:
            return gl.exp2(x)
        asm: gl.constexpr = _EXP2_POLY1 if POLY == 1 else _EXP2_POLY2
        return gl.inline_asm_elementwise(asm, _EXP2_CONSTRAINTS, [x], dtype=gl.float32, is_pure=True, pack=8)

    @gluon.jit
    @no_type_check  # device code: Triton's compiler types it, not mypy
    def _ws_loader(qn_d, qr_d, kn_d, kr_d, v_seg, k_rows, stride_vt, qn_s, qr_s, kn_s, kr_s, v_s,
                   q_bar, k_bar, v_bar, k_free, v_free, q_row, k_row, h, h_r, n_blocks,
                   BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, V_T: gl.constexpr,
                   P_REGS: gl.constexpr, HOST_Q: gl.constexpr, HOST_K: gl.constexpr):
        # a program per tile: ring position 0 written here, a constant the slot arithmetic
        # folds (passed through warp_specialize it would be a runtime value)
        _load_tile(qn_d, qr_d, kn_d, kr_d, v_seg, k_rows, stride_vt, qn_s, qr_s, kn_s, kr_s, v_s,
                   q_bar, k_bar, v_bar, k_free, v_free, q_row, k_row, h, h_r, n_blocks, 0,
                   BLOCK_M, BLOCK_N, STAGES, V_T, P_REGS, HOST_Q, HOST_K, False)

    @gluon.jit
    @no_type_check
    def _load_tile(qn_d, qr_d, kn_d, kr_d, v_seg, k_rows, stride_vt, qn_s, qr_s, kn_s, kr_s, v_s,
                   q_bar, k_bar, v_bar, k_free, v_free, q_row, k_row, h, h_r, n_blocks, g,
                   BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, V_T: gl.constexpr,
                   P_REGS: gl.constexpr, HOST_Q: gl.constexpr, HOST_K: gl.constexpr, PERSIST: gl.constexpr):
        """One tile's loads: its queries, then K and V of its ``n_blocks`` key blocks into the
        rings, block j in ring position ``g + j`` (``g``: blocks a persistent program loaded
        for its earlier tiles, 0 otherwise)."""
        HALF_M: gl.constexpr = BLOCK_M // 2
        if n_blocks > 0:
            for c in gl.static_range(2):
                bar = q_bar.index(c)
                mbarrier.expect(bar, qn_d.block_type.nbytes + qr_d.block_type.nbytes)
                if HOST_Q:  # [Tq, H, 192] boxes of [64, 1, cols] at (row, head, column)
                    qn = qn_s.index(c)._reinterpret(qn_s.dtype, [HALF_M, 1, 128], qn_d.layout)
                    qr = qr_s.index(c)._reinterpret(qr_s.dtype, [HALF_M, 1, 64], qr_d.layout)
                    tma.async_copy_global_to_shared(qn_d, [q_row + c * HALF_M, h, 0], bar, qn)
                    tma.async_copy_global_to_shared(qr_d, [q_row + c * HALF_M, h, 128], bar, qr)
                else:
                    tma.async_copy_global_to_shared(qn_d, [q_row + c * HALF_M, 0], bar, qn_s.index(c))
                    tma.async_copy_global_to_shared(qr_d, [q_row + c * HALF_M, 128], bar, qr_s.index(c))
            _load_k(kn_d, kr_d, kn_s, kr_s, k_bar, k_free, 0, g, k_row, h, h_r, BLOCK_N, STAGES, P_REGS, HOST_K)
        if PERSIST:
            # V's descriptor is rewritten in place once every copy through it landed: those
            # of the last STAGES positions (an earlier position's slot was since refilled)
            for i in gl.static_range(STAGES):
                r = g - STAGES + i
                if r >= 0:
                    mbarrier.wait(v_bar.index(r % STAGES), (r // STAGES) & 1)
        # V through a descriptor over this (segment, head), so that rows past the segment's end
        # read zeros (P is 0 there, but 0 · inf is not), made while q and the first K land
        if V_T:  # [H, 128, Tv]: keys contiguous
            v_d = tma.make_tensor_descriptor(v_seg, [128, k_rows], [stride_vt, 1], [128, BLOCK_N], v_s.layout)
        else:
            v_d = tma.make_tensor_descriptor(v_seg, [k_rows, 128], [stride_vt, 1], [BLOCK_N, 128], v_s.layout)
        for j in range(n_blocks):
            # K of the next block before V of this one: the consumers free a K slot as soon
            # as its scores are computed (a softmax and a P·V earlier than its V slot), and
            # they need the next K first (FA3's order)
            if j + 1 < n_blocks:
                _load_k(kn_d, kr_d, kn_s, kr_s, k_bar, k_free, j + 1, g + j + 1, k_row, h, h_r, BLOCK_N, STAGES,
                        P_REGS, HOST_K)
            r = g + j
            s = r % STAGES
            # a slot's barrier starts "phase 1 complete": the first pass does not wait
            mbarrier.wait(v_free.index(s), ((r // STAGES) & 1) ^ 1)
            vb = v_bar.index(s)
            mbarrier.expect(vb, v_d.block_type.nbytes)
            if V_T:
                tma.async_copy_global_to_shared(v_d, [0, j * BLOCK_N], vb, v_s.index(s))
            else:
                tma.async_copy_global_to_shared(v_d, [j * BLOCK_N, 0], vb, v_s.index(s))

    @gluon.jit
    @no_type_check
    def _load_k(kn_d, kr_d, kn_s, kr_s, k_bar, k_free, j, r, k_row, h, h_r, BLOCK_N: gl.constexpr,
                STAGES: gl.constexpr, P_REGS: gl.constexpr, HOST_K: gl.constexpr):
        """K of block j (nope and rope) into ring position r's slot, once freed; with
        ``P_REGS`` through 5-D descriptors whose rows land in ``_key_of``'s order; with
        ``HOST_K`` through the launch's [Tk, H, cols] descriptors (rope at head ``h_r``)."""
        s = r % STAGES
        mbarrier.wait(k_free.index(s), ((r // STAGES) & 1) ^ 1)
        kb = k_bar.index(s)
        mbarrier.expect(kb, kn_d.block_type.nbytes + kr_d.block_type.nbytes)
        if HOST_K:
            kn = kn_s.index(s)._reinterpret(kn_s.dtype, [BLOCK_N, 1, 128], kn_d.layout)
            kr = kr_s.index(s)._reinterpret(kr_s.dtype, [BLOCK_N, 1, 64], kr_d.layout)
            tma.async_copy_global_to_shared(kn_d, [k_row + j * BLOCK_N, h, 0], kb, kn)
            tma.async_copy_global_to_shared(kr_d, [k_row + j * BLOCK_N, h_r, 0], kb, kr)
        elif P_REGS:
            G: gl.constexpr = BLOCK_N // 16
            kn = kn_s.index(s)._reinterpret(kn_s.dtype, [G, 2, 4, 2, 128], kn_d.layout)
            kr = kr_s.index(s)._reinterpret(kr_s.dtype, [G, 2, 4, 2, 64], kr_d.layout)
            tma.async_copy_global_to_shared(kn_d, [j * G, 0, 0, 0, 0], kb, kn)
            tma.async_copy_global_to_shared(kr_d, [j * G, 0, 0, 0, 0], kb, kr)
        else:
            tma.async_copy_global_to_shared(kn_d, [j * BLOCK_N, 0], kb, kn_s.index(s))
            tma.async_copy_global_to_shared(kr_d, [j * BLOCK_N, 0], kb, kr_s.index(s))

    @gluon.jit
    @no_type_check
    def _free_k(k_free, s, now: gl.constexpr):
        """This consumer's release of K slot s, where ``now`` (EARLY_K: right after the
        scores; otherwise with V, after P·V: the release before K and V were freed apart)."""
        if now:
            mbarrier.arrive(k_free.index(s), count=1)

    @gluon.jit
    @no_type_check
    def _turn_wait(turn, C: gl.constexpr, i, on: gl.constexpr):
        """Wait for this consumer's i-th turn at the tensor cores (``PINGPONG``): consumer 0's
        first turn is free (a fresh barrier reads "phase 1 complete"), every later one is
        passed on by the other consumer."""
        if on:
            mbarrier.wait(turn.index(C), (i & 1) ^ (1 - C))

    @gluon.jit
    @no_type_check
    def _turn_pass(turn, C: gl.constexpr, on: gl.constexpr):
        """Hand the turn to the other consumer, once this one's MMAs are issued."""
        if on:
            mbarrier.arrive(turn.index(1 - C), count=1)

    @gluon.jit
    @no_type_check
    def _after(x, C: gl.constexpr):
        """``x`` [64] unchanged, passed through a barrier reduction of consumer C's warpgroup
        (named barrier 14 + C) that reads it: ptxas leaves a wgmma wait placed after this
        behind the code that computes ``x`` (``PV_WAIT_LATE``; as read in the SASS, which
        tests/test_backend_triton.py's cross-compile check asserts)."""
        BAR: gl.constexpr = 14 + C
        return gl.inline_asm_elementwise(
            "{ .reg .pred q; .reg .b32 t; or.b32 t, $2, $3; setp.ne.b32 q, t, 0; "
            f"bar.red.or.pred q, {BAR}, 128, q; mov.b32 $0, $2; mov.b32 $1, $3; }}",
            "=r,=r,r,r", [x], dtype=gl.float32, is_pure=False, pack=2)

    @gluon.jit
    @no_type_check
    def _after_any(x, need, C: gl.constexpr):
        """:func:`_after` whose barrier reduction also ORs ``need`` [64] (int32) over consumer
        C's warpgroup: (``x`` unchanged, 1 where any of its rows needs it else 0, per row)."""
        BAR: gl.constexpr = 14 + C
        return gl.inline_asm_elementwise(
            "{ .reg .pred q; .reg .b32 t; or.b32 t, $6, $7; setp.ne.b32 q, t, 0; "
            f"bar.red.or.pred q, {BAR}, 128, q; selp.b32 $2, 1, 0, q; selp.b32 $3, 1, 0, q; "
            "mov.b32 $0, $4; mov.b32 $1, $5; }",
            "=r,=r,=r,=r,r,r,r,r", [x, need], dtype=(gl.float32, gl.int32), is_pure=False, pack=2)

    @gluon.jit
    @no_type_check
    def _rescale_if(acc, alpha, any_need, row_o: gl.constexpr):
        """``acc`` [64, 128] times ``alpha`` [64] by row where ``any_need`` (the same for the
        whole warpgroup, :func:`_after_any`) is set; left as is, without the multiplies,
        where it is not (``LAZY_RESCALE``: every alpha is then 1)."""
        a, _ = gl.broadcast(gl.convert_layout(alpha, row_o)[:, None], acc)
        f, _ = gl.broadcast(gl.convert_layout(any_need, row_o)[:, None], acc)
        return gl.inline_asm_elementwise(_RESCALE_IF_ASM, _RESCALE_IF_CONSTRAINTS, [acc, a, f],
                                         dtype=gl.float32, is_pure=True, pack=_RESCALE_PACK)

    @gluon.jit
    @no_type_check
    def _qk(qn, qr, kn_s, kr_s, s, zero_s):
        """S = q_nope·k_noperᵀ + q_rope·k_ropeᵀ of slot s, issued asynchronously."""
        acc = warpgroup_mma(qn, kn_s.index(s).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        return warpgroup_mma(qr, kr_s.index(s).permute((1, 0)), acc, is_async=True)

    @gluon.jit
    @no_type_check
    def _softmax(sc, m_i, l_i, start_n, k_len, qk_scale, offs_n, IS_FP8: gl.constexpr,
                 EXP2_POLY: gl.constexpr, LAZY: gl.constexpr = False):
        """Online-softmax step on raw scores ``sc`` (scale folded into exp2's FMA).
        Returns (p, alpha, l, m): m in raw score units. ``LAZY``: a row keeps its max
        unless the new one exceeds it by more than ``_LAZY_TAU`` in log2 units (its alpha
        then exactly 1, its p at most 2**_LAZY_TAU)."""
        if start_n + sc.shape[1] > k_len:  # the segment's last, partial block
            sc = gl.where(((start_n + offs_n) < k_len)[None, :], sc, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(sc, axis=1))
        if LAZY:  # (-inf - -inf: NaN, not above: a row with no keys yet stays at -inf)
            m_new = gl.where((m_new - m_i) * qk_scale > _LAZY_TAU_C, m_new, m_i)
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: no -inf - -inf
        alpha = gl.exp2((m_i - m_use) * qk_scale)
        m_scaled = m_use * qk_scale
        if IS_FP8:
            m_scaled = m_scaled - _P_SHIFT_C  # p in [0, 2**8]; the row sum alike, undone in lse
        p = _exp2(sc * qk_scale - m_scaled[:, None], EXP2_POLY)
        l_i = l_i * alpha + gl.sum(p, axis=1)
        return p, alpha, l_i, m_new


    @gluon.jit
    @no_type_check
    def _stage_p(p, p_smem):
        """fp8 P (scaled by 2**8 already) into this consumer's shared buffer, for P·V."""
        p_smem.store(p.to(p_smem.dtype))
        fence_async_shared()

    @gluon.jit
    @no_type_check
    def _key_of(offs_n):
        """The key of each score column under ``P_REGS``: K's rows land in shared memory so
        that column 16h + 8r + 2q + e holds key 16h + 4q + 2r + e (e < 2, q < 4, r < 2),
        which puts in each thread's registers the keys of its fp8 P operand for P·V."""
        return (offs_n // 16) * 16 + ((offs_n % 8) // 2) * 4 + ((offs_n % 16) // 8) * 2 + offs_n % 2

    @gluon.jit
    @no_type_check
    def _p_operand(p, p_layout: gl.constexpr):
        """fp8 P [64, BLOCK_N] (columns in ``_key_of``'s order) as P·V's register operand,
        keys in order: a relabelling of registers, no data moved (asserted)."""
        M: gl.constexpr = p.shape[0]
        N: gl.constexpr = p.shape[1]
        p8 = gl.reshape(p.to(gl.float8e4nv), [M, N // 16, 2, 4, 2])
        p8 = gl.reshape(gl.permute(p8, [0, 1, 3, 2, 4]), [M, N])
        return gl.convert_layout(p8, p_layout, assert_trivial=True)

    @gluon.jit
    @no_type_check
    def _hand_over_p(p, p_smem, p_layout: gl.constexpr, P_REGS: gl.constexpr):
        """fp8 P for the P·V to come: staged in this consumer's shared buffer (returned as
        is), or with ``P_REGS`` made the register operand (32 registers to carry, not 128)."""
        if P_REGS:
            p = _p_operand(p, p_layout)
        else:
            _stage_p(p, p_smem)
        return p

    @gluon.jit
    @no_type_check
    def _keep(x):
        """``x`` read after a wgmma wait: an 8-bit register operand of the MMA waited for
        keeps its registers until then (the wait's own ``deps`` take 16-bit and wider)."""
        return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=x.dtype, is_pure=False, pack=4)

    @gluon.jit
    @no_type_check
    def _pv(p, v_s, s, acc, p_layout: gl.constexpr, p_smem, V_T: gl.constexpr, IS_FP8: gl.constexpr,
            P_REGS: gl.constexpr):
        """acc += P·V of slot s, issued asynchronously. Returns (token, P operand).
        bf16: P from registers. fp8: from shared memory (``p_smem``, staged by
        :func:`_stage_p` before), or with ``P_REGS`` from registers (``p`` made the operand
        by :func:`_p_operand` before)."""
        if V_T:
            vb = v_s.index(s).permute((1, 0))  # [128, BLOCK_N] keys-last -> K-major B
        else:
            vb = v_s.index(s)
        if IS_FP8:
            if P_REGS:  # p is the operand already (_p_operand, where the staged kernel stages P)
                keep = p
                tok = warpgroup_mma(keep, vb, acc, is_async=True)
            else:
                tok = warpgroup_mma(p_smem, vb, acc, is_async=True)
                keep = acc  # placeholder: P lives in shared memory
        else:
            keep = gl.convert_layout(p.to(v_s.dtype), p_layout)
            tok = warpgroup_mma(keep, vb, acc, is_async=True)
        return tok, keep

    @gluon.jit
    @no_type_check
    def _pv_wait(o_tok, keep, IS_FP8: gl.constexpr, P_REGS: gl.constexpr):
        """Wait for the P·V in flight; a register P stays alive until then."""
        if IS_FP8:
            acc = warpgroup_mma_wait(0, deps=(o_tok, ))
            if P_REGS:
                _keep(keep)
        else:
            acc, keep = warpgroup_mma_wait(0, deps=(o_tok, keep))
        return acc

    @gluon.jit
    @no_type_check
    def _ws_consumer(qn_s, qr_s, kn_s, kr_s, v_s, p_s, q_bar, k_bar, v_bar, k_free, v_free, turn,
                     O, LSE,  # noqa: E741  (the output, as in BLAS)
                     q_start, q_len, m0, k_len, n_blocks, h, stride_ot, stride_oh, stride_lh, qk_scale,
                     C: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                     PIPE: gl.constexpr, IS_FP8: gl.constexpr, V_T: gl.constexpr, EARLY_K: gl.constexpr,
                     RESCALE_EARLY: gl.constexpr, PINGPONG: gl.constexpr, PV_WAIT_LATE: gl.constexpr,
                     P_REGS: gl.constexpr, EXP2_POLY: gl.constexpr, ARRIVE_NOSYNC: gl.constexpr,
                     LAZY_RESCALE: gl.constexpr):
        # a program per tile: ring position, queries' phase and turns 0 as constants (as above)
        _consume_tile(qn_s, qr_s, kn_s, kr_s, v_s, p_s, q_bar, k_bar, v_bar, k_free, v_free, turn, q_bar, O, LSE,
                      q_start, q_len, m0, k_len, n_blocks, h, stride_ot, stride_oh, stride_lh, qk_scale, 0, 0, 0,
                      C, BLOCK_M, BLOCK_N, STAGES, PIPE, IS_FP8, V_T, EARLY_K, RESCALE_EARLY, PINGPONG,
                      PV_WAIT_LATE, P_REGS, EXP2_POLY, ARRIVE_NOSYNC, LAZY_RESCALE, False)

    @gluon.jit
    @no_type_check
    def _consume_tile(qn_s, qr_s, kn_s, kr_s, v_s, p_s, q_bar, k_bar, v_bar, k_free, v_free, turn, q_free,
                      O, LSE,  # noqa: E741  (the output, as in BLAS)
                      q_start, q_len, m0, k_len, n_blocks, h, stride_ot, stride_oh, stride_lh, qk_scale,
                      g, qi, tb,
                      C: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                      PIPE: gl.constexpr, IS_FP8: gl.constexpr, V_T: gl.constexpr, EARLY_K: gl.constexpr,
                      RESCALE_EARLY: gl.constexpr, PINGPONG: gl.constexpr, PV_WAIT_LATE: gl.constexpr,
                      P_REGS: gl.constexpr, EXP2_POLY: gl.constexpr, ARRIVE_NOSYNC: gl.constexpr,
                      LAZY_RESCALE: gl.constexpr, PERSIST: gl.constexpr):
        """Consumer C's half of one tile, its epilogue included. Key block j lies in ring
        position ``g + j``, this is the consumer's ``qi``-th tile with keys and its turns
        start at ``tb`` (a persistent program's counts over its earlier tiles, 0 otherwise);
        with ``PERSIST`` it releases its queries (``q_free``) once its last scores are in
        (serial: after its last P·V, outside the key loop)."""
        HALF_M: gl.constexpr = BLOCK_M // 2
        K_INSTR: gl.constexpr = 32 if IS_FP8 else 16
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, K_INSTR])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, 128, K_INSTR])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4 if IS_FP8 else 2)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

        m_i = gl.full([HALF_M], float("-inf"), gl.float32, row_s)
        l_i = gl.zeros([HALF_M], gl.float32, row_s)
        if ARRIVE_NOSYNC:
            l_i = _mark_nosync(l_i)
        acc = gl.zeros([HALF_M, 128], gl.float32, o_layout)
        zero_s = gl.zeros([HALF_M, BLOCK_N], gl.float32, s_layout)
        offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        if P_REGS:  # the key of each score column (the partial block's mask)
            offs_n = _key_of(offs_n)
        qn = qn_s.index(C)
        qr = qr_s.index(C)
        p_smem = p_s.index(C)
        if n_blocks > 0:
            mbarrier.wait(q_bar.index(C), qi & 1)
        if PIPE:
            if n_blocks > 0:
                # block 0: scores and softmax, its P·V waits for the next iteration
                s0 = g % STAGES
                mbarrier.wait(k_bar.index(s0), (g // STAGES) & 1)
                _turn_wait(turn, C, tb, PINGPONG)
                s_tok = _qk(qn, qr, kn_s, kr_s, s0, zero_s)
                _turn_pass(turn, C, PINGPONG)
                sc = warpgroup_mma_wait(0, deps=(s_tok, ))
                _free_k(k_free, s0, EARLY_K)
                p, alpha, l_i, m_i = _softmax(sc, m_i, l_i, 0, k_len, qk_scale, offs_n, IS_FP8, EXP2_POLY,
                                              LAZY_RESCALE)
                # fp8: P goes to shared memory (or becomes the register operand) before the
                # next Q·Kᵀ is issued, so that its registers are free for that block's scores
                if IS_FP8:
                    p = _hand_over_p(p, p_smem, p_layout, P_REGS)
                for j in range(1, n_blocks):
                    s = (g + j) % STAGES
                    ph = ((g + j) // STAGES) & 1
                    prev = (g + j - 1) % STAGES
                    prev_ph = ((g + j - 1) // STAGES) & 1
                    mbarrier.wait(k_bar.index(s), ph)
                    _turn_wait(turn, C, tb + j, PINGPONG)  # this block's Q·Kᵀ and the last one's P·V in one turn
                    s_tok = _qk(qn, qr, kn_s, kr_s, s, zero_s)
                    if RESCALE_EARLY:  # the previous block's rescale, under this block's Q·Kᵀ
                        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
                    mbarrier.wait(v_bar.index(prev), prev_ph)
                    o_tok, pop = _pv(p, v_s, prev, acc, p_layout, p_smem, V_T, IS_FP8, P_REGS)
                    _turn_pass(turn, C, PINGPONG)
                    sc = warpgroup_mma_wait(1, deps=(s_tok, ))  # Q·Kᵀ done, P·V may run on
                    _free_k(k_free, s, EARLY_K)
                    m_prev = m_i
                    p, alpha, l_i, m_i = _softmax(sc, m_i, l_i, j * BLOCK_N, k_len, qk_scale, offs_n, IS_FP8,
                                                  EXP2_POLY, LAZY_RESCALE)
                    if LAZY_RESCALE:  # O is rescaled where a row with keys before moved its max
                        need = ((alpha != 1.0) & (m_prev > float("-inf"))).to(gl.int32)
                        l_i, any_need = _after_any(l_i, need, C)
                    elif PV_WAIT_LATE:  # the softmax (its row sums) before P·V's wait, as written
                        l_i = _after(l_i, C)
                    acc = _pv_wait(o_tok, pop, IS_FP8, P_REGS)
                    _free_k(k_free, prev, not EARLY_K)
                    mbarrier.arrive(v_free.index(prev), count=1)
                    if LAZY_RESCALE:
                        acc = _rescale_if(acc, alpha, any_need, row_o)
                    elif not RESCALE_EARLY:
                        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
                    if IS_FP8:  # the P·V that read the buffer is done
                        p = _hand_over_p(p, p_smem, p_layout, P_REGS)
                if PERSIST:  # every Q·Kᵀ of the tile done: the loader may load the next queries
                    mbarrier.arrive(q_free.index(C), count=1)
                last = (g + n_blocks - 1) % STAGES
                if RESCALE_EARLY:
                    acc = acc * gl.convert_layout(alpha, row_o)[:, None]
                mbarrier.wait(v_bar.index(last), ((g + n_blocks - 1) // STAGES) & 1)
                _turn_wait(turn, C, tb + n_blocks, PINGPONG)
                o_tok, pop = _pv(p, v_s, last, acc, p_layout, p_smem, V_T, IS_FP8, P_REGS)
                _turn_pass(turn, C, PINGPONG)
                acc = _pv_wait(o_tok, pop, IS_FP8, P_REGS)
                _free_k(k_free, last, not EARLY_K)
                mbarrier.arrive(v_free.index(last), count=1)
        else:
            for j in range(n_blocks):
                s = (g + j) % STAGES
                ph = ((g + j) // STAGES) & 1
                mbarrier.wait(k_bar.index(s), ph)
                _turn_wait(turn, C, tb + j, PINGPONG)  # serial: the turn covers Q·Kᵀ's issue
                s_tok = _qk(qn, qr, kn_s, kr_s, s, zero_s)
                _turn_pass(turn, C, PINGPONG)
                sc = warpgroup_mma_wait(0, deps=(s_tok, ))
                _free_k(k_free, s, EARLY_K)  # the loader may refill K now
                p, alpha, l_i, m_i = _softmax(sc, m_i, l_i, j * BLOCK_N, k_len, qk_scale, offs_n, IS_FP8,
                                              EXP2_POLY)
                acc = acc * gl.convert_layout(alpha, row_o)[:, None]
                mbarrier.wait(v_bar.index(s), ph)
                if IS_FP8:
                    p = _hand_over_p(p, p_smem, p_layout, P_REGS)
                o_tok, pop = _pv(p, v_s, s, acc, p_layout, p_smem, V_T, IS_FP8, P_REGS)
                acc = _pv_wait(o_tok, pop, IS_FP8, P_REGS)
                _free_k(k_free, s, not EARLY_K)
                mbarrier.arrive(v_free.index(s), count=1)
            if PERSIST:
                if n_blocks > 0:
                    mbarrier.arrive(q_free.index(C), count=1)

        # epilogue: l == 0 exactly when the row saw no key -> out 0, lse -inf
        empty = l_i == 0.0
        l_safe = gl.where(empty, 1.0, l_i)
        out = acc / gl.convert_layout(l_safe, row_o)[:, None]
        m_use = gl.where(m_i == float("-inf"), 0.0, m_i)
        lse2 = m_use * qk_scale + gl.log2(l_safe)
        if IS_FP8:
            lse2 = lse2 - _P_SHIFT_C
        lse = gl.where(empty, float("-inf"), lse2 * 0.6931471805599453)
        rows_o = m0 + C * HALF_M + gl.arange(0, HALF_M, layout=row_o)
        cols = gl.arange(0, 128, layout=gl.SliceLayout(0, o_layout))
        o_ptr = O + (q_start + rows_o).to(gl.int64)[:, None] * stride_ot + h.to(gl.int64) * stride_oh + cols[None, :]
        gl.store(o_ptr, out.to(gl.bfloat16), mask=(rows_o < q_len)[:, None])
        rows_s = m0 + C * HALF_M + gl.arange(0, HALF_M, layout=row_s)
        gl.store(LSE + h.to(gl.int64) * stride_lh + q_start + rows_s, lse, mask=rows_s < q_len)

    @gluon.jit
    @no_type_check
    def _decode(code, B, n_heads, m_tiles):
        """A launch order's tile code, (b * m_tiles + m) * n_heads + h: (valid, b, h, m); a
        code outside the batch is not valid (and reads as tile 0)."""
        valid = (code >= 0) & (code < B * m_tiles * n_heads)
        code = gl.where(valid, code, 0)
        h = code % n_heads
        m = (code // n_heads) % m_tiles
        return valid, code // (n_heads * m_tiles), h, m

    @gluon.jit
    @no_type_check
    def _segment(cu_q, cu_k, b, valid, m, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
        """(m0, q_start, q_len, k_start, k_len, n_blocks) of segment b's query tile m (rows
        from m0): no metadata read where not ``valid`` (no rows, no keys: nothing computed,
        every store masked), no key blocks for a tile past the segment's end."""
        q_start = gl.load(cu_q + b, mask=valid, other=0)
        q_len = gl.load(cu_q + b + 1, mask=valid, other=0) - q_start
        m0 = m * BLOCK_M
        k_start = gl.load(cu_k + b, mask=valid, other=0)
        k_len = gl.load(cu_k + b + 1, mask=valid, other=0) - k_start
        n_blocks = gl.where(m0 < q_len, gl.cdiv(k_len, BLOCK_N), 0)
        return m0, q_start, q_len, k_start, k_len, n_blocks

    @gluon.jit
    @no_type_check
    def _tile(t, ORDER, cu_q, cu_k, B, n_heads, m_tiles, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              USE_ORDER: gl.constexpr):
        """Tile ``t`` of a persistent launch: (valid, b, h, m0, q_start, q_len, k_start, k_len,
        n_blocks). With ``USE_ORDER`` tile t is code ``ORDER[t]``, else the 3-D grid's order:
        query tile fastest, then head, then segment."""
        if USE_ORDER:
            valid, b, h, m = _decode(gl.load(ORDER + t), B, n_heads, m_tiles)
        else:
            m = t % m_tiles
            h = (t // m_tiles) % n_heads
            b = t // (m_tiles * n_heads)
            valid = b < B
        m0, q_start, q_len, k_start, k_len, n_blocks = _segment(cu_q, cu_k, b, valid, m, BLOCK_M, BLOCK_N)
        return valid, b, h, m0, q_start, q_len, k_start, k_len, n_blocks

    @gluon.jit
    @no_type_check
    def _tile_descriptors(Q, K, KR, V, QN_D, QR_D, KN_D, KR_D, cu_v, valid, b, h, m0, q_start, q_len, k_start,
                          k_len, stride_qt, stride_qh, stride_kt, stride_kh, stride_rt, stride_rh, stride_vt,
                          stride_vh, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, V_T: gl.constexpr,
                          P_REGS: gl.constexpr, HOST_DESC: gl.constexpr, HOST_K: gl.constexpr):
        """A tile's q and K descriptors and where its loads start: (qn_d, qr_d, kn_d, kr_d,
        q_row, k_row, h_r, k_rows, v_seg); the loader makes V's from ``v_seg``."""
        HALF_M: gl.constexpr = BLOCK_M // 2
        dt: gl.constexpr = Q.dtype.element_ty
        qn_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF_M, 128], dt)
        qr_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF_M, 64], dt)
        kn_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, 128], dt)
        kr_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, 64], dt)
        # descriptors over this (segment, head): loads past its end read zeros
        q_seg = Q + q_start.to(gl.int64) * stride_qt + h.to(gl.int64) * stride_qh
        # K's nope and rope columns through descriptors of their own: one packed K (KR = its
        # rope columns) or the two where they lie (rope shared by the heads: stride_rh 0)
        k_seg = K + k_start.to(gl.int64) * stride_kt + h.to(gl.int64) * stride_kh
        kr_seg = KR + k_start.to(gl.int64) * stride_rt + h.to(gl.int64) * stride_rh
        q_rows = gl.maximum(q_len, 1)
        k_rows = gl.maximum(k_len, 1)
        if HOST_DESC:
            # the launch's descriptors over all of q (a tile's rows past its segment are rows
            # whose output is never stored) and of K (keys past the segment's end are masked
            # out of the scores): none made per program, each a GPU-scope fence before any load
            qn_d = QN_D
            qr_d = QR_D
            q_row = q_start + m0
        else:
            qn_d = tma.make_tensor_descriptor(q_seg, [q_rows, 192], [stride_qt, 1], [HALF_M, 128], qn_l)
            qr_d = tma.make_tensor_descriptor(q_seg, [q_rows, 192], [stride_qt, 1], [HALF_M, 64], qr_l)
            q_row = m0
        if HOST_K:
            kn_d = KN_D
            kr_d = KR_D
        elif P_REGS:
            # K as [group, r, q, e, column] (strides 16, 2, 4, 1 rows): key 16 group + 4q + 2r + e
            # lands in row 16 group + 8r + 2q + e (``_key_of``); whole groups are read, up to 15
            # rows past the segment (the caller's P_REGS_SLACK_ROWS), masked out of the scores
            G: gl.constexpr = BLOCK_N // 16
            k_groups = gl.cdiv(k_rows, 16)
            kn_d = tma.make_tensor_descriptor(
                k_seg, [k_groups, 2, 4, 2, 128], [16 * stride_kt, 2 * stride_kt, 4 * stride_kt, stride_kt, 1],
                [G, 2, 4, 2, 128], gl.NVMMASharedLayout.get_default_for([G, 2, 4, 2, 128], dt))
            kr_d = tma.make_tensor_descriptor(
                kr_seg, [k_groups, 2, 4, 2, 64], [16 * stride_rt, 2 * stride_rt, 4 * stride_rt, stride_rt, 1],
                [G, 2, 4, 2, 64], gl.NVMMASharedLayout.get_default_for([G, 2, 4, 2, 64], dt))
        else:
            kn_d = tma.make_tensor_descriptor(k_seg, [k_rows, 128], [stride_kt, 1], [BLOCK_N, 128], kn_l)
            kr_d = tma.make_tensor_descriptor(kr_seg, [k_rows, 64], [stride_rt, 1], [BLOCK_N, 64], kr_l)
        k_row = k_start if HOST_K else 0  # the first key's row in K's descriptors
        # the rope keys' head in KR_D (0: one head shared by all, stride 0)
        h_r = gl.where(stride_rh == 0, 0, h) if HOST_K else h
        if V_T:  # V [H, 128, Tv], keys contiguous from column cu_v[b] (16-byte aligned: the caller's)
            v_seg = V + gl.load(cu_v + b, mask=valid, other=0).to(gl.int64) + h.to(gl.int64) * stride_vh
        else:
            v_seg = V + k_start.to(gl.int64) * stride_vt + h.to(gl.int64) * stride_vh
        return qn_d, qr_d, kn_d, kr_d, q_row, k_row, h_r, k_rows, v_seg

    @gluon.jit
    @no_type_check
    def _ws_loader_persist(Q, K, KR, V, QN_D, QR_D, KN_D, KR_D, ORDER, cu_q, cu_k, cu_v, B, n_heads, m_tiles,
                           n_tiles, Tq, Tk, stride_qt, stride_qh, stride_kt, stride_kh, stride_rt, stride_rh,
                           stride_vt, stride_vh, qn_s, qr_s, kn_s, kr_s, v_s, q_bar, k_bar, v_bar, k_free, v_free,
                           q_free, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                           V_T: gl.constexpr, P_REGS: gl.constexpr, HOST_DESC: gl.constexpr,
                           USE_ORDER: gl.constexpr):
        """``PERSIST``'s loader: the program's tiles one after another through the same rings,
        the next tile's queries and first K loading while the consumers finish this one. q
        and K (but ``P_REGS``'s 5-D K) come through descriptors over the whole tensors, as
        ``HOST_DESC``'s: the launch's, or made here once for all the program's tiles."""
        HALF_M: gl.constexpr = BLOCK_M // 2
        WIDE_K: gl.constexpr = not P_REGS
        dt: gl.constexpr = Q.dtype.element_ty
        qn_w = QN_D
        qr_w = QR_D
        kn_w = KN_D
        kr_w = KR_D
        if not HOST_DESC:  # [Tq, H, 192] in boxes of [64, 1, cols]; K [Tk, H, 128], rope [Tk, H or 1, 64]
            qn_w = tma.make_tensor_descriptor(Q, [gl.maximum(Tq, 1), n_heads, 192], [stride_qt, stride_qh, 1],
                                              [HALF_M, 1, 128],
                                              gl.NVMMASharedLayout.get_default_for([HALF_M, 1, 128], dt))
            qr_w = tma.make_tensor_descriptor(Q, [gl.maximum(Tq, 1), n_heads, 192], [stride_qt, stride_qh, 1],
                                              [HALF_M, 1, 64],
                                              gl.NVMMASharedLayout.get_default_for([HALF_M, 1, 64], dt))
            if WIDE_K:
                kn_w = tma.make_tensor_descriptor(K, [gl.maximum(Tk, 1), n_heads, 128], [stride_kt, stride_kh, 1],
                                                  [BLOCK_N, 1, 128],
                                                  gl.NVMMASharedLayout.get_default_for([BLOCK_N, 1, 128], dt))
                # rope keys shared by the heads (head stride 0): one head
                shared = stride_rh == 0
                kr_w = tma.make_tensor_descriptor(KR, [gl.maximum(Tk, 1), gl.where(shared, 1, n_heads), 64],
                                                  [stride_rt, gl.where(shared, 64, stride_rh), 1], [BLOCK_N, 1, 64],
                                                  gl.NVMMASharedLayout.get_default_for([BLOCK_N, 1, 64], dt))
        g = 0  # key blocks loaded for the earlier tiles: the rings' position
        qi = 0  # the earlier tiles with keys: the queries' phase
        for t in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
            valid, b, h, m0, q_start, q_len, k_start, k_len, n_blocks = _tile(
                t, ORDER, cu_q, cu_k, B, n_heads, m_tiles, BLOCK_M, BLOCK_N, USE_ORDER)
            if n_blocks > 0:
                # both consumers released their queries after the earlier tile's last scores:
                # every copy of q and K landed (P_REGS's K descriptors are rewritten in place)
                for c in gl.static_range(2):
                    mbarrier.wait(q_free.index(c), (qi & 1) ^ 1)
                qn_d, qr_d, kn_d, kr_d, q_row, k_row, h_r, k_rows, v_seg = _tile_descriptors(
                    Q, K, KR, V, qn_w, qr_w, kn_w, kr_w, cu_v, valid, b, h, m0, q_start, q_len, k_start, k_len,
                    stride_qt, stride_qh, stride_kt, stride_kh, stride_rt, stride_rh, stride_vt, stride_vh,
                    BLOCK_M, BLOCK_N, V_T, P_REGS, True, WIDE_K)
                _load_tile(qn_d, qr_d, kn_d, kr_d, v_seg, k_rows, stride_vt, qn_s, qr_s, kn_s, kr_s, v_s,
                           q_bar, k_bar, v_bar, k_free, v_free, q_row, k_row, h, h_r, n_blocks, g,
                           BLOCK_M, BLOCK_N, STAGES, V_T, P_REGS, True, WIDE_K, True)
                g += n_blocks
                qi += 1

    @gluon.jit
    @no_type_check
    def _ws_consumer_persist(qn_s, qr_s, kn_s, kr_s, v_s, p_s, q_bar, k_bar, v_bar, k_free, v_free, turn, q_free,
                             O, LSE, ORDER, cu_q, cu_k, B, n_heads, m_tiles, n_tiles,  # noqa: E741
                             stride_ot, stride_oh, stride_lh, qk_scale,
                             C: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                             PIPE: gl.constexpr, IS_FP8: gl.constexpr, V_T: gl.constexpr, EARLY_K: gl.constexpr,
                             RESCALE_EARLY: gl.constexpr, PINGPONG: gl.constexpr, PV_WAIT_LATE: gl.constexpr,
                             P_REGS: gl.constexpr, EXP2_POLY: gl.constexpr, ARRIVE_NOSYNC: gl.constexpr,
                             LAZY_RESCALE: gl.constexpr, USE_ORDER: gl.constexpr):
        """``PERSIST``'s consumer C: the program's tiles in the loader's order."""
        g = 0  # key blocks of the earlier tiles (the rings' position)
        qi = 0  # the earlier tiles with keys (the queries' phase)
        tb = 0  # turns taken (PINGPONG)
        for t in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
            valid, b, h, m0, q_start, q_len, k_start, k_len, n_blocks = _tile(
                t, ORDER, cu_q, cu_k, B, n_heads, m_tiles, BLOCK_M, BLOCK_N, USE_ORDER)
            _consume_tile(qn_s, qr_s, kn_s, kr_s, v_s, p_s, q_bar, k_bar, v_bar, k_free, v_free, turn, q_free, O,
                          LSE, q_start, q_len, m0, k_len, n_blocks, h, stride_ot, stride_oh, stride_lh, qk_scale,
                          g, qi, tb, C, BLOCK_M, BLOCK_N, STAGES, PIPE, IS_FP8, V_T, EARLY_K, RESCALE_EARLY,
                          PINGPONG, PV_WAIT_LATE, P_REGS, EXP2_POLY, ARRIVE_NOSYNC, LAZY_RESCALE, True)
            if n_blocks > 0:
                g += n_blocks
                qi += 1
                tb += n_blocks + 1 if PIPE else n_blocks  # (pipelined: one turn more, the last P·V)

    # what varies per request is not specialized: the batch's sizes and strides (a value of
    # 1 or a multiple of 16) and the metadata's addresses (16-byte aligned or not) would
    # otherwise compile another variant on a request's path
    @gluon.jit(do_not_specialize=["B", "stride_vt", "stride_vh", "stride_lh", "n_heads", "m_tiles", "n_tiles",
                                   "Tq", "Tk"],
               do_not_specialize_on_alignment=["cu_q", "cu_k", "cu_v", "ORDER"])
    @no_type_check
    def _mla_attn_ws_fwd(
        Q, K, KR, V, O, LSE, QN_D, QR_D, KN_D, KR_D,  # noqa: E741  (the output, as in BLAS)
        cu_q, cu_k, cu_v, qk_scale, B,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_rt, stride_rh, stride_vt, stride_vh,
        stride_ot, stride_oh, stride_lh, ORDER, n_heads, m_tiles, n_tiles, Tq, Tk,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PIPE: gl.constexpr,
        SORT_B: gl.constexpr, IS_FP8: gl.constexpr, V_T: gl.constexpr, EARLY_K: gl.constexpr,
        USE_ORDER: gl.constexpr, RESCALE_EARLY: gl.constexpr, PINGPONG: gl.constexpr, PV_WAIT_LATE: gl.constexpr,
        P_REGS: gl.constexpr, EXP2_POLY: gl.constexpr, HOST_DESC: gl.constexpr, ARRIVE_NOSYNC: gl.constexpr,
        LAZY_RESCALE: gl.constexpr, PERSIST: gl.constexpr,
    ):
        HALF_M: gl.constexpr = BLOCK_M // 2
        HOST_K: gl.constexpr = HOST_DESC and not P_REGS
        dt: gl.constexpr = Q.dtype.element_ty
        if not PERSIST:
            pid_m = gl.program_id(0)
            h = gl.program_id(1)
            b = gl.program_id(2)
            valid = b < B  # B == 0 still launches one program: cu_q[1] and cu_k[1] are not the batch's
            if USE_ORDER:
                # 1-D launch in the host's order (``tile_order``): program p runs tile ORDER[p]
                valid, b, h, pid_m = _decode(gl.load(ORDER + pid_m), B, n_heads, m_tiles)
            elif SORT_B > 0:
                # longest segment first (LPT), as triton_attention: rank r runs the r-th longest
                L2: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [4, 1], [1, 0])
                i_r = gl.arange(0, SORT_B, layout=gl.SliceLayout(1, L2))
                i_c = gl.arange(0, SORT_B, layout=gl.SliceLayout(0, L2))
                kl_r = gl.load(cu_k + i_r + 1, mask=i_r < B, other=0) - gl.load(cu_k + i_r, mask=i_r < B, other=0)
                kl_c = gl.load(cu_k + i_c + 1, mask=i_c < B, other=0) - gl.load(cu_k + i_c, mask=i_c < B, other=0)
                kl_r = gl.where(i_r < B, kl_r, -1)
                kl_c = gl.where(i_c < B, kl_c, -1)
                ahead = (kl_c[None, :] > kl_r[:, None]) | ((kl_c[None, :] == kl_r[:, None])
                                                            & (i_c[None, :] < i_r[:, None]))
                rank = gl.sum(ahead.to(gl.int32), axis=1)
                b = gl.sum(gl.where(rank == b, i_r, 0), axis=0)
            # a program outside the batch (a code past it, B == 0) reads no metadata; a tile past
            # its segment's end does nothing (0 blocks, stores masked): no early return, the
            # partitions all run
            m0, q_start, q_len, k_start, k_len, n_blocks = _segment(cu_q, cu_k, b, valid, pid_m, BLOCK_M, BLOCK_N)
            qn_d, qr_d, kn_d, kr_d, q_row, k_row, h_r, k_rows, v_seg = _tile_descriptors(
                Q, K, KR, V, QN_D, QR_D, KN_D, KR_D, cu_v, valid, b, h, m0, q_start, q_len, k_start, k_len,
                stride_qt, stride_qh, stride_kt, stride_kh, stride_rt, stride_rh, stride_vt, stride_vh,
                BLOCK_M, BLOCK_N, V_T, P_REGS, HOST_DESC, HOST_K)

        qn_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF_M, 128], dt)
        qr_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF_M, 64], dt)
        kn_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, 128], dt)
        kr_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, 64], dt)
        if V_T:
            vt_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([128, BLOCK_N], dt)
            v_s = gl.allocate_shared_memory(dt, [STAGES, 128, BLOCK_N], vt_l)
        else:
            v_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, 128], dt)
            v_s = gl.allocate_shared_memory(dt, [STAGES, BLOCK_N, 128], v_l)
        qn_s = gl.allocate_shared_memory(dt, [2, HALF_M, 128], qn_l)
        qr_s = gl.allocate_shared_memory(dt, [2, HALF_M, 64], qr_l)
        kn_s = gl.allocate_shared_memory(dt, [STAGES, BLOCK_N, 128], kn_l)
        kr_s = gl.allocate_shared_memory(dt, [STAGES, BLOCK_N, 64], kr_l)
        # fp8: each consumer's P goes through shared memory (1 slot x 64 x BLOCK_N bytes)
        # (bf16 keeps P in registers: a token 16 x 16 buffer)
        P_ROWS: gl.constexpr = HALF_M if IS_FP8 and not P_REGS else 16
        P_COLS: gl.constexpr = BLOCK_N if IS_FP8 and not P_REGS else 16
        p_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([P_ROWS, P_COLS], dt)
        p_s = gl.allocate_shared_memory(dt, [2, P_ROWS, P_COLS], p_l)
        q_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        k_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        # K and V slots are freed apart: K once both consumers have their scores, V after P·V
        k_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        # PINGPONG: consumer c's turn at the tensor cores (the other consumer passes it on)
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for c in gl.static_range(2):
            mbarrier.init(q_bar.index(c), count=1)
            mbarrier.init(turn.index(c), count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(k_bar.index(i), count=1)
            mbarrier.init(v_bar.index(i), count=1)
            mbarrier.init(k_free.index(i), count=2)  # both consumers release a slot
            mbarrier.init(v_free.index(i), count=2)

        if PERSIST:
            # PERSIST: consumer c's queries released (after its last scores of a tile)
            q_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
            for c in gl.static_range(2):
                mbarrier.init(q_free.index(c), count=1)
            gl.warp_specialize([
                (_ws_consumer_persist, (qn_s, qr_s, kn_s, kr_s, v_s, p_s, q_bar, k_bar, v_bar, k_free, v_free, turn,
                                        q_free, O, LSE, ORDER, cu_q, cu_k, B, n_heads, m_tiles, n_tiles, stride_ot,
                                        stride_oh, stride_lh, qk_scale, 0, BLOCK_M, BLOCK_N, STAGES, PIPE, IS_FP8,
                                        V_T, EARLY_K, RESCALE_EARLY, PINGPONG, PV_WAIT_LATE, P_REGS, EXP2_POLY,
                                        ARRIVE_NOSYNC, LAZY_RESCALE, USE_ORDER)),
                (_ws_consumer_persist, (qn_s, qr_s, kn_s, kr_s, v_s, p_s, q_bar, k_bar, v_bar, k_free, v_free, turn,
                                        q_free, O, LSE, ORDER, cu_q, cu_k, B, n_heads, m_tiles, n_tiles, stride_ot,
                                        stride_oh, stride_lh, qk_scale, 1, BLOCK_M, BLOCK_N, STAGES, PIPE, IS_FP8,
                                        V_T, EARLY_K, RESCALE_EARLY, PINGPONG, PV_WAIT_LATE, P_REGS, EXP2_POLY,
                                        ARRIVE_NOSYNC, LAZY_RESCALE, USE_ORDER)),
                (_ws_loader_persist, (Q, K, KR, V, QN_D, QR_D, KN_D, KR_D, ORDER, cu_q, cu_k, cu_v, B, n_heads,
                                      m_tiles, n_tiles, Tq, Tk, stride_qt, stride_qh, stride_kt, stride_kh,
                                      stride_rt, stride_rh, stride_vt, stride_vh, qn_s, qr_s, kn_s, kr_s, v_s,
                                      q_bar, k_bar, v_bar, k_free, v_free, q_free, BLOCK_M, BLOCK_N, STAGES, V_T,
                                      P_REGS, HOST_DESC, USE_ORDER)),
            ], [4, 1], [240, 24])
        else:
            gl.warp_specialize([
                (_ws_consumer, (qn_s, qr_s, kn_s, kr_s, v_s, p_s, q_bar, k_bar, v_bar, k_free, v_free, turn, O, LSE,
                                q_start, q_len, m0, k_len, n_blocks, h, stride_ot, stride_oh, stride_lh, qk_scale,
                                0, BLOCK_M, BLOCK_N, STAGES, PIPE, IS_FP8, V_T, EARLY_K, RESCALE_EARLY, PINGPONG,
                                PV_WAIT_LATE, P_REGS, EXP2_POLY, ARRIVE_NOSYNC, LAZY_RESCALE)),
                (_ws_consumer, (qn_s, qr_s, kn_s, kr_s, v_s, p_s, q_bar, k_bar, v_bar, k_free, v_free, turn, O, LSE,
                                q_start, q_len, m0, k_len, n_blocks, h, stride_ot, stride_oh, stride_lh, qk_scale,
                                1, BLOCK_M, BLOCK_N, STAGES, PIPE, IS_FP8, V_T, EARLY_K, RESCALE_EARLY, PINGPONG,
                                PV_WAIT_LATE, P_REGS, EXP2_POLY, ARRIVE_NOSYNC, LAZY_RESCALE)),
                (_ws_loader, (qn_d, qr_d, kn_d, kr_d, v_seg, k_rows, stride_vt, qn_s, qr_s, kn_s, kr_s, v_s,
                              q_bar, k_bar, v_bar, k_free, v_free, q_row, k_row, h, h_r, n_blocks, BLOCK_M, BLOCK_N,
                              STAGES, V_T, P_REGS, HOST_DESC, HOST_K)),
            ], [4, 1], [240, 24])



def p_regs_problem(q: torch.Tensor, k: torch.Tensor, kr: torch.Tensor, v_t: bool) -> str | None:
    """Why ``P_REGS`` cannot run on these inputs (it wants fp8, keys-last V, and K — ``k``,
    ``kr`` — readable for ``P_REGS_SLACK_ROWS`` rows past their last row), or None."""
    need = k.shape[0] + P_REGS_SLACK_ROWS
    short = [f"{n} ({rows_readable(t)} rows readable, {need} needed)" for n, t in (("k", k), ("kr", kr))
             if rows_readable(t) < need]
    if q.dtype.itemsize != 1 or not v_t or short:
        return (f"P_REGS needs fp8 q/k/v, V keys-last and {P_REGS_SLACK_ROWS} rows of K's storage past its last "
                f"row; got q {q.dtype}, keys-last {v_t}, short: {', '.join(short) or 'none'}")
    return None


def check_p_regs(q: torch.Tensor, k: torch.Tensor, kr: torch.Tensor, v_t: bool) -> None:
    """ValueError where :func:`p_regs_problem` finds one."""
    why = p_regs_problem(q, k, kr, v_t)
    if why is not None:
        raise ValueError(why)


def unrunnable(cfg: dict[str, Any], fp8: bool) -> dict[str, str]:
    """The variants ``cfg`` turns on that its other settings cannot carry, each with why
    (the launch refuses them; ``triton_attention.ws_config`` drops them from defaults)."""
    out = {}
    if cfg["ARRIVE_NOSYNC"] and fp8 and not cfg["P_REGS"]:
        out["ARRIVE_NOSYNC"] = ("needs consumers that write no shared memory: bf16, or fp8 with P_REGS "
                                "(fp8 P staged in shared memory is ordered by those barriers)")
    if cfg["LAZY_RESCALE"] and (fp8 or not cfg["PIPE"] or cfg["RESCALE_EARLY"]):
        out["LAZY_RESCALE"] = ("runs in the pipelined bf16 consumer with O rescaled after P·V (fp8's p, scaled "
                               "by 2**8 for its e4m3 cast, has no room for 2**8 more)")
    return out


def launch(q: torch.Tensor, k: torch.Tensor, kr: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
           lse: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, cu_v: torch.Tensor, qk_scale: float,
           grid: tuple[int, int, int], sort_b: int, v_t: bool, config: dict[str, Any] | None = None,
           order: torch.Tensor | None = None, m_tiles: int = 0, p_regs_checked: bool = False) -> None:
    """Launch the kernel on inputs ``triton_attention.mla_context_attention`` validated
    (non-causal; q/k/v with 16-byte aligned bases and strides; ``k`` read for its first
    128 columns, ``kr`` [Tk, H, 64] the rope keys; ``qk_scale`` in log2
    units; ``grid`` (query tiles of BLOCK_M, H, B)). With ``order`` (int32 tile codes on
    the device, ``tile_order``; ``m_tiles`` the query tiles they count with) the launch
    is 1-D, one program per code, in that order. ``p_regs_checked``: the caller has checked
    that these inputs take ``P_REGS`` (``triton_attention.ws_config``), so it is not checked
    again (two storage lookups a tensor, host time of every launch)."""
    cfg = dict(CONFIG, **(config or {}))
    if cfg["P_REGS"] and not p_regs_checked:
        check_p_regs(q, k, kr, v_t)
    if bad := unrunnable(cfg, q.dtype.itemsize == 1):
        raise ValueError("; ".join(f"{key} {why}" for key, why in bad.items()))
    if cfg["EXP2_POLY"] not in (0, 1, 2):
        raise ValueError(f"EXP2_POLY (exp2s of every 8 on the FMA pipes) must be 0, 1 or 2, got {cfg['EXP2_POLY']}")
    H = q.shape[1]
    m_tiles = int(m_tiles) if order is not None else grid[0]
    n_tiles = order.numel() if order is not None else grid[0] * grid[1] * grid[2]
    persist = bool(cfg["PERSIST"])
    if persist:  # one program per SM (or per tile, if fewer), each taking every P-th tile
        grid = (max(1, min(n_tiles, sms(q.device))), 1, 1)
        sort_b = 0
    elif order is not None:
        grid = (n_tiles, 1, 1)
    # no keys or no queries at all: no descriptor over them (TMA wants every size > 0)
    host = bool(cfg["HOST_DESC"]) and q.shape[0] > 0 and k.shape[0] > 0
    descs = _host_descriptors(q, k, kr, cfg) if host else (None, None, None, None)
    _mla_attn_ws_fwd[grid](
        q, k, kr, v, out, lse, *descs, cu_q, cu_k, cu_v, qk_scale, cu_q.numel() - 1,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), kr.stride(0), kr.stride(1),
        v.stride(1) if v_t else v.stride(0), v.stride(0) if v_t else v.stride(1),
        out.stride(0), out.stride(1), lse.stride(0), cu_q if order is None else order, H, max(m_tiles, 1), n_tiles,
        q.shape[0], k.shape[0],
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], STAGES=cfg["STAGES"], PIPE=cfg["PIPE"],
        SORT_B=sort_b, IS_FP8=q.dtype.itemsize == 1, V_T=v_t, EARLY_K=cfg["EARLY_K"],
        USE_ORDER=order is not None, RESCALE_EARLY=cfg["RESCALE_EARLY"], PINGPONG=cfg["PINGPONG"],
        PV_WAIT_LATE=cfg["PV_WAIT_LATE"], P_REGS=cfg["P_REGS"], EXP2_POLY=cfg["EXP2_POLY"], HOST_DESC=host,
        ARRIVE_NOSYNC=bool(cfg["ARRIVE_NOSYNC"]), LAZY_RESCALE=bool(cfg["LAZY_RESCALE"]), PERSIST=persist, num_warps=4,
        maxnreg=_MAXNREG,
    )


def _host_descriptors(q: torch.Tensor, k: torch.Tensor, kr: torch.Tensor,
                      cfg: dict[str, Any]) -> tuple[Any, Any, Any, Any]:
    """``HOST_DESC``'s launch-wide TMA descriptors (QN_D, QR_D, KN_D, KR_D): q [Tq, H, 192]
    in boxes of [64, 1, 128] and [64, 1, 64]; k's first 128 columns and kr [Tk, H or 1, 64]
    in boxes of [BLOCK_N, 1, cols] (None for K under ``P_REGS``, whose 5-D boxes start at a
    segment)."""
    fp8 = q.dtype.itemsize == 1
    half, bn = cfg["BLOCK_M"] // 2, cfg["BLOCK_N"]

    def desc(t: torch.Tensor, shape: list[int], strides: list[int], box: list[int]) -> Any:
        return TensorDescriptor(t, shape, strides, box, _box_layout(tuple(box), fp8))

    Tq, H = q.shape[0], q.shape[1]
    qs = [q.stride(0), q.stride(1), 1]
    qn = desc(q, [Tq, H, 192], qs, [half, 1, 128])
    qr = desc(q, [Tq, H, 192], qs, [half, 1, 64])
    if cfg["P_REGS"]:
        return qn, qr, None, None
    Tk = k.shape[0]
    kn = desc(k, [Tk, H, 128], [k.stride(0), k.stride(1), 1], [bn, 1, 128])
    # rope keys shared by the heads (head stride 0): one head, its stride any aligned value
    shared = kr.stride(1) == 0
    krd = desc(kr, [Tk, 1 if shared else H, 64], [kr.stride(0), 64 if shared else kr.stride(1), 1], [bn, 1, 64])
    return qn, qr, kn, krd


@functools.cache
def sms(device: torch.device | str) -> int:
    """The device's SM count (``PERSIST``'s programs; ``tile_order``'s lists)."""
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


@functools.cache
def _box_layout(box: tuple[int, ...], fp8: bool) -> Any:
    """The shared-memory layout of a TMA box, computed once (several µs of host time each)."""
    return gl.NVMMASharedLayout.get_default_for(list(box), gl.float8e4nv if fp8 else gl.bfloat16)
