"""The cross-rank protocol of :class:`~slimcomm.ist.ISTTrainer`: the fingerprint agreement
of construction and checkpoint loads, the broadcast of rank 0's model, the per-round
agreement of the ranks' counters before any exchange, the failed state (after a failed
synchronisation the trainer refuses further use), and ``join()`` for uneven inputs."""

from __future__ import annotations

import contextlib
from typing import Dict, List, Optional

import torch

from .. import _comm, ops
from .._comm import CollectiveError
from ..agreement import agree_across_ranks, gather_across_ranks

_FP_ERROR = -1  # placeholder fingerprint of a rank whose validation failed (sent with its failure flag)


class _ProtocolMixin:
    """Agreement, broadcast, failure and ``join()`` of :class:`~slimcomm.ist.ISTTrainer`."""

    def _check_agreement(self, fingerprint: int, error: Optional[Exception],
                         disagree: Optional[str] = None) -> None:
        """All ranks: exchange a 63-bit fingerprint and whether this rank failed
        (with ``error``) in one all-reduce; raise on every rank if any rank failed
        or the fingerprints differ (``disagree`` says what they cover; the
        message groups the ranks by fingerprint)."""
        differ = agree_across_ranks(
            {"fingerprint": fingerprint}, error, group=self._pg,
            timeout=getattr(self, "_timeout", None),
            other_failed=("ISTTrainer: another rank of the process group rejected its model or "
                          "arguments (see the error raised there); no rank can proceed"))
        if differ:
            # Rare path, reached by every rank alike: gather the fingerprints to name the groups.
            groups: Dict[int, List[int]] = {}
            for r, v in enumerate(gather_across_ranks(fingerprint, self._pg)):
                groups.setdefault(v, []).append(r)
            if disagree is None:
                disagree = ("the ranks disagree on the model architecture, dtype or IST "
                            "settings (seed, local_steps, rescale, scale_grads, broadcast_model)")
                hint = "Build the same model with the same arguments on every rank."
            else:
                hint = "Load the checkpoint of the same synchronisation round on every rank."
            raise RuntimeError(f"ISTTrainer: {disagree}; ranks grouped by fingerprint: "
                               f"{sorted(groups.values())}. {hint}")

    def _broadcast_model(self) -> None:
        tensors = list(self.model.parameters()) + list(self.model.buffers())
        by_dtype: Dict[torch.dtype, List[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        with torch.no_grad():
            for group in by_dtype.values():
                flat = torch.cat([t.detach().reshape(-1) for t in group])
                _comm.wait(_comm.broadcast(flat, 0, self._pg, self._timeout),
                           "ISTTrainer: the broadcast of rank 0's model at construction",
                           self._timeout)
                pos = 0
                for t in group:
                    t.copy_(flat[pos:pos + t.numel()].view_as(t))
                    pos += t.numel()

    def _check_usable(self) -> None:
        if self._failed is not None:
            raise CollectiveError(f"ISTTrainer cannot be used after a failed synchronisation: "
                                  f"{self._failed}")

    def _all_gather(self, send: torch.Tensor, width: int) -> torch.Tensor:
        """``[world_size, width]``: every rank's ``send`` (padded to ``width``), in rank
        order; a failed or timed-out collective marks the trainer failed and raises
        :class:`~slimcomm.CollectiveError` before anything is written."""
        w = self._world_size
        if w == 1:
            return send.unsqueeze(0)
        send = torch.nn.functional.pad(send, (0, width - send.numel()))
        gathered = send.new_empty((w, width))
        try:
            _comm.wait(_comm.all_gather(gathered.view(-1), send, self._pg, self._timeout),
                       self._what(), self._timeout)
        except CollectiveError as exc:  # nothing was written into the model
            self._failed = str(exc)
            raise
        self._wire_bytes += (w - 1) * width * send.element_size()
        return gathered

    def _what(self) -> str:
        return (f"ISTTrainer.synchronize (round {self._round}, local step {self._local_step}, "
                f"step {self._steps})")

    def _agree(self, joined: bool) -> Dict[str, bool]:
        """The per-round agreement (see the class docstring); raises on every rank if the
        ranks that have not joined disagree. Returns ``any_active``, ``unsynced``."""
        if not self._distributed or self._world_size == 1:
            return {"any_active": not joined, "unsynced": self._local_step > 0}
        vals = [0 if joined else 1, self._round, None if joined else self._local_step,
                None if joined else self._steps, int(self._local_step > 0)]
        try:
            hi, lo = _comm.agree_counters(vals, self._pg, self._timeout, self._plan.device,
                                          self._what())
        except CollectiveError as exc:
            self._failed = str(exc)
            raise
        self._check_bytes += 2 * 8 * len(vals)
        if hi[1] != lo[1] or hi[2] != lo[2] or hi[3] != lo[3]:
            rows = _comm.gather_rows([-1 if v is None else v for v in vals], self._pg,
                                     self._timeout, self._plan.device)
            where = ", ".join(
                f"rank {r}: round {row[1]}, " + ("joined" if row[0] == 0 else
                                                 f"local step {row[2]}, {row[3]} steps")
                for r, row in enumerate(rows))
            self._failed = (
                f"{self._what()}: the ranks reached this synchronisation at different points "
                f"({where}). Every rank must call step() the same number of times and "
                f"synchronize() at the same step. Usual causes: uneven inputs (a rank ran out "
                f"of batches: wrap the loop in `with trainer.join():`, or agree on the number "
                f"of steps up front); synchronize() called on some ranks only. Nothing was "
                f"exchanged; restart every rank from the last checkpoint")
            raise CollectiveError(self._failed)
        return {"any_active": hi[0] == 1, "unsynced": hi[4] == 1}

    @contextlib.contextmanager
    def join(self):
        """Context manager for uneven inputs: ranks may take different numbers of steps.

        A rank whose loop inside the block ends first shadows the other ranks'
        synchronisations when it leaves the block: it takes part in each of
        their rounds, sending its subnet as it is (its neurons are not trained
        further; the shared output bias is still averaged over every rank), so
        every rank keeps the same full model and partition. When all ranks have
        left their loops, a last synchronisation runs if any rank is mid-round,
        and every rank leaves the block with the same full model. A finished
        rank waits up to ``timeout`` seconds for each round of the others.

        Example::

            with trainer.join():
                for x, y in loader:            # loaders of different lengths
                    trainer.step(x, y, torch.nn.functional.cross_entropy)

        Without ``join()``: agree on the number of steps up front (one
        all-reduce MIN of ``len(loader)``) and run exactly that many.

        Raises:
            CollectiveError: as :meth:`synchronize`.
            RuntimeError: ``join()`` is already active (it cannot nest).
        """
        self._check_usable()
        if self._joined:
            raise RuntimeError("ISTTrainer.join() is already active (it cannot nest)")
        self._joined = True
        try:
            yield self
        except BaseException:
            self._joined = False
            raise
        try:
            while True:
                seen = self._agree(joined=True)
                if not seen["any_active"] and not seen["unsynced"]:
                    break
                with ops.trusted_indices():
                    self._synchronize()
                if not seen["any_active"]:
                    break
        finally:
            self._joined = False
