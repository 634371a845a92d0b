// A captured graph's kernel arguments that hold addresses inside given buffers, found once
// and pointed at other buffers of the same size before each launch: a replay reads the
// request's q and writes its output where they lie, with no copy in or out.
//
// Plain C++ over the CUDA runtime and driver (the driver's calls fetched through the
// runtime, csrc/driver_entry.h: no libcuda link); csrc/binding.cpp wraps it for Python
// (engine/graphs.py). Errors are thrown: std::invalid_argument for bad arguments,
// std::runtime_error for a graph that cannot be patched or a CUDA call that failed.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <cuda.h>
#include <cuda_runtime.h>

namespace ctxprefill {

// One argument found pointing into a buffer (GraphPatch::sites): what a test names.
struct PatchSite {
  std::string kernel;  // the kernel's name ("" where the driver gives none); "memcpy" / "memset" for copies
  int64_t param;       // the kernel's parameter index; for a copy its end (0 source, 1 destination)
  int64_t offset;      // byte offset in the node's argument bytes (-1 for a copy)
  int64_t size;        // the parameter's size in bytes, as the driver lists it (-1 for a copy)
  int64_t buffer;
  int64_t delta;       // the captured address - the buffer's captured base
  bool descriptor;     // a TMA descriptor, else a raw address word (or a copy's pointer)
  // a raw word in a parameter shaped like a CUtensorMap (128 bytes) that the
  // address probe did not recognise: the probe call's CUresult where it failed, else one
  // of the kProbe* values below
  int64_t probe;
};

// PatchSite::probe other than a CUresult: no probe tried, no such driver call, no word took
// the probe address, the map given back that word changed
constexpr int kProbeNotTried = -1, kProbeNoCall = -2, kProbeNoWord = -3, kProbeCheckFailed = -4;

class GraphPatch {
 public:
  // Finds, in `graph`'s kernel nodes, each argument word that holds an address inside one
  // of `buffers` (base, bytes, base, bytes, ...) and each TMA descriptor (CUtensorMap)
  // whose global address lies inside one; and each copy or memset node's end inside one.
  // `exec` is `graph` instantiated; it is what apply() rewrites. Throws
  // std::runtime_error where a copy or memset reaches into a buffer from outside it or the
  // graph holds a child graph (what apply() could not redirect).
  GraphPatch(cudaGraph_t graph, cudaGraphExec_t exec, const std::vector<uint64_t>& buffers);

  // Points every found argument at `bases` (one per buffer, in order): buffer b's
  // argument at captured address a becomes bases[b] + (a - captured base b). Only the
  // nodes whose arguments change are written. Each base must keep its buffer's
  // captured alignment to 256 bytes (what the kernels were specialized and checked for).
  // Where a CUDA call fails part way, the next apply() rewrites every argument.
  void apply(const std::vector<uint64_t>& bases);

  // per buffer: the arguments found pointing into it (raw words and descriptors)
  std::vector<int64_t> counts() const;
  // per buffer: the descriptors among them
  std::vector<int64_t> descriptor_counts() const;
  // every argument found, node by node (what counts() counts)
  std::vector<PatchSite> sites() const;
  // nodes rewritten by apply() (kernels, copies and memsets), and kernel nodes whose
  // arguments could not be listed
  int64_t nodes() const { return static_cast<int64_t>(nodes_.size() + copies_.size()); }
  int64_t unlisted() const { return unlisted_; }

 private:
  struct Site {
    uint32_t offset;  // byte offset in the node's argument bytes
    uint32_t param;   // the kernel's parameter index
    uint32_t size;    // that parameter's size in bytes
    uint32_t buffer;
    uint64_t delta;   // captured address - captured base
    bool descriptor;  // a CUtensorMap (rewritten with cuTensorMapReplaceAddress), else a raw address word
    int probe;        // PatchSite::probe
  };
  struct Node {
    CUgraphNode node;
    CUDA_KERNEL_NODE_PARAMS params;  // kernelParams points into args
    std::unique_ptr<unsigned char[]> raw;  // the argument bytes, 64-byte aligned inside
    unsigned char* bytes;
    std::vector<void*> args;
    std::vector<Site> sites;
    std::string name;  // the kernel's, for sites()
  };
  struct Copy {  // a copy (or memset: `set`) node with an end inside a buffer
    CUgraphNode node;
    bool set;
    cudaMemcpy3DParms copy;
    cudaMemsetParams memset;
    int buffer[2];     // per end (source, destination; a memset's is its destination): the buffer, or -1
    uint64_t delta[2]; // that end's pointer - the buffer's captured base
  };
  void redirect(const std::vector<uint64_t>& bases, const std::vector<bool>& changed);
  void scan(CUgraphNode node);
  void scan_copy(CUgraphNode node, bool set);
  std::vector<Copy> copies_;
  CUgraphExec exec_;
  std::vector<uint64_t> base_, size_;  // captured buffers
  std::vector<uint64_t> current_;      // bases the exec's arguments point at now
  std::vector<Node> nodes_;
  int64_t unlisted_ = 0;
};

}  // namespace ctxprefill
