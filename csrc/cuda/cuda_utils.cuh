// Helpers shared by the slimcomm CUDA kernels: launch configuration, scratch
// memory, batched index-range validation, the score rank key, and the two
// block-level building blocks of exact deterministic selection:
//
//   block_select_threshold  radix select (8-bit digits, shared-memory
//                           histograms) of the m-th smallest key among the
//                           valid items of a range, returning the key T and
//                           how many items equal to T belong to the m smallest
//                           ("need");
//   block_emit_ordered      one ordered pass that emits, in index order, every
//                           valid item with key < T and the first `need` items
//                           with key == T (ties go to the lowest index).
//
// Together they select the m smallest (key, index) pairs exactly, with no
// order-dependent atomics: shared-memory atomics only count, and output
// positions come from block-wide prefix sums in index order.
#pragma once

#include "common.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <cub/cub.cuh>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace slimcomm {
namespace cuda {

inline cudaStream_t current_stream() { return at::cuda::getCurrentCUDAStream(); }

inline int num_sms() { return at::cuda::getCurrentDeviceProperties()->multiProcessorCount; }

// Blocks for a grid-stride loop over `items` work items of `per_block` each.
inline unsigned int grid_for(int64_t items, int64_t per_block, int blocks_per_sm = 8) {
  const int64_t want = (items + per_block - 1) / per_block;
  const int64_t cap = static_cast<int64_t>(num_sms()) * blocks_per_sm;
  return static_cast<unsigned int>(std::max<int64_t>(1, std::min(want, cap)));
}

// Stream-ordered scratch memory from the caching allocator.
inline at::Tensor scratch_bytes(int64_t bytes, const at::Device& dev) {
  return at::empty({std::max<int64_t>(bytes, 1)},
                   at::TensorOptions().dtype(at::kByte).device(dev));
}

// One index tensor to range-check: every entry must lie in [0, size).
struct RangeCheck {
  std::string arg;
  at::Tensor idx;  // 1-D int64 on the device
  int64_t size;
};

// How the CUDA kernels validate the CONTENTS of device tensors (index ranges,
// the exclude list); shapes, dtypes, devices and every size argument are
// always checked on the host, from metadata, with no synchronisation.
//   host   (default): a device reduction, then ONE device-to-host read of the
//          result per op, so a bad value raises a c10::Error that names the
//          argument (the CPU kernel's message) before anything is written.
//          This is the only host sync left in the ops (see each kernel file).
//   device (environment SLIMCOMM_CUDA_CHECKS=device, read once per process):
//          no host sync. The check runs on the device, on the current stream,
//          before the kernels that write, and a bad value stops the stream with
//          a device-side assert (the message, naming the op, is printed by the
//          device; the CUDA context is lost, as with an out-of-range index in
//          torch's own CUDA indexing ops). For hot paths whose indices come from
//          slimcomm's own selection ops (the DDP hook, the optimizer-side sync).
enum class CheckMode { kHost, kDevice };
inline CheckMode check_mode() {
  if (cuda_checks_override >= 0) {  // slimcomm.ops.trusted_indices() on this thread
    return cuda_checks_override == 1 ? CheckMode::kDevice : CheckMode::kHost;
  }
  static const CheckMode mode = [] {
    const char* v = std::getenv("SLIMCOMM_CUDA_CHECKS");
    if (v == nullptr || *v == '\0' || std::string(v) == "host") return CheckMode::kHost;
    TORCH_CHECK(std::string(v) == "device",
                "slimcomm: environment SLIMCOMM_CUDA_CHECKS must be 'host' or 'device', got '",
                v, "'");
    return CheckMode::kDevice;
  }();
  return mode;
}

// Device-side range check (CheckMode::kDevice): traps on the first entry
// outside [0, size). `what` is a small code printed with the failure.
static __global__ void device_range_check_kernel(const int64_t* __restrict__ idx, int64_t n,
                                          int64_t size, int what) {
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < n;
       j += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t v = idx[j];
    if (v < 0 || v >= size) {
      printf("slimcomm: index tensor #%d of the op has entry %lld = %lld outside [0, %lld) "
             "(SLIMCOMM_CUDA_CHECKS=device)\n",
             what, static_cast<long long>(j), static_cast<long long>(v),
             static_cast<long long>(size));
      __trap();  // not CUDA_KERNEL_ASSERT: builds with TORCH_DISABLE_GPU_ASSERTS compile it away
    }
  }
}

// Range-checks several device index tensors. CheckMode::kHost: one device
// reduction each and ONE device-to-host copy of all (min, max) pairs (the
// host sync that lets the error be raised, naming the argument, before
// anything is written; messages are those of check_index_range_cpu).
// CheckMode::kDevice: one check kernel per tensor, no host sync.
static inline void check_index_ranges_cuda(const char* op, const std::vector<RangeCheck>& checks) {
  if (check_mode() == CheckMode::kDevice) {
    int what = 0;
    for (const auto& c : checks) {
      ++what;
      const int64_t n = c.idx.numel();
      if (n == 0) continue;
      device_range_check_kernel<<<grid_for(n, 256 * 4), 256, 0, current_stream()>>>(
          c.idx.data_ptr<int64_t>(), n, c.size, what);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    return;
  }
  std::vector<at::Tensor> parts;
  for (const auto& c : checks) {
    if (c.idx.numel() == 0) continue;
    auto mm = at::aminmax(c.idx);
    parts.push_back(std::get<0>(mm).reshape({1}));
    parts.push_back(std::get<1>(mm).reshape({1}));
  }
  if (parts.empty()) return;
  const at::Tensor host = at::cat(parts).cpu();  // host sync (see above)
  int64_t j = 0;
  for (const auto& c : checks) {
    if (c.idx.numel() == 0) continue;
    check_index_range_cpu(op, c.arg.c_str(), host.slice(0, 2 * j, 2 * j + 2).contiguous(), c.size);
    ++j;
  }
}

// Copies a small host vector to the device through pinned memory (the caching
// host allocator keeps the pinned block alive until the copy has run).
inline at::Tensor to_device_i64(const std::vector<int64_t>& v, const at::Device& dev) {
  at::Tensor h = at::empty({static_cast<int64_t>(v.size())},
                           at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  std::copy(v.begin(), v.end(), h.data_ptr<int64_t>());
  return h.to(dev, /*non_blocking=*/true);
}

// ---------------------------------------------------------------------------
// Score rank key: the order of significance_topk as an ascending 32-bit key.
// score_key's order (larger score first, NaN above +inf) inverted, so that
// "best" is the smallest key and every selection is "the m smallest (key,
// index)". Built from common.h's score_value / score_key, as on the CPU.
// ---------------------------------------------------------------------------
__device__ __forceinline__ uint32_t rank_key(float w, float g, int mode) {
  return ~score_key(score_value(w, g, static_cast<ScoreMode>(mode)));
}

template <typename T>
__device__ __forceinline__ uint32_t rank_key_at(const T* w, const T* g, int64_t i, int mode) {
  const float fw = mode == static_cast<int>(ScoreMode::kGrad) ? 0.f : static_cast<float>(w[i]);
  const float fg = mode == static_cast<int>(ScoreMode::kWeight) ? 0.f : static_cast<float>(g[i]);
  return rank_key(fw, fg, mode);
}

// Number of entries of the ascending array a[0, n) that are < v.
__device__ __forceinline__ int64_t count_below(const int64_t* a, int64_t n, int64_t v) {
  int64_t lo = 0, hi = n;
  while (lo < hi) {
    const int64_t mid = (lo + hi) >> 1;
    if (a[mid] < v) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

// Adds 1 to hist[bin] for every lane of the warp with `ok`, with one shared
// atomic per distinct bin of the warp: on tied keys (all-zero scores) every
// lane hits the same bin, and 32 atomics on one address would serialise.
// Every lane of the warp must call it (warp-uniform control flow).
__device__ __forceinline__ void warp_hist_add(unsigned int* hist, bool ok, unsigned int bin) {
  const unsigned int peers = __match_any_sync(0xFFFFFFFFu, ok ? bin : 0xFFFFFFFFu);
  if (ok && __ffs(peers) - 1 == static_cast<int>(threadIdx.x & 31u))
    atomicAdd(&hist[bin], static_cast<unsigned int>(__popc(peers)));
}

// ---------------------------------------------------------------------------
// Block-level exact selection.
// ---------------------------------------------------------------------------
template <typename KeyT>
struct SelectShared {
  unsigned int hist[256];
  KeyT prefix;
  long long remaining;
};

// Radix select over the items [0, len) of a range, for one thread block.
// kf(i, key) returns whether item i takes part and sets its key. Requires
// 1 <= m <= number of valid items. On return (in every thread):
//   T    = the m-th smallest key among the valid items,
//   need = m - #(valid items with key < T), 1 <= need <= #(key == T).
// Must be called by all threads of the block (BLOCK a multiple of 32).
template <typename KeyT, int BLOCK, typename KeyFn>
__device__ void block_select_threshold(const KeyFn& kf, int64_t len, int64_t m,
                                       SelectShared<KeyT>& sh, KeyT& T, int64_t& need) {
  constexpr int kBits = static_cast<int>(sizeof(KeyT) * 8);
  if (threadIdx.x == 0) {
    sh.prefix = KeyT(0);
    sh.remaining = m;
  }
  for (int d = kBits - 8; d >= 0; d -= 8) {
    for (int b = threadIdx.x; b < 256; b += BLOCK) sh.hist[b] = 0u;
    __syncthreads();
    const KeyT prefix = sh.prefix;
    const KeyT hi_mask = (d + 8 >= kBits) ? KeyT(0) : static_cast<KeyT>(~KeyT(0) << (d + 8));
    // Block-uniform trip count, so whole warps aggregate their increments.
#pragma unroll 4
    for (int64_t i0 = 0; i0 < len; i0 += BLOCK) {
      const int64_t i = i0 + threadIdx.x;
      KeyT key = KeyT(0);
      const bool ok = i < len && kf(i, key) && (key & hi_mask) == prefix;
      warp_hist_add(sh.hist, ok, static_cast<unsigned int>(key >> d) & 0xFFu);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      const long long rem = sh.remaining;
      long long below = 0;
      int b = 0;
      for (; b < 255; ++b) {
        if (below + sh.hist[b] >= rem) break;
        below += sh.hist[b];
      }
      sh.prefix = static_cast<KeyT>(prefix | (static_cast<KeyT>(b) << d));
      sh.remaining = rem - below;
    }
    __syncthreads();
  }
  T = sh.prefix;
  need = sh.remaining;
  __syncthreads();  // sh may be reused by the caller
}

// One ordered pass over items [begin, end): emits, in index order, every valid
// item with key < T and each valid item with key == T while fewer than `need`
// such items came before it (counting from eq_before, the number of key == T
// items before `begin`). emit(pos, i) receives the output position, starting
// at out_before. Stops early once out_end positions are filled. All threads
// of the block must call it; `scan` is the block's BlockScan storage. Each
// thread takes kItems consecutive items per round (blocked arrangement), so
// the (thread, item) order is the index order.
template <typename KeyT, int BLOCK, typename KeyFn, typename EmitFn>
__device__ void block_emit_ordered(const KeyFn& kf, int64_t begin, int64_t end, KeyT T,
                                   int64_t need, int64_t eq_before, int64_t out_before,
                                   int64_t out_end, EmitFn&& emit,
                                   typename cub::BlockScan<int, BLOCK>::TempStorage& scan) {
  constexpr int kItems = 4;
  using Scan = cub::BlockScan<int, BLOCK>;
  int64_t eq_run = eq_before, out_run = out_before;
  for (int64_t base = begin; base < end && out_run < out_end; base += int64_t(BLOCK) * kItems) {
    const int64_t i0 = base + int64_t(threadIdx.x) * kItems;
    bool lt[kItems], eq[kItems];
    int n_eq = 0;
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      KeyT key = KeyT(0);
      const bool valid = i0 + j < end && kf(i0 + j, key);
      lt[j] = valid && key < T;
      eq[j] = valid && key == T;
      n_eq += eq[j] ? 1 : 0;
    }
    int eq_rank, eq_total;
    Scan(scan).ExclusiveSum(n_eq, eq_rank, eq_total);
    __syncthreads();
    bool sel[kItems];
    int n_sel = 0;
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      sel[j] = lt[j] || (eq[j] && eq_run + eq_rank < need);
      eq_rank += eq[j] ? 1 : 0;
      n_sel += sel[j] ? 1 : 0;
    }
    int sel_rank, sel_total;
    Scan(scan).ExclusiveSum(n_sel, sel_rank, sel_total);
    __syncthreads();
    int64_t pos = out_run + sel_rank;
#pragma unroll
    for (int j = 0; j < kItems; ++j)
      if (sel[j]) emit(pos++, i0 + j);
    eq_run += eq_total;
    out_run += sel_total;
  }
}

}  // namespace cuda
}  // namespace slimcomm
