"""``kv_b_proj``'s bf16 GEMM as a persistent warp-specialized Hopper kernel (Gluon).

``y [M, N] = latent [M, K] · weight [N, K]ᵀ``, bf16 in and out, fp32 accumulation — what
:func:`ops.kv_b_proj.kv_b_proj` computes for a bf16 weight through cuBLAS. Its reduction
is short (K = 512: eight 64-wide steps a tile), so a tile's prologue (its first loads)
and epilogue (storing 128 × 256 bf16) are long next to its main loop; a kernel that runs
them in series with the MMAs leaves the tensor cores idle for them (cuBLAS runs these
shapes well below a large GEMM's rate: ``bench/probe_gemm.py``).

One program per SM walks its tiles (``GROUP_M`` rows of tiles at a time, so that
neighbouring programs share the weight's columns in L2), three partitions:

* a loader warp streams A and B of every k-step of every tile into a ring of ``STAGES``
  shared-memory slots, running ahead across tiles: the next tile's first steps are
  loaded while this tile's last ones are multiplied;
* two consumer warpgroups multiply from the slots (wgmma, one group in flight), free the
  slot the group before read, and store their result through shared memory
  (``stmatrix``) with an asynchronous TMA store that drains while the next MMAs run.
  Cooperative (the default), each owns 64 rows of every 128 × ``BN`` tile, both reading
  the same B; ``PINGPONG`` (CUTLASS's name), each owns every other tile whole and their
  main loops take turns (an mbarrier each), so that one's epilogue can run under the
  other's MMAs, at the price of a narrower tile (128 × 128: the accumulator of a whole
  128 × 256 tile would be 256 registers a thread). ``STORE_UNDER_MMA`` keeps a
  cooperative consumer's result in registers as bf16 (64 a thread beside the next
  accumulator's 128) and stores it once the next tile's first two k-steps are issued, so
  that the store runs under MMAs instead of between them.

Shared memory: ``STAGES`` × (A 16 KiB + B ``BN`` × 128 B) + 2 consumers' results (2 × 64
× ``BN`` × 2 B cooperative, 2 × 128 × ``BN`` × 2 B ping-pong): 208 KiB at ``BN`` 256 in 3
stages, 192 KiB ping-pong at ``BN`` 128 in 4. Registers: the loader gives its budget to
the consumers (``setmaxnreg`` 24 / 240; each accumulator 128 fp32 a thread).
Opt-in (``EngineConfig.kv_b_proj_gemm``): ``bench/probe_gemm.py`` times it against cuBLAS in one
process, and on the engine's 16k-row chunks cuBLAS leads (docs/DESIGN.md).

:func:`launch_paged` is the same kernel with another loader: the chunk's latents are read
where they lie in the paged cache — each 64-row half of an A tile by one TMA load from
its run of cache slots, looked up from the block table by the loader — and the rows' k_pe
copied into the workspace on the way (a TMA load and store per row of tiles), which folds
the chunk's gather into the GEMM (``kv_b_proj_gemm = "paged"``).
"""

from __future__ import annotations

import functools
from typing import Any, no_type_check

import torch

from ._gluon import (
    GLUON_ERR,
    fence_async_shared,
    gl,
    gluon,
    mbarrier,
    tma,
    tma_scratch,
    triton,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from .kv_b_proj import PAGE_ROWS

__all__ = ["CONFIG", "GLUON_ERR", "TUNING", "kv_b_proj_gluon", "launch", "launch_paged", "paged_problem", "problem"]

#: BM: a tile's rows (64 for each consumer; with PINGPONG, one consumer's); BN, STAGES,
#: GROUP_M, PINGPONG, STORE_UNDER_MMA: the knobs bench/probe_gemm.py tries
CONFIG: dict[str, Any] = dict(BM=128, BN=256, BK=64, STAGES=3, GROUP_M=8, PINGPONG=False, STORE_UNDER_MMA=False)
#: the configurations bench/probe_gemm.py times (changes to CONFIG), each tested on the GPU
TUNING: list[dict[str, Any]] = [{}, dict(STORE_UNDER_MMA=True), dict(BN=128, STAGES=5),
                                dict(BN=128, STAGES=4, PINGPONG=True), dict(BN=128, STAGES=5, PINGPONG=True, GROUP_M=4)]
#: launch: 4 + 4 + 1 warps with 168 registers a thread (3 x 128 x 168 <= 65,536), then
#: ``setmaxnreg`` moves them: loader 24, consumers 240
_MAXNREG = 168

if gluon is not None:

    @gluon.jit
    @no_type_check
    def _tile(t, num_m, num_n, BM: gl.constexpr, BN: gl.constexpr, GROUP_M: gl.constexpr):
        """Tile t's (first row, first column): ``GROUP_M`` tile rows walked column by column."""
        per_group = GROUP_M * num_n
        first_m = (t // per_group) * GROUP_M
        rows = gl.minimum(num_m - first_m, GROUP_M)
        return (first_m + t % rows) * BM, ((t % per_group) // rows) * BN

    @gluon.jit
    @no_type_check
    def _gemm_loader(a_d, b_d, a_s, b_s, ready, free, M, N, K,
                     BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
                     GROUP_M: gl.constexpr):
        num_m = gl.cdiv(M, BM)
        num_n = gl.cdiv(N, BN)
        k_steps = gl.cdiv(K, BK)
        g = 0  # k-steps issued by this program: slot g % STAGES, its use (g // STAGES)
        for t in range(gl.program_id(0), num_m * num_n, gl.num_programs(0)):
            om, on = _tile(t, num_m, num_n, BM, BN, GROUP_M)
            for kk in range(k_steps):
                s = g % STAGES
                mbarrier.wait(free.index(s), ((g // STAGES) & 1) ^ 1)
                bar = ready.index(s)
                mbarrier.expect(bar, a_d.block_type.nbytes + b_d.block_type.nbytes)
                tma.async_copy_global_to_shared(a_d, [om, kk * BK], bar, a_s.index(s))
                tma.async_copy_global_to_shared(b_d, [on, kk * BK], bar, b_s.index(s))
                g += 1

    @gluon.jit
    @no_type_check
    def _store_tile(acc, c_buf, c_d, row, col):
        """A consumer's result tile (bf16, in registers) to [row, col] of the output, through
        c_buf (``stmatrix``) and an asynchronous TMA store."""
        tma.store_wait(0)  # the previous tile's store has left c_buf
        c_buf.store(acc)
        fence_async_shared()
        tma.async_copy_shared_to_global(c_d, [row, col], c_buf)

    @gluon.jit
    @no_type_check
    def _gemm_consumer(a_s, b_s, c_s, ready, free, turn, c_d, M, N, K, C: gl.constexpr,
                       BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
                       GROUP_M: gl.constexpr, PINGPONG: gl.constexpr, STORE_UNDER_MMA: gl.constexpr):
        # cooperative: 64 rows of every tile; PINGPONG: every other tile whole, the two
        # consumers' main loops taking turns (one's epilogue under the other's MMAs);
        # STORE_UNDER_MMA: a tile's result kept in registers as bf16 and stored while the
        # next tile's first two k-steps run on the tensor cores
        ROWS: gl.constexpr = BM if PINGPONG else BM // 2
        STEP: gl.constexpr = 2 if PINGPONG else 1
        FIRST: gl.constexpr = C if PINGPONG else 0
        acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BN, 16])
        num_m = gl.cdiv(M, BM)
        num_n = gl.cdiv(N, BN)
        k_steps = gl.cdiv(K, BK)
        store_at = gl.minimum(k_steps - 1, 1)  # STORE_UNDER_MMA: after issuing this k-step's MMA
        c_buf = c_s.index(C)
        held = gl.zeros([ROWS, BN], gl.bfloat16, acc_l)  # STORE_UNDER_MMA: the last tile's result
        held_row = 0
        held_col = 0
        acc = gl.zeros([ROWS, BN], gl.float32, acc_l)  # each tile's first MMA ignores it (use_acc)
        i = FIRST  # this program's tile count: its k-steps start at ring position i * k_steps
        for t in range(gl.program_id(0) + FIRST * gl.num_programs(0), num_m * num_n, STEP * gl.num_programs(0)):
            om, on = _tile(t, num_m, num_n, BM, BN, GROUP_M)
            g = i * k_steps
            if PINGPONG:  # this consumer's n-th turn, n = i // 2 (consumer 0's first is free)
                mbarrier.wait(turn.index(C), ((i // 2) & 1) ^ (1 - C))
            for kk in range(k_steps):
                s = g % STAGES
                mbarrier.wait(ready.index(s), (g // STAGES) & 1)
                if PINGPONG:
                    a = a_s.index(s)
                else:
                    a = a_s.index(s).slice(C * ROWS, ROWS)
                acc = warpgroup_mma(a, b_s.index(s).permute((1, 0)), acc, use_acc=kk > 0, is_async=True)
                if STORE_UNDER_MMA:
                    if kk == store_at and i > FIRST:
                        _store_tile(held, c_buf, c_d, held_row, held_col)
                acc = warpgroup_mma_wait(1, deps=(acc, ))
                if kk > 0:  # the group before is done: its slot is free (for this consumer)
                    mbarrier.arrive(free.index((g - 1) % STAGES), count=1)
                g += 1
            acc = warpgroup_mma_wait(0, deps=(acc, ))
            mbarrier.arrive(free.index((g - 1) % STAGES), count=1)
            if PINGPONG:  # the tensor cores to the other consumer
                mbarrier.arrive(turn.index(1 - C), count=1)
            if STORE_UNDER_MMA:
                held = acc.to(gl.bfloat16)
                held_row = om + (C - FIRST) * ROWS
                held_col = on
            else:
                _store_tile(acc.to(gl.bfloat16), c_buf, c_d, om + (C - FIRST) * ROWS, on)
            i += STEP
        if STORE_UNDER_MMA:
            if i > FIRST:  # the last tile's result
                _store_tile(held, c_buf, c_d, held_row, held_col)
        tma.store_wait(0)

    # a chunk's rows vary per request: not specialized (1 or a multiple of 16 would compile
    # another variant on a request's path)
    @gluon.jit(do_not_specialize=["M"])
    @no_type_check
    def _kv_b_proj_ws(A, B, Y, M, N, K, stride_am, stride_bn, stride_ym,
                      BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
                      GROUP_M: gl.constexpr, PINGPONG: gl.constexpr, STORE_UNDER_MMA: gl.constexpr):
        ROWS: gl.constexpr = BM if PINGPONG else BM // 2  # a consumer's rows of a tile
        a_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, BK], gl.bfloat16)
        b_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, BK], gl.bfloat16)
        c_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, BN], gl.bfloat16)
        # loads past M, N or K read zeros; stores past M or N are dropped
        a_d = tma.make_tensor_descriptor(A, [M, K], [stride_am, 1], [BM, BK], a_l)
        b_d = tma.make_tensor_descriptor(B, [N, K], [stride_bn, 1], [BN, BK], b_l)
        c_d = tma.make_tensor_descriptor(Y, [M, N], [stride_ym, 1], [ROWS, BN], c_l)
        a_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BM, BK], a_l)
        b_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BN, BK], b_l)
        c_s = gl.allocate_shared_memory(gl.bfloat16, [2, ROWS, BN], c_l)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(free.index(i), count=1 if PINGPONG else 2)  # the consumers that read a slot
        for c in gl.static_range(2):
            mbarrier.init(turn.index(c), count=1)
        gl.warp_specialize([
            (_gemm_consumer, (a_s, b_s, c_s, ready, free, turn, c_d, M, N, K, 0, BM, BN, BK, STAGES, GROUP_M,
                              PINGPONG, STORE_UNDER_MMA)),
            (_gemm_consumer, (a_s, b_s, c_s, ready, free, turn, c_d, M, N, K, 1, BM, BN, BK, STAGES, GROUP_M,
                              PINGPONG, STORE_UNDER_MMA)),
            (_gemm_loader, (a_d, b_d, a_s, b_s, ready, free, M, N, K, BM, BN, BK, STAGES, GROUP_M)),
        ], [4, 1], [240, 24])


    @gluon.jit
    @no_type_check
    def _cache_slot(r, M, BT, stride_bt, CU, ST, n_seqs, block_size):
        """The cache slot of chunk row ``r`` (0 past the chunk's M rows): its sequence b (the
        last whose first row is at most r), its context token j, j's block's id."""
        rc = gl.minimum(r, M - 1)  # a row past the chunk looks up its last row's (read only in range)
        b = 0
        for i in range(1, n_seqs):
            b += (gl.load(CU + i) <= rc).to(gl.int32)
        j = gl.load(ST + b) + rc - gl.load(CU + b)
        blk = gl.load(BT + b * stride_bt + j // block_size)
        return gl.where(r < M, blk * block_size + j % block_size, 0)

    @gluon.jit
    @no_type_check
    def _paged_loader(a_d, b_d, kin_d, kout_d, a_s, b_s, k_s, ready, free, kbar, BT, stride_bt, CU, ST, n_seqs,
                      block_size, M, N, K, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
                      STAGES: gl.constexpr, GROUP_M: gl.constexpr):
        # _gemm_loader with A read from the paged cache: each half of a tile (64 rows, in one
        # cache block: paged_problem, chunk_pages_aligned) from its slot; once per row of tiles (its first
        # column) the rows' k_pe copied from the cache into the workspace beside the latent
        HALF: gl.constexpr = BM // 2
        num_m = gl.cdiv(M, BM)
        num_n = gl.cdiv(N, BN)
        k_steps = gl.cdiv(K, BK)
        g = 0
        kp = 0  # k_pe copies made: kbar's phase
        for t in range(gl.program_id(0), num_m * num_n, gl.num_programs(0)):
            om, on = _tile(t, num_m, num_n, BM, BN, GROUP_M)
            s0 = _cache_slot(om, M, BT, stride_bt, CU, ST, n_seqs, block_size)
            s1 = _cache_slot(om + HALF, M, BT, stride_bt, CU, ST, n_seqs, block_size)
            for kk in range(k_steps):
                s = g % STAGES
                mbarrier.wait(free.index(s), ((g // STAGES) & 1) ^ 1)
                bar = ready.index(s)
                mbarrier.expect(bar, 2 * a_d.block_type.nbytes + b_d.block_type.nbytes)
                tma.async_copy_global_to_shared(a_d, [s0, kk * BK], bar, a_s.index(s).slice(0, HALF))
                tma.async_copy_global_to_shared(a_d, [s1, kk * BK], bar, a_s.index(s).slice(HALF, HALF))
                tma.async_copy_global_to_shared(b_d, [on, kk * BK], bar, b_s.index(s))
                g += 1
            if on == 0:
                tma.store_wait(0)  # the previous rows' k_pe has left k_s
                mbarrier.expect(kbar, 2 * kin_d.block_type.nbytes)
                tma.async_copy_global_to_shared(kin_d, [s0, 0], kbar, k_s.slice(0, HALF))
                tma.async_copy_global_to_shared(kin_d, [s1, 0], kbar, k_s.slice(HALF, HALF))
                mbarrier.wait(kbar, kp & 1)
                kp += 1
                tma.async_copy_shared_to_global(kout_d, [om, 0], k_s.slice(0, HALF))
                tma.async_copy_shared_to_global(kout_d, [om + HALF, 0], k_s.slice(HALF, HALF))
        tma.store_wait(0)

    # rows, sequences, the block table's width and the metadata's addresses vary per request
    @gluon.jit(do_not_specialize=["M", "n_seqs", "stride_bt"], do_not_specialize_on_alignment=["BT", "CU", "ST"])
    @no_type_check
    def _kv_b_proj_paged_ws(A, KIN, B, Y, KOUT, BT, CU, ST, M, N, K, num_slots, n_seqs, block_size, stride_slot,
                            stride_bn, stride_ym, stride_ws, stride_bt,
                            BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
                            GROUP_M: gl.constexpr, PINGPONG: gl.constexpr, STORE_UNDER_MMA: gl.constexpr):
        HALF: gl.constexpr = BM // 2
        ROWS: gl.constexpr = BM if PINGPONG else BM // 2
        a_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, BK], gl.bfloat16)
        b_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, BK], gl.bfloat16)
        c_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, BN], gl.bfloat16)
        k_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, 64], gl.bfloat16)
        # A: the cache's latents [num_slots, K] (rows stride_slot apart); KIN its k_pe
        # [num_slots, 64]; KOUT the workspace's k_pe [M, 64] (stores past M are dropped)
        a_d = tma.make_tensor_descriptor(A, [num_slots, K], [stride_slot, 1], [HALF, BK], a_l)
        b_d = tma.make_tensor_descriptor(B, [N, K], [stride_bn, 1], [BN, BK], b_l)
        c_d = tma.make_tensor_descriptor(Y, [M, N], [stride_ym, 1], [ROWS, BN], c_l)
        kin_d = tma.make_tensor_descriptor(KIN, [num_slots, 64], [stride_slot, 1], [HALF, 64], k_l)
        kout_d = tma.make_tensor_descriptor(KOUT, [M, 64], [stride_ws, 1], [HALF, 64], k_l)
        a_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BM, BK], a_l)
        b_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BN, BK], b_l)
        c_s = gl.allocate_shared_memory(gl.bfloat16, [2, ROWS, BN], c_l)
        k_s = gl.allocate_shared_memory(gl.bfloat16, [BM, 64], k_l)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        kbar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(free.index(i), count=1 if PINGPONG else 2)
        for c in gl.static_range(2):
            mbarrier.init(turn.index(c), count=1)
        mbarrier.init(kbar, count=1)
        gl.warp_specialize([
            (_gemm_consumer, (a_s, b_s, c_s, ready, free, turn, c_d, M, N, K, 0, BM, BN, BK, STAGES, GROUP_M,
                              PINGPONG, STORE_UNDER_MMA)),
            (_gemm_consumer, (a_s, b_s, c_s, ready, free, turn, c_d, M, N, K, 1, BM, BN, BK, STAGES, GROUP_M,
                              PINGPONG, STORE_UNDER_MMA)),
            (_paged_loader, (a_d, b_d, kin_d, kout_d, a_s, b_s, k_s, ready, free, kbar, BT, stride_bt, CU, ST,
                             n_seqs, block_size, M, N, K, BM, BN, BK, STAGES, GROUP_M)),
        ], [4, 1], [240, 24])


@functools.cache
def _device_facts(index: int) -> tuple[int, int]:
    """(compute capability's major, SM count) of CUDA device ``index``: looked up once (each
    lookup costs the host microseconds, and kv_b_proj runs once a chunk)."""
    return torch.cuda.get_device_capability(index)[0], torch.cuda.get_device_properties(index).multi_processor_count


def _tma_rows(t: torch.Tensor) -> bool:
    """Whether bf16 ``t``'s rows can go through TMA: contiguous, 16-byte aligned base and stride."""
    return not t.numel() or (t.stride(1) == 1 and (t.stride(0) * 2) % 16 == 0 and t.data_ptr() % 16 == 0)


def problem(latent: torch.Tensor, weight: torch.Tensor) -> str | None:
    """Why the kernel cannot take these operands, or None: bf16 on a Hopper GPU, 2-D, rows
    contiguous, row strides and the base 16-byte aligned (TMA's terms)."""
    if GLUON_ERR:
        return GLUON_ERR
    if latent.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16:
        return f"needs bf16 latent and weight, got {latent.dtype} and {weight.dtype}"
    if latent.dim() != 2 or weight.dim() != 2 or latent.shape[1] != weight.shape[1]:
        return f"needs latent [M, K] and weight [N, K], got {list(latent.shape)} and {list(weight.shape)}"
    if latent.device.type != "cuda" or weight.device != latent.device or _device_facts(latent.get_device())[0] != 9:
        return f"needs both on one Hopper GPU, got {latent.device} and {weight.device}"
    for name, t in (("latent", latent), ("weight", weight)):
        if not _tma_rows(t):
            return f"{name}: rows must be contiguous, 16-byte aligned, with a 16-byte multiple stride"
    return None


def kv_b_proj_gluon(latent: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None,
                    config: dict[str, Any] | None = None) -> torch.Tensor:
    """latent [M, K] bf16, weight [N, K] bf16 (both rows contiguous) -> [M, N] bf16
    (``out`` where given: [M, N] bf16, rows contiguous), accumulated in fp32.
    ValueError where :func:`problem` finds one."""
    why = problem(latent, weight)
    if why is not None:
        raise ValueError(f"kv_b_proj_gluon: {why}")
    M, N = latent.shape[0], weight.shape[0]
    if out is not None and (out.shape != (M, N) or out.dtype != torch.bfloat16 or out.device != latent.device
                            or not _tma_rows(out)):
        raise ValueError(f"kv_b_proj_gluon: out must be [{M}, {N}] bf16 on {latent.device} with contiguous, "
                         f"16-byte aligned rows; got {list(out.shape)} {out.dtype} on {out.device}, strides "
                         f"{out.stride()}")
    return launch(latent, weight, out, config)


def launch(latent: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None,
           config: dict[str, Any] | None = None) -> torch.Tensor:
    """:func:`kv_b_proj_gluon` on operands :func:`problem` accepted (and a checked ``out``),
    without checking them again."""
    cfg = dict(CONFIG, **(config or {}))
    M, K = latent.shape
    N = weight.shape[0]
    if out is None:
        out = torch.empty((M, N), dtype=torch.bfloat16, device=latent.device)
    if M == 0 or N == 0:
        return out
    if K == 0:  # an empty sum
        return out.zero_()
    _launch_persistent(_kv_b_proj_ws, M, N, latent.get_device(), cfg,
                       latent, weight, out, M, N, K, latent.stride(0), weight.stride(0), out.stride(0))
    return out


def _launch_persistent(kernel: Any, M: int, N: int, device: int, cfg: dict[str, Any], *args: Any) -> None:
    """Launch one of the GEMM kernels over an [M, N] output: a program per tile, at most one
    per SM of CUDA device ``device`` (each loops over tiles), ``cfg``'s knobs as constexprs."""
    tiles = -(-M // cfg["BM"]) * -(-N // cfg["BN"])
    sms = _device_facts(device)[1]
    triton.set_allocator(tma_scratch)  # a ContextVar: set in the calling thread, every call
    kernel[(min(sms, tiles),)](*args, BM=cfg["BM"], BN=cfg["BN"], BK=cfg["BK"], STAGES=cfg["STAGES"],
                               GROUP_M=cfg["GROUP_M"], PINGPONG=cfg["PINGPONG"],
                               STORE_UNDER_MMA=cfg["STORE_UNDER_MMA"], num_warps=4, maxnreg=_MAXNREG)


def paged_problem(cache: torch.Tensor, weight: torch.Tensor, block_size: int) -> str | None:
    """Why :func:`launch_paged` cannot read ``cache`` (a bf16 cache's bytes, uint8
    ``[num_slots, 1152]``) with ``weight``, or None. A chunk must also have its
    sequences' starts on multiples of ``PAGE_ROWS`` (``kv_b_proj.chunk_pages_aligned``)."""
    if GLUON_ERR:
        return GLUON_ERR
    width = 2 * (weight.shape[1] + 64)
    if cache.dim() != 2 or cache.dtype != torch.uint8 or cache.shape[1] != width:
        return f"needs a bf16 cache's bytes [slots, {width}], got {cache.dtype} {list(cache.shape)}"
    if block_size % PAGE_ROWS:
        return f"needs a block size that is a multiple of {PAGE_ROWS}, got {block_size}"
    view = cache.view(torch.bfloat16)
    return problem(view[:, : weight.shape[1]], weight)


def launch_paged(cache: torch.Tensor, block_table: torch.Tensor, cu_rows: torch.Tensor, context_starts: torch.Tensor,
                 block_size: int, workspace: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The chunk's gather and ``kv_b_proj`` in one launch: ``out [M, N] = latent · weightᵀ``
    with the latent of chunk row r read from its cache slot (row r of sequence b is context
    token ``context_starts[b] + r - cu_rows[b]``, in block ``block_table[b, j // block_size]``)
    instead of from a gathered workspace, and each row's k_pe copied to
    ``workspace[r, K:K+64]`` on the way, where the gather would have put it.

    cache: uint8 [num_slots, 2·(K+64)], a bf16 cache (:func:`paged_problem` accepted it);
    block_table: int32 [B, max_blocks], rows contiguous; cu_rows: int32 [B+1]; context_starts:
    int32 [B]; workspace: bf16 [M, K+64], rows contiguous; weight: bf16 [N, K]. Every
    sequence starts on a multiple of PAGE_ROWS (``kv_b_proj.chunk_pages_aligned``). Same bits as
    :func:`launch` on the gathered latent in its default configuration (the same tiles, the
    same k-steps)."""
    view = cache.view(torch.bfloat16)  # [num_slots, K + 64]
    M, N, K = workspace.shape[0], weight.shape[0], weight.shape[1]
    out = torch.empty((M, N), dtype=torch.bfloat16, device=cache.device)
    if M == 0 or N == 0:
        return out
    _launch_persistent(_kv_b_proj_paged_ws, M, N, cache.get_device(), CONFIG,
                       view, view[:, K:], weight, out, workspace[:, K:], block_table, cu_rows, context_starts,
                       M, N, K, view.shape[0], cu_rows.shape[0] - 1, block_size, view.stride(0),
                       weight.stride(0), out.stride(0), workspace.stride(0), block_table.stride(0))
    return out
