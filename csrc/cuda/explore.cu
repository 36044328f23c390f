// CUDA kernels of explore_sample, single-segment and segmented, the same
// exactly defined sample as the CPU kernel (csrc/cpu/selection.cpp), indices
// ascending. Shared helpers and the host-sync rules: selection_common.cuh.
//
// explore_sample ("first distinct draws", O(m) work): with a = number of
// non-excluded indices and t = min(m, a - m), draw j is the rank
// floor(u_j * a / 2^64) with u_j the Philox key of j (common.h, explore_key);
// R = the first t distinct draws; the sample is R (m <= a / 2) or its
// complement in [0, a), ranks mapped to the non-excluded indices in order.
//
// Small segments (the usual case inside a DDP bucket): one thread block each,
// all segments in one launch, no host synchronisation: chunks of draws in j
// order against a shared-memory bitmap of R; duplicates inside a chunk are
// resolved by a block radix sort of (value, draw) keys (the lowest draw of a
// value counts) and new values are accepted in j order by a block scan until
// t are found; the bitmap is then read out in rank order.
//
// Large segments, device-wide, one after the other:
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
#include "selection_common.cuh"

#include <torch/library.h>

#include <cmath>

namespace slimcomm {
namespace cuda {
namespace {

constexpr int64_t kExploreBlockSeg = int64_t(1) << 15;  // up to this: one block per segment


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
  m.impl("explore_sample", &explore_sample_cuda);
  m.impl("explore_sample_segmented", &explore_sample_segmented_cuda);
}

}  // namespace cuda
}  // namespace slimcomm
