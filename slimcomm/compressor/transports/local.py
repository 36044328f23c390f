"""Local transport: each rank's own top-k plus explore, (index, value) pairs
all-gathered (top-k / DGC baseline; SparseLoCo with ``error_decay < 1``)."""

import torch

from ... import _comm, ops
from ..feedback import _accumulate, _commit, _encode
from ..selection import _select_explore


def _every_index(layout, world_size):
    """``(idx, all_idx)`` of a group of dense parameters: every coordinate ``arange(N)``,
    and it once per rank (what the index all-gather would return), built once per layout
    on the device."""
    cached = layout._every
    if cached is None or cached[0] != world_size:
        idx = torch.arange(layout.numel, dtype=torch.int64, device=layout.device)
        cached = layout._every = (world_size, idx, idx.repeat(world_size))
    return cached[1], cached[2]


def _local(state, layout, buf, world_size, step, weight):
    """Every rank sends its own index set (top-k of the score on ``acc`` plus explore)
    with ``acc[idx] / world_size`` in the wire dtype; every rank scatter-adds all ranks'
    pairs in rank order in fp32 (``slimcomm.ops.step_commit_local``).

    A dense parameter (``k + m >= numel``) sends every coordinate and is averaged by the
    same scatter-add whatever group it is in: a group of dense parameters only takes this
    path too, with its index set ``arange(N)`` known to every rank, so only the values
    travel (one all-gather). It is not the dense transport's all-reduce, which sums in the
    wire dtype in the backend's order (an fp16/bf16 wire rounds every partial sum), so a
    dense parameter would be averaged differently alone in a group than beside sparse
    ones, and the result would depend on ``bucket_cap_mb``.
    """
    scale = state._loss_scale(layout)
    acc = _accumulate(state, layout, buf, scale)
    if layout.all_dense:
        idx, all_idx = _every_index(layout, world_size)
        n_explore = 0
    else:
        if state.score == "grad":
            weight = acc
        elif weight is None:
            weight = state._flat_weight(layout)
        core, _ = ops.significance_topk_segmented(weight, acc, layout.offsets, layout.ks,
                                                  state.score)
        idx, n_explore = _select_explore(state, layout, core, step)
    wire_dtype = state.value_dtype or buf.dtype
    wire, acc = _encode(state, layout, buf, idx, world_size, wire_dtype, scale,
                        accumulated=True)
    k = idx.numel()
    S = len(layout.numels)
    index_bytes = 0 if layout.all_dense else k * 8
    state._count(layout.numel * buf.element_size(),
                 wire.numel() * wire.element_size() + index_bytes,
                 layout.numel, k, k - n_explore, n_explore)
    futs = []
    if not layout.all_dense:
        all_idx = torch.empty(world_size * k, dtype=torch.int64, device=idx.device)
        futs.append(_comm.all_gather(all_idx, idx, state.group, state._timeout).get_future())
    all_val = torch.empty(world_size * (k + S), dtype=wire_dtype, device=idx.device)
    futs.append(_comm.all_gather(all_val, wire, state.group, state._timeout).get_future())

    def done(gathered):
        # wait() on each all-gather: it raises if that collective failed, so a failed
        # collective never decodes its (uninitialised) receive buffers, and on CUDA it
        # makes the current stream wait for the gathered tensors. The collect_all
        # future has no CUDA events of its own and value() does not synchronise, so
        # reading all_idx / all_val without it raced with gloo's host-to-device
        # copies (replicas diverged on the H200, bench/results/gpu/...-run2).
        for f in gathered.value():
            f.wait()
        _commit(state, layout, buf, acc, idx, None, step, scale,
                local=(all_idx, all_val, world_size))
        return buf

    return torch.futures.collect_all(futs).then(ops.run_trusted(done))
