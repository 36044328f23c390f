"""The global model and this rank's checkpoint: ``outer_weights()`` (the model holds the
outer parameters inside the block, no communication), ``state_dict`` / ``load_state_dict``
(every rank its own; a load is checked on every rank)."""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Optional

import torch

from ..agreement import agree_across_ranks
from .groups import _offsets

_STATE_VERSION = 1


class _CheckpointMixin:
    """``outer_weights`` and checkpoints of :class:`~slimcomm.optim.SlimDPOptimizer`."""

    def _forbid_in_outer(self, what: str) -> None:
        if self._in_outer:
            raise RuntimeError(
                f"SlimDPOptimizer.{what} inside outer_weights(): the model holds the outer "
                f"parameters there and this rank's local ones are set aside until the block "
                f"exits; call it after the block")

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
        with torch.no_grad():  # this rank's local parameters, set aside for the block
            self._aside = [[p.detach().clone() for p in g.params] for g in self._groups]
            for g in self._groups:
                torch._foreach_copy_(g.params, g.outer_views)
        self._in_outer = True
        try:
            yield self._module
        finally:
            self._in_outer = False
            with torch.no_grad():
                for g, aside in zip(self._groups, self._aside):
                    torch._foreach_copy_(g.params, aside)
            self._aside = None

    # ---------------------------------------------------------------- checkpoint
    def state_dict(self) -> Dict[str, Any]:
        """This rank's state: inner optimizer, outer parameters and momentum,
        compressor (residuals: per rank), this rank's local parameters (they
        differ from the outer ones between synchronisations, and the
        constructor broadcasts rank 0's), counters and ``compression``. Every
        rank saves its own; a resume is bit-exact. Inside :meth:`outer_weights`
        it is the same as outside (the local parameters set aside there).
        Tensors are references to the live state (outer copies, local
        parameters, momentum, inner, compressor), as in
        ``torch.optim.Optimizer.state_dict``: no extra memory, valid until the
        next step, so save (``torch.save``) or copy them before stepping on: a
        dict kept in memory while training goes on holds the new tensors beside
        the old counters, and loading it later restores neither point (keep a
        restore point with ``copy.deepcopy(opt.state_dict())``).
        ``"local"`` holds per group the list of this rank's local parameters.

        FSDP2 (``DTensor``) parameters: the dict is the form
        ``torch.distributed.checkpoint`` (DCP) saves and loads, ``{"fsdp_layout":
        {"world_size", "replicate_size", "shard_size"} (identical on every rank),
        "per_rank": {"rank<global rank>": bytes}}``, where the bytes are the dict
        above (local shards; the inner optimizer's ``DTensor`` states as their
        local tensors) serialised with ``torch.save``: a snapshot, costing one
        copy of this rank's state in host memory while it exists. Each rank's
        entry is written once (no de-duplication across ranks), so::

            dcp.save({"optim": opt.state_dict()}, checkpoint_id=path)  # every rank
            sd = {"optim": opt.state_dict()}        # a fresh optimizer's: any template
            dcp.load(sd, checkpoint_id=path)         # every rank
            opt.load_state_dict(sd["optim"])
            # or: dcp.load({"optim": opt}, checkpoint_id=path)  (DCP's Stateful protocol)

        (``torch.save`` / ``torch.load`` of the dict per rank works too.) It
        holds the local parameters, so loading it also restores the model's
        shards."""
        if self._start_pending:   # no inner step yet: the model itself is the starting point
            self._take_start()
            self._start_pending = True
        delay = self._delay_state()   # first: waits for a synchronisation in flight
        local = [[p.detach() for p in (self._aside[i] if self._in_outer else g.params)]
                 for i, g in enumerate(self._groups)]
        state = {
            "version": _STATE_VERSION,
            "compression": self.compression,
            "nonfinite_syncs": self._nonfinite_syncs,
            "start_adopted": not self._adopt_start,
            "local_step": self.local_step,
            "syncs": self.syncs,
            "synced_at": self._synced_at,
            "inner": self.inner.state_dict(),
            "outer": [g.outer for g in self._groups],
            "local": local,
            "momentum": [g.momentum for g in self._groups],
            "compressor": self.compressor.state_dict(copy=False),
            **delay,
        }
        return state if self._sharding is None else self._sharding.wrap(state)

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
                (raised on the rank that has it); FSDP2 parameters: a state
                saved on another mesh (world size, replicate size or shard
                count: resuming at another shard count is not supported, the
                message names both layouts), a state of plain parameters, or
                one without this rank's entry.
            RuntimeError: the state was saved by another rank or world size
                (on that rank), or another rank's load failed (on the others);
                called inside :meth:`outer_weights`.
        """
        self._forbid_in_outer("load_state_dict()")
        error: Optional[BaseException] = None
        try:
            if self._sharding is not None:
                state_dict = self._sharding.unwrap(
                    state_dict, [p for g in self.inner.param_groups for p in g["params"]])
            elif isinstance(state_dict, dict) and "per_rank" in state_dict and \
                    "version" not in state_dict:
                raise ValueError("state_dict: saved by a SlimDPOptimizer over FSDP2 (DTensor) "
                                 "parameters, but this one's parameters are plain tensors")
            self._check_state(state_dict)
            self._check_delay_state(state_dict)
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
                if torch.is_tensor(loc):  # one flat tensor per group (slimcomm <= 0.x)
                    loc = [loc[a:a + v.numel()].view(v.shape) for a, v in
                           zip(_offsets(g.outer_views), g.outer_views)]
                torch._foreach_copy_(g.params, list(loc))
                if g.momentum is not None and m is not None:
                    g.momentum.copy_(m)
        self.local_step = state_dict["local_step"]
        self.syncs = state_dict["syncs"]
        self._synced_at = state_dict["synced_at"]
        self._nonfinite_syncs = int(state_dict.get("nonfinite_syncs", 0))
        self._pending.clear()
        self._load_delay_state(state_dict)
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
        for i, (loc, g) in enumerate(zip(state_dict["local"], self._groups)):
            shapes = [tuple(p.shape) for p in g.params]
            ok = loc.numel() == g.outer.numel() if torch.is_tensor(loc) else \
                isinstance(loc, (list, tuple)) and all(torch.is_tensor(t) for t in loc) and \
                [tuple(t.shape) for t in loc] == shapes
            if not ok:
                raise ValueError(f"state_dict: 'local' of parameter group {i} does not match this "
                                 f"model's parameters {shapes[:4]}{' ...' if len(shapes) > 4 else ''}")
        if not isinstance(state_dict["compressor"], dict) or \
                "owner" not in state_dict["compressor"]:
            raise ValueError("state_dict: 'compressor' lacks its 'owner' (saved by an older "
                             "slimcomm?); start from a fresh SlimDPOptimizer")
