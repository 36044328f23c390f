// Helpers shared by the CPU kernels of the fused Slim-DP step (step.cpp) and of the
// indexed SGD update (sgd.cpp).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>

namespace slimcomm {
namespace cpu {

// fn(T*) with T the C++ type of a value dtype (fp32, fp16, bf16).
template <typename Fn>
void dispatch_value(at::ScalarType st, Fn&& fn) {
  switch (st) {
    case at::kFloat: fn(static_cast<float*>(nullptr)); break;
    case at::kHalf: fn(static_cast<at::Half*>(nullptr)); break;
    case at::kBFloat16: fn(static_cast<at::BFloat16*>(nullptr)); break;
    default: TORCH_CHECK(false, "slimcomm: unsupported dtype ", st);
  }
}

// Segment of bucket-flat index i: the s with o[s] <= i < o[s + 1].
inline int64_t segment_of(const int64_t* o, int64_t S, int64_t i) {
  return static_cast<int64_t>(std::upper_bound(o, o + S + 1, i) - o) - 1;
}

}  // namespace cpu
}  // namespace slimcomm
