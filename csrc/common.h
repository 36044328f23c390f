// Shared definitions for the slimcomm kernels: argument checks, the score
// order used by significance_topk and the Philox4x32-10 counter-based RNG used
// by explore_sample. Header-only and usable from C++ and CUDA sources.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#if defined(__CUDACC__)
#define SLIMCOMM_HD __host__ __device__ __forceinline__
#else
#define SLIMCOMM_HD inline
#endif

namespace slimcomm {

// How the CUDA kernels validate index CONTENTS on the calling thread (see
// csrc/cuda/cuda_utils.cuh): -1 = as the environment says (SLIMCOMM_CUDA_CHECKS,
// default host), 0 = host, 1 = device. Set through the op `_cuda_checks` by
// slimcomm.ops.trusted_indices() around slimcomm's own hot paths (the DDP hook,
// the optimizer-side sync, IST), whose indices come from its own selection ops,
// so that they run without a host sync. Thread-local: DDP hooks and collective
// callbacks run on different threads, each sets its own.
inline thread_local int cuda_checks_override = -1;

// ---------------------------------------------------------------------------
// Argument checks. Every message names the op and the argument.
// ---------------------------------------------------------------------------
#define SLIMCOMM_CHECK(cond, op, arg, ...) \
  TORCH_CHECK(cond, "slimcomm.", op, ": argument '", arg, "' ", __VA_ARGS__)

// Score modes of significance_topk.
enum class ScoreMode : int { kProduct = 0, kGrad = 1, kWeight = 2 };

ScoreMode parse_score(const char* op, const std::string& score);

void check_values(const char* op, const char* arg, const at::Tensor& t, bool require_1d = true);
void check_index_tensor(const char* op, const char* arg, const at::Tensor& t);
// Checks weight/grad of the selection ops and parses `score`.
ScoreMode check_topk_args(const char* op, const at::Tensor& weight, const at::Tensor& grad,
                          c10::string_view score);
void check_same(const char* op, const char* arg, const at::Tensor& t, const char* ref_arg,
                const at::Tensor& ref, bool same_dtype = true);
// Throws unless every index of `idx` (1-D int64, contiguous, on CPU) lies in [0, size).
void check_index_range_cpu(const char* op, const char* arg, const at::Tensor& idx, int64_t size);
// Checks offsets (S+1 non-decreasing in [0, n]) and counts (S, 0 <= c <= segment size).
void check_segments(const char* op, c10::IntArrayRef offsets, const char* offsets_arg,
                    c10::IntArrayRef counts, const char* counts_arg, int64_t n);

// Checks the list arguments of explore_sample_segmented (lengths, segment and
// exclude offsets, sample sizes) but not the contents of `exclude`; returns
// each segment's output offset (S + 1 entries).
std::vector<int64_t> check_explore_lists(const char* op, c10::IntArrayRef offsets,
                                         const at::Tensor& exclude,
                                         c10::IntArrayRef exclude_offsets, c10::IntArrayRef ms,
                                         c10::IntArrayRef rng_offsets);

// Shapes of gather_slices / scatter_slices after validation of ranks and devices.
struct SliceShape {
  int64_t rows;      // rows of the block
  int64_t cols;      // cols of the block (1 for a 1-D weight)
  int64_t numel() const { return rows * cols; }
};
SliceShape check_slices(const char* op, const std::string& where, const at::Tensor& weight,
                        const c10::optional<at::Tensor>& rows, const c10::optional<at::Tensor>& cols);
// The block's shape: [rows] for a 1-D weight, [rows, cols] for a 2-D one.
std::vector<int64_t> block_shape(const at::Tensor& weight, const SliceShape& s);
// scatter_slices' block: same dtype/device as weight and exactly the slice's shape.
void check_block(const char* op, const at::Tensor& weight, const SliceShape& s,
                 const at::Tensor& block);
// scatter_slices_multi's buffer: values like weights[0], exactly `total` elements.
void check_multi_buffer(const char* op, const at::Tensor& buffer, const at::Tensor& weight0,
                        int64_t total);
// pack / unpack argument checks (ranks, dtypes, devices, lengths; not index ranges).
void check_pack_args(const char* op, const at::Tensor& src, const at::Tensor& indices);
void check_unpack_args(const char* op, const at::Tensor& dst, const at::Tensor& indices,
                       const at::Tensor& values);

// ---------------------------------------------------------------------------
// Score order, shared by every backend. The score is |w|*|g|, |g| or |w| in
// fp32 (fabsf, so -0.0 scores like +0.0); non-negative fp32 values order like
// their IEEE bit patterns, and every NaN (any sign or payload) is mapped to the
// top key, above +inf (0x7F800000).
// ---------------------------------------------------------------------------
SLIMCOMM_HD float score_value(float w, float g, ScoreMode mode) {
  switch (mode) {
    case ScoreMode::kGrad: return fabsf(g);
    case ScoreMode::kWeight: return fabsf(w);
    default: return fabsf(w) * fabsf(g);
  }
}

SLIMCOMM_HD uint32_t score_key(float s) {
  uint32_t b;
#if defined(__CUDA_ARCH__)
  b = __float_as_uint(s);
#else
  std::memcpy(&b, &s, sizeof(b));
#endif
  return b > 0x7F800000u ? 0xFFFFFFFFu : b;
}

// ---------------------------------------------------------------------------
// Philox4x32-10 (Salmon, Moraes, Dror, Shaw, "Parallel random numbers: as easy
// as 1, 2, 3", SC'11). explore_sample's draw j uses
//   counter = (p_lo, p_hi, offset_lo, offset_hi), p = j >> 1,
//   key = (seed_lo, seed_hi),
// and takes words (0,1) for even j and (2,3) for odd j as a 64-bit value.
// ---------------------------------------------------------------------------
constexpr uint32_t kPhiloxM0 = 0xD2511F53u;
constexpr uint32_t kPhiloxM1 = 0xCD9E8D57u;
constexpr uint32_t kPhiloxW0 = 0x9E3779B9u;
constexpr uint32_t kPhiloxW1 = 0xBB67AE85u;

struct Philox4 {
  uint32_t x[4];
};

SLIMCOMM_HD Philox4 philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0,
                                  uint32_t k1) {
#pragma unroll
  for (int r = 0; r < 10; ++r) {
    uint64_t p0 = static_cast<uint64_t>(kPhiloxM0) * c0;
    uint64_t p1 = static_cast<uint64_t>(kPhiloxM1) * c2;
    uint32_t n0 = static_cast<uint32_t>(p1 >> 32) ^ c1 ^ k0;
    uint32_t n2 = static_cast<uint32_t>(p0 >> 32) ^ c3 ^ k1;
    c1 = static_cast<uint32_t>(p1);
    c3 = static_cast<uint32_t>(p0);
    c0 = n0;
    c2 = n2;
    k0 += kPhiloxW0;
    k1 += kPhiloxW1;
  }
  return Philox4{{c0, c1, c2, c3}};
}

// The 64-bit Philox value of explore draw i (see ops.explore_sample).
SLIMCOMM_HD uint64_t explore_key(uint64_t i, uint64_t seed, uint64_t offset) {
  uint64_t p = i >> 1;
  Philox4 o = philox4x32_10(static_cast<uint32_t>(p), static_cast<uint32_t>(p >> 32),
                            static_cast<uint32_t>(offset), static_cast<uint32_t>(offset >> 32),
                            static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
  return (i & 1) ? ((static_cast<uint64_t>(o.x[2]) << 32) | o.x[3])
                 : ((static_cast<uint64_t>(o.x[0]) << 32) | o.x[1]);
}

}  // namespace slimcomm
