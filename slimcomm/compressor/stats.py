"""The compressor's communication statistics: per-step counts folded in at ``end_step``,
device-side counters (no host sync) read only by ``stats``."""

from typing import Any, Dict

import torch


class _StatsMixin:
    """Counting and ``stats`` of :class:`~slimcomm.compressor.SlimDPCompressor`."""

    __slots__ = ()

    # ------------------------------------------------------------ stats
    def _count(self, dense_bytes: int, sent_bytes: int, numel: int, sent: int,
               core: int, explore: int) -> None:
        with self._lock:
            c = self._step_acc
            c["bytes_dense"] += dense_bytes
            c["bytes_sent"] += sent_bytes
            c["elements"] += numel
            c["elements_sent"] += sent
            c["core"] += core
            c["explore"] += explore

    def end_step(self) -> None:
        """Close one synchronised step: fold its counts into the stats, advance ``step``."""
        with self._lock:
            last = self._step_acc
            last["density"] = last["elements_sent"] / last["elements"] if last["elements"] else 0.0
            tot = self._stats["total"]
            for key in _COUNT_KEYS:
                tot[key] += last[key]
            tot["density"] = tot["elements_sent"] / tot["elements"] if tot["elements"] else 0.0
            self._stats["last"] = last
            self._stats["steps"] += 1
            self._step_acc = _new_counts()
            self.step += 1

    def _count_check(self, nbytes: int) -> None:
        """One cross-rank agreement all-reduce of ``nbytes`` (also in ``bytes_sent``)."""
        with self._lock:
            self._step_acc["checks"] += 1
            self._step_acc["check_bytes"] += nbytes
            self._step_acc["bytes_sent"] += nbytes

    def _note_nonfinite(self, n: torch.Tensor) -> None:
        """Add the int64 0-d device count ``n`` of non-finite parameters (no host sync)."""
        self._dev_count(n.device)[:1].add_(n)

    @property
    def stats(self) -> Dict[str, Any]:
        """Communication statistics (a copy).

        Returns a dict with ``steps`` (synchronised steps seen),
        ``nonfinite_fallbacks`` (parameter-steps whose averaged gradient
        held NaN/inf, so residual and ``G`` were not updated),
        ``voided_steps`` (DDP hook: steps undone for every parameter because
        some parameter was non-finite), ``core_fallbacks`` (core-set refreshes
        at which the ranks' new core sets differed, e.g. while a rank was
        joined, so every rank kept its previous core set; reading it
        synchronises with the device), and ``last`` / ``total`` (the last
        step, cumulative), each a
        dict of: ``bytes_sent`` (bytes this rank put into collectives,
        including the flag element and any agreement checksums),
        ``checks`` / ``check_bytes`` (cross-rank agreement all-reduces and
        their bytes, part of ``bytes_sent``: one of 8 int64 (64 bytes) per
        group at each core refresh of the shared mode with ``score`` other
        than ``"grad"``, and one of 12 int64 (96 bytes) per group every
        ``check_agreement_every`` compressed steps),
        ``bytes_dense`` (what DDP's default all-reduce would have put in),
        ``elements`` / ``elements_sent`` (gradient coordinates, all / sent),
        ``density`` = ``elements_sent / elements``, ``core`` and ``explore``
        (coordinates in the core and explore sets; dense parameters count as
        core). A ring all-reduce moves about ``2 (W-1)/W`` times
        ``bytes_sent`` over each rank's link; an all-gather (``"local"``
        mode) receives ``W`` times every rank's contribution.
        """
        with self._lock:
            fallbacks = list(self._fallbacks.values())
            dev = [c.tolist() for c in self._dev_counts.values()]  # reading stats syncs
            out = {
                "steps": self._stats["steps"],
                "nonfinite_fallbacks": self._stats["nonfinite_fallbacks"]
                + sum(c[0] for c in dev),
                "voided_steps": self._stats["voided_steps"] + sum(c[1] for c in dev),
                "last": dict(self._stats["last"]),
                "total": dict(self._stats["total"]),
            }
        out["core_fallbacks"] = int(sum(int(c) for c in fallbacks))
        return out

    def _dev_count(self, device) -> torch.Tensor:
        """int64 ``[2]`` device counters (non-finite parameter-steps, voided steps), added
        to without a host sync and read only by :attr:`stats`."""
        with self._lock:
            cnt = self._dev_counts.get(device)
            if cnt is None:
                cnt = self._dev_counts[device] = torch.zeros(2, dtype=torch.int64,
                                                             device=device)
                # the sink too: made once, at the first step, not inside a later one
                self._sink_counts[device] = torch.zeros(2, dtype=torch.int64, device=device)
        return cnt

    def _sink_count(self, device) -> torch.Tensor:
        """int64 ``[2]`` never read: where a fused op writes counts of values that were
        already counted (the delayed hook's bucket write); made with the counters."""
        self._dev_count(device)
        return self._sink_counts[device]


_COUNT_KEYS = ("bytes_dense", "bytes_sent", "elements", "elements_sent", "core", "explore",
               "checks", "check_bytes")


def _new_counts() -> Dict[str, Any]:
    c: Dict[str, Any] = {k: 0 for k in _COUNT_KEYS}
    c["density"] = 0.0
    return c


def _new_stats() -> Dict[str, Any]:
    return {"steps": 0, "nonfinite_fallbacks": 0, "voided_steps": 0, "last": _new_counts(),
            "total": _new_counts()}
