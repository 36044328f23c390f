// CPU kernels of the IST slicing ops: gather_slices / scatter_slices (one
// weight) and their multi-tensor forms that pack many slices into one flat
// buffer, so a single collective can move a whole subnet.
#include "common.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>

namespace slimcomm {
namespace {

using OptTensor = c10::optional<at::Tensor>;

inline bool given(const OptTensor& t) { return t.has_value() && t->defined(); }

// Validates one slice spec, including index ranges; returns the block shape.
SliceShape check_slice_cpu(const char* op, const std::string& where, const at::Tensor& weight,
                           const OptTensor& rows, const OptTensor& cols) {
  SliceShape s = check_slices(op, where, weight, rows, cols);
  if (given(rows))
    check_index_range_cpu(op, ("rows" + where).c_str(), rows->contiguous(), weight.size(0));
  if (given(cols))
    check_index_range_cpu(op, ("cols" + where).c_str(), cols->contiguous(), weight.size(1));
  return s;
}

// Copies between weight[rows][:, cols] and a contiguous block.
// to_block = true gathers, false scatters. `w` is contiguous.
template <typename T>
void copy_slices(T* w, int64_t ncols_w, const int64_t* rows, int64_t nr, const int64_t* cols,
                 int64_t nc, T* block, bool to_block) {
  const int64_t grain = std::max<int64_t>(1, (1 << 14) / std::max<int64_t>(1, nc));
  at::parallel_for(0, nr, grain, [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) {
      T* wrow = w + (rows ? rows[i] : i) * ncols_w;
      T* brow = block + i * nc;
      if (cols == nullptr) {
        if (to_block) std::memcpy(brow, wrow, nc * sizeof(T));
        else std::memcpy(wrow, brow, nc * sizeof(T));
      } else if (to_block) {
        for (int64_t j = 0; j < nc; ++j) brow[j] = wrow[cols[j]];
      } else {
        for (int64_t j = 0; j < nc; ++j) wrow[cols[j]] = brow[j];
      }
    }
  });
}

// Gathers (or scatters) one slice to (from) `block`, which has s.numel() elements.
void run_slice(const at::Tensor& weight, const OptTensor& rows, const OptTensor& cols,
               const SliceShape& s, void* block, bool to_block) {
  at::Tensor w = weight.is_contiguous() ? weight : weight.contiguous();
  at::Tensor r = given(rows) ? rows->contiguous() : at::Tensor();
  at::Tensor c = given(cols) ? cols->contiguous() : at::Tensor();
  const int64_t ncols_w = weight.dim() == 2 ? weight.size(1) : 1;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, w.scalar_type(), "slices", [&] {
    copy_slices<scalar_t>(w.data_ptr<scalar_t>(), ncols_w, r.defined() ? r.data_ptr<int64_t>() : nullptr,
                          s.rows, c.defined() ? c.data_ptr<int64_t>() : nullptr, s.cols,
                          static_cast<scalar_t*>(block), to_block);
  });
  if (!to_block && !w.is_same(weight)) weight.copy_(w);
}

at::Tensor gather_slices_cpu(const at::Tensor& weight, const OptTensor& rows, const OptTensor& cols) {
  SliceShape s = check_slice_cpu("gather_slices", "", weight, rows, cols);
  at::Tensor out = at::empty(block_shape(weight, s), weight.options());
  run_slice(weight, rows, cols, s, out.data_ptr(), true);
  return out;
}

void scatter_slices_cpu(const at::Tensor& weight, const OptTensor& rows, const OptTensor& cols,
                        const at::Tensor& block) {
  const char* op = "scatter_slices";
  SliceShape s = check_slice_cpu(op, "", weight, rows, cols);
  check_block(op, weight, s, block);
  at::Tensor b = block.contiguous();
  run_slice(weight, rows, cols, s, b.data_ptr(), false);
}

// Validates every slice of a multi op; returns each block's element offset.
std::vector<int64_t> check_multi(const char* op, at::TensorList weights,
                                 const c10::List<OptTensor>& rows,
                                 const c10::List<OptTensor>& cols) {
  SLIMCOMM_CHECK(!weights.empty(), op, "weights", "must not be empty");
  SLIMCOMM_CHECK(rows.size() == weights.size(), op, "rows", "has ", rows.size(),
                 " entries but 'weights' has ", weights.size());
  SLIMCOMM_CHECK(cols.size() == weights.size(), op, "cols", "has ", cols.size(),
                 " entries but 'weights' has ", weights.size());
  std::vector<int64_t> off(weights.size() + 1, 0);
  for (size_t t = 0; t < weights.size(); ++t) {
    const std::string where = "[" + std::to_string(t) + "]";
    if (t > 0) check_same(op, ("weights" + where).c_str(), weights[t], "weights[0]", weights[0]);
    SliceShape s = check_slice_cpu(op, where, weights[t], rows.get(t), cols.get(t));
    off[t + 1] = off[t] + s.numel();
  }
  return off;
}

at::Tensor gather_slices_multi_cpu(at::TensorList weights, const c10::List<OptTensor>& rows,
                                   const c10::List<OptTensor>& cols) {
  const char* op = "gather_slices_multi";
  auto off = check_multi(op, weights, rows, cols);
  at::Tensor out = at::empty({off.back()}, weights[0].options());
  const int64_t esize = out.element_size();
  for (size_t t = 0; t < weights.size(); ++t) {
    SliceShape s = check_slices(op, "", weights[t], rows.get(t), cols.get(t));
    run_slice(weights[t], rows.get(t), cols.get(t), s,
              static_cast<char*>(out.data_ptr()) + off[t] * esize, true);
  }
  return out;
}

void scatter_slices_multi_cpu(at::TensorList weights, const c10::List<OptTensor>& rows,
                              const c10::List<OptTensor>& cols, const at::Tensor& buffer) {
  const char* op = "scatter_slices_multi";
  auto off = check_multi(op, weights, rows, cols);
  check_multi_buffer(op, buffer, weights[0], off.back());
  at::Tensor b = buffer.contiguous();
  const int64_t esize = b.element_size();
  for (size_t t = 0; t < weights.size(); ++t) {
    SliceShape s = check_slices(op, "", weights[t], rows.get(t), cols.get(t));
    run_slice(weights[t], rows.get(t), cols.get(t), s,
              static_cast<char*>(b.data_ptr()) + off[t] * esize, false);
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(slimcomm, CPU, m) {
  m.impl("gather_slices", &gather_slices_cpu);
  m.impl("scatter_slices", &scatter_slices_cpu);
  m.impl("gather_slices_multi", &gather_slices_multi_cpu);
  m.impl("scatter_slices_multi", &scatter_slices_multi_cpu);
}

}  // namespace slimcomm
