// CUDA kernels of the low-bit value codec (contracts in slimcomm/ops.py,
// definitions in slimcomm/reference.py, arithmetic in csrc/codec.h, CPU kernels
// in csrc/cpu/codec.cpp): quantize_chunks, dequantize_chunks_mean.
//
//   layout_kernel    one block: the segment offsets clamped into a valid layout
//                    (0 = oc[0] <= ... <= oc[S] = K) and the first chunk of
//                    every segment (an exclusive scan of ceil(count / chunk));
//   scales_kernel    one warp per chunk: bits 1 sums |x| in value order (the
//                    warp loads 32 values at a time and every lane adds them one
//                    by one, so the sum rounds exactly like the CPU's sequential
//                    sum); bits 2+ takes the max of the |x| bit patterns (NaN
//                    patterns above +inf; order-independent);
//   encode_kernel    one thread per output byte: its 8 / bits codes, their
//                    errors, the byte (no atomics, no byte shared by threads);
//   decode_kernel    one thread per byte of codes: the level of each code times
//                    its row's scale, added over the rows in row order.
//
// No host synchronisation and no allocation outside the caching allocator;
// everything runs on the current stream. seg_offsets is read on the device only:
// on a malformed layout (which the CPU kernels reject) the values are
// unspecified, but every access stays in bounds. Rounding follows ATen's CUDA
// kernels: divisions by a number (1.5, L, the divisor) are multiplications by
// the fp32 reciprocal (codec::level_of<B, true>).
#include "codec.h"
#include "cuda_utils.cuh"

#include <torch/library.h>

#include <tuple>

namespace slimcomm {
namespace cuda {
namespace {

using codec::Levels;

constexpr int kBlock = 256;
constexpr int kWarps = kBlock / 32;
constexpr unsigned kFull = 0xFFFFFFFFu;

struct MaxOp64 {
  __device__ __forceinline__ int64_t operator()(int64_t a, int64_t b) const { return a > b ? a : b; }
};

template <typename Fn>
void dispatch_bits(int64_t bits, Fn&& fn) {
  switch (bits) {
    case 1: fn(std::integral_constant<int, 1>()); break;
    case 2: fn(std::integral_constant<int, 2>()); break;
    case 4: fn(std::integral_constant<int, 4>()); break;
    case 8: fn(std::integral_constant<int, 8>()); break;
    default: TORCH_CHECK(false, "slimcomm: unsupported bits ", bits);
  }
}

// oc[0..S]: o clamped into [0, K], made non-decreasing, oc[0] = 0, oc[S] = K;
// cp[0..S]: cp[s] = chunks of the segments before s (cp[S] = all of them).
__global__ void __launch_bounds__(kBlock)
    layout_kernel(const int64_t* __restrict__ o, int64_t S, int64_t K, int64_t chunk, int64_t* oc,
                  int64_t* cp) {
  using Scan = cub::BlockScan<int64_t, kBlock>;
  __shared__ typename Scan::TempStorage tmp;
  __shared__ int64_t carry;
  if (threadIdx.x == 0) carry = 0;
  __syncthreads();
  for (int64_t base = 0; base <= S; base += kBlock) {
    const int64_t s = base + threadIdx.x;
    int64_t v = 0;
    if (s <= S) {
      v = o[s];
      v = v < 0 ? 0 : (v > K ? K : v);
      if (s == 0) v = 0;
      if (s == S) v = K;
    }
    int64_t run;
    Scan(tmp).InclusiveScan(v, run, MaxOp64());
    run = run > carry ? run : carry;
    if (s <= S) oc[s] = run;
    __syncthreads();
    if (threadIdx.x == kBlock - 1) carry = run;
    __syncthreads();
  }
  if (threadIdx.x == 0) carry = 0;
  __syncthreads();  // also makes oc visible to the whole block
  for (int64_t base = 0; base <= S; base += kBlock) {
    const int64_t s = base + threadIdx.x;
    const int64_t n = s < S ? codec::ceil_div(oc[s + 1] - oc[s], chunk) : 0;
    int64_t excl, total;
    Scan(tmp).ExclusiveSum(n, excl, total);
    if (s <= S) cp[s] = carry + excl;
    __syncthreads();
    if (threadIdx.x == 0) carry += total;
    __syncthreads();
  }
}

template <int B>
__global__ void __launch_bounds__(kBlock)
    scales_kernel(const float* __restrict__ v, const int64_t* __restrict__ oc,
                  const int64_t* __restrict__ cp, int64_t S, int64_t chunk, int64_t nchunks,
                  uint16_t* __restrict__ scales) {
  const int lane = threadIdx.x & 31;
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; c < nchunks;
       c += static_cast<int64_t>(gridDim.x) * kWarps) {
    int64_t a, e;
    codec::chunk_range(oc, cp, S, chunk, c, a, e);
    uint16_t out;
    if (B == 1) {
      float acc = 0.f;  // adding the +0 of the lanes past the end changes nothing
      for (int64_t base = a; base < e; base += 32) {
        const int64_t i = base + lane;
        const float x = i < e ? fabsf(v[i]) : 0.f;
#pragma unroll
        for (int k = 0; k < 32; ++k) acc = __fadd_rn(acc, __shfl_sync(kFull, x, k));
      }
      out = codec::scale_from_sum(acc, e - a);
    } else {
      uint32_t m = 0u;
      for (int64_t i = a + lane; i < e; i += 32) {
        const uint32_t x = __float_as_uint(v[i]) & 0x7FFFFFFFu;
        m = x > m ? x : m;
      }
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) {
        const uint32_t y = __shfl_xor_sync(kFull, m, off);
        m = y > m ? y : m;
      }
      out = codec::scale_from_maxbits(m);
    }
    if (lane == 0) scales[c] = out;
  }
}

template <int B>
__global__ void __launch_bounds__(kBlock)
    encode_kernel(const float* __restrict__ v, const int64_t* __restrict__ oc,
                  const int64_t* __restrict__ cp, int64_t S, int64_t chunk, int64_t nchunks,
                  int64_t K, const uint16_t* __restrict__ scales, uint8_t* __restrict__ packed,
                  float* __restrict__ err) {
  constexpr int per = Levels<B>::kPer;
  const int64_t nbytes = codec::packed_bytes(K, B);
  for (int64_t q = static_cast<int64_t>(blockIdx.x) * kBlock + threadIdx.x; q < nbytes;
       q += static_cast<int64_t>(gridDim.x) * kBlock) {
    const int64_t i0 = q * per;
    codec::ChunkCursor cur(oc, cp, S, chunk, i0);
    uint32_t byte = 0u;
#pragma unroll
    for (int k = 0; k < per; ++k) {
      const int64_t i = i0 + k;
      if (i < K) {
        if (i >= cur.end) cur.next(i);
        const float s = codec::bf16_float(scales[min(cur.c, nchunks - 1)]);
        const float x = v[i];
        const float r = codec::code_of<B>(codec::fdiv(x, codec::divisor_of(s)));
        err[i] = codec::fsub(x, codec::fmul(codec::level_of<B, true>(r), s));
        byte |= static_cast<uint32_t>(static_cast<int>(r)) << (k * B);
      }
    }
    packed[q] = static_cast<uint8_t>(byte);
  }
}

template <int B>
__global__ void __launch_bounds__(kBlock)
    decode_kernel(const uint8_t* __restrict__ packed, int64_t ps,
                  const uint16_t* __restrict__ scales, int64_t ss, int64_t R,
                  const int64_t* __restrict__ oc, const int64_t* __restrict__ cp, int64_t S,
                  int64_t chunk, int64_t nchunks, int64_t K, float inv_divisor,
                  float* __restrict__ out) {
  constexpr int per = Levels<B>::kPer;
  constexpr unsigned mask = Levels<B>::kMask;
  const int64_t nbytes = codec::packed_bytes(K, B);
  for (int64_t q = static_cast<int64_t>(blockIdx.x) * kBlock + threadIdx.x; q < nbytes;
       q += static_cast<int64_t>(gridDim.x) * kBlock) {
    const int64_t i0 = q * per;
    codec::ChunkCursor cur(oc, cp, S, chunk, i0);
    int64_t cs[per];
    float acc[per];
#pragma unroll
    for (int k = 0; k < per; ++k) {
      if (i0 + k < K && i0 + k >= cur.end) cur.next(i0 + k);
      cs[k] = min(cur.c, nchunks - 1);
      acc[k] = 0.f;
    }
    for (int64_t r = 0; r < R; ++r) {
      const unsigned byte = packed[r * ps + q];
      const uint16_t* srow = scales + r * ss;
#pragma unroll
      for (int k = 0; k < per; ++k) {
        const float level = codec::level_of<B, true>(static_cast<float>((byte >> (k * B)) & mask));
        acc[k] = __fadd_rn(acc[k], __fmul_rn(level, codec::bf16_float(srow[cs[k]])));
      }
    }
#pragma unroll
    for (int k = 0; k < per; ++k)
      if (i0 + k < K) out[i0 + k] = __fmul_rn(acc[k], inv_divisor);
  }
}

// The valid layout of seg_offsets on the device: int64 [2 (S + 1)] = [oc | cp].
at::Tensor device_layout(const at::Tensor& seg_offsets, int64_t S, int64_t K, int64_t chunk) {
  at::Tensor lay = at::empty({2 * (S + 1)}, seg_offsets.options());
  int64_t* p = lay.data_ptr<int64_t>();
  layout_kernel<<<1, kBlock, 0, current_stream()>>>(seg_offsets.data_ptr<int64_t>(), S, K, chunk,
                                                    p, p + S + 1);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return lay;
}

at::Tensor rows_contiguous(const at::Tensor& t) {
  return (t.size(1) <= 1 || t.stride(1) == 1) ? t : t.contiguous();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_chunks_cuda(
    const at::Tensor& vals, const at::Tensor& seg_offsets, int64_t chunk, int64_t bits,
    int64_t nchunks) {
  const char* op = "quantize_chunks";
  const int64_t S = codec::check_quantize_args(op, vals, seg_offsets, chunk, bits, nchunks);
  const c10::cuda::CUDAGuard guard(vals.device());
  const at::Tensor v = vals.contiguous();
  const at::Tensor o = seg_offsets.contiguous();
  const int64_t K = v.numel();
  const int64_t nbytes = codec::packed_bytes(K, bits);
  at::Tensor packed = at::empty({nbytes}, v.options().dtype(at::kByte));
  at::Tensor scales = at::empty({nchunks}, v.options().dtype(at::kBFloat16));
  at::Tensor error = at::empty({K}, v.options());
  if (K == 0) return {packed, scales, error};  // then nchunks == 0 too
  const at::Tensor lay = device_layout(o, S, K, chunk);
  const int64_t* oc = lay.data_ptr<int64_t>();
  const int64_t* cp = oc + S + 1;
  uint16_t* sc = reinterpret_cast<uint16_t*>(scales.data_ptr<at::BFloat16>());
  const cudaStream_t stream = current_stream();
  dispatch_bits(bits, [&](auto tag) {
    constexpr int B = decltype(tag)::value;
    scales_kernel<B><<<grid_for(nchunks, kWarps, 16), kBlock, 0, stream>>>(
        v.data_ptr<float>(), oc, cp, S, chunk, nchunks, sc);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    encode_kernel<B><<<grid_for(nbytes, kBlock, 8), kBlock, 0, stream>>>(
        v.data_ptr<float>(), oc, cp, S, chunk, nchunks, K, sc, packed.data_ptr<uint8_t>(),
        error.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {packed, scales, error};
}

at::Tensor dequantize_chunks_mean_cuda(const at::Tensor& packed, const at::Tensor& scales,
                                       const at::Tensor& seg_offsets, int64_t chunk,
                                       int64_t bits, int64_t numel, double divisor) {
  const char* op = "dequantize_chunks_mean";
  const int64_t S = codec::check_dequantize_args(op, packed, scales, seg_offsets, chunk, bits,
                                                 numel, divisor);
  const c10::cuda::CUDAGuard guard(packed.device());
  const int64_t K = numel, R = packed.size(0), nchunks = scales.size(1);
  at::Tensor out = at::empty({K}, packed.options().dtype(at::kFloat));
  if (K == 0) return out;
  const at::Tensor p = rows_contiguous(packed), s = rows_contiguous(scales);
  const at::Tensor lay = device_layout(seg_offsets.contiguous(), S, K, chunk);
  const int64_t* oc = lay.data_ptr<int64_t>();
  // ATen's CUDA division by a number: a multiplication by its fp32 reciprocal.
  const float inv = 1.0f / static_cast<float>(divisor);
  const int64_t nbytes = codec::packed_bytes(K, bits);
  dispatch_bits(bits, [&](auto tag) {
    constexpr int B = decltype(tag)::value;
    decode_kernel<B><<<grid_for(nbytes, kBlock, 8), kBlock, 0, current_stream()>>>(
        p.data_ptr<uint8_t>(), p.stride(0),
        reinterpret_cast<const uint16_t*>(s.data_ptr<at::BFloat16>()), s.stride(0), R, oc,
        oc + S + 1, S, chunk, nchunks, K, inv, out.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

}  // namespace
}  // namespace cuda

TORCH_LIBRARY_IMPL(slimcomm, CUDA, m) {
  m.impl("quantize_chunks", &cuda::quantize_chunks_cuda);
  m.impl("dequantize_chunks_mean", &cuda::dequantize_chunks_mean_cuda);
}

}  // namespace slimcomm
