// The fused MLA K/V pack (CONTRACT §5, §6): one launch per chunk, reading the strided
// halves of the kv_b_proj output and the strided k_pe view of the workspace
// directly — no expand, no cat, no intermediate copies.
//
//   fused_mla_kv_concat:            k[t,h] = [k_nope[t,h] | k_pe[t]]          (bf16/fp16)
//   fused_mla_kv_concat_quant_fp8:  k8[t,h] = sat_e4m3([k_nope[t,h] | k_pe[t]]),
//                                   v8[t,h] = sat_e4m3(v[t,h])                 (bytes)
//
// bf16/fp16 (kv_concat_kernel): a warp per segment of a token's k rows; each warp
// instruction stores 512 contiguous bytes, as a copy does, every load of the segment in
// flight before its first store, each lane's one k_pe chunk held in a register
// (90.6-91.2 % of copy bandwidth at T*H >= 2^20 on an H200; see the kernel).
//
// fp8 work decomposition. One work item = (token t, 16-byte output chunk c of one head
// row). A thread owns an item and walks the heads h = 0..H-1 with HB heads in
// flight per step: for a k_nope / v chunk it loads and stores per head; for a k_pe
// chunk it loads (and converts) the k_pe piece ONCE per token and stores it to all
// H heads from registers (the broadcast). Adjacent lanes own adjacent chunks, so
// loads and stores are coalesced 16-byte accesses. With few heads (H < HB) a
// thread takes IB items per step instead, so that IB*HB accesses are always in
// flight per thread. Grid capped at one resident wave, grid-stride beyond.
//
// bf16: 24 chunks per head row (16 of k_nope, 8 of k_pe), 8 elements each.
// fp8 : 20 chunks per head row, 16 fp8 bytes each: 8 k_nope + 4 k_pe -> k8 row
//       (192 B), 8 v -> v8 row (128 B). A 16-value chunk reads two 16-byte loads.
// fp8 cast: __nv_cvt_float2_to_fp8x2 / __nv_cvt_halfraw2_to_fp8x2 with
// __NV_SATFINITE, __NV_E4M3 (see common.cuh) == x.clamp(-448,448).to(e4m3fn).

#include <algorithm>
#include <cstdint>

#include "common.cuh"

namespace ctxprefill {
namespace {

using dev::ld16;
using dev::st16;

// ---- bf16 / fp16 concat ---------------------------------------------------------------
// A warp writes a segment of one token's k rows: U store instructions, each 512
// contiguous bytes of the token's 24 * H chunks. Chunk qc of a token is head qc / 24,
// column c = qc % 24; since 32 = 8 (mod 24) and a segment starts at a multiple of 32
// chunks, c = lane (mod 8) in every instruction of lane `lane`: the only k_pe chunk a
// lane ever writes is chunk lane % 8, loaded once per segment into a register (a flat
// run of chunks would reload it per head: a third of the load instructions, cache
// hits). A work item is one segment of U instructions, not a whole token, so that the
// grid-stride loop balances finely at any H. On an H200 (bench_kernels, side by side):
// U = 4 segments 90.6-91.2 % of copy at T*H >= 2^20, whole tokens 88.1-90.7, a flat
// run 87.1-87.4; non-coherent / no-allocate loads with evict-first stores and U = 16
// were no better.
template <int A, int U>
__global__ void __launch_bounds__(dev::kThreads, 3)  // as measured (60 registers, 4 blocks per SM)
kv_concat_kernel(const uint16_t* __restrict__ kn, int64_t kn_s0, int64_t kn_s1,
                 const uint16_t* __restrict__ pe, int64_t pe_s0, uint16_t* __restrict__ k, int64_t T, int H) {
  constexpr int C = kQK / 8;     // 24 chunks per head row
  constexpr int CN = kNope / 8;  // 16 of them from k_nope
  static_assert(C % 8 == 0 && C - CN == 8, "lane % 8 is the k_pe chunk of every instruction");
  const int lane = threadIdx.x & 31;
  const int64_t warp = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const int64_t nwarps = ((int64_t)gridDim.x * blockDim.x) >> 5;
  const int Q = C * H;               // chunks per token
  const int I = (Q + 31) / 32;       // store instructions per token
  const int S = (I + U - 1) / U;     // segments per token
  const int64_t items = T * S;
  for (int64_t it = warp; it < items; it += nwarps) {
    const int64_t t = it / S;
    const int s = (int)(it - t * S);
    const uint4 p = ld16<A>(pe + t * pe_s0 + (lane & 7) * 8);
    const uint16_t* src = kn + t * kn_s0;
    uint16_t* dst = k + t * (int64_t)Q * 8;
    // one pass of U instructions, written as a loop: the compiler schedules it
    // differently from straight-line code (60 registers against 45), and the
    // 60-register build is the one that reaches 90.6-91.2 %
    const int i_end = min(I, (s + 1) * U);
    for (int i0 = s * U; i0 < i_end; i0 += U) {
      uint4 v[U];
#pragma unroll
      for (int j = 0; j < U; ++j) {  // every load of the segment before its first store
        const int qc = 32 * (i0 + j) + lane;
        const int h = qc / C, c = qc - h * C;
        v[j] = p;
        if (qc < Q && c < CN) v[j] = ld16<A>(src + (int64_t)h * kn_s1 + c * 8);
      }
#pragma unroll
      for (int j = 0; j < U; ++j) {
        const int qc = 32 * (i0 + j) + lane;
        if (qc < Q) st16<A>(dst + (int64_t)qc * 8, v[j]);
      }
    }
  }
}

// ---- fp8 quantizing concat -----------------------------------------------------------
// The work items of one thread, `first` and every `S`-th after it. WITH_V: the v8 row
// chunks are items too (20 per head row); without, only k8's 12 (the keys-last kernel
// below writes v8 its own way).
template <int A, bool FP16, bool PE_FP8, int IB, int HB, bool WITH_V>
__device__ __forceinline__ void quant_items(const uint16_t* __restrict__ kn, int64_t kn_s0, int64_t kn_s1,
                                            const void* __restrict__ pe, int64_t pe_s0,
                                            const uint16_t* __restrict__ vv, int64_t v_s0, int64_t v_s1,
                                            uint8_t* __restrict__ k8, uint8_t* __restrict__ v8, int64_t T, int H,
                                            int64_t first, int64_t S, int64_t limit = INT64_MAX) {
  constexpr int UKN = kNope / 16;      // 8 k_nope chunks of 16 values
  constexpr int UPE = kRope / 16;      // 4 k_pe chunks
  constexpr int UK = UKN + UPE;        // 12 chunks per k8 row (192 B)
  constexpr int UV = kV / 16;          // 8 chunks per v8 row (128 B)
  constexpr int U = WITH_V ? UK + UV : UK;  // 20 (or 12)
  const int64_t NG = (H + HB - 1) / HB;
  const int64_t items = min(T * NG * U, limit);  // limit: the end of one work unit (keys-last kernel)
  for (int64_t base = first; base < items; base += IB * S) {
    int64_t t[IB];
    int c[IB], h0[IB];
    bool ok[IB];
    uint4 pv[IB];
#pragma unroll
    for (int i = 0; i < IB; ++i) {
      const int64_t it = base + i * S;
      ok[i] = it < items;
      const int64_t r = it / U;
      c[i] = (int)(it - r * U);
      t[i] = r / NG;
      h0[i] = (int)(r - t[i] * NG) * HB;
      pv[i] = make_uint4(0u, 0u, 0u, 0u);
      if (ok[i] && c[i] >= UKN && c[i] < UK) {  // k_pe chunk: read and convert once for HB heads
        const int64_t off = t[i] * pe_s0 + (c[i] - UKN) * 16;
        if constexpr (PE_FP8) {
          pv[i] = ld16<A>(static_cast<const uint8_t*>(pe) + off);
        } else {
          const uint16_t* p = static_cast<const uint16_t*>(pe) + off;
          pv[i] = dev::e4m3x16_from_16bit<FP16>(ld16<A>(p), ld16<A>(p + 8));
        }
      }
    }
    uint4 lo[IB][HB], hi[IB][HB];
#pragma unroll
    for (int i = 0; i < IB; ++i)
#pragma unroll
      for (int j = 0; j < HB; ++j) {
        const int h = h0[i] + j;
        lo[i][j] = hi[i][j] = make_uint4(0u, 0u, 0u, 0u);
        if (ok[i] && h < H && (c[i] < UKN || c[i] >= UK)) {
          const uint16_t* p = c[i] < UKN ? kn + t[i] * kn_s0 + (int64_t)h * kn_s1 + c[i] * 16
                                         : vv + t[i] * v_s0 + (int64_t)h * v_s1 + (c[i] - UK) * 16;
          lo[i][j] = ld16<A>(p);
          hi[i][j] = ld16<A>(p + 8);
        }
      }
#pragma unroll
    for (int i = 0; i < IB; ++i)
#pragma unroll
      for (int j = 0; j < HB; ++j) {
        const int h = h0[i] + j;
        if (!(ok[i] && h < H)) continue;
        const int64_t row = t[i] * H + h;
        if (c[i] < UK) {
          const uint4 o = c[i] < UKN ? dev::e4m3x16_from_16bit<FP16>(lo[i][j], hi[i][j]) : pv[i];
          st16<16>(k8 + row * kQK + c[i] * 16, o);
        } else if constexpr (WITH_V) {
          st16<16>(v8 + row * kV + (c[i] - UK) * 16, dev::e4m3x16_from_16bit<FP16>(lo[i][j], hi[i][j]));
        }
      }
  }
}

template <int A, bool FP16, bool PE_FP8, int IB, int HB>
__global__ void __launch_bounds__(dev::kThreads, 2)
kv_concat_quant_kernel(const uint16_t* __restrict__ kn, int64_t kn_s0, int64_t kn_s1,
                       const void* __restrict__ pe, int64_t pe_s0,
                       const uint16_t* __restrict__ vv, int64_t v_s0, int64_t v_s1,
                       uint8_t* __restrict__ k8, uint8_t* __restrict__ v8, int64_t T, int H) {
  quant_items<A, FP16, PE_FP8, IB, HB, true>(kn, kn_s0, kn_s1, pe, pe_s0, vv, v_s0, v_s1, k8, v8, T, H,
                                             (int64_t)blockIdx.x * blockDim.x + threadIdx.x,
                                             (int64_t)gridDim.x * blockDim.x);
}

// ---- fp8 quantizing concat, V keys-last --------------------------------------------------
// v8t [H, 128, v_cols]: segment s (tokens cu_k[s] .. cu_k[s+1]) from column cu_v[s], a
// multiple of 16, v8t[h, d, cu_v[s] + j] = sat_e4m3(v[cu_k[s] + j, h, d]); the columns
// between one segment's last key and the next segment's start are zero. Why: Hopper's
// fp8 MMA takes its B operand K-major only, and for P·V the K dimension is the keys, so
// the attention reads V keys-last without transposing tiles — through per-segment TMA
// descriptors, whose base must be 16-byte aligned (hence the segment starts).
// A transpose in 16-byte accesses goes through shared memory: a block takes a tile of
// kVtCols columns x 128 values of one head; each thread takes 4 columns (one segment's,
// 16-column aligned starts never split a quad) x 16 values — values dc*8..dc*8+7 and
// 64+dc*8..64+dc*8+7 of its token rows, so that each of its two 16-byte load
// instructions covers 128 contiguous bytes of a row per 8 lanes (whole 32-byte sectors;
// 16 consecutive values put one instruction's loads 32 bytes apart, half of every sector;
// on an H200 the two differ by less than the noise) — converts, and packs each value's 4 bytes into one word
// of the tile [128][columns] (+1 word per row: a 4-way bank conflict at worst); then
// every thread stores 16-byte pieces of tile rows (8 lanes = 128 contiguous bytes of one
// v8t row). k8 is written as the row-major kernel does, in the same launch.
constexpr int kVtCols = 128;              // columns per V tile (32 quads x 8 value chunks = 256 threads)
constexpr int kVtWords = kVtCols / 4 + 1;  // shared words per tile row

template <int A, bool FP16>
__device__ __forceinline__ void v_keys_last_tiles(const uint16_t* __restrict__ vv, int64_t v_s0, int64_t v_s1,
                                                  const int32_t* __restrict__ cu_k,
                                                  const int32_t* __restrict__ cu_v, int B,
                                                  uint8_t* __restrict__ v8t, int64_t v_cols, int H,
                                                  int64_t first, int64_t S, uint32_t* sm) {
  const int64_t tiles = (v_cols + kVtCols - 1) / kVtCols * H;
  const int tid = threadIdx.x;
  const int cq = tid >> 3, dc = tid & 7;  // load: column quad, 16-value chunk
  for (int64_t tile = first; tile < tiles; tile += S) {
    const int h = (int)(tile % H);
    const int64_t c0 = tile / H * kVtCols;
    const int64_t c = c0 + cq * 4;
    // the quad's segment: the last s with cu_v[s] <= c (binary search, B small)
    int64_t t_first = 0;  // token of column c
    int n_ok = 0;         // of the quad's 4 columns, how many hold keys
    if (c < v_cols) {
      int lo = 0, hi = B - 1;
      while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (cu_v[mid] <= c) lo = mid; else hi = mid - 1;
      }
      const int64_t off = c - cu_v[lo];
      const int64_t len = cu_k[lo + 1] - cu_k[lo];
      t_first = cu_k[lo] + off;
      n_ok = (int)max((int64_t)0, min((int64_t)4, len - off));
    }
    uint32_t w[16];
#pragma unroll
    for (int j = 0; j < 16; ++j) w[j] = 0u;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      uint4 lo = make_uint4(0u, 0u, 0u, 0u), hi = lo;
      if (i < n_ok) {
        const uint16_t* p = vv + (t_first + i) * v_s0 + (int64_t)h * v_s1 + dc * 8;
        lo = ld16<A>(p);
        hi = ld16<A>(p + kV / 2);
      }
      // byte j: value dc*8 + j (j < 8), kV/2 + dc*8 + j-8 (j >= 8); zeros -> 0
      const uint4 q = dev::e4m3x16_from_16bit<FP16>(lo, hi);
      const uint32_t qs[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
      for (int j = 0; j < 16; ++j) w[j] |= ((qs[j >> 2] >> (8 * (j & 3))) & 0xffu) << (8 * i);
    }
    __syncthreads();  // the previous tile's stores have read the shared tile
#pragma unroll
    for (int j = 0; j < 16; ++j) sm[(j < 8 ? dc * 8 + j : kV / 2 + dc * 8 + (j - 8)) * kVtWords + cq] = w[j];
    __syncthreads();
#pragma unroll
    for (int p = 0; p < kV / 32; ++p) {  // 128 rows x 8 pieces of 16 bytes, 4 per thread
      const int d = p * 32 + (tid >> 3), piece = tid & 7;
      const int64_t col = c0 + piece * 16;
      if (col < v_cols) {
        const uint32_t* src = sm + d * kVtWords + piece * 4;
        st16<16>(v8t + ((int64_t)h * kV + d) * v_cols + col, make_uint4(src[0], src[1], src[2], src[3]));
      }
    }
  }
}

// One grid-stride over both kinds of work unit: k8 units of kThreads * IB items first,
// then V tiles. Why not a fixed split of the wave between the two kinds (each part
// striding over its own): one part idles at its end, and on an H200 no split reaches
// 90 % of copy for every shape (86-90 %; this: 90-93 %). A unit's threads all
// take the same kind, so the V tile's __syncthreads stay uniform. At IB = 1, 4 blocks per
// SM hold it to 64 registers (72 without, and 2 blocks).
template <int A, bool FP16, bool PE_FP8, int IB, int HB>
__global__ void __launch_bounds__(dev::kThreads, IB == 1 ? 4 : 2)
kv_concat_quant_vt_kernel(const uint16_t* __restrict__ kn, int64_t kn_s0, int64_t kn_s1,
                          const void* __restrict__ pe, int64_t pe_s0,
                          const uint16_t* __restrict__ vv, int64_t v_s0, int64_t v_s1,
                          const int32_t* __restrict__ cu_k, const int32_t* __restrict__ cu_v, int B,
                          uint8_t* __restrict__ k8, uint8_t* __restrict__ v8t, int64_t v_cols, int64_t T, int H,
                          int64_t k_units) {
  __shared__ uint32_t sm[kV * kVtWords];
  constexpr int64_t P = (int64_t)dev::kThreads * IB;  // k8 items per unit
  const int64_t v_tiles = (v_cols + kVtCols - 1) / kVtCols * H;
  for (int64_t u = blockIdx.x; u < k_units + v_tiles; u += gridDim.x) {
    if (u < k_units) {
      quant_items<A, FP16, PE_FP8, IB, HB, false>(kn, kn_s0, kn_s1, pe, pe_s0, vv, v_s0, v_s1, k8, nullptr, T, H,
                                                  u * P + threadIdx.x, dev::kThreads, (u + 1) * P);
    } else {
      v_keys_last_tiles<A, FP16>(vv, v_s0, v_s1, cu_k, cu_v, B, v8t, v_cols, H, u - k_units, v_tiles, sm);
    }
  }
}

// Heads per work item: the smallest power of two >= H, capped at `n` accesses in
// flight per thread; with fewer heads, a thread takes IB = n / HB items per step.
inline int heads_per_item(int64_t H, int n) {
  int hb = 1;
  while (hb < n && hb < H) hb *= 2;
  return hb;
}

template <auto Kernel>
inline unsigned pack_grid(int64_t T, int64_t H, int U, int IB, int HB) {
  const int64_t items = T * ((H + HB - 1) / HB) * U;
  return grid_one_wave<Kernel>(items, (int64_t)dev::kThreads * IB);
}

template <int A>
cudaError_t concat_dispatch(const void* kn, int64_t kn_s0, int64_t kn_s1, const void* pe, int64_t pe_s0,
                            void* k, int64_t T, int64_t H, cudaStream_t s) {
  constexpr int U = 4;  // store instructions per work item (8: 0.5-3 points less at H = 128)
  const int64_t items = T * (((kQK / 8) * H + 32 * U - 1) / (32 * U));
  kv_concat_kernel<A, U><<<grid_one_wave<kv_concat_kernel<A, U>>(items, dev::kThreads / 32), dev::kThreads, 0,
                           s>>>(static_cast<const uint16_t*>(kn), kn_s0, kn_s1, static_cast<const uint16_t*>(pe),
                                pe_s0, static_cast<uint16_t*>(k), T, (int)H);
  return cudaGetLastError();
}

template <int A, bool FP16, bool PE_FP8>
cudaError_t quant_dispatch(const void* kn, int64_t kn_s0, int64_t kn_s1, const void* pe, int64_t pe_s0,
                           const void* v, int64_t v_s0, int64_t v_s1, void* k8, void* v8, int64_t T,
                           int64_t H, cudaStream_t s) {
  const auto* a = static_cast<const uint16_t*>(kn);
  const auto* vv = static_cast<const uint16_t*>(v);
  auto* ko = static_cast<uint8_t*>(k8);
  auto* vo = static_cast<uint8_t*>(v8);
  const int h = (int)H;
  constexpr int U = 20;
#define CTXP_QUANT(IB_, HB_)                                                                             \
  kv_concat_quant_kernel<A, FP16, PE_FP8, IB_, HB_>                                                      \
      <<<pack_grid<kv_concat_quant_kernel<A, FP16, PE_FP8, IB_, HB_>>(T, H, U, IB_, HB_), dev::kThreads, \
         0, s>>>(a, kn_s0, kn_s1, pe, pe_s0, vv, v_s0, v_s1, ko, vo, T, h)
  if constexpr (A < 16) {  // unaligned fallback: one shape only
    CTXP_QUANT(1, 4);
  } else {
    switch (heads_per_item(H, 4)) {
      case 1: CTXP_QUANT(4, 1); break;
      case 2: CTXP_QUANT(2, 2); break;
      default: CTXP_QUANT(1, 4); break;
    }
  }
#undef CTXP_QUANT
  return cudaGetLastError();
}

template <int A, bool FP16, bool PE_FP8>
cudaError_t quant_vt_dispatch(const void* kn, int64_t kn_s0, int64_t kn_s1, const void* pe, int64_t pe_s0,
                              const void* v, int64_t v_s0, int64_t v_s1, const int32_t* cu_k, const int32_t* cu_v,
                              int B, void* k8, void* v8t, int64_t v_cols, int64_t T, int64_t H, cudaStream_t s) {
  const auto* a = static_cast<const uint16_t*>(kn);
  const auto* vv = static_cast<const uint16_t*>(v);
  auto* ko = static_cast<uint8_t*>(k8);
  auto* vo = static_cast<uint8_t*>(v8t);
  const int h = (int)H;
  // k8 units and V tiles in one grid of at most one resident wave
#define CTXP_QUANT_VT(IB_, HB_)                                                                          \
  do {                                                                                                   \
    constexpr auto kern = kv_concat_quant_vt_kernel<A, FP16, PE_FP8, IB_, HB_>;                         \
    const int64_t per = (int64_t)dev::kThreads * IB_;                                                    \
    const int64_t k_units = (T * ((H + HB_ - 1) / HB_) * 12 + per - 1) / per;                            \
    const int64_t units = k_units + (v_cols + kVtCols - 1) / kVtCols * H;                                \
    const int64_t wave = (int64_t)num_sms() * resident_blocks_per_sm<kern>();                            \
    kern<<<(unsigned)std::max<int64_t>(1, std::min(units, wave)), dev::kThreads, 0, s>>>(                 \
        a, kn_s0, kn_s1, pe, pe_s0, vv, v_s0, v_s1, cu_k, cu_v, B, ko, vo, v_cols, T, h, k_units);         \
  } while (0)
  if constexpr (A < 16) {  // unaligned fallback: one shape only
    CTXP_QUANT_VT(1, 4);
  } else {
    switch (heads_per_item(H, 4)) {
      case 1: CTXP_QUANT_VT(4, 1); break;
      case 2: CTXP_QUANT_VT(2, 2); break;
      default: CTXP_QUANT_VT(1, 4); break;
    }
  }
#undef CTXP_QUANT_VT
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_kv_concat(const void* k_nope, int64_t kn_s0, int64_t kn_s1, const void* k_pe,
                             int64_t pe_s0, void* k, int64_t T, int64_t H, DType dtype,
                             cudaStream_t stream) {
  if (T <= 0 || H <= 0) return cudaSuccess;
  if (dtype != DType::BF16 && dtype != DType::FP16) return cudaErrorInvalidValue;
  // 16-bit elements: a row stride that is a multiple of 8 elements keeps 16 B alignment
  const bool vec = aligned16(k_nope) && aligned16(k_pe) && aligned16(k) && kn_s0 % 8 == 0 &&
                   kn_s1 % 8 == 0 && pe_s0 % 8 == 0;
  // the copy does not depend on the 16-bit format: bf16 and fp16 share one kernel
  return vec ? concat_dispatch<16>(k_nope, kn_s0, kn_s1, k_pe, pe_s0, k, T, H, stream)
             : concat_dispatch<1>(k_nope, kn_s0, kn_s1, k_pe, pe_s0, k, T, H, stream);
}

cudaError_t launch_kv_concat_quant_fp8(const void* k_nope, int64_t kn_s0, int64_t kn_s1,
                                       const void* k_pe, int64_t pe_s0, DType pe_dtype,
                                       const void* v, int64_t v_s0, int64_t v_s1, void* k_fp8,
                                       void* v_fp8, int64_t T, int64_t H, DType dtype,
                                       cudaStream_t stream) {
  if (T <= 0 || H <= 0) return cudaSuccess;
  if (dtype != DType::BF16 && dtype != DType::FP16) return cudaErrorInvalidValue;
  const bool pe_fp8 = pe_dtype == DType::FP8E4M3;
  if (!pe_fp8 && pe_dtype != dtype) return cudaErrorInvalidValue;
  const int64_t pe_align = pe_fp8 ? 16 : 8;  // elements per 16 bytes
  const bool vec = aligned16(k_nope) && aligned16(k_pe) && aligned16(v) && aligned16(k_fp8) &&
                   aligned16(v_fp8) && kn_s0 % 8 == 0 && kn_s1 % 8 == 0 && v_s0 % 8 == 0 &&
                   v_s1 % 8 == 0 && pe_s0 % pe_align == 0;
  const bool f16 = dtype == DType::FP16;
#define CTXP_Q(A_, F_, P_) \
  quant_dispatch<A_, F_, P_>(k_nope, kn_s0, kn_s1, k_pe, pe_s0, v, v_s0, v_s1, k_fp8, v_fp8, T, H, stream)
  if (vec) {
    if (f16) return pe_fp8 ? CTXP_Q(16, true, true) : CTXP_Q(16, true, false);
    return pe_fp8 ? CTXP_Q(16, false, true) : CTXP_Q(16, false, false);
  }
  if (f16) return pe_fp8 ? CTXP_Q(1, true, true) : CTXP_Q(1, true, false);
  return pe_fp8 ? CTXP_Q(1, false, true) : CTXP_Q(1, false, false);
#undef CTXP_Q
}

cudaError_t launch_kv_concat_quant_fp8_vt(const void* k_nope, int64_t kn_s0, int64_t kn_s1,
                                          const void* k_pe, int64_t pe_s0, DType pe_dtype,
                                          const void* v, int64_t v_s0, int64_t v_s1, const int32_t* cu_seqlens_k,
                                          const int32_t* cu_seqlens_v, int64_t B, void* k_fp8, void* v_fp8_t,
                                          int64_t v_cols, int64_t T, int64_t H, DType dtype, cudaStream_t stream) {
  if (T <= 0 || H <= 0) return cudaSuccess;
  if (dtype != DType::BF16 && dtype != DType::FP16) return cudaErrorInvalidValue;
  if (B < 1 || B > (int64_t)1 << 30 || v_cols < T || v_cols % 16 != 0 || !aligned16(v_fp8_t))
    return cudaErrorInvalidValue;
  const bool pe_fp8 = pe_dtype == DType::FP8E4M3;
  if (!pe_fp8 && pe_dtype != dtype) return cudaErrorInvalidValue;
  const int64_t pe_align = pe_fp8 ? 16 : 8;  // elements per 16 bytes
  const bool vec = aligned16(k_nope) && aligned16(k_pe) && aligned16(v) && aligned16(k_fp8) &&
                   kn_s0 % 8 == 0 && kn_s1 % 8 == 0 && v_s0 % 8 == 0 && v_s1 % 8 == 0 && pe_s0 % pe_align == 0;
  const bool f16 = dtype == DType::FP16;
  const int b = (int)B;
#define CTXP_QT(A_, F_, P_)                                                                                  \
  quant_vt_dispatch<A_, F_, P_>(k_nope, kn_s0, kn_s1, k_pe, pe_s0, v, v_s0, v_s1, cu_seqlens_k, cu_seqlens_v, b, \
                                k_fp8, v_fp8_t, v_cols, T, H, stream)
  if (vec) {
    if (f16) return pe_fp8 ? CTXP_QT(16, true, true) : CTXP_QT(16, true, false);
    return pe_fp8 ? CTXP_QT(16, false, true) : CTXP_QT(16, false, false);
  }
  if (f16) return pe_fp8 ? CTXP_QT(1, true, true) : CTXP_QT(1, true, false);
  return pe_fp8 ? CTXP_QT(1, false, true) : CTXP_QT(1, false, false);
#undef CTXP_QT
}

}  // namespace ctxprefill
