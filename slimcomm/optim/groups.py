"""The optimizer's parameter groups and starting point: the constructor's checks, the
flat outer copies (``_Group``), rank 0's state broadcast at construction and adopted at
the first synchronisation, and the check that the synchronised parameters did not change."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
from torch import nn

from .. import _comm
from ..agreement import max_min_across_ranks
from .sharded import local

COMPRESSIONS = ("shared", "local", "dense")


def views_of(flat: torch.Tensor, like: List[torch.Tensor]) -> List[torch.Tensor]:
    """Consecutive views of ``flat`` with the shapes of the tensors ``like``."""
    out, off = [], 0
    for t in like:
        out.append(flat[off:off + t.numel()].view(t.shape))
        off += t.numel()
    return out


class _Group:
    """One flat run of parameters: outer copy, scratch, momentum, views."""

    __slots__ = ("positions", "params", "keys", "outer", "outer_views", "scratch",
                 "scratch_views", "momentum", "key", "reset_at")

    def __init__(self, positions: List[int], params: List[torch.Tensor], momentum: bool,
                 scratch: Optional[torch.Tensor] = None,
                 keys: Optional[List[torch.Tensor]] = None):
        self.positions = positions
        self.key = tuple(positions)
        # the tensors synchronised (a DTensor parameter's local shard) and the parameters
        # the inner optimizer's state is keyed by (the same tensors unless sharded)
        self.params = params
        self.keys = params if keys is None else keys
        n = sum(p.numel() for p in params)
        dev = params[0].device
        self.outer = torch.empty(n, dtype=torch.float32, device=dev)
        # the pseudo-gradient and, after the synchronisation, the average: the group's own
        # buffer, or a view of one buffer that every group on the device shares
        self.scratch = torch.empty(n, dtype=torch.float32, device=dev) if scratch is None \
            else scratch[:n]
        self.outer_views = views_of(self.outer, params)
        self.scratch_views = views_of(self.scratch, params)
        self.momentum = torch.zeros(n, dtype=torch.float32, device=dev) if momentum else None
        self.reset_at = -1   # the synchronisation at which this rank last reset its inner state


class _GroupsMixin:
    """Groups and starting point of :class:`~slimcomm.optim.SlimDPOptimizer`."""

    # ---------------------------------------------------------------- setup
    @staticmethod
    def _validate(model, inner, sync_every, compression, outer_lr, outer_momentum,
                  bucket_cap_mb):
        if not isinstance(model, nn.Module):
            raise ValueError(f"model must be an nn.Module, got {type(model).__name__}")
        if not isinstance(inner, torch.optim.Optimizer):
            raise ValueError(f"inner must be a torch.optim.Optimizer, got {type(inner).__name__}")
        if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
            raise ValueError(f"sync_every must be an int >= 1, got {sync_every!r}")
        if compression not in COMPRESSIONS:
            raise ValueError(f"compression must be one of {COMPRESSIONS}, got {compression!r}")
        if isinstance(outer_lr, bool) or not isinstance(outer_lr, (int, float)) or \
                not 0 < outer_lr < float("inf"):
            raise ValueError(f"outer_lr must be a finite number > 0, got {outer_lr!r}")
        if isinstance(outer_momentum, bool) or not isinstance(outer_momentum, (int, float)) or \
                not 0 <= outer_momentum < 1:
            raise ValueError(f"outer_momentum must be in [0, 1), got {outer_momentum!r}")
        if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) or \
                not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb!r}")
        module = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
        everything = {id(p) for p in module.parameters()}
        mine = {id(p) for p in module.parameters() if p.requires_grad}
        theirs = {id(p) for g in inner.param_groups for p in g["params"]}
        if not mine:
            raise ValueError("model has no parameters with requires_grad")
        # Frozen parameters of the model may be in inner (torch optimizers skip parameters
        # without a gradient); unfreezing one later is refused at the next synchronisation.
        if theirs - everything or mine - theirs:
            raise ValueError(
                f"inner must optimize exactly the model's trainable parameters: "
                f"{len(theirs - everything)} of inner's parameters are not in the model and "
                f"{len(mine - theirs)} of the model's trainable ones are not in inner")
        for i, g in enumerate(inner.param_groups):
            eps = g.get("eps")
            if "betas" in g and isinstance(eps, (int, float)) and eps < _FP16_TINY and \
                    any(p.dtype == torch.float16 for p in g["params"]):
                raise ValueError(
                    f"inner ({type(inner).__name__}): parameter group {i} holds float16 "
                    f"parameters with eps={eps!r}, below float16's smallest normal number "
                    f"{_FP16_TINY:.3g}: eps rounds to 0 and the second moments underflow, so "
                    f"the updates are inf/NaN and every synchronisation would discard them. "
                    f"Keep the parameters in float32 (torch.autocast for float16 compute, with "
                    f"a GradScaler on opt.inner) or bfloat16, or use eps >= {_FP16_TINY:.3g}")

    def _make_groups(self, named, bucket_cap_mb, share_scratch=False,
                     keys=None) -> List[_Group]:
        cap = int(bucket_cap_mb * 2**20)
        groups, cur, size = [], [], 0
        for pos, (_, p) in enumerate(named):
            if cur and (size + 4 * p.numel() > cap or p.device != named[cur[0]][1].device):
                groups.append(cur)
                cur, size = [], 0
            cur.append(pos)
            size += 4 * p.numel()
        if cur:
            groups.append(cur)
        momentum = self.outer_momentum > 0
        shared: Dict[torch.device, torch.Tensor] = {}
        if share_scratch:  # one buffer per device, the size of its largest group
            for g in groups:
                dev, n = named[g[0]][1].device, sum(named[i][1].numel() for i in g)
                if dev not in shared or shared[dev].numel() < n:
                    shared[dev] = torch.empty(n, dtype=torch.float32, device=dev)
        return [_Group(g, [named[i][1] for i in g], momentum,
                       shared.get(named[g[0]][1].device),
                       None if keys is None else [keys[i] for i in g]) for g in groups]

    def _broadcast_initial_state(self) -> None:
        """Rank 0's parameters (trainable and frozen) and buffers everywhere;
        outer copy := parameters."""
        group, t = self.process_group, self.timeout
        what = "SlimDPOptimizer: the broadcast of rank 0's parameters at construction"
        with torch.no_grad():
            for g in self._groups:
                torch._foreach_copy_(g.outer_views, g.params)
                _comm.wait(_comm.broadcast(g.outer, 0, group, t), what, t)
                torch._foreach_copy_(g.params, g.outer_views)
            _broadcast_flat([local(p) for _, p in self._frozen_named] +
                            [local(b) for b in self._module.buffers()],
                            group, t, what)

    def _before_inner_step(self) -> None:
        """Pre-step hook of ``inner`` (every inner step, also through a GradScaler): O(1)
        host work, no tensor op except at the first step (outer copy := parameters)."""
        if self._in_outer:
            raise RuntimeError(
                "SlimDPOptimizer: an inner step inside outer_weights() would train the outer "
                "parameters and then be discarded when the block exits; step after the block")
        if self._start_pending:
            self._take_start()

    def _take_start(self) -> None:
        """Outer copy := the model's parameters (before this rank's first inner step)."""
        with torch.no_grad():
            for g in self._groups:
                torch._foreach_copy_(g.outer_views, g.params)
        self._start_pending = False

    def _adopt_rank0_start(self) -> None:
        """First synchronisation: rank 0's starting point becomes every rank's.

        Each rank's local parameters are shifted by (rank 0's start - its own start),
        so its pseudo-gradient is still relative to where it started, and the outer
        copies (and frozen parameters) are rank 0's: weights loaded after
        construction, on every rank or on rank 0 only, give identical replicas.
        Identical starts leave the parameters bit-identical. Once per run: one small
        checksum all-reduce (and a host read) first, and only where some rank's start
        differs from rank 0's one broadcast per group (a full fp32 copy of the model
        from rank 0 to every rank: at 8 ranks on 100 Mbit/s links ~10 s for 5.8M
        parameters, which the usual identical start does not pay).
        """
        group, t = self.process_group, self.timeout
        what = f"{self._what()}: the broadcast of rank 0's starting point"
        with torch.no_grad():
            frozen = [local(p) for _, p in self._frozen_named]
            if _identical_across_ranks([g.outer for g in self._groups] + frozen, group, t):
                self._adopt_start = False
                return
            for g in self._groups:
                g.scratch.copy_(g.outer)
                _comm.wait(_comm.broadcast(g.outer, 0, group, t), what, t)
                torch.sub(g.outer, g.scratch, out=g.scratch)
                torch._foreach_add_(g.params, g.scratch_views)
            _broadcast_flat(frozen, group, t, what)
        self._adopt_start = False

    def _check_parameters_unchanged(self) -> None:
        """Host-only checks at each synchronisation (O(frozen parameters + groups))."""
        size = _inner_size(self.inner)
        if size != self._inner_size:
            raise RuntimeError(
                f"SlimDPOptimizer: inner holds {size[1]} parameters in {size[0]} groups, "
                f"{self._inner_size[1]} in {self._inner_size[0]} at construction (add_param_group "
                f"after constructing SlimDPOptimizer?); only the parameters given at "
                f"construction are synchronised: add every parameter group to inner first, then "
                f"construct SlimDPOptimizer")
        thawed = [n for n, p in self._frozen_named if p.requires_grad]
        if thawed:
            raise RuntimeError(
                f"SlimDPOptimizer: parameters frozen (requires_grad=False) at construction are "
                f"trainable now: {thawed[:5]}{' ...' if len(thawed) > 5 else ''}; only the "
                f"parameters trainable at construction are synchronised, so these would train "
                f"locally and drift apart across ranks. Unfreeze them before constructing "
                f"SlimDPOptimizer (construct a new one, with an inner optimizer over them)")


#: float16's smallest normal number: an Adam eps below it rounds to a subnormal or 0
_FP16_TINY = float(torch.finfo(torch.float16).tiny)


def _inner_size(inner: torch.optim.Optimizer):
    """(parameter groups, parameters) of ``inner``: O(groups)."""
    return len(inner.param_groups), sum(len(g["params"]) for g in inner.param_groups)


def _identical_across_ranks(tensors: List[torch.Tensor], group,
                            timeout: Optional[float]) -> bool:
    """Whether every rank holds bit-identical ``tensors`` (same shapes on every rank):
    three int64 sums of each tensor's bits (all, odd and every third 16-bit word),
    compared across the ranks with one all-reduce of MAX ``[x, -x]``; one host read."""
    if not tensors:
        return True
    sums = []
    for t in tensors:
        flat = t.detach().reshape(-1)
        wide = flat.element_size() >= 2
        b = flat.view(torch.int16 if wide else torch.uint8)
        sums += [b.sum(dtype=torch.int64), b[1::2].sum(dtype=torch.int64),
                 b[::3].sum(dtype=torch.int64)]
    dev = tensors[0].device
    hi, lo = max_min_across_ranks(torch.stack([x.to(dev) for x in sums]), group, timeout)
    return bool(torch.equal(hi, lo))


def _broadcast_flat(tensors: List[torch.Tensor], group, timeout: Optional[float],
                    what: str) -> None:
    """Broadcast ``tensors`` from group rank 0: one collective per (device, dtype), each
    waited for (``CollectiveError`` naming ``what`` on failure or after ``timeout``)."""
    by_kind: Dict[Any, List[torch.Tensor]] = {}
    for t in tensors:
        by_kind.setdefault((t.device, t.dtype), []).append(t)
    with torch.no_grad():
        for same in by_kind.values():
            flat = torch.cat([t.detach().reshape(-1) for t in same])
            _comm.wait(_comm.broadcast(flat, 0, group, timeout), what, timeout)
            torch._foreach_copy_([t.detach() for t in same],
                                 [v.view(t.shape) for v, t in
                                  zip(flat.split([t.numel() for t in same]), same)])


def _offsets(views: List[torch.Tensor]) -> List[int]:
    out, off = [], 0
    for v in views:
        out.append(off)
        off += v.numel()
    return out
