// ctxprefill CUDA kernels: the plain C++ launch interface.
//
// Nothing here includes torch: the .cu files compile with a bare nvcc
// (`nvcc -gencode=arch=compute_90a,code=sm_90a -c`), and csrc/binding.cpp is
// the one translation unit that sees torch. Every launcher takes raw device
// pointers, sizes and strides, launches on the given stream, and returns the
// launch's cudaError_t (cudaSuccess when there was nothing to do).
//
// Strides are in ELEMENTS of the tensor they belong to, except where a name
// ends in `_bytes`. All inputs need a unit last stride only; the launcher picks
// the 16-byte vector kernels when every pointer and row stride is 16-byte
// aligned, and a byte-wise fallback otherwise (correct, not fast).
//
// Numerics are the torch references' (server/ctxprefill/ops/*.py), bit for bit:
// see each .cu file's header comment.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#if defined(__CUDACC__)
#define CTXPREFILL_HD __host__ __device__
#else
#define CTXPREFILL_HD
#endif

namespace ctxprefill {

enum class DType : int { BF16 = 0, FP16 = 1, FP32 = 2, FP8E4M3 = 3 };
enum class CacheDtype : int { Auto = 0, Fp8 = 1, Fp8DsMla = 2 };

// Model constants the kernels are built for (DeepSeek-V3 / Kimi MLA).
constexpr int kLatent = 512;     // L, kv_lora_rank
constexpr int kRope = 64;        // R, qk_rope_head_dim
constexpr int kNope = 128;       // P, qk_nope_head_dim
constexpr int kV = 128;          // V, v_head_dim
constexpr int kQK = kNope + kRope;  // 192
// Rows of storage past a keys-last chunk's fp8 K (ops/pack.py's KEY_SLACK_ROWS): attention
// that loads K in whole 16-key groups reads up to 15 rows past the last segment (masked).
constexpr int kKeySlackRows = 15;
constexpr int kDsTile = 128;     // fp8_ds_mla tile of latent values sharing one scale

// Bytes per cache slot (CONTRACT §2): auto 1152, fp8 576, fp8_ds_mla 656.
CTXPREFILL_HD constexpr int64_t slot_bytes(CacheDtype d) {
  return d == CacheDtype::Auto ? 2 * (kLatent + kRope)
       : d == CacheDtype::Fp8  ? (kLatent + kRope)
                               : kLatent + 4 * (kLatent / kDsTile) + 2 * kRope;
}

// ---- pack (csrc/pack.cu) -------------------------------------------------------
// k[t, h, :] = [k_nope[t, h, :] | k_pe[t, :]]; k contiguous [T, H, 192] of `dtype`
// (BF16 or FP16). k_nope [T, H, 128] strides (kn_s0, kn_s1, 1); k_pe [T, 64]
// stride (pe_s0, 1), same dtype. k is written as a flat run of 16-byte chunks, each
// loaded from its source (a token's k_pe row is a cache hit after its first head).
cudaError_t launch_kv_concat(const void* k_nope, int64_t kn_s0, int64_t kn_s1,
                             const void* k_pe, int64_t pe_s0, void* k, int64_t T,
                             int64_t H, DType dtype, cudaStream_t stream);

// As launch_kv_concat, plus the saturating fp8 e4m3 cast of k and v:
// k_fp8 contiguous [T, H, 192], v_fp8 contiguous [T, H, 128] (bytes).
// k_pe is `dtype` (converted) or FP8E4M3 (its bytes copied); v [T, H, 128] of
// `dtype` with strides (v_s0, v_s1, 1).
cudaError_t launch_kv_concat_quant_fp8(const void* k_nope, int64_t kn_s0, int64_t kn_s1,
                                       const void* k_pe, int64_t pe_s0, DType pe_dtype,
                                       const void* v, int64_t v_s0, int64_t v_s1,
                                       void* k_fp8, void* v_fp8, int64_t T, int64_t H,
                                       DType dtype, cudaStream_t stream);

// As launch_kv_concat_quant_fp8, with V written keys-last, one segment after another:
// v_fp8_t [H, 128, v_cols] contiguous (16-byte aligned base, v_cols a multiple of 16),
// segment s (tokens cu_seqlens_k[s] .. cu_seqlens_k[s+1]) from column cu_seqlens_v[s]
// (a multiple of 16, increasing, with room for the segment before the next start or
// v_cols): v_fp8_t[h, d, cu_seqlens_v[s] + j] = sat_e4m3(v[cu_seqlens_k[s] + j, h, d]);
// every other column 0. cu_seqlens_* are int32 device arrays of B + 1 entries, trusted
// (the engine builds them from a checked plan). One launch.
cudaError_t launch_kv_concat_quant_fp8_vt(const void* k_nope, int64_t kn_s0, int64_t kn_s1,
                                          const void* k_pe, int64_t pe_s0, DType pe_dtype,
                                          const void* v, int64_t v_s0, int64_t v_s1, const int32_t* cu_seqlens_k,
                                          const int32_t* cu_seqlens_v, int64_t B, void* k_fp8, void* v_fp8_t,
                                          int64_t v_cols, int64_t T, int64_t H, DType dtype, cudaStream_t stream);

// ---- cache ops (csrc/cache_ops.cu) ---------------------------------------------
// Insert T tokens: kv_c [T, 512] (BF16 or FP32, row stride kv_s0), k_pe [T, 64]
// (BF16 or FP32, row stride pe_s0) into cache rows slot_mapping[t] (int64, stride
// slot_s). cache is contiguous [num_slots, slot_bytes(cache_dtype)] uint8. A slot
// outside [0, num_slots) (-1 = skip) is not written.
cudaError_t launch_insert(uint8_t* cache, int64_t num_slots, CacheDtype cache_dtype,
                          const void* kv_c, int64_t kv_s0, DType kv_dtype,
                          const void* k_pe, int64_t pe_s0, DType pe_dtype,
                          const int64_t* slot_mapping, int64_t slot_s, int64_t T,
                          double k_scale, cudaStream_t stream);

// Gather `rows` rows of one chunk into out [rows, 576] (row stride out_s0 elements,
// BF16 or, for the Fp8 cache only, FP8E4M3 = raw bytes). Row r belongs to the
// sequence b with cu_seq_lens[b] <= r < cu_seq_lens[b+1] (binary search on the
// device, no host sync); it is context token j = seq_starts[b] + r - cu[b], in slot
// block_table[b, j / block_size] * block_size + j % block_size. A row with no
// sequence, a block index past max_blocks or a block id outside [0, num_blocks)
// gets zeros (defense in depth: the host checked every index already).
cudaError_t launch_gather(const uint8_t* cache, int64_t num_blocks, int64_t block_size,
                          CacheDtype cache_dtype, const int32_t* block_table,
                          int64_t bt_s0, int64_t bt_s1, int64_t max_blocks,
                          const int32_t* cu_seq_lens, int64_t cu_s,
                          const int32_t* seq_starts, int64_t st_s, int64_t num_seqs,
                          void* out, int64_t out_s0, DType out_dtype, int64_t rows,
                          double k_scale, cudaStream_t stream);

// ---- merge (csrc/merge.cu) ------------------------------------------------------
// In place: (out [T, H, V] bf16, lse [H, T] f32) <- merge with (part [T, H, V] bf16,
// part_lse [H, T] f32). out/part strides (s0, s1, 1); lse strides arbitrary.
cudaError_t launch_merge(void* out, int64_t o_s0, int64_t o_s1, float* lse, int64_t l_s0,
                         int64_t l_s1, const void* part, int64_t p_s0, int64_t p_s1,
                         const float* part_lse, int64_t pl_s0, int64_t pl_s1, int64_t T,
                         int64_t H, int64_t V, cudaStream_t stream);

}  // namespace ctxprefill
