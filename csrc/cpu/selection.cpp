// CPU kernels of the selection ops: significance_topk and explore_sample,
// single-segment and segmented.
//
// significance_topk: two streaming passes over (weight, grad).
//   1. Per-thread-chunk histogram of the top 16 bits of the fp32 score's key
//      (score_key in common.h), reduced to find the bin holding the k-th key.
//   2. Each chunk writes the indices of keys in higher bins ("certain") and
//      the (key, index) pairs of keys in the threshold bin ("candidates") at
//      offsets known from pass 1, so both lists come out ascending by index.
//   The candidates are resolved exactly by (key desc, index asc) with
//   nth_element and merged with the certain list.
// explore_sample: one pass computing the Philox key of every index and keeping
//   those under a threshold chosen so that, with overwhelming probability, at
//   least m non-excluded indices pass; the m smallest (key, index) are then
//   selected exactly. If too few passed, the threshold is raised and the pass
//   repeated, so the result is always the exact m smallest keys.
#include "common.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace slimcomm {
namespace {

constexpr int64_t kSmall = 1 << 14;  // below this, select with one nth_element
constexpr int kBins = 1 << 16;      // histogram on the top 16 bits of the key
constexpr int64_t kMinChunk = 1 << 16;

struct Cand {
  uint32_t key;
  int64_t idx;
};

// Top-k order: larger key first, then lower index first.
inline bool topk_before(const Cand& a, const Cand& b) {
  return a.key > b.key || (a.key == b.key && a.idx < b.idx);
}

// The score key of element i with the mode fixed at compile time, for the hot loops.
template <ScoreMode M, typename T>
inline uint32_t key_at(const T* w, const T* g, int64_t i) {
  const float fw = M == ScoreMode::kGrad ? 0.f : static_cast<float>(w[i]);
  const float fg = M == ScoreMode::kWeight ? 0.f : static_cast<float>(g[i]);
  return score_key(score_value(fw, fg, M));
}

// splitmix64: positions of the threshold sample (affects speed only, never results).
inline uint64_t mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

int64_t num_chunks(int64_t n) {
  int64_t by_size = std::max<int64_t>(1, n / kMinChunk);
  return std::min<int64_t>(by_size, std::max<int64_t>(1, at::get_num_threads()));
}

// Keeps the k first (topk_before) of `cand`, which is in ascending index
// order, and writes their indices ascending (+ base): find the k-th largest
// key, then keep every larger key and the lowest-index ties of it.
void finish_candidates(const std::vector<Cand>& cand, int64_t k, int64_t base, int64_t* out) {
  std::vector<uint32_t> keys(cand.size());
  for (size_t i = 0; i < cand.size(); ++i) keys[i] = cand[i].key;
  std::nth_element(keys.begin(), keys.begin() + (k - 1), keys.end(), std::greater<uint32_t>());
  const uint32_t kth = keys[k - 1];
  int64_t greater = 0;
  for (const auto& c : cand) greater += c.key > kth;
  int64_t ties = k - greater, o = 0;
  for (const auto& c : cand) {
    if (c.key > kth || (c.key == kth && ties-- > 0)) out[o++] = base + c.idx;
  }
}

// Exact selection with a 16-bit histogram pass and a compaction pass; used
// when the sampled bracket of topk_select misses.
template <ScoreMode M, typename T>
void topk_histogram(const T* w, const T* g, int64_t n, int64_t k, int64_t base, int64_t* out,
                    bool parallel) {
  const int64_t chunks = parallel ? num_chunks(n) : 1;
  const int64_t chunk_len = (n + chunks - 1) / chunks;
  std::vector<uint32_t> hist(static_cast<size_t>(chunks) * kBins, 0);

  auto for_chunks = [&](auto&& fn) {
    at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
      for (int64_t c = c0; c < c1; ++c) fn(c, c * chunk_len, std::min(n, (c + 1) * chunk_len));
    });
  };

  // Pass 1: histograms.
  for_chunks([&](int64_t c, int64_t lo, int64_t hi) {
    uint32_t* h = hist.data() + c * kBins;
    for (int64_t i = lo; i < hi; ++i) ++h[key_at<M>(w, g, i) >> 16];
  });

  // Threshold bin: the bin holding the k-th largest key.
  std::vector<int64_t> total(kBins, 0);
  for (int64_t c = 0; c < chunks; ++c)
    for (int b = 0; b < kBins; ++b) total[b] += hist[c * kBins + b];
  int64_t above = 0;
  int tb = kBins - 1;
  for (; tb > 0; --tb) {
    if (above + total[tb] >= k) break;
    above += total[tb];
  }
  // Per-chunk write offsets for the certain list and the candidate list.
  std::vector<int64_t> off_above(chunks + 1, 0), off_cand(chunks + 1, 0);
  for (int64_t c = 0; c < chunks; ++c) {
    int64_t a = 0;
    const uint32_t* h = hist.data() + c * kBins;
    for (int b = tb + 1; b < kBins; ++b) a += h[b];
    off_above[c + 1] = off_above[c] + a;
    off_cand[c + 1] = off_cand[c] + h[tb];
  }
  const int64_t need = k - above;
  std::vector<int64_t> certain(above);
  std::vector<Cand> cand(off_cand[chunks]);

  // Pass 2: compaction.
  for_chunks([&](int64_t c, int64_t lo, int64_t hi) {
    int64_t* pa = certain.data() + off_above[c];
    Cand* pc = cand.data() + off_cand[c];
    const uint32_t t = static_cast<uint32_t>(tb);
    for (int64_t i = lo; i < hi; ++i) {
      const uint32_t key = key_at<M>(w, g, i);
      const uint32_t bin = key >> 16;
      if (bin > t) {
        *pa++ = i;
      } else if (bin == t) {
        *pc++ = {key, i};
      }
    }
  });

  // Resolve the threshold bin exactly.
  if (need < static_cast<int64_t>(cand.size())) {
    std::nth_element(cand.begin(), cand.begin() + need, cand.end(), topk_before);
    cand.resize(need);
    std::sort(cand.begin(), cand.end(), [](const Cand& a, const Cand& b) { return a.idx < b.idx; });
  }
  // Merge the two ascending lists.
  int64_t i = 0, j = 0, o = 0;
  const int64_t na = static_cast<int64_t>(certain.size()), nc = need;
  while (i < na && j < nc) out[o++] = base + (certain[i] < cand[j].idx ? certain[i++] : cand[j++].idx);
  while (i < na) out[o++] = base + certain[i++];
  while (j < nc) out[o++] = base + cand[j++].idx;
}

// Writes the k selected indices of [0, n), ascending, to out (local indices + base).
// One streaming pass: a sample of the keys brackets the k-th largest key from
// below; every key at or above the bracket is a candidate, and the candidates
// (about k of them) are resolved exactly.
template <ScoreMode M, typename T>
void topk_select(const T* w, const T* g, int64_t n, int64_t k, int64_t base, int64_t* out,
                 bool parallel) {
  if (k == 0) return;
  if (k == n) {
    for (int64_t i = 0; i < n; ++i) out[i] = base + i;
    return;
  }
  if (n <= kSmall) {
    std::vector<Cand> c(n);
    for (int64_t i = 0; i < n; ++i) c[i] = {key_at<M>(w, g, i), i};
    finish_candidates(c, k, base, out);
    return;
  }
  constexpr int64_t kSample = 1 << 15;
  std::vector<uint32_t> sample(kSample);
  for (int64_t j = 0; j < kSample; ++j)
    sample[j] = key_at<M>(w, g, static_cast<int64_t>(mix64(j) % static_cast<uint64_t>(n)));
  const double r = static_cast<double>(k) * kSample / static_cast<double>(n);
  const int64_t rank = static_cast<int64_t>(r + 6.0 * std::sqrt(r) + 32.0);
  if (rank >= kSample) {  // k close to n: the bracket would keep nearly everything
    topk_histogram<M>(w, g, n, k, base, out, parallel);
    return;
  }
  std::nth_element(sample.begin(), sample.begin() + rank, sample.end(), std::greater<uint32_t>());
  const uint32_t thr = sample[rank];

  const int64_t chunks = parallel ? num_chunks(n) : 1;
  const int64_t chunk_len = (n + chunks - 1) / chunks;
  std::vector<std::vector<Cand>> parts(chunks);
  const double expect = static_cast<double>(rank + 1) / kSample;
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t lo = c * chunk_len, hi = std::min(n, lo + chunk_len);
      auto& p = parts[c];
      p.reserve(static_cast<size_t>((hi - lo) * expect * 1.2) + 64);
      for (int64_t i = lo; i < hi; ++i) {
        const uint32_t key = key_at<M>(w, g, i);
        if (key >= thr) p.push_back({key, i});
      }
    }
  });
  size_t total = 0;
  for (auto& p : parts) total += p.size();
  if (static_cast<int64_t>(total) < k) {  // the bracket missed (rare): exact fallback
    topk_histogram<M>(w, g, n, k, base, out, parallel);
    return;
  }
  std::vector<Cand> cand;
  cand.reserve(total);
  for (auto& p : parts) cand.insert(cand.end(), p.begin(), p.end());
  finish_candidates(cand, k, base, out);
}

template <typename T>
void topk_dispatch(ScoreMode mode, const T* w, const T* g, int64_t n, int64_t k, int64_t base,
                   int64_t* out, bool parallel) {
  switch (mode) {
    case ScoreMode::kGrad: return topk_select<ScoreMode::kGrad>(w, g, n, k, base, out, parallel);
    case ScoreMode::kWeight: return topk_select<ScoreMode::kWeight>(w, g, n, k, base, out, parallel);
    default: return topk_select<ScoreMode::kProduct>(w, g, n, k, base, out, parallel);
  }
}

template <typename Fn>
void dispatch_values(const at::Tensor& t, Fn&& fn) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, t.scalar_type(), "significance_topk", [&] {
    fn(static_cast<scalar_t*>(nullptr));
  });
}

std::tuple<at::Tensor, at::Tensor> significance_topk_segmented_cpu(
    const at::Tensor& weight, const at::Tensor& grad, c10::IntArrayRef offsets,
    c10::IntArrayRef ks, c10::string_view score) {
  const char* op = "significance_topk_segmented";
  const ScoreMode mode = check_topk_args(op, weight, grad, score);
  check_segments(op, offsets, "offsets", ks, "ks", weight.numel());
  const int64_t S = static_cast<int64_t>(ks.size());
  std::vector<int64_t> out_off(S + 1, 0);
  for (int64_t s = 0; s < S; ++s) out_off[s + 1] = out_off[s] + ks[s];
  at::Tensor idx = at::empty({out_off[S]}, weight.options().dtype(at::kLong));
  at::Tensor w = weight.contiguous(), g = grad.contiguous();
  int64_t* po = idx.data_ptr<int64_t>();
  dispatch_values(w, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* pw = w.data_ptr<T>();
    const T* pg = g.data_ptr<T>();
    // Small segments in parallel (one thread each), large ones one by one
    // with parallelism inside.
    std::vector<int64_t> small, large;
    for (int64_t s = 0; s < S; ++s)
      (offsets[s + 1] - offsets[s] <= kSmall ? small : large).push_back(s);
    at::parallel_for(0, static_cast<int64_t>(small.size()), 8, [&](int64_t a, int64_t b) {
      for (int64_t j = a; j < b; ++j) {
        const int64_t s = small[j], lo = offsets[s];
        topk_dispatch(mode, pw + lo, pg + lo, offsets[s + 1] - lo, ks[s], lo, po + out_off[s], false);
      }
    });
    for (int64_t s : large) {
      const int64_t lo = offsets[s];
      topk_dispatch(mode, pw + lo, pg + lo, offsets[s + 1] - lo, ks[s], lo, po + out_off[s], true);
    }
  });
  return {idx, grad.index_select(0, idx)};
}

std::tuple<at::Tensor, at::Tensor> significance_topk_cpu(const at::Tensor& weight,
                                                         const at::Tensor& grad, int64_t k,
                                                         c10::string_view score) {
  const char* op = "significance_topk";
  check_topk_args(op, weight, grad, score);
  SLIMCOMM_CHECK(k >= 0 && k <= weight.numel(), op, "k", "must be in [0, numel(weight) = ",
                 weight.numel(), "], got ", k);
  const int64_t offsets[2] = {0, weight.numel()};
  return significance_topk_segmented_cpu(weight, grad, offsets, {k}, score);
}

// ---------------------------------------------------------------------------
// explore_sample
// ---------------------------------------------------------------------------

struct KeyIdx {
  uint64_t key;
  int64_t idx;
  bool operator<(const KeyIdx& o) const { return key < o.key || (key == o.key && idx < o.idx); }
};

inline bool excluded(const int64_t* ex, int64_t ne, int64_t i) {
  return std::binary_search(ex, ex + ne, i);
}

// Appends (key, index) for every index of the pair-aligned range [lo, hi) (lo
// even) whose explore key is below `limit` and that is not excluded.
void keys_below_scalar(int64_t lo, int64_t hi, uint64_t seed, uint64_t offset, uint64_t limit,
                       const int64_t* ex, int64_t ne, std::vector<KeyIdx>& out) {
  for (int64_t i = lo; i < hi; ++i) {
    const uint64_t key = explore_key(static_cast<uint64_t>(i), seed, offset);
    if (key < limit && !excluded(ex, ne, i)) out.push_back({key, i});
  }
}

// Appends the hits of one block in ascending index order: lane l covers the
// pair (i + 2l, i + 2l + 1); bit l of me / mo marks a hit of the even / odd index.
inline void emit_hits(int64_t i, unsigned me, unsigned mo, const uint64_t* ke, const uint64_t* ko,
                      const int64_t* ex, int64_t ne, std::vector<KeyIdx>& out) {
  for (unsigned both = me | mo; both != 0; both &= both - 1) {
    const int l = __builtin_ctz(both);
    const int64_t j = i + 2 * l;
    if (((me >> l) & 1) && !excluded(ex, ne, j)) out.push_back({ke[l], j});
    if (((mo >> l) & 1) && !excluded(ex, ne, j + 1)) out.push_back({ko[l], j + 1});
  }
}

#if defined(__x86_64__)
// Bit l set when unsigned lane l of v is below the limit (a signed compare
// after flipping the sign bits; `lim` is already flipped).
__attribute__((target("avx2"))) inline int below_mask(__m256i v, __m256i lim, __m256i sign) {
  return _mm256_movemask_pd(
      _mm256_castsi256_pd(_mm256_cmpgt_epi64(lim, _mm256_xor_si256(v, sign))));
}

// The same with AVX2: Philox4x32-10 on 8 counters (pairs) at a time, each
// 32-bit word held in a 64-bit lane so _mm256_mul_epu32 gives the full product.
__attribute__((target("avx2"))) void keys_below_avx2(int64_t lo, int64_t hi, uint64_t seed,
                                                     uint64_t offset, uint64_t limit,
                                                     const int64_t* ex, int64_t ne,
                                                     std::vector<KeyIdx>& out) {
  const __m256i m0 = _mm256_set1_epi64x(kPhiloxM0), m1 = _mm256_set1_epi64x(kPhiloxM1);
  const __m256i low = _mm256_set1_epi64x(0xFFFFFFFFll);
  const __m256i sign = _mm256_set1_epi64x(static_cast<int64_t>(0x8000000000000000ull));
  const __m256i lim = _mm256_xor_si256(_mm256_set1_epi64x(static_cast<int64_t>(limit)), sign);
  const __m256i lane = _mm256_set_epi64x(3, 2, 1, 0);
  const __m256i c2init = _mm256_set1_epi64x(static_cast<uint32_t>(offset));
  const __m256i c3init = _mm256_set1_epi64x(static_cast<uint32_t>(offset >> 32));
  int64_t i = lo;
  for (; i + 16 <= hi; i += 16) {
    const int64_t p = i >> 1;
    __m256i pa = _mm256_add_epi64(_mm256_set1_epi64x(p), lane);
    __m256i pb = _mm256_add_epi64(_mm256_set1_epi64x(p + 4), lane);
    __m256i a0 = pa, a1 = _mm256_srli_epi64(pa, 32), a2 = c2init, a3 = c3init;
    __m256i b0 = pb, b1 = _mm256_srli_epi64(pb, 32), b2 = c2init, b3 = c3init;
    uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
    for (int r = 0; r < 10; ++r) {
      const __m256i K0 = _mm256_set1_epi64x(k0), K1 = _mm256_set1_epi64x(k1);
      const __m256i pa0 = _mm256_mul_epu32(a0, m0), pa1 = _mm256_mul_epu32(a2, m1);
      const __m256i pb0 = _mm256_mul_epu32(b0, m0), pb1 = _mm256_mul_epu32(b2, m1);
      // Upper halves of the lanes carry garbage; mul_epu32 ignores them and
      // the final keys mask them off.
      a0 = _mm256_xor_si256(_mm256_xor_si256(_mm256_srli_epi64(pa1, 32), a1), K0);
      a2 = _mm256_xor_si256(_mm256_xor_si256(_mm256_srli_epi64(pa0, 32), a3), K1);
      a1 = pa1;
      a3 = pa0;
      b0 = _mm256_xor_si256(_mm256_xor_si256(_mm256_srli_epi64(pb1, 32), b1), K0);
      b2 = _mm256_xor_si256(_mm256_xor_si256(_mm256_srli_epi64(pb0, 32), b3), K1);
      b1 = pb1;
      b3 = pb0;
      k0 += kPhiloxW0;
      k1 += kPhiloxW1;
    }
    const __m256i ea = _mm256_or_si256(_mm256_slli_epi64(a0, 32), _mm256_and_si256(a1, low));
    const __m256i oa = _mm256_or_si256(_mm256_slli_epi64(a2, 32), _mm256_and_si256(a3, low));
    const __m256i eb = _mm256_or_si256(_mm256_slli_epi64(b0, 32), _mm256_and_si256(b1, low));
    const __m256i ob = _mm256_or_si256(_mm256_slli_epi64(b2, 32), _mm256_and_si256(b3, low));
    const int me_a = below_mask(ea, lim, sign), mo_a = below_mask(oa, lim, sign);
    const int me_b = below_mask(eb, lim, sign), mo_b = below_mask(ob, lim, sign);
    if ((me_a | mo_a | me_b | mo_b) == 0) continue;
    alignas(32) uint64_t ke[8], ko[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(ke), ea);
    _mm256_store_si256(reinterpret_cast<__m256i*>(ke + 4), eb);
    _mm256_store_si256(reinterpret_cast<__m256i*>(ko), oa);
    _mm256_store_si256(reinterpret_cast<__m256i*>(ko + 4), ob);
    const int me = me_a | (me_b << 4), mo = mo_a | (mo_b << 4);
    emit_hits(i, me, mo, ke, ko, ex, ne, out);
  }
  keys_below_scalar(i, hi, seed, offset, limit, ex, ne, out);
}
#endif

#if defined(__x86_64__)
// The same with AVX-512F: 16 counters (pairs) per iteration in two 8-lane
// vectors; AVX-512 has the unsigned 64-bit compare, so no sign flipping.
__attribute__((target("avx512f"))) void keys_below_avx512(int64_t lo, int64_t hi, uint64_t seed,
                                                          uint64_t offset, uint64_t limit,
                                                          const int64_t* ex, int64_t ne,
                                                          std::vector<KeyIdx>& out) {
  const __m512i m0 = _mm512_set1_epi64(kPhiloxM0), m1 = _mm512_set1_epi64(kPhiloxM1);
  const __m512i low = _mm512_set1_epi64(0xFFFFFFFFll);
  const __m512i lim = _mm512_set1_epi64(static_cast<int64_t>(limit));
  const __m512i lane = _mm512_set_epi64(7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i c2init = _mm512_set1_epi64(static_cast<uint32_t>(offset));
  const __m512i c3init = _mm512_set1_epi64(static_cast<uint32_t>(offset >> 32));
  int64_t i = lo;
  for (; i + 32 <= hi; i += 32) {
    const int64_t p = i >> 1;
    const __m512i pa = _mm512_add_epi64(_mm512_set1_epi64(p), lane);
    const __m512i pb = _mm512_add_epi64(_mm512_set1_epi64(p + 8), lane);
    __m512i a0 = pa, a1 = _mm512_srli_epi64(pa, 32), a2 = c2init, a3 = c3init;
    __m512i b0 = pb, b1 = _mm512_srli_epi64(pb, 32), b2 = c2init, b3 = c3init;
    uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
    for (int r = 0; r < 10; ++r) {
      const __m512i K0 = _mm512_set1_epi64(k0), K1 = _mm512_set1_epi64(k1);
      const __m512i pa0 = _mm512_mul_epu32(a0, m0), pa1 = _mm512_mul_epu32(a2, m1);
      const __m512i pb0 = _mm512_mul_epu32(b0, m0), pb1 = _mm512_mul_epu32(b2, m1);
      a0 = _mm512_xor_si512(_mm512_xor_si512(_mm512_srli_epi64(pa1, 32), a1), K0);
      a2 = _mm512_xor_si512(_mm512_xor_si512(_mm512_srli_epi64(pa0, 32), a3), K1);
      a1 = pa1;
      a3 = pa0;
      b0 = _mm512_xor_si512(_mm512_xor_si512(_mm512_srli_epi64(pb1, 32), b1), K0);
      b2 = _mm512_xor_si512(_mm512_xor_si512(_mm512_srli_epi64(pb0, 32), b3), K1);
      b1 = pb1;
      b3 = pb0;
      k0 += kPhiloxW0;
      k1 += kPhiloxW1;
    }
    const __m512i ea = _mm512_or_si512(_mm512_slli_epi64(a0, 32), _mm512_and_si512(a1, low));
    const __m512i oa = _mm512_or_si512(_mm512_slli_epi64(a2, 32), _mm512_and_si512(a3, low));
    const __m512i eb = _mm512_or_si512(_mm512_slli_epi64(b0, 32), _mm512_and_si512(b1, low));
    const __m512i ob = _mm512_or_si512(_mm512_slli_epi64(b2, 32), _mm512_and_si512(b3, low));
    const unsigned me = _mm512_cmplt_epu64_mask(ea, lim) | (_mm512_cmplt_epu64_mask(eb, lim) << 8);
    const unsigned mo = _mm512_cmplt_epu64_mask(oa, lim) | (_mm512_cmplt_epu64_mask(ob, lim) << 8);
    if ((me | mo) == 0) continue;
    alignas(64) uint64_t ke[16], ko[16];
    _mm512_store_si512(ke, ea);
    _mm512_store_si512(ke + 8, eb);
    _mm512_store_si512(ko, oa);
    _mm512_store_si512(ko + 8, ob);
    emit_hits(i, me, mo, ke, ko, ex, ne, out);
  }
  keys_below_scalar(i, hi, seed, offset, limit, ex, ne, out);
}
#endif

void keys_below(int64_t lo, int64_t hi, uint64_t seed, uint64_t offset, uint64_t limit,
                const int64_t* ex, int64_t ne, std::vector<KeyIdx>& out) {
#if defined(__x86_64__)
  static const bool avx512 = __builtin_cpu_supports("avx512f");
  static const bool avx2 = __builtin_cpu_supports("avx2");
  if (avx512) return keys_below_avx512(lo, hi, seed, offset, limit, ex, ne, out);
  if (avx2) return keys_below_avx2(lo, hi, seed, offset, limit, ex, ne, out);
#endif
  keys_below_scalar(lo, hi, seed, offset, limit, ex, ne, out);
}

// Writes the m selected indices of [0, n) \ exclude, ascending, to out (+ base).
void explore_select(int64_t n, const int64_t* ex, int64_t ne, int64_t m, uint64_t seed,
                    uint64_t offset, int64_t base, int64_t* out, bool parallel) {
  if (m == 0) return;
  const int64_t avail = n - ne;
  if (m == avail) {  // everything that is left, no randomness needed
    int64_t o = 0, j = 0;
    for (int64_t i = 0; i < n; ++i) {
      if (j < ne && ex[j] == i) { ++j; continue; }
      out[o++] = base + i;
    }
    return;
  }
  // Threshold on the uniform 64-bit key: expected m + 8 sqrt(m) + 64 hits.
  double q = (static_cast<double>(m) + 8.0 * std::sqrt(static_cast<double>(m)) + 64.0) /
             static_cast<double>(avail);
  const int64_t chunks = parallel ? num_chunks(n) : 1;
  // Chunks are aligned to pairs so that each Philox call belongs to one chunk.
  const int64_t chunk_len = ((n + chunks - 1) / chunks + 1) & ~int64_t(1);
  std::vector<KeyIdx> cand;
  for (;;) {
    const uint64_t limit =
        q >= 0.99 ? ~uint64_t(0) : static_cast<uint64_t>(std::ldexp(q, 64));
    std::vector<std::vector<KeyIdx>> parts(chunks);
    at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
      for (int64_t c = c0; c < c1; ++c) {
        const int64_t lo = c * chunk_len, hi = std::min(n, lo + chunk_len);
        if (lo >= hi) continue;
        parts[c].reserve(static_cast<size_t>((hi - lo) * std::min(1.0, q) * 1.1 + 16));
        keys_below(lo, hi, seed, offset, limit, ex, ne, parts[c]);
      }
    });
    cand.clear();
    for (auto& p : parts) cand.insert(cand.end(), p.begin(), p.end());
    if (static_cast<int64_t>(cand.size()) >= m || q >= 0.99) break;
    q = std::min(1.0, q * 4.0);  // deterministic retry: still the exact m smallest keys
  }
  // cand is in ascending index order: find the m-th smallest key, then keep,
  // in index order, every smaller key and the lowest-index ties of it.
  std::vector<uint64_t> keys(cand.size());
  for (size_t i = 0; i < cand.size(); ++i) keys[i] = cand[i].key;
  std::nth_element(keys.begin(), keys.begin() + (m - 1), keys.end());
  const uint64_t kth = keys[m - 1];
  int64_t less = 0;
  for (const auto& c : cand) less += c.key < kth;
  int64_t ties = m - less, o = 0;
  for (const auto& c : cand) {
    if (c.key < kth || (c.key == kth && ties-- > 0)) out[o++] = base + c.idx;
  }
}

// Validates one segment's exclude list: inside [lo, hi), strictly increasing.
void check_exclude(const char* op, const int64_t* ex, int64_t ne, int64_t lo, int64_t hi,
                   int64_t seg) {
  for (int64_t j = 0; j < ne; ++j) {
    SLIMCOMM_CHECK(ex[j] >= lo && ex[j] < hi, op, "exclude", "has index ", ex[j],
                   " outside [", lo, ", ", hi, ")", seg >= 0 ? " (segment " : "",
                   seg >= 0 ? std::to_string(seg) : std::string(), seg >= 0 ? ")" : "");
    SLIMCOMM_CHECK(j == 0 || ex[j] > ex[j - 1], op, "exclude",
                   "must be sorted ascending without duplicates, but entry ", j, " (", ex[j],
                   ") follows ", ex[j - 1]);
  }
}

at::Tensor explore_sample_segmented_cpu(c10::IntArrayRef offsets, const at::Tensor& exclude,
                                        c10::IntArrayRef exclude_offsets, c10::IntArrayRef ms,
                                        int64_t seed, c10::IntArrayRef rng_offsets) {
  const char* op = "explore_sample_segmented";
  const std::vector<int64_t> out_off =
      check_explore_lists(op, offsets, exclude, exclude_offsets, ms, rng_offsets);
  const int64_t S = static_cast<int64_t>(ms.size());
  at::Tensor ex = exclude.contiguous();
  const int64_t* pe = ex.data_ptr<int64_t>();
  for (int64_t s = 0; s < S; ++s) {
    const int64_t e0 = exclude_offsets[s];
    check_exclude(op, pe + e0, exclude_offsets[s + 1] - e0, offsets[s], offsets[s + 1], s);
  }
  at::Tensor out = at::empty({out_off[S]}, exclude.options());
  int64_t* po = out.data_ptr<int64_t>();
  // Segment-local exclude lists (explore keys use segment-local indices).
  std::vector<int64_t> local(pe, pe + ex.numel());
  for (int64_t s = 0; s < S; ++s)
    for (int64_t j = exclude_offsets[s]; j < exclude_offsets[s + 1]; ++j) local[j] -= offsets[s];
  const uint64_t useed = static_cast<uint64_t>(seed);
  std::vector<int64_t> small, large;
  for (int64_t s = 0; s < S; ++s)
    (offsets[s + 1] - offsets[s] <= kSmall ? small : large).push_back(s);
  auto run = [&](int64_t s, bool par) {
    explore_select(offsets[s + 1] - offsets[s], local.data() + exclude_offsets[s],
                   exclude_offsets[s + 1] - exclude_offsets[s], ms[s], useed,
                   static_cast<uint64_t>(rng_offsets[s]), offsets[s], po + out_off[s], par);
  };
  at::parallel_for(0, static_cast<int64_t>(small.size()), 8, [&](int64_t a, int64_t b) {
    for (int64_t j = a; j < b; ++j) run(small[j], false);
  });
  for (int64_t s : large) run(s, true);
  return out;
}

at::Tensor explore_sample_cpu(int64_t n, const at::Tensor& exclude, int64_t m, int64_t seed,
                              int64_t offset) {
  const char* op = "explore_sample";
  SLIMCOMM_CHECK(n >= 0, op, "n", "must be >= 0, got ", n);
  SLIMCOMM_CHECK(m >= 0, op, "m", "must be >= 0, got ", m);
  check_index_tensor(op, "exclude", exclude);
  at::Tensor ex = exclude.contiguous();
  check_exclude(op, ex.data_ptr<int64_t>(), ex.numel(), 0, n, -1);
  SLIMCOMM_CHECK(m <= n - ex.numel(), op, "m", "is ", m, " but only n - len(exclude) = ",
                 n - ex.numel(), " indices are left");
  const int64_t offsets[2] = {0, n};
  const int64_t ex_offsets[2] = {0, ex.numel()};
  return explore_sample_segmented_cpu(offsets, ex, ex_offsets, {m}, seed, {offset});
}

}  // namespace

TORCH_LIBRARY_IMPL(slimcomm, CPU, m) {
  m.impl("significance_topk", &significance_topk_cpu);
  m.impl("significance_topk_segmented", &significance_topk_segmented_cpu);
  m.impl("explore_sample", &explore_sample_cpu);
  m.impl("explore_sample_segmented", &explore_sample_segmented_cpu);
}

}  // namespace slimcomm
