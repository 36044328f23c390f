"""Optimizer-side Slim-DP: local steps, then a compressed outer synchronisation.

The DDP hook (:mod:`slimcomm.hooks`) compresses gradients, which is right for
SGD but wrong for Adam-type optimizers: Adam normalises every coordinate every
step, so a coordinate whose sparse gradient waits ~50 steps in the error
feedback residual moves about one learning-rate step instead of ~50. This
module compresses the *optimizer's update* instead, in the local-steps form
of DiLoCo (Douillard et al., arXiv 2311.08105, Alg. 1):

1. every rank steps its own inner optimizer (e.g. AdamW) on its local
   gradients for ``sync_every`` steps (no communication);
2. pseudo-gradient ``delta = outer - local`` (the outer parameters are
   identical on every rank);
3. ``delta`` goes through the one Slim-DP compressor core
   (:class:`slimcomm.compressor.SlimDPCompressor`): error feedback keeps
   the unsent part of each update with its full magnitude, and the index set
   is *shared* (core set scored by ``|outer| * |G|``, plus a Philox explore
   set), so one all-reduce of ``k + m`` values per group and no indices
   travel;
4. outer step on the averaged sparse ``delta`` (SGD with optional
   (Nesterov) momentum, as in DiLoCo), then every rank's parameters are set
   to the new outer parameters, so replicas are identical after every sync.

The same class gives the baselines: ``compression="dense"`` is DiLoCo (dense
averaged pseudo-gradient, outer Nesterov SGD), ``compression="local"`` with
``error_decay < 1`` and plain outer SGD is SparseLoCo (Sarfi et al., arXiv
2508.15706, Alg. 1: per-rank top-k of an error-feedback accumulator decayed by
``beta``, all-gathered).

Usage (no DDP wrapper needed; every rank runs the same code)::

    inner = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.99))
    opt = SlimDPOptimizer(model, inner, sync_every=8, core_ratio=0.05, explore_ratio=0.05)
    model.load_state_dict(pretrained)  # optional; before the first step (any rank(s))
    for step, (x, y) in enumerate(loader, 1):
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)   # local gradient
        opt.step()                   # inner step; every 8th call also synchronises
        if step % 1000 == 0:         # evaluate / checkpoint the global model: on any ranks
            with torch.no_grad(), opt.outer_weights() as m:
                evaluate(m)
                torch.save(m.state_dict(), "global.pt")   # inside the block (or clone)
            torch.save(opt.state_dict(), f"opt-rank{rank}.pt")  # each rank its own, to resume
    opt.synchronize()                # end of training, every rank: replicas identical

``outer_weights()`` is the one way to look at the global model during
training: it needs no communication (rank 0 alone may evaluate), and it
refuses to nest or to run ``synchronize()``/``step()`` inside. Calling
``synchronize()`` yourself mid-training is a collective (on one rank it
hangs) and an extra outer step, so it is only for the end of training.

With a ``GradScaler``: ``scaler.step(opt); scaler.update()`` (a step the scaler
skips on one rank is still counted; the same as ``scaler.step(opt.inner);
opt.advance()``). Without one, a non-finite step on some rank (an inf loss)
costs that rank's contribution to one synchronisation and resets its inner
optimizer state (see :meth:`SlimDPOptimizer.synchronize`); float16 parameters
with Adam's default ``eps`` are refused. Uneven inputs (ranks with different
numbers of batches): run the loop inside ``with opt.join():``. A rank that dies
or hangs makes every other rank raise :class:`CollectiveError` within
``timeout`` seconds.
"""

from __future__ import annotations

import collections
import contextlib
import warnings
import weakref
import zlib
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from .. import _comm
from .._comm import CollectiveError
from ..agreement import agree_across_ranks
from ..compressor import SlimDPCompressor

__all__ = ["SlimDPOptimizer", "COMPRESSIONS", "CollectiveError"]

COMPRESSIONS = ("shared", "local", "dense")
_STATE_VERSION = 1


class _Group:
    """One flat run of parameters: outer copy, scratch, momentum, views."""

    __slots__ = ("positions", "params", "outer", "outer_views", "scratch", "scratch_views",
                 "momentum", "key", "reset_at")

    def __init__(self, positions: List[int], params: List[torch.Tensor], momentum: bool):
        self.positions = positions
        self.key = tuple(positions)
        self.params = params
        n = sum(p.numel() for p in params)
        dev = params[0].device
        self.outer = torch.empty(n, dtype=torch.float32, device=dev)
        self.scratch = torch.empty(n, dtype=torch.float32, device=dev)
        self.outer_views, self.scratch_views = [], []
        off = 0
        for p in params:
            self.outer_views.append(self.outer[off:off + p.numel()].view(p.shape))
            self.scratch_views.append(self.scratch[off:off + p.numel()].view(p.shape))
            off += p.numel()
        self.momentum = torch.zeros(n, dtype=torch.float32, device=dev) if momentum else None
        self.reset_at = -1   # the synchronisation at which this rank last reset its inner state


class SlimDPOptimizer:
    r"""Local steps of any torch optimizer + a Slim-DP-compressed outer step.

    See the module docstring for the algorithm. Not a ``torch.optim.Optimizer``
    subclass: schedule the learning rate on ``inner`` (``opt.inner``), which
    is also what a ``GradScaler`` steps.

    Args:
        model: the ``nn.Module`` trained (or a DDP wrapper, whose ``module``
            is used; use DDP's ``no_sync()`` for the local steps then).
            Every parameter with ``requires_grad`` at construction is
            synchronised; position ``i`` is the ``i``-th such parameter of
            ``named_parameters()``. Parameters (trainable and frozen) and
            buffers (e.g. BatchNorm statistics) are broadcast from rank 0 at
            construction (like DDP), so replicas start identical; buffers and
            frozen parameters are not synchronised afterwards. Weights loaded
            into the model after construction and before the first inner step
            (on every rank, or on rank 0 only) are the starting point: the
            outer copy follows the model until this rank's first inner step,
            and the first synchronisation makes rank 0's starting point
            everyone's (each rank's pseudo-gradient stays relative to its own
            start). Loading weights into the model later is overwritten at the
            next synchronisation (use :meth:`load_state_dict` to resume).
        inner: the inner optimizer, built over exactly those parameters
            (frozen parameters of the model may be in it too; they must stay
            frozen). Groups added later with ``add_param_group`` or a frozen
            parameter unfrozen later are refused at the next
            synchronisation: construct a new ``SlimDPOptimizer``.
        sync_every: ``H``, inner steps between synchronisations (>= 1).
        compression: ``"shared"`` (Slim-DP, one all-reduce of the values at an
            index set identical on every rank), ``"local"`` (per-rank top-k,
            all-gathered index/value pairs: SparseLoCo's compressor) or
            ``"dense"`` (every coordinate: DiLoCo).
        core_ratio, explore_ratio: fractions of each parameter in the core
            set (top-k by ``score``) and in the uniform explore set, as in
            :class:`slimcomm.hooks.SlimDPState` (ignored for ``"dense"``).
        core_refresh: synchronisations between core-set refreshes (>= 1).
        warmup_syncs: the first synchronisations are dense (``G`` starts from
            their average), >= 0.
        score: ``"product"`` (``|outer| * |G|``), ``"grad"`` (``|G|``) or
            ``"weight"``.
        value_dtype: wire dtype of the values (default bf16).
        value_bits: ``None`` (values in ``value_dtype``, all-reduced) or 1, 2,
            4, 8: per-chunk scaled low-bit codes (:mod:`slimcomm.codec`),
            all-gathered, with the rounding error kept by error feedback.
        quant_chunk: values per quantisation chunk (one bf16 scale each).
        outer_lr: outer learning rate (1.0 = apply the averaged update).
        outer_momentum: outer SGD momentum in ``[0, 1)`` (DiLoCo: 0.9).
        nesterov: Nesterov outer momentum (DiLoCo: True).
        error_feedback: keep the unsent part of each update (recommended).
        error_decay: ``beta`` in ``(0, 1]``; the residual is multiplied by it
            before the next pseudo-gradient is added (SparseLoCo: 0.95).
        seed: explore-set seed, equal on every rank.
        process_group: group to synchronise over (default: the world).
        bucket_cap_mb: parameters are synchronised in groups of about this
            many MB of fp32 values (one collective per group).
        check_agreement_every: every n-th compressed sync checks the index
            sets across ranks with one all-reduce of 8 int64 (default 100;
            0 = never; cost in ``stats["total"]["checks"/"check_bytes"]``).
        timeout: seconds any one collective may wait (default 300; ``None`` =
            the process group's own timeout, 30 minutes on gloo). Passed to the
            backend with each collective (the process group is not changed). A
            rank that died is noticed within about a second; one that hangs
            or stopped stepping makes the others raise after ``timeout``.
            After ``sync_every`` steps the faster ranks wait for the slowest
            at the synchronisation, so keep ``timeout`` above the time of
            ``sync_every`` steps (plus checkpointing or evaluation between).

    Reliability: a failed or timed-out collective, or ranks whose local steps
    or synchronisation counts drifted apart (see :meth:`synchronize`), raise
    :class:`~slimcomm.optim.CollectiveError` on every surviving rank; nothing
    of that synchronisation is written into the model and the optimizer
    refuses further use. Uneven inputs: :meth:`join`.

    Arguments are fixed at construction: assigning ``sync_every``,
    ``compression``, ``outer_lr``, ``outer_momentum``, ``nesterov``,
    ``process_group`` or ``inner`` afterwards raises ``AttributeError``
    (build a new ``SlimDPOptimizer``; the compressor's hyperparameters are
    frozen the same way). Schedule the learning rate on ``inner``'s
    ``param_groups``.

    Raises:
        ValueError: an argument out of range, ``inner`` not over the model's
            trainable parameters, float16 parameters in an Adam-type group
            (``betas`` and ``eps``) whose ``eps`` is below float16's smallest
            normal number 6.1e-05 (its updates are inf/NaN) (raised on the
            rank that sees it; the other ranks raise a RuntimeError instead of
            waiting).
    """

    def __init__(
        self,
        model: nn.Module,
        inner: torch.optim.Optimizer,
        *,
        sync_every: int = 8,
        compression: str = "shared",
        core_ratio: float = 0.05,
        explore_ratio: float = 0.05,
        core_refresh: int = 1,
        warmup_syncs: int = 0,
        score: str = "product",
        value_dtype: Optional[torch.dtype] = torch.bfloat16,
        value_bits: Optional[int] = None,
        quant_chunk: int = 4096,
        outer_lr: float = 1.0,
        outer_momentum: float = 0.0,
        nesterov: bool = False,
        error_feedback: bool = True,
        error_decay: float = 1.0,
        seed: int = 0,
        process_group: Optional[dist.ProcessGroup] = None,
        bucket_cap_mb: float = 25.0,
        check_agreement_every: int = 100,
        timeout: Optional[float] = 300.0,
    ):
        self.process_group = process_group
        self._failed: Optional[str] = None
        self._joined = False
        error: Optional[BaseException] = None
        fingerprint = 0
        try:
            self._validate(model, inner, sync_every, compression, outer_lr, outer_momentum,
                           bucket_cap_mb)
            self.timeout = _comm.check_timeout(timeout, "SlimDPOptimizer")
            for name, v in (("nesterov", nesterov), ("error_feedback", error_feedback)):
                if not isinstance(v, bool):
                    raise ValueError(f"{name} must be a bool (True or False), got {v!r}")
            if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
                raise ValueError(f"process_group must be a torch.distributed.ProcessGroup or "
                                 f"None, got {type(process_group).__name__} {process_group!r}")
            module = model.module if isinstance(model, nn.parallel.DistributedDataParallel) \
                else model
            named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
            self.compression = compression
            dense = compression == "dense"
            self.compressor = SlimDPCompressor(
                process_group=process_group,
                core_ratio=1.0 if dense else core_ratio,
                explore_ratio=0.0 if dense else explore_ratio,
                core_refresh=core_refresh, warmup_steps=warmup_syncs, score=score,
                index_mode="local" if compression == "local" else "shared",
                error_feedback=error_feedback and not dense, error_decay=error_decay,
                value_dtype=value_dtype, seed=seed,
                check_agreement_every=check_agreement_every, value_bits=value_bits,
                quant_chunk=quant_chunk)
            self.compressor._timeout = self.timeout
            self.inner = inner
            self.sync_every = sync_every
            self.outer_lr = float(outer_lr)
            self.outer_momentum = float(outer_momentum)
            self.nesterov = bool(nesterov)
            self.local_step = 0
            self.syncs = 0
            self._synced_at = 0
            self._module = module
            self._groups = self._make_groups(named, bucket_cap_mb)
            hp = (sync_every, compression, self.outer_lr, self.outer_momentum, self.nesterov,
                  self.compressor._hyperparameters(),
                  [(n, tuple(p.shape), str(p.dtype)) for n, p in named])
            fingerprint = zlib.crc32(repr(hp).encode())
        except ValueError as exc:
            error = exc
        device = self._groups[0].outer.device if error is None and self._groups else None
        differ = agree_across_ranks(
            {"hyperparameters and parameter shapes": fingerprint}, error, group=process_group,
            device=device, timeout=timeout if error is None else None,
            other_failed="SlimDPOptimizer: another rank could not be constructed (see its "
                         "error); no rank can proceed")
        if differ:
            raise RuntimeError(
                "SlimDPOptimizer: the ranks were constructed with different hyperparameters "
                "or models; construct it with the same arguments on every rank")
        views = [v for g in self._groups for v in g.outer_views]
        self.compressor.attach_parameters([(n, v) for (n, _), v in zip(named, views)])
        # Parameters frozen at construction (broadcast like DDP, never synchronised; one
        # unfrozen later is refused at the next synchronisation) and inner's size, to
        # refuse parameters added later with add_param_group.
        self._names = [n for n, _ in named]
        self._frozen_named = [(n, p) for n, p in module.named_parameters() if not p.requires_grad]
        self._inner_size = _inner_size(inner)
        self._broadcast_initial_state()
        # Until this rank's first inner step the outer copy follows the model (weights loaded
        # after construction are the starting point, as with DDP); the first synchronisation
        # makes rank 0's starting point everyone's (see _adopt_rank0_start).
        self._start_pending = True
        self._adopt_start = True
        self._in_outer = False
        # Non-finite pseudo-gradients: per-sync device flags read on the host without a sync.
        self._zero = {g.outer.device: torch.zeros((), dtype=torch.float32, device=g.outer.device)
                      for g in self._groups}
        self._pending: collections.deque = collections.deque()
        self._nonfinite_syncs = 0
        self._warned_nonfinite = False
        me = weakref.ref(self)   # the hook must not keep this object alive through inner

        def before_inner_step(optimizer, args, kwargs):
            opt = me()
            if opt is not None:
                opt._before_inner_step()

        self._hook = inner.register_step_pre_hook(before_inner_step)
        self._frozen = True

    _FROZEN = frozenset(("sync_every", "compression", "outer_lr", "outer_momentum", "nesterov",
                         "process_group", "inner", "compressor", "timeout"))

    def __setattr__(self, name, value):
        if name in self._FROZEN and self.__dict__.get("_frozen"):
            raise AttributeError(
                f"SlimDPOptimizer.{name} cannot be changed after construction (every rank's "
                f"outer step and the synchronisation schedule depend on it); construct a new "
                f"SlimDPOptimizer with {name}={value!r} instead")
        object.__setattr__(self, name, value)

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

    def _make_groups(self, named, bucket_cap_mb) -> List[_Group]:
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
        return [_Group(g, [named[i][1] for i in g], momentum) for g in groups]

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
            _broadcast_flat([p for _, p in self._frozen_named] + list(self._module.buffers()),
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
        Identical starts leave the parameters bit-identical. One broadcast per group,
        once per run.
        """
        group, t = self.process_group, self.timeout
        what = f"{self._what()}: the broadcast of rank 0's starting point"
        with torch.no_grad():
            for g in self._groups:
                g.scratch.copy_(g.outer)
                _comm.wait(_comm.broadcast(g.outer, 0, group, t), what, t)
                torch.sub(g.outer, g.scratch, out=g.scratch)
                torch._foreach_add_(g.params, g.scratch_views)
            _broadcast_flat([p for _, p in self._frozen_named], group, t, what)
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

    def _forbid_in_outer(self, what: str) -> None:
        if self._in_outer:
            raise RuntimeError(
                f"SlimDPOptimizer.{what} inside outer_weights(): the model holds the outer "
                f"parameters there and this rank's local ones are set aside until the block "
                f"exits; call it after the block")

    # ---------------------------------------------------------------- stepping
    @property
    def param_groups(self):
        """The inner optimizer's ``param_groups`` (learning rates live there)."""
        return self.inner.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``inner.zero_grad(set_to_none)``."""
        self.inner.zero_grad(set_to_none=set_to_none)

    #: ``torch.amp.GradScaler.step(opt)`` then always calls :meth:`step` (with
    #: ``grad_scale`` / ``found_inf`` set), so a step it skips is still counted
    _step_supports_amp_scaling = True

    def step(self, closure=None):
        """One inner step, then :meth:`advance`. Returns the closure's loss, if any.

        Under ``GradScaler.step(opt)`` (``scaler.step(opt); scaler.update()``) the
        gradients are unscaled here and the inner step is skipped when the scaler
        found inf/NaN on this rank -- but the step is counted either way, so the
        ranks' synchronisation schedules cannot drift apart. (Equivalent to
        ``scaler.step(opt.inner); opt.advance()``.)

        Raises:
            RuntimeError: inside :meth:`outer_weights`.
            CollectiveError: after a failed synchronisation.
        """
        self._check_usable()
        self._forbid_in_outer("step()")
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None:  # called by GradScaler.step(self)
            if closure is not None:
                raise ValueError("SlimDPOptimizer.step: a closure cannot be used under "
                                 "GradScaler.step(opt)")
            grad_scale = getattr(self, "grad_scale", None)
            if grad_scale is not None:  # not unscaled yet: do what GradScaler.unscale_ does
                grads = [p.grad for g in self.inner.param_groups for p in g["params"]
                         if p.grad is not None]
                inv = grad_scale.double().reciprocal().float()
                dummy = torch.zeros((), dtype=torch.float32, device=inv.device)
                for dev in {gr.device for gr in grads}:
                    torch._amp_foreach_non_finite_check_and_unscale_(
                        [gr for gr in grads if gr.device == dev], dummy.to(dev), inv.to(dev))
            if not bool(found_inf):  # GradScaler's own skip decision (one host read)
                self.inner.step()
            self.advance()
            return None
        loss = self.inner.step(closure) if closure is not None else self.inner.step()
        self.advance()
        return loss

    def advance(self) -> bool:
        """Count one local step; synchronise when ``sync_every`` steps are done.

        Call on every rank after every inner step, also one a ``GradScaler``
        skipped. Returns whether it synchronised.

        Raises:
            RuntimeError: inside :meth:`outer_weights`.
        """
        self._check_usable()
        self._forbid_in_outer("advance()")
        self.local_step += 1
        if self.local_step % self.sync_every == 0:
            self.synchronize()
            return True
        return False

    @torch.no_grad()
    def synchronize(self) -> None:
        """Outer step now (collective): compress and average the pseudo-gradients,
        step the outer parameters, set every rank's parameters to them.

        Called by :meth:`advance` every ``sync_every`` steps. Calling it yourself
        is a collective (every rank alike, or the others hang) and an extra outer
        step (outer momentum included): do it once at the end of training, on
        every rank, to make the local parameters the global ones. To evaluate or
        checkpoint the global model during training use :meth:`outer_weights`
        (no communication, any subset of ranks). A no-op when no local step
        happened since the last synchronisation.

        A rank whose pseudo-gradient in a parameter group is non-finite (NaN/inf
        somewhere, e.g. after an inf loss without a ``GradScaler``) sends zeros
        for that whole group instead (the average still divides by the world
        size), and resets its inner optimizer's state of those
        parameters (to a fresh optimizer's: empty) so that its next steps are
        finite again; its local parameters are set to the new outer ones like
        every rank's. The first occurrence warns (``RuntimeWarning``);
        ``stats["nonfinite_syncs"]`` counts them. No host sync: on a GPU the
        host learns of it (and resets the state) one synchronisation later.

        Each synchronisation starts with one agreement all-reduce of 5 int64
        counters (80 bytes, one host read, once per ``sync_every`` steps; in
        ``stats["total"]["checks"]``): the local step, the number of
        synchronisations and whether each rank has joined. It runs *before* the
        value collectives because consecutive synchronisations can differ in
        their collectives (warm-up, core refresh, agreement checks), so ranks
        whose schedules drifted must be stopped before they issue collectives
        of different sizes.

        Raises:
            CollectiveError (a ``RuntimeError``), on every rank: a collective
                failed or did not complete within ``timeout`` seconds (a rank
                died, hung, or stopped calling :meth:`step`), or the ranks
                reached this synchronisation at different local steps or
                synchronisation counts (uneven inputs without :meth:`join`;
                :meth:`synchronize` called on some ranks only; a step not
                counted with :meth:`advance`). The model is left as it was
                before this synchronisation, and the optimizer refuses further
                use (restart from a checkpoint).
            RuntimeError: inside :meth:`outer_weights`; ``inner`` gained
                parameters (``add_param_group``) or a parameter frozen at
                construction was unfrozen (on the ranks where that happened;
                the other ranks raise CollectiveError after ``timeout``).
        """
        self._check_usable()
        self._forbid_in_outer("synchronize()")
        if self.local_step == self._synced_at:
            return
        self._check_parameters_unchanged()
        self._agree(joined=False)
        self._sync_collectives()

    def _check_usable(self) -> None:
        if self._failed is not None:
            raise CollectiveError(f"SlimDPOptimizer cannot be used after a failed "
                                  f"synchronisation: {self._failed}")

    def _what(self) -> str:
        return (f"SlimDPOptimizer.synchronize (synchronisation {self.syncs + 1}, local step "
                f"{self.local_step})")

    def _fail(self, exc: BaseException):
        self._failed = str(exc)
        return exc

    def _agree(self, joined: bool) -> Dict[str, Any]:
        """The per-sync agreement (see :meth:`synchronize`); raises on every rank if the
        counters of the ranks that have not joined differ. Returns what every rank
        learnt: ``any_active`` (some rank still steps), ``unsynced`` (some rank has
        local steps since the last synchronisation)."""
        vals = [0 if joined else 1, self.syncs, self.compressor.step,
                None if joined else self.local_step, int(self.local_step != self._synced_at)]
        dev = self._groups[0].outer.device
        try:
            hi, lo = _comm.agree_counters(vals, self.process_group, self.timeout, dev,
                                          self._what())
        except CollectiveError:
            self._failed = "a rank died or hung (see the first error)"
            raise
        self.compressor._count_check(2 * 8 * len(vals))
        if hi[1] != lo[1] or hi[2] != lo[2] or hi[3] != lo[3]:
            # Rare path, taken by every rank alike: one more collective names the ranks.
            rows = _comm.gather_rows([-1 if v is None else v for v in vals],
                                     self.process_group, self.timeout, dev)
            where = ", ".join(
                f"rank {r}: " + ("joined" if row[0] == 0 else f"local step {row[3]}")
                + f", {row[1]} synchronisations done" for r, row in enumerate(rows))
            raise self._fail(CollectiveError(
                f"{self._what()}: the ranks reached this synchronisation at different "
                f"points ({where}). Every rank must call step() (or advance()) the same "
                f"number of times and synchronize() at the same local step. Usual causes: "
                f"uneven inputs (a rank ran out of batches: wrap the training loop in "
                f"`with opt.join():`, or agree on the number of steps up front); "
                f"synchronize() called on some ranks only (e.g. in an evaluation block on "
                f"rank 0); a step skipped without advance(). Nothing was synchronised; "
                f"restart every rank from the last checkpoint"))
        return {"any_active": hi[0] == 1, "unsynced": hi[4] == 1}

    def _sync_collectives(self) -> None:
        if self._start_pending:      # no inner step ran on this rank (e.g. GradScaler skips)
            self._take_start()
        if self._adopt_start:
            self._adopt_rank0_start()
        comp = self.compressor
        what = self._what()
        futs = []
        bad: Dict[torch.device, List[torch.Tensor]] = {}   # per device: finite flags
        try:
            for i, g in enumerate(self._groups):
                layout = comp.layout_for(lambda g=g: g.key,
                                         lambda key, g=g: (g.outer.device, torch.float32),
                                         f"parameter group {i}", g.outer.device)
                # pseudo-gradient = outer - local, into the scratch buffer
                torch._foreach_copy_(g.scratch_views, g.params)
                torch.sub(g.outer, g.scratch, out=g.scratch)
                # Non-finite on this rank: send zeros instead (branchless, 3 ops; the largest
                # |x| is NaN or inf iff some coordinate is)
                ok = torch.linalg.vector_norm(g.scratch, float("inf")) < float("inf")
                torch.where(ok, g.scratch, self._zero[g.outer.device], out=g.scratch)
                bad.setdefault(g.outer.device, []).append(ok)
                futs.append(comp.synchronize(layout, g.scratch, weight=g.outer,
                                             warmup_dtype=comp.value_dtype or torch.float32))
            comp.end_step()
            # Every group's result first: a failed collective raises here, before any
            # parameter is written (no group is applied from a partly failed sync).
            avgs = [_comm.wait(fut, what, self.timeout) for fut in futs]
        except CollectiveError as exc:
            if not str(exc).startswith("SlimDPOptimizer"):
                exc = CollectiveError(f"{what}: {exc}")
            raise self._fail(exc) from exc.__cause__
        except Exception as exc:  # the compressor state may be half-updated: stop here
            self._fail(exc)
            raise
        for g, avg in zip(self._groups, avgs):
            # A parameter that was non-finite on some rank comes back NaN: skip its update.
            # (nan_to_num to 0 is where(isfinite(avg), avg, 0), in one op)
            avg = avg.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
            if g.momentum is not None:
                g.momentum.mul_(self.outer_momentum).add_(avg)
                upd = avg.add(g.momentum, alpha=self.outer_momentum) if self.nesterov \
                    else g.momentum
            else:
                upd = avg
            g.outer.sub_(upd, alpha=self.outer_lr)
            torch._foreach_copy_(g.params, g.outer_views)
        self._publish_flags(bad)
        self.syncs += 1
        self._synced_at = self.local_step
        self._drain_flags(wait=False)

    # ---------------------------------------------------------------- non-finite steps
    def _publish_flags(self, bad: Dict[torch.device, List[torch.Tensor]]) -> None:
        """Queue this synchronisation's per-group finite flags (bool, True = finite) for
        the host: on a
        GPU one ``stack`` and one non-blocking copy to pinned memory per device, and
        an event; on the CPU the flags are host memory already (read with numpy,
        which dispatches nothing)."""
        parts = []
        for dev, flags in bad.items():
            if dev.type == "cpu":
                parts.append((flags, None))      # fresh tensors every synchronisation
            elif dev.type == "cuda":             # into pinned memory, no stream sync
                host = torch.stack(flags).to("cpu", non_blocking=True)
                ev = torch.cuda.Event()
                ev.record()
                parts.append((host, ev))
            else:                                # other accelerators: a blocking copy
                parts.append((torch.stack(flags).cpu(), None))
        self._pending.append((self.syncs, parts))

    def _drain_flags(self, wait: bool) -> None:
        """Handle the queued flags whose copies are done (all of them if ``wait``)."""
        while self._pending:
            index, parts = self._pending[0]
            if not wait and any(ev is not None and not ev.query() for _, ev in parts):
                break
            for _, ev in parts:
                if ev is not None:
                    ev.synchronize()
            self._pending.popleft()
            flags = [not f for host, _ in parts
                     for t in (host if isinstance(host, list) else [host])
                     for f in t.numpy().reshape(-1)]
            self._handle_nonfinite(index, flags)

    def _handle_nonfinite(self, index: int, flags: List[bool]) -> None:
        """Synchronisation ``index`` had these per-group non-finite flags (device order)."""
        if not any(flags):
            return
        self._nonfinite_syncs += 1
        groups = [g for dev in self._zero for g in self._groups if g.outer.device == dev]
        hit = [g for g, f in zip(groups, flags) if f]
        current = self.syncs - 1
        names = []
        for g in hit:
            if index > g.reset_at:   # not caused by a state this rank has already reset
                for p in g.params:
                    self.inner.state.pop(p, None)
                g.reset_at = current
            names.extend(self._names[pos] for pos in g.positions)
        if not self._warned_nonfinite:
            self._warned_nonfinite = True
            rank = dist.get_rank(self.process_group)
            warnings.warn(
                f"SlimDPOptimizer: rank {rank}: non-finite pseudo-gradient (NaN/inf local "
                f"parameters, e.g. after an inf loss without a GradScaler) at synchronisation "
                f"{index} in {len(names)} parameter(s) ({', '.join(names[:3])}"
                f"{', ...' if len(names) > 3 else ''}): this rank sent zeros for them, reset "
                f"its inner optimizer state of those parameters and continues from the outer "
                f"ones. Later occurrences are only counted, in stats['nonfinite_syncs']",
                RuntimeWarning, stacklevel=4)

    @contextlib.contextmanager
    def join(self):
        """Context manager for uneven inputs: ranks may run different numbers of steps.

        A rank whose loop inside the block ends first *shadows* the others'
        synchronisations when it leaves the block (like DDP's ``join()``): it
        takes part in every synchronisation the other ranks still do, sending
        the local progress it had not synchronised yet and then nothing new
        (its error feedback residual still drains), and applies the same outer
        step, so its outer parameters stay identical. When every rank has left
        its loop, one last synchronisation runs if any rank has unsynchronised
        local steps, and every rank leaves the block with identical parameters.
        A rank that finished waits up to ``timeout`` seconds per synchronisation
        of the others (the time ``sync_every`` steps take must stay below it).

        Example::

            with opt.join():
                for x, y in loader:        # loaders of different lengths per rank
                    opt.zero_grad()
                    loss_fn(model(x), y).backward()
                    opt.step()
            # here: every rank synchronised, replicas identical

        The alternative without ``join()``: agree on the number of steps up front
        (e.g. ``n = min over ranks of len(loader)`` with one all-reduce MIN) and
        run exactly ``n`` steps on every rank.

        Raises:
            CollectiveError: as :meth:`synchronize` (e.g. a rank not inside
                ``join()`` ran out of batches, or a rank died).
            RuntimeError: ``join()`` entered while already joined.
        """
        self._check_usable()
        if self._joined:
            raise RuntimeError("SlimDPOptimizer.join() is already active (it cannot nest)")
        self._joined = True
        try:
            yield self
        except BaseException:
            self._joined = False
            raise
        try:
            with torch.no_grad():
                while True:
                    seen = self._agree(joined=True)
                    if not seen["any_active"]:
                        if seen["unsynced"]:
                            self._sync_collectives()  # the last one, every rank together
                        break
                    self._sync_collectives()  # shadow an active rank's synchronisation
        finally:
            self._joined = False

    @contextlib.contextmanager
    def outer_weights(self):
        """Context manager: the model holds the outer (global) parameters inside it.

        The one way to evaluate or checkpoint the global model during training::

            with torch.no_grad(), opt.outer_weights() as model:   # any subset of ranks
                val_loss = evaluate(model)
                if rank == 0:
                    torch.save(model.state_dict(), "global.pt")    # saved inside the block

        The outer parameters are those of the last synchronisation (before the
        first one: the starting point), identical on every rank; the local
        progress since then is not in them. No communication, so it is correct
        on one rank (e.g. rank 0 evaluating alone) or on all. On exit the model
        holds this rank's local parameters again, in place: a
        ``model.state_dict()`` taken inside holds references that show the
        local parameters after the block, so save it (or ``clone()`` its
        tensors) inside. ``opt.state_dict()`` inside is the same as outside
        (this rank's local parameters, set aside while in the block). Buffers
        (e.g. BatchNorm statistics) stay this rank's. Yields the model.

        Raises:
            RuntimeError: nested in another ``outer_weights()`` block;
                :meth:`step`, :meth:`advance`, :meth:`synchronize`,
                :meth:`load_state_dict` or an inner step (``opt.inner.step()``,
                ``scaler.step(opt.inner)``) inside the block.
        """
        if self._in_outer:
            raise RuntimeError(
                "SlimDPOptimizer.outer_weights() is already active: nested blocks would set "
                "this rank's local parameters aside twice and lose them; use one block")
        if self._start_pending:   # no inner step yet: the model itself is the starting point
            with torch.no_grad():
                for g in self._groups:
                    torch._foreach_copy_(g.outer_views, g.params)
        with torch.no_grad():
            for g in self._groups:
                torch._foreach_copy_(g.scratch_views, g.params)
                torch._foreach_copy_(g.params, g.outer_views)
        self._in_outer = True
        try:
            yield self._module
        finally:
            self._in_outer = False
            with torch.no_grad():
                for g in self._groups:
                    torch._foreach_copy_(g.params, g.scratch_views)

    # ---------------------------------------------------------------- stats
    @property
    def stats(self) -> Dict[str, Any]:
        """The compressor's stats (``total``/``last``: ``bytes_sent`` per rank,
        ``bytes_dense``, ``density``, ...; one "step" = one synchronisation)
        plus ``local_steps``, ``syncs`` and ``nonfinite_syncs`` (synchronisations
        at which this rank's pseudo-gradient was non-finite in some parameter
        group, so it sent zeros there; see :meth:`synchronize`). Reading it
        synchronises with the device."""
        st = self.compressor.stats
        st["local_steps"] = self.local_step
        st["syncs"] = self.syncs
        pending = 0
        for _, parts in self._pending:   # not yet seen by the host (GPU): count, handle later
            for host, ev in parts:
                if ev is not None:
                    ev.synchronize()
            pending += any(not f for host, _ in parts
                           for t in (host if isinstance(host, list) else [host])
                           for f in t.numpy().reshape(-1))
        st["nonfinite_syncs"] = self._nonfinite_syncs + pending
        return st

    # ---------------------------------------------------------------- checkpoint
    def state_dict(self) -> Dict[str, Any]:
        """This rank's state: inner optimizer, outer parameters and momentum,
        compressor (residuals: per rank), this rank's local parameters (they
        differ from the outer ones between synchronisations, and the
        constructor broadcasts rank 0's), counters and ``compression``. Every
        rank saves its own; a resume is bit-exact. Inside :meth:`outer_weights`
        it is the same as outside (the local parameters set aside there).
        Tensors are copies (outer, local, momentum) or references (inner,
        compressor), as in ``torch.optim.Optimizer.state_dict``."""
        if self._start_pending:   # no inner step yet: the model itself is the starting point
            self._take_start()
            self._start_pending = True
        local = []
        with torch.no_grad():
            for g in self._groups:
                flat = torch.empty_like(g.outer)
                src = g.scratch_views if self._in_outer else g.params
                torch._foreach_copy_([flat[a:a + v.numel()].view(v.shape) for a, v in
                                      zip(_offsets(g.outer_views), g.outer_views)], src)
                local.append(flat)
        return {
            "version": _STATE_VERSION,
            "compression": self.compression,
            "nonfinite_syncs": self._nonfinite_syncs,
            "start_adopted": not self._adopt_start,
            "local_step": self.local_step,
            "syncs": self.syncs,
            "synced_at": self._synced_at,
            "inner": self.inner.state_dict(),
            "outer": [g.outer.clone() for g in self._groups],
            "local": local,
            "momentum": [None if g.momentum is None else g.momentum.clone()
                         for g in self._groups],
            "compressor": self.compressor.state_dict(),
        }

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` of this rank, saved with the same model
        and arguments.

        Collective (every rank calls it): the state records the rank that saved
        it, and a load of another rank's state (e.g. rank 0's file on every
        rank) or a malformed one raises on every rank before anything is
        changed.

        Raises:
            ValueError: unknown version, group sizes that do not match, a
                state saved with another ``compression``, a malformed entry
                (raised on the rank that has it).
            RuntimeError: the state was saved by another rank or world size
                (on that rank), or another rank's load failed (on the others);
                called inside :meth:`outer_weights`.
        """
        self._forbid_in_outer("load_state_dict()")
        error: Optional[BaseException] = None
        try:
            self._check_state(state_dict)
            err = self.compressor._owner_error(state_dict["compressor"]["owner"])
            if err is not None:
                raise err
        except (ValueError, RuntimeError, KeyError, TypeError) as exc:
            error = exc
        agree_across_ranks(
            {}, error, group=self.process_group, device=self._groups[0].outer.device,
            other_failed="SlimDPOptimizer.load_state_dict: another rank could not load its "
                         "state_dict (see its error, e.g. a file saved by another rank); no "
                         "rank can proceed")
        outer, mom = state_dict["outer"], state_dict["momentum"]
        self.compressor.load_state_dict(state_dict["compressor"])
        self.inner.load_state_dict(state_dict["inner"])
        with torch.no_grad():
            for g, o, m, loc in zip(self._groups, outer, mom, state_dict["local"]):
                g.outer.copy_(o)
                torch._foreach_copy_(g.params, [loc[a:a + v.numel()].view(v.shape) for a, v in
                                                zip(_offsets(g.outer_views), g.outer_views)])
                if g.momentum is not None and m is not None:
                    g.momentum.copy_(m)
        self.local_step = state_dict["local_step"]
        self.syncs = state_dict["syncs"]
        self._synced_at = state_dict["synced_at"]
        self._nonfinite_syncs = int(state_dict.get("nonfinite_syncs", 0))
        self._pending.clear()
        # The checkpoint's outer copies are the starting point (identical on every rank).
        self._start_pending = False
        self._adopt_start = not state_dict.get("start_adopted", True)

    def _check_state(self, state_dict: Dict[str, Any]) -> None:
        if not isinstance(state_dict, dict):
            raise ValueError(f"state_dict must be a dict, got {type(state_dict).__name__}")
        if state_dict.get("version") != _STATE_VERSION:
            raise ValueError(f"state_dict: unknown version {state_dict.get('version')!r} "
                             f"(expected {_STATE_VERSION})")
        for key in ("local_step", "syncs", "synced_at", "inner", "outer", "local", "momentum",
                    "compressor"):
            if key not in state_dict:
                raise ValueError(f"state_dict lacks {key!r}")
        saved = state_dict.get("compression", self.compression)
        if saved != self.compression:
            raise ValueError(
                f"state_dict was saved by a SlimDPOptimizer with compression={saved!r}; this "
                f"one has compression={self.compression!r}: resume with "
                f"compression={saved!r} (the residuals, index sets and momentum belong to it)")
        for key in ("local_step", "syncs", "synced_at"):
            v = state_dict[key]
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"state_dict: {key} must be an int >= 0, got {v!r}")
        outer = state_dict["outer"]
        if len(outer) != len(self._groups) or len(state_dict["local"]) != len(self._groups) or \
                any(o.numel() != g.outer.numel() for o, g in zip(outer, self._groups)):
            raise ValueError("state_dict: outer parameters do not match this model's parameter "
                             "groups (same model and bucket_cap_mb needed)")
        if not isinstance(state_dict["compressor"], dict) or \
                "owner" not in state_dict["compressor"]:
            raise ValueError("state_dict: 'compressor' lacks its 'owner' (saved by an older "
                             "slimcomm?); start from a fresh SlimDPOptimizer")


#: float16's smallest normal number: an Adam eps below it rounds to a subnormal or 0
_FP16_TINY = float(torch.finfo(torch.float16).tiny)


def _inner_size(inner: torch.optim.Optimizer):
    """(parameter groups, parameters) of ``inner``: O(groups)."""
    return len(inner.param_groups), sum(len(g["params"]) for g in inner.param_groups)


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
