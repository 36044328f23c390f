"""``delay_syncs=1``: the synchronisation of period k is applied at the end of period k+1,
so its collectives run while this rank takes the next ``sync_every`` inner steps.

The delayed outer step of overlapped DiLoCo-type training (Streaming DiLoCo, Douillard
et al., arXiv 2501.18512, Sec. 2.3: the outer gradient of one round is communicated while
the next round's inner steps run, and merged when it arrives; also Kale et al., "eager
updates", arXiv 2502.12996). Here the merge keeps this rank's whole local progress:

* every rank keeps an *anchor* per group, its local parameters where the current period
  began (at the first synchronisation: the outer parameters, the common start);
* at the end of period k, first the average of period k-1 (launched a period ago) is
  waited for and the outer step applied to the outer parameters ``outer`` (momentum as
  usual); then this rank's progress over period k, ``delta = anchor - local``, goes
  through the compressor and its collectives are launched, not waited for (the two-stage
  all-reduce of dense low-bit codes still waits for its all-to-all at the launch, so only
  its all-gather overlaps); last, the local parameters and the anchor become
  ``outer - delta``: the new global point plus this rank's own last period.

``overlap_steps`` (Streaming DiLoCo's tau, ``1 <= tau <= sync_every``; default
``sync_every``, as above) applies the average ``tau`` inner steps after its launch instead:
the outer step, then ``local += outer - anchor`` (the rank's own period, sent with that
synchronisation, replaced by the average; its steps since the launch kept) and
``anchor := outer``; the period's end then launches ``anchor - local`` as above.

So each pseudo-gradient is exactly one period of one rank's inner steps, every average is
applied once, ``overlap_steps`` inner steps after its launch, and the outer parameters are
identical on every rank (they change only by decoded averages). The replicas' local parameters differ by one period of
local progress, as between the synchronisations of ``delay_syncs=0``. A failed collective
(waiting for the one in flight, or launching the next) raises on every rank before the
model is written: it holds the last synchronisation that completed.

:meth:`SlimDPOptimizer.synchronize` (the explicit one at the end of training) and the end
of ``join()`` *drain*: the average in flight is applied and every rank's parameters become
the outer ones, so replicas are identical afterwards, as with ``delay_syncs=0``.

Memory: one more fp32 copy of the parameters (the anchors, 4 bytes per parameter), and the
average of the synchronisation in flight (the group's scratch buffer, or the gathered codes
of the two-stage all-reduce).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from .. import _comm
from .groups import views_of


def _done(value) -> torch.futures.Future:
    """A completed future holding ``value``."""
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(value)
    return fut


class _DelayedMixin:
    """``delay_syncs`` of :class:`~slimcomm.optim.SlimDPOptimizer` (see the module docstring)."""

    def _init_delay(self, delay_syncs: int, overlap_steps: Optional[int]) -> None:
        self.delay_syncs = delay_syncs
        self.overlap_steps = (self.sync_every if overlap_steps is None else overlap_steps) \
            if delay_syncs else None
        self._inflight: Optional[List[torch.futures.Future]] = None
        self._anchored = False
        self._anchors = [torch.zeros_like(g.outer) for g in self._groups] if delay_syncs else []
        self._anchor_views = [views_of(a, g.params) for a, g in zip(self._anchors, self._groups)]

    @staticmethod
    def _check_delay(delay_syncs, overlap_steps, sync_every) -> None:
        if isinstance(delay_syncs, bool) or delay_syncs not in (0, 1):
            raise ValueError(f"delay_syncs must be 0 or 1, got {delay_syncs!r}")
        if overlap_steps is None:
            return
        if not delay_syncs:
            raise ValueError(f"overlap_steps={overlap_steps!r} applies with delay_syncs=1 only")
        if isinstance(overlap_steps, bool) or not isinstance(overlap_steps, int) or \
                not 1 <= overlap_steps <= sync_every:
            raise ValueError(f"overlap_steps must be an int in [1, sync_every={sync_every}], "
                             f"got {overlap_steps!r}")

    def _resolve_inflight(self, what: str) -> Optional[List[Any]]:
        """Wait for the synchronisation in flight (None if there is none); raises
        CollectiveError (a ``RuntimeError``) before anything is written."""
        if self._inflight is None:
            return None
        with self._failing(what):
            return [_comm.wait(f, what, self.timeout) for f in self._inflight]

    def _anchor_start(self) -> None:
        if not self._anchored:   # the first period began at the (common) outer parameters
            for a, g in zip(self._anchors, self._groups):
                a.copy_(g.outer)
            self._anchored = True

    def _apply_inflight(self, what: str) -> None:
        """Wait for the synchronisation in flight and step the outer parameters with it
        (the model is not written here)."""
        avgs = self._resolve_inflight(what)
        self._inflight = None
        if avgs is not None:
            for g, avg in zip(self._groups, avgs):
                self._outer_step(g, avg)

    def _shift(self, i: int, ok: Optional[torch.Tensor]) -> None:
        """``delta = anchor - local`` (zeros where ``ok`` is False), then local := anchor :=
        outer - delta: the new outer parameters plus this rank's progress of the period."""
        g, a, views = self._groups[i], self._anchors[i], self._anchor_views[i]
        torch._foreach_sub_(views, g.params)
        if ok is not None:
            torch.where(ok, a, self._zero[g.outer.device], out=a)
        torch.sub(g.outer, a, out=a)
        torch._foreach_copy_(g.params, views)

    def _sync_delayed(self) -> None:
        """One synchronisation with ``delay_syncs=1`` (after the agreement): apply the one in
        flight to the outer parameters, launch this period's (``anchor - local``, the same
        value :meth:`_shift` then takes), and only then write the model, so a collective
        that fails leaves the model as it was."""
        what = self._what()
        self._apply_inflight(f"SlimDPOptimizer.synchronize (synchronisation {self.syncs}, "
                             f"applied at local step {self.local_step})")
        self._anchor_start()
        futs, oks = self._launch_all(self._anchors, what)
        self._inflight = futs
        for i, ok in enumerate(oks):
            self._shift(i, ok)
        bad = self._by_device(oks)
        self._publish_flags(bad)
        self.syncs += 1
        self._synced_at = self.local_step
        self._drain_flags(wait=False)

    @torch.no_grad()
    def _apply_due(self) -> None:
        """``overlap_steps`` inner steps after a launch (before the period ends): the outer
        step from the synchronisation in flight, and this rank's parameters and anchor
        rebased onto it: ``local += outer - anchor`` (its own period, sent with that
        synchronisation, replaced by the average; the steps since the launch kept), then
        ``anchor := outer``. Waiting may raise CollectiveError before anything is
        written; no collective is issued."""
        self._check_usable()
        self._apply_inflight(f"SlimDPOptimizer (synchronisation {self.syncs}, applied at "
                             f"local step {self.local_step})")
        for g, a, views in zip(self._groups, self._anchors, self._anchor_views):
            torch.sub(g.outer, a, out=a)
            torch._foreach_add_(g.params, views)
            a.copy_(g.outer)

    def _drain(self) -> None:
        """Apply the synchronisation in flight without launching another (no collective is
        issued): with no local step since, every rank's parameters become the outer ones."""
        if self._inflight is None:
            return
        self._apply_inflight(f"SlimDPOptimizer.synchronize (draining synchronisation "
                             f"{self.syncs})")
        for i in range(len(self._groups)):
            self._shift(i, None)

    # ---------------------------------------------------------------- checkpoint
    def _delay_state(self) -> Dict[str, Any]:
        """``delay_syncs``, the anchors and the average in flight (waited for here and kept
        resolved, so the next synchronisation applies the same values)."""
        if not self.delay_syncs:
            return {"delay_syncs": 0}
        inflight = None
        if self._inflight is not None:
            vals = self._resolve_inflight(
                f"SlimDPOptimizer.state_dict (synchronisation {self.syncs} in flight)")
            vals = [v(torch.empty_like(g.outer)) if callable(v) else v
                    for v, g in zip(vals, self._groups)]
            self._inflight = [_done(v) for v in vals]
            inflight = vals
        return {"delay_syncs": 1, "anchor": list(self._anchors) if self._anchored else None,
                "inflight": inflight}

    def _check_delay_state(self, state_dict: Dict[str, Any]) -> None:
        saved = state_dict.get("delay_syncs", 0)
        if saved != self.delay_syncs:
            raise ValueError(
                f"state_dict was saved by a SlimDPOptimizer with delay_syncs={saved!r}; this one "
                f"has delay_syncs={self.delay_syncs!r}: resume with delay_syncs={saved!r} (a "
                f"synchronisation may be in flight in it)")
        for key in ("anchor", "inflight"):
            vals = state_dict.get(key)
            if vals is None:
                continue
            if not isinstance(vals, (list, tuple)) or len(vals) != len(self._groups) or any(
                    not torch.is_tensor(v) or v.numel() != g.outer.numel()
                    for v, g in zip(vals, self._groups)):
                raise ValueError(f"state_dict: {key!r} does not match this model's parameter "
                                 f"groups (same model and bucket_cap_mb needed)")

    def _load_delay_state(self, state_dict: Dict[str, Any]) -> None:
        if not self.delay_syncs:
            return
        anchors, inflight = state_dict.get("anchor"), state_dict.get("inflight")
        self._anchored = anchors is not None
        if anchors is not None:
            for a, s in zip(self._anchors, anchors):
                a.copy_(s)
        self._inflight = None if inflight is None else \
            [_done(v.to(g.outer.device, torch.float32).clone().view(-1))
             for v, g in zip(inflight, self._groups)]
