"""Delayed transport (``delay_steps=1``, the DDP hook only): the all-reduce of step ``t``
runs while step ``t + 1`` computes, and its average is applied at step ``t + 1``.

Per group and compressed step ``t`` (after the dense warm-up):

1. **Resolve** step ``t - 1``: wait for its all-reduce (bounded by the collective's
   ``timeout``; a failure raises :class:`slimcomm._comm.CollectiveError` and nothing of it
   is applied) and commit its *state* half: ``G`` at its index set and the residual
   (``acc`` where the parameter was good, the old residual where not), exactly as the
   undelayed shared transport does (``ops.step_commit(write_buf=False)``).
2. **Encode** step ``t`` as the shared transport does (core refresh from the weights and
   ``G``, explore set, error feedback from the residual of step 1) and start its
   all-reduce, asynchronously, from the calling thread.
3. **Write** the bucket: the averaged values of step ``t - 1`` (zeros elsewhere; the
   *bucket* half of the same commit), zeros at the first compressed step (nothing is in
   flight yet). DDP gets an already completed future, so the optimizer step of ``t``
   does not wait for the network; the all-reduce overlaps the next forward and backward.

A group of dense parameters is delayed too (its wire is the plain average in
``value_dtype``), so a parameter is applied one step late whatever bucket it is in
(layout invariance). The staleness is one step for every coordinate; error feedback is
unchanged (Slim-DP keeps what was not sent, the delay only moves when the sent part
lands). Delayed SGD with a one-step-stale gradient: e.g. Pipe-SGD (Li et al., NeurIPS
2018) and OD-SGD; Slim-DP itself is Sun et al., arXiv 1709.09393.

What is kept between steps is ``layout.delayed``: ``None``, ``("inflight", future,
indices)`` (``indices`` ``None`` for a group of dense parameters) or ``("result", R)``
with ``R`` the bucket-to-be ``[N]`` in the bucket's dtype (after a checkpoint or a
regrouping, :func:`materialize`; it is what ``state_dict()`` saves per parameter as
``"delayed_result"``, so a resumed run applies the same values at the same step).

Policies that differ from the undelayed hook: a step with a non-finite parameter is not
undone for every parameter (the next step's values are already on the wire); the bad
parameters keep their old residual and ``G`` and come back NaN one step later, as they
would in DDP without a GradScaler. A GradScaler cannot be attached (its skip decision
would concern the step whose values are still in flight).
"""

import torch

from ... import _comm, ops
from ..feedback import _encode
from ..selection import _index_set
from .dense import _segment_max_abs


def _delayed(state, layout, buf, world_size, step, weight):
    """Steps 1-3 of the module docstring for one group; returns a completed future of
    ``buf``."""
    resolved = _resolve(state, layout, buf)
    wire_dtype = state.value_dtype or buf.dtype
    n = layout.numel
    if layout.all_dense:
        wire = buf.div(world_size) if wire_dtype == buf.dtype else \
            buf.float().div_(world_size).to(wire_dtype)
        idx = None
        state._count(n * buf.element_size(), n * wire.element_size(), n, n, n, 0)
    else:
        idx, n_explore = _index_set(state, layout, step, weight)
        wire, _ = _encode(state, layout, buf, idx, world_size, wire_dtype, None)
        k = idx.numel()
        state._count(n * buf.element_size(), wire.numel() * wire.element_size(), n, k,
                     k - n_explore, n_explore)
    work = _comm.all_reduce(wire, state.group, timeout=state._timeout)
    _write(state, layout, buf, resolved)
    layout.delayed = ("inflight", work.get_future(), idx)
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(buf)
    return fut


def _resolve(state, layout, buf):
    """Wait for the group's all-reduce in flight and commit its state half (``G``, the
    residual, the non-finite count). Returns what :func:`_write` puts into the bucket:
    ``None`` (nothing was in flight), ``("result", R)``, ``("dense", avg)`` or
    ``("sparse", indices, avg)``. ``buf``: the bucket (not written here) or any
    contiguous ``[N]`` tensor of its dtype."""
    d = layout.delayed
    if d is None or d[0] == "result":
        return d
    _, fut, idx = d
    layout.delayed = None  # consumed: a failure below leaves nothing half-applied
    avg = _comm.wait(fut, f"Slim-DP delayed all-reduce of {layout.label}", state._timeout)[0]
    if idx is None:
        fin = torch.isfinite(_segment_max_abs(layout, avg))
        if layout.G is not None:
            torch.where(layout.expand(fin), avg.float(), layout.G, out=layout.G)
        state._note_nonfinite(fin.logical_not().sum())
        return ("dense", avg)
    counter = state._dev_count(buf.device)
    residual = layout.residual
    with state._lock:
        ops.step_commit(buf, idx, layout.offsets_tensor(), avg, counter, G=layout.G,
                        acc=layout.spare if residual is not None else None, residual=residual,
                        keep_all_zero=state._KEEP_ALL_ZERO, write_buf=False)
    if residual is not None:
        layout.residual, layout.spare = layout.spare, residual
    return ("sparse", idx, avg)


def _write(state, layout, buf, resolved) -> None:
    """The bucket half: ``buf`` <- what step ``t - 1`` averaged (zeros if nothing)."""
    if resolved is None:
        buf.zero_()
    elif resolved[0] in ("result", "dense"):
        buf.copy_(resolved[1])
    else:
        _, idx, avg = resolved
        sink = state._sink_count(buf.device)  # these values were counted in _resolve
        ops.step_commit(buf, idx, layout.offsets_tensor(), avg, sink,
                        keep_all_zero=state._KEEP_ALL_ZERO)


def materialize(state, layout) -> None:
    """Resolve the group's all-reduce in flight and keep the bucket-to-be it gives as
    ``("result", R)`` (for ``state_dict()`` and for moving state into a new grouping)."""
    if layout.delayed is None or layout.delayed[0] == "result":
        return
    out = torch.empty(layout.numel, dtype=layout.dtype, device=layout.device)
    with ops.trusted_indices():
        _write(state, layout, out, _resolve(state, layout, out))
    layout.delayed = ("result", out)
