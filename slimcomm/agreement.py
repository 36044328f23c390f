"""Cross-rank agreement checks: a mistake one rank can detect becomes an error
on every rank instead of a hang in the next collective.

Used by the Slim-DP hook (bucket layouts, index sets), the IST trainer (model
fingerprints) and the training command (configurations). Each check is one
all-reduce of a few int64 values (plus one all_gather of a flag per rank when
some rank failed, to name it), so it costs the same at any world size.
"""

from __future__ import annotations

from typing import List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist

from . import _comm

__all__ = ["max_min_across_ranks", "gather_across_ranks", "agree_across_ranks"]


def max_min_across_ranks(vals: torch.Tensor, group=None,
                         timeout: Optional[float] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Element-wise max and min of an int64 tensor over the ranks of ``group``.

    One all-reduce (MAX of ``[x, -x]``); equal max and min mean every rank
    holds the same value. Collective: every rank of ``group`` must call it.

    Args:
        vals: int64 ``[n]`` on the device the backend reduces on (CPU for gloo).
        group: process group (default: the world).
        timeout: seconds this collective may wait (``None``: the process
            group's timeout); a failure or timeout raises
            :class:`slimcomm._comm.CollectiveError`.

    Returns:
        ``(max, min)``, each int64 ``[n]``.
    """
    both = torch.cat([vals, -vals])
    _comm.wait(_comm.all_reduce(both, group, dist.ReduceOp.MAX, timeout),
               "cross-rank agreement check", timeout)
    n = vals.numel()
    return both[:n], -both[n:]


def _reduce_device(group, device: Optional[torch.device]) -> torch.device:
    """``device``, or the current GPU for an NCCL group, else the CPU."""
    if device is not None:
        return device
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def gather_across_ranks(value: int, group=None, device: Optional[torch.device] = None,
                        timeout: Optional[float] = None) -> List[int]:
    """Every rank's int64 ``value``, indexed by rank in ``group`` (one all_gather).

    Collective. For error messages (which ranks failed, which ranks agree);
    the checks themselves use :func:`max_min_across_ranks`.
    """
    mine = torch.tensor([int(value)], dtype=torch.int64, device=_reduce_device(group, device))
    everyone = torch.empty(dist.get_world_size(group), dtype=torch.int64, device=mine.device)
    _comm.wait(_comm.all_gather(everyone, mine, group, timeout), "cross-rank agreement check",
               timeout)
    return everyone.tolist()


def agree_across_ranks(values: Mapping[str, int], error: Optional[BaseException], *,
                       other_failed: str, group=None,
                       device: Optional[torch.device] = None,
                       timeout: Optional[float] = None) -> List[str]:
    """Exchange named int64 values and a failure flag; report what differs.

    Collective: every rank of ``group`` calls it with the same names, also a
    rank whose local validation failed (it passes its exception as ``error``
    and any placeholders as ``values``), so no rank is left waiting.

    Args:
        values: name -> value in ``[-2**63 + 1, 2**63)``; the same names in
            the same order on every rank.
        error: this rank's failure, re-raised after the exchange.
        other_failed: message of the RuntimeError raised on the ranks that did
            not fail when another rank did.
        group: process group (default: the world).
        device: where the values are reduced (default: the current GPU for
            an NCCL group, else the CPU).
        timeout: seconds each collective may wait (``None``: the process
            group's timeout).

    Returns:
        the names whose values differ across ranks (empty if all agree).

    Raises:
        ``error`` on the rank that failed; on every other rank, when any rank
        failed, RuntimeError(``other_failed``) naming the failed ranks (found
        with one extra all_gather, only on this path).
    """
    device = _reduce_device(group, device)
    vals = torch.tensor([int(error is not None)] + [int(v) for v in values.values()],
                        dtype=torch.int64, device=device)
    hi, lo = max_min_across_ranks(vals, group, timeout)
    hi, lo = hi.tolist(), lo.tolist()
    if hi[0] != 0:
        # Rare path, taken by every rank alike: one more collective names the failed ranks.
        flags = gather_across_ranks(int(error is not None), group, device, timeout)
        if error is not None:
            raise error
        failed = [r for r, f in enumerate(flags) if f != 0]
        raise RuntimeError(f"{other_failed} (failed rank(s) {failed} of the process group)")
    return [name for i, name in enumerate(values, start=1) if hi[i] != lo[i]]
