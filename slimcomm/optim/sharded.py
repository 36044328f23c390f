"""``SlimDPOptimizer`` on FSDP2 / HSDP: parameters that are ``DTensor`` shards.

A model sharded with ``fully_shard(module, mesh=mesh["shard"])`` over the 1-D
*shard* sub-mesh of a ``(replicate, shard)`` mesh holds its parameters as
``DTensor`` s whose local tensors are this rank's dim-0 chunks (FSDP2 keeps
them as views of its padded shard storage; on uneven splits the last chunks
are shorter, possibly empty). The inner steps are plain FSDP *inside* the
replica group (FSDP's reduce-scatter averages over the shard group only). The
optimizer then works on the local tensors alone: its outer copy, scratch,
momentum and the compressor's residuals, ``G`` and index sets are the size of
this rank's shard (memory per rank falls with the shard count ``S``), and it
synchronises over ``process_group = mesh["replicate"]``: every shard position
with its own replica peers, which hold chunks of the same shape.

This module holds what differs from plain tensors: the checks of the
parameters and the mesh at construction (:func:`inspect`), the local tensors
(:func:`local`), and the checkpoint wrapping that makes
``SlimDPOptimizer.state_dict()`` usable with ``torch.distributed.checkpoint``
(:class:`_Sharding`).
"""

from __future__ import annotations

import io
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..fsdp import _as_group, _check_meets_only_here

#: key of the layout entry of a sharded ``state_dict`` (identical on every rank)
LAYOUT_KEY = "fsdp_layout"
#: key of the per-rank entries of a sharded ``state_dict``: ``{"rank<global rank>": bytes}``
PER_RANK_KEY = "per_rank"


def _dtensor_class():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without DTensor
        return None
    return DTensor


def is_dtensor(t) -> bool:
    cls = _dtensor_class()
    return cls is not None and isinstance(t, cls)


def local(t: torch.Tensor) -> torch.Tensor:
    """``t``'s local tensor if it is a ``DTensor`` (the live storage, no copy), else ``t``."""
    if is_dtensor(t):
        with torch.no_grad():
            return t.to_local()
    return t


def as_process_group(process_group):
    """``process_group`` as a ``ProcessGroup`` (or ``None``): a 1-D ``DeviceMesh``
    (``mesh["replicate"]``) gives its group.

    Raises:
        ValueError: neither ``None``, a ``ProcessGroup`` nor a 1-D ``DeviceMesh``
            (the message names ``process_group``).
    """
    if process_group is None or isinstance(process_group, dist.ProcessGroup):
        return process_group
    try:
        return _as_group(process_group)
    except ValueError as exc:
        raise ValueError(str(exc).replace("replicate_group", "process_group", 1)) from None


class _Sharding:
    """Where this rank sits: the shard mesh of the parameters and the replicate group."""

    __slots__ = ("mesh", "shard_group", "shard_rank", "shard_size", "replicate_size", "rank",
                 "world_size")

    def __init__(self, mesh, process_group):
        self.mesh = mesh
        self.shard_group = mesh.get_group(0)
        self.shard_rank = dist.get_rank(self.shard_group)
        self.shard_size = dist.get_world_size(self.shard_group)
        self.replicate_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()

    def layout(self) -> Dict[str, int]:
        """Identical on every rank of the job: what a checkpoint must match."""
        return {"world_size": self.world_size, "replicate_size": self.replicate_size,
                "shard_size": self.shard_size}

    def fingerprint(self) -> Tuple[int, int]:
        """Compared across the replicate group: its ranks must hold the same shard."""
        return (self.shard_rank, self.shard_size)

    # ------------------------------------------------------------ checkpoint
    def wrap(self, per_rank: Dict[str, Any]) -> Dict[str, Any]:
        """The ``torch.distributed.checkpoint``-ready form of this rank's state.

        ``per_rank`` (this rank's plain state dict) with the inner optimizer's
        ``DTensor`` states replaced by their local tensors (their places
        recorded in ``"inner_dtensor"``), serialised with ``torch.save`` into
        ``bytes`` under ``"per_rank"/"rank<global rank>"``: DCP writes each
        rank's entry once (no de-duplication across ranks, whose residuals and
        local parameters differ) and loads it into any template, whatever
        state the template's optimizer has. ``"fsdp_layout"`` (world size,
        replicate size, shard size) is identical on every rank.
        """
        inner = per_rank["inner"]
        marks, state = [], {}
        for i, st in inner["state"].items():
            state[i] = {}
            for k, v in st.items():
                if is_dtensor(v):
                    marks.append((i, k))
                    v = v.to_local()
                state[i][k] = v
        per_rank = dict(per_rank, inner=dict(inner, state=state), inner_dtensor=marks)
        buf = io.BytesIO()
        torch.save(per_rank, buf)
        return {LAYOUT_KEY: self.layout(), PER_RANK_KEY: {f"rank{self.rank}": buf.getvalue()}}

    def unwrap(self, state_dict: Any, inner_params: List[torch.Tensor]) -> Dict[str, Any]:
        """This rank's plain state from a dict made by :meth:`wrap` (after ``dcp.load`` or
        ``torch.load``), with the inner optimizer's ``DTensor`` states rebuilt on the
        parameters' meshes (``inner_params``: the inner optimizer's parameters in
        ``state_dict`` order).

        Raises:
            ValueError: ``state_dict`` is not a sharded state (e.g. saved by a
                ``SlimDPOptimizer`` over plain tensors), was saved at another
                world size, replicate size or shard count (the residuals, index
                sets, owner-side residuals and inner states are shard-local:
                resuming at another shard count is not supported), lacks
                this rank's entry (e.g. another rank's file), or that entry
                cannot be read.
        """
        if not isinstance(state_dict, dict) or LAYOUT_KEY not in state_dict or \
                PER_RANK_KEY not in state_dict:
            raise ValueError(
                f"state_dict: not the state of a SlimDPOptimizer over FSDP2 (DTensor) "
                f"parameters (no {LAYOUT_KEY!r} / {PER_RANK_KEY!r} entries); this optimizer's "
                f"parameters are DTensor shards: load a state saved by one like it")
        saved, mine = state_dict[LAYOUT_KEY], self.layout()
        if not isinstance(saved, dict):
            raise ValueError(f"state_dict: {LAYOUT_KEY!r} must be a dict, got "
                             f"{type(saved).__name__}")
        if saved != mine:
            raise ValueError(
                f"state_dict: saved with world_size={saved.get('world_size')}, "
                f"replicate_size={saved.get('replicate_size')}, shard_size="
                f"{saved.get('shard_size')} but this job has world_size={mine['world_size']}, "
                f"replicate_size={mine['replicate_size']}, shard_size={mine['shard_size']}: "
                f"SlimDPOptimizer cannot resume on another mesh (its residuals, core index "
                f"sets and owner-side residuals are shard-local, the inner optimizer states "
                f"and local parameters per replica); resume on the same (replicate, shard) "
                f"mesh, or start a fresh SlimDPOptimizer from the model's weights")
        entries = state_dict[PER_RANK_KEY]
        blob = entries.get(f"rank{self.rank}") if isinstance(entries, dict) else None
        if not isinstance(blob, (bytes, bytearray)):
            raise ValueError(
                f"state_dict: {PER_RANK_KEY!r} holds no entry 'rank{self.rank}' for this rank "
                f"(pass the dict of opt.state_dict() that torch.distributed.checkpoint.load "
                f"filled, or this rank's own torch.save file)")
        try:  # tensors, dicts, lists, numbers, strings: no pickled code
            per_rank = torch.load(io.BytesIO(blob), weights_only=True)
        except Exception as exc:  # noqa: BLE001 - every rank must learn of it, as ValueError
            raise ValueError(f"state_dict: the entry 'rank{self.rank}' of {PER_RANK_KEY!r} "
                             f"cannot be read ({type(exc).__name__}: {exc})") from exc
        if not isinstance(per_rank, dict) or not isinstance(per_rank.get("inner"), dict):
            raise ValueError(f"state_dict: the entry 'rank{self.rank}' of {PER_RANK_KEY!r} is "
                             f"not a SlimDPOptimizer state")
        inner = per_rank["inner"]
        for i, k in per_rank.pop("inner_dtensor", []):
            p = inner_params[i]
            inner["state"][i][k] = _dtensor_class().from_local(
                inner["state"][i][k].to(local(p).device), p.device_mesh, p.placements,
                run_check=False, shape=p.shape, stride=p.stride())
        return per_rank


def inspect(named: Sequence[Tuple[str, torch.Tensor]], process_group) -> Optional[_Sharding]:
    """Check the trainable parameters ``named``: plain tensors (``None``) or FSDP2
    ``DTensor`` shards over one 1-D mesh whose group meets ``process_group`` (``None`` =
    the world) in this rank only (a :class:`_Sharding`).

    Raises:
        ValueError: parameters mixing ``DTensor`` and plain tensors (``model``);
            ``DTensor`` s on different meshes, on a 2-D (HSDP) mesh or with a
            non-``Shard`` placement (``model``); ``process_group`` sharing another
            rank with the shard group (e.g. the world, or ``mesh["shard"]``).
    """
    dts = [n for n, p in named if is_dtensor(p)]
    if not dts:
        return None
    if len(dts) != len(named):
        plain = [n for n, p in named if not is_dtensor(p)]
        raise ValueError(
            f"model: {len(dts)} trainable parameters are DTensors (FSDP2 shards, e.g. "
            f"{dts[0]!r}) and {len(plain)} are plain tensors (e.g. {plain[0]!r}); "
            f"SlimDPOptimizer needs all of them sharded by fully_shard over the same 1-D shard "
            f"mesh, or none (apply fully_shard to the root module too)")
    first_name, first = named[0]
    mesh = first.device_mesh
    for n, p in named:
        if p.device_mesh.ndim != 1:
            raise ValueError(
                f"model: parameter {n!r} is sharded over a {p.device_mesh.ndim}-D mesh "
                f"{p.device_mesh.mesh_dim_names} (HSDP): FSDP would all-reduce its gradient "
                f"across the replicate dimension at every inner step. Shard the model over the "
                f"1-D shard sub-mesh, fully_shard(module, mesh=mesh['shard']), and pass "
                f"process_group=mesh['replicate'] to SlimDPOptimizer")
        if p.device_mesh != mesh:
            raise ValueError(
                f"model: parameter {n!r} is sharded over mesh {p.device_mesh} but "
                f"{first_name!r} over {mesh}; SlimDPOptimizer needs every parameter on one 1-D "
                f"shard mesh (one fully_shard mesh for the whole model)")
        if not all(pl.is_shard() for pl in p.placements):
            raise ValueError(
                f"model: parameter {n!r} has placements {p.placements}; SlimDPOptimizer "
                f"supports FSDP2's Shard placements over a 1-D shard mesh")
    group = mesh.get_group(0)
    _check_meets_only_here(process_group, group, "process_group")
    return _Sharding(mesh, process_group)
