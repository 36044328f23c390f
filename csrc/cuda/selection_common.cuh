// Shared pieces of the CUDA selection kernels (topk.cu: significance_topk,
// explore.cu: explore_sample): block sizes, the test switch for the
// device-side fallbacks, and the CUB radix sort both use. Results of both ops
// are identical to the CPU kernels (csrc/cpu/selection.cpp): each computes an
// exactly defined set that no implementation detail can change, and indices
// come out ascending.
//
// Host syncs: none on the data path of either op; all launches on the current
// stream, scratch from the caching allocator (no cudaMalloc / cudaFree /
// cudaDeviceSynchronize), small per-segment tables copied host-to-device from
// pinned memory without waiting. The one sync left is explore.cu's validation
// of the exclude VALUES (check_exclude_cuda), one device-to-host read per call
// so that a bad entry raises the CPU kernel's error, naming the argument,
// before any output exists; SLIMCOMM_CUDA_CHECKS=device moves it onto the
// device (a trap, no sync; see cuda_utils.cuh).
#pragma once

#include "cuda_utils.cuh"

#include <cstdlib>
#include <string>

namespace slimcomm {
namespace cuda {
namespace {

constexpr int kBlock = 256;
constexpr int kSegBlock = 512;  // threads of the one-block-per-segment kernels
constexpr int64_t kIdx32 = int64_t(1) << 32;

// Tests only (tests/test_cuda_fallbacks.py): environment SLIMCOMM_CUDA_TEST_FALLBACKS=1,
// read once per process, shrinks the top-k candidate buffer to k / 2 and the
// explore draws to t / 2, so that the device-side fallbacks, otherwise beyond 8
// standard deviations, run; results must not change.
inline bool test_fallbacks() {
  static const bool on = [] {
    const char* v = std::getenv("SLIMCOMM_CUDA_TEST_FALLBACKS");
    return v != nullptr && std::string(v) == "1";
  }();
  return on;
}

// Number of bits needed to represent every value in [0, n).
inline int bits_for(int64_t n) {
  int b = 1;
  while (b < 63 && (int64_t(1) << b) < n) ++b;
  return b;
}

template <typename K>
void sort_keys(const K* in, K* out, int64_t n, int end_bit, const at::Device& dev) {
  if (n == 0) return;
  cudaStream_t st = current_stream();
  size_t bytes = 0;
  C10_CUDA_CHECK(cub::DeviceRadixSort::SortKeys(nullptr, bytes, in, out, n, 0, end_bit, st));
  at::Tensor tmp = scratch_bytes(static_cast<int64_t>(bytes), dev);
  C10_CUDA_CHECK(
      cub::DeviceRadixSort::SortKeys(tmp.data_ptr(), bytes, in, out, n, 0, end_bit, st));
}

}  // namespace
}  // namespace cuda
}  // namespace slimcomm
