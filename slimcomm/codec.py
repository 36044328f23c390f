"""Low-bit value codec of the Slim-DP compressor: per-chunk scaled quantisation.

The values a rank sends (a group's packed coordinates, in segment order) are
cut into chunks that never cross a tensor boundary (each tensor's values are
chunked on their own, so the result does not depend on how tensors are
grouped); each chunk has one bf16 scale and every value one ``bits``-bit code:

* ``bits = 1``: ``sign(x) * mean(|x|)`` over the chunk (scaled sign, as in
  1-bit SGD, Seide et al., Interspeech 2014, and EF-signSGD, Karimireddy et
  al., ICML 2019, Alg. 1);
* ``bits = 2``: levels ``{-1, -1/3, 1/3, 1} * max|x|`` (nearest);
* ``bits = 4, 8``: ``round(x / max|x| * L) / L * max|x|`` with
  ``L = 2**(bits-1) - 1`` (nearest, zero representable).

Rounding is deterministic (nearest), so with error feedback the rounding
error is carried to the next round instead of being averaged away by chance;
a rank decodes every rank's codes with the same arithmetic, so all ranks get
bit-identical averages. Every function is a fixed number of tensor ops: no
host sync, no Python loop over values or tensors.
"""

from __future__ import annotations

from typing import List, Tuple

import torch

__all__ = ["BITS", "ChunkPlan", "quantize", "dequantize", "pack_codes", "unpack_codes"]

BITS = (1, 2, 4, 8)
_TINY = 1e-30


class ChunkPlan:
    """Chunk index of each packed value, fixed per group layout.

    Args:
        counts: values per segment, in packed order (segment-contiguous).
        chunk: values per chunk (>= 1); a segment's last chunk may be short.
        device: where the plan lives.

    Attributes:
        chunk_of: int64 ``[K]``, chunk index of each value.
        nchunks: number of chunks.
        sizes: fp32 ``[nchunks]``, values per chunk.
    """

    __slots__ = ("chunk_of", "nchunks", "sizes", "numel")

    def __init__(self, counts: List[int], chunk: int, device: torch.device):
        ids, base = [], 0
        for c in counts:
            if c:
                ids.append(torch.arange(c, device=device) // chunk + base)
                base += -(-c // chunk)
        self.numel = sum(counts)
        self.nchunks = base
        self.chunk_of = torch.cat(ids) if ids else torch.empty(0, dtype=torch.int64, device=device)
        self.sizes = torch.bincount(self.chunk_of, minlength=base).to(torch.float32)


def quantize(vals: torch.Tensor, plan: ChunkPlan, bits: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Codes (uint8 ``[K]``, one per value, in ``[0, 2**bits)``) and bf16 scales ``[nchunks]``.

    Args:
        vals: fp32 ``[K]`` laid out as ``plan`` says.
        plan: the chunk plan.
        bits: one of :data:`BITS`.
    """
    a = vals.abs()
    if bits == 1:
        s = torch.zeros(plan.nchunks, dtype=torch.float32, device=vals.device)
        s.index_add_(0, plan.chunk_of, a).div_(plan.sizes)
    else:
        s = torch.zeros(plan.nchunks, dtype=torch.float32, device=vals.device)
        s.scatter_reduce_(0, plan.chunk_of, a, "amax", include_self=True)
    scales = s.to(torch.bfloat16)
    x = vals / scales.float().clamp_min(_TINY)[plan.chunk_of]
    if bits == 1:
        codes = (x >= 0)
    elif bits == 2:
        codes = torch.round((x + 1.0) * 1.5).clamp_(0, 3)
    else:
        L = 2 ** (bits - 1) - 1
        codes = torch.round(x * L).clamp_(-L, L).add_(L)
    return codes.to(torch.uint8), scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, plan: ChunkPlan, bits: int) -> torch.Tensor:
    """fp32 values from ``codes`` (uint8 ``[..., K]``) and ``scales`` (bf16 ``[..., nchunks]``).

    Leading dimensions (e.g. one row per rank) are decoded together.
    """
    c = codes.to(torch.float32)
    if bits == 1:
        level = c.mul_(2.0).sub_(1.0)
    elif bits == 2:
        level = c.div_(1.5).sub_(1.0)
    else:
        L = 2 ** (bits - 1) - 1
        level = c.sub_(L).div_(L)
    return level.mul_(scales.float()[..., plan.chunk_of])


_SHIFTS = {}  # (device, bits) -> int32 [8 // bits] bit offsets of the codes in a byte


def _shifts(device: torch.device, bits: int) -> torch.Tensor:
    t = _SHIFTS.get((device, bits))
    if t is None:
        t = _SHIFTS[(device, bits)] = torch.arange(0, 8, bits, dtype=torch.int32, device=device)
    return t


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``8 // bits`` codes per byte (low bits first); uint8 ``[ceil(K * bits / 8)]``."""
    per = 8 // bits
    pad = (-codes.numel()) % per
    c = torch.nn.functional.pad(codes, (0, pad)).view(-1, per).to(torch.int32)
    return (c << _shifts(codes.device, bits)).sum(1).to(torch.uint8)


def unpack_codes(packed: torch.Tensor, numel: int, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes` over the last dimension: uint8 ``[..., numel]``."""
    c = (packed.to(torch.int32).unsqueeze(-1) >> _shifts(packed.device, bits)) & ((1 << bits) - 1)
    return c.flatten(-2)[..., :numel].to(torch.uint8)
