#!/usr/bin/env python3
"""Time to target of every method at added one-way link delays, from a bench/netbench.py results dir.

Projected, not measured: the emulated links of ``bench/netbench.py`` have no delay of their own
(``tbf`` only; ``netem`` is not available on the benchmark's kernels). Each run's times at delay 0
are its own (the measured run, or the netbench projection of a timed run at a ``--timed-rates``
rate); at a one-way delay ``d`` per hop (rank to rank) every training time up to step ``k`` grows
by ``d * hops_per_step * k`` (:func:`slimcomm.train.projection.delayed_result`): the alpha term
of the repository's one cost model, with every collective call of the method counted
(:func:`slimcomm.train.projection.collective_calls`: DDP's bucket all-reduces, the Slim-DP hook's
checksum all-reduces, one agreement all-reduce and the value collectives per synchronisation of
the local-step methods). Bytes and scores (the trajectory) do not depend on the link. Delay 0
reproduces the netbench tables' times exactly.

With a ``local`` run in the directory (``netbench.py --methods ...,local``: every rank trains
alone, no communication) the tables also give the *compute limit*: ddp's steps to the target x
local's measured ms/step, and each method's time as a multiple of it.

Not modelled: TCP throughput capped by the bandwidth-delay product (at 1 Gbit/s and 50 ms one way
a window of 6.25 MB is needed for full rate, more than Linux's default maximum receive buffer of
6 MB; large ring messages then move slower than the fitted goodput), retransmissions, overlap of
communication with compute (none, except a run of the Slim-DP hook with ``--delay-steps 1``, whose
payload all-reduces overlap the next step: only what outlasts the step is added,
:func:`slimcomm.train.projection.delayed_result`; its ``hops/step`` column is the count before
that overlap).

Usage::

    bench/latency_tables.py bench/results/scale/mlp_8ranks_seeds --delays 0,10,50ms \\
        --out bench/results/scale/latency_mlp_8ranks.md
    bench/latency_tables.py bench/results/scale/gpt_8ranks --target ddp --target all \\
        --out bench/results/scale/latency_gpt_8ranks.md
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import statistics
import sys
from typing import Dict, List, Optional, Sequence, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (REPO, os.path.join(REPO, "bench")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from netbench import parse_rate  # noqa: E402
from slimcomm.train import projection as P  # noqa: E402

__all__ = ["load_results", "time_to", "resolve_targets", "latency_rows", "intro", "markdown", "main"]

#: methods whose algorithm is slimcomm's own (the rest are baselines and published peers, even where
#: slimcomm's SlimDPOptimizer runs them: diloco, sparseloco)
SLIMCOMM_METHODS = ("slimdp", "slimdp-local", "ist")
#: the no-communication reference; never a contender
LIMIT_METHOD = "local"

_NAME_RE = re.compile(r"^(?P<rate>[0-9.]+(?:kbit|mbit|gbit))_(?P<label>.+?)(?:_s(?P<seed>\d+))?\.json$")


def load_results(results_dir: str) -> Dict[str, Dict[str, List[Dict]]]:
    """``{rate: {method label: [result per seed, by seed]}}`` of a netbench JSON directory
    (``<rate>_<label>[_s<seed>].json``; ``*_timed.json`` are the timed runs the projected
    files were made from, and are skipped).

    Raises:
        ValueError: ``results_dir`` is not a directory or holds no result, or a rate lacks
            ddp (every table compares with it).
    """
    if not os.path.isdir(results_dir):
        raise ValueError(f"results_dir: {results_dir!r} is not a directory")
    out: Dict[str, Dict[str, List[Tuple[int, Dict]]]] = {}
    for name in sorted(os.listdir(results_dir)):
        if name.endswith("_timed.json"):
            continue
        m = _NAME_RE.match(name)
        if not m:
            continue
        with open(os.path.join(results_dir, name)) as f:
            r = json.load(f)
        seed = int(m.group("seed")) if m.group("seed") is not None else int((r.get("config") or {}).get("seed") or 0)
        out.setdefault(m.group("rate"), {}).setdefault(m.group("label"), []).append((seed, r))
    if not out:
        raise ValueError(f"results_dir: no netbench result JSON (<rate>_<method>[_s<seed>].json) in {results_dir!r}")
    res = {rate: {lab: [r for _, r in sorted(runs, key=lambda x: x[0])] for lab, runs in by.items()}
           for rate, by in out.items()}
    for rate, by in res.items():
        if "ddp" not in by:
            raise ValueError(f"results_dir: no ddp run at {rate} in {results_dir!r} (the tables compare with it)")
    # the faster rate first (the trajectory one); ddp first within a rate
    res = {rate: dict(sorted(by.items(), key=lambda kv: (kv[0] != "ddp", kv[0]))) for rate, by in res.items()}
    return dict(sorted(res.items(), key=lambda kv: -parse_rate(kv[0])))


def _metric(run: Dict) -> Tuple[str, str]:
    m = run.get("metric") or {}
    return m.get("name", "test_acc"), m.get("goal", "max")


def time_to(run: Dict, target: float, key: str = "train_time_s") -> Optional[float]:
    """``key`` (train time, or ``"step"``) of the first evaluation of ``run`` that reaches
    ``target`` (test accuracy >= target, or validation loss <= target); None if none does."""
    name, goal = _metric(run)
    for e in run["evals"]:
        v = e.get(name)
        if v is not None and (v >= target - 1e-12 if goal == "max" else v <= target + 1e-12):
            return e[key]
    return None


def _best(run: Dict) -> float:
    name, goal = _metric(run)
    vals = [e[name] for e in run["evals"] if e.get(name) is not None]
    return max(vals) if goal == "max" else min(vals)


def resolve_targets(by_method: Dict[str, List[Dict]], spec: str) -> Tuple[str, List[float]]:
    """``(description, per-seed targets)`` for one ``--target``: ``"run"`` the runs' own
    ``--target-acc``/``--target-loss`` (config), ``"ddp"`` ddp's final score of the same seed
    (the netbench GPT tables' target), ``"all"`` the loosest score every run of every method
    (``local`` aside) reaches, or a number.

    Raises:
        ValueError: an unknown spec, a ``"run"`` target the runs do not have, or ddp with a
            different number of seeds than the other methods (for ``"ddp"``)."""
    ddp = by_method["ddp"]
    name, goal = _metric(ddp[0])
    n = len(ddp)
    if spec == "run":
        t = ddp[0]["config"].get("target_acc" if name == "test_acc" else "target_loss")
        if t is None:
            raise ValueError(f"--target run: the runs have no {'--target-acc' if name == 'test_acc' else '--target-loss'}")
        return f"{name} {'>=' if goal == 'max' else '<='} {t:g} (the runs' target)", [float(t)] * n
    if spec == "ddp":
        return (f"ddp's final {name} of the same seed (median {statistics.median(r['final'][name] for r in ddp):.4f})",
                [float(r["final"][name]) for r in ddp])
    if spec == "all":
        bests = [_best(r) for lab, runs in by_method.items() if lab.split("@")[0] != LIMIT_METHOD for r in runs]
        t = min(bests) if goal == "max" else max(bests)
        return f"{name} {'>=' if goal == 'max' else '<='} {t:.4f} (the loosest score every method's every run reaches)", [t] * n
    try:
        t = float(spec)
    except ValueError:
        raise ValueError(f"--target {spec!r}: expected run, ddp, all or a number") from None
    if not math.isfinite(t):
        raise ValueError(f"--target {spec!r}: expected a finite number")
    return f"{name} {'>=' if goal == 'max' else '<='} {t:g}", [t] * n


def _median_or_none(xs: Sequence[Optional[float]]) -> Optional[float]:
    return None if not xs or any(x is None for x in xs) else statistics.median(xs)


def latency_rows(by_method: Dict[str, List[Dict]], targets: Sequence[float], delays: Sequence[float],
                 current_code: bool = False) -> Dict[str, Dict]:
    """Per method label: ``{"hops_per_step", "steps" (median steps to target or None), "ms_per_step",
    "times": [median time to target at each delay, None if a seed never reaches it],
    "per_seed": [[time per seed] per delay]}``; seed ``i`` of every method is held to ``targets[i]``
    (methods with fewer seeds: the first ones). ``current_code``: the latency of the collective
    calls the current code makes with each run's settings
    (:func:`slimcomm.train.projection.collective_calls`)."""
    out = {}
    for lab, runs in by_method.items():
        tg = list(targets[:len(runs)]) + [targets[0]] * max(0, len(runs) - len(targets))
        per_delay = []
        for d in delays:
            per_delay.append([time_to(P.delayed_result(r, d, current_code), t) for r, t in zip(runs, tg)])
        steps = [time_to(r, t, "step") for r, t in zip(runs, tg)]
        out[lab] = {
            "hops_per_step": statistics.median(P.hops_per_step(r, current_code) for r in runs),
            "steps": _median_or_none(steps),
            "ms_per_step": statistics.median(1000.0 * r["final"]["train_time_s"] / max(1, r["steps"]) for r in runs),
            "times": [_median_or_none(ts) for ts in per_delay],
            "per_seed": per_delay,
            "projected_rate": any(r.get("projected") for r in runs),
        }
    return out


def _limit(rows: Dict[str, Dict]) -> Optional[float]:
    """Compute limit (s): ddp's median steps to target x local's median ms/step (None without local)."""
    loc = next((v for k, v in rows.items() if k.split("@")[0] == LIMIT_METHOD), None)
    ddp = rows.get("ddp")
    if loc is None or ddp is None or ddp["steps"] is None:
        return None
    return ddp["steps"] * loc["ms_per_step"] / 1000.0


def _winners(rows: Dict[str, Dict], i: int) -> Dict[str, Optional[Tuple[str, float]]]:
    def best(pred):
        cands = [(v["times"][i], k) for k, v in rows.items() if pred(k.split("@")[0]) and v["times"][i] is not None]
        return (min(cands)[1], min(cands)[0]) if cands else None

    return {"overall": best(lambda m: m != LIMIT_METHOD),
            "slimcomm": best(lambda m: m in SLIMCOMM_METHODS),
            "peer": best(lambda m: m not in SLIMCOMM_METHODS and m != LIMIT_METHOD)}


def _ms(d: float) -> str:
    return f"{d * 1e3:g} ms"


def intro(world_size: int, command: str) -> List[str]:
    """The report's opening paragraphs: what is projected and how, and the command."""
    w = world_size
    return [
        f"**Projected** for every delay above 0: the time of each run at delay 0 (its own measured time, or "
        f"for a rate marked *timed* the netbench projection of a short timed run at that rate) plus, at a "
        f"one-way delay d per hop (rank to rank), d x (ring hops per step) x steps: {w} ranks, a ring "
        f"all-reduce pays {P.ring_hops('allreduce', w)} hops, an all-gather {P.ring_hops('allgather', w)}, "
        f"per collective call (`slimcomm.train.projection.collective_calls`). Scores and bytes are the "
        f"runs' own (the trajectory does not depend on the link). Time to target = train time (evaluation "
        f"excluded) at the first evaluation that reaches it; medians over seeds; 'not reached' if any seed "
        f"never did. Not modelled: TCP windows smaller than the bandwidth-delay product (at 1 Gbit/s and "
        f"50 ms a full-rate TCP stream needs 6.25 MB in flight), which slows the large messages of ddp and "
        f"the hook further at high delay.", "",
        f"'slimcomm method' = {', '.join(SLIMCOMM_METHODS)} (slimcomm's own algorithms); every other method is a "
        f"peer, diloco and sparseloco included (published algorithms, here run by slimcomm's SlimDPOptimizer); "
        f"{LIMIT_METHOD} is the no-communication reference.", "",
        f"Command: `{command}`", ""]


def markdown(results: Dict[str, Dict[str, List[Dict]]], delays: Sequence[float], target_specs: Sequence[str],
             title: str, command: Optional[str] = None, current_code: bool = False) -> Tuple[str, List[Dict]]:
    """The markdown report of one results directory and its summary rows (``{"rate", "target",
    "delay_s", "overall", "slimcomm", "peer", "ratio"}``: the best methods at each delay and the
    best slimcomm method's time over the best peer's). ``command``: with it, :func:`intro` comes
    after ``title``; without, only the tables."""
    from tabulate import tabulate

    any_run = next(iter(next(iter(results.values())).values()))[0]
    parts = [title, ""] + (intro(int(any_run["world_size"]), command) if command is not None else [])
    summary: List[Dict] = []
    for spec in target_specs:
        for rate, by in results.items():
            desc, targets = resolve_targets(by, spec)
            rows = latency_rows(by, targets, delays, current_code)
            timed = any(v["projected_rate"] for v in rows.values())
            parts.append(f"#### {rate} per link{' (timed: netbench-projected at delay 0)' if timed else ''}, "
                         f"target: {desc}{'; calls of the current code' if current_code else ''}")
            parts.append("")
            limit = _limit(rows)
            headers = ["method", "hops/step", "steps to target", "ms/step at 0 ms"]
            for d in delays:
                headers += [f"time to target at {_ms(d)} (s)", f"speed-up vs ddp at {_ms(d)}"]
            if limit is not None:
                headers += ["x of the compute limit at " + _ms(d) for d in delays]
            table = []
            base = rows["ddp"]["times"]
            for lab, v in rows.items():
                row = [lab, f"{v['hops_per_step']:.3g}", f"{v['steps']:.0f}" if v["steps"] is not None else "-",
                       f"{v['ms_per_step']:.0f}"]
                for i in range(len(delays)):
                    t = v["times"][i]
                    row += [f"{t:.1f}" if t is not None else "not reached",
                            f"{base[i] / t:.2f}x" if (t and base[i]) else "-"]
                if limit is not None:
                    row += [f"{v['times'][i] / limit:.2f}" if v["times"][i] is not None else "-"
                            for i in range(len(delays))]
                table.append(row)
            parts.append(tabulate(table, headers=headers, tablefmt="github", disable_numparse=True))
            parts.append("")
            if limit is not None:
                parts.append(f"Compute limit (measured in the same run): ddp's {rows['ddp']['steps']:.0f} steps to "
                             f"the target x local's {[v for k, v in rows.items() if k.split('@')[0] == LIMIT_METHOD][0]['ms_per_step']:.0f} "
                             f"ms/step = {limit:.1f} s (no communication, so the same at every delay).")
                parts.append("")
            lines = []
            for i, d in enumerate(delays):
                win = _winners(rows, i)
                ratio = (win["slimcomm"][1] / win["peer"][1]) if (win["slimcomm"] and win["peer"]) else None
                summary.append({"rate": rate, "target": desc, "delay_s": d, **win, "ratio": ratio,
                                "current_code": current_code})

                def fmt(x):
                    return f"{x[0]} {x[1]:.1f} s" if x else "none reaches it"

                lines.append(f"- {_ms(d)}: best {fmt(win['overall'])}; best slimcomm method {fmt(win['slimcomm'])}, "
                             f"best peer {fmt(win['peer'])}"
                             + (f" (slimcomm / peer time {ratio:.2f})" if ratio is not None else ""))
            parts += lines + [""]
    return "\n".join(parts) + "\n", summary


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("results_dirs", nargs="+", metavar="results_dir",
                   help="bench/netbench.py JSON directories (<results-dir>/<name>/), one section each")
    p.add_argument("--delays", default="0,10,50ms", help="one-way delays per hop, comma-separated (ms unless a unit)")
    p.add_argument("--target", action="append", default=None, metavar="T",
                   help="repeatable: run (the runs' --target-acc/--target-loss), ddp (ddp's final score of the "
                        "same seed), all (the loosest score every run reaches) or a number (default: run for "
                        "accuracy, ddp for loss)")
    p.add_argument("--calls", choices=("as-run", "current", "both"), default="as-run",
                   help="latency of the collective calls each run made (as-run: its recorded counters), of "
                        "those the current code makes with its settings (current: the per-sync agreement "
                        "all-reduce, slimdp-local's two-stage all-reduce, where the run predates them), or "
                        "both tables")
    p.add_argument("--title", default=None, help="first line of the report (default: from the directory names)")
    p.add_argument("--out", default=None, help="markdown file to write (default: print only)")
    a = p.parse_args(argv)
    loaded = []
    try:
        delays = P.parse_delays(a.delays)
        for d in a.results_dirs:
            results = load_results(d)
            any_run = next(iter(next(iter(results.values())).values()))[0]
            specs = a.target or (["run"] if _metric(any_run)[0] == "test_acc" else ["ddp"])
            for by in results.values():
                for spec in specs:
                    resolve_targets(by, spec)
            loaded.append((d, results, specs, int(any_run["world_size"])))
    except ValueError as e:
        p.error(str(e))
    names = ", ".join(os.path.basename(os.path.normpath(d)) for d in a.results_dirs)
    title = a.title or f"## Time to target at added one-way link delay (projected): {names}"
    cmd = "bench/latency_tables.py " + shlex.join(list(argv if argv is not None else sys.argv[1:]))
    parts = [title, ""] + intro(loaded[0][3], cmd)
    modes = {"as-run": [False], "current": [True], "both": [False, True]}[a.calls]
    for d, results, specs, _ in loaded:
        for cur in modes:
            head = f"### {os.path.relpath(os.path.abspath(d), REPO)}" + (
                ": the collective calls of the current code" if cur else
                (": the collective calls as run" if len(modes) > 1 else ""))
            md, _ = markdown(results, delays, specs, head, current_code=cur)
            parts.append(md)
    md = "\n".join(parts)
    if a.out:
        with open(a.out, "w") as f:
            f.write(md)
    print(md)
    if a.out:
        print(f"[latency_tables] wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
