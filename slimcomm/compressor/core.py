"""The Slim-DP compressor core: shared index sets, error feedback, per-parameter state.

Slim-DP (Sun, Chen, Bian, Liu, Liu, "Slim-DP: A Light Communication Data
Parallelism for DNN", arXiv 1709.09393, AAMAS 2018) communicates, each step,
only the *core set* (the coordinates that are significant in the latest
snapshot, significance = ``|w| * |g|``, Sec. 3.1) plus a random *explore set*
of other coordinates (Sec. 3.2). The paper uses a parameter server; on
all-reduce there is none, so the index set is **shared**: every rank derives
the same index set from state that is identical on every rank (the weights
and the last *globally averaged* value of each coordinate), so only the packed
values travel, through one dense ``all_reduce`` of ``k + m`` elements per
group. There is no index traffic and the bytes per rank do not grow with the
world size.

:class:`SlimDPCompressor` is that logic once, independent of what carries the
values. It synchronises a *group*: a flat buffer holding several tensors
(positions), each with its own state. Its adapters:

* :mod:`slimcomm.hooks` -- the DDP communication hook: a group is a DDP
  bucket of gradients (the SGD path).
* :mod:`slimcomm.optim` -- the optimizer-side sync: a group is a run of
  pseudo-gradients (outer parameters minus local parameters after local
  steps), for AdamW and other adaptive optimizers.

Per tensor ``p`` (position ``pos``, ``n`` elements) and per synchronised step
``t``:

1. ``acc = buf + error_decay * residual`` (error feedback; fp32; local to
   the rank).
2. Core set, refreshed when ``(t - warmup_steps) % core_refresh == 0``: the
   ``k`` coordinates with the largest ``|w| * |G|`` (``score``), where ``w``
   is the tensor's value (identical on all ranks) and ``G`` the last
   globally averaged value per coordinate
   (``slimcomm.ops.significance_topk_segmented``).
3. Explore set: ``m`` coordinates outside the core set from
   ``slimcomm.ops.explore_sample_segmented`` with ``seed`` and RNG offset
   :func:`explore_rng_offset` ``(t, pos)`` -- never torch's global RNG,
   never the group index.
4. ``values = pack(acc, core ∪ explore) / world_size`` (cast to
   ``value_dtype``), one ``all_reduce`` per group.
5. The buffer becomes zeros with the averaged values at the index set;
   ``G[index set] = values``; ``residual = acc`` with the sent coordinates
   zeroed.

``k, m = selection_sizes(n, core_ratio, explore_ratio)``; a tensor with
``k + m >= n`` is sent densely inside the same packed buffer, and a group of
only such tensors is a plain all-reduce. Everything is per position, so the
result does not depend on how tensors are grouped (DDP's ``bucket_cap_mb``,
its bucket rebuild after the first iteration, a new DDP instance after a
checkpoint).

``index_mode="local"`` is the classic per-rank top-k / deep gradient
compression baseline (each rank its own top-k of ``|w| * |acc|`` plus
explore, all-gathered (index, value) pairs); with ``error_decay < 1`` on
pseudo-gradients it is SparseLoCo's compressor (arXiv 2508.15706, Sec. 3).
"""

import inspect
import logging
import math
import threading
import zlib
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .. import _comm, ops
from ..agreement import agree_across_ranks, max_min_across_ranks
from ..codec import BITS, ChunkPlan

__all__ = ["SlimDPCompressor", "selection_sizes", "explore_rng_offset"]

logger = logging.getLogger(__name__)

_VALUE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_STATE_VERSION = 2  # 2: adds "owner" (rank, world size, kind), refused when it does not match
_FP16_MAX = 65504.0


class _Frozen:
    """A hyperparameter: readable, and fixed once the object is constructed.

    The ratios are baked into each group's cached layout (sizes on the wire),
    the seed and the refresh period into the index sets every rank derives,
    so a change on a live state could only be applied inconsistently;
    assigning raises ``AttributeError`` that says to build a new object.
    """

    __slots__ = ("name", "slot")

    def __set_name__(self, owner, name):
        self.name = name
        self.slot = "_hp_" + name

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        return getattr(obj, self.slot)

    def __set__(self, obj, value):
        raise AttributeError(
            f"{type(obj).__name__}.{self.name} cannot be changed after construction (the "
            f"index sets of every rank depend on it); construct a new "
            f"{type(obj).__name__} with {self.name}={value!r} instead")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)



def selection_sizes(numel: int, core_ratio: float, explore_ratio: float) -> Tuple[int, int, bool]:
    """Core size ``k``, explore size ``m`` and the dense flag of one parameter.

    ``k = max(1, ceil(core_ratio * numel))``; ``m = max(1, ceil(explore_ratio *
    numel))`` (``m = 0`` when ``explore_ratio == 0``). The products are rounded
    to 6 decimals before the ceiling so that float noise (``0.01 * 300 =
    3.0000000000000004``) does not add an element. When ``k + m >= numel``
    the parameter is *dense*: all ``numel`` coordinates are sent and
    ``(numel, 0, True)`` is returned.

    Args:
        numel: number of elements of the parameter, ``>= 0``.
        core_ratio: fraction in ``(0, 1]``.
        explore_ratio: fraction in ``[0, 1]``.

    Returns:
        ``(k, m, dense)``.

    Raises:
        ValueError: ``numel`` not an int ``>= 0``, or a ratio out of range
            (the message names the argument).
    """
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ValueError(f"numel must be an int >= 0, got {numel!r}")
    if not 0 < core_ratio <= 1:
        raise ValueError(f"core_ratio must be in (0, 1], got {core_ratio!r}")
    if not 0 <= explore_ratio <= 1:
        raise ValueError(f"explore_ratio must be in [0, 1], got {explore_ratio!r}")
    k = max(1, math.ceil(round(core_ratio * numel, 6)))
    m = max(1, math.ceil(round(explore_ratio * numel, 6))) if explore_ratio > 0 else 0
    if k + m >= numel:
        return numel, 0, True
    return k, m, False


def explore_rng_offset(step: int, position: int) -> int:
    """RNG offset of the explore set of parameter ``position`` at step ``step``.

    ``step * 2**32 + position``: a distinct Philox stream per (step,
    parameter), identical on every rank and independent of bucketing.
    """
    return (step << 32) + position


class _Layout:
    """Flat per-bucket storage for the per-parameter state of one bucket layout.

    The authoritative state of parameter ``positions[s]`` is segment ``s`` of
    these flat buffers; when DDP regroups parameters a new layout is built by
    copying each parameter's segment (see ``SlimDPCompressor.layout_for``).
    """

    __slots__ = (
        "positions", "offsets", "numels", "ks", "ms", "dense", "all_dense",
        "core_offsets", "numel", "device", "dtype", "residual", "spare", "G",
        "core", "topk_ks", "has_dense", "names", "pending", "label", "plan",
        "_lengths", "_wcache", "_offsets_t", "qpad", "_cksum",
    )

    def __init__(self, positions, numels, names, ratios, device, dtype, error_feedback):
        self.positions = positions
        self.numels = numels
        self.names = names
        self.offsets = [0]
        for n in numels:
            self.offsets.append(self.offsets[-1] + n)
        self.numel = self.offsets[-1]
        sizes = [selection_sizes(n, *ratios) for n in numels]
        self.ks = [k for k, _, _ in sizes]
        self.ms = [m for _, m, _ in sizes]
        self.dense = [d for _, _, d in sizes]
        self.all_dense = all(self.dense)
        self.has_dense = any(self.dense)
        self.topk_ks = [0 if d else k for k, d in zip(self.ks, self.dense)]
        self.core_offsets = [0]
        for k in self.ks:
            self.core_offsets.append(self.core_offsets[-1] + k)
        self.device = device
        self.dtype = dtype
        self.G = torch.zeros(self.numel, dtype=torch.float32, device=device)
        if error_feedback:
            self.residual = torch.zeros(self.numel, dtype=torch.float32, device=device)
            self.spare = torch.empty(self.numel, dtype=torch.float32, device=device)
        else:
            self.residual = None
            self.spare = None
        self.core: Optional[torch.Tensor] = None  # int64 [sum ks], bucket-flat indices
        # Parameter-local cores known for some segments only (from a checkpoint or an
        # older layout) while others must be computed: list of tensor-or-None.
        self.pending: Optional[List[Optional[torch.Tensor]]] = None
        self.label = ""  # names the group in errors, e.g. "bucket 3"
        self.plan = None  # codec.ChunkPlan of the packed values (value_bits only)
        self._lengths = None  # int64 [S] segment lengths on the device (segment_reduce)
        self._wcache = None   # (param data_ptrs, fp32 weight [N], its segment views, sources)
        self._offsets_t = None  # int64 [S + 1] segment offsets on the device (fused step ops)
        self.qpad = None  # the zero paddings of the quantised payload (value_bits only)
        self._cksum = {}  # k -> (int64 arange(1, k + 1), int64 k) of the index checksums

    def lengths(self) -> torch.Tensor:
        """int64 ``[S]`` segment lengths on the device, built once per layout."""
        if self._lengths is None:
            self._lengths = torch.tensor(self.numels, dtype=torch.int64, device=self.device)
        return self._lengths

    def offsets_tensor(self) -> torch.Tensor:
        """int64 ``[S + 1]`` segment offsets on the device, built once per layout (the
        fused step ops read the segment boundaries from it, without a host copy)."""
        if self._offsets_t is None:
            self._offsets_t = torch.tensor(self.offsets, dtype=torch.int64, device=self.device)
        return self._offsets_t

    def expand(self, per_segment: torch.Tensor) -> torch.Tensor:
        """``[S]`` -> ``[N]``: each segment's value repeated over its elements (one op,
        no host sync: the output size is the layout's)."""
        return torch.repeat_interleave(per_segment, self.lengths(), output_size=self.numel)

    def seg(self, s):
        return self.offsets[s], self.offsets[s + 1]


class SlimDPCompressor:
    r"""Slim-DP index sets, error feedback and per-position state for flat groups.

    Transport-agnostic core behind :class:`slimcomm.hooks.SlimDPState` (DDP
    comm hook) and :class:`slimcomm.optim.SlimDPOptimizer` (optimizer-side
    sync); see the module docstring for the algorithm. Users normally build
    one of those; the hyperparameters below are documented there too.

    Hyperparameters (keyword arguments): ``process_group`` (``None`` = the
    default group), ``core_ratio`` (0, 1], ``explore_ratio`` [0, 1],
    ``core_refresh`` (int >= 1, synchronised steps between core-set
    refreshes), ``warmup_steps`` (dense steps first; ``G`` starts from the
    dense average), ``score`` (``"product"`` = ``|w| * |G|``, ``"grad"``,
    ``"weight"``), ``index_mode`` (``"shared"`` or ``"local"``),
    ``error_feedback`` (bool), ``error_decay`` (0, 1]: the residual is
    multiplied by it before the next values are added (1 = classic error
    feedback; SparseLoCo uses it as outer momentum), ``value_dtype`` (wire
    dtype: ``None`` = the buffer's, or fp32/fp16/bf16), ``seed`` (64-bit int,
    equal on all ranks), ``check_agreement_every`` (int >= 0, default 100:
    every n-th compressed step checks the index sets across ranks with one
    all-reduce of 8 int64 per group; 0 = never).

    Hyperparameters are fixed at construction: assigning one raises
    ``AttributeError`` (the cached layouts and every rank's index sets depend
    on them); build a new object instead. Bools are not accepted as numbers,
    ``error_feedback`` must be a bool, ``process_group`` a ``ProcessGroup``
    or ``None``.

    The core set is refreshed from the weights, which can differ across
    ranks (a rank joined under DDP's ``join()`` with uneven inputs no longer
    steps its optimizer): at each refresh one tiny all-reduce of checksums
    (no host sync) makes every rank keep its previous core set where the new
    ones differ (``stats["core_fallbacks"]``), so ``G`` and the index sets
    stay identical on every rank.

    State per position: fp32 ``residual``, fp32 ``G``, the core set (int64
    position-local indices), and the step counter ``step`` (also the explore
    RNG position). ``state_dict()`` holds this rank's residuals: every rank
    saves and loads its own.

    Raises:
        ValueError: a hyperparameter out of range (the message names it).
    """

    # Subclasses tighten these (the DDP hook needs a dense warm-up step for G).
    _MIN_WARMUP = 0
    _WARMUP_WHY = ""
    _HYPERPARAMETERS = ("core_ratio", "explore_ratio", "core_refresh", "warmup_steps", "score",
                        "index_mode", "error_feedback", "error_decay", "value_dtype", "seed",
                        "check_agreement_every", "value_bits", "quant_chunk")

    __slots__ = [
        # hyperparameters (read through the _Frozen descriptors below)
        "_hp_process_group",
        "_hp_core_ratio",
        "_hp_explore_ratio",
        "_hp_core_refresh",
        "_hp_warmup_steps",
        "_hp_score",
        "_hp_index_mode",
        "_hp_error_feedback",
        "_hp_error_decay",
        "_hp_value_dtype",
        "_hp_seed",
        "_hp_check_agreement_every",
        "_hp_value_bits",
        "_hp_quant_chunk",
        # internal state
        "step",
        "_positions",   # id(param) -> position in model.parameters()
        "_names",       # position -> name
        "_numels",      # position -> numel
        "_params",      # strong references matching _positions' ids
        "_layouts",     # tuple(positions) -> _Layout
        "_slots",       # position -> (layout, segment)
        "_loaded",      # position -> dict from load_state_dict, not yet placed
        "_stats",
        "_step_acc",
        "_lock",
        "_owner_pending",  # "owner" of a loaded state_dict, checked at the next new layout
        "_scaler",         # GradScaler whose scale the residual and G are divided by
        "_undo",           # [(layout, step, idx, old G values)] of steps not yet settled
        "_fallbacks",      # device -> int64 count of refreshes whose new core set differed
        "_dev_counts",     # device -> int64 [2]: non-finite parameter-steps, voided steps
        "_void_flags",     # step -> bool 0-d device tensor: some parameter was non-finite
        "_timeout",        # seconds each collective may wait (None: the process group's)
    ]

    process_group = _Frozen()
    core_ratio = _Frozen()
    explore_ratio = _Frozen()
    core_refresh = _Frozen()
    warmup_steps = _Frozen()
    score = _Frozen()
    index_mode = _Frozen()
    error_feedback = _Frozen()
    error_decay = _Frozen()
    value_dtype = _Frozen()
    seed = _Frozen()
    check_agreement_every = _Frozen()
    value_bits = _Frozen()
    quant_chunk = _Frozen()

    # Adapter policies (see SlimDPState): a parameter whose values are exactly zero on
    # every rank keeps its residual and G (DDP discards the result of a parameter no rank
    # used); a step in which any parameter was non-finite is undone for every parameter
    # (a GradScaler skips the whole step).
    _KEEP_ALL_ZERO = False
    _VOID_NONFINITE_STEP = False

    def __init__(
        self,
        process_group: Optional[dist.ProcessGroup] = None,
        core_ratio: float = 0.01,
        explore_ratio: float = 0.01,
        core_refresh: int = 10,
        warmup_steps: int = 2,
        score: str = "product",
        index_mode: str = "shared",
        error_feedback: bool = True,
        error_decay: float = 1.0,
        value_dtype: Optional[torch.dtype] = None,
        seed: int = 0,
        check_agreement_every: int = 100,
        value_bits: Optional[int] = None,
        quant_chunk: int = 4096,
    ):
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise ValueError(f"process_group must be a torch.distributed.ProcessGroup or None, "
                             f"got {type(process_group).__name__} {process_group!r}")
        if not _is_real(core_ratio) or not 0 < core_ratio <= 1:
            raise ValueError(f"core_ratio must be a number in (0, 1], got {core_ratio!r}")
        if not _is_real(explore_ratio) or not 0 <= explore_ratio <= 1:
            raise ValueError(f"explore_ratio must be a number in [0, 1], got {explore_ratio!r}")
        if not _is_int(core_refresh) or core_refresh < 1:
            raise ValueError(f"core_refresh must be an int >= 1, got {core_refresh!r}")
        if not _is_int(warmup_steps) or warmup_steps < self._MIN_WARMUP:
            raise ValueError(
                f"warmup_steps must be an int >= {self._MIN_WARMUP}{self._WARMUP_WHY}, "
                f"got {warmup_steps!r}"
            )
        if not _is_real(error_decay) or not 0 < error_decay <= 1:
            raise ValueError(f"error_decay must be a number in (0, 1], got {error_decay!r}")
        if not isinstance(error_feedback, bool):
            raise ValueError(f"error_feedback must be a bool (True or False), got "
                             f"{error_feedback!r}")
        if value_bits is not None and (not _is_int(value_bits) or value_bits not in BITS):
            raise ValueError(f"value_bits must be None or one of {BITS}, got {value_bits!r}")
        if value_bits is not None and index_mode != "shared":
            raise ValueError("value_bits needs index_mode='shared' (codes are all-gathered "
                             "at the shared index set)")
        if not _is_int(quant_chunk) or quant_chunk < 1:
            raise ValueError(f"quant_chunk must be an int >= 1, got {quant_chunk!r}")
        if not isinstance(score, str) or score not in ops.SCORES:
            raise ValueError(f"score must be one of {ops.SCORES}, got {score!r}")
        if not isinstance(index_mode, str) or index_mode not in ("shared", "local"):
            raise ValueError(f"index_mode must be 'shared' or 'local', got {index_mode!r}")
        if value_dtype is not None and (not isinstance(value_dtype, torch.dtype)
                                        or value_dtype not in _VALUE_DTYPES):
            raise ValueError(
                f"value_dtype must be None or one of {_VALUE_DTYPES}, got {value_dtype!r}"
            )
        if not _is_int(seed) or not -2**63 <= seed < 2**64:
            raise ValueError(f"seed must be an int in [-2**63, 2**64) (64 bits), got {seed!r}")
        if not _is_int(check_agreement_every) or check_agreement_every < 0:
            raise ValueError(
                f"check_agreement_every must be an int >= 0, got {check_agreement_every!r}"
            )
        self._hp_process_group = process_group
        self._hp_core_ratio = float(core_ratio)
        self._hp_explore_ratio = float(explore_ratio)
        self._hp_core_refresh = core_refresh
        self._hp_warmup_steps = warmup_steps
        self._hp_score = score
        self._hp_index_mode = index_mode
        self._hp_error_feedback = error_feedback
        self._hp_error_decay = float(error_decay)
        self._hp_value_dtype = value_dtype
        self._hp_seed = seed
        self._hp_check_agreement_every = check_agreement_every
        self._hp_value_bits = value_bits
        self._hp_quant_chunk = quant_chunk
        self.step = 0
        self._positions: Dict[int, int] = {}
        self._names: List[str] = []
        self._numels: List[int] = []
        self._params: List[torch.Tensor] = []
        self._layouts: Dict[Tuple[int, ...], _Layout] = {}
        self._slots: Dict[int, Tuple[_Layout, int]] = {}
        self._loaded: Dict[int, Dict[str, Any]] = {}
        self._stats = _new_stats()
        self._step_acc = _new_counts()
        self._lock = threading.Lock()
        self._owner_pending: Optional[Dict[str, Any]] = None
        self._scaler = None
        self._undo: List[Tuple[_Layout, int, Optional[torch.Tensor], Optional[torch.Tensor]]] = []
        self._fallbacks: Dict[torch.device, torch.Tensor] = {}
        self._dev_counts: Dict[torch.device, torch.Tensor] = {}
        self._void_flags: Dict[int, torch.Tensor] = {}
        # Seconds each collective may wait before it fails (None: the process group's own
        # timeout). Not a hyperparameter: it changes no result, only how long a dead or
        # hung peer can stall this rank. SlimDPOptimizer sets it from its ``timeout``.
        self._timeout: Optional[float] = None

    # ------------------------------------------------------------ parameters
    def attach_parameters(self, named: Sequence[Tuple[str, torch.Tensor]]) -> "SlimDPCompressor":
        """Give every synchronised tensor a stable position; call before the first sync.

        Args:
            named: ``(name, tensor)`` pairs; position ``i`` is the ``i``-th
                pair. The tensors' values must be identical on every rank
                when :meth:`synchronize` runs (the core set is scored on
                them): the model's parameters for a DDP hook, the outer
                (anchor) parameters for an optimizer-side sync.

        Returns:
            ``self``.

        Raises:
            ValueError: already-held state (from :meth:`load_state_dict` or
                training) names a position that has a different name or size
                in ``named``.
        """
        names = [n for n, _ in named]
        numels = [t.numel() for _, t in named]
        old_names, old_numels = self._names, self._numels
        held = set(self._slots) | set(self._loaded)
        for pos in sorted(held):
            want_name = self._loaded[pos]["name"] if pos in self._loaded else old_names[pos]
            want_numel = self._loaded[pos]["numel"] if pos in self._loaded else old_numels[pos]
            if pos >= len(named) or names[pos] != want_name or numels[pos] != want_numel:
                got = f"{names[pos]!r} ({numels[pos]} elements)" if pos < len(named) else "nothing"
                raise ValueError(
                    f"model: {type(self).__name__} state for parameter position {pos} belongs "
                    f"to {want_name!r} ({want_numel} elements) but the model has {got} there"
                )
        self._params = [t for _, t in named]
        self._positions = {id(t): i for i, t in enumerate(self._params)}
        self._names = names
        self._numels = numels
        return self

    # ------------------------------------------------------------ layouts
    def layout_for(self, key_fn: Callable[[], Tuple[int, ...]],
                   check_fn: Callable[[Tuple[int, ...]], Tuple[torch.device, torch.dtype]],
                   label: str, device: torch.device) -> _Layout:
        """The layout of a group of positions; a new one is checked across ranks.

        Collective for a new layout only (one small all-reduce); a known
        layout is a dictionary lookup.

        Args:
            key_fn: returns the group's positions (a tuple of ints); may raise
                ``RuntimeError`` for a mistake only this rank can see.
            check_fn: for a new layout, validates the group's flat buffer and
                returns its ``(device, dtype)``; may raise ``RuntimeError``.
            label: names the group in errors (e.g. ``"bucket 3"``).
            device: where the cross-rank check is reduced.

        A mistake only this rank can see is raised only after it has been
        signalled in the cross-rank check that every rank runs for a new
        layout, so the other ranks raise too instead of blocking in a
        collective.
        """
        self._settle()
        layout: Optional[_Layout] = None
        error: Optional[RuntimeError] = None
        try:
            if not self._positions:
                raise RuntimeError(
                    f"{type(self).__name__} is not attached to a model: call "
                    f"state.attach(ddp_model) (or pass model=) before the first backward pass"
                )
            key = key_fn()
            layout = self._layouts.get(key)
            if layout is not None:
                return layout
            dev, dtype = check_fn(key)
            self._check_owner()
            layout = _Layout(
                list(key), [self._numels[i] for i in key], [self._names[i] for i in key],
                (self.core_ratio, self.explore_ratio), dev, dtype, self.error_feedback,
            )
            layout.label = label
        except RuntimeError as exc:
            error = exc
        self._verify_layout_across_ranks(layout, label, device, error)
        self._move_state_into(layout)
        # Older layouts that share a parameter are stale now.
        key = tuple(layout.positions)
        for old_key in [k for k in self._layouts if set(k) & set(key)]:
            del self._layouts[old_key]
        self._layouts[key] = layout
        return layout

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

    def _hyperparameters(self) -> Tuple:
        return (self.core_ratio, self.explore_ratio, self.core_refresh, self.warmup_steps,
                self.score, self.index_mode, self.error_feedback, self.error_decay,
                str(self.value_dtype), self.seed, self.check_agreement_every, self.value_bits,
                self.quant_chunk)

    def _verify_layout_across_ranks(self, layout: Optional[_Layout], label: str,
                                    device: torch.device,
                                    error: Optional[RuntimeError] = None) -> None:
        """Once per new layout: check that every rank agrees on the group's
        parameters, the sizes on the wire, the hyperparameters and the step (a
        mismatch would otherwise mismatch collective sizes and hang or corrupt),
        and that no rank failed to build its layout (``error``, re-raised here
        after the exchange; the other ranks raise a RuntimeError that says so).
        One all-reduce (MAX of ``[x, -x]``) of a few int64 values."""
        failed = error is not None
        items = {
            "parameter positions": 0 if failed else zlib.crc32(repr(layout.positions).encode()),
            "bucket size": 0 if failed else layout.numel,
            "core + explore sizes": 0 if failed else sum(layout.ks) + sum(layout.ms),
            "hyperparameters": zlib.crc32(repr(self._hyperparameters()).encode()),
            "step": self.step,
        }
        name = type(self).__name__
        differ = agree_across_ranks(
            items, error, group=self.group, device=device, timeout=self._timeout,
            other_failed=(
                f"{name}: another rank could not map {label} to its "
                f"Slim-DP state (see the error raised on that rank, e.g. a state that is not "
                f"attached, attached to another model, or loaded from a state_dict another "
                f"rank saved); no rank can proceed"))
        if differ:
            raise RuntimeError(
                f"{name} differs across ranks for {label} (parameters "
                f"{layout.names}): {', '.join(differ)}. Construct {name} with the same "
                f"arguments on every rank and load each rank's own checkpoint of the same step."
            )

    def _move_state_into(self, layout: _Layout) -> None:
        """Copy each parameter's residual, G and core into ``layout``'s segments."""
        cores: List[Optional[torch.Tensor]] = []
        for s, pos in enumerate(layout.positions):
            lo, hi = layout.seg(s)
            core = None
            if pos in self._slots:
                old, os_ = self._slots[pos]
                olo, ohi = old.seg(os_)
                layout.G[lo:hi].copy_(old.G[olo:ohi])
                if layout.residual is not None and old.residual is not None:
                    layout.residual[lo:hi].copy_(old.residual[olo:ohi])
                if old.core is not None:
                    core = old.core[old.core_offsets[os_]:old.core_offsets[os_ + 1]] - olo
            elif pos in self._loaded:
                d = self._loaded.pop(pos)
                layout.G[lo:hi].copy_(d["G"].reshape(-1))
                if layout.residual is not None and d.get("residual") is not None:
                    layout.residual[lo:hi].copy_(d["residual"].reshape(-1))
                core = d.get("core")
                if core is not None:
                    core = core.to(device=layout.device, dtype=torch.int64)
            if core is not None and core.numel() != layout.ks[s]:
                core = None  # sizes changed (new ratios): recompute at the next sparse step
            cores.append(core)
            self._slots[pos] = (layout, s)
        if cores and all(c is not None for c in cores):
            layout.core = torch.cat([c + layout.offsets[s] for s, c in enumerate(cores)])
        elif any(c is not None for c in cores):
            layout.pending = cores

    # ------------------------------------------------------------ synchronisation
    @property
    def group(self):
        """The process group values are reduced over (the default group if ``None``)."""
        return self.process_group if self.process_group is not None else dist.group.WORLD

    def synchronize(self, layout: _Layout, buf: torch.Tensor,
                    weight: Optional[torch.Tensor] = None,
                    warmup_dtype: Optional[torch.dtype] = None) -> torch.futures.Future:
        """Start averaging one group's flat buffer over the ranks, Slim-DP style.

        Args:
            layout: from :meth:`layout_for`; ``buf`` must match it.
            buf: flat ``[N]`` fp32/fp16/bf16, the group's per-rank values
                (gradients for the DDP hook, pseudo-gradients for the
                optimizer-side sync), written in place.
            weight: flat fp32 ``[N]`` of the values the core set is scored on
                (identical on every rank); ``None`` gathers the attached
                tensors (only when the score needs them).
            warmup_dtype: wire dtype of the dense warm-up steps (default
                ``buf``'s dtype: bit-identical to a plain averaged all-reduce).

        Returns:
            a future of ``buf`` holding, when it completes: the dense average
            during warm-up and for groups of dense parameters only; otherwise
            zeros except the averaged values at the group's index set. A
            parameter whose values held NaN/inf on any rank comes back filled
            with NaN on every rank, and its residual and ``G`` are not updated.

        One collective per call (two in ``"local"`` mode, all-gathers), issued
        from the calling thread; the caller closes the step with
        :meth:`end_step` after the last group.
        """
        world_size = dist.get_world_size(self.group)
        step = self.step
        if step < self.warmup_steps:
            return _dense(self, layout, buf, world_size, warmup_dtype or buf.dtype)
        with ops.trusted_indices():  # our own index sets: no host sync for CUDA value checks
            if self.value_bits is not None:
                return _quantised(self, layout, buf, world_size, step, weight)
            if layout.all_dense:
                return _dense(self, layout, buf, world_size, self.value_dtype or buf.dtype)
            if self.index_mode == "shared":
                return _shared(self, layout, buf, world_size, step, weight)
            return _local(self, layout, buf, world_size, step, weight)

    # ------------------------------------------------------------ core set
    def _refresh_core(self, layout: _Layout, force_all: bool,
                      weight: Optional[torch.Tensor]) -> None:
        """Recompute the core set: every segment if ``force_all`` (a refresh step),
        else only the segments without a known core (``layout.pending``)."""
        pending = None if force_all else layout.pending
        layout.pending = None
        if pending is None:
            ks = layout.topk_ks
        else:
            ks = [k if c is None else 0 for k, c in zip(layout.topk_ks, pending)]
        if self.score == "grad":
            weight = layout.G
        elif weight is None:
            weight = self._flat_weight(layout)
        idx, _ = ops.significance_topk_segmented(weight, layout.G, layout.offsets, ks, self.score)
        core = self._assemble_core(layout, idx, pending, ks)
        if self.score != "grad" and dist.get_world_size(self.group) > 1:
            # The score reads the weights, which are NOT identical on every rank while a
            # rank is joined (DDP join with uneven inputs: the joined rank no longer steps
            # its optimizer) or after a non-deterministic update. G is identical by
            # construction, so a core set that differs across ranks would make G (and the
            # replicas) diverge for good. One tiny all-reduce of checksums decides, without
            # a host sync: where any rank's new core differs, every rank keeps its previous
            # core set (or, for a layout that has none yet, the top-k of |G| alone).
            if layout.core is not None:
                fallback = layout.core
            else:
                fb, _ = ops.significance_topk_segmented(layout.G, layout.G, layout.offsets, ks,
                                                        "grad")
                fallback = self._assemble_core(layout, fb, pending, ks)
            hi, lo = _index_checksums(self, layout, core)
            agree = torch.eq(hi, lo).all()
            core = torch.where(agree, core, fallback)
            dev = core.device
            with self._lock:
                cnt = self._fallbacks.get(dev)
                if cnt is None:
                    cnt = self._fallbacks[dev] = torch.zeros((), dtype=torch.int64, device=dev)
                cnt.add_(agree.logical_not())
        layout.core = core

    def _assemble_core(self, layout: _Layout, idx: torch.Tensor, pending, ks) -> torch.Tensor:
        """Bucket-flat core of every segment: top-k ``idx`` (``ks`` per segment), dense
        segments whole, segments known from ``pending`` as they are."""
        if pending is None and not layout.has_dense:
            return idx
        parts, at = [], 0
        for s in range(len(layout.positions)):
            lo, hi = layout.seg(s)
            if layout.dense[s]:
                parts.append(torch.arange(lo, hi, dtype=torch.int64, device=layout.device))
            elif pending is not None and pending[s] is not None:
                parts.append(pending[s] + lo)
            else:
                parts.append(idx[at:at + ks[s]])
                at += ks[s]
        return torch.cat(parts)

    def _flat_weight(self, layout: _Layout) -> torch.Tensor:
        """The attached tensors flattened like their values in the group buffer: in memory
        order (DDP lays a dense, non-overlapping gradient out like its parameter, e.g.
        channels_last), else in logical order."""
        params = [self._params[pos] for pos in layout.positions]
        key = tuple(p.data_ptr() for p in params)
        cache = layout._wcache
        if cache is None or cache[0] != key:
            # Built once per layout (and again if a parameter's storage is replaced): the
            # flat weight, its segment views and the parameters' flat views, so that each
            # refresh is one multi-tensor copy whatever the number of parameters.
            w = torch.empty(layout.numel, dtype=torch.float32, device=layout.device)
            dst, src, slow = [], [], []
            for s, p in enumerate(params):
                lo, hi = layout.seg(s)
                flat = _memory_order_flat(p.detach())
                if hi == lo:
                    continue
                if flat.untyped_storage().data_ptr() == p.untyped_storage().data_ptr():
                    dst.append(w[lo:hi])
                    src.append(flat)
                else:
                    slow.append((lo, hi, p))  # not viewable flat: a fresh copy each time
            cache = layout._wcache = (key, w, dst, src, slow)
        _, w, dst, src, slow = cache
        if dst:
            torch._foreach_copy_(dst, src)
        for lo, hi, p in slow:
            w[lo:hi].copy_(_memory_order_flat(p.detach()))
        return w

    # ------------------------------------------------------------ loss scale, void steps
    def attach_grad_scaler(self, scaler) -> "SlimDPCompressor":
        """Keep error feedback in *unscaled* units under a dynamic loss scale.

        With a ``torch.amp.GradScaler`` the values reaching the compressor are the
        gradients times the current scale ``S``, which halves on overflow and grows
        every ``growth_interval`` steps. Without this call the residual and ``G`` hold
        values of whatever scale they were made at, so after a scale change the residual
        is applied ``S_old / S_new`` times too strongly or weakly. After it, each step
        uses ``acc = grad + S * residual`` and stores ``residual = unsent / S`` and
        ``G = averaged / S`` (a few elementwise ops with the scale tensor, no host sync).

        Args:
            scaler: the ``torch.amp.GradScaler`` (or ``torch.cuda.amp.GradScaler``) whose
                ``scale(loss)`` produced the gradients; ``None`` detaches it.

        Returns:
            ``self``.

        Raises:
            ValueError: ``scaler`` is not a GradScaler.
        """
        if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
            raise ValueError(f"scaler must be a torch.amp.GradScaler or None, got "
                             f"{type(scaler).__name__}")
        self._scaler = scaler
        return self

    def _loss_scale(self, layout: _Layout) -> Optional[torch.Tensor]:
        sc = self._scaler
        if sc is None or not sc.is_enabled() or getattr(sc, "_scale", None) is None:
            return None
        scale = sc._scale
        if scale.device != layout.device or scale.dtype != torch.float32:
            scale = scale.to(device=layout.device, dtype=torch.float32)
        return scale

    def _dev_count(self, device) -> torch.Tensor:
        """int64 ``[2]`` device counters (non-finite parameter-steps, voided steps), added
        to without a host sync and read only by :attr:`stats`."""
        with self._lock:
            cnt = self._dev_counts.get(device)
            if cnt is None:
                cnt = self._dev_counts[device] = torch.zeros(2, dtype=torch.int64,
                                                             device=device)
        return cnt

    def _settle(self) -> None:
        """Undo, for every parameter, the commits of a finished step in which any parameter
        was non-finite (policy ``_VOID_NONFINITE_STEP``: a GradScaler skips the whole
        step, so values sent then were never applied and must stay in the residual).
        Runs at the start of the next step and before :meth:`state_dict`.

        Branchless (no host sync): whether the step is void is a device flag, and every
        recorded group selects, with ``torch.where``, its old residual and old ``G`` at
        the sent coordinates where the flag is set and the new ones elsewhere."""
        if not self._undo:
            return
        with self._lock:
            done = [u for u in self._undo if u[1] < self.step]
            if not done:
                return
            self._undo = [u for u in self._undo if u[1] >= self.step]
            flags = self._void_flags
            self._void_flags = {t: v for t, v in flags.items() if t >= self.step}
        counted = set()
        for layout, step, idx, undo_g in done:
            void = flags.get(step)
            if void is None:
                continue
            counter = None
            if step not in counted:  # the voided-steps counter, once per step
                counted.add(step)
                counter = self._dev_count(void.device)
            if self._layouts.get(tuple(layout.positions)) is not layout:
                if counter is not None:
                    ops.step_undo(void, counter=counter)
                continue
            has_res = layout.residual is not None
            has_g = undo_g is not None
            # one fused op: residual <- old residual and G[idx] <- old G where void
            ops.step_undo(void, residual=layout.residual if has_res else None,
                          spare=layout.spare if has_res else None,
                          G=layout.G if has_g else None, indices=idx if has_g else None,
                          old_g=undo_g, counter=counter)

    # ------------------------------------------------------------ stats
    def _count(self, dense_bytes: int, sent_bytes: int, numel: int, sent: int,
               core: int, explore: int) -> None:
        with self._lock:
            c = self._step_acc
            c["bytes_dense"] += dense_bytes
            c["bytes_sent"] += sent_bytes
            c["elements"] += numel
            c["elements_sent"] += sent
            c["core"] += core
            c["explore"] += explore

    def end_step(self) -> None:
        """Close one synchronised step: fold its counts into the stats, advance ``step``."""
        with self._lock:
            last = self._step_acc
            last["density"] = last["elements_sent"] / last["elements"] if last["elements"] else 0.0
            tot = self._stats["total"]
            for key in _COUNT_KEYS:
                tot[key] += last[key]
            tot["density"] = tot["elements_sent"] / tot["elements"] if tot["elements"] else 0.0
            self._stats["last"] = last
            self._stats["steps"] += 1
            self._step_acc = _new_counts()
            self.step += 1

    def _count_check(self, nbytes: int) -> None:
        """One cross-rank agreement all-reduce of ``nbytes`` (also in ``bytes_sent``)."""
        with self._lock:
            self._step_acc["checks"] += 1
            self._step_acc["check_bytes"] += nbytes
            self._step_acc["bytes_sent"] += nbytes

    def _note_nonfinite(self, n: torch.Tensor) -> None:
        """Add the int64 0-d device count ``n`` of non-finite parameters (no host sync)."""
        self._dev_count(n.device)[:1].add_(n)

    @property
    def stats(self) -> Dict[str, Any]:
        """Communication statistics (a copy).

        Returns a dict with ``steps`` (synchronised steps seen),
        ``nonfinite_fallbacks`` (parameter-steps whose averaged gradient
        held NaN/inf, so residual and ``G`` were not updated),
        ``voided_steps`` (DDP hook: steps undone for every parameter because
        some parameter was non-finite), ``core_fallbacks`` (core-set refreshes
        at which the ranks' new core sets differed, e.g. while a rank was
        joined, so every rank kept its previous core set; reading it
        synchronises with the device), and ``last`` / ``total`` (the last
        step, cumulative), each a
        dict of: ``bytes_sent`` (bytes this rank put into collectives,
        including the flag element and any agreement checksums),
        ``checks`` / ``check_bytes`` (cross-rank agreement all-reduces and
        their bytes, part of ``bytes_sent``: one of 8 int64 (64 bytes) per
        group at each core refresh of the shared mode with ``score`` other
        than ``"grad"``, and one of 12 int64 (96 bytes) per group every
        ``check_agreement_every`` compressed steps),
        ``bytes_dense`` (what DDP's default all-reduce would have put in),
        ``elements`` / ``elements_sent`` (gradient coordinates, all / sent),
        ``density`` = ``elements_sent / elements``, ``core`` and ``explore``
        (coordinates in the core and explore sets; dense parameters count as
        core). A ring all-reduce moves about ``2 (W-1)/W`` times
        ``bytes_sent`` over each rank's link; an all-gather (``"local"``
        mode) receives ``W`` times every rank's contribution.
        """
        with self._lock:
            fallbacks = list(self._fallbacks.values())
            dev = [c.tolist() for c in self._dev_counts.values()]  # reading stats syncs
            out = {
                "steps": self._stats["steps"],
                "nonfinite_fallbacks": self._stats["nonfinite_fallbacks"]
                + sum(c[0] for c in dev),
                "voided_steps": self._stats["voided_steps"] + sum(c[1] for c in dev),
                "last": dict(self._stats["last"]),
                "total": dict(self._stats["total"]),
            }
        out["core_fallbacks"] = int(sum(int(c) for c in fallbacks))
        return out

    # ------------------------------------------------------------ checkpoint
    def state_dict(self) -> Dict[str, Any]:
        """This rank's Slim-DP state, for ``torch.save`` (every rank saves its own).

        Returns:
            dict with ``version``, ``step`` (synchronised steps done; also the
            explore RNG position), the hyperparameters that determine the
            index sets (``seed``, ``core_ratio``, ``explore_ratio``,
            ``core_refresh``, ``warmup_steps``, ``score``, ``index_mode``),
            ``stats``, ``owner`` (whose state this is: ``rank`` and
            ``world_size`` in the process group, ``None`` when no process
            group was initialised, and ``kind``, the class name; a load on
            another rank, world size or kind is refused), and ``params``:
            ``{position: {"name", "numel",
            "residual" (fp32 [numel] or None), "G" (fp32 [numel]), "core"
            (int64 parameter-local indices, or None)}}``. Tensors are clones
            on the state's device. No process group, no model.
        """
        self._settle()
        params: Dict[int, Dict[str, Any]] = {}
        for pos, (layout, s) in self._slots.items():
            lo, hi = layout.seg(s)
            core = None
            if layout.core is not None:
                core = (layout.core[layout.core_offsets[s]:layout.core_offsets[s + 1]] - lo).clone()
            elif layout.pending is not None and layout.pending[s] is not None:
                core = layout.pending[s].clone()
            params[pos] = {
                "name": self._names[pos],
                "numel": hi - lo,
                "residual": None if layout.residual is None else layout.residual[lo:hi].clone(),
                "G": layout.G[lo:hi].clone(),
                "core": core,
            }
        for pos, d in self._loaded.items():
            params[pos] = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in d.items()}
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
            "stats": self.stats,
            "params": params,
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
                ``warmup_steps``, ``score`` or ``index_mode`` differ from this
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
        for key in ("seed", "core_ratio", "explore_ratio", "core_refresh", "warmup_steps",
                    "score", "index_mode", "error_decay"):
            saved = state_dict.get(key, 1.0) if key == "error_decay" else state_dict[key]
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
            for field in ("name", "numel", "G"):
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
        self._loaded = loaded
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
        hp = state["hyperparameters"]
        accepted = inspect.signature(type(self).__init__).parameters
        # an adapter may not offer every core hyperparameter (SlimDPState: no value_bits)
        self.__init__(process_group=None, **{k: v for k, v in hp.items() if k in accepted})
        self.load_state_dict(state["state"])



_COUNT_KEYS = ("bytes_dense", "bytes_sent", "elements", "elements_sent", "core", "explore",
               "checks", "check_bytes")


def _new_counts() -> Dict[str, Any]:
    c: Dict[str, Any] = {k: 0 for k in _COUNT_KEYS}
    c["density"] = 0.0
    return c


def _check_entry(pos: int, d: Dict[str, Any]) -> None:
    """Validate one parameter entry of a loaded state_dict (ValueError naming it)."""
    name, numel = d["name"], d["numel"]
    what = f"state_dict: parameter {pos} ({name!r})"
    if not isinstance(name, str):
        raise ValueError(f"state_dict: parameter {pos} name must be a str, got {name!r}")
    if not _is_int(numel) or numel < 0:
        raise ValueError(f"{what}: numel must be an int >= 0, got {numel!r}")
    for field in ("G", "residual"):
        t = d.get(field)
        if t is None and field == "residual":
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


def _new_stats() -> Dict[str, Any]:
    return {"steps": 0, "nonfinite_fallbacks": 0, "voided_steps": 0, "last": _new_counts(),
            "total": _new_counts()}


def _memory_order_flat(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as ``[numel]`` in memory order when ``t`` is dense and
    non-overlapping (a view when possible), else in logical order -- the order of its
    gradient in a DDP bucket."""
    if t.dim() < 2 or t.is_contiguous():
        return t.reshape(-1)
    perm = sorted(range(t.dim()), key=lambda d: (-t.stride(d), -t.size(d)))
    v = t.permute(perm)
    return v.reshape(-1) if v.is_contiguous() else t.reshape(-1)



# ---------------------------------------------------------------------------
# Synchronising one group
# ---------------------------------------------------------------------------
#
# Ordering rule: every collective is issued from the caller's thread (for the
# DDP hook, DDP's), never from a future callback (those run on the backend's
# thread, concurrently with the next group's call, so a collective there could
# be matched with a different collective on another rank). Non-finite values
# are therefore signalled in-band: one flag element per position travels with
# the values.

def _dense(state, layout, buf, world_size, wire_dtype):
    """Plain average; ``G`` <- the average (parameters whose average is finite).

    With the wire dtype equal to the bucket's (always during warm-up) this is
    exactly DDP's default hook. After warm-up the values travel in
    ``value_dtype`` like dense parameters inside mixed buckets do, so a dense
    parameter is averaged the same way whatever bucket it lands in.
    """
    n = buf.numel()
    if wire_dtype == buf.dtype:
        wire = buf.div_(world_size)
    else:
        wire = buf.float().div_(world_size).to(wire_dtype)
    state._count(n * buf.element_size(), n * wire.element_size(), n, n, n, 0)
    fut = _comm.all_reduce(wire, state.group, timeout=state._timeout).get_future()

    scale = state._loss_scale(layout)

    def done(f):
        out = f.value()[0]  # raises if the collective failed: nothing is written then
        if out is not buf:
            buf.copy_(out)
        # Branchless: G <- the average in the parameters whose average is finite.
        fin = torch.isfinite(_segment_max_abs(layout, out))
        torch.where(layout.expand(fin), out, layout.G, out=layout.G)
        state._note_nonfinite(fin.logical_not().sum())
        if scale is not None:
            layout.G.div_(scale)
        return buf

    return fut.then(ops.run_trusted(done))


def _accumulate(state, layout: _Layout, buf: torch.Tensor, scale) -> torch.Tensor:
    """``acc = buf + error_decay * scale * residual`` in fp32, into the spare buffer (the
    residual is kept). ``scale``: the loss scale of ``buf`` (0-d tensor) or None."""
    if layout.residual is None:
        return buf if buf.dtype == torch.float32 else buf.float()
    if scale is not None:
        return torch.addcmul(buf, layout.residual, scale, value=state.error_decay,
                             out=layout.spare)
    if state.error_decay != 1.0:
        return torch.add(buf, layout.residual, alpha=state.error_decay, out=layout.spare)
    return torch.add(layout.residual, buf, out=layout.spare)


def _segment_max_abs(layout: _Layout, buf: torch.Tensor) -> torch.Tensor:
    """``[S]`` in ``buf``'s dtype: per segment the largest ``|x|`` (NaN if any is NaN,
    0 for an empty segment); two ops whatever the number of segments."""
    return torch.segment_reduce(buf.abs(), "max", lengths=layout.lengths(), initial=0)


def _select_explore(state, layout, core, step):
    if sum(layout.ms) == 0:
        return core, 0
    rng = [explore_rng_offset(step, p) for p in layout.positions]
    explore = ops.explore_sample_segmented(
        layout.offsets, core, layout.core_offsets, layout.ms, state.seed, rng)
    return torch.cat([core, explore]), explore.numel()


def _fp16_limit(world_size: int) -> float:
    """Largest power of two ``L`` with ``world_size * L <= 65504``: every partial sum of
    ``world_size`` fp16 values in ``[-L, L]`` is finite, whatever the summation order."""
    return 2.0 ** math.floor(math.log2(_FP16_MAX / world_size))


def _encode(state, layout, buf, idx, world_size, wire_dtype, scale, accumulated=False):
    """``(wire, acc)``: one fused op (``slimcomm.ops.step_encode``) for steps 1 and 4-5
    of the module docstring on this rank's side: ``acc = buf + error_decay * scale *
    residual`` (fp32, into the spare buffer; already there when ``accumulated``), the
    payload ``[acc[idx] / world_size | flags]`` in ``wire_dtype`` (per parameter of this
    rank's new values ``buf``: NaN if they hold NaN/inf, else 1 if any is nonzero, else 0;
    summed over the ranks: NaN if non-finite on some rank, 0 if exactly zero on every
    rank, e.g. a parameter no rank used, whose result DDP discards), and in ``acc`` the
    next residual (sent coordinates zeroed, or set to what the fp16 saturation clipped
    off, divided by the loss ``scale``).

    On an fp16 wire without a loss scale the values are saturated at
    :func:`_fp16_limit` so the sum cannot overflow (a residual piled up over many steps
    would otherwise turn into inf on every send, and never drain); ``world_size`` times
    what was clipped off stays in the residual. With a GradScaler attached an overflow
    is left to become inf: the scaler skips the step (undone for every parameter) and
    lowers the scale, and the residual, kept unscaled, then fits. ``acc`` is None
    without error feedback."""
    clip = _fp16_limit(world_size) if wire_dtype == torch.float16 and scale is None else None
    acc = layout.spare if layout.residual is not None else None
    wire = ops.step_encode(buf, idx, layout.offsets_tensor(), world_size, wire_dtype, acc=acc,
                           residual=None if accumulated else layout.residual, scale=scale,
                           error_decay=state.error_decay, accumulate=not accumulated,
                           clip=clip)
    return wire, acc


def _commit(state, layout, buf, acc, idx, avg, step, scale, local=None):
    """After the collective: ``buf``, ``G`` and the residual updated, NaN where flagged.

    One fused op: ``slimcomm.ops.step_commit`` (``avg``: the summed payload ``[values |
    flags]`` of :func:`_encode`, values at ``idx``) or, with ``local = (all_idx,
    all_val, world_size)``, ``slimcomm.ops.step_commit_local`` (every rank's pairs).
    Per parameter ``good`` = flags finite (and nonzero under ``_KEEP_ALL_ZERO``) and the
    averaged values finite: the residual becomes ``acc`` where good and stays the old
    one elsewhere; ``G[idx]`` (shared mode) takes the averaged values (divided by the
    loss ``scale``) where good. A parameter flagged NaN on some rank comes back NaN;
    under ``_KEEP_ALL_ZERO`` one that was exactly zero on every rank comes back zero and
    keeps its residual and ``G``. The non-finite count stays on the device.

    With ``_VOID_NONFINITE_STEP`` the old ``G`` values at ``idx`` are returned by the op
    (the old residual stays in ``layout.spare``) so that
    :meth:`SlimDPCompressor._settle` can undo the whole step if any parameter of it was
    non-finite; the op ORs its own "some parameter was non-finite" into the step's flag.
    No host sync, a fixed number of ops whatever the number of parameters."""
    counter = state._dev_count(buf.device)
    residual = layout.residual
    if residual is None:
        acc = None  # no error feedback: nothing to keep
    void_policy = state._VOID_NONFINITE_STEP

    def run(prev):
        if local is not None:
            all_idx, all_val, world_size = local
            void = ops.step_commit_local(buf, all_idx, all_val, layout.offsets_tensor(),
                                         world_size, counter, acc=acc, residual=residual,
                                         keep_all_zero=state._KEEP_ALL_ZERO, void_in=prev)
            return None, void
        return ops.step_commit(buf, idx, layout.offsets_tensor(), avg, counter, G=layout.G,
                               acc=acc, residual=residual, scale=scale,
                               keep_all_zero=state._KEEP_ALL_ZERO, return_old_g=void_policy,
                               void_in=prev)

    with state._lock:  # the counter (and the step's flag) updated atomically
        if void_policy:
            old_g, void = run(state._void_flags.get(step))
            state._undo.append((layout, step, idx, old_g))
            state._void_flags[step] = void
        else:
            run(None)
    if residual is not None:
        layout.residual, layout.spare = acc, residual


def _shared(state, layout, buf, world_size, step, weight):
    since = step - state.warmup_steps
    if since % state.core_refresh == 0 or layout.core is None:
        state._refresh_core(layout, since % state.core_refresh == 0, weight)
    idx, n_explore = _select_explore(state, layout, layout.core, step)
    if state.check_agreement_every and since % state.check_agreement_every == 0:
        _check_agreement(state, layout, idx)
    scale = state._loss_scale(layout)
    wire, acc = _encode(state, layout, buf, idx, world_size, state.value_dtype or buf.dtype,
                        scale)
    k = idx.numel()
    state._count(layout.numel * buf.element_size(), wire.numel() * wire.element_size(),
                 layout.numel, k, k - n_explore, n_explore)
    fut = _comm.all_reduce(wire, state.group, timeout=state._timeout).get_future()

    def done(f):
        # f.value() raises if the collective failed: nothing is committed then
        _commit(state, layout, buf, acc, idx, f.value()[0], step, scale)
        return buf

    return fut.then(ops.run_trusted(done))


def _local(state, layout, buf, world_size, step, weight):
    scale = state._loss_scale(layout)
    acc = _accumulate(state, layout, buf, scale)
    if state.score == "grad":
        weight = acc
    elif weight is None:
        weight = state._flat_weight(layout)
    core, _ = ops.significance_topk_segmented(weight, acc, layout.offsets, layout.ks, state.score)
    idx, n_explore = _select_explore(state, layout, core, step)
    wire_dtype = state.value_dtype or buf.dtype
    wire, acc = _encode(state, layout, buf, idx, world_size, wire_dtype, scale,
                        accumulated=True)
    k = idx.numel()
    S = len(layout.numels)
    state._count(layout.numel * buf.element_size(),
                 wire.numel() * wire.element_size() + k * 8,
                 layout.numel, k, k - n_explore, n_explore)
    all_idx = torch.empty(world_size * k, dtype=torch.int64, device=idx.device)
    all_val = torch.empty(world_size * (k + S), dtype=wire_dtype, device=idx.device)
    f1 = _comm.all_gather(all_idx, idx, state.group, state._timeout).get_future()
    f2 = _comm.all_gather(all_val, wire, state.group, state._timeout).get_future()

    def done(both):
        # wait() on each all-gather: it raises if that collective failed, so a failed
        # collective never decodes its (uninitialised) receive buffers, and on CUDA it
        # makes the current stream wait for the gathered tensors. The collect_all
        # future has no CUDA events of its own and value() does not synchronise, so
        # reading all_idx / all_val without it raced with gloo's host-to-device
        # copies (replicas diverged on the H200, bench/results/gpu/...-run2).
        for f in both.value():
            f.wait()
        _commit(state, layout, buf, acc, idx, None, step, scale,
                local=(all_idx, all_val, world_size))
        return buf

    return torch.futures.collect_all([f1, f2]).then(ops.run_trusted(done))


def _index_checksums(state, layout, idx, extra=()):
    """``(max, min)`` over the ranks of int64 checksums of ``idx`` (plus the int64 0-d
    tensors ``extra``); one tiny all-reduce, counted in the stats as a check."""
    k = idx.numel()
    cached = layout._cksum.get(k)
    if cached is None:  # the position weights and k itself, fixed per layout and size
        cached = layout._cksum[k] = (torch.arange(1, k + 1, dtype=torch.int64, device=idx.device),
                                     torch.tensor(k, dtype=torch.int64, device=idx.device))
    w, kt = cached
    sums = torch.stack([idx.sum(), (idx * w).sum(), (idx * idx).sum(), kt, *extra])
    hi, lo = max_min_across_ranks(sums, state.group, state._timeout)
    state._count_check(2 * sums.numel() * sums.element_size())
    return hi, lo


def _check_agreement(state, layout, idx) -> None:
    """Checksum all-reduce (MAX of [x, -x]) of the index set and of ``G``'s bits (identical
    on every rank by construction; the weights are not compared, they may legitimately
    differ while a rank is joined); raise on every rank if they differ."""
    g_bits = layout.G.view(torch.int32)
    hi, lo = _index_checksums(state, layout, idx, [g_bits.sum(dtype=torch.int64),
                                                   g_bits[1::2].sum(dtype=torch.int64)])
    if not torch.equal(hi, lo):
        raise RuntimeError(
            f"Slim-DP index sets or G differ across ranks in {layout.label} (parameters "
            f"{layout.names}) at step {state.step}: the global gradient estimate G or the "
            f"core sets diverged between ranks (e.g. states constructed with different "
            f"arguments, or edited by hand). Restart from a checkpoint in which every rank "
            f"saved its own state."
        )


def _quantised(state, layout, buf, world_size, step, weight):
    """Low-bit values (:mod:`slimcomm.codec`) at the shared index set, all-gathered.

    Codes cannot be summed by an all-reduce, so every rank all-gathers every
    rank's payload ``[flags fp32 [S] | scales bf16 | codes packed]`` (one
    uint8 collective) and decodes and averages them in rank order: the same
    arithmetic on the same bytes, so the average is bit-identical on every
    rank. The residual keeps ``acc - decoded`` at the sent coordinates (the
    rounding error), i.e. error feedback of the quantisation too. A group of
    dense tensors sends every coordinate (no selection).
    """
    if layout.all_dense:
        if layout.core is None:
            layout.core = torch.arange(layout.numel, device=layout.device)
        idx, n_explore = layout.core, 0
    else:
        since = step - state.warmup_steps
        if since % state.core_refresh == 0 or layout.core is None:
            state._refresh_core(layout, since % state.core_refresh == 0, weight)
        idx, n_explore = _select_explore(state, layout, layout.core, step)
        idx = torch.sort(idx).values  # segment-contiguous, so the chunk plan is fixed
    if layout.plan is None:
        layout.plan = ChunkPlan([k + m for k, m in zip(layout.ks, layout.ms)],
                                state.quant_chunk, layout.device)
    bits, plan = state.value_bits, layout.plan
    scale = state._loss_scale(layout)
    k = idx.numel()
    S = len(layout.numels)
    # One fused op: acc = buf + error_decay * scale * residual (into the spare buffer),
    # [acc[idx] | flags] in fp32 (world size 1: undivided), acc[idx] = 0, acc /= scale.
    head, acc = _encode(state, layout, buf, idx, 1, torch.float32, scale)
    vals, flags = head[:k], head[k:]
    # scales, packed codes and the rounding error vals - decoded, in one op
    packed, scales, lost = plan.quantize(vals, bits)
    nsc = plan.nchunks + plan.nchunks % 2  # keep the codes 4-byte aligned
    if layout.qpad is None:  # zero padding of the payload, fixed per layout
        layout.qpad = (torch.zeros(2 * (nsc - plan.nchunks), dtype=torch.uint8, device=buf.device),
                       torch.zeros((-packed.numel()) % 4, dtype=torch.uint8, device=buf.device))
    parts = [flags.view(torch.uint8), scales.view(torch.uint8), layout.qpad[0], packed,
             layout.qpad[1]]
    wire = torch.cat(parts)
    P = wire.numel()
    state._count(layout.numel * buf.element_size(), P, layout.numel, k, k - n_explore, n_explore)
    if acc is not None:
        # what was not delivered (the rounding error) stays in the residual, unscaled
        ops.unpack(acc, idx, lost if scale is None else lost.div_(scale))
    gathered = torch.empty(world_size * P, dtype=torch.uint8, device=buf.device)
    fut = _comm.all_gather(gathered, wire, state.group, state._timeout).get_future()

    def done(f):
        f.value()  # raises if the all-gather failed: its receive buffer is never decoded
        rows = gathered.view(world_size, P)
        all_flags = rows[:, :4 * S].view(torch.float32).sum(0)
        all_scales = rows[:, 4 * S:4 * S + 2 * plan.nchunks].view(torch.bfloat16)
        # every rank's codes decoded and summed in rank order, / world size, in one op
        avg = plan.dequantize_mean(rows[:, 4 * S + 2 * nsc:], all_scales, bits, world_size)
        _commit(state, layout, buf, acc, idx, torch.cat([avg, all_flags]), step, scale)
        return buf

    return fut.then(ops.run_trusted(done))
