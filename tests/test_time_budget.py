"""Time budgets (issue 24): ``slimcomm.train --time-budget`` and netbench's cut of projected runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "bench"))

from netbench_projection import apply_budget, timed_args  # noqa: E402

TINY = ["--dataset", "digits", "--hidden", "48,48", "--batch-size", "16",
        "--no-progress", "--threads", "1", "--timeout", "60"]


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def test_train_stops_at_the_first_evaluation_past_the_budget(tmp_path):
    # A budget far below one evaluation interval: every rank stops at the first evaluation
    # (step 5), together (the ranks agree on the slowest rank's time), with the JSON saying so.
    p = tmp_path / "ist.json"
    r = subprocess.run([sys.executable, "-m", "slimcomm.train", "--method", "ist", "--world-size", "2",
                        "--epochs", "5", "--eval-every", "5", "--time-budget", "0.0001",
                        "--out", str(p), *TINY],
                       env=_env(), capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(p.read_text())
    assert res["stopped_at_budget"] is True
    assert res["steps"] == 5 and [e["step"] for e in res["evals"]] == [5]
    assert res["config"]["time_budget"] == 0.0001
    assert res["planned_steps"] > 5


def test_time_budget_must_be_positive(tmp_path):
    r = subprocess.run([sys.executable, "-m", "slimcomm.train", "--method", "ist", "--time-budget", "0",
                        "--out", str(tmp_path / "x.json"), *TINY],
                       env=_env(), capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode != 0 and "--time-budget" in r.stderr


def _run(times, target_at=None):
    evals = [{"epoch": 0.5 * (i + 1), "step": 10 * (i + 1), "train_time_s": t, "bytes_sent_per_rank": 100 * (i + 1),
              "test_acc": 0.5 + 0.1 * i, "test_loss": 1.0 - 0.1 * i, "train_loss": 1.0} for i, t in enumerate(times)]
    ttt = None
    if target_at is not None:
        e = evals[target_at]
        ttt = {"target": 0.85, "metric": "test_acc", "train_time_s": e["train_time_s"], "step": e["step"],
               "bytes_sent_per_rank": e["bytes_sent_per_rank"], "epoch": e["epoch"]}
    return {"evals": evals, "epochs": [dict(evals[1])], "steps": evals[-1]["step"],
            "final": {"test_acc": evals[-1]["test_acc"], "test_loss": evals[-1]["test_loss"],
                      "train_time_s": times[-1], "eval_time_s": 3.0, "wall_time_s": 9.0,
                      "bytes_sent_per_rank": evals[-1]["bytes_sent_per_rank"]},
            "time_to_target": ttt}


def test_apply_budget_cuts_evaluations_final_and_target():
    run = _run([1.0, 2.0, 3.0, 4.0], target_at=3)
    out = apply_budget(run, 2.5)
    assert [e["step"] for e in out["evals"]] == [10, 20]
    assert out["steps"] == 20 and out["final"]["test_acc"] == pytest.approx(0.6)
    assert out["final"]["train_time_s"] == 2.0 and out["final"]["bytes_sent_per_rank"] == 200
    assert out["time_to_target"] is None            # reached at 4.0 s: beyond the budget
    assert out["budget_s"] == 2.5 and out["stopped_at_budget"]
    assert run["final"]["test_acc"] == pytest.approx(0.8)   # the input is not modified
    kept = apply_budget(_run([1.0, 2.0, 3.0], target_at=1), 2.0)
    assert kept["time_to_target"]["train_time_s"] == 2.0    # at the budget counts
    none = apply_budget(run, 0.5)
    assert none["evals"] == [] and none["steps"] == 0 and "test_acc" not in none["final"]
    with pytest.raises(ValueError, match="time-budget"):
        apply_budget(run, 0.0)


def test_timed_runs_drop_the_budget():
    assert timed_args(["--epochs", "9", "--time-budget", "30", "--lr", "0.1"], 24) == \
        ["--lr", "0.1", "--steps", "24"]
    assert timed_args(["--time-budget=30"], 12) == ["--steps", "12"]


def test_timed_eval_every_replaces_the_full_runs():
    assert timed_args(["--eval-every", "117", "--epochs", "9"], 120, 20) == \
        ["--steps", "120", "--eval-every", "20"]
    assert timed_args(["--eval-every=117"], 120) == ["--eval-every=117", "--steps", "120"]
    with pytest.raises(ValueError, match="timed-eval-every"):
        timed_args([], 120, 0)


def test_apply_budget_scales_wire_counters_to_the_kept_steps():
    run = _run([1.0, 2.0, 3.0, 4.0])
    run["wire"] = [{"iface": "v0", "tx_bytes": 4000, "rx_bytes": 8000, "per_step_bytes": []}]
    out = apply_budget(run, 2.0)
    assert out["steps"] == 20 and out["wire"][0]["tx_bytes"] == 2000 and out["wire"][0]["rx_bytes"] == 4000
    assert run["wire"][0]["tx_bytes"] == 4000
