// LSE merge of two attention partials, in place (CONTRACT §3, §5), mirroring
// ops/merge.py:merge_reference operation by operation so that the bytes equal the
// torch reference run on CUDA:
//
//   a = (lse == +inf) ? -inf : lse          b = likewise for part_lse
//   m = maximum(a, b)        (NaN propagates, as torch.maximum)
//   empty = (m == -inf);     ms = empty ? 0 : m
//   wa = expf(a - ms), wb = expf(b - ms), s = wa + wb, ss = empty ? 1 : s
//   out = empty ? 0 : bf16_rn(float(o) * (wa / ss) + float(p) * (wb / ss))
//   lse = empty ? -inf : ms + logf(ss)
//
// Every step is one IEEE operation (__fadd_rn, __fsub_rn, __fmul_rn, __fdiv_rn: nvcc
// may not contract them into FMAs, and torch runs each as its own kernel), expf and
// logf are CUDA's full-precision functions (no fast math), as torch's exp/log.
//
// Fast path (V == 128, 16-byte aligned rows): a warp takes 32 (t, h) pairs; lane i
// computes the weights of pair i once and writes its LSE; then the warp streams the
// 32 output rows, two per step (16 lanes x 16 bytes = one 256-byte row), fetching
// each pair's weights from its owner lane by shuffle. Pairs are ordered along the
// LSE's smaller stride so that LSE reads and writes coalesce too.

#include "common.cuh"

namespace ctxprefill {
namespace {

using dev::ld16;
using dev::st16;

struct Weights {
  float fa, fb, lse;
  bool empty;
};

__device__ __forceinline__ Weights merge_weights(float a, float b) {
  const float inf = __int_as_float(0x7f800000);
  if (a == inf) a = -inf;
  if (b == inf) b = -inf;
  const float m = (a != a) ? a : (b != b) ? b : fmaxf(a, b);
  Weights w;
  w.empty = (m == -inf);
  const float ms = w.empty ? 0.0f : m;
  const float wa = expf(__fsub_rn(a, ms));
  const float wb = expf(__fsub_rn(b, ms));
  const float s = __fadd_rn(wa, wb);
  const float ss = w.empty ? 1.0f : s;
  w.fa = __fdiv_rn(wa, ss);
  w.fb = __fdiv_rn(wb, ss);
  w.lse = w.empty ? -inf : __fadd_rn(ms, logf(ss));
  return w;
}

// 8 bf16 of out and part -> 8 merged bf16
__device__ __forceinline__ uint4 merge8(uint4 o, uint4 p, float fa, float fb, bool empty) {
  const uint32_t ow[4] = {o.x, o.y, o.z, o.w}, pw[4] = {p.x, p.y, p.z, p.w};
  uint32_t r[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float lo = __fadd_rn(__fmul_rn(dev::bf16_lo(ow[i]), fa), __fmul_rn(dev::bf16_lo(pw[i]), fb));
    const float hi = __fadd_rn(__fmul_rn(dev::bf16_hi(ow[i]), fa), __fmul_rn(dev::bf16_hi(pw[i]), fb));
    r[i] = empty ? 0u : dev::bf16x2_from_f32(lo, hi);
  }
  return make_uint4(r[0], r[1], r[2], r[3]);
}

__global__ void __launch_bounds__(dev::kThreads)
merge_v128_kernel(uint16_t* __restrict__ out, int64_t o_s0, int64_t o_s1, float* __restrict__ lse, int64_t l_s0,
                  int64_t l_s1, const uint16_t* __restrict__ part, int64_t p_s0, int64_t p_s1,
                  const float* __restrict__ plse, int64_t pl_s0, int64_t pl_s1, int64_t T, int64_t H,
                  bool h_major) {
  constexpr int UNR = 4;  // row pairs (steps) in flight per lane
  const int lane = threadIdx.x & 31;
  const int64_t warp = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const int64_t nwarps = ((int64_t)gridDim.x * blockDim.x) >> 5;
  const int64_t P = T * H;
  const int64_t batches = (P + 31) / 32;
  const int half = lane >> 4, c = lane & 15;
  for (int64_t bidx = warp; bidx < batches; bidx += nwarps) {
    // this lane's pair: weights, LSE, and the element offsets of its rows
    const int64_t q = bidx * 32 + lane;
    float fa = 0.0f, fb = 0.0f;
    int empty = 1;
    int64_t ooff = 0, poff = 0;
    if (q < P) {
      int64_t t, h;
      if (h_major) { h = q / T; t = q - h * T; }
      else { t = q / H; h = q - t * H; }
      const Weights w = merge_weights(lse[h * l_s0 + t * l_s1], plse[h * pl_s0 + t * pl_s1]);
      lse[h * l_s0 + t * l_s1] = w.lse;
      fa = w.fa;
      fb = w.fb;
      empty = w.empty;
      ooff = t * o_s0 + h * o_s1;
      poff = t * p_s0 + h * p_s1;
    }
    const int64_t left = P - bidx * 32;
    const int n_pairs = left < 32 ? (int)left : 32;
#pragma unroll 1
    for (int s0 = 0; s0 < 16; s0 += UNR) {
      uint4 o[UNR], p[UNR];
      float wa[UNR], wb[UNR];
      int em[UNR];
      int64_t oo[UNR];
      bool ok[UNR];
#pragma unroll
      for (int u = 0; u < UNR; ++u) {
        const int src = 2 * (s0 + u) + half;
        wa[u] = __shfl_sync(0xffffffffu, fa, src);
        wb[u] = __shfl_sync(0xffffffffu, fb, src);
        em[u] = __shfl_sync(0xffffffffu, empty, src);
        oo[u] = __shfl_sync(0xffffffffu, ooff, src);
        const int64_t po = __shfl_sync(0xffffffffu, poff, src);
        ok[u] = src < n_pairs;
        o[u] = p[u] = make_uint4(0u, 0u, 0u, 0u);
        if (ok[u]) {
          o[u] = ld16<16>(out + oo[u] + c * 8);
          p[u] = ld16<16>(part + po + c * 8);
        }
      }
#pragma unroll
      for (int u = 0; u < UNR; ++u)
        if (ok[u]) st16<16>(out + oo[u] + c * 8, merge8(o[u], p[u], wa[u], wb[u], em[u] != 0));
    }
  }
}

// Any V, any alignment: one thread per (t, h) pair, element by element (correct,
// not fast; the engine's merges always take the fast path).
__global__ void __launch_bounds__(dev::kThreads)
merge_generic_kernel(uint16_t* __restrict__ out, int64_t o_s0, int64_t o_s1, float* __restrict__ lse, int64_t l_s0,
                     int64_t l_s1, const uint16_t* __restrict__ part, int64_t p_s0, int64_t p_s1,
                     const float* __restrict__ plse, int64_t pl_s0, int64_t pl_s1, int64_t T, int64_t H,
                     int64_t V) {
  const int64_t n = T * H;
  const int64_t S = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += S) {
    const int64_t h = i / T, t = i - h * T;
    float* l = lse + h * l_s0 + t * l_s1;
    const Weights w = merge_weights(*l, plse[h * pl_s0 + t * pl_s1]);
    uint16_t* o = out + t * o_s0 + h * o_s1;
    const uint16_t* p = part + t * p_s0 + h * p_s1;
    for (int64_t e = 0; e < V; ++e) {
      const float r = __fadd_rn(__fmul_rn(__uint_as_float((uint32_t)o[e] << 16), w.fa),
                                __fmul_rn(__uint_as_float((uint32_t)p[e] << 16), w.fb));
      const __nv_bfloat16 b = __float2bfloat16_rn(r);
      o[e] = w.empty ? (uint16_t)0 : *reinterpret_cast<const uint16_t*>(&b);
    }
    *l = w.lse;
  }
}

}  // namespace

cudaError_t launch_merge(void* out, int64_t o_s0, int64_t o_s1, float* lse, int64_t l_s0, int64_t l_s1,
                         const void* part, int64_t p_s0, int64_t p_s1, const float* part_lse, int64_t pl_s0,
                         int64_t pl_s1, int64_t T, int64_t H, int64_t V, cudaStream_t stream) {
  if (T <= 0 || H <= 0 || V <= 0) return cudaSuccess;
  auto* o = static_cast<uint16_t*>(out);
  const auto* p = static_cast<const uint16_t*>(part);
  const bool fast = V == 128 && aligned16(out) && aligned16(part) && o_s0 % 8 == 0 && o_s1 % 8 == 0 &&
                    p_s0 % 8 == 0 && p_s1 % 8 == 0;
  if (fast) {
    const int64_t l0 = l_s0 < 0 ? -l_s0 : l_s0, l1 = l_s1 < 0 ? -l_s1 : l_s1;
    const bool h_major = l1 <= l0;  // consecutive pairs walk t: LSE [H, T] rows coalesce
    const int64_t batches = (T * H + 31) / 32;
    merge_v128_kernel<<<grid_one_wave<merge_v128_kernel>(batches, dev::kThreads / 32), dev::kThreads, 0, stream>>>(
        o, o_s0, o_s1, lse, l_s0, l_s1, p, p_s0, p_s1, part_lse, pl_s0, pl_s1, T, H, h_major);
    return cudaGetLastError();
  }
  merge_generic_kernel<<<grid_for(T * H, dev::kThreads), dev::kThreads, 0, stream>>>(
      o, o_s0, o_s1, lse, l_s0, l_s1, p, p_s0, p_s1, part_lse, pl_s0, pl_s1, T, H, V);
  return cudaGetLastError();
}

}  // namespace ctxprefill
