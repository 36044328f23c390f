"""bench/netbench.py's tables and argument checks (no namespaces needed)."""

import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "bench"))

import netbench  # noqa: E402


def _run(ttt, acc, steps=100, train_time=50.0, mb=10.0, stopped=False):
    return {
        "config": {"target_acc": 0.85, "epochs": 2},
        "completed_epochs": 1 if stopped else 2,
        "stopped_at_target": stopped,
        "time_to_target": None if ttt is None else {"train_time_s": ttt, "epoch": ttt / 100},
        "steps": steps,
        "final": {"test_acc": acc, "bytes_sent_per_rank": mb * 1e6 * steps, "train_time_s": train_time},
        "evals": [{"train_time_s": 1.0, "test_acc": 0.5}],
        "method_flags": [],
    }


def _row(md, method):
    return [c.strip() for c in next(ln for ln in md.splitlines() if ln.startswith(f"| {method} ")).split("|")[1:-1]]


def test_markdown_reports_medians_over_seeds():
    results = {"1gbit": {
        "ddp": [_run(90.0, 0.85), _run(60.0, 0.86), _run(66.0, 0.84)],
        "slimdp": [_run(30.0, 0.87, train_time=20.0), _run(10.0, 0.88, train_time=30.0),
                   _run(22.0, 0.86, train_time=40.0)],
        "topk": [_run(None, 0.80), _run(5.0, 0.9), _run(6.0, 0.9)],
    }}
    md = netbench.markdown(results, {"1gbit": 950.0}, "header")
    assert "median time to 0.85 (s)" in md and "per seed (s)" in md
    ddp, slim, topk = _row(md, "ddp"), _row(md, "slimdp"), _row(md, "topk")
    assert ddp[1] == "66.0" and ddp[2] == "90.0, 60.0, 66.0"
    assert slim[1] == "22.0" and slim[4] == "3.00x"  # 66 / 22
    assert slim[5] == "0.8700"  # median final accuracy
    assert slim[7] == "-" and slim[8] == "-"  # no interface counters in these runs: no wire figures
    assert slim[9] == "300"  # median ms/step: 30 s / 100 steps
    assert topk[1] == "not reached" and topk[2] == "never, 5.0, 6.0" and topk[4] == "-"


def test_markdown_single_seed_has_no_seed_column():
    md = netbench.markdown({"100mbit": {"ddp": [_run(400.0, 0.85, stopped=True)]}}, {"100mbit": 96.0}, "h")
    assert "per seed" not in md and "time to 0.85 (s)" in md
    assert _row(md, "ddp")[1] == "400.0" and _row(md, "ddp")[4] == "(stopped at target)"


@pytest.mark.parametrize("argv,msg", [
    (["--seeds", "1,x"], "--seeds"),
    (["--seeds", "1,1"], "distinct"),
    (["--seeds", "1,2", "--", "--seed", "3"], "--seed is set by netbench"),
    (["--seeds", "1,,2"], "without empty entries"),
    (["--seeds", "-1"], "[0, 2**63)"),
    (["--seeds", str(2**63)], "[0, 2**63)"),
    (["--", "--world-size=3"], "--world-size is set by netbench"),
    (["--", "--out=/tmp/x.json"], "--out is set by netbench"),
    (["--", "--wor", "3"], "--world-size is set by netbench"),
])
def test_bad_seeds_are_refused(argv, msg, capsys, monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    with pytest.raises(SystemExit) as e:
        netbench.main(argv)
    assert e.value.code == 2
    assert msg in capsys.readouterr().err


def _committed(name, rates, methods, seeds):
    import json

    d = os.path.join(REPO, "bench", "results", name)
    return {rate: {m: [json.load(open(os.path.join(d, f"{rate}_{m}{'' if s is None else f'_s{s}'}.json")))
                       for s in seeds] for m in methods} for rate in rates}


def test_plot_uses_the_shared_median_band_figure(tmp_path, monkeypatch):
    """netbench.plot draws through slimcomm.train.report: one panel per rate, one median line + band per method."""
    from slimcomm.train import report

    results = _committed("netbench_2ranks", ["1gbit", "100mbit"], ["ddp", "slimdp", "ist"], [0, 1, 2])
    figs = []
    real = report.build_figure
    monkeypatch.setattr(report, "build_figure", lambda *a, **k: figs.append(real(*a, **k)) or figs[-1])
    png = tmp_path / "nb.png"
    netbench.plot(results, str(png))
    assert png.read_bytes()[:4] == b"\x89PNG"
    fig = figs[0]
    assert [ax.get_title() for ax in fig.axes] == ["vs training time, 1gbit per link",
                                                   "vs training time, 100mbit per link"]
    for ax in fig.axes:
        labels = [t.get_text() for t in ax.get_legend().get_texts()]
        assert labels == ["ddp (3 seeds)", "slimdp (3 seeds)", "ist (3 seeds)", "target test acc 0.85"]
        assert len(ax.collections) == 3 and ax.get_xscale() == "log"
    assert "fashion-mnist" in fig._suptitle.get_text() and "2 ranks" in fig._suptitle.get_text()


def test_plot_lm_labels_ddp_final_loss(tmp_path, monkeypatch):
    from slimcomm.train import report

    results = _committed("netbench_gpt_2ranks", ["10gbit"], ["ddp", "slimdp-local"], [0])
    figs = []
    real = report.build_figure
    monkeypatch.setattr(report, "build_figure", lambda *a, **k: figs.append(real(*a, **k)) or figs[-1])
    netbench.plot_lm(results, str(tmp_path / "lm.png"))
    ax_time, ax_bytes = figs[0].axes
    target = results["10gbit"]["ddp"][0]["final"]["val_loss"]
    assert [t.get_text() for t in ax_bytes.get_legend().get_texts()] == [
        "ddp", "slimdp-local", f"ddp's final val loss {target:.3f}"]
    assert "10gbit per link" in figs[0]._suptitle.get_text()


def _run_step(ttt, step, train_time=50.0, steps=500, acc=0.86):
    r = _run(ttt, acc, steps=steps, train_time=train_time)
    if r["time_to_target"] is not None:
        r["time_to_target"]["step"] = step
    return r


def test_compute_limit_from_a_local_run():
    """ddp's median 100 steps to the target x local's 100 ms/step (50 s / 500 steps) = 10 s; a method
    at 20 s is 2.00x the limit; without local there is no limit line or column."""
    res = {"1gbit": {"ddp": [_run_step(40.0, 100), _run_step(45.0, 120), _run_step(38.0, 80)],
                     "slimdp": [_run_step(20.0, 150)] * 3,
                     "local": [_run_step(None, None, train_time=50.0, acc=0.80)] * 3}}
    md = netbench.markdown(res, {"1gbit": 950.0}, "# h")
    assert "Compute limit: ddp's 100 steps to the target x local's measured 100 ms/step" in md
    assert "= 10.0 s" in md
    head = [c.strip() for c in next(ln for ln in md.splitlines() if ln.startswith("| method")).split("|")[1:-1]]
    col = head.index("x of the compute limit")
    assert _row(md, "slimdp")[col] == "2.00" and _row(md, "ddp")[col] == "4.00"
    assert _row(md, "local")[col] == "-"
    no_local = {"1gbit": {k: v for k, v in res["1gbit"].items() if k != "local"}}
    md2 = netbench.markdown(no_local, {"1gbit": 950.0}, "# h")
    assert "Compute limit" not in md2 and "x of the compute limit" not in md2


def test_compute_limit_lm():
    def lm(losses, steps=100, train_time=20.0):
        return {"config": {"seed": 0}, "steps": steps, "dense_bytes_per_step": 1000,
                "evals": [{"step": 25 * (i + 1), "train_time_s": train_time * (i + 1) / len(losses), "val_loss": v}
                          for i, v in enumerate(losses)],
                "final": {"val_loss": losses[-1], "train_time_s": train_time, "bytes_sent_per_rank": 1000 * steps},
                "metric": {"name": "val_loss"}, "method_flags": []}
    res = {"1gbit": {"ddp": [lm([3.0, 2.5, 2.2, 2.0], train_time=80.0)], "local": [lm([3.1, 2.9, 2.8, 2.7])]}}
    md = netbench.markdown_lm(res, {"1gbit": 950.0}, "# h")
    # ddp reaches its own final loss at step 100; local 20 s / 100 steps = 200 ms/step: 20 s; ddp 80 s = 4.00x
    assert "ddp's 100 steps to the target x local's measured 200 ms/step" in md and "= 20.0 s" in md
    head = [c.strip() for c in next(ln for ln in md.splitlines() if ln.startswith("| method")).split("|")[1:-1]]
    assert _row(md, "ddp")[head.index("x of the compute limit")] == "4.00"


def test_slow_link_bytes_per_node_lm():
    """With --nodes R of S > 1 ranks the GPT table gains the node's uplink MB per step (mean over nodes of
    the TX counters / steps) and its share of ddp's; one-rank nodes or runs without the entry: no column."""
    def lm(tx, steps=100):
        r = {"config": {"seed": 0}, "steps": steps, "dense_bytes_per_step": 1000,
             "evals": [{"step": steps, "train_time_s": 10.0, "val_loss": 2.0}],
             "final": {"val_loss": 2.0, "train_time_s": 10.0, "bytes_sent_per_rank": 1000 * steps},
             "metric": {"name": "val_loss"}, "method_flags": []}
        if tx is not None:
            r["nodes"] = {"nodes": 2, "ranks_per_node": 2, "uplink_tx_bytes": tx, "uplink_rx_bytes": tx[::-1]}
        return r
    res = {"1gbit": {"ddp": [lm([4e8, 6e8])], "slimdp-local": [lm([1e7, 1e7])]}}
    md = netbench.markdown_lm(res, {"1gbit": 950.0}, "# h")
    head = [c.strip() for c in next(ln for ln in md.splitlines() if ln.startswith("| method")).split("|")[1:-1]]
    up, share = head.index("slow-link MB/node/step"), head.index("% of ddp's slow-link bytes")
    assert share == up + 1 and head[up - 1] == "% of ddp bytes"
    assert _row(md, "ddp")[up] == "5.000" and _row(md, "ddp")[share] == "100.00%"
    assert _row(md, "slimdp-local")[up] == "0.100" and _row(md, "slimdp-local")[share] == "2.00%"
    res["1gbit"]["slimdp-local"][0]["nodes"]["ranks_per_node"] = 1
    assert "slow-link" not in netbench.markdown_lm(res, {"1gbit": 950.0}, "# h")
    del res["1gbit"]["ddp"][0]["nodes"]
    assert "slow-link" not in netbench.markdown_lm(res, {"1gbit": 950.0}, "# h")
