"""Index-set selection: the core set (top-k of the score, refreshed and kept identical
across ranks), the explore set, and the checksum all-reduces that check the ranks agree."""

from typing import Optional

import torch
import torch.distributed as dist

from .. import ops
from ..agreement import max_min_across_ranks
from .layout import _Layout, explore_rng_offset


class _SelectionMixin:
    """The core set of :class:`~slimcomm.compressor.SlimDPCompressor`'s layouts."""

    __slots__ = ()

    # ------------------------------------------------------------ core set
    def _refresh_core(self, layout: _Layout, force_all: bool,
                      weight: Optional[torch.Tensor]) -> None:
        """Recompute the core set: every segment if ``force_all`` (a refresh step),
        else only the segments without a known core (``layout.pending``)."""
        pending = None if force_all else layout.pending
        layout.pending = None
        if pending is None:
            ks = layout.topk_ks
        else:
            ks = [k if c is None else 0 for k, c in zip(layout.topk_ks, pending)]
        if self.score == "grad":
            weight = layout.G
        elif weight is None:
            weight = self._flat_weight(layout)
        idx, _ = ops.significance_topk_segmented(weight, layout.G, layout.offsets, ks, self.score)
        core = self._assemble_core(layout, idx, pending, ks)
        if self.score != "grad" and dist.get_world_size(self.group) > 1:
            # The score reads the weights, which are NOT identical on every rank while a
            # rank is joined (DDP join with uneven inputs: the joined rank no longer steps
            # its optimizer) or after a non-deterministic update. G is identical by
            # construction, so a core set that differs across ranks would make G (and the
            # replicas) diverge for good. One tiny all-reduce of checksums decides, without
            # a host sync: where any rank's new core differs, every rank keeps its previous
            # core set (or, for a layout that has none yet, the top-k of |G| alone).
            if layout.core is not None:
                fallback = layout.core
            else:
                fb, _ = ops.significance_topk_segmented(layout.G, layout.G, layout.offsets, ks,
                                                        "grad")
                fallback = self._assemble_core(layout, fb, pending, ks)
            hi, lo = _index_checksums(self, layout, core)
            agree = torch.eq(hi, lo).all()
            core = torch.where(agree, core, fallback)
            dev = core.device
            with self._lock:
                cnt = self._fallbacks.get(dev)
                if cnt is None:
                    cnt = self._fallbacks[dev] = torch.zeros((), dtype=torch.int64, device=dev)
                cnt.add_(agree.logical_not())
        layout.core = core

    def _assemble_core(self, layout: _Layout, idx: torch.Tensor, pending, ks) -> torch.Tensor:
        """Bucket-flat core of every segment: top-k ``idx`` (``ks`` per segment), dense
        segments whole, segments known from ``pending`` as they are."""
        if pending is None:
            if not layout.has_dense:
                return idx
            template, slots = layout.dense_core()
            return template.masked_scatter(slots, idx)
        parts, at = [], 0
        for s in range(len(layout.positions)):
            lo, hi = layout.seg(s)
            if layout.dense[s]:
                parts.append(torch.arange(lo, hi, dtype=torch.int64, device=layout.device))
            elif pending is not None and pending[s] is not None:
                parts.append(pending[s] + lo)
            else:
                parts.append(idx[at:at + ks[s]])
                at += ks[s]
        return torch.cat(parts)

    def _flat_weight(self, layout: _Layout) -> torch.Tensor:
        """The attached tensors flattened like their values in the group buffer: in memory
        order (DDP lays a dense, non-overlapping gradient out like its parameter, e.g.
        channels_last), else in logical order."""
        params = [self._params[pos] for pos in layout.positions]
        key = tuple(p.data_ptr() for p in params)
        cache = layout._wcache
        if cache is None or cache[0] != key:
            # Built once per layout (and again if a parameter's storage is replaced): the
            # flat weight, its segment views and the parameters' flat views, so that each
            # refresh is one multi-tensor copy whatever the number of parameters.
            w = torch.empty(layout.numel, dtype=torch.float32, device=layout.device)
            dst, src, slow = [], [], []
            for s, p in enumerate(params):
                lo, hi = layout.seg(s)
                flat = _memory_order_flat(p.detach())
                if hi == lo:
                    continue
                if flat.untyped_storage().data_ptr() == p.untyped_storage().data_ptr():
                    dst.append(w[lo:hi])
                    src.append(flat)
                else:
                    slow.append((lo, hi, p))  # not viewable flat: a fresh copy each time
            cache = layout._wcache = (key, w, dst, src, slow)
        _, w, dst, src, slow = cache
        if dst:
            torch._foreach_copy_(dst, src)
        for lo, hi, p in slow:
            w[lo:hi].copy_(_memory_order_flat(p.detach()))
        return w


def _memory_order_flat(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as ``[numel]`` in memory order when ``t`` is dense and
    non-overlapping (a view when possible), else in logical order -- the order of its
    gradient in a DDP bucket."""
    if t.dim() < 2 or t.is_contiguous():
        return t.reshape(-1)
    perm = sorted(range(t.dim()), key=lambda d: (-t.stride(d), -t.size(d)))
    v = t.permute(perm)
    return v.reshape(-1) if v.is_contiguous() else t.reshape(-1)


def _index_set(state, layout, step, weight):
    """``(indices, n_explore)`` of a group at compressed step ``step``: the core set refreshed
    when due (or not known yet), the explore set appended, and every
    ``check_agreement_every``-th step the cross-rank check of both (the shared index mode)."""
    since = step - state.warmup_steps
    if since % state.core_refresh == 0 or layout.core is None:
        state._refresh_core(layout, since % state.core_refresh == 0, weight)
    idx, n_explore = _select_explore(state, layout, layout.core, step)
    if state.check_agreement_every and since % state.check_agreement_every == 0:
        _check_agreement(state, layout, idx)
    return idx, n_explore


def _select_explore(state, layout, core, step):
    if sum(layout.ms) == 0:
        return core, 0
    rng = [explore_rng_offset(step, p) for p in layout.positions]
    explore = ops.explore_sample_segmented(
        layout.offsets, core, layout.core_offsets, layout.ms, state.seed, rng)
    return torch.cat([core, explore]), explore.numel()


def _index_checksums(state, layout, idx, extra=()):
    """``(max, min)`` over the ranks of int64 checksums of ``idx`` (plus the int64 0-d
    tensors ``extra``); one tiny all-reduce, counted in the stats as a check."""
    k = idx.numel()
    cached = layout._cksum.get(k)
    if cached is None:  # the position weights and k itself, fixed per layout and size
        cached = layout._cksum[k] = (torch.arange(1, k + 1, dtype=torch.int64, device=idx.device),
                                     torch.tensor(k, dtype=torch.int64, device=idx.device))
    w, kt = cached
    sums = torch.stack([idx.sum(), (idx * w).sum(), (idx * idx).sum(), kt, *extra])
    hi, lo = max_min_across_ranks(sums, state.group, state._timeout)
    state._count_check(2 * sums.numel() * sums.element_size())
    return hi, lo


def _check_agreement(state, layout, idx) -> None:
    """Checksum all-reduce (MAX of [x, -x]) of the index set and of ``G``'s bits (identical
    on every rank by construction; the weights are not compared, they may legitimately
    differ while a rank is joined); raise on every rank if they differ."""
    g_bits = layout.G.view(torch.int32)
    hi, lo = _index_checksums(state, layout, idx, [g_bits.sum(dtype=torch.int64),
                                                   g_bits[1::2].sum(dtype=torch.int64)])
    if not torch.equal(hi, lo):
        raise RuntimeError(
            f"Slim-DP index sets or G differ across ranks in {layout.label} (parameters "
            f"{layout.names}) at step {state.step}: the global gradient estimate G or the "
            f"core sets diverged between ranks (e.g. states constructed with different "
            f"arguments, or edited by hand). Restart from a checkpoint in which every rank "
            f"saved its own state."
        )
