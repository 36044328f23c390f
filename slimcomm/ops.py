"""Typed wrappers around the ``torch.ops.slimcomm`` kernels.

Every function here is a thin, documented entry point to one registered op.
The op itself (schema in ``csrc/ops.cpp``) validates its arguments, so calling
``torch.ops.slimcomm.<name>`` directly is equally safe; the wrappers add type
hints, defaults and docstrings, and the fake (meta) kernels that let
``torch.compile`` trace the ops live next to them.

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
from typing import Callable, Iterator, Optional, Sequence, Tuple, TypeVar

import torch

from . import _C  # noqa: F401  (loads the kernel library and registers the ops)

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



# ---------------------------------------------------------------------------
# The fused Slim-DP step (arXiv 1709.09393, Sec. 3; slimcomm.compressor)
# ---------------------------------------------------------------------------
#
# One group (a DDP bucket, a run of pseudo-gradients) is a flat buffer of S
# segments (parameters), segment s = [offsets[s], offsets[s + 1]). These four
# ops do, each in one dispatched call whatever S is and without a host sync,
# what the compressor did with ~50 elementwise/segmented ATen ops per group.
# Indices are bucket-flat, unique within a call (as the selection ops produce
# them; duplicates give unspecified results) and in [0, N): checked on CPU;
# on CUDA they are not range-checked (that would need a host sync) and an
# out-of-range index trips a device-side assertion. ``offsets`` contents
# (0 = o[0] <= ... <= o[S] = N) are likewise checked on CPU only.

def step_encode(
    buf: torch.Tensor,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    world_size: int,
    wire_dtype: torch.dtype,
    acc: Optional[torch.Tensor] = None,
    residual: Optional[torch.Tensor] = None,
    scale: Optional[torch.Tensor] = None,
    error_decay: float = 1.0,
    accumulate: bool = True,
    clip: Optional[float] = None,
) -> torch.Tensor:
    """This rank's Slim-DP payload, error feedback included, in one op.

    1. With ``acc`` and ``accumulate``: ``acc = buf + error_decay * scale *
       residual`` in fp32 (error feedback, Slim-DP Sec. 3 / DGC; the scale only
       with a GradScaler). With ``accumulate=False`` ``acc`` already holds it
       (the local index mode scores on it first). Without ``acc`` the values
       are ``buf`` itself (no error feedback).
    2. Per segment ``s`` a flag of ``buf`` (this rank's new values): NaN if a
       value is NaN/inf, else 1 if any is nonzero, else 0.
    3. ``wire = [v | flags]`` in ``wire_dtype`` with ``v = acc[indices] /
       world_size``; with ``clip`` (the fp16 saturation limit) ``v`` is
       clamped to ``[-clip, clip]``.
    4. ``acc[indices] = world_size * (unclamped v - clamped v)`` (0 without
       ``clip``): what was not sent stays in the residual; then, with
       ``scale``, ``acc /= scale`` (the residual is kept unscaled).

    Bit-identical to the ATen sequence it replaces (``reference.step_encode``) on
    the same device: on CUDA the division by ``world_size`` is, as in ATen's CUDA
    division by a Python number, a multiplication by its fp32 reciprocal (the
    same as the CPU's true division for a power-of-two world size); the
    accumulations with ``error_decay != 1`` or a ``scale`` run the ATen op itself.

    Args:
        buf: 1-D ``[N]`` fp32/fp16/bf16, contiguous (not modified).
        indices: 1-D int64 ``[k]``, the index set (bucket-flat, unique).
        offsets: 1-D int64 ``[S + 1]`` on ``buf``'s device.
        world_size: ``>= 1``, the divisor of the values.
        wire_dtype: fp32, fp16 or bf16.
        acc: fp32 ``[N]`` contiguous, written (must not alias the others).
        residual: fp32 ``[N]``; required exactly when ``acc`` is given and
            ``accumulate`` is True.
        scale: fp32 one-element tensor (the loss scale) or None.
        error_decay: the residual's weight, in ``(0, 1]``.
        accumulate: compute ``acc`` (True) or read it (False).
        clip: ``> 0`` saturation limit, or None.

    Returns:
        ``[k + S]`` tensor of ``wire_dtype``: values then flags.

    Raises:
        RuntimeError: wrong dtypes, shapes or devices, ``residual`` given
            without ``acc`` (or missing), ``world_size < 1``, ``clip <= 0``,
            an index out of range or malformed ``offsets`` (CPU); the message
            names the argument.
    """
    return _ops.step_encode(buf, indices, offsets, world_size, wire_dtype, acc, residual, scale,
                            float(error_decay), accumulate, clip)


def step_commit(
    buf: torch.Tensor,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    avg: torch.Tensor,
    counter: torch.Tensor,
    G: Optional[torch.Tensor] = None,
    acc: Optional[torch.Tensor] = None,
    residual: Optional[torch.Tensor] = None,
    scale: Optional[torch.Tensor] = None,
    keep_all_zero: bool = False,
    return_old_g: bool = False,
    void_in: Optional[torch.Tensor] = None,
) -> tuple:
    """Apply the summed payload of :func:`step_encode` (shared index set), in one op.

    Per segment ``s``: ``fl`` = the summed flag (``avg[k + s]``), ``fin`` = ``fl``
    finite and every value of ``s`` (``avg[j]`` for ``indices[j]`` in ``s``, cast
    to ``buf``'s dtype) finite. Policy ``keep_all_zero=False``: ``keep = fl is
    not NaN``, ``good = fin``, bad = not good. ``keep_all_zero=True`` (DDP: a
    parameter no rank used is exactly zero everywhere): ``keep = fl > 0``,
    ``good = keep and fin``, bad = not good and ``fl != 0``.

    * ``buf`` = zeros with ``avg[:k]`` (cast) at ``indices``, in the kept
      segments; ``fl * 0`` (NaN where flagged, else 0) in the others.
    * ``G[indices] = avg[:k] / scale`` (fp32; no scale: unscaled) where good.
    * ``acc`` (the residual-to-be) = ``residual`` in the segments that are not
      good.
    * ``counter[0] += number of bad segments``.

    Args:
        buf: 1-D ``[N]`` fp32/fp16/bf16, contiguous, overwritten.
        indices: 1-D int64 ``[k]`` (any order, unique).
        offsets: 1-D int64 ``[S + 1]`` on ``buf``'s device.
        avg: ``[k + S]`` fp32/fp16/bf16, the all-reduced payload.
        counter: int64 ``[>= 2]``, element 0 incremented.
        G: fp32 ``[N]`` or None (no ``G`` update).
        acc, residual: fp32 ``[N]``, both or neither.
        scale: fp32 one-element tensor or None.
        keep_all_zero: the policy above.
        return_old_g: return ``G[indices]`` as it was before (needs ``G``).
        void_in: bool one-element tensor or None, ORed into the result.

    Returns:
        ``(old_g, void)``: fp32 ``[k]`` (``[0]`` unless ``return_old_g``) and a
        0-d bool tensor, ``void_in or (some segment bad)``.

    Raises:
        RuntimeError: wrong dtypes, shapes or devices (``avg`` not ``k + S``
            long, ``acc`` without ``residual``, ``return_old_g`` without ``G``),
            an index out of range or malformed ``offsets`` (CPU); the message
            names the argument.
    """
    return _ops.step_commit(buf, indices, offsets, avg, counter, G, acc, residual, scale,
                            keep_all_zero, return_old_g, void_in)


def step_commit_local(
    buf: torch.Tensor,
    all_indices: torch.Tensor,
    all_values: torch.Tensor,
    offsets: torch.Tensor,
    world_size: int,
    counter: torch.Tensor,
    acc: Optional[torch.Tensor] = None,
    residual: Optional[torch.Tensor] = None,
    keep_all_zero: bool = False,
    void_in: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Apply the all-gathered (index, value) pairs of the local index mode, in one op.

    ``buf`` = the sum over the ranks ``r = 0 .. W-1``, in this order and in fp32,
    of rank ``r``'s values ``all_values[r, :k]`` scattered at
    ``all_indices[r]`` (top-k / DGC baseline), cast to ``buf``'s dtype. Then as
    :func:`step_commit` with ``fl`` = the sum of the ranks' flags
    ``all_values[r, k:]``, ``fin`` = every element of the segment of ``buf``
    finite, kept segments left as summed, and no ``G``.

    Args:
        buf: 1-D ``[N]`` fp32/fp16/bf16, contiguous, overwritten.
        all_indices: int64 ``[W * k]``, rank-major (each rank's unique).
        all_values: ``[W * (k + S)]`` fp32/fp16/bf16, rank-major, each rank's
            :func:`step_encode` payload.
        offsets: 1-D int64 ``[S + 1]`` on ``buf``'s device.
        world_size: ``W >= 1``.
        counter: int64 ``[>= 2]``, element 0 incremented by the bad count.
        acc, residual: fp32 ``[N]``, both or neither.
        keep_all_zero: as in :func:`step_commit`.
        void_in: bool one-element tensor or None, ORed into the result.

    Returns:
        0-d bool tensor: ``void_in or (some segment bad)``.

    Raises:
        RuntimeError: sizes not ``W * k`` / ``W * (k + S)``, wrong dtypes or
            devices, an index out of range (CPU); the message names the argument.
    """
    return _ops.step_commit_local(buf, all_indices, all_values, offsets, world_size, counter,
                                  acc, residual, keep_all_zero, void_in)


def step_undo(
    void_flag: torch.Tensor,
    residual: Optional[torch.Tensor] = None,
    spare: Optional[torch.Tensor] = None,
    G: Optional[torch.Tensor] = None,
    indices: Optional[torch.Tensor] = None,
    old_g: Optional[torch.Tensor] = None,
    counter: Optional[torch.Tensor] = None,
) -> None:
    """Undo a committed step where ``void_flag`` is set, in one op, without a host sync.

    Where ``void_flag`` (a GradScaler skipped the step, so nothing sent was applied):
    ``residual = spare`` (the old residual) and ``G[indices] = old_g``. Always:
    ``counter[1] += void_flag``.

    Args:
        void_flag: bool one-element tensor.
        residual, spare: fp32 ``[N]``, both or neither.
        G: fp32 ``[N]``; indices: int64 ``[k]``; old_g: fp32 ``[k]``; all three or
            none.
        counter: int64 ``[>= 2]`` or None.

    Raises:
        RuntimeError: arguments given without their partners, wrong dtypes,
            shapes or devices, an index out of range (CPU).
    """
    _ops.step_undo(void_flag, residual, spare, G, indices, old_g, counter)


# ---------------------------------------------------------------------------
# The low-bit value codec (SlimDPCompressor with value_bits)
# ---------------------------------------------------------------------------

CODEC_BITS = (1, 2, 4, 8)
"""Accepted values of the ``bits`` argument of the codec ops."""


def chunk_count(counts: Sequence[int], chunk: int) -> int:
    """Number of chunks of ``chunk`` values that segments of ``counts`` values make.

    Each segment is cut on its own (its last chunk may be short; an empty segment
    makes none): ``sum(ceil(c / chunk))``. A host-side helper: the codec ops take
    the count as an argument (their output shapes must not depend on tensor
    contents) and check it against ``seg_offsets`` on the CPU.

    Raises:
        ValueError: ``chunk < 1`` or a negative count.
    """
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk!r}")
    if any(c < 0 for c in counts):
        raise ValueError(f"counts must be >= 0, got {list(counts)!r}")
    return sum(-(-int(c) // chunk) for c in counts)


def quantize_chunks(
    vals: torch.Tensor,
    seg_offsets: torch.Tensor,
    chunk: int,
    bits: int,
    nchunks: int,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-chunk scaled low-bit codes of ``vals``, packed, with their rounding error.

    ``vals`` is segment-contiguous: segment ``s`` holds ``vals[o[s]:o[s + 1]]``
    (``o = seg_offsets``, possibly empty). Each segment is cut into chunks of
    ``chunk`` values (the last one may be short), numbered in order over all
    segments; each chunk gets one bf16 scale and each value one ``bits``-bit code:

    * ``bits = 1``: scale = ``bf16(sum |x| / size)`` (the fp32 sum accumulated
      in value order), code = ``x / d >= 0``; level ``2c - 1`` (scaled sign:
      1-bit SGD, Seide et al. 2014; EF-signSGD, Karimireddy et al. 2019);
    * ``bits = 2``: scale = ``bf16(max |x|)``, code = ``clamp(round((x / d + 1)
      * 1.5), 0, 3)``; level ``c / 1.5 - 1``, i.e. ``{-1, -1/3, 1/3, 1}``;
    * ``bits = 4, 8``: scale = ``bf16(max |x|)``, code = ``clamp(round(x / d *
      L), -L, L) + L`` with ``L = 2**(bits-1) - 1``; level ``(c - L) / L``;

    with ``d = max(float(scale), 1e-30)``, round half to even, and the decoded
    value ``level * float(scale)``. Codes are packed ``8 // bits`` per byte, low
    bits first, over all ``K`` values (zero codes pad the last byte).

    A chunk holding NaN or inf gets a non-finite scale (NaN if any NaN), so its
    values decode to non-finite values (a NaN ``x / d`` gets the lowest code);
    other chunks are unaffected. Divisions by a number (``1.5``, ``L``) are true
    divisions on the CPU and multiplications by the fp32 reciprocal on CUDA, as
    in ATen's kernels (``reference.quantize_chunks`` run on the same device is
    bit-identical; bits 4/8 levels may differ in the last bit between devices).

    Args:
        vals: fp32 ``[K]``.
        seg_offsets: int64 ``[S + 1]`` on ``vals``' device, ``0 = o[0] <= ... <=
            o[S] = K``.
        chunk: values per chunk, ``>= 1``.
        bits: one of :data:`CODEC_BITS`.
        nchunks: the number of chunks, :func:`chunk_count` of the segment sizes.

    Returns:
        ``(packed, scales, error)``: uint8 ``[ceil(K * bits / 8)]``, bf16
        ``[nchunks]``, and fp32 ``[K]`` = ``vals - decoded`` (the rounding error,
        for error feedback).

    Raises:
        RuntimeError: ``vals`` not fp32 or not 1-D, ``seg_offsets`` not 1-D
            int64 or on another device, ``chunk < 1``, ``bits`` not in
            :data:`CODEC_BITS`, ``nchunks`` impossible for ``K`` and ``S``; on the
            CPU also ``seg_offsets`` not ``0 .. K`` non-decreasing or ``nchunks``
            not what it makes (on CUDA its contents are not read on the host:
            malformed offsets give unspecified values, never an out-of-bounds
            access). The message names the argument.
    """
    return _ops.quantize_chunks(vals, seg_offsets, chunk, bits, nchunks)


def dequantize_chunks_mean(
    packed: torch.Tensor,
    scales: torch.Tensor,
    seg_offsets: torch.Tensor,
    chunk: int,
    bits: int,
    numel: int,
    divisor: float,
) -> torch.Tensor:
    """Decode every row of :func:`quantize_chunks` output and average them.

    ``out = (((0 + dec(row 0)) + dec(row 1)) + ... + dec(row R-1)) / divisor``
    in fp32: the rows are added one by one in row (rank) order, starting from
    ``+0``, so every rank that decodes the same bytes gets a bit-identical mean.
    ``dec(row r)`` is ``level(code) * float(scale)`` as in :func:`quantize_chunks`.
    The division is a true division on the CPU and a multiplication by the fp32
    reciprocal on CUDA (ATen's rounding for a division by a number on each).

    Args:
        packed: uint8 ``[R, B]`` with ``B >= ceil(numel * bits / 8)`` (extra bytes
            are ignored); rows may be strided (e.g. a view of an all-gathered
            buffer) as long as each row is contiguous.
        scales: bf16 ``[R, nchunks]`` on ``packed``'s device, rows likewise.
        seg_offsets: int64 ``[S + 1]``, the layout of :func:`quantize_chunks`.
        chunk: values per chunk, ``>= 1``.
        bits: one of :data:`CODEC_BITS`.
        numel: ``K >= 0``, values per row.
        divisor: finite, nonzero (e.g. the world size).

    Returns:
        fp32 ``[numel]``.

    Raises:
        RuntimeError: wrong dtypes, ranks or devices, ``scales`` rows not those
            of ``packed``, ``packed`` too narrow, ``nchunks`` impossible, ``chunk <
            1``, ``bits`` not in :data:`CODEC_BITS`, ``numel < 0``, ``divisor`` zero
            or non-finite; on the CPU also malformed ``seg_offsets`` or
            ``scales.shape[1]`` not the chunk count they make. The message names
            the argument.
    """
    return _ops.dequantize_chunks_mean(packed, scales, seg_offsets, chunk, bits, numel,
                                       float(divisor))


# ---------------------------------------------------------------------------
# Fake (meta) kernels: output shapes from the arguments alone.
# ---------------------------------------------------------------------------

@torch.library.register_fake("slimcomm::significance_topk")
def _(weight, grad, k, score="product"):
    return weight.new_empty((k,), dtype=torch.int64), grad.new_empty((k,))


@torch.library.register_fake("slimcomm::significance_topk_segmented")
def _(weight, grad, offsets, ks, score="product"):
    total = sum(ks)
    return weight.new_empty((total,), dtype=torch.int64), grad.new_empty((total,))


@torch.library.register_fake("slimcomm::explore_sample")
def _(n, exclude, m, seed, offset):
    return exclude.new_empty((m,), dtype=torch.int64)


@torch.library.register_fake("slimcomm::explore_sample_segmented")
def _(offsets, exclude, exclude_offsets, ms, seed, rng_offsets):
    return exclude.new_empty((sum(ms),), dtype=torch.int64)


@torch.library.register_fake("slimcomm::pack")
def _(src, indices):
    return src.new_empty((indices.shape[0],))


@torch.library.register_fake("slimcomm::unpack")
def _(dst, indices, values, accumulate=False):
    return None


def _block_shape(w, r, c):
    nr = w.shape[0] if r is None else r.shape[0]
    if w.dim() == 1:
        return (nr,)
    return (nr, w.shape[1] if c is None else c.shape[0])


@torch.library.register_fake("slimcomm::gather_slices")
def _(weight, rows, cols):
    return weight.new_empty(_block_shape(weight, rows, cols))


@torch.library.register_fake("slimcomm::scatter_slices")
def _(weight, rows, cols, block):
    return None


@torch.library.register_fake("slimcomm::gather_slices_multi")
def _(weights, rows, cols):
    total = 0
    for w, r, c in zip(weights, rows, cols):
        n = 1
        for d in _block_shape(w, r, c):
            n = n * d
        total = total + n
    return weights[0].new_empty((total,))


@torch.library.register_fake("slimcomm::scatter_slices_multi")
def _(weights, rows, cols, buffer):
    return None


@torch.library.register_fake("slimcomm::step_encode")
def _(buf, indices, offsets, world_size, wire_dtype, acc=None, residual=None, scale=None,
      error_decay=1.0, accumulate=True, clip=None):
    return buf.new_empty((indices.shape[0] + offsets.shape[0] - 1,), dtype=wire_dtype)


@torch.library.register_fake("slimcomm::step_commit")
def _(buf, indices, offsets, avg, counter, G=None, acc=None, residual=None, scale=None,
      keep_all_zero=False, return_old_g=False, void_in=None):
    k = indices.shape[0] if return_old_g else 0
    return buf.new_empty((k,), dtype=torch.float32), buf.new_empty((), dtype=torch.bool)


@torch.library.register_fake("slimcomm::step_commit_local")
def _(buf, all_indices, all_values, offsets, world_size, counter, acc=None, residual=None,
      keep_all_zero=False, void_in=None):
    return buf.new_empty((), dtype=torch.bool)


@torch.library.register_fake("slimcomm::step_undo")
def _(void_flag, residual=None, spare=None, G=None, indices=None, old_g=None, counter=None):
    return None


@torch.library.register_fake("slimcomm::quantize_chunks")
def _(vals, seg_offsets, chunk, bits, nchunks):
    K = vals.shape[0]
    return (vals.new_empty(((K * bits + 7) // 8,), dtype=torch.uint8),
            vals.new_empty((nchunks,), dtype=torch.bfloat16),
            vals.new_empty((K,), dtype=torch.float32))


@torch.library.register_fake("slimcomm::dequantize_chunks_mean")
def _(packed, scales, seg_offsets, chunk, bits, numel, divisor):
    return packed.new_empty((numel,), dtype=torch.float32)
