// CPU kernels of the fused Slim-DP step ops (see slimcomm/ops.py for the
// contracts and slimcomm/reference.py for executable definitions):
//
//   step_encode        acc = buf + error_decay * scale * residual, the
//                      per-segment flags of buf, the payload [acc[idx] / W |
//                      flags] in the wire dtype (fp16 saturation), and the
//                      residual-to-be (sent coordinates zeroed or set to what
//                      was clipped off, divided by the loss scale);
//   step_commit        after the all-reduce (shared index set): buf, G and the
//                      residual updated per segment under the policies, the
//                      non-finite count added to a counter;
//   step_commit_local  the same after the all-gathers of the local mode
//                      (scatter-add of every rank's pairs in rank order);
//   step_undo          restore the residual and G of a voided step.
//
// Indices are unique within a call (by contract), so parallel loops write
// disjoint locations and results do not depend on the thread count.
#include "step.h"
#include "step_cpu.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>
#include <tuple>
#include <vector>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

namespace slimcomm {
namespace {

using OptTensor = c10::optional<at::Tensor>;
using step::given;

constexpr int64_t kGrain = 1 << 15;

using step::dispatch_value;
using cpu::segment_of;

// Runs fn(s, lo, hi) over [0, N) in parallel chunks split at segment boundaries.
template <typename Fn>
void for_each_segment_range(const int64_t* o, int64_t S, int64_t N, Fn&& fn) {
  at::parallel_for(0, N, kGrain, [&](int64_t a, int64_t b) {
    if (a >= b) return;
    int64_t s = segment_of(o, S, a);
    int64_t e = a;
    while (e < b) {
      while (o[s + 1] <= e) ++s;
      const int64_t hi = std::min(b, o[s + 1]);
      fn(s, e, hi);
      e = hi;
    }
  });
}

// Buffers of at least this many elements get the accumulator written with streaming
// (non-temporal) stores: larger than the caches, so a normal store would first read each
// line of the old contents only to overwrite it (a quarter of step_encode's memory traffic).
constexpr int64_t kStreamMin = 1 << 20;
constexpr int64_t kBlock = 2048;  // elements per L1-resident block of the streamed pass

// dst[0, n) = src[0, n) bytes (any value dtype): streaming stores on the part where dst is
// 16-byte aligned (x86-64), memcpy elsewhere. The storing thread issues the store fence
// (stream_fence) before the data is read elsewhere.
inline void stream_bytes(void* dst, const void* src, size_t n) {
#if defined(__SSE2__)
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
  size_t head = (16u - (reinterpret_cast<uintptr_t>(d) & 15u)) & 15u;
  head = std::min(head, n);
  std::memcpy(d, s, head);
  d += head, s += head, n -= head;
  for (; n >= 16; n -= 16, d += 16, s += 16)
    _mm_stream_si128(reinterpret_cast<__m128i*>(d),
                     _mm_loadu_si128(reinterpret_cast<const __m128i*>(s)));
  std::memcpy(d, s, n);
#else
  std::memcpy(dst, src, n);
#endif
}

// dst[0, n) = src[0, n) (fp32): stream_bytes on the floats.
inline void stream_store(float* dst, const float* src, int64_t n) {
  stream_bytes(dst, src, static_cast<size_t>(n) * sizeof(float));
}

inline void stream_fence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

// Where indices p[0, k) split into two strictly ascending runs [0, split) and [split, k)
// (the compressor's index set: the core set, then the explore set, each ascending):
// split = k for one run; -1 when there are more than two.
int64_t two_ascending_runs(const int64_t* p, int64_t k) {
  int64_t split = k;
  for (int64_t j = 1; j < k; ++j) {
    if (p[j] <= p[j - 1]) {
      if (split != k) return -1;
      split = j;
    }
  }
  return split;
}

// ---------------------------------------------------------------------------
// step_encode
// ---------------------------------------------------------------------------
at::Tensor step_encode_cpu(const at::Tensor& buf, const at::Tensor& indices,
                           const at::Tensor& offsets, int64_t world_size,
                           at::ScalarType wire_dtype, const OptTensor& acc_opt,
                           const OptTensor& residual, const OptTensor& scale, double error_decay,
                           bool accumulate, c10::optional<double> clip) {
  const char* op = "step_encode";
  check_values(op, "buf", buf);
  SLIMCOMM_CHECK(buf.is_contiguous(), op, "buf", "must be contiguous");
  check_index_tensor(op, "indices", indices);
  check_same(op, "indices", indices, "buf", buf, false);
  const int64_t S = step::check_offsets(op, offsets, buf, "buf");
  const int64_t N = buf.numel();
  SLIMCOMM_CHECK(world_size >= 1, op, "world_size", "must be >= 1, got ", world_size);
  SLIMCOMM_CHECK(step::is_value_dtype(wire_dtype), op, "wire_dtype",
                 "must be float32, float16 or bfloat16, got ", wire_dtype);
  const bool has_acc = given(acc_opt);
  if (has_acc) step::check_f32(op, "acc", *acc_opt, N, buf, "buf");
  SLIMCOMM_CHECK(given(residual) == (has_acc && accumulate), op, "residual",
                 given(residual) ? "is only read when 'acc' is given and accumulate=True"
                                 : "is required when 'acc' is given and accumulate=True");
  if (given(residual)) step::check_f32(op, "residual", *residual, N, buf, "buf");
  step::check_scale(op, scale, buf, "buf");
  SLIMCOMM_CHECK(!clip.has_value() || *clip > 0, op, "clip", "must be > 0 or None, got ",
                 clip.has_value() ? *clip : 0.0);
  at::Tensor idx = indices.contiguous();
  check_index_range_cpu(op, "indices", idx, N);
  step::check_offsets_cpu(op, offsets, N);
  const int64_t k = idx.numel();
  const int64_t* o = offsets.data_ptr<int64_t>();
  const int64_t* pi = idx.data_ptr<int64_t>();
  at::Tensor wire = at::empty({k + S}, buf.options().dtype(wire_dtype));
  float* acc = has_acc ? acc_opt->data_ptr<float>() : nullptr;
  const float ws = static_cast<float>(world_size);
  const float lim = clip.has_value() ? static_cast<float>(*clip) : 0.f;
  // payload v = acc[i] / ws of index j (fp16 saturation: sent part, the rest kept in acc)
  auto pack_one = [&](float a, float& kept) {
    const float v = a / ws;
    float sent = v;
    kept = 0.f;
    if (clip.has_value()) {
      sent = step::clamp_sym(v, lim);
      kept = (v - sent) * ws;
    }
    return sent;
  };
  // Streamed pass with the index set as two ascending runs: step 3 is done on each block
  // while it is in L1, instead of a gather from the streamed-out accumulator afterwards
  // (one cache miss per index).
  bool packed = false;

  // 1. acc = buf + error_decay * scale * residual. Only the plain sum is done here, in the
  // same pass as the flags of step 2; the other forms run the ATen op the unfused path
  // used, so they round identically.
  // seg_max[s]: max |buf| over segment s, NaN if any value is NaN or inf.
  std::vector<float> seg_max(static_cast<size_t>(S), 0.f);
  bool have_max = false;
  if (has_acc && accumulate) {
    at::Tensor acc_t = *acc_opt;
    if (given(scale)) {
      at::addcmul_out(acc_t, buf, *residual, *scale, error_decay);
    } else if (error_decay != 1.0) {
      at::add_out(acc_t, buf, *residual, error_decay);
    } else {
      const float* res = residual->data_ptr<float>();
      std::vector<float> seg_nan(static_cast<size_t>(S), 0.f);
      std::mutex mu;
      const bool stream = N >= kStreamMin;
      const int64_t split = stream ? two_ascending_runs(pi, k) : -1;
      packed = split >= 0;
      dispatch_value(buf.scalar_type(), [&](auto* tag) {
        using T = std::remove_pointer_t<decltype(tag)>;
        const T* pb = buf.data_ptr<T>();
        dispatch_value(packed ? wire_dtype : at::kFloat, [&](auto* wtag) {
        using W = std::remove_pointer_t<decltype(wtag)>;
        W* pw = static_cast<W*>(wire.data_ptr());  // only written when packed (W = wire dtype)
        for_each_segment_range(o, S, N, [&](int64_t s, int64_t lo, int64_t hi) {
          // Local restrict pointers: through the lambda's captured references the compiler
          // cannot rule out that a store to acc changes them, and would not vectorise.
          const T* __restrict b = pb;
          const float* __restrict r = res;
          float* __restrict out = acc;
          // m: max |x| over the finite values; z: sum of x * 0, NaN iff some x is not finite.
          float m = 0.f, z = 0.f;
          if (!stream) {
#pragma omp simd reduction(max : m) reduction(+ : z)
            for (int64_t e = lo; e < hi; ++e) {
              const float x = static_cast<float>(b[e]);
              out[e] = r[e] + x;
              const float a = std::fabs(x);
              m = a > m ? a : m;
              z += x * 0.f;
            }
          } else {
            alignas(64) float blk[kBlock];
            // cursors of the two runs at the first index >= lo
            int64_t ja = packed ? std::lower_bound(pi, pi + split, lo) - pi : 0;
            int64_t jb = packed ? std::lower_bound(pi + split, pi + k, lo) - pi : 0;
            for (int64_t e0 = lo; e0 < hi; e0 += kBlock) {
              const int64_t len = std::min(kBlock, hi - e0);
              float* __restrict t = blk;
#pragma omp simd reduction(max : m) reduction(+ : z)
              for (int64_t j = 0; j < len; ++j) {
                const float x = static_cast<float>(b[e0 + j]);
                t[j] = r[e0 + j] + x;
                const float a = std::fabs(x);
                m = a > m ? a : m;
                z += x * 0.f;
              }
              if (packed) {
                const int64_t e1 = e0 + len;
                float kept;
                for (; ja < split && pi[ja] < e1; ++ja) {
                  pw[ja] = static_cast<W>(pack_one(blk[pi[ja] - e0], kept));
                  blk[pi[ja] - e0] = kept;
                }
                for (; jb < k && pi[jb] < e1; ++jb) {
                  pw[jb] = static_cast<W>(pack_one(blk[pi[jb] - e0], kept));
                  blk[pi[jb] - e0] = kept;
                }
              }
              stream_store(out + e0, blk, len);
            }
            stream_fence();  // on the thread that stored, before the chunk's join
          }
          std::lock_guard<std::mutex> lock(mu);
          seg_max[s] = std::max(seg_max[s], m);
          seg_nan[s] += z;
        });
        });
      });
      for (int64_t s = 0; s < S; ++s)
        if (seg_nan[s] != seg_nan[s]) seg_max[s] = seg_nan[s];
      have_max = true;
    }
  }
  if (!have_max) {
    // max |x| through ATen's vectorised abs + amax (NaN-propagating) per segment, several
    // times faster than a scalar loop with per-element NaN branches.
    at::parallel_for(0, S, N >= kGrain ? 1 : std::max<int64_t>(S, 1), [&](int64_t s0, int64_t s1) {
      for (int64_t s = s0; s < s1; ++s)
        if (o[s + 1] > o[s]) seg_max[s] = at::amax(at::abs(buf.slice(0, o[s], o[s + 1]))).item<float>();
    });
  }
  dispatch_value(buf.scalar_type(), [&](auto* btag) {
    using T = std::remove_pointer_t<decltype(btag)>;
    const T* pb = buf.data_ptr<T>();
    dispatch_value(wire_dtype, [&](auto* wtag) {
      using W = std::remove_pointer_t<decltype(wtag)>;
      W* pw = wire.data_ptr<W>();
      // 2. flags of buf per segment: flag_of_max(max |x|), NaN if any x is NaN or inf.
      for (int64_t s = 0; s < S; ++s) pw[k + s] = static_cast<W>(step::flag_of_max(seg_max[s]));
      // 3. payload and the sent coordinates of the residual-to-be (done in the pass above
      // when packed).
      if (packed) return;
      at::parallel_for(0, k, kGrain, [&](int64_t a, int64_t b) {
        for (int64_t j = a; j < b; ++j) {
          const int64_t i = pi[j];
          float kept;
          pw[j] = static_cast<W>(pack_one(acc ? acc[i] : static_cast<float>(pb[i]), kept));
          if (acc) acc[i] = kept;
        }
      });
    });
  });
  // 4. the residual is kept unscaled.
  if (has_acc && given(scale)) {
    const float sc = scale->data_ptr<float>()[0];
    at::parallel_for(0, N, kGrain, [&](int64_t a, int64_t b) {
      for (int64_t e = a; e < b; ++e) acc[e] = acc[e] / sc;
    });
  }
  return wire;
}

// ---------------------------------------------------------------------------
// step_commit / step_commit_local: shared checks and the per-segment pass
// ---------------------------------------------------------------------------
void check_acc_residual(const char* op, const OptTensor& acc, const OptTensor& residual,
                        const at::Tensor& buf) {
  SLIMCOMM_CHECK(given(acc) == given(residual), op, given(acc) ? "residual" : "acc",
                 "must be given together with '", given(acc) ? "acc" : "residual", "'");
  if (given(acc)) {
    step::check_f32(op, "acc", *acc, buf.numel(), buf, "buf");
    step::check_f32(op, "residual", *residual, buf.numel(), buf, "buf");
  }
}

// buf/acc over every element by segment: buf = fill where not keep (zero_kept: 0 where
// keep), acc = residual where not good. pb null: buf is not written.
template <typename T>
void apply_segments(T* pb, float* acc, const float* res, const int64_t* o, int64_t S, int64_t N,
                    const std::vector<int>& dec, const std::vector<T>& fill, bool zero_kept) {
  for_each_segment_range(o, S, N, [&](int64_t s, int64_t lo, int64_t hi) {
    const bool keep = dec[s] & 1, good = dec[s] & 2;
    if (pb && keep && zero_kept) {
      // +0 is all-zero bits in fp32/fp16/bf16: memset, whose large fills use streaming
      // stores (no read of the bucket's old contents), where a store loop would read each
      // cache line before writing it
      std::memset(pb + lo, 0, static_cast<size_t>(hi - lo) * sizeof(T));
    } else if (pb && !keep) {
      const T v = fill[s];
      for (int64_t e = lo; e < hi; ++e) pb[e] = v;
    }
    if (acc && !good)
      std::memcpy(acc + lo, res + lo, static_cast<size_t>(hi - lo) * sizeof(float));
  });
}

at::Tensor finish_void(int64_t bad, at::Tensor& counter, const OptTensor& void_in,
                       const at::Tensor& buf) {
  counter.data_ptr<int64_t>()[0] += bad;
  at::Tensor v = at::empty({}, buf.options().dtype(at::kBool));
  bool prev = given(void_in) ? void_in->data_ptr<bool>()[0] : false;
  v.data_ptr<bool>()[0] = prev || bad > 0;
  return v;
}

template <typename T>
int64_t decide_all(const float* fl, const std::vector<char>& nonfinite, bool keep_all_zero,
                   std::vector<int>& dec, std::vector<T>& fill) {
  int64_t bad = 0;
  const int64_t S = static_cast<int64_t>(dec.size());
  for (int64_t s = 0; s < S; ++s) {
    dec[s] = step::decide(fl[s], !nonfinite[s], keep_all_zero);
    fill[s] = static_cast<T>(fl[s] * 0.0f);
    bad += (dec[s] & 4) ? 1 : 0;
  }
  return bad;
}

std::tuple<at::Tensor, at::Tensor> step_commit_cpu(
    const at::Tensor& buf, const at::Tensor& indices, const at::Tensor& offsets,
    const at::Tensor& avg, at::Tensor& counter, const OptTensor& G, const OptTensor& acc,
    const OptTensor& residual, const OptTensor& scale, bool keep_all_zero, bool return_old_g,
    const OptTensor& void_in, bool write_buf) {
  const char* op = "step_commit";
  check_values(op, "buf", buf);
  SLIMCOMM_CHECK(buf.is_contiguous(), op, "buf", "must be contiguous");
  check_index_tensor(op, "indices", indices);
  check_same(op, "indices", indices, "buf", buf, false);
  const int64_t S = step::check_offsets(op, offsets, buf, "buf");
  const int64_t N = buf.numel();
  check_values(op, "avg", avg);
  check_same(op, "avg", avg, "buf", buf, false);
  const int64_t k = indices.numel();
  SLIMCOMM_CHECK(avg.numel() == k + S, op, "avg", "must hold len(indices) + S = ", k + S,
                 " elements (values then flags), got ", avg.numel());
  step::check_counter(op, counter, buf, "buf");
  if (given(G)) step::check_f32(op, "G", *G, N, buf, "buf");
  SLIMCOMM_CHECK(!return_old_g || given(G), op, "G", "is required when return_old_g=True");
  check_acc_residual(op, acc, residual, buf);
  step::check_scale(op, scale, buf, "buf");
  step::check_void_in(op, void_in, buf, "buf");
  at::Tensor idx = indices.contiguous(), av = avg.contiguous();
  check_index_range_cpu(op, "indices", idx, N);
  step::check_offsets_cpu(op, offsets, N);
  const int64_t* o = offsets.data_ptr<int64_t>();
  const int64_t* pi = idx.data_ptr<int64_t>();
  at::Tensor old_g = at::empty({return_old_g ? k : 0}, buf.options().dtype(at::kFloat));
  float* pg = given(G) ? G->data_ptr<float>() : nullptr;
  float* pold = return_old_g ? old_g.data_ptr<float>() : nullptr;
  float* pacc = given(acc) ? acc->data_ptr<float>() : nullptr;
  const float* pres = given(residual) ? residual->data_ptr<float>() : nullptr;
  const bool has_scale = given(scale);
  const float sc = has_scale ? scale->data_ptr<float>()[0] : 1.f;
  int64_t bad = 0;
  dispatch_value(buf.scalar_type(), [&](auto* btag) {
    using T = std::remove_pointer_t<decltype(btag)>;
    T* pb = write_buf ? buf.data_ptr<T>() : nullptr;
    dispatch_value(av.scalar_type(), [&](auto* wtag) {
      using W = std::remove_pointer_t<decltype(wtag)>;
      const W* pa = av.data_ptr<W>();
      std::vector<char> nonfinite(S, 0);
      {
        cpu::SegmentCursor seg_of(o, S);
        for (int64_t j = 0; j < k; ++j) {
          const float v = static_cast<float>(static_cast<T>(pa[j]));
          if (v - v != 0.f) nonfinite[seg_of(pi[j])] = 1;
        }
      }
      std::vector<float> fl(S);
      for (int64_t s = 0; s < S; ++s) fl[s] = static_cast<float>(pa[k + s]);
      std::vector<int> dec(S);
      std::vector<T> fill(S);
      bad = decide_all(fl.data(), nonfinite, keep_all_zero, dec, fill);
      // Large buffers with the index set as two ascending runs (core, explore): each block
      // of a kept segment is built in L1 (zeros, then its values) and streamed out, where
      // a streamed zero fill followed by the scattered values would read back every cache
      // line a value lands in.
      const int64_t split = pb && N >= kStreamMin ? two_ascending_runs(pi, k) : -1;
      const bool packed = split >= 0;
      apply_segments(pb, pacc, pres, o, S, N, dec, fill, /*zero_kept=*/!packed);
      if (packed) {
        for_each_segment_range(o, S, N, [&](int64_t s, int64_t lo, int64_t hi) {
          if (!(dec[s] & 1)) return;
          alignas(64) T blk[kBlock];
          int64_t ja = std::lower_bound(pi, pi + split, lo) - pi;
          int64_t jb = std::lower_bound(pi + split, pi + k, lo) - pi;
          for (int64_t e0 = lo; e0 < hi; e0 += kBlock) {
            const int64_t len = std::min(kBlock, hi - e0), e1 = e0 + len;
            std::memset(blk, 0, static_cast<size_t>(len) * sizeof(T));  // +0 in every dtype
            for (; ja < split && pi[ja] < e1; ++ja) blk[pi[ja] - e0] = static_cast<T>(pa[ja]);
            for (; jb < k && pi[jb] < e1; ++jb) blk[pi[jb] - e0] = static_cast<T>(pa[jb]);
            stream_bytes(pb + e0, blk, static_cast<size_t>(len) * sizeof(T));
          }
          stream_fence();
        });
      }
      at::parallel_for(0, k, kGrain, [&](int64_t a, int64_t b) {
        cpu::SegmentCursor seg_of(o, S);
        for (int64_t j = a; j < b; ++j) {
          // reading the old G (for the undo of a void step) misses the cache at every
          // sparse index: prefetched ahead as in sgd_apply_indexed (stores alone do not stall)
          if (pold && j + cpu::kPrefetchAhead < b)
            __builtin_prefetch(pg + pi[j + cpu::kPrefetchAhead], 1);
          const int64_t i = pi[j];
          const int d = dec[seg_of(i)];
          if (pb && !packed && (d & 1)) pb[i] = static_cast<T>(pa[j]);
          if (pg) {
            const float old = pg[i];
            if (pold) pold[j] = old;
            if (d & 2) {
              const float g = static_cast<float>(pa[j]);
              pg[i] = has_scale ? g / sc : g;
            }
          }
        }
      });
    });
  });
  return {old_g, finish_void(bad, counter, void_in, buf)};
}

at::Tensor step_commit_local_cpu(const at::Tensor& buf, const at::Tensor& all_indices,
                                 const at::Tensor& all_values, const at::Tensor& offsets,
                                 int64_t world_size, at::Tensor& counter, const OptTensor& acc,
                                 const OptTensor& residual, bool keep_all_zero,
                                 const OptTensor& void_in) {
  const char* op = "step_commit_local";
  check_values(op, "buf", buf);
  SLIMCOMM_CHECK(buf.is_contiguous(), op, "buf", "must be contiguous");
  check_index_tensor(op, "all_indices", all_indices);
  check_same(op, "all_indices", all_indices, "buf", buf, false);
  const int64_t S = step::check_offsets(op, offsets, buf, "buf");
  const int64_t N = buf.numel();
  SLIMCOMM_CHECK(world_size >= 1, op, "world_size", "must be >= 1, got ", world_size);
  SLIMCOMM_CHECK(all_indices.numel() % world_size == 0, op, "all_indices", "has ",
                 all_indices.numel(), " elements, not a multiple of world_size = ", world_size);
  const int64_t k = all_indices.numel() / world_size;
  check_values(op, "all_values", all_values);
  check_same(op, "all_values", all_values, "buf", buf, false);
  SLIMCOMM_CHECK(all_values.numel() == world_size * (k + S), op, "all_values",
                 "must hold world_size * (k + S) = ", world_size * (k + S),
                 " elements (each rank's values then flags), got ", all_values.numel());
  step::check_counter(op, counter, buf, "buf");
  check_acc_residual(op, acc, residual, buf);
  step::check_void_in(op, void_in, buf, "buf");
  at::Tensor idx = all_indices.contiguous(), av = all_values.contiguous();
  check_index_range_cpu(op, "all_indices", idx, N);
  step::check_offsets_cpu(op, offsets, N);
  const int64_t* o = offsets.data_ptr<int64_t>();
  const int64_t* pi = idx.data_ptr<int64_t>();
  float* pacc = given(acc) ? acc->data_ptr<float>() : nullptr;
  const float* pres = given(residual) ? residual->data_ptr<float>() : nullptr;
  const bool f32 = buf.scalar_type() == at::kFloat;
  at::Tensor out = f32 ? buf : at::empty({N}, buf.options().dtype(at::kFloat));
  float* po = out.data_ptr<float>();
  int64_t bad = 0;
  dispatch_value(buf.scalar_type(), [&](auto* btag) {
    using T = std::remove_pointer_t<decltype(btag)>;
    T* pb = buf.data_ptr<T>();
    dispatch_value(av.scalar_type(), [&](auto* wtag) {
      using W = std::remove_pointer_t<decltype(wtag)>;
      const W* pa = av.data_ptr<W>();
      // Scatter-add every rank's pairs in rank order, in fp32.
      at::parallel_for(0, N, kGrain, [&](int64_t a, int64_t b) {
        for (int64_t e = a; e < b; ++e) po[e] = 0.f;
      });
      for (int64_t r = 0; r < world_size; ++r) {
        const int64_t* ids = pi + r * k;
        const W* vals = pa + r * (k + S);
        at::parallel_for(0, k, kGrain, [&](int64_t a, int64_t b) {
          for (int64_t j = a; j < b; ++j) po[ids[j]] = po[ids[j]] + static_cast<float>(vals[j]);
        });
      }
      std::vector<float> fl(S, 0.f);
      for (int64_t r = 0; r < world_size; ++r)
        for (int64_t s = 0; s < S; ++s) fl[s] += static_cast<float>(pa[r * (k + S) + k + s]);
      // buf <- out in buf's dtype; per segment whether every value is finite.
      std::vector<char> nonfinite(S, 0);
      at::parallel_for(0, S, N >= kGrain ? 1 : std::max<int64_t>(S, 1), [&](int64_t s0, int64_t s1) {
        for (int64_t s = s0; s < s1; ++s) {
          bool nf = false;
          for (int64_t e = o[s]; e < o[s + 1]; ++e) {
            const T v = static_cast<T>(po[e]);
            if (!f32) pb[e] = v;
            const float fv = static_cast<float>(v);
            nf = nf || (fv - fv != 0.f);
          }
          nonfinite[s] = nf;
        }
      });
      std::vector<int> dec(S);
      std::vector<T> fill(S);
      bad = decide_all(fl.data(), nonfinite, keep_all_zero, dec, fill);
      apply_segments(pb, pacc, pres, o, S, N, dec, fill, /*zero_kept=*/false);
    });
  });
  return finish_void(bad, counter, void_in, buf);
}

// ---------------------------------------------------------------------------
// step_undo
// ---------------------------------------------------------------------------
void step_undo_cpu(const at::Tensor& void_flag, const OptTensor& residual, const OptTensor& spare,
                   const OptTensor& G, const OptTensor& indices, const OptTensor& old_g,
                   const OptTensor& counter) {
  const char* op = "step_undo";
  SLIMCOMM_CHECK(void_flag.defined() && void_flag.scalar_type() == at::kBool &&
                     void_flag.numel() == 1,
                 op, "void", "must be a bool tensor of one element");
  SLIMCOMM_CHECK(given(residual) == given(spare), op, given(residual) ? "spare" : "residual",
                 "must be given together with '", given(residual) ? "residual" : "spare", "'");
  if (given(residual)) {
    step::check_f32(op, "residual", *residual, residual->numel(), void_flag, "void");
    step::check_f32(op, "spare", *spare, residual->numel(), void_flag, "void");
  }
  const bool has_g = given(G);
  SLIMCOMM_CHECK(has_g == given(indices) && has_g == given(old_g), op, "G",
                 "'G', 'indices' and 'old_g' must be given together");
  at::Tensor idx;
  if (has_g) {
    step::check_f32(op, "G", *G, G->numel(), void_flag, "void");
    check_index_tensor(op, "indices", *indices);
    check_same(op, "indices", *indices, "void", void_flag, false);
    step::check_f32(op, "old_g", *old_g, indices->numel(), void_flag, "void");
    idx = indices->contiguous();
    check_index_range_cpu(op, "indices", idx, G->numel());
  }
  if (given(counter)) step::check_counter(op, *counter, void_flag, "void");
  const bool v = void_flag.data_ptr<bool>()[0];
  if (given(counter)) counter->data_ptr<int64_t>()[1] += v ? 1 : 0;
  if (!v) return;
  if (given(residual)) residual->copy_(*spare);
  if (has_g) {
    float* pg = G->data_ptr<float>();
    const float* po = old_g->data_ptr<float>();
    const int64_t* pi = idx.data_ptr<int64_t>();
    const int64_t k = idx.numel();
    at::parallel_for(0, k, kGrain, [&](int64_t a, int64_t b) {
      for (int64_t j = a; j < b; ++j) pg[pi[j]] = po[j];
    });
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(slimcomm, CPU, m) {
  m.impl("step_encode", &step_encode_cpu);
  m.impl("step_commit", &step_commit_cpu);
  m.impl("step_commit_local", &step_commit_local_cpu);
  m.impl("step_undo", &step_undo_cpu);
}

}  // namespace slimcomm
