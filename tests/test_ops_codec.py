"""The low-bit value codec ops (quantize_chunks, dequantize_chunks_mean) on the CPU
against slimcomm.reference (the ATen sequence of the compressor's codec before the
fusion): bit for bit for bits 1/2/4/8, random segment layouts with empty segments
and segments shorter than a chunk, several chunk sizes, 1-4 rows (strided views
too), empty inputs, rounding ties, tiny and huge values; non-finite chunks;
thread-count independence; argument errors; opcheck; hypothesis property tests."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from slimcomm import ops, reference as ref

from _ops_cases import assert_bit_equal as _bit_equal, assert_equal_nan


def assert_bit_equal(a, b, what=""):
    """Bit-equal floats (NaN payloads included), equal integers."""
    if a.is_floating_point():
        _bit_equal(a, b, what)
    else:
        assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype)
        assert torch.equal(a, b), f"{what}: values differ"

OPS = torch.ops.slimcomm
BITS = (1, 2, 4, 8)
SETTINGS = settings(max_examples=80, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _offsets(counts, device="cpu"):
    o = np.concatenate([[0], np.cumsum(np.asarray(counts, dtype=np.int64))]).astype(np.int64)
    return torch.from_numpy(o).to(device)


def _values(K, rng, pattern="random"):
    x = rng.standard_normal(K).astype(np.float32)
    if pattern == "random":  # magnitudes over many binades
        x = x * np.exp(rng.uniform(-4, 4, K)).astype(np.float32)
    elif pattern == "ties":  # dyadic values: exact .5 cases in every rounding
        x = rng.choice(np.array([-1, -0.75, -0.5, -0.25, 0, 0.25, 0.5, 0.75, 1], np.float32),
                       K) * np.float32(4)
    elif pattern == "zeros":
        x[rng.random(K) < 0.7] = 0
        x[rng.random(K) < 0.2] = -0.0
    elif pattern == "tiny":  # scales below the 1e-30 clamp, subnormals
        x = x * np.float32(1e-32) if rng.random() < 0.5 else x * np.float32(1e-40)
    elif pattern == "huge":  # max |x| rounds to inf in bf16: finite in, non-finite out
        x = np.clip(x.astype(np.float64) * 2e38, -3.4e38, 3.4e38).astype(np.float32)
    return torch.from_numpy(x)


def _same(a, b, what, nan_ok=False):
    assert a.shape == b.shape and a.dtype == b.dtype, (what, a.shape, b.shape, a.dtype, b.dtype)
    if nan_ok and a.is_floating_point():
        assert_equal_nan(a, b, what)
    else:
        assert_bit_equal(a, b, what)


def _assert_sum_close(dec, err, vals):
    """dec + err == vals to within the rounding of the sum and of err = vals - dec."""
    tol = (dec.abs() + err.abs() + vals.abs()) * 2.0 ** -23 + 1e-45
    assert ((dec + err - vals).abs() <= tol).all()


def _quantize_both(vals, counts, chunk, bits, nan_ok=False):
    off = _offsets(counts, vals.device)
    n = ops.chunk_count(counts, chunk)
    got = ops.quantize_chunks(vals, off, chunk, bits, n)
    exp = ref.quantize_chunks(vals, off, chunk, bits, n)
    for name, a, b in zip(("packed", "scales", "error"), got, exp):
        _same(a, b, name, nan_ok)
    assert got[0].numel() == (vals.numel() * bits + 7) // 8 and got[1].numel() == n
    return got


def _rows(counts, chunk, bits, R, rng, pattern="random"):
    """R rows of quantize_chunks output (one per rank)."""
    K = int(sum(counts))
    off, n = _offsets(counts), ops.chunk_count(counts, chunk)
    outs = [ops.quantize_chunks(_values(K, rng, pattern), off, chunk, bits, n) for _ in range(R)]
    return torch.stack([o[0] for o in outs]), torch.stack([o[1] for o in outs])


def _dequant_both(packed, scales, counts, chunk, bits, divisor, nan_ok=False):
    off = _offsets(counts, packed.device)
    K = int(sum(counts))
    got = ops.dequantize_chunks_mean(packed, scales, off, chunk, bits, K, divisor)
    exp = ref.dequantize_chunks_mean(packed, scales, off, chunk, bits, K, divisor)
    _same(got, exp, "mean", nan_ok)
    return got


LAYOUTS = [
    [0],
    [5],
    [0, 0, 3],
    [1, 0, 7, 0, 0, 2, 13],
    [64, 64, 1],
    [100, 0, 37, 4097, 5],
    [3000, 17, 0, 999],
]


@pytest.mark.parametrize("counts", LAYOUTS, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("chunk", [1, 3, 8, 64, 4096])
@pytest.mark.parametrize("bits", BITS)
def test_quantize_chunks_matches_reference(counts, chunk, bits):
    rng = np.random.default_rng([bits, chunk, len(counts)])
    for pattern in ("random", "ties", "zeros", "tiny"):
        _quantize_both(_values(sum(counts), rng, pattern), counts, chunk, bits)


@pytest.mark.parametrize("counts", LAYOUTS, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("chunk", [1, 3, 64, 4096])
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("R", [1, 2, 3, 4])
def test_dequantize_chunks_mean_matches_reference(counts, chunk, bits, R):
    rng = np.random.default_rng([bits, chunk, R, len(counts)])
    packed, scales = _rows(counts, chunk, bits, R, rng)
    for divisor in (R, 3.0, 0.7):
        _dequant_both(packed, scales, counts, chunk, bits, divisor)


@pytest.mark.parametrize("bits", BITS)
def test_dequantize_any_bytes_and_strided_rows(bits):
    """Every byte is a valid code word; rows may be views of a wider buffer (as the
    compressor passes the all-gathered payload), with extra bytes at the end."""
    rng = np.random.default_rng(bits)
    counts, chunk, R = [70, 0, 33, 1, 200], 16, 3
    K, n = sum(counts), ops.chunk_count(counts, 16)
    B = (K * bits + 7) // 8
    wide = torch.from_numpy(rng.integers(0, 256, (R, 2 * n + B + 6), dtype=np.uint8))
    wide[:, :2 * n] = torch.from_numpy(rng.standard_normal((R, n)).astype(np.float32)).to(
        torch.bfloat16).view(torch.uint8)
    scales, packed = wide[:, :2 * n].view(torch.bfloat16), wide[:, 2 * n:]
    assert not packed.is_contiguous() and not scales.is_contiguous()
    got = _dequant_both(packed, scales, counts, chunk, bits, R)
    _same(got, ops.dequantize_chunks_mean(packed.contiguous(), scales.contiguous(),
                                          _offsets(counts), chunk, bits, K, R), "contiguous")


@pytest.mark.parametrize("bits", BITS)
def test_round_trip_and_error(bits):
    """One row, divisor 1: the mean is the decoded values, and decoded + error is the
    input to within one rounding; the error is within half a level step of the scale."""
    rng = np.random.default_rng(10 + bits)
    counts, chunk = [500, 0, 77, 3], 32
    vals = _values(sum(counts), rng)
    packed, scales, err = _quantize_both(vals, counts, chunk, bits)
    dec = ops.dequantize_chunks_mean(packed[None], scales[None], _offsets(counts), chunk, bits,
                                     vals.numel(), 1)
    _assert_sum_close(dec, err, vals)
    if bits > 1:
        chunk_of, _ = ref._chunk_of(_offsets(counts), chunk, "cpu")
        step = 2.0 / 3 if bits == 2 else 1.0 / (2 ** (bits - 1) - 1)
        bound = scales.float()[chunk_of] * (step / 2 * 1.01) + vals.abs() * 2 ** -7
        assert (err.abs() <= bound).all()


def test_empty():
    for bits in BITS:
        p, s, e = ops.quantize_chunks(torch.empty(0), torch.zeros(3, dtype=torch.int64), 4, bits, 0)
        assert p.shape == (0,) and s.shape == (0,) and e.shape == (0,)
        assert p.dtype == torch.uint8 and s.dtype == torch.bfloat16 and e.dtype == torch.float32
        for R in (0, 2):
            out = ops.dequantize_chunks_mean(torch.empty(R, 0, dtype=torch.uint8),
                                             torch.empty(R, 0, dtype=torch.bfloat16),
                                             torch.zeros(1, dtype=torch.int64), 4, bits, 0, 2)
            assert out.shape == (0,) and out.dtype == torch.float32
    # no rows: the mean of nothing is +0
    out = ops.dequantize_chunks_mean(torch.empty(0, 3, dtype=torch.uint8),
                                     torch.empty(0, 1, dtype=torch.bfloat16),
                                     torch.tensor([0, 5]), 8, 4, 5, 1)
    assert_bit_equal(out, torch.zeros(5))


def test_huge_values_match_reference():
    """A chunk whose max |x| rounds to inf in bf16 decodes to non-finite values, like the
    unfused codec; the kernels agree with the reference (NaN payloads aside)."""
    rng = np.random.default_rng(3)
    counts = [40, 9, 0, 30]
    for bits in BITS:
        vals = _values(sum(counts), rng, "huge")
        packed, scales, _ = _quantize_both(vals, counts, 8, bits, nan_ok=True)
        _dequant_both(packed[None], scales[None], counts, 8, bits, 2, nan_ok=True)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_chunk(bits, bad):
    """A chunk holding NaN/inf gets a non-finite scale and decodes to non-finite values
    (no crash, deterministic); every other chunk is as if it were not there."""
    rng = np.random.default_rng(bits)
    counts, chunk = [20, 0, 13, 40], 8  # chunks: 3 + 2 + 5
    K, n = sum(counts), ops.chunk_count(counts, chunk)
    off = _offsets(counts)
    chunk_of, _ = ref._chunk_of(off, chunk, "cpu")
    vals = _values(K, rng)
    dirty = vals.clone()
    dirty[[25, 27]] = bad  # chunk 3: values 20..27, the first chunk of segment 2
    hit = int(chunk_of[25])
    p1, s1, e1 = ops.quantize_chunks(dirty, off, chunk, bits, n)
    p2, s2, e2 = ops.quantize_chunks(dirty, off, chunk, bits, n)
    for a, b in ((p1, p2), (s1, s2), (e1, e2)):
        assert_bit_equal(a, b, "deterministic")
    _quantize_both(dirty, counts, chunk, bits, nan_ok=True)
    assert not torch.isfinite(s1[hit].float())
    mine = chunk_of == hit
    dec = ops.dequantize_chunks_mean(p1[None], s1[None], off, chunk, bits, K, 1)
    assert not torch.isfinite(dec[mine]).any()
    assert not torch.isfinite(e1[mine]).any()
    # the other chunks: bit-identical to quantizing with the bad chunk zeroed
    clean = dirty.clone()
    clean[mine] = 0
    p0, s0, e0 = ops.quantize_chunks(clean, off, chunk, bits, n)
    other = torch.arange(n) != hit
    assert_bit_equal(s1[other], s0[other], "scales")
    assert_bit_equal(e1[~mine], e0[~mine], "error")
    d0 = ops.dequantize_chunks_mean(p0[None], s0[None], off, chunk, bits, K, 1)
    assert_bit_equal(dec[~mine], d0[~mine], "decoded")
    # a rank's non-finite chunk spreads to the mean of that chunk only
    both = ops.dequantize_chunks_mean(torch.stack([p0, p1]), torch.stack([s0, s1]), off, chunk,
                                      bits, K, 2)
    assert not torch.isfinite(both[mine]).any() and torch.isfinite(both[~mine]).all()


def test_thread_count_does_not_matter():
    rng = np.random.default_rng(5)
    counts, chunk = [300_001, 0, 5, 70_000, 123_456], 4096
    K, n = sum(counts), ops.chunk_count(counts, 4096)
    off = _offsets(counts)
    vals = _values(K, rng)
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            per_bits = []
            for bits in BITS:
                p, s, e = ops.quantize_chunks(vals, off, chunk, bits, n)
                m = ops.dequantize_chunks_mean(torch.stack([p, p.flip(0)]), torch.stack([s, s]),
                                               off, chunk, bits, K, 2)
                per_bits.append((p, s, e, m))
            outs.append(per_bits)
    finally:
        torch.set_num_threads(before)
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            for x, y in zip(a, b):
                assert_bit_equal(x, y, "threads")
    for bits, (p, s, e, _) in zip(BITS, outs[0]):  # and the large case matches the reference
        for name, x, y in zip(("packed", "scales", "error"), (p, s, e),
                              ref.quantize_chunks(vals, off, chunk, bits, n)):
            assert_bit_equal(x, y, f"{name} bits={bits}")


def test_bits1_scale_is_the_sequential_sum():
    """bits 1: the fp32 sum of |x| runs from +0 in value order (index_add_ on the CPU)."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(10_000) * np.exp(rng.uniform(-8, 8, 10_000))).astype(np.float32)
    counts, chunk = [10_000], 1000
    _, s, _ = ops.quantize_chunks(torch.from_numpy(x), _offsets(counts), chunk, 1, 10)
    for c in range(10):
        acc = np.float32(0)
        for v in np.abs(x[c * chunk:(c + 1) * chunk]):
            acc = np.float32(acc + v)
        want = torch.tensor(np.float32(acc) / np.float32(chunk)).to(torch.bfloat16)
        assert_bit_equal(s[c:c + 1], want.reshape(1), f"chunk {c}")


def test_bits2_level_multiply_is_the_division():
    """The kernels decode bits 2 as c * fp32(1 / 1.5) - 1 on both devices: the same as
    the reference's c / 1.5 - 1 (ATen's CPU division) for every code c = 0..3."""
    c = np.arange(4, dtype=np.float32)
    assert np.array_equal((c / np.float32(1.5)).view(np.int32),
                          (c * (np.float32(1) / np.float32(1.5))).view(np.int32))


def test_chunk_count():
    assert ops.chunk_count([], 3) == 0
    assert ops.chunk_count([0, 1, 3, 4, 0, 7], 3) == 0 + 1 + 1 + 2 + 0 + 3
    with pytest.raises(ValueError, match="chunk"):
        ops.chunk_count([1], 0)
    with pytest.raises(ValueError, match="counts"):
        ops.chunk_count([1, -1], 2)


# ---------------------------------------------------------------------------
# Argument errors: every message names the argument.
# ---------------------------------------------------------------------------

def _q_args():
    return dict(vals=torch.randn(10), seg_offsets=torch.tensor([0, 4, 4, 10]), chunk=3, bits=2,
                nchunks=4)


Q_BAD = [
    ("vals", dict(vals=torch.randn(10, dtype=torch.float64))),
    ("vals", dict(vals=torch.randn(2, 5))),
    ("vals", dict(vals=torch.randn(10).to(torch.bfloat16))),
    ("seg_offsets", dict(seg_offsets=torch.tensor([0, 4, 4, 10], dtype=torch.int32))),
    ("seg_offsets", dict(seg_offsets=torch.tensor([[0, 4, 4, 10]]))),
    ("seg_offsets", dict(seg_offsets=torch.zeros(0, dtype=torch.int64))),
    ("seg_offsets", dict(seg_offsets=torch.tensor([0, 4, 4, 9]))),
    ("seg_offsets", dict(seg_offsets=torch.tensor([1, 4, 4, 10]))),
    ("seg_offsets", dict(seg_offsets=torch.tensor([0, 5, 4, 10]))),
    ("seg_offsets", dict(seg_offsets=torch.tensor([0]))),
    ("chunk", dict(chunk=0)),
    ("chunk", dict(chunk=-2)),
    ("bits", dict(bits=3)),
    ("bits", dict(bits=0)),
    ("bits", dict(bits=16)),
    ("nchunks", dict(nchunks=5)),
    ("nchunks", dict(nchunks=3)),
    ("nchunks", dict(nchunks=-1)),
    ("nchunks", dict(nchunks=11)),
]


@pytest.mark.parametrize("arg,change", Q_BAD, ids=[f"{a}-{i}" for i, (a, _) in enumerate(Q_BAD)])
def test_quantize_chunks_errors_name_the_argument(arg, change):
    with pytest.raises(RuntimeError, match=f"quantize_chunks: argument '{arg}'"):
        ops.quantize_chunks(**{**_q_args(), **change})


def _d_args():
    return dict(packed=torch.zeros(2, 3, dtype=torch.uint8),
                scales=torch.ones(2, 4, dtype=torch.bfloat16),
                seg_offsets=torch.tensor([0, 4, 4, 10]), chunk=3, bits=2, numel=10, divisor=2.0)


D_BAD = [
    ("packed", dict(packed=torch.zeros(2, 3, dtype=torch.int8))),
    ("packed", dict(packed=torch.zeros(6, dtype=torch.uint8))),
    ("packed", dict(packed=torch.zeros(2, 2, dtype=torch.uint8))),
    ("scales", dict(scales=torch.ones(2, 4))),
    ("scales", dict(scales=torch.ones(8, dtype=torch.bfloat16))),
    ("scales", dict(scales=torch.ones(3, 4, dtype=torch.bfloat16))),
    ("scales", dict(scales=torch.ones(2, 5, dtype=torch.bfloat16))),
    ("scales", dict(scales=torch.ones(2, 3, dtype=torch.bfloat16))),
    ("seg_offsets", dict(seg_offsets=torch.tensor([0.0, 4.0, 4.0, 10.0]))),
    ("seg_offsets", dict(seg_offsets=torch.tensor([0, 4, 4, 11]))),
    ("seg_offsets", dict(seg_offsets=torch.tensor([0, 4, 3, 10]))),
    ("chunk", dict(chunk=0)),
    ("bits", dict(bits=5)),
    ("numel", dict(numel=-1)),
    ("divisor", dict(divisor=0.0)),
    ("divisor", dict(divisor=float("inf"))),
    ("divisor", dict(divisor=float("nan"))),
    ("divisor", dict(divisor=1e300)),
]


@pytest.mark.parametrize("arg,change", D_BAD, ids=[f"{a}-{i}" for i, (a, _) in enumerate(D_BAD)])
def test_dequantize_chunks_mean_errors_name_the_argument(arg, change):
    with pytest.raises(RuntimeError, match=f"dequantize_chunks_mean: argument '{arg}'"):
        ops.dequantize_chunks_mean(**{**_d_args(), **change})


def test_codec_opcheck():
    off = torch.tensor([0, 5, 5, 20, 21])
    vals = torch.randn(21)
    for bits in BITS:
        torch.library.opcheck(OPS.quantize_chunks, (vals, off, 4, bits, 7))
        packed, scales, _ = ops.quantize_chunks(vals, off, 4, bits, 7)
        torch.library.opcheck(OPS.dequantize_chunks_mean,
                              (torch.stack([packed, packed]), torch.stack([scales, scales]), off,
                               4, bits, 21, 2.0))


def test_codec_under_torch_compile():
    off = torch.tensor([0, 5, 5, 20, 21])
    vals = torch.randn(21)

    def f(v):
        p, s, e = ops.quantize_chunks(v, off, 4, 2, 7)
        return ops.dequantize_chunks_mean(p[None], s[None], off, 4, 2, 21, 1.0) + e

    torch.testing.assert_close(torch.compile(f, backend="eager", fullgraph=True)(vals), f(vals),
                               rtol=0, atol=0)


# ---------------------------------------------------------------------------
# Property tests
# ---------------------------------------------------------------------------

@st.composite
def layouts(draw):
    S = draw(st.integers(1, 7))
    counts = [draw(st.one_of(st.just(0), st.integers(1, 5), st.integers(0, 90)))
              for _ in range(S)]
    chunk = draw(st.one_of(st.integers(1, 9), st.sampled_from([16, 32, 64, 1000])))
    return counts, chunk


@SETTINGS
@given(layouts(), st.sampled_from(BITS), st.integers(1, 4),
       st.sampled_from(["random", "ties", "zeros", "tiny"]), st.integers(0, 2**31))
def test_codec_property(layout, bits, R, pattern, seed):
    """Whatever the layout: both ops equal the reference bit for bit, one row decodes to
    vals - error (to within a rounding), and the mean of R rows is their row-order sum
    divided by R."""
    counts, chunk = layout
    rng = np.random.default_rng(seed)
    K = sum(counts)
    vals = _values(K, rng, pattern)
    packed, scales, err = _quantize_both(vals, counts, chunk, bits)
    rows_p, rows_s = _rows(counts, chunk, bits, R - 1, rng, pattern) if R > 1 else (
        torch.empty(0, packed.numel(), dtype=torch.uint8),
        torch.empty(0, scales.numel(), dtype=torch.bfloat16))
    all_p, all_s = torch.cat([packed[None], rows_p]), torch.cat([scales[None], rows_s])
    mean = _dequant_both(all_p, all_s, counts, chunk, bits, R)
    off = _offsets(counts)
    one = [ops.dequantize_chunks_mean(all_p[r:r + 1], all_s[r:r + 1], off, chunk, bits, K, 1)
           for r in range(R)]
    _assert_sum_close(one[0], err, vals)
    acc = torch.zeros(K)
    for d in one:
        acc = acc + d
    assert_bit_equal(mean, acc.div_(R), "mean of rows")
