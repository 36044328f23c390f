// Shared pieces of the low-bit value codec ops (quantize_chunks,
// dequantize_chunks_mean): argument checks common to the CPU and CUDA kernels
// and the per-value arithmetic, written once so that both backends round
// exactly like the ATen sequence they replace (slimcomm/reference.py,
// quantize_chunks / dequantize_chunks_mean; the compressor's codec before the
// fusion).
//
// Layout: the K values are segment-contiguous (segment s holds
// o[s + 1] - o[s] values, possibly 0); each segment is cut into chunks of
// `chunk` values (its last chunk may be short), numbered in order over all
// segments. So the chunks tile [0, K) contiguously, every chunk is non-empty,
// and chunk c + 1 starts where chunk c ends.
//
// Arithmetic (fp32, each step rounded on its own, as separate ATen ops round):
//   bits 1:  scale = bf16(sum |x| / size), the sum accumulated from +0 in value
//            order (what index_add_ does on the CPU); code = (x / d >= 0);
//   bits 2+: scale = bf16(max |x|) (NaN if any x is NaN);
//            x' = x / d with d = clamp_min(float(scale), 1e-30) (NaN stays NaN);
//            bits 2:    code = clamp(round((x' + 1) * 1.5), 0, 3);
//            bits 4, 8: code = clamp(round(x' * L), -L, L) + L, L = 2^(bits-1) - 1;
//   level    bits 1: 2c - 1; bits 2: c / 1.5 - 1; bits 4, 8: (c - L) / L;
//   value  = level * float(scale).
// round = round half to even. clamp(round(y)) == round(clamp(y)) for integer
// bounds, so the kernels clamp first and round with the 1.5 * 2^23 trick
// (exact for |y| <= 2^22), which vectorises without SSE4.1. A NaN y gets the
// code of the lower bound (deterministic; its chunk's scale is non-finite, so
// the decoded value is non-finite anyway).
//
// Divisions by a number (1.5, L, the divisor of the mean): true fp32 divisions
// on the CPU, multiplications by the fp32 reciprocal on CUDA -- what ATen's
// CPU and CUDA kernels do for a tensor divided by a Python number (kRecip).
#pragma once

#include "common.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace slimcomm {
namespace codec {

// fp32(1e-30): torch.clamp_min(x, 1e-30) rounds the bound to the tensor's dtype.
constexpr float kTiny = 1e-30f;
// Adding and subtracting 1.5 * 2^23 rounds |y| <= 2^22 to an integer, half to even.
constexpr float kRoundMagic = 12582912.0f;

inline bool valid_bits(int64_t b) { return b == 1 || b == 2 || b == 4 || b == 8; }

// ceil(n / d) for n >= 0, d >= 1, without overflow.
SLIMCOMM_HD int64_t ceil_div(int64_t n, int64_t d) { return n == 0 ? 0 : 1 + (n - 1) / d; }

// Bytes of K codes of `bits` bits, 8 / bits per byte.
SLIMCOMM_HD int64_t packed_bytes(int64_t K, int64_t bits) { return (K * bits + 7) / 8; }

// ---------------------------------------------------------------------------
// Argument checks (metadata only: no read of device memory).
// ---------------------------------------------------------------------------

// seg_offsets: int64 [S + 1] on ref's device; returns S.
inline int64_t check_seg_offsets(const char* op, const at::Tensor& o, const at::Tensor& ref,
                                 const char* ref_arg) {
  check_index_tensor(op, "seg_offsets", o);
  SLIMCOMM_CHECK(o.numel() >= 1, op, "seg_offsets", "must hold S + 1 >= 1 entries, got 0");
  check_same(op, "seg_offsets", o, ref_arg, ref, false);
  return o.numel() - 1;
}

inline void check_chunk_bits(const char* op, int64_t chunk, int64_t bits) {
  SLIMCOMM_CHECK(chunk >= 1, op, "chunk", "must be >= 1, got ", chunk);
  SLIMCOMM_CHECK(valid_bits(bits), op, "bits", "must be 1, 2, 4 or 8, got ", bits);
}

// What the metadata allows for the number of chunks of K values in S segments:
// 0 for K = 0, else ceil(K / chunk) .. min(K, ceil(K / chunk) + S - 1).
inline void check_nchunks_bounds(const char* op, const char* arg, int64_t nchunks, int64_t K,
                                 int64_t S, int64_t chunk) {
  SLIMCOMM_CHECK(S >= 1 || K == 0, op, "seg_offsets", "has no segment (1 entry) but there are ",
                 K, " values");
  const int64_t lo = ceil_div(K, chunk);
  const int64_t hi = K == 0 ? 0 : std::min<int64_t>(K, lo + S - 1);
  SLIMCOMM_CHECK(nchunks >= lo && nchunks <= hi, op, arg, "gives ", nchunks, " chunks, but ",
                 K, " values in ", S, " segments of chunk size ", chunk, " make between ", lo,
                 " and ", hi);
}

// quantize_chunks(vals, seg_offsets, chunk, bits, nchunks); returns S.
inline int64_t check_quantize_args(const char* op, const at::Tensor& vals,
                                   const at::Tensor& seg_offsets, int64_t chunk, int64_t bits,
                                   int64_t nchunks) {
  SLIMCOMM_CHECK(vals.defined(), op, "vals", "is undefined");
  SLIMCOMM_CHECK(vals.scalar_type() == at::kFloat, op, "vals", "must be float32, got ",
                 vals.scalar_type());
  SLIMCOMM_CHECK(vals.dim() == 1, op, "vals", "must be 1-D, got shape ", vals.sizes());
  const int64_t S = check_seg_offsets(op, seg_offsets, vals, "vals");
  check_chunk_bits(op, chunk, bits);
  check_nchunks_bounds(op, "nchunks", nchunks, vals.numel(), S, chunk);
  return S;
}

// dequantize_chunks_mean(packed, scales, seg_offsets, chunk, bits, numel, divisor); returns S.
inline int64_t check_dequantize_args(const char* op, const at::Tensor& packed,
                                     const at::Tensor& scales, const at::Tensor& seg_offsets,
                                     int64_t chunk, int64_t bits, int64_t numel, double divisor) {
  SLIMCOMM_CHECK(packed.defined(), op, "packed", "is undefined");
  SLIMCOMM_CHECK(packed.scalar_type() == at::kByte, op, "packed", "must be uint8, got ",
                 packed.scalar_type());
  SLIMCOMM_CHECK(packed.dim() == 2, op, "packed", "must be 2-D [rows, bytes], got shape ",
                 packed.sizes());
  SLIMCOMM_CHECK(scales.defined(), op, "scales", "is undefined");
  SLIMCOMM_CHECK(scales.scalar_type() == at::kBFloat16, op, "scales", "must be bfloat16, got ",
                 scales.scalar_type());
  SLIMCOMM_CHECK(scales.dim() == 2, op, "scales", "must be 2-D [rows, nchunks], got shape ",
                 scales.sizes());
  check_same(op, "scales", scales, "packed", packed, false);
  SLIMCOMM_CHECK(scales.size(0) == packed.size(0), op, "scales", "has ", scales.size(0),
                 " rows but 'packed' has ", packed.size(0));
  const int64_t S = check_seg_offsets(op, seg_offsets, packed, "packed");
  check_chunk_bits(op, chunk, bits);
  SLIMCOMM_CHECK(numel >= 0, op, "numel", "must be >= 0, got ", numel);
  const int64_t need = packed_bytes(numel, bits);
  SLIMCOMM_CHECK(packed.size(1) >= need, op, "packed", "has ", packed.size(1),
                 " bytes per row, but ", numel, " codes of ", bits, " bits need ", need);
  check_nchunks_bounds(op, "scales", scales.size(1), numel, S, chunk);
  SLIMCOMM_CHECK(std::isfinite(divisor) && divisor != 0.0 &&
                     std::isfinite(static_cast<float>(divisor)) &&
                     static_cast<float>(divisor) != 0.0f,
                 op, "divisor", "must be finite and nonzero (in float32), got ", divisor);
  return S;
}

// The CPU-only content check of seg_offsets (0 = o[0] <= ... <= o[S] = K) and of the
// chunk count; returns the layout [oc | cp] (S + 1 entries each, see below) that the CUDA
// kernels build on the device (layout_kernel), so both backends walk the same code.
inline std::vector<int64_t> layout_cpu(const char* op, const at::Tensor& seg_offsets, int64_t K,
                                       int64_t chunk, int64_t nchunks, const char* nchunks_arg) {
  const at::Tensor oc = seg_offsets.contiguous();
  const int64_t* o = oc.data_ptr<int64_t>();
  const int64_t S = oc.numel() - 1;
  SLIMCOMM_CHECK(o[0] == 0 && o[S] == K, op, "seg_offsets", "must start at 0 and end at the "
                 "number of values ", K, ", got ", o[0], " .. ", o[S]);
  std::vector<int64_t> lay(2 * (S + 1));
  int64_t total = 0;
  for (int64_t s = 0; s <= S; ++s) {
    lay[s] = o[s];
    lay[S + 1 + s] = total;
    if (s == S) break;
    SLIMCOMM_CHECK(o[s + 1] >= o[s], op, "seg_offsets", "must be non-decreasing, but entry ",
                   s + 1, " (", o[s + 1], ") < entry ", s, " (", o[s], ")");
    total += ceil_div(o[s + 1] - o[s], chunk);
  }
  SLIMCOMM_CHECK(total == nchunks, op, nchunks_arg, "gives ", nchunks, " chunks, but the "
                 "segments of 'seg_offsets' make ", total, " chunks of ", chunk, " values");
  return lay;
}

// ---------------------------------------------------------------------------
// Chunk layout on the device, from oc (the offsets, 0 = oc[0] <= ... <= oc[S] = K) and
// cp (cp[s] = the chunks of the segments before s, cp[S] = all of them), S + 1 each.
// ---------------------------------------------------------------------------

// Last s in [0, n) with a[s] <= v (a non-decreasing, a[0] <= v).
SLIMCOMM_HD int64_t last_le(const int64_t* a, int64_t n, int64_t v) {
  int64_t lo = 0, hi = n;  // first entry > v
  while (lo < hi) {
    const int64_t mid = (lo + hi) >> 1;
    if (a[mid] <= v) lo = mid + 1;
    else hi = mid;
  }
  return lo - 1;
}

// The values [a, e) of chunk c (empty when c >= cp[S]).
SLIMCOMM_HD void chunk_range(const int64_t* oc, const int64_t* cp, int64_t S, int64_t chunk,
                             int64_t c, int64_t& a, int64_t& e) {
  const int64_t s = last_le(cp, S + 1, c);  // S when c is past the layout's chunks
  a = e = 0;
  if (s < S) {
    a = oc[s] + (c - cp[s]) * chunk;
    const int64_t left = oc[s + 1] - a;
    e = a + (chunk < left ? chunk : left);
  }
}

// Walks the chunks value by value, from value i (0 <= i < K).
struct ChunkCursor {
  const int64_t* oc;
  int64_t chunk;
  int64_t s, c, end;  // segment and chunk of the current value, end of the chunk

  SLIMCOMM_HD ChunkCursor(const int64_t* oc_, const int64_t* cp, int64_t S, int64_t chunk_,
                          int64_t i)
      : oc(oc_), chunk(chunk_) {
    s = last_le(oc, S + 1, i);  // < S since i < K = oc[S]
    const int64_t j = (i - oc[s]) / chunk;
    c = cp[s] + j;
    const int64_t a = oc[s] + j * chunk, left = oc[s + 1] - a;
    end = a + (chunk < left ? chunk : left);
  }
  // Moves to value i == end, the first value of the next chunk.
  SLIMCOMM_HD void next(int64_t i) {
    ++c;  // the chunks tile the values in order
    if (end == oc[s + 1]) {
      ++s;
      while (oc[s + 1] <= i) ++s;  // empty segments
    }
    const int64_t left = oc[s + 1] - i;
    end = i + (chunk < left ? chunk : left);
  }
};

// ---------------------------------------------------------------------------
// Per-value arithmetic (host and device). On the device every operation is an
// explicit round-to-nearest intrinsic, so nvcc cannot contract a multiply and an
// add into an FMA (the host build uses -ffp-contract=off for the same reason).
// ---------------------------------------------------------------------------
SLIMCOMM_HD float fadd(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
SLIMCOMM_HD float fsub(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
SLIMCOMM_HD float fmul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
SLIMCOMM_HD float fdiv(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

SLIMCOMM_HD uint32_t f2u(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}
SLIMCOMM_HD float u2f(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

// fp32 -> bf16 bits, round to nearest even (c10::BFloat16's conversion; NaN -> 0x7FC0).
SLIMCOMM_HD uint16_t bf16_bits(float f) {
  if (f != f) return 0x7FC0u;
  const uint32_t u = f2u(f);
  return static_cast<uint16_t>((u + (((u >> 16) & 1u) + 0x7FFFu)) >> 16);
}
SLIMCOMM_HD float bf16_float(uint16_t b) { return u2f(static_cast<uint32_t>(b) << 16); }

// The scale of a chunk from its fp32 sum of |x| and size (bits 1) or the bit pattern of
// its max |x| (bits >= 2; NaN patterns sort above +inf).
SLIMCOMM_HD uint16_t scale_from_sum(float sum, int64_t size) {
  return bf16_bits(fdiv(sum, static_cast<float>(size)));
}
SLIMCOMM_HD uint16_t scale_from_maxbits(uint32_t m) { return bf16_bits(u2f(m)); }

// d = clamp_min(scale, 1e-30), NaN propagating like torch.clamp_min.
SLIMCOMM_HD float divisor_of(float scale) {
  return scale != scale ? scale : (scale < kTiny ? kTiny : scale);
}

template <int B>
struct Levels {
  static constexpr int kL = B >= 4 ? (1 << (B - 1)) - 1 : 1;
  static constexpr int kPer = 8 / B;
  static constexpr unsigned kMask = (1u << B) - 1u;
};

// The code of x = v / d as a float (an exact small integer).
template <int B>
SLIMCOMM_HD float code_of(float x) {
  if (B == 1) return x >= 0.f ? 1.f : 0.f;
  float y, lo, hi;
  if (B == 2) {
    y = fmul(fadd(x, 1.f), 1.5f);
    lo = 0.f;
    hi = 3.f;
  } else {
    const float L = static_cast<float>(Levels<B>::kL);
    y = fmul(x, L);
    lo = -L;
    hi = L;
  }
  y = y > lo ? y : lo;  // NaN -> lo
  y = y < hi ? y : hi;
  y = fsub(fadd(y, kRoundMagic), kRoundMagic);
  if (B == 2) return y;
  return fadd(y, static_cast<float>(Levels<B>::kL));
}

// The level of code r (a float holding the code), before the scale.
template <int B, bool kRecip>
SLIMCOMM_HD float level_of(float r) {
  if (B == 1) return fsub(fmul(r, 2.f), 1.f);
  // bits 2: r * fp32(1 / 1.5) == r / 1.5 for the codes r = 0..3 (checked exhaustively,
  // tests/test_ops_codec.py), so both devices multiply (a division does not vectorise well).
  if (B == 2) return fsub(fmul(r, fdiv(1.f, 1.5f)), 1.f);
  const float L = static_cast<float>(Levels<B>::kL);
  const float c = fsub(r, L);
  return kRecip ? fmul(c, fdiv(1.f, L)) : fdiv(c, L);
}

}  // namespace codec
}  // namespace slimcomm
