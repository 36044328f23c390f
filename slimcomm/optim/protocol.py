"""The cross-rank protocol of a synchronisation: the agreement of the ranks' counters
before any value collective, the failed state (after a failed synchronisation the
optimizer refuses further use), and ``join()`` for uneven inputs."""

from __future__ import annotations

import contextlib
from typing import Any, Dict

import torch

from .. import _comm
from .._comm import CollectiveError


class _ProtocolMixin:
    """Agreement, failure and ``join()`` of :class:`~slimcomm.optim.SlimDPOptimizer`."""

    def _check_usable(self) -> None:
        if self._failed is not None:
            raise CollectiveError(f"SlimDPOptimizer cannot be used after a failed "
                                  f"synchronisation: {self._failed}")

    def _what(self) -> str:
        return (f"SlimDPOptimizer.synchronize (synchronisation {self.syncs + 1}, local step "
                f"{self.local_step})")

    def _fail(self, exc: BaseException):
        self._failed = str(exc)
        return exc

    def _agree(self, joined: bool) -> Dict[str, Any]:
        """The per-sync agreement (see :meth:`synchronize`); raises on every rank if the
        counters of the ranks that have not joined differ. Returns what every rank
        learnt: ``any_active`` (some rank still steps), ``unsynced`` (some rank has
        local steps since the last synchronisation)."""
        vals = [0 if joined else 1, self.syncs, self.compressor.step,
                None if joined else self.local_step, int(self.local_step != self._synced_at)]
        dev = self._groups[0].outer.device
        try:
            hi, lo = _comm.agree_counters(vals, self.process_group, self.timeout, dev,
                                          self._what())
        except CollectiveError:
            self._failed = "a rank died or hung (see the first error)"
            raise
        self.compressor._count_check(2 * 8 * len(vals))
        if hi[1] != lo[1] or hi[2] != lo[2] or hi[3] != lo[3]:
            # Rare path, taken by every rank alike: one more collective names the ranks.
            rows = _comm.gather_rows([-1 if v is None else v for v in vals],
                                     self.process_group, self.timeout, dev)
            where = ", ".join(
                f"rank {r}: " + ("joined" if row[0] == 0 else f"local step {row[3]}")
                + f", {row[1]} synchronisations done" for r, row in enumerate(rows))
            raise self._fail(CollectiveError(
                f"{self._what()}: the ranks reached this synchronisation at different "
                f"points ({where}). Every rank must call step() (or advance()) the same "
                f"number of times and synchronize() at the same local step. Usual causes: "
                f"uneven inputs (a rank ran out of batches: wrap the training loop in "
                f"`with opt.join():`, or agree on the number of steps up front); "
                f"synchronize() called on some ranks only (e.g. in an evaluation block on "
                f"rank 0); a step skipped without advance(). Nothing was synchronised; "
                f"restart every rank from the last checkpoint"))
        return {"any_active": hi[0] == 1, "unsynced": hi[4] == 1}

    @contextlib.contextmanager
    def join(self):
        """Context manager for uneven inputs: ranks may run different numbers of steps.

        A rank whose loop inside the block ends first *shadows* the others'
        synchronisations when it leaves the block (like DDP's ``join()``): it
        takes part in every synchronisation the other ranks still do, sending
        the local progress it had not synchronised yet and then nothing new
        (its error feedback residual still drains), and applies the same outer
        step, so its outer parameters stay identical. When every rank has left
        its loop, one last synchronisation runs if any rank has unsynchronised
        local steps, and every rank leaves the block with identical parameters.
        A rank that finished waits up to ``timeout`` seconds per synchronisation
        of the others (the time ``sync_every`` steps take must stay below it).

        Example::

            with opt.join():
                for x, y in loader:        # loaders of different lengths per rank
                    opt.zero_grad()
                    loss_fn(model(x), y).backward()
                    opt.step()
            # here: every rank synchronised, replicas identical

        The alternative without ``join()``: agree on the number of steps up front
        (e.g. ``n = min over ranks of len(loader)`` with one all-reduce MIN) and
        run exactly ``n`` steps on every rank.

        Raises:
            CollectiveError: as :meth:`synchronize` (e.g. a rank not inside
                ``join()`` ran out of batches, or a rank died).
            RuntimeError: ``join()`` entered while already joined.
        """
        self._check_usable()
        if self._joined:
            raise RuntimeError("SlimDPOptimizer.join() is already active (it cannot nest)")
        self._joined = True
        try:
            yield self
        except BaseException:
            self._joined = False
            raise
        try:
            with torch.no_grad():
                while True:
                    seen = self._agree(joined=True)
                    if not seen["any_active"]:
                        if seen["unsynced"]:
                            self._sync_collectives()  # the last one, every rank together
                        break
                    self._sync_collectives()  # shadow an active rank's synchronisation
                self._drain()   # delay_syncs=1: apply the one in flight, every rank alike
        finally:
            self._joined = False
