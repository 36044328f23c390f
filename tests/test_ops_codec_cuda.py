"""CUDA kernels of the codec ops (quantize_chunks, dequantize_chunks_mean) against
slimcomm.reference run on the GPU (skipped without a GPU).

The reference is the ATen sequence of the unfused codec, so on CUDA it rounds like
ATen's CUDA kernels (a division by a number is a multiplication by its fp32
reciprocal there): the CUDA kernels must match it bit for bit, i.e. the fused GPU
path gives the same results as the unfused one. The bits-1 sums run in value order
on both devices, so bits 1 and 2 (whose levels round the same either way) and
power-of-two divisors give the same bytes and values on the CPU and the GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from slimcomm import ops, reference as ref

from _ops_cases import assert_bit_equal as _bit_equal, assert_equal_nan


def assert_bit_equal(a, b, what=""):
    """Bit-equal floats (NaN payloads included), equal integers."""
    if a.is_floating_point():
        _bit_equal(a, b, what)
    else:
        assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype)
        assert torch.equal(a, b), f"{what}: values differ"

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

BITS = (1, 2, 4, 8)
LAYOUTS = [
    [5],
    [0, 0, 3],
    [1, 0, 7, 0, 0, 2, 13],
    [100, 0, 37, 4097, 5],
    [2**20 + 3, 0, 999, 64],
    [1] * 3000 + [0] * 7 + [70_000],
]


def _offsets(counts, device):
    o = np.concatenate([[0], np.cumsum(np.asarray(counts, dtype=np.int64))]).astype(np.int64)
    return torch.from_numpy(o).to(device)


def _values(K, rng, pattern):
    x = rng.standard_normal(K).astype(np.float32) * np.exp(rng.uniform(-4, 4, K)).astype(np.float32)
    if pattern == "ties":
        x = rng.choice(np.array([-1, -0.5, -0.25, 0, 0.25, 0.5, 0.75, 1], np.float32), K) * 4
    elif pattern == "zeros":
        x[rng.random(K) < 0.7] = 0
    elif pattern == "nonfinite" and K:
        x[rng.integers(0, K, 3)] = [np.nan, np.inf, -np.inf]
    return torch.from_numpy(x.astype(np.float32))


def _same(a, b, what, nan_ok):
    assert a.shape == b.shape and a.dtype == b.dtype, (what, a.shape, b.shape)
    a, b = a.cpu(), b.cpu()
    if nan_ok and a.is_floating_point():
        assert_equal_nan(a, b, what)
    else:
        assert_bit_equal(a, b, what)


@pytest.mark.parametrize("counts", LAYOUTS, ids=lambda c: f"S{len(c)}K{sum(c)}")
@pytest.mark.parametrize("chunk", [1, 7, 64, 4096])
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("pattern", ["random", "ties", "zeros", "nonfinite"])
def test_codec_cuda_matches_reference(counts, chunk, bits, pattern):
    if chunk == 1 and sum(counts) > 100_000:
        pytest.skip("the reference's per-value chunk plan is slow")
    rng = np.random.default_rng([bits, chunk, len(counts)])
    K, n = sum(counts), ops.chunk_count(counts, chunk)
    off = _offsets(counts, "cuda")
    nan_ok = pattern == "nonfinite"
    rows = []
    for r in range(3):
        vals = _values(K, rng, pattern if r == 0 else "random").cuda()
        got = ops.quantize_chunks(vals, off, chunk, bits, n)
        exp = ref.quantize_chunks(vals, off, chunk, bits, n)
        for name, a, b in zip(("packed", "scales", "error"), got, exp):
            _same(a, b, name, nan_ok)
        again = ops.quantize_chunks(vals, off, chunk, bits, n)
        for a, b in zip(got, again):
            _same(a, b, "deterministic", nan_ok)
        if bits <= 2 and not nan_ok:  # the same bytes as the CPU kernel
            for name, a, b in zip(("packed", "scales", "error"), got,
                                  ops.quantize_chunks(vals.cpu(), off.cpu(), chunk, bits, n)):
                _same(a, b, f"cpu {name}", False)
        rows.append(got)
    packed = torch.stack([g[0] for g in rows])
    scales = torch.stack([g[1] for g in rows])
    for R in (1, 2, 3):
        for divisor in (R, 4.0, 3.0):
            got = ops.dequantize_chunks_mean(packed[:R], scales[:R], off, chunk, bits, K, divisor)
            exp = ref.dequantize_chunks_mean(packed[:R], scales[:R], off, chunk, bits, K, divisor)
            _same(got, exp, f"mean R={R} /{divisor}", nan_ok)
            if bits <= 2 and not nan_ok and divisor in (1, 2, 4.0):
                cpu = ops.dequantize_chunks_mean(packed[:R].cpu(), scales[:R].cpu(), off.cpu(),
                                                 chunk, bits, K, divisor)
                _same(got, cpu, "cpu mean", False)


@pytest.mark.parametrize("bits", BITS)
def test_codec_cuda_strided_rows_and_any_bytes(bits):
    rng = np.random.default_rng(bits)
    counts, chunk, R = [70, 0, 33, 1, 200], 16, 3
    K, n = sum(counts), ops.chunk_count(counts, 16)
    B = (K * bits + 7) // 8
    wide = torch.from_numpy(rng.integers(0, 256, (R, 2 * n + B + 6), dtype=np.uint8))
    wide[:, :2 * n] = torch.from_numpy(rng.standard_normal((R, n)).astype(np.float32)).to(
        torch.bfloat16).view(torch.uint8)
    wide = wide.cuda()
    scales, packed = wide[:, :2 * n].view(torch.bfloat16), wide[:, 2 * n:]
    off = _offsets(counts, "cuda")
    got = ops.dequantize_chunks_mean(packed, scales, off, chunk, bits, K, R)
    _same(got, ref.dequantize_chunks_mean(packed, scales, off, chunk, bits, K, R), "mean", False)


def test_codec_cuda_empty_and_errors():
    p, s, e = ops.quantize_chunks(torch.empty(0, device="cuda"),
                                  torch.zeros(2, dtype=torch.int64, device="cuda"), 4, 2, 0)
    assert p.shape == s.shape == e.shape == (0,) and p.is_cuda
    with pytest.raises(RuntimeError, match="argument 'seg_offsets'"):
        ops.quantize_chunks(torch.randn(4, device="cuda"), torch.tensor([0, 4]), 4, 2, 1)
    with pytest.raises(RuntimeError, match="argument 'nchunks'"):
        ops.quantize_chunks(torch.randn(4, device="cuda"), torch.tensor([0, 4], device="cuda"),
                            4, 2, 2)
    with pytest.raises(RuntimeError, match="argument 'bits'"):
        ops.quantize_chunks(torch.randn(4, device="cuda"), torch.tensor([0, 4], device="cuda"),
                            4, 3, 1)


def test_codec_cuda_malformed_offsets_stay_in_bounds():
    """Offsets are not read on the host on CUDA: a malformed layout gives unspecified
    values, but the kernels finish without a fault."""
    vals = torch.randn(100, device="cuda")
    for o in ([0, 120, 50, 100], [5, 3, 100], [-4, 50, 200]):
        off = torch.tensor(o, device="cuda")
        p, s, _ = ops.quantize_chunks(vals, off, 8, 2, 13)
        ops.dequantize_chunks_mean(p[None], s[None], off, 8, 2, 100, 1.0)
    torch.cuda.synchronize()


def test_codec_cuda_opcheck():
    off = torch.tensor([0, 5, 5, 20, 21], device="cuda")
    vals = torch.randn(21, device="cuda")
    for bits in BITS:
        torch.library.opcheck(torch.ops.slimcomm.quantize_chunks, (vals, off, 4, bits, 7))
        p, s, _ = ops.quantize_chunks(vals, off, 4, bits, 7)
        torch.library.opcheck(torch.ops.slimcomm.dequantize_chunks_mean,
                              (torch.stack([p, p]), torch.stack([s, s]), off, 4, bits, 21, 2.0))
