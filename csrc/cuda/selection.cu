// CUDA kernels of the selection ops: significance_topk and explore_sample,
// single-segment and segmented. Results are identical to the CPU kernels
// (csrc/cpu/selection.cpp): both compute the same exactly defined set (no
// implementation detail can change it), and indices come out ascending.
//
// significance_topk selects the k smallest (rank_key, index) pairs: rank_key
// (cuda_utils.cuh) is the fp32 score's bit pattern inverted, NaN first, so
// "most significant" = smallest key and ties go to the lowest index.
//
// explore_sample ("first distinct draws", O(m) work): with a = number of
// non-excluded indices and t = min(m, a - m), draw j is the rank
// floor(u_j * a / 2^64) with u_j the Philox key of j (common.h, explore_key);
// R = the first t distinct draws; the sample is R (m <= a / 2) or its
// complement in [0, a), ranks mapped to the non-excluded indices in order.
//
// Small segments (the usual case inside a DDP bucket) are done by one thread
// block each, all segments in one launch, with no host synchronisation:
//  significance_topk: block_select_threshold finds the exact k-th key by 8-bit
//   radix passes over the segment, block_emit_ordered writes the selection in
//   index order;
//  explore_sample: chunks of draws in j order against a shared-memory bitmap
//   of R; duplicates inside a chunk are resolved by a block radix sort of
//   (value, draw) keys (the lowest draw of a value counts) and new values are
//   accepted in j order by a block scan until t are found; the bitmap is then
//   read out in rank order.
//
// Large segments, device-wide, one after the other:
//  significance_topk
//   1. a Philox-free hashed sample of 32768 keys brackets the k-th key: the
//      threshold is the sample's (rank+1)-th best key, rank chosen so that at
//      least k keys pass with overwhelming probability;
//   2. ONE streaming pass (16-byte vector loads, fp32 scores) appends every
//      (key << 32 | index) strictly below the threshold to a candidate buffer,
//      with one block-aggregated atomic per 4096 elements (the order of the
//      buffer is irrelevant: the next step sorts it by a total order), and
//      only COUNTS the keys equal to the threshold, per tile of 4096 indices
//      (so a degenerate distribution -- all-zero gradients or weights, a few
//      distinct values -- cannot fill the buffer: memory stays O(k));
//   3. the path is decided ON THE DEVICE (topk_decide_kernel, no host read):
//      the candidate buffer (its capacity, a worst case from n, k and the
//      sample rank, filled with an all-ones sentinel that sorts last) is
//      radix-sorted whole; with at least k candidates the first k are the
//      answer; otherwise the threshold is the k-th key and the answer is every
//      candidate plus the first k - candidates ties in index order, emitted
//      from the tiles that supply them (prefix sums of the tile counts; tiles
//      past the last needed tie return at once; with no tie needed the whole
//      grid returns at once); the k indices are then sorted ascending and
//      written unless the bracket missed;
//   4. fallback when the bracket missed (fewer than k candidates and ties, or
//      more candidates than the buffer holds): four device-wide
//      8-bit radix-select histogram passes find the exact k-th key and the
//      number of ties to take, then a tiled two-pass ordered compaction
//      (per-tile counts, prefix sums, ordered emission) writes the result
//      directly in index order. Its kernels are always launched, behind a
//      device-side gate (gate_open): when the bracket hit they return at once.
//  explore_sample
//   M draws (the expected count for t distinct values plus a margin) as keys
//   (d_j << 32 | j), radix-sorted; the first key of each value marks its first
//   draw; an inclusive scan of those marks in j order gives the number of
//   distinct values and the draw J at which the t-th appears; the first draws
//   up to J, compacted in sorted order, are R ascending; R (or its
//   complement) is mapped to indices by binary search. If the M draws hold
//   fewer than t distinct values (beyond 8 standard deviations), a device
//   flag switches to fallback kernels that continue the draw sequence on the
//   device (explore_fb_*, which otherwise return at once): no host read.
//  The exclude list is validated on the device first.
//
// Host syncs: none on the data path; all launches on the current stream,
// scratch from the caching allocator (no cudaMalloc / cudaFree /
// cudaDeviceSynchronize), small per-segment tables copied host-to-device from
// pinned memory without waiting. The one sync left is the validation of the
// exclude VALUES (check_exclude_cuda), one device-to-host read per call so that
// a bad entry raises the CPU kernel's error, naming the argument, before any
// output exists; SLIMCOMM_CUDA_CHECKS=device moves it onto the device (a trap,
// no sync; see cuda_utils.cuh).
#include "cuda_utils.cuh"

#include <torch/library.h>

#include <cmath>

namespace slimcomm {
namespace cuda {
namespace {

constexpr int kBlock = 256;
constexpr int kSegBlock = 512;  // threads of the one-block-per-segment kernels
constexpr int64_t kTopkBlockSeg = int64_t(1) << 16;     // up to this: one block per segment
constexpr int64_t kExploreBlockSeg = int64_t(1) << 15;  // same for explore_sample
constexpr int kSample = 1 << 15;                        // threshold sample size
constexpr int64_t kTileItems = int64_t(kBlock) * 16;    // tile of the ordered fallback
constexpr int64_t kIdx32 = int64_t(1) << 32;

template <typename Fn>
void dispatch_values(at::ScalarType st, Fn&& fn) {
  switch (st) {
    case at::kFloat: fn(static_cast<float*>(nullptr)); break;
    case at::kHalf: fn(static_cast<at::Half*>(nullptr)); break;
    case at::kBFloat16: fn(static_cast<at::BFloat16*>(nullptr)); break;
    default: TORCH_CHECK(false, "slimcomm: unsupported dtype ", st);
  }
}

// Tests only (tests/test_cuda_fallbacks.py): environment SLIMCOMM_CUDA_TEST_FALLBACKS=1,
// read once per process, shrinks the top-k candidate buffer to k / 2 and the
// explore draws to t / 2, so that the device-side fallbacks, otherwise beyond 8
// standard deviations, run; results must not change.
inline bool test_fallbacks() {
  static const bool on = [] {
    const char* v = std::getenv("SLIMCOMM_CUDA_TEST_FALLBACKS");
    return v != nullptr && std::string(v) == "1";
  }();
  return on;
}

// Number of bits needed to represent every value in [0, n).
inline int bits_for(int64_t n) {
  int b = 1;
  while (b < 63 && (int64_t(1) << b) < n) ++b;
  return b;
}

// splitmix64: positions of the threshold sample (affects speed only, never results).
__host__ __device__ __forceinline__ uint64_t mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

template <typename K>
void sort_keys(const K* in, K* out, int64_t n, int end_bit, const at::Device& dev) {
  if (n == 0) return;
  cudaStream_t st = current_stream();
  size_t bytes = 0;
  C10_CUDA_CHECK(cub::DeviceRadixSort::SortKeys(nullptr, bytes, in, out, n, 0, end_bit, st));
  at::Tensor tmp = scratch_bytes(static_cast<int64_t>(bytes), dev);
  C10_CUDA_CHECK(
      cub::DeviceRadixSort::SortKeys(tmp.data_ptr(), bytes, in, out, n, 0, end_bit, st));
}

void exclusive_sum(const int64_t* in, int64_t* out, int64_t n, const at::Device& dev) {
  cudaStream_t st = current_stream();
  size_t bytes = 0;
  C10_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(nullptr, bytes, in, out, n, st));
  at::Tensor tmp = scratch_bytes(static_cast<int64_t>(bytes), dev);
  C10_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(tmp.data_ptr(), bytes, in, out, n, st));
}

// ===========================================================================
// significance_topk
// ===========================================================================

template <typename T>
struct TopkKeys {
  const T* w;
  const T* g;
  int mode;
  __device__ __forceinline__ bool operator()(int64_t i, uint32_t& key) const {
    key = rank_key_at(w, g, i, mode);
    return true;
  }
};

// ---- small segments: one block each ---------------------------------------
// segs: [S, 4] int64 rows (lo, len, k, out) with 0 < k.
template <typename T>
__global__ void __launch_bounds__(kSegBlock)
    topk_segments_kernel(const T* __restrict__ w, const T* __restrict__ g, int mode,
                         const int64_t* __restrict__ segs, int64_t* __restrict__ out_idx,
                         T* __restrict__ out_val) {
  __shared__ SelectShared<uint32_t> sel;
  __shared__ typename cub::BlockScan<int, kSegBlock>::TempStorage scan;
  const int64_t* sd = segs + 4 * static_cast<int64_t>(blockIdx.x);
  const int64_t lo = sd[0], len = sd[1], k = sd[2], out = sd[3];
  int64_t* oi = out_idx + out;
  T* ov = out_val + out;
  const T* sg = g + lo;
  if (k >= len) {  // everything
    for (int64_t i = threadIdx.x; i < len; i += kSegBlock) {
      oi[i] = lo + i;
      ov[i] = sg[i];
    }
    return;
  }
  const TopkKeys<T> kf{w + lo, sg, mode};
  uint32_t thr;
  int64_t need;
  block_select_threshold<uint32_t, kSegBlock>(kf, len, k, sel, thr, need);
  block_emit_ordered<uint32_t, kSegBlock>(
      kf, 0, len, thr, need, 0, 0, k,
      [&](int64_t pos, int64_t i) {
        oi[pos] = lo + i;
        ov[pos] = sg[i];
      },
      scan);
}

// ---- large segments: sampled bracket + one streaming pass -----------------

template <typename T>
__global__ void __launch_bounds__(kBlock)
    topk_sample_kernel(const T* __restrict__ w, const T* __restrict__ g, int64_t n, int mode,
                       uint32_t* __restrict__ keys) {
  const int j = blockIdx.x * kBlock + threadIdx.x;
  if (j < kSample)
    keys[j] = rank_key_at(w, g, static_cast<int64_t>(mix64(j) % static_cast<uint64_t>(n)), mode);
}

// thr_out = the m-th smallest of the kSample sample keys.
__global__ void __launch_bounds__(1024)
    topk_sample_select_kernel(const uint32_t* __restrict__ keys, int64_t m,
                              uint32_t* __restrict__ thr_out) {
  __shared__ SelectShared<uint32_t> sel;
  auto kf = [keys](int64_t i, uint32_t& key) {
    key = keys[i];
    return true;
  };
  uint32_t thr;
  int64_t need;
  block_select_threshold<uint32_t, 1024>(kf, kSample, m, sel, thr, need);
  if (threadIdx.x == 0) *thr_out = thr;
}

// Appends (key << 32 | idx0 + i) for every i in [0, len) with key < *thr_p,
// and counts the keys == *thr_p: per tile of kTileItems segment indices
// (idx0 + i) / kTileItems in tie_cnt, and in all in *ties.
// VEC elements per 16-byte load (VEC = 1: scalar loads, any alignment);
// len must be a multiple of VEC and w, g 16-byte aligned when VEC > 1.
template <typename T, int VEC>
__global__ void __launch_bounds__(kBlock)
    topk_compact_kernel(const T* __restrict__ w, const T* __restrict__ g, int64_t len,
                        int64_t idx0, int mode, const uint32_t* __restrict__ thr_p,
                        uint64_t* __restrict__ cand, unsigned long long* __restrict__ count,
                        int64_t cap, unsigned long long* __restrict__ tie_cnt,
                        unsigned long long* __restrict__ ties) {
  constexpr int UNROLL = VEC >= 16 ? 1 : 16 / VEC;
  constexpr int64_t kTile = int64_t(kBlock) * UNROLL;  // vectors: kTile * VEC = kTileItems items
  static_assert(kTile * VEC == kTileItems, "a block tile spans at most two count tiles");
  struct alignas(sizeof(T) * VEC) V {
    T v[VEC];
  };
  using Scan = cub::BlockScan<int, kBlock>;
  using Reduce = cub::BlockReduce<int, kBlock>;
  __shared__ typename Scan::TempStorage scan;
  __shared__ typename Reduce::TempStorage red;
  __shared__ unsigned long long s_base;
  const uint32_t thr = *thr_p;
  const bool use_w = mode != static_cast<int>(ScoreMode::kGrad);
  const bool use_g = mode != static_cast<int>(ScoreMode::kWeight);
  const V* vw = reinterpret_cast<const V*>(w);
  const V* vg = reinterpret_cast<const V*>(g);
  const int64_t nvec = len / VEC;
  const int64_t tiles = (nvec + kTile - 1) / kTile;
  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const int64_t v0 = tile * kTile + threadIdx.x;
    V a[UNROLL], b[UNROLL];
#pragma unroll
    for (int r = 0; r < UNROLL; ++r) {
      const int64_t v = v0 + int64_t(r) * kBlock;
      if (v < nvec) {
        if (use_w) a[r] = vw[v];
        if (use_g) b[r] = vg[v];
      }
    }
    // The block tile's items lie in count tiles t0 and t0 + 1; ties are
    // counted as (in t0) + (in t0 + 1) << 16 (each at most kTileItems < 2^16).
    const int64_t first = idx0 + tile * kTile * VEC;
    const int64_t t0 = first / kTileItems, split = (t0 + 1) * kTileItems;
    uint32_t key[UNROLL][VEC];
    int cnt = 0, eq = 0;
#pragma unroll
    for (int r = 0; r < UNROLL; ++r) {
      const int64_t v = v0 + int64_t(r) * kBlock;
      const bool ok = v < nvec;
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        key[r][j] = ok ? rank_key(use_w ? static_cast<float>(a[r].v[j]) : 0.f,
                                  use_g ? static_cast<float>(b[r].v[j]) : 0.f, mode)
                       : 0u;
        cnt += (ok && key[r][j] < thr) ? 1 : 0;
        if (ok && key[r][j] == thr) eq += idx0 + v * VEC + j < split ? 1 : (1 << 16);
      }
    }
    int off, total;
    Scan(scan).ExclusiveSum(cnt, off, total);
    const int eq_sum = Reduce(red).Sum(eq);  // valid in thread 0
    if (threadIdx.x == 0) {
      s_base = total > 0 ? atomicAdd(count, static_cast<unsigned long long>(total)) : 0ull;
      const unsigned long long e0 = static_cast<unsigned int>(eq_sum) & 0xFFFFu;
      const unsigned long long e1 = static_cast<unsigned int>(eq_sum) >> 16;
      if (e0) atomicAdd(&tie_cnt[t0], e0);
      if (e1) atomicAdd(&tie_cnt[t0 + 1], e1);
      if (e0 + e1) atomicAdd(ties, e0 + e1);
    }
    __syncthreads();
    unsigned long long pos = s_base + static_cast<unsigned long long>(off);
#pragma unroll
    for (int r = 0; r < UNROLL; ++r) {
      const int64_t v = v0 + int64_t(r) * kBlock;
      const bool ok = v < nvec;
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        if (ok && key[r][j] < thr) {
          if (pos < static_cast<unsigned long long>(cap))
            cand[pos] = (static_cast<uint64_t>(key[r][j]) << 32) |
                        static_cast<uint32_t>(idx0 + v * VEC + j);
          ++pos;
        }
      }
    }
    __syncthreads();  // scan storage and s_base are reused by the next tile
  }
}

// The bracket path's decision, on the device. ctl[0] = 1 iff it missed (more
// candidates than the buffer holds, or fewer candidates and ties together than
// k): the radix fallback runs and the bracket writes nothing. Otherwise
// ctl[1] = min(total, k) candidates are taken from the sorted buffer and
// ctl[2] = max(0, k - total) ties after them (0 unless the threshold is the
// k-th key).
__global__ void topk_decide_kernel(const unsigned long long* __restrict__ count,
                                   const unsigned long long* __restrict__ ties, int64_t cap,
                                   int64_t k, int64_t* __restrict__ ctl) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  const unsigned long long total = *count, nties = *ties;
  const bool miss = total > static_cast<unsigned long long>(cap) ||
                    total + nties < static_cast<unsigned long long>(k);
  const int64_t tot = miss ? 0 : static_cast<int64_t>(total);  // <= cap when used
  ctl[0] = miss ? 1 : 0;
  ctl[1] = miss ? 0 : std::min<int64_t>(tot, k);
  ctl[2] = miss ? 0 : std::max<int64_t>(0, k - tot);
}

// idx[j] = the index (low word) of sorted[j] for j < ctl[1] (grid sized for k).
__global__ void low_words_kernel(const uint64_t* __restrict__ sorted,
                                 const int64_t* __restrict__ ctl, uint32_t* __restrict__ idx) {
  const int64_t take = ctl[1];
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * kBlock + threadIdx.x; j < take;
       j += static_cast<int64_t>(gridDim.x) * kBlock)
    idx[j] = static_cast<uint32_t>(sorted[j]);
}

// Final write of the bracket path, skipped (the fallback writes) when it missed.
template <typename T>
__global__ void topk_write_kernel(const uint32_t* __restrict__ idx, int64_t k, int64_t lo,
                                  const T* __restrict__ g, int64_t* __restrict__ out_idx,
                                  T* __restrict__ out_val, const int64_t* __restrict__ ctl) {
  if (ctl[0] != 0) return;  // uniform across the grid
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * kBlock + threadIdx.x; j < k;
       j += static_cast<int64_t>(gridDim.x) * kBlock) {
    const int64_t i = idx[j];
    out_idx[j] = lo + i;
    out_val[j] = g[i];
  }
}

// Launches the compaction over [0, n): a scalar head up to 16-byte alignment,
// the vectorised body, a scalar tail (all scalar if w and g are misaligned
// relative to each other).
template <typename T>
void launch_topk_compact(const T* w, const T* g, int64_t n, int mode, const uint32_t* thr,
                         uint64_t* cand, unsigned long long* count, int64_t cap,
                         unsigned long long* tie_cnt, unsigned long long* ties) {
  constexpr int VEC = 16 / sizeof(T);
  cudaStream_t st = current_stream();
  auto scalar = [&](int64_t a, int64_t b) {
    if (b <= a) return;
    topk_compact_kernel<T, 1><<<grid_for(b - a, kBlock * 16), kBlock, 0, st>>>(
        w + a, g + a, b - a, a, mode, thr, cand, count, cap, tie_cnt, ties);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  const uintptr_t aw = reinterpret_cast<uintptr_t>(w) % 16, ag = reinterpret_cast<uintptr_t>(g) % 16;
  const bool w_used = mode != static_cast<int>(ScoreMode::kGrad);
  const bool g_used = mode != static_cast<int>(ScoreMode::kWeight);
  const uintptr_t mis = w_used ? aw : ag;
  if ((w_used && g_used && aw != ag) || mis % sizeof(T) != 0) {
    scalar(0, n);
    return;
  }
  const int64_t head = std::min<int64_t>(n, static_cast<int64_t>((16 - mis) % 16 / sizeof(T)));
  const int64_t body = (n - head) / VEC * VEC;
  scalar(0, head);
  if (body > 0) {
    topk_compact_kernel<T, VEC><<<grid_for(body, kBlock * 16), kBlock, 0, st>>>(
        w + head, g + head, body, head, mode, thr, cand, count, cap, tie_cnt, ties);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  scalar(head + body, n);
}

// ---- large segments: exact radix-select fallback --------------------------

// The radix-select fallback runs behind a device-side gate: gate == nullptr
// (the host chose it from the arguments) or *gate != 0 (the bracket path
// missed, decided on the device by topk_decide_kernel). With the gate closed
// every kernel of the fallback returns at once (the tile counts are zeroed so
// that the scans between them read defined values), and nothing is written.
__device__ __forceinline__ bool gate_open(const int64_t* gate) {
  return gate == nullptr || *gate != 0;
}

// state[0] = key prefix found so far, state[1] = how many still to take.
__global__ void init_state_kernel(int64_t* state, int64_t k, const int64_t* gate) {
  if (!gate_open(gate)) return;
  state[0] = 0;
  state[1] = k;
}

template <typename T>
__global__ void __launch_bounds__(kBlock)
    topk_hist_kernel(const T* __restrict__ w, const T* __restrict__ g, int64_t n, int mode,
                     const int64_t* __restrict__ state, int d,
                     unsigned long long* __restrict__ hist, const int64_t* __restrict__ gate) {
  if (!gate_open(gate)) return;  // uniform across the grid
  __shared__ unsigned int h[256];
  for (int b = threadIdx.x; b < 256; b += kBlock) h[b] = 0u;
  __syncthreads();
  const uint32_t prefix = static_cast<uint32_t>(state[0]);
  const uint32_t hi_mask = d + 8 >= 32 ? 0u : (~0u << (d + 8));
  // Grid-stride with a block-uniform trip count, so whole warps aggregate
  // their increments (tied keys would serialise on one bin).
  for (int64_t i0 = static_cast<int64_t>(blockIdx.x) * kBlock; i0 < n;
       i0 += static_cast<int64_t>(gridDim.x) * kBlock) {
    const int64_t i = i0 + threadIdx.x;
    const uint32_t key = i < n ? rank_key_at(w, g, i, mode) : 0u;
    warp_hist_add(h, i < n && (key & hi_mask) == prefix, (key >> d) & 0xFFu);
  }
  __syncthreads();
  for (int b = threadIdx.x; b < 256; b += kBlock)
    if (h[b]) atomicAdd(&hist[b], static_cast<unsigned long long>(h[b]));
}

__global__ void pick_digit_kernel(const unsigned long long* __restrict__ hist,
                                  int64_t* __restrict__ state, int d,
                                  const int64_t* __restrict__ gate) {
  if (threadIdx.x != 0 || !gate_open(gate)) return;
  const int64_t rem = state[1];
  int64_t below = 0;
  int b = 0;
  for (; b < 255; ++b) {
    if (below + static_cast<int64_t>(hist[b]) >= rem) break;
    below += static_cast<int64_t>(hist[b]);
  }
  state[0] = static_cast<int64_t>(static_cast<uint32_t>(state[0]) | (static_cast<uint32_t>(b) << d));
  state[1] = rem - below;
}

// Per tile: number of keys < thr and == thr.
template <typename T>
__global__ void __launch_bounds__(kBlock)
    topk_tile_count_kernel(const T* __restrict__ w, const T* __restrict__ g, int64_t n, int mode,
                           const int64_t* __restrict__ state, int64_t ntiles,
                           int64_t* __restrict__ lt_cnt, int64_t* __restrict__ eq_cnt,
                           const int64_t* __restrict__ gate) {
  using Reduce = cub::BlockReduce<int, kBlock>;
  __shared__ typename Reduce::TempStorage red;
  if (!gate_open(gate)) {  // defined zeros for the scans that follow
    for (int64_t t = static_cast<int64_t>(blockIdx.x) * kBlock + threadIdx.x; t < ntiles;
         t += static_cast<int64_t>(gridDim.x) * kBlock)
      lt_cnt[t] = eq_cnt[t] = 0;
    return;
  }
  const uint32_t thr = static_cast<uint32_t>(state[0]);
  for (int64_t t = blockIdx.x; t < ntiles; t += gridDim.x) {
    int lt = 0, eq = 0;
    const int64_t end = std::min(n, (t + 1) * kTileItems);
    for (int64_t i = t * kTileItems + threadIdx.x; i < end; i += kBlock) {
      const uint32_t key = rank_key_at(w, g, i, mode);
      lt += key < thr;
      eq += key == thr;
    }
    const int lt_sum = Reduce(red).Sum(lt);
    __syncthreads();
    const int eq_sum = Reduce(red).Sum(eq);
    __syncthreads();
    if (threadIdx.x == 0) {
      lt_cnt[t] = lt_sum;
      eq_cnt[t] = eq_sum;
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kBlock)
    topk_tile_emit_kernel(const T* __restrict__ w, const T* __restrict__ g, int64_t n, int mode,
                          const int64_t* __restrict__ state, int64_t ntiles,
                          const int64_t* __restrict__ lt_cnt, const int64_t* __restrict__ eq_cnt,
                          const int64_t* __restrict__ lt_pre, const int64_t* __restrict__ eq_pre,
                          int64_t lo, int64_t* __restrict__ out_idx, T* __restrict__ out_val,
                          const int64_t* __restrict__ gate) {
  __shared__ typename cub::BlockScan<int, kBlock>::TempStorage scan;
  if (!gate_open(gate)) return;  // uniform across the grid
  const uint32_t thr = static_cast<uint32_t>(state[0]);
  const int64_t need = state[1];
  const TopkKeys<T> kf{w, g, mode};
  for (int64_t t = blockIdx.x; t < ntiles; t += gridDim.x) {
    const int64_t begin = t * kTileItems, end = std::min(n, begin + kTileItems);
    const int64_t out_before = lt_pre[t] + std::min(eq_pre[t], need);
    const int64_t out_end = lt_pre[t] + lt_cnt[t] + std::min(eq_pre[t] + eq_cnt[t], need);
    block_emit_ordered<uint32_t, kBlock>(
        kf, begin, end, thr, need, eq_pre[t], out_before, out_end,
        [&](int64_t pos, int64_t i) {
          out_idx[pos] = lo + i;
          out_val[pos] = g[i];
        },
        scan);
  }
}

// Exact top-k of one segment by device-wide radix select (no host sync),
// behind the device-side gate (see gate_open; nullptr: always).
template <typename T>
void topk_radix(const T* w, const T* g, int64_t n, int64_t k, int mode, int64_t lo,
                int64_t* out_idx, T* out_val, const at::Device& dev, const int64_t* gate) {
  cudaStream_t st = current_stream();
  const auto i64 = at::TensorOptions().dtype(at::kLong).device(dev);
  at::Tensor state = at::empty({2}, i64);
  at::Tensor hist = at::zeros({4 * 256}, i64);
  int64_t* ps = state.data_ptr<int64_t>();
  auto* ph = reinterpret_cast<unsigned long long*>(hist.data_ptr<int64_t>());
  init_state_kernel<<<1, 1, 0, st>>>(ps, k, gate);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const unsigned int grid = grid_for(n, kBlock * 16);
  for (int pass = 0; pass < 4; ++pass) {
    const int d = 24 - 8 * pass;
    topk_hist_kernel<T><<<grid, kBlock, 0, st>>>(w, g, n, mode, ps, d, ph + 256 * pass, gate);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    pick_digit_kernel<<<1, 32, 0, st>>>(ph + 256 * pass, ps, d, gate);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  const int64_t ntiles = (n + kTileItems - 1) / kTileItems;
  at::Tensor counts = at::empty({4, ntiles}, i64);
  int64_t* lt_cnt = counts[0].data_ptr<int64_t>();
  int64_t* eq_cnt = counts[1].data_ptr<int64_t>();
  int64_t* lt_pre = counts[2].data_ptr<int64_t>();
  int64_t* eq_pre = counts[3].data_ptr<int64_t>();
  const unsigned int tgrid = grid_for(ntiles, 1);
  topk_tile_count_kernel<T><<<tgrid, kBlock, 0, st>>>(w, g, n, mode, ps, ntiles, lt_cnt, eq_cnt,
                                                      gate);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  exclusive_sum(lt_cnt, lt_pre, ntiles, dev);
  exclusive_sum(eq_cnt, eq_pre, ntiles, dev);
  topk_tile_emit_kernel<T><<<tgrid, kBlock, 0, st>>>(w, g, n, mode, ps, ntiles, lt_cnt, eq_cnt,
                                                     lt_pre, eq_pre, lo, out_idx, out_val, gate);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Bracket path with the threshold as the k-th key: writes, to
// idx[ctl[1], ctl[1] + need) with need = ctl[2], the indices of the first
// `need` keys == *thr_p in index order (tile t holds tie_cnt[t] of them,
// tie_pre[t] before it). Tiles past the last needed tie return at once, so
// with need == 0 (the other paths) the whole grid returns at once.
template <typename T>
__global__ void __launch_bounds__(kBlock)
    topk_tie_emit_kernel(const T* __restrict__ w, const T* __restrict__ g, int64_t n, int mode,
                         const uint32_t* __restrict__ thr_p, int64_t ntiles,
                         const int64_t* __restrict__ tie_cnt, const int64_t* __restrict__ tie_pre,
                         const int64_t* __restrict__ ctl, uint32_t* __restrict__ idx_base) {
  __shared__ typename cub::BlockScan<int, kBlock>::TempStorage scan;
  const int64_t need = ctl[2];
  if (need == 0) return;  // uniform across the grid
  uint32_t* idx = idx_base + ctl[1];
  const uint32_t thr = *thr_p;
  // Only the ties take part (the keys below thr are already candidates).
  auto kf = [w, g, mode, thr](int64_t i, uint32_t& key) {
    key = rank_key_at(w, g, i, mode);
    return key == thr;
  };
  for (int64_t t = blockIdx.x; t < ntiles; t += gridDim.x) {
    const int64_t before = tie_pre[t];
    if (before >= need) continue;  // uniform across the block
    const int64_t begin = t * kTileItems, end = std::min(n, begin + kTileItems);
    block_emit_ordered<uint32_t, kBlock>(
        kf, begin, end, thr, need, before, before, std::min(before + tie_cnt[t], need),
        [&](int64_t pos, int64_t i) { idx[pos] = static_cast<uint32_t>(i); }, scan);
  }
}

// The bracket path, with no host sync: every size is a worst case known from
// the arguments, and the choice between its two endings and the radix
// fallback is made on the device (topk_decide_kernel). Returns the 3-entry
// control tensor; ctl[0] != 0 means it missed (nothing written) and the caller
// must run topk_radix gated on it.
template <typename T>
at::Tensor topk_bracket(const T* w, const T* g, int64_t n, int64_t k, int64_t rank, int mode,
                        int64_t lo, int64_t* out_idx, T* out_val, const at::Device& dev) {
  cudaStream_t st = current_stream();
  const auto i64 = at::TensorOptions().dtype(at::kLong).device(dev);
  at::Tensor keys = at::empty({kSample}, i64.dtype(at::kInt));
  // [0] candidate count, [1] threshold, [2] tie count, [3, 6) ctl, [6, 6 + ntiles) ties per tile.
  const int64_t ntiles = (n + kTileItems - 1) / kTileItems;
  at::Tensor misc = at::zeros({6 + ntiles}, i64);
  auto* count = reinterpret_cast<unsigned long long*>(misc.data_ptr<int64_t>());
  auto* thr = reinterpret_cast<uint32_t*>(misc.data_ptr<int64_t>() + 1);
  auto* ties = reinterpret_cast<unsigned long long*>(misc.data_ptr<int64_t>() + 2);
  int64_t* ctl = misc.data_ptr<int64_t>() + 3;
  auto* tie_cnt = reinterpret_cast<unsigned long long*>(misc.data_ptr<int64_t>() + 6);
  auto* pkeys = reinterpret_cast<uint32_t*>(keys.data_ptr<int32_t>());
  topk_sample_kernel<T><<<kSample / kBlock, kBlock, 0, st>>>(w, g, n, mode, pkeys);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  topk_sample_select_kernel<<<1, 1024, 0, st>>>(pkeys, rank + 1, thr);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  // About n (rank+1)/kSample keys pass, with a relative spread of 1/sqrt(rank+1).
  const double expect = static_cast<double>(n) * (rank + 1) / kSample;
  int64_t cap = std::min<int64_t>(
      n, static_cast<int64_t>(expect * (1.0 + 8.0 / std::sqrt(rank + 1.0))) + 1024);
  if (test_fallbacks()) cap = std::max<int64_t>(1, k / 2);  // tests: force the rare paths
  // Unused slots hold the all-ones sentinel, which sorts after every candidate
  // (a candidate's key is below the threshold, so its high word is < 2^32 - 1).
  at::Tensor cand = at::full({cap}, -1, i64);
  auto* pcand = reinterpret_cast<uint64_t*>(cand.data_ptr<int64_t>());
  launch_topk_compact<T>(w, g, n, mode, thr, pcand, count, cap, tie_cnt, ties);
  topk_decide_kernel<<<1, 1, 0, st>>>(count, ties, cap, k, ctl);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  // Sorted candidates, the whole buffer (the worst case): the first min(total, k)
  // are the best candidates in (key, index) order, sentinels follow.
  at::Tensor sorted = at::empty({cap}, i64);
  auto* psorted = reinterpret_cast<uint64_t*>(sorted.data_ptr<int64_t>());
  sort_keys<uint64_t>(pcand, psorted, cap, 64, dev);
  at::Tensor idx = at::empty({2, k}, i64.dtype(at::kInt));
  auto* pidx = reinterpret_cast<uint32_t*>(idx[0].data_ptr<int32_t>());
  auto* pidx_sorted = reinterpret_cast<uint32_t*>(idx[1].data_ptr<int32_t>());
  const unsigned int grid = grid_for(k, kBlock);
  low_words_kernel<<<grid, kBlock, 0, st>>>(psorted, ctl, pidx);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  // Threshold == the k-th key: the first ctl[2] ties in index order after them.
  const int64_t* cnt = misc.data_ptr<int64_t>() + 6;
  at::Tensor pre = at::empty({ntiles}, i64);
  exclusive_sum(cnt, pre.data_ptr<int64_t>(), ntiles, dev);
  topk_tie_emit_kernel<T><<<grid_for(ntiles, 1), kBlock, 0, st>>>(
      w, g, n, mode, thr, ntiles, cnt, pre.data_ptr<int64_t>(), ctl, pidx);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  // When it missed, idx holds undefined values: sorted anyway (harmless, a
  // rare path), and not written out.
  sort_keys<uint32_t>(pidx, pidx_sorted, k, bits_for(n), dev);
  topk_write_kernel<T><<<grid, kBlock, 0, st>>>(pidx_sorted, k, lo, g, out_idx, out_val, ctl);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return misc.slice(0, 3, 6);
}

// k == n: every index, in order.
template <typename T>
__global__ void topk_all_kernel(const T* __restrict__ g, int64_t n, int64_t lo,
                                int64_t* __restrict__ out_idx, T* __restrict__ out_val) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kBlock + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * kBlock) {
    out_idx[i] = lo + i;
    out_val[i] = g[i];
  }
}

// Top-k of one large segment w[0, n), 0 < k <= n; outputs at out_idx/out_val.
template <typename T>
void topk_large(const T* w, const T* g, int64_t n, int64_t k, int mode, int64_t lo,
                int64_t* out_idx, T* out_val, const at::Device& dev) {
  if (k == n) {
    topk_all_kernel<T><<<grid_for(n, kBlock), kBlock, 0, current_stream()>>>(g, n, lo, out_idx,
                                                                             out_val);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  if (n < kIdx32) {
    const double r = static_cast<double>(k) * kSample / static_cast<double>(n);
    const int64_t rank = static_cast<int64_t>(r + 6.0 * std::sqrt(r) + 32.0);
    if (rank < kSample) {
      const at::Tensor ctl = topk_bracket<T>(w, g, n, k, rank, mode, lo, out_idx, out_val, dev);
      // Runs only if the bracket missed (ctl[0] != 0, on the device).
      topk_radix<T>(w, g, n, k, mode, lo, out_idx, out_val, dev, ctl.data_ptr<int64_t>());
      return;
    }
  }
  topk_radix<T>(w, g, n, k, mode, lo, out_idx, out_val, dev, nullptr);
}

std::tuple<at::Tensor, at::Tensor> significance_topk_segmented_cuda(
    const at::Tensor& weight, const at::Tensor& grad, c10::IntArrayRef offsets,
    c10::IntArrayRef ks, c10::string_view score) {
  const char* op = "significance_topk_segmented";
  const int mode = static_cast<int>(check_topk_args(op, weight, grad, score));
  check_segments(op, offsets, "offsets", ks, "ks", weight.numel());
  c10::cuda::CUDAGuard guard(weight.device());
  const at::Device dev = weight.device();
  const int64_t S = static_cast<int64_t>(ks.size());
  std::vector<int64_t> out_off(S + 1, 0);
  for (int64_t s = 0; s < S; ++s) out_off[s + 1] = out_off[s] + ks[s];
  at::Tensor idx = at::empty({out_off[S]}, weight.options().dtype(at::kLong));
  at::Tensor val = at::empty({out_off[S]}, grad.options());
  if (out_off[S] == 0) return {idx, val};
  at::Tensor w = weight.contiguous(), g = grad.contiguous();
  std::vector<int64_t> small;  // rows (lo, len, k, out)
  std::vector<int64_t> large;
  for (int64_t s = 0; s < S; ++s) {
    if (ks[s] == 0) continue;
    const int64_t len = offsets[s + 1] - offsets[s];
    if (len <= kTopkBlockSeg) {
      small.insert(small.end(), {offsets[s], len, ks[s], out_off[s]});
    } else {
      large.push_back(s);
    }
  }
  dispatch_values(w.scalar_type(), [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* pw = w.data_ptr<T>();
    const T* pg = g.data_ptr<T>();
    int64_t* pi = idx.data_ptr<int64_t>();
    T* pv = val.data_ptr<T>();
    const int64_t ns = static_cast<int64_t>(small.size()) / 4;
    if (ns > 0) {
      at::Tensor segs = to_device_i64(small, dev);
      topk_segments_kernel<T><<<static_cast<unsigned int>(ns), kSegBlock, 0, current_stream()>>>(
          pw, pg, mode, segs.data_ptr<int64_t>(), pi, pv);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    for (int64_t s : large) {
      const int64_t lo = offsets[s];
      topk_large<T>(pw + lo, pg + lo, offsets[s + 1] - lo, ks[s], mode, lo, pi + out_off[s],
                    pv + out_off[s], dev);
    }
  });
  return {idx, val};
}

std::tuple<at::Tensor, at::Tensor> significance_topk_cuda(const at::Tensor& weight,
                                                          const at::Tensor& grad, int64_t k,
                                                          c10::string_view score) {
  const char* op = "significance_topk";
  check_topk_args(op, weight, grad, score);
  SLIMCOMM_CHECK(k >= 0 && k <= weight.numel(), op, "k", "must be in [0, numel(weight) = ",
                 weight.numel(), "], got ", k);
  const int64_t offsets[2] = {0, weight.numel()};
  const int64_t ks[1] = {k};
  return significance_topk_segmented_cuda(weight, grad, offsets, ks, score);
}

// ===========================================================================
// explore_sample
// ===========================================================================
// Definition (identical on every backend): a = n - len(exclude); m == a takes
// every non-excluded index. Otherwise comp = 2m > a, t = comp ? a - m : m, and
// draw j (j = 0, 1, ...) is the rank d_j = floor(u_j * a / 2^64) with u_j the
// 64-bit explore key of j (common.h). R = the first t distinct values of
// d_0, d_1, ...; the selected ranks are R (or [0, a) minus R when comp); rank
// r is the r-th non-excluded index of the segment.

constexpr int kExItems = 4;                     // draws per thread per chunk (even)
constexpr int kExChunk = kSegBlock * kExItems;  // draws per chunk of the block kernel (< 2^16)
// Invariants explore_segments_kernel relies on: draws come in Philox pairs
// starting at an even j; the draw-in-chunk fits the low 16 bits of a sort key;
// (a << 16) | draw-in-chunk, a <= kExploreBlockSeg, fits in 32 bits; the
// bitmap `taken` covers every rank.
static_assert(kExItems % 2 == 0, "kExItems must be even (one Philox call per draw pair)");
static_assert(kExChunk <= (1 << 16), "draw-in-chunk must fit in 16 bits");
static_assert(kExploreBlockSeg <= (int64_t(1) << 15), "(a << 16) must fit in a uint32 key");
static_assert(kExploreBlockSeg % 32 == 0, "the rank bitmap has kExploreBlockSeg / 32 words");

// Philox output of draw pair p = j >> 1: words (0,1) are draw 2p, words (2,3)
// draw 2p + 1, exactly as explore_key in common.h.
__device__ __forceinline__ Philox4 explore_pair(uint64_t p, uint64_t seed, uint64_t offset) {
  return philox4x32_10(static_cast<uint32_t>(p), static_cast<uint32_t>(p >> 32),
                       static_cast<uint32_t>(offset), static_cast<uint32_t>(offset >> 32),
                       static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
}

// floor(u * a / 2^64) for the even (h = 0) or odd (h = 1) draw of a pair; a < 2^32.
__device__ __forceinline__ uint32_t explore_rank(const Philox4& x, int h, uint64_t a) {
  const uint64_t u = h == 0 ? ((static_cast<uint64_t>(x.x[0]) << 32) | x.x[1])
                            : ((static_cast<uint64_t>(x.x[2]) << 32) | x.x[3]);
  return static_cast<uint32_t>(__umul64hi(u, a));
}

// Buffer index of rank r: the r-th (0-based) index of the segment starting at
// lo that is not in ex[0, ne) (the segment's ascending exclude list, buffer
// indices), i.e. lo + r + #{e : ex[e] - lo - e <= r} (non-decreasing in e).
__device__ __forceinline__ int64_t rank_to_index(int64_t r, int64_t lo, const int64_t* ex,
                                                 int64_t ne) {
  int64_t x = 0, y = ne;
  while (x < y) {
    const int64_t mid = (x + y) >> 1;
    if (ex[mid] - lo - mid <= r) x = mid + 1;
    else y = mid;
  }
  return lo + r + x;
}

// Writes every non-excluded index of [lo, lo + len) in order (m == what is left).
__device__ __forceinline__ void write_complement(int64_t i, int64_t lo, const int64_t* ex,
                                                 int64_t ne, int64_t* out) {
  const int64_t b = count_below(ex, ne, lo + i);
  if (b < ne && ex[b] == lo + i) return;
  out[i - b] = lo + i;
}

// ---- small segments: one block each ----------------------------------------
// segs: [S, 7] int64 rows (lo, len, e0, e1, m, out, rng_offset) with 0 < m and
// len <= kExploreBlockSeg; ex holds buffer indices.
//
// Draws are processed in chunks of kExChunk, in j order. Per chunk: each
// thread computes kExItems consecutive draws; a draw whose value is already in
// the shared bitmap `taken` is marked stale; the keys (value << 16 | draw in
// chunk) are block-radix-sorted, so the first key of each value is the value's
// lowest draw of the chunk; those draws are flagged new, the flags are
// block-scanned in j order and the first t - found new values are set in
// `taken`. Then `taken` (R) is read out rank by rank in order.
__global__ void __launch_bounds__(kSegBlock)
    explore_segments_kernel(const int64_t* __restrict__ segs, const int64_t* __restrict__ ex,
                            uint64_t seed, int64_t* __restrict__ out) {
  using Sort = cub::BlockRadixSort<uint32_t, kSegBlock, kExItems>;
  using Scan = cub::BlockScan<int, kSegBlock>;
  __shared__ union {
    typename Sort::TempStorage sort;
    uint32_t keys[kExChunk];  // the sorted keys of the chunk
  } sh;
  __shared__ typename Scan::TempStorage scan;
  __shared__ uint32_t taken[kExploreBlockSeg / 32];  // bit r: rank r is in R
  __shared__ uint8_t fresh[kExChunk];                // draw (in chunk) is a new value
  const int64_t* sd = segs + 7 * static_cast<int64_t>(blockIdx.x);
  const int64_t lo = sd[0], len = sd[1], e0 = sd[2], e1 = sd[3], m = sd[4];
  int64_t* o = out + sd[5];
  const uint64_t offset = static_cast<uint64_t>(sd[6]);
  const int64_t ne = e1 - e0;
  const int64_t* sex = ex + e0;
  const int64_t a = len - ne;
  if (m == a) {
    for (int64_t i = threadIdx.x; i < len; i += kSegBlock) write_complement(i, lo, sex, ne, o);
    return;
  }
  const bool comp = 2 * m > a;
  const int64_t t = comp ? a - m : m;  // 1 <= t <= a / 2
  const uint32_t ua = static_cast<uint32_t>(a);  // a <= 2^15
  // Keys are (v << 16) | draw-in-chunk with v = the rank or, for a stale
  // draw, a itself: all keys are below 2^end_bit.
  const int end_bit = 16 + (32 - __clz(static_cast<int>(ua)));
  const int l0 = static_cast<int>(threadIdx.x) * kExItems;  // this thread's first slot
  for (int64_t w = threadIdx.x; w < (a + 31) / 32; w += kSegBlock) taken[w] = 0u;
  __syncthreads();
  int64_t found = 0;  // |R| so far (the same in every thread)
  for (uint64_t j0 = 0; found < t; j0 += kExChunk) {
    uint32_t d[kExItems], key[kExItems];
#pragma unroll
    for (int k = 0; k < kExItems; k += 2) {
      const Philox4 x = explore_pair((j0 + static_cast<uint64_t>(l0 + k)) >> 1, seed, offset);
      d[k] = explore_rank(x, 0, ua);
      d[k + 1] = explore_rank(x, 1, ua);
    }
#pragma unroll
    for (int k = 0; k < kExItems; ++k) {
      const bool stale = (taken[d[k] >> 5] >> (d[k] & 31)) & 1u;
      key[k] = ((stale ? ua : d[k]) << 16) | static_cast<uint32_t>(l0 + k);
    }
    Sort(sh.sort).Sort(key, 0, end_bit);  // blocked: key[k] is sorted position l0 + k
    __syncthreads();                      // sort storage is reused as sh.keys
#pragma unroll
    for (int k = 0; k < kExItems; ++k) sh.keys[l0 + k] = key[k];
    __syncthreads();
#pragma unroll
    for (int k = 0; k < kExItems; ++k) {
      const int p = l0 + k;
      const uint32_t v = key[k] >> 16;
      fresh[key[k] & 0xFFFFu] = (v < ua && (p == 0 || (sh.keys[p - 1] >> 16) != v)) ? 1 : 0;
    }
    __syncthreads();
    bool is_new[kExItems];
    int cnt = 0;
#pragma unroll
    for (int k = 0; k < kExItems; ++k) {
      is_new[k] = fresh[l0 + k] != 0;
      cnt += is_new[k] ? 1 : 0;
    }
    int rank, total;
    Scan(scan).ExclusiveSum(cnt, rank, total);  // in j order
    const int64_t need = t - found;
#pragma unroll
    for (int k = 0; k < kExItems; ++k) {
      if (is_new[k]) {
        if (rank < need) atomicOr(&taken[d[k] >> 5], 1u << (d[k] & 31));  // distinct values
        ++rank;
      }
    }
    found += std::min<int64_t>(total, need);
    __syncthreads();  // taken, sh, fresh and scan are reused by the next chunk
  }
  // Output: ranks in R (or not in R when comp), ascending, mapped to indices.
  int64_t written = 0;
  for (int64_t base = 0; base < a; base += kExChunk) {
    bool sel[kExItems];
    int cnt = 0;
#pragma unroll
    for (int k = 0; k < kExItems; ++k) {
      const int64_t r = base + l0 + k;
      sel[k] = r < a && ((((taken[r >> 5] >> (r & 31)) & 1u) != 0u) != comp);
      cnt += sel[k] ? 1 : 0;
    }
    int pos, total;
    Scan(scan).ExclusiveSum(cnt, pos, total);
#pragma unroll
    for (int k = 0; k < kExItems; ++k)
      if (sel[k]) o[written + pos++] = rank_to_index(base + l0 + k, lo, sex, ne);
    written += total;
    __syncthreads();  // scan storage is reused
  }
}

// ---- large segments: device-wide, one segment at a time -------------------

__global__ void complement_kernel(int64_t n, int64_t lo, const int64_t* __restrict__ ex,
                                  int64_t ne, int64_t* __restrict__ out) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kBlock + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * kBlock)
    write_complement(i, lo, ex, ne, out);
}

// keys[j] = (d_j << 32) | j for j < M (a < 2^32, M <= 2^32).
__global__ void __launch_bounds__(kBlock)
    explore_draws_kernel(int64_t M, uint64_t a, uint64_t seed, uint64_t offset,
                         uint64_t* __restrict__ keys) {
  const int64_t pairs = (M + 1) / 2;
  for (int64_t p = static_cast<int64_t>(blockIdx.x) * kBlock + threadIdx.x; p < pairs;
       p += static_cast<int64_t>(gridDim.x) * kBlock) {
    const Philox4 x = explore_pair(static_cast<uint64_t>(p), seed, offset);
    const uint64_t j = 2 * static_cast<uint64_t>(p);
    keys[j] = (static_cast<uint64_t>(explore_rank(x, 0, a)) << 32) | j;
    if (static_cast<int64_t>(j) + 1 < M)
      keys[j + 1] = (static_cast<uint64_t>(explore_rank(x, 1, a)) << 32) | (j + 1);
  }
}

// sorted: the draw keys in ascending (d, j) order. flag[j] = 1 iff draw j is
// the first draw of its value.
__global__ void __launch_bounds__(kBlock)
    explore_first_kernel(const uint64_t* __restrict__ sorted, int64_t M,
                         uint32_t* __restrict__ flag) {
  for (int64_t p = static_cast<int64_t>(blockIdx.x) * kBlock + threadIdx.x; p < M;
       p += static_cast<int64_t>(gridDim.x) * kBlock) {
    const uint64_t key = sorted[p];
    flag[static_cast<uint32_t>(key)] = (p == 0 || (sorted[p - 1] >> 32) != (key >> 32)) ? 1u : 0u;
  }
}

// *cut = the draw at which the t-th distinct value appears (scan: inclusive
// sum of flag in j order, whose last entry is >= t). Exactly one j matches.
__global__ void __launch_bounds__(kBlock)
    explore_cut_kernel(const uint32_t* __restrict__ flag, const uint32_t* __restrict__ scan,
                       int64_t M, int64_t t, int64_t* __restrict__ cut) {
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * kBlock + threadIdx.x; j < M;
       j += static_cast<int64_t>(gridDim.x) * kBlock)
    if (flag[j] != 0u && static_cast<int64_t>(scan[j]) == t) *cut = j;
}

// keep[p] = 1 iff sorted[p] is the first draw of its value and comes no later
// than *cut: exactly the t values of R, in ascending order of value.
__global__ void __launch_bounds__(kBlock)
    explore_keep_kernel(const uint64_t* __restrict__ sorted, const uint32_t* __restrict__ flag,
                        int64_t M, const int64_t* __restrict__ cut, uint8_t* __restrict__ keep) {
  const int64_t J = *cut;
  for (int64_t p = static_cast<int64_t>(blockIdx.x) * kBlock + threadIdx.x; p < M;
       p += static_cast<int64_t>(gridDim.x) * kBlock) {
    const uint32_t j = static_cast<uint32_t>(sorted[p]);
    keep[p] = (flag[j] != 0u && static_cast<int64_t>(j) <= J) ? 1 : 0;
  }
}

// Non-complement output: R (keys, rank in the high word, ascending) mapped to indices.
__global__ void __launch_bounds__(kBlock)
    explore_out_kernel(const uint64_t* __restrict__ R, int64_t t, int64_t lo,
                       const int64_t* __restrict__ ex, int64_t ne, int64_t* __restrict__ out) {
  for (int64_t k = static_cast<int64_t>(blockIdx.x) * kBlock + threadIdx.x; k < t;
       k += static_cast<int64_t>(gridDim.x) * kBlock)
    out[k] = rank_to_index(static_cast<int64_t>(R[k] >> 32), lo, ex, ne);
}

// Complement output: every rank r in [0, a) not in R goes to position
// r - #{R < r}, mapped to its index.
__global__ void __launch_bounds__(kBlock)
    explore_out_comp_kernel(const uint64_t* __restrict__ R, int64_t t, int64_t a, int64_t lo,
                            const int64_t* __restrict__ ex, int64_t ne,
                            int64_t* __restrict__ out) {
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * kBlock + threadIdx.x; r < a;
       r += static_cast<int64_t>(gridDim.x) * kBlock) {
    int64_t x = 0, y = t;
    while (x < y) {
      const int64_t mid = (x + y) >> 1;
      if (static_cast<int64_t>(R[mid] >> 32) < r) x = mid + 1;
      else y = mid;
    }
    if (x < t && static_cast<int64_t>(R[x] >> 32) == r) continue;
    out[r - x] = rank_to_index(r, lo, ex, ne);
  }
}

// ---- large segments: the rare case of too few distinct values among the M draws
// (M is the expected count plus 8 standard deviations). Decided on the device:
// ctl[0] = the cut draw (-1 until explore_cut_kernel finds it), ctl[2] = 1 iff
// the M draws hold fewer than t distinct values. Then the normal path selects
// nothing (no draw is at the cut) and these kernels, which otherwise return at
// once, build R in a bitmap of the a ranks: every value of the M draws, then
// the draws j = M, M + 1, ... in order, one thread, each new value taken until
// t -- the same R, the first t distinct values of the sequence -- and write R
// ascending as keys (rank << 32), the form the output kernels read.
__global__ void explore_ctl_kernel(const uint32_t* __restrict__ scan, int64_t M, int64_t t,
                                   int64_t* __restrict__ ctl) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  ctl[0] = -1;
  ctl[2] = static_cast<int64_t>(scan[M - 1]) < t ? 1 : 0;
}

__global__ void explore_fb_zero_kernel(const int64_t* __restrict__ ctl, uint32_t* __restrict__ bits,
                                       int64_t words) {
  if (ctl[2] == 0) return;
  for (int64_t w = static_cast<int64_t>(blockIdx.x) * kBlock + threadIdx.x; w < words;
       w += static_cast<int64_t>(gridDim.x) * kBlock)
    bits[w] = 0u;
}

__global__ void explore_fb_mark_kernel(const int64_t* __restrict__ ctl,
                                       const uint64_t* __restrict__ sorted, int64_t M,
                                       uint32_t* __restrict__ bits) {
  if (ctl[2] == 0) return;
  for (int64_t p = static_cast<int64_t>(blockIdx.x) * kBlock + threadIdx.x; p < M;
       p += static_cast<int64_t>(gridDim.x) * kBlock) {
    const uint32_t v = static_cast<uint32_t>(sorted[p] >> 32);
    atomicOr(&bits[v >> 5], 1u << (v & 31u));
  }
}

// One thread: continues the draw sequence at j = M until t distinct values.
__global__ void explore_fb_extend_kernel(const int64_t* __restrict__ ctl,
                                         const uint32_t* __restrict__ scan, int64_t M, int64_t t,
                                         uint64_t a, uint64_t seed, uint64_t offset,
                                         uint32_t* __restrict__ bits) {
  if (ctl[2] == 0 || threadIdx.x != 0 || blockIdx.x != 0) return;
  int64_t found = static_cast<int64_t>(scan[M - 1]);
  for (uint64_t j = static_cast<uint64_t>(M); found < t; ++j) {
    const Philox4 x = explore_pair(j >> 1, seed, offset);
    const uint32_t d = explore_rank(x, static_cast<int>(j & 1u), a);
    const uint32_t bit = 1u << (d & 31u);
    if ((bits[d >> 5] & bit) == 0u) {
      bits[d >> 5] |= bit;
      ++found;
    }
  }
}

// One block: the t set bits of the bitmap, ascending, as keys rank << 32.
__global__ void __launch_bounds__(kBlock)
    explore_fb_emit_kernel(const int64_t* __restrict__ ctl, const uint32_t* __restrict__ bits,
                           int64_t words, uint64_t* __restrict__ R) {
  if (ctl[2] == 0) return;
  __shared__ typename cub::BlockScan<int, kBlock>::TempStorage scan;
  int64_t written = 0;
  for (int64_t base = 0; base < words; base += kBlock) {
    const int64_t w = base + threadIdx.x;
    const uint32_t word = w < words ? bits[w] : 0u;
    int pos, total;
    cub::BlockScan<int, kBlock>(scan).ExclusiveSum(__popc(word), pos, total);
    uint32_t rest = word;
    while (rest != 0u) {  // bits in ascending order
      const int b = __ffs(rest) - 1;
      rest &= rest - 1u;
      R[written + pos++] = static_cast<uint64_t>(w * 32 + b) << 32;
    }
    written += total;
    __syncthreads();  // scan storage is reused
  }
}

void inclusive_sum_u32(const uint32_t* in, uint32_t* out, int64_t n, const at::Device& dev) {
  cudaStream_t st = current_stream();
  size_t bytes = 0;
  C10_CUDA_CHECK(cub::DeviceScan::InclusiveSum(nullptr, bytes, in, out, n, st));
  at::Tensor tmp = scratch_bytes(static_cast<int64_t>(bytes), dev);
  C10_CUDA_CHECK(cub::DeviceScan::InclusiveSum(tmp.data_ptr(), bytes, in, out, n, st));
}

void select_flagged_u64(const uint64_t* in, const uint8_t* flags, uint64_t* out,
                        int64_t* num_selected, int64_t n, const at::Device& dev) {
  cudaStream_t st = current_stream();
  size_t bytes = 0;
  C10_CUDA_CHECK(cub::DeviceSelect::Flagged(nullptr, bytes, in, flags, out, num_selected, n, st));
  at::Tensor tmp = scratch_bytes(static_cast<int64_t>(bytes), dev);
  C10_CUDA_CHECK(
      cub::DeviceSelect::Flagged(tmp.data_ptr(), bytes, in, flags, out, num_selected, n, st));
}

// Explore sample of one large segment [lo, lo + n) with ne excluded (device
// pointer `ex`, buffer indices), 0 < m <= n - ne < 2^32; writes m indices at out.
void explore_large(int64_t n, int64_t lo, const int64_t* ex, int64_t ne, int64_t m, uint64_t seed,
                   uint64_t offset, int64_t* out, const at::Device& dev) {
  cudaStream_t st = current_stream();
  const int64_t a = n - ne;
  if (m == a) {
    complement_kernel<<<grid_for(n, kBlock), kBlock, 0, st>>>(n, lo, ex, ne, out);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  const bool comp = 2 * m > a;
  const int64_t t = comp ? a - m : m;  // 1 <= t <= a / 2
  // Draws: the expected number for t distinct values, a ln(a / (a - t)), plus
  // a margin of 8 standard deviations. Should they hold fewer than t distinct
  // values, the fallback kernels below continue the sequence on the device.
  // The result does not depend on M: the first t distinct values of the first
  // M draws are the first t distinct values of the sequence.
  const double expect = -static_cast<double>(a) * std::log1p(-static_cast<double>(t) / a);
  int64_t M = std::max<int64_t>(
      t, static_cast<int64_t>(std::ceil(expect + 8.0 * std::sqrt(expect) + 64.0)));
  M = std::min<int64_t>(M, kIdx32);  // draw numbers fit in the low 32 bits of a key
  if (test_fallbacks()) M = std::max<int64_t>(1, t / 2);  // tests: force the fallback
  const auto i64 = at::TensorOptions().dtype(at::kLong).device(dev);
  at::Tensor keys = at::empty({M}, i64);
  at::Tensor sorted = at::empty({M}, i64);
  at::Tensor flags = at::empty({2, M}, i64.dtype(at::kInt));
  auto* pk = reinterpret_cast<uint64_t*>(keys.data_ptr<int64_t>());
  auto* ps = reinterpret_cast<uint64_t*>(sorted.data_ptr<int64_t>());
  uint32_t* flag = reinterpret_cast<uint32_t*>(flags.data_ptr<int32_t>());  // [M] first draws
  uint32_t* scan = flag + M;  // [M] inclusive sum of flag, in j order
  explore_draws_kernel<<<grid_for((M + 1) / 2, kBlock), kBlock, 0, st>>>(
      M, static_cast<uint64_t>(a), seed, offset, pk);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  sort_keys<uint64_t>(pk, ps, M, 32 + bits_for(a), dev);
  explore_first_kernel<<<grid_for(M, kBlock), kBlock, 0, st>>>(ps, M, flag);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  inclusive_sum_u32(flag, scan, M, dev);
  // [0] the cut draw, [1] number selected by the normal path, [2] fallback flag.
  at::Tensor misc = at::empty({3}, i64);
  int64_t* pmisc = misc.data_ptr<int64_t>();
  explore_ctl_kernel<<<1, 1, 0, st>>>(scan, M, t, pmisc);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const unsigned int grid = grid_for(M, kBlock);
  explore_cut_kernel<<<grid, kBlock, 0, st>>>(flag, scan, M, t, pmisc);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  // The unsorted keys are no longer needed: their storage holds the keep flags.
  // With the cut at -1 (fallback) no draw is kept and nothing is selected.
  auto* keep = reinterpret_cast<uint8_t*>(pk);
  explore_keep_kernel<<<grid, kBlock, 0, st>>>(ps, flag, M, pmisc, keep);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  at::Tensor r_keys = at::empty({t}, i64);
  auto* pr = reinterpret_cast<uint64_t*>(r_keys.data_ptr<int64_t>());
  select_flagged_u64(ps, keep, pr, pmisc + 1, M, dev);
  // The fallback (returns at once unless pmisc[2]): a bitmap of a bits, scratch
  // from the caching allocator, touched only then.
  const int64_t words = (a + 31) / 32;
  at::Tensor bitmap = at::empty({words}, i64.dtype(at::kInt));
  auto* pbits = reinterpret_cast<uint32_t*>(bitmap.data_ptr<int32_t>());
  explore_fb_zero_kernel<<<grid_for(words, kBlock), kBlock, 0, st>>>(pmisc, pbits, words);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  explore_fb_mark_kernel<<<grid, kBlock, 0, st>>>(pmisc, ps, M, pbits);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  explore_fb_extend_kernel<<<1, 1, 0, st>>>(pmisc, scan, M, t, static_cast<uint64_t>(a), seed,
                                            offset, pbits);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  explore_fb_emit_kernel<<<1, kBlock, 0, st>>>(pmisc, pbits, words, pr);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (comp) {
    explore_out_comp_kernel<<<grid_for(a, kBlock), kBlock, 0, st>>>(pr, t, a, lo, ex, ne, out);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  } else {
    explore_out_kernel<<<grid_for(t, kBlock), kBlock, 0, st>>>(pr, t, lo, ex, ne, out);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

// bounds: [offsets (S + 1), exclude_offsets (S + 1)]. bad <- the smallest j
// whose exclude entry is outside its segment or not above its predecessor.
__global__ void check_exclude_kernel(const int64_t* __restrict__ ex, int64_t ne_total,
                                     const int64_t* __restrict__ bounds, int64_t S,
                                     unsigned long long* __restrict__ bad) {
  const int64_t* offs = bounds;
  const int64_t* eoff = bounds + S + 1;
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * kBlock + threadIdx.x; j < ne_total;
       j += static_cast<int64_t>(gridDim.x) * kBlock) {
    // s = the last segment with eoff[s] <= j (then eoff[s + 1] > j).
    int64_t a = 0, b = S + 1;
    while (a < b) {
      const int64_t mid = (a + b) >> 1;
      if (eoff[mid] <= j) a = mid + 1;
      else b = mid;
    }
    const int64_t s = a - 1;
    const int64_t v = ex[j];
    const bool ok = v >= offs[s] && v < offs[s + 1] && (j == eoff[s] || v > ex[j - 1]);
    if (!ok) atomicMin(bad, static_cast<unsigned long long>(j));
  }
}

// The CPU's per-segment exclude check, for the error message.
void check_exclude_host(const char* op, const int64_t* ex, int64_t ne, int64_t lo, int64_t hi,
                        int64_t seg) {
  for (int64_t j = 0; j < ne; ++j) {
    SLIMCOMM_CHECK(ex[j] >= lo && ex[j] < hi, op, "exclude", "has index ", ex[j], " outside [",
                   lo, ", ", hi, ")", seg >= 0 ? " (segment " : "",
                   seg >= 0 ? std::to_string(seg) : std::string(), seg >= 0 ? ")" : "");
    SLIMCOMM_CHECK(j == 0 || ex[j] > ex[j - 1], op, "exclude",
                   "must be sorted ascending without duplicates, but entry ", j, " (", ex[j],
                   ") follows ", ex[j - 1]);
  }
}

// CheckMode::kDevice: stops the stream (device trap) when the check found a bad entry.
__global__ void exclude_trap_kernel(const unsigned long long* __restrict__ bad, int64_t ne) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  if (*bad < static_cast<unsigned long long>(ne)) {
    printf("slimcomm.explore_sample: argument 'exclude' is invalid at entry %llu (outside its "
           "segment, unsorted or duplicated; SLIMCOMM_CUDA_CHECKS=device)\n", *bad);
    __trap();
  }
}

// Validates the exclude entries of every segment on the device; on a
// violation, redoes the check on the host for the CPU kernel's message.
// HOST SYNC (CheckMode::kHost, the default): the error must be raised before
// any output is produced. CheckMode::kDevice: no sync, a trap (cuda_utils.cuh).
void check_exclude_cuda(const char* op, const at::Tensor& ex, c10::IntArrayRef offsets,
                        c10::IntArrayRef exclude_offsets, bool single) {
  const int64_t ne = ex.numel();
  if (ne == 0) return;
  const int64_t S = static_cast<int64_t>(offsets.size()) - 1;
  std::vector<int64_t> bounds(offsets.begin(), offsets.end());
  bounds.insert(bounds.end(), exclude_offsets.begin(), exclude_offsets.end());
  at::Tensor dbounds = to_device_i64(bounds, ex.device());
  at::Tensor bad = at::full({1}, ne, ex.options());
  check_exclude_kernel<<<grid_for(ne, kBlock), kBlock, 0, current_stream()>>>(
      ex.data_ptr<int64_t>(), ne, dbounds.data_ptr<int64_t>(), S,
      reinterpret_cast<unsigned long long*>(bad.data_ptr<int64_t>()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (check_mode() == CheckMode::kDevice) {
    exclude_trap_kernel<<<1, 1, 0, current_stream()>>>(
        reinterpret_cast<const unsigned long long*>(bad.data_ptr<int64_t>()), ne);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  if (bad.item<int64_t>() >= ne) return;  // HOST SYNC (see above)
  const at::Tensor h = ex.cpu();
  const int64_t* p = h.data_ptr<int64_t>();
  for (int64_t s = 0; s < S; ++s)
    check_exclude_host(op, p + exclude_offsets[s], exclude_offsets[s + 1] - exclude_offsets[s],
                       offsets[s], offsets[s + 1], single ? -1 : s);
  TORCH_CHECK(false, "slimcomm.", op, ": argument 'exclude' is invalid");
}

// Explore sample after validation.
at::Tensor explore_impl(c10::IntArrayRef offsets, const at::Tensor& ex,
                        c10::IntArrayRef exclude_offsets, c10::IntArrayRef ms, int64_t seed,
                        c10::IntArrayRef rng_offsets) {
  const char* op = "explore_sample";
  const at::Device dev = ex.device();
  const int64_t S = static_cast<int64_t>(ms.size());
  std::vector<int64_t> out_off(S + 1, 0);
  for (int64_t s = 0; s < S; ++s) out_off[s + 1] = out_off[s] + ms[s];
  at::Tensor out = at::empty({out_off[S]}, ex.options());
  if (out_off[S] == 0) return out;
  std::vector<int64_t> small, large;
  for (int64_t s = 0; s < S; ++s) {
    if (ms[s] == 0) continue;
    const int64_t len = offsets[s + 1] - offsets[s];
    SLIMCOMM_CHECK(len < kIdx32, op, "n", "is ", len,
                   ": the CUDA kernel samples from ranges of fewer than 2^32 indices");
    if (len <= kExploreBlockSeg) {
      small.insert(small.end(), {offsets[s], len, exclude_offsets[s], exclude_offsets[s + 1],
                                 ms[s], out_off[s], rng_offsets[s]});
    } else {
      large.push_back(s);
    }
  }
  const int64_t* pe = ex.data_ptr<int64_t>();
  int64_t* po = out.data_ptr<int64_t>();
  const uint64_t useed = static_cast<uint64_t>(seed);
  const int64_t ns = static_cast<int64_t>(small.size()) / 7;
  if (ns > 0) {
    at::Tensor segs = to_device_i64(small, dev);
    explore_segments_kernel<<<static_cast<unsigned int>(ns), kSegBlock, 0, current_stream()>>>(
        segs.data_ptr<int64_t>(), pe, useed, po);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  for (int64_t s : large) {
    const int64_t e0 = exclude_offsets[s];
    explore_large(offsets[s + 1] - offsets[s], offsets[s], pe + e0, exclude_offsets[s + 1] - e0,
                  ms[s], useed, static_cast<uint64_t>(rng_offsets[s]), po + out_off[s], dev);
  }
  return out;
}

at::Tensor explore_sample_segmented_cuda(c10::IntArrayRef offsets, const at::Tensor& exclude,
                                         c10::IntArrayRef exclude_offsets, c10::IntArrayRef ms,
                                         int64_t seed, c10::IntArrayRef rng_offsets) {
  const char* op = "explore_sample_segmented";
  check_explore_lists(op, offsets, exclude, exclude_offsets, ms, rng_offsets);
  c10::cuda::CUDAGuard guard(exclude.device());
  at::Tensor ex = exclude.contiguous();
  check_exclude_cuda(op, ex, offsets, exclude_offsets, false);
  return explore_impl(offsets, ex, exclude_offsets, ms, seed, rng_offsets);
}

at::Tensor explore_sample_cuda(int64_t n, const at::Tensor& exclude, int64_t m, int64_t seed,
                               int64_t offset) {
  const char* op = "explore_sample";
  SLIMCOMM_CHECK(n >= 0, op, "n", "must be >= 0, got ", n);
  SLIMCOMM_CHECK(m >= 0, op, "m", "must be >= 0, got ", m);
  check_index_tensor(op, "exclude", exclude);
  c10::cuda::CUDAGuard guard(exclude.device());
  at::Tensor ex = exclude.contiguous();
  const int64_t offsets[2] = {0, n};
  const int64_t ex_offsets[2] = {0, ex.numel()};
  check_exclude_cuda(op, ex, offsets, ex_offsets, true);
  SLIMCOMM_CHECK(m <= n - ex.numel(), op, "m", "is ", m, " but only n - len(exclude) = ",
                 n - ex.numel(), " indices are left");
  const int64_t ms[1] = {m};
  const int64_t rng[1] = {offset};
  return explore_impl(offsets, ex, ex_offsets, ms, seed, rng);
}

}  // namespace

TORCH_LIBRARY_IMPL(slimcomm, CUDA, m) {
  m.impl("significance_topk", &significance_topk_cuda);
  m.impl("significance_topk_segmented", &significance_topk_segmented_cuda);
  m.impl("explore_sample", &explore_sample_cuda);
  m.impl("explore_sample_segmented", &explore_sample_segmented_cuda);
}

}  // namespace cuda
}  // namespace slimcomm
