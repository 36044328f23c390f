"""Slim-DP on FSDP2 / HSDP: the replicate-dimension gradient all-reduce, compressed.

A model sharded with ``torch.distributed.fsdp.fully_shard`` over the *shard*
dimension of a 2-D device mesh ``(replicate, shard)`` runs FSDP's own
reduce-scatter and all-gather inside each replica group (fast links: one node,
one cluster); what crosses the slow link between replica groups is one
all-reduce per FSDP parameter group per step of the reduce-scattered gradient
shard. This module does that all-reduce with the Slim-DP compressor core
(:class:`slimcomm.compressor.SlimDPCompressor`, Slim-DP: Sun et al., arXiv
1709.09393), through ``FSDPModule.set_all_reduce_hook``: each shard position
with its own replica peers, error feedback per shard (residuals the size of
the local shard, so their memory falls with the shard count).

Usage (4 ranks: 2 replica groups of 2 shards)::

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from slimcomm import register_slim_dp_hook

    mesh = init_device_mesh("cuda", (2, 2), mesh_dim_names=("replicate", "shard"))
    for block in model.blocks:
        fully_shard(block, mesh=mesh["shard"])      # 1-D: FSDP inside the replica group
    fully_shard(model, mesh=mesh["shard"])
    state = register_slim_dp_hook(model, replicate_group=mesh["replicate"],
                                  core_ratio=0.01, explore_ratio=0.01)
    ...
    torch.save({"slim_dp": state.state_dict(), ...}, f"ckpt-rank{rank}.pt")  # every rank

How FSDP2 calls the hook (torch 2.13, ``_fully_shard/_fsdp_collectives.py``
``foreach_reduce``): once per FSDP parameter group per backward that reduces
gradients, with ``reduce_output``: the flat ``[N]`` reduce-scattered gradient
(``reduce_dtype``, by default the parameters' dtype), the concatenation of the
group's parameters' *padded* local shards (dim-0 chunks, each padded to the
size of chunk 0), already averaged over the shard group (for fp32/bf16 by the
reduce-scatter's ``AVG``; for fp16 FSDP divides part before and part after,
the latter after the hook). The hook must write the result into
``reduce_output`` in place; FSDP then views the local gradients out of it and
assigns them to ``param.grad``. With a 1-D mesh there is no other replicate
all-reduce. With a 2-D (HSDP) mesh FSDP runs its own dense replicate
all-reduce *before* the hook, so compressing there would be pointless:
:func:`register_slim_dp_hook` refuses such a model and asks for the 1-D shard
sub-mesh instead (the result is the same HSDP, with the replicate all-reduce
compressed).

What this hook does per group and step (per parameter shard, as the DDP hook
:mod:`slimcomm.hooks` does per parameter): Slim-DP's shared core set of the
largest ``|w| * |G|`` (``w`` the local weight shard, ``G`` the last averaged
gradient shard) plus a seeded explore set, packed, averaged over the replica
group with one dense all-reduce of ``k + m`` values, error feedback of the
rest; or ``index_mode="local"`` (per-rank top-k, all-gathered pairs); or,
with ``value_bits``, low-bit codes (dense with ``core_ratio=1``). The first
``warmup_steps`` steps are plain averaged all-reduces (in bf16 when
``value_dtype`` is bf16).

Invariants (the DDP hook's): the gradient shards, hence the parameter shards,
stay identical across each replica group (every peer derives the same index
set from identical state); results do not depend on how the model is divided
into FSDP modules (state is per parameter shard); a state saved with
:meth:`SlimDPFSDPState.state_dict` and loaded into a fresh one resumes
bit-exactly. Every collective's result is checked: a failed or timed-out
collective raises :class:`slimcomm._comm.CollectiveError` out of
``loss.backward()`` on the surviving ranks, before FSDP assigns any
gradient, and the state refuses further use.
"""

from __future__ import annotations

import threading
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn

from . import _comm
from ._comm import CollectiveError
from .compressor import SlimDPCompressor

__all__ = ["SlimDPFSDPState", "register_slim_dp_hook", "CollectiveError"]

_FSDP_KEY = "fsdp"  # extra entry of the state_dict: where on the mesh the state was saved


def _fsdp_module_class():
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError as exc:  # pragma: no cover - torch without FSDP2
        raise RuntimeError("slimcomm.fsdp needs torch.distributed.fsdp.FSDPModule (FSDP2, "
                           "torch >= 2.6)") from exc
    return FSDPModule


def _as_group(replicate_group) -> dist.ProcessGroup:
    """A ProcessGroup from a ProcessGroup or a 1-D DeviceMesh (``mesh["replicate"]``)."""
    if isinstance(replicate_group, dist.ProcessGroup):
        return replicate_group
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # pragma: no cover
        DeviceMesh = ()
    if DeviceMesh and isinstance(replicate_group, DeviceMesh):
        if replicate_group.ndim != 1:
            raise ValueError(f"replicate_group: a DeviceMesh must be 1-D (e.g. "
                             f"mesh['replicate']), got {replicate_group.ndim}-D "
                             f"{replicate_group.mesh_dim_names}")
        return replicate_group.get_group()
    raise ValueError(f"replicate_group must be a torch.distributed.ProcessGroup or a 1-D "
                     f"DeviceMesh (mesh['replicate']), got {type(replicate_group).__name__}")


class _Group:
    """One FSDP parameter group: its positions, parameters and flat padded sizes."""

    __slots__ = ("key", "fsdp_params", "numels", "numel", "label", "module")

    def __init__(self, key, fsdp_params, numels, label, module):
        self.key = key
        self.fsdp_params = fsdp_params
        self.numels = numels
        self.numel = sum(numels)
        self.label = label
        self.module = module


class _GroupHook:
    """The callable given to ``FSDPModule.set_all_reduce_hook`` for one group."""

    __slots__ = ("state", "index")

    def __init__(self, state: "SlimDPFSDPState", index: int):
        self.state = state
        self.index = index

    def __call__(self, reduce_output: torch.Tensor) -> None:
        self.state._reduce(self.index, reduce_output)


class SlimDPFSDPState(SlimDPCompressor):
    r"""Slim-DP compression of FSDP2's replicate-dimension gradient all-reduce.

    Usually built by :func:`register_slim_dp_hook`. One state serves one model
    sharded with ``fully_shard`` over a 1-D shard mesh; :meth:`attach`
    installs a hook on every FSDP module of it (one call per FSDP parameter
    group per step, see the module docstring for the semantics of the hook).

    Hyperparameters (keyword arguments; the same meaning as
    :class:`slimcomm.SlimDPState`, the DDP hook, per parameter *shard*):

    * ``replicate_group`` (``ProcessGroup`` or 1-D ``DeviceMesh``, default
      ``None`` = the default group): the ranks holding the same shard in the
      other replica groups (``mesh["replicate"]``); the gradient shard is
      averaged over it. Must meet the model's FSDP shard group in this rank
      only (checked by :meth:`attach`).
    * ``core_ratio`` (0, 1], default 0.01; ``explore_ratio`` [0, 1], default
      0.01: fractions of each parameter shard (padded) in the core set
      (largest ``|w| * |G|``, Slim-DP Sec. 3.1) and the random explore set
      (Sec. 3.2). ``k + m >= n`` sends that shard densely; ``core_ratio=1``
      makes every step a plain averaged all-reduce (the dense baseline).
    * ``core_refresh`` (int >= 1, default 10): steps between core-set refreshes.
    * ``warmup_steps`` (int >= 1, default 1): dense steps first (``G`` starts
      from the dense average), in bf16 when ``value_dtype`` is bf16.
    * ``score`` (``"product"``, ``"grad"``, ``"weight"``), ``index_mode``
      (``"shared"`` = Slim-DP, ``"local"`` = per-rank top-k with all-gathered
      (index, value) pairs), ``error_feedback`` (bool, default True),
      ``error_decay`` (0, 1], ``seed`` (64-bit int, equal on every rank),
      ``check_agreement_every`` (int >= 0, default 100).
    * ``value_dtype`` (``None`` = the gradient's, or fp32/fp16/bf16): the
      wire dtype of the values.
    * ``value_bits`` (``None`` or 1/2/4/8) and ``quant_chunk`` (int >= 1,
      default 4096): low-bit codes with one bf16 scale per chunk of values,
      all-gathered and decoded identically on every rank
      (:mod:`slimcomm.codec`); needs ``index_mode="shared"``. With
      ``core_ratio=1`` this is dense low-bit compression.
    * ``timeout`` (seconds > 0 or ``None`` = the process group's own): how
      long each of the hook's collectives may wait for a replica peer; a dead
      or hung peer then raises :class:`CollectiveError` on the survivors.

    State, per parameter shard (position ``i`` = the ``i``-th trainable
    FSDP-managed parameter of ``model.named_parameters()``): fp32
    ``residual`` and fp32 ``G`` of the padded local shard size (the DTensor's
    dim-0 chunk, padded like FSDP pads it), the core set (int64 shard-local
    indices) and the step counter ``step``. Memory: ``8`` bytes per local
    gradient element (``4`` without error feedback), i.e. ``1/S`` of the
    unsharded model's per shard count ``S``.

    ``state_dict()`` / ``load_state_dict()``: this rank's state; every rank
    saves and loads its own file. The dict records the rank's place on the
    mesh (global rank, shard rank, shard size); loading another rank's state
    raises ``ValueError`` at the load (or at :meth:`attach`), a state of
    another replica rank or replicate size raises on every replica peer at the
    first step after the load. Resuming at another shard count is refused
    (the residuals are shard-local); start a fresh state instead.

    Limits: one hook call per FSDP group per synchronised step, so gradient
    accumulation must use ``model.set_requires_gradient_sync(False)`` on the
    micro-steps (FSDP then skips the reduce-scatter and the hook);
    ``set_requires_all_reduce(False)`` does not skip the hook on a 1-D mesh.
    Parameters that get no gradient are reduce-scattered as zeros
    (:meth:`attach` sets ``set_reduce_scatter_unused_params(True)``), so the
    flat layout is fixed; a parameter whose gradient is zero on every replica
    peer keeps its residual and ``G`` that step. The gradient divide factor is
    FSDP's for the shard group; the hook always averages over the replicate
    group (``set_gradient_divide_factor`` then does not cover the replicate
    dimension). Only one parameter group per FSDP module (no per-parameter
    meshes).

    Raises:
        ValueError: a hyperparameter out of range (the message names it).
    """

    __slots__ = ("_groups", "_hooks", "_seen", "_failed", "_mesh_place", "_place_pending",
                 "_hook_lock")
    _KEEP_ALL_ZERO = True          # a parameter no rank used is reduced as zeros: keep state
    _VOID_NONFINITE_STEP = True    # a GradScaler skips the whole step
    _MIN_WARMUP = 1
    _WARMUP_WHY = " (G starts from a dense average)"

    def __init__(
        self,
        replicate_group: Union[dist.ProcessGroup, Any, None] = None,
        core_ratio: float = 0.01,
        explore_ratio: float = 0.01,
        core_refresh: int = 10,
        warmup_steps: int = 1,
        score: str = "product",
        index_mode: str = "shared",
        error_feedback: bool = True,
        error_decay: float = 1.0,
        value_dtype: Optional[torch.dtype] = None,
        seed: int = 0,
        check_agreement_every: int = 100,
        value_bits: Optional[int] = None,
        quant_chunk: int = 4096,
        timeout: Optional[float] = None,
        process_group: Optional[dist.ProcessGroup] = None,
    ):
        if process_group is not None:  # the core's name (used when unpickling)
            if replicate_group is not None:
                raise ValueError("pass replicate_group or process_group, not both")
            replicate_group = process_group
        group = None if replicate_group is None else _as_group(replicate_group)
        super().__init__(
            process_group=group, core_ratio=core_ratio, explore_ratio=explore_ratio,
            core_refresh=core_refresh, warmup_steps=warmup_steps, score=score,
            index_mode=index_mode, error_feedback=error_feedback, error_decay=error_decay,
            value_dtype=value_dtype, seed=seed, check_agreement_every=check_agreement_every,
            value_bits=value_bits, quant_chunk=quant_chunk)
        self._timeout = _comm.check_timeout(timeout, "SlimDPFSDPState")
        self._groups: List[_Group] = []
        self._hooks: List[_GroupHook] = []
        self._seen: set = set()
        self._failed: Optional[str] = None
        self._mesh_place: Optional[Dict[str, int]] = None
        self._place_pending: Optional[Dict[str, int]] = None
        self._hook_lock = threading.Lock()

    # ------------------------------------------------------------ attach
    def attach(self, model: nn.Module) -> "SlimDPFSDPState":
        """Map the FSDP parameters to positions and install the hook on every FSDP module.

        Args:
            model: the root module, after ``fully_shard`` was applied to it
                and/or to its submodules over a **1-D** shard mesh. Position
                ``i`` is the ``i``-th trainable FSDP-managed parameter of
                ``model.named_parameters()``, which does not depend on how the
                model is divided into FSDP modules.

        Returns:
            ``self``.

        Raises:
            ValueError: ``model`` is not an ``nn.Module`` or holds no FSDP
                module; an FSDP module was sharded over a 2-D (HSDP) mesh
                (FSDP's own replicate all-reduce would run first) or has more
                than one parameter group; the replicate group and the FSDP
                shard group share another rank than this one (the wrong mesh
                dimension); held state names a parameter of another name or
                size; a loaded state was saved at another place on the mesh.
            RuntimeError: this torch's FSDP2 internals are not the ones this
                module was written against (torch 2.13).
        """
        if not isinstance(model, nn.Module):
            raise ValueError(f"model must be an nn.Module, got {type(model).__name__}")
        FSDPModule = _fsdp_module_class()
        fsdp_modules = [(n, m) for n, m in model.named_modules() if isinstance(m, FSDPModule)]
        if not fsdp_modules:
            raise ValueError("model: no FSDP module found; apply "
                             "torch.distributed.fsdp.fully_shard(module, mesh=mesh['shard']) "
                             "first")
        by_id = {id(p): (name, p) for name, p in model.named_parameters()}
        raw: List[Tuple[str, nn.Module, list]] = []
        shard_group = None
        for mname, m in fsdp_modules:
            pgroups = _param_groups(m)
            if len(pgroups) > 1:
                raise ValueError(f"model: FSDP module {mname or '<root>'!r} has "
                                 f"{len(pgroups)} parameter groups (per-parameter meshes); "
                                 f"the all-reduce hook supports one")
            for pg in pgroups:
                if not _is_plain_fsdp(pg):
                    raise ValueError(
                        f"model: FSDP module {mname or '<root>'!r} is sharded over a 2-D "
                        f"(HSDP) mesh (or replicated), so FSDP runs its own dense replicate "
                        f"all-reduce before any hook. Shard it over the 1-D shard sub-mesh instead, "
                        f"fully_shard(module, mesh=mesh['shard']), and pass "
                        f"replicate_group=mesh['replicate']")
                fps = [fp for fp in pg.fsdp_params if fp.sharded_param.requires_grad]
                if fps:
                    raw.append((mname, m, fps))
                    shard_group = shard_group or _shard_group(pg)
        if not raw:
            raise ValueError("model: its FSDP modules hold no trainable parameter")
        self._check_groups_meet_here(shard_group)
        # positions in named_parameters() order
        order = []
        for _, _, fps in raw:
            for fp in fps:
                if id(fp.sharded_param) not in by_id:
                    raise RuntimeError(
                        "slimcomm.fsdp: an FSDP parameter is not a parameter of the model "
                        "(FSDP2 internals differ from torch 2.13's)")
                order.append(fp)
        index = {name: i for i, (name, _) in enumerate(model.named_parameters())}
        order.sort(key=lambda fp: index[by_id[id(fp.sharded_param)][0]])
        pos_of = {id(fp): i for i, fp in enumerate(order)}
        named = [(by_id[id(fp.sharded_param)][0], _padded_flat(fp)) for fp in order]
        place = self._place(shard_group)
        if self._place_pending is not None:
            self._check_place(self._place_pending, place)
        self.attach_parameters(named)
        self._mesh_place = place
        self._place_pending = None
        groups, hooks = [], []
        for gi, (mname, m, fps) in enumerate(raw):
            key = tuple(pos_of[id(fp)] for fp in fps)
            numels = [self._numels[p] for p in key]
            groups.append(_Group(key, fps, numels, f"FSDP module {mname or '<root>'!r}", m))
            hooks.append(_GroupHook(self, gi))
        self._groups, self._hooks, self._seen = groups, hooks, set()
        for g, h in zip(groups, hooks):
            g.module.set_reduce_scatter_unused_params(True, recurse=False)
            g.module.set_all_reduce_hook(h)
        return self

    def _check_groups_meet_here(self, shard_group) -> None:
        _check_meets_only_here(self.group, shard_group, "replicate_group")

    def _place(self, shard_group) -> Dict[str, int]:
        if not dist.is_initialized():
            return {"rank": -1, "shard_rank": 0, "shard_size": 1}
        if shard_group is None:
            return {"rank": dist.get_rank(), "shard_rank": 0, "shard_size": 1}
        return {"rank": dist.get_rank(), "shard_rank": dist.get_rank(shard_group),
                "shard_size": dist.get_world_size(shard_group)}

    @staticmethod
    def _check_place(saved: Dict[str, int], mine: Dict[str, int]) -> None:
        if saved.get("shard_size") != mine["shard_size"]:
            raise ValueError(
                f"state_dict: saved with {saved.get('shard_size')} shards per replica group "
                f"but this model has {mine['shard_size']}; the residuals are shard-local and "
                f"cannot be resharded: start from a fresh SlimDPFSDPState (residuals restart "
                f"at zero)")
        if saved.get("rank") != mine["rank"] or saved.get("shard_rank") != mine["shard_rank"]:
            raise ValueError(
                f"state_dict: saved by global rank {saved.get('rank')} (shard "
                f"{saved.get('shard_rank')}) but loaded on rank {mine['rank']} (shard "
                f"{mine['shard_rank']}); every rank must load the file it saved itself")

    # ------------------------------------------------------------ the hook
    def _reduce(self, index: int, buf: torch.Tensor) -> None:
        """Average one group's reduce-scattered gradient ``buf`` over the replica group,
        in place (called by FSDP through the group's hook)."""
        if self._failed is not None:
            raise CollectiveError(
                f"SlimDPFSDPState cannot be used after a failed synchronisation "
                f"({self._failed}); restart every rank from the last checkpoint")
        g = self._groups[index]
        if index in self._seen:  # a group again: the previous step ended without it
            self.end_step()
            self._seen = set()
        self._seen.add(index)
        if buf.dim() != 1 or buf.numel() != g.numel or not buf.is_contiguous():
            self._failed = f"{g.label}: unexpected gradient buffer"
            raise RuntimeError(
                f"SlimDPFSDPState: {g.label} handed the hook a gradient of shape "
                f"{tuple(buf.shape)}, expected a flat [{g.numel}] (its trainable parameters' "
                f"padded shards {g.numels}); requires_grad changed after attach(), or "
                f"set_reduce_scatter_unused_params was turned off: attach a new state")
        for fp, pos in zip(g.fsdp_params, g.key):  # FSDP may re-pad (load_state_dict, _apply)
            if fp._sharded_param_data is not self._params[pos]:
                self._params[pos] = fp._sharded_param_data
        layout = self.layout_for(lambda: g.key, lambda key: (buf.device, buf.dtype),
                                 g.label, buf.device)
        try:
            fut = self.synchronize(layout, buf)
        except BaseException as exc:
            self._failed = f"{type(exc).__name__} in {g.label}"
            raise
        try:
            fut.wait()  # value() of a failed collective raises; nothing was committed
        except BaseException as exc:
            self._failed = f"{type(exc).__name__} in {g.label}"
            if isinstance(exc, CollectiveError):
                raise
            raise _comm.failure(f"SlimDPFSDPState ({g.label})", self._timeout, exc) from exc
        if len(self._seen) == len(self._groups):
            self.end_step()
            self._seen = set()

    # ------------------------------------------------------------ checkpoint
    def state_dict(self) -> Dict[str, Any]:
        """This rank's state (see :meth:`SlimDPCompressor.state_dict`), plus ``"fsdp"``:
        ``{"rank", "shard_rank", "shard_size"}``, where on the mesh it was saved.

        Raises:
            RuntimeError: called in the middle of a backward pass (some FSDP groups
                of the step reduced, others not).
        """
        if self._seen:
            raise RuntimeError("SlimDPFSDPState.state_dict: called between the hook calls of "
                               "one step (inside backward); save after loss.backward()")
        sd = super().state_dict()
        sd[_FSDP_KEY] = dict(self._mesh_place) if self._mesh_place else None
        return sd

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restore this rank's state saved by :meth:`state_dict` (every rank its own).

        Raises:
            ValueError: as :meth:`SlimDPCompressor.load_state_dict`; the state was
                saved by another global rank or shard rank, or at another shard
                count (checked now if attached, else at :meth:`attach`).
            RuntimeError: (at the next step, on every replica peer) the state was
                saved by another replica rank, replicate size or kind of state.
        """
        if not isinstance(state_dict, dict):
            raise ValueError(f"state_dict must be a dict, got {type(state_dict).__name__}")
        place = state_dict.get(_FSDP_KEY)
        if place is not None and self._mesh_place is not None:
            self._check_place(place, self._mesh_place)
        super().load_state_dict({k: v for k, v in state_dict.items() if k != _FSDP_KEY})
        self._seen = set()
        self._place_pending = place if self._mesh_place is None else None


def _check_meets_only_here(replicate_group, shard_group, argument: str) -> None:
    """Raise ``ValueError`` naming ``argument`` unless ``replicate_group`` (``None`` = the
    world) and the FSDP ``shard_group`` share this rank and no other: the replicate group
    must hold the ranks with the *same* shard in the other replica groups."""
    if shard_group is None or not dist.is_initialized():
        return
    rep = set(dist.get_process_group_ranks(replicate_group or dist.group.WORLD))
    shard = set(dist.get_process_group_ranks(shard_group))
    me = dist.get_rank()
    if rep & shard != {me}:
        raise ValueError(
            f"{argument}: ranks {sorted(rep)} share ranks {sorted(rep & shard)} with "
            f"the model's FSDP shard group {sorted(shard)}; the replicate group must hold "
            f"the ranks with the same shard in the other replica groups "
            f"(mesh['replicate'] of a (replicate, shard) mesh whose mesh['shard'] the "
            f"model was sharded over)")


def register_slim_dp_hook(model: nn.Module, replicate_group=None, **kwargs) -> SlimDPFSDPState:
    """Compress the replicate-dimension gradient all-reduce of an FSDP2 model with Slim-DP.

    Builds a :class:`SlimDPFSDPState` from ``replicate_group`` and ``kwargs``
    (its hyperparameters: ``core_ratio``, ``explore_ratio``, ``value_bits``,
    ``timeout``, ...) and installs its hook on every FSDP module of ``model``
    (``FSDPModule.set_all_reduce_hook``). The shard-dimension reduce-scatter
    and all-gather stay FSDP's.

    Args:
        model: sharded with ``fully_shard(..., mesh=mesh["shard"])`` (1-D).
        replicate_group: ``mesh["replicate"]`` (1-D DeviceMesh) or its
            ProcessGroup; ``None`` = the default group (only right when every
            FSDP module's shard group is this rank alone).
        **kwargs: :class:`SlimDPFSDPState` hyperparameters.

    Returns:
        the state: read ``state.stats``, save ``state.state_dict()`` per rank.

    Raises:
        ValueError: see :class:`SlimDPFSDPState` and :meth:`SlimDPFSDPState.attach`.
    """
    state = SlimDPFSDPState(replicate_group=replicate_group, **kwargs)
    return state.attach(model)


# ---------------------------------------------------------------------------
# FSDP2 internals (torch 2.13, torch/distributed/fsdp/_fully_shard/): read-only
# ---------------------------------------------------------------------------

def _param_groups(module) -> list:
    try:
        st = module._get_fsdp_state()
        return list(st._fsdp_param_groups)
    except AttributeError as exc:
        raise RuntimeError(f"slimcomm.fsdp: this torch's FSDP2 state has no parameter groups "
                           f"where torch 2.13 keeps them ({exc})") from exc


def _is_plain_fsdp(pg) -> bool:
    """Sharded over a 1-D mesh with no replicate dimension of FSDP's own (no native
    all-reduce before the hook)."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import DDPMeshInfo, FSDPMeshInfo
    info = getattr(pg, "mesh_info", None)
    return isinstance(info, FSDPMeshInfo) and not isinstance(info, DDPMeshInfo) and \
        info.mesh.ndim == 1


def _shard_group(pg):
    info = getattr(pg, "mesh_info", None)
    return getattr(info, "shard_process_group", None)


def _padded_flat(fp) -> torch.Tensor:
    """The parameter's padded local shard as ``[n]`` (FSDP's own storage: the optimizer's
    updates are visible through it); its size is the parameter's slice of the flat
    gradient the hook receives."""
    data = getattr(fp, "_sharded_param_data", None)
    if data is None or data.dim() != 1 or \
            data.numel() != _numel(getattr(fp, "padded_sharded_param_size", ())):
        raise RuntimeError("slimcomm.fsdp: FSDPParam has no 1-D padded shard "
                           "_sharded_param_data (FSDP2 internals differ from torch 2.13's)")
    return data


def _numel(size: Sequence[int]) -> int:
    n = 1
    for s in size:
        n *= int(s)
    return n
