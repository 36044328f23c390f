"""Typed wrappers around the ``torch.ops.slimcomm`` kernels.

Every function here is a thin, documented entry point to one registered op.
The op itself (schema in ``csrc/ops.cpp``) validates its arguments, so calling
``torch.ops.slimcomm.<name>`` directly is equally safe; the wrappers add type
hints, defaults and docstrings; the fake (meta) kernels that let
``torch.compile`` trace the ops live in :mod:`slimcomm._fake`, and the
wrappers of the compressor's fused step and low-bit codec in
:mod:`slimcomm._step_ops` (both imported here: ``slimcomm.ops.<name>`` is
every wrapper).

Conventions shared by all ops
-----------------------------
* Value tensors may be ``torch.float32``, ``torch.float16`` or
  ``torch.bfloat16``; arithmetic (scores, accumulation) is done in fp32.
* Index tensors are 1-D ``torch.int64``. Outputs that are index sets are
  sorted ascending.
* Output shapes depend only on the arguments (``k``, ``m``, index lengths),
  never on tensor contents, so the ops are traceable.
* Bad arguments raise ``RuntimeError`` (from ``TORCH_CHECK``) whose message
  names the offending argument; nothing is modified when an error is raised.
* Ops dispatch on the device of their tensor arguments. On a build without
  CUDA kernels (see ``python -m slimcomm.info``), calling an op on CUDA
  tensors raises an error that says so.

The semantics of every op are defined executably by the pure-PyTorch
versions in :mod:`slimcomm.reference`; the tests hold the kernels to them.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, Iterator, Optional, Sequence, TypeVar

import torch

from . import _C  # noqa: F401  (loads the kernel library and registers the ops)
from . import _fake  # noqa: F401  (registers the fake kernels torch.compile traces with)
from ._fake import _block_shape
from ._step_ops import (CODEC_BITS, chunk_count, dequantize_chunks_mean, quantize_chunks,  # noqa: F401
                        sgd_apply_indexed, step_commit, step_commit_local, step_encode,
                        step_undo)

__all__ = [
    "SCORES",
    "significance_topk",
    "significance_topk_segmented",
    "explore_sample",
    "explore_sample_segmented",
    "pack",
    "unpack",
    "gather_slices",
    "scatter_slices",
    "gather_slices_multi",
    "scatter_slices_multi",
    "slices_numel",
    "step_encode",
    "step_commit",
    "step_commit_local",
    "step_undo",
    "sgd_apply_indexed",
    "CODEC_BITS",
    "chunk_count",
    "quantize_chunks",
    "dequantize_chunks_mean",
    "trusted_indices",
    "run_trusted",
]

SCORES = ("product", "grad", "weight")
"""Accepted values of the ``score`` argument of the selection ops."""

_ops = torch.ops.slimcomm

_I64_MIN, _U64_END = -(1 << 63), 1 << 64


_F = TypeVar("_F", bound=Callable)


@contextlib.contextmanager
def trusted_indices() -> Iterator[None]:
    """Inside this block (on this thread), the CUDA kernels check index contents on the device.

    By default a CUDA op validates the *values* of its index arguments
    (``indices``, ``exclude``, IST ``rows``/``cols``) with one device reduction
    and one device-to-host read, so that a bad index raises a ``RuntimeError``
    naming the argument before anything is written: one host sync per op. Inside
    this block the check runs on the device instead (no host sync; a bad index
    stops the stream with a device-side trap, which loses the CUDA context, as
    an out-of-range index does in torch's own CUDA indexing ops). slimcomm's hot
    paths (the DDP comm hook, ``SlimDPOptimizer``'s synchronisation, IST) run in
    it, because their indices come from slimcomm's own selection ops (issue 12:
    no host sync in the steady-state step). Shapes, dtypes and size arguments
    are always checked on the host, from metadata. CPU kernels are unaffected.
    The environment variable ``SLIMCOMM_CUDA_CHECKS=device`` makes it the
    process-wide default. Thread-local; nests; restores the previous mode.
    """
    prev = _ops._cuda_checks("device")
    try:
        yield
    finally:
        _ops._cuda_checks(prev)


def run_trusted(fn: _F) -> _F:
    """``fn`` wrapped in :func:`trusted_indices` (for collective callbacks, which run on other threads)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with trusted_indices():
            return fn(*args, **kwargs)
    return wrapper  # type: ignore[return-value]


def _bits64(value: int, op: str, name: str) -> int:
    """A 64-bit seed/offset as the signed int64 the schema takes (same bit pattern).

    Accepts any Python int in ``[-2**63, 2**64)``: values ``>= 2**63`` are
    unsigned 64-bit patterns and map to their two's complement.
    """
    if isinstance(value, bool):
        raise RuntimeError(f"slimcomm.{op}: argument '{name}' must be an int, got bool")
    if not isinstance(value, int):
        try:
            value = int(value.__index__())  # numpy / torch integer scalars
        except (AttributeError, TypeError):
            raise RuntimeError(
                f"slimcomm.{op}: argument '{name}' must be an int, got {type(value).__name__}"
            ) from None
    if not _I64_MIN <= value < _U64_END:
        raise RuntimeError(
            f"slimcomm.{op}: argument '{name}' must be a 64-bit integer in "
            f"[-2**63, 2**64), got {value}"
        )
    return value - _U64_END if value >= (1 << 63) else value


# ---------------------------------------------------------------------------
# Selection (Slim-DP, arXiv 1709.09393, Sec. 3: significance = |w| x |g|)
# ---------------------------------------------------------------------------

def significance_topk(
    weight: torch.Tensor, grad: torch.Tensor, k: int, score: str = "product"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices and gradient values of the ``k`` most significant coordinates.

    Slim-DP (Sun et al., arXiv 1709.09393, Sec. 3.1) calls a parameter
    significant when ``|w| * |g|`` is large; the core set is the top-k by that
    score. The score is computed on the fly in fp32 and never materialised.

    Args:
        weight: 1-D tensor ``[N]``, fp32/fp16/bf16.
        grad: 1-D tensor ``[N]``, same dtype and device as ``weight``.
        k: number of coordinates to select, ``0 <= k <= N``.
        score: ``"product"`` = ``|w| * |g|`` (fp32), ``"grad"`` = ``|g|``,
            ``"weight"`` = ``|w|``.

    Returns:
        ``(indices, values)``: ``indices`` int64 ``[k]`` sorted ascending,
        ``values = grad[indices]`` ``[k]`` in ``grad``'s dtype.

    Ordering is that of ``torch.topk`` on the fp32 score with NaN ranked above
    ``+inf``; among equal scores the lowest index wins, so the selected set is
    fully determined by the inputs.

    Raises:
        RuntimeError: ``k`` negative or larger than ``N``; ``weight``/``grad``
            not 1-D, of different shapes, dtypes or devices, or not floating
            point; unknown ``score``.
    """
    return _ops.significance_topk(weight, grad, k, score)


def significance_topk_segmented(
    weight: torch.Tensor,
    grad: torch.Tensor,
    offsets: Sequence[int],
    ks: Sequence[int],
    score: str = "product",
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`significance_topk` over every segment of a flat buffer, in one call.

    A DDP bucket is a flat concatenation of parameters and Slim-DP selects per
    parameter; this op does the work of one call per segment.

    Args:
        weight, grad: 1-D ``[N]`` as in :func:`significance_topk`.
        offsets: ``S + 1`` non-decreasing ints with ``0 <= offsets[0]`` and
            ``offsets[S] <= N``; segment ``s`` is ``[offsets[s], offsets[s+1])``.
            Gaps between segments are allowed and ignored.
        ks: ``S`` ints, ``0 <= ks[s] <= offsets[s+1] - offsets[s]``.
        score: as in :func:`significance_topk`.

    Returns:
        ``(indices, values)`` of length ``sum(ks)``: the concatenation over
        segments of each segment's result, indices into the flat buffer
        (segment-local result + ``offsets[s]``), ascending within a segment.
        Each segment's part equals ``significance_topk`` on that segment alone.

    Raises:
        RuntimeError: as :func:`significance_topk`, plus malformed ``offsets``
            or ``ks`` (wrong length, decreasing, out of range).
    """
    return _ops.significance_topk_segmented(weight, grad, list(offsets), list(ks), score)


def explore_sample(
    n: int,
    exclude: torch.Tensor,
    m: int,
    seed: int,
    offset: int,
) -> torch.Tensor:
    """``m`` distinct indices of ``[0, n)`` outside ``exclude``, uniformly at random.

    The explore set of Slim-DP (arXiv 1709.09393, Sec. 3.2): coordinates that
    are insignificant now are still visited at random. Sampling is uniform
    without replacement and a pure function of the arguments (bit-identical
    on every process, thread count and device, independent of torch's global
    RNG). Definition, with ``a = n - len(exclude)`` non-excluded indices:

    1. ``t = m``, or ``t = a - m`` when ``2 * m > a`` (then the complement of
       the drawn set is returned); ``m == a`` returns everything left.
    2. Draw ``j = 0, 1, 2, ...`` takes the 64-bit key ``u_j`` from
       Philox4x32-10 with ``key = (seed & 0xffffffff, seed >> 32)`` and
       ``counter = (p & 0xffffffff, p >> 32, offset & 0xffffffff, offset >> 32)``,
       ``p = j >> 1`` (an even ``j`` takes ``out[0] << 32 | out[1]``, an odd
       one ``out[2] << 32 | out[3]``), and is the rank
       ``d_j = floor(u_j * a / 2**64)`` among the non-excluded indices.
    3. The first ``t`` distinct ranks drawn (or the other ``a - t``) are
       mapped to indices (rank ``r`` is the ``r``-th non-excluded index) and
       returned ascending.

    Work is ``O(t)`` Philox draws (``a * ln(a / (a - t)) <= 1.39 t``
    expected, since ``t <= a / 2``) plus a merge with ``exclude`` and either
    an ``a / 64``-word bitmap pass (when that is at most 16 words per draw and
    1 GiB, or for the complement) or a hash set and a sort of the ``t`` ranks,
    instead of a key per index. The first distinct values of i.i.d. uniform
    draws are a uniform ``t``-subset, so the sample is uniform.

    Args:
        n: size of the index range, ``n >= 0``.
        exclude: 1-D int64 tensor of indices to skip, strictly increasing,
            within ``[0, n)``. Its device selects the kernel (pass an empty
            tensor on the wanted device to exclude nothing).
        m: sample size, ``0 <= m <= n - len(exclude)``.
        seed: 64-bit seed, a Python int in ``[-2**63, 2**64)`` (a negative
            value and ``value + 2**64`` are the same bit pattern, the same seed).
        offset: 64-bit RNG stream offset, same range and convention as
            ``seed``; use a different one per step and per parameter to get
            independent samples.

    Returns:
        int64 tensor ``[m]`` sorted ascending, on ``exclude``'s device.

    Raises:
        RuntimeError: negative ``n``/``m``, ``m`` larger than what is left,
            ``exclude`` not 1-D int64, out of range, or not strictly increasing;
            ``seed``/``offset`` not an int in ``[-2**63, 2**64)``.
    """
    return _ops.explore_sample(
        n, exclude, m, _bits64(seed, "explore_sample", "seed"),
        _bits64(offset, "explore_sample", "offset"))


def explore_sample_segmented(
    offsets: Sequence[int],
    exclude: torch.Tensor,
    exclude_offsets: Sequence[int],
    ms: Sequence[int],
    seed: int,
    rng_offsets: Sequence[int],
) -> torch.Tensor:
    """:func:`explore_sample` for every segment of a flat buffer, in one call.

    Args:
        offsets: ``S + 1`` non-decreasing ints; segment ``s`` is
            ``[offsets[s], offsets[s+1])`` of a flat buffer.
        exclude: 1-D int64, the concatenation of each segment's excluded
            indices, given as indices into the flat buffer, strictly
            increasing within each segment and inside that segment.
        exclude_offsets: ``S + 1`` non-decreasing ints delimiting the part of
            ``exclude`` that belongs to each segment
            (``exclude_offsets[0] == 0``, ``exclude_offsets[S] == len(exclude)``).
        ms: ``S`` sample sizes.
        seed: as in :func:`explore_sample`.
        rng_offsets: ``S`` RNG offsets, one per segment.

    Returns:
        int64 ``[sum(ms)]``: concatenation over segments of
        ``explore_sample(n_s, exclude_s - offsets[s], ms[s], seed, rng_offsets[s])
        + offsets[s]``, i.e. draws use segment-local ranks.

    Raises:
        RuntimeError: as :func:`explore_sample` (``rng_offsets[s]`` named on a
            range error), plus malformed offsets.
    """
    op = "explore_sample_segmented"
    rng = [_bits64(o, op, f"rng_offsets[{i}]") for i, o in enumerate(rng_offsets)]
    return _ops.explore_sample_segmented(
        list(offsets), exclude, list(exclude_offsets), list(ms), _bits64(seed, op, "seed"), rng
    )


# ---------------------------------------------------------------------------
# Sparse pack / unpack
# ---------------------------------------------------------------------------

def pack(src: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Gather ``src[indices]`` into a new contiguous buffer.

    Args:
        src: 1-D ``[N]`` fp32/fp16/bf16.
        indices: 1-D int64 ``[K]``, each in ``[0, N)``, same device.

    Returns:
        ``[K]`` tensor of ``src``'s dtype.

    Raises:
        RuntimeError: non-1-D arguments, wrong index dtype, index out of
            range, mismatched devices.
    """
    return _ops.pack(src, indices)


def unpack(
    dst: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, accumulate: bool = False
) -> None:
    """Scatter ``values`` into ``dst`` at ``indices``, in place.

    ``dst[indices] = values`` or, with ``accumulate=True``,
    ``dst[indices] += values`` (sum in fp32, rounded once to ``dst``'s dtype).
    ``indices`` must be unique (as produced by the selection ops); with
    duplicates the result is unspecified.

    Args:
        dst: 1-D ``[N]`` fp32/fp16/bf16, modified in place.
        indices: 1-D int64 ``[K]`` in ``[0, N)``.
        values: 1-D ``[K]``, same dtype and device as ``dst``.

    Raises:
        RuntimeError: shape/dtype/device mismatch or index out of range
            (``dst`` is left untouched).
    """
    _ops.unpack(dst, indices, values, accumulate)


# ---------------------------------------------------------------------------
# Row/column slicing for independent subnet training (IST, arXiv 1910.02120)
# ---------------------------------------------------------------------------

def gather_slices(
    weight: torch.Tensor, rows: Optional[torch.Tensor], cols: Optional[torch.Tensor]
) -> torch.Tensor:
    """``weight[rows][:, cols]`` as one contiguous block.

    IST (Yuan et al., arXiv 1910.02120, Sec. 3) gives each worker the rows
    (output neurons) and columns (input neurons) of its block.

    Args:
        weight: 2-D ``[R, C]`` (or 1-D ``[R]``, then ``cols`` must be None),
            fp32/fp16/bf16.
        rows: 1-D int64 ``[r]`` in ``[0, R)``, or None for all rows.
        cols: 1-D int64 ``[c]`` in ``[0, C)``, or None for all columns.

    Returns:
        contiguous ``[r, c]`` (or ``[r]``) tensor of ``weight``'s dtype.

    Raises:
        RuntimeError: index out of range, wrong dtype/rank, device mismatch.
    """
    return _ops.gather_slices(weight, rows, cols)


def scatter_slices(
    weight: torch.Tensor,
    rows: Optional[torch.Tensor],
    cols: Optional[torch.Tensor],
    block: torch.Tensor,
) -> None:
    """Write ``block`` back into ``weight[rows][:, cols]`` in place.

    Inverse of :func:`gather_slices`; ``rows`` and ``cols`` must be unique.

    Args:
        weight: 2-D ``[R, C]`` or 1-D ``[R]``, modified in place.
        rows, cols: as in :func:`gather_slices`.
        block: ``[r, c]`` (or ``[r]``), same dtype and device as ``weight``.

    Raises:
        RuntimeError: shape mismatch of ``block``, index out of range, dtype
            or device mismatch (``weight`` is left untouched).
    """
    _ops.scatter_slices(weight, rows, cols, block)


def gather_slices_multi(
    weights: Sequence[torch.Tensor],
    rows: Sequence[Optional[torch.Tensor]],
    cols: Sequence[Optional[torch.Tensor]],
) -> torch.Tensor:
    """Gather many slices into ONE flat buffer (so one collective moves a subnet).

    Args:
        weights: ``T`` tensors (1-D or 2-D), all of one dtype and device.
        rows, cols: ``T`` entries each, as in :func:`gather_slices`.

    Returns:
        1-D tensor ``[sum of block sizes]``: block ``t`` flattened row-major,
        blocks in list order (see :func:`slices_numel`).

    Raises:
        RuntimeError: lists of different lengths, mixed dtypes/devices, or any
            error of :func:`gather_slices` (naming the list position).
    """
    if len(weights) == 0:  # torch's dispatcher rejects an empty Tensor[] before our check
        raise RuntimeError("slimcomm.gather_slices_multi: argument 'weights' must not be empty")
    return _ops.gather_slices_multi(list(weights), list(rows), list(cols))


def scatter_slices_multi(
    weights: Sequence[torch.Tensor],
    rows: Sequence[Optional[torch.Tensor]],
    cols: Sequence[Optional[torch.Tensor]],
    buffer: torch.Tensor,
) -> None:
    """Inverse of :func:`gather_slices_multi`: write every block back in place.

    Args:
        weights, rows, cols: as in :func:`gather_slices_multi`.
        buffer: 1-D, exactly ``slices_numel(weights, rows, cols)`` elements,
            same dtype and device as the weights.

    Raises:
        RuntimeError: wrong ``buffer`` size, or any error of
            :func:`scatter_slices` (no weight is modified then).
    """
    _ops.scatter_slices_multi(list(weights), list(rows), list(cols), buffer)


def slices_numel(
    weights: Sequence[torch.Tensor],
    rows: Sequence[Optional[torch.Tensor]],
    cols: Sequence[Optional[torch.Tensor]],
) -> int:
    """Number of elements :func:`gather_slices_multi` returns for these slices.

    Args:
        weights, rows, cols: as in :func:`gather_slices_multi` (only shapes
            are read; index values are checked by the ops themselves).

    Returns:
        ``sum over t of r_t * c_t`` (``r_t`` for a 1-D weight).

    Raises:
        RuntimeError: lists of different lengths, a weight that is not 1-D
            or 2-D, ``cols[t]`` given for a 1-D weight.
    """
    op = "slices_numel"
    for name, seq in (("rows", rows), ("cols", cols)):
        if len(seq) != len(weights):
            raise RuntimeError(f"slimcomm.{op}: argument '{name}' has {len(seq)} entries but "
                               f"'weights' has {len(weights)}")
    total = 0
    for t, (w, r, c) in enumerate(zip(weights, rows, cols)):
        if w.dim() not in (1, 2):
            raise RuntimeError(f"slimcomm.{op}: argument 'weights[{t}]' must be 1-D or 2-D, "
                               f"got shape {list(w.shape)}")
        if w.dim() == 1 and c is not None:
            raise RuntimeError(f"slimcomm.{op}: argument 'cols[{t}]' must be None for a 1-D "
                               f"weight")
        n = 1
        for d in _block_shape(w, r, c):
            n *= d
        total += n
    return total
