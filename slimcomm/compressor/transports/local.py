"""Local transport: each rank's own top-k plus explore, (index, value) pairs
all-gathered (top-k / DGC baseline; SparseLoCo with ``error_decay < 1``)."""

import torch

from ... import _comm, ops
from ..feedback import _accumulate, _commit, _encode
from ..selection import _select_explore


def _local(state, layout, buf, world_size, step, weight):
    scale = state._loss_scale(layout)
    acc = _accumulate(state, layout, buf, scale)
    if state.score == "grad":
        weight = acc
    elif weight is None:
        weight = state._flat_weight(layout)
    core, _ = ops.significance_topk_segmented(weight, acc, layout.offsets, layout.ks, state.score)
    idx, n_explore = _select_explore(state, layout, core, step)
    wire_dtype = state.value_dtype or buf.dtype
    wire, acc = _encode(state, layout, buf, idx, world_size, wire_dtype, scale,
                        accumulated=True)
    k = idx.numel()
    S = len(layout.numels)
    state._count(layout.numel * buf.element_size(),
                 wire.numel() * wire.element_size() + k * 8,
                 layout.numel, k, k - n_explore, n_explore)
    all_idx = torch.empty(world_size * k, dtype=torch.int64, device=idx.device)
    all_val = torch.empty(world_size * (k + S), dtype=wire_dtype, device=idx.device)
    f1 = _comm.all_gather(all_idx, idx, state.group, state._timeout).get_future()
    f2 = _comm.all_gather(all_val, wire, state.group, state._timeout).get_future()

    def done(both):
        # wait() on each all-gather: it raises if that collective failed, so a failed
        # collective never decodes its (uninitialised) receive buffers, and on CUDA it
        # makes the current stream wait for the gathered tensors. The collect_all
        # future has no CUDA events of its own and value() does not synchronise, so
        # reading all_idx / all_val without it raced with gloo's host-to-device
        # copies (replicas diverged on the H200, bench/results/gpu/...-run2).
        for f in both.value():
            f.wait()
        _commit(state, layout, buf, acc, idx, None, step, scale,
                local=(all_idx, all_val, world_size))
        return buf

    return torch.futures.collect_all([f1, f2]).then(ops.run_trusted(done))
