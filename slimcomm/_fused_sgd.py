"""The Slim-DP hook's fused SGD step (:meth:`slimcomm.hooks.SlimDPState.fuse_sgd`).

Internal. With plain SGD (no momentum, no weight decay) the update of a compressed
step touches only the ``k`` coordinates of the index set, but the unfused step makes
two dense passes over a gradient that is zero elsewhere: ``step_commit`` writes the
whole bucket (zeros plus the averaged values) and ``optimizer.step()`` reads it with
the parameters and writes every parameter back. Fused, the hook's completion applies
``param[idx] -= lr * avg`` itself (:func:`slimcomm.ops.sgd_apply_indexed`) and leaves
the bucket as it was; the optimizer's next ``step()`` skips the parameters of the
groups fused in this backward (their ``.grad``, a view of the bucket, holds this
rank's own gradient), and still steps every other parameter (the dense warm-up steps,
buckets of dense parameters only, parameters the hook never saw).

The skip swaps each parameter group's ``"params"`` list for one without the fused
parameters in a step pre-hook and puts it back in the step post-hook (lists cached
per set of fused groups: no per-parameter Python loop in a step).
"""

from __future__ import annotations

from typing import Dict, FrozenSet, List, Optional, Tuple

import torch

_POLICY = "momentum=0, dampening=0, weight_decay=0, nesterov=False, maximize=False"


def _check_groups(optimizer: torch.optim.Optimizer, groups, where: str) -> float:
    """The learning rate shared by ``groups`` (indices into ``param_groups``); ValueError
    naming the setting that is not plain SGD, or lrs that differ."""
    lrs = set()
    for gi in groups:
        g = optimizer.param_groups[gi]
        bad = [k for k, want in (("momentum", 0), ("dampening", 0), ("weight_decay", 0),
                                 ("nesterov", False), ("maximize", False))
               if k in g and g[k] != want]
        if bad:
            raise ValueError(
                f"SlimDPState.fuse_sgd: {where}: parameter group {gi} has "
                f"{', '.join(f'{k}={g[k]!r}' for k in bad)}; the fused step is plain SGD "
                f"({_POLICY}); use the unfused hook (do not call fuse_sgd) for other settings")
        lr = g["lr"]
        if isinstance(lr, torch.Tensor):
            raise ValueError(f"SlimDPState.fuse_sgd: {where}: parameter group {gi} has a tensor "
                             f"lr; the fused step reads a Python float")
        lrs.add(float(lr))
    if len(lrs) > 1:
        raise ValueError(
            f"SlimDPState.fuse_sgd: {where}: the parameters of one DDP bucket sit in parameter "
            f"groups with different learning rates {sorted(lrs)}; the fused step applies one lr "
            f"per bucket (use the unfused hook, or one lr for these groups)")
    return lrs.pop() if lrs else 0.0


class _FusedSGD:
    """Book-keeping of one fused optimizer: which groups a layout's parameters sit in,
    the layouts fused since the last ``step()``, and the skip of their parameters."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: Dict[int, torch.Tensor]):
        if not isinstance(optimizer, torch.optim.SGD):
            raise TypeError(f"SlimDPState.fuse_sgd: optimizer must be a torch.optim.SGD, got "
                            f"{type(optimizer).__name__}")
        group_of: Dict[int, int] = {}
        for gi, g in enumerate(optimizer.param_groups):
            for p in g["params"]:
                group_of[id(p)] = gi
        missing = [pos for pos, p in params.items() if id(p) not in group_of]
        if missing:
            raise ValueError(
                f"SlimDPState.fuse_sgd: the optimizer does not hold the model's parameters at "
                f"positions {missing[:8]} (build it over ddp.parameters() of the attached model)")
        for gi in sorted(set(group_of.values())):  # one bucket's groups must share an lr: per step
            _check_groups(optimizer, [gi], "at fuse time")
        self.optimizer = optimizer
        self.group_of = {pos: group_of[id(p)] for pos, p in params.items()}
        self.params = params
        self.pending: set = set()            # layouts' positions fused since the last step()
        self._lists: Dict[FrozenSet, List[List[torch.Tensor]]] = {}
        self._per_layout: Dict[Tuple[int, ...], Tuple[List[torch.Tensor], Tuple[int, ...]]] = {}
        self._saved: Optional[List[list]] = None
        self._handles = (optimizer.register_step_pre_hook(self._pre),
                         optimizer.register_step_post_hook(self._post))

    def for_layout(self, positions: Tuple[int, ...]) -> Tuple[List[torch.Tensor], float]:
        """``(parameters in layout order, lr)`` for a layout about to be fused; marks it
        fused for the optimizer's next ``step()``."""
        entry = self._per_layout.get(positions)
        if entry is None:
            entry = self._per_layout[positions] = (
                [self.params[pos] for pos in positions],
                tuple(sorted({self.group_of[pos] for pos in positions})))
        plist, groups = entry
        lr = _check_groups(self.optimizer, groups, f"parameters {list(positions)[:8]}")
        self.pending.add(positions)
        return plist, lr

    def _pre(self, optimizer, args, kwargs):
        self._restore()  # a previous step() that raised never ran its post-hook
        if not self.pending:
            return None
        key = frozenset(self.pending)
        self.pending = set()
        lists = self._lists.get(key)
        if lists is None:
            skip = {id(self.params[pos]) for positions in key for pos in positions}
            lists = self._lists[key] = [[p for p in g["params"] if id(p) not in skip]
                                        for g in optimizer.param_groups]
        self._saved = [g["params"] for g in optimizer.param_groups]
        for g, ps in zip(optimizer.param_groups, lists):
            g["params"] = ps
        return None

    def _post(self, optimizer, args, kwargs):
        self._restore()

    def _restore(self):
        if self._saved is not None:
            for g, ps in zip(self.optimizer.param_groups, self._saved):
                g["params"] = ps
            self._saved = None

    def remove(self):
        self._restore()
        for h in self._handles:
            h.remove()
