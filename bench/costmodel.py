#!/usr/bin/env python3
"""Alpha-beta cost model of one data-parallel training step: fit on 2 ranks, check at more, project.

Model (per rank, one link of ``R`` bit/s each way, Hockney's alpha-beta model
of ring collectives; Thakur, Rabenseifner & Gropp, IJHPCA 2005, section 2):

* ring all-reduce of ``B`` bytes: ``2 (W-1) alpha + 2 (W-1)/W * 8 B / R_eff``
* ring all-gather of ``b`` bytes per rank: ``(W-1) alpha + (W-1) * 8 b / R_eff``

``R_eff = eta * R`` is the goodput of the link (TCP/IP framing, gloo's
protocol); ``alpha`` and ``eta`` are fitted per link rate from the 2-rank runs
(:func:`fit_link`). A method's step time is

    t(W) = c_m * s(W) + sum over its collectives of the collective time,

with ``c_m`` its compute + selection + framework time per step, fitted from
the same 2-rank runs (the measured step time minus the modelled collective
time), and ``s(W)`` the slow-down of compute when ``W`` ranks share the
machine's cores (``max(1, W * threads / cores)`` relative to 2 ranks: on the
2-core benchmark machine 8 ranks each get a quarter core; a property of the
emulation, not of the method). The per-rank payload does not depend on ``W``
except for IST, whose subnet (payload and compute) shrinks with ``W``
(:func:`subnet_scale`).

The fit uses 2-rank data only; :func:`validate` then compares the predicted
4- and 8-rank step times with the measured ones, and :func:`project` applies
the same formulas, on paper, to 16 ... 1024 ranks and faster links for a
5.8M- and a 1B-parameter model (assumptions in :data:`PROJECTION_ASSUMPTIONS`;
compare Agarwal et al., "On the utility of gradient compression in
distributed training systems", MLSys 2022: compression pays only while the
link, not compute or the compression itself, bounds the step).

The model's formulas (:class:`LinkModel`, :func:`fit_link`, :data:`PATTERN`,
:func:`collectives_per_step`) live in ``slimcomm/train/projection.py``, where
the training command uses them to project its own runs onto 100 Mbit/s and
1 Gbit/s links; this script imports them from there (one model).

Usage::

    python bench/costmodel.py --runs bench/results/netbench_scale   # fit, validate, project
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

# The model itself (ring all-reduce / all-gather times, its fit, a method's collectives per step)
# lives with the training command, which projects its own runs onto slower links with it
# (slimcomm.train.projection); this script fits and validates it on the network benchmark's runs.
from slimcomm.train.projection import (  # noqa: E402,F401  (re-exported: tests, collbench)
    PATTERN, LinkModel, _coeffs, collectives_per_step, fit_link)


# ---------------------------------------------------------------------------
# netbench runs -> observations
# ---------------------------------------------------------------------------

@dataclass
class Run:
    """The figures of one netbench run the model needs (medians over seeds)."""

    method: str
    world_size: int
    rate: str
    step_s: float            # measured training time per step after any dense warm-up
    payload: float           # steady payload bytes per rank per step
    wire: Optional[float]    # measured steady wire bytes (TX+RX) per rank per step
    collectives: float       # collectives per step (amortised over local steps)
    threads: int
    num_params: int
    #: IST's MLP ``(in_features, hidden widths, classes)``: its subnet, so its payload and compute, shrinks with W
    mlp: Optional[Tuple[int, Tuple[int, ...], int]] = None


def load_runs(paths: Iterable[str]) -> List[Run]:
    """netbench result JSONs -> one :class:`Run` per (method label, world size, rate), medians over seeds."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from netbench import steady_bytes_per_step
    from netbench_projection import steady_ms_per_step

    groups: Dict[Tuple[str, int, str], List[Dict]] = {}
    for p in paths:
        with open(p) as f:
            r = json.load(f)
        rate = os.path.basename(p).split("_", 1)[0]
        label = r["method"] + ("@" + r["label"] if r.get("label") else "")
        groups.setdefault((label, r["world_size"], rate), []).append(r)
    out = []
    for (label, w, rate), rs in sorted(groups.items()):
        b = [steady_bytes_per_step(r) for r in rs]
        wires = [x["wire"] for x in b if x["wire"] is not None]
        out.append(Run(
            method=label, world_size=w, rate=rate,
            step_s=statistics.median((r["projected"]["ms_per_step"] if r.get("projected") else
                                      steady_ms_per_step(r)) / 1000.0 for r in rs),
            payload=statistics.median(x["payload"] for x in b),
            wire=statistics.median(wires) if wires else None,
            collectives=collectives_per_step(rs[0]),
            threads=int(rs[0]["config"].get("threads") or 1),
            num_params=int(rs[0]["model"]["num_params"]),
            mlp=(_mlp_shape(rs[0]) if rs[0]["method"] == "ist" else None),
        ))
    return out


def _mlp_shape(run: Dict) -> Tuple[int, Tuple[int, ...], int]:
    """``(in_features, hidden widths, classes)`` of a run's MLP; the classes follow from its parameter
    count (``slimcomm.train`` records the features, the widths and the count, not the classes)."""
    d = int(run["dataset"]["features"])
    hidden = tuple(int(h) for h in run["config"]["hidden"])
    widths = (d,) + hidden
    body = sum(widths[i] * widths[i + 1] + widths[i + 1] for i in range(len(widths) - 1))
    classes, rest = divmod(int(run["model"]["num_params"]) - body, hidden[-1] + 1)
    if rest or classes < 1:
        raise ValueError(f"{run['method']} run: {run['model']['num_params']} parameters is not an MLP "
                         f"{d}-{'-'.join(map(str, hidden))}-C for any number of classes C")
    return d, hidden, classes


def ist_subnet_params(in_features: int, hidden: Sequence[int], classes: int, world_size: int) -> float:
    """Parameters of one rank's IST subnet of an MLP (Yuan et al., PVLDB 2022, section 3): every hidden
    layer keeps ``1/W`` of its neurons, so the first and last Linear shrink as ``1/W`` and the hidden-to-
    hidden ones as ``1/W**2`` (biases of hidden layers included; the last bias is shared, not counted)."""
    widths = [float(in_features)] + [h / world_size for h in hidden] + [float(classes)]
    return sum(widths[i] * widths[i + 1] for i in range(len(widths) - 1)) + sum(widths[1:-1])


def subnet_scale(run: Run, world_size: int) -> float:
    """Factor by which a rank's payload and compute change from ``run.world_size`` to ``world_size`` ranks:
    1 for data-parallel methods, the subnet-size ratio for IST (:func:`ist_subnet_params`).

    Raises:
        ValueError: an IST run without its MLP shape (``run.mlp``)."""
    if run.method.split("@")[0] != "ist":
        return 1.0
    if run.mlp is None:
        raise ValueError(f"run {run.method} at {run.world_size} ranks: IST's scaling needs its MLP shape (Run.mlp)")
    d, hidden, c = run.mlp
    return ist_subnet_params(d, hidden, c, world_size) / ist_subnet_params(d, hidden, c, run.world_size)


def payload_at(run: Run, world_size: int) -> float:
    """Per-rank payload bytes per step at ``world_size`` ranks (IST's slices shrink with the subnet)."""
    return run.payload * subnet_scale(run, world_size)


def compute_slowdown(world_size: int, threads: int, cores: int, ref_world_size: int = 2) -> float:
    """Compute-time factor of ``world_size`` ranks sharing ``cores`` cores, relative to ``ref_world_size``."""
    def load(w):
        return max(1.0, w * threads / cores)
    return load(world_size) / load(ref_world_size)


@dataclass
class Fitted:
    links: Dict[str, LinkModel]      # rate -> link model
    compute_s: Dict[str, float]      # method -> c_m (seconds per step at 2 ranks)
    cores: int
    link_source: str = "goodput fitted with the compute times from the 2-rank step times"

    def predict(self, run_2: Run, world_size: int, rate: str) -> float:
        m = run_2.method
        kind = PATTERN[m.split("@")[0]]
        comm = self.links[rate].collective_s(kind, payload_at(run_2, world_size), world_size, run_2.collectives)
        return (self.compute_s[m] * subnet_scale(run_2, world_size)
                * compute_slowdown(world_size, run_2.threads, self.cores) + comm)


def fit(runs: Sequence[Run], cores: int, alpha_s: float = 0.0,
        links: Optional[Dict[str, LinkModel]] = None) -> Fitted:
    """Fit every method's compute time and the links' efficiency from the 2-rank runs only.

    With ``links`` (rate -> :class:`LinkModel` measured on 2 ranks, e.g. by
    ``bench/collbench.py``, :func:`load_links`) the links are taken as given and
    only ``c_m`` is fitted: the mean over the method's 2-rank runs of the step
    time minus the modelled collective time (one rate per method suffices).
    Otherwise:

    Linear least squares over all 2-rank (method, rate) runs of

        step(m, R) - a_m * alpha = c_m + x_m / (eta * R)

    (``a_m``, ``x_m`` the latency and bandwidth multipliers of the method's
    collectives, :func:`fit_link`'s model) in the unknowns ``c_m`` (one per method)
    and ``1/eta`` (one, shared by all rates: the goodput is a fixed fraction of the
    tbf rate). ``alpha_s``: the per-hop latency, measured separately (e.g. with
    :func:`fit_link` on collective timings; with ``c_m`` free it is not identifiable
    from 2-rank step times, which pay it a constant number of times).

    Raises:
        ValueError: no 2-rank runs, or a method measured at fewer than two rates
            (its compute and its transfer time cannot be told apart).
    """
    import numpy as np

    two = [r for r in runs if r.world_size == 2]
    if not two:
        raise ValueError("runs: no 2-rank runs to fit on")
    methods = sorted({r.method for r in two})
    if links is not None:
        missing = sorted({r.rate for r in runs} - set(links), key=_rate_bps)
        if missing:
            raise ValueError(f"links: no measured link model for rate(s) {missing} (have {sorted(links)})")
        compute = {}
        for m in methods:
            rs = [r for r in two if r.method == m]
            compute[m] = max(0.0, statistics.fmean(
                r.step_s - links[r.rate].collective_s(PATTERN[m.split("@")[0]], r.payload, 2, r.collectives)
                for r in rs))
        return Fitted(links={rate: links[rate] for rate in sorted({r.rate for r in runs}, key=_rate_bps)},
                      compute_s=compute, cores=cores,
                      link_source="alpha and goodput measured on 2-rank gloo collectives (bench/collbench.py)")
    for m in methods:
        n = len({r.rate for r in two if r.method == m})
        if n < 2:
            raise ValueError(f"runs: {m} has 2-rank runs at {n} rate(s); the fit needs at least two rates "
                             f"per method (it refuses to extrapolate)")
    A = np.zeros((len(two), len(methods) + 1))
    b = np.zeros(len(two))
    for i, r in enumerate(two):
        a, x = _coeffs(PATTERN[r.method.split("@")[0]], r.payload, 2, r.collectives)
        A[i, methods.index(r.method)] = 1.0
        A[i, -1] = x / _rate_bps(r.rate)
        b[i] = r.step_s - a * alpha_s
    sol, *_ = np.linalg.lstsq(A, b, rcond=None)
    inv_eta = float(sol[-1])
    if inv_eta <= 0:
        raise ValueError(f"runs: fitted link efficiency is not positive (1/eta = {inv_eta:g}); the step "
                         f"times do not grow with bytes / rate")
    rates = sorted({r.rate for r in runs}, key=_rate_bps)
    links = {rate: LinkModel(alpha_s, _rate_bps(rate) / inv_eta) for rate in rates}
    compute = {m: max(0.0, float(c)) for m, c in zip(methods, sol[:-1])}
    return Fitted(links=links, compute_s=compute, cores=cores)


def load_links(path: str, gap_ms: Optional[float] = None) -> Dict[str, LinkModel]:
    """Link models (rate -> :class:`LinkModel`) from a ``bench/collbench.py`` JSON: the fit on 2-rank
    collective timings with idle gap ``gap_ms`` before every call (default: the largest gap measured,
    the closest to a training step's compute between collectives).

    Raises:
        ValueError: the file has no fit for ``gap_ms``."""
    with open(path) as f:
        fits = json.load(f)["fits"].values()
    gaps = sorted({f["gap_ms"] for f in fits})
    gap = gaps[-1] if gap_ms is None else gap_ms
    out = {f["rate"]: LinkModel(f["alpha_s"], f["goodput_bps"]) for f in fits if f["gap_ms"] == gap}
    if not out:
        raise ValueError(f"--links-gap-ms {gap_ms:g}: {path} has fits for gaps {gaps} ms only")
    return out


def validate(fitted: Fitted, runs: Sequence[Run]) -> List[Dict]:
    """Predicted vs measured step time of every run with more than 2 ranks."""
    two = {(r.method, r.rate): r for r in runs if r.world_size == 2}
    rows = []
    for r in runs:
        if r.world_size == 2 or (r.method, r.rate) not in two:
            continue
        pred = fitted.predict(two[(r.method, r.rate)], r.world_size, r.rate)
        rows.append({"method": r.method, "world_size": r.world_size, "rate": r.rate,
                     "measured_ms": 1000 * r.step_s, "predicted_ms": 1000 * pred,
                     "error": pred / r.step_s - 1.0})
    return rows


def _rate_bps(s: str) -> float:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from netbench import parse_rate

    return parse_rate(s)


# ---------------------------------------------------------------------------
# Projection (on paper)
# ---------------------------------------------------------------------------

#: every assumption of :func:`project`, printed with its table
PROJECTION_ASSUMPTIONS = {
    "link": "ring collectives at the stated rate per rank, goodput 0.95 x rate, alpha 50 us per hop "
            "(no hierarchy, no tree: NCCL's tree all-reduce would cut the latency term to O(log W))",
    "compute 5.8M": "each measured method's fitted compute + selection time of the MLP at its measured batch "
                    "(one CPU core per rank; 0.06 s + 0.007 s selection for methods not measured)",
    "compute 1B": "0.15 s/step (8192 tokens per rank per step, 6 x params x tokens FLOPs at 330 TFLOP/s)",
    "selection": "slimdp/topk: 3 passes over the fp32 gradient at 3 TB/s (GPU) per step; on the 5.8M model "
                 "the measured CPU overhead (1.11x dense step at loopback) instead",
    "scope": "time per step only: the methods need different numbers of steps to reach a given loss "
             "(measured at 2, 4 and 8 ranks only; see the netbench tables), so a faster step is not a faster run",
    "payloads": "ddp fp32 4P bytes, fp16 2P, powersgd rank 4 at the 2-rank measured ratio 1.1% of fp32, "
                "slimdp 2% of P in bf16 (+ flags), topk 2% of P as (int64 index + bf16 value) all-gathered, "
                "diloco fp32 every 24 steps, slimdp-local 2-bit every 3 steps all-gathered, sparseloco 64 of every 4096 "
                "values (2-bit values + indices, 0.155 bytes per parameter as measured) every 15 steps all-gathered",
}


def project_step_s(method: str, params: float, world_size: int, rate_bps: float, compute_s: float,
                   selection_s: float, alpha_s: float = 50e-6, eta: float = 0.95) -> float:
    """Projected seconds per step of ``method`` (see :data:`PROJECTION_ASSUMPTIONS`)."""
    link = LinkModel(alpha_s, eta * rate_bps)
    w = world_size
    if method == "ddp":
        return compute_s + link.allreduce_s(4 * params, w)
    if method == "fp16":
        return compute_s + link.allreduce_s(2 * params, w)
    if method == "powersgd":
        return compute_s + selection_s + link.allreduce_s(0.011 * 4 * params, w, 2)
    if method == "slimdp":
        return compute_s + selection_s + link.allreduce_s(0.02 * 2 * params, w)
    if method == "topk":
        return compute_s + selection_s + link.allgather_s(0.02 * 10 * params, w, 2)
    if method == "diloco":
        return compute_s + link.allreduce_s(4 * params, w) / 24
    if method == "slimdp-local":
        return compute_s + selection_s / 3 + link.allgather_s(params / 4, w) / 3
    if method == "sparseloco":
        return compute_s + selection_s / 15 + link.allgather_s(0.155 * params, w) / 15
    raise ValueError(f"method: no projection for {method!r}")


def project(world_sizes=(16, 64, 256, 1024), rates=("100mbit", "1gbit", "10gbit", "100gbit"),
            models=(("5.8M", 5.8e6, 0.06, 0.007), ("1B", 1e9, 0.15, 3 * 4e9 / 3e12)),
            methods=("ddp", "fp16", "powersgd", "topk", "slimdp", "diloco", "sparseloco", "slimdp-local"),
            fitted: Optional["Fitted"] = None) -> List[Dict]:
    """Projected step times, one row per (model, rate, world size): every method's seconds per
    step, the fastest method and slimdp's speed-up over ddp and over fp16 (on paper).

    ``models``: ``(name, parameters, compute s/step, selection s/step)``. With ``fitted``, the
    5.8M model uses the fitted per-method compute + selection times of the measured MLP (one
    CPU core per rank) instead of the assumed ones, for the methods that were measured."""
    rows = []
    for name, params, comp, sel in models:
        measured = fitted.compute_s if fitted is not None and name == "5.8M" else {}
        for rate in rates:
            bps = _rate_bps(rate)
            for w in world_sizes:
                t = {m: project_step_s(m, params, w, bps, measured[m], 0.0) if m in measured
                     else project_step_s(m, params, w, bps, comp, sel) for m in methods}
                best = min(t, key=t.get)
                rows.append({"model": name, "rate": rate, "world_size": w, "times": t, "best": best,
                             "slimdp_vs_ddp": t["ddp"] / t["slimdp"], "slimdp_vs_fp16": t["fp16"] / t["slimdp"]})
    return rows


# ---------------------------------------------------------------------------
# Reports
# ---------------------------------------------------------------------------

def ring_factor(method: str, world_size: int) -> float:
    """Wire bytes (TX + RX) per rank per payload byte of a ring collective: all-reduce
    ``4 (W-1)/W`` (each direction carries ``2 (W-1)/W`` of the buffer), all-gather
    ``2 (W-1)`` (each direction carries every other rank's contribution once)."""
    w = world_size
    return 4 * (w - 1) / w if PATTERN[method.split("@")[0]] == "allreduce" else 2.0 * (w - 1)


def bytes_table(runs: Sequence[Run]) -> str:
    """Markdown: measured wire bytes per rank per step by world size, per method and rate, with the
    growth from the smallest to the largest world size and the wire bytes over the ring model's."""
    from tabulate import tabulate

    sizes = sorted({r.world_size for r in runs})
    rows = []
    for rate in sorted({r.rate for r in runs}, key=_rate_bps):
        for m in sorted({r.method for r in runs if r.rate == rate}):
            by_w = {r.world_size: r for r in runs if r.rate == rate and r.method == m and r.wire}
            if not by_w:
                continue
            row = [m, rate] + [f"{by_w[w].payload / 1e6:.3f} / {by_w[w].wire / 1e6:.3f}" if w in by_w else "-"
                               for w in sizes]
            lo, hi = min(by_w), max(by_w)
            row.append(f"{by_w[hi].wire / by_w[lo].wire:.2f}x" if hi != lo else "-")
            row.append(", ".join(f"{by_w[w].wire / (ring_factor(m, w) * by_w[w].payload):.2f}"
                                 for w in sorted(by_w) if by_w[w].payload > 0))
            rows.append(row)
    return tabulate(rows, headers=["method", "rate"] + [f"W={w}: payload / wire MB" for w in sizes]
                    + [f"wire W={sizes[-1]} / W={sizes[0]}", "wire / ring model, per W"], tablefmt="github")


def markdown(fitted: Fitted, runs: Sequence[Run], checks: Sequence[Dict], proj: Sequence[Dict]) -> str:
    from tabulate import tabulate

    out = []
    if any(r.wire for r in runs):
        out.append("## Bytes per rank per step on the wire (measured, steady state)\n")
        out.append("payload = bytes handed to collectives; wire = TX + RX of the rank's interface (kernel "
                   "counters); ring model = payload x 4 (W-1)/W for an all-reduce, x 2 (W-1) for an all-gather.\n")
        out.append(bytes_table(runs) + "\n")
    if fitted is None:
        out.append("## Cost model: not fitted (needs 2-rank runs at two or more rates per method)\n")
    else:
        out.append("## Cost model: fitted on 2 ranks\n")
        out.append(f"Links: {fitted.link_source}.\n")
        out.append(tabulate([[rate, f"{1e6 * lm.alpha_s:.0f}", f"{lm.goodput_bps / 1e6:.1f}",
                          f"{lm.goodput_bps / _rate_bps(rate):.2f}"] for rate, lm in fitted.links.items()],
                            headers=["rate", "alpha (us/hop)", "goodput (Mbit/s)", "eta"], tablefmt="github"))
        out.append("\n" + tabulate([[m, f"{1000 * c:.1f}"] for m, c in sorted(fitted.compute_s.items())],
                                   headers=["method", "compute + selection at 2 ranks (ms/step)"],
                                   tablefmt="github"))
    if checks:
        out.append("\n## Predicted vs measured step time (model fitted on 2 ranks only)\n")
        out.append(tabulate([[c["method"], c["world_size"], c["rate"], f"{c['measured_ms']:.0f}",
                              f"{c['predicted_ms']:.0f}", f"{100 * c['error']:+.0f}%"] for c in checks],
                            headers=["method", "ranks", "rate", "measured ms/step", "predicted ms/step", "error"],
                            tablefmt="github"))
        worst = max(abs(c["error"]) for c in checks)
        out.append(f"\nLargest error: {100 * worst:.0f}% (target: within 20%).")
    out.append("\n## Projection (on paper, not measured)\n")
    out.append("Assumptions: " + "; ".join(f"{k}: {v}" for k, v in PROJECTION_ASSUMPTIONS.items()) + ".\n")
    if proj:
        methods = list(proj[0]["times"])
        out.append(tabulate([[p["model"], p["rate"], p["world_size"]]
                             + [f"{1000 * p['times'][m]:.0f}" for m in methods]
                             + [p["best"], f"{p['slimdp_vs_ddp']:.1f}x", f"{p['slimdp_vs_fp16']:.2f}x"]
                             for p in proj],
                            headers=["model", "rate", "ranks"] + [f"{m} ms" for m in methods]
                            + ["fastest", "slimdp vs ddp", "slimdp vs fp16"], tablefmt="github"))
    return "\n".join(out) + "\n"


def plot(runs: Sequence[Run], fitted: Optional[Fitted], out_png: str, note: str = "") -> None:
    """Log-log panels: measured wire bytes per rank per step vs world size, and step time vs world
    size (measured points, model lines fitted on 2 ranks), one colour per method, one panel per rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = sorted({r.rate for r in runs}, key=_rate_bps)
    fig, axes = plt.subplots(2, len(rates), figsize=(5.5 * len(rates), 8), squeeze=False)
    methods = sorted({r.method for r in runs})
    for j, rate in enumerate(rates):
        for i, m in enumerate(methods):
            rs = sorted((r for r in runs if r.rate == rate and r.method == m), key=lambda r: r.world_size)
            if not rs:
                continue
            c = f"C{i % 10}"
            ws = [r.world_size for r in rs]
            wires = [(r.world_size, r.wire) for r in rs if r.wire]
            if wires:
                axes[0][j].plot([w for w, _ in wires], [b / 1e6 for _, b in wires], "o-", color=c, label=m)
            axes[1][j].plot(ws, [1000 * r.step_s for r in rs], "o", color=c, label=f"{m} measured")
            two = next((r for r in rs if r.world_size == 2), None)
            if fitted is not None and two is not None and m in fitted.compute_s:
                grid = sorted(set(ws) | {2, 4, 8})
                axes[1][j].plot(grid, [1000 * fitted.predict(two, w, rate) for w in grid], "--", color=c, lw=1)
        sizes = sorted({r.world_size for r in runs})
        for ax, ylab in ((axes[0][j], "wire MB per rank per step (TX+RX)"), (axes[1][j], "ms per step")):
            ax.set_xscale("log", base=2)
            ax.set_xticks(sizes, [str(w) for w in sizes])
            ax.set_yscale("log")
            ax.set_xlabel("ranks (world size)")
            ax.set_ylabel(ylab)
            ax.grid(alpha=0.3, which="both")
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
        axes[0][j].set_title(f"bytes on the wire, {rate} per link")
        axes[1][j].set_title(f"step time, {rate} per link (dashed: model fitted on 2 ranks)")
    if note:
        fig.suptitle(note, fontsize=9)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--runs", nargs="+", required=True, metavar="DIR_OR_JSON",
                   help="netbench result folders (their *.json) or JSON files, any world sizes")
    p.add_argument("--cores", type=int, default=os.cpu_count() or 1,
                   help="CPU cores the benchmark ranks shared (compute slow-down with more ranks)")
    p.add_argument("--alpha-us", type=float, default=0.0,
                   help="per-hop latency of the links in microseconds (not identifiable from 2-rank step times)")
    p.add_argument("--links", default=None, metavar="COLLBENCH_JSON",
                   help="measured link models (bench/collbench.py output) instead of fitting the goodput "
                        "from step times (then --alpha-us is ignored)")
    p.add_argument("--links-gap-ms", type=float, default=None,
                   help="which idle gap's link fit to use from --links (default: the largest)")
    p.add_argument("--note", default="", help="a line printed above the tables and the plot (e.g. the setting)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out", "costmodel"),
                   help="output base path (writes BASE.md and BASE.png)")
    a = p.parse_args(argv)
    paths = []
    for x in a.runs:
        # a timed run's figures are already in its projected result (``<rate>_<method>.json``)
        paths += (sorted(q for q in glob.glob(os.path.join(x, "*.json")) if not q.endswith("_timed.json"))
                  if os.path.isdir(x) else [x])
    if not paths:
        p.error(f"--runs {a.runs}: no result JSONs found")
    runs = load_runs(paths)
    try:
        links = load_links(a.links, a.links_gap_ms) if a.links else None
    except (OSError, ValueError, KeyError) as e:
        p.error(f"--links {a.links}: {e}")
    try:
        fitted = fit(runs, a.cores, a.alpha_us * 1e-6, links=links)
    except ValueError as e:  # e.g. bytes-only sweeps at one rate: report the bytes, no model
        print(f"[costmodel] no step-time fit: {e}", file=sys.stderr)
        fitted = None
    checks = validate(fitted, runs) if fitted is not None else []
    md = markdown(fitted, runs, checks, project(fitted=fitted))
    if a.note:
        md = f"{a.note}\n\n{md}"
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out + ".md", "w") as f:
        f.write(md)
    plot(runs, fitted, a.out + ".png", a.note)
    print(md)
    print(f"[costmodel] wrote {a.out}.md and {a.out}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
