"""One round of :class:`~slimcomm.ist.ISTTrainer`: draw the partition, upload every subnet's
indices, (re)fill the cached subnet whose tensors are views of the payload buffer, and
the synchronisation itself (ONE ``all_gather`` of the packed slices, exact or as low-bit
codes of the round's update, the write-back into the full model with the mean over a
subnet's ranks, the mean of the shared tensors and the shared neurons' region)."""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from .. import ops
from .extraction import _strip_scales, extract_subnet
from ..codec import ChunkPlan
from .partition import partition

#: values per quantisation chunk of the coded exchange (one bf16 scale each)
EXCHANGE_CHUNK = 4096


class _RoundsMixin:
    """Partition, subnet and synchronisation of :class:`~slimcomm.ist.ISTTrainer`."""

    def _begin_round(self) -> None:
        """Draw this round's partition, upload every rank's indices, (re)fill the subnet.

        Steady-state cost (issue 12): besides :func:`partition` (host-side CPU
        ops, a few per hidden layer: one generator, ``randperm``, ``split`` and
        ``sort``s), a constant number of dispatched ops whatever the number of
        layers: one ``cat`` of the blocks, one host-to-device copy, one
        ``split`` into index views, and, when a subnet with this round's widths
        is cached, one ``gather_slices_multi`` + ``copy_`` into its flat buffer
        (plus one ``_foreach_copy_`` of the BatchNorm counters). No host sync:
        the blocks come from :func:`partition`, valid by construction, so the
        value checks of :func:`extract_subnet` (which read index values on the
        host) only run when a subnet is built.
        """
        plan = self._plan
        self._blocks = partition(plan.hidden_sizes, self.subnets, self.seed, self._round,
                                 shared=self.shared)
        self._rows, self._cols = self._upload_indices(self._blocks)
        full = [getattr(self.model[s.module], s.name) for s in plan.slices]
        self._slice_numel = [ops.slices_numel(full, self._rows[g], self._cols[g])
                             for g in range(self.subnets)]
        self._shared_numel = sum(getattr(self.model[i], a).numel() for i, a in plan.shared)
        self._subnet = self._fill_subnet(full)
        if self.exchange_bits is not None and self._world_size > 1:
            # the coded exchange's chunk layouts (cached by shape: no op in a steady state)
            self._plans = [self._chunk_plan(self._slice_counts(g)) for g in range(self.subnets)]
            self._shared_plan = (self._chunk_plan([t.numel() for _, t in self._shared_tensors()])
                                 if plan.shared else None)
        self._grads = self._attach_grads(self._subnet)
        optimizer = self._factory(self._subnet.parameters())
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer_factory must return a torch.optim.Optimizer, got "
                f"{type(optimizer).__name__}"
            )
        self._optimizer = optimizer

    def _upload_indices(
        self, blocks: Sequence[Sequence[torch.Tensor]]
    ) -> Tuple[List[List[Optional[torch.Tensor]]], List[List[Optional[torch.Tensor]]]]:
        """Per-subnet rows/cols index tensors of every sliced tensor, on the model's device.

        All subnets' blocks travel in ONE host-to-device copy, ``non_blocking``
        (from pageable host memory the driver stages the source before the
        call returns, so the temporary may be freed at once and no stream
        synchronisation happens), then one ``split`` gives views per (rank,
        layer). Returns ``(rows, cols)`` with ``rows[g][t]`` for subnet ``g``, slice ``t``.
        """
        plan = self._plan
        w, n_layers = self.subnets, len(blocks)
        order = [blocks[l][r] for r in range(w) for l in range(n_layers)]
        flat = torch.cat(order)
        if flat.device != plan.device:
            flat = flat.to(plan.device, non_blocking=True)
        views = flat.split([b.numel() for b in order])
        if any(self._counts):
            # One more split of the same buffer cuts the shared prefix off rank 0's blocks:
            # the shared neurons' global indices, with no per-layer op.
            sizes: List[int] = []
            at: Dict[int, int] = {}
            for j, b in enumerate(order):
                m = self._counts[j] if j < n_layers else 0
                if m:
                    at[j] = len(sizes)
                    sizes += [m, b.numel() - m]
                else:
                    sizes.append(b.numel())
            cut = flat.split(sizes)
            self._shared_idx = [cut[at[l]] if l in at else None for l in range(n_layers)]
        rows: List[List[Optional[torch.Tensor]]] = []
        cols: List[List[Optional[torch.Tensor]]] = []
        for r in range(w):
            on_dev = views[r * n_layers:(r + 1) * n_layers]
            rows.append([None if s.row_layer is None else on_dev[s.row_layer]
                         for s in plan.slices])
            cols.append([None if s.col_layer is None else on_dev[s.col_layer]
                         for s in plan.slices])
        return rows, cols

    def _subnet_tensors(self, subnet: nn.Sequential) -> List[Tuple[nn.Module, str]]:
        """(module, attribute) of the subnet's sliced then shared tensors, in payload order."""
        mods = _strip_scales(subnet, self.model)
        plan = self._plan
        return ([(mods[s.module], s.name) for s in plan.slices]
                + [(mods[i], a) for i, a in plan.shared])

    def _fill_subnet(self, full: List[torch.Tensor]) -> nn.Sequential:
        """This round's subnet, its floating tensors views of ONE flat buffer.

        The buffer is laid out as the payload of :meth:`synchronize` (sliced
        tensors in plan order, then the shared ones), so the send buffer is the
        subnet itself, with no gather. Subnets are cached by their widths (at
        most :attr:`_CACHE` of them; with widths divisible by the world size
        there is one): a cached subnet is refilled from the model in one
        ``gather_slices_multi`` and keeps its module objects (the optimizer is
        still re-created by the caller, and gradients are reset). The values
        equal those of :func:`extract_subnet` exactly (both are copies).
        """
        plan = self._plan
        rank = self._group   # the subnet this rank trains
        shared_full = [getattr(self.model[i], a) for i, a in plan.shared]
        nones = [None] * len(shared_full)
        widths = tuple(int(layer[rank].numel()) for layer in self._blocks)
        entry = self._subnet_cache.pop(widths, None)
        with torch.no_grad():
            packed = ops.gather_slices_multi(full + shared_full, self._rows[rank] + nones,
                                             self._cols[rank] + nones)
            if entry is not None:
                subnet, flat, ptrs = entry
                attrs = self._subnet_tensors(subnet)
                if [getattr(m, a).data_ptr() for m, a in attrs] != ptrs:
                    entry = None  # someone re-pointed a tensor: rebuild
            if entry is None:
                subnet = extract_subnet(self.model, self._blocks, rank, rescale=self.rescale,
                                        shared=self._counts)
                flat = packed
                pos = 0
                for m, a in self._subnet_tensors(subnet):
                    t = getattr(m, a)
                    view = flat[pos:pos + t.numel()].view(t.shape)
                    pos += t.numel()
                    if isinstance(t, nn.Parameter):
                        t.data = view
                    else:
                        setattr(m, a, view)
                ptrs = [getattr(m, a).data_ptr() for m, a in self._subnet_tensors(subnet)]
            else:
                flat.copy_(packed)
                counters = self._counter_pairs(subnet)
                if counters:
                    torch._foreach_copy_([s for s, _ in counters], [f for _, f in counters])
                for p in subnet.parameters():
                    p.grad = None
                subnet.train(self.model.training)
        self._subnet_cache[widths] = (subnet, flat, ptrs)
        while len(self._subnet_cache) > self._CACHE:
            self._subnet_cache.pop(next(iter(self._subnet_cache)))
        self._subnet_flat = flat
        self._subnet_ptrs = ptrs
        return subnet

    def _local_shared_indices(self) -> List[Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]]:
        """(rows, cols) of the shared region inside the subnet's tensor, per shared slice:
        the leading ``m`` rows/columns of a sliced dimension (blocks start with the shared
        neurons), all of an unsliced one. Constant over rounds; built once."""
        plan = self._plan
        out = []
        for t in self._shared_slices:
            sl = plan.slices[t]
            r = None if sl.row_layer is None else torch.arange(
                self._counts[sl.row_layer], device=plan.device)
            c = None if sl.col_layer is None else torch.arange(
                self._counts[sl.col_layer], device=plan.device)
            out.append((r, c))
        return out

    def _shared_region_numel(self) -> int:
        """Elements of the shared region all-reduced per round (0 without shared neurons)."""
        plan = self._plan
        n = 0
        for t in self._shared_slices:
            full = getattr(self.model[plan.slices[t].module], plan.slices[t].name)
            r, c = self._shared_local[self._shared_slices.index(t)]
            rows = full.shape[0] if r is None else r.numel()
            n += rows if full.dim() == 1 else rows * (full.shape[1] if c is None else c.numel())
        return n

    def _average_shared(self, attrs: List[Tuple[nn.Module, str]]) -> None:
        """Overwrite the shared region of the full model with its mean over the ranks.

        Gather the region out of this rank's trained subnet (one
        ``gather_slices_multi``), sum it over the ranks (one ``all_reduce``, in
        fp32), divide by the world size and scatter it to the shared neurons'
        global indices (one ``scatter_slices_multi``): a constant number of ops
        whatever the depth. Every rank ends with the same values."""
        plan = self._plan
        w = self._world_size
        sub = [getattr(*attrs[t]) for t in self._shared_slices]
        local_r = [r for r, _ in self._shared_local]
        local_c = [c for _, c in self._shared_local]
        part = ops.gather_slices_multi(sub, local_r, local_c).float()   # under no_grad
        dist.all_reduce(part, group=self._pg)
        part = part.div_(w).to(plan.dtype)
        full = [getattr(self.model[plan.slices[t].module], plan.slices[t].name)
                for t in self._shared_slices]
        idx = self._shared_idx
        rows = [None if plan.slices[t].row_layer is None else idx[plan.slices[t].row_layer]
                for t in self._shared_slices]
        cols = [None if plan.slices[t].col_layer is None else idx[plan.slices[t].col_layer]
                for t in self._shared_slices]
        start = ops.gather_slices_multi(full, rows, cols)   # a diverged rank's nan/inf: not written
        ops.scatter_slices_multi(full, rows, cols, torch.where(torch.isfinite(part), part, start))

    def _counter_pairs(self, subnet: nn.Sequential) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """(subnet, model) ``num_batches_tracked`` tensors of the BatchNorm layers."""
        mods = _strip_scales(subnet, self.model)
        return [(mods[i].num_batches_tracked, self.model[i].num_batches_tracked)
                for i in self._plan.counters]

    def _synchronize(self) -> None:
        plan = self._plan
        w = self._world_size
        attrs = self._subnet_tensors(self._subnet)
        full_tensors = [getattr(self.model[s.module], s.name) for s in plan.slices]
        shared_full = [getattr(self.model[i], a) for i, a in plan.shared]
        with torch.no_grad():
            if [getattr(m, a).data_ptr() for m, a in attrs] == self._subnet_ptrs:
                packed = self._subnet_flat  # the subnet's tensors ARE the payload
            else:  # a tensor of the subnet was replaced: gather it
                sub_tensors = [getattr(m, a).detach() for m, a in attrs]
                nones = [None] * len(sub_tensors)
                packed = ops.gather_slices_multi(sub_tensors, nones, nones)
            if self.exchange_bits is None or w == 1:   # one rank: nothing travels
                self._exchange_values(packed, full_tensors, shared_full)
            else:
                self._exchange_codes(packed, full_tensors, shared_full)
            if self._shared_slices and w > 1:
                self._average_shared(attrs)
            counters = self._counter_pairs(self._subnet)
            if counters:
                torch._foreach_copy_([f for _, f in counters], [s for s, _ in counters])
        self._rounds += 1
        if self._shared_slices and w > 1:   # ring all-reduce of the fp32 shared region
            n = self._shared_numel_cache
            self._payload_bytes += n * 4
            self._wire_bytes += 2 * (w - 1) * n * 4 // w
        self._local_step = 0
        self._round += 1
        self._begin_round()

    def _exchange_values(self, packed: torch.Tensor, full_tensors: List[torch.Tensor],
                         shared_full: List[torch.Tensor]) -> None:
        """Exact exchange (``exchange_bits=None``): one ``all_gather`` of the trained
        values; each subnet's slices are written back (the mean of its ranks' values,
        fp32 in rank order, when several ranks trained it), the shared tensors get the
        mean over all ranks. A non-finite value (a rank diverged) is not written: that
        entry keeps the round's start, on every rank alike."""
        plan = self._plan
        w = self._world_size
        width = max(self.payload_numel(r) for r in range(w))
        self._payload_bytes += packed.numel() * self._itemsize
        gathered = self._all_gather(packed, width)
        for g, ranks in enumerate(self._members):
            n = self._slice_numel[g]
            if len(ranks) == 1:
                vals = gathered[ranks[0], :n]
            else:
                acc = gathered[ranks[0], :n].float()
                for r in ranks[1:]:
                    acc = acc + gathered[r, :n].float()
                vals = (acc / len(ranks)).to(plan.dtype)
            start = ops.gather_slices_multi(full_tensors, self._rows[g], self._cols[g])
            ops.scatter_slices_multi(full_tensors, self._rows[g], self._cols[g],
                                     torch.where(torch.isfinite(vals), vals, start))
        if plan.shared:
            acc = gathered[0, self._slice_numel[self._subnet_of(0)]:self.payload_numel(0)].float()
            for r in range(1, w):
                acc = acc + gathered[r, self._slice_numel[self._subnet_of(r)]:
                                     self.payload_numel(r)].float()
            acc = (acc / w).to(plan.dtype)
            start = torch.cat([t.reshape(-1) for t in shared_full])
            acc = torch.where(torch.isfinite(acc), acc, start)
            parts = acc.split([t.numel() for t in shared_full])
            torch._foreach_copy_([t.view(-1) for t in shared_full], list(parts))

    def _shared_tensors(self) -> List[Tuple[str, torch.Tensor]]:
        return [(a, getattr(self.model[i], a)) for i, a in self._plan.shared]

    def _subnet_of(self, rank: int) -> int:
        """The subnet rank ``rank`` trains."""
        return rank % self.subnets

    def _chunk_plan(self, counts: Sequence[int]) -> ChunkPlan:
        """The :class:`~slimcomm.codec.ChunkPlan` of a payload with these per-tensor counts
        (cached: a few distinct layouts per run)."""
        key = tuple(int(c) for c in counts)
        p = self._chunk_plans.get(key)
        if p is None:
            if len(self._chunk_plans) >= 4 * self.subnets + 1:
                self._chunk_plans.pop(next(iter(self._chunk_plans)))
            p = self._chunk_plans[key] = ChunkPlan(list(key), EXCHANGE_CHUNK, self._plan.device)
        return p

    def _slice_counts(self, g: int) -> List[int]:
        """Values of every sliced tensor in subnet ``g``'s payload, in plan order (host ints)."""
        out = []
        for s in self._plan.slices:
            t = getattr(self.model[s.module], s.name)
            rows = t.shape[0] if s.row_layer is None else self._blocks[s.row_layer][g].numel()
            if t.dim() == 1:
                out.append(int(rows))
            else:
                cols = t.shape[1] if s.col_layer is None else self._blocks[s.col_layer][g].numel()
                out.append(int(rows) * int(cols))
        return out

    def _exchange_codes(self, packed: torch.Tensor, full_tensors: List[torch.Tensor],
                        shared_full: List[torch.Tensor]) -> None:
        """Coded exchange (``exchange_bits=b``): every rank sends its round's update
        (trained values minus the round's start, fp32) as per-chunk scaled ``b``-bit codes
        (:func:`slimcomm.ops.quantize_chunks`, bf16 scales, chunks of
        :data:`EXCHANGE_CHUNK` values that never cross a tensor), in ONE ``all_gather``
        of bytes laid out ``[shared codes | shared scales | slice codes | slice scales]``;
        every rank decodes every subnet's rows with
        :func:`slimcomm.ops.dequantize_chunks_mean` (the mean over the subnet's ranks, in
        rank order) and adds it to the round's start in fp32, so all ranks write the
        same bytes-derived values and stay bit-identical; the shared tensors get the mean
        update over all ranks. A non-finite decoded update (a chunk coded from a diverged
        rank's nan/inf) is dropped: those entries keep the round's start."""
        plan = self._plan
        w, b, g_me = self._world_size, self.exchange_bits, self._group
        nones_s = [None] * len(shared_full)
        k_me = self._slice_numel[g_me]
        start = ops.gather_slices_multi(full_tensors + shared_full, self._rows[g_me] + nones_s,
                                        self._cols[g_me] + nones_s)
        delta = packed.float().sub_(start.float())
        shared_plan, plans = self._shared_plan, self._plans

        def nbytes(p: ChunkPlan) -> Tuple[int, int]:
            # codes padded to an even byte count: every bf16 scale block starts 2-aligned
            return ((p.numel * b + 7) // 8 + 1) // 2 * 2, 2 * p.nchunks

        def encode(p: ChunkPlan, vals: torch.Tensor) -> List[torch.Tensor]:
            c, s, _ = p.quantize(vals, b)
            return [torch.nn.functional.pad(c, (0, nbytes(p)[0] - c.numel())),
                    s.view(torch.uint8)]

        parts = []
        head = 0
        if shared_plan is not None:
            parts += encode(shared_plan, delta[k_me:])
            head = sum(nbytes(shared_plan))
        parts += encode(plans[g_me], delta[:k_me])
        send = torch.cat(parts)
        width = head + max(sum(nbytes(p)) for p in plans)
        self._payload_bytes += send.numel()
        gathered = self._all_gather(send, width)
        for g, ranks in enumerate(self._members):
            cb, sb = nbytes(plans[g])
            rows = gathered[g::self.subnets]   # the subnet's ranks g, g + G, ... in rank order
            codes = rows[:, head:head + cb].contiguous()
            scales = rows[:, head + cb:head + cb + sb].contiguous().view(torch.bfloat16)
            update = plans[g].dequantize_mean(codes, scales, b, float(len(ranks)))
            # a chunk coded from non-finite values (a rank diverged) decodes to nan/inf:
            # it is not applied, its entries keep the round's start on every rank
            update = torch.nan_to_num_(update, nan=0.0, posinf=0.0, neginf=0.0)
            vals = ops.gather_slices_multi(full_tensors, self._rows[g], self._cols[g]).float()
            ops.scatter_slices_multi(full_tensors, self._rows[g], self._cols[g],
                                     vals.add_(update).to(plan.dtype))
        if shared_plan is not None:
            cb, sb = nbytes(shared_plan)
            codes = gathered[:, :cb].contiguous()
            scales = gathered[:, cb:cb + sb].contiguous().view(torch.bfloat16)
            update = shared_plan.dequantize_mean(codes, scales, b, float(w))
            update = torch.nan_to_num_(update, nan=0.0, posinf=0.0, neginf=0.0)
            vals = start[k_me:].float().add_(update).to(plan.dtype)
            torch._foreach_copy_([t.view(-1) for t in shared_full],
                                 list(vals.split([t.numel() for t in shared_full])))
