// The fused MLA K/V pack (SPEC §5, §6): one launch per chunk, reading the strided
// halves of the kv_b_proj output and the strided k_pe view of the workspace
// directly — no expand, no cat, no intermediate copies.
//
//   fused_mla_kv_concat:            k[t,h] = [k_nope[t,h] | k_pe[t]]          (bf16/fp16)
//   fused_mla_kv_concat_quant_fp8:  k8[t,h] = sat_e4m3([k_nope[t,h] | k_pe[t]]),
//                                   v8[t,h] = sat_e4m3(v[t,h])                 (bytes)
//
// Work decomposition. Both outputs are row-major arrays of T*H rows (row r = t*H + h:
// k [T*H, 192], k8 [T*H, 192 B], v8 [T*H, 128 B]). One work item = 8 consecutive output
// rows (8 heads of one token when 8 divides H; with any other H an item may span two or
// more tokens, and every row finds its own (t, h)). A warp owns an item and covers its
// rows with lane-consecutive 16-byte chunks, so every store instruction writes 512
// contiguous bytes. A lane's chunk positions in an item are the same for every item.
//
// bf16: 24 chunks of 8 elements per row (16 of k_nope, 8 of k_pe): 8 x 24 = 6 chunks per
//       lane; a warp step takes IB = 2 items: 12 independent 16-byte loads per lane are
//       in flight before its first store.
// fp8 : 16 values per chunk: k8 rows 12 chunks (8 k_nope + 4 k_pe), v8 rows 8 chunks:
//       3 k8 + 2 v8 chunks per lane, each from two 16-byte loads: 10 loads in flight.
// k_nope and v are streamed (see common.cuh: L2 evict_first, no L1 allocation); a k_pe
// chunk is loaded per row through L1 instead: the 128 bytes of a token's k_pe row are
// shared by its H rows, which are items of neighbouring warps of one block, so DRAM sends
// each k_pe row about once and L1 serves the repeats.
// Grid: at most one resident wave with every warp doing the same number of steps
// (grid_balanced), grid-stride beyond.
// fp8 cast: __nv_cvt_float2_to_fp8x2 / __nv_cvt_halfraw2_to_fp8x2 with
// __NV_SATFINITE, __NV_E4M3 (see common.cuh) == x.clamp(-448,448).to(e4m3fn).

#include "common.cuh"

namespace ctxprefill {
namespace {

constexpr int kRowsPerItem = 8;  // output rows per work item (one warp's unit of work)
constexpr int64_t kMaxHeads = int64_t(1) << 30;  // head indices (+ 8) fit an int

// (t, h) of output row r0 + j, where t0 = r0 / H and h0 = r0 % H (0 <= j < 8): one compare
// unless the rows cross a token boundary.
__device__ __forceinline__ void row_th(int64_t t0, int h0, int j, int H, int64_t& t, int& h) {
  h = h0 + j;
  t = t0;
  if (h >= H) {
    const int w = (int)((unsigned)h / (unsigned)H);
    t += w;
    h -= w * H;
  }
}

// One item's rows: r0 = item * 8 and, when `whole`, the 8 rows are heads h0..h0+7 of token
// t0 (warp-uniform; every item but the last when 8 divides H), so that a row needs no
// check at all. Otherwise each row is checked against the end and finds its own (t, h).
struct Item {
  int64_t r0, t0;
  int h0;
  bool whole;
};

__device__ __forceinline__ Item item_at(int64_t it, int64_t rows, int H) {
  Item m;
  m.r0 = it * kRowsPerItem;
  m.t0 = m.r0 / H;
  m.h0 = (int)(m.r0 - m.t0 * H);
  m.whole = m.r0 + kRowsPerItem <= rows && m.h0 + kRowsPerItem <= H;
  return m;
}

// (t, h) of row j of item m; false when the row is past the end (then t, h are unset)
__device__ __forceinline__ bool item_row(const Item& m, int j, int64_t rows, int H, int64_t& t, int& h) {
  if (m.whole) {
    t = m.t0;
    h = m.h0 + j;
    return true;
  }
  if (m.r0 + j >= rows) return false;
  row_th(m.t0, m.h0, j, H, t, h);
  return true;
}

// ---- bf16 / fp16 concat ------------------------------------------------------------
template <int A, int IB>
__global__ void __launch_bounds__(dev::kThreads, 3)
kv_concat_kernel(const uint16_t* __restrict__ kn, int64_t kn_s0, int64_t kn_s1,
                 const uint16_t* __restrict__ pe, int64_t pe_s0, uint16_t* __restrict__ k,
                 int64_t T, int H) {
  constexpr int U = kQK / 8;                  // 24 chunks of 8 elements per output row
  constexpr int UN = kNope / 8;               // 16 of them from k_nope
  constexpr int K = kRowsPerItem * U / 32;    // 6 chunks per lane per item
  static_assert(kRowsPerItem * U == 32 * K, "an item is a whole number of warp-wide chunks");
  const int lane = threadIdx.x & 31;
  const int64_t rows = T * H;
  const int64_t items = (rows + kRowsPerItem - 1) / kRowsPerItem;
  const int64_t W = ((int64_t)gridDim.x * blockDim.x) >> 5;  // warps in the grid
  const int64_t gw = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const uint64_t pol = dev::evict_first_policy();
  // items gw, gw + W, gw + 2W, ... : IB of them per step
  for (int64_t it0 = gw; it0 < items; it0 += (int64_t)IB * W) {
    uint4 v[IB][K];
#pragma unroll
    for (int i = 0; i < IB; ++i) {
      const Item m = item_at(it0 + i * W, rows, H);  // past the last item: no row is valid
#pragma unroll
      for (int kk = 0; kk < K; ++kk) {
        const int q = lane + 32 * kk;  // chunk of the item: row j, chunk c of the row
        const int j = q / U, c = q - j * U;
        int64_t t;
        int h;
        v[i][kk] = make_uint4(0u, 0u, 0u, 0u);
        if (item_row(m, j, rows, H, t, h)) {
          if (c < UN) v[i][kk] = dev::ld16s<A>(kn + t * kn_s0 + (int64_t)h * kn_s1 + c * 8, pol);
          else v[i][kk] = dev::ld16c<A>(pe + t * pe_s0 + (c - UN) * 8);
        }
      }
    }
#pragma unroll
    for (int i = 0; i < IB; ++i) {
      const int64_t r0 = (it0 + i * W) * kRowsPerItem;
#pragma unroll
      for (int kk = 0; kk < K; ++kk) {
        const int q = lane + 32 * kk;
        if (r0 + q / U < rows) dev::st16s<A>(k + (r0 * U + q) * 8, v[i][kk], pol);
      }
    }
  }
}

// ---- fp8 quantizing concat -----------------------------------------------------------
template <int A, bool FP16, bool PE_FP8>
__global__ void __launch_bounds__(dev::kThreads)
kv_concat_quant_kernel(const uint16_t* __restrict__ kn, int64_t kn_s0, int64_t kn_s1,
                       const void* __restrict__ pe, int64_t pe_s0,
                       const uint16_t* __restrict__ vv, int64_t v_s0, int64_t v_s1,
                       uint8_t* __restrict__ k8, uint8_t* __restrict__ v8, int64_t T, int H) {
  constexpr int UK = kQK / 16;                 // 12 chunks of 16 values per k8 row (192 B)
  constexpr int UKN = kNope / 16;              // 8 of them from k_nope, 4 from k_pe
  constexpr int UV = kV / 16;                  // 8 chunks per v8 row (128 B)
  constexpr int KK = kRowsPerItem * UK / 32;   // 3 k8 chunks per lane per item
  constexpr int KV = kRowsPerItem * UV / 32;   // 2 v8 chunks per lane per item
  static_assert(kRowsPerItem * UK == 32 * KK && kRowsPerItem * UV == 32 * KV, "whole warp-wide chunks");
  const int lane = threadIdx.x & 31;
  const int64_t rows = T * H;
  const int64_t items = (rows + kRowsPerItem - 1) / kRowsPerItem;
  const int64_t W = ((int64_t)gridDim.x * blockDim.x) >> 5;
  const int64_t gw = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const uint64_t pol = dev::evict_first_policy();
  for (int64_t it = gw; it < items; it += W) {
    const Item m = item_at(it, rows, H);
    // every load first: 16 values per chunk = two 16-byte loads (one for a raw fp8 k_pe chunk)
    uint4 klo[KK], khi[KK], vlo[KV], vhi[KV];
#pragma unroll
    for (int kk = 0; kk < KK; ++kk) {
      const int q = lane + 32 * kk;
      const int j = q / UK, c = q - j * UK;
      int64_t t;
      int h;
      klo[kk] = khi[kk] = make_uint4(0u, 0u, 0u, 0u);
      if (item_row(m, j, rows, H, t, h)) {
        if (c < UKN) {
          const uint16_t* p = kn + t * kn_s0 + (int64_t)h * kn_s1 + c * 16;
          klo[kk] = dev::ld16s<A>(p, pol);
          khi[kk] = dev::ld16s<A>(p + 8, pol);
        } else if constexpr (PE_FP8) {
          klo[kk] = dev::ld16c<A>(static_cast<const uint8_t*>(pe) + t * pe_s0 + (c - UKN) * 16);
        } else {
          const uint16_t* p = static_cast<const uint16_t*>(pe) + t * pe_s0 + (c - UKN) * 16;
          klo[kk] = dev::ld16c<A>(p);
          khi[kk] = dev::ld16c<A>(p + 8);
        }
      }
    }
#pragma unroll
    for (int kk = 0; kk < KV; ++kk) {
      const int q = lane + 32 * kk;
      const int j = q / UV, c = q - j * UV;
      int64_t t;
      int h;
      vlo[kk] = vhi[kk] = make_uint4(0u, 0u, 0u, 0u);
      if (item_row(m, j, rows, H, t, h)) {
        const uint16_t* p = vv + t * v_s0 + (int64_t)h * v_s1 + c * 16;
        vlo[kk] = dev::ld16s<A>(p, pol);
        vhi[kk] = dev::ld16s<A>(p + 8, pol);
      }
    }
    // then convert and store
#pragma unroll
    for (int kk = 0; kk < KK; ++kk) {
      const int q = lane + 32 * kk;
      const int j = q / UK, c = q - j * UK;
      if (m.r0 + j >= rows) continue;
      const uint4 o = (PE_FP8 && c >= UKN) ? klo[kk] : dev::e4m3x16_from_16bit<FP16>(klo[kk], khi[kk]);
      dev::st16s<A>(k8 + (m.r0 * UK + q) * 16, o, pol);
    }
#pragma unroll
    for (int kk = 0; kk < KV; ++kk) {
      const int q = lane + 32 * kk;
      if (m.r0 + q / UV >= rows) continue;
      dev::st16s<A>(v8 + (m.r0 * UV + q) * 16, dev::e4m3x16_from_16bit<FP16>(vlo[kk], vhi[kk]), pol);
    }
  }
}

template <int A>
cudaError_t concat_dispatch(const void* kn, int64_t kn_s0, int64_t kn_s1, const void* pe, int64_t pe_s0,
                            void* k, int64_t T, int64_t H, cudaStream_t s) {
  constexpr int IB = A < 16 ? 1 : 2;  // the unaligned fallback is for correctness only
  const int64_t items = (T * H + kRowsPerItem - 1) / kRowsPerItem;
  constexpr auto kernel = kv_concat_kernel<A, IB>;
  kernel<<<grid_balanced<kernel>((items + IB - 1) / IB), dev::kThreads, 0, s>>>(
      static_cast<const uint16_t*>(kn), kn_s0, kn_s1, static_cast<const uint16_t*>(pe), pe_s0,
      static_cast<uint16_t*>(k), T, (int)H);
  return cudaGetLastError();
}

template <int A, bool FP16, bool PE_FP8>
cudaError_t quant_dispatch(const void* kn, int64_t kn_s0, int64_t kn_s1, const void* pe, int64_t pe_s0,
                           const void* v, int64_t v_s0, int64_t v_s1, void* k8, void* v8, int64_t T,
                           int64_t H, cudaStream_t s) {
  const int64_t items = (T * H + kRowsPerItem - 1) / kRowsPerItem;
  constexpr auto kernel = kv_concat_quant_kernel<A, FP16, PE_FP8>;
  kernel<<<grid_balanced<kernel>(items), dev::kThreads, 0, s>>>(
      static_cast<const uint16_t*>(kn), kn_s0, kn_s1, pe, pe_s0, static_cast<const uint16_t*>(v), v_s0, v_s1,
      static_cast<uint8_t*>(k8), static_cast<uint8_t*>(v8), T, (int)H);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_kv_concat(const void* k_nope, int64_t kn_s0, int64_t kn_s1, const void* k_pe,
                             int64_t pe_s0, void* k, int64_t T, int64_t H, DType dtype,
                             cudaStream_t stream) {
  if (T <= 0 || H <= 0) return cudaSuccess;
  if (dtype != DType::BF16 && dtype != DType::FP16) return cudaErrorInvalidValue;
  if (H > kMaxHeads) return cudaErrorInvalidValue;
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
  if (H > kMaxHeads) return cudaErrorInvalidValue;
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

}  // namespace ctxprefill
