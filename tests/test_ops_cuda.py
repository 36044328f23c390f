"""CUDA kernels equal the CPU kernels, op by op (skipped without a GPU).

The CPU kernels are held to slimcomm.reference by test_ops.py; here every op
is run on the same inputs on both devices and the results must be identical:
index sets exactly, gathered values bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from slimcomm import ops

from _ops_cases import (
    DTYPES, PATTERNS, SCORES, TIED_KINDS, assert_bit_equal, assert_equal_nan, counts_for, ks_for,
    make_exclude, make_layout, make_pair, make_tied, tie_ks,
)

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

SIZES = [0, 1, 2, 7, 1000, 2**20 + 3, 2**22 + 1]


@pytest.fixture(scope="module", autouse=True)
def _require_cuda_build():
    from slimcomm.info import build_info
    if not build_info()["cuda"]:
        pytest.fail("a CUDA device is available but this slimcomm build has no CUDA kernels; "
                    "rebuild with a CUDA torch and CUDA_HOME set (see `python -m slimcomm.info`)")


def _cuda(*ts):
    return [t.cuda() if isinstance(t, torch.Tensor) else t for t in ts]


def _topk_cases():
    for n in SIZES:
        for pattern in PATTERNS:
            for k in ks_for(n):
                for score in SCORES:
                    for dtype in DTYPES:
                        if n > 2**20 and (pattern not in ("random", "nonfinite", "ties") or dtype == torch.float16):
                            continue
                        yield pytest.param(n, pattern, k, score, dtype,
                                           id=f"{n}-{pattern}-k{k}-{score}-{str(dtype)[6:]}")


@pytest.mark.parametrize("n,pattern,k,score,dtype", list(_topk_cases()))
def test_significance_topk_cuda_equals_cpu(n, pattern, k, score, dtype):
    w, g = make_pair(n, dtype, pattern)
    idx, val = ops.significance_topk(w, g, k, score)
    cidx, cval = ops.significance_topk(*_cuda(w, g), k, score)
    assert cidx.is_cuda and cval.is_cuda
    assert torch.equal(cidx.cpu(), idx)
    assert_bit_equal(cval.cpu(), val)


@pytest.mark.parametrize("layout_seed", range(6))
@pytest.mark.parametrize("score", SCORES)
def test_significance_topk_segmented_cuda_equals_cpu(layout_seed, score):
    rng = np.random.default_rng(layout_seed)
    offsets, total = make_layout(rng, 40)
    ks = counts_for(rng, offsets)
    dtype = DTYPES[layout_seed % 3]
    w, g = make_pair(total, dtype, PATTERNS[layout_seed % len(PATTERNS)], seed=layout_seed)
    idx, val = ops.significance_topk_segmented(w, g, offsets, ks, score)
    cidx, cval = ops.significance_topk_segmented(*_cuda(w, g), offsets, ks, score)
    assert torch.equal(cidx.cpu(), idx)
    assert_bit_equal(cval.cpu(), val)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("kind", ["none", "random", "prefix", "all_but_one"])
@pytest.mark.parametrize("seed,offset", [(0, 0), (-1, 2**63 - 1), (2**40 + 3, 77)])
def test_explore_sample_cuda_equals_cpu(n, kind, seed, offset):
    ex = make_exclude(n, kind if n >= 2 else "none")
    avail = n - ex.numel()
    for m in sorted({m for m in (0, 1, avail // 100, avail // 2, avail - 1, avail) if 0 <= m <= avail}):
        out = ops.explore_sample(n, ex, m, seed, offset)
        cout = ops.explore_sample(n, ex.cuda(), m, seed, offset)
        assert cout.is_cuda
        assert torch.equal(cout.cpu(), out), f"m={m}"


@pytest.mark.parametrize("layout_seed", range(6))
def test_explore_sample_segmented_cuda_equals_cpu(layout_seed):
    rng = np.random.default_rng(50 + layout_seed)
    offsets, _ = make_layout(rng, 40)
    S = len(offsets) - 1
    parts, ex_off = [], [0]
    for s in range(S):
        n_s = offsets[s + 1] - offsets[s]
        kind = ["none", "random", "prefix", "all_but_one"][int(rng.integers(4))] if n_s >= 2 else "none"
        e = make_exclude(n_s, kind, seed=s) + offsets[s]
        parts.append(e)
        ex_off.append(ex_off[-1] + e.numel())
    ex = torch.cat(parts)
    avail = [(offsets[s + 1] - offsets[s]) - (ex_off[s + 1] - ex_off[s]) for s in range(S)]
    ms = counts_for(rng, offsets, avail)
    rng_offsets = [int(x) for x in rng.integers(0, 2**40, S)]
    out = ops.explore_sample_segmented(offsets, ex, ex_off, ms, 9, rng_offsets)
    cout = ops.explore_sample_segmented(offsets, ex.cuda(), ex_off, ms, 9, rng_offsets)
    assert torch.equal(cout.cpu(), out)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("n", SIZES)
def test_pack_unpack_cuda_equals_cpu(n, dtype):
    src, other = make_pair(n, dtype, "nonfinite", seed=5)
    rng = np.random.default_rng(n)
    for size in {0, min(n, 1), n // 3, n}:
        idx = torch.from_numpy(rng.choice(n, size=size, replace=False).astype(np.int64)) if n else torch.empty(0, dtype=torch.int64)
        vals = ops.pack(src, idx)
        cvals = ops.pack(*_cuda(src, idx))
        assert_bit_equal(cvals.cpu(), vals)
        for accumulate in (False, True):
            dst, cdst = other.clone(), other.cuda()
            ops.unpack(dst, idx, vals, accumulate)
            ops.unpack(cdst, idx.cuda(), cvals, accumulate)
            (assert_equal_nan if accumulate else assert_bit_equal)(cdst.cpu(), dst)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("shape", [(0, 0), (1, 1), (7, 2), (300, 1000), (4096, 1030)])
def test_slices_cuda_equals_cpu(shape, dtype):
    R, C = shape
    rng = np.random.default_rng(R + C)
    W = make_pair(R * C, dtype, "random")[0].view(R, C)
    t = lambda a: torch.from_numpy(np.asarray(a, dtype=np.int64))  # noqa: E731
    specs = [(None, None), (t(rng.permutation(R)[: R // 2]), None), (None, t(rng.permutation(C)[: C // 3])),
             (t(rng.permutation(R)[: R // 2]), t(rng.permutation(C)[: C // 2]))]
    for rows, cols in specs:
        blk = ops.gather_slices(W, rows, cols)
        cblk = ops.gather_slices(W.cuda(), *_cuda(rows, cols))
        assert_bit_equal(cblk.cpu(), blk)
        new = torch.randn(blk.shape).to(dtype)
        a, b = W.clone(), W.cuda()
        ops.scatter_slices(a, rows, cols, new)
        ops.scatter_slices(b, *_cuda(rows, cols), new.cuda())
        assert_bit_equal(b.cpu(), a)
    # Multi-tensor form, including a 1-D weight and a transposed one.
    ws = [W, W[:, :1].reshape(-1).contiguous(), W.t()]
    rs = [specs[3][0], specs[1][0], specs[2][1]]
    cs = [specs[3][1], None, specs[1][0]]
    buf = ops.gather_slices_multi(ws, rs, cs)
    cbuf = ops.gather_slices_multi(_cuda(*ws), _cuda(*rs), _cuda(*cs))
    assert_bit_equal(cbuf.cpu(), buf)
    new = torch.randn(buf.numel()).to(dtype)
    a = [w.clone() for w in ws]
    b = [w.cuda() for w in ws]
    ops.scatter_slices_multi(a, rs, cs, new)
    ops.scatter_slices_multi(b, _cuda(*rs), _cuda(*cs), new.cuda())
    for x, y in zip(a, b):
        assert_bit_equal(y.cpu(), x)


def test_noncontiguous_cuda():
    base = make_pair(2 * 300_001, torch.float32, "ties")[0].cuda()
    w, g = base[::2], base.flip(0)[::2]
    idx, val = ops.significance_topk(w, g, 3000)
    cidx, cval = ops.significance_topk(w.cpu(), g.cpu(), 3000)
    assert torch.equal(idx.cpu(), cidx) and torch.equal(val.cpu(), cval)
    dst_base = torch.zeros(3000, device="cuda")
    dst = dst_base[::3]
    ops.unpack(dst, torch.tensor([0, 999], device="cuda"), torch.tensor([1.0, 2.0], device="cuda"))
    assert dst_base[0].item() == 1.0 and dst_base[2997].item() == 2.0 and dst_base.sum().item() == 3.0


def test_cuda_errors_name_the_argument():
    w = torch.randn(10, device="cuda")
    with pytest.raises(RuntimeError, match=r"'k'"):
        ops.significance_topk(w, w, 11)
    with pytest.raises(RuntimeError, match=r"'indices' has an index out of range"):
        ops.pack(w, torch.tensor([10], device="cuda"))
    before = w.clone()
    with pytest.raises(RuntimeError, match=r"'indices' has an index out of range"):
        ops.unpack(w, torch.tensor([0, -1], device="cuda"), torch.ones(2, device="cuda"))
    assert torch.equal(w, before)
    with pytest.raises(RuntimeError, match=r"'exclude'"):
        ops.explore_sample(10, torch.tensor([3, 3], device="cuda"), 1, 0, 0)
    # Mismatched devices.
    with pytest.raises(RuntimeError, match=r"'grad' is on"):
        ops.significance_topk(w, w.cpu(), 1)
    with pytest.raises(RuntimeError, match=r"'indices' is on"):
        ops.pack(w, torch.tensor([1]))
    with pytest.raises(RuntimeError, match=r"'values' is on"):
        ops.unpack(w, torch.tensor([1], device="cuda"), torch.ones(1))
    with pytest.raises(RuntimeError, match=r"'rows' is on"):
        ops.gather_slices(w.view(2, 5), torch.tensor([1]), None)
    assert torch.equal(w, before)


@pytest.mark.parametrize("pattern", ["random", "ties"])
def test_topk_large_segments_at_odd_offsets(pattern):
    """Segments of 100k-300k elements starting at odd offsets (unaligned 16-byte loads),
    on random data (sampled-bracket path) and heavy ties (fallback path)."""
    lens = [1, 100_003, 4, 250_001, 7, 299_999]
    offsets = [0]
    for n in lens:
        offsets.append(offsets[-1] + n)
    ks = [1, 1_000, 0, 25_000, 7, 2_999]
    w, g = make_pair(offsets[-1], torch.float32, pattern, seed=11)
    idx, val = ops.significance_topk_segmented(w, g, offsets, ks)
    cidx, cval = ops.significance_topk_segmented(*_cuda(w, g), offsets, ks)
    assert torch.equal(cidx.cpu(), idx)
    assert_bit_equal(cval.cpu(), val)


@pytest.mark.parametrize("n", [50_001, 300_007, 2**22 + 1])
@pytest.mark.parametrize("kind", TIED_KINDS)
def test_topk_tied_cuda_equals_cpu(kind, n):
    """Tied scores (zero gradient / weight, few levels, ties straddling k): the
    block path (n <= 2^16), the bracket path with the threshold as the k-th
    key (tie emission), and the radix fallback (k close to n)."""
    w, g = make_tied(n, kind)
    cw, cg = _cuda(w, g)
    for score in (SCORES if kind in ("zero_grad", "zero_weight") else ["product"]):
        for k in tie_ks(w, g, score):
            idx, val = ops.significance_topk(w, g, k, score)
            cidx, cval = ops.significance_topk(cw, cg, k, score)
            assert torch.equal(cidx.cpu(), idx), (score, k)
            assert_bit_equal(cval.cpu(), val)


def test_topk_tied_segments_at_odd_offsets():
    """A bucket of tied segments (zero grad, zero weight, levels) at odd offsets."""
    parts = [make_tied(n, kind, seed=i) for i, (kind, n) in enumerate(
        [("zero_grad", 100_003), ("all_zero", 5), ("zero_weight", 250_001), ("levels", 70_001),
         ("all_zero", 40_000), ("spread_top", 299_999)])]
    w = torch.cat([p[0] for p in parts])
    g = torch.cat([p[1] for p in parts])
    offsets = [0]
    for p in parts:
        offsets.append(offsets[-1] + p[0].numel())
    ks = [1_000, 3, 2_501, 40_000, 39_999, 30_000]
    idx, val = ops.significance_topk_segmented(w, g, offsets, ks)
    cidx, cval = ops.significance_topk_segmented(*_cuda(w, g), offsets, ks)
    assert torch.equal(cidx.cpu(), idx)
    assert_bit_equal(cval.cpu(), val)


def test_topk_weight_and_grad_mutually_misaligned():
    """weight and grad views that start at different 16-byte phases."""
    n = 200_001
    a, b = make_pair(n + 3, torch.float32, "random", seed=5)
    w, g = a[1:n + 1], b[:n]
    idx, val = ops.significance_topk(w, g, 2_000)
    ca, cb = _cuda(a, b)
    cidx, cval = ops.significance_topk(ca[1:n + 1], cb[:n], 2_000)
    assert torch.equal(cidx.cpu(), idx)
    assert_bit_equal(cval.cpu(), val)


def test_ops_on_a_side_stream():
    """Kernels launch on the current stream: results are right inside torch.cuda.stream(s)."""
    n = 1 << 20
    w, g = make_pair(n, torch.float32, "random", seed=3)
    idx, _ = ops.significance_topk(w, g, n // 100)
    ex = ops.explore_sample(n, idx, n // 100, 7, 9)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        cw, cg = w.cuda(), g.cuda()
        cidx, cval = ops.significance_topk(cw, cg, n // 100)
        cex = ops.explore_sample(n, cidx, n // 100, 7, 9)
        packed = ops.pack(cg, cidx)
    s.synchronize()
    assert torch.equal(cidx.cpu(), idx)
    assert torch.equal(cex.cpu(), ex)
    assert torch.equal(packed.cpu(), g[idx])


def test_opcheck_cuda():
    """torch.library.opcheck on CUDA tensors for every op."""
    w, g = (t.cuda() for t in make_pair(1000, torch.float32, "random", seed=1))
    idx = torch.arange(0, 1000, 7, device="cuda")
    W = torch.randn(12, 9, device="cuda")
    r, c = torch.tensor([0, 3, 5], device="cuda"), torch.tensor([1, 8], device="cuda")
    o = torch.ops.slimcomm
    torch.library.opcheck(o.significance_topk, (w, g, 10, "product"))
    torch.library.opcheck(o.significance_topk_segmented, (w, g, [0, 400, 1000], [4, 6], "product"))
    torch.library.opcheck(o.explore_sample, (1000, idx, 20, 3, 4))
    torch.library.opcheck(o.explore_sample_segmented,
                          ([0, 500, 1000], idx, [0, 72, idx.numel()], [5, 6], 3, [1, 2]))
    torch.library.opcheck(o.pack, (g, idx))
    torch.library.opcheck(o.unpack, (g.clone(), idx, w[:idx.numel()].clone(), True))
    torch.library.opcheck(o.gather_slices, (W, r, c))
    torch.library.opcheck(o.scatter_slices, (W.clone(), r, c, torch.randn(3, 2, device="cuda")))
    torch.library.opcheck(o.gather_slices_multi, ([W, W[0].clone()], [r, r], [c, None]))
    torch.library.opcheck(o.scatter_slices_multi,
                          ([W.clone(), W[0].clone()], [r, r], [c, None], torch.randn(9, device="cuda")))
