// Helpers shared by the CPU kernels of the fused Slim-DP step (step.cpp) and of the
// indexed SGD update (sgd.cpp); the dtype dispatch is step::dispatch_value (step.h).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>

namespace slimcomm {
namespace cpu {

// Segment of bucket-flat index i: the s with o[s] <= i < o[s + 1].
inline int64_t segment_of(const int64_t* o, int64_t S, int64_t i) {
  return static_cast<int64_t>(std::upper_bound(o, o + S + 1, i) - o) - 1;
}

}  // namespace cpu
}  // namespace slimcomm
