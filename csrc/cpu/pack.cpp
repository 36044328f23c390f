// CPU kernels of pack (gather into a contiguous buffer) and unpack (scatter or
// scatter-add back in place). Indices are unique, so the parallel loops write
// disjoint locations and results do not depend on the thread count.
#include "common.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

namespace slimcomm {
namespace {

constexpr int64_t kGrain = 1 << 18;  // small gathers stay on one thread

at::Tensor pack_cpu(const at::Tensor& src, const at::Tensor& indices) {
  const char* op = "pack";
  check_pack_args(op, src, indices);
  at::Tensor s = src.contiguous(), idx = indices.contiguous();
  check_index_range_cpu(op, "indices", idx, s.numel());
  at::Tensor out = at::empty({idx.numel()}, src.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, s.scalar_type(), "pack", [&] {
    const scalar_t* ps = s.data_ptr<scalar_t>();
    const int64_t* pi = idx.data_ptr<int64_t>();
    scalar_t* po = out.data_ptr<scalar_t>();
    at::parallel_for(0, idx.numel(), kGrain, [&](int64_t a, int64_t b) {
      for (int64_t i = a; i < b; ++i) po[i] = ps[pi[i]];
    });
  });
  return out;
}

void unpack_cpu(const at::Tensor& dst, const at::Tensor& indices, const at::Tensor& values,
                bool accumulate) {
  const char* op = "unpack";
  check_unpack_args(op, dst, indices, values);
  at::Tensor idx = indices.contiguous(), v = values.contiguous();
  check_index_range_cpu(op, "indices", idx, dst.numel());
  at::Tensor d = dst.is_contiguous() ? dst : dst.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, d.scalar_type(), "unpack", [&] {
    scalar_t* pd = d.data_ptr<scalar_t>();
    const int64_t* pi = idx.data_ptr<int64_t>();
    const scalar_t* pv = v.data_ptr<scalar_t>();
    at::parallel_for(0, idx.numel(), kGrain, [&](int64_t a, int64_t b) {
      if (accumulate) {
        for (int64_t i = a; i < b; ++i)
          pd[pi[i]] = static_cast<scalar_t>(static_cast<float>(pd[pi[i]]) + static_cast<float>(pv[i]));
      } else {
        for (int64_t i = a; i < b; ++i) pd[pi[i]] = pv[i];
      }
    });
  });
  if (!d.is_same(dst)) dst.copy_(d);
}

}  // namespace

TORCH_LIBRARY_IMPL(slimcomm, CPU, m) {
  m.impl("pack", &pack_cpu);
  m.impl("unpack", &unpack_cpu);
}

}  // namespace slimcomm
