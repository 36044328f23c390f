"""``SlimDPCompressor``: the one Slim-DP core object, assembled from the mixins of the
package's modules; holds the per-position state and sends each group to its transport."""

import threading
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .. import ops
from .checkpoint import _CheckpointMixin
from .feedback import _FeedbackMixin
from .hyperparameters import _HyperparametersMixin
from .layout import _Layout, _LayoutsMixin
from .selection import _SelectionMixin
from .stats import _StatsMixin, _new_counts, _new_stats
from .transports import _delayed, _dense, _local, _quantised, _reduce_scatter_codes, _shared

__all__ = ["SlimDPCompressor"]


class SlimDPCompressor(_HyperparametersMixin, _LayoutsMixin, _SelectionMixin, _FeedbackMixin,
                       _StatsMixin, _CheckpointMixin):
    r"""Slim-DP index sets, error feedback and per-position state for flat groups.

    Transport-agnostic core behind :class:`slimcomm.hooks.SlimDPState` (DDP
    comm hook) and :class:`slimcomm.optim.SlimDPOptimizer` (optimizer-side
    sync); see :mod:`slimcomm.compressor` for the algorithm. Users normally build
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
    all-reduce of 8 int64 per group; 0 = never), ``value_bits`` (``None`` or
    1/2/4/8: per-chunk scaled codes of :mod:`slimcomm.codec`), ``quant_chunk``
    (values per code chunk), ``lowbit_collective`` (how codes of a group of
    dense parameters travel: ``"all_gather"``, every rank's codes to every
    rank, bytes per rank growing with the world size; or ``"all_reduce"``,
    the two-stage all-reduce of :mod:`.transports.reduce_scatter`, ``2 (W-1)/W``
    x one rank's code size per rank at any world size, with an owner-side
    residual; used when ``core_ratio == 1``, every tensor sent densely;
    otherwise codes at sparse index sets are all-gathered), ``delay_steps`` (0 or 1; 1
    only in the DDP hook, :class:`slimcomm.hooks.SlimDPState`: each step's all-reduce is
    applied one step later, overlapping the next step's computation; see
    :mod:`.transports.delayed`), ``allreduce_algorithm`` (how the values at a shared
    index set are summed: ``"backend"``, the process group's ``all_reduce`` (gloo: a ring,
    ``2 (W-1)`` hops of latency); ``"two_shot"``, two direct all-to-all exchanges of the
    same bytes (2 hops; :func:`slimcomm._comm.two_shot_all_reduce`)),
    ``min_compress_numel`` (int >= 0, default 0: a parameter with fewer elements is sent
    whole, dense, inside the same packed buffer; the DDP hook's default is 2048).

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

    __slots__ = [
        # hyperparameters (read through the _Frozen descriptors of _HyperparametersMixin)
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
        "_hp_lowbit_collective",
        "_hp_delay_steps",
        "_hp_allreduce_algorithm",
        "_hp_min_compress_numel",
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
        "_sink_counts",    # device -> int64 [2]: counts written and never read (_sink_count)
        "_void_flags",     # step -> bool 0-d device tensor: some parameter was non-finite
        "_timeout",        # seconds each collective may wait (None: the process group's)
        "_server_loaded",  # positions -> owner-side residual from load_state_dict, not yet placed
    ]

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
        lowbit_collective: str = "all_gather",
        delay_steps: int = 0,
        allreduce_algorithm: str = "backend",
        min_compress_numel: int = 0,
    ):
        self._check_hyperparameters(process_group, core_ratio, explore_ratio, core_refresh,
                                    warmup_steps, score, index_mode, error_feedback,
                                    error_decay, value_dtype, seed, check_agreement_every,
                                    value_bits, quant_chunk, lowbit_collective, delay_steps,
                                    allreduce_algorithm, min_compress_numel)
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
        self._hp_lowbit_collective = lowbit_collective
        self._hp_delay_steps = delay_steps
        self._hp_allreduce_algorithm = allreduce_algorithm
        self._hp_min_compress_numel = min_compress_numel
        self._server_loaded: Dict[Tuple[int, ...], torch.Tensor] = {}
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
        self._sink_counts: Dict[torch.device, torch.Tensor] = {}
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

    # ------------------------------------------------------------ synchronisation
    @property
    def group(self):
        """The process group values are reduced over (the default group if ``None``)."""
        return self.process_group if self.process_group is not None else dist.group.WORLD

    def synchronize(self, layout: _Layout, buf: torch.Tensor,
                    weight: Optional[torch.Tensor] = None,
                    warmup_dtype: Optional[torch.dtype] = None,
                    deferred: bool = False) -> torch.futures.Future:
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
                bf16 when ``value_dtype`` is bf16, else ``buf``'s dtype,
                bit-identical to a plain averaged all-reduce: fp16 has too
                little range for raw or loss-scaled gradients).
            deferred: only for the two-stage low-bit all-reduce: the future then
                holds ``decode(out)`` instead of ``buf`` (``buf`` is free again
                when this call returns); other transports ignore it.

        Returns:
            a future of ``buf`` holding, when it completes: the dense average
            during warm-up and for groups of dense parameters only (in
            ``"local"`` mode the all-gathered values of every rank summed in
            fp32 in rank order, as in any group, so a dense parameter's
            average does not depend on its group); otherwise
            zeros except the averaged values at the group's index set. A
            parameter whose values held NaN/inf on any rank comes back filled
            with NaN on every rank, and its residual and ``G`` are not updated.

        One collective per call (in ``"local"`` mode all-gathers: two, one for
        a group of dense parameters only, whose indices are known), issued
        from the calling thread; the caller closes the step with
        :meth:`end_step` after the last group.
        """
        world_size = dist.get_world_size(self.group)
        step = self.step
        if step < self.warmup_steps:
            # bf16 has fp32's range; an fp16 wire would overflow on raw (or loss-scaled)
            # gradients without the compressed path's saturation, so it warms up exactly
            wire = self.value_dtype if self.value_dtype == torch.bfloat16 else None
            return _dense(self, layout, buf, world_size, warmup_dtype or wire or buf.dtype)
        with ops.trusted_indices():  # our own index sets: no host sync for CUDA value checks
            if self.delay_steps:
                return _delayed(self, layout, buf, world_size, step, weight)
            if self.value_bits is not None:
                # only when every tensor is dense in every grouping (core_ratio 1): a dense
                # tensor beside sparse ones is all-gathered, so the path must not depend on
                # the grouping (layout invariance)
                if self.lowbit_collective == "all_reduce" and self.core_ratio >= 1.0:
                    return _reduce_scatter_codes(self, layout, buf, world_size, step, deferred)
                return _quantised(self, layout, buf, world_size, step, weight)
            if self.index_mode == "local":
                # dense parameters too: averaged by the local scatter-add whatever group
                # they are in (the dense all-reduce would round differently)
                return _local(self, layout, buf, world_size, step, weight)
            if layout.all_dense:
                return _dense(self, layout, buf, world_size, self.value_dtype or buf.dtype)
            return _shared(self, layout, buf, world_size, step, weight)
