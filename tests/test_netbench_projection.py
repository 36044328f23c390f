"""bench/netbench_projection.py: timed-run flags and projected results (no namespaces needed)."""

import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "bench"))

import netbench  # noqa: E402
from netbench_projection import project_run, timed_args  # noqa: E402


def test_timed_args_replaces_the_length_flags():
    extra = ["--model", "gpt", "--epochs", "2", "--steps=900", "--stop-at-target", "--lr", "0.1"]
    assert timed_args(extra, 120) == ["--model", "gpt", "--lr", "0.1", "--steps", "120"]
    assert timed_args([], 7) == ["--steps", "7"]
    with pytest.raises(ValueError, match="--timed-steps"):
        timed_args([], 0)


def _lm_run(method, steps, ms, losses, ttt_step=None):
    evals = [{"step": s, "train_time_s": s * ms / 1000, "val_loss": v, "bytes_sent_per_rank": s * 10}
             for s, v in losses]
    return {"method": method, "world_size": 2, "steps": steps, "dense_bytes_per_step": 100,
            "metric": {"name": "val_loss"}, "config": {}, "evals": evals,
            "final": {"val_loss": losses[-1][1], "train_time_s": steps * ms / 1000,
                      "bytes_sent_per_rank": steps * 10},
            "time_to_target": None if ttt_step is None else {"step": ttt_step, "train_time_s": ttt_step * ms / 1000},
            "method_flags": []}


def test_project_run_rescales_every_time_and_keeps_the_trajectory():
    traj = _lm_run("ddp", 100, 10.0, [(50, 2.5), (100, 2.0)], ttt_step=100)
    timed = _lm_run("ddp", 20, 40.0, [(20, 3.0)])
    p = project_run(traj, timed, "1gbit")
    assert [e["train_time_s"] for e in p["evals"]] == [pytest.approx(2.0), pytest.approx(4.0)]
    assert p["final"]["train_time_s"] == pytest.approx(4.0)
    assert p["time_to_target"]["train_time_s"] == pytest.approx(4.0)
    assert p["final"]["val_loss"] == 2.0 and p["final"]["bytes_sent_per_rank"] == 1000
    assert p["projected"]["ms_per_step"] == pytest.approx(40.0) and p["projected"]["timed_steps"] == 20
    assert traj["evals"][0]["train_time_s"] == pytest.approx(0.5)  # the input is not modified
    with pytest.raises(ValueError, match="method"):
        project_run(traj, _lm_run("slimdp", 20, 40.0, [(20, 3.0)]), "1gbit")


def test_projected_rows_are_marked_in_the_lm_table():
    traj = {"ddp": [_lm_run("ddp", 100, 10.0, [(50, 2.5), (100, 2.0)])],
            "slimdp-local": [_lm_run("slimdp-local", 100, 5.0, [(50, 2.2), (100, 1.9)])]}
    slow = {m: [project_run(r[0], _lm_run(m, 20, ms, [(20, 3.0)]), "1gbit")]
            for (m, r), ms in zip(traj.items(), (50.0, 6.0))}
    md = netbench.markdown_lm({"1gbit": traj, "100mbit": slow}, {"1gbit": 950.0, "100mbit": 96.0}, "h")
    sec = md.split("### 100mbit")[1]
    assert "**Projected**" in sec and "20 timed steps" in sec and "at 1gbit" in sec
    assert "**Projected**" not in md.split("### 100mbit")[0]
    row = next(ln for ln in sec.splitlines() if ln.startswith("| slimdp-local "))
    assert "| 6 " in row  # ms/step measured on the slow link
    ddp = next(ln for ln in sec.splitlines() if ln.startswith("| ddp "))
    assert "5.0" in ddp  # ddp reaches its own final loss at step 100: 100 x 50 ms


def test_timed_rates_are_checked(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    for argv, msg in [(["--rates", "1gbit", "--timed-rates", "1gbit"], "at least one rate"),
                      (["--rates", "1gbit", "--timed-rates", "100mbit"], "not in --rates"),
                      (["--rates", "1gbit,100mbit", "--timed-rates", "100mbit", "--timed-steps", "0"],
                       "--timed-steps")]:
        with pytest.raises(SystemExit):
            netbench.main(argv)
        assert msg in capsys.readouterr().err


def test_lm_table_targets_ddp_final_loss_of_the_same_seed():
    """With seeds, each run's target is ddp's final loss of its seed: ddp reaches it at its last step."""
    def run(m, seed, losses):
        r = _lm_run(m, 100, 10.0, losses)
        r["config"]["seed"] = seed
        return r
    by = {"ddp": [run("ddp", 0, [(50, 2.5), (100, 2.0)]), run("ddp", 1, [(50, 2.6), (100, 2.2)])],
          "slimdp-local": [run("slimdp-local", 0, [(50, 2.1), (100, 1.9)]),
                           run("slimdp-local", 1, [(50, 2.15), (100, 2.0)])]}
    md = netbench.markdown_lm({"1gbit": by}, {"1gbit": 950.0}, "h")
    assert "of the same seed" in md
    ddp = [c.strip() for c in next(ln for ln in md.splitlines() if ln.startswith("| ddp ")).split("|")[1:-1]]
    slim = [c.strip() for c in next(ln for ln in md.splitlines()
                                    if ln.startswith("| slimdp-local ")).split("|")[1:-1]]
    assert ddp[1] == "1.0" and ddp[2] == "1.0, 1.0"        # both seeds reach their own final at step 100
    assert slim[2] == "1.0, 0.5" and slim[3] == "1.33x"     # seed 1: 2.15 <= 2.2 at step 50


def test_timed_steps_per_method():
    assert netbench.parse_timed_steps("120") == {None: 120}
    assert netbench.parse_timed_steps("ddp=24") == {None: 120, "ddp": 24}
    assert netbench.parse_timed_steps("60, ddp=24,fp16=12") == {None: 60, "ddp": 24, "fp16": 12}
    for bad, msg in [("0", ">= 1"), ("ddp=x", "not N or METHOD=N"), ("60,60", "twice"), ("ddp=3,ddp=4", "twice")]:
        with pytest.raises(ValueError, match=msg):
            netbench.parse_timed_steps(bad)


def test_timed_steps_name_known_methods(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    with pytest.raises(SystemExit):
        netbench.main(["--rates", "1gbit,100mbit", "--timed-rates", "100mbit", "--methods", "ddp",
                       "--timed-steps", "120,fp16=24"])
    assert "['fp16'] not in --methods" in capsys.readouterr().err
