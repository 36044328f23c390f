"""Checkpoints of :class:`~slimcomm.ist.ISTTrainer`: ``state_dict`` (this rank's; the same
on every rank right after a synchronisation) and ``load_state_dict`` (checked on every
rank)."""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Dict, Optional

import torch

from .protocol import _FP_ERROR


class _CheckpointMixin:
    """``state_dict`` / ``load_state_dict`` of :class:`~slimcomm.ist.ISTTrainer`."""

    def state_dict(self) -> Dict[str, Any]:
        """Trainer state: full model, round, counters and, mid-round, this rank's subnet.

        Right after :meth:`synchronize` the state is the same on every rank
        (one checkpoint serves all); mid-round it also holds this rank's
        subnet and optimizer state, so each rank must save and load its own:
        ``rank`` records whose it is, and :meth:`load_state_dict` refuses a
        mid-round state of another rank on every rank.
        Tensors are references, as in ``nn.Module.state_dict``.
        """
        mid = self._local_step > 0
        return {
            "version": 1,
            "rank": self._rank,
            "world_size": self._world_size,
            "seed": self.seed,
            "local_steps": self.local_steps,
            "rescale": self.rescale,
            "scale_grads": self.scale_grads,
            "shared": self.shared,
            "subnets": self.subnets,
            "exchange_bits": self.exchange_bits,
            "round": self._round,
            "local_step": self._local_step,
            "model": self.model.state_dict(),
            "subnet": self._subnet.state_dict() if mid else None,
            "optimizer": self._optimizer.state_dict() if mid else None,
            "stats": dataclasses.asdict(self.stats),
            "payload_bytes": self._payload_bytes,
            "wire_bytes": self._wire_bytes,
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`.

        A state taken at a round boundary (``local_step == 0``) may be loaded
        with a different world size, ``local_steps``, ``subnets`` or
        ``exchange_bits``; a mid-round state needs the same world size,
        ``local_steps`` and ``subnets``, and this rank's own state. The seed must match
        (it defines the partitions of the rounds to come).

        Collective when distributed (all ranks call it together): after the
        local checks and the model load, the ranks exchange a fingerprint of
        (round, local step, full model), so a rank that loaded another round's
        or another run's checkpoint, or whose load failed, makes every rank
        raise instead of training on different partitions or waiting in the
        next synchronisation.

        Raises:
            KeyError: a missing key.
            ValueError: ``seed`` differs, or a mid-round state with a
                different ``world_size``/``local_steps``/``subnets`` or saved by another
                rank (raised there; the other ranks raise RuntimeError).
            RuntimeError: ``state["model"]`` does not fit the model (missing or
                unexpected keys, other shapes; raised before any weight is
                written) or ``model.load_state_dict`` failed; another rank failed
                to load; the ranks loaded different rounds or models.
        """
        error: Optional[Exception] = None
        fingerprint = _FP_ERROR
        try:
            self._validate_state(state)
            _check_model_state(self.model, state["model"])  # before writing anything
            self.model.load_state_dict(state["model"])
            h = hashlib.blake2b(digest_size=8)
            h.update(f"{int(state['round'])}|{int(state['local_step'])}".encode())
            for name, t in self.model.state_dict().items():
                h.update(name.encode())
                h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy())
            fingerprint = int.from_bytes(h.digest(), "little") >> 1
        except Exception as exc:  # noqa: BLE001 - must reach the exchange below, never hang
            error = exc
        if self._distributed:
            self._check_agreement(
                fingerprint, error,
                "the ranks loaded states of different rounds, local steps or models")
        elif error is not None:
            raise error
        mid = state["local_step"] > 0
        self._round = int(state["round"])
        self._local_step = int(state["local_step"])
        self._rounds = int(state["stats"]["rounds"])
        self._steps = int(state["stats"]["steps"])
        self._payload_bytes = int(state["payload_bytes"])
        self._wire_bytes = int(state["wire_bytes"])
        self._reread = False   # the checkpoint is the starting point
        self._begin_round()
        if mid:
            self._subnet.load_state_dict(state["subnet"])
            self._optimizer.load_state_dict(state["optimizer"])

    def _validate_state(self, state: Dict[str, Any]) -> None:
        for key in ("version", "world_size", "seed", "local_steps", "round", "local_step",
                    "model", "subnet", "optimizer", "stats", "payload_bytes", "wire_bytes"):
            if key not in state:
                raise KeyError(f"state_dict is missing {key!r}")
        if state["version"] != 1:
            raise ValueError(f"state_dict['version'] = {state['version']} is not supported")
        if state["seed"] != self.seed:
            raise ValueError(
                f"state_dict['seed'] = {state['seed']} differs from this trainer's seed "
                f"{self.seed}"
            )
        mid = state["local_step"] > 0
        if mid and state.get("rank") != self._rank:
            raise ValueError(
                f"state_dict: this mid-round state was saved by rank {state.get('rank')} but is "
                f"loaded on rank {self._rank}; mid-round it holds that rank's subnet and "
                f"optimizer, so every rank must load its own file (save one per rank, e.g. "
                f"f'ist-rank{{rank}}.pt'), or checkpoint right after synchronize(), where one "
                f"file serves every rank")
        if mid and state["world_size"] != self._world_size:
            raise ValueError(
                f"state_dict['world_size'] = {state['world_size']} differs from "
                f"{self._world_size}; a mid-round state can only be loaded on the same world size"
            )
        if mid and float(state.get("shared", 0.0)) != self.shared:
            raise ValueError(
                f"state_dict['shared'] = {state.get('shared', 0.0)} differs from {self.shared}; a "
                f"mid-round state needs the same shared fraction (its subnet has that width)")
        if mid and state.get("subnets", state["world_size"]) != self.subnets:
            raise ValueError(
                f"state_dict['subnets'] = {state.get('subnets', state['world_size'])} differs from "
                f"{self.subnets}; a mid-round state needs the same number of subnets (its subnet "
                f"has that width)")
        if mid and state["local_steps"] != self.local_steps:
            raise ValueError(
                f"state_dict['local_steps'] = {state['local_steps']} differs from "
                f"{self.local_steps}; a mid-round state needs the same local_steps"
            )


def _check_model_state(model: torch.nn.Module, saved: Any) -> None:
    """RuntimeError naming the keys if ``saved`` (a model ``state_dict``) does not fit
    ``model`` exactly; ``nn.Module.load_state_dict`` would copy the tensors that fit before
    raising about the others, leaving a refused checkpoint half-loaded."""
    if not isinstance(saved, dict):
        raise RuntimeError(f"state_dict['model'] must be the model's state_dict, got "
                           f"{type(saved).__name__}")
    own = model.state_dict()
    missing = [k for k in own if k not in saved]
    unexpected = [k for k in saved if k not in own]
    shapes = [f"{k} {tuple(saved[k].shape)} (model: {tuple(v.shape)})" for k, v in own.items()
              if k in saved and torch.is_tensor(saved[k]) and saved[k].shape != v.shape]
    if missing or unexpected or shapes:
        parts = [f"{what}: {', '.join(ks[:4])}{' ...' if len(ks) > 4 else ''}"
                 for what, ks in (("missing keys", missing), ("unexpected keys", unexpected),
                                  ("other shapes", shapes)) if ks]
        raise RuntimeError(f"state_dict['model'] does not fit this model ({'; '.join(parts)}); "
                           f"nothing was loaded")
