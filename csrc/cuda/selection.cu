// CUDA kernels of the selection ops: significance_topk and explore_sample,
// single-segment and segmented. Results are identical to the CPU kernels
// (csrc/cpu/selection.cpp): both select exactly the k (or m) smallest
// (key, index) pairs of a total order, so no implementation detail can change
// the set, and indices come out ascending.
//
// Keys. significance_topk ranks by rank_key (cuda_utils.cuh): the fp32 score's
// bit pattern inverted, NaN first, so "most significant" = smallest key and
// ties go to the lowest index. explore_sample ranks by the 64-bit Philox key
// of common.h (explore_key) over the non-excluded indices.
//
// Small segments (the usual case inside a DDP bucket) are done by one thread
// block each, all segments in one launch, with no host synchronisation:
// block_select_threshold finds the exact k-th key by 8-bit radix passes over
// the segment, block_emit_ordered writes the selection in index order.
//
// Large segments, device-wide, one after the other:
//  significance_topk
//   1. a Philox-free hashed sample of 32768 keys brackets the k-th key: the
//      threshold is the sample's (rank+1)-th best key, rank chosen so that at
//      least k keys pass with overwhelming probability;
//   2. ONE streaming pass (16-byte vector loads, fp32 scores) appends every
//      (key << 32 | index) at or below the threshold to a candidate buffer,
//      with one block-aggregated atomic per 4096 elements (the order of the
//      buffer is irrelevant: the next step sorts it by a total order);
//   3. the candidate count is read back (HOST SYNC: it sizes the sort and
//      decides on the fallback); the candidates are radix-sorted, the first
//      k are the answer, and their indices are sorted ascending;
//   4. fallback when the bracket missed (fewer than k, or more candidates than
//      the buffer holds, e.g. massive ties at the threshold): four device-wide
//      8-bit radix-select histogram passes find the exact k-th key and the
//      number of ties to take, then a tiled two-pass ordered compaction
//      (per-tile counts, prefix sums, ordered emission) writes the result
//      directly in index order. No host synchronisation in the fallback.
//  explore_sample
//   one pass computing Philox keys pair by pair and appending the (key, index)
//   of non-excluded indices below a limit chosen so that at least m pass with
//   overwhelming probability (HOST SYNC on the count, as above); if fewer pass
//   the limit is raised and the pass repeated, exactly as on the CPU. The
//   candidates are sorted by (key, index) and the first m kept.
//  The exclude list is validated on the device first (HOST SYNC: the error
//  must be raised before any output is produced).
#include "cuda_utils.cuh"

#include <torch/library.h>

#include <cuda/std/tuple>

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

// Appends (key << 32 | idx0 + i) for every i in [0, len) with key <= *thr_p.
// VEC elements per 16-byte load (VEC = 1: scalar loads, any alignment);
// len must be a multiple of VEC and w, g 16-byte aligned when VEC > 1.
template <typename T, int VEC>
__global__ void __launch_bounds__(kBlock)
    topk_compact_kernel(const T* __restrict__ w, const T* __restrict__ g, int64_t len,
                        int64_t idx0, int mode, const uint32_t* __restrict__ thr_p,
                        uint64_t* __restrict__ cand, unsigned long long* __restrict__ count,
                        int64_t cap) {
  constexpr int UNROLL = VEC >= 16 ? 1 : 16 / VEC;
  constexpr int64_t kTile = int64_t(kBlock) * UNROLL;
  struct alignas(sizeof(T) * VEC) V {
    T v[VEC];
  };
  using Scan = cub::BlockScan<int, kBlock>;
  __shared__ typename Scan::TempStorage scan;
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
    uint32_t key[UNROLL][VEC];
    int cnt = 0;
#pragma unroll
    for (int r = 0; r < UNROLL; ++r) {
      const bool ok = v0 + int64_t(r) * kBlock < nvec;
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        key[r][j] = ok ? rank_key(use_w ? static_cast<float>(a[r].v[j]) : 0.f,
                                  use_g ? static_cast<float>(b[r].v[j]) : 0.f, mode)
                       : 0u;
        cnt += (ok && key[r][j] <= thr) ? 1 : 0;
      }
    }
    int off, total;
    Scan(scan).ExclusiveSum(cnt, off, total);
    if (threadIdx.x == 0)
      s_base = total > 0 ? atomicAdd(count, static_cast<unsigned long long>(total)) : 0ull;
    __syncthreads();
    unsigned long long pos = s_base + static_cast<unsigned long long>(off);
#pragma unroll
    for (int r = 0; r < UNROLL; ++r) {
      const int64_t v = v0 + int64_t(r) * kBlock;
      const bool ok = v < nvec;
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        if (ok && key[r][j] <= thr) {
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

__global__ void low_words_kernel(const uint64_t* __restrict__ sorted, int64_t k,
                                 uint32_t* __restrict__ idx) {
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * kBlock + threadIdx.x; j < k;
       j += static_cast<int64_t>(gridDim.x) * kBlock)
    idx[j] = static_cast<uint32_t>(sorted[j]);
}

template <typename T>
__global__ void topk_write_kernel(const uint32_t* __restrict__ idx, int64_t k, int64_t lo,
                                  const T* __restrict__ g, int64_t* __restrict__ out_idx,
                                  T* __restrict__ out_val) {
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
                         uint64_t* cand, unsigned long long* count, int64_t cap) {
  constexpr int VEC = 16 / sizeof(T);
  cudaStream_t st = current_stream();
  auto scalar = [&](int64_t a, int64_t b) {
    if (b <= a) return;
    topk_compact_kernel<T, 1><<<grid_for(b - a, kBlock * 16), kBlock, 0, st>>>(
        w + a, g + a, b - a, a, mode, thr, cand, count, cap);
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
        w + head, g + head, body, head, mode, thr, cand, count, cap);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  scalar(head + body, n);
}

// ---- large segments: exact radix-select fallback --------------------------

// state[0] = key prefix found so far, state[1] = how many still to take.
__global__ void init_state_kernel(int64_t* state, int64_t k) {
  state[0] = 0;
  state[1] = k;
}

template <typename T>
__global__ void __launch_bounds__(kBlock)
    topk_hist_kernel(const T* __restrict__ w, const T* __restrict__ g, int64_t n, int mode,
                     const int64_t* __restrict__ state, int d,
                     unsigned long long* __restrict__ hist) {
  __shared__ unsigned int h[256];
  for (int b = threadIdx.x; b < 256; b += kBlock) h[b] = 0u;
  __syncthreads();
  const uint32_t prefix = static_cast<uint32_t>(state[0]);
  const uint32_t hi_mask = d + 8 >= 32 ? 0u : (~0u << (d + 8));
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kBlock + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * kBlock) {
    const uint32_t key = rank_key_at(w, g, i, mode);
    if ((key & hi_mask) == prefix) atomicAdd(&h[(key >> d) & 0xFFu], 1u);
  }
  __syncthreads();
  for (int b = threadIdx.x; b < 256; b += kBlock)
    if (h[b]) atomicAdd(&hist[b], static_cast<unsigned long long>(h[b]));
}

__global__ void pick_digit_kernel(const unsigned long long* __restrict__ hist,
                                  int64_t* __restrict__ state, int d) {
  if (threadIdx.x != 0) return;
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
                           int64_t* __restrict__ lt_cnt, int64_t* __restrict__ eq_cnt) {
  using Reduce = cub::BlockReduce<int, kBlock>;
  __shared__ typename Reduce::TempStorage red;
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
                          int64_t lo, int64_t* __restrict__ out_idx, T* __restrict__ out_val) {
  __shared__ typename cub::BlockScan<int, kBlock>::TempStorage scan;
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

// Exact top-k of one segment by device-wide radix select (no host sync).
template <typename T>
void topk_radix(const T* w, const T* g, int64_t n, int64_t k, int mode, int64_t lo,
                int64_t* out_idx, T* out_val, const at::Device& dev) {
  cudaStream_t st = current_stream();
  const auto i64 = at::TensorOptions().dtype(at::kLong).device(dev);
  at::Tensor state = at::empty({2}, i64);
  at::Tensor hist = at::zeros({4 * 256}, i64);
  int64_t* ps = state.data_ptr<int64_t>();
  auto* ph = reinterpret_cast<unsigned long long*>(hist.data_ptr<int64_t>());
  init_state_kernel<<<1, 1, 0, st>>>(ps, k);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const unsigned int grid = grid_for(n, kBlock * 16);
  for (int pass = 0; pass < 4; ++pass) {
    const int d = 24 - 8 * pass;
    topk_hist_kernel<T><<<grid, kBlock, 0, st>>>(w, g, n, mode, ps, d, ph + 256 * pass);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    pick_digit_kernel<<<1, 32, 0, st>>>(ph + 256 * pass, ps, d);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  const int64_t ntiles = (n + kTileItems - 1) / kTileItems;
  at::Tensor counts = at::empty({4, ntiles}, i64);
  int64_t* lt_cnt = counts[0].data_ptr<int64_t>();
  int64_t* eq_cnt = counts[1].data_ptr<int64_t>();
  int64_t* lt_pre = counts[2].data_ptr<int64_t>();
  int64_t* eq_pre = counts[3].data_ptr<int64_t>();
  const unsigned int tgrid = grid_for(ntiles, 1);
  topk_tile_count_kernel<T><<<tgrid, kBlock, 0, st>>>(w, g, n, mode, ps, ntiles, lt_cnt, eq_cnt);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  exclusive_sum(lt_cnt, lt_pre, ntiles, dev);
  exclusive_sum(eq_cnt, eq_pre, ntiles, dev);
  topk_tile_emit_kernel<T><<<tgrid, kBlock, 0, st>>>(w, g, n, mode, ps, ntiles, lt_cnt, eq_cnt,
                                                     lt_pre, eq_pre, lo, out_idx, out_val);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The bracket path; returns false (having written nothing) when it missed.
template <typename T>
bool topk_bracket(const T* w, const T* g, int64_t n, int64_t k, int64_t rank, int mode,
                  int64_t lo, int64_t* out_idx, T* out_val, const at::Device& dev) {
  cudaStream_t st = current_stream();
  const auto i64 = at::TensorOptions().dtype(at::kLong).device(dev);
  at::Tensor keys = at::empty({kSample}, i64.dtype(at::kInt));
  at::Tensor misc = at::zeros({2}, i64);  // [0] candidate count, [1] threshold
  auto* count = reinterpret_cast<unsigned long long*>(misc.data_ptr<int64_t>());
  auto* thr = reinterpret_cast<uint32_t*>(misc.data_ptr<int64_t>() + 1);
  auto* pkeys = reinterpret_cast<uint32_t*>(keys.data_ptr<int32_t>());
  topk_sample_kernel<T><<<kSample / kBlock, kBlock, 0, st>>>(w, g, n, mode, pkeys);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  topk_sample_select_kernel<<<1, 1024, 0, st>>>(pkeys, rank + 1, thr);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  // About n (rank+1)/kSample keys pass, with a relative spread of 1/sqrt(rank+1).
  const double expect = static_cast<double>(n) * (rank + 1) / kSample;
  const int64_t cap = std::min<int64_t>(
      n, static_cast<int64_t>(expect * (1.0 + 8.0 / std::sqrt(rank + 1.0))) + 1024);
  at::Tensor cand = at::empty({cap}, i64);
  auto* pcand = reinterpret_cast<uint64_t*>(cand.data_ptr<int64_t>());
  launch_topk_compact<T>(w, g, n, mode, thr, pcand, count, cap);
  // HOST SYNC: the candidate count sizes the sort below and decides on the fallback.
  const int64_t total = misc[0].item<int64_t>();
  if (total < k || total > cap) return false;
  at::Tensor sorted = at::empty({total}, i64);
  auto* psorted = reinterpret_cast<uint64_t*>(sorted.data_ptr<int64_t>());
  sort_keys<uint64_t>(pcand, psorted, total, 64, dev);
  at::Tensor idx = at::empty({2, k}, i64.dtype(at::kInt));
  auto* pidx = reinterpret_cast<uint32_t*>(idx[0].data_ptr<int32_t>());
  auto* pidx_sorted = reinterpret_cast<uint32_t*>(idx[1].data_ptr<int32_t>());
  const unsigned int grid = grid_for(k, kBlock);
  low_words_kernel<<<grid, kBlock, 0, st>>>(psorted, k, pidx);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  sort_keys<uint32_t>(pidx, pidx_sorted, k, bits_for(n), dev);
  topk_write_kernel<T><<<grid, kBlock, 0, st>>>(pidx_sorted, k, lo, g, out_idx, out_val);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return true;
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
    if (rank < kSample && topk_bracket<T>(w, g, n, k, rank, mode, lo, out_idx, out_val, dev))
      return;
  }
  topk_radix<T>(w, g, n, k, mode, lo, out_idx, out_val, dev);
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

// Writes every non-excluded index of [lo, lo + len) in order (m == what is left).
__device__ __forceinline__ void write_complement(int64_t i, int64_t lo, const int64_t* ex,
                                                 int64_t ne, int64_t* out) {
  const int64_t b = count_below(ex, ne, lo + i);
  if (b < ne && ex[b] == lo + i) return;
  out[i - b] = lo + i;
}

// Explore key of segment-local index i, exclusion looked up in a shared-memory
// bitmap of the segment (bit i set = excluded).
struct ExploreKeysBitmap {
  const uint32_t* excluded;
  uint64_t seed, offset;
  __device__ __forceinline__ bool operator()(int64_t i, uint64_t& key) const {
    if ((excluded[i >> 5] >> (i & 31)) & 1u) return false;
    key = explore_key(static_cast<uint64_t>(i), seed, offset);
    return true;
  }
};

// segs: [S, 7] int64 rows (lo, len, e0, e1, m, out, rng_offset) with 0 < m and
// len <= kExploreBlockSeg.
__global__ void __launch_bounds__(kSegBlock)
    explore_segments_kernel(const int64_t* __restrict__ segs, const int64_t* __restrict__ ex,
                            uint64_t seed, int64_t* __restrict__ out) {
  __shared__ SelectShared<uint64_t> sel;
  __shared__ typename cub::BlockScan<int, kSegBlock>::TempStorage scan;
  __shared__ uint32_t excluded[kExploreBlockSeg / 32];
  const int64_t* sd = segs + 7 * static_cast<int64_t>(blockIdx.x);
  const int64_t lo = sd[0], len = sd[1], e0 = sd[2], e1 = sd[3], m = sd[4];
  int64_t* o = out + sd[5];
  const int64_t ne = e1 - e0;
  const int64_t* sex = ex + e0;
  if (m == len - ne) {
    for (int64_t i = threadIdx.x; i < len; i += kSegBlock) write_complement(i, lo, sex, ne, o);
    return;
  }
  const int64_t words = (len + 31) / 32;
  for (int64_t j = threadIdx.x; j < words; j += kSegBlock) excluded[j] = 0u;
  __syncthreads();
  for (int64_t j = threadIdx.x; j < ne; j += kSegBlock) {
    const int64_t i = sex[j] - lo;  // validated: inside the segment
    atomicOr(&excluded[i >> 5], 1u << (i & 31));
  }
  __syncthreads();
  const ExploreKeysBitmap kf{excluded, seed, static_cast<uint64_t>(sd[6])};
  uint64_t thr;
  int64_t need;
  block_select_threshold<uint64_t, kSegBlock>(kf, len, m, sel, thr, need);
  block_emit_ordered<uint64_t, kSegBlock>(
      kf, 0, len, thr, need, 0, 0, m, [&](int64_t pos, int64_t i) { o[pos] = lo + i; }, scan);
}

__global__ void complement_kernel(int64_t n, int64_t lo, const int64_t* __restrict__ ex,
                                  int64_t ne, int64_t* __restrict__ out) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kBlock + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * kBlock)
    write_complement(i, lo, ex, ne, out);
}

struct ExCand {
  uint64_t key;
  uint32_t idx;
};

// (key, idx) lexicographic order for cub's radix sort.
struct ExCandDecomposer {
  __host__ __device__ ::cuda::std::tuple<uint64_t&, uint32_t&> operator()(ExCand& c) const {
    return {c.key, c.idx};
  }
};

// Appends (key, i) for every non-excluded i in [0, n) with key < limit, one
// Philox call per pair (2p, 2p + 1).
__global__ void __launch_bounds__(kBlock)
    explore_compact_kernel(int64_t n, int64_t lo, const int64_t* __restrict__ ex, int64_t ne,
                           uint64_t seed, uint64_t offset, uint64_t limit,
                           ExCand* __restrict__ cand, unsigned long long* __restrict__ count,
                           int64_t cap) {
  constexpr int UNROLL = 4;
  constexpr int64_t kTile = int64_t(kBlock) * UNROLL;
  using Scan = cub::BlockScan<int, kBlock>;
  __shared__ typename Scan::TempStorage scan;
  __shared__ unsigned long long s_base;
  const int64_t pairs = (n + 1) / 2;
  const int64_t tiles = (pairs + kTile - 1) / kTile;
  const uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  const uint32_t c2 = static_cast<uint32_t>(offset), c3 = static_cast<uint32_t>(offset >> 32);
  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    uint64_t key[UNROLL][2];
    bool hit[UNROLL][2];
    int cnt = 0;
#pragma unroll
    for (int r = 0; r < UNROLL; ++r) {
      const int64_t p = tile * kTile + int64_t(r) * kBlock + threadIdx.x;
      hit[r][0] = hit[r][1] = false;
      if (p < pairs) {
        const Philox4 o = philox4x32_10(static_cast<uint32_t>(p), static_cast<uint32_t>(p >> 32),
                                        c2, c3, k0, k1);
        key[r][0] = (static_cast<uint64_t>(o.x[0]) << 32) | o.x[1];
        key[r][1] = (static_cast<uint64_t>(o.x[2]) << 32) | o.x[3];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int64_t i = 2 * p + h;
          hit[r][h] = i < n && key[r][h] < limit && !(ne > 0 && sorted_contains(ex, ne, lo + i));
          cnt += hit[r][h] ? 1 : 0;
        }
      }
    }
    int off, total;
    Scan(scan).ExclusiveSum(cnt, off, total);
    if (threadIdx.x == 0)
      s_base = total > 0 ? atomicAdd(count, static_cast<unsigned long long>(total)) : 0ull;
    __syncthreads();
    unsigned long long pos = s_base + static_cast<unsigned long long>(off);
#pragma unroll
    for (int r = 0; r < UNROLL; ++r) {
      const int64_t p = tile * kTile + int64_t(r) * kBlock + threadIdx.x;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if (hit[r][h]) {
          if (pos < static_cast<unsigned long long>(cap))
            cand[pos] = ExCand{key[r][h], static_cast<uint32_t>(2 * p + h)};
          ++pos;
        }
      }
    }
    __syncthreads();
  }
}

__global__ void excand_idx_kernel(const ExCand* __restrict__ sorted, int64_t m,
                                  uint32_t* __restrict__ idx) {
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * kBlock + threadIdx.x; j < m;
       j += static_cast<int64_t>(gridDim.x) * kBlock)
    idx[j] = sorted[j].idx;
}

__global__ void write_indices_kernel(const uint32_t* __restrict__ idx, int64_t m, int64_t lo,
                                     int64_t* __restrict__ out) {
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * kBlock + threadIdx.x; j < m;
       j += static_cast<int64_t>(gridDim.x) * kBlock)
    out[j] = lo + idx[j];
}

// Explore sample of one large segment [lo, lo + n) with ne excluded (device
// pointer `ex`, buffer indices), 0 < m <= n - ne; writes m indices at out.
void explore_large(int64_t n, int64_t lo, const int64_t* ex, int64_t ne, int64_t m, uint64_t seed,
                   uint64_t offset, int64_t* out, const at::Device& dev) {
  cudaStream_t st = current_stream();
  const int64_t avail = n - ne;
  if (m == avail) {
    complement_kernel<<<grid_for(n, kBlock), kBlock, 0, st>>>(n, lo, ex, ne, out);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  const auto i64 = at::TensorOptions().dtype(at::kLong).device(dev);
  at::Tensor count_t = at::empty({1}, i64);
  auto* count = reinterpret_cast<unsigned long long*>(count_t.data_ptr<int64_t>());
  // Same limits as the CPU kernel (the result never depends on them: the m
  // smallest keys among the candidates are the m smallest overall).
  double q = (static_cast<double>(m) + 8.0 * std::sqrt(static_cast<double>(m)) + 64.0) /
             static_cast<double>(avail);
  at::Tensor cand;
  int64_t total = 0;
  for (;;) {
    const uint64_t limit = q >= 0.99 ? ~uint64_t(0) : static_cast<uint64_t>(std::ldexp(q, 64));
    const double expect = std::min(1.0, q) * static_cast<double>(n);
    int64_t cap = std::min<int64_t>(n, static_cast<int64_t>(expect + 8.0 * std::sqrt(expect)) + 1024);
    for (;;) {
      cand = at::empty({cap * static_cast<int64_t>(sizeof(ExCand))}, i64.dtype(at::kByte));
      count_t.zero_();
      const int64_t pairs = (n + 1) / 2;
      explore_compact_kernel<<<grid_for(pairs, kBlock * 4), kBlock, 0, st>>>(
          n, lo, ex, ne, seed, offset, limit, reinterpret_cast<ExCand*>(cand.data_ptr()), count,
          cap);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      // HOST SYNC: the candidate count sizes the buffer and the sort.
      total = count_t.item<int64_t>();
      if (total <= cap) break;
      cap = total;  // rerun the same (deterministic) pass with room for all
    }
    if (total >= m || q >= 0.99) break;
    q = std::min(1.0, q * 4.0);
  }
  TORCH_CHECK(total >= m, "slimcomm.explore_sample: internal error: only ", total,
              " candidates for m = ", m);
  at::Tensor sorted = at::empty({total * static_cast<int64_t>(sizeof(ExCand))}, i64.dtype(at::kByte));
  const ExCand* pc = reinterpret_cast<const ExCand*>(cand.data_ptr());
  ExCand* ps = reinterpret_cast<ExCand*>(sorted.data_ptr());
  size_t bytes = 0;
  C10_CUDA_CHECK(cub::DeviceRadixSort::SortKeys(nullptr, bytes, pc, ps, total, ExCandDecomposer{}, st));
  at::Tensor tmp = scratch_bytes(static_cast<int64_t>(bytes), dev);
  C10_CUDA_CHECK(
      cub::DeviceRadixSort::SortKeys(tmp.data_ptr(), bytes, pc, ps, total, ExCandDecomposer{}, st));
  at::Tensor idx = at::empty({2, m}, i64.dtype(at::kInt));
  auto* pidx = reinterpret_cast<uint32_t*>(idx[0].data_ptr<int32_t>());
  auto* pidx_sorted = reinterpret_cast<uint32_t*>(idx[1].data_ptr<int32_t>());
  const unsigned int grid = grid_for(m, kBlock);
  excand_idx_kernel<<<grid, kBlock, 0, st>>>(ps, m, pidx);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  sort_keys<uint32_t>(pidx, pidx_sorted, m, bits_for(n), dev);
  write_indices_kernel<<<grid, kBlock, 0, st>>>(pidx_sorted, m, lo, out);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
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

// Validates the exclude entries of every segment on the device; on a
// violation, redoes the check on the host for the CPU kernel's message.
// HOST SYNC: the error must be raised before any output is produced.
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
  if (bad.item<int64_t>() >= ne) return;
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
