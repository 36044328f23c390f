"""Shared input generators for the slimcomm op tests (CPU and CUDA).

Everything here is deterministic (numpy Generators with fixed seeds) so a
failing case can be reproduced from its pytest id alone.
"""

from __future__ import annotations

import numpy as np
import torch

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SIZES = [0, 1, 2, 7, 1000, 2**20 + 3]
SCORES = ["product", "grad", "weight"]
PATTERNS = ["random", "ties", "equal", "zeros", "nonfinite"]

_INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16,
             torch.int64: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bit pattern of ``t`` (NaN-aware exact comparison via ``torch.equal``)."""
    return t.contiguous().view(_INT_VIEW[t.dtype])


def assert_bit_equal(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    assert actual.dtype == expected.dtype, (what, actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    assert torch.equal(bits(actual), bits(expected)), f"{what}: values differ"


def assert_equal_nan(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """Bit-equal except that any NaN matches any NaN (for results of arithmetic,
    where the NaN payload depends on the conversion routine, not on the op)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    na, ne = torch.isnan(actual), torch.isnan(expected)
    assert torch.equal(na, ne), f"{what}: NaN positions differ"
    assert torch.equal(bits(actual)[~na], bits(expected)[~ne]), f"{what}: values differ"


def ks_for(n: int) -> list[int]:
    """k (or m) at 0, 1, n-1, n and a middle value, restricted to valid ones."""
    return sorted({k for k in (0, 1, n // 100, n // 3, n - 1, n) if 0 <= k <= n})


def make_pair(n: int, dtype: torch.dtype, pattern: str, seed: int = 0):
    """(weight, grad) of length n in ``dtype`` following ``pattern``.

    random:    normal values (fp16/bf16 rounding already makes some ties);
    ties:      values from a tiny set, so most scores tie;
    equal:     every score equal (weight = grad = 1);
    zeros:     all zeros;
    nonfinite: random with NaN, +inf and -inf sprinkled in, including
               positions where weight is 0 and grad is inf (0 * inf = NaN).
    """
    rng = np.random.default_rng(seed * 1000 + n)
    if pattern == "random":
        w = rng.standard_normal(n)
        g = rng.standard_normal(n) * 1e-3
    elif pattern == "ties":
        w = rng.integers(-3, 4, n).astype(np.float64)
        g = rng.integers(-2, 3, n).astype(np.float64) * 0.5
    elif pattern == "equal":
        w = np.ones(n)
        g = -np.ones(n)
    elif pattern == "zeros":
        w = np.zeros(n)
        g = np.zeros(n)
    elif pattern == "nonfinite":
        w = rng.standard_normal(n)
        g = rng.standard_normal(n)
        if n:
            for arr, vals in ((w, (np.nan, np.inf, -np.inf, 0.0)), (g, (np.nan, np.inf, -np.inf, 0.0))):
                pos = rng.choice(n, size=max(1, n // 50), replace=True)
                arr[pos] = rng.choice(vals, size=len(pos))
            # 0 * inf = NaN in the product score, at a known position.
            j = int(rng.integers(n))
            w[j], g[j] = 0.0, np.inf
    else:
        raise ValueError(pattern)
    wt = torch.from_numpy(w).to(dtype)
    gt = torch.from_numpy(g).to(dtype)
    return wt, gt


def make_exclude(n: int, kind: str, seed: int = 0) -> torch.Tensor:
    """A sorted, unique int64 exclude list for ``[0, n)``."""
    rng = np.random.default_rng(seed + 7 * n)
    if kind == "none" or n == 0:
        ex = np.empty(0, dtype=np.int64)
    elif kind == "random":
        ex = np.sort(rng.choice(n, size=n // 4, replace=False))
    elif kind == "prefix":
        ex = np.arange(n // 2)
    elif kind == "all_but_one":
        keep = int(rng.integers(n))
        ex = np.delete(np.arange(n), keep)
    else:
        raise ValueError(kind)
    return torch.from_numpy(ex.astype(np.int64))


def make_layout(rng: np.random.Generator, n_segments: int, allow_large: bool = True):
    """A random segment layout: (offsets, total length) with empty segments,
    gaps, one-element segments and, optionally, segments over 16384 elements."""
    lengths = []
    for _ in range(n_segments):
        kind = rng.integers(5 if allow_large else 4)
        if kind == 0:
            lengths.append(0)
        elif kind == 1:
            lengths.append(1)
        elif kind == 2:
            lengths.append(int(rng.integers(2, 200)))
        elif kind == 3:
            lengths.append(int(rng.integers(200, 16384)))
        else:
            lengths.append(int(rng.integers(16385, 70000)))
    # Segments are [offsets[s], offsets[s+1]), so they abut; the gaps are a
    # leading and a trailing run of the buffer that belongs to no segment
    # (a gap inside is a segment with k = 0, which the counts also produce).
    offsets = [int(rng.integers(0, 5))]
    for ln in lengths:
        offsets.append(offsets[-1] + ln)
    total = offsets[-1] + int(rng.integers(0, 5))
    return offsets, total


def counts_for(rng: np.random.Generator, offsets, avail=None):
    """Per-segment k/m: 0, all, 1 or random, each valid for its segment."""
    out = []
    for s in range(len(offsets) - 1):
        n = (offsets[s + 1] - offsets[s]) if avail is None else avail[s]
        choice = rng.integers(4)
        if n == 0 or choice == 0:
            out.append(0)
        elif choice == 1:
            out.append(n)
        elif choice == 2:
            out.append(1)
        else:
            out.append(int(rng.integers(0, n + 1)))
    return out


TIED_KINDS = ["zero_grad", "zero_weight", "all_zero", "levels", "sparse", "late_top", "spread_top"]


def make_tied(n: int, kind: str, dtype: torch.dtype = torch.float32, seed: int = 0):
    """(weight, grad) of length n whose product scores are massively tied.

    zero_grad:   random weight, all-zero gradient (every product score 0);
    zero_weight: all-zero weight (a zero-initialised layer), random gradient;
    all_zero:    both zero;
    levels:      weight 1, gradient from {0, 1, 2, 3} (four distinct scores);
    sparse:      random, with 90% of the gradient zero;
    late_top:    first half random in (0, 1), second half all equal to 2 (the
                 top ties sit in the last chunks);
    spread_top:  random in (0, 1) with 10% of the entries, spread out, equal
                 to 2 (a tie group larger than k, spread over every chunk).
    """
    rng = np.random.default_rng(seed * 1000 + n + 17)
    w = rng.standard_normal(n)
    g = rng.standard_normal(n) * 1e-3
    if kind == "zero_grad":
        g[:] = 0.0
    elif kind == "zero_weight":
        w[:] = 0.0
    elif kind == "all_zero":
        w[:] = 0.0
        g[:] = 0.0
    elif kind == "levels":
        w[:] = 1.0
        g = rng.integers(0, 4, n).astype(np.float64)
    elif kind == "sparse":
        g[rng.random(n) < 0.9] = 0.0
    elif kind == "late_top":
        w[:] = 1.0
        g = rng.random(n)
        g[n // 2:] = 2.0
    elif kind == "spread_top":
        w[:] = 1.0
        g = rng.random(n)
        g[rng.random(n) < 0.1] = 2.0
    else:
        raise ValueError(kind)
    return torch.from_numpy(w).to(dtype), torch.from_numpy(g).to(dtype)


def tie_ks(w: torch.Tensor, g: torch.Tensor, score: str) -> list[int]:
    """k values around every large tie group of the score: just before, at the
    start, inside, at the end and just after the group in (score desc, index
    asc) order, plus 1%, n/3 and n - 5 (the histogram path)."""
    from slimcomm import reference as ref
    n = w.numel()
    s = ref.score_of(w, g, score)
    vals, counts = torch.unique(s, return_counts=True)
    ks = {1, n // 100, n // 3, n - 5}
    for v, c in zip(vals.tolist(), counts.tolist()):
        if c < 100:
            continue
        gt = int((s > v).sum())
        ks.update({gt - 1, gt, gt + 1, gt + c // 2, gt + c - 1, gt + c, gt + c + 1})
    return sorted(k for k in ks if 0 < k < n)
