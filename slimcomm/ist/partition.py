"""The per-round partition of the hidden neurons: :func:`partition`, a pure function of
``(hidden_sizes, world_size, seed, round)`` (every rank computes the same blocks without
communicating), :func:`shared_counts` (the neurons every subnet holds) and the integer
checks the package shares."""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

import torch

_MASK64 = (1 << 64) - 1


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
