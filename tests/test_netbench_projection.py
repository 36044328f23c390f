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


def _warm_run(method, steps, warm_s, ms, warmup=2, evals=(20, 40, 60), cfg=None):
    """A run whose first ``warmup`` steps took ``warm_s`` seconds each, later ones ``ms``."""
    def t(s):
        return min(s, warmup) * warm_s + max(0, s - warmup) * ms / 1000
    return {"method": method, "world_size": 8, "steps": steps, "config": cfg or {"warmup_steps": warmup},
            "evals": [{"step": s, "train_time_s": t(s), "test_acc": 0.8} for s in evals],
            "final": {"train_time_s": t(steps), "test_acc": 0.8, "bytes_sent_per_rank": 1},
            "time_to_target": {"step": 180, "train_time_s": t(180)}}


def test_dense_warmup_is_counted_once_not_at_the_mean_rate():
    """slimdp's 2 dense warm-up steps (4 s each at 100 Mbit/s, 8 ranks) inside a 120-step timed run:
    the projection charges them once and every later step at the steady 380 ms, as a full run would."""
    from netbench_projection import dense_warmup_steps, steady_ms_per_step

    timed = _warm_run("slimdp", 120, 4.0, 380.0, evals=(20, 40, 60, 80, 100, 120))
    traj = _warm_run("slimdp", 468, 0.5, 300.0, evals=(20, 180, 468))
    assert dense_warmup_steps(timed) == 2 and steady_ms_per_step(timed) == pytest.approx(380.0)
    p = project_run(traj, timed, "1gbit")
    assert p["projected"]["ms_per_step"] == pytest.approx(380.0)
    assert p["time_to_target"]["train_time_s"] == pytest.approx(2 * 4.0 + 178 * 0.380)
    assert p["final"]["train_time_s"] == pytest.approx(2 * 4.0 + 466 * 0.380)
    # the mean over the timed run would have charged the warm-up to all 180 steps
    mean = timed["final"]["train_time_s"] / 120
    assert 180 * mean == pytest.approx(79.26) and 180 * mean - p["time_to_target"]["train_time_s"] > 3.5
    # methods without a dense warm-up keep the timed run's mean rate; so does a run without an evaluation past it
    for run in (_warm_run("diloco", 120, 0.2, 0.2 * 1000, cfg={}),
                _warm_run("slimdp", 120, 4.0, 380.0, evals=(120,))):
        assert steady_ms_per_step(run) == pytest.approx(1000 * run["final"]["train_time_s"] / 120)
    assert dense_warmup_steps({"method": "powersgd", "config": {"powersgd_start_iter": 3}}) == 3
    assert dense_warmup_steps({"method": "ddp", "config": {"warmup_steps": 2}}) == 0


def test_steady_rate_of_a_local_step_method_counts_its_synchronisations():
    """DiLoCo-like: 200 ms local steps, a 2.4 s synchronisation every 24 steps, 3 s of start-up in the
    first 20 steps; evaluations every 20 steps hold 1 or 0 synchronisations each, so no single window
    is representative, the regression on (steps, synchronisations) is: 200 + 2400 / 24 ms."""
    from netbench_projection import steady_ms_per_step, sync_period

    def t(s):
        return 3.0 * min(s, 20) / 20 + 0.2 * s + 2.4 * (s // 24)
    run = {"method": "diloco", "world_size": 8, "steps": 120, "config": {"sync_every": 24},
           "evals": [{"step": s, "train_time_s": t(s)} for s in (20, 40, 60, 80, 100, 120)],
           "final": {"train_time_s": t(120), "bytes_sent_per_rank": 1}}
    assert sync_period(run) == 24
    # on its own the timed run cannot separate them (every window (20, k] holds one sync per 20 steps)
    assert steady_ms_per_step(run) == pytest.approx(1000 * t(120) / 120)
    # the full run at the fast rate (local steps 200 ms, syncs 0.1 s, evaluations every 20 to 468) can
    traj = {"method": "diloco", "world_size": 8, "steps": 468, "config": {"sync_every": 24},
            "evals": [{"step": s, "train_time_s": 0.2 * s + 0.1 * (s // 24)} for s in range(20, 468, 20)],
            "final": {"train_time_s": 0.2 * 468 + 0.1 * 19}, "time_to_target": {"step": 260, "train_time_s": 0}}
    assert steady_ms_per_step(traj) == pytest.approx(200 + 100 / 24)
    p = project_run(traj, run, "1gbit")
    assert p["projected"]["ms_per_step"] == pytest.approx(300.0)
    assert p["time_to_target"]["train_time_s"] == pytest.approx(t(20) + 240 * 0.3)
    # with evaluations that do separate them, the timed run alone gives the same rate
    sep = dict(run, steps=240, evals=[{"step": s, "train_time_s": t(s)} for s in range(20, 240, 20)],
               final={"train_time_s": t(240)})
    assert steady_ms_per_step(sep) == pytest.approx(300.0)


def test_heading_names_the_priority_of_the_timed_runs_not_the_reused_trajectory():
    # a trajectory reused from a run with normal loop threads, timed with idle ones: the
    # projected run's times are the timed run's, so the heading names idle for it
    traj = _lm_run("ddp", 100, 10.0, [(50, 2.5), (100, 2.0)])
    traj["config"] = {"comm_thread_priority": "normal"}
    timed = _lm_run("ddp", 20, 40.0, [(20, 3.0)])
    timed["config"] = {"comm_thread_priority": "idle"}
    p = project_run(traj, timed, "1gbit")
    assert p["projected"]["comm_thread_priority"] == "idle"
    assert p["config"]["comm_thread_priority"] == "normal"  # the trajectory's config is kept
    assert netbench._loop_priority({"100mbit": {"ddp": [p]}}) == \
        "gloo loop threads idle (--comm-thread-priority)"
    assert netbench._loop_priority({"1gbit": {"ddp": [traj]}, "100mbit": {"ddp": [p]}}) == \
        "gloo loop threads (--comm-thread-priority): ddp idle/normal"
    # a projected run recorded before the field existed falls back to its config
    del p["projected"]["comm_thread_priority"]
    assert netbench._loop_priority({"100mbit": {"ddp": [p]}}) == \
        "gloo loop threads normal (--comm-thread-priority)"


def test_heading_names_the_model():
    assert netbench._model_words({"model": {"name": "mlp"}}, {"hidden": [2048, 2048]}) == \
        "MLP hidden [2048, 2048]"
    assert netbench._model_words({"model": {"name": "cnn"}}, {"model": "cnn", "hidden": None}) == "CNN"
    assert netbench._model_words({"model": {}}, {"hidden": [64]}) == "MLP hidden [64]"  # old results
