"""IST for transformer blocks: which tensors of a GPT are sliced by a partition of its
attention heads and FFN hidden neurons, the per-rank index sets, the narrow subnet
(:class:`GPTSubnet`), :func:`extract_gpt_subnet` and :func:`write_back_gpt`.

The model is the decoder-only GPT of :mod:`slimcomm.train.workloads.models`
(``tok_emb``, ``pos_emb``, ``drop``, ``blocks`` of ``ln1`` / ``attn`` (``qkv``,
``proj``, ``n_head``, ``dropout``, ``resid_drop``) / ``ln2`` / ``mlp`` =
``Sequential(Linear(d, f), GELU, Linear(f, d), Dropout)``, ``ln_f``, ``head``), or
any module of exactly that structure (checked, errors name the attribute).

Partition (IST, Yuan et al., arXiv 1910.02120, Sec. 3, applied to a transformer's
width as in TwIST, arXiv 2511.03983, and SDP, arXiv 2507.09029): every round,
:func:`slimcomm.ist.partition` over the widths ``[n_head] * L + [f] * L`` (the
heads of each block, then the FFN hidden neurons of each block) gives each rank a
disjoint set of heads ``H_l^r`` and of FFN neurons ``F_l^r`` per block ``l``.

Slicing rules for rank ``r`` (``d`` = model width, ``h = d / n_head`` = head size):

* ``attn.qkv.weight`` ``[3d, d]`` and ``attn.qkv.bias`` ``[3d]``: the rows of the
  rank's heads in each of q, k and v (``p d + j h + i`` for ``p`` in 0..2, ``j`` in
  ``H_l^r``, ``i < h``; ascending, so q, k, v of the kept heads in head order);
* ``attn.proj.weight`` ``[d, d]``: the columns ``j h + i`` of the kept heads;
* ``mlp[0].weight`` ``[f, d]``, ``mlp[0].bias`` ``[f]``: rows ``F_l^r``;
  ``mlp[2].weight`` ``[d, f]``: columns ``F_l^r``;
* shared by every subnet (trained by every rank, averaged at the synchronisation):
  ``tok_emb``, ``pos_emb``, every LayerNorm (``ln1``, ``ln2``, ``ln_f``), the biases
  of the two projections that write into the residual stream (``attn.proj.bias``,
  ``mlp[2].bias``) and the LM head (``head.weight``, ``head.bias`` if any).

Rescaling (the inverted-dropout view of IST, :mod:`slimcomm.ist`, "Pre-activation
scaling"): each branch of a subnet sums over only its heads / neurons, so with
``rescale=True`` the concatenated head outputs are multiplied by
``c_attn = n_head / |H_l^r|`` before ``attn.proj`` and the GELU outputs by
``c_ffn = f / |F_l^r|`` before ``mlp[2]`` (each head / neuron is in the rank's set
with probability ``|set| / n``, so the branch's residual-stream contribution is an
unbiased estimate of the full block's; ``c = world_size`` when it divides the
width). The full model is evaluated as is. ResIST (arXiv 2107.00961) rescales a
residual network's sub-branches in the same way; TwIST's activation-shift
correction is not applied.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .. import ops
from .extraction import _check_blocks

__all__ = ["GPTSubnet", "extract_gpt_subnet", "write_back_gpt"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class _GSlice:
    name: str                   # parameter name in the full model
    block: int                  # transformer block
    rows: Optional[str]         # "qkv" | "ffn" | None (all rows)
    cols: Optional[str]         # "head" | "ffn" | None (all columns)


@dataclass
class _GPTPlan:
    n_layer: int
    d: int
    n_head: int
    head_dim: int
    ffn: int
    sliced: List[_GSlice]        # payload order
    shared: List[str]            # payload order, after the sliced tensors
    emb_p: float
    attn_p: float
    resid_p: float
    mlp_p: float
    block_size: int
    dtype: torch.dtype
    device: torch.device
    descriptor: str

    @property
    def widths(self) -> List[int]:
        """The partitioned widths: ``[n_head] * n_layer + [ffn] * n_layer``."""
        return [self.n_head] * self.n_layer + [self.ffn] * self.n_layer


def _need(obj: Any, attr: str, kind: type, where: str) -> Any:
    m = getattr(obj, attr, None)
    if type(m) is not kind:
        got = "missing" if m is None else type(m).__name__
        raise TypeError(f"model.{where}{attr} must be an nn.{kind.__name__} (the GPT of "
                        f"slimcomm.train.workloads.models), got {got}")
    return m


def _build_gpt_plan(model: nn.Module) -> _GPTPlan:
    """Validate ``model`` as a GPT for IST and list its sliced and shared tensors.

    Raises:
        TypeError: ``model`` is not an ``nn.Module`` or a sub-module has another type
            (the message names the attribute), or a dtype is not fp32/fp16/bf16.
        ValueError: inconsistent widths, a missing bias, mixed dtypes or devices.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module (a GPT), got {type(model).__name__}")
    tok = _need(model, "tok_emb", nn.Embedding, "")
    pos = _need(model, "pos_emb", nn.Embedding, "")
    drop = _need(model, "drop", nn.Dropout, "")
    blocks = _need(model, "blocks", nn.ModuleList, "")
    _need(model, "ln_f", nn.LayerNorm, "")
    head = _need(model, "head", nn.Linear, "")
    if len(blocks) < 1:
        raise ValueError("model.blocks is empty: IST partitions the heads and FFN neurons of the blocks")
    d = tok.embedding_dim
    if pos.embedding_dim != d or head.in_features != d:
        raise ValueError(f"model.pos_emb / model.head widths ({pos.embedding_dim}, {head.in_features}) "
                         f"differ from model.tok_emb's {d}")
    sliced: List[_GSlice] = []
    shared: List[str] = ["tok_emb.weight", "pos_emb.weight"]
    n_head = ffn = None
    attn_p = resid_p = mlp_p = 0.0
    for l, blk in enumerate(blocks):
        w = f"blocks[{l}]."
        _need(blk, "ln1", nn.LayerNorm, w)
        _need(blk, "ln2", nn.LayerNorm, w)
        attn = getattr(blk, "attn", None)
        if attn is None:
            raise TypeError(f"model.{w}attn is missing (the GPT of slimcomm.train.workloads.models)")
        qkv = _need(attn, "qkv", nn.Linear, w + "attn.")
        proj = _need(attn, "proj", nn.Linear, w + "attn.")
        rd = _need(attn, "resid_drop", nn.Dropout, w + "attn.")
        mlp = _need(blk, "mlp", nn.Sequential, w)
        types_ = tuple(type(m) for m in mlp)
        if types_ != (nn.Linear, nn.GELU, nn.Linear, nn.Dropout) or mlp[1].approximate != "none":
            raise TypeError(f"model.{w}mlp must be Sequential(Linear, GELU(), Linear, Dropout), got "
                            f"({', '.join(t.__name__ for t in types_)})")
        h = getattr(attn, "n_head", None)
        if isinstance(h, bool) or not isinstance(h, int) or h < 1 or d % h:
            raise ValueError(f"model.{w}attn.n_head must be a positive divisor of {d}, got {h!r}")
        for ln in (blk.ln1, blk.ln2):
            if tuple(ln.normalized_shape) != (d,) or ln.weight is None or ln.bias is None:
                raise ValueError(f"model.{w}ln1/ln2 must be LayerNorm({d}) with weight and bias")
        f = mlp[0].out_features
        if (qkv.in_features, qkv.out_features, proj.in_features, proj.out_features) != (d, 3 * d, d, d) \
                or (mlp[0].in_features, mlp[2].in_features, mlp[2].out_features) != (d, f, d):
            raise ValueError(f"model.{w}: attn.qkv must be Linear({d}, {3 * d}), attn.proj Linear({d}, {d}), "
                             f"mlp Linear({d}, f) then Linear(f, {d})")
        if any(m.bias is None for m in (qkv, proj, mlp[0], mlp[2])):
            raise ValueError(f"model.{w}: attn.qkv, attn.proj, mlp[0] and mlp[2] need biases")
        if n_head is not None and (h, f) != (n_head, ffn):
            raise ValueError(f"model.{w}: n_head / FFN width ({h}, {f}) differ from block 0's "
                             f"({n_head}, {ffn})")
        ps = (float(getattr(attn, "dropout", 0.0)), rd.p, mlp[3].p)
        if l and ps != (attn_p, resid_p, mlp_p):
            raise ValueError(f"model.{w}: dropout probabilities differ from block 0's")
        n_head, ffn = h, f
        attn_p, resid_p, mlp_p = ps
        p = f"blocks.{l}."
        sliced += [_GSlice(p + "attn.qkv.weight", l, "qkv", None),
                   _GSlice(p + "attn.qkv.bias", l, "qkv", None),
                   _GSlice(p + "attn.proj.weight", l, None, "head"),
                   _GSlice(p + "mlp.0.weight", l, "ffn", None),
                   _GSlice(p + "mlp.0.bias", l, "ffn", None),
                   _GSlice(p + "mlp.2.weight", l, None, "ffn")]
        shared += [p + "ln1.weight", p + "ln1.bias", p + "attn.proj.bias",
                   p + "ln2.weight", p + "ln2.bias", p + "mlp.2.bias"]
    ln_f = model.ln_f
    if tuple(ln_f.normalized_shape) != (d,) or ln_f.weight is None or ln_f.bias is None:
        raise ValueError(f"model.ln_f must be LayerNorm({d}) with weight and bias")
    shared += ["ln_f.weight", "ln_f.bias", "head.weight"] + (["head.bias"] if head.bias is not None else [])
    params = dict(model.named_parameters())
    missing = [n for n in [s.name for s in sliced] + shared if n not in params]
    extra = sorted(set(params) - {s.name for s in sliced} - set(shared))
    if missing or extra:
        raise ValueError(f"model's parameters do not match the GPT layout: missing {missing}, "
                         f"unexpected {extra}")
    if any(True for _ in model.buffers()):
        raise ValueError("model has buffers; the GPT of slimcomm.train.workloads.models has none "
                         "(IST would not know how to synchronise them)")
    dtype, device = tok.weight.dtype, tok.weight.device
    for name, t in params.items():
        if t.dtype not in _DTYPES:
            raise TypeError(f"model parameter {name!r} has dtype {t.dtype}; IST supports float32, "
                            f"float16 and bfloat16")
        if t.dtype != dtype or t.device != device:
            raise ValueError(f"model parameter {name!r} is {t.dtype} on {t.device} but tok_emb.weight is "
                             f"{dtype} on {device}; all parameters must share one dtype and device")
    block_size = pos.num_embeddings
    descriptor = (f"GPT(vocab={tok.num_embeddings},block={block_size},L={len(blocks)},d={d},"
                  f"heads={n_head},ffn={ffn},head_bias={head.bias is not None},"
                  f"drop={drop.p!r}/{attn_p!r}/{resid_p!r}/{mlp_p!r})|dtype={dtype}|device={device.type}"
                  "|grad=" + "".join("1" if p.requires_grad else "0" for p in params.values()))
    return _GPTPlan(len(blocks), d, n_head, d // n_head, ffn, sliced, shared, drop.p, attn_p, resid_p,
                    mlp_p, block_size, dtype, device, descriptor)


def _check_world(plan: _GPTPlan, world_size: int) -> None:
    if plan.n_head < world_size:
        raise ValueError(f"model.n_head = {plan.n_head} is smaller than world_size = {world_size}: "
                         f"IST for transformer blocks gives every rank at least one attention head")
    if plan.ffn < world_size:
        raise ValueError(f"the FFN width {plan.ffn} is smaller than world_size = {world_size}")


def _check_partition(plan: _GPTPlan, blocks: Any, rank: Any) -> int:
    """Validate ``blocks`` (a partition of the heads and FFN neurons) and ``rank``; the world size."""
    if isinstance(blocks, Sequence) and blocks and isinstance(blocks[0], Sequence):
        _check_world(plan, len(blocks[0]))
    return _check_blocks(types.SimpleNamespace(hidden_sizes=plan.widths), blocks, rank)


def _index_sets(plan: _GPTPlan, blocks: Sequence[Sequence[torch.Tensor]], ranks: Sequence[int],
                device: torch.device) -> List[List[torch.Tensor]]:
    """Per rank in ``ranks``: ``[qkv rows, head columns, ffn]`` of every block (3 L int64
    views on ``device``, in block order).

    A constant number of dispatched ops whatever the depth and the number of ranks (a
    gather builds every segment's q/k/v rows at once), ONE host-to-device copy and one
    ``split``: with ``J`` (rank, block) segments of ``n_j = |heads| h`` head columns,
    segment ``j``'s q/k/v rows are ``p d + cols_j`` for ``p`` = 0, 1, 2, in that order."""
    hd, d, L = plan.head_dim, plan.d, plan.n_layer
    segs = [(r, l) for r in ranks for l in range(L)]
    heads = torch.cat([blocks[l][r] for r, l in segs]).to("cpu", torch.int64)
    cols = (heads[:, None] * hd + torch.arange(hd, dtype=torch.int64)[None, :]).reshape(-1)
    n = [int(blocks[l][r].numel()) * hd for r, l in segs]
    n_t = torch.tensor(n, dtype=torch.int64)
    starts = torch.cumsum(n_t, 0) - n_t
    seg = torch.repeat_interleave(torch.arange(len(segs)), 3 * n_t)        # segment of every row
    at = torch.arange(3 * sum(n), dtype=torch.int64) - torch.repeat_interleave(3 * starts, 3 * n_t)
    width = n_t[seg]
    qkv = cols[starts[seg] + at % width] + (at // width) * d
    ffn = [blocks[L + l][r] for r, l in segs]
    flat = torch.cat([qkv, cols, torch.cat(ffn).to("cpu", torch.int64)])
    if flat.device != device:
        flat = flat.to(device, non_blocking=True)
    views = flat.split([3 * k for k in n] + n + [int(f.numel()) for f in ffn])
    J = len(segs)
    return [[v for l in range(L) for v in (views[i * L + l], views[J + i * L + l], views[2 * J + i * L + l])]
            for i in range(len(ranks))]


def _slice_indices(plan: _GPTPlan, sets: Sequence[torch.Tensor]
                   ) -> Tuple[List[Optional[torch.Tensor]], List[Optional[torch.Tensor]]]:
    """rows / cols of every sliced tensor (plan order) from one rank's :func:`_index_sets` list."""
    key = {"qkv": 0, "head": 1, "ffn": 2}
    rows = [None if s.rows is None else sets[3 * s.block + key[s.rows]] for s in plan.sliced]
    cols = [None if s.cols is None else sets[3 * s.block + key[s.cols]] for s in plan.sliced]
    return rows, cols


def _full_tensors(plan: _GPTPlan, model: nn.Module) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    params = dict(model.named_parameters())
    return [params[s.name] for s in plan.sliced], [params[n] for n in plan.shared]


class GPTSubnet(nn.Module):
    """One rank's narrow GPT for one round (see the module docstring for the slicing).

    Its parameters are views of one flat buffer laid out as the synchronisation
    payload (the sliced tensors in plan order, then the shared ones), named like the
    full model's with ``.`` replaced by ``__``. Blocks keep ``heads[l]`` heads and
    ``ffn[l]`` FFN neurons; the head outputs are multiplied by ``attn_scale[l]`` and
    the GELU outputs by ``ffn_scale[l]`` (1.0 = no multiplication). Dropout, in the
    same places and order as the full GPT, is active in ``train()`` mode.

    Shapes: ``idx`` int64/int32 ``[B, T]`` (``1 <= T <= block_size``) -> logits
    ``[B, T, vocab_size]`` in the model's dtype.

    Raises:
        ValueError: (:meth:`forward`) ``idx`` of the wrong rank, dtype or length.
    """

    def __init__(self, plan: _GPTPlan, flat: torch.Tensor, shapes: Sequence[Tuple[int, ...]],
                 requires_grad: Sequence[bool], heads: Sequence[int], ffn: Sequence[int],
                 attn_scale: Sequence[float], ffn_scale: Sequence[float]):
        super().__init__()
        self._names = [s.name for s in plan.sliced] + list(plan.shared)
        pos = 0
        for name, shape, rg in zip(self._names, shapes, requires_grad):
            n = 1
            for s in shape:
                n *= s
            self.register_parameter(name.replace(".", "__"),
                                    nn.Parameter(flat[pos:pos + n].view(shape), requires_grad=rg))
            pos += n
        self.flat = flat
        self.n_layer, self.head_dim, self.block_size = plan.n_layer, plan.head_dim, plan.block_size
        self.heads, self.ffn = list(heads), list(ffn)
        self.attn_scale, self.ffn_scale = list(attn_scale), list(ffn_scale)
        self.p = (plan.emb_p, plan.attn_p, plan.resid_p, plan.mlp_p)
        self.d = plan.d

    def tensor(self, name: str) -> torch.Tensor:
        """The subnet's parameter for the full model's parameter ``name``."""
        return getattr(self, name.replace(".", "__"))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """``idx`` int ``[B, T]`` -> logits ``[B, T, vocab_size]`` (see the class docstring)."""
        if not isinstance(idx, torch.Tensor) or idx.dim() != 2 or idx.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"idx must be an int64/int32 [B, T] tensor, got "
                             f"{getattr(idx, 'dtype', type(idx).__name__)} {list(getattr(idx, 'shape', []))}")
        b, t = idx.shape
        if not 1 <= t <= self.block_size:
            raise ValueError(f"idx has {t} positions; must be in [1, block_size={self.block_size}]")
        g = self.tensor
        emb_p, attn_p, resid_p, mlp_p = self.p
        tr = self.training
        x = F.embedding(idx, g("tok_emb.weight")) + F.embedding(torch.arange(t, device=idx.device),
                                                                 g("pos_emb.weight"))
        x = F.dropout(x, emb_p, tr)
        d = self.d
        for l in range(self.n_layer):
            p = f"blocks.{l}."
            nh, hd = self.heads[l], self.head_dim
            y = F.layer_norm(x, (d,), g(p + "ln1.weight"), g(p + "ln1.bias"))
            q, k, v = F.linear(y, g(p + "attn.qkv.weight"), g(p + "attn.qkv.bias")).split(nh * hd, dim=2)
            q, k, v = (z.view(b, t, nh, hd).transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=attn_p if tr else 0.0, is_causal=True)
            y = y.transpose(1, 2).reshape(b, t, nh * hd)
            if self.attn_scale[l] != 1.0:
                y = y * self.attn_scale[l]
            x = x + F.dropout(F.linear(y, g(p + "attn.proj.weight"), g(p + "attn.proj.bias")), resid_p, tr)
            y = F.layer_norm(x, (d,), g(p + "ln2.weight"), g(p + "ln2.bias"))
            y = F.gelu(F.linear(y, g(p + "mlp.0.weight"), g(p + "mlp.0.bias")))
            if self.ffn_scale[l] != 1.0:
                y = y * self.ffn_scale[l]
            x = x + F.dropout(F.linear(y, g(p + "mlp.2.weight"), g(p + "mlp.2.bias")), mlp_p, tr)
        x = F.layer_norm(x, (d,), g("ln_f.weight"), g("ln_f.bias"))
        head_b = getattr(self, "head__bias", None)
        return F.linear(x, g("head.weight"), head_b)


def _scales(plan: _GPTPlan, blocks: Sequence[Sequence[torch.Tensor]], rank: int,
            rescale: bool) -> Tuple[List[int], List[int], List[float], List[float]]:
    L = plan.n_layer
    heads = [int(blocks[l][rank].numel()) for l in range(L)]
    ffn = [int(blocks[L + l][rank].numel()) for l in range(L)]
    if not rescale:
        return heads, ffn, [1.0] * L, [1.0] * L
    return heads, ffn, [plan.n_head / h for h in heads], [plan.ffn / f for f in ffn]


def _make_subnet(plan: _GPTPlan, model: nn.Module, blocks, rank: int, rescale: bool,
                 flat: torch.Tensor, rows, cols) -> GPTSubnet:
    sliced_full, shared_full = _full_tensors(plan, model)
    shapes: List[Tuple[int, ...]] = []
    for t, r, c in zip(sliced_full, rows, cols):
        nr = t.shape[0] if r is None else r.numel()
        shapes.append((nr,) if t.dim() == 1 else (nr, t.shape[1] if c is None else c.numel()))
    shapes += [tuple(t.shape) for t in shared_full]
    rg = [t.requires_grad for t in sliced_full + shared_full]
    sub = GPTSubnet(plan, flat, shapes, rg, *_scales(plan, blocks, rank, rescale))
    sub.train(model.training)
    return sub


def extract_gpt_subnet(model: nn.Module, blocks: Sequence[Sequence[torch.Tensor]], rank: int, *,
                       rescale: bool = True) -> GPTSubnet:
    """Rank ``rank``'s :class:`GPTSubnet` of the GPT ``model`` under the partition ``blocks``.

    IST (arXiv 1910.02120, Sec. 3) for transformer blocks; the slicing and the
    scaling are in the module docstring. All tensors are copied in ONE
    :func:`slimcomm.ops.gather_slices_multi` (the subnet owns them: training it
    leaves ``model`` untouched).

    Args:
        model: the GPT (see the module docstring).
        blocks: ``partition(plan widths, world_size, seed, round)``: ``2 L`` lists
            (the heads of each block, then the FFN neurons of each block) of
            ``world_size`` int64 index tensors each.
        rank: which block to take, ``0 <= rank < world_size``.
        rescale: multiply the head and GELU outputs by ``n / |set|`` (default).

    Returns:
        :class:`GPTSubnet` in ``model``'s dtype, device and train/eval mode.

    Raises:
        TypeError / ValueError: unsupported model (naming the attribute), ``blocks``
            not a partition of the heads and FFN neurons, ``rank`` out of range,
            ``rescale`` not a bool.
    """
    plan = _build_gpt_plan(model)
    if not isinstance(rescale, bool):
        raise TypeError(f"rescale must be a bool, got {type(rescale).__name__}")
    world = _check_partition(plan, blocks, rank)
    rows, cols = _slice_indices(plan, _index_sets(plan, blocks, [rank], plan.device)[0])
    sliced_full, shared_full = _full_tensors(plan, model)
    nones = [None] * len(shared_full)
    with torch.no_grad():
        flat = ops.gather_slices_multi(sliced_full + shared_full, rows + nones, cols + nones)
    return _make_subnet(plan, model, blocks, rank, rescale, flat, rows, cols)


def write_back_gpt(model: nn.Module, subnet: GPTSubnet, blocks: Sequence[Sequence[torch.Tensor]],
                   rank: int) -> None:
    """Write rank ``rank``'s (trained) subnet back into ``model``, in place.

    The inverse of :func:`extract_gpt_subnet`: the sliced tensors with ONE
    :func:`slimcomm.ops.scatter_slices_multi`, the shared ones copied whole
    (:class:`~slimcomm.ist.GPTISTTrainer` averages them over the ranks instead).
    ``write_back_gpt(m, extract_gpt_subnet(m, blocks, r), blocks, r)`` leaves ``m``
    bit-identical.

    Raises:
        TypeError / ValueError: as :func:`extract_gpt_subnet`, or a ``subnet`` whose
            tensor shapes do not match the block (checked before anything is written).
    """
    plan = _build_gpt_plan(model)
    world = _check_partition(plan, blocks, rank)
    if not isinstance(subnet, GPTSubnet):
        raise TypeError(f"subnet must be a GPTSubnet, got {type(subnet).__name__}")
    rows, cols = _slice_indices(plan, _index_sets(plan, blocks, [rank], plan.device)[0])
    sliced_full, shared_full = _full_tensors(plan, model)
    names = [s.name for s in plan.sliced] + list(plan.shared)
    parts = []
    for name, full, r, c in zip(names, sliced_full + shared_full, rows + [None] * len(shared_full),
                                cols + [None] * len(shared_full)):
        nr = full.shape[0] if r is None else r.numel()
        shape = (nr,) if full.dim() == 1 else (nr, full.shape[1] if c is None else c.numel())
        part = getattr(subnet, name.replace(".", "__"), None)
        if not isinstance(part, torch.Tensor) or tuple(part.shape) != shape:
            raise ValueError(f"subnet's {name} has shape "
                             f"{None if part is None else tuple(part.shape)}, expected {shape} for rank "
                             f"{rank}'s block")
        parts.append(part.detach().reshape(-1))
    with torch.no_grad():
        n = len(sliced_full)
        ops.scatter_slices_multi(sliced_full, rows, cols, torch.cat(parts[:n]))
        torch._foreach_copy_([t.view(-1) for t in shared_full], parts[n:])
