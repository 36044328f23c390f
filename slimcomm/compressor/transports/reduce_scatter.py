"""Two-stage low-bit all-reduce of a dense group: codes reduce-scattered to shard owners
with one all-to-all, summed and re-quantised there with a server-side residual, then
all-gathered. Bytes per rank ``2 (W-1)/W`` x the one-rank code size, at any world size.

The scheme is the compressed all-reduce of 1-bit Adam (Tang et al., arXiv 2102.02888,
Sec. 4: worker error feedback, codes to the shard owners, owner-side ("server")
error feedback, re-compress, all-gather), here with the per-chunk scaled 1/2/4/8-bit
codes of :mod:`slimcomm.codec`.
"""

from __future__ import annotations

import bisect
from typing import List

import torch

from ... import _comm, ops
from ...codec import ChunkPlan
from .dense import _segment_max_abs


def _pad4(n: int) -> int:
    return n + (-n) % 4


class ShardPlan:
    """A chunk-aligned split of a dense group's ``K`` values over ``W`` owners.

    Shard ``j`` holds values ``[cuts[j], cuts[j + 1])``; every cut lies on a chunk
    boundary of the group's :class:`~slimcomm.codec.ChunkPlan` (chunks never cross a
    tensor boundary), so a shard is chunked exactly as the whole group is and a
    value's code does not depend on ``W``. Cuts are the chunk boundaries nearest to
    ``j K / W``. Built once per (layout, world size) on the host.

    Messages are 4-byte aligned uint8 blocks of one size per stage (the largest
    shard's): a block of the all-to-all is ``[scales bf16 [nchunks_j] | pad | codes
    | pad]`` (``nbytes`` bytes), a block of the all-gather the same behind the
    sender's per-segment flags ``fp32 [S]`` (``4 S + nbytes`` bytes).

    Attributes:
        cuts: ``W + 1`` value offsets.
        plans: per shard, the :class:`ChunkPlan` of its values.
        code_offset: per shard, the byte offset of its codes inside a block.
        nbytes: the all-to-all block size.
    """

    __slots__ = ("cuts", "plans", "code_offset", "nbytes", "nseg", "zeros")

    def __init__(self, counts: List[int], chunk: int, world_size: int, bits: int,
                 device: torch.device):
        ends, seg_bounds, off = [], [0], 0
        for c in counts:
            ends.extend(off + min(s + chunk, c) for s in range(0, c, chunk))
            off += c
            seg_bounds.append(off)
        K = off
        cuts = [0]
        for j in range(1, world_size):
            target = j * K / world_size
            i = bisect.bisect_left(ends, target)
            near = [ends[t] for t in (i - 1, i) if 0 <= t < len(ends)]
            best = min(near, key=lambda e: (abs(e - target), e)) if near else 0
            cuts.append(max(best, cuts[-1]))
        cuts.append(K)
        self.cuts = cuts
        self.nseg = len(counts)
        self.plans = []
        for lo, hi in zip(cuts[:-1], cuts[1:]):
            pieces = [min(hi, b) - max(lo, a) for a, b in zip(seg_bounds[:-1], seg_bounds[1:])]
            self.plans.append(ChunkPlan([p for p in pieces if p > 0], chunk, device))
        self.code_offset = [_pad4(2 * p.nchunks) for p in self.plans]
        self.nbytes = max([4] + [o + _pad4(-(-p.numel * bits // 8))  # >= 4: aligned views
                                 for o, p in zip(self.code_offset, self.plans)])
        self.zeros = torch.zeros(self.nbytes, dtype=torch.uint8, device=device)  # the paddings

    def block(self, j: int, scales: torch.Tensor, packed: torch.Tensor) -> List[torch.Tensor]:
        """The uint8 parts of shard ``j``'s all-to-all block (to be concatenated)."""
        pad = self.code_offset[j] - 2 * self.plans[j].nchunks
        tail = self.nbytes - self.code_offset[j] - packed.numel()
        return [scales.view(torch.uint8), self.zeros[:pad], packed, self.zeros[:tail]]

    def decode(self, j: int, rows: torch.Tensor, bits: int, divisor: float) -> torch.Tensor:
        """fp32 ``[n_j]``: the blocks of shard ``j`` in ``rows`` (uint8 ``[R, nbytes]``)
        decoded, summed in row order, divided by ``divisor``."""
        p = self.plans[j]
        scales = rows[:, :2 * p.nchunks].view(torch.bfloat16)
        return p.dequantize_mean(rows[:, self.code_offset[j]:], scales, bits, divisor)


def _plan(state, layout, world_size: int) -> ShardPlan:
    plan = layout.shards
    if plan is None or len(plan.cuts) != world_size + 1:
        plan = layout.shards = ShardPlan(layout.numels, state.quant_chunk, world_size,
                                         state.value_bits, layout.device)
    return plan


def _segment_flags(layout, buf: torch.Tensor) -> torch.Tensor:
    """fp32 ``[S]`` per segment of ``buf``: NaN if non-finite, 1 if nonzero, else 0."""
    m = _segment_max_abs(layout, buf)
    return m.mul(0).add_(m > 0)  # 0 * inf and 0 * NaN are NaN


def _reduce_scatter_codes(state, layout, buf, world_size, step, deferred=False):
    """The dense group ``buf`` averaged through codes (see the module docstring).

    1. ``acc = buf + error_decay * residual`` (in place in ``buf``); each shard of
       ``acc`` quantised on its own (:func:`slimcomm.ops.quantize_chunks`), the
       rounding error kept as the next residual (worker error feedback);
    2. one all-to-all: block ``j`` (scales and codes of shard ``j``) to rank ``j``.
       Waited for here (bounded by the state's timeout), because the owner's step
       must run before the all-gather is issued from this thread (see
       :mod:`.transports` for the ordering rule);
    3. the owner decodes the ``W`` blocks of its shard, sums them in rank order and
       divides by ``W`` (:func:`slimcomm.ops.dequantize_chunks_mean`), adds its
       server residual, re-quantises; the new rounding error is the server residual;
    4. one all-gather of every owner's block behind the owner's own per-parameter
       flags; every rank decodes the same bytes and sums the flags in rank order,
       so the average is bit-identical on every rank.

    Bytes this rank puts on its link: ``(W-1) (P1 + P2)`` with ``P1 = nbytes`` and
    ``P2 = 4 S + nbytes`` (``~ 2 (W-1)/W`` x one rank's code size); counted in
    ``bytes_sent`` as ``W (P1 + P2) / 2``, so the ring all-reduce rule of
    :attr:`SlimDPCompressor.stats` gives it exactly.

    Returns a future of ``buf`` holding the average (NaN in a parameter that was
    non-finite on some rank); with ``deferred`` the future holds a callable
    ``decode(out)`` that writes it into ``out`` (fp32 ``[K]``) instead, so a caller
    can reuse ``buf`` for the next group while the all-gather runs.
    """
    if state._loss_scale(layout) is not None:
        raise RuntimeError("lowbit_collective='all_reduce' does not support a GradScaler "
                           "attached to the compressor")
    if buf.dtype != torch.float32:
        raise RuntimeError(f"lowbit_collective='all_reduce' needs an fp32 buffer, got {buf.dtype}")
    bits, plan = state.value_bits, _plan(state, layout, world_size)
    rank = torch.distributed.get_rank(state.group)
    W, P, S = world_size, plan.nbytes, plan.nseg
    shards = list(zip(plan.cuts[:-1], plan.cuts[1:]))
    if layout.residual is not None:
        buf.add_(layout.residual, alpha=state.error_decay)
    flags = _segment_flags(layout, buf)
    parts: List[torch.Tensor] = []
    for j, (lo, hi) in enumerate(shards):
        packed, scales, lost = plan.plans[j].quantize(buf[lo:hi], bits)
        if layout.residual is not None:
            layout.residual[lo:hi].copy_(lost)
        parts += plan.block(j, scales, packed)
    send = torch.cat(parts)
    del parts
    if layout.residual is not None:  # a non-finite parameter restarts its residual
        layout.residual.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
    state._count(layout.numel * buf.element_size(), W * (2 * P + 4 * S) // 2, layout.numel,
                 layout.numel, layout.numel, 0)
    recv = torch.empty_like(send)
    what = f"{type(state).__name__}: the all-to-all of {layout.label or 'a group'}'s codes"
    _comm.wait(_comm.all_to_all(recv, send, state.group, state._timeout), what, state._timeout)
    del send
    # owner step: decode-sum-average the W blocks of this rank's shard, add the server
    # residual, re-quantise
    avg = plan.decode(rank, recv.view(W, P), bits, W)
    del recv
    if layout.residual is not None:
        if layout.server is None:  # from a checkpoint of this layout, else zeros
            saved = state._server_loaded.pop(tuple(layout.positions), None)
            layout.server = saved.to(buf.device) if saved is not None and \
                saved.numel() == avg.numel() else torch.zeros_like(avg)
        avg.add_(layout.server)
    packed, scales, lost = plan.plans[rank].quantize(avg, bits)
    if layout.residual is not None:  # copied into the same buffer (no heap churn)
        torch.nan_to_num(lost, nan=0.0, posinf=0.0, neginf=0.0, out=layout.server)
    del avg, lost
    block = torch.cat([flags.view(torch.uint8)] + plan.block(rank, scales, packed))
    gathered = torch.empty(W * (4 * S + P), dtype=torch.uint8, device=buf.device)
    fut = _comm.all_gather(gathered, block, state.group, state._timeout).get_future()

    def decode(out: torch.Tensor) -> torch.Tensor:
        g = gathered.view(W, 4 * S + P)
        for j, (lo, hi) in enumerate(shards):
            out[lo:hi].copy_(plan.decode(j, g[j:j + 1, 4 * S:], bits, 1.0))
        bad = g[:, :4 * S].view(torch.float32).sum(0).isnan()  # flags are 0, 1 or NaN
        out.masked_fill_(layout.expand(bad), float("nan"))
        state._note_nonfinite(bad.sum())
        return out

    def done(f):
        f.value()  # raises if the all-gather failed: its receive buffer is never decoded
        return decode if deferred else decode(buf)

    return fut.then(ops.run_trusted(done))
