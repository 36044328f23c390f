"""bench/costmodel.py: the alpha-beta fit is exact on data it generated, refuses what it cannot identify,
and the step model fitted on 2 ranks predicts synthetic 4- and 8-rank runs exactly."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

import costmodel as cm  # noqa: E402


def test_fit_link_recovers_alpha_and_goodput_exactly():
    truth = cm.LinkModel(alpha_s=120e-6, goodput_bps=87e6)
    obs = []
    for kind in ("allreduce", "allgather"):
        for w in (2, 4, 8):
            for nbytes in (4e3, 1e5, 2.3e7):
                n = 2.0 if kind == "allgather" else 1.0
                obs.append((kind, nbytes, w, n, truth.collective_s(kind, nbytes, w, n)))
    got = cm.fit_link(obs)
    assert got.alpha_s == pytest.approx(truth.alpha_s, rel=1e-9)
    assert got.goodput_bps == pytest.approx(truth.goodput_bps, rel=1e-9)


def test_ring_formulas():
    lm = cm.LinkModel(alpha_s=0.0, goodput_bps=8e6)  # 1 MB/s
    # ring all-reduce: each rank moves 2 (W-1)/W of the buffer; all-gather (W-1) x its own part
    assert lm.allreduce_s(1e6, 2) == pytest.approx(1.0)
    assert lm.allreduce_s(1e6, 8) == pytest.approx(1.75)
    assert lm.allgather_s(1e6, 8) == pytest.approx(7.0)
    with pytest.raises(ValueError, match="kind"):
        lm.collective_s("broadcast", 1.0, 2)


def test_fit_link_refuses_one_size_and_bad_observations():
    lm = cm.LinkModel(1e-4, 1e8)
    one = [("allreduce", 1e6, 2, 1.0, lm.allreduce_s(1e6, 2))] * 3
    with pytest.raises(ValueError, match="at least two sizes"):
        cm.fit_link(one)
    with pytest.raises(ValueError, match="world_size >= 2"):
        cm.fit_link([("allreduce", 1e6, 1, 1.0, 0.1), ("allreduce", 2e6, 2, 1.0, 0.2)])
    with pytest.raises(ValueError, match="kind"):
        cm.fit_link([("scatter", 1e6, 2, 1.0, 0.1), ("scatter", 2e6, 2, 1.0, 0.2)])
    with pytest.raises(ValueError, match="not positive"):  # bigger messages faster: no model
        cm.fit_link([("allreduce", 1e6, 2, 1.0, 0.2), ("allreduce", 2e6, 2, 1.0, 0.1)])


def _synthetic_runs(eta=0.9, alpha=0.0, cores=2):
    compute = {"ddp": 0.035, "slimdp": 0.1, "topk": 0.14, "ist": 0.03}
    payload = {"ddp": 23.3e6, "slimdp": 0.24e6, "topk": 1.26e6, "ist": 0.76e6}
    colls = {"ddp": 2.0, "slimdp": 2.0, "topk": 4.0, "ist": 0.1}
    fitted = cm.Fitted(links={r: cm.LinkModel(alpha, eta * cm._rate_bps(r)) for r in ("100mbit", "1gbit")},
                       compute_s=compute, cores=cores)
    runs = []
    for m in compute:
        for rate in ("100mbit", "1gbit"):
            mlp = (784, (2048, 2048), 10) if m == "ist" else None
            two = cm.Run(m, 2, rate, 0.0, payload[m], None, colls[m], 1, 5_824_522, mlp=mlp)
            for w in (2, 4, 8):
                t = fitted.predict(two, w, rate)
                runs.append(cm.Run(m, w, rate, t, cm.payload_at(two, w), None, colls[m], 1, 5_824_522, mlp=mlp))
    return runs, fitted


def test_step_fit_on_two_ranks_predicts_more_ranks_exactly():
    runs, truth = _synthetic_runs()
    got = cm.fit(runs, cores=2)
    for m, c in truth.compute_s.items():
        assert got.compute_s[m] == pytest.approx(c, rel=1e-6, abs=1e-9)
    assert got.links["1gbit"].goodput_bps == pytest.approx(truth.links["1gbit"].goodput_bps, rel=1e-6)
    checks = cm.validate(got, runs)
    assert {(c["world_size"]) for c in checks} == {4, 8}
    assert max(abs(c["error"]) for c in checks) < 1e-6


def test_step_fit_ignores_more_rank_runs():
    """The fit reads 2-rank runs only: corrupting every 4- and 8-rank step time changes nothing."""
    runs, _ = _synthetic_runs()
    a = cm.fit(runs, cores=2)
    for r in runs:
        if r.world_size > 2:
            r.step_s *= 3.0
    b = cm.fit(runs, cores=2)
    assert a.compute_s == b.compute_s and a.links == b.links


def test_step_fit_refuses_a_method_at_one_rate():
    runs, _ = _synthetic_runs()
    runs = [r for r in runs if not (r.method == "topk" and r.rate == "1gbit")]
    with pytest.raises(ValueError, match="topk has 2-rank runs at 1 rate"):
        cm.fit(runs, cores=2)
    with pytest.raises(ValueError, match="no 2-rank runs"):
        cm.fit([r for r in runs if r.world_size > 2], cores=2)


def test_compute_slowdown_of_shared_cores():
    assert cm.compute_slowdown(2, 1, cores=2) == 1.0
    assert cm.compute_slowdown(8, 1, cores=2) == 4.0
    assert cm.compute_slowdown(8, 1, cores=16) == 1.0
    # data-parallel payloads do not change with the world size (IST's: test_ist_subnet_scales_...)
    assert cm.payload_at(cm.Run("slimdp", 2, "1gbit", 0.1, 1e6, None, 1, 1, 10), 8) == 1e6


def test_projection_table_is_labelled_and_complete():
    rows = cm.project(world_sizes=(16, 1024), rates=("100mbit", "100gbit"))
    assert len(rows) == 2 * 2 * 2
    slow = next(r for r in rows if r["model"] == "1B" and r["rate"] == "100mbit" and r["world_size"] == 16)
    fast = next(r for r in rows if r["model"] == "1B" and r["rate"] == "100gbit" and r["world_size"] == 16)
    # a slow link: compression wins by a lot; a fast one: the gap closes (compute-bound)
    assert slow["slimdp_vs_ddp"] > 10 and fast["slimdp_vs_ddp"] < slow["slimdp_vs_ddp"] / 5
    # per-rank top-k all-gathers grow with W, the shared index set's all-reduce does not
    t16 = next(r for r in rows if r["model"] == "1B" and r["rate"] == "100mbit" and r["world_size"] == 16)
    t1k = next(r for r in rows if r["model"] == "1B" and r["rate"] == "100mbit" and r["world_size"] == 1024)
    assert t1k["times"]["topk"] / t16["times"]["topk"] > 30
    assert t1k["times"]["slimdp"] / t16["times"]["slimdp"] < 1.2
    md = cm.markdown(cm.fit(_synthetic_runs()[0], 2), [], [], rows)
    assert "on paper, not measured" in md and "Assumptions" in md


def test_ist_subnet_scales_payload_and_compute():
    """An IST subnet keeps 1/W of every hidden layer: 784-2048-2048-10 has 1,863,680 parameters per
    rank at 2 ranks (what netbench measured: 0.745 MB of fp32 per step every 10 local steps) and
    1/W**2 of the hidden-to-hidden layer, so the factor from 2 to 8 ranks is below 1/4."""
    assert cm.ist_subnet_params(784, [2048, 2048], 10, 2) == 784 * 1024 + 1024 + 1024 * 1024 + 1024 + 1024 * 10
    assert cm.ist_subnet_params(784, [2048], 10, 1) == 784 * 2048 + 2048 + 2048 * 10
    r = cm.Run("ist", 2, "1gbit", 0.1, 1e6, None, 0.1, 1, 5_824_522, mlp=(784, (2048, 2048), 10))
    f8 = cm.ist_subnet_params(784, [2048, 2048], 10, 8) / cm.ist_subnet_params(784, [2048, 2048], 10, 2)
    assert cm.subnet_scale(r, 8) == pytest.approx(f8) and f8 < 0.25
    assert cm.payload_at(r, 8) == pytest.approx(1e6 * f8)
    fitted = cm.Fitted(links={"1gbit": cm.LinkModel(0.0, 1e9)}, compute_s={"ist": 0.04}, cores=2)
    comm = cm.LinkModel(0.0, 1e9).allgather_s(1e6 * f8, 8, 0.1)
    assert fitted.predict(r, 8, "1gbit") == pytest.approx(0.04 * f8 * 4.0 + comm)
    assert cm.subnet_scale(cm.Run("slimdp", 2, "1gbit", 0.1, 1e6, None, 1, 1, 10), 8) == 1.0
    with pytest.raises(ValueError, match="MLP shape"):
        cm.subnet_scale(cm.Run("ist", 2, "1gbit", 0.1, 1e6, None, 0.1, 1, 10), 8)
    # the classes follow from the parameter count
    run = {"method": "ist", "dataset": {"features": 784}, "config": {"hidden": [2048, 2048]},
           "model": {"num_params": 5_824_522}}
    assert cm._mlp_shape(run) == (784, (2048, 2048), 10)
    with pytest.raises(ValueError, match="not an MLP"):
        cm._mlp_shape(dict(run, model={"num_params": 5_824_523}))


def test_step_fit_with_measured_links_recovers_compute_and_refuses_missing_rates():
    runs, truth = _synthetic_runs(alpha=2e-3)
    got = cm.fit(runs, cores=2, links=truth.links)
    for m, c in truth.compute_s.items():
        assert got.compute_s[m] == pytest.approx(c, rel=1e-9, abs=1e-12)
    assert "collbench" in got.link_source
    assert max(abs(c["error"]) for c in cm.validate(got, runs)) < 1e-9
    with pytest.raises(ValueError, match="no measured link model"):
        cm.fit(runs, cores=2, links={"1gbit": truth.links["1gbit"]})
