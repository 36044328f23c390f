"""``SlimDPOptimizer``: local steps of any torch optimizer, then a Slim-DP-compressed
outer step; construction, stepping and the synchronisation itself (see
:mod:`slimcomm.optim` for the algorithm and usage)."""

from __future__ import annotations

import collections
import contextlib
import weakref
import zlib
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from .. import _comm
from .._comm import CollectiveError
from ..agreement import agree_across_ranks
from ..compressor import SlimDPCompressor
from .checkpoint import _CheckpointMixin
from .delayed import _DelayedMixin, _done
from .groups import COMPRESSIONS, _GroupsMixin, _inner_size
from .nonfinite import _NonfiniteMixin
from .protocol import _ProtocolMixin
from . import sharded as _sharded

__all__ = ["SlimDPOptimizer", "COMPRESSIONS", "CollectiveError"]


class SlimDPOptimizer(_GroupsMixin, _ProtocolMixin, _NonfiniteMixin, _CheckpointMixin,
                      _DelayedMixin):
    r"""Local steps of any torch optimizer + a Slim-DP-compressed outer step.

    See :mod:`slimcomm.optim` for the algorithm. Not a ``torch.optim.Optimizer``
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
            FSDP2 / HSDP: a model sharded with ``fully_shard(..., mesh=mesh["shard"])``
            over the 1-D shard sub-mesh of a ``(replicate, shard)`` mesh (every
            trainable parameter a ``DTensor`` on that one mesh): the inner steps
            are plain FSDP inside the replica group, and everything here works
            on this rank's local shards (outer copy, residuals, momentum: memory
            per rank ~1/S; "rank 0" above is rank 0 of ``process_group``, per
            shard position). A model on the 2-D mesh (FSDP's own HSDP, which
            all-reduces every inner step across replica groups) is refused.
            See :mod:`slimcomm.optim.sharded`.
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
            4, 8: per-chunk scaled low-bit codes (:mod:`slimcomm.codec`), with
            the rounding error kept by error feedback (also with ``"dense"``).
        lowbit_collective: how ``"dense"`` codes travel: ``"all_reduce"``
            (default; two-stage all-reduce: codes to the shard owners with one
            all-to-all, averaged and re-quantised there with an owner-side
            residual, all-gathered; ``2 (W-1)/W`` x one rank's code size per rank
            at any world size W, and the groups share one scratch buffer) or
            ``"all_gather"`` (every rank's codes to every rank: bytes per rank
            grow ~linearly in W). Sparse index sets always all-gather.
        quant_chunk: values per quantisation chunk (one bf16 scale each).
        outer_lr: outer learning rate (1.0 = apply the averaged update).
        outer_momentum: outer SGD momentum in ``[0, 1)`` (DiLoCo: 0.9).
        nesterov: Nesterov outer momentum (DiLoCo: True).
        error_feedback: keep the unsent part of each update (recommended).
        error_decay: ``beta`` in ``(0, 1]``; the residual is multiplied by it
            before the next pseudo-gradient is added (SparseLoCo: 0.95).
        seed: explore-set seed, equal on every rank.
        process_group: group to synchronise over (default: the world), a
            ``ProcessGroup`` or a 1-D ``DeviceMesh``. FSDP2 parameters:
            ``mesh["replicate"]``, the ranks holding the same shard in the other
            replica groups (each shard position synchronises with its own replica
            peers); a group that shares another rank with the shard mesh (the
            world when ``S > 1``, ``mesh["shard"]``) raises ``ValueError``, one
            joining ranks of different shard positions ``RuntimeError``.
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
        delay_syncs: 0 (default) or 1: the synchronisation of period k is
            launched at its end and applied at the end of period k+1, so its
            collectives overlap the next ``sync_every`` inner steps; each rank
            keeps its own progress of the period in between (Streaming
            DiLoCo's overlapped outer step, arXiv 2501.18512, Sec. 2.3; see
            :mod:`slimcomm.optim.delayed`). Costs one more fp32 copy of the
            parameters. :meth:`outer_weights` then shows the outer parameters
            one synchronisation behind; :meth:`synchronize` and the end of
            :meth:`join` apply the one in flight, so replicas are identical
            after them as with 0.
        overlap_steps: with ``delay_syncs=1``, the inner steps after its launch
            at which a synchronisation is applied, ``1 <= overlap_steps <=
            sync_every`` (Streaming DiLoCo's tau; default ``None`` =
            ``sync_every``, the end of the next period). A smaller value hides
            less communication and applies a less stale average; the local
            progress since the launch is kept either way.

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
            trainable parameters, ``process_group`` neither a ``ProcessGroup``
            nor a 1-D ``DeviceMesh``; FSDP2: trainable parameters mixing
            ``DTensor`` and plain tensors, on different meshes or on a 2-D
            (HSDP) mesh (``model``), ``process_group`` sharing another rank with
            the shard mesh, float16 parameters in an Adam-type group
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
        lowbit_collective: str = "all_reduce",
        delay_syncs: int = 0,
        overlap_steps: Optional[int] = None,
    ):
        process_group = _sharded.as_process_group(process_group)
        self.process_group = process_group
        self._sharding = None
        self._failed: Optional[str] = None
        self._joined = False
        error: Optional[BaseException] = None
        fingerprint = 0
        try:
            self._validate(model, inner, sync_every, compression, outer_lr, outer_momentum,
                           bucket_cap_mb)
            self.timeout = _comm.check_timeout(timeout, "SlimDPOptimizer")
            self._check_delay(delay_syncs, overlap_steps, sync_every)
            for name, v in (("nesterov", nesterov), ("error_feedback", error_feedback)):
                if not isinstance(v, bool):
                    raise ValueError(f"{name} must be a bool (True or False), got {v!r}")
            if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
                raise ValueError(f"process_group must be a torch.distributed.ProcessGroup or "
                                 f"None, got {type(process_group).__name__} {process_group!r}")
            module = model.module if isinstance(model, nn.parallel.DistributedDataParallel) \
                else model
            named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
            # FSDP2 (DTensor) parameters: everything below works on this rank's local shards
            self._sharding = _sharded.inspect(named, process_group)
            local_named = [(n, _sharded.local(p)) for n, p in named]
            self.compression = compression
            dense = compression == "dense"
            self.compressor = SlimDPCompressor(
                process_group=process_group,
                core_ratio=1.0 if dense else core_ratio,
                explore_ratio=0.0 if dense else explore_ratio,
                core_refresh=core_refresh, warmup_steps=warmup_syncs, score=score,
                index_mode="local" if compression == "local" else "shared",
                error_feedback=error_feedback and (not dense or value_bits is not None),
                error_decay=error_decay, value_dtype=value_dtype, seed=seed,
                check_agreement_every=check_agreement_every, value_bits=value_bits,
                quant_chunk=quant_chunk, lowbit_collective=lowbit_collective)
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
            # dense codes through the two-stage all-reduce: each group's buffer is free once
            # its codes are sent, so every group can share one (memory: outer + residual)
            self._deferred = dense and value_bits is not None and \
                lowbit_collective == "all_reduce"
            self._groups = self._make_groups(local_named, bucket_cap_mb,
                                             share_scratch=self._deferred,
                                             keys=[p for _, p in named])
            # the groups too: each is one collective, so groups that differ across ranks
            # (bucket_cap_mb) would mismatch their sizes (gloo aborts the process)
            hp = (sync_every, delay_syncs, overlap_steps, compression, self.outer_lr,
                  self.outer_momentum, self.nesterov,
                  self.compressor._hyperparameters(),
                  [(n, tuple(p.shape), str(p.dtype)) for n, p in named],
                  [g.key for g in self._groups],
                  None if self._sharding is None else
                  (self._sharding.fingerprint(), [tuple(p.shape) for _, p in local_named]))
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
                "(e.g. sync_every, compression, bucket_cap_mb) or models; construct it with the "
                "same arguments on every rank" + (
                    "" if self._sharding is None else
                    f" (FSDP2: process_group must join the ranks that hold the same shard, "
                    f"mesh['replicate'] of the (replicate, shard) mesh; this rank holds shard "
                    f"{self._sharding.shard_rank} of {self._sharding.shard_size})"))
        self._init_delay(delay_syncs, overlap_steps)
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
        self._aside = None   # outer_weights(): this rank's local parameters, set aside
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
                         "process_group", "inner", "compressor", "timeout", "delay_syncs",
                         "overlap_steps"))

    def __setattr__(self, name, value):
        if name in self._FROZEN and self.__dict__.get("_frozen"):
            raise AttributeError(
                f"SlimDPOptimizer.{name} cannot be changed after construction (every rank's "
                f"outer step and the synchronisation schedule depend on it); construct a new "
                f"SlimDPOptimizer with {name}={value!r} instead")
        object.__setattr__(self, name, value)

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
                grads = [_sharded.local(p.grad) for g in self.inner.param_groups
                         for p in g["params"] if p.grad is not None]
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
            self._synchronize(final=False)
            return True
        if self._inflight is not None and \
                self.local_step - self._synced_at == self.overlap_steps:
            self._apply_due()   # delay_syncs=1 with overlap_steps < sync_every
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
        self._synchronize(final=True)

    @torch.no_grad()
    def _synchronize(self, final: bool) -> None:
        self._check_usable()
        self._forbid_in_outer("synchronize()")
        if self.local_step != self._synced_at:
            self._check_parameters_unchanged()
            self._agree(joined=False)
            self._sync_collectives()
        if final:
            self._drain()

    def _sync_collectives(self) -> None:
        if self._start_pending:      # no inner step ran on this rank (e.g. GradScaler skips)
            self._take_start()
        if self._adopt_start:
            self._adopt_rank0_start()
        if self.delay_syncs:
            self._sync_delayed()
            return
        what = self._what()
        futs, oks = self._launch_all([g.outer for g in self._groups], what)
        # Every group's result first: a failed collective raises here, before any
        # parameter is written (no group is applied from a partly failed sync).
        with self._failing(what):
            avgs = [_comm.wait(fut, what, self.timeout) for fut in futs]
        for g, avg in zip(self._groups, avgs):
            self._outer_step(g, avg)
            torch._foreach_copy_(g.params, g.outer_views)
        bad = self._by_device(oks)
        self._publish_flags(bad)
        self.syncs += 1
        self._synced_at = self.local_step
        self._drain_flags(wait=False)

    @contextlib.contextmanager
    def _failing(self, what: str):
        """Any error inside marks the optimizer failed (it refuses further use) and is
        raised; a failed collective as a CollectiveError naming the synchronisation."""
        try:
            yield
        except CollectiveError as exc:
            if not str(exc).startswith("SlimDPOptimizer"):
                exc = CollectiveError(f"{what}: {exc}")
            raise self._fail(exc) from exc.__cause__
        except Exception as exc:  # the compressor state may be half-updated: stop here
            self._fail(exc)
            raise

    def _launch_all(self, refs: List[torch.Tensor], what: str):
        """Per group the pseudo-gradient ``refs[i] - local`` (the outer copy, or with
        ``delay_syncs`` the anchor) into the scratch, zeros if non-finite on this rank,
        handed to the compressor. Returns the futures and the per-group finite flags."""
        futs, oks = [], []
        with self._failing(what):
            for i, (g, ref) in enumerate(zip(self._groups, refs)):
                torch._foreach_copy_(g.scratch_views, g.params)
                torch.sub(ref, g.scratch, out=g.scratch)
                oks.append(self._zero_nonfinite(g))
                futs.append(self._launch(i, g, what))
            self.compressor.end_step()
        return futs, oks

    def _by_device(self, oks: List[torch.Tensor]) -> Dict[torch.device, List[torch.Tensor]]:
        bad: Dict[torch.device, List[torch.Tensor]] = {}
        for g, ok in zip(self._groups, oks):
            bad.setdefault(g.outer.device, []).append(ok)
        return bad

    def _zero_nonfinite(self, g) -> torch.Tensor:
        """The group's pseudo-gradient (in its scratch) becomes zeros if this rank's is
        non-finite (branchless, 3 ops: the largest |x| is NaN or inf iff some coordinate
        is). Returns the device flag (True = finite)."""
        ok = torch.linalg.vector_norm(g.scratch, float("inf")) < float("inf") \
            if g.scratch.numel() else torch.ones((), dtype=torch.bool, device=g.outer.device)
        torch.where(ok, g.scratch, self._zero[g.outer.device], out=g.scratch)
        return ok

    def _launch(self, i: int, g, what: str) -> torch.futures.Future:
        """Hand group ``i``'s pseudo-gradient (its scratch) to the compressor: a future of
        the average (or, deferred, of its decode callable)."""
        comp = self.compressor
        layout = comp.layout_for(lambda: g.key, lambda key: (g.outer.device, torch.float32),
                                 f"parameter group {i}", g.outer.device)
        warm = self._deferred and comp.step < comp.warmup_steps
        fut = comp.synchronize(layout, g.scratch, weight=g.outer,
                               warmup_dtype=comp.value_dtype or torch.float32,
                               deferred=self._deferred)
        if warm:  # a dense warm-up average lands in the shared scratch: keep a copy
            fut = _done(_comm.wait(fut, what, self.timeout).clone())
        return fut

    def _outer_step(self, g, avg) -> None:
        """``outer -= outer_lr * update`` from the group's average ``avg`` (outer (Nesterov)
        momentum as configured); ``avg`` may be a deferred decode into the scratch."""
        if callable(avg):  # deferred decode (two-stage all-reduce): into the scratch now
            avg = avg(g.scratch)
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

