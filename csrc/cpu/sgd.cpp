// CPU kernel of sgd_apply_indexed: plain SGD (no momentum, no weight decay) applied to
// the parameters at a Slim-DP index set only, straight from the all-reduced payload, in
// place of the dense bucket write of step_commit and the optimizer's dense pass over a
// gradient that is zero everywhere else (slimcomm/ops.py for the contract,
// slimcomm/reference.py for the executable definition).
#include "step.h"
#include "step_cpu.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

namespace slimcomm {
namespace {

constexpr int64_t kGrain = 1 << 14;

void sgd_apply_indexed_cpu(at::TensorList params, const at::Tensor& indices,
                           const at::Tensor& offsets, const at::Tensor& avg, double lr,
                           bool keep_all_zero) {
  const char* op = "sgd_apply_indexed";
  const int64_t N = step::check_sgd_params(op, params, indices, offsets, avg);
  const int64_t S = offsets.numel() - 1;
  const int64_t* o = offsets.data_ptr<int64_t>();
  for (int64_t s = 0; s < S; ++s)
    SLIMCOMM_CHECK(o[s + 1] - o[s] == params[s].numel(), op, "params", "entry ", s, " has ",
                   params[s].numel(), " elements but its segment of offsets ", o[s + 1] - o[s]);
  step::check_offsets_cpu(op, offsets, N);
  if (S == 0) return;
  const at::Tensor idx = indices.contiguous(), av = avg.contiguous();
  check_index_range_cpu(op, "indices", idx, N);
  const int64_t k = idx.numel();
  const int64_t* pi = idx.data_ptr<int64_t>();
  // torch's add_(grad, alpha=-lr) multiplies by the scalar cast to the opmath type
  const float neg_lr = static_cast<float>(-lr);
  step::dispatch_value(params[0].scalar_type(), [&](auto* ptag) {
    using T = std::remove_pointer_t<decltype(ptag)>;
    std::vector<T*> base(S);
    for (int64_t s = 0; s < S; ++s) base[s] = params[s].data_ptr<T>();
    step::dispatch_value(av.scalar_type(), [&](auto* wtag) {
      using W = std::remove_pointer_t<decltype(wtag)>;
      const W* pa = av.data_ptr<W>();
      // the decision of step_commit: values cast to the parameters' dtype, per segment
      std::vector<char> nonfinite(S, 0);
      cpu::SegmentCursor seg_of(o, S);
      for (int64_t j = 0; j < k; ++j) {
        const float v = static_cast<float>(static_cast<T>(pa[j]));
        if (v - v != 0.f) nonfinite[seg_of(pi[j])] = 1;
      }
      std::vector<char> good(S);
      for (int64_t s = 0; s < S; ++s)
        good[s] = (step::decide(static_cast<float>(pa[k + s]), !nonfinite[s], keep_all_zero) & 2)
                      ? 1 : 0;
      at::parallel_for(0, k, kGrain, [&](int64_t a, int64_t b) {
        // Each update reads a parameter value at a sparse, data-dependent position: a cache
        // miss the hardware prefetcher cannot foresee, which serialised the loop on memory
        // latency (about 3x the time of step_commit's stores to G at the same indices).
        // The value kPrefetchAhead indices on is prefetched: that many misses in flight.
        cpu::SegmentCursor seg_of(o, S), ahead_seg(o, S);
        for (int64_t j = a; j < b; ++j) {
          if (j + cpu::kPrefetchAhead < b) {
            const int64_t ia = pi[j + cpu::kPrefetchAhead];
            const int64_t sa = ahead_seg(ia);
            __builtin_prefetch(base[sa] + (ia - o[sa]), 1);
          }
          const int64_t i = pi[j];
          const int64_t s = seg_of(i);
          if (!good[s]) continue;
          T* p = base[s] + (i - o[s]);
          const float g = static_cast<float>(static_cast<T>(pa[j]));
          *p = static_cast<T>(std::fma(g, neg_lr, static_cast<float>(*p)));
        }
      });
    });
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(slimcomm, CPU, m) { m.impl("sgd_apply_indexed", &sgd_apply_indexed_cpu); }

}  // namespace slimcomm
