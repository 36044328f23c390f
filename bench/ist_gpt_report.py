"""Compare GPT IST with DDP at equal wall time from ``python -m slimcomm.train --compare ddp,ist
--model gpt --link-times ...`` results (issue 24, item 4).

For each link in the results' ``link_times`` (plus the measured loopback), every evaluation's
time (measured, or projected: the run's compute time plus its counted bytes through the link's
collective model, :mod:`slimcomm.train.projection`) and validation loss, then each method's
validation loss at the equal wall time ``T = min(final times)`` (linear interpolation between
evaluations; before a method's first evaluation: not available), and the bytes each rank handed
to collectives per step and per IST round.

Usage::

    python bench/ist_gpt_report.py DIR [DIR ...] > table.md

Each ``DIR`` holds ``ddp.json`` and ``ist.json`` of one ``--compare`` run.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Dict, List, Optional, Tuple


def _series(r: Dict, rate: Optional[str]) -> List[Tuple[float, float, int]]:
    """``(time s, val loss, step)`` per evaluation on ``rate`` (None = loopback, measured)."""
    if rate is None:
        return [(e["train_time_s"], e["val_loss"], e["step"]) for e in r["evals"]]
    proj = {e["step"]: e["train_time_s"] for e in r["link_times"]["links"][rate]["evals"]}
    return [(proj[e["step"]], e["val_loss"], e["step"]) for e in r["evals"]]


def _at(series: List[Tuple[float, float, int]], t: float) -> Optional[float]:
    if not series or t < series[0][0]:
        return None
    for (t0, v0, _), (t1, v1, _) in zip(series, series[1:]):
        if t0 <= t <= t1:
            return v0 + (v1 - v0) * (t - t0) / (t1 - t0) if t1 > t0 else v1
    return series[-1][1]


def report(folder: str) -> str:
    res = {m: json.load(open(os.path.join(folder, f"{m}.json"))) for m in ("ddp", "ist")}
    d, i = res["ddp"], res["ist"]
    w = d["world_size"]
    mdl = d["model"]
    lines = [f"### {folder}: {w} ranks, GPT {mdl['n_layer']}x{mdl['n_embd']}, {mdl['n_head']} heads "
             f"({mdl['num_params']:,} params), {d['dataset']['name']}, {d['steps']} steps, "
             f"batch {d['config']['batch_size']}/rank, IST local steps {i['config']['local_steps']}", ""]
    rates = [None] + list(d.get("link_times", {}).get("links", {}))
    lines += ["| link | T = equal wall time (s) | ddp val loss at T | ist val loss at T | ddp step at T |"
              " ist step at T | ddp final (s) | ist final (s) |", "|---|---|---|---|---|---|---|---|"]
    for rate in rates:
        sd, si = _series(d, rate), _series(i, rate)
        t = min(sd[-1][0], si[-1][0])
        vd, vi = _at(sd, t), _at(si, t)

        def step_at(s):
            return max((k for tt, _, k in s if tt <= t), default=0)

        lines.append(f"| {rate or 'loopback (measured)'} | {t:.1f} | "
                     f"{'n/a (before 1st eval)' if vd is None else f'{vd:.4f}'} | "
                     f"{'n/a' if vi is None else f'{vi:.4f}'} | ~{step_at(sd)} | ~{step_at(si)} | "
                     f"{sd[-1][0]:.1f} | {si[-1][0]:.1f} |")
    # Independent of this machine's (loaded) compute time: DDP's communication alone on each
    # emulated link, with ZERO compute, in IST's projected time there.
    from slimcomm.train import projection as P

    lines += ["", "DDP with zero compute (communication only, the projection's link model) in IST's "
              "projected time on the link: the most steps it could take, and its val loss at that step "
              "(interpolated; a lower bound on its loss if the loss falls monotonically):", "",
              "| link | IST time (s) | DDP comm s/step | DDP steps at most | DDP val loss there | IST val loss |",
              "|---|---|---|---|---|---|"]
    for rate in rates[1:]:
        si = _series(i, rate)
        per = P.collectives_per_step(d)
        comm = P.EMULATED_LINKS[rate]["allreduce"].collective_s(
            "allreduce", d["dense_bytes_per_step"], w, per)
        k = si[-1][0] / comm
        by_step = [(float(e["step"]), e["val_loss"], e["step"]) for e in d["evals"]]
        v = _at(by_step, k)
        if k > by_step[-1][0]:
            lines.append(f"| {rate} | {si[-1][0]:.1f} | {comm:.3f} | {k:.0f} | beyond the run "
                         f"({by_step[-1][2]} steps: {by_step[-1][1]:.4f}) | {si[-1][1]:.4f} |")
            continue
        lines.append(f"| {rate} | {si[-1][0]:.1f} | {comm:.3f} | {k:.0f} | "
                     f"{'n/a (before 1st eval, step ' + str(by_step[0][2]) + f': {by_step[0][1]:.4f})' if v is None else f'{v:.4f}'}"
                     f" | {si[-1][1]:.4f} |")
    st = i["stats"]
    lines += ["", "| method | val loss per eval (step: loss) | bytes/rank total | bytes/rank/step |"
              " bytes/rank/round (ist) |", "|---|---|---|---|---|"]
    for m, r in res.items():
        evs = ", ".join(f"{e['step']}: {e['val_loss']:.4f}" for e in r["evals"])
        b = r["final"]["bytes_sent_per_rank"]
        per_round = f"{b / st['rounds']:,.0f}" if m == "ist" else "-"
        lines.append(f"| {m} | {evs} | {b:,} | {b / r['steps']:,.0f} | {per_round} |")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit("usage: python bench/ist_gpt_report.py DIR [DIR ...]")
    print("\n\n".join(report(f) for f in sys.argv[1:]))
