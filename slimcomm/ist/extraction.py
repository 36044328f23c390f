"""Model analysis and the subnet itself: which tensors of the MLP are sliced and how
(:class:`InputScale`, the plan), the checks of a partition against a model,
:func:`extract_subnet` (cut rank ``r``'s subnet out of the full model) and
:func:`write_back` (put it back), with :func:`slimcomm.ops.gather_slices` /
:func:`slimcomm.ops.scatter_slices`."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .. import ops
from .partition import _check_int

_ACTIVATIONS = (nn.ReLU, nn.GELU, nn.Tanh, nn.SiLU, nn.LeakyReLU)
_STATELESS = _ACTIVATIONS + (nn.Dropout,)
_NORMS = (nn.BatchNorm1d, nn.LayerNorm)
SUPPORTED_MODULES = (nn.Linear,) + _STATELESS + _NORMS
"""Module types (matched exactly) that IST can partition."""

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# ---------------------------------------------------------------------------
# Model analysis: which tensors are sliced, and how
# ---------------------------------------------------------------------------

class InputScale(nn.Module):
    """Multiply the input by a constant: ``y = x * factor``.

    :func:`extract_subnet` puts one in front of every hidden and output Linear
    of a subnet when ``rescale=True`` (``factor = world_size``); see the module
    docstring, "Pre-activation scaling". :func:`write_back` skips them.
    With shared neurons (:func:`partition`, ``shared > 0``) the factor is
    per feature: ``scale`` is a ``[in_features]`` tensor (a non-persistent
    buffer) holding 1 for the shared neurons and ``world_size`` for the
    rank's own, and ``factor`` is ``None``.
    """

    def __init__(self, factor: "float | torch.Tensor"):
        super().__init__()
        if isinstance(factor, torch.Tensor):
            self.factor = None
            self.register_buffer("scale", factor.detach().clone(), persistent=False)
        else:
            self.factor = float(factor)
            self.scale = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * (self.factor if self.scale is None else self.scale)

    def extra_repr(self) -> str:
        if self.scale is None:
            return f"factor={self.factor}"
        return f"per-feature scale [{self.scale.numel()}]"


@dataclass(frozen=True)
class _Slice:
    module: int               # index of the module in the nn.Sequential
    name: str                 # attribute: weight, bias, running_mean, running_var
    row_layer: Optional[int]  # hidden layer whose block selects rows; None = all
    col_layer: Optional[int]  # hidden layer whose block selects columns; None = all


@dataclass
class _Plan:
    linears: List[int]              # module index of each Linear
    hidden_sizes: List[int]
    slices: List[_Slice]            # tensors sliced with the neurons
    shared: List[Tuple[int, str]]   # tensors every subnet holds whole (averaged)
    counters: List[int]             # BatchNorm1d modules with num_batches_tracked
    dtype: torch.dtype
    device: torch.device
    descriptor: str                 # architecture description, for fingerprints


def _describe(m: nn.Module) -> str:
    if type(m) is nn.Linear:
        return f"Linear({m.in_features},{m.out_features},bias={m.bias is not None})"
    if type(m) is nn.BatchNorm1d:
        return (f"BatchNorm1d({m.num_features},eps={m.eps!r},momentum={m.momentum!r},"
                f"affine={m.affine},bias={m.bias is not None},track={m.track_running_stats})")
    if type(m) is nn.LayerNorm:
        return (f"LayerNorm({tuple(m.normalized_shape)},eps={m.eps!r},"
                f"weight={m.weight is not None},bias={m.bias is not None})")
    return repr(m)


def _build_plan(model: nn.Module) -> _Plan:
    """Validate ``model`` for IST and list the tensors to slice.

    Raises TypeError (unsupported container/module, dtype) or ValueError
    (structure: too few Linear layers, mismatched widths, a norm layer outside
    the hidden layers, mixed dtypes/devices).
    """
    if type(model) is not nn.Sequential:
        raise TypeError(
            "model must be an nn.Sequential of "
            f"{', '.join(t.__name__ for t in SUPPORTED_MODULES)}; "
            f"got {type(model).__name__}"
        )
    linears: List[int] = []
    norms: List[Tuple[int, int]] = []   # (module index, hidden layer index)
    for i, m in enumerate(model):
        t = type(m)
        if t is nn.Linear:
            if linears:
                prev = model[linears[-1]]
                if m.in_features != prev.out_features:
                    raise ValueError(
                        f"model[{i}] (Linear) has in_features={m.in_features} but the previous "
                        f"Linear model[{linears[-1]}] has out_features={prev.out_features}"
                    )
            linears.append(i)
        elif t in _NORMS:
            if not linears:
                raise ValueError(
                    f"model[{i}] ({t.__name__}) comes before the first Linear: IST partitions "
                    f"only hidden neurons, so a norm layer must sit between two Linear layers"
                )
            norms.append((i, len(linears) - 1))
        elif t not in _STATELESS:
            raise TypeError(
                f"unsupported module model[{i}] ({t.__name__}) for IST; supported: "
                f"{', '.join(s.__name__ for s in SUPPORTED_MODULES)}"
            )
    if len(linears) < 2:
        raise ValueError(
            f"model has {len(linears)} Linear layer(s); IST needs at least 2 "
            f"(at least one hidden layer to partition)"
        )
    n_hidden = len(linears) - 1
    hidden_sizes = [model[i].out_features for i in linears[:-1]]

    slices: List[_Slice] = []
    for j, i in enumerate(linears):
        rows = j if j < n_hidden else None
        cols = j - 1 if j > 0 else None
        slices.append(_Slice(i, "weight", rows, cols))
        if model[i].bias is not None and j < n_hidden:
            slices.append(_Slice(i, "bias", j, None))
    shared: List[Tuple[int, str]] = []
    if model[linears[-1]].bias is not None:
        shared.append((linears[-1], "bias"))
    counters: List[int] = []
    for i, layer in norms:
        m = model[i]
        name = type(m).__name__
        if layer >= n_hidden:
            raise ValueError(
                f"model[{i}] ({name}) acts on the output of the last Linear: IST partitions "
                f"only hidden neurons, so a norm layer must sit between two Linear layers"
            )
        width = hidden_sizes[layer]
        if type(m) is nn.BatchNorm1d:
            if m.num_features != width:
                raise ValueError(
                    f"model[{i}] (BatchNorm1d) has num_features={m.num_features} but hidden "
                    f"layer {layer} has {width} neurons"
                )
            for attr in ("weight", "bias", "running_mean", "running_var"):
                if getattr(m, attr) is not None:
                    slices.append(_Slice(i, attr, layer, None))
            if m.num_batches_tracked is not None:
                counters.append(i)
        else:
            if tuple(m.normalized_shape) != (width,):
                raise ValueError(
                    f"model[{i}] (LayerNorm) has normalized_shape={tuple(m.normalized_shape)} "
                    f"but hidden layer {layer} has {width} neurons; only LayerNorm over the "
                    f"feature dimension is supported"
                )
            for attr in ("weight", "bias"):
                if getattr(m, attr) is not None:
                    slices.append(_Slice(i, attr, layer, None))

    dtype = model[linears[0]].weight.dtype
    device = model[linears[0]].weight.device
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if not t.is_floating_point():
            continue
        if t.dtype not in _DTYPES:
            raise TypeError(
                f"model parameter/buffer {name!r} has dtype {t.dtype}; IST supports "
                f"float32, float16 and bfloat16"
            )
        if t.dtype != dtype:
            raise ValueError(
                f"model parameter/buffer {name!r} has dtype {t.dtype} but the first Linear "
                f"has {dtype}; all floating tensors must share one dtype"
            )
        if t.device != device:
            raise ValueError(
                f"model parameter/buffer {name!r} is on {t.device} but the first Linear is "
                f"on {device}; all tensors must be on one device"
            )
    descriptor = ";".join(_describe(m) for m in model)
    descriptor += f"|dtype={dtype}|device={device.type}"
    descriptor += "|grad=" + "".join("1" if p.requires_grad else "0" for p in model.parameters())
    return _Plan(linears, hidden_sizes, slices, shared, counters, dtype, device, descriptor)


def _grad_exponents(plan: _Plan) -> List[int]:
    """Sliced dimensions ``k`` of every payload tensor (plan.slices, then shared):
    its subnet gradient is scaled by ``world_size ** -k`` (module docstring,
    "Gradient scaling")."""
    return ([(s.row_layer is not None) + (s.col_layer is not None) for s in plan.slices]
            + [0] * len(plan.shared))


def _check_shared(plan: _Plan, shared: Any) -> List[int]:
    """``shared`` (None or one int per hidden layer) as a list of ints."""
    if shared is None:
        return [0] * len(plan.hidden_sizes)
    if not isinstance(shared, Sequence) or len(shared) != len(plan.hidden_sizes):
        raise ValueError(f"shared must hold one count per hidden layer ({len(plan.hidden_sizes)}), "
                         f"got {shared!r}")
    return [_check_int(m, f"shared[{l}]", 0) for l, m in enumerate(shared)]


def _check_blocks(plan: _Plan, blocks: Any, rank: Any, shared: Optional[Sequence[int]] = None) -> int:
    """Validate ``blocks`` against the model and ``rank``; return world_size.

    With ``shared`` (``m_l`` per hidden layer, see :func:`partition`): every
    block of layer ``l`` starts with the same ``m_l`` indices, and those with
    the rest of every block form a partition of the layer's neurons."""
    counts = _check_shared(plan, shared)
    if not isinstance(blocks, Sequence) or len(blocks) != len(plan.hidden_sizes):
        n = len(blocks) if isinstance(blocks, Sequence) else type(blocks).__name__
        raise ValueError(
            f"blocks must hold one list per hidden layer ({len(plan.hidden_sizes)}), got {n}"
        )
    world_size = len(blocks[0]) if isinstance(blocks[0], Sequence) else -1
    for l, layer in enumerate(blocks):
        if not isinstance(layer, Sequence) or len(layer) != world_size or world_size < 1:
            raise ValueError(
                f"blocks[{l}] must be a list of one index tensor per rank "
                f"(world_size = {world_size} from blocks[0])"
            )
        for r, b in enumerate(layer):
            if not isinstance(b, torch.Tensor) or b.dtype != torch.int64 or b.dim() != 1:
                raise ValueError(f"blocks[{l}][{r}] must be a 1-D int64 tensor")
        m = counts[l]
        parts = list(layer)
        if m:
            head = layer[0][:m].detach().cpu()
            if any(b.numel() < m or not torch.equal(b[:m].detach().cpu(), head) for b in layer):
                raise ValueError(
                    f"blocks[{l}]: every rank's block must start with the same {m} shared neurons")
            parts = [layer[0][:m]] + [b[m:] for b in layer]
        total = sum(b.numel() for b in parts)
        if total != plan.hidden_sizes[l]:
            raise ValueError(
                f"blocks[{l}] holds {total} indices but hidden layer {l} has "
                f"{plan.hidden_sizes[l]} neurons"
            )
        n = plan.hidden_sizes[l]
        every = torch.cat([b.detach().reshape(-1).cpu() for b in parts])
        lo, hi = (int(v) for v in torch.aminmax(every)) if n else (0, -1)
        if lo < 0 or hi >= n or (n and int(torch.bincount(every, minlength=n).max()) != 1):
            bad = f"index {hi if hi >= n else lo} outside [0, {n})" if lo < 0 or hi >= n \
                else "an index in two blocks or twice in one"
            raise ValueError(
                f"blocks[{l}] is not a partition of the {n} neurons of hidden layer {l}: "
                f"{bad} (every neuron must be in exactly one rank's block)"
            )
    _check_int(rank, "rank", 0)
    if rank >= world_size:
        raise ValueError(f"rank must be < world_size = {world_size}, got {rank}")
    return world_size


def _rank_indices(
    plan: _Plan, blocks: Sequence[Sequence[torch.Tensor]], rank: int
) -> Tuple[List[Optional[torch.Tensor]], List[Optional[torch.Tensor]]]:
    """rows/cols index tensors (on the model's device) of every sliced tensor."""
    on_dev = [layer[rank].to(plan.device) for layer in blocks]
    rows = [None if s.row_layer is None else on_dev[s.row_layer] for s in plan.slices]
    cols = [None if s.col_layer is None else on_dev[s.col_layer] for s in plan.slices]
    return rows, cols


def _strip_scales(subnet: nn.Module, model: nn.Sequential) -> List[nn.Module]:
    if not isinstance(subnet, nn.Sequential):
        raise TypeError(f"subnet must be an nn.Sequential, got {type(subnet).__name__}")
    mods = [m for m in subnet if type(m) is not InputScale]
    if len(mods) != len(model) or any(type(a) is not type(b) for a, b in zip(mods, model)):
        raise ValueError(
            "subnet does not match model: expected the model's modules in order "
            f"({', '.join(type(m).__name__ for m in model)}), possibly with InputScale "
            f"modules, got ({', '.join(type(m).__name__ for m in subnet)})"
        )
    return mods


# ---------------------------------------------------------------------------
# Subnet extraction / write-back
# ---------------------------------------------------------------------------

def _param(src: nn.Parameter, value: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(value, requires_grad=src.requires_grad)


def extract_subnet(
    model: nn.Sequential,
    blocks: Sequence[Sequence[torch.Tensor]],
    rank: int,
    *,
    rescale: bool = True,
    shared: Optional[Sequence[int]] = None,
) -> nn.Sequential:
    """Rank ``rank``'s subnet of ``model`` under the partition ``blocks``.

    IST (arXiv 1910.02120, Sec. 3): the subnet has the full model's depth and
    the neurons of the rank's block in every hidden layer; see the module
    docstring for the slicing rules and the scaling. Sliced tensors are copied
    with :func:`slimcomm.ops.gather_slices`; the shared output bias and
    ``num_batches_tracked`` are cloned. The subnet owns its tensors (training
    it leaves ``model`` untouched), its modules are created without drawing
    from any random generator, and it is in ``model``'s train/eval mode.

    Args:
        model: ``nn.Sequential`` MLP as described in the module docstring.
        blocks: a partition as returned by :func:`partition` for the model's
            hidden sizes: ``blocks[l][r]`` int64 ``[|b_l^r|]``, sorted ascending
            (any order works; ascending is faster).
        rank: which block to take, ``0 <= rank < world_size = len(blocks[0])``.
        rescale: put an :class:`InputScale` (``world_size``) in front of every
            hidden and output Linear (default; nothing is inserted when
            ``world_size == 1``).
        shared: ``m_l`` per hidden layer when the blocks overlap in shared
            neurons (``shared_counts``; ``partition(..., shared=f)``): the
            first ``m_l`` entries of every block; their inputs are scaled by
            1, the rank's own by ``world_size`` (each own neuron is in the
            rank's block with probability ``1/world_size``, a shared one
            always). ``None`` = no shared neurons.

    Returns:
        ``nn.Sequential``: the model's modules in order, Linear/norm layers
        narrowed to the block, with :class:`InputScale` modules inserted when
        ``rescale``; parameters in the model's dtype and device, with the same
        ``requires_grad`` flags.

    Raises:
        TypeError: unsupported container, module type or dtype (the message
            names the module).
        ValueError: inconsistent model structure, ``blocks`` not a partition
            of the hidden neurons (wrong count, an index out of range, in two
            blocks or twice in one), ``rank`` out of range.
        RuntimeError: from the slicing kernels (index out of range).
    """
    plan = _build_plan(model)
    world_size = _check_blocks(plan, blocks, rank, shared)
    counts = _check_shared(plan, shared)
    if not isinstance(rescale, bool):
        raise TypeError(f"rescale must be a bool, got {type(rescale).__name__}")
    rows, cols = _rank_indices(plan, blocks, rank)
    sliced: Dict[Tuple[int, str], torch.Tensor] = {}
    with torch.no_grad():
        for s, r, c in zip(plan.slices, rows, cols):
            sliced[(s.module, s.name)] = ops.gather_slices(getattr(model[s.module], s.name), r, c)
    width = [len(layer[rank]) for layer in blocks]
    n_hidden = len(plan.hidden_sizes)
    kw = dict(device="meta", dtype=plan.dtype)

    out: List[nn.Module] = []
    layer = -1
    for i, m in enumerate(model):
        t = type(m)
        if t is nn.Linear:
            layer += 1
            in_f = m.in_features if layer == 0 else width[layer - 1]
            out_f = m.out_features if layer == n_hidden else width[layer]
            if layer > 0 and rescale and world_size > 1:
                m_in = counts[layer - 1]
                if m_in:
                    vec = torch.full((in_f,), float(world_size), dtype=plan.dtype, device=plan.device)
                    vec[:m_in] = 1.0
                    out.append(InputScale(vec))
                else:
                    out.append(InputScale(world_size))
            sub = nn.Linear(in_f, out_f, bias=m.bias is not None, **kw)
            sub.weight = _param(m.weight, sliced[(i, "weight")])
            if m.bias is not None:
                bias = sliced.get((i, "bias"))
                sub.bias = _param(m.bias, m.bias.detach().clone() if bias is None else bias)
        elif t is nn.BatchNorm1d:
            # Recent torch has BatchNorm1d(..., bias=False); pass it only when needed.
            extra = {"bias": False} if m.affine and m.bias is None else {}
            sub = nn.BatchNorm1d(width[layer], eps=m.eps, momentum=m.momentum, affine=m.affine,
                                 track_running_stats=m.track_running_stats, **kw, **extra)
            if m.weight is not None:
                sub.weight = _param(m.weight, sliced[(i, "weight")])
            if m.bias is not None:
                sub.bias = _param(m.bias, sliced[(i, "bias")])
            if m.track_running_stats:
                sub.running_mean = sliced[(i, "running_mean")]
                sub.running_var = sliced[(i, "running_var")]
                sub.num_batches_tracked = m.num_batches_tracked.detach().clone()
        elif t is nn.LayerNorm:
            sub = nn.LayerNorm(width[layer], eps=m.eps, elementwise_affine=m.weight is not None,
                               bias=m.bias is not None, **kw)
            if m.weight is not None:
                sub.weight = _param(m.weight, sliced[(i, "weight")])
            if m.bias is not None:
                sub.bias = _param(m.bias, sliced[(i, "bias")])
        else:
            sub = copy.deepcopy(m)
        out.append(sub)
    subnet = nn.Sequential(*out)
    subnet.train(model.training)
    return subnet


def write_back(
    model: nn.Sequential,
    subnet: nn.Sequential,
    blocks: Sequence[Sequence[torch.Tensor]],
    rank: int,
    *,
    shared: Optional[Sequence[int]] = None,
) -> None:
    """Write rank ``rank``'s (trained) subnet back into ``model``, in place.

    The inverse of :func:`extract_subnet` (IST, arXiv 1910.02120, Sec. 3):
    every sliced tensor goes back with :func:`slimcomm.ops.scatter_slices`;
    the output bias (shared) and ``num_batches_tracked`` are copied whole.
    Entries of ``model`` outside the rank's slices are not touched, so
    ``write_back(model, extract_subnet(model, blocks, r), blocks, r)`` leaves
    ``model`` bit-identical. (:class:`ISTTrainer` averages the shared output
    bias over the ranks instead of copying one rank's.)

    Args:
        model: the full model the subnet was extracted from.
        subnet: as returned by :func:`extract_subnet` for the same ``blocks``
            and ``rank`` (with or without :class:`InputScale` modules).
        blocks, rank, shared: as in :func:`extract_subnet` (shared neurons
            are written like the rest; :class:`ISTTrainer` averages them).

    Raises:
        TypeError / ValueError: as :func:`extract_subnet`, or ``subnet`` whose
            modules or tensor shapes do not match the model and the block
            (checked before anything is written).
        RuntimeError: from the slicing kernels.
    """
    plan = _build_plan(model)
    _check_blocks(plan, blocks, rank, shared)
    mods = _strip_scales(subnet, model)
    rows, cols = _rank_indices(plan, blocks, rank)
    pairs = []
    for s, r, c in zip(plan.slices, rows, cols):
        full = getattr(model[s.module], s.name)
        part = getattr(mods[s.module], s.name, None)
        nr = full.shape[0] if r is None else r.numel()
        shape = (nr,) if full.dim() == 1 else (nr, full.shape[1] if c is None else c.numel())
        if not isinstance(part, torch.Tensor) or tuple(part.shape) != shape:
            got = None if not isinstance(part, torch.Tensor) else tuple(part.shape)
            raise ValueError(
                f"subnet's {type(model[s.module]).__name__} (model[{s.module}]).{s.name} has "
                f"shape {got}, expected {shape} for rank {rank}'s block"
            )
        pairs.append((full, r, c, part))
    for i, name in plan.shared:
        part = getattr(mods[i], name, None)
        full = getattr(model[i], name)
        if not isinstance(part, torch.Tensor) or part.shape != full.shape:
            raise ValueError(f"subnet's model[{i}].{name} does not have shape {tuple(full.shape)}")
    with torch.no_grad():
        for full, r, c, part in pairs:
            ops.scatter_slices(full, r, c, part.detach())
        for i, name in plan.shared:
            getattr(model[i], name).copy_(getattr(mods[i], name))
        for i in plan.counters:
            model[i].num_batches_tracked.copy_(mods[i].num_batches_tracked)
