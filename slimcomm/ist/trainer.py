"""Independent subnet training (IST) for fully connected networks.

IST (Yuan, Wolfe, Dun, Tang, Kyrillidis, Jermaine, "Distributed Learning of
Fully Connected Neural Networks using Independent Subnet Training",
arXiv 1910.02120, PVLDB 15(8) 2022) decomposes an MLP into ``world_size``
narrow subnets of the same depth by partitioning the neurons of every hidden
layer. Each rank trains its subnet for ``local_steps`` steps on its own data
with no communication, then the trained slices are written back into the full
model and a new random partition is drawn (Sec. 3 of the paper).

This module provides the three pieces:

* :func:`partition` draws the per-round partition of the hidden neurons, a
  pure function of ``(hidden_sizes, world_size, seed, round)`` so that every
  rank computes the same blocks without communicating.
* :func:`extract_subnet` / :func:`write_back` cut rank ``r``'s subnet out of
  the full model and put it back, with the slicing kernels
  :func:`slimcomm.ops.gather_slices` / :func:`slimcomm.ops.scatter_slices`.
* :class:`ISTTrainer` runs the local steps and the synchronisation round, in
  which every rank's trained slices travel in ONE ``all_gather`` of packed
  buffers (:func:`slimcomm.ops.gather_slices_multi` /
  :func:`slimcomm.ops.scatter_slices_multi`).

Supported models
----------------
An ``nn.Sequential`` of ``nn.Linear`` (at least two), the activations
``nn.ReLU``, ``nn.GELU``, ``nn.Tanh``, ``nn.SiLU``, ``nn.LeakyReLU``,
``nn.Dropout``, and ``nn.BatchNorm1d`` / ``nn.LayerNorm`` acting on a hidden
layer (between two Linear layers). Inputs are ``[batch, features]``. All
floating parameters and buffers share one dtype (fp32, fp16 or bf16) and one
device. Module types are matched exactly (a subclass of ``nn.Linear`` may
change the computation, so it is rejected); anything else raises a
``TypeError`` naming the module.

Slicing rules (hidden layer ``l`` = output of the ``l``-th Linear, ``b_l`` =
rank ``r``'s block of it, ``L`` = number of hidden layers):

* first Linear: ``W[b_0, :]``, ``bias[b_0]`` (all inputs);
* hidden Linear ``l`` (``0 < l < L``): ``W[b_l, b_{l-1}]``, ``bias[b_l]``;
* last Linear: ``W[:, b_{L-1}]`` (all outputs); its bias is *shared* by all
  subnets and averaged over the ranks at synchronisation;
* ``BatchNorm1d`` (weight, bias, running_mean, running_var) and ``LayerNorm``
  (weight, bias) on hidden layer ``l``: ``[b_l]``. ``num_batches_tracked`` is
  a per-layer counter, copied whole.

Pre-activation scaling
----------------------
In the subnet, a neuron of hidden layer ``l > 0`` (or of the output) sums over
only the ``|b_{l-1}| ~ n_{l-1} / world_size`` neurons of the previous layer
that are in the rank's block, so its pre-activation is on average
``1/world_size`` of the full model's. With ``rescale=True`` (the default) the
subnet multiplies the input of every hidden and output Linear by
``world_size`` (an :class:`InputScale` module in front of it), the
inverted-dropout convention (Srivastava et al., JMLR 2014) with keep
probability ``1/world_size``: since every neuron lands in the block with
probability ``1/world_size``, the subnet's pre-activations are unbiased
estimates of the full model's, and the full model is evaluated as is, with no
rescaling. With ``rescale=False`` the subnet computes the plain partial sum;
the full model then sums ``world_size`` such partial sums and its hidden and
output pre-activations are about ``world_size`` times those seen in training.
For a bias-light ReLU network this barely changes the arg-max (ReLU is
positively homogeneous), so accuracy alone hides it, but the logits, and hence
the loss and any Tanh/GELU/norm layer downstream, are off by up to
``world_size ** depth``.
``LayerNorm`` in a subnet normalises over the neurons of the block (the subnet
is a narrower network of its own).

Gradient scaling (one learning rate for every world size)
---------------------------------------------------------
The input scaling makes the subnet's forward pass an unbiased estimate of the
full model's, but not its gradients: a neuron of a hidden layer feeds the next
layer with ``world_size`` times the full model's weight, so the loss's
derivative with respect to it (and to every weight or bias that feeds it) is
``world_size`` times the full model's, and a weight between two hidden layers
also sees a ``world_size``-times larger input. Per tensor, the subnet's
gradient is about ``world_size ** k`` times the full model's, where ``k`` is
the number of the tensor's dimensions that are sliced (1 for the first and
last Linear's weights, hidden biases and norm parameters, 2 for a weight
between two hidden layers, 0 for the shared output bias). Summed over the
subnet's ``1/world_size ** k`` share of each tensor, the tangent kernel of
the subnet (the change of its outputs per unit of SGD learning rate) is then
``world_size`` (first/last layer) to ``world_size ** 2`` (hidden-to-hidden)
times the full model's, so plain SGD on the subnet is stable only at a
learning rate that shrinks with the world size (measured on the
Fashion-MNIST MLP: lr 0.05, stable at 1 and 2 ranks, gives NaN at 4 and 8).
With ``scale_grads=True`` (the :class:`ISTTrainer` default) every sliced
tensor's gradient is multiplied by ``world_size ** -k``, i.e. by the share of
the tensor the subnet holds, before the optimizer sees it. Then one SGD step
of the subnet changes its outputs as much as one SGD step of the full model
would (per layer, to first order), and after the write-back the full model
follows data-parallel SGD at the same learning rate in expectation, except
that the hidden-to-hidden weights between different ranks' blocks are not
trained in the round. This is the IST theory paper's view of IST as gradient
steps taken at a sketched point (Shulgin and Richtarik, arXiv 2306.16484:
permutation sketches ``C = world_size * P`` applied to the model): keeping
the sketch's scale in the forward pass and dropping it from the update is
what makes the admissible step size independent of ``world_size``. Adam-type
optimizers normalise the gradient, so for them the scaling changes nothing
but the role of ``eps`` (their function step is already independent of the
world size); it is there for SGD. Without ``rescale`` there is no input
scale, the subnet's gradients are not inflated, and nothing is scaled.
With shared neurons (``partition(..., shared=f)``) the scale is per neuron,
``c = 1`` for a shared neuron and ``world_size`` for a rank's own, and the
gradient of a weight ``(i, j)`` is multiplied by ``1 / (c_i * c_j)`` (an
unsliced dimension counts as ``c = 1``): the same rule, entry by entry.

Shared neurons (overlapping subnets)
------------------------------------
At 8 ranks a 1/8-wide subnet is the full model under a dropout with keep
probability 1/8; the Fashion-MNIST MLP then plateaus near 0.80-0.82 test
accuracy (``bench/results/ist_scaling/``). With ``ISTTrainer(shared=f)``
a fraction ``f`` of every hidden layer's neurons (re-drawn every round) is in
every subnet and the rest is partitioned. The weights among shared neurons
(and their biases and norm parameters) are trained by every rank; at the
synchronisation they are averaged over the ranks (one extra ``all_reduce``
of that region, in fp32), the rest is written back as before. A subnet is
``f + (1 - f) / world_size`` of each hidden layer wide, which costs compute
and bytes (the all-reduce of the shared region) in exchange for accuracy.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

import contextlib

from .. import _comm, ops
from .._comm import CollectiveError
from ..agreement import agree_across_ranks, gather_across_ranks

__all__ = [
    "SUPPORTED_MODULES",
    "partition",
    "shared_counts",
    "extract_subnet",
    "write_back",
    "InputScale",
    "ISTStats",
    "ISTTrainer",
    "CollectiveError",
]

_ACTIVATIONS = (nn.ReLU, nn.GELU, nn.Tanh, nn.SiLU, nn.LeakyReLU)
_STATELESS = _ACTIVATIONS + (nn.Dropout,)
_NORMS = (nn.BatchNorm1d, nn.LayerNorm)
SUPPORTED_MODULES = (nn.Linear,) + _STATELESS + _NORMS
"""Module types (matched exactly) that IST can partition."""

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MASK64 = (1 << 64) - 1


# ---------------------------------------------------------------------------
# Partition
# ---------------------------------------------------------------------------

def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _layer_seed(seed: int, round: int, layer: int) -> int:
    """64-bit generator seed for one (seed, round, layer), well mixed."""
    h = _splitmix64(seed & _MASK64)
    h = _splitmix64(h ^ (round & _MASK64))
    return _splitmix64(h ^ layer)


def _check_int(value: Any, name: str, minimum: Optional[int] = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def shared_counts(hidden_sizes: Sequence[int], world_size: int, shared: float) -> List[int]:
    """Shared neurons ``m_l`` per hidden layer for a shared fraction (see :func:`partition`).

    ``m_l = floor(shared * n_l)``, lowered so that every rank keeps at least one
    neuron of its own (``n_l - m_l >= world_size``); 0 at world size 1.

    Raises:
        ValueError: ``shared`` outside ``[0, 1)``.
    """
    if isinstance(shared, bool) or not isinstance(shared, (int, float)) or not 0.0 <= shared < 1.0:
        raise ValueError(f"shared must be a fraction in [0, 1), got {shared!r}")
    if world_size == 1:
        return [0] * len(hidden_sizes)
    return [max(0, min(int(shared * n), n - world_size)) for n in hidden_sizes]


def partition(
    hidden_sizes: Sequence[int], world_size: int, seed: int, round: int, *, shared: float = 0.0
) -> List[List[torch.Tensor]]:
    """Random partition of every hidden layer's neurons into ``world_size`` blocks.

    IST (arXiv 1910.02120, Sec. 3): each synchronisation round draws a fresh
    random partition of each hidden layer's neurons, one block per worker.
    Layer ``l``'s neurons are permuted by ``torch.randperm`` with a private
    ``torch.Generator`` seeded from ``(seed, round, l)`` (never the global RNG),
    and the permutation is cut into ``world_size`` consecutive chunks. The
    result is a pure function of the arguments, identical on every process.

    Shared neurons (``shared > 0``): the first ``m_l`` neurons of the
    permutation (:func:`shared_counts`) are in EVERY rank's block, and only
    the other ``n_l - m_l`` are cut into ``world_size`` chunks; every subnet
    is then ``m_l + (n_l - m_l) / world_size`` wide instead of
    ``n_l / world_size``, so that it is less of a heavy dropout of the full
    model (keep probability ``1/world_size``) as the world size grows (an
    overlapping partition, as the issue 24 measurements chose; the weights
    among shared neurons are trained by every rank and averaged).

    Args:
        hidden_sizes: widths ``n_l`` of the hidden layers, each an int
            ``>= world_size``.
        world_size: number of blocks (ranks), ``>= 1``.
        seed: shared seed (any Python int; taken modulo ``2**64``).
        round: synchronisation round, ``>= 0``.
        shared: fraction of every hidden layer shared by all ranks, in
            ``[0, 1)`` (default 0: a partition).

    Returns:
        ``blocks`` with ``blocks[l][r]`` a 1-D int64 CPU tensor: the neurons of
        hidden layer ``l`` given to rank ``r``, sorted ascending (so slices
        read memory in order). For each ``l`` the blocks are disjoint, cover
        ``range(n_l)`` and have sizes ``n_l // world_size`` or one more; which
        ranks get the larger blocks rotates with ``round``. With ``shared >
        0``: ``blocks[l][r]`` = the ``m_l`` shared neurons (sorted, the same
        for every rank) followed by the rank's own chunk (sorted); the own
        chunks are disjoint and, with the shared neurons, cover
        ``range(n_l)``. ``shared = 0`` gives exactly the partition above.

    Raises:
        TypeError: an argument is not an int (or ``hidden_sizes`` not a sequence).
        ValueError: ``world_size < 1``, ``round < 0``, a width smaller than
            ``world_size`` (every block would need at least one neuron), or
            ``shared`` outside ``[0, 1)``.
    """
    _check_int(world_size, "world_size", 1)
    _check_int(seed, "seed")
    _check_int(round, "round", 0)
    if isinstance(hidden_sizes, (str, bytes)) or not isinstance(hidden_sizes, Sequence):
        raise TypeError(
            f"hidden_sizes must be a sequence of ints, got {type(hidden_sizes).__name__}"
        )
    for l, n in enumerate(hidden_sizes):
        _check_int(n, f"hidden_sizes[{l}]")
        if n < world_size:
            raise ValueError(
                f"hidden_sizes[{l}] = {n} is smaller than world_size = {world_size}: "
                f"IST needs at least one neuron of every hidden layer per rank"
            )
    counts = shared_counts(hidden_sizes, world_size, shared)
    blocks: List[List[torch.Tensor]] = []
    for l, n in enumerate(hidden_sizes):
        gen = torch.Generator(device="cpu")
        gen.manual_seed(_layer_seed(seed, round, l))
        perm = torch.randperm(n, generator=gen, dtype=torch.int64)
        m = counts[l]
        base, extra = divmod(n - m, world_size)
        sizes = [base + (1 if (r - round) % world_size < extra else 0) for r in range(world_size)]
        if m == 0:
            blocks.append([torch.sort(chunk).values for chunk in torch.split(perm, sizes)])
        else:
            common = torch.sort(perm[:m]).values
            blocks.append([torch.cat([common, torch.sort(chunk).values])
                           for chunk in torch.split(perm[m:], sizes)])
    return blocks


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


# ---------------------------------------------------------------------------
# Trainer
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class ISTStats:
    """Communication counters of one rank of an :class:`ISTTrainer` (bytes).

    Attributes:
        rounds: synchronisation rounds completed (collectives issued).
        steps: local training steps taken.
        payload_bytes: this rank's trained slices plus the shared output bias
            (and BatchNorm running statistics), unpadded, summed over rounds.
            Per round this is the analytic subnet size: per Linear,
            ``n_in * n_out / world_size`` for the first and last layer and
            ``n_in * n_out / world_size**2`` between hidden layers (exactly:
            the product of the block sizes).
            With shared neurons (``ISTTrainer(shared=f)``) it also counts the
            shared region handed to the extra ``all_reduce`` (fp32, 4 bytes
            per element) every round.
        bytes_sent, bytes_received: this rank's traffic in the synchronisation
            ``all_gather`` under the ring algorithm: ``(world_size - 1)`` times
            the padded buffer (the largest rank's payload) per round, each way;
            with shared neurons plus the ring ``all_reduce`` of the shared
            region, ``2 (world_size - 1) / world_size`` times its bytes.
        dense_bytes_sent, dense_bytes_received: what data-parallel training
            with a ring all-reduce of every trainable parameter's gradient
            (``N`` elements) would move per rank over the same ``steps``:
            ``steps * 2 * (world_size - 1) * N * itemsize // world_size``.
        check_bytes: bytes this rank put into the per-round agreement
            all-reduce (80 per synchronisation; not in ``bytes_sent``).
    """

    rounds: int = 0
    steps: int = 0
    payload_bytes: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    dense_bytes_sent: int = 0
    dense_bytes_received: int = 0
    check_bytes: int = 0


_FP_ERROR = -1  # placeholder fingerprint of a rank whose validation failed (sent with its failure flag)


class _SubnetGrads:
    """The subnet's parameter gradients as views of one flat buffer (see
    :meth:`ISTTrainer._attach_grads`): zeroed in one op per step and scaled
    entry-wise by ``scale`` (the same layout) in one more."""

    __slots__ = ("flat", "scale", "first", "first_grad")

    def __init__(self, flat: torch.Tensor, scale: torch.Tensor,
                 first: Optional[nn.Parameter], first_grad: Optional[torch.Tensor]):
        self.flat = flat            # [payload numel], the gradients' storage
        self.scale = scale          # [payload numel], 1 / (c_row * c_col) per entry
        self.first = first          # a parameter whose .grad must still be first_grad
        self.first_grad = first_grad


class ISTTrainer:
    """Independent subnet training of an MLP on a process group.

    IST (Yuan et al., arXiv 1910.02120, Sec. 3, Algorithm 1). Each round ``t``:

    1. every rank computes the same partition ``partition(hidden_sizes,
       world_size, seed, t)`` and extracts its subnet (:func:`extract_subnet`);
    2. it trains the subnet for ``local_steps`` calls of :meth:`step` on its
       own data, with no communication, using a fresh optimizer from
       ``optimizer_factory(subnet.parameters())``;
    3. :meth:`synchronize` (called automatically after ``local_steps`` steps)
       sends the rank's trained slices as one flat buffer (the subnet's
       tensors are views of it, filled by
       :func:`slimcomm.ops.gather_slices_multi` at the start of the round), padded to
       the largest rank's size (known to every rank from the shared
       partition, so no size exchange), runs ONE ``all_gather``, and writes
       every rank's slices into the full model with
       :func:`slimcomm.ops.scatter_slices_multi`; the blocks are disjoint, so
       nothing is averaged except the shared output bias (mean over ranks,
       in rank order, fp32). Afterwards every rank holds the same full model.

    Weights between neurons of different blocks are not trained in a round.

    Gradients: with ``scale_grads=True`` (default) each sliced tensor's
    gradient is multiplied by its share of the full tensor (``world_size **
    -k``, ``k`` sliced dimensions) after backward, so one SGD learning rate
    serves every world size (module docstring, "Gradient scaling"). The
    subnet's gradients are then views of one flat buffer, zeroed by
    :meth:`step` (do not set them to ``None`` in between; if that happens the
    trainer re-attaches them at the next step).

    Optimizer state: the optimizer is re-created at the start of every round,
    as in the paper's implementation. Its state (e.g. momentum) belongs to one
    subnet's neurons, and the next round slices different neurons, so carrying
    it over would apply momentum to the wrong weights; re-creating it is the
    only layout-safe choice without communicating optimizer state.

    Construction is a collective call on ``process_group``: every rank first
    validates its model locally, then the ranks exchange a 63-bit fingerprint
    of (architecture, dtype, world size, seed, local_steps, rescale,
    scale_grads, shared) in one
    ``all_gather`` of ``world_size`` int64, so a rank with a bad or different
    model makes EVERY rank raise instead of hanging in a later collective.
    Then, with ``broadcast_model=True`` (default, as DDP does), the full model
    is broadcast from group rank 0 so all ranks start from the same weights.
    The first :meth:`step` re-reads the model (broadcasting it from rank 0
    again with ``broadcast_model=True``), so weights loaded into the model
    after construction, like after wrapping a model in DDP, are the starting
    point; after that the trainer owns the model until the next
    synchronisation (a load mid-round is overwritten by it).
    :meth:`step` and :meth:`synchronize` are collective too: all ranks must
    call them the same number of times.

    Args:
        model: ``nn.Sequential`` MLP (see the module docstring); the trainer
            updates it in place at every synchronisation. Between
            synchronisations it is stale (each rank trains only a subnet):
            call :meth:`synchronize` before evaluating or checkpointing it.
        optimizer_factory: ``callable(params) -> torch.optim.Optimizer``, e.g.
            ``lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)``.
        local_steps: steps per round, ``>= 1``.
        process_group: ``torch.distributed`` group; ``None`` = the default
            group if one is initialised, else a single rank with no
            communication.
        seed: shared partition seed (must be the same on every rank).
        rescale: scale hidden/output Linear inputs by ``world_size`` in the
            subnet (see "Pre-activation scaling" in the module docstring).
        scale_grads: with ``rescale``, multiply each sliced tensor's gradient
            by ``world_size ** -k`` (``k`` = its sliced dimensions) so that the
            stable SGD learning rate does not depend on the world size (see
            "Gradient scaling" in the module docstring; ``False`` = the
            original IST update, whose stable learning rate shrinks with the
            world size). No effect without ``rescale`` or at world size 1.
        shared: fraction of every hidden layer's neurons in every rank's
            subnet (:func:`partition`; 0 = disjoint subnets, the original
            IST); their weights are averaged over the ranks at every
            synchronisation (module docstring, "Shared neurons").
        broadcast_model: broadcast rank 0's model at construction.
        timeout: seconds any one collective of the trainer may wait (default
            300; ``None`` = the process group's own timeout, 30 minutes on
            gloo). A rank that died is noticed within about a second (its
            connections close); one that hangs or stopped calling :meth:`step`
            makes the others raise after ``timeout`` seconds.

    Reliability: every :meth:`synchronize` starts with one agreement
    all-reduce of 5 int64 counters (80 bytes, one host read per round, in
    ``stats.check_bytes``): joined, round, local step, steps taken, mid-round. Ranks that
    reached it at different points (uneven inputs without :meth:`join`,
    :meth:`synchronize` called on some ranks only) raise
    :class:`~slimcomm.CollectiveError` on every rank before the exchange,
    instead of exchanging slices of different rounds. A collective that fails
    or times out raises the same error on every surviving rank, the model is
    not written, and the trainer refuses further use.

    Raises:
        TypeError / ValueError: bad arguments or an unsupported model (on the
            rank that has it, after the check exchange).
        RuntimeError: another rank failed validation, or the ranks disagree
            on the model or settings (raised on every rank).
    """

    #: subnets kept for reuse, keyed by their widths (see :meth:`_fill_subnet`)
    _CACHE = 2

    def __init__(
        self,
        model: nn.Sequential,
        optimizer_factory: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
        local_steps: int = 10,
        process_group: Optional[dist.ProcessGroup] = None,
        seed: int = 0,
        *,
        rescale: bool = True,
        scale_grads: bool = True,
        shared: float = 0.0,
        broadcast_model: bool = True,
        timeout: Optional[float] = 300.0,
    ):
        if not callable(optimizer_factory):
            raise TypeError(
                f"optimizer_factory must be callable, got {type(optimizer_factory).__name__}"
            )
        if process_group is not None and not (dist.is_available() and dist.is_initialized()):
            raise ValueError("process_group was given but torch.distributed is not initialised")
        self._distributed = dist.is_available() and dist.is_initialized()
        self._pg = process_group
        if self._distributed:
            self._world_size = dist.get_world_size(process_group)
            self._rank = dist.get_rank(process_group)
        else:
            self._world_size, self._rank = 1, 0

        error: Optional[Exception] = None
        fingerprint = _FP_ERROR
        try:
            _check_int(local_steps, "local_steps", 1)
            _check_int(seed, "seed")
            self._timeout = _comm.check_timeout(timeout, "ISTTrainer")
            if not isinstance(rescale, bool):
                raise TypeError(f"rescale must be a bool, got {type(rescale).__name__}")
            if not isinstance(scale_grads, bool):
                raise TypeError(f"scale_grads must be a bool, got {type(scale_grads).__name__}")
            if not isinstance(broadcast_model, bool):
                raise TypeError(
                    f"broadcast_model must be a bool, got {type(broadcast_model).__name__}"
                )
            plan = _build_plan(model)
            partition(plan.hidden_sizes, self._world_size, seed, 0, shared=shared)
            text = (f"{plan.descriptor}|world_size={self._world_size}|seed={seed}"
                    f"|local_steps={local_steps}|rescale={rescale}|broadcast={broadcast_model}"
                    f"|scale_grads={scale_grads}|shared={float(shared)!r}")
            digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
            fingerprint = int.from_bytes(digest, "little") >> 1   # 63 bits, >= 0
        except Exception as exc:  # noqa: BLE001 - must reach the exchange below, never hang
            error = exc
        if self._distributed:
            self._check_agreement(fingerprint, error)
        elif error is not None:
            raise error

        self.model = model
        self._plan = plan
        self._factory = optimizer_factory
        self.local_steps = local_steps
        self.seed = seed
        self.rescale = rescale
        self.scale_grads = scale_grads
        self.shared = float(shared)
        self._counts = shared_counts(plan.hidden_sizes, self._world_size, self.shared)
        self._shared_slices = [
            t for t, sl in enumerate(plan.slices)
            if (sl.row_layer is None or self._counts[sl.row_layer])
            and (sl.col_layer is None or self._counts[sl.col_layer])
            and any(self._counts)]
        self._shared_local = self._local_shared_indices()
        self._shared_idx: List[Optional[torch.Tensor]] = [None] * len(plan.hidden_sizes)
        self._shared_numel_cache = self._shared_region_numel()
        self._itemsize = torch.empty((), dtype=plan.dtype).element_size()
        self._dense_numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
        self._rounds = 0
        self._steps = 0
        self._payload_bytes = 0
        self._wire_bytes = 0
        self._round = 0
        self._local_step = 0
        self._subnet_cache: Dict[Tuple[int, ...], Any] = {}
        self._check_bytes = 0
        self._failed: Optional[str] = None
        self._joined = False
        self._grad_cache: Dict[int, Tuple[nn.Sequential, "_SubnetGrads", List[Any]]] = {}
        self._grads: Optional[_SubnetGrads] = None
        self._broadcast = self._distributed and broadcast_model and self._world_size > 1
        if self._broadcast:
            self._broadcast_model()
        self._begin_round()
        # Until the first step the model is re-read (and re-broadcast) there: weights loaded
        # into the model after construction are the starting point, as with DDP.
        self._reread = True

    # -- setup ---------------------------------------------------------------

    def _check_agreement(self, fingerprint: int, error: Optional[Exception],
                         disagree: Optional[str] = None) -> None:
        """All ranks: exchange a 63-bit fingerprint and whether this rank failed
        (with ``error``) in one all-reduce; raise on every rank if any rank failed
        or the fingerprints differ (``disagree`` says what they cover; the
        message groups the ranks by fingerprint)."""
        differ = agree_across_ranks(
            {"fingerprint": fingerprint}, error, group=self._pg,
            timeout=getattr(self, "_timeout", None),
            other_failed=("ISTTrainer: another rank of the process group rejected its model or "
                          "arguments (see the error raised there); no rank can proceed"))
        if differ:
            # Rare path, reached by every rank alike: gather the fingerprints to name the groups.
            groups: Dict[int, List[int]] = {}
            for r, v in enumerate(gather_across_ranks(fingerprint, self._pg)):
                groups.setdefault(v, []).append(r)
            if disagree is None:
                disagree = ("the ranks disagree on the model architecture, dtype or IST "
                            "settings (seed, local_steps, rescale, scale_grads, broadcast_model)")
                hint = "Build the same model with the same arguments on every rank."
            else:
                hint = "Load the checkpoint of the same synchronisation round on every rank."
            raise RuntimeError(f"ISTTrainer: {disagree}; ranks grouped by fingerprint: "
                               f"{sorted(groups.values())}. {hint}")

    def _broadcast_model(self) -> None:
        tensors = list(self.model.parameters()) + list(self.model.buffers())
        by_dtype: Dict[torch.dtype, List[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        with torch.no_grad():
            for group in by_dtype.values():
                flat = torch.cat([t.detach().reshape(-1) for t in group])
                _comm.wait(_comm.broadcast(flat, 0, self._pg, self._timeout),
                           "ISTTrainer: the broadcast of rank 0's model at construction",
                           self._timeout)
                pos = 0
                for t in group:
                    t.copy_(flat[pos:pos + t.numel()].view_as(t))
                    pos += t.numel()

    def _begin_round(self) -> None:
        """Draw this round's partition, upload every rank's indices, (re)fill the subnet.

        Steady-state cost (issue 12): besides :func:`partition` (host-side CPU
        ops, a few per hidden layer: one generator, ``randperm``, ``split`` and
        ``sort``s), a constant number of dispatched ops whatever the number of
        layers: one ``cat`` of the blocks, one host-to-device copy, one
        ``split`` into index views, and, when a subnet with this round's widths
        is cached, one ``gather_slices_multi`` + ``copy_`` into its flat buffer
        (plus one ``_foreach_copy_`` of the BatchNorm counters). No host sync:
        the blocks come from :func:`partition`, valid by construction, so the
        value checks of :func:`extract_subnet` (which read index values on the
        host) only run when a subnet is built.
        """
        plan = self._plan
        self._blocks = partition(plan.hidden_sizes, self._world_size, self.seed, self._round,
                                 shared=self.shared)
        self._rows, self._cols = self._upload_indices(self._blocks)
        full = [getattr(self.model[s.module], s.name) for s in plan.slices]
        self._slice_numel = [ops.slices_numel(full, self._rows[r], self._cols[r])
                             for r in range(self._world_size)]
        self._shared_numel = sum(getattr(self.model[i], a).numel() for i, a in plan.shared)
        self._subnet = self._fill_subnet(full)
        self._grads = self._attach_grads(self._subnet)
        optimizer = self._factory(self._subnet.parameters())
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer_factory must return a torch.optim.Optimizer, got "
                f"{type(optimizer).__name__}"
            )
        self._optimizer = optimizer

    def _upload_indices(
        self, blocks: Sequence[Sequence[torch.Tensor]]
    ) -> Tuple[List[List[Optional[torch.Tensor]]], List[List[Optional[torch.Tensor]]]]:
        """Per-rank rows/cols index tensors of every sliced tensor, on the model's device.

        All ranks' blocks travel in ONE host-to-device copy, ``non_blocking``
        (from pageable host memory the driver stages the source before the
        call returns, so the temporary may be freed at once and no stream
        synchronisation happens), then one ``split`` gives views per (rank,
        layer). Returns ``(rows, cols)`` with ``rows[r][t]`` for slice ``t``.
        """
        plan = self._plan
        w, n_layers = self._world_size, len(blocks)
        order = [blocks[l][r] for r in range(w) for l in range(n_layers)]
        flat = torch.cat(order)
        if flat.device != plan.device:
            flat = flat.to(plan.device, non_blocking=True)
        views = flat.split([b.numel() for b in order])
        if any(self._counts):
            # One more split of the same buffer cuts the shared prefix off rank 0's blocks:
            # the shared neurons' global indices, with no per-layer op.
            sizes: List[int] = []
            at: Dict[int, int] = {}
            for j, b in enumerate(order):
                m = self._counts[j] if j < n_layers else 0
                if m:
                    at[j] = len(sizes)
                    sizes += [m, b.numel() - m]
                else:
                    sizes.append(b.numel())
            cut = flat.split(sizes)
            self._shared_idx = [cut[at[l]] if l in at else None for l in range(n_layers)]
        rows: List[List[Optional[torch.Tensor]]] = []
        cols: List[List[Optional[torch.Tensor]]] = []
        for r in range(w):
            on_dev = views[r * n_layers:(r + 1) * n_layers]
            rows.append([None if s.row_layer is None else on_dev[s.row_layer]
                         for s in plan.slices])
            cols.append([None if s.col_layer is None else on_dev[s.col_layer]
                         for s in plan.slices])
        return rows, cols

    def _subnet_tensors(self, subnet: nn.Sequential) -> List[Tuple[nn.Module, str]]:
        """(module, attribute) of the subnet's sliced then shared tensors, in payload order."""
        mods = _strip_scales(subnet, self.model)
        plan = self._plan
        return ([(mods[s.module], s.name) for s in plan.slices]
                + [(mods[i], a) for i, a in plan.shared])

    def _fill_subnet(self, full: List[torch.Tensor]) -> nn.Sequential:
        """This round's subnet, its floating tensors views of ONE flat buffer.

        The buffer is laid out as the payload of :meth:`synchronize` (sliced
        tensors in plan order, then the shared ones), so the send buffer is the
        subnet itself, with no gather. Subnets are cached by their widths (at
        most :attr:`_CACHE` of them; with widths divisible by the world size
        there is one): a cached subnet is refilled from the model in one
        ``gather_slices_multi`` and keeps its module objects (the optimizer is
        still re-created by the caller, and gradients are reset). The values
        equal those of :func:`extract_subnet` exactly (both are copies).
        """
        plan = self._plan
        rank = self._rank
        shared_full = [getattr(self.model[i], a) for i, a in plan.shared]
        nones = [None] * len(shared_full)
        widths = tuple(int(layer[rank].numel()) for layer in self._blocks)
        entry = self._subnet_cache.pop(widths, None)
        with torch.no_grad():
            packed = ops.gather_slices_multi(full + shared_full, self._rows[rank] + nones,
                                             self._cols[rank] + nones)
            if entry is not None:
                subnet, flat, ptrs = entry
                attrs = self._subnet_tensors(subnet)
                if [getattr(m, a).data_ptr() for m, a in attrs] != ptrs:
                    entry = None  # someone re-pointed a tensor: rebuild
            if entry is None:
                subnet = extract_subnet(self.model, self._blocks, rank, rescale=self.rescale,
                                        shared=self._counts)
                flat = packed
                pos = 0
                for m, a in self._subnet_tensors(subnet):
                    t = getattr(m, a)
                    view = flat[pos:pos + t.numel()].view(t.shape)
                    pos += t.numel()
                    if isinstance(t, nn.Parameter):
                        t.data = view
                    else:
                        setattr(m, a, view)
                ptrs = [getattr(m, a).data_ptr() for m, a in self._subnet_tensors(subnet)]
            else:
                flat.copy_(packed)
                counters = self._counter_pairs(subnet)
                if counters:
                    torch._foreach_copy_([s for s, _ in counters], [f for _, f in counters])
                for p in subnet.parameters():
                    p.grad = None
                subnet.train(self.model.training)
        self._subnet_cache[widths] = (subnet, flat, ptrs)
        while len(self._subnet_cache) > self._CACHE:
            self._subnet_cache.pop(next(iter(self._subnet_cache)))
        self._subnet_flat = flat
        self._subnet_ptrs = ptrs
        return subnet

    def _local_shared_indices(self) -> List[Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]]:
        """(rows, cols) of the shared region inside the subnet's tensor, per shared slice:
        the leading ``m`` rows/columns of a sliced dimension (blocks start with the shared
        neurons), all of an unsliced one. Constant over rounds; built once."""
        plan = self._plan
        out = []
        for t in self._shared_slices:
            sl = plan.slices[t]
            r = None if sl.row_layer is None else torch.arange(
                self._counts[sl.row_layer], device=plan.device)
            c = None if sl.col_layer is None else torch.arange(
                self._counts[sl.col_layer], device=plan.device)
            out.append((r, c))
        return out

    def _shared_region_numel(self) -> int:
        """Elements of the shared region all-reduced per round (0 without shared neurons)."""
        plan = self._plan
        n = 0
        for t in self._shared_slices:
            full = getattr(self.model[plan.slices[t].module], plan.slices[t].name)
            r, c = self._shared_local[self._shared_slices.index(t)]
            rows = full.shape[0] if r is None else r.numel()
            n += rows if full.dim() == 1 else rows * (full.shape[1] if c is None else c.numel())
        return n

    def _average_shared(self, attrs: List[Tuple[nn.Module, str]]) -> None:
        """Overwrite the shared region of the full model with its mean over the ranks.

        Gather the region out of this rank's trained subnet (one
        ``gather_slices_multi``), sum it over the ranks (one ``all_reduce``, in
        fp32), divide by the world size and scatter it to the shared neurons'
        global indices (one ``scatter_slices_multi``): a constant number of ops
        whatever the depth. Every rank ends with the same values."""
        plan = self._plan
        w = self._world_size
        sub = [getattr(*attrs[t]) for t in self._shared_slices]
        local_r = [r for r, _ in self._shared_local]
        local_c = [c for _, c in self._shared_local]
        part = ops.gather_slices_multi(sub, local_r, local_c).float()   # under no_grad
        dist.all_reduce(part, group=self._pg)
        part = part.div_(w).to(plan.dtype)
        full = [getattr(self.model[plan.slices[t].module], plan.slices[t].name)
                for t in self._shared_slices]
        idx = self._shared_idx
        rows = [None if plan.slices[t].row_layer is None else idx[plan.slices[t].row_layer]
                for t in self._shared_slices]
        cols = [None if plan.slices[t].col_layer is None else idx[plan.slices[t].col_layer]
                for t in self._shared_slices]
        ops.scatter_slices_multi(full, rows, cols, part)

    def _attach_grads(self, subnet: nn.Sequential) -> Optional[_SubnetGrads]:
        """With gradient scaling: give the subnet's parameters gradients that are
        views of one flat buffer, grouped by their factor ``world_size ** -k``.

        Built once per cached subnet (slices and views are dispatched ops);
        for a cached one the views are re-attached (Python attribute sets, no
        dispatched op) and the buffer zeroed (one op). ``None`` when nothing
        is scaled (no ``rescale``, ``scale_grads=False`` or world size 1).
        """
        w = self._world_size
        if not (self.rescale and self.scale_grads and w > 1):
            return None
        entry = self._grad_cache.get(id(subnet))
        if entry is not None and entry[0] is subnet:
            grads, pairs = entry[1], entry[2]
            grads.flat.zero_()
        else:
            plan = self._plan
            tensors = [getattr(m, a) for m, a in self._subnet_tensors(subnet)]
            dims = ([(s.row_layer, s.col_layer) for s in plan.slices]
                    + [(None, None)] * len(plan.shared))
            total = sum(t.numel() for t in tensors)
            flat = torch.zeros(total, dtype=plan.dtype, device=plan.device)
            scale = torch.ones(total, dtype=plan.dtype, device=plan.device)

            def factors(layer: Optional[int], size: int) -> torch.Tensor:
                # 1 / c per neuron: c = 1 for an unsliced dimension or a shared neuron,
                # world_size for the rank's own neurons (module docstring, "Gradient scaling").
                f = torch.ones(size, dtype=torch.float64)
                if layer is not None:
                    f[self._counts[layer]:] = 1.0 / w
                return f

            pairs = []
            pos = 0
            for t, (rl, cl) in zip(tensors, dims):
                n = t.numel()
                if isinstance(t, nn.Parameter) and t.requires_grad:
                    pairs.append((t, flat[pos:pos + n].view(t.shape)))
                    f = factors(rl, t.shape[0])
                    if t.dim() == 2:
                        f = f[:, None] * factors(cl, t.shape[1])[None, :]
                    scale[pos:pos + n] = f.reshape(-1).to(plan.dtype)
                pos += n
            first = pairs[0] if pairs else (None, None)
            grads = _SubnetGrads(flat, scale, first[0], first[1])
            live = {id(e[0]) for e in self._subnet_cache.values()}
            self._grad_cache = {k: v for k, v in self._grad_cache.items() if k in live}
            self._grad_cache[id(subnet)] = (subnet, grads, pairs)
        for p, view in pairs:
            p.grad = view
        return grads

    def _counter_pairs(self, subnet: nn.Sequential) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """(subnet, model) ``num_batches_tracked`` tensors of the BatchNorm layers."""
        mods = _strip_scales(subnet, self.model)
        return [(mods[i].num_batches_tracked, self.model[i].num_batches_tracked)
                for i in self._plan.counters]

    # -- public API ----------------------------------------------------------

    @property
    def rank(self) -> int:
        """This process's rank in the process group."""
        return self._rank

    @property
    def world_size(self) -> int:
        """Number of ranks (= subnets per round)."""
        return self._world_size

    @property
    def round(self) -> int:
        """Index of the current round (partition seed component)."""
        return self._round

    @property
    def blocks(self) -> List[List[torch.Tensor]]:
        """The current round's partition (see :func:`partition`)."""
        return self._blocks

    @property
    def subnet(self) -> nn.Sequential:
        """The subnet this rank trains in the current round."""
        return self._subnet

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The current round's optimizer (re-created every round)."""
        return self._optimizer

    def payload_numel(self, rank: int) -> int:
        """Elements rank ``rank`` sends in the current round (slices + shared)."""
        return self._slice_numel[rank] + self._shared_numel

    @property
    def stats(self) -> ISTStats:
        """Communication counters so far (see :class:`ISTStats`)."""
        w = self._world_size
        dense = self._steps * 2 * (w - 1) * self._dense_numel * self._itemsize // w
        return ISTStats(
            rounds=self._rounds,
            steps=self._steps,
            payload_bytes=self._payload_bytes,
            check_bytes=self._check_bytes,
            bytes_sent=self._wire_bytes,
            bytes_received=self._wire_bytes,
            dense_bytes_sent=dense,
            dense_bytes_received=dense,
        )

    def step(
        self,
        inputs: torch.Tensor,
        targets: Any,
        loss_fn: Callable[[torch.Tensor, Any], torch.Tensor],
    ) -> float:
        """One local training step of this rank's subnet; synchronises every ``local_steps``.

        Computes ``loss = loss_fn(subnet(inputs), targets)``, back-propagates
        and steps the round's optimizer. The subnet runs in the full model's
        train/eval mode. After the ``local_steps``-th step of a round,
        :meth:`synchronize` runs (a collective).

        Args:
            inputs: ``[batch, in_features]`` on the model's device and dtype;
                each rank may feed its own data.
            targets: whatever ``loss_fn`` takes as its second argument.
            loss_fn: ``(outputs [batch, out_features], targets) -> scalar tensor``.

        Returns:
            the loss before the update, as a Python float.

        Raises:
            ValueError: ``inputs`` is not a tensor whose last dimension is the
                first Linear's ``in_features`` in the model's dtype and device
                (checked before anything runs); ``loss_fn`` did not return a
                scalar tensor.
        """
        self._check_usable()
        plan = self._plan
        in_features = self.model[plan.linears[0]].in_features
        if not isinstance(inputs, torch.Tensor):
            raise ValueError(f"inputs must be a torch.Tensor, got {type(inputs).__name__}")
        if inputs.dim() < 1 or inputs.shape[-1] != in_features:
            raise ValueError(
                f"inputs has shape {list(inputs.shape)}; expected [batch, in_features = "
                f"{in_features}] (the model's first Linear)"
            )
        if inputs.dtype != plan.dtype or inputs.device != plan.device:
            raise ValueError(
                f"inputs is {str(inputs.dtype).replace('torch.', '')} on {inputs.device}; the "
                f"model is {str(plan.dtype).replace('torch.', '')} on {plan.device}"
            )
        if self._reread:
            self._reread_model()
        self._subnet.train(self.model.training)
        grads = self._grads
        if grads is None:
            self._optimizer.zero_grad(set_to_none=True)
        else:
            if grads.first is not None and grads.first.grad is not grads.first_grad:
                self._grads = grads = self._attach_grads(self._subnet)  # views were dropped
            grads.flat.zero_()
        loss = loss_fn(self._subnet(inputs), targets)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError("loss_fn must return a scalar tensor")
        loss.backward()
        if grads is not None:
            with torch.no_grad():
                grads.flat.mul_(grads.scale)   # one op: every gradient times its share
        self._optimizer.step()
        self._steps += 1
        self._local_step += 1
        value = float(loss.detach())
        if self._local_step >= self.local_steps:
            self.synchronize()
        return value

    def _reread_model(self) -> None:
        """First step after construction: the model as it is now (rank 0's, broadcast
        again when ``broadcast_model``) refills the round's subnet in place; the
        optimizer is kept (re-created only if the subnet had to be rebuilt)."""
        self._reread = False
        if self._broadcast:
            self._broadcast_model()
        before = self._subnet
        full = [getattr(self.model[s.module], s.name) for s in self._plan.slices]
        self._subnet = self._fill_subnet(full)
        if self._subnet is not before:
            self._optimizer = self._factory(self._subnet.parameters())

    def synchronize(self) -> None:
        """End the round now: exchange the trained slices, then repartition.

        After it returns every rank holds the same full model (ready for
        evaluation or checkpointing) and a new subnet and optimizer for the
        next round. A no-op when no step was taken since the last
        synchronisation. Collective: all ranks must call it together.

        Cost (issue 12; ``tests/test_hot_path_ist.py``): no host sync, and a
        number of dispatched ops that depends on the world size but not on the
        number of layers or parameters (one pad, one ``all_gather``, one
        ``scatter_slices_multi`` per rank, the shared-bias mean, one
        ``_foreach_copy_`` each for the shared tensors and the BatchNorm
        counters), plus the repartition's (see :meth:`_begin_round`).
        """
        self._check_usable()
        if self._local_step == 0:
            return
        self._agree(joined=False)
        with ops.trusted_indices():  # the slices come from our own partition: no CUDA value-check syncs
            self._synchronize()

    def _check_usable(self) -> None:
        if self._failed is not None:
            raise CollectiveError(f"ISTTrainer cannot be used after a failed synchronisation: "
                                  f"{self._failed}")

    def _what(self) -> str:
        return (f"ISTTrainer.synchronize (round {self._round}, local step {self._local_step}, "
                f"step {self._steps})")

    def _agree(self, joined: bool) -> Dict[str, bool]:
        """The per-round agreement (see the class docstring); raises on every rank if the
        ranks that have not joined disagree. Returns ``any_active``, ``unsynced``."""
        if not self._distributed or self._world_size == 1:
            return {"any_active": not joined, "unsynced": self._local_step > 0}
        vals = [0 if joined else 1, self._round, None if joined else self._local_step,
                None if joined else self._steps, int(self._local_step > 0)]
        try:
            hi, lo = _comm.agree_counters(vals, self._pg, self._timeout, self._plan.device,
                                          self._what())
        except CollectiveError as exc:
            self._failed = str(exc)
            raise
        self._check_bytes += 2 * 8 * len(vals)
        if hi[1] != lo[1] or hi[2] != lo[2] or hi[3] != lo[3]:
            rows = _comm.gather_rows([-1 if v is None else v for v in vals], self._pg,
                                     self._timeout, self._plan.device)
            where = ", ".join(
                f"rank {r}: round {row[1]}, " + ("joined" if row[0] == 0 else
                                                 f"local step {row[2]}, {row[3]} steps")
                for r, row in enumerate(rows))
            self._failed = (
                f"{self._what()}: the ranks reached this synchronisation at different points "
                f"({where}). Every rank must call step() the same number of times and "
                f"synchronize() at the same step. Usual causes: uneven inputs (a rank ran out "
                f"of batches: wrap the loop in `with trainer.join():`, or agree on the number "
                f"of steps up front); synchronize() called on some ranks only. Nothing was "
                f"exchanged; restart every rank from the last checkpoint")
            raise CollectiveError(self._failed)
        return {"any_active": hi[0] == 1, "unsynced": hi[4] == 1}

    @contextlib.contextmanager
    def join(self):
        """Context manager for uneven inputs: ranks may take different numbers of steps.

        A rank whose loop inside the block ends first shadows the other ranks'
        synchronisations when it leaves the block: it takes part in each of
        their rounds, sending its subnet as it is (its neurons are not trained
        further; the shared output bias is still averaged over every rank), so
        every rank keeps the same full model and partition. When all ranks have
        left their loops, a last synchronisation runs if any rank is mid-round,
        and every rank leaves the block with the same full model. A finished
        rank waits up to ``timeout`` seconds for each round of the others.

        Example::

            with trainer.join():
                for x, y in loader:            # loaders of different lengths
                    trainer.step(x, y, torch.nn.functional.cross_entropy)

        Without ``join()``: agree on the number of steps up front (one
        all-reduce MIN of ``len(loader)``) and run exactly that many.

        Raises:
            CollectiveError: as :meth:`synchronize`.
            RuntimeError: ``join()`` is already active (it cannot nest).
        """
        self._check_usable()
        if self._joined:
            raise RuntimeError("ISTTrainer.join() is already active (it cannot nest)")
        self._joined = True
        try:
            yield self
        except BaseException:
            self._joined = False
            raise
        try:
            while True:
                seen = self._agree(joined=True)
                if not seen["any_active"] and not seen["unsynced"]:
                    break
                with ops.trusted_indices():
                    self._synchronize()
                if not seen["any_active"]:
                    break
        finally:
            self._joined = False

    def _synchronize(self) -> None:
        plan = self._plan
        w = self._world_size
        attrs = self._subnet_tensors(self._subnet)
        full_tensors = [getattr(self.model[s.module], s.name) for s in plan.slices]
        shared_full = [getattr(self.model[i], a) for i, a in plan.shared]
        width = max(self.payload_numel(r) for r in range(w))
        mine = self.payload_numel(self._rank)
        with torch.no_grad():
            if [getattr(m, a).data_ptr() for m, a in attrs] == self._subnet_ptrs:
                packed = self._subnet_flat  # the subnet's tensors ARE the payload
            else:  # a tensor of the subnet was replaced: gather it
                sub_tensors = [getattr(m, a).detach() for m, a in attrs]
                nones = [None] * len(sub_tensors)
                packed = ops.gather_slices_multi(sub_tensors, nones, nones)
            if w == 1:
                gathered = packed.unsqueeze(0)
            else:
                send = torch.nn.functional.pad(packed, (0, width - mine))
                gathered = packed.new_empty((w, width))
                try:
                    _comm.wait(_comm.all_gather(gathered.view(-1), send, self._pg,
                                                self._timeout), self._what(), self._timeout)
                except CollectiveError as exc:  # nothing was written into the model
                    self._failed = str(exc)
                    raise
            for r in range(w):
                n = self._slice_numel[r]
                ops.scatter_slices_multi(
                    full_tensors, self._rows[r], self._cols[r], gathered[r, :n])
            if plan.shared:
                acc = gathered[0, self._slice_numel[0]:self.payload_numel(0)].float()
                for r in range(1, w):
                    acc = acc + gathered[r, self._slice_numel[r]:self.payload_numel(r)].float()
                acc = (acc / w).to(plan.dtype)
                parts = acc.split([t.numel() for t in shared_full])
                torch._foreach_copy_([t.view(-1) for t in shared_full], list(parts))
            if self._shared_slices and w > 1:
                self._average_shared(attrs)
            counters = self._counter_pairs(self._subnet)
            if counters:
                torch._foreach_copy_([f for _, f in counters], [s for s, _ in counters])
        self._rounds += 1
        self._payload_bytes += mine * self._itemsize
        self._wire_bytes += (w - 1) * width * self._itemsize
        if self._shared_slices and w > 1:   # ring all-reduce of the fp32 shared region
            n = self._shared_numel_cache
            self._payload_bytes += n * 4
            self._wire_bytes += 2 * (w - 1) * n * 4 // w
        self._local_step = 0
        self._round += 1
        self._begin_round()

    # -- checkpointing -------------------------------------------------------

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
        with a different world size or ``local_steps``; a mid-round state needs
        the same world size, and this rank's own state. The seed must match
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
                different ``world_size``/``local_steps`` or saved by another
                rank (raised there; the other ranks raise RuntimeError).
            RuntimeError: from ``model.load_state_dict``; another rank failed
                to load; the ranks loaded different rounds or models.
        """
        error: Optional[Exception] = None
        fingerprint = _FP_ERROR
        try:
            self._validate_state(state)
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
        if mid and state["local_steps"] != self.local_steps:
            raise ValueError(
                f"state_dict['local_steps'] = {state['local_steps']} differs from "
                f"{self.local_steps}; a mid-round state needs the same local_steps"
            )
