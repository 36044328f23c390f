"""Train time on slower links: the alpha-beta cost model of ring collectives and the demo's projection.

Part of the training command (:mod:`slimcomm.train`), not of the library
core; the module imports torch only inside :func:`probe_link`, so
``bench/costmodel.py`` (which fits and validates the same model on the
network benchmark's runs) imports the model from here: there is one cost
model in the repository.

Model (per rank, Hockney's alpha-beta model of ring collectives; Thakur,
Rabenseifner & Gropp, IJHPCA 2005, section 2), :class:`LinkModel`:

* ring all-reduce of ``B`` bytes: ``2 (W-1) alpha + 2 (W-1)/W * 8 B / goodput``
* ring all-gather of ``b`` bytes per rank: ``(W-1) alpha + (W-1) * 8 b / goodput``

A run's time on another link (:func:`project_result`): the training command
measures every run's train time at each evaluation and counts the payload
bytes each rank handed to collectives up to it (exact). Its *compute* time up
to an evaluation is the measured train time minus the modelled time of its
collectives on the link it ran on (a spawned run: loopback, whose alpha and
goodput the run measures after training with a few timed collectives of
its own kind, :func:`probe_link`). The time on a link ``L`` is that
compute time plus the modelled time of the same collectives (the counted
bytes; :func:`collectives_per_step` collectives per step for the latency
term) on ``L``. The links are :data:`EMULATED_LINKS`: 2-rank gloo collectives
measured on this project's tbf-emulated 100 Mbit/s and 1 Gbit/s links
(``bench/collbench.py``, ``bench/results/scale/collbench.json``; one fit per
collective kind, because gloo's 2-rank all-gather moves its bytes at 70% of
the all-reduce's goodput there). ``tests/test_train_projection.py`` checks the
constants against that file and the projection against the committed measured
2-rank netbench runs.

Latency: every collective call pays :func:`ring_hops` hops (``2 (W-1)`` for a ring all-reduce,
``W-1`` for an all-gather) of ``alpha_s`` each; :func:`collective_calls` counts a method's calls
per step (DDP's buckets, the Slim-DP hook's checksum all-reduces, the local-step methods' value
collectives and agreement all-reduce per synchronisation). A one-way delay ``d`` between two
ranks adds ``d`` to every hop (:meth:`LinkModel.with_delay`, ``project_result(..., delay_s=d)``),
i.e. ``d * hops_per_step * steps`` to a run's time (:func:`delayed_result`, which
``bench/latency_tables.py`` applies to netbench results); delay 0 leaves every number as it was.

Known artefact: the 100 Mbit/s fits give no per-hop latency (small messages
beat the large-message line there) and the 1 Gbit/s ones 0.7-0.8 ms, so on a
payload of a few KB per step the projected 1 Gbit/s time exceeds the
100 Mbit/s one; on the demo's MLP (0.23-23 MB per step) the latency is a
fraction of a percent.

What it does not model: compute that changes with the link (it does not: a
step's collectives are not overlapped with computation, one DDP bucket holds
the MLP), a machine whose load changes between the runs compared (the
compute time is this run's), queueing of several links on one switch.
"""

from __future__ import annotations

import copy
import math
import statistics
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

__all__ = ["PATTERN", "pattern_of", "ring_hops", "two_shot", "LinkModel", "fit_link", "collective_calls", "collectives_per_step",
           "hops_per_step", "delay_s_at", "delayed_result", "parse_delays", "EMULATED_LINKS", "LINK_NAMES",
           "DEFAULT_RATES", "probe_link", "run_compute_s", "project_result", "add_link_times", "link_result",
           "links_table", "projection_note"]

#: how each method's traffic moves: collective kind (the latency/goodput terms of :class:`LinkModel`)
PATTERN = {
    "ddp": "allreduce", "fp16": "allreduce", "powersgd": "allreduce", "slimdp": "allreduce",
    "diloco": "allreduce", "topk": "allgather", "sparseloco": "allgather", "ist": "allgather",
    "slimdp-local": "allgather",
    "local": "allreduce",  # no collective at all (collectives_per_step 0, no bytes): the kind is never used
}


def pattern_of(method: str, config: Optional[Dict[str, Any]] = None) -> str:
    """The collective pattern (``"allreduce"`` / ``"allgather"``) of a run of ``method`` with the
    training command's ``config`` (a results dict's ``"config"``, or ``vars(args)``).

    slimdp-local without ``--value-bits`` all-reduces its values; its dense codes travel
    through the two-stage all-reduce
    (``--lowbit-collective all_reduce``, the default since it exists): its counted bytes are
    ``W (P1 + P2) / 2`` per synchronisation, so the ring all-reduce rule gives its link bytes,
    and its all-to-all + all-gather make ``2 (W-1)`` hops, as a ring all-reduce does. Runs
    without the key (older results) all-gathered. Other methods: :data:`PATTERN`."""
    if method == "slimdp-local" and config:
        if config.get("value_bits") is None:
            return "allreduce"  # values at a shared index set, or dense values: one all-reduce
        if config.get("lowbit_collective", "all_gather") == "all_reduce":
            return "allreduce"
    return PATTERN[method]


def ring_hops(kind: str, world_size: int) -> int:
    """Latency terms (ring hops) one collective call of ``kind`` pays on ``world_size`` ranks:
    ``2 (W-1)`` for a ring all-reduce (reduce-scatter, then all-gather), ``W-1`` for a ring
    all-gather, 2 for the two-shot all-reduce (:func:`slimcomm._comm.two_shot_all_reduce`:
    two all-to-alls whose messages are all posted at once; the same bytes as a ring).

    Raises:
        ValueError: an unknown ``kind`` or ``world_size`` < 1."""
    if world_size < 1:
        raise ValueError(f"world_size: expected >= 1, got {world_size}")
    if kind == "allreduce":
        return 2 * (world_size - 1)
    if kind == "allgather":
        return world_size - 1
    if kind == "two_shot":
        return 2 * min(1, world_size - 1)
    raise ValueError(f"kind: expected 'allreduce', 'allgather' or 'two_shot', got {kind!r}")


@dataclass(frozen=True)
class LinkModel:
    """alpha-beta parameters of one link rate.

    Attributes:
        alpha_s: latency per ring hop (seconds): the time a message of no size takes from one
            rank to the next, the link's one-way delay included.
        goodput_bps: effective rate ``eta * R`` (bits/s) the payload moves at.
    """

    alpha_s: float
    goodput_bps: float

    def with_delay(self, delay_s: float) -> "LinkModel":
        """This link with ``delay_s`` seconds of extra one-way delay between two ranks (netem-style
        propagation delay): every ring hop pays it once, the goodput is unchanged.

        Raises:
            ValueError: ``delay_s`` negative or not finite."""
        if not (math.isfinite(delay_s) and delay_s >= 0):
            raise ValueError(f"delay_s: expected a finite number of seconds >= 0, got {delay_s!r}")
        return LinkModel(alpha_s=self.alpha_s + delay_s, goodput_bps=self.goodput_bps)

    def latency_s(self, kind: str, world_size: int, collectives: float = 1.0) -> float:
        """Seconds of latency alone (no payload) of ``collectives`` calls of ``kind``:
        ``collectives * ring_hops(kind, world_size) * alpha_s``."""
        return collectives * ring_hops(kind, world_size) * self.alpha_s

    def allreduce_s(self, nbytes: float, world_size: int, collectives: float = 1.0) -> float:
        """Seconds for ``collectives`` ring all-reduces totalling ``nbytes`` bytes on ``world_size`` ranks."""
        w = world_size
        return self.latency_s("allreduce", w, collectives) + 2 * (w - 1) / w * 8 * nbytes / self.goodput_bps

    def allgather_s(self, nbytes: float, world_size: int, collectives: float = 1.0) -> float:
        """Seconds for ``collectives`` ring all-gathers of ``nbytes`` bytes per rank in total."""
        w = world_size
        return self.latency_s("allgather", w, collectives) + (w - 1) * 8 * nbytes / self.goodput_bps

    def collective_s(self, kind: str, nbytes: float, world_size: int, collectives: float = 1.0) -> float:
        if kind == "allreduce":
            return self.allreduce_s(nbytes, world_size, collectives)
        if kind == "allgather":
            return self.allgather_s(nbytes, world_size, collectives)
        raise ValueError(f"kind: expected 'allreduce' or 'allgather', got {kind!r}")


def _coeffs(kind: str, nbytes: float, world_size: int, collectives: float) -> Tuple[float, float]:
    """(multiplier of alpha, multiplier of 1/goodput) of one observation."""
    w = world_size
    hops = collectives * ring_hops(kind, w)
    return hops, (2 * (w - 1) / w if kind == "allreduce" else (w - 1)) * 8 * nbytes


def fit_link(obs: Sequence[Tuple[str, float, int, float, float]]) -> LinkModel:
    """Least-squares alpha and goodput from collective timings.

    Args:
        obs: ``(kind, nbytes, world_size, collectives, seconds)`` per
            observation: the time of ``collectives`` collectives of ``kind``
            moving ``nbytes`` bytes (per rank, in total) on ``world_size``
            ranks.

    Returns:
        the :class:`LinkModel` minimising the squared error (exact on data
        generated by a :class:`LinkModel`); a negative fitted alpha is
        clipped to 0.

    Raises:
        ValueError: fewer than two distinct message sizes (alpha and the
            goodput cannot both be identified: the model refuses to
            extrapolate), a non-positive fitted goodput, or a bad observation.
    """
    rows = []
    for o in obs:
        if len(o) != 5:
            raise ValueError(f"obs: expected (kind, nbytes, world_size, collectives, seconds), got {o!r}")
        kind, nbytes, w, n, t = o
        if not (nbytes >= 0 and w >= 2 and n > 0 and t >= 0):
            raise ValueError(f"obs: bad observation {o!r} (nbytes >= 0, world_size >= 2, collectives > 0, "
                             f"seconds >= 0)")
        rows.append((*_coeffs(kind, nbytes, w, n), t))
    sizes = {round(r[1], 6) for r in rows}
    if len(sizes) < 2:
        raise ValueError(f"obs: {len(rows)} observation(s) with {len(sizes)} distinct message size(s); "
                         f"fitting alpha and the goodput needs at least two sizes")
    # normal equations of t = a * alpha + x * inv_goodput
    saa = sum(a * a for a, _, _ in rows)
    sax = sum(a * x for a, x, _ in rows)
    sxx = sum(x * x for _, x, _ in rows)
    sat = sum(a * t for a, _, t in rows)
    sxt = sum(x * t for _, x, t in rows)
    det = saa * sxx - sax * sax
    if abs(det) <= 1e-12 * max(1.0, saa * sxx):
        raise ValueError("obs: the observations do not separate latency from bandwidth (collinear sizes)")
    alpha = (sat * sxx - sax * sxt) / det
    inv_g = (saa * sxt - sax * sat) / det
    if inv_g <= 0:
        raise ValueError(f"obs: fitted goodput is not positive (1/goodput = {inv_g:g}); the times do not grow "
                         f"with the message size")
    return LinkModel(alpha_s=max(0.0, alpha), goodput_bps=1.0 / inv_g)


#: SlimDPState's default check_agreement_every (slimcomm.train does not change it): one checksum
#: all-reduce per bucket every this many compressed steps
_CHECK_EVERY = 100


def _buckets(run: Dict) -> int:
    """DDP buckets (or SlimDPOptimizer parameter groups) of the run: its dense bytes over the
    ``bucket_cap_mb`` cap, at least 1."""
    cfg = run.get("config") or {}
    cap = float(cfg.get("bucket_cap_mb") or 25.0) * 2 ** 20
    # slimcomm.train passes bucket_cap_mb to DDP explicitly, so DDP's first bucket has the same cap
    # (its 1 MiB first bucket applies only when bucket_cap_mb is left unset); SlimDPOptimizer packs
    # its fp32 groups to the same cap
    return max(1, math.ceil(float(run["dense_bytes_per_step"]) / cap))


def two_shot(run: Dict) -> bool:
    """Whether a slimdp run summed its compressed buckets with the two-shot all-reduce
    (``--allreduce-algorithm two_shot``); runs made before the option existed used the
    backend's ring."""
    cfg = run.get("config") or {}
    return run.get("method") == "slimdp" and cfg.get("allreduce_algorithm") == "two_shot" \
        and int(run["world_size"]) > 1


def collective_calls(run: Dict, current_code: bool = False) -> Dict[str, float]:
    """Collective calls one training step issues, per latency class, amortised over the run.

    Returns ``{"allreduce": n, "allgather": m}`` (plus ``"two_shot"`` for a slimdp run that used
    it): ``n`` calls paying a ring all-reduce's
    ``2 (W-1)`` hops, ``m`` paying a ring all-gather's ``W-1`` (an all-to-all counts as one such
    call: its pairwise exchanges are not more than ``W-1`` sequential hops). ``B`` = buckets
    (DDP) or parameter groups (SlimDPOptimizer) of ``bucket_cap_mb``:

    * ddp, fp16: ``B`` all-reduces a step;
    * powersgd: ``3 B`` (the uncompressed tensors, P and Q of each bucket);
    * topk (hook, local index sets): ``2 B`` all-gathers (indices and values);
    * slimdp (hook): ``B`` all-reduces (``"two_shot"`` calls, 2 hops each, where the run summed
      its values with the two-shot all-reduce: :func:`two_shot`) plus its small checksum all-reduces (64-96 bytes; one per
      bucket at every core refresh and every 100th compressed step): the run's counted
      ``stats["total"]["checks"]`` when recorded, else ``B (1/core_refresh + 1/100)``;
    * ist: per round (``stats["rounds"]`` when recorded, else one per ``local_steps``): one
      all-gather, one agreement all-reduce (counted from ``stats["check_bytes"]``, 80 bytes a
      round, when the run has stats: runs made before the agreement existed have none), + one
      all-reduce of the shared neurons with ``ist_shared`` > 0;
    * diloco, sparseloco, slimdp-local (SlimDPOptimizer), per synchronisation (``stats["syncs"]``
      when recorded, else one per ``sync_every`` steps): per group ``B`` all-reduces (dense
      values, ``diloco``; shared index sets, slimdp-local without ``value_bits``), ``2 B``
      all-gathers (sparseloco: indices and values), or for 2-bit codes ``2 B`` all-gather-class
      calls (all-to-all + all-gather, ``lowbit_collective="all_reduce"``) or ``B`` all-gathers
      (``"all_gather"``); plus the small all-reduces the run counted in
      ``stats["total"]["checks"]`` (the 80-byte agreement that starts every synchronisation in
      the current code, index-set checks, core refreshes), or without stats one agreement per
      synchronisation;
    * local (no communication): none.

    The warm-up steps (a dense all-reduce instead) are not told apart.

    ``current_code=True``: the calls the current code would make with the run's settings where the
    run was made by older code: one agreement all-reduce per synchronisation / IST round where
    the run recorded fewer, and slimdp-local's 2-bit codes through the two-stage all-reduce
    (all-to-all + all-gather) where the run's config predates ``lowbit_collective``.

    Raises:
        ValueError: an unknown method.
    """
    cfg, m = run.get("config") or {}, run["method"]
    b = float(_buckets(run))
    steps = max(1, int(run.get("steps") or 0))
    total = ((run.get("stats") or {}).get("total") or {}) if isinstance(run.get("stats"), dict) else {}
    checks = total.get("checks") if isinstance(total, dict) else None
    if m == "local":
        return {"allreduce": 0.0, "allgather": 0.0}
    if m in ("ddp", "fp16"):
        return {"allreduce": b, "allgather": 0.0}
    if m == "powersgd":
        return {"allreduce": 3 * b, "allgather": 0.0}
    if m == "topk":
        return {"allreduce": 0.0, "allgather": 2 * b}
    if m == "slimdp":
        small = (checks / steps if checks is not None
                 else b * (1.0 / max(1, cfg.get("core_refresh") or 10) + 1.0 / _CHECK_EVERY))
        if two_shot(run):
            return {"allreduce": small, "allgather": 0.0, "two_shot": b}
        return {"allreduce": b + small, "allgather": 0.0}
    stats = run.get("stats") if isinstance(run.get("stats"), dict) else None
    if m == "ist":
        rounds = (stats or {}).get("rounds")
        per = rounds / steps if rounds is not None else 1.0 / max(1, cfg.get("local_steps") or 1)
        shared = 1.0 if (cfg.get("ist_shared") or 0) > 0 else 0.0
        if stats is None:
            agree = per  # the current code: one agreement all-reduce a round
        else:  # what the run recorded (80 bytes a round; runs made before the agreement have none)
            agree = (stats.get("check_bytes") or 0) / 80.0 / steps
            if current_code and agree < per:
                agree = per
        return {"allreduce": per * shared + agree, "allgather": per}
    if m in ("diloco", "sparseloco", "slimdp-local"):
        syncs = (stats or {}).get("syncs")
        per = (syncs / steps) if syncs is not None else 1.0 / max(1, cfg.get("sync_every") or 1)
        ar, ag = 0.0, 0.0
        if m == "diloco":
            ar += b
        elif m == "sparseloco":
            ag += 2 * b
        elif cfg.get("value_bits") is None:
            ar += b
        elif cfg.get("lowbit_collective", "all_reduce" if current_code else "all_gather") == "all_reduce":
            ag += 2 * b
        else:
            ag += b
        # small all-reduces: the agreement at every synchronisation (+ index-set checks and core
        # refreshes in shared mode), as the run counted them in stats["total"]["checks"] (runs made
        # before the agreement existed count none); without stats, the current code's one agreement
        small = checks / steps if checks is not None else per
        if current_code and checks is not None and checks < per * steps:
            small += per  # a run made before the per-sync agreement: add it
        return {"allreduce": per * ar + small, "allgather": per * ag}
    raise ValueError(f"method: unknown {m!r}; expected one of {', '.join(sorted(PATTERN))}")


def hops_per_step(run: Dict, current_code: bool = False) -> float:
    """Ring hops of latency one training step pays (amortised): :func:`collective_calls`
    weighted by :func:`ring_hops`. An added one-way delay ``d`` per hop adds ``d *
    hops_per_step(run)`` seconds to every step."""
    w = int(run["world_size"])
    return sum(n * ring_hops(k, w) for k, n in collective_calls(run, current_code).items())


def collectives_per_step(run: Dict) -> float:
    """Collectives one step issues (amortised), in calls of the run's pattern kind
    (:func:`pattern_of`) with the same ring hops: ``hops_per_step / ring_hops(pattern)``, so
    ``LinkModel.collective_s(pattern, bytes, W, collectives_per_step * steps)`` charges every call
    of :func:`collective_calls` its latency. 0 for ``local``; DDP ``B`` (buckets); local-step
    methods ``(calls per synchronisation) / H``."""
    w = int(run["world_size"])
    hops = ring_hops(pattern_of(run["method"], run.get("config")), w)
    return hops_per_step(run) / hops if hops else 0.0


def delay_s_at(run: Dict, step: float, delay_s: float) -> float:
    """Seconds ``delay_s`` of one-way delay per hop adds to ``run`` up to ``step``:
    ``delay_s * hops_per_step(run) * step`` (exactly the latency term of
    :meth:`LinkModel.with_delay`)."""
    if not (math.isfinite(delay_s) and delay_s >= 0):
        raise ValueError(f"delay_s: expected a finite number of seconds >= 0, got {delay_s!r}")
    return delay_s * hops_per_step(run) * step


def delayed_result(result: Dict[str, Any], delay_s: float, current_code: bool = False) -> Dict[str, Any]:
    """A copy of ``result`` as if every link had ``delay_s`` seconds more one-way delay per hop.

    Every training time (each evaluation's, ``final``'s and ``time_to_target``'s) grows by
    :func:`delay_s_at` at its step; bytes and scores stay. The times of ``result`` are the
    run's own (measured, or projected by ``bench/netbench_projection.py``) at delay 0; the copy
    records ``"delay": {"one_way_s", "hops_per_step", "source"}``. ``delay_s == 0`` returns the
    same times exactly. A run of the Slim-DP hook with ``delay_steps=1`` overlaps its payload
    all-reduce with the next step, so only what outlasts the step is added
    (:func:`_overlapped_delay`; ``hops_per_step`` is then the effective count). ``current_code``: count the calls the current code makes
    (:func:`collective_calls`).

    Raises:
        ValueError: ``delay_s`` negative or not finite; an unknown method.
    """
    if not (math.isfinite(delay_s) and delay_s >= 0):
        raise ValueError(f"delay_s: expected a finite number of seconds >= 0, got {delay_s!r}")
    hps = hops_per_step(result, current_code)
    overlap = _overlapped_delay(result, delay_s)
    if overlap is not None:  # the per-step seconds the delay adds, already multiplied out
        hps = overlap / delay_s if delay_s else hps
    r = copy.deepcopy(result)
    for e in r.get("evals") or []:
        e["train_time_s"] = e["train_time_s"] + delay_s * hps * e["step"]
    for e in r.get("epochs") or []:
        if "step" in e:
            e["train_time_s"] = e["train_time_s"] + delay_s * hps * e["step"]
    r["final"]["train_time_s"] = r["final"]["train_time_s"] + delay_s * hps * int(r["steps"])
    t = r.get("time_to_target")
    if t:
        t["train_time_s"] = t["train_time_s"] + delay_s * hps * int(t["step"])
    r["delay"] = {"one_way_s": delay_s, "hops_per_step": hps, "source": "projected" if delay_s else "as run"}
    return r


def _overlapped_delay(run: Dict, delay_s: float) -> Optional[float]:
    """Seconds per step a one-way delay adds to a run of the Slim-DP hook with
    ``delay_steps=1`` (else None): its ``B`` payload all-reduces of step ``t`` overlap step
    ``t + 1``'s computation, so they cost time only where they outlast the step:
    ``max(0, c0 + 2 (W-1) B d - T0)``, with ``T0`` the run's measured seconds per step and
    ``c0`` the modelled time of its payload all-reduces on its link (``run["link"]["rate"]``
    in :data:`EMULATED_LINKS`, else 0); the small checksum all-reduces at core refreshes are
    not overlapped and pay ``2 (W-1) d`` each."""
    cfg = run.get("config") or {}
    if run.get("method") != "slimdp" or not cfg.get("delay_steps"):
        return None
    w = int(run["world_size"])
    steps = max(1, int(run.get("steps") or 0))
    b = float(_buckets(run))
    calls = collective_calls(run)
    small = max(0.0, calls["allreduce"] - b)
    t0 = float(run["final"]["train_time_s"]) / steps
    rate = (run.get("link") or {}).get("rate")
    sent = float(run["final"].get("bytes_sent_per_rank") or 0.0) / steps
    link = EMULATED_LINKS.get(rate, {}).get("allreduce") if rate else None
    c0 = link.allreduce_s(sent, w, b) if link is not None else 0.0
    hop = ring_hops("allreduce", w) * delay_s
    return max(0.0, c0 + hop * b - t0) - max(0.0, c0 - t0) + small * hop


_DELAY_UNITS = {"ms": 1e-3, "us": 1e-6, "s": 1.0}


def parse_delays(spec: str) -> List[float]:
    """``"0,10,50ms"`` -> ``[0.0, 0.01, 0.05]`` (seconds). A unit (``ms``, ``us``, ``s``) on any
    entry applies to the entries before it that have none; without one, milliseconds.

    Raises:
        ValueError: an empty list, an entry that is not a number >= 0, or a repeated delay."""
    items = [x.strip() for x in str(spec).split(",")]
    if not items or any(not x for x in items):
        raise ValueError(f"--delays {spec!r}: expected comma-separated delays like 0,10,50ms")
    out: List[Optional[float]] = []
    pending: List[int] = []
    for x in items:
        unit = next((u for u in ("ms", "us", "s") if x.endswith(u)), None)
        num = x[: -len(unit)] if unit else x
        try:
            v = float(num)
        except ValueError:
            raise ValueError(f"--delays {spec!r}: {x!r} is not a delay like 10ms") from None
        if not (math.isfinite(v) and v >= 0):
            raise ValueError(f"--delays {spec!r}: {x!r} must be a finite delay >= 0")
        out.append(v)
        pending.append(len(out) - 1)
        if unit:
            for i in pending:
                out[i] = out[i] * _DELAY_UNITS[unit]
            pending = []
    for i in pending:
        out[i] = out[i] * 1e-3
    vals = [float(v) for v in out]
    if len(set(vals)) != len(vals):
        raise ValueError(f"--delays {spec!r}: a delay is given twice")
    return vals


# ---------------------------------------------------------------------------
# The links the demo reports
# ---------------------------------------------------------------------------

#: rate -> collective kind -> :class:`LinkModel`: 2-rank gloo collectives on this project's
#: tbf-emulated links, idle gap 300 ms before each call (the largest measured, closest to a
#: training step's compute between collectives), fitted per kind with :func:`fit_link` on
#: ``bench/results/scale/collbench.json`` (2026-12-01; 256 B-16 MiB messages, 2-core machine).
EMULATED_LINKS: Dict[str, Dict[str, LinkModel]] = {
    "1gbit": {"allreduce": LinkModel(alpha_s=0.71e-3, goodput_bps=976.7e6),
              "allgather": LinkModel(alpha_s=0.84e-3, goodput_bps=726.5e6)},
    "100mbit": {"allreduce": LinkModel(alpha_s=0.0, goodput_bps=89.23e6),
                "allgather": LinkModel(alpha_s=0.0, goodput_bps=62.03e6)},
}
EMULATED_LINKS_SOURCE = ("2-rank gloo collectives measured on tbf-emulated links (bench/results/scale/collbench.json, "
                         "fit per collective kind)")

LINK_NAMES = {"loopback": "loopback", "1gbit": "1 Gbit/s", "100mbit": "100 Mbit/s"}
DEFAULT_RATES = ("1gbit", "100mbit")


def _rate_name(rate: str) -> str:
    return LINK_NAMES.get(rate, rate)


def projection_note(rates: Sequence[str] = DEFAULT_RATES, methods: Sequence[str] = ("ddp", "slimdp", "ist"),
                    overlap: bool = False) -> str:
    """One line: what a projected figure assumes (per-link rate, goodput, latency, ring collectives).
    ``overlap``: a run of the Slim-DP hook with ``delay_steps=1`` is among the projected ones (its
    payload all-reduces overlap the next step, :func:`project_result`)."""
    kinds = {k: [m for m in methods if PATTERN.get(m) == k] for k in ("allreduce", "allgather")}
    how = " / ".join(f"ring {'all-reduce' if k == 'allreduce' else 'all-gather'} ({', '.join(ms)})"
                     for k, ms in kinds.items() if ms)
    parts = []
    for rate in rates:
        ar, ag = EMULATED_LINKS[rate]["allreduce"], EMULATED_LINKS[rate]["allgather"]
        parts.append(f"{_rate_name(rate)} per rank's link: all-reduce goodput {ar.goodput_bps / 1e6:.0f} Mbit/s, "
                     f"all-gather {ag.goodput_bps / 1e6:.0f} Mbit/s, latency {ar.alpha_s * 1e3:.1f}/"
                     f"{ag.alpha_s * 1e3:.1f} ms per hop")
    return ("projected = this run's compute time (its train time minus its collectives at the loopback speed "
            "it measured after training) + its counted bytes through " + how + " at " + "; ".join(parts) + " (measured on tbf-emulated links, "
            "bench/results/scale/collbench.md); " + (
                "no overlap of communication with compute, except the payload all-reduces of "
                "slimdp with --delay-steps 1, which overlap the next step (a step takes the longer "
                "of the two)" if overlap else "no overlap of communication with compute"))


def overlaps(result: Dict[str, Any]) -> bool:
    """Whether :func:`project_result` overlaps ``result``'s collectives with its computation
    (the Slim-DP hook with ``delay_steps=1``)."""
    return result.get("method") == "slimdp" and bool((result.get("config") or {}).get("delay_steps"))


# ---------------------------------------------------------------------------
# Measuring the link a run used
# ---------------------------------------------------------------------------

PROBE_BYTES = (1 << 18, 1 << 22, 1 << 24)
"""Message sizes of :func:`probe_link` (256 KiB, 4 MiB, 16 MiB)."""


def probe_link(kind: str, world_size: int, device=None, sizes: Sequence[int] = PROBE_BYTES, reps: int = 3,
               group=None) -> Dict[str, Any]:
    """Time ``reps`` collectives of ``kind`` per message size on the current process group; fit them.

    Collective: every rank must call it with the same arguments. Each call follows a barrier and
    is timed from there to its return on this rank; the per-size median enters :func:`fit_link`.

    Returns:
        ``{"kind", "alpha_s", "goodput_bps", "timings": [{"bytes", "median_s"}]}``; the fit is the
        one of rank 0's timings (every rank returns its own, rank 0's is what the results record).

    Raises:
        ValueError: ``world_size`` < 2 or an unknown ``kind``.
    """
    import torch
    import torch.distributed as dist

    if world_size < 2:
        raise ValueError(f"probe_link: needs at least 2 ranks, got {world_size}")
    if kind not in ("allreduce", "allgather"):
        raise ValueError(f"kind: expected 'allreduce' or 'allgather', got {kind!r}")
    timings = []
    for nbytes in sizes:
        x = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)
        outs = [torch.empty_like(x) for _ in range(world_size)] if kind == "allgather" else None
        ts = []
        for _ in range(reps):
            dist.barrier(group=group)
            t0 = time.perf_counter()
            if kind == "allreduce":
                dist.all_reduce(x, group=group)
            else:
                dist.all_gather(outs, x, group=group)
            if x.is_cuda:
                torch.cuda.synchronize(x.device)
            ts.append(time.perf_counter() - t0)
        timings.append({"bytes": int(x.numel() * 4), "median_s": statistics.median(ts)})
    lm = fit_link([(kind, t["bytes"], world_size, 1.0, t["median_s"]) for t in timings])
    return {"kind": kind, "alpha_s": lm.alpha_s, "goodput_bps": lm.goodput_bps, "timings": timings}


# ---------------------------------------------------------------------------
# Projection of one results dict
# ---------------------------------------------------------------------------

def _link_of(result: Dict[str, Any], links: Optional[Dict[str, Dict[str, LinkModel]]], rate: str) -> LinkModel:
    kind = pattern_of(result["method"], result.get("config"))
    if links is not None and rate in links:
        return links[rate][kind]
    if rate == "loopback":
        own = (result.get("link_times") or {}).get("measured_link")
        if not own:
            raise ValueError(f"{result['method']} run: no measured link (link_times.measured_link) to take "
                             "its own collectives out of its train time")
        return LinkModel(own["alpha_s"], own["goodput_bps"])
    return EMULATED_LINKS[rate][kind]


def _points(result: Dict[str, Any]) -> List[Tuple[int, float, float]]:
    """``(step, train_time_s, bytes_sent_per_rank)`` of every evaluation, then of the last step."""
    pts = [(int(e["step"]), float(e["train_time_s"]), float(e["bytes_sent_per_rank"])) for e in result["evals"]]
    f = result["final"]
    last = (int(result["steps"]), float(f["train_time_s"]), float(f["bytes_sent_per_rank"]))
    if not pts or pts[-1][0] != last[0]:
        pts.append(last)
    return pts


def run_compute_s(result: Dict[str, Any], ran_on: LinkModel) -> List[Tuple[int, float, float]]:
    """``(step, compute seconds, bytes)`` up to every evaluation of ``result``: its measured train
    time minus the modelled time of its collectives on ``ran_on``, the link it ran on (never below 0)."""
    kind = pattern_of(result["method"], result.get("config"))
    w = int(result["world_size"])
    per_step = collectives_per_step(result)
    return [(k, max(0.0, t - ran_on.collective_s(kind, b, w, per_step * k)), b) for k, t, b in _points(result)]


def project_result(result: Dict[str, Any], rate: str, ran_on: LinkModel,
                   links: Optional[Dict[str, Dict[str, LinkModel]]] = None, delay_s: float = 0.0) -> Dict[str, Any]:
    """``result``'s train time on the link ``rate`` (:data:`EMULATED_LINKS` unless ``links`` has it).

    ``ran_on``: the link ``result`` was measured on (its loopback :func:`probe_link` fit, or an
    emulated link's model). ``delay_s``: seconds of one-way delay per hop added to that link
    (:meth:`LinkModel.with_delay`; 0 = the link as fitted). Returns ``{"rate", "source":
    "projected", "delay_s", "train_time_s", "time_to_target_s", "evals": [{"step",
    "train_time_s"}]}``; ``time_to_target_s`` is the projected time of the evaluation that first
    reached the target (None if none did).

    Raises:
        ValueError: ``delay_s`` negative or not finite.
    """
    link = _link_of(result, links, rate).with_delay(delay_s)
    kind = pattern_of(result["method"], result.get("config"))
    w = int(result["world_size"])
    per_step = collectives_per_step(result)
    if overlaps(result):
        # delay_steps=1: the payload all-reduces overlap the next step's computation, so a step
        # takes the longer of the two; the small checksum all-reduces do not overlap
        nb = float(_buckets(result))
        small = max(0.0, collective_calls(result)["allreduce"] - nb)
        at = {k: max(c, link.allreduce_s(b, w, nb * k)) + link.latency_s("allreduce", w, small * k)
              for k, c, b in run_compute_s(result, ran_on)}
    else:
        at = {k: c + link.collective_s(kind, b, w, per_step * k) for k, c, b in run_compute_s(result, ran_on)}
    ttt = result.get("time_to_target")
    return {"rate": rate, "source": "projected", "delay_s": delay_s,
            "train_time_s": at[int(result["steps"])],
            "time_to_target_s": at[int(ttt["step"])] if ttt else None,
            "evals": [{"step": int(e["step"]), "train_time_s": at[int(e["step"])]} for e in result["evals"]]}


def add_link_times(result: Dict[str, Any], measured_link: Dict[str, Any],
                   rates: Sequence[str] = DEFAULT_RATES) -> Dict[str, Any]:
    """Record, in place, ``result["link_times"]``: the link the run measured (``measured_link``, a
    :func:`probe_link` dict), its compute per step, and its projected time at every ``rate``."""
    ran_on = LinkModel(measured_link["alpha_s"], measured_link["goodput_bps"])
    comp = run_compute_s(result, ran_on)
    steps = max(1, int(result["steps"]))
    result["link_times"] = {
        "measured_link": measured_link,
        "collectives_per_step": collectives_per_step(result),
        "compute_s_per_step": comp[-1][1] / steps,
        "assumptions": projection_note([r for r in rates if r in EMULATED_LINKS], [result["method"]],
                                       overlaps(result)),
        "links": {rate: project_result(result, rate, ran_on) for rate in rates},
    }
    return result


def link_result(result: Dict[str, Any], rate: str) -> Dict[str, Any]:
    """A copy of ``result`` as if it had run on ``rate``: evaluation, final and time-to-target times
    replaced by its ``link_times`` projection, and ``"link": {"rate", "source"}`` (for the plots,
    which draw one time panel per link rate)."""
    p = result["link_times"]["links"][rate]
    r = copy.deepcopy(result)
    by_step = {e["step"]: e["train_time_s"] for e in p["evals"]}
    for e in r["evals"]:
        e["train_time_s"] = by_step[int(e["step"])]
    r["final"]["train_time_s"] = p["train_time_s"]
    if r.get("time_to_target"):
        r["time_to_target"]["train_time_s"] = p["time_to_target_s"]
    r["link"] = {"rate": rate, "source": p["source"]}
    return r


# ---------------------------------------------------------------------------
# The demo's table
# ---------------------------------------------------------------------------

def _fmt_x(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.3g}x"


def links_table(results: Sequence[Dict[str, Any]], baseline: str = "ddp", fmt: str = "github") -> str:
    """One row per (link, method): train time, time to target, speed-ups against ``baseline`` on the
    same link, and whether the figure is measured or projected.

    The loopback rows are the runs' own measured times; the other links come from each result's
    ``link_times`` (:func:`add_link_times`). Results without ``link_times`` give loopback rows only.
    """
    from tabulate import tabulate

    rates: List[str] = []
    for r in results:
        for rate in (r.get("link_times") or {}).get("links", {}):
            if rate not in rates:
                rates.append(rate)
    tgt = next((r["time_to_target"]["target"] for r in results if r.get("time_to_target")), None)
    if tgt is None:
        tgt = next((r.get("config", {}).get("target_acc") for r in results
                    if r.get("config", {}).get("target_acc") is not None), None)
    tname = f"time to {tgt:g} (s)" if tgt is not None else "time to target (s)"
    ratios = len(results) > 1 and any(r["method"] == baseline for r in results)
    headers = (["link", "method", "train time (s)"] + ([f"time vs {baseline}"] if ratios else []) + [tname]
               + ([f"speed-up to target vs {baseline}"] if ratios else []) + ["figure"])

    def figures(r, rate):
        if rate == "loopback":
            t = r.get("time_to_target")
            return r["final"]["train_time_s"], (t["train_time_s"] if t else None), "measured (this machine)"
        p = r["link_times"]["links"][rate]
        src = "measured (emulated link)" if p["source"] == "measured" else "projected"
        return p["train_time_s"], p["time_to_target_s"], src

    rows = []
    for rate in ["loopback"] + rates:
        have = [r for r in results if rate == "loopback" or rate in (r.get("link_times") or {}).get("links", {})]
        base = next((r for r in have if r["method"] == baseline), None)
        bt, bttt = (figures(base, rate)[:2] if base is not None else (None, None))
        for r in have:
            t, ttt, src = figures(r, rate)
            rows.append([_rate_name(rate), r.get("label") or r["method"], f"{t:.1f}"]
                        + ([_fmt_x(t / bt) if bt else "-"] if ratios else [])
                        + [f"{ttt:.1f}" if ttt is not None else "not reached"]
                        + ([_fmt_x(bttt / ttt) if (bttt is not None and ttt) else "-"] if ratios else []) + [src])
    return tabulate(rows, headers=headers, tablefmt=fmt, disable_numparse=True)
