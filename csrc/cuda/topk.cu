// CUDA kernels of significance_topk, single-segment and segmented: the k
// smallest (rank_key, index) pairs, the same exactly defined set as the CPU
// kernel (csrc/cpu/selection.cpp), indices ascending. Shared helpers and the
// host-sync rules: selection_common.cuh.
//
// significance_topk selects the k smallest (rank_key, index) pairs: rank_key
// (cuda_utils.cuh) is the fp32 score's bit pattern inverted, NaN first, so
// "most significant" = smallest key and ties go to the lowest index.
//
//
// Small segments (the usual case inside a DDP bucket) are done by one thread
// block each, all segments in one launch, with no host synchronisation:
// block_select_threshold finds the exact k-th key by 8-bit radix passes over
// the segment, block_emit_ordered writes the selection in index order.
//
// Large segments, device-wide, one after the other:
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
#include "selection_common.cuh"

#include <torch/library.h>

#include <cmath>

namespace slimcomm {
namespace cuda {
namespace {

constexpr int64_t kTopkBlockSeg = int64_t(1) << 16;     // up to this: one block per segment
constexpr int kSample = 1 << 15;                        // threshold sample size
constexpr int64_t kTileItems = int64_t(kBlock) * 16;    // tile of the ordered fallback

template <typename Fn>
void dispatch_values(at::ScalarType st, Fn&& fn) {
  switch (st) {
    case at::kFloat: fn(static_cast<float*>(nullptr)); break;
    case at::kHalf: fn(static_cast<at::Half*>(nullptr)); break;
    case at::kBFloat16: fn(static_cast<at::BFloat16*>(nullptr)); break;
    default: TORCH_CHECK(false, "slimcomm: unsupported dtype ", st);
  }
}

// splitmix64: positions of the threshold sample (affects speed only, never results).
__host__ __device__ __forceinline__ uint64_t mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
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

}  // namespace

TORCH_LIBRARY_IMPL(slimcomm, CUDA, m) {
  m.impl("significance_topk", &significance_topk_cuda);
  m.impl("significance_topk_segmented", &significance_topk_segmented_cuda);
}

}  // namespace cuda
}  // namespace slimcomm
