"""numpy emulation of the CUDA large-segment control flow (csrc/cuda/topk.cu, csrc/cuda/explore.cu).

The CUDA kernels decide on the device, with no host read, between the paths
of significance_topk's bracket (candidates only / candidates + ties / the
radix fallback) and between explore_sample's normal path and its fallback
(too few distinct values among the M draws). These tests mirror that
structure step by step -- worst-case buffers with an all-ones sentinel, the
decision from device counters, gated kernels -- with every threshold,
capacity and draw count forced to each path, and compare the result with the
definition (slimcomm.reference). They run everywhere; tests/test_ops_cuda.py
compares the real kernels with the CPU ones on a GPU.
"""

import numpy as np
import pytest
import torch

from slimcomm import reference

SENTINEL = np.uint64(0xFFFFFFFFFFFFFFFF)
TILE = 4096


def topk_bracket_emulated(keys, k, thr, cap):
    """Mirror of topk_bracket + topk_radix (gated) for uint32 keys (smallest = best).

    Returns (indices ascending, which path ran)."""
    n = len(keys)
    idx = np.arange(n, dtype=np.uint64)
    below = keys < thr
    total = int(below.sum())                        # atomic candidate count
    nties = int((keys == thr).sum())
    tie_cnt = np.bincount(np.nonzero(keys == thr)[0] // TILE, minlength=(n + TILE - 1) // TILE)
    # compaction in an arbitrary order (block-aggregated atomics), clipped at cap
    cand_vals = (keys[below].astype(np.uint64) << np.uint64(32)) | idx[below]
    cand_vals = np.random.default_rng(0).permutation(cand_vals)
    cand = np.full(cap, SENTINEL, dtype=np.uint64)   # at::full(cap, -1)
    cand[:min(total, cap)] = cand_vals[:cap]
    # topk_decide_kernel
    miss = total > cap or total + nties < k
    tot = 0 if miss else total
    ctl = (1 if miss else 0, 0 if miss else min(tot, k), 0 if miss else max(0, k - tot))
    # the whole buffer is sorted (worst case), sentinels last
    srt = np.sort(cand)
    out = np.empty(k, dtype=np.uint64)
    out[:ctl[1]] = srt[:ctl[1]] & np.uint64(0xFFFFFFFF)        # low_words_kernel
    if ctl[2] > 0:                                              # topk_tie_emit_kernel
        pre = np.concatenate([[0], np.cumsum(tie_cnt)[:-1]])
        ties = np.nonzero(keys == thr)[0]
        assert all(pre[t] == np.searchsorted(ties, t * TILE) for t in range(len(tie_cnt)))
        out[ctl[1]:ctl[1] + ctl[2]] = ties[:ctl[2]]
    if ctl[0] == 0:                                             # topk_write_kernel
        return np.sort(out).astype(np.int64), "ties" if ctl[2] else "candidates"
    # topk_radix behind the open gate: exact k smallest (key, index)
    return np.sort(np.lexsort((idx, keys))[:k]).astype(np.int64), "radix"


def _expected_topk(keys, k):
    return np.sort(np.lexsort((np.arange(len(keys)), keys))[:k])


@pytest.mark.parametrize("kind", ["random", "few_values", "all_tied"])
def test_topk_bracket_device_decision_every_path(kind):
    rng = np.random.default_rng(1)
    n = 3 * TILE + 123
    keys = {"random": rng.integers(0, 2**32 - 1, n),
            "few_values": rng.integers(0, 5, n),
            "all_tied": np.zeros(n, dtype=np.int64)}[kind].astype(np.uint32)
    seen = set()
    for k in (1, 17, n // 3, n - 1):
        ref = _expected_topk(keys, k)
        kth = np.sort(keys)[k - 1]
        for thr in {int(kth), int(kth) + 1, int(kth) + 1000, 0, 2**32 - 1}:
            thr = min(thr, 2**32 - 1)
            for cap in (max(1, k // 2), k, k + 5, n):  # k // 2: SLIMCOMM_CUDA_TEST_FALLBACKS
                got, path = topk_bracket_emulated(keys, k, np.uint32(thr), cap)
                np.testing.assert_array_equal(got, ref, err_msg=f"{kind} k={k} thr={thr} cap={cap}")
                seen.add(path)
    assert seen == {"candidates", "ties", "radix"} or kind != "random" and "radix" in seen, seen


def explore_large_emulated(n, exclude, m, seed, offset, M):
    """Mirror of explore_large with a given number of draws M (the CUDA code uses
    the expected count + 8 sigma; a small M forces the device fallback)."""
    ex = np.asarray(exclude, dtype=np.int64)
    a = n - len(ex)
    assert 0 < m < a
    comp = 2 * m > a
    t = a - m if comp else m
    d = reference._scale_draws(reference.explore_keys(M, seed, offset), a).astype(np.uint64)
    j = np.arange(M, dtype=np.uint64)
    keys = (d << np.uint64(32)) | j                                   # explore_draws_kernel
    srt = np.sort(keys)                                               # sort_keys
    val = srt >> np.uint64(32)
    first_sorted = np.concatenate([[True], val[1:] != val[:-1]])
    flag = np.zeros(M, dtype=np.uint32)
    flag[(srt & np.uint64(0xFFFFFFFF)).astype(np.int64)] = first_sorted   # explore_first_kernel
    scan = np.cumsum(flag)                                            # inclusive_sum_u32
    ctl = [-1, 0, 1 if scan[M - 1] < t else 0]                        # explore_ctl_kernel
    hits = np.nonzero((flag != 0) & (scan == t))[0]                   # explore_cut_kernel
    assert len(hits) <= 1
    if len(hits):
        ctl[0] = int(hits[0])
    sj = (srt & np.uint64(0xFFFFFFFF)).astype(np.int64)
    keep = (flag[sj] != 0) & (sj <= ctl[0])                           # explore_keep_kernel
    R = srt[keep]                                                     # select_flagged_u64
    ctl[1] = len(R)
    if ctl[2]:                                                        # explore_fb_*
        assert ctl[0] == -1 and ctl[1] == 0
        bits = np.zeros(a, dtype=bool)
        bits[val.astype(np.int64)] = True                             # mark
        found, jj = int(scan[M - 1]), M
        more = reference._scale_draws(reference.explore_keys(M + 64 * a, seed, offset), a)
        while found < t:                                              # extend (one thread)
            dj = int(more[jj])
            if not bits[dj]:
                bits[dj] = True
                found += 1
            jj += 1
        R = np.nonzero(bits)[0].astype(np.uint64) << np.uint64(32)    # emit, ascending
    assert len(R) == t
    ranks = (R >> np.uint64(32)).astype(np.int64)
    if comp:
        ranks = np.setdiff1d(np.arange(a), ranks)
    return ranks + np.searchsorted(ex - np.arange(len(ex)), ranks, side="right"), ctl[2]


@pytest.mark.parametrize("n,m", [(5000, 7), (5000, 2400), (5000, 2600), (4099, 4000)])
def test_explore_device_fallback_equals_definition(n, m):
    exclude = np.arange(3, n, 97)
    ref = reference.explore_sample(n, torch.from_numpy(exclude), m, 11, 5).numpy()
    a = n - len(exclude)
    t = min(m, a - m)
    expect = -a * np.log1p(-t / a)
    M_cuda = max(t, int(np.ceil(expect + 8 * np.sqrt(expect) + 64)))
    paths = set()
    for M in (M_cuda, t, t + 3, max(1, t // 2), 1):  # t // 2: SLIMCOMM_CUDA_TEST_FALLBACKS
        got, fb = explore_large_emulated(n, exclude, m, 11, 5, M)
        np.testing.assert_array_equal(got, ref, err_msg=f"M={M}")
        paths.add(fb)
    assert paths == {0, 1}
