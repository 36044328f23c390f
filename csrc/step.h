// Shared pieces of the fused Slim-DP step ops (step_encode, step_commit,
// step_commit_local, step_undo): argument checks common to the CPU and CUDA
// kernels, and the per-element arithmetic, written once so that both
// backends round exactly like the ATen ops they replace
// (slimcomm/compressor.py before the fusion; slimcomm/reference.py).
#pragma once

#include "common.h"

#include <ATen/ATen.h>

#include <cmath>

namespace slimcomm {
namespace step {

// fn(T*) with T the C++ type of a value dtype (fp32, fp16, bf16): the host-side dtype
// dispatch of the CPU and CUDA step kernels.
template <typename Fn>
void dispatch_value(at::ScalarType st, Fn&& fn) {
  switch (st) {
    case at::kFloat: fn(static_cast<float*>(nullptr)); break;
    case at::kHalf: fn(static_cast<at::Half*>(nullptr)); break;
    case at::kBFloat16: fn(static_cast<at::BFloat16*>(nullptr)); break;
    default: TORCH_CHECK(false, "slimcomm: unsupported dtype ", st);
  }
}

// Value dtypes of buffers and wires.
inline bool is_value_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

inline void check_f32(const char* op, const char* arg, const at::Tensor& t, int64_t numel,
                      const at::Tensor& ref, const char* ref_arg) {
  SLIMCOMM_CHECK(t.scalar_type() == at::kFloat, op, arg, "must be float32, got ",
                 t.scalar_type());
  SLIMCOMM_CHECK(t.dim() == 1 && t.numel() == numel, op, arg, "must be 1-D with ", numel,
                 " elements (like '", ref_arg, "'), got shape ", t.sizes());
  SLIMCOMM_CHECK(t.is_contiguous(), op, arg, "must be contiguous");
  check_same(op, arg, t, ref_arg, ref, false);
}

// offsets: int64 [S + 1] on the values' device (segment boundaries of the group).
inline int64_t check_offsets(const char* op, const at::Tensor& offsets, const at::Tensor& ref,
                             const char* ref_arg) {
  check_index_tensor(op, "offsets", offsets);
  SLIMCOMM_CHECK(offsets.numel() >= 1, op, "offsets", "must hold S + 1 >= 1 entries");
  SLIMCOMM_CHECK(offsets.is_contiguous(), op, "offsets", "must be contiguous");
  check_same(op, "offsets", offsets, ref_arg, ref, false);
  return offsets.numel() - 1;
}

// The CPU-only content check of offsets: 0 = o[0] <= ... <= o[S] = n.
inline void check_offsets_cpu(const char* op, const at::Tensor& offsets, int64_t n) {
  const int64_t* o = offsets.data_ptr<int64_t>();
  const int64_t S = offsets.numel() - 1;
  SLIMCOMM_CHECK(o[0] == 0 && o[S] == n, op, "offsets", "must start at 0 and end at the buffer "
                 "size ", n, ", got ", o[0], " .. ", o[S]);
  for (int64_t s = 0; s < S; ++s)
    SLIMCOMM_CHECK(o[s + 1] >= o[s], op, "offsets", "must be non-decreasing, but entry ", s + 1,
                   " (", o[s + 1], ") < entry ", s, " (", o[s], ")");
}

inline void check_scale(const char* op, const c10::optional<at::Tensor>& scale,
                        const at::Tensor& ref, const char* ref_arg) {
  if (!scale.has_value() || !scale->defined()) return;
  SLIMCOMM_CHECK(scale->scalar_type() == at::kFloat && scale->numel() == 1, op, "scale",
                 "must be a float32 tensor of one element, got ", scale->scalar_type(), " ",
                 scale->sizes());
  check_same(op, "scale", *scale, ref_arg, ref, false);
}

inline void check_counter(const char* op, const at::Tensor& counter, const at::Tensor& ref,
                          const char* ref_arg) {
  SLIMCOMM_CHECK(counter.scalar_type() == at::kLong && counter.dim() == 1 &&
                     counter.numel() >= 2 && counter.is_contiguous(),
                 op, "counter", "must be a contiguous 1-D int64 tensor of >= 2 elements, got ",
                 counter.scalar_type(), " ", counter.sizes());
  check_same(op, "counter", counter, ref_arg, ref, false);
}

inline void check_void_in(const char* op, const c10::optional<at::Tensor>& v,
                          const at::Tensor& ref, const char* ref_arg) {
  if (!v.has_value() || !v->defined()) return;
  SLIMCOMM_CHECK(v->scalar_type() == at::kBool && v->numel() == 1, op, "void_in",
                 "must be a bool tensor of one element, got ", v->scalar_type(), " ", v->sizes());
  check_same(op, "void_in", *v, ref_arg, ref, false);
}

inline bool given(const c10::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

// ---------------------------------------------------------------------------
// Per-element arithmetic (host and device).
// ---------------------------------------------------------------------------

// torch.clamp(v, -lim, lim): NaN stays NaN.
SLIMCOMM_HD float clamp_sym(float v, float lim) {
  if (v != v) return v;
  return v < -lim ? -lim : (v > lim ? lim : v);
}

// The flag of a segment from its max |x| (NaN if any x was NaN): m * 0 + (m != 0),
// i.e. NaN if non-finite, else 1 if nonzero, else 0.
SLIMCOMM_HD float flag_of_max(float m) { return m * 0.0f + (m != 0.0f ? 1.0f : 0.0f); }

// max |x| with NaN propagation (the first NaN wins).
SLIMCOMM_HD float max_abs_step(float m, float x) {
  const float a = fabsf(x);
  if (m != m) return m;
  if (a != a) return a;
  return a > m ? a : m;
}

// Per-segment decision of a commit from the summed flag fl and whether the
// averaged values of the segment are all finite. Bits: 1 keep, 2 good, 4 bad.
SLIMCOMM_HD int decide(float fl, bool values_finite, bool keep_all_zero) {
  const bool fin = values_finite && (fl - fl == 0.0f);  // fl finite
  bool keep, good, bad;
  if (keep_all_zero) {
    keep = fl > 0.0f;
    good = keep && fin;
    bad = !good && fl != 0.0f;  // not good and not zero on every rank (NaN counts)
  } else {
    keep = fl == fl;
    good = fin;
    bad = !fin;
  }
  return (keep ? 1 : 0) | (good ? 2 : 0) | (bad ? 4 : 0);
}

}  // namespace step
}  // namespace slimcomm

namespace slimcomm {
namespace step {

// sgd_apply_indexed: params (one per segment, S of them) must be defined, of one value
// dtype, dense and non-overlapping (memory order is the bucket's order), on indices'
// device; avg holds k + S values (values then flags). Returns N = total numel.
inline int64_t check_sgd_params(const char* op, at::TensorList params, const at::Tensor& indices,
                                const at::Tensor& offsets, const at::Tensor& avg) {
  check_index_tensor(op, "indices", indices);
  const int64_t S = check_offsets(op, offsets, indices, "indices");
  SLIMCOMM_CHECK(static_cast<int64_t>(params.size()) == S, op, "params",
                 "must hold one tensor per segment (S = ", S, " = len(offsets) - 1), got ",
                 params.size());
  check_values(op, "avg", avg);
  check_same(op, "avg", avg, "indices", indices, false);
  SLIMCOMM_CHECK(avg.numel() == indices.numel() + S, op, "avg", "must hold len(indices) + S = ",
                 indices.numel() + S, " elements (values then flags), got ", avg.numel());
  int64_t n = 0;
  for (int64_t s = 0; s < S; ++s) {
    const at::Tensor& p = params[s];
    SLIMCOMM_CHECK(p.defined(), op, "params", "entry ", s, " is undefined");
    SLIMCOMM_CHECK(is_value_dtype(p.scalar_type()) && p.scalar_type() == params[0].scalar_type(),
                   op, "params", "must all be of one dtype among float32/float16/bfloat16; entry ",
                   s, " is ", p.scalar_type(), ", entry 0 ", params[0].scalar_type());
    SLIMCOMM_CHECK(p.is_non_overlapping_and_dense(), op, "params", "entry ", s,
                   " must be dense and non-overlapping (its memory order is its order in the "
                   "bucket)");
    check_same(op, "params", p, "indices", indices, false);
    n += p.numel();
  }
  return n;
}

}  // namespace step
}  // namespace slimcomm
