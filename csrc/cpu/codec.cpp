// CPU kernels of the low-bit value codec (contracts in slimcomm/ops.py,
// definitions in slimcomm/reference.py, arithmetic in csrc/codec.h):
//
//   quantize_chunks         per chunk one bf16 scale, per value one code,
//                           packed 8 / bits per byte (low bits first), and the
//                           rounding error vals - decode(code);
//   dequantize_chunks_mean  every row's codes decoded with its scales, the
//                           rows summed in row order from +0, divided by the
//                           divisor.
//
// Parallel over chunks (the scales) and over byte-aligned ranges of values
// (codes, errors, means), so every byte is written by one thread and results
// do not depend on the thread count. The chunks are walked with the layout
// functions the CUDA kernels use (codec::chunk_range, codec::ChunkCursor), so
// the CPU tests exercise them too. The bits-1 scale sums each chunk
// sequentially in value order (as index_add_ does); eight full chunks are summed
// interleaved, each still in its own order, to hide the latency of the adds.
#include "codec.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>

namespace slimcomm {
namespace {

using codec::bf16_float;
using codec::Levels;

constexpr int64_t kGrainValues = 1 << 15;  // values per parallel task (at least)
constexpr int64_t kBlockValues = 4096;     // values per inner block (fits in L1)

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

typedef uint32_t __attribute__((may_alias)) u32_alias;

// The validated chunk layout (codec::layout_cpu), walked with the same host-and-device
// functions as the CUDA kernels.
struct Layout {
  std::vector<int64_t> lay;  // [oc | cp]
  int64_t S, chunk;
  const int64_t* oc() const { return lay.data(); }
  const int64_t* cp() const { return lay.data() + S + 1; }
  codec::ChunkCursor cursor(int64_t i) const { return codec::ChunkCursor(oc(), cp(), S, chunk, i); }
};

// The bf16 scale (bits) of the values v[a, b).
template <int B>
uint16_t chunk_scale(const float* v, int64_t a, int64_t b) {
  if (B == 1) {
    float acc = 0.f;
    for (int64_t i = a; i < b; ++i) acc += std::fabs(v[i]);
    return codec::scale_from_sum(acc, b - a);
  }
  const u32_alias* u = reinterpret_cast<const u32_alias*>(v);
  uint32_t m = 0u;
  for (int64_t i = a; i < b; ++i) {
    const uint32_t x = u[i] & 0x7FFFFFFFu;
    m = x > m ? x : m;
  }
  return codec::scale_from_maxbits(m);
}

template <int B>
void compute_scales(const float* v, const Layout& L, int64_t nchunks, int64_t K, uint16_t* sc) {
  const int64_t chunk = L.chunk;
  const int64_t grain = std::max<int64_t>(1, kGrainValues / chunk);
  at::parallel_for(0, nchunks, grain, [&](int64_t c0, int64_t c1) {
    int64_t start, e;
    codec::chunk_range(L.oc(), L.cp(), L.S, chunk, c0, start, e);
    codec::ChunkCursor cur = L.cursor(start);
    constexpr int G = 8;
    for (int64_t c = c0; c < c1;) {
      const int n = (B == 1 && c + G <= c1) ? G : 1;
      int64_t lo[G], hi[G];
      bool full = true;
      for (int g = 0; g < n; ++g) {  // the next n chunks
        lo[g] = start;
        hi[g] = start = cur.end;
        full = full && hi[g] - lo[g] == chunk;
        if (start < K) cur.next(start);
      }
      if (n == G && full) {
        float acc[G];
        for (int g = 0; g < G; ++g) acc[g] = 0.f;
        for (int64_t i = 0; i < chunk; ++i)
          for (int g = 0; g < G; ++g) acc[g] += std::fabs(v[lo[g] + i]);
        for (int g = 0; g < G; ++g) sc[c + g] = codec::scale_from_sum(acc[g], chunk);
      } else {
        for (int g = 0; g < n; ++g) sc[c + g] = chunk_scale<B>(v, lo[g], hi[g]);
      }
      c += n;
    }
  });
}

// Codes and errors of n values of one chunk with scale s (int32 codes vectorise better).
template <int B>
void encode_run(const float* v, float* err, int32_t* codes, int64_t n, float s) {
  const float d = codec::divisor_of(s);
  for (int64_t j = 0; j < n; ++j) {
    const float r = codec::code_of<B>(codec::fdiv(v[j], d));
    err[j] = codec::fsub(v[j], codec::fmul(codec::level_of<B, false>(r), s));
    codes[j] = static_cast<int32_t>(r);
  }
}

template <int B>
void pack_bytes(const int32_t* codes, uint8_t* out, int64_t nbytes) {
  constexpr int per = Levels<B>::kPer;
  for (int64_t q = 0; q < nbytes; ++q) {
    uint32_t p = 0u;
    for (int k = 0; k < per; ++k) p |= static_cast<uint32_t>(codes[q * per + k]) << (k * B);
    out[q] = static_cast<uint8_t>(p);
  }
}

template <int B>
void encode_all(const float* v, float* err, uint8_t* packed, const uint16_t* sc,
                const Layout& L, int64_t K) {
  constexpr int per = Levels<B>::kPer;
  constexpr int64_t block_bytes = kBlockValues / per;
  const int64_t nbytes = codec::packed_bytes(K, B);
  at::parallel_for(0, nbytes, kGrainValues / per, [&](int64_t q0, int64_t q1) {
    int32_t codes[kBlockValues];
    for (int64_t qb = q0; qb < q1; qb += block_bytes) {
      const int64_t qe = std::min(q1, qb + block_bytes);
      const int64_t i0 = qb * per, i1 = std::min(qe * per, K);
      codec::ChunkCursor cur = L.cursor(i0);
      for (int64_t i = i0; i < i1;) {
        const int64_t hi = std::min(i1, cur.end);
        encode_run<B>(v + i, err + i, codes + (i - i0), hi - i, bf16_float(sc[cur.c]));
        i = hi;
        if (i < i1) cur.next(i);
      }
      for (int64_t i = i1; i < qe * per; ++i) codes[i - i0] = 0;  // padding of the last byte
      pack_bytes<B>(codes, packed + qb, qe - qb);
    }
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_chunks_cpu(
    const at::Tensor& vals, const at::Tensor& seg_offsets, int64_t chunk, int64_t bits,
    int64_t nchunks) {
  const char* op = "quantize_chunks";
  codec::check_quantize_args(op, vals, seg_offsets, chunk, bits, nchunks);
  const at::Tensor v = vals.contiguous();
  const int64_t K = v.numel();
  const int64_t S = seg_offsets.numel() - 1;
  const Layout L{codec::layout_cpu(op, seg_offsets, K, chunk, nchunks, "nchunks"), S, chunk};
  at::Tensor packed = at::empty({codec::packed_bytes(K, bits)}, v.options().dtype(at::kByte));
  at::Tensor scales = at::empty({nchunks}, v.options().dtype(at::kBFloat16));
  at::Tensor error = at::empty({K}, v.options());
  if (K == 0) return {packed, scales, error};
  const float* pv = v.data_ptr<float>();
  uint16_t* sc = reinterpret_cast<uint16_t*>(scales.data_ptr<at::BFloat16>());
  dispatch_bits(bits, [&](auto tag) {
    constexpr int B = decltype(tag)::value;
    compute_scales<B>(pv, L, nchunks, K, sc);
    encode_all<B>(pv, error.data_ptr<float>(), packed.data_ptr<uint8_t>(), sc, L, K);
  });
  return {packed, scales, error};
}

// o = ((first ? +0 : o) + t * s) [/ divisor if last], elementwise (vectorised).
inline void add_scaled(float* __restrict__ o, const float* __restrict__ t, int64_t n, float s,
                       bool first, bool last, float divisor) {
  if (first && last) {
    for (int64_t j = 0; j < n; ++j)
      o[j] = codec::fdiv(codec::fadd(0.f, codec::fmul(t[j], s)), divisor);
  } else if (first) {
    for (int64_t j = 0; j < n; ++j) o[j] = codec::fadd(0.f, codec::fmul(t[j], s));
  } else if (last) {
    for (int64_t j = 0; j < n; ++j)
      o[j] = codec::fdiv(codec::fadd(o[j], codec::fmul(t[j], s)), divisor);
  } else {
    for (int64_t j = 0; j < n; ++j) o[j] = codec::fadd(o[j], codec::fmul(t[j], s));
  }
}

template <int B>
void decode_mean_all(const uint8_t* packed, int64_t ps, const uint16_t* scales, int64_t ss,
                     int64_t R, const Layout& Lay, int64_t K, float divisor,
                     float* out) {
  constexpr int per = Levels<B>::kPer;
  constexpr unsigned mask = Levels<B>::kMask;
  constexpr int64_t block_bytes = kBlockValues / per;
  std::vector<float> lut(256 * per);  // the levels of every byte's codes
  for (int b = 0; b < 256; ++b)
    for (int k = 0; k < per; ++k)
      lut[b * per + k] = codec::level_of<B, false>(static_cast<float>((b >> (k * B)) & mask));
  const float* L = lut.data();
  const int64_t nbytes = codec::packed_bytes(K, B);
  at::parallel_for(0, nbytes, kGrainValues / per, [&](int64_t q0, int64_t q1) {
    float levels[kBlockValues];
    for (int64_t qb = q0; qb < q1; qb += block_bytes) {
      const int64_t qe = std::min(q1, qb + block_bytes);
      const int64_t i0 = qb * per, i1 = std::min(qe * per, K);
      float* o = out + i0;
      if (R == 0) {  // the mean of no rows: +0 / divisor
        for (int64_t i = 0; i < i1 - i0; ++i) o[i] = codec::fdiv(0.f, divisor);
        continue;
      }
      const codec::ChunkCursor first = Lay.cursor(i0);
      for (int64_t r = 0; r < R; ++r) {
        const uint8_t* P = packed + r * ps + qb;
        for (int64_t q = 0; q < qe - qb; ++q)
          std::memcpy(levels + q * per, L + static_cast<int64_t>(P[q]) * per, sizeof(float) * per);
        const uint16_t* srow = scales + r * ss;
        codec::ChunkCursor cur = first;
        for (int64_t i = i0; i < i1;) {
          const int64_t hi = std::min(i1, cur.end);
          add_scaled(o + (i - i0), levels + (i - i0), hi - i, bf16_float(srow[cur.c]), r == 0,
                     r == R - 1, divisor);
          i = hi;
          if (i < i1) cur.next(i);
        }
      }
    }
  });
}

// A 2-D tensor whose rows are contiguous (a row-strided view is kept as is).
at::Tensor rows_contiguous(const at::Tensor& t) {
  return (t.size(1) <= 1 || t.stride(1) == 1) ? t : t.contiguous();
}

at::Tensor dequantize_chunks_mean_cpu(const at::Tensor& packed, const at::Tensor& scales,
                                      const at::Tensor& seg_offsets, int64_t chunk, int64_t bits,
                                      int64_t numel, double divisor) {
  const char* op = "dequantize_chunks_mean";
  codec::check_dequantize_args(op, packed, scales, seg_offsets, chunk, bits, numel, divisor);
  const int64_t K = numel, R = packed.size(0), nchunks = scales.size(1);
  const int64_t S = seg_offsets.numel() - 1;
  const Layout L{codec::layout_cpu(op, seg_offsets, K, chunk, nchunks, "scales"), S, chunk};
  at::Tensor out = at::empty({K}, packed.options().dtype(at::kFloat));
  if (K == 0) return out;
  const at::Tensor p = rows_contiguous(packed), s = rows_contiguous(scales);
  const uint8_t* pp = p.data_ptr<uint8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(s.data_ptr<at::BFloat16>());
  dispatch_bits(bits, [&](auto tag) {
    constexpr int B = decltype(tag)::value;
    decode_mean_all<B>(pp, p.stride(0), sp, s.stride(0), R, L, K,
                       static_cast<float>(divisor), out.data_ptr<float>());
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(slimcomm, CPU, m) {
  m.impl("quantize_chunks", &quantize_chunks_cpu);
  m.impl("dequantize_chunks_mean", &dequantize_chunks_mean_cpu);
}

}  // namespace slimcomm
