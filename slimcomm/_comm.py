"""Collectives with a bounded wait, and the per-sync agreement on the counters.

Internal. :class:`slimcomm.optim.SlimDPOptimizer` and
:class:`slimcomm.ist.ISTTrainer` (and the compressor core they share with the
DDP hook) issue their collectives through these functions:

* ``timeout`` (seconds, or ``None`` for the process group's own timeout, which
  is 30 minutes on gloo by default) is handed to the backend with the
  collective's options (``AllreduceOptions.timeout``, ...). Gloo then aborts
  that one collective after ``timeout`` seconds with an error on the waiting
  rank, and closes the connections, so the other survivors fail at once too;
  the process group's default is not changed (the user's own collectives keep
  theirs). NCCL's watchdog honours the same per-collective timeout.
* A rank that died (exit, crash, SIGKILL) closes its sockets, so gloo raises
  "Connection closed/reset by peer" on the ranks that wait for it within
  about a second; ``timeout`` bounds the case of a rank that is alive but
  stopped calling the collectives (hung, or ran out of batches).

:func:`agree_counters` is the per-sync agreement: one all-reduce (MAX of
``[x, -x]``) of a few int64 counters; equal max and min mean every rank holds
the same value. A rank may pass ``None`` for a counter ("no opinion", e.g. the
local step of a rank that already joined), which then leaves it out.
"""

from __future__ import annotations

from datetime import timedelta
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

__all__ = ["CollectiveError", "all_reduce", "two_shot_all_reduce", "all_gather", "all_to_all",
           "broadcast", "wait", "agree_counters", "gather_rows", "check_timeout"]

#: "no opinion" in :func:`agree_counters`; counters must lie strictly inside (-_NONE, _NONE)
_NONE = 2 ** 62


class CollectiveError(RuntimeError):
    """A collective failed or timed out (a peer rank died, hung, or stopped calling
    the same collectives), or the ranks' synchronisation counters disagree. Raised on
    every surviving rank; the model was not changed by the failed synchronisation."""


def check_timeout(timeout, owner: str) -> Optional[float]:
    """``timeout`` as float seconds (``None`` kept); ValueError naming the argument."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or \
            not 0 < timeout < float("inf"):
        raise ValueError(f"{owner}: timeout must be a finite number of seconds > 0 or None "
                         f"(the process group's own timeout), got {timeout!r}")
    return float(timeout)


def _group(group):
    return group if group is not None else dist.distributed_c10d._get_default_group()


def _td(timeout: float) -> timedelta:
    return timedelta(seconds=timeout)


def all_reduce(tensor: torch.Tensor, group=None, op=dist.ReduceOp.SUM,
               timeout: Optional[float] = None):
    """Start an all-reduce of ``tensor`` in place; returns the ``Work``. ``timeout``:
    seconds for this collective (``None``: the process group's)."""
    if timeout is None:
        return dist.all_reduce(tensor, op=op, group=group, async_op=True)
    opts = dist.AllreduceOptions()
    opts.reduceOp = op
    opts.timeout = _td(timeout)
    opts.asyncOp = True
    return _group(group).allreduce([tensor], opts)


def two_shot_all_reduce(tensor: torch.Tensor, group=None, timeout: Optional[float] = None,
                        what: str = "two-shot all-reduce") -> torch.futures.Future:
    """Sum ``tensor`` (``[n]``) over the ranks in two direct exchanges; returns a future
    of ``[sum]`` (``[n]``, ``tensor``'s dtype; ``tensor`` itself is left as it is).

    The two-shot (direct) all-reduce: the ``[n]`` vector, zero-padded to ``W c``
    (``c = ceil(n / W)``), is cut into ``W`` blocks; one all-to-all sends block ``j`` to
    rank ``j`` (reduce-scatter), rank ``j`` sums the ``W`` copies of its block in fp32
    in rank order and rounds once to the dtype, and a second all-to-all sends that block
    to every rank (all-gather). Each rank puts ``2 (W-1) c`` elements on its link, what
    a ring all-reduce puts there, but every message of a phase is posted at once, so the
    latency is two one-way delays instead of the ring's ``2 (W-1)`` hops (Thakur,
    Rabenseifner, Gropp, "Optimization of collective communication operations in MPICH",
    IJHPCA 2005, Sec. 4: reduce-scatter + all-gather; here both by direct exchange).
    Every block is summed by one rank and sent as the same bits to all, so the result is
    bit-identical on every rank and does not depend on where a value sits in the vector.

    The first exchange is waited for in the calling thread (with gloo: a blocking wait;
    with NCCL: the current stream waits), so the second is issued from the same thread
    as every other collective (the ordering rule of :mod:`slimcomm.compressor.transports`).

    Raises:
        CollectiveError: the first exchange failed or timed out (raised here, naming
            ``what``); a failure of the second raises from the future's ``value()``.
    """
    W = dist.get_world_size(group)
    n = tensor.numel()
    if n == 0:  # the same n on every rank: nothing to exchange anywhere
        fut = torch.futures.Future()
        fut.set_result([tensor.reshape(-1).clone()])
        return fut
    c = -(-n // W)
    if c * W == n:
        send = tensor.reshape(-1)
    else:
        send = torch.zeros(c * W, dtype=tensor.dtype, device=tensor.device)
        send[:n].copy_(tensor.reshape(-1))
    recv = torch.empty_like(send)
    wait(all_to_all(recv, send, group, timeout), what, timeout)
    rows = recv.view(W, c)
    acc = rows[0].to(torch.float32, copy=True)
    for j in range(1, W):  # rank order: the same bits whatever the layout
        acc.add_(rows[j])
    block = acc.to(tensor.dtype)
    out = torch.empty_like(send)
    fut = all_to_all(out, block.repeat(W), group, timeout).get_future()

    def done(f):
        f.value()  # raises if the second exchange failed: its output is never read
        return [out[:n]]

    return fut.then(done)


def all_gather(output: torch.Tensor, input: torch.Tensor, group=None,
               timeout: Optional[float] = None):
    """Start an all-gather of ``input`` (``[n]``) into ``output`` (``[world_size * n]``,
    rank-major); returns the ``Work``."""
    if timeout is None:
        fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return fn(output, input, group=group, async_op=True)
    opts = dist.distributed_c10d.AllgatherOptions()
    opts.timeout = _td(timeout)
    opts.asyncOp = True
    return _group(group).all_gather_single(output, input, opts)


def all_to_all(output: torch.Tensor, input: torch.Tensor, group=None,
               timeout: Optional[float] = None):
    """Start an all-to-all of equal splits: ``input`` (``[world_size * n]``, block ``j``
    for group rank ``j``) into ``output`` (``[world_size * n]``, block ``j`` from group
    rank ``j``); returns the ``Work``."""
    if timeout is None:
        return dist.all_to_all_single(output, input, group=group, async_op=True)
    opts = dist.AllToAllOptions()
    opts.timeout = _td(timeout)
    opts.asyncOp = True
    return _group(group).alltoall_base(output, input, [], [], opts)


def broadcast(tensor: torch.Tensor, src: int, group=None, timeout: Optional[float] = None):
    """Start a broadcast of ``tensor`` from group rank ``src``; returns the ``Work``."""
    if timeout is None:
        glob = dist.get_global_rank(group, src) if group is not None else src
        return dist.broadcast(tensor, src=glob, group=group, async_op=True)
    opts = dist.BroadcastOptions()
    opts.rootRank = src
    opts.rootTensor = 0
    opts.timeout = _td(timeout)
    opts.asyncOp = True
    return _group(group).broadcast([tensor], opts)


def wait(work, what: str, timeout: Optional[float]):
    """Wait for ``work`` (a ``Work`` or a future); on failure raise
    :class:`CollectiveError` that names ``what`` and the likely causes."""
    try:
        if hasattr(work, "value"):  # a future (torch.futures.Future or torch._C.Future)
            return work.wait()
        work.wait()
        return None
    except CollectiveError:
        raise
    except Exception as exc:  # noqa: BLE001 - every backend error becomes one clear error
        raise failure(what, timeout, exc) from exc


def failure(what: str, timeout: Optional[float], exc: BaseException) -> CollectiveError:
    """The :class:`CollectiveError` for a failed collective of ``what``."""
    limit = "the process group's timeout" if timeout is None else f"timeout={timeout:g} s"
    return CollectiveError(
        f"{what}: a collective failed ({type(exc).__name__}: {str(exc).splitlines()[0][:300]}). "
        f"Another rank died (crash, exit, SIGKILL, pre-emption), did not reach this "
        f"collective within {limit} (hung, or it ran out of batches: see join()), or "
        f"issued a different collective. Nothing from this synchronisation was written into "
        f"the model; this object cannot continue: restart every rank from the last checkpoint")


def gather_rows(vals: Sequence[int], group=None, timeout: Optional[float] = None,
                device=None) -> List[List[int]]:
    """Every rank's int64 vector ``vals`` (same length on every rank), by group rank
    (one all-gather; for error messages)."""
    mine = torch.tensor(list(vals), dtype=torch.int64, device=device)
    out = torch.empty(dist.get_world_size(group) * mine.numel(), dtype=torch.int64,
                      device=mine.device)
    wait(all_gather(out, mine, group, timeout), "agreement", timeout)
    return out.view(-1, mine.numel()).tolist()


def agree_counters(vals: Sequence[Optional[int]], group=None, timeout: Optional[float] = None,
                   device=None, what: str = "agreement") -> Tuple[List[Optional[int]],
                                                                 List[Optional[int]]]:
    """``(max, min)`` over the ranks of each counter in ``vals`` (int or ``None`` = no
    opinion, left out; ``None`` comes back where no rank had one). One all-reduce of
    ``2 * len(vals)`` int64 and one host read; collective."""
    xs = []
    for v in vals:
        if v is not None and not -_NONE < v < _NONE:
            raise ValueError(f"{what}: counter {v} out of range")
    xs = [(-_NONE if v is None else v) for v in vals] + [(-_NONE if v is None else -v)
                                                           for v in vals]
    both = torch.tensor(xs, dtype=torch.int64, device=device)
    wait(all_reduce(both, group, dist.ReduceOp.MAX, timeout), what, timeout)
    out = both.tolist()
    n = len(vals)
    hi = [None if x == -_NONE else x for x in out[:n]]
    lo = [None if x == -_NONE else -x for x in out[n:]]
    return hi, lo
