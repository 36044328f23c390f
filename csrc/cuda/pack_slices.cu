// CUDA kernels of the gather/scatter ops: pack / unpack (sparse gradient
// values) and gather_slices / scatter_slices with their multi-tensor forms
// (IST subnets). Indices are unique by contract, so every kernel writes
// disjoint locations: no atomics, results independent of the launch shape.
// Strided (non-contiguous) src/dst/weight tensors are addressed through their
// strides, never copied. Everything runs on the current stream; scratch (none
// here) would come from the caching allocator.
//
// Host syncs: none on the data path. Output sizes come from the arguments'
// shapes. The one host sync left is the validation of the index VALUES
// (check_index_ranges_cuda, cuda_utils.cuh), one device-to-host read per op
// for all its index tensors, so that a bad index raises an error naming the
// argument before anything is written (the ops' contract). With
// SLIMCOMM_CUDA_CHECKS=device the check runs on the device instead (a trap on a
// bad index, no host sync), for hot paths whose indices come from slimcomm's
// own selection kernels.
#include "cuda_utils.cuh"

#include <ATen/Dispatch.h>
#include <torch/library.h>

namespace slimcomm {
namespace cuda {
namespace {

using OptTensor = c10::optional<at::Tensor>;

constexpr int kBlock = 256;
constexpr int kItems = 4;  // independent loads in flight per thread

inline bool given(const OptTensor& t) { return t.has_value() && t->defined(); }

// Dispatch over the three value dtypes (no double: the checks reject it).
template <typename Fn>
void dispatch_values(at::ScalarType st, Fn&& fn) {
  switch (st) {
    case at::kFloat: fn(static_cast<float*>(nullptr)); break;
    case at::kHalf: fn(static_cast<at::Half*>(nullptr)); break;
    case at::kBFloat16: fn(static_cast<at::BFloat16*>(nullptr)); break;
    default: TORCH_CHECK(false, "slimcomm: unsupported dtype ", st);
  }
}

// ---------------------------------------------------------------------------
// pack / unpack
// ---------------------------------------------------------------------------

template <typename T>
__global__ void __launch_bounds__(kBlock)
    pack_kernel(const T* __restrict__ src, int64_t src_stride, const int64_t* __restrict__ idx,
                T* __restrict__ out, int64_t k) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * kBlock * kItems;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * kBlock * kItems + threadIdx.x; base < k;
       base += step) {
    int64_t j[kItems];
#pragma unroll
    for (int u = 0; u < kItems; ++u) {
      const int64_t p = base + u * kBlock;
      j[u] = p < k ? idx[p] : 0;
    }
    T v[kItems];
#pragma unroll
    for (int u = 0; u < kItems; ++u)
      if (base + u * kBlock < k) v[u] = src[j[u] * src_stride];
#pragma unroll
    for (int u = 0; u < kItems; ++u)
      if (base + u * kBlock < k) out[base + u * kBlock] = v[u];
  }
}

template <typename T, bool kAccumulate>
__global__ void __launch_bounds__(kBlock)
    unpack_kernel(T* __restrict__ dst, int64_t dst_stride, const int64_t* __restrict__ idx,
                  const T* __restrict__ vals, int64_t k) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * kBlock * kItems;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * kBlock * kItems + threadIdx.x; base < k;
       base += step) {
    int64_t j[kItems];
    T v[kItems];
#pragma unroll
    for (int u = 0; u < kItems; ++u) {
      const int64_t p = base + u * kBlock;
      if (p < k) {
        j[u] = idx[p] * dst_stride;
        v[u] = vals[p];
      }
    }
#pragma unroll
    for (int u = 0; u < kItems; ++u) {
      if (base + u * kBlock < k) {
        if (kAccumulate)
          dst[j[u]] = static_cast<T>(static_cast<float>(dst[j[u]]) + static_cast<float>(v[u]));
        else
          dst[j[u]] = v[u];
      }
    }
  }
}

at::Tensor pack_cuda(const at::Tensor& src, const at::Tensor& indices) {
  const char* op = "pack";
  check_pack_args(op, src, indices);
  c10::cuda::CUDAGuard guard(src.device());
  at::Tensor idx = indices.contiguous();
  check_index_ranges_cuda(op, {{"indices", idx, src.numel()}});
  const int64_t k = idx.numel();
  at::Tensor out = at::empty({k}, src.options());
  if (k == 0) return out;
  dispatch_values(src.scalar_type(), [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    pack_kernel<T><<<grid_for(k, kBlock * kItems, 16), kBlock, 0, current_stream()>>>(
        src.data_ptr<T>(), src.stride(0), idx.data_ptr<int64_t>(), out.data_ptr<T>(), k);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

void unpack_cuda(const at::Tensor& dst, const at::Tensor& indices, const at::Tensor& values,
                 bool accumulate) {
  const char* op = "unpack";
  check_unpack_args(op, dst, indices, values);
  c10::cuda::CUDAGuard guard(dst.device());
  at::Tensor idx = indices.contiguous(), v = values.contiguous();
  check_index_ranges_cuda(op, {{"indices", idx, dst.numel()}});
  const int64_t k = idx.numel();
  if (k == 0) return;
  dispatch_values(dst.scalar_type(), [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const unsigned int grid = grid_for(k, kBlock * kItems, 16);
    if (accumulate)
      unpack_kernel<T, true><<<grid, kBlock, 0, current_stream()>>>(
          dst.data_ptr<T>(), dst.stride(0), idx.data_ptr<int64_t>(), v.data_ptr<T>(), k);
    else
      unpack_kernel<T, false><<<grid, kBlock, 0, current_stream()>>>(
          dst.data_ptr<T>(), dst.stride(0), idx.data_ptr<int64_t>(), v.data_ptr<T>(), k);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

// ---------------------------------------------------------------------------
// gather_slices / scatter_slices
// ---------------------------------------------------------------------------

// One slice: weight[rows][:, cols] <-> a contiguous row-major block [nr, nc].
template <typename T>
struct Slice {
  T* w;
  int64_t s0, s1;       // weight strides (s1 unused for 1-D)
  const int64_t* rows;  // nullptr = all rows
  const int64_t* cols;  // nullptr = all columns
  int64_t nr, nc;
  T* block;
};

// 2-D form: blockIdx.y walks rows, threads walk columns (coalesced when the
// weight's columns are contiguous). No integer division per element.
template <typename T, bool kToBlock>
__global__ void __launch_bounds__(kBlock) slice_rows_kernel(Slice<T> s) {
  for (int64_t r = blockIdx.y; r < s.nr; r += gridDim.y) {
    const int64_t wr = (s.rows ? s.rows[r] : r) * s.s0;
    T* brow = s.block + r * s.nc;
    for (int64_t c = static_cast<int64_t>(blockIdx.x) * kBlock + threadIdx.x; c < s.nc;
         c += static_cast<int64_t>(gridDim.x) * kBlock) {
      const int64_t wi = wr + (s.cols ? s.cols[c] : c) * s.s1;
      if (kToBlock) brow[c] = s.w[wi];
      else s.w[wi] = brow[c];
    }
  }
}

// Flat form for narrow blocks (1-D weights, or few columns): one element per
// thread, row/column from a division.
template <typename T, bool kToBlock>
__global__ void __launch_bounds__(kBlock) slice_flat_kernel(Slice<T> s) {
  const int64_t total = s.nr * s.nc;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * kBlock + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * kBlock) {
    const int64_t r = e / s.nc, c = e - r * s.nc;
    const int64_t wi = (s.rows ? s.rows[r] : r) * s.s0 + (s.cols ? s.cols[c] : c) * s.s1;
    if (kToBlock) s.block[e] = s.w[wi];
    else s.w[wi] = s.block[e];
  }
}

// Launches the copy between one slice and `block` (s.numel() elements).
void run_slice(const at::Tensor& weight, const at::Tensor& rows, const at::Tensor& cols,
               const SliceShape& shape, void* block, bool to_block) {
  if (shape.numel() == 0) return;
  dispatch_values(weight.scalar_type(), [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    Slice<T> s;
    s.w = weight.data_ptr<T>();
    s.s0 = weight.stride(0);
    s.s1 = weight.dim() == 2 ? weight.stride(1) : 0;
    s.rows = rows.defined() ? rows.data_ptr<int64_t>() : nullptr;
    s.cols = cols.defined() ? cols.data_ptr<int64_t>() : nullptr;
    s.nr = shape.rows;
    s.nc = shape.cols;
    s.block = static_cast<T*>(block);
    cudaStream_t st = current_stream();
    if (s.nc >= 64) {
      const int64_t col_blocks = (s.nc + kBlock - 1) / kBlock;
      const int64_t want_rows = std::max<int64_t>(1, (static_cast<int64_t>(num_sms()) * 16) / col_blocks);
      dim3 grid(static_cast<unsigned int>(std::min<int64_t>(col_blocks, 1 << 20)),
                static_cast<unsigned int>(std::min<int64_t>({s.nr, want_rows, 65535})));
      if (to_block) slice_rows_kernel<T, true><<<grid, kBlock, 0, st>>>(s);
      else slice_rows_kernel<T, false><<<grid, kBlock, 0, st>>>(s);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    } else {
      const unsigned int grid = grid_for(s.nr * s.nc, kBlock, 16);
      if (to_block) slice_flat_kernel<T, true><<<grid, kBlock, 0, st>>>(s);
      else slice_flat_kernel<T, false><<<grid, kBlock, 0, st>>>(s);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  });
}

// Contiguous index tensors of one slice (undefined = all).
struct SliceIdx {
  at::Tensor rows, cols;
};

SliceIdx slice_idx(const OptTensor& rows, const OptTensor& cols) {
  return {given(rows) ? rows->contiguous() : at::Tensor(),
          given(cols) ? cols->contiguous() : at::Tensor()};
}

void add_range_checks(std::vector<RangeCheck>& checks, const std::string& where,
                      const at::Tensor& weight, const SliceIdx& ix) {
  if (ix.rows.defined()) checks.push_back({"rows" + where, ix.rows, weight.size(0)});
  if (ix.cols.defined()) checks.push_back({"cols" + where, ix.cols, weight.size(1)});
}

at::Tensor gather_slices_cuda(const at::Tensor& weight, const OptTensor& rows, const OptTensor& cols) {
  const char* op = "gather_slices";
  SliceShape s = check_slices(op, "", weight, rows, cols);
  c10::cuda::CUDAGuard guard(weight.device());
  SliceIdx ix = slice_idx(rows, cols);
  std::vector<RangeCheck> checks;
  add_range_checks(checks, "", weight, ix);
  check_index_ranges_cuda(op, checks);
  at::Tensor out = at::empty(block_shape(weight, s), weight.options());
  run_slice(weight, ix.rows, ix.cols, s, out.data_ptr(), true);
  return out;
}

void scatter_slices_cuda(const at::Tensor& weight, const OptTensor& rows, const OptTensor& cols,
                         const at::Tensor& block) {
  const char* op = "scatter_slices";
  SliceShape s = check_slices(op, "", weight, rows, cols);
  check_block(op, weight, s, block);
  c10::cuda::CUDAGuard guard(weight.device());
  SliceIdx ix = slice_idx(rows, cols);
  std::vector<RangeCheck> checks;
  add_range_checks(checks, "", weight, ix);
  check_index_ranges_cuda(op, checks);
  at::Tensor b = block.contiguous();
  run_slice(weight, ix.rows, ix.cols, s, b.data_ptr(), false);
}

// Validates every slice of a multi op (at most one host sync for all index ranges);
// returns each block's element offset and the contiguous index tensors.
std::vector<int64_t> check_multi(const char* op, at::TensorList weights,
                                 const c10::List<OptTensor>& rows,
                                 const c10::List<OptTensor>& cols, std::vector<SliceIdx>& ix) {
  SLIMCOMM_CHECK(!weights.empty(), op, "weights", "must not be empty");
  SLIMCOMM_CHECK(rows.size() == weights.size(), op, "rows", "has ", rows.size(),
                 " entries but 'weights' has ", weights.size());
  SLIMCOMM_CHECK(cols.size() == weights.size(), op, "cols", "has ", cols.size(),
                 " entries but 'weights' has ", weights.size());
  std::vector<int64_t> off(weights.size() + 1, 0);
  std::vector<RangeCheck> checks;
  for (size_t t = 0; t < weights.size(); ++t) {
    const std::string where = "[" + std::to_string(t) + "]";
    if (t > 0) check_same(op, ("weights" + where).c_str(), weights[t], "weights[0]", weights[0]);
    SliceShape s = check_slices(op, where, weights[t], rows.get(t), cols.get(t));
    off[t + 1] = off[t] + s.numel();
    ix.push_back(slice_idx(rows.get(t), cols.get(t)));
    add_range_checks(checks, where, weights[t], ix.back());
  }
  check_index_ranges_cuda(op, checks);
  return off;
}

at::Tensor gather_slices_multi_cuda(at::TensorList weights, const c10::List<OptTensor>& rows,
                                    const c10::List<OptTensor>& cols) {
  const char* op = "gather_slices_multi";
  SLIMCOMM_CHECK(!weights.empty(), op, "weights", "must not be empty");
  c10::cuda::CUDAGuard guard(weights[0].device());
  std::vector<SliceIdx> ix;
  auto off = check_multi(op, weights, rows, cols, ix);
  at::Tensor out = at::empty({off.back()}, weights[0].options());
  const int64_t esize = out.element_size();
  for (size_t t = 0; t < weights.size(); ++t) {
    SliceShape s = check_slices(op, "", weights[t], rows.get(t), cols.get(t));
    run_slice(weights[t], ix[t].rows, ix[t].cols, s,
              static_cast<char*>(out.data_ptr()) + off[t] * esize, true);
  }
  return out;
}

void scatter_slices_multi_cuda(at::TensorList weights, const c10::List<OptTensor>& rows,
                               const c10::List<OptTensor>& cols, const at::Tensor& buffer) {
  const char* op = "scatter_slices_multi";
  SLIMCOMM_CHECK(!weights.empty(), op, "weights", "must not be empty");
  c10::cuda::CUDAGuard guard(weights[0].device());
  std::vector<SliceIdx> ix;
  auto off = check_multi(op, weights, rows, cols, ix);
  check_multi_buffer(op, buffer, weights[0], off.back());
  at::Tensor b = buffer.contiguous();
  const int64_t esize = b.element_size();
  for (size_t t = 0; t < weights.size(); ++t) {
    SliceShape s = check_slices(op, "", weights[t], rows.get(t), cols.get(t));
    run_slice(weights[t], ix[t].rows, ix[t].cols, s,
              static_cast<char*>(b.data_ptr()) + off[t] * esize, false);
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(slimcomm, CUDA, m) {
  m.impl("pack", &pack_cuda);
  m.impl("unpack", &unpack_cuda);
  m.impl("gather_slices", &gather_slices_cuda);
  m.impl("scatter_slices", &scatter_slices_cuda);
  m.impl("gather_slices_multi", &gather_slices_multi_cuda);
  m.impl("scatter_slices_multi", &scatter_slices_multi_cuda);
}

}  // namespace cuda
}  // namespace slimcomm
