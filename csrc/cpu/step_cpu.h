// Helpers shared by the CPU kernels of the fused Slim-DP step (step.cpp) and of the
// indexed SGD update (sgd.cpp); the dtype dispatch is step::dispatch_value (step.h).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>

namespace slimcomm {
namespace cpu {

// Indices between a software prefetch and its use in the loops that read values at a
// sparse index set (the hardware prefetcher cannot foresee those addresses).
constexpr int64_t kPrefetchAhead = 16;

// Segment of bucket-flat index i: the s with o[s] <= i < o[s + 1].
inline int64_t segment_of(const int64_t* o, int64_t S, int64_t i) {
  return static_cast<int64_t>(std::upper_bound(o, o + S + 1, i) - o) - 1;
}

// segment_of for a stream of indices: remembers the last segment and searches only when
// an index leaves it, so a run of ascending indices (a core or explore set) costs two
// compares per index instead of a binary search. Correct for indices in any order.
class SegmentCursor {
 public:
  SegmentCursor(const int64_t* o, int64_t S) : o_(o), S_(S) {}
  int64_t operator()(int64_t i) {
    if (i < o_[s_] || i >= o_[s_ + 1]) s_ = segment_of(o_, S_, i);
    return s_;
  }

 private:
  const int64_t* o_;
  int64_t S_;
  int64_t s_ = 0;
};

}  // namespace cpu
}  // namespace slimcomm
