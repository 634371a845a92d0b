// The fused MLA K/V pack (SPEC §5, §6): one launch per chunk, reading the strided
// halves of the kv_b_proj output and the strided k_pe view of the workspace
// directly — no expand, no cat, no intermediate copies.
//
//   fused_mla_kv_concat:            k[t,h] = [k_nope[t,h] | k_pe[t]]          (bf16/fp16)
//   fused_mla_kv_concat_quant_fp8:  k8[t,h] = sat_e4m3([k_nope[t,h] | k_pe[t]]),
//                                   v8[t,h] = sat_e4m3(v[t,h])                 (bytes)
//
// Work decomposition. One work item = (token t, 16-byte output chunk c of one head
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

#include "common.cuh"

namespace ctxprefill {
namespace {

using dev::ld16;
using dev::st16;

// ---- bf16 / fp16 concat ------------------------------------------------------------
template <int A, int IB, int HB>
__global__ void __launch_bounds__(dev::kThreads)
kv_concat_kernel(const uint16_t* __restrict__ kn, int64_t kn_s0, int64_t kn_s1,
                 const uint16_t* __restrict__ pe, int64_t pe_s0, uint16_t* __restrict__ k,
                 int64_t T, int H) {
  constexpr int U = kQK / 8;           // 24 chunks of 8 elements per head row
  constexpr int UN = kNope / 8;        // 16 of them from k_nope
  const int64_t NG = (H + HB - 1) / HB;  // head groups
  const int64_t items = T * NG * U;
  const int64_t S = (int64_t)gridDim.x * blockDim.x;
  for (int64_t base = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; base < items; base += IB * S) {
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
      // k_pe chunk: read once for the item's HB heads, stored to each from registers
      if (ok[i] && c[i] >= UN) pv[i] = ld16<A>(pe + t[i] * pe_s0 + (c[i] - UN) * 8);
    }
    uint4 v[IB][HB];
#pragma unroll
    for (int i = 0; i < IB; ++i)
#pragma unroll
      for (int j = 0; j < HB; ++j) {
        const int h = h0[i] + j;
        v[i][j] = pv[i];
        if (ok[i] && h < H && c[i] < UN) v[i][j] = ld16<A>(kn + t[i] * kn_s0 + (int64_t)h * kn_s1 + c[i] * 8);
      }
#pragma unroll
    for (int i = 0; i < IB; ++i)
#pragma unroll
      for (int j = 0; j < HB; ++j) {
        const int h = h0[i] + j;
        // streaming store (st.global.cs): k is written once here and read once, later, by
        // the attention; measured on the H200 +0.5-3.6 points of copy bandwidth over
        // plain stores (a streaming *load* of k_nope gained nothing)
        if (ok[i] && h < H) __stcs(reinterpret_cast<uint4*>(k + ((t[i] * H + h) * U + c[i]) * 8), v[i][j]);
      }
  }
}

// ---- fp8 quantizing concat -----------------------------------------------------------
template <int A, bool FP16, bool PE_FP8, int IB, int HB>
__global__ void __launch_bounds__(dev::kThreads, 2)
kv_concat_quant_kernel(const uint16_t* __restrict__ kn, int64_t kn_s0, int64_t kn_s1,
                       const void* __restrict__ pe, int64_t pe_s0,
                       const uint16_t* __restrict__ vv, int64_t v_s0, int64_t v_s1,
                       uint8_t* __restrict__ k8, uint8_t* __restrict__ v8, int64_t T, int H) {
  constexpr int UKN = kNope / 16;      // 8 k_nope chunks of 16 values
  constexpr int UPE = kRope / 16;      // 4 k_pe chunks
  constexpr int UK = UKN + UPE;        // 12 chunks per k8 row (192 B)
  constexpr int UV = kV / 16;          // 8 chunks per v8 row (128 B)
  constexpr int U = UK + UV;           // 20
  const int64_t NG = (H + HB - 1) / HB;
  const int64_t items = T * NG * U;
  const int64_t S = (int64_t)gridDim.x * blockDim.x;
  for (int64_t base = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; base < items; base += IB * S) {
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
        } else {
          st16<16>(v8 + row * kV + (c[i] - UK) * 16, dev::e4m3x16_from_16bit<FP16>(lo[i][j], hi[i][j]));
        }
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
  const auto* a = static_cast<const uint16_t*>(kn);
  const auto* b = static_cast<const uint16_t*>(pe);
  auto* o = static_cast<uint16_t*>(k);
  const int h = (int)H;
  constexpr int U = kQK / 8;
#define CTXP_CONCAT(IB_, HB_)                                                                         \
  kv_concat_kernel<A, IB_, HB_><<<pack_grid<kv_concat_kernel<A, IB_, HB_>>(T, H, U, IB_, HB_),       \
                                  dev::kThreads, 0, s>>>(a, kn_s0, kn_s1, b, pe_s0, o, T, h)
  if constexpr (A < 16) {  // unaligned fallback: one shape only
    CTXP_CONCAT(1, 8);
  } else {
    switch (heads_per_item(H, 8)) {  // H == 1: 4 items in flight (8 would spill registers)
      case 1: CTXP_CONCAT(4, 1); break;
      case 2: CTXP_CONCAT(4, 2); break;
      case 4: CTXP_CONCAT(2, 4); break;
      default: CTXP_CONCAT(1, 8); break;
    }
  }
#undef CTXP_CONCAT
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

}  // namespace ctxprefill
