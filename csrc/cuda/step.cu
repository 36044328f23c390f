// CUDA kernels of the fused Slim-DP step ops (contracts in slimcomm/ops.py,
// definitions in slimcomm/reference.py, CPU kernels in csrc/cpu/step.cpp):
// step_encode, step_commit, step_commit_local, step_undo, and sgd_apply_indexed
// (CPU: csrc/cpu/sgd.cpp).
//
// No host synchronisation: segment offsets, the loss scale and the void flag
// are read on the device; indices are not range-checked here (that would need
// a host sync), an out-of-range index trips CUDA_KERNEL_ASSERT. Everything
// runs on the current stream. Per-segment reductions use one atomic per block
// on a per-segment word (max of |x| bit patterns, OR of "non-finite"): both are
// order-independent, so results do not depend on the launch shape.
//
// Rounding follows the ATen CUDA kernels the fused path replaces: the division
// of the payload by the world size is a multiplication by the fp32 reciprocal
// (ATen's div by a CPU scalar), divisions by the loss-scale tensor are true
// divisions, and the non-default accumulations (error_decay != 1, loss scale)
// run the ATen op itself.
#include "cuda_utils.cuh"
#include "step.h"

#include <torch/library.h>

#include <tuple>

namespace slimcomm {
namespace cuda {
namespace {

using OptTensor = c10::optional<at::Tensor>;
using step::given;

constexpr int kBlock = 256;

using step::dispatch_value;

__device__ __forceinline__ bool finite_f(float v) { return v - v == 0.f; }

// Block-reduction operator (cub::Max is gone from recent CCCL releases).
struct MaxOp {
  template <typename T>
  __device__ __forceinline__ T operator()(const T& a, const T& b) const { return a > b ? a : b; }
};

// Segment of bucket-flat index i: the s with o[s] <= i < o[s + 1].
__device__ __forceinline__ int64_t segment_of(const int64_t* o, int64_t S, int64_t i) {
  int64_t lo = 0, hi = S + 1;  // first entry > i
  while (lo < hi) {
    const int64_t mid = (lo + hi) >> 1;
    if (o[mid] <= i) lo = mid + 1;
    else hi = mid;
  }
  return lo - 1;
}

// Grid for the per-segment kernels: blockIdx.y walks segments, blockIdx.x the
// elements of one segment (blocks past a short segment's end exit at once).
inline dim3 segment_grid(int64_t N, int64_t S) {
  const int64_t per = S > 0 ? (N / S + kBlock * 4 - 1) / (kBlock * 4) : 1;
  const int64_t x = std::max<int64_t>(1, std::min<int64_t>(per, 4 * num_sms()));
  return dim3(static_cast<unsigned int>(x),
              static_cast<unsigned int>(std::max<int64_t>(1, std::min<int64_t>(S, 65535))));
}

inline unsigned int flat_grid(int64_t n) { return grid_for(n, kBlock * 4, 8); }

// ---------------------------------------------------------------------------
// step_encode
// ---------------------------------------------------------------------------
template <typename T>
__global__ void __launch_bounds__(kBlock)
    acc_sum_kernel(const T* __restrict__ buf, const float* __restrict__ res, float* __restrict__ acc,
                   int64_t n) {
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * kBlock + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * kBlock)
    acc[e] = __fadd_rn(res[e], static_cast<float>(buf[e]));
}

// Per segment: atomicMax of the bit patterns of |x| (NaN patterns above inf).
template <typename T>
__global__ void __launch_bounds__(kBlock)
    seg_maxabs_kernel(const T* __restrict__ buf, const int64_t* __restrict__ o, int64_t S,
                      unsigned int* __restrict__ maxbits) {
  using Reduce = cub::BlockReduce<unsigned int, kBlock>;
  __shared__ typename Reduce::TempStorage tmp;
  for (int64_t s = blockIdx.y; s < S; s += gridDim.y) {
    const int64_t lo = o[s], hi = o[s + 1];
    unsigned int m = 0u;
    for (int64_t e = lo + static_cast<int64_t>(blockIdx.x) * kBlock + threadIdx.x; e < hi;
         e += static_cast<int64_t>(gridDim.x) * kBlock) {
      const unsigned int b = __float_as_uint(fabsf(static_cast<float>(buf[e])));
      m = b > m ? b : m;
    }
    const unsigned int bm = Reduce(tmp).Reduce(m, MaxOp());
    if (threadIdx.x == 0 && bm != 0u) atomicMax(&maxbits[s], bm);
    __syncthreads();
  }
}

template <typename W>
__global__ void flags_kernel(const unsigned int* __restrict__ maxbits, int64_t S, W* __restrict__ out) {
  for (int64_t s = static_cast<int64_t>(blockIdx.x) * kBlock + threadIdx.x; s < S;
       s += static_cast<int64_t>(gridDim.x) * kBlock)
    out[s] = static_cast<W>(step::flag_of_max(__uint_as_float(maxbits[s])));
}

template <typename T, typename W>
__global__ void __launch_bounds__(kBlock)
    payload_kernel(const T* __restrict__ buf, float* acc, const int64_t* __restrict__ idx,
                   int64_t k, int64_t n, float inv_ws, float ws, bool clip, float lim,
                   W* __restrict__ wire) {
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * kBlock + threadIdx.x; j < k;
       j += static_cast<int64_t>(gridDim.x) * kBlock) {
    const int64_t i = idx[j];
    CUDA_KERNEL_ASSERT(i >= 0 && i < n);
    const float v = __fmul_rn(acc ? acc[i] : static_cast<float>(buf[i]), inv_ws);
    float sent = v, kept = 0.f;
    if (clip) {
      sent = step::clamp_sym(v, lim);
      kept = __fmul_rn(__fsub_rn(v, sent), ws);
    }
    wire[j] = static_cast<W>(sent);
    if (acc) acc[i] = kept;
  }
}

__global__ void __launch_bounds__(kBlock)
    div_scale_kernel(float* __restrict__ acc, const float* __restrict__ scale, int64_t n) {
  const float sc = *scale;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * kBlock + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * kBlock)
    acc[e] = __fdiv_rn(acc[e], sc);
}

at::Tensor step_encode_cuda(const at::Tensor& buf, const at::Tensor& indices,
                            const at::Tensor& offsets, int64_t world_size,
                            at::ScalarType wire_dtype, const OptTensor& acc_opt,
                            const OptTensor& residual, const OptTensor& scale,
                            double error_decay, bool accumulate, c10::optional<double> clip) {
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
  c10::cuda::CUDAGuard guard(buf.device());
  cudaStream_t st = current_stream();
  at::Tensor idx = indices.contiguous();
  const int64_t k = idx.numel();
  at::Tensor wire = at::empty({k + S}, buf.options().dtype(wire_dtype));
  float* acc = has_acc ? acc_opt->data_ptr<float>() : nullptr;
  if (has_acc && accumulate) {
    at::Tensor acc_t = *acc_opt;
    if (given(scale)) {
      at::addcmul_out(acc_t, buf, *residual, *scale, error_decay);
    } else if (error_decay != 1.0) {
      at::add_out(acc_t, buf, *residual, error_decay);
    } else if (N > 0) {
      dispatch_value(buf.scalar_type(), [&](auto* tag) {
        using T = std::remove_pointer_t<decltype(tag)>;
        acc_sum_kernel<T><<<flat_grid(N), kBlock, 0, st>>>(
            buf.data_ptr<T>(), residual->data_ptr<float>(), acc, N);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    }
  }
  at::Tensor maxbits = at::empty({std::max<int64_t>(S, 1)}, buf.options().dtype(at::kInt));
  C10_CUDA_CHECK(cudaMemsetAsync(maxbits.data_ptr(), 0, sizeof(int) * std::max<int64_t>(S, 1), st));
  const float ws = static_cast<float>(world_size);
  const float inv_ws = 1.0f / ws;
  const float lim = clip.has_value() ? static_cast<float>(*clip) : 0.f;
  dispatch_value(buf.scalar_type(), [&](auto* btag) {
    using T = std::remove_pointer_t<decltype(btag)>;
    const T* pb = buf.data_ptr<T>();
    dispatch_value(wire_dtype, [&](auto* wtag) {
      using W = std::remove_pointer_t<decltype(wtag)>;
      W* pw = wire.data_ptr<W>();
      unsigned int* mb = reinterpret_cast<unsigned int*>(maxbits.data_ptr<int>());
      if (S > 0) {
        if (N > 0) {
          seg_maxabs_kernel<T><<<segment_grid(N, S), kBlock, 0, st>>>(
              pb, offsets.data_ptr<int64_t>(), S, mb);
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        }
        flags_kernel<W><<<flat_grid(S), kBlock, 0, st>>>(mb, S, pw + k);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
      if (k > 0) {
        payload_kernel<T, W><<<flat_grid(k), kBlock, 0, st>>>(
            pb, acc, idx.data_ptr<int64_t>(), k, N, inv_ws, ws, clip.has_value(), lim, pw);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
    });
  });
  if (has_acc && given(scale) && N > 0) {
    div_scale_kernel<<<flat_grid(N), kBlock, 0, st>>>(acc, scale->data_ptr<float>(), N);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return wire;
}

// ---------------------------------------------------------------------------
// step_commit / step_commit_local
// ---------------------------------------------------------------------------

// Values at idx cast to the buffer dtype: mark the segments holding a non-finite one.
template <typename T, typename W>
__global__ void __launch_bounds__(kBlock)
    idx_nonfinite_kernel(const W* __restrict__ avg, const int64_t* __restrict__ idx, int64_t k,
                         const int64_t* __restrict__ o, int64_t S, int64_t n,
                         int* __restrict__ nonfinite) {
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * kBlock + threadIdx.x; j < k;
       j += static_cast<int64_t>(gridDim.x) * kBlock) {
    const int64_t i = idx[j];
    CUDA_KERNEL_ASSERT(i >= 0 && i < n);
    const float v = static_cast<float>(static_cast<T>(avg[j]));
    if (!finite_f(v)) atomicOr(&nonfinite[segment_of(o, S, i)], 1);
  }
}

// Per segment the decision (bits: 1 keep, 2 good, 4 bad) and fill = fl * 0; the bad
// count into counter[0]; *void_out = *void_in | (bad > 0). One block.
// fl[s] = sum over r < R of flags[r * stride + s], in rank order.
template <typename W>
__global__ void __launch_bounds__(kBlock)
    decide_kernel(const W* __restrict__ flags, int64_t R, int64_t stride, int64_t S,
                  const int* __restrict__ nonfinite, bool keep_all_zero,
                  int* __restrict__ dec, float* __restrict__ fill,
                  long long* __restrict__ counter, const bool* __restrict__ void_in,
                  bool* __restrict__ void_out) {
  using Reduce = cub::BlockReduce<long long, kBlock>;
  __shared__ typename Reduce::TempStorage tmp;
  long long bad = 0;
  for (int64_t s = threadIdx.x; s < S; s += kBlock) {
    float fl = 0.f;
    if (R == 1) fl = static_cast<float>(flags[s]);
    else
      for (int64_t r = 0; r < R; ++r) fl = __fadd_rn(fl, static_cast<float>(flags[r * stride + s]));
    const int d = step::decide(fl, nonfinite[s] == 0, keep_all_zero);
    dec[s] = d;
    fill[s] = __fmul_rn(fl, 0.0f);
    bad += (d & 4) ? 1 : 0;
  }
  const long long total = Reduce(tmp).Sum(bad);
  if (threadIdx.x == 0) {
    counter[0] += total;
    *void_out = (void_in ? *void_in : false) || total > 0;
  }
}

// Every element by segment: buf = fill where not keep (zero_kept: 0 where keep; buf null:
// not written); acc = residual where not good.
template <typename T>
__global__ void __launch_bounds__(kBlock)
    apply_kernel(T* __restrict__ buf, float* __restrict__ acc, const float* __restrict__ res,
                 const int64_t* __restrict__ o, int64_t S, const int* __restrict__ dec,
                 const float* __restrict__ fill, bool zero_kept) {
  for (int64_t s = blockIdx.y; s < S; s += gridDim.y) {
    const int d = dec[s];
    const bool keep = d & 1, good = d & 2;
    const bool write_buf = buf != nullptr && (!keep || zero_kept);
    const bool write_acc = acc != nullptr && !good;
    if (!write_buf && !write_acc) continue;
    const T v = keep ? static_cast<T>(0.f) : static_cast<T>(fill[s]);
    const int64_t lo = o[s], hi = o[s + 1];
    for (int64_t e = lo + static_cast<int64_t>(blockIdx.x) * kBlock + threadIdx.x; e < hi;
         e += static_cast<int64_t>(gridDim.x) * kBlock) {
      if (write_buf) buf[e] = v;
      if (write_acc) acc[e] = res[e];
    }
  }
}

// The values at idx into buf (kept segments) and G (good segments; old values out).
template <typename T, typename W>
__global__ void __launch_bounds__(kBlock)
    scatter_commit_kernel(T* __restrict__ buf, const W* __restrict__ avg,
                          const int64_t* __restrict__ idx, int64_t k, const int64_t* __restrict__ o,
                          int64_t S, const int* __restrict__ dec, float* __restrict__ G,
                          float* __restrict__ old_g, const float* __restrict__ scale) {
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * kBlock + threadIdx.x; j < k;
       j += static_cast<int64_t>(gridDim.x) * kBlock) {
    const int64_t i = idx[j];
    const int d = dec[segment_of(o, S, i)];
    if (buf && (d & 1)) buf[i] = static_cast<T>(avg[j]);
    if (G) {
      const float old = G[i];
      if (old_g) old_g[j] = old;
      if (d & 2) {
        const float g = static_cast<float>(avg[j]);
        G[i] = scale ? __fdiv_rn(g, *scale) : g;
      }
    }
  }
}

// sgd_apply_indexed: param[i] = fma(avg[j] (cast to the parameters' dtype), -lr, param[i]) at
// every index of a good segment (the decision of step_commit, recomputed per thread from
// the summed flag and the segment's non-finite word); ptrs[s] = the data pointer of segment
// s's parameter.
template <typename T, typename W>
__global__ void __launch_bounds__(kBlock)
    sgd_indexed_kernel(const int64_t* __restrict__ ptrs, const W* __restrict__ avg,
                       const int64_t* __restrict__ idx, int64_t k, const int64_t* __restrict__ o,
                       int64_t S, int64_t n, const int* __restrict__ nonfinite,
                       bool keep_all_zero, float neg_lr) {
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * kBlock + threadIdx.x; j < k;
       j += static_cast<int64_t>(gridDim.x) * kBlock) {
    const int64_t i = idx[j];
    CUDA_KERNEL_ASSERT(i >= 0 && i < n);
    const int64_t s = segment_of(o, S, i);
    const int d = step::decide(static_cast<float>(avg[k + s]), nonfinite[s] == 0, keep_all_zero);
    if (!(d & 2)) continue;
    T* p = reinterpret_cast<T*>(ptrs[s]) + (i - o[s]);
    const float g = static_cast<float>(static_cast<T>(avg[j]));
    *p = static_cast<T>(__fmaf_rn(g, neg_lr, static_cast<float>(*p)));
  }
}

void sgd_apply_indexed_cuda(at::TensorList params, const at::Tensor& indices,
                            const at::Tensor& offsets, const at::Tensor& avg, double lr,
                            bool keep_all_zero) {
  const char* op = "sgd_apply_indexed";
  const int64_t N = step::check_sgd_params(op, params, indices, offsets, avg);
  const int64_t S = offsets.numel() - 1;
  const int64_t k = indices.numel();
  if (S == 0 || k == 0) return;
  c10::cuda::CUDAGuard guard(indices.device());
  cudaStream_t st = current_stream();
  const at::Tensor idx = indices.contiguous(), av = avg.contiguous();
  // the pointer table through pinned memory: an asynchronous copy, no host sync (the
  // caching host allocator keeps the pinned block until the copy has run)
  at::Tensor host = at::empty({S}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  int64_t* h = host.data_ptr<int64_t>();
  for (int64_t s = 0; s < S; ++s) h[s] = reinterpret_cast<int64_t>(params[s].data_ptr());
  const at::Tensor ptrs = host.to(indices.device(), /*non_blocking=*/true);
  at::Tensor nonfinite = at::empty({S}, indices.options().dtype(at::kInt));
  C10_CUDA_CHECK(cudaMemsetAsync(nonfinite.data_ptr(), 0, sizeof(int) * S, st));
  const float neg_lr = static_cast<float>(-lr);
  dispatch_value(params[0].scalar_type(), [&](auto* ptag) {
    using T = std::remove_pointer_t<decltype(ptag)>;
    dispatch_value(av.scalar_type(), [&](auto* wtag) {
      using W = std::remove_pointer_t<decltype(wtag)>;
      const W* pa = av.data_ptr<W>();
      const int64_t* po = offsets.data_ptr<int64_t>();
      idx_nonfinite_kernel<T, W><<<flat_grid(k), kBlock, 0, st>>>(
          pa, idx.data_ptr<int64_t>(), k, po, S, N, nonfinite.data_ptr<int>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      sgd_indexed_kernel<T, W><<<flat_grid(k), kBlock, 0, st>>>(
          ptrs.data_ptr<int64_t>(), pa, idx.data_ptr<int64_t>(), k, po, S, N,
          nonfinite.data_ptr<int>(), keep_all_zero, neg_lr);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

void check_acc_residual(const char* op, const OptTensor& acc, const OptTensor& residual,
                        const at::Tensor& buf) {
  SLIMCOMM_CHECK(given(acc) == given(residual), op, given(acc) ? "residual" : "acc",
                 "must be given together with '", given(acc) ? "acc" : "residual", "'");
  if (given(acc)) {
    step::check_f32(op, "acc", *acc, buf.numel(), buf, "buf");
    step::check_f32(op, "residual", *residual, buf.numel(), buf, "buf");
  }
}

// decide_kernel + apply_kernel, shared by both commits. Returns the void flag.
template <typename T, typename W>
at::Tensor decide_and_apply(T* pb, const W* flags, int64_t R, int64_t stride, int64_t S,
                            int64_t N, const at::Tensor& offsets, const at::Tensor& nonfinite,
                            bool keep_all_zero, at::Tensor& counter, const OptTensor& void_in,
                            const OptTensor& acc, const OptTensor& residual, bool zero_kept,
                            at::Tensor& dec, const at::Tensor& buf) {
  cudaStream_t st = current_stream();
  at::Tensor fill = at::empty({std::max<int64_t>(S, 1)}, buf.options().dtype(at::kFloat));
  at::Tensor void_out = at::empty({}, buf.options().dtype(at::kBool));
  decide_kernel<W><<<1, kBlock, 0, st>>>(
      flags, R, stride, S, nonfinite.data_ptr<int>(), keep_all_zero, dec.data_ptr<int>(),
      fill.data_ptr<float>(), reinterpret_cast<long long*>(counter.data_ptr<int64_t>()),
      given(void_in) ? void_in->data_ptr<bool>() : nullptr, void_out.data_ptr<bool>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (S > 0 && N > 0) {
    apply_kernel<T><<<segment_grid(N, S), kBlock, 0, st>>>(
        pb, given(acc) ? acc->data_ptr<float>() : nullptr,
        given(residual) ? residual->data_ptr<float>() : nullptr, offsets.data_ptr<int64_t>(), S,
        dec.data_ptr<int>(), fill.data_ptr<float>(), zero_kept);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return void_out;
}

std::tuple<at::Tensor, at::Tensor> step_commit_cuda(
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
  c10::cuda::CUDAGuard guard(buf.device());
  cudaStream_t st = current_stream();
  at::Tensor idx = indices.contiguous(), av = avg.contiguous();
  at::Tensor old_g = at::empty({return_old_g ? k : 0}, buf.options().dtype(at::kFloat));
  const int64_t S1 = std::max<int64_t>(S, 1);
  at::Tensor nonfinite = at::empty({S1}, buf.options().dtype(at::kInt));
  at::Tensor dec = at::empty({S1}, buf.options().dtype(at::kInt));
  C10_CUDA_CHECK(cudaMemsetAsync(nonfinite.data_ptr(), 0, sizeof(int) * S1, st));
  at::Tensor void_out;
  dispatch_value(buf.scalar_type(), [&](auto* btag) {
    using T = std::remove_pointer_t<decltype(btag)>;
    T* pb = write_buf ? buf.data_ptr<T>() : nullptr;
    dispatch_value(av.scalar_type(), [&](auto* wtag) {
      using W = std::remove_pointer_t<decltype(wtag)>;
      const W* pa = av.data_ptr<W>();
      const int64_t* po = offsets.data_ptr<int64_t>();
      if (k > 0) {
        idx_nonfinite_kernel<T, W><<<flat_grid(k), kBlock, 0, st>>>(
            pa, idx.data_ptr<int64_t>(), k, po, S, N, nonfinite.data_ptr<int>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
      void_out = decide_and_apply<T, W>(pb, pa + k, 1, 0, S, N, offsets, nonfinite,
                                        keep_all_zero, counter, void_in, acc, residual,
                                        /*zero_kept=*/true, dec, buf);
      if (k > 0) {
        scatter_commit_kernel<T, W><<<flat_grid(k), kBlock, 0, st>>>(
            pb, pa, idx.data_ptr<int64_t>(), k, po, S, dec.data_ptr<int>(),
            given(G) ? G->data_ptr<float>() : nullptr,
            return_old_g ? old_g.data_ptr<float>() : nullptr,
            given(scale) ? scale->data_ptr<float>() : nullptr);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
    });
  });
  return {old_g, void_out};
}

template <typename W>
__global__ void __launch_bounds__(kBlock)
    scatter_add_kernel(float* __restrict__ out, const int64_t* __restrict__ ids,
                       const W* __restrict__ vals, int64_t k, int64_t n) {
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * kBlock + threadIdx.x; j < k;
       j += static_cast<int64_t>(gridDim.x) * kBlock) {
    const int64_t i = ids[j];
    CUDA_KERNEL_ASSERT(i >= 0 && i < n);
    out[i] = __fadd_rn(out[i], static_cast<float>(vals[j]));
  }
}

// buf <- out in buf's dtype (when they differ); per segment whether all are finite.
template <typename T>
__global__ void __launch_bounds__(kBlock)
    cast_nonfinite_kernel(const float* out, T* buf, bool copy, const int64_t* __restrict__ o,
                          int64_t S, int* __restrict__ nonfinite) {
  using Reduce = cub::BlockReduce<int, kBlock>;
  __shared__ typename Reduce::TempStorage tmp;
  for (int64_t s = blockIdx.y; s < S; s += gridDim.y) {
    const int64_t lo = o[s], hi = o[s + 1];
    int nf = 0;
    for (int64_t e = lo + static_cast<int64_t>(blockIdx.x) * kBlock + threadIdx.x; e < hi;
         e += static_cast<int64_t>(gridDim.x) * kBlock) {
      const T v = static_cast<T>(out[e]);
      if (copy) buf[e] = v;
      nf |= finite_f(static_cast<float>(v)) ? 0 : 1;
    }
    const int any = Reduce(tmp).Reduce(nf, MaxOp());
    if (threadIdx.x == 0 && any) atomicOr(&nonfinite[s], 1);
    __syncthreads();
  }
}

at::Tensor step_commit_local_cuda(const at::Tensor& buf, const at::Tensor& all_indices,
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
  c10::cuda::CUDAGuard guard(buf.device());
  cudaStream_t st = current_stream();
  at::Tensor idx = all_indices.contiguous(), av = all_values.contiguous();
  const bool f32 = buf.scalar_type() == at::kFloat;
  at::Tensor out = f32 ? buf : at::empty({N}, buf.options().dtype(at::kFloat));
  if (N > 0) C10_CUDA_CHECK(cudaMemsetAsync(out.data_ptr(), 0, sizeof(float) * N, st));
  const int64_t S1 = std::max<int64_t>(S, 1);
  at::Tensor nonfinite = at::empty({S1}, buf.options().dtype(at::kInt));
  at::Tensor dec = at::empty({S1}, buf.options().dtype(at::kInt));
  C10_CUDA_CHECK(cudaMemsetAsync(nonfinite.data_ptr(), 0, sizeof(int) * S1, st));
  at::Tensor void_out;
  dispatch_value(buf.scalar_type(), [&](auto* btag) {
    using T = std::remove_pointer_t<decltype(btag)>;
    T* pb = buf.data_ptr<T>();
    dispatch_value(av.scalar_type(), [&](auto* wtag) {
      using W = std::remove_pointer_t<decltype(wtag)>;
      const W* pa = av.data_ptr<W>();
      // Rank order: one launch per rank (each rank's indices are unique: no atomics).
      for (int64_t r = 0; r < world_size && k > 0; ++r) {
        scatter_add_kernel<W><<<flat_grid(k), kBlock, 0, st>>>(
            out.data_ptr<float>(), idx.data_ptr<int64_t>() + r * k, pa + r * (k + S), k, N);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
      if (S > 0 && N > 0) {
        cast_nonfinite_kernel<T><<<segment_grid(N, S), kBlock, 0, st>>>(
            out.data_ptr<float>(), pb, !f32, offsets.data_ptr<int64_t>(), S,
            nonfinite.data_ptr<int>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
      void_out = decide_and_apply<T, W>(pb, pa + k, world_size, k + S, S, N, offsets, nonfinite,
                                        keep_all_zero, counter, void_in, acc, residual,
                                        /*zero_kept=*/false, dec, buf);
    });
  });
  return void_out;
}

// ---------------------------------------------------------------------------
// step_undo
// ---------------------------------------------------------------------------
__global__ void __launch_bounds__(kBlock)
    undo_kernel(const bool* __restrict__ void_flag, float* __restrict__ residual,
                const float* __restrict__ spare, int64_t n, float* __restrict__ G,
                const int64_t* __restrict__ idx, const float* __restrict__ old_g, int64_t k,
                int64_t gn, long long* __restrict__ counter) {
  const bool v = *void_flag;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * kBlock + threadIdx.x;
  if (counter && tid == 0 && v) counter[1] += 1;
  if (!v) return;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kBlock;
  if (residual)
    for (int64_t e = tid; e < n; e += stride) residual[e] = spare[e];
  if (G)
    for (int64_t j = tid; j < k; j += stride) {
      const int64_t i = idx[j];
      CUDA_KERNEL_ASSERT(i >= 0 && i < gn);
      G[i] = old_g[j];
    }
}

void step_undo_cuda(const at::Tensor& void_flag, const OptTensor& residual, const OptTensor& spare,
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
  }
  if (given(counter)) step::check_counter(op, *counter, void_flag, "void");
  c10::cuda::CUDAGuard guard(void_flag.device());
  const int64_t n = given(residual) ? residual->numel() : 0;
  const int64_t k = has_g ? idx.numel() : 0;
  undo_kernel<<<flat_grid(std::max<int64_t>({n, k, 1})), kBlock, 0, current_stream()>>>(
      void_flag.data_ptr<bool>(), given(residual) ? residual->data_ptr<float>() : nullptr,
      given(spare) ? spare->data_ptr<float>() : nullptr, n,
      has_g ? G->data_ptr<float>() : nullptr, has_g ? idx.data_ptr<int64_t>() : nullptr,
      has_g ? old_g->data_ptr<float>() : nullptr, k, has_g ? G->numel() : 0,
      given(counter) ? reinterpret_cast<long long*>(counter->data_ptr<int64_t>()) : nullptr);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace
}  // namespace cuda

TORCH_LIBRARY_IMPL(slimcomm, CUDA, m) {
  m.impl("step_encode", &cuda::step_encode_cuda);
  m.impl("step_commit", &cuda::step_commit_cuda);
  m.impl("step_commit_local", &cuda::step_commit_local_cuda);
  m.impl("step_undo", &cuda::step_undo_cuda);
  m.impl("sgd_apply_indexed", &cuda::sgd_apply_indexed_cuda);
}

}  // namespace slimcomm
