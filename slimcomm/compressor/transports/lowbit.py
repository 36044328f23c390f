"""Low-bit transport: per-chunk scaled codes at the shared index set, all-gathered and
decoded in rank order (bit-identical average on every rank)."""

import torch

from ... import _comm, ops
from ...codec import ChunkPlan
from ..feedback import _commit, _encode
from ..selection import _index_set


def _quantised(state, layout, buf, world_size, step, weight):
    """Low-bit values (:mod:`slimcomm.codec`) at the shared index set, all-gathered.

    Codes cannot be summed by an all-reduce, so every rank all-gathers every
    rank's payload ``[flags fp32 [S] | scales bf16 | codes packed]`` (one
    uint8 collective) and decodes and averages them in rank order: the same
    arithmetic on the same bytes, so the average is bit-identical on every
    rank. The residual keeps ``acc - decoded`` at the sent coordinates (the
    rounding error), i.e. error feedback of the quantisation too. A group of
    dense tensors sends every coordinate (no selection); otherwise the index set
    is the shared transport's, checked across ranks every
    ``check_agreement_every``-th compressed step.
    """
    if layout.all_dense:
        if layout.core is None:
            layout.core = torch.arange(layout.numel, device=layout.device)
        idx, n_explore = layout.core, 0
    else:
        # the shared transport's index set, with its periodic cross-rank agreement check:
        # codes decoded at an index set another rank did not use would be silent garbage
        idx, n_explore = _index_set(state, layout, step, weight)
        idx = torch.sort(idx).values  # segment-contiguous, so the chunk plan is fixed
    if layout.plan is None:
        layout.plan = ChunkPlan([k + m for k, m in zip(layout.ks, layout.ms)],
                                state.quant_chunk, layout.device)
    bits, plan = state.value_bits, layout.plan
    scale = state._loss_scale(layout)
    k = idx.numel()
    S = len(layout.numels)
    # One fused op: acc = buf + error_decay * scale * residual (into the spare buffer),
    # [acc[idx] | flags] in fp32 (world size 1: undivided), acc[idx] = 0, acc /= scale.
    head, acc = _encode(state, layout, buf, idx, 1, torch.float32, scale)
    vals, flags = head[:k], head[k:]
    # scales, packed codes and the rounding error vals - decoded, in one op
    packed, scales, lost = plan.quantize(vals, bits)
    nsc = plan.nchunks + plan.nchunks % 2  # keep the codes 4-byte aligned
    if layout.qpad is None:  # zero padding of the payload, fixed per layout
        layout.qpad = (torch.zeros(2 * (nsc - plan.nchunks), dtype=torch.uint8, device=buf.device),
                       torch.zeros((-packed.numel()) % 4, dtype=torch.uint8, device=buf.device))
    parts = [flags.view(torch.uint8), scales.view(torch.uint8), layout.qpad[0], packed,
             layout.qpad[1]]
    wire = torch.cat(parts)
    P = wire.numel()
    state._count(layout.numel * buf.element_size(), P, layout.numel, k, k - n_explore, n_explore)
    if acc is not None:
        # what was not delivered (the rounding error) stays in the residual, unscaled
        ops.unpack(acc, idx, lost if scale is None else lost.div_(scale))
    gathered = torch.empty(world_size * P, dtype=torch.uint8, device=buf.device)
    fut = _comm.all_gather(gathered, wire, state.group, state._timeout).get_future()

    def done(f):
        f.value()  # raises if the all-gather failed: its receive buffer is never decoded
        rows = gathered.view(world_size, P)
        all_flags = rows[:, :4 * S].view(torch.float32).sum(0)
        all_scales = rows[:, 4 * S:4 * S + 2 * plan.nchunks].view(torch.bfloat16)
        # every rank's codes decoded and summed in rank order, / world size, in one op
        avg = plan.dequantize_mean(rows[:, 4 * S + 2 * nsc:], all_scales, bits, world_size)
        _commit(state, layout, buf, acc, idx, torch.cat([avg, all_flags]), step, scale)
        return buf

    return fut.then(ops.run_trusted(done))
