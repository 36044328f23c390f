"""slimcomm.train.projection: the demo's per-link times, checked against committed measurements.

* the link constants are the fit of the committed collective timings (bench/results/scale/collbench.json);
* the projection is exact arithmetic on a synthetic run;
* projected from the committed 1 Gbit/s netbench runs (their measured compute per step and counted bytes),
  the 100 Mbit/s train time of ddp, slimdp and ist is within 15% of the committed measured 100 Mbit/s runs
  of the same setting (bench/results/netbench_2ranks/, re-measured 2026-12-05 with the current code) and of
  the 2-rank sweep with the current code (bench/results/scale/mlp_2ranks/).
"""

import json
import os
import statistics

import pytest

from slimcomm.train import projection as P

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NETBENCH = os.path.join(REPO, "bench", "results", "netbench_2ranks")
SWEEP = os.path.join(REPO, "bench", "results", "scale", "mlp_2ranks")
DEMO_METHODS = ("ddp", "slimdp", "ist")
TOLERANCE = 0.15


def _load(*parts):
    with open(os.path.join(*parts)) as f:
        return json.load(f)


@pytest.mark.parametrize("rate", ["1gbit", "100mbit"])
@pytest.mark.parametrize("kind", ["allreduce", "allgather"])
def test_link_constants_are_the_committed_collective_fit(rate, kind):
    """EMULATED_LINKS[rate][kind] = fit_link over the 2-rank timings of that kind, idle gap 300 ms."""
    bench = _load(REPO, "bench", "results", "scale", "collbench.json")
    obs = [(t["kind"], t["bytes"], 2, 1.0, t["median_s"]) for row in bench["rows"]
           if row["rate"] == rate and row["gap_ms"] == 300 and row["world_size"] == 2
           for t in row["timings"] if t["kind"] == kind]
    assert len(obs) >= 6
    fit = P.fit_link(obs)
    got = P.EMULATED_LINKS[rate][kind]
    assert got.goodput_bps == pytest.approx(fit.goodput_bps, rel=5e-3)
    assert got.alpha_s == pytest.approx(fit.alpha_s, abs=1e-5)


def _synthetic(method="ddp", steps=30, step_s=0.05, bytes_per_step=4e6):
    evals = [{"step": k, "train_time_s": k * step_s, "bytes_sent_per_rank": k * bytes_per_step,
              "test_acc": 0.5 + k / 100} for k in (10, 20, 30)]
    return {"method": method, "world_size": 2, "steps": steps, "dense_bytes_per_step": 4e6,
            "config": {"bucket_cap_mb": 25.0, "local_steps": 10, "core_refresh": 10, "target_acc": 0.85},
            "evals": evals, "final": {"train_time_s": steps * step_s, "bytes_sent_per_rank": steps * bytes_per_step,
                                      "test_acc": evals[-1]["test_acc"]},
            "time_to_target": {"target": 0.7, "step": 20, "train_time_s": 20 * step_s}}


def test_projection_is_compute_plus_link_time():
    r = _synthetic()
    ran_on = P.LinkModel(alpha_s=1e-3, goodput_bps=8e9)  # 1 GB/s
    slow = P.LinkModel(alpha_s=2e-3, goodput_bps=8e7)    # 10 MB/s
    links = {"slow": {"allreduce": slow, "allgather": slow}}
    p = P.project_result(r, "slow", ran_on, links=links)
    for e, pe in zip(r["evals"], p["evals"]):
        k = e["step"]
        # 2 ranks: one all-reduce per step moves its bytes once, 2 hops of latency
        compute = k * 0.05 - (k * 4e6 / 1e9 + 2 * k * 1e-3)
        assert pe["train_time_s"] == pytest.approx(compute + k * 4e6 / 1e7 + 2 * k * 2e-3, rel=1e-12)
    assert p["train_time_s"] == p["evals"][-1]["train_time_s"]
    assert p["time_to_target_s"] == p["evals"][1]["train_time_s"]
    assert p["source"] == "projected"
    # an all-gather method pays (W-1) x its bytes; per round (every 10 steps for IST) one all-gather
    # (1 hop at 2 ranks) and one agreement all-reduce (2 hops): 3 rounds x 3 hops
    g = P.project_result(_synthetic("ist"), "slow", ran_on, links=links)
    compute = 30 * 0.05 - (30 * 4e6 / 1e9 + 9 * 1e-3)
    assert g["train_time_s"] == pytest.approx(compute + 30 * 4e6 / 1e7 + 9 * 2e-3, rel=1e-12)


def test_add_link_times_and_link_result():
    r = _synthetic()
    probe = {"kind": "allreduce", "alpha_s": 0.0, "goodput_bps": 8e9, "timings": []}
    P.add_link_times(r, probe, ("1gbit", "100mbit"))
    lt = r["link_times"]
    assert set(lt["links"]) == {"1gbit", "100mbit"}
    assert lt["compute_s_per_step"] == pytest.approx(0.05 - 4e6 / 1e9)
    assert lt["links"]["100mbit"]["train_time_s"] > lt["links"]["1gbit"]["train_time_s"] > r["final"]["train_time_s"]
    q = P.link_result(r, "100mbit")
    assert q["link"] == {"rate": "100mbit", "source": "projected"}
    assert [e["train_time_s"] for e in q["evals"]] == [e["train_time_s"] for e in lt["links"]["100mbit"]["evals"]]
    assert q["final"]["bytes_sent_per_rank"] == r["final"]["bytes_sent_per_rank"]  # bytes stay as counted
    assert r["evals"][0]["train_time_s"] == pytest.approx(0.5)  # the original is untouched
    table = P.links_table([r])
    assert "| 100 Mbit/s | ddp" in table and "projected" in table and "measured (this machine)" in table


def _projected_at(fast, slow_step):
    """Train time of ``fast`` (a run on the emulated 1 Gbit/s link) projected onto 100 Mbit/s at ``slow_step``."""
    ran_on = P.EMULATED_LINKS["1gbit"][P.PATTERN[fast["method"]]]
    p = P.project_result(fast, "100mbit", ran_on)
    at = {e["step"]: e["train_time_s"] for e in p["evals"]}
    return at[slow_step]


def _measured_at(run, step):
    return next(e["train_time_s"] for e in run["evals"] if e["step"] == step)


# netbench_2ranks' ddp, slimdp and ist runs were re-measured on 2026-12-05 with the current code, each seed's
# 1 Gbit/s run followed at once by its 100 Mbit/s run (the earlier files ran every 1 Gbit/s run first and
# every 100 Mbit/s run afterwards; the machine computed 15-20% faster in the second phase, and slimdp, whose
# step is mostly compute, missed by +18%). Medians of the seeds: ddp +1.8%, slimdp +2.0%, ist -6.4%. The
# machine was shared (load average 1.3-17.5, median 7.8: bench/results/netbench_2ranks.md), so a seed's
# compute per step differs between its two runs and single seeds miss by up to 15% (slimdp seed 0: -15%,
# ist seed 0: +10%); the median over three seeds is what this test holds to the tolerance.


@pytest.mark.parametrize("method", DEMO_METHODS)
def test_projection_matches_measured_netbench_100mbit(method):
    """netbench_2ranks (Fashion-MNIST MLP 2048-2048, 2 ranks, batch 128, evaluation every 20 steps, seeds
    0-2): the 1 Gbit/s run's compute per step and bytes, projected onto 100 Mbit/s, against the measured
    100 Mbit/s run of the same seed up to the step it stopped at (the target, or the last step: ist with
    its current defaults does not reach 0.85 in 2 epochs); medians over the seeds."""
    proj, meas = [], []
    for seed in (0, 1, 2):
        fast = _load(NETBENCH, f"1gbit_{method}_s{seed}.json")
        slow = _load(NETBENCH, f"100mbit_{method}_s{seed}.json")
        assert fast["config"]["seed"] == slow["config"]["seed"] == seed
        for k in ("batch_size", "hidden", "lr", "eval_every", "local_steps", "core_refresh"):
            assert fast["config"][k] == slow["config"][k]
        step = slow["steps"]
        # same trajectory at both rates (CPU arithmetic does not depend on the link): same bytes
        assert next(e["bytes_sent_per_rank"] for e in fast["evals"] if e["step"] == step) == \
            slow["final"]["bytes_sent_per_rank"]
        proj.append(_projected_at(fast, step))
        meas.append(slow["final"]["train_time_s"])
    err = statistics.median(proj) / statistics.median(meas) - 1
    assert abs(err) <= TOLERANCE, (f"{method}: projected {statistics.median(proj):.1f} s vs measured "
                                   f"{statistics.median(meas):.1f} s at 100 Mbit/s ({100 * err:+.0f}%; per seed "
                                   + ", ".join(f"{p:.1f}/{m:.1f}" for p, m in zip(proj, meas)) + ")")


@pytest.mark.parametrize("method", DEMO_METHODS)
def test_projection_matches_measured_sweep_100mbit(method):
    """scale/mlp_2ranks (the 2-rank part of the 2026-12-02 sweep with the current code: batch 32, 7,500
    images per rank, seed 0): the full 1 Gbit/s run projected onto 100 Mbit/s against the measured
    100 Mbit/s timed run (its own first steps), at the timed run's last evaluation."""
    fast = _load(SWEEP, f"1gbit_{method}.json")
    slow = _load(SWEEP, f"100mbit_{method}_timed.json")
    steps = {e["step"] for e in fast["evals"]}
    step = max(e["step"] for e in slow["evals"] if e["step"] in steps)
    assert step >= 20
    proj, meas = _projected_at(fast, step), _measured_at(slow, step)
    err = proj / meas - 1
    assert abs(err) <= TOLERANCE, f"{method}: projected {proj:.2f} s vs measured {meas:.2f} s ({100 * err:+.0f}%)"


def test_demo_settings_give_at_least_ten_evaluations():
    """`make demo`'s flags (Makefile DEMO_ARGS) parse, and evaluate at least 10 times per method."""
    import re

    from slimcomm import train as T

    with open(os.path.join(REPO, "Makefile")) as f:
        m = re.search(r"^DEMO_ARGS := (.*)$", f.read(), re.M)
    assert m, "Makefile: no DEMO_ARGS line"
    args = T.build_parser().parse_args(["--compare", "ddp,slimdp,ist", "--world-size", "2"] + m.group(1).split())
    T.apply_method_defaults(args)
    steps = args.steps if args.steps is not None else args.epochs * 234  # 234 steps per epoch at batch 128
    assert args.eval_every > 0 and steps // args.eval_every >= 10
    assert args.test_subset is not None  # the cheap evaluation the README states


def test_note_says_when_delayed_slimdp_overlaps():
    # Found by the breaker: a --delay-steps 1 run is projected with its payload all-reduces
    # overlapped (project_result), but the printed note said "no overlap of communication with
    # compute".
    r = _synthetic("slimdp")
    r.setdefault("config", {})["delay_steps"] = 1
    probe = {"kind": "allreduce", "alpha_s": 0.0, "goodput_bps": 8e9, "timings": []}
    P.add_link_times(r, probe, ("1gbit",))
    assert "--delay-steps 1" in r["link_times"]["assumptions"]
    plain = _synthetic("slimdp")
    P.add_link_times(plain, probe, ("1gbit",))
    assert plain["link_times"]["assumptions"].endswith("no overlap of communication with compute")
