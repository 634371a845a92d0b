// Cache insert and gather (CONTRACT §2, §5): warps over rows, 16-byte accesses.
//
// Insert (mirrors slot_format.encode_slots, byte for byte):
//   auto       : bf16_rn(x) (fp32 input) or a copy (bf16 input)           1152 B/slot
//   fp8        : sat_e4m3(float(x) / (float)k_scale), IEEE division        576 B/slot
//   fp8_ds_mla : per tile of 128 latent values, amax over the FINITE |x|;
//                scale = 2^ceil(log2(max(amax / 448, 1e-4))) computed exactly
//                (frexpf: mantissa 0.5 means an exact power of two); values
//                sat_e4m3(x / scale) (IEEE division, exact but for underflow);
//                [512 fp8 | 4 f32 scales | 64 bf16 k_pe]                    656 B/slot
//   A slot outside [0, num_slots) is skipped (-1 by contract; anything else is a
//   second guard — the host validated every slot already).
//
// Gather (mirrors slot_format.decode_slots through gather.chunk_slots):
//   out fp8  (fp8 cache only)   : the raw bytes
//   out bf16 : auto copies; fp8 -> bf16_rn(float(e4m3) * (float)k_scale);
//              fp8_ds_mla -> bf16_rn(float(e4m3) * tile_scale), k_pe copied.
//   A row's sequence is found by binary search over cu_seq_lens on the device (no
//   host sync). Bad block ids, block indices past the table and rows past the last
//   sequence give zeros instead of a read (defense in depth).

#include "common.cuh"

namespace ctxprefill {
namespace {

using dev::ld16;
using dev::ld8;
using dev::ldf;
using dev::st16;
using dev::stf;

// 8 consecutive source values (bf16 or fp32) -> 8 bf16 (uint4): copy or bf16_rn
template <int A, bool F32>
__device__ __forceinline__ uint4 load8_as_bf16(const void* p) {
  if constexpr (F32) {
    const float* f = static_cast<const float*>(p);
    const uint4 a = ld16<A>(f), b = ld16<A>(f + 4);
    return make_uint4(dev::bf16x2_from_f32(__uint_as_float(a.x), __uint_as_float(a.y)),
                      dev::bf16x2_from_f32(__uint_as_float(a.z), __uint_as_float(a.w)),
                      dev::bf16x2_from_f32(__uint_as_float(b.x), __uint_as_float(b.y)),
                      dev::bf16x2_from_f32(__uint_as_float(b.z), __uint_as_float(b.w)));
  } else {
    return ld16<A>(p);
  }
}

// 16 consecutive source values (bf16 or fp32) -> float x[16] (exact)
template <int A, bool F32>
__device__ __forceinline__ void load16_f32(const void* p, float (&x)[16]) {
  if constexpr (F32) {
    const float* f = static_cast<const float*>(p);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint4 a = ld16<A>(f + 4 * i);
      x[4 * i] = __uint_as_float(a.x);
      x[4 * i + 1] = __uint_as_float(a.y);
      x[4 * i + 2] = __uint_as_float(a.z);
      x[4 * i + 3] = __uint_as_float(a.w);
    }
  } else {
    const uint16_t* h = static_cast<const uint16_t*>(p);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const uint4 a = ld16<A>(h + 8 * i);
      const uint32_t w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        x[8 * i + 2 * j] = dev::bf16_lo(w[j]);
        x[8 * i + 2 * j + 1] = dev::bf16_hi(w[j]);
      }
    }
  }
}

// 16 floats -> 16 saturating e4m3 bytes
__device__ __forceinline__ uint4 e4m3x16(const float (&y)[16]) {
  uint32_t o[4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
    o[i] = dev::e4m3x2_from_f32(y[4 * i], y[4 * i + 1]) | (dev::e4m3x2_from_f32(y[4 * i + 2], y[4 * i + 3]) << 16);
  return make_uint4(o[0], o[1], o[2], o[3]);
}

// 2^ceil(log2(max(amax / 448, 1e-4))), exactly (slot_format.ds_mla_tile_scales)
__device__ __forceinline__ float ds_mla_scale(float amax) {
  float ratio = __fdiv_rn(amax, 448.0f);
  ratio = ratio < 1e-4f ? 1e-4f : ratio;  // torch.clamp(min=1e-4) in float32
  int e = 0;
  const float m = frexpf(ratio, &e);      // ratio = m * 2^e, m in [0.5, 1)
  const int ce = (m == 0.5f) ? e - 1 : e;  // ceil(log2(ratio))
  return ldexpf(1.0f, ce);                 // ce in [-13, 120]: a normal power of two
}

// ---- insert ------------------------------------------------------------------------
template <int A, CacheDtype CD, bool KV32, bool PE32>
__global__ void __launch_bounds__(dev::kThreads)
insert_kernel(uint8_t* __restrict__ cache, int64_t num_slots, const void* __restrict__ kv, int64_t kv_s0,
              const void* __restrict__ pe, int64_t pe_s0, const int64_t* __restrict__ slots, int64_t slot_s,
              int64_t T, float k_scale) {
  constexpr int64_t BPS = slot_bytes(CD);
  constexpr int KVB = KV32 ? 4 : 2, PEB = PE32 ? 4 : 2;  // bytes per source element
  const int lane = threadIdx.x & 31;
  const int64_t warp = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const int64_t nwarps = ((int64_t)gridDim.x * blockDim.x) >> 5;
  const uint8_t* kvb = static_cast<const uint8_t*>(kv);
  const uint8_t* peb = static_cast<const uint8_t*>(pe);
  for (int64_t t = warp; t < T; t += nwarps) {
    const int64_t slot = slots[t * slot_s];
    if (slot < 0 || slot >= num_slots) continue;  // warp-uniform
    uint8_t* dst = cache + slot * BPS;
    const uint8_t* src_kv = kvb + t * kv_s0 * KVB;
    const uint8_t* src_pe = peb + t * pe_s0 * PEB;
    if constexpr (CD == CacheDtype::Auto) {
      // 72 chunks of 8 bf16: 64 of c, 8 of k_pe
#pragma unroll
      for (int k = 0; k < 3; ++k) {
        const int c = lane + 32 * k;
        if (c < 64) st16<A>(dst + c * 16, load8_as_bf16<A, KV32>(src_kv + c * 8 * KVB));
        else if (c < 72) st16<A>(dst + c * 16, load8_as_bf16<A, PE32>(src_pe + (c - 64) * 8 * PEB));
      }
    } else if constexpr (CD == CacheDtype::Fp8) {
      // 36 chunks of 16 e4m3: 32 of c, 4 of k_pe
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        const int c = lane + 32 * k;
        if (c >= 36) continue;
        float x[16];
        if (c < 32) load16_f32<A, KV32>(src_kv + c * 16 * KVB, x);
        else load16_f32<A, PE32>(src_pe + (c - 32) * 16 * PEB, x);
#pragma unroll
        for (int i = 0; i < 16; ++i) x[i] = __fdiv_rn(x[i], k_scale);
        st16<A>(dst + c * 16, e4m3x16(x));
      }
    } else {
      // lane l: latent values 16l..16l+15, tile l/8 (8 lanes per tile of 128)
      float x[16];
      load16_f32<A, KV32>(src_kv + lane * 16 * KVB, x);
      float amax = 0.0f;
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        const float a = fabsf(x[i]);
        if (a <= 3.402823466e38f) amax = fmaxf(amax, a);  // finite values only (NaN, inf fail)
      }
#pragma unroll
      for (int o = 1; o < 8; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
      const float scale = ds_mla_scale(amax);
#pragma unroll
      for (int i = 0; i < 16; ++i) x[i] = __fdiv_rn(x[i], scale);
      st16<A>(dst + lane * 16, e4m3x16(x));
      if ((lane & 7) == 0) stf<A>(dst + kLatent + 4 * (lane >> 3), scale);
      if (lane < 8)
        st16<A>(dst + kLatent + 16 + lane * 16, load8_as_bf16<A, PE32>(src_pe + lane * 8 * PEB));
    }
  }
}

// ---- gather ------------------------------------------------------------------------
// Slot of chunk row `row`, or -1 (zeros) when no valid slot exists.
__device__ __forceinline__ int64_t row_slot(int64_t row, const int32_t* __restrict__ cu, int64_t cu_s,
                                            const int32_t* __restrict__ starts, int64_t st_s, int n,
                                            const int32_t* __restrict__ bt, int64_t bt_s0, int64_t bt_s1,
                                            int64_t max_blocks, int64_t num_blocks, int64_t block_size) {
  // b = the first sequence with cu[b+1] > row (sequences with no rows are skipped)
  int lo = 0, hi = n;
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if ((int64_t)__ldg(cu + (int64_t)(mid + 1) * cu_s) > row) hi = mid;
    else lo = mid + 1;
  }
  if (lo >= n) return -1;
  const int64_t j = (int64_t)__ldg(starts + (int64_t)lo * st_s) + row - (int64_t)__ldg(cu + (int64_t)lo * cu_s);
  if (j < 0) return -1;
  const int64_t bi = j / block_size;
  if (bi >= max_blocks) return -1;
  const int64_t blk = __ldg(bt + (int64_t)lo * bt_s0 + bi * bt_s1);
  if (blk < 0 || blk >= num_blocks) return -1;
  return blk * block_size + (j - bi * block_size);
}

// The slots of a warp step's R consecutive rows r0 .. r0 + R - 1: lane r looks up row
// r0 + r (the R chains of dependent loads run side by side), then every lane gets all R
// by shuffle. -1: past the end or unmapped (zeros).
template <int R>
__device__ __forceinline__ void warp_row_slots(int64_t (&slot)[R], int64_t r0, int lane, int64_t rows,
                                               const int32_t* __restrict__ cu, int64_t cu_s,
                                               const int32_t* __restrict__ starts, int64_t st_s, int n,
                                               const int32_t* __restrict__ bt, int64_t bt_s0, int64_t bt_s1,
                                               int64_t max_blocks, int64_t num_blocks, int64_t block_size) {
  const int64_t mine = lane < R && r0 + lane < rows
                           ? row_slot(r0 + lane, cu, cu_s, starts, st_s, n, bt, bt_s0, bt_s1, max_blocks,
                                      num_blocks, block_size)
                           : -1;
#pragma unroll
  for (int r = 0; r < R; ++r) slot[r] = __shfl_sync(0xffffffffu, mine, r);
}

template <int A, CacheDtype CD, bool OUT_FP8>
__global__ void __launch_bounds__(dev::kThreads)
gather_kernel(const uint8_t* __restrict__ cache, int64_t num_blocks, int64_t block_size,
              const int32_t* __restrict__ bt, int64_t bt_s0, int64_t bt_s1, int64_t max_blocks,
              const int32_t* __restrict__ cu, int64_t cu_s, const int32_t* __restrict__ starts, int64_t st_s,
              int n, uint8_t* __restrict__ out, int64_t out_s0_bytes, int64_t rows, float k_scale) {
  static_assert(CD != CacheDtype::Fp8DsMla, "fp8_ds_mla has gather_ds_mla_kernel");
  constexpr int64_t BPS = slot_bytes(CD);
  constexpr int U = OUT_FP8 ? 36 : 72;  // 16-byte output chunks per row
  constexpr int K = (U + 31) / 32;      // chunks per lane per row
  constexpr int R = 4;                  // rows per warp step (loads in flight per lane: R * K)
  const int lane = threadIdx.x & 31;
  const int64_t warp = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const int64_t nwarps = ((int64_t)gridDim.x * blockDim.x) >> 5;
  // A warp takes R rows per step. Their slot lookups (binary search, start, block
  // table: a chain of dependent loads) run side by side, lane r for row r0 + r,
  // instead of one row after another; every lane then fetches each row's slot by
  // shuffle and copies its 16-byte chunks of all R rows, R * K loads in flight.
  // (32 rows per warp is slower for small gathers: too few warps.)
  for (int64_t r0 = warp * R; r0 < rows; r0 += nwarps * R) {
    int64_t slot[R];
    warp_row_slots<R>(slot, r0, lane, rows, cu, cu_s, starts, st_s, n, bt, bt_s0, bt_s1, max_blocks, num_blocks,
                      block_size);
    // Three phases: every load of the R rows first, then the conversions, then the
    // stores. A conversion right after its load (one block per chunk) made the compiler
    // wait for each load before issuing the next: one load in flight per lane, and the
    // dequantizing gathers ran at 61-69 % of copy bandwidth.
    uint4 v[R][K];
    float sc[R][K];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const int c = lane + 32 * k;
        v[r][k] = make_uint4(0u, 0u, 0u, 0u);
        sc[r][k] = k_scale;
        if (c >= U || slot[r] < 0) continue;
        const uint8_t* src = cache + slot[r] * BPS;
        if constexpr (CD == CacheDtype::Auto || OUT_FP8) {
          v[r][k] = ld16<A>(src + c * 16);  // bf16 -> bf16, or raw fp8 bytes
        } else {  // fp8 -> bf16: 8 e4m3 per output chunk
          const uint2 q = ld8<A>(src + c * 8);
          v[r][k].x = q.x;
          v[r][k].y = q.y;
        }
      }
    if constexpr (CD != CacheDtype::Auto && !OUT_FP8) {
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int k = 0; k < K; ++k) {
          const int c = lane + 32 * k;
          if (c < U && slot[r] >= 0) v[r][k] = dev::bf16x8_from_e4m3x8_scaled(make_uint2(v[r][k].x, v[r][k].y), sc[r][k]);
        }
    }
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const int c = lane + 32 * k;
        if (c < U && r0 + r < rows) st16<A>(out + (r0 + r) * out_s0_bytes + c * 16, v[r][k]);
      }
  }
}

// fp8_ds_mla -> bf16, a lane per 16 latent bytes: one 16-byte load of 16 e4m3 values and
// one scale load per lane and row (gather_kernel's layout would issue two 8-byte loads
// and two scale loads for the same bytes), R rows per warp step; the two converted
// chunks of lane l (output chunks 2l, 2l+1) are passed by shuffles so that each store
// instruction writes 512 contiguous bytes. On an H200 (side by side): 86.7 % of copy
// at 256k rows, R = 4 85.9, the gather_kernel form 84.3.
template <int A, int R>
__global__ void __launch_bounds__(dev::kThreads)
gather_ds_mla_kernel(const uint8_t* __restrict__ cache, int64_t num_blocks, int64_t block_size,
                     const int32_t* __restrict__ bt, int64_t bt_s0, int64_t bt_s1, int64_t max_blocks,
                     const int32_t* __restrict__ cu, int64_t cu_s, const int32_t* __restrict__ starts, int64_t st_s,
                     int n, uint8_t* __restrict__ out, int64_t out_s0_bytes, int64_t rows) {
  constexpr int64_t BPS = slot_bytes(CacheDtype::Fp8DsMla);
  static_assert(kLatent == 32 * 16, "a lane per 16 latent bytes");
  const int lane = threadIdx.x & 31;
  const int64_t warp = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const int64_t nwarps = ((int64_t)gridDim.x * blockDim.x) >> 5;
  for (int64_t r0 = warp * R; r0 < rows; r0 += nwarps * R) {
    int64_t slot[R];
    warp_row_slots<R>(slot, r0, lane, rows, cu, cu_s, starts, st_s, n, bt, bt_s0, bt_s1, max_blocks, num_blocks,
                      block_size);
    uint4 q[R], pe[R];
    float sc[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {  // every load first (see gather_kernel)
      q[r] = pe[r] = make_uint4(0u, 0u, 0u, 0u);
      sc[r] = 0.f;
      if (slot[r] < 0) continue;
      const uint8_t* src = cache + slot[r] * BPS;
      q[r] = ld16<A>(src + lane * 16);
      sc[r] = ldf<A>(src + kLatent + 4 * (lane >> 3));  // 8 lanes = 128 values share a scale
      if (lane < kRope * 2 / 16) pe[r] = ld16<A>(src + kLatent + 16 + lane * 16);
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (r0 + r >= rows) break;  // rows of a warp step are consecutive: the rest are past the end too
      uint4 a = make_uint4(0u, 0u, 0u, 0u), b = a;
      if (slot[r] >= 0) {  // an unmapped row is zeros, as in gather_kernel
        a = dev::bf16x8_from_e4m3x8_scaled(make_uint2(q[r].x, q[r].y), sc[r]);
        b = dev::bf16x8_from_e4m3x8_scaled(make_uint2(q[r].z, q[r].w), sc[r]);
      }
      // output chunk j lives in lane j/2 (a: j even, b: j odd); store chunks lane and 32 + lane
      uint8_t* o = out + (r0 + r) * out_s0_bytes;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int from = half * 16 + (lane >> 1);
        uint4 x, y;
        x.x = __shfl_sync(0xffffffffu, a.x, from); x.y = __shfl_sync(0xffffffffu, a.y, from);
        x.z = __shfl_sync(0xffffffffu, a.z, from); x.w = __shfl_sync(0xffffffffu, a.w, from);
        y.x = __shfl_sync(0xffffffffu, b.x, from); y.y = __shfl_sync(0xffffffffu, b.y, from);
        y.z = __shfl_sync(0xffffffffu, b.z, from); y.w = __shfl_sync(0xffffffffu, b.w, from);
        st16<A>(o + (half * 32 + lane) * 16, (lane & 1) ? y : x);
      }
      if (lane < kRope * 2 / 16) st16<A>(o + kLatent * 2 + lane * 16, pe[r]);
    }
  }
}

template <int A, CacheDtype CD>
cudaError_t insert_dispatch(uint8_t* cache, int64_t num_slots, const void* kv, int64_t kv_s0, bool kv32,
                            const void* pe, int64_t pe_s0, bool pe32, const int64_t* slots, int64_t slot_s,
                            int64_t T, float ks, cudaStream_t s) {
  const unsigned grid = grid_for(T, dev::kThreads / 32, 2);
#define CTXP_INS(K_, P_) \
  insert_kernel<A, CD, K_, P_><<<grid, dev::kThreads, 0, s>>>(cache, num_slots, kv, kv_s0, pe, pe_s0, slots, slot_s, T, ks)
  if (kv32) {
    if (pe32) CTXP_INS(true, true);
    else CTXP_INS(true, false);
  } else {
    if (pe32) CTXP_INS(false, true);
    else CTXP_INS(false, false);
  }
#undef CTXP_INS
  return cudaGetLastError();
}

template <int A>
cudaError_t gather_dispatch(const uint8_t* cache, int64_t num_blocks, int64_t block_size, CacheDtype cd,
                            const int32_t* bt, int64_t bt_s0, int64_t bt_s1, int64_t max_blocks,
                            const int32_t* cu, int64_t cu_s, const int32_t* st, int64_t st_s, int n,
                            uint8_t* out, int64_t out_s0_bytes, bool out_fp8, int64_t rows, float ks,
                            cudaStream_t s) {
  // one resident wave, grid-stride over the rows
#define CTXP_GAT(CD_, F8_)                                                                                 \
  gather_kernel<A, CD_, F8_><<<grid_one_wave<gather_kernel<A, CD_, F8_>>(rows, dev::kThreads / 32 * 4),   \
                               dev::kThreads, 0, s>>>(cache, num_blocks, block_size, bt, bt_s0, bt_s1,    \
                                                      max_blocks, cu, cu_s, st, st_s, n, out, out_s0_bytes, \
                                                      rows, ks)
  switch (cd) {
    case CacheDtype::Auto: CTXP_GAT(CacheDtype::Auto, false); break;
    case CacheDtype::Fp8:
      if (out_fp8) CTXP_GAT(CacheDtype::Fp8, true);
      else CTXP_GAT(CacheDtype::Fp8, false);
      break;
    default:  // fp8_ds_mla -> bf16, 8 rows per warp step
      gather_ds_mla_kernel<A, 8><<<grid_one_wave<gather_ds_mla_kernel<A, 8>>(rows, dev::kThreads / 32 * 8),
                                   dev::kThreads, 0, s>>>(cache, num_blocks, block_size, bt, bt_s0, bt_s1, max_blocks,
                                                          cu, cu_s, st, st_s, n, out, out_s0_bytes, rows);
      break;
  }
#undef CTXP_GAT
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_insert(uint8_t* cache, int64_t num_slots, CacheDtype cache_dtype, const void* kv_c,
                          int64_t kv_s0, DType kv_dtype, const void* k_pe, int64_t pe_s0, DType pe_dtype,
                          const int64_t* slot_mapping, int64_t slot_s, int64_t T, double k_scale,
                          cudaStream_t stream) {
  if (T <= 0 || num_slots <= 0) return cudaSuccess;
  const bool kv32 = kv_dtype == DType::FP32, pe32 = pe_dtype == DType::FP32;
  if ((!kv32 && kv_dtype != DType::BF16) || (!pe32 && pe_dtype != DType::BF16)) return cudaErrorInvalidValue;
  const int64_t kvb = kv32 ? 4 : 2, peb = pe32 ? 4 : 2;
  const bool vec = aligned16(cache) && aligned16(kv_c) && aligned16(k_pe) && (kv_s0 * kvb) % 16 == 0 &&
                   (pe_s0 * peb) % 16 == 0;
  const float ks = (float)k_scale;
#define CTXP_I(A_, CD_) \
  insert_dispatch<A_, CD_>(cache, num_slots, kv_c, kv_s0, kv32, k_pe, pe_s0, pe32, slot_mapping, slot_s, T, ks, stream)
  switch (cache_dtype) {
    case CacheDtype::Auto: return vec ? CTXP_I(16, CacheDtype::Auto) : CTXP_I(1, CacheDtype::Auto);
    case CacheDtype::Fp8: return vec ? CTXP_I(16, CacheDtype::Fp8) : CTXP_I(1, CacheDtype::Fp8);
    case CacheDtype::Fp8DsMla: return vec ? CTXP_I(16, CacheDtype::Fp8DsMla) : CTXP_I(1, CacheDtype::Fp8DsMla);
  }
#undef CTXP_I
  return cudaErrorInvalidValue;
}

cudaError_t launch_gather(const uint8_t* cache, int64_t num_blocks, int64_t block_size, CacheDtype cache_dtype,
                          const int32_t* block_table, int64_t bt_s0, int64_t bt_s1, int64_t max_blocks,
                          const int32_t* cu_seq_lens, int64_t cu_s, const int32_t* seq_starts, int64_t st_s,
                          int64_t num_seqs, void* out, int64_t out_s0, DType out_dtype, int64_t rows,
                          double k_scale, cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  if (block_size <= 0 || num_seqs < 0 || num_seqs > (int64_t)0x7fffffff) return cudaErrorInvalidValue;
  const bool out_fp8 = out_dtype == DType::FP8E4M3;
  if (!out_fp8 && out_dtype != DType::BF16) return cudaErrorInvalidValue;
  if (out_fp8 && cache_dtype != CacheDtype::Fp8) return cudaErrorInvalidValue;
  const int64_t out_s0_bytes = out_s0 * (out_fp8 ? 1 : 2);
  const bool vec = aligned16(cache) && aligned16(out) && out_s0_bytes % 16 == 0;
  auto* o = static_cast<uint8_t*>(out);
  const int n = (int)num_seqs;
  const float ks = (float)k_scale;
  return vec ? gather_dispatch<16>(cache, num_blocks, block_size, cache_dtype, block_table, bt_s0, bt_s1,
                                   max_blocks, cu_seq_lens, cu_s, seq_starts, st_s, n, o, out_s0_bytes,
                                   out_fp8, rows, ks, stream)
             : gather_dispatch<1>(cache, num_blocks, block_size, cache_dtype, block_table, bt_s0, bt_s1,
                                  max_blocks, cu_seq_lens, cu_s, seq_starts, st_s, n, o, out_s0_bytes,
                                  out_fp8, rows, ks, stream);
}

}  // namespace ctxprefill
