"""The Slim-DP compressor core (:class:`SlimDPCompressor`), split by job into modules."""

from .core import SlimDPCompressor, explore_rng_offset, selection_sizes

__all__ = ["SlimDPCompressor", "selection_sizes", "explore_rng_offset"]
