// CPU kernels of the selection ops: significance_topk and explore_sample,
// single-segment and segmented.
//
// significance_topk: one streaming pass over (weight, grad) in the usual case.
//   A hashed sample of the keys (score_key in common.h) brackets the k-th
//   largest key from below: thr. Each thread chunk keeps the (key, index) pairs
//   with key > thr (about k of them, like a bracket on random data) and only
//   COUNTS the keys equal to thr, storing the first few of their indices. Then
//   either at least k keys exceed thr (resolve them exactly with nth_element),
//   or thr is the k-th key: every key above it is taken plus the first k - G
//   ties in index order (read from the stored indices, or by re-reading the
//   chunks that supply them, from where their stored list stopped). A
//   degenerate distribution (all-zero gradients or weights, a few distinct
//   values) therefore costs what random data costs: memory O(k), one pass.
//   Fallback (k close to n, or the bracket missed): a 16-bit histogram pass;
//   if the threshold bin is small its (key, index) pairs are resolved
//   exactly, else (a degenerate bin) a second histogram on the low 16 bits of
//   that bin gives the exact k-th key and each chunk's number of ties to take,
//   and an ordered emission pass writes the result: memory O(k + chunks * 2^16).
// explore_sample: Philox draws scaled to ranks among the non-excluded indices,
//   the first distinct ones kept (a bitmap, or a hash set when the sample is
//   tiny against the range), O(m) draws instead of a key per index; the
//   ranks are mapped to indices by a merge with the sorted exclude list.
#include "common.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <type_traits>

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

// splitmix64: positions of the threshold sample and explore hash-set slots (affect
// speed only, never results).
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

// Exact selection by a 16-bit histogram pass; used when k is close to n or
// the sampled bracket of topk_select missed. A small threshold bin is
// resolved from its (key, index) pairs; a large one (ties: a degenerate
// distribution puts most keys in one bin) by a second histogram on the low 16
// bits of that bin and an ordered emission pass, so memory stays O(k) plus
// the histograms whatever the distribution.
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
  // The bin holding the need-th largest key of the summed histogram and the
  // number of keys in the bins above it.
  auto threshold_bin = [&](int64_t need, int& bin, int64_t& above) {
    std::vector<int64_t> total(kBins, 0);
    for (int64_t c = 0; c < chunks; ++c)
      for (int b = 0; b < kBins; ++b) total[b] += hist[c * kBins + b];
    above = 0;
    bin = kBins - 1;
    for (; bin > 0; --bin) {
      if (above + total[bin] >= need) break;
      above += total[bin];
    }
    return total[bin];
  };

  // Pass 1: histograms of the high 16 bits.
  for_chunks([&](int64_t c, int64_t lo, int64_t hi) {
    uint32_t* h = hist.data() + c * kBins;
    for (int64_t i = lo; i < hi; ++i) ++h[key_at<M>(w, g, i) >> 16];
  });
  int tb;
  int64_t above;
  const int64_t in_bin = threshold_bin(k, tb, above);
  const int64_t need = k - above;
  // Keys of chunk c in bins above `bin` of its histogram.
  auto above_in_chunk = [&](int64_t c, int bin) {
    int64_t a = 0;
    const uint32_t* h = hist.data() + c * kBins;
    for (int b = bin + 1; b < kBins; ++b) a += h[b];
    return a;
  };

  if (in_bin > std::max<int64_t>(kSmall, n / 64)) {
    // Degenerate threshold bin: the exact k-th key from its low 16 bits.
    std::vector<int64_t> gt(chunks), eq(chunks), off(chunks + 1, 0), take(chunks);
    for (int64_t c = 0; c < chunks; ++c) gt[c] = above_in_chunk(c, tb);
    std::fill(hist.begin(), hist.end(), 0u);
    // Pass 2: histograms of the low 16 bits of the keys in bin tb.
    for_chunks([&](int64_t c, int64_t lo, int64_t hi) {
      uint32_t* h = hist.data() + c * kBins;
      const uint32_t t = static_cast<uint32_t>(tb);
      for (int64_t i = lo; i < hi; ++i) {
        const uint32_t key = key_at<M>(w, g, i);
        if ((key >> 16) == t) ++h[key & 0xFFFFu];
      }
    });
    int tl;
    int64_t above_lo;
    threshold_bin(need, tl, above_lo);
    const uint32_t kth = (static_cast<uint32_t>(tb) << 16) | static_cast<uint32_t>(tl);
    // Every key > kth is taken, and the first `ties` keys == kth in index order.
    int64_t ties = need - above_lo;
    for (int64_t c = 0; c < chunks; ++c) {
      gt[c] += above_in_chunk(c, tl);
      eq[c] = hist[c * kBins + tl];
      take[c] = std::min(eq[c], ties);
      ties -= take[c];
      off[c + 1] = off[c] + gt[c] + take[c];
    }
    // Pass 3: ordered emission at known offsets (each chunk stops once it has
    // written its share).
    for_chunks([&](int64_t c, int64_t lo, int64_t hi) {
      int64_t* o = out + off[c];
      int64_t* const end = out + off[c + 1];
      int64_t left = take[c];
      for (int64_t i = lo; i < hi && o < end; ++i) {
        const uint32_t key = key_at<M>(w, g, i);
        if (key > kth || (key == kth && left-- > 0)) *o++ = base + i;
      }
    });
    return;
  }

  // Per-chunk write offsets for the certain list and the candidate list.
  std::vector<int64_t> off_above(chunks + 1, 0), off_cand(chunks + 1, 0);
  for (int64_t c = 0; c < chunks; ++c) {
    off_above[c + 1] = off_above[c] + above_in_chunk(c, tb);
    off_cand[c + 1] = off_cand[c] + hist[c * kBins + tb];
  }
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
// below (thr); keys above thr are candidates (about k of them), keys equal to
// thr are counted and the first few of each chunk remembered, so a massive
// Prefilter of topk_select's streaming pass over fp32 inputs: the first j >= i
// such that the 8 keys [j, j + 8) may hold one >= thr, or such that fewer than 8
// are left (j = hi - (hi - i) % 8). Only skips blocks in which no key can pass, so
// the exact scalar test after it decides everything: a lane passes if the bits
// of its score, as a signed int, are >= thr (scores are >= +0, so this orders
// them like score_key; a thr >= 2^31 lets every non-negative lane pass) or if
// the score is NaN (key 0xFFFFFFFF, whatever its sign bit).
using SkipFn = int64_t (*)(const float*, const float*, int64_t, int64_t, uint32_t);

int64_t skip_none(const float*, const float*, int64_t i, int64_t, uint32_t) { return i; }

#if defined(__x86_64__)
template <ScoreMode M>
__attribute__((target("avx2"))) int64_t skip_avx2(const float* w, const float* g, int64_t i,
                                                  int64_t hi, uint32_t thr) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256i below = _mm256_set1_epi32(static_cast<int32_t>(thr - 1u));
  const bool all_nonneg_pass = thr == 0 || thr > 0x80000000u;
  if (all_nonneg_pass) return i;  // nothing to skip: every block may hold a candidate
  for (; i + 8 <= hi; i += 8) {
    __m256 s;
    if (M == ScoreMode::kGrad) {
      s = _mm256_and_ps(_mm256_loadu_ps(g + i), abs_mask);
    } else if (M == ScoreMode::kWeight) {
      s = _mm256_and_ps(_mm256_loadu_ps(w + i), abs_mask);
    } else {
      s = _mm256_mul_ps(_mm256_and_ps(_mm256_loadu_ps(w + i), abs_mask),
                        _mm256_and_ps(_mm256_loadu_ps(g + i), abs_mask));
    }
    const __m256i pass = _mm256_or_si256(_mm256_cmpgt_epi32(_mm256_castps_si256(s), below),
                                         _mm256_castps_si256(_mm256_cmp_ps(s, s, _CMP_UNORD_Q)));
    if (!_mm256_testz_si256(pass, pass)) return i;
  }
  return i;
}
#endif

template <ScoreMode M, typename T>
SkipFn skip_fn() {
#if defined(__x86_64__)
  static const bool avx2 = __builtin_cpu_supports("avx2");
  if (std::is_same<T, float>::value && avx2) return skip_avx2<M>;
#endif
  return skip_none;
}

// tie at thr (all-zero scores) costs no more memory or time than random data.
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

  const SkipFn skip = skip_fn<M, T>();
  const int64_t chunks = parallel ? num_chunks(n) : 1;
  const int64_t chunk_len = (n + chunks - 1) / chunks;
  struct Part {
    std::vector<Cand> above;    // key > thr, ascending index
    std::vector<int64_t> ties;  // the first (up to tie_cap) indices with key == thr
    int64_t eq = 0;             // number of keys == thr in the chunk
    bool overflow = false;      // more keys above thr than the bracket allows
  };
  std::vector<Part> parts(chunks);
  // Ties stored per chunk: about 2k in all (what random data's candidates
  // cost), so that usually no chunk needs re-reading.
  const int64_t tie_cap = (2 * k + chunks - 1) / chunks + 64;
  const double expect = static_cast<double>(rank + 1) / kSample;
  // About n (rank+1)/kSample keys pass, with a relative spread of
  // 1/sqrt(rank+1); one chunk holding 8 spreads more than all of them means
  // the sample misjudged the data (adversarial, never random): stop, fall back.
  const size_t above_cap = static_cast<size_t>(
      static_cast<double>(n) * expect * (1.0 + 8.0 / std::sqrt(rank + 1.0))) + 4096;
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t lo = c * chunk_len, hi = std::min(n, lo + chunk_len);
      auto& p = parts[c];
      p.above.reserve(static_cast<size_t>((hi - lo) * expect * 1.2) + 64);
      int64_t eq = 0, i = lo;
      auto push_above = [&](uint32_t key, int64_t j) {
        p.above.push_back({key, j});
        if (p.above.size() <= above_cap) return true;
        p.overflow = true;
        return false;
      };
      // Until tie_cap ties are stored: on random data the whole chunk, blocks of
      // 8 keys without a candidate skipped by the vector prefilter (fp32), the
      // others tested one by one.
      while (i < hi && eq < tie_cap && !p.overflow) {
        if (skip != skip_none) {
          i = skip(reinterpret_cast<const float*>(w), reinterpret_cast<const float*>(g), i, hi,
                   thr);
          if (i >= hi) break;
        }
        const int64_t stop = skip != skip_none ? std::min(hi, i + 8) : hi;
        for (; i < stop && eq < tie_cap; ++i) {
          const uint32_t key = key_at<M>(w, g, i);
          if (key >= thr) {
            if (key > thr) {
              if (!push_above(key, i)) break;
            } else {
              p.ties.push_back(i);
              ++eq;
            }
          }
        }
      }
      // Then (massive ties only) the ties are counted without a branch.
      for (; i < hi && !p.overflow; ++i) {
        const uint32_t key = key_at<M>(w, g, i);
        if (key > thr && !push_above(key, i)) break;
        eq += key == thr;
      }
      p.eq = eq;
    }
  });
  int64_t greater = 0, equal = 0;
  bool overflow = false;
  for (auto& p : parts) {
    greater += static_cast<int64_t>(p.above.size());
    equal += p.eq;
    overflow |= p.overflow;
  }
  if (overflow) {  // the bracket sits far too low (adversarial data): exact fallback
    std::vector<Part>().swap(parts);
    topk_histogram<M>(w, g, n, k, base, out, parallel);
    return;
  }
  if (greater >= k) {  // the k-th key is above thr: resolve the candidates exactly
    std::vector<Cand> cand;
    cand.reserve(greater);
    for (auto& p : parts) {
      cand.insert(cand.end(), p.above.begin(), p.above.end());
      std::vector<Cand>().swap(p.above);
    }
    finish_candidates(cand, k, base, out);
    return;
  }
  if (greater + equal < k) {  // the bracket missed (rare): exact fallback
    std::vector<Part>().swap(parts);
    topk_histogram<M>(w, g, n, k, base, out, parallel);
    return;
  }
  // thr is the k-th key: take every key above it and the first k - greater
  // ties in index order. A chunk that must supply more ties than it stored is
  // re-read from just after its last stored tie (all-zero data: about k - tie_cap
  // elements of the first chunk).
  std::vector<int64_t> take(chunks);
  int64_t left = k - greater;
  for (int64_t c = 0; c < chunks; ++c) {
    take[c] = std::min(parts[c].eq, left);
    left -= take[c];
  }
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      auto& t = parts[c].ties;
      if (static_cast<int64_t>(t.size()) >= take[c]) {
        t.resize(take[c]);
        continue;
      }
      const int64_t hi = std::min(n, (c + 1) * chunk_len);
      t.reserve(take[c]);
      for (int64_t i = t.empty() ? c * chunk_len : t.back() + 1;
           i < hi && static_cast<int64_t>(t.size()) < take[c]; ++i)
        if (key_at<M>(w, g, i) == thr) t.push_back(i);
    }
  });
  // Merge the ascending lists (chunk by chunk: every index of chunk c is below
  // those of chunk c + 1).
  int64_t o = 0;
  for (auto& p : parts) {
    size_t a = 0, b = 0;
    const size_t na = p.above.size(), nb = p.ties.size();
    while (a < na && b < nb)
      out[o++] = base + (p.above[a].idx < p.ties[b] ? p.above[a++].idx : p.ties[b++]);
    while (a < na) out[o++] = base + p.above[a++].idx;
    while (b < nb) out[o++] = base + p.ties[b++];
  }
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
// Definition (ops.explore_sample): with a = n - |exclude| and t = m, or a - m
// when 2m > a (then the complement is sampled), draw j = 0, 1, ... is the rank
// d_j = mulhi64(explore_key(j), a) among the non-excluded indices; the first t
// distinct ranks are R; the result is R (or [0, a) \ R) mapped to indices.

// High 64 bits of u * a: a uniform 64-bit u scaled to [0, a).
inline uint64_t scale_draw(uint64_t u, uint64_t a) {
  return static_cast<uint64_t>((static_cast<unsigned __int128>(u) * a) >> 64);
}

// Keys of draws [j0, j0 + count) into out (j0 and count even): one Philox call
// per pair of draws.
void draw_keys_scalar(uint64_t j0, int64_t count, uint64_t seed, uint64_t offset, uint64_t* out) {
  for (int64_t i = 0; i < count; i += 2) {
    const uint64_t p = (j0 + static_cast<uint64_t>(i)) >> 1;
    const Philox4 o = philox4x32_10(static_cast<uint32_t>(p), static_cast<uint32_t>(p >> 32),
                                    static_cast<uint32_t>(offset),
                                    static_cast<uint32_t>(offset >> 32),
                                    static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
    out[i] = (static_cast<uint64_t>(o.x[0]) << 32) | o.x[1];
    out[i + 1] = (static_cast<uint64_t>(o.x[2]) << 32) | o.x[3];
  }
}

#if defined(__x86_64__)
// The same with AVX2: Philox4x32-10 on 4 counters (pairs) per vector, two
// vectors per iteration, each 32-bit word held in a 64-bit lane so that
// _mm256_mul_epu32 gives the full 64-bit product. count % 16 == 0.
__attribute__((target("avx2"))) void draw_keys_avx2(uint64_t j0, int64_t count, uint64_t seed,
                                                    uint64_t offset, uint64_t* out) {
  const __m256i m0 = _mm256_set1_epi64x(kPhiloxM0), m1 = _mm256_set1_epi64x(kPhiloxM1);
  const __m256i low = _mm256_set1_epi64x(0xFFFFFFFFll);
  const __m256i lane = _mm256_set_epi64x(3, 2, 1, 0);
  const __m256i c2init = _mm256_set1_epi64x(static_cast<uint32_t>(offset));
  const __m256i c3init = _mm256_set1_epi64x(static_cast<uint32_t>(offset >> 32));
  for (int64_t i = 0; i < count; i += 16) {
    const int64_t p = static_cast<int64_t>((j0 + static_cast<uint64_t>(i)) >> 1);
    const __m256i pa = _mm256_add_epi64(_mm256_set1_epi64x(p), lane);
    const __m256i pb = _mm256_add_epi64(_mm256_set1_epi64x(p + 4), lane);
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
    alignas(32) uint64_t ke[8], ko[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(ke),
                       _mm256_or_si256(_mm256_slli_epi64(a0, 32), _mm256_and_si256(a1, low)));
    _mm256_store_si256(reinterpret_cast<__m256i*>(ke + 4),
                       _mm256_or_si256(_mm256_slli_epi64(b0, 32), _mm256_and_si256(b1, low)));
    _mm256_store_si256(reinterpret_cast<__m256i*>(ko),
                       _mm256_or_si256(_mm256_slli_epi64(a2, 32), _mm256_and_si256(a3, low)));
    _mm256_store_si256(reinterpret_cast<__m256i*>(ko + 4),
                       _mm256_or_si256(_mm256_slli_epi64(b2, 32), _mm256_and_si256(b3, low)));
    for (int l = 0; l < 8; ++l) {
      out[i + 2 * l] = ke[l];
      out[i + 2 * l + 1] = ko[l];
    }
  }
}

// The same with AVX-512F: 16 counters (pairs) per iteration in two 8-lane
// vectors. count % 32 == 0.
__attribute__((target("avx512f"))) void draw_keys_avx512(uint64_t j0, int64_t count,
                                                         uint64_t seed, uint64_t offset,
                                                         uint64_t* out) {
  const __m512i m0 = _mm512_set1_epi64(kPhiloxM0), m1 = _mm512_set1_epi64(kPhiloxM1);
  const __m512i low = _mm512_set1_epi64(0xFFFFFFFFll);
  const __m512i lane = _mm512_set_epi64(7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i c2init = _mm512_set1_epi64(static_cast<uint32_t>(offset));
  const __m512i c3init = _mm512_set1_epi64(static_cast<uint32_t>(offset >> 32));
  // Interleave even (first operand) and odd (second operand) keys of lanes 0-3 / 4-7.
  const __m512i lo_pairs = _mm512_set_epi64(11, 3, 10, 2, 9, 1, 8, 0);
  const __m512i hi_pairs = _mm512_set_epi64(15, 7, 14, 6, 13, 5, 12, 4);
  for (int64_t i = 0; i < count; i += 32) {
    const int64_t p = static_cast<int64_t>((j0 + static_cast<uint64_t>(i)) >> 1);
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
    _mm512_storeu_si512(out + i, _mm512_permutex2var_epi64(ea, lo_pairs, oa));
    _mm512_storeu_si512(out + i + 8, _mm512_permutex2var_epi64(ea, hi_pairs, oa));
    _mm512_storeu_si512(out + i + 16, _mm512_permutex2var_epi64(eb, lo_pairs, ob));
    _mm512_storeu_si512(out + i + 24, _mm512_permutex2var_epi64(eb, hi_pairs, ob));
  }
}
#endif

constexpr int64_t kDrawBatch = 256;  // draws per key batch: a multiple of 32

// Keys of draws [j0, j0 + kDrawBatch) into out.
void draw_keys(uint64_t j0, uint64_t seed, uint64_t offset, uint64_t* out) {
#if defined(__x86_64__)
  static const bool avx512 = __builtin_cpu_supports("avx512f");
  static const bool avx2 = __builtin_cpu_supports("avx2");
  if (avx512) return draw_keys_avx512(j0, kDrawBatch, seed, offset, out);
  if (avx2) return draw_keys_avx2(j0, kDrawBatch, seed, offset, out);
#endif
  draw_keys_scalar(j0, kDrawBatch, seed, offset, out);
}

// Calls take(d) with the draws d_0, d_1, ... of [0, a) until it returns true.
template <typename Take>
void for_each_draw(uint64_t a, uint64_t seed, uint64_t offset, Take&& take) {
  alignas(64) uint64_t keys[kDrawBatch];
  for (uint64_t j0 = 0;; j0 += kDrawBatch) {
    draw_keys(j0, seed, offset, keys);
    for (int64_t i = 0; i < kDrawBatch; ++i)
      if (take(scale_draw(keys[i], a))) return;
  }
}

// Maps ranks (non-excluded positions), visited in ascending order, to indices:
// rank r is index r + #{e : ex[e] - e <= r}.
struct RankToIndex {
  const int64_t* ex;
  int64_t ne, e = 0;
  int64_t operator()(int64_t r) {
    while (e < ne && ex[e] - e <= r) ++e;
    return r + e;
  }
};

// ceil(a / 64), without overflow for a near 2^63.
inline int64_t bitmap_words(int64_t a) { return a / 64 + (a % 64 != 0); }

// The first t distinct draws of [0, a) as a bitmap of ceil(a / 64) words.
std::vector<uint64_t> distinct_draws_bitmap(int64_t a, int64_t t, uint64_t seed,
                                            uint64_t offset) {
  std::vector<uint64_t> bits(static_cast<size_t>(bitmap_words(a)), 0);
  int64_t found = 0;
  for_each_draw(static_cast<uint64_t>(a), seed, offset, [&](uint64_t d) {
    uint64_t& w = bits[d >> 6];
    const uint64_t b = uint64_t(1) << (d & 63);
    if (!(w & b)) {
      w |= b;
      ++found;
    }
    return found == t;
  });
  return bits;
}

// The first t distinct draws of [0, a), ascending, via an open-addressing
// hash set (for t much smaller than a, where a bitmap would cost O(a)).
std::vector<int64_t> distinct_draws_sorted(int64_t a, int64_t t, uint64_t seed,
                                           uint64_t offset) {
  size_t cap = 16;
  while (cap < static_cast<size_t>(2 * t)) cap <<= 1;
  const uint64_t kEmpty = ~uint64_t(0);  // never a rank: a < 2^63
  std::vector<uint64_t> table(cap, kEmpty);
  std::vector<int64_t> kept;
  kept.reserve(static_cast<size_t>(t));
  for_each_draw(static_cast<uint64_t>(a), seed, offset, [&](uint64_t d) {
    for (size_t h = mix64(d) & (cap - 1);; h = (h + 1) & (cap - 1)) {
      if (table[h] == d) return false;
      if (table[h] == kEmpty) {
        table[h] = d;
        kept.push_back(static_cast<int64_t>(d));
        return static_cast<int64_t>(kept.size()) == t;
      }
    }
  });
  std::sort(kept.begin(), kept.end());
  return kept;
}

// Writes the m selected indices of [0, n) \ exclude, ascending, to out (+ base).
void explore_select(int64_t n, const int64_t* ex, int64_t ne, int64_t m, uint64_t seed,
                    uint64_t offset, int64_t base, int64_t* out) {
  if (m == 0) return;
  const int64_t a = n - ne;
  RankToIndex index{ex, ne};
  int64_t o = 0;
  if (m == a) {  // everything that is left, no randomness needed
    for (int64_t r = 0; r < a; ++r) out[o++] = base + index(r);
    return;
  }
  const bool complement = 2 * m > a;
  const int64_t t = complement ? a - m : m;
  const int64_t words = bitmap_words(a);
  // A bitmap when it is cheap against the sample: at most 16 words per drawn
  // rank and 1 GiB (the complement path has t < a / 2 <= m, so a bitmap of
  // a / 8 bytes is below the output's 8 m bytes); else a hash set of ~2t words.
  if (complement || (words <= 16 * t && words <= (int64_t(1) << 27))) {
    const std::vector<uint64_t> bits = distinct_draws_bitmap(a, t, seed, offset);
    for (int64_t w = 0; w < words; ++w) {
      uint64_t x = complement ? ~bits[w] : bits[w];
      if (w == words - 1 && (a & 63)) x &= (uint64_t(1) << (a & 63)) - 1;
      for (; x != 0; x &= x - 1) out[o++] = base + index(w * 64 + __builtin_ctzll(x));
    }
    return;
  }
  for (int64_t r : distinct_draws_sorted(a, t, seed, offset)) out[o++] = base + index(r);
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
  // Segment-local exclude lists (draws use segment-local ranks).
  std::vector<int64_t> local(pe, pe + ex.numel());
  for (int64_t s = 0; s < S; ++s)
    for (int64_t j = exclude_offsets[s]; j < exclude_offsets[s + 1]; ++j) local[j] -= offsets[s];
  const uint64_t useed = static_cast<uint64_t>(seed);
  // Segments are independent (one task each); little work runs inline.
  int64_t work = 0;
  for (int64_t s = 0; s < S; ++s) work += std::min(ms[s], offsets[s + 1] - offsets[s] - ms[s]);
  at::parallel_for(0, S, work >= (int64_t(1) << 15) ? 1 : std::max<int64_t>(S, 1), [&](int64_t s0, int64_t s1) {
    for (int64_t s = s0; s < s1; ++s)
      explore_select(offsets[s + 1] - offsets[s], local.data() + exclude_offsets[s],
                     exclude_offsets[s + 1] - exclude_offsets[s], ms[s], useed,
                     static_cast<uint64_t>(rng_offsets[s]), offsets[s], po + out_off[s]);
  });
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
