"""Non-finite pseudo-gradients: the per-sync finite flags, read on the host one
synchronisation late without a device sync, the inner-state reset of the groups hit, and
``stats``, which counts them."""

from __future__ import annotations

import warnings
from typing import Any, Dict, List

import torch
import torch.distributed as dist


class _NonfiniteMixin:
    """Non-finite handling and ``stats`` of :class:`~slimcomm.optim.SlimDPOptimizer`."""

    # ---------------------------------------------------------------- non-finite steps
    def _publish_flags(self, bad: Dict[torch.device, List[torch.Tensor]]) -> None:
        """Queue this synchronisation's per-group finite flags (bool, True = finite) for
        the host: on a
        GPU one ``stack`` and one non-blocking copy to pinned memory per device, and
        an event; on the CPU the flags are host memory already (read with numpy,
        which dispatches nothing)."""
        parts = []
        for dev, flags in bad.items():
            if dev.type == "cpu":
                parts.append((flags, None))      # fresh tensors every synchronisation
            elif dev.type == "cuda":             # into pinned memory, no stream sync
                host = torch.stack(flags).to("cpu", non_blocking=True)
                ev = torch.cuda.Event()
                ev.record()
                parts.append((host, ev))
            else:                                # other accelerators: a blocking copy
                parts.append((torch.stack(flags).cpu(), None))
        self._pending.append((self.syncs, parts))

    def _drain_flags(self, wait: bool) -> None:
        """Handle the queued flags whose copies are done (all of them if ``wait``)."""
        while self._pending:
            index, parts = self._pending[0]
            if not wait and any(ev is not None and not ev.query() for _, ev in parts):
                break
            for _, ev in parts:
                if ev is not None:
                    ev.synchronize()
            self._pending.popleft()
            flags = [not f for host, _ in parts
                     for t in (host if isinstance(host, list) else [host])
                     for f in t.numpy().reshape(-1)]
            self._handle_nonfinite(index, flags)

    def _handle_nonfinite(self, index: int, flags: List[bool]) -> None:
        """Synchronisation ``index`` had these per-group non-finite flags (device order)."""
        if not any(flags):
            return
        self._nonfinite_syncs += 1
        groups = [g for dev in self._zero for g in self._groups if g.outer.device == dev]
        hit = [g for g, f in zip(groups, flags) if f]
        current = self.syncs - 1
        names = []
        for g in hit:
            if index > g.reset_at:   # not caused by a state this rank has already reset
                for p in g.keys:
                    self.inner.state.pop(p, None)
                g.reset_at = current
            names.extend(self._names[pos] for pos in g.positions)
        if not self._warned_nonfinite:
            self._warned_nonfinite = True
            rank = dist.get_rank(self.process_group)
            warnings.warn(
                f"SlimDPOptimizer: rank {rank}: non-finite pseudo-gradient (NaN/inf local "
                f"parameters, e.g. after an inf loss without a GradScaler) at synchronisation "
                f"{index} in {len(names)} parameter(s) ({', '.join(names[:3])}"
                f"{', ...' if len(names) > 3 else ''}): this rank sent zeros for them, reset "
                f"its inner optimizer state of those parameters and continues from the outer "
                f"ones. Later occurrences are only counted, in stats['nonfinite_syncs']",
                RuntimeWarning, stacklevel=4)

    # ---------------------------------------------------------------- stats
    @property
    def stats(self) -> Dict[str, Any]:
        """The compressor's stats (``total``/``last``: ``bytes_sent`` per rank,
        ``bytes_dense``, ``density``, ...; one "step" = one synchronisation)
        plus ``local_steps``, ``syncs`` and ``nonfinite_syncs`` (synchronisations
        at which this rank's pseudo-gradient was non-finite in some parameter
        group, so it sent zeros there; see :meth:`synchronize`). Reading it
        synchronises with the device."""
        st = self.compressor.stats
        st["local_steps"] = self.local_step
        st["syncs"] = self.syncs
        pending = 0
        for _, parts in self._pending:   # not yet seen by the host (GPU): count, handle later
            for host, ev in parts:
                if ev is not None:
                    ev.synchronize()
            pending += any(not f for host, _ in parts
                           for t in (host if isinstance(host, list) else [host])
                           for f in t.numpy().reshape(-1))
        st["nonfinite_syncs"] = self._nonfinite_syncs + pending
        return st
