"""Bad arguments to every slimcomm op raise RuntimeError naming the argument,
and leave in-place targets untouched."""

from __future__ import annotations

import pytest
import torch

from slimcomm import ops

f32 = torch.float32


def _w(n=10, dtype=f32):
    return torch.arange(n, dtype=torch.float32).to(dtype) + 1


def _i(*v):
    return torch.tensor(v, dtype=torch.int64)


E = torch.empty(0, dtype=torch.int64)

# (id, callable, regex that must appear in the message). Each message names the
# argument as 'name' (quoted), so the regex includes the quotes.
CASES = [
    # significance_topk
    ("topk k > numel", lambda: ops.significance_topk(_w(), _w(), 11), r"'k'.*\[0, numel\(weight\) = 10\]"),
    ("topk negative k", lambda: ops.significance_topk(_w(), _w(), -1), r"'k'"),
    ("topk 2-D weight", lambda: ops.significance_topk(_w().view(2, 5), _w().view(2, 5), 1), r"'weight' must be 1-D"),
    ("topk 2-D grad", lambda: ops.significance_topk(_w(), _w().view(2, 5), 1), r"'grad' must be 1-D"),
    ("topk 0-D weight", lambda: ops.significance_topk(torch.tensor(1.0), torch.tensor(1.0), 0), r"'weight' must be 1-D"),
    ("topk shape mismatch", lambda: ops.significance_topk(_w(10), _w(9), 1), r"'grad' has 9 elements"),
    ("topk dtype mismatch", lambda: ops.significance_topk(_w(), _w(dtype=torch.float16), 1), r"'grad' has dtype"),
    ("topk int weight", lambda: ops.significance_topk(torch.arange(10), torch.arange(10), 1), r"'weight' must be float32"),
    ("topk float64", lambda: ops.significance_topk(_w().double(), _w().double(), 1), r"'weight' must be float32"),
    ("topk bad score", lambda: ops.significance_topk(_w(), _w(), 1, "magnitude"), r"slimcomm\.significance_topk: argument 'score' must be one of"),
    # significance_topk_segmented
    ("seg topk offsets length", lambda: ops.significance_topk_segmented(_w(), _w(), [0, 5], [1, 1]), r"'offsets' must have len\('ks'\) \+ 1|'offsets' must have len\(ks\) \+ 1"),
    ("seg topk offsets decreasing", lambda: ops.significance_topk_segmented(_w(), _w(), [0, 6, 5], [1, 0]), r"'offsets' must be non-decreasing"),
    ("seg topk offsets negative", lambda: ops.significance_topk_segmented(_w(), _w(), [-1, 5], [1]), r"'offsets'"),
    ("seg topk offsets beyond", lambda: ops.significance_topk_segmented(_w(), _w(), [0, 11], [1]), r"'offsets'.*beyond"),
    ("seg topk k > segment", lambda: ops.significance_topk_segmented(_w(), _w(), [0, 3, 10], [4, 1]), r"'ks' entry 0 is 4"),
    ("seg topk negative k", lambda: ops.significance_topk_segmented(_w(), _w(), [0, 3, 10], [1, -1]), r"'ks' entry 1 is -1"),
    ("seg topk bad score", lambda: ops.significance_topk_segmented(_w(), _w(), [0, 10], [1], "abs"), r"'score'"),
    ("seg topk 2-D", lambda: ops.significance_topk_segmented(_w().view(2, 5), _w().view(2, 5), [0, 10], [1]), r"'weight' must be 1-D"),
    ("seg topk dtype mismatch", lambda: ops.significance_topk_segmented(_w(), _w(dtype=torch.bfloat16), [0, 10], [1]), r"'grad' has dtype"),
    # explore_sample
    ("explore negative n", lambda: ops.explore_sample(-1, E, 0, 0, 0), r"'n' must be >= 0"),
    ("explore bool seed", lambda: ops.explore_sample(10, E, 1, True, 0), r"'seed' must be an int, got bool"),
    ("explore negative m", lambda: ops.explore_sample(10, E, -1, 0, 0), r"'m' must be >= 0"),
    ("explore m too large", lambda: ops.explore_sample(10, _i(1, 2), 9, 0, 0), r"'m' is 9 but only n - len\(exclude\) = 8"),
    ("explore exclude out of range", lambda: ops.explore_sample(10, _i(3, 10), 1, 0, 0), r"'exclude' has index 10 outside \[0, 10\)"),
    ("explore exclude negative", lambda: ops.explore_sample(10, _i(-1, 3), 1, 0, 0), r"'exclude' has index -1"),
    ("explore exclude unsorted", lambda: ops.explore_sample(10, _i(5, 3), 1, 0, 0), r"'exclude' must be sorted"),
    ("explore exclude duplicated", lambda: ops.explore_sample(10, _i(3, 3), 1, 0, 0), r"'exclude' must be sorted ascending without duplicates"),
    ("explore exclude dtype", lambda: ops.explore_sample(10, torch.tensor([1, 2], dtype=torch.int32), 1, 0, 0), r"'exclude' must be an int64"),
    ("explore exclude float", lambda: ops.explore_sample(10, torch.tensor([1.0]), 1, 0, 0), r"'exclude' must be an int64"),
    ("explore exclude 2-D", lambda: ops.explore_sample(10, _i(1, 2).view(1, 2), 1, 0, 0), r"'exclude' must be 1-D"),
    # explore_sample_segmented
    ("seg explore offsets length", lambda: ops.explore_sample_segmented([0, 5], E, [0, 0, 0], [1, 1], 0, [0, 0]), r"'offsets' must have len\(ms\) \+ 1"),
    ("seg explore exclude_offsets length", lambda: ops.explore_sample_segmented([0, 5, 9], E, [0, 0], [1, 1], 0, [0, 0]), r"'exclude_offsets' must have"),
    ("seg explore rng_offsets length", lambda: ops.explore_sample_segmented([0, 5, 9], E, [0, 0, 0], [1, 1], 0, [0]), r"'rng_offsets' must have len\(ms\) = 2"),
    ("seg explore exclude_offsets end", lambda: ops.explore_sample_segmented([0, 5, 9], _i(1), [0, 0, 0], [1, 1], 0, [0, 0]), r"'exclude_offsets' must start at 0 and end at len\(exclude\)"),
    ("seg explore exclude_offsets decreasing", lambda: ops.explore_sample_segmented([0, 5, 9], _i(1, 6), [0, 3, 2], [1, 1], 0, [0, 0]), r"'exclude_offsets'"),
    ("seg explore offsets decreasing", lambda: ops.explore_sample_segmented([0, 5, 4], E, [0, 0, 0], [1, 0], 0, [0, 0]), r"'offsets' must be non-decreasing"),
    ("seg explore offsets negative", lambda: ops.explore_sample_segmented([-2, 5], E, [0, 0], [1], 0, [0]), r"'offsets' must start at >= 0"),
    ("seg explore exclude outside segment", lambda: ops.explore_sample_segmented([0, 5, 9], _i(6), [0, 1, 1], [1, 1], 0, [0, 0]), r"'exclude' has index 6 outside \[0, 5\) \(segment 0\)"),
    ("seg explore exclude unsorted", lambda: ops.explore_sample_segmented([0, 5, 9], _i(3, 1), [0, 2, 2], [1, 1], 0, [0, 0]), r"'exclude' must be sorted"),
    ("seg explore m too large", lambda: ops.explore_sample_segmented([0, 5, 9], _i(6), [0, 0, 1], [1, 4], 0, [0, 0]), r"'ms' entry 1 is 4 but must be in \[0, 3\]"),
    ("seg explore negative m", lambda: ops.explore_sample_segmented([0, 5], E, [0, 0], [-1], 0, [0]), r"'ms' entry 0 is -1"),
    ("seg explore exclude dtype", lambda: ops.explore_sample_segmented([0, 5], torch.tensor([1], dtype=torch.int32), [0, 1], [1], 0, [0]), r"'exclude' must be an int64"),
    # pack
    ("pack index out of range", lambda: ops.pack(_w(), _i(0, 10)), r"'indices' has an index out of range \[0, 10\)"),
    ("pack negative index", lambda: ops.pack(_w(), _i(-1)), r"'indices' has an index out of range"),
    ("pack index dtype", lambda: ops.pack(_w(), torch.tensor([1], dtype=torch.int32)), r"'indices' must be an int64"),
    ("pack 2-D src", lambda: ops.pack(_w().view(2, 5), _i(1)), r"'src' must be 1-D"),
    ("pack 2-D indices", lambda: ops.pack(_w(), _i(1, 2).view(2, 1)), r"'indices' must be 1-D"),
    ("pack int src", lambda: ops.pack(torch.arange(10), _i(1)), r"'src' must be float32"),
]


@pytest.mark.parametrize("fn,match", [pytest.param(f, m, id=i) for i, f, m in CASES])
def test_bad_argument_raises_naming_it(fn, match):
    with pytest.raises(RuntimeError, match=match):
        fn()


# In-place ops: the error names the argument and the target is untouched.
def _unpack_cases():
    d = lambda: _w(10)  # noqa: E731
    return [
        ("index out of range", d, lambda t: ops.unpack(t, _i(1, 10), _w(2)), r"'indices' has an index out of range"),
        ("index out of range (acc)", d, lambda t: ops.unpack(t, _i(-3, 1), _w(2), True), r"'indices' has an index out of range"),
        ("values length", d, lambda t: ops.unpack(t, _i(1, 2), _w(3)), r"'values' has 3 elements but 'indices' has 2"),
        ("values dtype", d, lambda t: ops.unpack(t, _i(1, 2), _w(2, torch.float16)), r"'values' has dtype"),
        ("values 2-D", d, lambda t: ops.unpack(t, _i(1, 2), _w(2).view(1, 2)), r"'values' must be 1-D"),
        ("index dtype", d, lambda t: ops.unpack(t, torch.tensor([1, 2], dtype=torch.int32), _w(2)), r"'indices' must be an int64"),
        ("dst 2-D", lambda: _w(10).view(2, 5), lambda t: ops.unpack(t, _i(1, 2), _w(2)), r"'dst' must be 1-D"),
    ]


@pytest.mark.parametrize("make,fn,match", [pytest.param(m, f, r, id=i) for i, m, f, r in _unpack_cases()])
def test_unpack_bad_argument_leaves_dst_untouched(make, fn, match):
    dst = make()
    before = dst.clone()
    with pytest.raises(RuntimeError, match=match):
        fn(dst)
    assert torch.equal(dst, before)


def _slices_cases():
    W = lambda: torch.randn(6, 5)  # noqa: E731
    return [
        ("rows out of range", W, lambda t: ops.scatter_slices(t, _i(0, 6), None, torch.zeros(2, 5)), r"'rows' has an index out of range \[0, 6\)"),
        ("cols out of range", W, lambda t: ops.scatter_slices(t, None, _i(-1), torch.zeros(6, 1)), r"'cols' has an index out of range \[0, 5\)"),
        ("block shape", W, lambda t: ops.scatter_slices(t, _i(0, 1), _i(2), torch.zeros(2, 2)), r"'block' must have shape \[2, 1\]"),
        ("block dtype", W, lambda t: ops.scatter_slices(t, _i(0), None, torch.zeros(1, 5, dtype=torch.float16)), r"'block' has dtype"),
        ("rows dtype", W, lambda t: ops.scatter_slices(t, torch.tensor([0], dtype=torch.int32), None, torch.zeros(1, 5)), r"'rows' must be an int64"),
        ("rows 2-D", W, lambda t: ops.scatter_slices(t, _i(0, 1).view(2, 1), None, torch.zeros(2, 5)), r"'rows' must be 1-D"),
        ("cols for 1-D weight", lambda: torch.randn(6), lambda t: ops.scatter_slices(t, _i(0), _i(0), torch.zeros(1)), r"'cols' must be None for a 1-D weight"),
        ("3-D weight", lambda: torch.randn(2, 3, 4), lambda t: ops.scatter_slices(t, None, None, torch.zeros(2, 3, 4)), r"'weight' must be 1-D or 2-D"),
    ]


@pytest.mark.parametrize("make,fn,match", [pytest.param(m, f, r, id=i) for i, m, f, r in _slices_cases()])
def test_scatter_slices_bad_argument_leaves_weight_untouched(make, fn, match):
    w = make()
    before = w.clone()
    with pytest.raises(RuntimeError, match=match):
        fn(w)
    assert torch.equal(w, before)


@pytest.mark.parametrize("rows,cols,match", [
    (_i(0, 6), None, r"'rows' has an index out of range"),
    (None, _i(5), r"'cols' has an index out of range"),
    (torch.tensor([0.0]), None, r"'rows' must be an int64"),
])
def test_gather_slices_bad_argument(rows, cols, match):
    with pytest.raises(RuntimeError, match=match):
        ops.gather_slices(torch.randn(6, 5), rows, cols)


def _multi():
    ws = [torch.randn(6, 5), torch.randn(6), torch.randn(4, 6)]
    rows = [_i(0, 2), _i(0, 2), None]
    cols = [None, None, _i(0, 2)]
    return ws, rows, cols


@pytest.mark.parametrize("mutate,match", [
    (lambda ws, r, c: (ws, r[:2], c), r"'rows' has 2 entries but 'weights' has 3"),
    (lambda ws, r, c: (ws, r, c + [None]), r"'cols' has 4 entries but 'weights' has 3"),
    (lambda ws, r, c: ([], [], []), r"'weights' must not be empty"),
    (lambda ws, r, c: (ws[:2] + [ws[2].half()], r, c), r"'weights\[2\]' has dtype"),
    (lambda ws, r, c: (ws, r, c[:2] + [_i(0, 6)]), r"'cols\[2\]' has an index out of range"),
    (lambda ws, r, c: (ws, [r[0], _i(7), r[2]], c), r"'rows\[1\]' has an index out of range"),
    (lambda ws, r, c: (ws, r, [c[0], _i(0), c[2]]), r"'cols\[1\]' must be None for a 1-D weight"),
])
def test_gather_slices_multi_bad_argument(mutate, match):
    ws, r, c = mutate(*_multi())
    with pytest.raises(RuntimeError, match=match):
        ops.gather_slices_multi(ws, r, c)


@pytest.mark.parametrize("mutate,buf_delta,match", [
    (lambda ws, r, c: (ws, r[:2], c), 0, r"'rows' has 2 entries"),
    (lambda ws, r, c: (ws, r, c[:1]), 0, r"'cols' has 1 entries"),
    (lambda ws, r, c: (ws, r, c), 1, r"'buffer' has 21 elements but the slices need exactly 20"),
    (lambda ws, r, c: (ws, r, c), -1, r"'buffer' has 19 elements"),
    (lambda ws, r, c: ([], [], []), 0, r"'weights' must not be empty"),
    # An error in the LAST slice: no earlier weight may have been written.
    (lambda ws, r, c: (ws, r, c[:2] + [_i(0, 6)]), 0, r"'cols\[2\]' has an index out of range"),
    (lambda ws, r, c: (ws[:2] + [ws[2].double()], r, c), 0, r"'weights\[2\]' has dtype"),
])
def test_scatter_slices_multi_bad_argument_leaves_weights_untouched(mutate, buf_delta, match):
    ws, r, c = _multi()
    need = ops.slices_numel(ws, r, c)
    assert need == 20
    ws2, r2, c2 = mutate(ws, r, c)
    before = [w.clone() for w in ws]
    with pytest.raises(RuntimeError, match=match):
        ops.scatter_slices_multi(ws2, r2, c2, torch.zeros(need + buf_delta))
    for w, b in zip(ws, before):
        assert torch.equal(w, b)


def test_scatter_slices_multi_buffer_dtype():
    ws, r, c = _multi()
    before = [w.clone() for w in ws]
    with pytest.raises(RuntimeError, match=r"'buffer' has dtype"):
        ops.scatter_slices_multi(ws, r, c, torch.zeros(20, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match=r"'buffer' must be 1-D"):
        ops.scatter_slices_multi(ws, r, c, torch.zeros(2, 10))
    for w, b in zip(ws, before):
        assert torch.equal(w, b)


def test_every_op_has_a_cuda_kernel_registered():
    # Real kernels on a CUDA build, the "this build has no CUDA kernels" error
    # kernel otherwise; either way a CUDA tensor never falls through to a
    # confusing dispatcher error. (Calling it needs a GPU: tests/test_ops_cuda.py.)
    for name in ("significance_topk", "significance_topk_segmented", "explore_sample",
                 "explore_sample_segmented", "pack", "unpack", "gather_slices",
                 "scatter_slices", "gather_slices_multi", "scatter_slices_multi"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"slimcomm::{name}", "CUDA"), name


def test_explore_seed_and_offset_take_any_64_bit_pattern():
    # The documented seed is 64 bits: [2**63, 2**64) is the same bit pattern as
    # its negative two's complement, and the reference (seed mod 2**64) agrees.
    from slimcomm import reference as ref
    ex = _i(2, 5)
    for seed, offset in ((2**64 - 1, 3), (2**63, 2**64 - 7)):
        out = ops.explore_sample(50, ex, 10, seed, offset)
        assert torch.equal(out, ops.explore_sample(50, ex, 10, seed - 2**64,
                                                   offset - 2**64 if offset >= 2**63 else offset))
        assert torch.equal(out, ref.explore_sample(50, ex, 10, seed, offset))
    seg = ops.explore_sample_segmented([0, 20, 50], ex, [0, 2, 2], [3, 4], 2**64 - 1, [2**63, 1])
    assert torch.equal(seg, ref.explore_sample_segmented([0, 20, 50], ex, [0, 2, 2], [3, 4],
                                                         2**64 - 1, [2**63, 1]))


@pytest.mark.parametrize("fn,match", [
    (lambda: ops.explore_sample(10, E, 1, 2**64, 0), r"'seed'"),
    (lambda: ops.explore_sample(10, E, 1, -2**63 - 1, 0), r"'seed'"),
    (lambda: ops.explore_sample(10, E, 1, 0, 2**64), r"'offset'"),
    (lambda: ops.explore_sample_segmented([0, 10], E, [0, 0], [1], 2**65, [0]), r"'seed'"),
    (lambda: ops.explore_sample_segmented([0, 10], E, [0, 0], [1], 0, [2**64]), r"'rng_offsets\[0\]'"),
])
def test_explore_seed_out_of_64_bits_names_the_argument(fn, match):
    with pytest.raises(RuntimeError, match=match):
        fn()


@pytest.mark.parametrize("ws,rows,cols,match", [
    ([torch.randn(4)], [None, None], [None], r"'rows' has 2 entries but 'weights' has 1"),
    ([torch.randn(4)], [None], [], r"'cols' has 0 entries but 'weights' has 1"),
    ([torch.randn(2, 2, 2)], [None], [None], r"'weights\[0\]' must be 1-D or 2-D"),
    ([torch.randn(4)], [None], [_i(0)], r"'cols\[0\]' must be None for a 1-D weight"),
])
def test_slices_numel_bad_argument(ws, rows, cols, match):
    with pytest.raises(RuntimeError, match=match):
        ops.slices_numel(ws, rows, cols)
