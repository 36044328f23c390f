"""Shared transport (Slim-DP): the values at the index set every rank derives, one
all-reduce of ``k + m`` values plus the flags; no index travels. The all-reduce is the
process group's own or, with ``allreduce_algorithm="two_shot"``, two direct exchanges (:func:`slimcomm._comm.two_shot_all_reduce`)."""

from ... import _comm, ops
from ..feedback import _commit, _encode
from ..selection import _index_set


def _shared(state, layout, buf, world_size, step, weight):
    idx, n_explore = _index_set(state, layout, step, weight)
    scale = state._loss_scale(layout)
    wire, acc = _encode(state, layout, buf, idx, world_size, state.value_dtype or buf.dtype,
                        scale)
    k = idx.numel()
    state._count(layout.numel * buf.element_size(), wire.numel() * wire.element_size(),
                 layout.numel, k, k - n_explore, n_explore)
    fused = state._fused_sgd(layout)  # (parameters, lr) when the hook applies SGD itself
    if state._two_shot(world_size):
        fut = _comm.two_shot_all_reduce(
            wire, state.group, state._timeout,
            f"{type(state).__name__}: the two-shot all-reduce of {layout.label or 'a group'}")
    else:
        fut = _comm.all_reduce(wire, state.group, timeout=state._timeout).get_future()

    def done(f):
        # f.value() raises if the collective failed: nothing is committed then
        avg = f.value()[0]
        _commit(state, layout, buf, acc, idx, avg, step, scale, write_buf=fused is None)
        if fused is not None:
            ops.sgd_apply_indexed(fused[0], idx, layout.offsets_tensor(), avg, fused[1],
                                  keep_all_zero=state._KEEP_ALL_ZERO)
        return buf

    return fut.then(ops.run_trusted(done))
