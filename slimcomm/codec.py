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
bit-identical averages.

The arithmetic lives in two fused ops, :func:`slimcomm.ops.quantize_chunks`
and :func:`slimcomm.ops.dequantize_chunks_mean` (defined executably by
:mod:`slimcomm.reference`); this module only holds the chunk layout of a group,
built once per layout on the host, so that the ops run without a host sync.
"""

from __future__ import annotations

from typing import List, Tuple

import torch

from . import ops

__all__ = ["BITS", "ChunkPlan"]

BITS = ops.CODEC_BITS


class ChunkPlan:
    """The chunk layout of a group's packed values, fixed per group layout.

    Args:
        counts: values per segment, in packed order (segment-contiguous).
        chunk: values per chunk (>= 1); a segment's last chunk may be short.
        device: where the plan lives.

    Attributes:
        offsets: int64 ``[S + 1]`` on ``device``, the segment offsets of the values.
        chunk: values per chunk.
        nchunks: number of chunks (:func:`slimcomm.ops.chunk_count`).
        numel: number of values ``K``.
    """

    __slots__ = ("offsets", "chunk", "nchunks", "numel")

    def __init__(self, counts: List[int], chunk: int, device: torch.device):
        o = [0]
        for c in counts:
            o.append(o[-1] + int(c))
        self.offsets = torch.tensor(o, dtype=torch.int64, device=device)
        self.chunk = chunk
        self.nchunks = ops.chunk_count(counts, chunk)
        self.numel = o[-1]

    def quantize(self, vals: torch.Tensor, bits: int) -> Tuple[torch.Tensor, torch.Tensor,
                                                                torch.Tensor]:
        """``(packed uint8, scales bf16 [nchunks], error fp32 [K])`` of fp32 ``vals [K]``
        (:func:`slimcomm.ops.quantize_chunks`)."""
        return ops.quantize_chunks(vals, self.offsets, self.chunk, bits, self.nchunks)

    def dequantize_mean(self, packed: torch.Tensor, scales: torch.Tensor, bits: int,
                        divisor: float) -> torch.Tensor:
        """fp32 ``[K]``: the rows of ``packed`` uint8 ``[R, >= bytes]`` / ``scales`` bf16
        ``[R, nchunks]`` decoded, summed in row order, divided by ``divisor``
        (:func:`slimcomm.ops.dequantize_chunks_mean`)."""
        return ops.dequantize_chunks_mean(packed, scales, self.offsets, self.chunk, bits,
                                          self.numel, divisor)
