// The one torch-facing translation unit of the ctxprefill CUDA extension.
//
// Thin on purpose (this header set is the slow part of the build): every input is
// checked up front — device, dtype, shape, unit last stride, contiguity of the
// outputs — with a message naming the argument, outputs are allocated here, and
// the plain launchers of csrc/launchers.h run on the current CUDA stream. The
// Python signatures are the ones server/ctxprefill/ops/*.py call.

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <memory>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <torch/extension.h>

#include "driver_entry.h"
#include "graph_patch.h"
#include "launchers.h"

namespace {

using ctxprefill::CacheDtype;
using ctxprefill::DType;

constexpr auto kFp8 = at::ScalarType::Float8_e4m3fn;

// Error messages are built as plain std::string here and never stream numbers or
// c10::ArrayRef through TORCH_CHECK's ostringstream: on the GPU machine that
// instantiated libstdc++'s ostream code inside this .so and crashed (SIGSEGV in
// basic_ostream::_M_insert<long>, called on torch's own stream object).
std::string txt(const char* s) { return s; }
std::string txt(const std::string& s) { return s; }
std::string txt(at::ScalarType t) { return c10::toString(t); }
std::string txt(const at::Device& d) { return d.str(); }
std::string txt(c10::IntArrayRef a) {
  std::string s = "[";
  for (size_t i = 0; i < a.size(); ++i) s += (i ? ", " : "") + std::to_string(a[i]);
  return s + "]";
}
template <typename T, std::enable_if_t<std::is_arithmetic_v<T>, int> = 0>
std::string txt(T v) { return std::to_string(v); }
template <typename... A>
std::string msg(const A&... a) { return (std::string() + ... + txt(a)); }
#define ARG_CHECK(cond, ...) TORCH_CHECK(cond, msg(__VA_ARGS__))

DType dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::ScalarType::BFloat16: return DType::BF16;
    case at::ScalarType::Half: return DType::FP16;
    case at::ScalarType::Float: return DType::FP32;
    case at::ScalarType::Float8_e4m3fn: return DType::FP8E4M3;
    default: ARG_CHECK(false, "ctxprefill: unsupported dtype ", t.scalar_type());
  }
  return DType::BF16;
}

CacheDtype parse_cache_dtype(const std::string& s) {
  if (s == "auto") return CacheDtype::Auto;
  if (s == "fp8") return CacheDtype::Fp8;
  if (s == "fp8_ds_mla") return CacheDtype::Fp8DsMla;
  ARG_CHECK(false, "ctxprefill: cache_dtype must be one of auto, fp8, fp8_ds_mla; got '", s, "'");
  return CacheDtype::Auto;
}

// `t` is a CUDA tensor on `dev` (the device of the op's first tensor)
void check_device(const at::Tensor& t, const char* op, const char* name, const at::Device& dev) {
  ARG_CHECK(t.is_cuda(), op, ": ", name, " must be a CUDA tensor, got one on ", t.device());
  ARG_CHECK(t.device() == dev, op, ": ", name, " is on ", t.device(), " but the other inputs are on ", dev);
}

void check_dim(const at::Tensor& t, const char* op, const char* name, int64_t dim) {
  ARG_CHECK(t.dim() == dim, op, ": ", name, " must be ", dim, "-D, got shape ", t.sizes());
}

void check_size(const at::Tensor& t, const char* op, const char* name, int64_t d, int64_t want) {
  ARG_CHECK(t.size(d) == want, op, ": ", name, ".shape[", d, "] must be ", want, ", got shape ", t.sizes());
}

void check_dtype(const at::Tensor& t, const char* op, const char* name, at::ScalarType want) {
  ARG_CHECK(t.scalar_type() == want, op, ": ", name, " must be ", want, ", got ", t.scalar_type());
}

void check_unit_last(const at::Tensor& t, const char* op, const char* name) {
  ARG_CHECK(t.size(-1) <= 1 || t.stride(-1) == 1, op, ": ", name,
              " needs a unit last stride, got strides ", t.strides());
}

void check_launch(cudaError_t e, const char* op) {
  ARG_CHECK(e == cudaSuccess, op, ": CUDA kernel launch failed: ", cudaGetErrorString(e));
}

// k_pe as [T, 64] (accepts [T, 1, 64]); returns its row stride in elements
int64_t pe_row_stride(const at::Tensor& k_pe, const char* op, int64_t T) {
  ARG_CHECK(k_pe.dim() == 2 || (k_pe.dim() == 3 && k_pe.size(1) == 1), op,
              ": k_pe must be [T, 64] or [T, 1, 64], got shape ", k_pe.sizes());
  check_size(k_pe, op, "k_pe", 0, T);
  ARG_CHECK(k_pe.size(-1) == ctxprefill::kRope, op, ": k_pe's last dim must be ", ctxprefill::kRope,
              ", got shape ", k_pe.sizes());
  check_unit_last(k_pe, op, "k_pe");
  return k_pe.stride(0);
}

void check_pack_half(const at::Tensor& x, const char* op, const char* name, int64_t last) {
  check_dim(x, op, name, 3);
  check_size(x, op, name, 2, last);
  check_unit_last(x, op, name);
}

// ---- pack --------------------------------------------------------------------------

at::Tensor fused_mla_kv_concat(const at::Tensor& k_nope, const at::Tensor& k_pe) {
  const char* op = "fused_mla_kv_concat";
  ARG_CHECK(k_nope.is_cuda(), op, ": k_nope must be a CUDA tensor, got one on ", k_nope.device());
  const auto dev = k_nope.device();
  check_device(k_pe, op, "k_pe", dev);
  check_pack_half(k_nope, op, "k_nope", ctxprefill::kNope);
  const auto st = k_nope.scalar_type();
  ARG_CHECK(st == at::ScalarType::BFloat16 || st == at::ScalarType::Half, op,
              ": k_nope must be bfloat16 or float16, got ", st);
  check_dtype(k_pe, op, "k_pe", st);
  const int64_t T = k_nope.size(0), H = k_nope.size(1);
  const int64_t pe_s0 = pe_row_stride(k_pe, op, T);
  auto k = at::empty({T, H, ctxprefill::kQK}, k_nope.options());
  if (T == 0 || H == 0) return k;
  const c10::cuda::CUDAGuard guard(dev);
  check_launch(ctxprefill::launch_kv_concat(k_nope.data_ptr(), k_nope.stride(0), k_nope.stride(1), k_pe.data_ptr(),
                                            pe_s0, k.data_ptr(), T, H, dtype_of(k_nope),
                                            c10::cuda::getCurrentCUDAStream(dev.index()).stream()),
               op);
  return k;
}

// The checks both fp8 packs make of their inputs; returns k_pe's row stride.
int64_t check_quant_pack(const at::Tensor& k_nope, const at::Tensor& k_pe, const at::Tensor& v, const char* op) {
  ARG_CHECK(k_nope.is_cuda(), op, ": k_nope must be a CUDA tensor, got one on ", k_nope.device());
  const auto dev = k_nope.device();
  check_device(k_pe, op, "k_pe", dev);
  check_device(v, op, "v", dev);
  check_pack_half(k_nope, op, "k_nope", ctxprefill::kNope);
  check_pack_half(v, op, "v", ctxprefill::kV);
  const auto st = k_nope.scalar_type();
  ARG_CHECK(st == at::ScalarType::BFloat16 || st == at::ScalarType::Half, op,
              ": k_nope must be bfloat16 or float16, got ", st);
  check_dtype(v, op, "v", st);
  ARG_CHECK(k_pe.scalar_type() == st || k_pe.scalar_type() == kFp8, op, ": k_pe must be ", st,
              " or float8_e4m3fn, got ", k_pe.scalar_type());
  const int64_t T = k_nope.size(0), H = k_nope.size(1);
  ARG_CHECK(v.size(0) == T && v.size(1) == H, op, ": v ", v.sizes(), " does not match k_nope ", k_nope.sizes());
  return pe_row_stride(k_pe, op, T);
}

std::tuple<at::Tensor, at::Tensor> fused_mla_kv_concat_quant_fp8(const at::Tensor& k_nope, const at::Tensor& k_pe,
                                                                 const at::Tensor& v) {
  const char* op = "fused_mla_kv_concat_quant_fp8";
  const int64_t pe_s0 = check_quant_pack(k_nope, k_pe, v, op);
  const auto dev = k_nope.device();
  const int64_t T = k_nope.size(0), H = k_nope.size(1);
  const auto o8 = k_nope.options().dtype(kFp8);
  auto k8 = at::empty({T, H, ctxprefill::kQK}, o8);
  auto v8 = at::empty({T, H, ctxprefill::kV}, o8);
  if (T == 0 || H == 0) return {k8, v8};
  const c10::cuda::CUDAGuard guard(dev);
  check_launch(ctxprefill::launch_kv_concat_quant_fp8(
                   k_nope.data_ptr(), k_nope.stride(0), k_nope.stride(1), k_pe.data_ptr(), pe_s0, dtype_of(k_pe),
                   v.data_ptr(), v.stride(0), v.stride(1), k8.data_ptr(), v8.data_ptr(), T, H, dtype_of(k_nope),
                   c10::cuda::getCurrentCUDAStream(dev.index()).stream()),
               op);
  return {k8, v8};
}

// V keys-last: v8t [H, 128, v_cols], segment s from column cu_seqlens_v[s] (launchers.h).
std::tuple<at::Tensor, at::Tensor> fused_mla_kv_concat_quant_fp8_vt(const at::Tensor& k_nope,
                                                                    const at::Tensor& k_pe, const at::Tensor& v,
                                                                    const at::Tensor& cu_seqlens_k,
                                                                    const at::Tensor& cu_seqlens_v, int64_t v_cols) {
  const char* op = "fused_mla_kv_concat_quant_fp8_vt";
  const int64_t pe_s0 = check_quant_pack(k_nope, k_pe, v, op);
  const auto dev = k_nope.device();
  check_device(cu_seqlens_k, op, "cu_seqlens_k", dev);
  check_device(cu_seqlens_v, op, "cu_seqlens_v", dev);
  for (const auto* cu : {&cu_seqlens_k, &cu_seqlens_v}) {
    check_dtype(*cu, op, "cu_seqlens", at::ScalarType::Int);
    check_dim(*cu, op, "cu_seqlens", 1);
    ARG_CHECK(cu->is_contiguous(), op, ": cu_seqlens_k / cu_seqlens_v must be contiguous");
  }
  const int64_t B = cu_seqlens_k.size(0) - 1;
  ARG_CHECK(B >= 1 && cu_seqlens_v.size(0) == B + 1, op, ": cu_seqlens_k and cu_seqlens_v need B + 1 >= 2 entries each, got ",
              cu_seqlens_k.size(0), " and ", cu_seqlens_v.size(0));
  const int64_t T = k_nope.size(0), H = k_nope.size(1);
  ARG_CHECK(v_cols >= T && v_cols % 16 == 0, op, ": v_cols must be a multiple of 16 and >= T = ", T, ", got ", v_cols);
  const auto o8 = k_nope.options().dtype(kFp8);
  // K with the rows past its end that attention may read (launchers.h: kKeySlackRows)
  auto k8 = at::empty({T + ctxprefill::kKeySlackRows, H, ctxprefill::kQK}, o8).narrow(0, 0, T);
  auto v8t = at::empty({H, ctxprefill::kV, v_cols}, o8);
  if (T == 0 || H == 0) return {k8, v8t};
  const c10::cuda::CUDAGuard guard(dev);
  check_launch(ctxprefill::launch_kv_concat_quant_fp8_vt(
                   k_nope.data_ptr(), k_nope.stride(0), k_nope.stride(1), k_pe.data_ptr(), pe_s0, dtype_of(k_pe),
                   v.data_ptr(), v.stride(0), v.stride(1), cu_seqlens_k.data_ptr<int32_t>(),
                   cu_seqlens_v.data_ptr<int32_t>(), B, k8.data_ptr(), v8t.data_ptr(), v_cols, T, H,
                   dtype_of(k_nope), c10::cuda::getCurrentCUDAStream(dev.index()).stream()),
               op);
  return {k8, v8t};
}

// ---- cache ops ------------------------------------------------------------------------

void check_cache(const at::Tensor& cache, const char* op, CacheDtype cd) {
  check_dim(cache, op, "cache", 2);
  check_dtype(cache, op, "cache", at::ScalarType::Byte);
  ARG_CHECK(cache.is_contiguous(), op, ": cache must be contiguous, got strides ", cache.strides());
  ARG_CHECK(cache.size(1) == ctxprefill::slot_bytes(cd), op, ": cache rows are ", cache.size(1),
              " bytes, but this cache dtype has ", ctxprefill::slot_bytes(cd), " bytes per slot");
}

void insert(at::Tensor cache, const at::Tensor& kv_c, const at::Tensor& k_pe, const at::Tensor& slot_mapping,
            const std::string& cache_dtype, double k_scale) {
  const char* op = "insert";
  const CacheDtype cd = parse_cache_dtype(cache_dtype);
  ARG_CHECK(cache.is_cuda(), op, ": cache must be a CUDA tensor, got one on ", cache.device());
  const auto dev = cache.device();
  check_device(kv_c, op, "kv_c", dev);
  check_device(k_pe, op, "k_pe", dev);
  check_device(slot_mapping, op, "slot_mapping", dev);
  check_cache(cache, op, cd);
  check_dim(kv_c, op, "kv_c", 2);
  check_dim(k_pe, op, "k_pe", 2);
  check_dim(slot_mapping, op, "slot_mapping", 1);
  check_dtype(slot_mapping, op, "slot_mapping", at::ScalarType::Long);
  const int64_t T = slot_mapping.size(0);
  check_size(kv_c, op, "kv_c", 0, T);
  check_size(kv_c, op, "kv_c", 1, ctxprefill::kLatent);
  check_size(k_pe, op, "k_pe", 0, T);
  check_size(k_pe, op, "k_pe", 1, ctxprefill::kRope);
  for (const auto* p : {&kv_c, &k_pe}) {
    const auto s = p->scalar_type();
    ARG_CHECK(s == at::ScalarType::BFloat16 || s == at::ScalarType::Float, op, ": ",
                p == &kv_c ? "kv_c" : "k_pe", " must be bfloat16 or float32, got ", s);
  }
  check_unit_last(kv_c, op, "kv_c");
  check_unit_last(k_pe, op, "k_pe");
  ARG_CHECK(std::isfinite(k_scale) && k_scale > 0, op, ": k_scale must be finite and > 0, got ", k_scale);
  if (T == 0) return;
  const c10::cuda::CUDAGuard guard(dev);
  check_launch(ctxprefill::launch_insert(cache.data_ptr<uint8_t>(), cache.size(0), cd, kv_c.data_ptr(), kv_c.stride(0),
                                         dtype_of(kv_c), k_pe.data_ptr(), k_pe.stride(0), dtype_of(k_pe),
                                         slot_mapping.data_ptr<int64_t>(), slot_mapping.stride(0), T, k_scale,
                                         c10::cuda::getCurrentCUDAStream(dev.index()).stream()),
               op);
}

void gather(const at::Tensor& cache, const at::Tensor& block_table, const at::Tensor& cu_seq_lens,
            const at::Tensor& seq_starts, at::Tensor out, const std::string& cache_dtype, double k_scale,
            int64_t block_size) {
  const char* op = "gather";
  const CacheDtype cd = parse_cache_dtype(cache_dtype);
  ARG_CHECK(cache.is_cuda(), op, ": cache must be a CUDA tensor, got one on ", cache.device());
  const auto dev = cache.device();
  check_device(block_table, op, "block_table", dev);
  check_device(cu_seq_lens, op, "cu_seq_lens", dev);
  check_device(seq_starts, op, "seq_starts", dev);
  check_device(out, op, "out", dev);
  check_cache(cache, op, cd);
  ARG_CHECK(block_size > 0, op, ": block_size must be > 0, got ", block_size);
  check_dim(block_table, op, "block_table", 2);
  check_dim(cu_seq_lens, op, "cu_seq_lens", 1);
  check_dim(seq_starts, op, "seq_starts", 1);
  check_dtype(block_table, op, "block_table", at::ScalarType::Int);
  check_dtype(cu_seq_lens, op, "cu_seq_lens", at::ScalarType::Int);
  check_dtype(seq_starts, op, "seq_starts", at::ScalarType::Int);
  const int64_t n = block_table.size(0);
  ARG_CHECK(cu_seq_lens.size(0) == n + 1, op, ": cu_seq_lens must have n+1 = ", n + 1,
              " entries for a block table of ", n, " rows, got ", cu_seq_lens.size(0));
  ARG_CHECK(seq_starts.size(0) == n, op, ": seq_starts must have ", n, " entries, got ", seq_starts.size(0));
  check_dim(out, op, "out", 2);
  check_size(out, op, "out", 1, ctxprefill::kLatent + ctxprefill::kRope);
  ARG_CHECK(out.is_contiguous(), op, ": out must be contiguous, got strides ", out.strides());
  const auto ot = out.scalar_type();
  ARG_CHECK(ot == at::ScalarType::BFloat16 || ot == kFp8, op, ": out must be bfloat16 or float8_e4m3fn, got ", ot);
  ARG_CHECK(ot != kFp8 || cd == CacheDtype::Fp8, op,
              ": an float8_e4m3fn out (raw bytes) needs the 'fp8' cache, got '", cache_dtype, "'");
  ARG_CHECK(std::isfinite(k_scale), op, ": k_scale must be finite, got ", k_scale);
  const int64_t rows = out.size(0);
  if (rows == 0) return;
  const c10::cuda::CUDAGuard guard(dev);
  check_launch(ctxprefill::launch_gather(cache.data_ptr<uint8_t>(), cache.size(0) / block_size, block_size, cd,
                                         block_table.data_ptr<int32_t>(), block_table.stride(0),
                                         block_table.stride(1), block_table.size(1), cu_seq_lens.data_ptr<int32_t>(),
                                         cu_seq_lens.stride(0), seq_starts.data_ptr<int32_t>(), seq_starts.stride(0),
                                         n, out.data_ptr(), out.stride(0), dtype_of(out), rows, k_scale,
                                         c10::cuda::getCurrentCUDAStream(dev.index()).stream()),
               op);
}

// ---- merge -------------------------------------------------------------------------------

void merge(at::Tensor out, at::Tensor lse, const at::Tensor& part_out, const at::Tensor& part_lse) {
  const char* op = "merge";
  ARG_CHECK(out.is_cuda(), op, ": out must be a CUDA tensor, got one on ", out.device());
  const auto dev = out.device();
  check_device(lse, op, "lse", dev);
  check_device(part_out, op, "part_out", dev);
  check_device(part_lse, op, "part_lse", dev);
  check_dim(out, op, "out", 3);
  check_dim(part_out, op, "part_out", 3);
  check_dim(lse, op, "lse", 2);
  check_dim(part_lse, op, "part_lse", 2);
  check_dtype(out, op, "out", at::ScalarType::BFloat16);
  check_dtype(part_out, op, "part_out", at::ScalarType::BFloat16);
  check_dtype(lse, op, "lse", at::ScalarType::Float);
  check_dtype(part_lse, op, "part_lse", at::ScalarType::Float);
  const int64_t T = out.size(0), H = out.size(1), V = out.size(2);
  ARG_CHECK(part_out.sizes() == out.sizes(), op, ": part_out ", part_out.sizes(), " does not match out ",
              out.sizes());
  ARG_CHECK(lse.size(0) == H && lse.size(1) == T, op, ": lse must be [H, T] = [", H, ", ", T, "], got ",
              lse.sizes());
  ARG_CHECK(part_lse.sizes() == lse.sizes(), op, ": part_lse ", part_lse.sizes(), " does not match lse ",
              lse.sizes());
  check_unit_last(out, op, "out");
  check_unit_last(part_out, op, "part_out");
  if (T == 0 || H == 0 || V == 0) return;
  const c10::cuda::CUDAGuard guard(dev);
  check_launch(ctxprefill::launch_merge(out.data_ptr(), out.stride(0), out.stride(1), lse.data_ptr<float>(),
                                        lse.stride(0), lse.stride(1), part_out.data_ptr(), part_out.stride(0),
                                        part_out.stride(1), part_lse.data_ptr<float>(), part_lse.stride(0),
                                        part_lse.stride(1), T, H, V,
                                        c10::cuda::getCurrentCUDAStream(dev.index()).stream()),
               op);
}

// ---- CUDA IPC (the shared-memory transport, docs/TRANSPORT.md) ----------------------------
//
// ipc_open maps another process's device memory, given its cudaIpcMemHandle_t, and returns
// a uint8 CUDA tensor of [base + offset, base + offset + byte_size) whose deleter calls
// cudaIpcCloseMemHandle. Errors are raised as std exceptions that pybind11 turns into
// Python types the registry maps to status codes: std::invalid_argument -> ValueError
// (bad handle, device, sizes; a handle that does not open here), std::out_of_range ->
// IndexError (the range is past the end of the allocation), std::runtime_error ->
// RuntimeError (a CUDA call that should not fail did). The handle is closed on every
// error path after it opened. (CUDA reference-counts a handle opened twice in one
// context, so several regions of one allocation each open and close it.)

using MemGetAddressRangeFn = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);

// The driver's cuMemGetAddressRange (the allocation's true extent, so that a region past
// its end is refused before a kernel reads it), fetched through the runtime: no libcuda
// link needed. nullptr when the driver does not provide it.
MemGetAddressRangeFn mem_get_address_range() {
  static const auto fn =
      reinterpret_cast<MemGetAddressRangeFn>(ctxprefill::driver_entry_point("cuMemGetAddressRange", 12000));
  return fn;
}

// Close an opened handle (on its device); errors are reported on stderr, never thrown
// (this runs in a tensor deleter).
void ipc_close(void* base, int device) {
  int prev = -1;
  const cudaError_t g = cudaGetDevice(&prev);
  if (g != cudaSuccess) {
    (void)cudaGetLastError();
    prev = -1;
  }
  cudaError_t e = cudaSetDevice(device);
  if (e == cudaSuccess) e = cudaIpcCloseMemHandle(base);
  if (e != cudaSuccess) {
    std::fprintf(stderr, "[ctxprefill] ipc_close: cudaIpcCloseMemHandle on cuda:%d failed: %s\n", device,
                 cudaGetErrorString(e));
    (void)cudaGetLastError();
  }
  if (prev >= 0 && prev != device) {
    const cudaError_t r = cudaSetDevice(prev);
    if (r != cudaSuccess) {
      std::fprintf(stderr, "[ctxprefill] ipc_close: restoring cuda:%d failed: %s\n", prev, cudaGetErrorString(r));
      (void)cudaGetLastError();
    }
  }
}

at::Tensor ipc_open(const std::string& handle, int64_t device, int64_t byte_size, int64_t offset) {
  const char* op = "ipc_open";
  if (handle.size() != sizeof(cudaIpcMemHandle_t))
    throw std::invalid_argument(msg(op, ": the handle has ", handle.size(), " bytes; a cudaIpcMemHandle_t has ",
                                    sizeof(cudaIpcMemHandle_t)));
  if (byte_size < 1) throw std::invalid_argument(msg(op, ": byte_size must be >= 1, got ", byte_size));
  if (offset < 0) throw std::invalid_argument(msg(op, ": offset must be >= 0, got ", offset));
  if (offset > INT64_MAX - byte_size)
    throw std::out_of_range(msg(op, ": offset ", offset, " + byte_size ", byte_size, " overflows"));
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    throw std::runtime_error(msg(op, ": cudaGetDeviceCount failed: ", cudaGetErrorString(e)));
  }
  if (device < 0 || device >= count)
    throw std::invalid_argument(msg(op, ": device ", device, " is not one of this process's ", count, " devices"));
  const int dev = static_cast<int>(device);
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(dev));

  cudaIpcMemHandle_t h;
  std::memcpy(&h, handle.data(), sizeof(h));
  void* base = nullptr;
  e = cudaIpcOpenMemHandle(&base, h, cudaIpcMemLazyEnablePeerAccess);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    throw std::invalid_argument(msg(op, ": cudaIpcOpenMemHandle failed: ", cudaGetErrorString(e),
                                    " (a handle opens only in another process on the same host, while the owner "
                                    "keeps the memory allocated)"));
  }
  auto closed = std::make_shared<std::atomic<bool>>(false);
  auto close_once = [base, dev, closed]() {
    if (!closed->exchange(true)) ipc_close(base, dev);
  };
  try {
    cudaPointerAttributes attr;
    e = cudaPointerGetAttributes(&attr, base);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      throw std::runtime_error(msg(op, ": cudaPointerGetAttributes failed: ", cudaGetErrorString(e)));
    }
    if (attr.device != dev)
      throw std::invalid_argument(msg(op, ": the memory is on cuda:", attr.device, " of this process, not on cuda:",
                                      dev));
    const MemGetAddressRangeFn range = mem_get_address_range();
    if (range == nullptr)
      throw std::runtime_error(msg(op, ": the driver does not provide cuMemGetAddressRange; cannot check the range"));
    CUdeviceptr alloc_base = 0;
    size_t alloc_size = 0;
    const CUdeviceptr ptr = static_cast<CUdeviceptr>(reinterpret_cast<uintptr_t>(base));
    const CUresult r = range(&alloc_base, &alloc_size, ptr);
    if (r != CUDA_SUCCESS)
      throw std::runtime_error(msg(op, ": cuMemGetAddressRange failed with CUresult ", static_cast<int>(r)));
    const uint64_t avail = static_cast<uint64_t>(alloc_size) - static_cast<uint64_t>(ptr - alloc_base);
    if (static_cast<uint64_t>(offset) + static_cast<uint64_t>(byte_size) > avail)
      throw std::out_of_range(msg(op, ": offset ", offset, " + byte_size ", byte_size, " = ", offset + byte_size,
                                  " is past the end of the allocation (", avail, " bytes)"));
    return torch::from_blob(static_cast<char*>(base) + offset, {byte_size},
                            [close_once](void*) { close_once(); },
                            at::TensorOptions().dtype(at::kByte).device(at::Device(at::kCUDA, dev)));
  } catch (...) {
    close_once();
    throw;
  }
}

// Milliseconds between pairs of recorded CUDA events, read in one call after the
// request's synchronize: [start0, end0, start1, end1, ...] (cudaEvent_t handles, torch's
// Event.cuda_event) -> one value per pair. A 4-chunk request reads ~25 stage timings, and
// torch's Event.elapsed_time costs ~4 us of host each (device guard, argument parsing),
// time that runs after the device is done and so adds to the request's latency.
std::vector<double> events_elapsed_ms(const std::vector<int64_t>& events) {
  const char* op = "events_elapsed_ms";
  if (events.size() % 2 != 0)
    throw std::invalid_argument(msg(op, ": events must hold (start, end) pairs; got ", events.size(), " handles"));
  std::vector<double> out(events.size() / 2);
  for (size_t i = 0; i < out.size(); ++i) {
    if (events[2 * i] == 0 || events[2 * i + 1] == 0)
      throw std::invalid_argument(msg(op, ": pair ", i, " holds an event that was never recorded"));
    float ms = 0.f;
    const cudaError_t e = cudaEventElapsedTime(&ms, reinterpret_cast<cudaEvent_t>(events[2 * i]),
                                               reinterpret_cast<cudaEvent_t>(events[2 * i + 1]));
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      throw std::runtime_error(msg(op, ": pair ", i, ": cudaEventElapsedTime failed: ", cudaGetErrorString(e)));
    }
    out[i] = ms;
  }
  return out;
}

// copies_async: cudaMemcpyAsync of each (dst, src, bytes) triple of addresses, in order, on
// `stream` (a cudaStream_t handle), then `event` (a cudaEvent_t handle, 0: none) recorded
// there. A captured chunk loop takes a request's metadata and q this way, and gives its
// output and LSE back (engine/graphs.py), in one call where torch's Tensor.copy_ would
// dispatch, check and record a pinned block's event per copy. The caller keeps every
// buffer alive and unchanged until the copies are done.
void cuda_call(const char* op, const char* what, size_t i, cudaError_t e) {
  if (e == cudaSuccess) return;
  (void)cudaGetLastError();
  throw std::runtime_error(msg(op, ": ", what, " ", i, " failed: ", cudaGetErrorString(e)));
}

void enqueue_copies(const char* op, const std::vector<int64_t>& triples, cudaStream_t stream) {
  if (triples.size() % 3 != 0)
    throw std::invalid_argument(msg(op, ": triples must hold (dst, src, bytes) triples; got ", triples.size(),
                                    " values"));
  for (size_t i = 0; i < triples.size(); i += 3) {
    if (triples[i] == 0 || triples[i + 1] == 0 || triples[i + 2] < 0)
      throw std::invalid_argument(msg(op, ": copy ", i / 3, " has a null address or a negative size"));
  }
  for (size_t i = 0; i < triples.size(); i += 3)
    cuda_call(op, "cudaMemcpyAsync of copy", i / 3,
              cudaMemcpyAsync(reinterpret_cast<void*>(triples[i]), reinterpret_cast<const void*>(triples[i + 1]),
                              static_cast<size_t>(triples[i + 2]), cudaMemcpyDefault, stream));
}

void copies_async(const std::vector<int64_t>& triples, int64_t stream, int64_t event) {
  const char* op = "copies_async";
  const auto s = reinterpret_cast<cudaStream_t>(stream);
  enqueue_copies(op, triples, s);
  if (event != 0) cuda_call(op, "cudaEventRecord of event", 0, cudaEventRecord(reinterpret_cast<cudaEvent_t>(event), s));
}

// graph_launch: a captured chunk loop's replay, queued on `stream` in one call: the copies
// into its buffers (copies_async's triples), `staged` recorded after them, `begin` recorded,
// then the graph (a cudaGraphExec_t handle, torch's CUDAGraph.raw_cuda_graph_exec) launched.
// Every handle is checked before anything is queued. Returns CLOCK_MONOTONIC (Python's
// time.perf_counter on Linux) in seconds once the copies were queued: the request's first
// device work, which a host probe cannot mark from outside the call.
double launch_graph(const char* op, const std::vector<int64_t>& triples, int64_t staged, int64_t begin,
                    int64_t graph_exec, int64_t stream, ctxprefill::GraphPatch* patch,
                    const std::vector<int64_t>& bases) {
  if (staged == 0 || begin == 0 || graph_exec == 0)
    throw std::invalid_argument(msg(op, ": staged, begin and graph_exec must be handles; got ", staged, ", ",
                                    begin, ", ", graph_exec));
  if (patch != nullptr) patch->apply(std::vector<uint64_t>(bases.begin(), bases.end()));
  const auto s = reinterpret_cast<cudaStream_t>(stream);
  enqueue_copies(op, triples, s);
  timespec queued{};
  clock_gettime(CLOCK_MONOTONIC, &queued);
  cuda_call(op, "cudaEventRecord of event", 0, cudaEventRecord(reinterpret_cast<cudaEvent_t>(staged), s));
  cuda_call(op, "cudaEventRecord of event", 1, cudaEventRecord(reinterpret_cast<cudaEvent_t>(begin), s));
  cuda_call(op, "cudaGraphLaunch of graph", 0, cudaGraphLaunch(reinterpret_cast<cudaGraphExec_t>(graph_exec), s));
  return static_cast<double>(queued.tv_sec) + static_cast<double>(queued.tv_nsec) * 1e-9;
}

double graph_launch(const std::vector<int64_t>& triples, int64_t staged, int64_t begin, int64_t graph_exec,
                    int64_t stream) {
  return launch_graph("graph_launch", triples, staged, begin, graph_exec, stream, nullptr, {});
}

// GraphPatch (csrc/graph_patch.h) for Python: found over a torch CUDAGraph's raw graph and
// exec (kept graph), then launch() = graph_launch with the kernels' arguments first pointed
// at the request's buffers. A launch that throws from the patch leaves the exec's arguments
// unknown: the caller drops the graph.
std::unique_ptr<ctxprefill::GraphPatch> graph_patch_new(int64_t graph, int64_t graph_exec,
                                                        const std::vector<int64_t>& buffers) {
  return std::make_unique<ctxprefill::GraphPatch>(reinterpret_cast<cudaGraph_t>(graph),
                                                  reinterpret_cast<cudaGraphExec_t>(graph_exec),
                                                  std::vector<uint64_t>(buffers.begin(), buffers.end()));
}

double graph_patch_launch(ctxprefill::GraphPatch& patch, const std::vector<int64_t>& bases,
                          const std::vector<int64_t>& triples, int64_t staged, int64_t begin, int64_t graph_exec,
                          int64_t stream) {
  return launch_graph("GraphPatch.launch", triples, staged, begin, graph_exec, stream, &patch, bases);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "ctxprefill fused CUDA kernels: MLA K/V pack, cache insert/gather, LSE merge; CUDA IPC open";
  m.def("fused_mla_kv_concat", &fused_mla_kv_concat,
        "k_nope [T,H,128], k_pe [T,64] (strided, same dtype) -> k [T,H,192] contiguous", py::arg("k_nope"),
        py::arg("k_pe"));
  m.def("fused_mla_kv_concat_quant_fp8", &fused_mla_kv_concat_quant_fp8,
        "k_nope [T,H,128], k_pe [T,64] (k_nope's dtype or fp8), v [T,H,128] -> (k_fp8 [T,H,192], v_fp8 [T,H,128])",
        py::arg("k_nope"), py::arg("k_pe"), py::arg("v"));
  m.def("fused_mla_kv_concat_quant_fp8_vt", &fused_mla_kv_concat_quant_fp8_vt,
        "fused_mla_kv_concat_quant_fp8 with V written keys-last, segment s from column cu_seqlens_v[s]: "
        "(k_fp8 [T,H,192], v_fp8_t [H,128,v_cols])",
        py::arg("k_nope"), py::arg("k_pe"), py::arg("v"), py::arg("cu_seqlens_k"), py::arg("cu_seqlens_v"),
        py::arg("v_cols"));
  m.def("insert", &insert, "write latents into cache slots (slot -1 skipped)", py::arg("cache"), py::arg("kv_c"),
        py::arg("k_pe"), py::arg("slot_mapping"), py::arg("cache_dtype"), py::arg("k_scale"));
  m.def("gather", &gather, "gather one chunk's latents from the paged cache into out [rows, 576]",
        py::arg("cache"), py::arg("block_table"), py::arg("cu_seq_lens"), py::arg("seq_starts"), py::arg("out"),
        py::arg("cache_dtype"), py::arg("k_scale"), py::arg("block_size"));
  m.def("merge", &merge, "merge (part_out, part_lse) into (out, lse) by LSE, in place", py::arg("out"),
        py::arg("lse"), py::arg("part_out"), py::arg("part_lse"));
  m.def("ipc_open", &ipc_open,
        "open another process's CUDA memory by its 64-byte cudaIpcMemHandle_t: a uint8 CUDA tensor of "
        "byte_size bytes at offset of the allocation; closed (cudaIpcCloseMemHandle) when the tensor is freed",
        py::arg("handle"), py::arg("device"), py::arg("byte_size"), py::arg("offset"));
  m.def("events_elapsed_ms", &events_elapsed_ms,
        "milliseconds between recorded CUDA events, pairwise: [start0, end0, start1, end1, ...] handles -> "
        "one value per pair (after a synchronize)", py::arg("events"));
  m.def("copies_async", &copies_async,
        "cudaMemcpyAsync of each (dst, src, bytes) address triple, in order, on a cudaStream_t handle; then a "
        "cudaEvent_t handle recorded there (0: none)",
        py::arg("triples"), py::arg("stream"), py::arg("event") = 0);
  m.def("graph_launch", &graph_launch,
        "copies_async's triples, then the staged and begin events recorded and the cudaGraphExec_t launched, "
        "all on a cudaStream_t handle; returns CLOCK_MONOTONIC seconds (time.perf_counter's clock on Linux) "
        "once the copies were queued",
        py::arg("triples"), py::arg("staged"), py::arg("begin"), py::arg("graph_exec"), py::arg("stream"));
  py::class_<ctxprefill::GraphPatch>(m, "GraphPatch",
                                     "a captured graph's kernel arguments that point into given buffers, "
                                     "redirected per launch")
      .def(py::init(&graph_patch_new), "raw cudaGraph_t and its cudaGraphExec_t handles, buffers as "
           "(base, bytes, ...) addresses", py::arg("graph"), py::arg("graph_exec"), py::arg("buffers"))
      .def("launch", &graph_patch_launch,
           "graph_launch with every found argument first pointed at bases (one per buffer)", py::arg("bases"),
           py::arg("triples"), py::arg("staged"), py::arg("begin"), py::arg("graph_exec"), py::arg("stream"))
      .def("apply", [](ctxprefill::GraphPatch& p, const std::vector<int64_t>& bases) {
             p.apply(std::vector<uint64_t>(bases.begin(), bases.end()));
           }, "point every found argument at bases (one per buffer), for the next launch", py::arg("bases"))
      .def_property_readonly("counts", &ctxprefill::GraphPatch::counts, "per buffer: arguments found")
      .def_property_readonly("descriptor_counts", &ctxprefill::GraphPatch::descriptor_counts,
                             "per buffer: TMA descriptors among them")
      .def_property_readonly("sites", [](const ctxprefill::GraphPatch& p) {
             py::list out;
             for (const ctxprefill::PatchSite& s : p.sites())
               out.append(py::dict(py::arg("kernel") = s.kernel, py::arg("param") = s.param,
                                   py::arg("offset") = s.offset, py::arg("size") = s.size,
                                   py::arg("buffer") = s.buffer,
                                   py::arg("delta") = s.delta, py::arg("descriptor") = s.descriptor,
                                   py::arg("probe") = s.probe));
             return out;
           }, "every argument found, as dicts (kernel, param, offset, size, buffer, delta, descriptor, probe: "
              "csrc/graph_patch.h PatchSite): what counts counts, named")
      .def_property_readonly("nodes", &ctxprefill::GraphPatch::nodes, "nodes a launch rewrites (kernels, copies and memsets)")
      .def_property_readonly("unlisted", &ctxprefill::GraphPatch::unlisted,
                             "kernel nodes whose arguments could not be listed");
}
