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

A timed run starts with steps slower than the rest (dense warm-up steps of
slimdp/topk ``--warmup-steps`` and PowerSGD's ``--powersgd-start-iter``, each as slow
as a ddp step; the first use of every connection; first allocations): at 8 ranks
and 100 Mbit/s its first 20 steps take 1.6-5x the later ones. Projecting at the
mean rate of a short timed run would charge that start-up to every step of the
full run. So the time up to the timed run's first evaluation past the warm-up is
taken as measured and every later step at the steady ms/step measured after it
(:func:`steady_ms_per_step`, which also separates a local-step method's
synchronisations from its local steps), so the start-up is counted once, as in a
full run. Evaluations are excluded from train time in both runs.
"""

from __future__ import annotations

import copy
from typing import Dict, List, Optional, Sequence, Tuple

__all__ = ["timed_args", "project_run", "dense_warmup_steps", "sync_period", "steady_ms_per_step",
           "apply_budget"]

_DROP_WITH_VALUE = ("--epochs", "--steps", "--time-budget")
_DROP_ALONE = ("--stop-at-target",)


def timed_args(extra: Sequence[str], steps: int, eval_every: Optional[int] = None) -> List[str]:
    """``extra`` (slimcomm.train flags) for the timed run: ``--epochs``/``--steps``/
    ``--time-budget``/``--stop-at-target`` removed (also as ``--flag=value``), ``--steps steps``
    appended; with ``eval_every`` also ``--eval-every`` replaced by it (the steady ms/step needs
    several evaluation windows past the start-up, e.g. every 20 of 120 timed steps, while the
    full run may evaluate less often)."""
    if steps < 1:
        raise ValueError(f"--timed-steps must be >= 1, got {steps}")
    if eval_every is not None and eval_every < 1:
        raise ValueError(f"--timed-eval-every must be >= 1, got {eval_every}")
    out: List[str] = []
    skip = False
    for tok in extra:
        if skip:
            skip = False
            continue
        flag = tok.split("=", 1)[0]
        if flag in _DROP_WITH_VALUE or (eval_every is not None and flag == "--eval-every"):
            skip = "=" not in tok
            continue
        if flag in _DROP_ALONE:
            continue
        out.append(tok)
    out += ["--steps", str(steps)]
    return out + (["--eval-every", str(eval_every)] if eval_every is not None else [])


def apply_budget(run: Dict, budget_s: float) -> Dict:
    """``run`` cut at a training-time budget (netbench ``--time-budget``), e.g. a projected run.

    Keeps the evaluations whose ``train_time_s`` is at most ``budget_s``; ``final`` becomes
    the last one kept (its accuracy/loss, time, bytes; ``steps`` its step), the time to
    target is dropped if it lies beyond the budget, and ``budget_s`` is recorded. A run
    whose first evaluation is already past the budget keeps no evaluation and a ``final``
    without scores. Returns a new dict.

    Raises:
        ValueError: ``budget_s`` is not positive.
    """
    if not budget_s > 0:
        raise ValueError(f"--time-budget must be > 0, got {budget_s}")
    out = copy.deepcopy(run)
    kept = [e for e in out.get("evals", []) if e["train_time_s"] <= budget_s]
    out["evals"] = kept
    out["epochs"] = [e for e in out.get("epochs", []) if e["train_time_s"] <= budget_s]
    final = dict(out["final"])
    if kept:
        last = kept[-1]
        for k, v in last.items():
            if k not in ("epoch", "step", "train_loss"):
                final[k] = v
        out["steps"] = last["step"]
    else:
        final = {k: v for k, v in final.items() if k in ("eval_time_s", "wall_time_s")}
        final.update(train_time_s=0.0, bytes_sent_per_rank=0)
        out["steps"] = 0
    out["final"] = final
    old_steps = max(1, int(run.get("steps") or 1))
    for w in out.get("wire") or []:   # interface counters: pro rata to the steps kept
        for k in ("tx_bytes", "rx_bytes"):
            if k in w:
                w[k] = int(w[k] * out["steps"] / old_steps)
    ttt = out.get("time_to_target")
    if ttt is not None and ttt["train_time_s"] > budget_s:
        out["time_to_target"] = None
    out["budget_s"] = budget_s
    out["stopped_at_budget"] = True
    return out


def dense_warmup_steps(run: Dict) -> int:
    """Dense (uncompressed) steps a run starts with: slimdp/topk ``warmup_steps``, PowerSGD's
    ``powersgd_start_iter``, else 0."""
    cfg = run.get("config") or {}
    if run["method"] in ("slimdp", "topk"):
        return int(cfg.get("warmup_steps") or 0)
    if run["method"] == "powersgd":
        return int(cfg.get("powersgd_start_iter") or 0)
    return 0


def sync_period(run: Dict) -> int:
    """Steps per synchronisation: IST ``local_steps``, DiLoCo/SparseLoCo/slimdp-local ``sync_every``, else 1."""
    cfg = run.get("config") or {}
    if run["method"] == "ist":
        return max(1, int(cfg.get("local_steps") or 1))
    if run["method"] in ("diloco", "sparseloco", "slimdp-local"):
        return max(1, int(cfg.get("sync_every") or 1))
    return 1


def _knots(run: Dict) -> List[Tuple[int, float]]:
    """``(step, train time)`` of every evaluation before the last step, then of the last step."""
    pts = sorted((int(e["step"]), float(e["train_time_s"])) for e in run["evals"] if 0 < e["step"] < run["steps"])
    return pts + [(int(run["steps"]), float(run["final"]["train_time_s"]))]


def _windows(run: Dict) -> Tuple[int, float, List[Tuple[int, int, float]]]:
    """``(k1, t1, rows)``: the first evaluation at or past the start-up (dense warm-up, first
    connections, first allocations), its train time, and per later knot ``k`` the window ``(k1, k]``
    as ``(steps, synchronisations, seconds)``; ``(0, 0.0, [])`` without such an evaluation."""
    knots = _knots(run)
    n_warm = max(1, dense_warmup_steps(run))
    starts = [(k, t) for k, t in knots[:-1] if k >= n_warm]
    if not starts:
        return 0, 0.0, []
    k1, t1 = starts[0]
    period = sync_period(run)
    return k1, t1, [(k - k1, k // period - k1 // period, t - t1) for k, t in knots if k > k1]


def _step_and_sync_s(rows: Sequence[Tuple[int, int, float]]) -> Optional[Tuple[float, float]]:
    """Least squares of ``seconds = c * steps + s * synchronisations`` over the windows; None when the
    windows all hold the same share of synchronisations (c and s are then not separable)."""
    skk = sum(a * a for a, _, _ in rows)
    skn = sum(a * b for a, b, _ in rows)
    snn = sum(b * b for _, b, _ in rows)
    det = skk * snn - skn * skn
    if det <= 1e-9 * max(1.0, skk * snn):
        return None
    skt = sum(a * c for a, _, c in rows)
    snt = sum(b * c for _, b, c in rows)
    return (snn * skt - skn * snt) / det, (skk * snt - skn * skt) / det


def _steady(run: Dict, local_step_s: Optional[float] = None) -> Tuple[int, float, float]:
    """``(k1, t1, ms)``: :func:`_windows`' start and the steady ms/step after it (see
    :func:`steady_ms_per_step`). ``local_step_s``: a local step's seconds from another run of the
    method (its full run), used when this run's windows cannot separate steps from synchronisations."""
    k1, t1, rows = _windows(run)
    if not rows:
        return 0, 0.0, 1000.0 * run["final"]["train_time_s"] / run["steps"]
    period = sync_period(run)
    kT, nT, tT = rows[-1]
    if period == 1 or nT * period == kT:  # every-step method, or a window with its share of syncs
        return k1, t1, 1000.0 * tT / kT
    fit = _step_and_sync_s(rows)
    if fit is not None:
        return k1, t1, 1000.0 * (fit[0] + fit[1] / period)
    if local_step_s is not None and nT > 0:
        return k1, t1, 1000.0 * (local_step_s + (tT - local_step_s * kT) / nT / period)
    return 0, 0.0, 1000.0 * run["final"]["train_time_s"] / run["steps"]


def steady_ms_per_step(run: Dict) -> float:
    """Milliseconds per training step after the start-up, as a full run averages them.

    The first evaluation at or past the dense warm-up (``k1``; the first evaluation without one)
    ends the start-up (dense steps, first use of every connection, first allocations: at 8 ranks
    on 100 Mbit/s the first 20 steps take 1.6-5x the later ones); after it, the train time
    between evaluations is ``c * steps + s * synchronisations`` (methods with a period
    :func:`sync_period` > 1; least squares over the windows ``(k1, k]``), and the steady ms/step
    is ``c + s / period``; for every-step methods (and a window ``(k1, last step]`` that holds its
    share of synchronisations) it is the mean over that window. Without an evaluation past the
    start-up, or when the windows cannot separate ``c`` from ``s`` (evaluations every 20 steps,
    a synchronisation every 24: every window holds one per 20 steps), it is the mean over the whole
    run; :func:`project_run` then takes ``c`` from the full run instead.

    Raises:
        ValueError: the run made no step."""
    if run["steps"] < 1:
        raise ValueError("the run made no training step")
    return _steady(run)[2]


def project_run(trajectory: Dict, timed: Dict, trajectory_rate: str) -> Dict:
    """The result of ``trajectory`` (a full run) with its times rescaled to ``timed``'s ms/step.

    Args:
        trajectory: slimcomm.train result JSON of the full run (same method, seed, flags).
        timed: result JSON of the short run at the slow rate (``timed_args``).
        trajectory_rate: the rate ``trajectory`` ran at (recorded).

    Returns a new dict: ``evals[i]["train_time_s"]`` = the timed run's measured time up to its
    first evaluation past the start-up (step ``k0``; before it proportionally), then
    ``ms = steady_ms_per_step(timed)`` per step (for a local-step method whose timed windows cannot
    separate local steps from synchronisations, the local step's time is the full run's and the
    synchronisations' the timed run's), the same for ``final`` and ``time_to_target``; bytes, losses, accuracies and wire
    counters are the trajectory's; ``"projected"`` records the timed run (steps, ms/step,
    train time, its own payload and wire bytes, the gloo loop threads' priority it ran with).

    Raises:
        ValueError: if the runs disagree on method or world size, or the timed run has no steps.
    """
    for key in ("method", "world_size"):
        if trajectory.get(key) != timed.get(key):
            raise ValueError(f"timed and trajectory runs differ in {key}: "
                             f"{timed.get(key)!r} vs {trajectory.get(key)!r}")
    if timed["steps"] < 1:
        raise ValueError("the timed run made no training step")
    local = None
    if sync_period(timed) > 1:  # a local step costs the same at every rate: the full run separates it
        fit = _step_and_sync_s(_windows(trajectory)[2])
        local = fit[0] if fit is not None else None
    k0, t0, ms = _steady(timed, local)

    def at(step: float) -> float:
        if step <= k0:
            return t0 * step / k0
        return t0 + (step - k0) * ms / 1000.0

    p = copy.deepcopy(trajectory)
    for e in p["evals"]:
        e["train_time_s"] = at(e["step"])
    p["final"]["train_time_s"] = at(p["steps"])
    t = p.get("time_to_target")
    if t:
        if "step" not in t:
            raise ValueError("the trajectory's time_to_target has no step to rescale")
        t["train_time_s"] = at(t["step"])
    p["projected"] = {
        "trajectory_rate": trajectory_rate,
        "timed_steps": timed["steps"],
        "ms_per_step": ms,
        "warmup_knot": {"step": k0, "train_time_s": t0},
        "timed_train_time_s": timed["final"]["train_time_s"],
        "timed_bytes_sent_per_rank": timed["final"]["bytes_sent_per_rank"],
        "timed_wire": timed.get("wire"),
        # the trajectory may be reused from a run made with another priority
        "comm_thread_priority": timed["config"].get("comm_thread_priority", "normal"),
    }
    return p
