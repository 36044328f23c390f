"""slimcomm.ops (CPU kernels) against the slimcomm.reference oracle.

Index sets must match the reference exactly; values are gathered, so they
must match bit for bit (NaN-aware). Covers odd sizes, every dtype, k/m at the
edges, ties, zeros, NaN/inf, segmented layouts and non-contiguous inputs.
Argument errors live in test_ops_errors.py, property tests in
test_ops_properties.py, opcheck/torch.compile in test_ops_compile.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from slimcomm import ops, reference as ref

from _ops_cases import (
    DTYPES, PATTERNS, SCORES, SIZES, TIED_KINDS, assert_bit_equal, assert_equal_nan, counts_for, ks_for,
    make_exclude, make_layout, make_pair, make_tied, tie_ks,
)

LARGE = 2**20 + 3


def _topk_cases():
    """(n, pattern, k, score, dtype). At 2^20+3 the reference takes ~1 s per
    call, so there (product, float32) runs every pattern at k = 0, 1, 1%, n-1,
    n, and every other (score, dtype) runs the sampled-threshold path (k = 1%)
    and the histogram path (k = n-1) on random and NaN/inf data; the smaller
    sizes run every combination."""
    for n in SIZES:
        for pattern in PATTERNS:
            for k in ks_for(n):
                for score in SCORES:
                    for dtype in DTYPES:
                        if n == LARGE:
                            if (score, dtype) == ("product", torch.float32):
                                if k == n // 3:
                                    continue
                            elif k not in (n // 100, n - 1) or pattern not in ("random", "nonfinite"):
                                continue
                        yield pytest.param(n, pattern, k, score, dtype,
                                           id=f"{n}-{pattern}-k{k}-{score}-{str(dtype)[6:]}")


# ---------------------------------------------------------------------------
# significance_topk
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("n,pattern,k,score,dtype", list(_topk_cases()))
def test_significance_topk_matches_reference(n, pattern, k, score, dtype):
    w, g = make_pair(n, dtype, pattern)
    idx, val = ops.significance_topk(w, g, k, score)
    ridx, rval = ref.significance_topk(w, g, k, score)
    assert idx.dtype == torch.int64 and idx.shape == (k,)
    assert torch.equal(idx, ridx), "selected index set differs from the reference"
    assert_bit_equal(val, rval, "values")
    if k > 1:
        assert bool((idx[1:] > idx[:-1]).all()), "indices not strictly ascending"


def test_significance_topk_nan_and_inf_rank_first():
    # NaN ranks above +inf, +inf above every finite score; ties -> lowest index.
    w = torch.tensor([1.0, 2.0, 0.0, 3.0, float("inf"), 5.0, float("nan"), 4.0])
    g = torch.tensor([1.0, 1.0, float("inf"), 1.0, 1.0, 1.0, 1.0, float("-inf")])
    # product scores: 1, 2, NaN (0*inf), 3, inf, 5, NaN, inf
    idx, val = ops.significance_topk(w, g, 2)
    assert idx.tolist() == [2, 6]
    idx, _ = ops.significance_topk(w, g, 3)
    assert idx.tolist() == [2, 4, 6]          # first inf (index 4) beats the later one (7)
    idx, _ = ops.significance_topk(w, g, 5)
    assert idx.tolist() == [2, 4, 5, 6, 7]


def test_significance_topk_ties_go_to_lowest_index():
    w = torch.ones(100_000)
    g = torch.ones(100_000)
    idx, _ = ops.significance_topk(w, g, 1234)
    assert torch.equal(idx, torch.arange(1234))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("score", SCORES)
@pytest.mark.parametrize("layout_seed", range(4))
def test_significance_topk_segmented_equals_per_segment(layout_seed, score, dtype):
    rng = np.random.default_rng(layout_seed)
    offsets, total = make_layout(rng, 12)
    ks = counts_for(rng, offsets)
    pattern = PATTERNS[layout_seed % len(PATTERNS)]
    w, g = make_pair(total, dtype, pattern, seed=layout_seed)
    idx, val = ops.significance_topk_segmented(w, g, offsets, ks, score)
    assert idx.shape == (sum(ks),)
    pos = 0
    for s, k in enumerate(ks):
        lo, hi = offsets[s], offsets[s + 1]
        si, sv = ops.significance_topk(w[lo:hi], g[lo:hi], k, score)
        assert torch.equal(idx[pos:pos + k], si + lo), f"segment {s} differs from the single op"
        assert_bit_equal(val[pos:pos + k], sv, f"segment {s} values")
        pos += k
    ridx, rval = ref.significance_topk_segmented(w, g, offsets, ks, score)
    assert torch.equal(idx, ridx)
    assert_bit_equal(val, rval)


def test_significance_topk_segmented_no_segments():
    w = torch.randn(10)
    idx, val = ops.significance_topk_segmented(w, w, [3], [])
    assert idx.shape == (0,) and val.shape == (0,) and idx.dtype == torch.int64


def test_significance_topk_mlp_bucket_layout():
    # A DDP bucket of an MLP 784-512-512-10: weights and biases back to back.
    shapes = [(512, 784), (512,), (512, 512), (512,), (10, 512), (10,)]
    sizes = [int(np.prod(s)) for s in shapes]
    offsets = np.concatenate([[0], np.cumsum(sizes)]).tolist()
    ks = [max(1, n // 100) for n in sizes]
    w, g = make_pair(offsets[-1], torch.float32, "random", seed=3)
    idx, val = ops.significance_topk_segmented(w, g, offsets, ks)
    ridx, rval = ref.significance_topk_segmented(w, g, offsets, ks)
    assert torch.equal(idx, ridx)
    assert_bit_equal(val, rval)


# ---------------------------------------------------------------------------
# significance_topk on tied scores (zero-initialised layers, zero gradients,
# few distinct values): exact, and bounded in memory like random data
# ---------------------------------------------------------------------------

TIED_N = 300_007  # above the one-shot size and 4 * 2^16, so 4 threads make 4 chunks


@pytest.fixture(params=[1, 4], ids=lambda t: f"{t}thr")
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def _check_topk(w, g, k, score):
    idx, val = ops.significance_topk(w, g, k, score)
    ridx, rval = ref.significance_topk(w, g, k, score)
    assert idx.shape == (k,)
    assert torch.equal(idx, ridx), f"k={k}: selected index set differs from the reference"
    assert_bit_equal(val, rval, f"k={k} values")


def _tied_cases():
    for kind in TIED_KINDS:
        scores = SCORES if kind in ("zero_grad", "zero_weight") else ["product"]
        for score in scores:
            yield pytest.param(kind, score, id=f"{kind}-{score}")


@pytest.mark.parametrize("kind,score", list(_tied_cases()))
def test_significance_topk_tied_matches_reference(kind, score, threads):
    # Every k around every large tie group: the k-th key above the group, at
    # its first, middle and last member, and below it.
    w, g = make_tied(TIED_N, kind)
    for k in tie_ks(w, g, score):
        _check_topk(w, g, k, score)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("kind", ["zero_grad", "levels", "spread_top"])
def test_significance_topk_tied_half_dtypes(kind, dtype):
    w, g = make_tied(TIED_N, kind, dtype)
    for k in (1, TIED_N // 100, TIED_N // 3, TIED_N - 5):
        _check_topk(w, g, k, "product")


def _mix64(x: int) -> int:
    """splitmix64, as the CPU kernel uses to place its threshold sample."""
    m = (1 << 64) - 1
    x = (x + 0x9E3779B97F4A7C15) & m
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
    return x ^ (x >> 31)


@pytest.mark.parametrize("sampled", ["top_tie", "bottom"])
def test_significance_topk_misleading_sample_is_still_exact(sampled, threads):
    # Data built against the kernel's sample positions: "top_tie" puts one tied
    # top value exactly there (the bracket misses for k above their count),
    # "bottom" puts zeros there (the bracket sits far too low). The result must
    # not depend on the sample.
    n = TIED_N
    pos = torch.tensor(sorted({_mix64(j) % n for j in range(1 << 15)}))
    rng = np.random.default_rng(5)
    g = torch.from_numpy(rng.random(n) + 1.0).float()
    g[pos] = 3.0 if sampled == "top_tie" else 0.0
    w = torch.ones(n)
    for k in (1000, pos.numel() - 1, pos.numel(), pos.numel() + 1, 50_000, n // 3):
        _check_topk(w, g, k, "product")


@pytest.mark.parametrize("score", SCORES)
def test_significance_topk_segmented_tied_bucket(score, threads):
    # A bucket of a partly zero-initialised model: a zero-gradient weight, a
    # zero weight (LoRA B), zero biases, a few-level segment, sparse gradients,
    # small segments; each k on or around a tie boundary of its segment.
    parts, ks = [], []
    rng = np.random.default_rng(11)
    for kind, n in (("zero_grad", 200_003), ("all_zero", 300), ("zero_weight", 131_075),
                    ("levels", 100_001), ("sparse", 70_001), ("all_zero", 5), ("spread_top", 40_000),
                    ("levels", 999)):
        w, g = make_tied(n, kind, seed=len(parts))
        parts.append((w, g))
        cands = tie_ks(w, g, score) if n > 1 else [1]
        ks.append(int(rng.choice(cands)))
    w = torch.cat([p[0] for p in parts])
    g = torch.cat([p[1] for p in parts])
    offsets = [0]
    for p in parts:
        offsets.append(offsets[-1] + p[0].numel())
    idx, val = ops.significance_topk_segmented(w, g, offsets, ks, score)
    ridx, rval = ref.significance_topk_segmented(w, g, offsets, ks, score)
    assert torch.equal(idx, ridx)
    assert_bit_equal(val, rval)
    pos = 0
    for s, k in enumerate(ks):
        lo, hi = offsets[s], offsets[s + 1]
        si, _ = ops.significance_topk(w[lo:hi], g[lo:hi], k, score)
        assert torch.equal(idx[pos:pos + k], si + lo), f"segment {s} differs from the single op"
        pos += k


_PEAK_SCRIPT = r"""
import sys, torch
from slimcomm import ops
n, k, kind = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
g = torch.Generator().manual_seed(0)
w = torch.randn(n, generator=g)
gr = torch.randn(n, generator=g)
if kind == "zero_grad":
    gr.zero_()
elif kind == "zero_weight":
    w.zero_()
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak-RSS mark to the current RSS
base = rss()
ops.significance_topk(w, gr, k)
with open("/proc/self/status") as f:  # VmHWM: ru_maxrss keeps the forked parent's peak
    hwm = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM:"))
print(hwm - base)
"""


def _peak_bytes(n, k, kind):
    import os
    import subprocess
    import sys
    env = dict(os.environ, OMP_NUM_THREADS="2")
    out = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, str(n), str(k), kind], env=env,
                         capture_output=True, text=True, timeout=300, check=True)
    return int(out.stdout.split()[-1])


def test_significance_topk_tied_memory_is_bounded_like_random():
    # The peak memory (RSS above the inputs) of one call on an all-zero
    # gradient or weight stays within 1.5x of random data's (it was ~36 bytes
    # per element: every element a candidate).
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pytest.skip("needs Linux /proc/self/clear_refs to measure the peak RSS")
    n, k = 4_000_000, 40_000
    rand = _peak_bytes(n, k, "random")
    for kind in ("zero_grad", "zero_weight"):
        tied = _peak_bytes(n, k, kind)
        assert tied <= 1.5 * rand + (2 << 20), (
            f"{kind}: peak {tied / n:.2f} B/element vs random {rand / n:.2f} B/element")


# ---------------------------------------------------------------------------
# explore_sample
# ---------------------------------------------------------------------------

def _explore_cases():
    for n in SIZES:
        for kind in ("none", "random", "prefix", "all_but_one"):
            if n < 2 and kind != "none":
                continue
            avail = n - make_exclude(n, kind).numel()
            for m in sorted({m for m in (0, 1, avail // 100, avail // 2, avail - 1, avail)
                             if 0 <= m <= avail}):
                yield n, kind, m


_SEEDS = [(0, 0), (12345, 7), (-1, 2**63 - 1), (2**40 + 3, -5)]


@pytest.mark.parametrize("n,kind,m,seed,offset", [
    (n, kind, m, seed, offset)
    for n, kind, m in _explore_cases()
    for seed, offset in (_SEEDS[::2] if n == LARGE else _SEEDS)  # large: two seeds suffice
])
def test_explore_sample_matches_reference(n, kind, m, seed, offset):
    ex = make_exclude(n, kind)
    out = ops.explore_sample(n, ex, m, seed, offset)
    expect = ref.explore_sample(n, ex, m, seed, offset)
    assert out.dtype == torch.int64 and out.shape == (m,)
    assert torch.equal(out, expect)


def test_explore_keys_match_reference_philox():
    # Known-answer check of the Philox4x32-10 implementation in the oracle
    # (Random123 kat_vectors: philox4x32_10, counter = key = 0 and all-ones).
    zero = ref.philox4x32_10(np.zeros((1, 4), dtype=np.uint32), (0, 0))[0]
    assert [int(x) for x in zero] == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    ones = ref.philox4x32_10(np.full((1, 4), 0xFFFFFFFF, dtype=np.uint32), (0xFFFFFFFF, 0xFFFFFFFF))[0]
    assert [int(x) for x in ones] == [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]


def _explore_by_definition(n, exclude, m, seed, offset):
    """ops.explore_sample's definition, one draw at a time in plain Python
    (independent of the vectorised reference)."""
    ex = [int(e) for e in exclude]
    allowed = [i for i in range(n) if i not in set(ex)] if n < 10**6 else None
    a = n - len(ex)
    complement = 2 * m > a
    t = a - m if complement else m
    kept, j, seen = [], 0, set()
    while len(kept) < t:
        p = j >> 1
        ctr = np.array([[p & 0xFFFFFFFF, p >> 32, offset & 0xFFFFFFFF, (offset >> 32) & 0xFFFFFFFF]],
                       dtype=np.uint32)
        w = [int(x) for x in ref.philox4x32_10(ctr, (seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF))[0]]
        key = (w[0] << 32 | w[1]) if j % 2 == 0 else (w[2] << 32 | w[3])
        d = (key * a) >> 64
        if d not in seen:
            seen.add(d)
            kept.append(d)
        j += 1
    ranks = sorted(set(range(a)) - seen) if complement else sorted(kept)
    if allowed is not None:
        return [allowed[r] for r in ranks]
    out = []
    for r in ranks:  # r-th non-excluded index
        i = r
        for e in ex:
            if e <= i:
                i += 1
        out.append(i)
    return out


@pytest.mark.parametrize("n,ex,m,seed,offset", [
    (1, [], 1, 0, 0), (2, [], 1, 3, 4), (10, [2, 3, 9], 3, 7, 1), (10, [2, 3, 9], 4, 7, 1),
    (10, [2, 3, 9], 6, 2**64 - 1, 2**63), (300, [0, 1, 150, 299], 29, 11, 12),
    (300, list(range(0, 300, 3)), 150, 5, 6), (1000, [], 999, 1, 1),
    (2**33 + 5, [0, 7, 2**32, 2**33], 6, 3, 9),  # hash-set path, ranks past 2^32
    (2**63 - 1, [], 3, 12345, 2**64 - 7),  # largest n: no overflow in the bitmap size
    (2**63 - 1, [5, 2**62], 2, 1, 2),
])
def test_explore_sample_follows_its_definition(n, ex, m, seed, offset):
    exclude = torch.tensor(ex, dtype=torch.int64)
    out = ops.explore_sample(n, exclude, m, seed, offset)
    assert out.tolist() == _explore_by_definition(n, ex, m, seed, offset)


@pytest.mark.parametrize("m", [63, 64, 65, 640])
def test_explore_sample_bitmap_and_hash_paths_agree_with_reference(m):
    # The kernel switches from a bitmap to a hash set when the sample is tiny
    # against the range; the result must not depend on the path.
    n = 1024 * 64 + 17  # 1025 bitmap words: m <= 64 takes the hash set, m >= 65 the bitmap
    ex = torch.empty(0, dtype=torch.int64)
    assert torch.equal(ops.explore_sample(n, ex, m, 4, 5), ref.explore_sample(n, ex, m, 4, 5))


@pytest.mark.parametrize("layout_seed", range(5))
def test_explore_sample_segmented_equals_per_segment(layout_seed):
    rng = np.random.default_rng(100 + layout_seed)
    offsets, _ = make_layout(rng, 12)
    S = len(offsets) - 1
    ex_parts, ex_off = [], [0]
    for s in range(S):
        n_s = offsets[s + 1] - offsets[s]
        kind = ["none", "random", "prefix", "all_but_one"][int(rng.integers(4))] if n_s >= 2 else "none"
        e = make_exclude(n_s, kind, seed=s) + offsets[s]
        ex_parts.append(e)
        ex_off.append(ex_off[-1] + e.numel())
    exclude = torch.cat(ex_parts) if ex_parts else torch.empty(0, dtype=torch.int64)
    avail = [(offsets[s + 1] - offsets[s]) - (ex_off[s + 1] - ex_off[s]) for s in range(S)]
    ms = counts_for(rng, offsets, avail)
    seed = int(rng.integers(0, 2**62))
    rng_offsets = [int(x) for x in rng.integers(0, 2**40, S)]
    out = ops.explore_sample_segmented(offsets, exclude, ex_off, ms, seed, rng_offsets)
    assert out.shape == (sum(ms),)
    pos = 0
    for s, m in enumerate(ms):
        lo, hi = offsets[s], offsets[s + 1]
        local_ex = exclude[ex_off[s]:ex_off[s + 1]] - lo
        single = ops.explore_sample(hi - lo, local_ex, m, seed, rng_offsets[s])
        assert torch.equal(out[pos:pos + m], single + lo), f"segment {s} differs from the single op"
        pos += m
    assert torch.equal(out, ref.explore_sample_segmented(offsets, exclude, ex_off, ms, seed, rng_offsets))


# ---------------------------------------------------------------------------
# pack / unpack
# ---------------------------------------------------------------------------

def _index_sets(n, seed=0):
    rng = np.random.default_rng(seed + n)
    sets = {"empty": np.empty(0, dtype=np.int64)}
    if n:
        sets["all"] = np.arange(n)
        sets["one"] = np.array([n - 1])
        sets["random_unsorted"] = rng.choice(n, size=max(1, n // 3), replace=False)
        sets["random_sorted"] = np.sort(rng.choice(n, size=max(1, n - 1), replace=False))
    return {k: torch.from_numpy(v.astype(np.int64)) for k, v in sets.items()}


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("n", SIZES)
def test_pack_unpack_match_reference(n, dtype):
    src, other = make_pair(n, dtype, "nonfinite", seed=5)
    for name, idx in _index_sets(n).items():
        out = ops.pack(src, idx)
        assert_bit_equal(out, ref.pack(src, idx), f"pack {name}")
        for accumulate in (False, True):
            dst, rdst = other.clone(), other.clone()
            ops.unpack(dst, idx, out, accumulate)
            ref.unpack(rdst, idx, out, accumulate)
            check = assert_equal_nan if accumulate else assert_bit_equal
            check(dst, rdst, f"unpack {name} accumulate={accumulate}")


# ---------------------------------------------------------------------------
# gather_slices / scatter_slices and the multi-tensor forms
# ---------------------------------------------------------------------------

def _slice_specs(R, C, seed=0):
    rng = np.random.default_rng(seed + R * 31 + C)
    t = lambda a: torch.from_numpy(np.asarray(a, dtype=np.int64))  # noqa: E731
    specs = [(None, None), (t([]), None), (None, t([]))]
    if R:
        specs += [(t(rng.permutation(R)[: max(1, R // 2)]), None), (t([R - 1]), None)]
    if C:
        specs += [(None, t(rng.permutation(C)[: max(1, C // 3)]))]
    if R and C:
        specs += [(t(rng.permutation(R)[: max(1, R // 2)]), t(np.sort(rng.permutation(C)[: max(1, C - 1)])))]
    return specs


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("shape", [(0, 0), (1, 1), (2, 7), (7, 2), (300, 1000), (1030, 1025)])
def test_gather_scatter_slices_match_reference(shape, dtype):
    R, C = shape
    w, _ = make_pair(R * C, dtype, "nonfinite", seed=9)
    w = w.view(R, C)
    for rows, cols in _slice_specs(R, C):
        blk = ops.gather_slices(w, rows, cols)
        assert blk.is_contiguous()
        assert_bit_equal(blk, ref.gather_slices(w, rows, cols), f"gather rows={rows is not None} cols={cols is not None}")
        new = torch.randn(blk.shape).to(dtype)
        a, b = w.clone(), w.clone()
        ops.scatter_slices(a, rows, cols, new)
        ref.scatter_slices(b, rows, cols, new)
        assert_bit_equal(a, b, "scatter")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("n", [0, 1, 7, 1000])
def test_gather_scatter_slices_1d(n, dtype):
    w, _ = make_pair(n, dtype, "random", seed=2)
    for rows, _c in _slice_specs(n, 0):
        if _c is not None:
            continue
        blk = ops.gather_slices(w, rows, None)
        assert_bit_equal(blk, ref.gather_slices(w, rows, None))
        new = torch.randn(blk.shape).to(dtype)
        a, b = w.clone(), w.clone()
        ops.scatter_slices(a, rows, None, new)
        ref.scatter_slices(b, rows, None, new)
        assert_bit_equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_slices_multi_match_reference(dtype):
    rng = np.random.default_rng(4)
    t = lambda a: torch.from_numpy(np.asarray(a, dtype=np.int64))  # noqa: E731
    # An MLP subnet: first layer rows, hidden W[rows][:, cols], last layer cols, biases.
    W1, b1 = torch.randn(64, 20).to(dtype), torch.randn(64).to(dtype)
    W2, b2 = torch.randn(48, 64).to(dtype), torch.randn(48).to(dtype)
    W3, b3 = torch.randn(10, 48).to(dtype), torch.randn(10).to(dtype)
    r1, r2 = t(np.sort(rng.permutation(64)[:32])), t(np.sort(rng.permutation(48)[:24]))
    weights = [W1, b1, W2, b2, W3, b3]
    rows = [r1, r1, r2, r2, None, None]
    cols = [None, None, r1, None, r2, None]
    buf = ops.gather_slices_multi(weights, rows, cols)
    assert buf.dim() == 1 and buf.numel() == ops.slices_numel(weights, rows, cols)
    assert_bit_equal(buf, ref.gather_slices_multi(weights, rows, cols))
    new = torch.randn(buf.numel()).to(dtype)
    a = [x.clone() for x in weights]
    b = [x.clone() for x in weights]
    ops.scatter_slices_multi(a, rows, cols, new)
    ref.scatter_slices_multi(b, rows, cols, new)
    for i, (x, y) in enumerate(zip(a, b)):
        assert_bit_equal(x, y, f"weights[{i}]")


# ---------------------------------------------------------------------------
# Non-contiguous inputs: all accepted and handled like their contiguous copy.
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("score", SCORES)
def test_noncontiguous_topk_inputs(score):
    base_w, base_g = make_pair(2 * 40_001, torch.float32, "ties", seed=1)
    w, g = base_w[::2], base_g[1::2]
    assert not w.is_contiguous()
    for k in (0, 1, 400, 40_000, 40_001):
        idx, val = ops.significance_topk(w, g, k, score)
        ridx, rval = ref.significance_topk(w.contiguous(), g.contiguous(), k, score)
        assert torch.equal(idx, ridx)
        assert_bit_equal(val, rval)
    offsets, ks = [0, 10, 20_000, 40_001], [3, 100, 5]
    idx, val = ops.significance_topk_segmented(w, g, offsets, ks, score)
    ridx, rval = ref.significance_topk_segmented(w.contiguous(), g.contiguous(), offsets, ks, score)
    assert torch.equal(idx, ridx)
    assert_bit_equal(val, rval)


def test_noncontiguous_pack_unpack():
    base = torch.randn(2000)
    src = base[::2]
    idx_base = torch.randperm(1000)[:300].repeat_interleave(2)
    idx = idx_base[::2]  # non-contiguous index tensor
    assert not src.is_contiguous() and not idx.is_contiguous()
    assert_bit_equal(ops.pack(src, idx), src.contiguous()[idx.contiguous()])
    vals_base = torch.randn(600)
    vals = vals_base[::2]
    for accumulate in (False, True):
        dst_base = torch.randn(3000)
        dst = dst_base[::3]                       # non-contiguous destination
        expect = dst_base.clone()
        ref.unpack(expect[::3], idx, vals, accumulate)
        ops.unpack(dst, idx, vals, accumulate)
        # The view is written through to its base; the elements between untouched.
        assert_bit_equal(dst_base, expect)


def test_noncontiguous_slices():
    base = torch.randn(40, 30)
    wt = base.t()                                 # transposed [30, 40] view
    assert not wt.is_contiguous()
    rows = torch.tensor([29, 0, 7, 3])
    cols = torch.tensor([1, 39, 5])
    assert_bit_equal(ops.gather_slices(wt, rows, cols), ref.gather_slices(wt, rows, cols))
    blk = torch.randn(4, 3)
    expect = base.clone()
    ref.scatter_slices(expect.t(), rows, cols, blk)
    ops.scatter_slices(wt, rows, cols, blk.t().contiguous().t())   # non-contiguous block too
    assert_bit_equal(base, expect)
    # Multi form: one transposed, one strided 1-D weight.
    b1 = torch.randn(20)
    v1 = b1[::2]
    ws, rs, cs = [wt, v1], [rows, torch.tensor([9, 0])], [cols, None]
    buf = ops.gather_slices_multi(ws, rs, cs)
    assert_bit_equal(buf, ref.gather_slices_multi(ws, rs, cs))
    e_base, e_b1 = base.clone(), b1.clone()
    new = torch.randn(buf.numel())
    ref.scatter_slices_multi([e_base.t(), e_b1[::2]], rs, cs, new)
    ops.scatter_slices_multi(ws, rs, cs, new)
    assert_bit_equal(base, e_base)
    assert_bit_equal(b1, e_b1)


def test_noncontiguous_exclude():
    ex_base = torch.arange(0, 2000, dtype=torch.int64)
    ex = ex_base[::4]
    assert not ex.is_contiguous()
    out = ops.explore_sample(2000, ex, 50, 3, 4)
    assert torch.equal(out, ref.explore_sample(2000, ex.contiguous(), 50, 3, 4))
