"""Checkpointing: this rank's state as a ``state_dict`` and back (with its checks), the
ownership check (a state is one rank's, of one world size and kind), pickling."""

import inspect
import logging
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist

from .hyperparameters import _is_int
from .stats import _new_counts, _new_stats


logger = logging.getLogger(__name__)

_STATE_VERSION = 2  # 2: adds "owner" (rank, world size, kind), refused when it does not match


class _CheckpointMixin:
    """``state_dict`` / ``load_state_dict`` of :class:`~slimcomm.compressor.SlimDPCompressor`."""

    __slots__ = ()

    def _owner(self) -> Dict[str, Any]:
        """Whose state this is: ``{"rank", "world_size", "kind"}`` (rank and world size
        in the process group; ``None`` when no process group is initialised)."""
        if dist.is_available() and dist.is_initialized():
            rank, ws = dist.get_rank(self.group), dist.get_world_size(self.group)
        else:
            rank = ws = None
        return {"rank": rank, "world_size": ws, "kind": type(self).__name__}

    def _owner_error(self, owner: Optional[Dict[str, Any]]) -> Optional[RuntimeError]:
        """The error for a loaded state that is not this rank's own, else None."""
        if owner is None:
            return None
        mine = self._owner()
        name = type(self).__name__
        if owner.get("kind") != mine["kind"]:
            return RuntimeError(
                f"{name}.load_state_dict: the state_dict belongs to a {owner.get('kind')}, "
                f"not a {name} (e.g. SlimDPOptimizer's compressor state given to the DDP "
                f"hook); load the state_dict saved by this same kind of object")
        if owner.get("rank") is None or mine["rank"] is None:
            return None  # saved or loaded outside a process group: nothing to compare
        if owner.get("world_size") != mine["world_size"]:
            return RuntimeError(
                f"{name}.load_state_dict: the state_dict was saved with world size "
                f"{owner.get('world_size')} but is loaded with world size "
                f"{mine['world_size']}; the residuals are per rank, so it cannot be resumed "
                f"on another world size: start from a fresh {name} (residuals restart at "
                f"zero) and load only the model and optimizer")
        if owner.get("rank") != mine["rank"]:
            return RuntimeError(
                f"{name}.load_state_dict: this rank ({mine['rank']} of {mine['world_size']}) "
                f"loaded the state_dict saved by rank {owner.get('rank')}. The residuals "
                f"(error feedback) are per rank, so every rank must save its own "
                f"(e.g. torch.save(state.state_dict(), f'slimdp-rank{{rank}}.pt')) and load "
                f"that same file -- not rank 0's on every rank as in PowerSGD's example. If "
                f"only one rank's file exists, start from a fresh {name} instead")
        return None

    def _check_owner(self) -> None:
        """Raise (through the cross-rank layout check, so every rank raises) if the loaded
        state_dict is not this rank's."""
        err = self._owner_error(self._owner_pending)
        if err is not None:
            raise err
        self._owner_pending = None

    # ------------------------------------------------------------ checkpoint
    def state_dict(self, copy: bool = True) -> Dict[str, Any]:
        """This rank's Slim-DP state, for ``torch.save`` (every rank saves its own).

        Args:
            copy: ``True``: the tensors are clones. ``False``: views of the live
                state where one exists (no extra memory; valid until the next
                synchronised step, so save them first, as with
                ``torch.optim.Optimizer.state_dict``).

        Returns:
            dict with ``version``, ``step`` (synchronised steps done; also the
            explore RNG position), the hyperparameters that determine the
            index sets (``seed``, ``core_ratio``, ``explore_ratio``,
            ``core_refresh``, ``warmup_steps``, ``score``, ``index_mode``),
            ``stats``, ``owner`` (whose state this is: ``rank`` and
            ``world_size`` in the process group, ``None`` when no process
            group was initialised, and ``kind``, the class name; a load on
            another rank, world size or kind is refused),
            ``server_residuals`` (``lowbit_collective="all_reduce"``: per group
            ``{"positions", "residual"}``, this rank's shard of the owner-side
            residual), and ``params``: ``{position: {"name", "numel",
            "residual" (fp32 [numel] or None), "G" (fp32 [numel], or None for a
            parameter in a group of dense parameters, which selects nothing), "core"
            (int64 parameter-local indices, or None), and with ``delay_steps=1``
            "delayed_result" (the averaged gradient of the last step, still to be
            applied at the next one: ``[numel]`` in the gradient's dtype)}}``; the
            ``delay_steps``. Saving with ``delay_steps=1`` waits for the all-reduce in
            flight (no new collective). Tensors are clones
            (``copy=False``: views) on the state's device. No process group, no
            model.
        """
        self._settle()
        if self.delay_steps:
            from .transports.delayed import materialize
            for layout in self._layouts.values():
                materialize(self, layout)  # waits for the step in flight (collective-free)

        def keep(t: torch.Tensor) -> torch.Tensor:
            return t.clone() if copy else t

        params: Dict[int, Dict[str, Any]] = {}
        for pos, (layout, s) in self._slots.items():
            lo, hi = layout.seg(s)
            core = None
            if layout.all_dense:
                pass  # every coordinate is sent: the index set is all of them, not saved
            elif layout.core is not None:
                core = (layout.core[layout.core_offsets[s]:layout.core_offsets[s + 1]] - lo).clone()
            elif layout.pending is not None and layout.pending[s] is not None:
                core = layout.pending[s].clone()
            params[pos] = {
                "name": self._names[pos],
                "numel": hi - lo,
                "residual": None if layout.residual is None else keep(layout.residual[lo:hi]),
                "G": None if layout.G is None else keep(layout.G[lo:hi]),
                "core": core,
            }
            if layout.delayed is not None:
                params[pos]["delayed_result"] = keep(layout.delayed[1][lo:hi])
        for pos, d in self._loaded.items():
            params[pos] = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in d.items()}
        # the owners' residuals of lowbit_collective="all_reduce": one shard per group
        server = {key: t.clone() for key, t in self._server_loaded.items()}
        for key, layout in self._layouts.items():
            if layout.server is not None:
                server[key] = keep(layout.server)
        return {
            "version": _STATE_VERSION,
            "owner": self._owner(),
            "step": self.step,
            "seed": self.seed,
            "core_ratio": self.core_ratio,
            "explore_ratio": self.explore_ratio,
            "core_refresh": self.core_refresh,
            "warmup_steps": self.warmup_steps,
            "score": self.score,
            "index_mode": self.index_mode,
            "error_decay": self.error_decay,
            "delay_steps": self.delay_steps,
            "min_compress_numel": self.min_compress_numel,
            "stats": self.stats,
            "params": params,
            "server_residuals": [{"positions": list(k), "residual": t} for k, t in server.items()],
        }

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restore this rank's state saved by :meth:`state_dict`.

        Call on a fresh state (after or before :meth:`attach`) of the same
        hyperparameters; the per-parameter entries are placed into whatever
        buckets the new DDP instance forms. If attached, names and sizes are
        checked now, otherwise at :meth:`attach`.

        The state must be this rank's own: ``state_dict["owner"]`` (rank,
        world size, kind) is compared with this rank's when the next new
        group is set up (at the first synchronised step after the load, a
        collective), and a mismatch raises on **every** rank. Unlike the
        PowerSGD example that loads rank 0's state everywhere, residuals are
        per rank: save one file per rank (``f"slimdp-rank{rank}.pt"``) and
        load each rank's own. To resume from one rank's file only, start a
        fresh state instead (residuals restart at zero).

        Raises:
            ValueError: unknown ``version``; ``seed``, ratios, ``core_refresh``,
                ``warmup_steps``, ``score``, ``index_mode``, ``delay_steps`` or
                ``min_compress_numel`` differ from this
                state's (they determine the index sets); a malformed entry
                (``step`` not an int >= 0, a core index outside its parameter,
                tensors of the wrong size or dtype); a parameter entry whose
                name or size does not match the attached model.
            RuntimeError: (at the next synchronised step, on every rank) the
                state was saved by another rank, world size or kind of state.
        """
        if not isinstance(state_dict, dict):
            raise ValueError(f"state_dict must be a dict, got {type(state_dict).__name__}")
        if state_dict.get("version") != _STATE_VERSION:
            raise ValueError(
                f"state_dict: unknown version {state_dict.get('version')!r} "
                f"(expected {_STATE_VERSION}; version 1 states record no owner rank and "
                f"cannot be checked: start from a fresh {type(self).__name__})"
            )
        for key in ("owner", "step", "params", "seed", "core_ratio", "explore_ratio",
                    "core_refresh", "warmup_steps", "score", "index_mode"):
            if key not in state_dict:
                raise ValueError(f"state_dict lacks {key!r}")
        owner = state_dict["owner"]
        if not isinstance(owner, dict) or not {"rank", "world_size", "kind"} <= set(owner):
            raise ValueError(f"state_dict: 'owner' must be a dict with rank, world_size and "
                             f"kind, got {owner!r}")
        step = state_dict["step"]
        if not _is_int(step) or step < 0:
            raise ValueError(f"state_dict: step must be an int >= 0, got {step!r}")
        # absent from older states (saved with these values)
        optional = {"error_decay": 1.0, "delay_steps": 0, "min_compress_numel": 0}
        for key in ("seed", "core_ratio", "explore_ratio", "core_refresh", "warmup_steps",
                    "score", "index_mode", "error_decay", "delay_steps", "min_compress_numel"):
            saved = state_dict.get(key, optional[key]) if key in optional else state_dict[key]
            if saved != getattr(self, key):
                raise ValueError(
                    f"state_dict: {key} was {saved!r} when saved but this state "
                    f"has {getattr(self, key)!r}; construct {type(self).__name__} with the "
                    f"same value"
                )
        if not isinstance(state_dict["params"], dict):
            raise ValueError("state_dict: 'params' must be a dict {position: entry}")
        loaded = {}
        for pos, d in state_dict["params"].items():
            if not _is_int(pos) and not (isinstance(pos, str) and pos.isdigit()):
                raise ValueError(f"state_dict: parameter position {pos!r} is not an int")
            pos = int(pos)
            if pos < 0:
                raise ValueError(f"state_dict: negative parameter position {pos}")
            if not isinstance(d, dict):
                raise ValueError(f"state_dict: parameter {pos} entry is not a dict")
            for field in ("name", "numel"):
                if field not in d:
                    raise ValueError(f"state_dict: parameter {pos} lacks {field!r}")
            _check_entry(pos, d)
            loaded[pos] = dict(d)
        if self._names:
            for pos, d in loaded.items():
                if pos >= len(self._names) or self._names[pos] != d["name"] or \
                        self._numels[pos] != d["numel"]:
                    got = (f"{self._names[pos]!r} ({self._numels[pos]} elements)"
                           if pos < len(self._names) else "nothing")
                    raise ValueError(
                        f"state_dict: parameter position {pos} was {d['name']!r} "
                        f"({d['numel']} elements) but the attached model has {got} there"
                    )
        self._layouts.clear()
        self._slots.clear()
        self._undo = []
        self._void_flags = {}
        server = {}
        for e in state_dict.get("server_residuals", []):
            if not isinstance(e, dict) or not torch.is_tensor(e.get("residual")) or \
                    e["residual"].dtype != torch.float32 or \
                    not all(_is_int(i) for i in e.get("positions", [None])):
                raise ValueError("state_dict: each 'server_residuals' entry must be a dict "
                                 "with 'positions' (ints) and an fp32 'residual'")
            server[tuple(e["positions"])] = e["residual"].reshape(-1)
        self._loaded = loaded
        # the owners' residuals belong to the two-stage all-reduce: resumed with
        # lowbit_collective="all_gather" they are dropped (not carried to a later save)
        self._server_loaded = server if self.lowbit_collective == "all_reduce" else {}
        self._owner_pending = dict(owner)
        self.step = step
        st = state_dict.get("stats")
        with self._lock:
            self._stats = _new_stats()
            self._dev_counts = {}
            if st:
                self._stats["steps"] = st["steps"]
                self._stats["nonfinite_fallbacks"] = st["nonfinite_fallbacks"]
                self._stats["voided_steps"] = st.get("voided_steps", 0)
                self._stats["last"] = {**_new_counts(), **st["last"]}
                self._stats["total"] = {**_new_counts(), **st["total"]}
            self._step_acc = _new_counts()

    # ------------------------------------------------------------ pickling
    def __getstate__(self):
        """Hyperparameters and :meth:`state_dict`; no process group, no model."""
        logger.warning("NOTE: the process group and the model are not pickled with "
                       "%s; call attach(model) after unpickling.", type(self).__name__)
        hp = {s: getattr(self, s) for s in self._HYPERPARAMETERS}
        return {"hyperparameters": hp, "state": self.state_dict()}

    def __setstate__(self, state):
        """Rebuild with the default process group; re-attach the model afterwards."""
        # pickles made before min_compress_numel existed compressed every parameter
        hp = {"min_compress_numel": 0, **state["hyperparameters"]}
        accepted = inspect.signature(type(self).__init__).parameters
        # an adapter may not offer every core hyperparameter (SlimDPState: no value_bits)
        self.__init__(process_group=None, **{k: v for k, v in hp.items() if k in accepted})
        self.load_state_dict(state["state"])


def _check_entry(pos: int, d: Dict[str, Any]) -> None:
    """Validate one parameter entry of a loaded state_dict (ValueError naming it)."""
    name, numel = d["name"], d["numel"]
    what = f"state_dict: parameter {pos} ({name!r})"
    if not isinstance(name, str):
        raise ValueError(f"state_dict: parameter {pos} name must be a str, got {name!r}")
    if not _is_int(numel) or numel < 0:
        raise ValueError(f"{what}: numel must be an int >= 0, got {numel!r}")
    for field in ("G", "residual", "delayed_result"):
        t = d.get(field)
        if t is None:
            continue
        if not torch.is_tensor(t) or not t.is_floating_point() or t.numel() != numel:
            raise ValueError(f"{what}: {field} must be a floating-point tensor of numel={numel} "
                             f"elements, got {t if not torch.is_tensor(t) else t.shape}")
    core = d.get("core")
    if core is not None:
        if not torch.is_tensor(core) or core.dtype not in (torch.int64, torch.int32) or \
                core.dim() != 1:
            raise ValueError(f"{what}: core must be a 1-d int64 tensor of indices or None")
        if core.numel() and (int(core.min()) < 0 or int(core.max()) >= numel):
            raise ValueError(f"{what}: core holds indices outside [0, {numel})")
        if core.numel() > 1 and not bool((core[1:] > core[:-1]).all()):
            raise ValueError(f"{what}: core indices must be distinct and ascending")
