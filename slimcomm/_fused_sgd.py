"""The Slim-DP hook's fused SGD step (:meth:`slimcomm.hooks.SlimDPState.fuse_sgd`).

Internal. With plain SGD (no momentum, no weight decay) the update of a compressed
step touches only the ``k`` coordinates of the index set, but the unfused step makes
two dense passes over a gradient that is zero elsewhere: ``step_commit`` writes the
whole bucket (zeros plus the averaged values) and ``optimizer.step()`` reads it with
the parameters and writes every parameter back. Fused, the hook's completion applies
``param[idx] -= lr * avg`` itself (:func:`slimcomm.ops.sgd_apply_indexed`) and leaves
the bucket as it was; the optimizer's ``step()`` calls until the next synchronised
step skip the parameters of the groups fused in it (their ``.grad``, a view of the
bucket, holds this rank's own gradient), and still step every other parameter (the
dense warm-up steps, buckets of dense parameters only, parameters the hook never saw,
groups that fell back to the unfused path).

A group falls back to the unfused path for the step (its bucket is written as
usual, the optimizer steps it) when its parameters are not fp32, or when their
optimizer groups are not plain SGD or do not share one lr at that step: the update
is then exactly torch's, whatever the setting (one warning per reason).

The skip wraps the optimizer instance's ``step``: each parameter group's ``"params"``
list is swapped for one without the fused parameters for the duration of the call and
put back in a ``finally`` (lists cached per set of fused groups and per identity and
length of the groups' lists: no per-parameter Python loop in a step).
"""

from __future__ import annotations

import logging
import types
from typing import Dict, FrozenSet, List, Optional, Sequence, Tuple

import torch

log = logging.getLogger(__name__)

_PLAIN = "momentum=0, weight_decay=0, nesterov=False, maximize=False"


def _not_plain(group: dict) -> List[str]:
    """The settings of an SGD parameter group that make it more than plain SGD."""
    bad = [k for k, want in (("momentum", 0), ("weight_decay", 0), ("nesterov", False),
                             ("maximize", False)) if k in group and group[k] != want]
    if isinstance(group.get("lr"), torch.Tensor):
        bad.append("lr (a tensor)")
    return bad


class _FusedSGD:
    """One fused optimizer: which group each attached parameter sits in, the groups fused
    in the current synchronised step, and the skip of their parameters in ``step()``."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: Dict[int, torch.Tensor],
                 names: Sequence[str]):
        if type(optimizer) is not torch.optim.SGD:
            raise TypeError(f"SlimDPState.fuse_sgd: optimizer must be a torch.optim.SGD (not a "
                            f"subclass, which may change the update), got {type(optimizer).__name__}")
        group_of: Dict[int, int] = {}
        for gi, g in enumerate(optimizer.param_groups):
            for p in g["params"]:
                group_of[id(p)] = gi
        missing = [names[pos] for pos, p in params.items()
                   if p.requires_grad and id(p) not in group_of]
        if missing:
            raise ValueError(
                f"SlimDPState.fuse_sgd: the optimizer does not hold the model's trainable "
                f"parameters {missing[:8]}{' ...' if len(missing) > 8 else ''} (build it over "
                f"the attached model's parameters)")
        for gi in sorted(set(group_of.values())):
            bad = _not_plain(optimizer.param_groups[gi])
            if bad:
                raise ValueError(
                    f"SlimDPState.fuse_sgd: parameter group {gi} has "
                    f"{', '.join(bad)}; the fused step is plain SGD ({_PLAIN}, a float lr); "
                    f"use the unfused hook (do not call fuse_sgd) for other settings")
        self.optimizer = optimizer
        self.names = names
        self.group_of = {pos: group_of[id(p)] for pos, p in params.items() if id(p) in group_of}
        self.params = params
        self.pending: set = set()        # groups' positions fused in the current step
        self.skip: FrozenSet = frozenset()  # ... in the last finished step: step() skips them
        self._lists: Dict[tuple, List[List[torch.Tensor]]] = {}
        self._per_layout: Dict[Tuple[int, ...], tuple] = {}
        self._warned: set = set()
        self._active = False
        self._prev_step = None

    # ------------------------------------------------------------ the hook's side
    def for_layout(self, positions: Tuple[int, ...], dtype: torch.dtype
                   ) -> Optional[Tuple[List[torch.Tensor], float]]:
        """``(parameters in layout order, lr)`` of a group to fuse in this step, or None
        (the unfused path, see the module docstring)."""
        entry = self._per_layout.get(positions)
        if entry is None:
            held = all(pos in self.group_of for pos in positions)
            groups = tuple(sorted({self.group_of[pos] for pos in positions})) if held else None
            entry = self._per_layout[positions] = ([self.params[pos] for pos in positions], groups)
        plist, groups = entry
        why = None
        if dtype != torch.float32:
            why = f"its parameters are {dtype} (the fused step is fp32 only)"
        elif groups is None:
            why = "some of its parameters are not in the optimizer"
        else:
            lrs = set()
            for gi in groups:
                g = self.optimizer.param_groups[gi]
                bad = _not_plain(g)
                if bad:
                    why = f"parameter group {gi} has {', '.join(bad)}"
                    break
                lrs.add(float(g["lr"]))
            if why is None and len(lrs) > 1:
                why = f"its parameters sit in groups with different lrs {sorted(lrs)}"
        if why is not None:
            if why not in self._warned:
                self._warned.add(why)
                log.warning("SlimDPState.fuse_sgd: the group of %s is synchronised unfused "
                            "(optimizer.step() applies it) because %s",
                            [self.names[p] for p in positions[:4]], why)
            return None
        self.pending.add(positions)
        return plist, lrs.pop()

    def end_step(self) -> None:
        """The synchronised step is complete: its fused groups are skipped by ``step()``."""
        self.skip, self.pending = frozenset(self.pending), set()

    # ------------------------------------------------------------ the optimizer's side
    def install(self) -> None:
        opt = self.optimizer
        self._prev_step = opt.__dict__.get("step")  # an instance attribute (another wrapper's)
        inner = opt.step
        fused = self

        def step(_opt, *args, **kwargs):
            return fused._step(inner, *args, **kwargs)

        # a bound method, as torch's own lr schedulers expect to find (they wrap step.__func__)
        self._wrapper = types.MethodType(step, opt)
        opt.step = self._wrapper
        self._active = True

    def remove(self) -> None:
        self._active = False
        opt = self.optimizer
        if opt.__dict__.get("step") is getattr(self, "_wrapper", None):
            if self._prev_step is None:
                del opt.step
            else:
                opt.step = self._prev_step

    def _step(self, inner, *args, **kwargs):
        if not self._active or not self.skip:
            return inner(*args, **kwargs)
        if (args and args[0] is not None) or kwargs.get("closure") is not None:
            raise RuntimeError(
                "SlimDPState.fuse_sgd: optimizer.step(closure) is not supported: the hook has "
                "already applied this step's update to the fused parameters, and the closure's "
                "backward would apply another; use the unfused hook (fuse_sgd(None)) with closures")
        groups = self.optimizer.param_groups
        saved = [g["params"] for g in groups]
        key = (self.skip, tuple(id(ps) for ps in saved), tuple(len(ps) for ps in saved))
        lists = self._lists.get(key)
        if lists is None:
            ids = {id(self.params[pos]) for positions in self.skip for pos in positions}
            lists = self._lists[key] = [[p for p in ps if id(p) not in ids] for ps in saved]
        try:
            for g, ps in zip(groups, lists):
                g["params"] = ps
            return inner(*args, **kwargs)
        finally:
            for g, ps in zip(groups, saved):
                g["params"] = ps
