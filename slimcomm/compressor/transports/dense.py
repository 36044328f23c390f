"""Dense transport: the plain average of the whole group, one all-reduce."""

import torch

from ... import _comm, ops
from ..layout import _Layout


def _dense(state, layout, buf, world_size, wire_dtype):
    """Plain average; ``G`` <- the average (parameters whose average is finite).

    With the wire dtype equal to the bucket's this is exactly DDP's default
    hook; with ``value_dtype`` bf16 the hooks' warm-up steps travel in bf16,
    like DDP's ``bf16_compress_hook`` (the values are divided by the world size
    before the cast). After warm-up (shared index mode only; the
    local mode averages dense groups with its own scatter-add, see
    :func:`.local._local`) the values travel in ``value_dtype`` like dense
    parameters inside mixed buckets do, so a dense parameter is averaged the
    same way whatever bucket it lands in.
    """
    n = buf.numel()
    if wire_dtype == buf.dtype:
        wire = buf.div_(world_size)
    else:
        wire = buf.float().div_(world_size).to(wire_dtype)
    state._count(n * buf.element_size(), n * wire.element_size(), n, n, n, 0)
    fut = _comm.all_reduce(wire, state.group, timeout=state._timeout).get_future()

    scale = state._loss_scale(layout)

    def done(f):
        out = f.value()[0]  # raises if the collective failed: nothing is written then
        if out is not buf:
            buf.copy_(out)
        # Branchless: G <- the average in the parameters whose average is finite.
        fin = torch.isfinite(_segment_max_abs(layout, out))
        if layout.G is not None:  # (a group of dense parameters selects nothing: no G)
            torch.where(layout.expand(fin), out, layout.G, out=layout.G)
            if scale is not None:
                layout.G.div_(scale)
        state._note_nonfinite(fin.logical_not().sum())
        return buf

    return fut.then(ops.run_trusted(done))


def _segment_max_abs(layout: _Layout, buf: torch.Tensor) -> torch.Tensor:
    """``[S]`` in ``buf``'s dtype: per segment the largest ``|x|`` (NaN if any is NaN,
    0 for an empty segment), from the segment max and min: a fixed number of ops
    whatever the number of segments, and no temporary of ``buf``'s size."""
    hi = torch.segment_reduce(buf, "max", lengths=layout.lengths(), initial=0)
    lo = torch.segment_reduce(buf, "min", lengths=layout.lengths(), initial=0)
    return torch.maximum(hi, lo.neg_())  # NaN propagates
