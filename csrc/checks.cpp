// Argument validation shared by the CPU and CUDA kernels (device independent
// except check_index_range_cpu, which reads a CPU index tensor).
#include "common.h"

#include <ATen/ATen.h>

namespace slimcomm {

ScoreMode parse_score(const char* op, const std::string& score) {
  if (score == "product") return ScoreMode::kProduct;
  if (score == "grad") return ScoreMode::kGrad;
  if (score == "weight") return ScoreMode::kWeight;
  TORCH_CHECK(false, "slimcomm.", op, ": argument 'score' must be one of 'product', 'grad', "
              "'weight', got '", score, "'");
}

void check_values(const char* op, const char* arg, const at::Tensor& t, bool require_1d) {
  SLIMCOMM_CHECK(t.defined(), op, arg, "is undefined");
  auto dt = t.scalar_type();
  SLIMCOMM_CHECK(dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16, op, arg,
                 "must be float32, float16 or bfloat16, got ", dt);
  if (require_1d) {
    SLIMCOMM_CHECK(t.dim() == 1, op, arg, "must be 1-D (flatten it first), got shape ",
                   t.sizes());
  }
}

ScoreMode check_topk_args(const char* op, const at::Tensor& weight, const at::Tensor& grad,
                          c10::string_view score) {
  check_values(op, "weight", weight);
  check_values(op, "grad", grad);
  check_same(op, "grad", grad, "weight", weight);
  SLIMCOMM_CHECK(grad.numel() == weight.numel(), op, "grad", "has ", grad.numel(),
                 " elements but 'weight' has ", weight.numel());
  return parse_score(op, std::string(score));
}

void check_index_tensor(const char* op, const char* arg, const at::Tensor& t) {
  SLIMCOMM_CHECK(t.defined(), op, arg, "is undefined");
  SLIMCOMM_CHECK(t.scalar_type() == at::kLong, op, arg, "must be an int64 tensor, got ",
                 t.scalar_type());
  SLIMCOMM_CHECK(t.dim() == 1, op, arg, "must be 1-D, got shape ", t.sizes());
}

void check_same(const char* op, const char* arg, const at::Tensor& t, const char* ref_arg,
                const at::Tensor& ref, bool same_dtype) {
  SLIMCOMM_CHECK(t.device() == ref.device(), op, arg, "is on ", t.device(), " but '", ref_arg,
                 "' is on ", ref.device());
  if (same_dtype) {
    SLIMCOMM_CHECK(t.scalar_type() == ref.scalar_type(), op, arg, "has dtype ", t.scalar_type(),
                   " but '", ref_arg, "' has dtype ", ref.scalar_type());
  }
}

void check_index_range_cpu(const char* op, const char* arg, const at::Tensor& idx, int64_t size) {
  const int64_t* p = idx.data_ptr<int64_t>();
  const int64_t n = idx.numel();
  int64_t lo = 0, hi = 0;
  if (n > 0) {
    lo = hi = p[0];
    for (int64_t i = 1; i < n; ++i) {
      lo = p[i] < lo ? p[i] : lo;
      hi = p[i] > hi ? p[i] : hi;
    }
  }
  SLIMCOMM_CHECK(n == 0 || (lo >= 0 && hi < size), op, arg, "has an index out of range [0, ",
                 size, "): min ", lo, ", max ", hi);
}

void check_segments(const char* op, c10::IntArrayRef offsets, const char* offsets_arg,
                    c10::IntArrayRef counts, const char* counts_arg, int64_t n) {
  const size_t S = counts.size();
  SLIMCOMM_CHECK(offsets.size() == S + 1, op, offsets_arg, "must have len(", counts_arg,
                 ") + 1 = ", S + 1, " entries, got ", offsets.size());
  SLIMCOMM_CHECK(offsets[0] >= 0, op, offsets_arg, "must start at >= 0, got ", offsets[0]);
  SLIMCOMM_CHECK(offsets[S] <= n, op, offsets_arg, "ends at ", offsets[S],
                 " beyond the buffer size ", n);
  for (size_t s = 0; s < S; ++s) {
    const int64_t len = offsets[s + 1] - offsets[s];
    SLIMCOMM_CHECK(len >= 0, op, offsets_arg, "must be non-decreasing, but entry ", s + 1, " (",
                   offsets[s + 1], ") < entry ", s, " (", offsets[s], ")");
    SLIMCOMM_CHECK(counts[s] >= 0 && counts[s] <= len, op, counts_arg, "entry ", s, " is ",
                   counts[s], " but must be in [0, ", len, "] (the segment's size)");
  }
}

std::vector<int64_t> check_explore_lists(const char* op, c10::IntArrayRef offsets,
                                         const at::Tensor& exclude,
                                         c10::IntArrayRef exclude_offsets, c10::IntArrayRef ms,
                                         c10::IntArrayRef rng_offsets) {
  check_index_tensor(op, "exclude", exclude);
  const int64_t S = static_cast<int64_t>(ms.size());
  SLIMCOMM_CHECK(offsets.size() == static_cast<size_t>(S + 1), op, "offsets",
                 "must have len(ms) + 1 = ", S + 1, " entries, got ", offsets.size());
  SLIMCOMM_CHECK(exclude_offsets.size() == static_cast<size_t>(S + 1), op, "exclude_offsets",
                 "must have len(ms) + 1 = ", S + 1, " entries, got ", exclude_offsets.size());
  SLIMCOMM_CHECK(rng_offsets.size() == static_cast<size_t>(S), op, "rng_offsets",
                 "must have len(ms) = ", S, " entries, got ", rng_offsets.size());
  SLIMCOMM_CHECK(exclude_offsets[0] == 0 && exclude_offsets[S] == exclude.numel(), op,
                 "exclude_offsets", "must start at 0 and end at len(exclude) = ", exclude.numel(),
                 ", got ", exclude_offsets[0], " .. ", exclude_offsets[S]);
  SLIMCOMM_CHECK(offsets[0] >= 0, op, "offsets", "must start at >= 0, got ", offsets[0]);
  std::vector<int64_t> out_off(S + 1, 0);
  for (int64_t s = 0; s < S; ++s) {
    const int64_t lo = offsets[s], hi = offsets[s + 1];
    SLIMCOMM_CHECK(hi >= lo, op, "offsets", "must be non-decreasing, but entry ", s + 1, " (", hi,
                   ") < entry ", s, " (", lo, ")");
    const int64_t e0 = exclude_offsets[s], e1 = exclude_offsets[s + 1];
    SLIMCOMM_CHECK(e1 >= e0 && e1 <= exclude.numel(), op, "exclude_offsets",
                   "must be non-decreasing within [0, len(exclude)], bad entry ", s + 1);
    const int64_t avail = (hi - lo) - (e1 - e0);
    SLIMCOMM_CHECK(ms[s] >= 0 && ms[s] <= avail, op, "ms", "entry ", s, " is ", ms[s],
                   " but must be in [0, ", avail, "] (segment size minus excluded)");
    out_off[s + 1] = out_off[s] + ms[s];
  }
  return out_off;
}

void check_pack_args(const char* op, const at::Tensor& src, const at::Tensor& indices) {
  check_values(op, "src", src);
  check_index_tensor(op, "indices", indices);
  check_same(op, "indices", indices, "src", src, false);
}

void check_unpack_args(const char* op, const at::Tensor& dst, const at::Tensor& indices,
                       const at::Tensor& values) {
  check_values(op, "dst", dst);
  check_index_tensor(op, "indices", indices);
  check_values(op, "values", values);
  check_same(op, "indices", indices, "dst", dst, false);
  check_same(op, "values", values, "dst", dst);
  SLIMCOMM_CHECK(values.numel() == indices.numel(), op, "values", "has ", values.numel(),
                 " elements but 'indices' has ", indices.numel());
}

std::vector<int64_t> block_shape(const at::Tensor& weight, const SliceShape& s) {
  if (weight.dim() == 1) return {s.rows};
  return {s.rows, s.cols};
}

void check_block(const char* op, const at::Tensor& weight, const SliceShape& s,
                 const at::Tensor& block) {
  check_same(op, "block", block, "weight", weight);
  auto want = block_shape(weight, s);
  SLIMCOMM_CHECK(block.sizes() == c10::IntArrayRef(want), op, "block", "must have shape ",
                 c10::IntArrayRef(want), " (the slice's shape), got ", block.sizes());
}

void check_multi_buffer(const char* op, const at::Tensor& buffer, const at::Tensor& weight0,
                        int64_t total) {
  check_values(op, "buffer", buffer);
  check_same(op, "buffer", buffer, "weights[0]", weight0);
  SLIMCOMM_CHECK(buffer.numel() == total, op, "buffer", "has ", buffer.numel(),
                 " elements but the slices need exactly ", total);
}

SliceShape check_slices(const char* op, const std::string& where, const at::Tensor& weight,
                        const c10::optional<at::Tensor>& rows, const c10::optional<at::Tensor>& cols) {
  const std::string w = "weight" + where, r = "rows" + where, c = "cols" + where;
  SLIMCOMM_CHECK(weight.defined(), op, w, "is undefined");
  auto dt = weight.scalar_type();
  SLIMCOMM_CHECK(dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16, op, w,
                 "must be float32, float16 or bfloat16, got ", dt);
  SLIMCOMM_CHECK(weight.dim() == 1 || weight.dim() == 2, op, w, "must be 1-D or 2-D, got shape ",
                 weight.sizes());
  SliceShape s{weight.size(0), weight.dim() == 2 ? weight.size(1) : 1};
  if (rows.has_value() && rows->defined()) {
    check_index_tensor(op, r.c_str(), *rows);
    check_same(op, r.c_str(), *rows, w.c_str(), weight, false);
    s.rows = rows->numel();
  }
  if (cols.has_value() && cols->defined()) {
    SLIMCOMM_CHECK(weight.dim() == 2, op, c, "must be None for a 1-D weight");
    check_index_tensor(op, c.c_str(), *cols);
    check_same(op, c.c_str(), *cols, w.c_str(), weight, false);
    s.cols = cols->numel();
  }
  return s;
}

}  // namespace slimcomm
