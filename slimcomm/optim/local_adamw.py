"""``LocalAdamW``: the inner AdamW of a local-step method, normalised as if it saw the
average gradient of the ``W`` ranks (issue 25).

Why. In a local-step method (DiLoCo, SparseLoCo, :class:`~slimcomm.optim.SlimDPOptimizer`)
every rank steps its own AdamW on its own mini-batch, and the ranks' updates are averaged.
Per coordinate write a rank's gradient as ``g = mu + noise`` with ``E[noise^2] = s^2``. A
rank's second moment is ``v ~ mu^2 + s^2``; the second moment DDP's AdamW sees, of the mean
of ``W`` such gradients, is ``mu^2 + s^2 / W``. Where the noise dominates, every rank's
update ``m / sqrt(v)`` is ``sqrt(W)`` times smaller than DDP's, and averaging the ranks'
updates does not give it back (it averages the noise away, not the scale). Measured on the
GPT at 8 ranks, batch 4 per rank, 500 steps (``bench/results/adamw_8ranks_inner.md``): even
averaging the parameters after every single step in fp32 ends 6.4% above DDP with AdamW,
and 0.5% below it with this optimizer.

What. Besides AdamW's ``m`` (``exp_avg``) and ``v`` (``exp_avg_sq``) this keeps
``u = EMA_beta2(m_hat^2)`` (``exp_avg_m_sq``). For gradients whose noise is independent
from step to step, ``m``'s noise has variance ``c s^2`` with ``c = (1 - beta1) / (1 + beta1)``
(an exponential moving average's variance), so ``u ~ mu^2 + c s^2`` and
``s^2 ~ (v_hat - u_hat) / (1 - c)`` (clamped at 0). The denominator uses the second moment
of the W-rank mean::

    v_W = max(v_hat - (1 - 1/W) s^2,  v_hat / W)

and otherwise the step is AdamW's (Loshchilov & Hutter, arXiv 1711.05101, Alg. 2, with
Adam's bias corrections, Kingma & Ba, arXiv 1412.6980): ``p <- p (1 - lr wd) - lr m_hat /
(sqrt(v_W) + eps)``. With ``world_size=1`` it is ``torch.optim.AdamW`` (amsgrad off) up to
floating-point rounding. Correlated noise or a drifting ``mu`` make ``u`` larger, hence
``s^2`` smaller: the estimate errs towards plain AdamW, never past ``v_hat / W``.

With ``beta1 = 0`` there is no momentum to estimate the noise from (``u`` would equal ``v``):
the step is then AdamW's at any ``world_size``.

``world_size`` is the number of ranks whose updates the outer step averages (the data-parallel
world size; with HSDP the replicate dimension), not a property of the process group at
step time: the optimizer issues no collective and needs no process group.

Cost: one more fp32 state tensor per parameter (``exp_avg_m_sq``, +4 bytes per parameter
over AdamW) and about twice AdamW's elementwise work per step, in ``torch._foreach_*``
calls per (device, dtype) bucket of a parameter group; no host synchronisation.
"""

from typing import Any, Dict, Iterable, List, Tuple

import torch

__all__ = ["LocalAdamW"]


def _check_args(lr, betas, eps, weight_decay, world_size) -> None:
    def number(name, x):
        if isinstance(x, bool) or not isinstance(x, (int, float)):
            raise TypeError(f"{name} must be a number, got {type(x).__name__}")
    number("lr", lr)
    if not lr >= 0:
        raise ValueError(f"lr must be >= 0, got {lr}")
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    for i, b in enumerate(betas):
        number(f"betas[{i}]", b)
        if not 0.0 <= b < 1.0:
            raise ValueError(f"betas[{i}] must be in [0, 1), got {b}")
    number("eps", eps)
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    number("weight_decay", weight_decay)
    if not weight_decay >= 0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")


class LocalAdamW(torch.optim.Optimizer):
    r"""AdamW for the inner steps of a local-step method at ``world_size`` ranks.

    See :mod:`slimcomm.optim.local_adamw` for the estimate and the measurements.

    Args:
        params: parameters or parameter groups (as for ``torch.optim.AdamW``);
            floating-point tensors on any device; gradients of the same shape and dtype.
        lr: learning rate (>= 0; per group; LR schedulers change it as usual).
        betas: ``(beta1, beta2)``, each in [0, 1).
        eps: added to ``sqrt(v_W)`` (>= 0).
        weight_decay: decoupled weight decay (>= 0; per group).
        world_size: ranks whose updates are averaged (int >= 1); 1 = AdamW.

    State per parameter (shapes and dtypes of the parameter): ``exp_avg``, ``exp_avg_sq``,
    ``exp_avg_m_sq``, and ``step`` (int). ``state_dict()``/``load_state_dict()`` as for any
    torch optimizer; ``world_size`` is an attribute, not part of the state.

    Raises:
        TypeError / ValueError: an argument out of range (the message names it).
    """

    def __init__(self, params: Iterable, lr: float = 1e-3,
                 betas: Tuple[float, float] = (0.9, 0.99), eps: float = 1e-8,
                 weight_decay: float = 0.01, world_size: int = 1):
        _check_args(lr, betas, eps, weight_decay, world_size)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps,
                                      weight_decay=weight_decay))
        self.world_size = world_size

    def _buckets(self, group: Dict[str, Any]) -> Dict[Tuple, List[List[torch.Tensor]]]:
        """Per (device, dtype, step): [params, grads, exp_avg, exp_avg_sq, exp_avg_m_sq]."""
        out: Dict[Tuple, List[List[torch.Tensor]]] = {}
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("LocalAdamW does not support sparse gradients")
            st = self.state[p]
            if not st:
                st["step"] = 0
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_m_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            st["step"] = int(st["step"]) + 1
            lists = out.setdefault((p.device, p.dtype, st["step"]), [[], [], [], [], []])
            for lst, t in zip(lists, (p, p.grad, st["exp_avg"], st["exp_avg_sq"],
                                      st["exp_avg_m_sq"])):
                lst.append(t)
        return out

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step with the ``world_size``-rank second moment; returns the closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        w = float(self.world_size)
        for group in self.param_groups:
            b1, b2 = group["betas"]
            c = (1.0 - b1) / (1.0 + b1)
            lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
            for (_, _, t), (ps, gs, ms, vs, us) in self._buckets(group).items():
                bc1, bc2 = 1.0 - b1 ** t, 1.0 - b2 ** t
                torch._foreach_lerp_(ms, gs, 1.0 - b1)
                torch._foreach_mul_(vs, b2)
                torch._foreach_addcmul_(vs, gs, gs, 1.0 - b2)
                # m_hat = m / bc1 is folded into the scalars (no per-step copy of m)
                torch._foreach_mul_(us, b2)
                torch._foreach_addcmul_(us, ms, ms, (1.0 - b2) / (bc1 * bc1))
                denom = torch._foreach_div(vs, bc2)             # v_hat (temporaries: this and s2)
                if w > 1.0 and b1 > 0.0:   # beta1 = 0: m is g, u is v, nothing to tell noise by
                    s2 = torch._foreach_div(us, bc2)            # u_hat
                    torch._foreach_sub_(s2, denom)              # u_hat - v_hat = -(1 - c) s^2
                    torch._foreach_clamp_max_(s2, 0.0)
                    # v_W = max(v_hat - (1 - 1/W) s^2, v_hat / W), in place in s2 and denom
                    torch._foreach_mul_(s2, (1.0 - 1.0 / w) / (1.0 - c))
                    torch._foreach_add_(s2, denom)
                    torch._foreach_div_(denom, w)
                    torch._foreach_maximum_(denom, s2)
                torch._foreach_sqrt_(denom)
                torch._foreach_add_(denom, eps)
                if wd:
                    torch._foreach_mul_(ps, 1.0 - lr * wd)
                torch._foreach_addcdiv_(ps, ms, denom, value=-lr / bc1)
        return loss
