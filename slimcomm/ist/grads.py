"""Gradient scaling (module docstring of :mod:`slimcomm.ist`, "Gradient scaling"): the
subnet's gradients as views of one flat buffer, multiplied entry-wise by each entry's
share of the full tensor in one op per step."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn


class _SubnetGrads:
    """The subnet's parameter gradients as views of one flat buffer (see
    :meth:`ISTTrainer._attach_grads`): zeroed in one op per step and scaled
    entry-wise by ``scale`` (the same layout) in one more."""

    __slots__ = ("flat", "scale", "first", "first_grad")

    def __init__(self, flat: torch.Tensor, scale: torch.Tensor,
                 first: Optional[nn.Parameter], first_grad: Optional[torch.Tensor]):
        self.flat = flat            # [payload numel], the gradients' storage
        self.scale = scale          # [payload numel], 1 / (c_row * c_col) per entry
        self.first = first          # a parameter whose .grad must still be first_grad
        self.first_grad = first_grad


class _GradsMixin:
    """The flat, scaled gradients of :class:`~slimcomm.ist.ISTTrainer`'s subnet."""

    def _attach_grads(self, subnet: nn.Sequential) -> Optional[_SubnetGrads]:
        """With gradient scaling: give the subnet's parameters gradients that are
        views of one flat buffer, grouped by their factor ``subnets ** -k``.

        Built once per cached subnet (slices and views are dispatched ops);
        for a cached one the views are re-attached (Python attribute sets, no
        dispatched op) and the buffer zeroed (one op). ``None`` when nothing
        is scaled (no ``rescale``, ``scale_grads=False`` or world size 1).
        """
        w = self.subnets
        if not (self.rescale and self.scale_grads and w > 1):
            return None
        entry = self._grad_cache.get(id(subnet))
        if entry is not None and entry[0] is subnet:
            grads, pairs = entry[1], entry[2]
            grads.flat.zero_()
        else:
            plan = self._plan
            tensors = [getattr(m, a) for m, a in self._subnet_tensors(subnet)]
            dims = ([(s.row_layer, s.col_layer) for s in plan.slices]
                    + [(None, None)] * len(plan.shared))
            total = sum(t.numel() for t in tensors)
            flat = torch.zeros(total, dtype=plan.dtype, device=plan.device)
            scale = torch.ones(total, dtype=plan.dtype, device=plan.device)

            def factors(layer: Optional[int], size: int) -> torch.Tensor:
                # 1 / c per neuron: c = 1 for an unsliced dimension or a shared neuron,
                # subnets for the rank's own neurons (module docstring, "Gradient scaling").
                f = torch.ones(size, dtype=torch.float64)
                if layer is not None:
                    f[self._counts[layer]:] = 1.0 / w
                return f

            pairs = []
            pos = 0
            for t, (rl, cl) in zip(tensors, dims):
                n = t.numel()
                if isinstance(t, nn.Parameter) and t.requires_grad:
                    pairs.append((t, flat[pos:pos + n].view(t.shape)))
                    f = factors(rl, t.shape[0])
                    if t.dim() == 2:
                        f = f[:, None] * factors(cl, t.shape[1])[None, :]
                    scale[pos:pos + n] = f.reshape(-1).to(plan.dtype)
                pos += n
            first = pairs[0] if pairs else (None, None)
            grads = _SubnetGrads(flat, scale, first[0], first[1])
            live = {id(e[0]) for e in self._subnet_cache.values()}
            self._grad_cache = {k: v for k, v in self._grad_cache.items() if k in live}
            self._grad_cache[id(subnet)] = (subnet, grads, pairs)
        for p, view in pairs:
            p.grad = view
        return grads
