"""Projected runs of bench/netbench.py: a short timed run at a slow rate + a full trajectory.

A method's trajectory (loss or accuracy after each evaluation, bytes per step) does
not depend on the link: the arithmetic is the same at every rate and on CPU it is
deterministic for a seed, so only the time per step changes. At a rate given with
``--timed-rates`` each (method, seed) therefore trains only ``--timed-steps`` steps
(the same flags otherwise) to measure its ms/step on that link, and its result is
the full run of the same method and seed at the trajectory rate (the first rate of
``--rates`` not timed) with every time rescaled to that ms/step:
``train_time(step) = step * ms_per_step``. Such results carry ``"projected"`` and the
tables say so. This is the "run slow methods to a fixed number of steps and report
their measured ms/step and steps to target" of the scaling benchmark, for every method.

Assumes a constant time per step over the run (evaluations are excluded from train
time in both runs; dense warm-up steps are counted at the steady rate).
"""

from __future__ import annotations

import copy
from typing import Dict, List, Sequence

__all__ = ["timed_args", "project_run"]

_DROP_WITH_VALUE = ("--epochs", "--steps")
_DROP_ALONE = ("--stop-at-target",)


def timed_args(extra: Sequence[str], steps: int) -> List[str]:
    """``extra`` (slimcomm.train flags) for the timed run: ``--epochs``/``--steps``/
    ``--stop-at-target`` removed (also as ``--flag=value``), ``--steps steps`` appended."""
    if steps < 1:
        raise ValueError(f"--timed-steps must be >= 1, got {steps}")
    out: List[str] = []
    skip = False
    for tok in extra:
        if skip:
            skip = False
            continue
        flag = tok.split("=", 1)[0]
        if flag in _DROP_WITH_VALUE:
            skip = "=" not in tok
            continue
        if flag in _DROP_ALONE:
            continue
        out.append(tok)
    return out + ["--steps", str(steps)]


def project_run(trajectory: Dict, timed: Dict, trajectory_rate: str) -> Dict:
    """The result of ``trajectory`` (a full run) with its times rescaled to ``timed``'s ms/step.

    Args:
        trajectory: slimcomm.train result JSON of the full run (same method, seed, flags).
        timed: result JSON of the short run at the slow rate (``timed_args``).
        trajectory_rate: the rate ``trajectory`` ran at (recorded).

    Returns a new dict: ``evals[i]["train_time_s"] = evals[i]["step"] * ms / 1000``, the
    same for ``final`` and ``time_to_target``; bytes, losses, accuracies and wire
    counters are the trajectory's; ``"projected"`` records the timed run (steps, ms/step,
    train time, its own payload and wire bytes).

    Raises:
        ValueError: if the runs disagree on method or world size, or the timed run has no steps.
    """
    for key in ("method", "world_size"):
        if trajectory.get(key) != timed.get(key):
            raise ValueError(f"timed and trajectory runs differ in {key}: "
                             f"{timed.get(key)!r} vs {trajectory.get(key)!r}")
    if timed["steps"] < 1:
        raise ValueError("the timed run made no training step")
    ms = 1000.0 * timed["final"]["train_time_s"] / timed["steps"]
    p = copy.deepcopy(trajectory)
    for e in p["evals"]:
        e["train_time_s"] = e["step"] * ms / 1000.0
    p["final"]["train_time_s"] = p["steps"] * ms / 1000.0
    t = p.get("time_to_target")
    if t:
        if "step" not in t:
            raise ValueError("the trajectory's time_to_target has no step to rescale")
        t["train_time_s"] = t["step"] * ms / 1000.0
    p["projected"] = {
        "trajectory_rate": trajectory_rate,
        "timed_steps": timed["steps"],
        "ms_per_step": ms,
        "timed_train_time_s": timed["final"]["train_time_s"],
        "timed_bytes_sent_per_rank": timed["final"]["bytes_sent_per_rank"],
        "timed_wire": timed.get("wire"),
    }
    return p
