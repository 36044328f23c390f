"""How each method of :mod:`slimcomm.train` trains: the model wrapping, the optimizer, the schedule, the bytes.

:class:`_Method` wraps the model for one ``--method`` (DDP with a comm hook,
an :class:`~slimcomm.ist.ISTTrainer` or, for the GPT,
:class:`~slimcomm.ist.GPTISTTrainer`, or a synchronising optimizer from
``SYNC_OPTIMIZER_BUILDERS``), builds the optimizer (:func:`_make_optimizer`)
and its learning-rate schedule (:func:`lr_factor`), runs one training step and
counts the bytes sent per rank by the definition in :mod:`slimcomm.train`'s
docstring ("Bytes sent per rank"). The options it reads are resolved by
:mod:`slimcomm.train.args`.
"""

from __future__ import annotations

import argparse
import contextlib
import math
from typing import Any, Callable, Dict, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from .args import SYNC_DEFAULTS


_VALUE_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def lr_factor(step: int, total_steps: int, warmup_steps: int, schedule: str, final_ratio: float) -> float:
    """Learning-rate multiplier for the 0-based ``step`` of ``total_steps``.

    Linear warm-up ``(step + 1) / warmup_steps`` for the first
    ``warmup_steps`` steps; then ``1`` (``schedule="constant"``) or a half
    cosine from ``1`` down to ``final_ratio`` (``= min_lr / lr``) reached at
    the last step ``total_steps - 1`` (``"cosine"``). Steps past the end stay
    at ``final_ratio``.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    span = max(1, total_steps - 1 - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return final_ratio + (1.0 - final_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _data_parallel_size(args) -> int:
    """Ranks whose updates an optimizer-side method averages: the replicate dimension of
    ``--mesh R,S`` (R), else the world size."""
    mesh = getattr(args, "mesh", None)
    if mesh is not None:
        return int(mesh[0])
    return dist.get_world_size() if dist.is_initialized() else 1


def _make_optimizer(params, args, lr: Optional[float] = None) -> torch.optim.Optimizer:
    """SGD (L2 on every parameter), AdamW (decoupled decay on tensors with ndim >= 2 only), or
    with ``--inner-optimizer local-adamw`` :class:`slimcomm.optim.LocalAdamW` (the same groups)."""
    lr = args.lr if lr is None else lr
    if args.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=args.momentum, weight_decay=args.weight_decay)
    params = list(params)
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": args.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    if getattr(args, "inner_optimizer", None) == "local-adamw":
        from ..optim import LocalAdamW

        return LocalAdamW([g for g in groups if g["params"]], lr=lr, betas=(args.beta1, args.beta2),
                          world_size=_data_parallel_size(args))
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=(args.beta1, args.beta2))


# ---------------------------------------------------------------------------
# Methods whose optimizer owns the synchronisation (no DDP)
# ---------------------------------------------------------------------------
#
# A builder here maps a method name to ``builder(args, model, inner) -> optimizer`` where
# ``inner`` is the torch optimizer built by _make_optimizer over ``model.parameters()`` (the
# learning-rate schedule drives ``inner``). The returned object owns every collective:
# ``step()`` (after the training loop's ``loss.backward()`` and the --grad-clip of the LOCAL
# gradient), ``zero_grad(set_to_none=True)``, ``stats`` (a dict with
# ``stats["total"]["bytes_sent"]``: payload bytes per rank by the module-level definition) and
# ``state_dict()``. The model is not wrapped in DDP. The slimcomm.optim.SlimDPOptimizer methods
# (diloco, sparseloco, slimdp-local) are wired here, with their names added to METHODS and their
# options to build_parser, once that class lands, e.g.
#
#     def _build_diloco(args, model, inner):
#         from ..optim import SlimDPOptimizer
#         return SlimDPOptimizer(model, inner, sync_every=args.sync_every, compression="dense",
#                                outer_lr=args.outer_lr, outer_momentum=args.outer_momentum,
#                                nesterov=True, seed=args.seed)
#     SYNC_OPTIMIZER_BUILDERS["diloco"] = _build_diloco
#
# Between synchronisations the replicas differ, so an evaluation there averages the per-rank
# models' losses; such methods should evaluate at synchronisation steps (--eval-every a
# multiple of the sync period).
SYNC_OPTIMIZER_BUILDERS: Dict[str, Callable[[argparse.Namespace, nn.Module, torch.optim.Optimizer], Any]] = {}


def _build_sync_optimizer(args, model, inner, process_group=None):
    """``process_group``: the group the optimizer synchronises over (``--mesh``: ``mesh["replicate"]``;
    None = every rank)."""
    from ..optim import SlimDPOptimizer

    m = args.method
    kw = dict(sync_every=args.sync_every, outer_lr=args.outer_lr, outer_momentum=args.outer_momentum,
              nesterov=args.outer_momentum > 0, error_decay=args.error_decay, seed=args.seed,
              value_dtype=_VALUE_DTYPES[args.value_dtype] or torch.float32,
              value_bits=args.value_bits, bucket_cap_mb=args.bucket_cap_mb,
              lowbit_collective=args.lowbit_collective, error_feedback=not args.no_error_feedback,
              delay_syncs=getattr(args, "delay_syncs", None) or 0,
              overlap_steps=getattr(args, "overlap_steps", None))
    if m == "diloco":
        kw.update(compression="dense")
    elif m == "sparseloco":
        kw.update(compression="local", score="grad", core_ratio=args.core_ratio,
                  explore_ratio=args.explore_ratio)
    else:
        full = args.core_ratio + args.explore_ratio >= 1 or args.value_bits is not None
        kw.update(compression="dense" if full else "shared", core_ratio=args.core_ratio,
                  explore_ratio=args.explore_ratio, core_refresh=args.core_refresh)
    return SlimDPOptimizer(model, inner, process_group=process_group, **kw)


for _m in SYNC_DEFAULTS:
    SYNC_OPTIMIZER_BUILDERS[_m] = _build_sync_optimizer


class _Method:
    """One training method: owns the (wrapped) model, the optimizer, the LR schedule and the byte accounting.

    Args:
        args: the resolved options.
        model: the full model (identical initial weights on every rank).
        world_size: number of ranks.
        loss_fn: ``loss_fn(output, target) -> scalar tensor`` (mean over the batch).
        total_steps: planned training steps (the end of the cosine schedule).
        classify: count correct predictions (``argmax(1) == y``) in :meth:`train_step`.
    """

    def __init__(self, args, model: nn.Module, world_size: int, loss_fn: Callable, total_steps: int,
                 classify: bool):
        self.args = args
        self.name = args.method
        self.model = model
        self.world_size = world_size
        self.loss_fn = loss_fn
        self.classify = classify
        self.params = list(model.parameters())
        self.num_params = sum(p.numel() for p in self.params)
        self.dense_step_bytes = sum(p.numel() * p.element_size() for p in self.params)
        self.clip = float(args.grad_clip)
        self.steps = 0
        self.hook_state = None
        self.trainer = None
        self.ddp = None
        self.sched = None
        self.sync_optimizer = args.method in SYNC_OPTIMIZER_BUILDERS
        self.profiler = None
        if getattr(args, "profile", False):
            from .profile import StepProfiler

            self.profiler = StepProfiler()
        # local: the replicas never meet, so every rank scores its own model on the whole evaluation
        # set (the reported score is the mean over ranks); the others split it over the ranks
        self.eval_split = args.method != "local"
        final_ratio = args.min_lr / args.lr if args.lr_schedule == "cosine" else 1.0
        self._scheduled = args.lr_schedule != "constant" or args.warmup_lr_steps > 0

        def factor(step):
            return lr_factor(step, total_steps, args.warmup_lr_steps, args.lr_schedule, final_ratio)

        self._factor = factor
        m = self.name
        self.mesh = None
        self.eval_lockstep = False
        if getattr(args, "mesh", None) is not None:
            # FSDP2 over a (replicate, shard) mesh (slimcomm.train.sharding): the parameters become
            # DTensor shards; every rank of a replica group takes part in each forward, evaluations too
            from .sharding import MeshSetup

            self.mesh = MeshSetup(args, model, lambda params: _make_optimizer(params, args),
                                  _build_sync_optimizer)
            self.params = list(model.parameters())
            self.dense_step_bytes = self.mesh.dense_step_bytes
            self.sync_optimizer = self.mesh.sync_optimizer is not None
            self.hook_state = self.mesh.hook_state
            self.opt, inner = self.mesh.opt, self.mesh.inner
            self.forward_model = model
            self.eval_lockstep = True
            if self._scheduled:
                self.sched = torch.optim.lr_scheduler.LambdaLR(inner, factor)
            return
        if m == "ist" and args.model == "gpt":
            from ..ist import GPTISTTrainer

            # Heads and FFN neurons of every block partitioned over the ranks; embeddings,
            # LayerNorms, residual-projection biases and the head averaged at each round.
            # --grad-clip clips each rank's subnet gradient (on the device).
            self.trainer = GPTISTTrainer(
                model,
                lambda params: _make_optimizer(params, args, lr=args.lr * factor(self.steps)),
                local_steps=args.local_steps,
                seed=args.seed,
                scale_grads=not args.no_scale_grads,
                max_grad_norm=self.clip if self.clip > 0 else None,
            )
            return
        if m == "ist":
            from ..ist import ISTTrainer

            # The trainer builds a fresh optimizer every round; it starts at the schedule's lr
            # for the round's first step, and train_step keeps it on the schedule.
            self.trainer = ISTTrainer(
                model,
                lambda params: _make_optimizer(params, args, lr=args.lr * factor(self.steps)),
                local_steps=args.local_steps,
                seed=args.seed,
                scale_grads=not args.no_scale_grads,
                shared=args.ist_shared,
                subnets=getattr(args, "ist_subnets", None),
                # --ist-exchange-bits: None = not given (the trainer's default), 0 = 'none'
                **({} if getattr(args, "ist_exchange_bits", None) is None
                   else {"exchange_bits": args.ist_exchange_bits or None}),
            )
            return
        if self.sync_optimizer:
            inner = _make_optimizer(model.parameters(), args)
            self.opt = SYNC_OPTIMIZER_BUILDERS[m](args, model, inner)
            self.forward_model = model
        elif m == "local":
            # no DDP, no collective in a training step: each rank steps its own replica on its own
            # shard (the same initial weights everywhere: every rank seeds the model with --seed)
            inner = self.opt = _make_optimizer(model.parameters(), args)
            self.forward_model = model
        else:
            from torch.nn.parallel import DistributedDataParallel as DDP

            dev_ids = [model_device(model).index] if args.device == "cuda" else None
            # gradient_as_bucket_view: the gradients are views into DDP's buckets, which
            # saves copying every gradient out of its bucket after the synchronisation.
            self.ddp = DDP(model, device_ids=dev_ids, bucket_cap_mb=args.bucket_cap_mb,
                           gradient_as_bucket_view=True)
            self.forward_model = self.ddp
            register = self.ddp.register_comm_hook
            if self.profiler is not None:  # the hook's calls timed (slimcomm.train.profile)
                def register(state, hook, _reg=self.ddp.register_comm_hook, _p=self.profiler):
                    return _reg(state, _p.wrap_hook(hook))
            if m == "ddp" and self.profiler is not None:
                from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

                register(None, default_hooks.allreduce_hook)  # DDP's average, as a timed hook
            if m == "fp16":
                from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

                register(None, default_hooks.fp16_compress_hook)
            elif m == "powersgd":
                from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

                self.hook_state = psgd.PowerSGDState(
                    process_group=None,
                    matrix_approximation_rank=args.powersgd_rank,
                    start_powerSGD_iter=args.powersgd_start_iter,
                    use_error_feedback=True,
                    warm_start=True,
                    random_seed=args.seed,
                )
                register(self.hook_state, psgd.powerSGD_hook)
            elif m in ("topk", "slimdp"):
                from ..hooks import SlimDPState, slim_dp_hook

                kw = dict(
                    core_ratio=args.core_ratio,
                    explore_ratio=args.explore_ratio,
                    core_refresh=args.core_refresh,
                    index_mode="local" if m == "topk" else "shared",
                    value_dtype=_VALUE_DTYPES[args.value_dtype],
                    seed=args.seed,
                    warmup_steps=args.warmup_steps,
                    delay_steps=getattr(args, "delay_steps", None) or 0,
                    error_feedback=not args.no_error_feedback,
                )
                if getattr(args, "min_compress_numel", None) is not None:
                    kw["min_compress_numel"] = args.min_compress_numel
                if m == "slimdp":
                    kw["allreduce_algorithm"] = getattr(args, "allreduce_algorithm", None) or "backend"
                self.hook_state = SlimDPState(**kw).attach(model)
                register(self.hook_state, slim_dp_hook)
            inner = self.opt = _make_optimizer(self.ddp.parameters(), args)
            if m == "slimdp" and args.fuse_sgd:
                self.hook_state.fuse_sgd(inner)  # SGD at the index set, inside the hook
        if self._scheduled:
            self.sched = torch.optim.lr_scheduler.LambdaLR(inner, factor)

    def train_step(self, x: torch.Tensor, y: torch.Tensor):
        """One training step; returns (loss float, number correct or None)."""
        self.steps += 1
        if self.trainer is not None:
            loss = self.trainer.step(x, y, self.loss_fn)
            if self._scheduled:  # lr of the next step, on the current round's optimizer
                lr = self.args.lr * self._factor(self.steps)
                for group in self.trainer.optimizer.param_groups:
                    group["lr"] = lr
            return float(loss), None
        prof = self.profiler
        if prof is not None:
            prof.begin()
        self.opt.zero_grad(set_to_none=True)
        out = self.forward_model(x)
        loss = self.loss_fn(out, y)
        if prof is not None:
            prof.mark("forward")
        loss.backward()  # DDP: the comm hook has synchronised the gradient; sync optimizer: local only
        if prof is not None:
            prof.mark("backward")
        if self.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        self.opt.step()
        if prof is not None:
            prof.mark("optimizer")
        if self.sched is not None:
            self.sched.step()
        correct = int((out.detach().argmax(1) == y).sum()) if self.classify else None
        return float(loss.detach()), correct

    def before_eval(self):
        if self.trainer is not None:
            self.trainer.synchronize()

    def eval_model(self) -> nn.Module:
        return self.model

    def eval_context(self):
        """Local-step methods evaluate the outer (global) parameters, identical on every rank."""
        if self.sync_optimizer:
            return self.opt.outer_weights()
        return contextlib.nullcontext()

    def bytes_sent(self) -> int:
        """Bytes sent per rank so far, by the module-level definition (0 with one rank:
        its collectives have no other rank to send to, whatever the method)."""
        if self.world_size == 1:
            return 0
        if self.mesh is not None:  # across the replicate dimension only (sharding.REPLICATE_BYTES_DEFINITION)
            return self.mesh.replicate_bytes(self.steps)
        m = self.name
        if m == "local":
            return 0
        if self.sync_optimizer:
            return int(self.opt.stats["total"]["bytes_sent"])
        if m == "ddp":
            return self.steps * self.dense_step_bytes
        if m == "fp16":
            return self.steps * self.num_params * 2
        if m == "powersgd":
            st = self.hook_state
            dense_steps = min(self.steps, st.start_powerSGD_iter)
            return dense_steps * self.dense_step_bytes + 4 * int(st.total_numel_after_compression)
        if m in ("topk", "slimdp"):
            return int(self.hook_state.stats["total"]["bytes_sent"])
        # IST: ISTStats.bytes_sent is the ring all-gather's link traffic, (W - 1) x the padded
        # buffer each rank hands to all_gather per round; the payload definition is that buffer.
        st = self.trainer.stats
        return int(st.bytes_sent) // (self.world_size - 1) if self.world_size > 1 else 0

    def stats(self) -> Dict[str, Any]:
        if self.sync_optimizer:
            return _jsonable(self.opt.stats)
        if self.name == "powersgd":
            rate, before, after = self.hook_state.compression_stats()
            return {"compression_rate": rate, "numel_before_compression": before,
                    "numel_after_compression": after, "iter": self.hook_state.iter}
        if self.hook_state is not None:
            return _jsonable(self.hook_state.stats)
        if self.trainer is not None:
            return _jsonable(self.trainer.stats)
        return {}


def _jsonable(obj):
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return obj.tolist() if obj.numel() > 1 else obj.item()
    if isinstance(obj, (int, float, str, bool)) or obj is None:
        return obj
    if hasattr(obj, "__dataclass_fields__"):
        return {k: _jsonable(getattr(obj, k)) for k in obj.__dataclass_fields__}
    if hasattr(obj, "_asdict"):
        return _jsonable(obj._asdict())
    if hasattr(obj, "__dict__"):
        return _jsonable(vars(obj))
    return repr(obj)


def model_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device
