"""Count dispatched ATen ops and host syncs around a call (tests and benchmarks).

On a GPU every dispatched op is roughly one kernel launch and every
``aten._local_scalar_dense`` (what ``.item()``, ``bool(tensor)``,
``int(tensor)`` and ``.tolist()`` dispatch) stalls the host until the device
is done. Counting them on CPU is deterministic, so the hot paths of the hook
and of the optimizer-side sync are held to a budget by tests
(``tests/test_hot_path.py``) and reported by ``bench/hook_overhead.py``.

Not part of the public API.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Iterator

import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["OpCounter", "synchronous_collectives", "HOST_SYNC", "VIEW_OPS", "HOST_ONLY_OPS"]

#: the op every host read of a device scalar dispatches
HOST_SYNC = "_local_scalar_dense"

#: metadata-only ops (no kernel launch on a GPU), reported apart from the rest
VIEW_OPS = frozenset({
    "view", "_unsafe_view", "slice", "select", "as_strided", "reshape", "alias", "t",
    "transpose", "permute", "expand", "unsqueeze", "squeeze", "detach", "split",
    "split_with_sizes", "narrow", "unbind", "flatten", "view_as",
})


#: host-only ops (no tensor in or out, no kernel, no sync), not counted: the thread-local
#: index-check mode switch of :func:`slimcomm.ops.trusted_indices`
HOST_ONLY_OPS = frozenset({"slimcomm._cuda_checks"})


class OpCounter(TorchDispatchMode):
    """``with OpCounter() as c: ...`` counts ``func.overloadpacket`` names in ``c.ops``.

    ``c.total`` is every dispatched op, ``c.launches`` those that are not
    views nor collectives (namespace ``c10d``), ``c.host_syncs`` the
    ``_local_scalar_dense`` calls. The mode is thread-local: ops run on another
    thread (a future's callback completed by the backend) are not seen, see
    :func:`synchronous_collectives`.
    """

    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        pkt = func.overloadpacket
        ns = getattr(pkt, "_qualified_op_name", "aten::").split("::")[0]
        name = pkt.__name__ if ns == "aten" else f"{ns}.{pkt.__name__}"
        if name not in HOST_ONLY_OPS:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    @property
    def host_syncs(self) -> int:
        return self.ops[HOST_SYNC]

    @property
    def launches(self) -> int:
        return self.total - self.views - self.collectives

    @property
    def views(self) -> int:
        return sum(n for k, n in self.ops.items() if k in VIEW_OPS)

    @property
    def collectives(self) -> int:
        return sum(n for k, n in self.ops.items() if k.startswith("c10d."))

    def reset(self) -> None:
        self.ops.clear()


@contextlib.contextmanager
def synchronous_collectives(*modules) -> Iterator[None]:
    """Make ``dist.all_reduce`` / ``dist.all_gather_into_tensor`` and
    :mod:`slimcomm._comm`'s ``all_reduce`` / ``all_gather`` (what ``modules`` issue
    their collectives through) wait before returning, so that a
    ``fut.then(cb)`` on their futures runs ``cb`` inline in the calling thread, where an
    :class:`OpCounter` sees it. Results are unchanged (the same collectives, in the
    same order)."""
    from . import _comm

    real_ar = dist.all_reduce
    real_ag = dist.all_gather_into_tensor
    real_comm = (_comm.all_reduce, _comm.all_gather)

    def wrap(real):
        def call(*args, async_op=False, **kwargs):
            work = real(*args, async_op=True, **kwargs)
            work.wait()
            return work if async_op else None
        return call

    def wrap_comm(real):
        def call(*args, **kwargs):
            work = real(*args, **kwargs)
            work.wait()
            return work
        return call

    try:
        dist.all_reduce = wrap(real_ar)
        dist.all_gather_into_tensor = wrap(real_ag)
        _comm.all_reduce, _comm.all_gather = (wrap_comm(f) for f in real_comm)
        yield
    finally:
        dist.all_reduce = real_ar
        dist.all_gather_into_tensor = real_ag
        _comm.all_reduce, _comm.all_gather = real_comm
