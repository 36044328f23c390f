"""Where a training step's time goes: the phases of ``--profile`` (issue 31, item 1).

Part of the training command (:mod:`slimcomm.train`), not of the library. Wall-clock
timers (``time.perf_counter``) around the phases of one step of a DDP method, on every
rank; nothing else runs (no torch profiler, no extra synchronisation), so the step is the
one the benchmark times. On a GPU the phases would need a device synchronisation to mean
anything: ``--profile`` is refused there (and for ``--method ist``, whose trainer owns
the whole step).

Phases of a step (milliseconds; per rank the mean over the profiled steps, so the phases
add up to the step, then the mean and the max over the ranks):

* ``forward``: ``zero_grad`` and the forward pass with the loss.
* ``backward_compute``: from the start of ``backward()`` to DDP's first comm-hook call
  (with one bucket, the whole backward computation; with several, up to the first
  bucket ready).
* ``hook``: the comm hook's own calls, summed over buckets (index sets, error feedback,
  packing, launching the collective; with ``delay_steps=1`` also waiting for the
  previous step's all-reduce and applying it).
* ``wait``: from the end of the last hook call to the end of ``backward()``: DDP
  waiting for the collectives (the transfer itself and the slowest rank's late entry,
  i.e. rank skew), plus what is left of the backward computation after the last bucket.
* ``optimizer``: the optimizer step (for the methods that own their synchronisation:
  the local step and, every H steps, the synchronisation).
* ``step``: the whole ``train_step``, for the methods without a hook this and
  ``forward``/``backward_compute``/``optimizer`` only.

``backward_compute`` of a method without a comm hook is its whole backward.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Dict, List, Optional

import torch.distributed as dist

PHASES = ("forward", "backward_compute", "hook", "wait", "optimizer", "step")


class StepProfiler:
    """Per-step phase timers of one rank; see the module docstring.

    Use: :meth:`wrap_hook` around the comm hook before ``register_comm_hook``; per step
    :meth:`begin`, then :meth:`mark` ``("forward")`` after the loss, ``("backward")``
    after ``backward()``, ``("optimizer")`` after the optimizer step; :meth:`summary`
    (collective) after training.
    """

    def __init__(self, skip: int = 3):
        if skip < 0:
            raise ValueError(f"skip must be >= 0, got {skip}")
        self.skip = skip  # first steps (warm-up, layouts, DDP's bucket rebuild) left out
        self.steps: List[Dict[str, float]] = []
        self._t = 0.0
        self._start = 0.0
        self._cur: Dict[str, float] = {}
        self._hook_first: Optional[float] = None
        self._hook_last = 0.0
        self._hook_sum = 0.0

    def wrap_hook(self, hook: Callable) -> Callable:
        """``hook(state, bucket) -> Future`` with its calls timed."""
        def timed(state, bucket):
            t0 = time.perf_counter()
            try:
                return hook(state, bucket)
            finally:
                t1 = time.perf_counter()
                if self._hook_first is None:
                    self._hook_first = t0
                self._hook_last = t1
                self._hook_sum += t1 - t0
        return timed

    def begin(self) -> None:
        self._start = self._t = time.perf_counter()
        self._cur = {}
        self._hook_first, self._hook_sum = None, 0.0

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        if phase == "backward":
            if self._hook_first is None:
                self._cur["backward_compute"] = now - self._t
            else:
                self._cur["backward_compute"] = self._hook_first - self._t
                self._cur["hook"] = self._hook_sum
                self._cur["wait"] = now - self._hook_last
        else:
            self._cur[phase] = now - self._t
        self._t = now
        if phase == "optimizer":
            self._cur["step"] = now - self._start
            self.steps.append(self._cur)

    def rank_means(self) -> Dict[str, float]:
        """This rank's mean ms per phase (phases it never saw are absent)."""
        rows = self.steps[self.skip:] or self.steps
        out = {}
        for ph in PHASES:
            vals = [r[ph] for r in rows if ph in r]
            if vals:
                out[ph] = 1e3 * statistics.fmean(vals)
        return out

    def summary(self) -> Dict[str, Any]:
        """Collective (one ``all_gather_object``): ``{"steps", "skip", "ranks": [per-rank
        means], "mean": {...}, "max": {...}}`` in ms; ``skip`` is the number of first steps
        actually left out (0 when the run had no more than ``skip`` steps: then all count)."""
        mine = self.rank_means()
        ranks = [mine]
        if dist.is_initialized() and dist.get_world_size() > 1:
            ranks = [None] * dist.get_world_size()
            dist.all_gather_object(ranks, mine)
        keys = [ph for ph in PHASES if all(ph in r for r in ranks)]
        # rank_means() falls back to every step when there are no more than ``skip``: say so
        skip = self.skip if len(self.steps) > self.skip else 0
        return {"steps": len(self.steps), "skip": skip, "ranks": ranks,
                "mean": {k: statistics.fmean(r[k] for r in ranks) for k in keys},
                "max": {k: max(r[k] for r in ranks) for k in keys}}

