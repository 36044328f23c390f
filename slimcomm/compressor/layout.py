"""Where the per-parameter state lives: index-set sizes, explore RNG offsets, and the
flat per-group storage (``_Layout``), built and checked across ranks for each new group."""

import math
import zlib
from typing import Callable, List, Optional, Tuple

import torch

from ..agreement import agree_across_ranks


def selection_sizes(numel: int, core_ratio: float, explore_ratio: float,
                    min_compress_numel: int = 0) -> Tuple[int, int, bool]:
    """Core size ``k``, explore size ``m`` and the dense flag of one parameter.

    ``k = max(1, ceil(core_ratio * numel))``; ``m = max(1, ceil(explore_ratio *
    numel))`` (``m = 0`` when ``explore_ratio == 0``). The products are rounded
    to 6 decimals before the ceiling so that float noise (``0.01 * 300 =
    3.0000000000000004``) does not add an element. When ``k + m >= numel``
    the parameter is *dense*: all ``numel`` coordinates are sent and
    ``(numel, 0, True)`` is returned; so is a parameter with fewer than
    ``min_compress_numel`` elements (small tensors sent whole, as PowerSGD sends
    vectors uncompressed, Vogels et al. 2019, Sec. 4).

    Args:
        numel: number of elements of the parameter, ``>= 0``.
        core_ratio: fraction in ``(0, 1]``.
        explore_ratio: fraction in ``[0, 1]``.
        min_compress_numel: int ``>= 0``; parameters with fewer elements are dense.

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
    if isinstance(min_compress_numel, bool) or not isinstance(min_compress_numel, int) or \
            min_compress_numel < 0:
        raise ValueError(f"min_compress_numel must be an int >= 0, got {min_compress_numel!r}")
    if numel < min_compress_numel:
        return numel, 0, True
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
        "_lengths", "_wcache", "_offsets_t", "qpad", "_cksum", "shards", "server", "_every",
        "delayed", "key", "_dense_core",
    )

    def __init__(self, positions, numels, names, ratios, device, dtype, error_feedback):
        self.positions = positions
        self.key = tuple(positions)  # the layout's key in SlimDPCompressor._layouts
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
        # G is read only to select sparse coordinates: a group of dense parameters has none
        self.G = None if self.all_dense else torch.zeros(self.numel, dtype=torch.float32,
                                                         device=device)
        self.residual = torch.zeros(self.numel, dtype=torch.float32, device=device) \
            if error_feedback else None
        self.spare = None  # fp32 [N] scratch of the fused step ops, made at first use (spare_buf)
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
        self.shards = None  # reduce_scatter.ShardPlan (lowbit_collective="all_reduce" only)
        self.server = None  # fp32 [this rank's shard]: the owner's residual (idem)
        # (world_size, int64 arange(N), it repeated world_size times): the index sets of a
        # group of dense parameters in the local index mode, fixed per layout
        self._every = None
        # delay_steps=1: the step in flight or the bucket-to-be (transports/delayed.py)
        self.delayed = None
        self._dense_core = None  # (int64 [sum ks] core template, bool [sum ks] top-k slots)

    def spare_buf(self) -> torch.Tensor:
        """The fp32 ``[N]`` scratch that the fused step ops write the next residual into
        (swapped with ``residual`` after each step); made at first use, so a transport
        that never needs it (``lowbit_collective="all_reduce"``) costs no memory."""
        if self.spare is None:
            self.spare = torch.empty(self.numel, dtype=torch.float32, device=self.device)
        return self.spare

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

    def dense_core(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(template, slots)`` of a layout with dense segments, built once: int64
        ``[sum ks]`` holding every dense segment's bucket-flat indices at its place in the
        core (the rest unset), and the bool mask of the places the top-k indices of the
        other segments fill, in segment order (``template.masked_scatter(slots, idx)``
        is then the whole core in one op, whatever the number of segments)."""
        if self._dense_core is None:
            k = self.core_offsets[-1]
            template = torch.zeros(k, dtype=torch.int64, device=self.device)
            slots = torch.ones(k, dtype=torch.bool, device=self.device)
            for s, d in enumerate(self.dense):
                if d:
                    a, b = self.core_offsets[s], self.core_offsets[s + 1]
                    lo, hi = self.seg(s)
                    template[a:b] = torch.arange(lo, hi, dtype=torch.int64, device=self.device)
                    slots[a:b] = False
            self._dense_core = (template, slots)
        return self._dense_core


class _LayoutsMixin:
    """The layouts of :class:`~slimcomm.compressor.SlimDPCompressor`: one per group of
    positions, checked across ranks when new, the state of its positions moved into it."""

    __slots__ = ()

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
                (self.core_ratio, self.explore_ratio, self.min_compress_numel), dev, dtype,
                self.error_feedback,
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
        results: List[Tuple[int, int, torch.Tensor]] = []  # delay_steps=1: buckets-to-be
        for s, pos in enumerate(layout.positions):
            lo, hi = layout.seg(s)
            core = None
            if pos in self._slots:
                old, os_ = self._slots[pos]
                olo, ohi = old.seg(os_)
                if old.delayed is not None:
                    from .transports.delayed import materialize
                    materialize(self, old)  # G and the residual settled first
                    results.append((lo, hi, old.delayed[1][olo:ohi]))
                if layout.G is not None and old.G is not None:
                    layout.G[lo:hi].copy_(old.G[olo:ohi])
                if layout.residual is not None and old.residual is not None:
                    layout.residual[lo:hi].copy_(old.residual[olo:ohi])
                if old.core is not None:
                    core = old.core[old.core_offsets[os_]:old.core_offsets[os_ + 1]] - olo
            elif pos in self._loaded:
                d = self._loaded.pop(pos)
                if layout.G is not None and d.get("G") is not None:
                    layout.G[lo:hi].copy_(d["G"].reshape(-1))
                if layout.residual is not None and d.get("residual") is not None:
                    layout.residual[lo:hi].copy_(d["residual"].reshape(-1))
                core = d.get("core")
                if core is not None:
                    core = core.to(device=layout.device, dtype=torch.int64)
                if d.get("delayed_result") is not None:
                    results.append((lo, hi, d["delayed_result"].reshape(-1)))
            if core is not None and core.numel() != layout.ks[s]:
                core = None  # sizes changed (new ratios): recompute at the next sparse step
            cores.append(core)
            self._slots[pos] = (layout, s)
        if results:  # every parameter of a step in flight has one (all were synchronised)
            out = torch.zeros(layout.numel, dtype=layout.dtype, device=layout.device)
            for lo, hi, r in results:
                out[lo:hi].copy_(r)
            layout.delayed = ("result", out)
        if layout.all_dense:  # every coordinate is sent: no index set to keep (8 B/param)
            return
        if cores and all(c is not None for c in cores):
            layout.core = torch.cat([c + layout.offsets[s] for s, c in enumerate(cores)])
        elif any(c is not None for c in cores):
            layout.pending = cores
