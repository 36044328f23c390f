"""Typed wrappers of the compressor's per-group kernels: the fused Slim-DP step and the low-bit codec.

Part of :mod:`slimcomm.ops` (which re-exports every name here; call them as
``slimcomm.ops.step_encode``, ...): the four ops of one synchronisation step of
a group (encode, commit, commit of all-gathered pairs, undo of a voided step)
and the chunked low-bit value codec behind ``value_bits``. The conventions of
:mod:`slimcomm.ops` apply.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from . import _C  # noqa: F401  (loads the kernel library and registers the ops)

_ops = torch.ops.slimcomm


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
    write_buf: bool = True,
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

    With ``write_buf=False`` ``buf`` is not written (it still gives ``N`` and the
    dtype the values are checked in): the state half of a commit, whose bucket
    half a later call with ``G``, ``acc`` and ``residual`` left out writes (the
    one-step delayed update of the DDP hook, ``delay_steps=1``).

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
        write_buf: write ``buf`` (default) or leave it untouched.

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
                            keep_all_zero, return_old_g, void_in, write_buf)


def sgd_apply_indexed(
    params: Sequence[torch.Tensor],
    indices: torch.Tensor,
    offsets: torch.Tensor,
    avg: torch.Tensor,
    lr: float,
    keep_all_zero: bool = False,
) -> None:
    """Plain SGD at a shared index set, straight from the all-reduced payload, in place.

    The optimizer half of a fused Slim-DP step (``SlimDPState.fuse_sgd``): where
    :func:`step_commit` would write the bucket (zeros with the averaged values at
    ``indices``) and ``torch.optim.SGD`` (no momentum, no weight decay) would then
    make a dense pass over that mostly-zero gradient, this writes the ``k`` updated
    parameter values only. Per segment ``s`` the decision of :func:`step_commit`
    (same ``avg``, same ``keep_all_zero``, values cast to the parameters' dtype):
    in a *good* segment every ``param_s.flat[i - offsets[s]]`` with ``indices[j] =
    i`` in ``s`` becomes ``fma(g, -lr, param)`` with ``g = avg[j]`` cast to the
    parameters' dtype, computed in fp32 and rounded to the parameters' dtype (for fp32
    parameters what ``param.add_(grad, alpha=-lr)`` computes; for fp16/bf16 ones torch
    first rounds ``alpha`` to the parameter dtype, so the last bit may differ, and
    ``SlimDPState.fuse_sgd`` leaves such buckets unfused); a segment that
    is not good (non-finite on some rank, or unused by every rank under
    ``keep_all_zero``) is left unchanged. ``flat`` is the parameter's memory order,
    which is its gradient's order in a DDP bucket.

    Args:
        params: ``S`` tensors (one per segment), one dtype among fp32/fp16/bf16,
            each dense and non-overlapping, ``params[s].numel() == offsets[s+1] -
            offsets[s]``, on ``indices``' device; updated in place (no autograd
            record, no version bump: call it on leaf parameters under no_grad,
            like an optimizer).
        indices: 1-D int64 ``[k]`` bucket-flat, unique.
        offsets: 1-D int64 ``[S + 1]``.
        avg: ``[k + S]`` fp32/fp16/bf16, the summed payload ``[values | flags]`` of
            :func:`step_encode` (values already divided by the world size).
        lr: the learning rate (cast to fp32).
        keep_all_zero: the policy of :func:`step_commit`.

    Raises:
        RuntimeError: wrong dtypes, shapes or devices, a parameter whose size does
            not match its segment, an index out of range or malformed ``offsets``
            (CPU); the message names the argument.
    """
    _ops.sgd_apply_indexed(list(params), indices, offsets, avg, float(lr), keep_all_zero)


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
