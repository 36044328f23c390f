"""Optimizer-side Slim-DP (:class:`SlimDPOptimizer`), split by job into modules."""

from .optimizer import COMPRESSIONS, CollectiveError, SlimDPOptimizer

__all__ = ["SlimDPOptimizer", "COMPRESSIONS", "CollectiveError"]
