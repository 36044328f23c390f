#!/usr/bin/env python3
"""Estimated time to target of a local-step run measured off the emulated network, at added delays.

For a SlimDPOptimizer configuration that has a trajectory (a ``slimcomm.train`` results JSON,
e.g. run on loopback: on CPU the trajectory is the same for the same seed, torch and threads,
whatever the link) but no netbench run. Its time is *estimated* from a netbench run of a
method with the same local steps (same model, batch, inner optimizer: ``diloco``) on each link:

    t(k) = T_ref(k) - comm_ref(k) + comm_run(k) + syncs_run(k) x codec_s + d x hops_run x k

``T_ref(k)``: the reference run's train time at the run's step to target ``k`` (an evaluation
step of both); ``comm_*``: the cost model's bandwidth and hop time of each run's counted bytes
and collective calls on that link (:data:`slimcomm.train.projection.EMULATED_LINKS`);
``codec_s``: the extra compute of one synchronisation of the run over the reference's (encode
and decode of the low-bit codes; see ``--codec-s``); ``d``: the added one-way delay per hop,
``hops_run``: :func:`slimcomm.train.projection.hops_per_step`. The reference at the same delay is
``T_ref(k_ref) + d x hops_ref x k_ref`` (:func:`slimcomm.train.projection.delayed_result`, the calls
of the current code). Estimated, not measured: the rows say so.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Dict, List, Optional, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (REPO, os.path.join(REPO, "bench")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from latency_tables import load_results  # noqa: E402
from slimcomm.train import projection as P  # noqa: E402

__all__ = ["estimate", "main"]

#: extra seconds of one 2-bit synchronisation over a dense bf16 one at 8 ranks on the benchmark
#: machine (2 cores, a quarter core per rank): the 9-method sweep's slimdp-local (H=3, 156 syncs,
#: 355 ms/step at 1 Gbit/s) against DiLoCo (H=24, 19 syncs, 149 ms/step), (0.355 - 0.149) x 468 /
#: 137 = 0.70 s per sync, less 0.11 s of modelled 1 Gbit/s all-gather traffic
#: (bench/results/scale/mlp_8ranks/1gbit_*.json)
CODEC_S = 0.6


def _at(run: Dict, step: int, key: str) -> float:
    for e in run["evals"]:
        if int(e["step"]) == step:
            return float(e[key])
    raise ValueError(f"the {run['method']} run has no evaluation at step {step}")


def estimate(run: Dict, ref: Dict, rate: str, delays: Sequence[float], codec_s: float = CODEC_S
             ) -> Dict[str, List[Optional[float]]]:
    """``{"run": [estimated time to target per delay], "ref": [the reference's own per delay]}``
    (None where the run or the reference never reached the target).

    Raises:
        ValueError: different world sizes, an unknown ``rate``, a negative ``codec_s``, or the
            reference has no evaluation at the run's step to target."""
    if run["world_size"] != ref["world_size"]:
        raise ValueError(f"world sizes differ: run {run['world_size']}, reference {ref['world_size']}")
    if rate not in P.EMULATED_LINKS:
        raise ValueError(f"rate: {rate!r} has no emulated link model ({', '.join(P.EMULATED_LINKS)})")
    if not codec_s >= 0:
        raise ValueError(f"--codec-s must be >= 0, got {codec_s}")
    w = int(run["world_size"])
    t = run.get("time_to_target")
    rt = ref.get("time_to_target")
    out: Dict[str, List[Optional[float]]] = {"run": [], "ref": []}
    for d in delays:
        out["ref"].append(P.delayed_result(ref, d, current_code=True)["time_to_target"]["train_time_s"]
                          if rt else None)
        if not t:
            out["run"].append(None)
            continue
        k = int(t["step"])
        kinds = {}
        for name, r, b in (("ref", ref, _at(ref, k, "bytes_sent_per_rank")), ("run", run, _at(run, k, "bytes_sent_per_rank"))):
            kind = P.pattern_of(r["method"], r.get("config"))
            link = P.EMULATED_LINKS[rate][kind]
            kinds[name] = link.collective_s(kind, b, w, P.collectives_per_step(r) * k)
        syncs = k // max(1, int(run["config"].get("sync_every") or 1))
        base = _at(ref, k, "train_time_s") - kinds["ref"] + kinds["run"] + syncs * codec_s
        out["run"].append(base + P.delay_s_at(run, k, d))
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("runs", nargs="+", help="results JSONs of the configuration (one per seed)")
    p.add_argument("--reference", required=True, help="netbench results dir holding the reference method's runs")
    p.add_argument("--reference-method", default="diloco")
    p.add_argument("--delays", default="0,10,50ms")
    p.add_argument("--codec-s", type=float, default=CODEC_S, help="extra seconds of compute per synchronisation")
    a = p.parse_args(argv)
    try:
        delays = P.parse_delays(a.delays)
        res = load_results(a.reference)
        runs = []
        for path in a.runs:
            with open(path) as f:
                runs.append(json.load(f))
    except (ValueError, OSError) as e:
        p.error(str(e))
    print("| link | one-way delay | " + a.reference_method + " (its runs, s) | this configuration (estimated, s) "
          "| estimated / reference |")
    print("|---|---|---|---|---|")
    for rate, by in res.items():
        refs = by.get(a.reference_method)
        if not refs:
            p.error(f"--reference-method {a.reference_method}: no such runs at {rate} in {a.reference}")
        by_seed = {r["config"]["seed"]: r for r in refs}
        try:
            per = [estimate(r, by_seed[r["config"]["seed"]], rate, delays, a.codec_s) for r in runs
                   if r["config"]["seed"] in by_seed]
        except ValueError as e:
            p.error(str(e))
        if not per:
            p.error(f"no seed of the runs has a {a.reference_method} run at {rate}")
        for i, d in enumerate(delays):
            ests = [x["run"][i] for x in per]
            rts = [x["ref"][i] for x in per]
            e = None if any(v is None for v in ests) else statistics.median(ests)
            rr = None if any(v is None for v in rts) else statistics.median(rts)
            print(f"| {rate} | {d * 1e3:g} ms | {rr:.1f} | {e:.1f} | {e / rr:.2f} |" if e is not None and rr
                  else f"| {rate} | {d * 1e3:g} ms | {rr} | {e} | - |")
    print(f"\n{len(per)} seed(s): {', '.join(str(r['config']['seed']) for r in runs)}; codec {a.codec_s:g} s per "
          f"synchronisation; medians over seeds.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
