"""Reporting for the training command: results tables, plots and ``--plot-from``.

Part of the command (:mod:`slimcomm.train`), not of the library core: it
only reads results dicts (the JSON files the training command writes,
``"format": "slimcomm.train/1"``) and never imports torch.

Grouping
--------
Runs are grouped by *configuration*: :func:`config_key` hashes the settings
that change what is measured (method, model, data, optimisation and method
options, world size, device, threads per rank; everything but the seed and
the output/launch plumbing) together with the data set actually loaded and
the emulated link rate when ``bench/netbench.py`` recorded one. The training
command stores the key in every results JSON (``"config_key"``); older JSONs
without it get the key computed from their stored ``"config"``. Runs with
the same key differ only by seed and are drawn as one median line with a
band; runs with different keys are never merged, and when two configurations
share a method, their legend labels name the settings that differ.

Plots
-----
One median line per configuration over the seeds, aligned by training step
(x: the median train time or bytes at that step), a band from the minimum to
the maximum (``band="minmax"``) or the interquartile range (``band="iqr"``);
a title with the common setting (data, model, world size, link rate if known,
length, batch); the target accuracy or loss as a labelled dashed line; a
y-range at least :data:`MIN_Y_SPAN` wide (accuracy points; for a loss, that
fraction of the best loss) so that a small gap does not fill the panel.
``bench/netbench.py`` draws its figures with the same :func:`plot_results`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import statistics
from typing import Any, Dict, List, Optional, Sequence, Tuple

log = logging.getLogger(__name__)

__all__ = ["RESULT_FORMAT", "CONFIG_KEYS", "config_key", "Group", "group_results", "compare_table",
           "setting_summary", "build_figure", "plot_results", "load_result", "metric_of"]

RESULT_FORMAT = "slimcomm.train/1"

CONFIG_KEYS = (
    "method", "model", "world_size", "device", "threads", "dataset", "train_subset", "test_subset", "hidden",
    "epochs", "steps", "batch_size", "optimizer", "lr", "momentum", "beta1", "beta2", "weight_decay",
    "lr_schedule", "warmup_lr_steps", "min_lr", "grad_clip", "bucket_cap_mb", "eval_every", "target_acc",
    "target_loss", "stop_at_target", "powersgd_rank", "powersgd_start_iter", "core_ratio", "explore_ratio",
    "core_refresh", "warmup_steps", "value_dtype", "local_steps", "tokens", "text_file", "n_layer", "n_embd",
    "n_head", "block_size", "dropout", "val_batches", "sync_every", "outer_lr", "outer_momentum", "value_bits",
    "error_decay", "min_compress_numel",
)
"""Options that define a configuration (the seed and output/launch options are left out)."""

MIN_Y_SPAN = 0.10
"""Smallest y-range of a plot: 0.10 accuracy (10 points); for a loss, 10% of the lowest value drawn."""

_METRIC_LABELS = {"test_acc": "test acc", "val_loss": "val loss"}
_METRIC_AXIS = {"test_acc": "test accuracy", "val_loss": "validation loss (nats/token)"}


# ---------------------------------------------------------------------------
# Configurations
# ---------------------------------------------------------------------------

def _norm(v: Any) -> Any:
    return list(v) if isinstance(v, tuple) else v


def _link_rate(result: Dict[str, Any]) -> Optional[str]:
    return (result.get("link") or {}).get("rate")


def config_key(result: Dict[str, Any]) -> str:
    """12 hex digits identifying ``result``'s configuration.

    The stored ``"config_key"`` if present, else :func:`compute_config_key` of
    ``result["config"]`` restricted to :data:`CONFIG_KEYS` (missing keys count
    as ``None``) and the data set's name; combined with the link rate when
    ``bench/netbench.py`` recorded one (``result["link"]["rate"]``).
    """
    key = result.get("config_key") or compute_config_key(result.get("config", {}),
                                                         (result.get("dataset") or {}).get("name"))
    rate = _link_rate(result)
    if rate is not None:  # the training command does not know the link; netbench records it afterwards
        key = hashlib.sha256(f"{key}@{rate}".encode()).hexdigest()[:12]
    return str(key)


def compute_config_key(config: Dict[str, Any], dataset: Optional[str]) -> str:
    """The hash the training command stores as ``"config_key"``: options dict + the data set's name."""
    items = [[k, _norm(config.get(k))] for k in CONFIG_KEYS] + [["dataset_name", dataset]]
    return hashlib.sha256(json.dumps(items, default=str).encode()).hexdigest()[:12]


class Group:
    """Runs of one configuration (they differ only by seed).

    Attributes:
        key: :func:`config_key` of the runs.
        method: the method (or a ``bench/netbench.py`` variant label such as ``slimdp@lr02``).
        runs: the results dicts, in input order.
        label: legend label: the method, plus the settings that tell it apart from
            other configurations of the same method (set by :func:`group_results`).
    """

    __slots__ = ("key", "method", "runs", "label")

    def __init__(self, key: str, method: str):
        self.key, self.method, self.runs, self.label = key, method, [], method

    @property
    def rate(self) -> Optional[str]:
        return _link_rate(self.runs[0])

    @property
    def seeds(self) -> List[Any]:
        return [r.get("config", {}).get("seed") for r in self.runs]

    def settings(self) -> Dict[str, Any]:
        cfg = self.runs[0].get("config", {})
        s = {k: _norm(cfg.get(k)) for k in CONFIG_KEYS if k != "method"}
        s["link"] = self.rate
        s["data"] = (self.runs[0].get("dataset") or {}).get("name")
        return s

    def __repr__(self) -> str:
        return f"Group({self.label!r}, {len(self.runs)} run(s), key {self.key})"


def _fmt_setting(k: str, v: Any) -> str:
    if k == "link":
        return f"@{v}"
    if isinstance(v, list):
        v = ",".join(map(str, v))
    return f"{k.replace('_', '-')} {v:g}" if isinstance(v, float) else f"{k.replace('_', '-')} {v}"


def group_results(results: Sequence[Dict[str, Any]], split_links: bool = True) -> List[Group]:
    """Group ``results`` by configuration, in order of first appearance; sets each group's label.

    Labels are the method (``result["label"]`` when ``bench/netbench.py`` named a
    variant); if several groups share it, each label adds the settings in which
    those groups differ (``slimdp, lr 0.6`` / ``slimdp, lr 0.2``), the link rate as
    ``@100mbit`` unless ``split_links`` (the caller draws one panel per rate).
    """
    groups: Dict[str, Group] = {}
    for r in results:
        k = config_key(r)
        if k not in groups:
            groups[k] = Group(k, r.get("label") or r["method"])
        groups[k].runs.append(r)
    out = list(groups.values())
    peers: Dict[Any, List[Group]] = {}  # groups that share a legend: same method (and link, if split)
    for g in out:
        peers.setdefault((g.method, g.rate) if split_links else g.method, []).append(g)
    for gs in peers.values():
        if len(gs) < 2:
            continue
        sets = [g.settings() for g in gs]
        differ = [k for k in sets[0] if any(s[k] != sets[0][k] for s in sets)]
        for g, s in zip(gs, sets):
            shown = [_fmt_setting(k, s[k]) for k in differ]
            g.label = g.method + (", " + ", ".join(shown) if shown else "")
    return out


def metric_of(results: Sequence[Dict[str, Any]]) -> str:
    """The metric of a set of results (results JSONs before the ``metric`` field are test accuracy).

    Raises:
        ValueError: the results mix metrics.
    """
    names = {r.get("metric", {}).get("name", "test_acc") for r in results}
    if len(names) != 1:
        raise ValueError(f"results mix metrics {sorted(names)}; compare runs of one workload at a time")
    return names.pop()


def _target(results: Sequence[Dict[str, Any]], metric: str) -> Optional[float]:
    for r in results:
        if r.get("time_to_target"):
            return r["time_to_target"]["target"]
    cfg = results[0].get("config", {}) if results else {}
    return cfg.get("target_acc") if metric == "test_acc" else cfg.get("target_loss")


def setting_summary(results: Sequence[Dict[str, Any]], with_method: bool = False) -> str:
    """One line naming what the runs share: data, model, ranks, link, length, batch, optimizer.

    An item that differs between the runs is left out (the legend labels name it).
    """
    def common(fn):
        vals = set()
        for r in results:
            try:
                vals.add(json.dumps(fn(r), default=str))
            except (KeyError, TypeError):
                return None
        return json.loads(vals.pop()) if len(vals) == 1 else None

    parts = []
    if with_method and common(lambda r: r.get("label") or r["method"]) is not None:
        parts.append(common(lambda r: r.get("label") or r["method"]))
    data = common(lambda r: r["dataset"]["name"])
    if data:
        parts.append(data)
    model = common(lambda r: r["model"])
    if model:
        name = model.get("name") or ("mlp" if model.get("hidden") else "model")
        if name == "mlp" and model.get("hidden"):
            desc = "MLP " + "-".join(map(str, model["hidden"]))
        elif name == "gpt":
            desc = f"GPT {model.get('n_layer')}x{model.get('n_embd')}"
        else:
            desc = name.upper() if name == "cnn" else name
        if model.get("num_params"):
            desc += f" ({model['num_params']:,} params)"
        parts.append(desc)
    ws = common(lambda r: r.get("world_size", r["config"].get("world_size")))
    if ws:
        parts.append(f"{ws} ranks")
    rate = common(_link_rate)
    if rate:
        parts.append(f"{rate} per link")
    steps_per_epoch = common(lambda r: r.get("steps_per_epoch"))
    epochs = common(lambda r: r["config"].get("epochs"))
    steps = common(lambda r: r["config"].get("steps"))
    if steps is not None:
        parts.append(f"{steps} steps")
    elif epochs is not None and steps_per_epoch is not None:
        parts.append(f"{epochs} epoch(s) of {steps_per_epoch} steps")
    elif epochs is not None:
        parts.append(f"{epochs} epoch(s)")
    batch = common(lambda r: r["config"].get("batch_size"))
    if batch:
        parts.append(f"batch {batch}/rank")
    opt = common(lambda r: r["config"].get("optimizer"))
    if opt:
        parts.append(opt)
    seeds = sorted({str(r.get("config", {}).get("seed")) for r in results})
    parts.append(("seed " if len(seeds) == 1 else "seeds ") + ", ".join(seeds))
    return ", ".join(parts)


# ---------------------------------------------------------------------------
# Tables
# ---------------------------------------------------------------------------

def _fmt_ratio(x):
    return "-" if x is None else f"{x:.3g}x"


def compare_table(results: Sequence[Dict[str, Any]], baseline: str = "ddp", fmt: str = "github") -> str:
    """One table: method, final metric, train time, MB sent per rank, ratios vs ``baseline``.

    ``results`` are results dicts (as written to the JSON files), all of one
    workload: the metric column is test accuracy (mlp, cnn) or validation loss
    in nats/token (gpt). The ratio columns appear only when the baseline is
    among the results and there is something to compare it with.
    Time-to-target is shown when any run reached it. A ``config`` column
    holds the :func:`config_key` when two rows share a method.

    Raises:
        ValueError: the results mix metrics.
    """
    from tabulate import tabulate

    metric = metric_of(results)
    base = next((r for r in results if r["method"] == baseline), None)
    ratios = base is not None and len(results) > 1
    has_ttt = any(r.get("time_to_target") for r in results)
    labels = [r.get("label") or r["method"] for r in results]
    show_key = len(set(labels)) < len(labels)
    headers = ["method"] + (["config"] if show_key else []) + [
        _METRIC_LABELS.get(metric, metric), "train time (s)", "MB sent/rank"]
    if ratios:
        headers += [f"MB vs {baseline}", f"time vs {baseline}"]
    if has_ttt:
        tgt = next(r["time_to_target"]["target"] for r in results if r.get("time_to_target"))
        headers.append(f"time to {tgt:g} (s)")
    rows = []
    for r, label in zip(results, labels):
        f = r["final"]
        row = [label] + ([config_key(r)[:8]] if show_key else []) + [
            f"{f[metric]:.4f}", f"{f['train_time_s']:.1f}", f"{f['bytes_sent_per_rank'] / 1e6:.2f}"]
        if ratios:
            row += [_fmt_ratio(f["bytes_sent_per_rank"] / base["final"]["bytes_sent_per_rank"]),
                    _fmt_ratio(f["train_time_s"] / base["final"]["train_time_s"])]
        if has_ttt:
            t = r.get("time_to_target")
            row.append(f"{t['train_time_s']:.1f}" if t else "not reached")
        rows.append(row)
    return tabulate(rows, headers=headers, tablefmt=fmt, disable_numparse=True)


# ---------------------------------------------------------------------------
# Plots
# ---------------------------------------------------------------------------

def _x_of(e: Dict[str, Any], x: str) -> float:
    if x == "time":
        return e["train_time_s"]
    return max(e["bytes_sent_per_rank"], 1) / 1e6


def group_curve(group: Group, metric: str, x: str, band: str = "minmax"
                ) -> Tuple[List[float], List[float], List[float], List[float]]:
    """``(xs, median, low, high)`` of a group over its seeds, aligned by training step.

    A step enters the curve when at least half of the seeds evaluated there
    (runs that stopped at the target end earlier). ``x`` is ``"time"`` (train
    seconds) or ``"bytes"`` (MB sent per rank); ``band`` ``"minmax"`` or ``"iqr"``.
    """
    by_step: Dict[int, List[Tuple[float, float]]] = {}
    for r in group.runs:
        for e in r["evals"]:
            if x == "bytes" and e["bytes_sent_per_rank"] <= 0:
                continue
            by_step.setdefault(e["step"], []).append((_x_of(e, x), e[metric]))
    need = (len(group.runs) + 1) // 2
    xs, med, lo, hi = [], [], [], []
    for step in sorted(by_step):
        pts = by_step[step]
        if len(pts) < need:
            continue
        ys = sorted(p[1] for p in pts)
        xs.append(statistics.median(p[0] for p in pts))
        med.append(statistics.median(ys))
        if band == "iqr" and len(ys) >= 4:
            q = statistics.quantiles(ys, n=4, method="inclusive")
            lo.append(q[0])
            hi.append(q[2])
        else:
            lo.append(ys[0])
            hi.append(ys[-1])
    return xs, med, lo, hi


def _y_limits(values: Sequence[float], metric: str) -> Tuple[float, float]:
    lo, hi = min(values), max(values)
    pad = 0.04 * max(hi - lo, 1e-9)
    if metric == "test_acc":
        lo, hi = lo - pad, min(1.0, hi + pad)
        if hi - lo < MIN_Y_SPAN:
            lo = hi - MIN_Y_SPAN
        return max(0.0, lo), hi
    span = MIN_Y_SPAN * max(abs(lo), 1e-9)
    lo, hi = lo - pad, hi + pad
    if hi - lo < span:
        hi = lo + span
    return lo, hi


def build_figure(results: Sequence[Dict[str, Any]], title: Optional[str] = None, *,
                 panels: Sequence[str] = ("time", "bytes"), band: str = "minmax", log_time: bool = False,
                 target: Optional[float] = None, target_label: Optional[str] = None,
                 rate_titles: Optional[Dict[Optional[str], str]] = None):
    """The matplotlib figure behind :func:`plot_results` (for tests and callers that add to it).

    One panel per entry of ``panels``: ``"time"`` (metric vs train time) or
    ``"bytes"`` (metric vs MB sent per rank, log x). Results recorded at
    several link rates (``bench/netbench.py``) get one ``"time"`` panel per
    rate; the ``"bytes"`` panel uses the first rate (bytes do not depend on
    the link). Each panel's legend has one entry per configuration
    (``"label (n seeds)"``) and one for the target line. ``rate_titles``
    names the link of each time panel in its title (rate -> text, ``None``
    the results without a link rate), e.g. ``{None: "loopback (measured)",
    "100mbit": "100 Mbit/s per link (projected)"}``.

    Raises:
        ValueError: no results, the results mix metrics, or an unknown panel or band.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not results:
        raise ValueError("no results to plot")
    if band not in ("minmax", "iqr"):
        raise ValueError(f"band must be 'minmax' or 'iqr', got {band!r}")
    bad = [p for p in panels if p not in ("time", "bytes")]
    if bad or not panels:
        raise ValueError(f"panels must be 'time' and/or 'bytes', got {list(panels)!r}")
    metric = metric_of(results)
    groups = group_results(results, split_links=True)
    rates: List[Optional[str]] = []
    for g in groups:
        if g.rate not in rates:
            rates.append(g.rate)
    layout: List[Tuple[str, Optional[str]]] = []
    for p in panels:
        if p == "time":
            layout += [("time", rt) for rt in rates]
        else:
            layout.append(("bytes", rates[0]))
    colors: Dict[str, str] = {}
    for g in groups:
        colors.setdefault(g.label, f"C{len(colors) % 10}")
    if target is None:
        target = _target(results, metric)
    if target is not None and target_label is None:
        target_label = f"target {_METRIC_LABELS.get(metric, metric)} {target:g}"
    fig, axes = plt.subplots(1, len(layout), figsize=(5.6 * len(layout), 4.4), squeeze=False)
    band_name = "min-max" if band == "minmax" else "IQR"
    for ax, (kind, rate) in zip(axes[0], layout):
        ys: List[float] = []
        for g in groups:
            if g.rate != rate:
                continue
            xs, med, lo, hi = group_curve(g, metric, kind, band)
            if not xs:
                continue
            n = len(g.runs)
            distinct = len(set(g.seeds))
            label = (f"{g.label} ({n} seeds)" if distinct == n else f"{g.label} ({n} runs)") if n > 1 else g.label
            ax.plot(xs, med, marker="o", ms=3, lw=1.5, color=colors[g.label], label=label)
            if n > 1:
                ax.fill_between(xs, lo, hi, color=colors[g.label], alpha=0.2, lw=0)
            ys += lo + hi
        if target is not None:
            ax.axhline(target, color="gray", ls="--", lw=1.0, label=target_label)
            ys.append(target)
        if ys:
            ax.set_ylim(*_y_limits(ys, metric))
        ax.set_ylabel(_METRIC_AXIS.get(metric, metric))
        if kind == "time":
            ax.set_xlabel("training wall time (s" + (", log)" if log_time else ")"))
            if log_time:
                from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

                ax.set_xscale("log")
                # plain numbers at 1, 2, 5 x 10^k: a range of less than a decade otherwise gets
                # overlapping minor labels in scientific notation
                ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
                ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
                ax.xaxis.set_minor_formatter(NullFormatter())
            else:
                ax.set_xlim(left=0)
            if rate_titles is not None and rate in rate_titles:
                where = f", {rate_titles[rate]}"
            else:
                where = f", {rate} per link" if rate and len(rates) > 1 else ""
            ax.set_title(f"vs training time{where}", fontsize=10)
        else:
            ax.set_xlabel("MB sent per rank (log)")
            ax.set_xscale("log")
            ax.set_title("vs bytes sent", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="best")
    if title is None:
        title = setting_summary(results)
    if any(len(g.runs) > 1 for g in groups):
        title += f"\nlines: median over runs, bands: {band_name}"
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def plot_results(results: Sequence[Dict[str, Any]], out_png: str, title: Optional[str] = None, **kw) -> str:
    """Write :func:`build_figure`'s PNG to ``out_png`` (folders created); returns the path.

    Keyword arguments go to :func:`build_figure` (``panels``, ``band``,
    ``log_time``, ``target``, ``target_label``, ``rate_titles``).

    Raises:
        ValueError: as :func:`build_figure`.
    """
    import matplotlib.pyplot as plt

    fig = build_figure(results, title, **kw)
    os.makedirs(os.path.dirname(os.path.abspath(out_png)), exist_ok=True)
    fig.savefig(out_png, dpi=120)
    plt.close(fig)
    log.debug("wrote %s", out_png)
    return out_png


# ---------------------------------------------------------------------------
# --plot-from
# ---------------------------------------------------------------------------

def load_result(path: str) -> Dict[str, Any]:
    """Read one results JSON; ``SystemExit("error: ...")`` naming the file if it is not one."""
    try:
        with open(path) as f:
            r = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise SystemExit(f"error: --plot-from {path}: cannot read a results JSON: {e}")
    if not isinstance(r, dict) or r.get("format") != RESULT_FORMAT:
        fmt = r.get("format") if isinstance(r, dict) else None
        raise SystemExit(f"error: --plot-from {path}: not a slimcomm.train results file (format {fmt!r})")
    return r


def plot_from(paths: Sequence[str], out_png: str, band: str = "minmax") -> int:
    """``--plot-from``: print one table row per run (grouped by configuration), write the plot."""
    results = [load_result(p) for p in paths]
    try:
        metric_of(results)
    except ValueError as e:
        raise SystemExit(f"error: --plot-from: {e}")
    groups = group_results(results, split_links=False)
    ordered = [r for g in groups for r in g.runs]
    print(setting_summary(ordered))
    print(compare_table(ordered))
    if len(groups) > 1:
        print(f"{len(groups)} configurations:")
        for g in groups:
            print(f"  {g.label}: config {g.key}, {len(g.runs)} run(s), seeds {', '.join(map(str, g.seeds))}")
    print(f"wrote {plot_results(results, out_png, band=band)}")
    return 0
