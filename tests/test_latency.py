"""One-way delay in the cost model (slimcomm.train.projection): ring hops per collective call,
the calls of every method, delay 0 as the identity, and bench/latency_tables.py on committed results."""

import json
import os
import subprocess
import sys

import pytest

from slimcomm.train import projection as P

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MLP8 = os.path.join(REPO, "bench", "results", "scale", "mlp_8ranks_seeds")


def _run(method, world_size=8, steps=480, dense=23_298_088, stats=None, **cfg):
    config = {"bucket_cap_mb": 25.0, "core_refresh": 10, "local_steps": 10, "target_acc": 0.82}
    config.update(cfg)
    evals = [{"step": k, "train_time_s": 0.1 * k, "bytes_sent_per_rank": 1000 * k, "test_acc": 0.8 + k / 10000}
             for k in (120, 240, 480)]
    r = {"method": method, "world_size": world_size, "steps": steps, "dense_bytes_per_step": dense,
         "config": config, "evals": evals,
         "final": {"train_time_s": 0.1 * steps, "bytes_sent_per_rank": 1000 * steps, "test_acc": 0.848},
         "time_to_target": {"target": 0.82, "step": 240, "train_time_s": 24.0}}
    if stats is not None:
        r["stats"] = stats
    return r


def test_ring_hops():
    assert P.ring_hops("allreduce", 8) == 14 and P.ring_hops("allgather", 8) == 7
    assert P.ring_hops("allreduce", 2) == 2 and P.ring_hops("allgather", 2) == 1
    with pytest.raises(ValueError, match="kind"):
        P.ring_hops("broadcast", 8)


# hops per step at 8 ranks (ring all-reduce 14 hops, all-gather 7), one bucket / group unless said
HAND = [
    ("ddp", {}, None, 14.0),
    ("fp16", {}, None, 14.0),
    ("powersgd", {}, None, 3 * 14.0),                     # uncompressed tensors, P, Q
    ("topk", {}, None, 2 * 7.0),                          # indices + values all-gathers
    # the hook: one value all-reduce a step + a 64-byte all-reduce per core refresh + a checksum per 100
    ("slimdp", {}, None, 14.0 * (1 + 1 / 10 + 1 / 100)),
    # ... or exactly the checks the run counted (52 in 480 steps)
    ("slimdp", {}, {"total": {"checks": 52}}, 14.0 * (480 + 52) / 480),
    ("ist", {"local_steps": 10}, None, (14.0 + 7.0) / 10),  # agreement all-reduce + all-gather a round
    # ... as recorded: 48 rounds, 48 agreements (80 bytes each), or none in a run made before them
    ("ist", {"local_steps": 10}, {"rounds": 48, "check_bytes": 48 * 80}, 48 * (14.0 + 7.0) / 480),
    ("ist", {"local_steps": 10}, {"rounds": 48}, 48 * 7.0 / 480),
    # DiLoCo: one synchronisation per H = 24 steps: agreement all-reduce + one dense all-reduce
    ("diloco", {"sync_every": 24}, None, 2 * 14.0 / 24),
    # ... as recorded: 20 synchronisations, each with its agreement (20 checks) or none (older run)
    ("diloco", {"sync_every": 24}, {"syncs": 20, "total": {"checks": 20}}, 20 * 2 * 14.0 / 480),
    ("diloco", {"sync_every": 24}, {"syncs": 20, "total": {"checks": 0}}, 20 * 14.0 / 480),
    ("sparseloco", {"sync_every": 15}, None, (14.0 + 2 * 7.0) / 15),
    ("slimdp-local", {"sync_every": 3, "value_bits": 2, "lowbit_collective": "all_reduce"}, None,
     (14.0 + 2 * 7.0) / 3),                               # agreement + all-to-all + all-gather
    ("slimdp-local", {"sync_every": 3, "value_bits": 2, "lowbit_collective": "all_gather"}, None,
     (14.0 + 7.0) / 3),
    ("local", {}, None, 0.0),
]


@pytest.mark.parametrize("method,cfg,stats,hops", HAND, ids=[f"{h[0]}-{i}" for i, h in enumerate(HAND)])
def test_hops_per_step_by_hand(method, cfg, stats, hops):
    r = _run(method, stats=stats, **cfg)
    assert P.hops_per_step(r) == pytest.approx(hops, rel=1e-12)
    # collectives_per_step is the same hops in calls of the pattern kind
    kind = P.pattern_of(method, r["config"])
    assert P.collectives_per_step(r) * P.ring_hops(kind, 8) == pytest.approx(hops, rel=1e-12)


def test_buckets_multiply_the_calls():
    r = _run("ddp", dense=60 * 2 ** 20)  # 60 MiB over 25 MiB buckets: 3 buckets
    assert P.hops_per_step(r) == 3 * 14
    assert P.hops_per_step(_run("diloco", dense=60 * 2 ** 20, sync_every=24)) == pytest.approx((1 + 3) * 14 / 24)


@pytest.mark.parametrize("method,cfg,stats,hops", HAND, ids=[f"{h[0]}-{i}" for i, h in enumerate(HAND)])
def test_delay_adds_hops_times_delay_per_step(method, cfg, stats, hops):
    r = _run(method, stats=stats, **cfg)
    d = 0.05
    q = P.delayed_result(r, d)
    for e, qe in zip(r["evals"], q["evals"]):
        assert qe["train_time_s"] - e["train_time_s"] == pytest.approx(hops * d * e["step"], rel=1e-9, abs=1e-12)
    assert q["time_to_target"]["train_time_s"] == pytest.approx(24.0 + hops * d * 240, rel=1e-12)
    assert q["final"]["train_time_s"] == pytest.approx(48.0 + hops * d * 480, rel=1e-12)
    assert q["delay"]["one_way_s"] == d
    assert r["final"]["train_time_s"] == 48.0  # the input is untouched


def test_ddp_hand_computed_fifty_ms():
    """8 ranks, one bucket, 240 steps to target at 50 ms one-way: 14 hops x 0.05 s x 240 = 168 s more."""
    q = P.delayed_result(_run("ddp"), 0.05)
    assert q["time_to_target"]["train_time_s"] == pytest.approx(24.0 + 168.0, rel=1e-12)


def test_delay_zero_is_the_identity_on_committed_runs():
    names = sorted(f for f in os.listdir(MLP8) if f.endswith(".json"))
    assert len(names) >= 12
    for name in names:
        with open(os.path.join(MLP8, name)) as f:
            r = json.load(f)
        q = P.delayed_result(r, 0.0)
        assert [e["train_time_s"] for e in q["evals"]] == [e["train_time_s"] for e in r["evals"]]
        assert q["final"]["train_time_s"] == r["final"]["train_time_s"]
        if r.get("time_to_target"):
            assert q["time_to_target"]["train_time_s"] == r["time_to_target"]["train_time_s"]


def test_project_result_with_delay():
    r = _run("slimdp", stats={"total": {"checks": 52}})
    ran_on = P.EMULATED_LINKS["1gbit"]["allreduce"]
    base = P.project_result(r, "100mbit", ran_on)
    zero = P.project_result(r, "100mbit", ran_on, delay_s=0.0)
    assert zero["evals"] == base["evals"] and zero["train_time_s"] == base["train_time_s"]
    d = P.project_result(r, "100mbit", ran_on, delay_s=0.01)
    for b, e in zip(base["evals"], d["evals"]):
        assert e["train_time_s"] - b["train_time_s"] == pytest.approx(P.delay_s_at(r, e["step"], 0.01), rel=1e-9)
    assert d["delay_s"] == 0.01


def test_link_with_delay():
    link = P.LinkModel(alpha_s=1e-3, goodput_bps=1e8)
    slow = link.with_delay(0.01)
    assert slow.alpha_s == pytest.approx(0.011) and slow.goodput_bps == 1e8
    assert link.with_delay(0.0) == link
    assert slow.allreduce_s(1e6, 8, 3) - link.allreduce_s(1e6, 8, 3) == pytest.approx(3 * 14 * 0.01)
    assert slow.allgather_s(1e6, 8, 2) - link.allgather_s(1e6, 8, 2) == pytest.approx(2 * 7 * 0.01)
    for bad in (-1e-3, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="delay_s"):
            link.with_delay(bad)
        with pytest.raises(ValueError, match="delay_s"):
            P.delayed_result(_run("ddp"), bad)


def test_parse_delays():
    assert P.parse_delays("0,10,50ms") == pytest.approx([0.0, 0.01, 0.05])
    assert P.parse_delays("0,10,50") == pytest.approx([0.0, 0.01, 0.05])
    assert P.parse_delays("0.5s,100us") == pytest.approx([0.5, 1e-4])
    for bad in ("", "0,,1", "x", "-5ms", "10,10ms", "nan"):
        with pytest.raises(ValueError, match="--delays"):
            P.parse_delays(bad)


# ---------------------------------------------------------------------------
# bench/latency_tables.py on the committed 8-rank results
# ---------------------------------------------------------------------------

sys.path.insert(0, os.path.join(REPO, "bench"))
import latency_tables as LT  # noqa: E402


def test_latency_tables_at_zero_delay_are_the_netbench_tables():
    """Delay 0 gives the committed netbench table's median times to 0.85 exactly
    (bench/results/scale/mlp_8ranks_seeds.md), at the measured and at the projected rate."""
    res = LT.load_results(MLP8)
    assert set(res) == {"1gbit", "100mbit"}
    assert set(res["1gbit"]) == {"ddp", "slimdp", "slimdp@delayed", "diloco", "sparseloco", "local"}
    want = {"1gbit": {"ddp": 72.9, "slimdp": 37.6, "slimdp@delayed": 40.8, "diloco": 34.1,
                      "sparseloco": 39.2},
            "100mbit": {"ddp": 581.5, "slimdp": 55.4, "slimdp@delayed": 46.2, "diloco": 56.3,
                        "sparseloco": 61.3}}
    for rate, by in res.items():
        _, targets = LT.resolve_targets(by, "run")
        rows = LT.latency_rows(by, targets, [0.0, 0.01])
        for m, t in want[rate].items():
            assert f"{rows[m]['times'][0]:.1f}" == f"{t:.1f}", (rate, m)
            # 10 ms: + 0.01 s x hops/step x steps to target, per seed, then the median
            if m == "slimdp@delayed":  # overlapped: see test_delayed_hook_pays_only_...
                continue
            per = [time_to + 0.01 * P.hops_per_step(r) * r["time_to_target"]["step"]
                   for r, time_to in zip(by[m], [r["time_to_target"]["train_time_s"] for r in by[m]])]
            assert rows[m]["times"][1] == pytest.approx(sorted(per)[1], rel=1e-12)


def test_latency_tables_compute_limit_and_targets():
    """A local run gives the compute limit column; --target all is reached by every method."""
    ddp = [_run("ddp")]
    loc = _run("local")
    loc["final"]["train_time_s"] = 0.05 * 480  # 50 ms/step
    by = {"ddp": ddp, "local": [loc], "diloco": [_run("diloco", sync_every=24)]}
    md, summary = LT.markdown({"1gbit": by}, [0.0, 0.05], ["run", "all"], "# t", "cmd")
    # ddp reaches 0.82 at step 240 (its first evaluation at or above it): 240 x 50 ms = 12 s
    assert "Compute limit (measured in the same run): ddp's 240 steps to the target x local's 50 ms/step = 12.0 s" in md
    assert "x of the compute limit at 50 ms" in md
    best = [s for s in summary if s["delay_s"] == 0.05 and "runs' target" in s["target"]][0]
    assert best["overall"][0] == "diloco" and best["slimcomm"] is None
    with pytest.raises(ValueError, match="--target"):
        LT.resolve_targets(by, "bogus")


def test_latency_tables_cli_errors(tmp_path, capsys):
    with pytest.raises(SystemExit):
        LT.main([str(tmp_path / "missing")])
    assert "is not a directory" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        LT.main([MLP8, "--delays", "-3ms"])
    assert "--delays" in capsys.readouterr().err
    (tmp_path / "1gbit_slimdp.json").write_text(json.dumps(_run("slimdp")))
    with pytest.raises(SystemExit):
        LT.main([str(tmp_path)])
    assert "no ddp run" in capsys.readouterr().err


def test_latency_tables_script_writes_markdown(tmp_path):
    out = tmp_path / "lat.md"
    r = subprocess.run([sys.executable, os.path.join(REPO, "bench", "latency_tables.py"), MLP8,
                        "--delays", "0,50ms", "--out", str(out)], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=REPO))
    assert r.returncode == 0, r.stderr
    md = out.read_text()
    assert "**Projected**" in md and "time to target at 50 ms (s)" in md and "| slimdp " in md


def test_current_code_adds_what_older_runs_did_not_make():
    """A run made before the per-sync agreement (checks 0) and the two-stage all-reduce (no
    lowbit_collective in its config): current_code adds one 14-hop agreement per synchronisation
    and counts the 2-bit codes as all-to-all + all-gather (14 hops instead of 7)."""
    old = _run("slimdp-local", sync_every=3, value_bits=2, stats={"syncs": 160, "total": {"checks": 0}})
    assert P.hops_per_step(old) == pytest.approx(160 * 7.0 / 480)
    assert P.hops_per_step(old, current_code=True) == pytest.approx(160 * (14.0 + 14.0) / 480)
    new = _run("diloco", sync_every=24, stats={"syncs": 20, "total": {"checks": 20}})
    assert P.hops_per_step(new, current_code=True) == P.hops_per_step(new)  # already counted
    ist = _run("ist", stats={"rounds": 48})
    assert P.hops_per_step(ist, current_code=True) == pytest.approx(48 * 21.0 / 480)
    assert P.hops_per_step(_run("slimdp", stats={"total": {"checks": 52}}), current_code=True) == \
        P.hops_per_step(_run("slimdp", stats={"total": {"checks": 52}}))


def test_swap_sync_estimate_is_the_reference_for_the_same_run():
    """A run estimated from itself as reference: its own time; the codec cost adds syncs x codec_s;
    a delay adds d x hops x steps to both."""
    import latency_swap_sync as S

    ref = _run("diloco", sync_every=24)
    run = json.loads(json.dumps(ref))
    est = S.estimate(run, ref, "1gbit", [0.0, 0.05], codec_s=0.0)
    assert est["run"][0] == pytest.approx(24.0, rel=1e-12) and est["ref"][0] == 24.0
    assert est["run"][1] - est["run"][0] == pytest.approx(0.05 * P.hops_per_step(run) * 240, rel=1e-12)
    assert est["run"][1] == pytest.approx(est["ref"][1], rel=1e-12)
    with_codec = S.estimate(run, ref, "1gbit", [0.0], codec_s=1.0)
    assert with_codec["run"][0] == pytest.approx(24.0 + 240 // 24, rel=1e-12)
    with pytest.raises(ValueError, match="rate"):
        S.estimate(run, ref, "10gbit", [0.0])


def test_delayed_hook_pays_only_the_latency_that_outlasts_its_step():
    """delay_steps=1: the payload all-reduce (14 hops at 8 ranks) overlaps a 0.1 s step; the
    checksum all-reduces (48 counted over 480 steps: 0.1 a step) do not."""
    stats = {"total": {"checks": 48}}
    run = _run("slimdp", stats=stats, delay_steps=1)
    run["link"] = {"rate": "1gbit"}
    link = P.EMULATED_LINKS["1gbit"]["allreduce"]
    c0 = link.allreduce_s(1000.0, 8, 1.0)  # 1000 payload bytes a step
    for d in (0.002, 0.005, 0.05):
        want = max(0.0, c0 + 14 * d - 0.1) - max(0.0, c0 - 0.1) + 0.1 * 14 * d
        got = P.delayed_result(run, d)
        assert got["final"]["train_time_s"] == pytest.approx(0.1 * 480 + want * 480)
        plain = P.delayed_result(_run("slimdp", stats=stats), d)
        assert got["final"]["train_time_s"] <= plain["final"]["train_time_s"]
    # 2 ms: 28 ms of hops hide inside the 100 ms step; only the checksums' latency is added
    assert P.delayed_result(run, 0.002)["final"]["train_time_s"] == pytest.approx(48 + 0.1 * 14 * 0.002 * 480)
    assert P.delayed_result(run, 0.0)["final"]["train_time_s"] == 48.0


def test_project_result_overlaps_a_delayed_hooks_payload():
    run = _run("slimdp", stats={"total": {"checks": 48}}, delay_steps=1)
    loop = P.LinkModel(alpha_s=0.0, goodput_bps=1e12)
    fast = P.project_result(run, "1gbit", loop)
    slow = P.project_result(run, "100mbit", loop)
    plain = P.project_result(_run("slimdp", stats={"total": {"checks": 48}}), "100mbit", loop)
    # 1000 bytes a step: the transfer hides behind the 0.1 s step on either link
    assert fast["train_time_s"] == pytest.approx(48.0 + 0.1 * 480 * 14 * 0.71e-3, rel=1e-6)
    assert slow["train_time_s"] == pytest.approx(48.0, rel=1e-6)
    assert slow["train_time_s"] < plain["train_time_s"]
