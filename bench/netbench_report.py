"""Tables and plots of bench/netbench.py's results (markdown per link rate, PNGs).

Input everywhere: ``{rate: {method label: [slimcomm.train result JSON per seed]}}``;
every number is a median over seeds. Rows of a rate run with ``--timed-rates`` are
projections (:mod:`netbench_projection`) and their section says so.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

__all__ = ["steady_bytes_per_step", "compute_limit", "markdown", "markdown_lm", "plot", "plot_lm"]


def _median(xs: Sequence[float]) -> float:
    import statistics

    return statistics.median(xs)


def _ttt(runs: Sequence[Dict]) -> Optional[float]:
    """Median time to target over seeds (None if any seed never reached it)."""
    ts = [r["time_to_target"]["train_time_s"] if r.get("time_to_target") else None for r in runs]
    return None if any(t is None for t in ts) else _median(ts)


def _dense_warmup_steps(run: Dict) -> int:
    """Leading steps in which the method sends dense gradients (slimdp/topk warm-up, PowerSGD's
    start iteration), excluded from the steady-state per-step figures."""
    cfg, m = run.get("config", {}), run.get("method")
    if m in ("slimdp", "topk"):
        w = cfg.get("warmup_steps") or 0
    elif m == "powersgd":
        w = cfg.get("powersgd_start_iter") or 0
    else:
        w = 0
    return min(int(w), max(0, run["steps"] - 1))


def steady_bytes_per_step(run: Dict) -> Dict[str, Optional[float]]:
    """Steady-state bytes per rank per step of one run (the dense warm-up steps left out).

    ``payload``: bytes handed to collectives (the ``bytes_definition`` of the run);
    ``wire``: TX + RX bytes the rank's interface carried during training steps and
    synchronisations (kernel counters, ``slimcomm.train --wire-iface``), mean over ranks,
    with ``wire_min``/``wire_max`` over ranks; None without counters. Includes every frame:
    Ethernet/IP/TCP headers, ACKs, retransmissions, and both directions."""
    warm = _dense_warmup_steps(run)
    n = max(1, run["steps"] - warm)
    payload = (run["final"]["bytes_sent_per_rank"] - warm * run["dense_bytes_per_step"]) / n
    out: Dict[str, Optional[float]] = {"payload": payload, "wire": None, "wire_min": None, "wire_max": None}
    ranks = run.get("wire")
    if ranks:
        per = [(w["tx_bytes"] + w["rx_bytes"] - sum(w["per_step_bytes"][:warm])) / n for w in ranks]
        out.update(wire=sum(per) / len(per), wire_min=min(per), wire_max=max(per))
    return out


def _wire_cells(runs: Sequence[Dict]) -> List[str]:
    """['wire MB/rank/step', 'wire / payload'] table cells (medians over seeds)."""
    if not runs or not all(r.get("wire") for r in runs):
        return ["-", "-"]
    b = [steady_bytes_per_step(r) for r in runs]
    wire = _median([x["wire"] for x in b])
    ratio = _median([x["wire"] / x["payload"] for x in b if x["payload"] > 0]) if any(
        x["payload"] > 0 for x in b) else None
    return [f"{wire / 1e6:.3f}", f"{ratio:.2f}" if ratio is not None else "-"]


def _uplink_mb_per_step(run: Dict) -> Optional[float]:
    """Mean over nodes of a node's uplink TX bytes per training step, in MB (the ``nodes`` entry
    netbench adds with ``--nodes``: kernel counters of the slow link over the whole job, so
    rendezvous and evaluations are in it); None for one-rank nodes or runs without the entry."""
    n = run.get("nodes")
    if not n or n.get("ranks_per_node", 1) < 2 or not n.get("uplink_tx_bytes"):
        return None
    tx = n["uplink_tx_bytes"]
    return sum(tx) / len(tx) / max(1, run["steps"]) / 1e6


def _rate_title(rate: str, by_method: Dict[str, List[Dict]], measured: Dict[str, float]) -> str:
    """The section title of one rate; says when its rows are projected from timed runs."""
    title = f"\n### {rate} per link (measured {measured[rate]:.0f} Mbit/s TCP)\n"
    proj = [r["projected"] for runs in by_method.values() for r in runs if r.get("projected")]
    if proj:
        steps = {m: runs[0]["projected"]["timed_steps"] for m, runs in by_method.items() if runs[0].get("projected")}
        common = max(set(steps.values()), key=list(steps.values()).count)
        others = ", ".join(f"{m} {n}" for m, n in steps.items() if n != common)
        title += (f"\n**Projected**: every run here trained {common} timed steps on this link"
                  f"{' (' + others + ')' if others else ''}; "
                  f"times = its measured time up to the first evaluation past the start-up (dense warm-up "
                  f"steps, first connections), then steps x its steady measured ms/step, losses/accuracies and bytes from the full run of the "
                  f"same method and seed at {proj[0]['trajectory_rate']} (same arithmetic, same trajectory).\n")
    return title


LIMIT_METHOD = "local"


def _local_ms_per_step(by_method: Dict[str, List[Dict]]) -> Optional[float]:
    """Median ms per training step of the ``local`` runs (no communication), None without them."""
    runs = next((rs for m, rs in by_method.items() if m.split("@")[0] == LIMIT_METHOD), None)
    if not runs:
        return None
    return _median([1000.0 * r["final"]["train_time_s"] / max(1, r["steps"]) for r in runs])


def compute_limit(by_method: Dict[str, List[Dict]], ddp_steps: Optional[float]) -> Optional[Dict[str, float]]:
    """The compute limit of one rate: ddp's steps to the target (``ddp_steps``, median over seeds)
    times the measured ms/step of ``local`` (every rank alone, no communication) in the same
    netbench run. ``{"steps", "ms_per_step", "seconds"}``, or None without a local run or when ddp
    never reached the target."""
    ms = _local_ms_per_step(by_method)
    if ms is None or ddp_steps is None:
        return None
    return {"steps": ddp_steps, "ms_per_step": ms, "seconds": ddp_steps * ms / 1000.0}


def _limit_line(lim: Optional[Dict[str, float]]) -> List[str]:
    if lim is None:
        return []
    return [f"\nCompute limit: ddp's {lim['steps']:.0f} steps to the target x local's measured "
            f"{lim['ms_per_step']:.0f} ms/step (every rank trains alone on its shard, no communication, "
            f"same run) = {lim['seconds']:.1f} s; 'x of the limit' = a method's time to the target over it. "
            f"local's own score: the mean over ranks of each rank's model on the whole evaluation set.\n"]


def markdown(results: Dict[str, Dict[str, List[Dict]]], measured: Dict[str, float], header: str) -> str:
    """Markdown tables (one per rate) from {rate: {method: [results dict per seed]}}.

    With several seeds every number is the median over seeds; the time to
    target of each seed is listed too. The speed-up is ddp's median time over
    the method's median time.
    """
    from tabulate import tabulate

    parts = [header]
    for rate, by_method in results.items():
        any_r = next(iter(by_method.values()))[0]
        tgt = any_r["config"]["target_acc"]
        epochs = any_r["config"]["epochs"]
        budget = any_r["config"].get("time_budget") or any_r.get("budget_s")
        n_seeds = max(len(runs) for runs in by_method.values())
        parts.append(_rate_title(rate, by_method, measured))
        rows = []
        base = _ttt(by_method["ddp"]) if "ddp" in by_method else None
        ddp_reached = [r["time_to_target"] for r in by_method.get("ddp", []) if r.get("time_to_target")]
        lim = compute_limit(by_method, _median([t["step"] for t in ddp_reached])
                            if ddp_reached and len(ddp_reached) == len(by_method["ddp"])
                            and all("step" in t for t in ddp_reached) else None)
        for m, runs in by_method.items():
            t = _ttt(runs)
            reached = [r["time_to_target"] for r in runs if r.get("time_to_target")]
            done = all(((r["completed_epochs"] == epochs if epochs is not None
                         else r["steps"] == r.get("planned_steps")) or r.get("stopped_at_budget"))
                       and not r.get("stopped_at_target") for r in runs)
            steps = [max(1, r["steps"]) for r in runs]
            per_seed = ", ".join(f"{r['time_to_target']['train_time_s']:.1f}" if r.get("time_to_target")
                                 else "never" for r in runs)
            row = [
                m,
                f"{t:.1f}" if t is not None else "not reached",
                f"{_median([x['epoch'] for x in reached]):.2f}" if len(reached) == len(runs) else "-",
                f"{base / t:.2f}x" if base and t else "-",
                (f"{_median([r['final']['test_acc'] for r in runs]):.4f}" if done
                 else "(stopped at target)"),
                f"{_median([r['final']['bytes_sent_per_rank'] / 1e6 / n for r, n in zip(runs, steps)]):.3f}",
                *_wire_cells(runs),
                f"{_median([1000 * r['final']['train_time_s'] / n for r, n in zip(runs, steps)]):.0f}",
                " ".join(runs[0].get("method_flags", [])) or "-",
            ]
            if n_seeds > 1:
                row.insert(2, per_seed)
            if lim is not None:
                row.insert(5 if n_seeds > 1 else 4, f"{t / lim['seconds']:.2f}" if t is not None else "-")
            rows.append(row)
        headers = ["method", f"time to {tgt:g} (s)", "epoch reached", "speed-up vs ddp",
                   (f"test acc at the {budget:g} s budget" if budget
                    else f"test acc after {epochs} epochs" if epochs is not None
                    else f"test acc after {any_r['config']['steps']} steps"),
                   "MB/rank/step", "wire MB/rank/step", "wire/payload",
                   "ms/step", "method flags"]
        if n_seeds > 1:
            headers[1] = f"median time to {tgt:g} (s)"
            headers.insert(2, "per seed (s)")
        if lim is not None:
            headers.insert(5 if n_seeds > 1 else 4, "x of the compute limit")
        parts.append(tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True))
        parts += _limit_line(lim)
    return "\n".join(parts) + "\n"


def _is_lm(results) -> bool:
    any_r = next(iter(next(iter(results.values())).values()))[0]
    return any_r.get("metric", {}).get("name") == "val_loss"


def _loss_target(by_method: Dict[str, List[Dict]]) -> Optional[float]:
    """DDP's median final validation loss (the time-to-target target), else --target-loss."""
    if "ddp" in by_method:
        return _median([r["final"]["val_loss"] for r in by_method["ddp"]])
    return next(iter(by_method.values()))[0]["config"].get("target_loss")


def _seed_targets(by_method: Dict[str, List[Dict]], n: int) -> List[Optional[float]]:
    """Per-seed targets: ddp's final validation loss of the same seed (position) when ddp ran
    the same seeds, so ddp reaches its own target at its last step; else the median target."""
    ddp = by_method.get("ddp")
    if ddp and len(ddp) == n and all(r["config"].get("seed") is not None for r in ddp):
        return [r["final"]["val_loss"] for r in ddp]
    return [_loss_target(by_method)] * n


def _time_to_loss(run: Dict, target: Optional[float], key: str = "train_time_s") -> Optional[float]:
    """Training time (or ``key="step"``: the step) of the first evaluation with validation
    loss <= target (None if never)."""
    if target is None:
        return None
    for e in run["evals"]:
        if e["val_loss"] <= target + 1e-12:
            return e[key]
    return None


def markdown_lm(results: Dict[str, Dict[str, List[Dict]]], measured: Dict[str, float], header: str) -> str:
    """Markdown tables for the GPT workload: time to ddp's final validation loss (read from the
    evaluations every --eval-every steps), validation loss after equal steps, bytes per step."""
    from tabulate import tabulate

    parts = [header]
    for rate, by_method in results.items():
        target = _loss_target(by_method)
        parts.append(_rate_title(rate, by_method, measured))
        dense = next(iter(by_method.values()))[0]["dense_bytes_per_step"]
        n_seeds = max(len(runs) for runs in by_method.values())
        seed_t = _seed_targets(by_method, n_seeds)
        times = {m: [_time_to_loss(r, tg) for r, tg in zip(runs, seed_t)] for m, runs in by_method.items()}
        steps_to = {m: [_time_to_loss(r, tg, "step") for r, tg in zip(runs, seed_t)]
                    for m, runs in by_method.items()}
        def med_t(ts):
            return None if any(t is None for t in ts) else _median(ts)
        base = med_t(times["ddp"]) if "ddp" in times else None
        ddp_loss = _median([r["final"]["val_loss"] for r in by_method["ddp"]]) if "ddp" in by_method else None
        lim = compute_limit(by_method, med_t(steps_to["ddp"]) if "ddp" in steps_to else None)
        uplink = {m: [_uplink_mb_per_step(r) for r in runs] for m, runs in by_method.items()}
        with_nodes = all(x is not None for xs in uplink.values() for x in xs)
        ddp_up = _median(uplink["ddp"]) if with_nodes and "ddp" in uplink else None
        rows = []
        for m, runs in by_method.items():
            t = med_t(times[m])
            loss = _median([r["final"]["val_loss"] for r in runs])
            mb = _median([r["final"]["bytes_sent_per_rank"] / max(1, r["steps"]) for r in runs])
            rows.append([
                m,
                f"{t:.1f}" if t is not None else "not reached",
                ", ".join("never" if x is None else f"{x:.1f}" for x in times[m]),
                f"{base / t:.2f}x" if base and t else "-",
                (f"{_median(steps_to[m]):.0f}" if t is not None else "-"),
                f"{loss:.4f}",
                f"{loss / ddp_loss:.3f}" if ddp_loss else "-",
                "/".join(sorted({str(r["steps"]) for r in runs})),
                f"{mb / 1e6:.3f}",
                f"{100 * mb / dense:.2f}%",
                *_wire_cells(runs),
                f"{_median([1000 * r['final']['train_time_s'] / max(1, r['steps']) for r in runs]):.0f}",
                " ".join(runs[0].get("method_flags", [])) or "-",
            ])
            if with_nodes:
                up = _median(uplink[m])
                rows[-1][10:10] = [f"{up:.3f}", f"{100 * up / ddp_up:.2f}%" if ddp_up else "-"]
            if lim is not None:
                rows[-1].insert(4, f"{t / lim['seconds']:.2f}" if t is not None else "-")
        per_seed_target = len(set(seed_t)) > 1 or (n_seeds > 1 and "ddp" in by_method)
        headers = ["method", ("time to ddp's final val loss of the same seed (median " f"{target:.4f}) (s)"
                              if per_seed_target and target else
                              f"time to ddp's final val loss {target:.4f} (s)" if target else "time to target (s)"),
                   "per seed (s)", "speed-up vs ddp", "step reached", "final val loss", "vs ddp", "steps",
                   "MB/rank/step", "% of ddp bytes", "wire MB/rank/step", "wire/payload", "ms/step",
                   "method flags"]
        if with_nodes:
            headers[10:10] = ["slow-link MB/node/step", "% of ddp's slow-link bytes"]
        if lim is not None:
            headers.insert(4, "x of the compute limit")
        parts.append(tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True))
        parts += _limit_line(lim)
    return "\n".join(parts) + "\n"


def _flat_results(results: Dict[str, Dict[str, List[Dict]]]) -> List[Dict]:
    """{rate: {label: [run per seed]}} as one list, each run tagged with its link rate and label."""
    out = []
    for rate, by_method in results.items():
        for m, runs in by_method.items():
            for r in runs:
                out.append(dict(r, link=dict(r.get("link") or {}, rate=rate), label=m))
    return out


def plot_lm(results: Dict[str, Dict[str, List[Dict]]], out_png: str) -> None:
    """Validation loss vs training time (one panel per rate) and vs total MB sent per rank.

    Drawn by :func:`slimcomm.train.report.plot_results`: one median line per method over the seeds with a
    min-max band, ddp's median final validation loss as the labelled target line.
    """
    from slimcomm.train.report import plot_results

    target = _loss_target(next(iter(results.values())))
    plot_results(_flat_results(results), out_png, panels=("time", "bytes"), log_time=True, target=target,
                 target_label=None if target is None else f"ddp's final val loss {target:.3f}")


def plot(results: Dict[str, Dict[str, List[Dict]]], out_png: str) -> None:
    """Test accuracy vs training time, one panel per rate (:func:`slimcomm.train.report.plot_results`)."""
    from slimcomm.train.report import plot_results

    plot_results(_flat_results(results), out_png, panels=("time",), log_time=True)
