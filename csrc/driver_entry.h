// A CUDA driver function fetched through the runtime (cudaGetDriverEntryPointByVersion):
// the extension calls a few driver functions without linking libcuda.
#pragma once

#include <cuda_runtime_api.h>

namespace ctxprefill {

// The driver's `symbol` with the ABI of CUDA `version` (e.g. 12000), or nullptr where the
// driver lacks it (the runtime's error cleared).
inline void* driver_entry_point(const char* symbol, unsigned int version) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
  const cudaError_t e = cudaGetDriverEntryPointByVersion(symbol, &p, version, cudaEnableDefault, &found);
#else
  (void)version;
  const cudaError_t e = cudaGetDriverEntryPoint(symbol, &p, cudaEnableDefault, &found);
#endif
  if (e != cudaSuccess || found != cudaDriverEntryPointSuccess || p == nullptr) {
    (void)cudaGetLastError();
    return nullptr;
  }
  return p;
}

}  // namespace ctxprefill
