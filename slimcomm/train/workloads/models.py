"""Models the training command trains: an MLP, a small convnet and a decoder-only GPT.

All three are plain ``torch.nn`` modules with no buffers, so DDP has nothing to
broadcast besides the initial weights, and a synchroniser that does not use
DDP (an optimizer-side one) has no unsynchronised state to worry about.

* :func:`build_mlp`: ``nn.Sequential`` of Linear + ReLU (what
  :class:`slimcomm.ist.ISTTrainer` partitions).
* :class:`ConvNet`: conv + GroupNorm + ReLU + max-pool blocks, then two
  Linear layers, for small images such as Fashion-MNIST ``1 x 28 x 28``.
* :class:`GPT`: decoder-only transformer (token + learned position
  embeddings, pre-LayerNorm blocks of causal self-attention and a GELU MLP,
  final LayerNorm, untied linear head), in the GPT-2 arrangement (Radford et
  al., 2019).
"""

from __future__ import annotations

import math
from typing import List, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["build_mlp", "ConvNet", "GPT", "num_params"]


def num_params(model: nn.Module) -> int:
    """Number of parameter elements of ``model`` (each shared tensor counted once)."""
    return sum(p.numel() for p in model.parameters())


def _check_pos_int(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be a positive integer, got {v!r}")
    return v


def build_mlp(in_features: int, hidden: Sequence[int], num_classes: int) -> nn.Sequential:
    """``nn.Sequential`` MLP: Linear(in, h1), ReLU, ..., Linear(h_last, num_classes).

    Input float ``[N, in_features]``, output logits float ``[N, num_classes]``.
    With the training command's defaults (784 inputs, hidden 2048, 2048, 10
    classes) it has 5,824,522 parameters.

    Raises:
        ValueError: a size is not a positive integer (named).
    """
    _check_pos_int("in_features", in_features)
    _check_pos_int("num_classes", num_classes)
    for i, h in enumerate(hidden):
        _check_pos_int(f"hidden[{i}]", h)
    layers: List[nn.Module] = []
    prev = in_features
    for h in hidden:
        layers += [nn.Linear(prev, h), nn.ReLU()]
        prev = h
    layers.append(nn.Linear(prev, num_classes))
    return nn.Sequential(*layers)


class ConvNet(nn.Module):
    """A small convnet for ``C x S x S`` images (Fashion-MNIST: ``1 x 28 x 28``).

    Per entry of ``channels``: Conv2d 3x3 (padding 1) -> GroupNorm -> ReLU ->
    MaxPool2d(2); then flatten -> Linear(``channels[-1] * (S // 2**len(channels))**2``,
    ``hidden``) -> ReLU -> Linear(``hidden``, ``num_classes``). GroupNorm
    instead of BatchNorm: no running statistics, so nothing differs between
    ranks but the weights. With the defaults (1 x 28 x 28, channels (32, 64),
    hidden 128, 10 classes) it has 421,834 parameters.

    Args:
        num_classes: output classes.
        in_channels: ``C``.
        image_size: ``S`` (square images); ``S // 2**len(channels)`` must be >= 1.
        channels: output channels of each conv block (at least one).
        hidden: width of the hidden Linear layer.
        groups: GroupNorm groups per block (capped at the block's channels;
            must divide them).

    Shapes:
        input float ``[N, C, S, S]`` -> logits float ``[N, num_classes]``.

    Raises:
        ValueError: a size is not a positive integer, the image is too small
            for the number of pooling steps, or ``groups`` does not divide a
            block's channels (each named).
    """

    def __init__(self, num_classes: int = 10, in_channels: int = 1, image_size: int = 28,
                 channels: Sequence[int] = (32, 64), hidden: int = 128, groups: int = 8):
        super().__init__()
        _check_pos_int("num_classes", num_classes)
        _check_pos_int("in_channels", in_channels)
        _check_pos_int("image_size", image_size)
        _check_pos_int("hidden", hidden)
        _check_pos_int("groups", groups)
        channels = tuple(channels)
        if not channels:
            raise ValueError("channels must list at least one conv block")
        for i, c in enumerate(channels):
            _check_pos_int(f"channels[{i}]", c)
        side = image_size // 2 ** len(channels)
        if side < 1:
            raise ValueError(f"image_size {image_size} is too small for {len(channels)} 2x2 poolings")
        blocks: List[nn.Module] = []
        prev = in_channels
        for c in channels:
            g = min(groups, c)
            if c % g:
                raise ValueError(f"groups {groups} must divide every entry of channels, got {c}")
            blocks += [nn.Conv2d(prev, c, 3, padding=1), nn.GroupNorm(g, c), nn.ReLU(), nn.MaxPool2d(2)]
            prev = c
        self.in_channels = in_channels
        self.image_size = image_size
        self.features = nn.Sequential(*blocks)
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(prev * side * side, hidden), nn.ReLU(),
                                        nn.Linear(hidden, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` float ``[N, C, S, S]`` -> logits ``[N, num_classes]``."""
        if x.dim() != 4 or x.shape[1] != self.in_channels or x.shape[2:] != (self.image_size, self.image_size):
            raise ValueError(f"x must be [N, {self.in_channels}, {self.image_size}, {self.image_size}], "
                             f"got {list(x.shape)}")
        return self.classifier(self.features(x))


class _CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float):
        super().__init__()
        self.n_head = n_head
        self.dropout = dropout
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        # [B, T, C] -> [B, H, T, C / H]
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0,
                                           is_causal=True)
        y = y.transpose(1, 2).reshape(b, t, c)
        return self.resid_drop(self.proj(y))


class _Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float):
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = _CausalSelfAttention(n_embd, n_head, dropout)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd),
                                 nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Decoder-only transformer language model (GPT-2 arrangement, Radford et al., 2019).

    ``logits = head(ln_f(blocks(tok_emb(idx) + pos_emb(0..T-1))))`` where each
    of the ``n_layer`` blocks is pre-LayerNorm: ``x + attn(ln1(x))`` then
    ``x + mlp(ln2(x))``; ``attn`` is causal multi-head self-attention through
    :func:`torch.nn.functional.scaled_dot_product_attention` (``is_causal=True``)
    and ``mlp`` is Linear(d, 4d) -> GELU -> Linear(4d, d). The head is an
    untied Linear(d, vocab_size) without bias. Initialisation: normal(0, 0.02)
    for Linear and Embedding weights, zero biases, and normal(0, 0.02 /
    sqrt(2 n_layer)) for the two projections that write into the residual
    stream (GPT-2's scaled residual init). Dropout (on the embeddings, the
    attention probabilities and both residual branches) is active only in
    ``train()`` mode.

    Args:
        vocab_size: number of token ids ``V``.
        block_size: longest context ``T_max`` (size of the position table).
        n_layer: number of blocks.
        n_embd: model width ``d``; a multiple of ``n_head``.
        n_head: attention heads (head size ``d / n_head``).
        dropout: dropout probability in ``[0, 1)``.

    Shapes:
        ``idx`` int64 (or int32) ``[B, T]`` with ``1 <= T <= block_size`` and
        values in ``[0, V)`` -> logits float32 ``[B, T, V]``; logit ``[b, t]``
        depends only on ``idx[b, :t + 1]``.

    Parameters: ``V d + T_max d + n_layer (12 d^2 + 13 d) + 2 d + d V``
    (embeddings, blocks with biases and LayerNorms, final LayerNorm, head).

    Raises:
        ValueError: a size is not a positive integer, ``n_embd`` is not a
            multiple of ``n_head`` or ``dropout`` is outside ``[0, 1)``
            (named); in :meth:`forward`, ``idx`` of the wrong rank, dtype or
            length.
    """

    def __init__(self, vocab_size: int, block_size: int = 64, n_layer: int = 2, n_embd: int = 128,
                 n_head: int = 2, dropout: float = 0.0):
        super().__init__()
        for name, v in (("vocab_size", vocab_size), ("block_size", block_size), ("n_layer", n_layer),
                        ("n_embd", n_embd), ("n_head", n_head)):
            _check_pos_int(name, v)
        if n_embd % n_head:
            raise ValueError(f"n_embd ({n_embd}) must be a multiple of n_head ({n_head})")
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.n_layer, self.n_embd, self.n_head, self.dropout = n_layer, n_embd, n_head, float(dropout)
        self.tok_emb = nn.Embedding(vocab_size, n_embd)
        self.pos_emb = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(_Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        self._init_weights()

    def _init_weights(self) -> None:
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
        resid_std = 0.02 / math.sqrt(2 * self.n_layer)
        for blk in self.blocks:
            nn.init.normal_(blk.attn.proj.weight, mean=0.0, std=resid_std)
            nn.init.normal_(blk.mlp[2].weight, mean=0.0, std=resid_std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """``idx`` int ``[B, T]`` (``T <= block_size``) -> logits float ``[B, T, vocab_size]``."""
        if idx.dim() != 2 or idx.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"idx must be an int64/int32 [B, T] tensor, got {idx.dtype} {list(idx.shape)}")
        t = idx.shape[1]
        if not 1 <= t <= self.block_size:
            raise ValueError(f"idx has {t} positions; must be in [1, block_size={self.block_size}]")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))
