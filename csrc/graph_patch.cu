// GraphPatch (graph_patch.h): host code only; nvcc compiles it with the kernels.
#include "graph_patch.h"

#include "driver_entry.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <utility>

namespace ctxprefill {
namespace {

using GetParamsFn = CUresult (*)(CUgraphNode, CUDA_KERNEL_NODE_PARAMS*);
using ExecSetParamsFn = CUresult (*)(CUgraphExec, CUgraphNode, const CUDA_KERNEL_NODE_PARAMS*);
using FuncParamInfoFn = CUresult (*)(CUfunction, size_t, size_t*, size_t*);
using KernelParamInfoFn = CUresult (*)(CUkernel, size_t, size_t*, size_t*);
using ReplaceAddressFn = CUresult (*)(CUtensorMap*, void*);
using FuncGetNameFn = CUresult (*)(const char**, CUfunction);
using KernelGetNameFn = CUresult (*)(const char**, CUkernel);

// The driver calls used here, fetched once through the runtime (nullptr where the driver lacks one).
struct Driver {
  GetParamsFn get_params = nullptr;
  ExecSetParamsFn exec_set_params = nullptr;
  FuncParamInfoFn func_param_info = nullptr;
  KernelParamInfoFn kernel_param_info = nullptr;
  ReplaceAddressFn replace_address = nullptr;
  FuncGetNameFn func_get_name = nullptr;      // names for sites() alone
  KernelGetNameFn kernel_get_name = nullptr;
};

const Driver& driver() {
  static const Driver d = [] {
    Driver r;
    // 12000: the _v2 kernel-node calls (CUDA_KERNEL_NODE_PARAMS_v2); 12040: the parameter queries
    r.get_params = reinterpret_cast<GetParamsFn>(driver_entry_point("cuGraphKernelNodeGetParams", 12000));
    r.exec_set_params =
        reinterpret_cast<ExecSetParamsFn>(driver_entry_point("cuGraphExecKernelNodeSetParams", 12000));
    r.func_param_info = reinterpret_cast<FuncParamInfoFn>(driver_entry_point("cuFuncGetParamInfo", 12040));
    r.kernel_param_info = reinterpret_cast<KernelParamInfoFn>(driver_entry_point("cuKernelGetParamInfo", 12040));
    r.replace_address = reinterpret_cast<ReplaceAddressFn>(driver_entry_point("cuTensorMapReplaceAddress", 12000));
    r.func_get_name = reinterpret_cast<FuncGetNameFn>(driver_entry_point("cuFuncGetName", 12030));
    r.kernel_get_name = reinterpret_cast<KernelGetNameFn>(driver_entry_point("cuKernelGetName", 12030));
    return r;
  }();
  return d;
}

std::string cat(const std::string& a) { return a; }
template <typename... A>
std::string cat(const std::string& a, const A&... rest) { return a + cat(rest...); }
std::string num(uint64_t v) { return std::to_string(v); }

void runtime_call(const char* what, cudaError_t e) {
  if (e == cudaSuccess) return;
  (void)cudaGetLastError();
  throw std::runtime_error(cat("graph_patch: ", what, " failed: ", cudaGetErrorString(e)));
}

// The buffer [base, base + size) that holds address v, or -1.
int buffer_of(const std::vector<uint64_t>& base, const std::vector<uint64_t>& size, uint64_t v) {
  for (size_t b = 0; b < base.size(); ++b)
    if (v >= base[b] && v - base[b] < size[b]) return static_cast<int>(b);
  return -1;
}

// The first buffer that [lo, hi) overlaps, or -1.
int buffer_overlapping(const std::vector<uint64_t>& base, const std::vector<uint64_t>& size, uint64_t lo,
                       uint64_t hi) {
  for (size_t b = 0; b < base.size(); ++b)
    if (lo < base[b] + size[b] && base[b] < hi) return static_cast<int>(b);
  return -1;
}

// [first, last + 1) of the bytes a 3D copy reads or writes at one end: rows of `pitch`
// bytes, slices of `pitch * ysize` (a 1D copy has no pitch). (0, 0) for an array end.
std::pair<uint64_t, uint64_t> copied_bytes(const cudaPitchedPtr& p, const cudaPos& at, const cudaExtent& e) {
  const uint64_t base = reinterpret_cast<uint64_t>(p.ptr);
  if (base == 0) return {0, 0};
  const uint64_t slice = static_cast<uint64_t>(p.pitch) * p.ysize;
  const uint64_t first = base + at.z * slice + at.y * p.pitch + at.x;
  const uint64_t rows = e.height > 0 ? e.height - 1 : 0, slices = e.depth > 0 ? e.depth - 1 : 0;
  return {first, first + slices * slice + rows * p.pitch + e.width};
}

// The global address of the CUtensorMap at `src`, learnt without assuming its layout: a
// copy given a probe address shows which 8-byte word holds it, and the map given back the
// value of that word must come out byte for byte as it was. False where either fails, with
// the reason in `why`.
bool descriptor_address(const unsigned char* src, uint64_t* address, int* why) {
  const ReplaceAddressFn replace = driver().replace_address;
  *why = kProbeNoCall;
  if (replace == nullptr) return false;
  CUtensorMap map, probe, check;  // alignas(64) by their declaration
  std::memcpy(&map, src, sizeof(map));
  probe = map;
  constexpr uint64_t kProbe = 0x00007a5a5a5a5a00ull;  // 256-byte aligned, never dereferenced
  const CUresult r = replace(&probe, reinterpret_cast<void*>(kProbe));
  if (r != CUDA_SUCCESS) {
    *why = static_cast<int>(r);
    return false;
  }
  uint64_t pw[sizeof(CUtensorMap) / 8], mw[sizeof(CUtensorMap) / 8];
  std::memcpy(pw, &probe, sizeof(pw));
  std::memcpy(mw, &map, sizeof(mw));
  *why = kProbeNoWord;
  for (size_t j = 0; j < sizeof(pw) / 8; ++j) {
    if (pw[j] != kProbe || mw[j] == 0 || mw[j] % 16 != 0) continue;
    check = map;
    if (replace(&check, reinterpret_cast<void*>(mw[j])) == CUDA_SUCCESS &&
        std::memcmp(&check, &map, sizeof(map)) == 0) {
      *address = mw[j];
      return true;
    }
    *why = kProbeCheckFailed;
  }
  return false;
}

}  // namespace

GraphPatch::GraphPatch(cudaGraph_t graph, cudaGraphExec_t exec, const std::vector<uint64_t>& buffers)
    : exec_(exec) {
  if (graph == nullptr || exec == nullptr) throw std::invalid_argument("graph_patch: graph and exec must be handles");
  if (buffers.empty() || buffers.size() % 2 != 0)
    throw std::invalid_argument(cat("graph_patch: buffers must be (base, bytes) pairs; got ", num(buffers.size()),
                                    " values"));
  for (size_t i = 0; i < buffers.size(); i += 2) {
    if (buffers[i] == 0 || buffers[i + 1] == 0)
      throw std::invalid_argument(cat("graph_patch: buffer ", num(i / 2), " has a null base or no bytes"));
    base_.push_back(buffers[i]);
    size_.push_back(buffers[i + 1]);
  }
  current_ = base_;
  const Driver& d = driver();
  if (d.get_params == nullptr || d.exec_set_params == nullptr || d.func_param_info == nullptr)
    throw std::runtime_error("graph_patch: the driver lacks the kernel-node calls (CUDA 12.4 or later needed)");
  size_t n = 0;
  runtime_call("cudaGraphGetNodes", cudaGraphGetNodes(graph, nullptr, &n));
  std::vector<cudaGraphNode_t> all(n);
  runtime_call("cudaGraphGetNodes", cudaGraphGetNodes(graph, all.data(), &n));
  for (cudaGraphNode_t node : all) {
    cudaGraphNodeType type;
    runtime_call("cudaGraphNodeGetType", cudaGraphNodeGetType(node, &type));
    if (type == cudaGraphNodeTypeKernel) {
      scan(node);
    } else if (type == cudaGraphNodeTypeMemcpy || type == cudaGraphNodeTypeMemset) {
      scan_copy(node, type == cudaGraphNodeTypeMemset);
    } else if (type == cudaGraphNodeTypeGraph || type == cudaGraphNodeTypeConditional) {
      throw std::runtime_error("graph_patch: the graph holds a child or conditional graph");
    }
  }
}

void GraphPatch::scan_copy(CUgraphNode node, bool set) {
  Copy c{};
  c.node = node;
  c.set = set;
  c.buffer[0] = c.buffer[1] = -1;
  std::pair<uint64_t, uint64_t> ends[2] = {{0, 0}, {0, 0}};
  uint64_t ptr[2] = {0, 0};
  if (set) {
    runtime_call("cudaGraphMemsetNodeGetParams", cudaGraphMemsetNodeGetParams(node, &c.memset));
    ptr[1] = reinterpret_cast<uint64_t>(c.memset.dst);
    const uint64_t rows = c.memset.height > 0 ? c.memset.height - 1 : 0;
    ends[1] = {ptr[1], ptr[1] + rows * c.memset.pitch + static_cast<uint64_t>(c.memset.width) * c.memset.elementSize};
  } else {
    runtime_call("cudaGraphMemcpyNodeGetParams", cudaGraphMemcpyNodeGetParams(node, &c.copy));
    ptr[0] = reinterpret_cast<uint64_t>(c.copy.srcPtr.ptr);
    ptr[1] = reinterpret_cast<uint64_t>(c.copy.dstPtr.ptr);
    ends[0] = copied_bytes(c.copy.srcPtr, c.copy.srcPos, c.copy.extent);
    ends[1] = copied_bytes(c.copy.dstPtr, c.copy.dstPos, c.copy.extent);
  }
  bool found = false;
  for (int e = 0; e < 2; ++e) {
    if (ends[e].first == 0) continue;
    const int b = buffer_overlapping(base_, size_, ends[e].first, ends[e].second);
    if (b < 0) continue;
    // redirected by its pointer: every byte it touches must lie in the buffer
    if (buffer_of(base_, size_, ptr[e]) != b || ends[e].second > base_[b] + size_[b])
      throw std::runtime_error(cat("graph_patch: a copy or memset node reaches into buffer ", num(b),
                                   " from outside it"));
    c.buffer[e] = b;
    c.delta[e] = ptr[e] - base_[b];
    found = true;
  }
  if (found) copies_.push_back(c);
}

void GraphPatch::scan(CUgraphNode node) {
  const Driver& d = driver();
  CUDA_KERNEL_NODE_PARAMS p;
  std::memset(&p, 0, sizeof(p));
  if (d.get_params(node, &p) != CUDA_SUCCESS || p.kernelParams == nullptr ||
      (p.func == nullptr && (p.kern == nullptr || d.kernel_param_info == nullptr))) {
    ++unlisted_;
    return;
  }
  std::vector<size_t> offsets, sizes;
  for (size_t i = 0;; ++i) {
    size_t off = 0, sz = 0;
    const CUresult r = p.func != nullptr ? d.func_param_info(p.func, i, &off, &sz)
                                         : d.kernel_param_info(p.kern, i, &off, &sz);
    if (r == CUDA_ERROR_INVALID_VALUE) break;  // past the last parameter
    if (r != CUDA_SUCCESS) {
      ++unlisted_;
      return;
    }
    offsets.push_back(off);
    sizes.push_back(sz);
  }
  size_t total = 0;
  for (size_t i = 0; i < offsets.size(); ++i) total = std::max(total, offsets[i] + sizes[i]);
  Node n;
  n.node = node;
  n.raw.reset(new unsigned char[total + 64]);
  const uint64_t at = reinterpret_cast<uint64_t>(n.raw.get());
  // a 64-aligned start: each argument keeps the alignment the driver's layout gives it
  // (this file reads and writes them through memcpy; maps through aligned copies)
  n.bytes = n.raw.get() + ((64 - at % 64) % 64);
  for (size_t i = 0; i < offsets.size(); ++i) {
    unsigned char* arg = n.bytes + offsets[i];
    std::memcpy(arg, p.kernelParams[i], sizes[i]);
    n.args.push_back(arg);
    uint64_t a = 0;
    const uint32_t param = static_cast<uint32_t>(i), psize = static_cast<uint32_t>(sizes[i]);
    int why = kProbeNotTried;
    // (at any offset: the driver lists Triton's launch-made maps at offsets 48 and 240,
    // counted from a parameter space whose start need not be 64-aligned)
    if (sizes[i] == sizeof(CUtensorMap) && descriptor_address(arg, &a, &why)) {
      const int b = buffer_of(base_, size_, a);
      if (b >= 0)
        n.sites.push_back(
            {static_cast<uint32_t>(offsets[i]), param, psize, static_cast<uint32_t>(b), a - base_[b], true,
             kProbeNotTried});
      continue;  // a descriptor's other words are sizes and strides
    }
    for (size_t w = (offsets[i] + 7) / 8 * 8; w + 8 <= offsets[i] + sizes[i]; w += 8) {
      uint64_t v;
      std::memcpy(&v, n.bytes + w, 8);
      const int b = buffer_of(base_, size_, v);
      if (b >= 0)
        n.sites.push_back({static_cast<uint32_t>(w), param, psize, static_cast<uint32_t>(b), v - base_[b], false, why});
    }
  }
  if (n.sites.empty()) return;
  const char* name = nullptr;
  if (p.func != nullptr ? (d.func_get_name != nullptr && d.func_get_name(&name, p.func) == CUDA_SUCCESS)
                        : (d.kernel_get_name != nullptr && d.kernel_get_name(&name, p.kern) == CUDA_SUCCESS))
    n.name = name != nullptr ? name : "";
  n.params = p;
  n.params.kernelParams = n.args.data();
  n.params.extra = nullptr;
  nodes_.push_back(std::move(n));
}

void GraphPatch::apply(const std::vector<uint64_t>& bases) {
  if (bases.size() != base_.size())
    throw std::invalid_argument(cat("graph_patch: ", num(base_.size()), " bases expected; got ", num(bases.size())));
  std::vector<bool> changed(bases.size());
  bool any = false;
  for (size_t b = 0; b < bases.size(); ++b) {
    if (bases[b] == 0 || (bases[b] - base_[b]) % 256 != 0)
      throw std::invalid_argument(cat("graph_patch: base ", num(b), " (", num(bases[b]),
                                      ") must keep the captured buffer's alignment to 256 bytes"));
    changed[b] = bases[b] != current_[b];
    any = any || changed[b];
  }
  if (!any) return;
  try {
    redirect(bases, changed);
  } catch (...) {
    std::fill(current_.begin(), current_.end(), 0);  // unknown: the next apply rewrites every argument
    throw;
  }
  current_ = bases;
}

void GraphPatch::redirect(const std::vector<uint64_t>& bases, const std::vector<bool>& changed) {
  const Driver& d = driver();
  for (Node& n : nodes_) {
    if (std::none_of(n.sites.begin(), n.sites.end(), [&](const Site& s) { return changed[s.buffer]; })) continue;
    for (const Site& s : n.sites) {
      if (!changed[s.buffer]) continue;
      const uint64_t a = bases[s.buffer] + s.delta;
      if (s.descriptor) {
        CUtensorMap map;  // aligned, where the argument bytes may not be
        std::memcpy(&map, n.bytes + s.offset, sizeof(map));
        if (d.replace_address(&map, reinterpret_cast<void*>(a)) != CUDA_SUCCESS)
          throw std::runtime_error("graph_patch: cuTensorMapReplaceAddress failed");
        std::memcpy(n.bytes + s.offset, &map, sizeof(map));
      } else {
        std::memcpy(n.bytes + s.offset, &a, 8);
      }
    }
    const CUresult r = d.exec_set_params(exec_, n.node, &n.params);
    if (r != CUDA_SUCCESS)
      throw std::runtime_error(cat("graph_patch: cuGraphExecKernelNodeSetParams failed (CUresult ", num(r), ")"));
  }
  for (Copy& c : copies_) {
    bool touched = false;
    for (int e = 0; e < 2; ++e) touched = touched || (c.buffer[e] >= 0 && changed[c.buffer[e]]);
    if (!touched) continue;
    for (int e = 0; e < 2; ++e) {
      if (c.buffer[e] < 0) continue;
      void* a = reinterpret_cast<void*>(bases[c.buffer[e]] + c.delta[e]);
      if (c.set) c.memset.dst = a;
      else (e == 0 ? c.copy.srcPtr : c.copy.dstPtr).ptr = a;
    }
    const cudaError_t r = c.set ? cudaGraphExecMemsetNodeSetParams(exec_, c.node, &c.memset)
                                : cudaGraphExecMemcpyNodeSetParams(exec_, c.node, &c.copy);
    runtime_call(c.set ? "cudaGraphExecMemsetNodeSetParams" : "cudaGraphExecMemcpyNodeSetParams", r);
  }
}

std::vector<int64_t> GraphPatch::counts() const {
  std::vector<int64_t> c(base_.size(), 0);
  for (const Node& n : nodes_)
    for (const Site& s : n.sites) ++c[s.buffer];
  for (const Copy& k : copies_)
    for (int e = 0; e < 2; ++e)
      if (k.buffer[e] >= 0) ++c[k.buffer[e]];
  return c;
}

std::vector<PatchSite> GraphPatch::sites() const {
  std::vector<PatchSite> out;
  for (const Node& n : nodes_)
    for (const Site& s : n.sites)
      out.push_back({n.name, s.param, s.offset, s.size, s.buffer, static_cast<int64_t>(s.delta), s.descriptor,
                     s.probe});
  for (const Copy& k : copies_)
    for (int e = 0; e < 2; ++e)
      if (k.buffer[e] >= 0)
        out.push_back({k.set ? "memset" : "memcpy", e, -1, -1, k.buffer[e], static_cast<int64_t>(k.delta[e]), false,
                       kProbeNotTried});
  return out;
}

std::vector<int64_t> GraphPatch::descriptor_counts() const {
  std::vector<int64_t> c(base_.size(), 0);
  for (const Node& n : nodes_)
    for (const Site& s : n.sites)
      if (s.descriptor) ++c[s.buffer];
  return c;
}

}  // namespace ctxprefill
