// Shared device helpers: 16/8-byte memory access with a compile-time alignment
// guarantee, the saturating fp8 e4m3 casts, bf16 conversions, launch sizing.
//
// The one fp8 cast of this project (CONTRACT §6): round to nearest even, finite
// overflow and +-inf saturate to +-448, NaN stays NaN — i.e. torch's
// `x.clamp(-448, 448).to(torch.float8_e4m3fn)`. On sm_89+ it is one
// `cvt.rn.satfinite.e4m3x2.{f32,f16x2}` instruction per pair of values.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include "launchers.h"

namespace ctxprefill {
namespace dev {

constexpr int kThreads = 256;  // threads per block of every kernel here

// ---- memory access -------------------------------------------------------------
// A = 16: the pointer is 16-byte aligned (one vector instruction).
// A = 1 : no alignment known beyond a byte (the fallback kernels; correctness only).

template <int A>
__device__ __forceinline__ uint4 ld16(const void* p) {
  if constexpr (A >= 16) {
    return *reinterpret_cast<const uint4*>(p);
  } else {
    const unsigned char* b = reinterpret_cast<const unsigned char*>(p);
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
      w[i] = uint32_t(b[4 * i]) | (uint32_t(b[4 * i + 1]) << 8) | (uint32_t(b[4 * i + 2]) << 16) |
             (uint32_t(b[4 * i + 3]) << 24);
    return make_uint4(w[0], w[1], w[2], w[3]);
  }
}

template <int A>
__device__ __forceinline__ uint2 ld8(const void* p) {
  if constexpr (A >= 8) {
    return *reinterpret_cast<const uint2*>(p);
  } else {
    const unsigned char* b = reinterpret_cast<const unsigned char*>(p);
    uint32_t w[2];
#pragma unroll
    for (int i = 0; i < 2; ++i)
      w[i] = uint32_t(b[4 * i]) | (uint32_t(b[4 * i + 1]) << 8) | (uint32_t(b[4 * i + 2]) << 16) |
             (uint32_t(b[4 * i + 3]) << 24);
    return make_uint2(w[0], w[1]);
  }
}

template <int A>
__device__ __forceinline__ float ldf(const void* p) {
  if constexpr (A >= 4) {
    return *reinterpret_cast<const float*>(p);
  } else {
    const unsigned char* b = reinterpret_cast<const unsigned char*>(p);
    return __uint_as_float(uint32_t(b[0]) | (uint32_t(b[1]) << 8) | (uint32_t(b[2]) << 16) |
                           (uint32_t(b[3]) << 24));
  }
}

template <int A>
__device__ __forceinline__ void st16(void* p, uint4 v) {
  if constexpr (A >= 16) {
    *reinterpret_cast<uint4*>(p) = v;
  } else {
    unsigned char* b = reinterpret_cast<unsigned char*>(p);
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) b[4 * i + j] = (unsigned char)(w[i] >> (8 * j));
  }
}

template <int A>
__device__ __forceinline__ void stf(void* p, float f) {
  if constexpr (A >= 4) {
    *reinterpret_cast<float*>(p) = f;
  } else {
    unsigned char* b = reinterpret_cast<unsigned char*>(p);
    const uint32_t w = __float_as_uint(f);
#pragma unroll
    for (int j = 0; j < 4; ++j) b[j] = (unsigned char)(w >> (8 * j));
  }
}

// ---- conversions -----------------------------------------------------------------
// Element 0 of a packed pair is in the low half (little endian), as in memory.

__device__ __forceinline__ float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }

// two floats -> one packed e4m3 pair (low byte = a): saturating, RNE, NaN -> NaN
__device__ __forceinline__ uint32_t e4m3x2_from_f32(float a, float b) {
  return (uint32_t)__nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
}

// one packed bf16 pair -> packed e4m3 pair (bf16 -> f32 is exact: one rounding)
__device__ __forceinline__ uint32_t e4m3x2_from_bf16x2(uint32_t w) {
  return e4m3x2_from_f32(bf16_lo(w), bf16_hi(w));
}

// one packed fp16 pair -> packed e4m3 pair (one cvt.rn.satfinite.e4m3x2.f16x2)
__device__ __forceinline__ uint32_t e4m3x2_from_f16x2(uint32_t w) {
  __half2_raw r;
  r.x = (unsigned short)(w & 0xffffu);
  r.y = (unsigned short)(w >> 16);
  return (uint32_t)__nv_cvt_halfraw2_to_fp8x2(r, __NV_SATFINITE, __NV_E4M3);
}

// 8 packed 16-bit values (lo: elements 0..7 as one uint4) -> 8 e4m3 bytes (uint2)
template <bool FP16>
__device__ __forceinline__ uint2 e4m3x8_from_16bit(uint4 v) {
  auto cv = [](uint32_t w) { return FP16 ? e4m3x2_from_f16x2(w) : e4m3x2_from_bf16x2(w); };
  return make_uint2(cv(v.x) | (cv(v.y) << 16), cv(v.z) | (cv(v.w) << 16));
}

// 16 values in two uint4 of 16-bit elements -> 16 e4m3 bytes
template <bool FP16>
__device__ __forceinline__ uint4 e4m3x16_from_16bit(uint4 lo, uint4 hi) {
  const uint2 a = e4m3x8_from_16bit<FP16>(lo), b = e4m3x8_from_16bit<FP16>(hi);
  return make_uint4(a.x, a.y, b.x, b.y);
}

// packed e4m3 pair (low byte = element 0) -> two floats (exact; NaN -> NaN)
__device__ __forceinline__ float2 f32x2_from_e4m3x2(uint32_t pair) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(pair & 0xffffu), __NV_E4M3);
  return make_float2(__half2float(__half(__half_raw{h.x})), __half2float(__half(__half_raw{h.y})));
}

// two floats -> packed bf16 pair, round to nearest even (cvt.rn.bf16x2.f32)
__device__ __forceinline__ uint32_t bf16x2_from_f32(float a, float b) {
  const __nv_bfloat162 r = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&r);
}

// 8 e4m3 bytes (uint2) -> 8 bf16 = bf16_rn(float(e4m3) * scale), as a uint4
__device__ __forceinline__ uint4 bf16x8_from_e4m3x8_scaled(uint2 q, float scale) {
  uint32_t o[4];
  const uint32_t w[2] = {q.x, q.y};
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const float2 a = f32x2_from_e4m3x2(w[i] & 0xffffu);
    const float2 b = f32x2_from_e4m3x2(w[i] >> 16);
    o[2 * i] = bf16x2_from_f32(__fmul_rn(a.x, scale), __fmul_rn(a.y, scale));
    o[2 * i + 1] = bf16x2_from_f32(__fmul_rn(b.x, scale), __fmul_rn(b.y, scale));
  }
  return make_uint4(o[0], o[1], o[2], o[3]);
}

// ---- launch sizing -----------------------------------------------------------------

}  // namespace dev

// Multiprocessors of the current device (cached per device; 132 on an H200).
inline int num_sms() {
  static int cache[64] = {0};
  int d = 0;
  if (cudaGetDevice(&d) != cudaSuccess || d < 0) return 132;
  if (d < 64 && cache[d] > 0) return cache[d];
  int n = 0;
  if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, d) != cudaSuccess || n <= 0) n = 132;
  if (d < 64) cache[d] = n;
  return n;
}

// Blocks for `work` units of `per_block` each, capped at `waves` resident waves of
// kThreads-thread blocks (the kernels loop grid-stride over the rest).
inline unsigned grid_for(int64_t work, int64_t per_block, int waves = 1) {
  const int64_t cap = (int64_t)num_sms() * (2048 / dev::kThreads) * waves;
  int64_t b = (work + per_block - 1) / per_block;
  if (b > cap) b = cap;
  if (b < 1) b = 1;
  return (unsigned)b;
}

// Blocks of `Kernel` (kThreads threads, no dynamic shared memory) that fit on one
// multiprocessor at once, from the occupancy calculator (cached per kernel).
template <auto Kernel>
inline int resident_blocks_per_sm() {
  static int cached = 0;  // a benign race: every thread computes the same value
  if (cached > 0) return cached;
  int n = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, Kernel, dev::kThreads, 0) != cudaSuccess || n <= 0) n = 1;
  cached = n;
  return n;
}

// Grid for a grid-stride kernel: enough blocks for `work` units of `per_block`, capped
// at exactly one resident wave, so that no block waits for a second wave and the
// grid-stride loop balances the work across all resident threads.
template <auto Kernel>
inline unsigned grid_one_wave(int64_t work, int64_t per_block) {
  const int64_t cap = (int64_t)num_sms() * resident_blocks_per_sm<Kernel>();
  int64_t b = (work + per_block - 1) / per_block;
  if (b > cap) b = cap;
  if (b < 1) b = 1;
  return (unsigned)b;
}

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

}  // namespace ctxprefill
