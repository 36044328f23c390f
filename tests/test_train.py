"""End-to-end tests of the training command (python -m slimcomm.train) at 2 ranks on gloo."""

import argparse
import json
import math
import os
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from slimcomm import train as T
from slimcomm.train import loop as train_loop  # monkeypatched where main() and run() look names up

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The DDP-hook and IST methods; the local-step methods (SlimDPOptimizer) need more steps than a
# tiny run has before their outer model moves, and are tested with a short sync period below.
# local (no communication, the compute limit) has its own tests below.
METHODS = [m for m in T.METHODS if m not in T.SYNC_DEFAULTS and m != "local"]
SYNC_METHODS = list(T.SYNC_DEFAULTS)
TINY = ["--dataset", "digits", "--hidden", "48,48", "--epochs", "1", "--batch-size", "16",
        "--no-progress", "--threads", "1", "--timeout", "60"]


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def _cmd(*args):
    return [sys.executable, "-m", "slimcomm.train", *args]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def compare_run(tmp_path_factory):
    """Every method, one after another, 2 ranks, 1 epoch on the digits set."""
    out = tmp_path_factory.mktemp("compare")
    png = out / "acc.png"
    r = subprocess.run(
        _cmd("--compare", ",".join(METHODS), "--world-size", "2", "--eval-every", "20",
             "--out-dir", str(out), "--plot", str(png), *TINY),
        env=_env(), capture_output=True, text=True, timeout=400, cwd=REPO)
    return r, out, png


def test_compare_exits_zero_and_prints_table(compare_run):
    r, out, png = compare_run
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = r.stdout.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("| method"))
    rows = []
    for ln in lines[start:]:  # the comparison table: up to its last row
        if not ln.startswith("|"):
            break
        if ln.startswith("| "):
            rows.append(ln)
    assert rows[0].split("|")[1].strip() == "method"
    assert [ln.split("|")[1].strip() for ln in rows[1:]] == METHODS
    # the per-link table: every method measured on loopback, projected on 1 Gbit/s and 100 Mbit/s
    link_rows = [[c.strip() for c in ln.split("|")[1:-1]] for ln in lines
                 if ln.startswith("| ") and not ln.startswith("| link") and ln.split("|")[1].strip()
                 in ("loopback", "1 Gbit/s", "100 Mbit/s")]
    assert [(c[0], c[1]) for c in link_rows] == [(link, m) for link in ("loopback", "1 Gbit/s", "100 Mbit/s")
                                                 for m in METHODS]
    assert {c[-1] for c in link_rows[:len(METHODS)]} == {"measured (this machine)"}
    assert {c[-1] for c in link_rows[len(METHODS):]} == {"projected"}
    assert any(ln.startswith("projected = this run's compute time") for ln in lines)
    assert any(ln.startswith("train time, time vs ddp and time to target: measured on this machine") for ln in lines)
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert any(ln.startswith("digits, MLP 48-48 (5,962 params), 2 ranks, 1 epoch(s)") for ln in lines)
    assert f"INFO slimcomm.train: results go to {out}" in r.stderr  # logged at the default level INFO


@pytest.mark.parametrize("method", METHODS)
def test_method_result_json(compare_run, method):
    r, out, _ = compare_run
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((out / f"{method}.json").read_text())
    assert res["format"] == T.RESULT_FORMAT and res["method"] == method
    assert res["config_key"] == R.compute_config_key(res["config"], res["dataset"]["name"])
    assert res["world_size"] == 2 and res["backend"] == "gloo"
    assert res["completed_epochs"] == 1 and len(res["epochs"]) == 1
    steps = res["steps_per_epoch"]
    assert res["steps"] == steps == res["dataset"]["train_samples_per_rank"] // 16
    # evaluations every 20 steps plus the end of the epoch, in order
    assert [e["step"] for e in res["evals"]] == list(range(20, steps, 20)) + [steps]
    times = [e["train_time_s"] for e in res["evals"]]
    assert times == sorted(times) and times[0] > 0
    acc = res["final"]["test_acc"]
    assert 0.3 < acc <= 1.0, f"{method}: accuracy {acc} not above chance (0.1)"
    assert res["final"]["test_acc"] == res["evals"][-1]["test_acc"]
    nparams = res["model"]["num_params"]
    assert nparams == (64 * 48 + 48) + (48 * 48 + 48) + (48 * 10 + 10)
    dense = 4 * nparams * res["steps"]
    assert res["final"]["dense_bytes_per_rank"] == dense
    sent = res["final"]["bytes_sent_per_rank"]
    if method == "ddp":
        assert sent == dense
    elif method == "fp16":
        assert sent == dense // 2
    else:
        assert 0 < sent < dense, f"{method}: sent {sent} bytes, dense {dense}"
    if method in ("topk", "slimdp"):
        assert res["stats"]["total"]["bytes_sent"] == sent
    if method == "ist":
        assert res["stats"]["rounds"] >= steps // 10
    # the loopback the ranks used was timed after training; the projected times keep its compute and bytes
    lt = res["link_times"]
    assert lt["measured_link"]["kind"] == ("allgather" if method in ("topk", "ist") else "allreduce")
    assert lt["measured_link"]["goodput_bps"] > 0 and len(lt["measured_link"]["timings"]) == 3
    slow, fast = lt["links"]["100mbit"], lt["links"]["1gbit"]
    assert [e["step"] for e in slow["evals"]] == [e["step"] for e in res["evals"]]
    assert slow["train_time_s"] > 0 and fast["train_time_s"] > 0
    if method == "ddp":  # 24 KB per step: bytes, not the per-hop latency, dominate: the slower link takes longer
        assert slow["train_time_s"] > fast["train_time_s"]
    # (smaller payloads: the fitted 1 Gbit/s latency, 0.7 ms per hop, exceeds the 100 Mbit/s one, fitted 0;
    # on a few KB per step the 1 Gbit/s projection can then be the slower one, see slimcomm.train.projection)


def test_same_seed_same_result(compare_run, tmp_path):
    """A rerun of one method with the same seed gives the same accuracy trajectory, whatever
    the priority of gloo's loop threads (the first run had the default, idle)."""
    r, out, _ = compare_run
    first = json.loads((out / "slimdp.json").read_text())
    assert first["config"]["comm_thread_priority"] == "idle"
    p = tmp_path / "again.json"
    r2 = subprocess.run(_cmd("--method", "slimdp", "--eval-every", "20", "--out", str(p), "--quiet",
                             "--comm-thread-priority", "normal", *TINY),
                        env=_env(), capture_output=True, text=True, timeout=200, cwd=REPO)
    assert r2.returncode == 0, r2.stderr[-3000:]
    assert "INFO" not in r2.stderr  # --quiet: warnings and errors only
    assert "digits, MLP 48-48" in r2.stdout and "vs ddp" not in r2.stdout  # setting line, no empty ratios
    again = json.loads(p.read_text())
    assert [e["test_acc"] for e in again["evals"]] == [e["test_acc"] for e in first["evals"]]
    assert again["final"]["bytes_sent_per_rank"] == first["final"]["bytes_sent_per_rank"]


def test_plot_from_json(compare_run, tmp_path):
    r, out, _ = compare_run
    png = tmp_path / "again.png"
    r2 = subprocess.run(_cmd("--plot", str(png), "--plot-from", str(out / "ddp.json"), str(out / "ist.json")),
                        env=_env(), capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r2.returncode == 0, r2.stderr
    assert png.read_bytes()[:4] == b"\x89PNG" and "| ist" in r2.stdout
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    r3 = subprocess.run(_cmd("--plot", str(png), "--plot-from", str(bad)),
                        env=_env(), capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r3.returncode != 0 and "bad.json" in r3.stderr


def test_external_ranks_fashion_idx(tmp_path):
    """One process per rank (as netbench / torchrun launch it), Fashion-MNIST IDX files from --data-dir."""
    from test_data import write_fashion

    write_fashion(str(tmp_path / "fm"), n_train=200, n_test=40)
    port = _free_port()
    out = tmp_path / "ext.json"
    common = ["--method", "ddp", "--data-dir", str(tmp_path / "fm"),
              "--hidden", "32", "--epochs", "2", "--batch-size", "20", "--no-progress", "--threads", "1",
              "--timeout", "60", "--out", str(out)]
    env0 = _env()
    env1 = dict(_env(), RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # torchrun-style
    p0 = subprocess.Popen(_cmd("--rank", "0", "--world-size", "2", "--master-addr", "127.0.0.1",
                               "--master-port", str(port), *common),
                          env=env0, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    p1 = subprocess.Popen(_cmd(*common), env=env1,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        o0, e0 = p0.communicate(timeout=150)
        o1, e1 = p1.communicate(timeout=30)
    finally:
        for p in (p0, p1):
            if p.poll() is None:
                p.kill()
    assert p0.returncode == 0, e0[-3000:]
    assert p1.returncode == 0, e1[-3000:]
    res = json.loads(out.read_text())
    assert res["dataset"]["name"] == "fashion-mnist" and res["dataset"]["train_samples_per_rank"] == 100
    assert res["model"]["num_params"] == 784 * 32 + 32 + 32 * 10 + 10
    assert res["steps"] == 10 and res["final"]["test_acc"] > 0.3


def test_mismatched_ranks_fail_fast(tmp_path):
    """Ranks started with different flags raise on every rank instead of hanging in a collective."""
    port = _free_port()
    base = ["--world-size", "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
            "--out", str(tmp_path / "x.json"), *TINY]
    p0 = subprocess.Popen(_cmd("--rank", "0", "--method", "ddp", *base), env=_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    p1 = subprocess.Popen(_cmd("--rank", "1", "--method", "fp16", *base), env=_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        _, e0 = p0.communicate(timeout=120)
        _, e1 = p1.communicate(timeout=30)
    finally:
        for p in (p0, p1):
            if p.poll() is None:
                p.kill()
    for code, err in ((p0.returncode, e0), (p1.returncode, e1)):
        assert code != 0
        assert "different configurations" in err, err[-2000:]


def test_setup_error_on_every_rank(tmp_path):
    """A data error (batch larger than the shard) fails the spawned job with the flag named."""
    r = subprocess.run(_cmd("--method", "ddp", "--train-subset", "20", "--out", str(tmp_path / "y.json"),
                            *[a if a != "16" else "64" for a in TINY]),
                       env=_env(), capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode != 0 and "--batch-size 64" in r.stderr


@pytest.mark.parametrize("argv,needle", [
    (["--hidden", "a,b"], "--hidden"),
    (["--core-ratio", "0"], "--core-ratio"),
    (["--compare", "ddp,bogus"], "bogus"),
    (["--epochs", "0"], "--epochs"),
    (["--rank", "0", "--world-size", "2"], "--master-addr"),
    (["--rank", "2", "--world-size", "2", "--master-addr", "x", "--master-port", "1"], "--rank 2"),
    (["--powersgd-start-iter", "1"], "--powersgd-start-iter"),
    (["--warmup-steps", "0"], "--warmup-steps"),
    (["--target-acc", "5"], "--target-acc"),
    (["--seed", "99999999999999999999999"], "--seed"),
])
def test_bad_arguments(argv, needle, monkeypatch, capsys):
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(SystemExit) as ei:
        T.main(argv + ["--dataset", "digits"])
    assert ei.value.code != 0
    err = capsys.readouterr().err + str(ei.value.code)
    assert needle in err


def test_compare_table_ratios():
    def res(m, acc, t, b):
        return {"method": m, "final": {"test_acc": acc, "train_time_s": t, "bytes_sent_per_rank": b},
                "time_to_target": {"target": 0.85, "train_time_s": t / 2} if acc >= 0.85 else None}
    s = T.compare_table([res("ddp", 0.87, 10.0, 4e6), res("slimdp", 0.86, 2.0, 1e5), res("ist", 0.80, 1.0, 2e5)])
    rows = {ln.split("|")[1].strip(): [c.strip() for c in ln.split("|")[2:-1]] for ln in s.splitlines()[2:]}
    assert rows["slimdp"] == ["0.8600", "2.0", "0.10", "0.025x", "0.2x", "1.0"]
    assert rows["ist"][-1] == "not reached"
    assert rows["ddp"][3:5] == ["1x", "1x"]


def test_build_model_default_size():
    m = T.build_model(784, (2048, 2048), 10)
    assert sum(p.numel() for p in m.parameters()) == 5_824_522


def test_failed_run_keeps_previous_result(tmp_path, monkeypatch):
    """A run whose ranks exit without writing the JSON raises and leaves the old file intact."""
    out = tmp_path / "ddp.json"
    out.write_text('{"previous": true}')
    monkeypatch.setattr(train_loop, "_spawn_entry", _exit_without_writing)
    args = T.build_parser().parse_args(["--method", "ddp", "--world-size", "1", "--dataset", "digits",
                                        "--out", str(out)])
    T._resolve_launch(args)
    with pytest.raises(RuntimeError, match="without writing"):
        T.run(args)
    assert out.read_text() == '{"previous": true}'


def _exit_without_writing(rank, args, init_method):
    return None


@pytest.mark.parametrize("method,lr,momentum", [
    ("ddp", 0.05, 0.9), ("powersgd", 0.05, 0.9), ("ist", 0.03, 0.9), ("topk", 0.4, 0.0), ("slimdp", 0.6, 0.0),
    ("local", 0.05, 0.9),  # ddp's SGD settings: its ms/step is ddp's compute limit
])
def test_method_defaults(method, lr, momentum):
    args = T.apply_method_defaults(T.build_parser().parse_args(["--method", method]))
    assert (args.lr, args.momentum) == (lr, momentum)
    # the benchmark configuration is the default one: short warm-ups, bf16 wire, core refresh 10
    assert (args.warmup_steps, args.powersgd_start_iter, args.value_dtype, args.core_refresh) == (1, 2, "bf16", 10)
    explicit = T.apply_method_defaults(T.build_parser().parse_args(["--method", method, "--lr", "0.3",
                                                                    "--momentum", "0.5"]))
    assert (explicit.lr, explicit.momentum) == (0.3, 0.5)


# ---------------------------------------------------------------------------
# --model gpt / cnn, optimizers, schedules, refusals
# ---------------------------------------------------------------------------

LM_METHODS = [m for m in METHODS if m != "ist"]  # GPT IST: tests/test_ist_gpt.py::test_training_command_ist_gpt
GPT_TINY = ["--model", "gpt", "--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--block-size", "16",
            "--batch-size", "4", "--steps", "8", "--eval-every", "4", "--val-batches", "2",
            "--no-progress", "--threads", "1", "--timeout", "60"]
CNN_TINY = ["--model", "cnn", "--dataset", "digits", "--steps", "30", "--batch-size", "16", "--eval-every", "15",
            "--no-progress", "--threads", "1", "--timeout", "60"]


@pytest.fixture(scope="module")
def small_text(tmp_path_factory):
    p = tmp_path_factory.mktemp("text") / "story.txt"
    p.write_text("The quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs.\n" * 60)
    return str(p)


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory, small_text):
    out = tmp_path_factory.mktemp("gpt")
    r = subprocess.run(_cmd("--compare", ",".join(LM_METHODS), "--world-size", "2", "--text-file", small_text,
                            "--out-dir", str(out), "--plot", str(out / "loss.png"), *GPT_TINY),
                       env=_env(), capture_output=True, text=True, timeout=600, cwd=REPO)
    return r, out


@pytest.fixture(scope="module")
def cnn_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("cnn")
    r = subprocess.run(_cmd("--compare", ",".join(LM_METHODS), "--world-size", "2", "--out-dir", str(out),
                            *CNN_TINY),
                       env=_env(), capture_output=True, text=True, timeout=600, cwd=REPO)
    return r, out


def test_gpt_compare_every_method(gpt_run, small_text):
    r, out = gpt_run
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [ln for ln in r.stdout.splitlines() if ln.startswith("| ")]
    rows = rows[:next((i for i, ln in enumerate(rows) if ln.startswith("| link")), len(rows))]  # first table
    assert rows[0].split("|")[2].strip() == "val loss"
    assert [ln.split("|")[1].strip() for ln in rows[1:]] == LM_METHODS
    assert (out / "loss.png").read_bytes()[:4] == b"\x89PNG"
    text = open(small_text).read()
    vocab = "".join(sorted(set(text)))
    d, v, t = 16, len(vocab), 16
    nparams = v * d + t * d + (12 * d * d + 13 * d) + 2 * d + d * v
    for method in LM_METHODS:
        res = json.loads((out / f"{method}.json").read_text())
        assert res["method"] == method and res["metric"] == {"name": "val_loss", "goal": "min", "unit": "nats/token"}
        assert res["model"] == {"name": "gpt", "n_layer": 1, "n_embd": 16, "n_head": 2, "block_size": 16,
                                "vocab_size": v, "dropout": 0.0, "num_params": nparams}
        assert res["dataset"]["vocab"] == vocab and res["dataset"]["tokens"] == "char"
        assert res["dataset"]["train_tokens"] + res["dataset"]["val_tokens"] == len(text)
        assert res["steps"] == res["planned_steps"] == 8 and res["steps_per_epoch"] is None and res["epochs"] == []
        assert [e["step"] for e in res["evals"]] == [4, 8]
        assert all(math.isfinite(e["val_loss"]) for e in res["evals"])
        assert res["final"]["val_loss"] == res["evals"][-1]["val_loss"] < math.log(v)
        # the defaults of the gpt workload: AdamW, warm-up (capped at --steps) + cosine, clip 1.0
        c = res["config"]
        assert (c["optimizer"], c["lr"], c["beta1"], c["beta2"], c["weight_decay"], c["grad_clip"]) == \
            ("adamw", 1e-3, 0.9, 0.99, 0.1, 1.0)
        assert (c["lr_schedule"], c["warmup_lr_steps"], c["min_lr"], c["momentum"]) == ("cosine", 8, 1e-4, None)
        dense = 4 * nparams * 8
        sent = res["final"]["bytes_sent_per_rank"]
        assert res["final"]["dense_bytes_per_rank"] == dense
        if method == "ddp":
            assert sent == dense
        elif method == "fp16":
            assert sent == dense // 2
        else:
            assert 0 < sent < dense, method
    ddp = json.loads((out / "ddp.json").read_text())
    fp16 = json.loads((out / "fp16.json").read_text())
    assert abs(ddp["final"]["val_loss"] - fp16["final"]["val_loss"]) < 0.05


def test_cnn_compare_every_method(cnn_run):
    r, out = cnn_run
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for method in LM_METHODS:
        res = json.loads((out / f"{method}.json").read_text())
        assert res["model"]["name"] == "cnn" and res["model"]["image_size"] == 8
        assert res["metric"]["name"] == "test_acc" and res["steps"] == 30
        steps_per_epoch = res["steps_per_epoch"]
        assert steps_per_epoch > 30 and res["completed_epochs"] == 1  # --steps stops inside the first epoch
        assert res["epochs"][0]["epoch"] == round(30 / steps_per_epoch, 4)
        assert [e["step"] for e in res["evals"]] == [15, 30]
        assert res["final"]["test_acc"] > 0.2, f"{method}: accuracy {res['final']['test_acc']} near chance"
        assert res["config"]["optimizer"] == "sgd" and res["config"]["lr_schedule"] == "constant"


def test_steps_overrides_epochs_for_mlp(tmp_path):
    """--steps with the MLP runs exactly that many steps across epoch boundaries (digits: 46 steps/epoch)."""
    p = tmp_path / "ddp.json"
    i = TINY.index("--epochs")
    args = TINY[:i] + TINY[i + 2:]
    r = subprocess.run(_cmd("--method", "ddp", "--steps", "50", "--out", str(p), *args),
                       env=_env(), capture_output=True, text=True, timeout=200, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(p.read_text())
    per = res["steps_per_epoch"]
    assert res["steps"] == 50 and per < 50 and res["completed_epochs"] == 2
    assert res["epochs"][0]["epoch"] == 1 and res["epochs"][1]["epoch"] == round(1 + (50 - per) / per, 4)


def _no_env(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)


@pytest.mark.parametrize("argv,needle", [
    (["--weight-decay", "nan"], "--weight-decay"),
    (["--weight-decay", "-1"], "--weight-decay"),
    (["--grad-clip", "inf"], "--grad-clip"),
    (["--dropout", "1"], "--dropout"),
    (["--beta2", "1.5", "--optimizer", "adamw"], "--beta2"),
    (["--momentum", "nan"], "--momentum"),
    (["--target-loss", "0"], "--target-loss"),
    (["--model", "gpt", "--method", "ist", "--ist-shared", "0.2"], "--ist-shared"),
    (["--model", "gpt", "--method", "ist", "--ist-subnets", "2"], "--ist-subnets applies to"),
    (["--model", "gpt", "--method", "ist", "--ist-exchange-bits", "none"], "--ist-exchange-bits applies"),
    (["--method", "ist", "--world-size", "2", "--ist-subnets", "3"], "--ist-subnets 3 exceeds the world size 2"),
    (["--method", "ist", "--ist-subnets", "0"], "--ist-subnets"),
    (["--method", "ist", "--ist-exchange-bits", "3"], "--ist-exchange-bits must be 1, 2, 4, 8 or none"),
    (["--model", "gpt", "--method", "ist", "--world-size", "4"], "--n-head 3 is smaller than --world-size 4"),
    (["--model", "cnn", "--method", "ist"], "--method ist needs --model mlp or gpt"),
    (["--model", "cnn", "--compare", "ddp,ist"], "--method ist needs --model mlp or gpt"),
    (["--model", "gpt", "--n-embd", "30", "--n-head", "4"], "--n-embd 30"),
    (["--model", "gpt", "--hidden", "8"], "--hidden"),
    (["--model", "gpt", "--epochs", "2"], "--epochs"),
    (["--model", "gpt", "--target-acc", "0.5"], "--target-acc"),
    (["--model", "gpt", "--momentum", "0.9"], "--momentum"),
    (["--model", "gpt", "--steps", "10", "--warmup-lr-steps", "11"], "--warmup-lr-steps 11"),
    (["--model", "gpt", "--min-lr", "0.1"], "--min-lr"),
    (["--model", "gpt", "--lr-schedule", "constant", "--min-lr", "1e-5"], "--min-lr"),
    (["--model", "cnn", "--hidden", "8"], "--hidden"),
    (["--model", "mlp", "--text-file", "x.txt"], "--text-file"),
    (["--model", "cnn", "--n-layer", "2"], "--n-layer"),
    (["--model", "mlp", "--target-loss", "1.5"], "--target-loss"),
    (["--beta1", "0.9"], "--beta1"),
    (["--steps", "10", "--epochs", "1"], "--steps"),
    (["--method", "ist", "--grad-clip", "1"], "--grad-clip"),
    (["--method", "local", "--sync-every", "3"], "--sync-every applies to --method diloco"),
    (["--method", "local", "--outer-lr", "0.7"], "--outer-lr"),
    (["--method", "local", "--core-ratio", "0.1"], "--core-ratio does not apply to --method local"),
    (["--compare", "ddp,local", "--explore-ratio", "0.1"], "--explore-ratio does not apply to --method local"),
])
def test_bad_option_combinations(argv, needle, monkeypatch, capsys):
    _no_env(monkeypatch)
    with pytest.raises(SystemExit) as ei:
        T.main(argv)
    assert ei.value.code != 0
    err = capsys.readouterr().err + str(ei.value.code)
    assert needle in err, err


def test_out_directory_refused_before_training(tmp_path, monkeypatch, capsys):
    _no_env(monkeypatch)
    monkeypatch.setattr(train_loop, "run", lambda args: pytest.fail("training started"))
    with pytest.raises(SystemExit) as ei:
        T.main(["--method", "ddp", "--dataset", "digits", "--out", str(tmp_path)])
    assert "is a directory" in str(ei.value.code) and str(tmp_path) in str(ei.value.code)
    assert list(tmp_path.iterdir()) == []


def test_results_json_written_through_unique_temp_files(tmp_path, monkeypatch):
    """Two writers of the same --out use different temporary files in its folder; none is left behind."""
    out = tmp_path / "sub" / "r.json"
    renames = []
    real_replace = os.replace
    monkeypatch.setattr(train_loop.os, "replace", lambda a, b: (renames.append((a, b)), real_replace(a, b)))
    T._write_json_atomic({"run": 1}, str(out))
    T._write_json_atomic({"run": 2}, str(out))
    (a, _), (b, _) = renames
    assert a != b and os.path.dirname(a) == os.path.dirname(b) == str(out.parent)
    assert a != str(out) + ".tmp"
    assert json.loads(out.read_text()) == {"run": 2}
    assert [p.name for p in out.parent.iterdir()] == ["r.json"]


def test_gpt_and_mlp_defaults():
    g = T.apply_method_defaults(T.build_parser().parse_args(["--model", "gpt", "--method", "slimdp"]))
    assert (g.optimizer, g.lr, g.beta1, g.beta2, g.weight_decay, g.grad_clip) == ("adamw", 1e-3, 0.9, 0.99, 0.1, 1.0)
    assert (g.lr_schedule, g.warmup_lr_steps, g.min_lr, g.steps, g.tokens) == ("cosine", 30, 1e-4, 1000, "char")
    assert (g.n_layer, g.n_embd, g.n_head, g.block_size, g.batch_size) == tuple(
        T.GPT_DEFAULTS[k] for k in ("n_layer", "n_embd", "n_head", "block_size", "batch_size"))
    assert g.momentum is None and g.hidden is None and g.epochs is None and g.dataset is None
    m = T.apply_method_defaults(T.build_parser().parse_args([]))
    assert (m.model, m.optimizer, m.lr, m.momentum, m.weight_decay, m.grad_clip) == ("mlp", "sgd", 0.6, 0.0, 0.0, 0.0)
    assert (m.lr_schedule, m.warmup_lr_steps, m.min_lr, m.epochs, m.steps, m.batch_size, m.hidden) == \
        ("constant", 0, None, 2, None, 128, (2048, 2048))
    assert (m.beta1, m.tokens, m.n_layer) == (None, None, None)
    assert T.apply_method_defaults(argparse.Namespace(**vars(m))) == m  # idempotent
    for argv in (["--method", "diloco", "--delay-syncs", "1", "--overlap-steps", "2"],
                 ["--method", "slimdp-local"], ["--method", "ddp"],
                 ["--method", "slimdp", "--delay-steps", "1"]):   # idempotent for every method
        x = T.apply_method_defaults(T.build_parser().parse_args(argv))
        assert T.apply_method_defaults(argparse.Namespace(**vars(x))) == x, argv
    c = T.apply_method_defaults(T.build_parser().parse_args(["--model", "cnn", "--method", "topk"]))
    assert (c.lr, c.momentum, c.hidden) == (0.2, 0.0, None)
    # the hook sends parameters under 2048 elements whole; the top-k baseline compresses all
    assert (m.min_compress_numel, c.min_compress_numel) == (2048, 0)
    assert T.apply_method_defaults(argparse.Namespace(**vars(c))) == c
    e = T.apply_method_defaults(T.build_parser().parse_args(["--min-compress-numel", "0"]))
    assert e.min_compress_numel == 0
    a = T.apply_method_defaults(T.build_parser().parse_args(["--optimizer", "adamw", "--method", "ddp"]))
    assert (a.lr, a.momentum, a.weight_decay, a.lr_schedule) == (1e-3, None, 0.1, "constant")


def test_inner_optimizer_defaults_and_refusals():
    def parse(*argv):
        return T.apply_method_defaults(T.build_parser().parse_args(list(argv)))
    sl = parse("--model", "gpt", "--method", "slimdp-local")
    assert (sl.inner_optimizer, sl.outer_lr) == ("local-adamw", 1.0)     # plain average with LocalAdamW
    assert parse("--model", "gpt", "--method", "slimdp-local", "--inner-optimizer", "adamw").outer_lr == 1.4
    assert parse("--method", "slimdp-local").outer_lr == 1.4               # SGD
    assert parse("--model", "gpt", "--method", "diloco").inner_optimizer == "adamw"
    assert parse("--model", "gpt", "--method", "sparseloco").inner_optimizer == "adamw"
    assert parse("--model", "gpt", "--method", "diloco", "--inner-optimizer", "local-adamw").inner_optimizer \
        == "local-adamw"
    assert parse("--method", "slimdp-local").inner_optimizer is None       # SGD: no inner AdamW
    assert parse("--model", "gpt", "--method", "ddp").inner_optimizer is None
    for argv in (["--model", "gpt", "--method", "ddp", "--inner-optimizer", "adamw"],
                 ["--method", "slimdp-local", "--inner-optimizer", "local-adamw"],   # SGD
                 ["--model", "gpt", "--method", "ist", "--inner-optimizer", "local-adamw"]):
        with pytest.raises(SystemExit, match="--inner-optimizer"):
            parse(*argv)
    x = parse("--model", "gpt", "--method", "slimdp-local")
    assert T.apply_method_defaults(argparse.Namespace(**vars(x))) == x   # idempotent
    from slimcomm.optim import LocalAdamW
    from slimcomm.train import methods as M
    opt = M._make_optimizer(torch.nn.Linear(3, 2).parameters(), x)
    assert isinstance(opt, LocalAdamW) and opt.world_size == 1            # no process group here
    assert M._data_parallel_size(argparse.Namespace(mesh=(2, 3))) == 2    # HSDP: the replicas
    assert type(M._make_optimizer(torch.nn.Linear(3, 2).parameters(),
                                  parse("--model", "gpt", "--method", "diloco"))) is torch.optim.AdamW


def test_lr_factor():
    f = [T.lr_factor(s, 100, 10, "cosine", 0.1) for s in range(100)]
    assert f[:10] == [pytest.approx((s + 1) / 10) for s in range(10)]
    assert f[10] == pytest.approx(1.0) and f[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(f[10:], f[11:]))  # monotone after the warm-up
    assert f[10 + 89 // 2] == pytest.approx(0.55, abs=0.02)  # half-way: the mean of 1 and 0.1
    assert T.lr_factor(150, 100, 10, "cosine", 0.1) == pytest.approx(0.1)
    assert [T.lr_factor(s, 50, 0, "constant", 1.0) for s in (0, 49)] == [1.0, 1.0]
    assert T.lr_factor(0, 50, 4, "constant", 1.0) == 0.25


class _AverageEvery:
    """A stand-in for an optimizer that owns the synchronisation: local steps, parameter average every H."""

    def __init__(self, model, inner, sync_every):
        self.params, self.inner, self.sync_every = list(model.parameters()), inner, sync_every
        self.stats = {"total": {"bytes_sent": 0}}
        self.calls, self.grad_norms = 0, []

    def zero_grad(self, set_to_none=True):
        self.inner.zero_grad(set_to_none=set_to_none)

    def step(self):
        self.grad_norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in self.params])))
        self.inner.step()
        self.calls += 1
        if self.calls % self.sync_every == 0:
            for p in self.params:
                dist.all_reduce(p.data)
                p.data /= dist.get_world_size()
                self.stats["total"]["bytes_sent"] += 4 * p.numel()

    def state_dict(self):
        return {"calls": self.calls}


def test_sync_optimizer_place(tmp_path, monkeypatch):
    """A method registered in SYNC_OPTIMIZER_BUILDERS trains the bare model: no DDP, clip on the local
    gradient, the optimizer's step() called once per step, bytes read from its stats."""
    import torch.nn.functional as F

    made = {}

    def build(args, model, inner):
        inner_params = {id(p) for g in inner.param_groups for p in g["params"]}
        assert isinstance(inner, torch.optim.AdamW) and inner_params == {id(p) for p in model.parameters()}
        made["opt"] = _AverageEvery(model, inner, sync_every=3)
        return made["opt"]

    monkeypatch.setitem(T.SYNC_OPTIMIZER_BUILDERS, "avg-every-3", build)
    args = T.build_parser().parse_args(["--optimizer", "adamw", "--grad-clip", "0.01", "--warmup-lr-steps", "2",
                                        "--dataset", "digits"])
    args.method = "avg-every-3"
    T.apply_method_defaults(args)
    args.device = "cpu"
    dist.init_process_group("gloo", init_method="file://" + str(tmp_path / "store"), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = T.build_model(5, (7,), 3)
        m = T._Method(args, model, 1, F.cross_entropy, total_steps=6, classify=True)
        assert m.ddp is None and m.forward_model is model and m.sync_optimizer
        x, y = torch.randn(8, 5), torch.randint(0, 3, (8,))
        lrs = []
        for _ in range(6):
            loss, correct = m.train_step(x, y)
            lrs.append(m.opt.inner.param_groups[0]["lr"])
            assert math.isfinite(loss) and 0 <= correct <= 8
        opt = made["opt"]
        assert opt.calls == 6 and max(opt.grad_norms) <= 0.01 * (1 + 1e-5)  # clipped before step()
        assert m.bytes_sent() == 0          # one rank: nothing is sent, whatever stats say
        assert m.stats() == {"total": {"bytes_sent": 2 * 4 * sum(p.numel() for p in model.parameters())}}
        assert lrs[0] == pytest.approx(1e-3) and lrs[-1] == pytest.approx(1e-3)  # warm-up 2, then constant
    finally:
        dist.destroy_process_group()


def test_version_flag(capsys):
    from slimcomm import __version__

    with pytest.raises(SystemExit) as e:
        T.main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"slimcomm {__version__}"


def test_local_step_methods_on_gpt(tmp_path, small_text):
    out = tmp_path / "sync"
    r = subprocess.run(_cmd("--compare", ",".join(SYNC_METHODS), "--world-size", "2", "--text-file", small_text,
                            "--sync-every", "2", "--out-dir", str(out), *GPT_TINY),
                       env=_env(), capture_output=True, text=True, timeout=600, cwd=REPO)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    vocab = len(set(open(small_text).read()))
    for method in SYNC_METHODS:
        res = json.loads((out / f"{method}.json").read_text())
        assert res["method"] == method and res["steps"] == 8
        assert [e["step"] for e in res["evals"]] == [4, 8]
        # the outer model (evaluated) has moved: 4 synchronisations of 2 local steps
        assert res["final"]["val_loss"] < math.log(vocab), method
        st = res["stats"]
        assert st["local_steps"] == 8 and st["syncs"] == 4
        sent, dense = res["final"]["bytes_sent_per_rank"], res["final"]["dense_bytes_per_rank"]
        assert 0 < sent < dense / 2, method
        assert res["config"]["sync_every"] == 2


# ---------------------------------------------------------------------------
# Reporting (slimcomm.train.report): grouping by configuration, plots, logging, the CLI split
# ---------------------------------------------------------------------------

from slimcomm.train import report as R  # noqa: E402


def _fake_result(method, seed, lr=0.05, accs=(0.70, 0.80, 0.86), stored_key=True, rate=None, label=None):
    """A results dict shaped like the training command's, with evaluations every 10 steps."""
    cfg = {"method": method, "model": "mlp", "world_size": 2, "device": "cpu", "threads": 1, "dataset": "auto",
           "hidden": [48, 48], "epochs": 1, "batch_size": 16, "optimizer": "sgd", "lr": lr, "momentum": 0.0,
           "seed": seed, "eval_every": 10, "target_acc": 0.85, "out_dir": f"runs/{seed}", "quiet": seed % 2 == 0}
    evals = [{"step": 10 * (i + 1), "train_time_s": (i + 1) * (1.0 + 0.1 * seed),
              "bytes_sent_per_rank": (i + 1) * 1000, "test_acc": a + 0.01 * seed} for i, a in enumerate(accs)]
    r = {"format": R.RESULT_FORMAT, "method": method, "config": cfg, "world_size": 2,
         "dataset": {"name": "digits"}, "model": {"name": "mlp", "hidden": [48, 48], "num_params": 5962},
         "steps_per_epoch": 30, "metric": {"name": "test_acc", "goal": "max", "unit": "accuracy"},
         "evals": evals, "final": dict(evals[-1], bytes_sent_per_rank=evals[-1]["bytes_sent_per_rank"]),
         "time_to_target": None}
    if stored_key:
        r["config_key"] = R.compute_config_key(cfg, "digits")
    if rate:
        r["link"] = {"rate": rate}
    if label:
        r["label"] = label
    return r


def test_config_key_ignores_seed_and_output_options():
    a, b = _fake_result("ddp", 0), _fake_result("ddp", 1)
    assert a["config"]["out_dir"] != b["config"]["out_dir"] and a["config"]["quiet"] != b["config"]["quiet"]
    assert R.config_key(a) == R.config_key(b)
    assert R.config_key(_fake_result("ddp", 0, lr=0.1)) != R.config_key(a)
    assert R.config_key(_fake_result("slimdp", 0)) != R.config_key(a)
    # an older JSON without a stored key is grouped by its stored args: the same key
    assert R.config_key(_fake_result("ddp", 2, stored_key=False)) == R.config_key(a)
    # netbench's link rate separates otherwise identical runs
    assert R.config_key(_fake_result("ddp", 0, rate="100mbit")) != R.config_key(_fake_result("ddp", 0, rate="1gbit"))


def test_group_results_never_mixes_settings():
    runs = ([_fake_result("ddp", s) for s in (0, 1, 2)]
            + [_fake_result("slimdp", s, lr=0.6) for s in (0, 1)]
            + [_fake_result("slimdp", 0, lr=0.2, stored_key=False)])
    groups = R.group_results(runs)
    assert [(g.label, len(g.runs)) for g in groups] == [("ddp", 3), ("slimdp, lr 0.6", 2), ("slimdp, lr 0.2", 1)]
    assert groups[0].seeds == [0, 1, 2]
    xs, med, lo, hi = R.group_curve(groups[0], "test_acc", "time")
    assert med == pytest.approx([0.71, 0.81, 0.87]) and lo == pytest.approx([0.70, 0.80, 0.86])
    assert hi == pytest.approx([0.72, 0.82, 0.88]) and xs == pytest.approx([1.1, 2.2, 3.3])


def test_plot_one_median_line_per_configuration(tmp_path):
    runs = ([_fake_result("ddp", s) for s in (0, 1, 2)]
            + [_fake_result("slimdp", s, lr=0.6, accs=(0.80, 0.84, 0.85)) for s in (0, 1)]
            + [_fake_result("slimdp", 0, lr=0.2)])
    fig = R.build_figure(runs)
    try:
        assert len(fig.axes) == 2  # vs time, vs bytes
        for ax in fig.axes:
            labels = [t.get_text() for t in ax.get_legend().get_texts()]
            assert labels == ["ddp (3 seeds)", "slimdp, lr 0.6 (2 seeds)", "slimdp, lr 0.2", "target test acc 0.85"]
            assert len(ax.get_lines()) == 4  # 3 medians + the target line
            assert len(ax.collections) == 2  # bands for the groups with more than one seed
            lo, hi = ax.get_ylim()
            assert hi - lo >= R.MIN_Y_SPAN - 1e-9 and hi <= 1.0
        title = fig._suptitle.get_text()
        assert "digits" in title and "2 ranks" in title and "MLP 48-48" in title and "1 epoch(s)" in title
        assert "median over runs" in title
    finally:
        import matplotlib.pyplot as plt
        plt.close(fig)
    png = R.plot_results(runs, str(tmp_path / "sub" / "p.png"), band="iqr")
    assert open(png, "rb").read(4) == b"\x89PNG"


def test_plot_panels_per_link_rate(tmp_path):
    runs = [_fake_result(m, s, rate=rate, label=m) for rate in ("100mbit", "1gbit") for m in ("ddp", "slimdp")
            for s in (0, 1)]
    fig = R.build_figure(runs, panels=("time", "bytes"), log_time=True)
    try:
        assert [ax.get_title() for ax in fig.axes] == ["vs training time, 100mbit per link",
                                                       "vs training time, 1gbit per link", "vs bytes sent"]
        for ax in fig.axes:
            assert [t.get_text() for t in ax.get_legend().get_texts()][:2] == ["ddp (2 seeds)", "slimdp (2 seeds)"]
    finally:
        import matplotlib.pyplot as plt
        plt.close(fig)


def test_plot_from_groups_by_configuration(tmp_path, capsys):
    paths = []
    for i, r in enumerate([_fake_result("ddp", 0), _fake_result("ddp", 1), _fake_result("slimdp", 0, lr=0.6),
                           _fake_result("slimdp", 0, lr=0.2, stored_key=False)]):
        p = tmp_path / f"r{i}.json"
        p.write_text(json.dumps(r))
        paths.append(str(p))
    png = tmp_path / "p.png"
    assert T.main(["--plot", str(png), "--plot-band", "iqr", "--plot-from", *paths]) == 0
    out = capsys.readouterr().out
    assert "3 configurations:" in out and "slimdp, lr 0.6: config" in out and "seeds 0, 1" in out
    assert png.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(SystemExit):
        T.main(["--plot", "--plot-from", *paths])  # --plot without a path needs a run directory


def test_log_level_options(capsys):
    p = T.build_parser()
    assert T.log_level(p.parse_args([])) == "INFO"
    assert T.log_level(p.parse_args(["--quiet"])) == "WARNING"
    assert T.log_level(p.parse_args(["--quiet", "--log-level", "debug"])) == "DEBUG"
    with pytest.raises(SystemExit):
        p.parse_args(["--log-level", "loud"])
    import logging
    try:
        T.setup_logging("INFO", rank=1)
        assert logging.getLogger().level == logging.WARNING  # ranks other than 0: warnings only
        T.setup_logging("DEBUG")
        assert logging.getLogger().level == logging.DEBUG
    finally:
        logging.basicConfig(level=logging.WARNING, force=True)


def test_help_and_errors_read_cleanly(capsys):
    with pytest.raises(SystemExit):
        T.main(["--help"])
    out = capsys.readouterr().out
    assert "(default: False)" not in out and "--log-level" in out
    for line in out.splitlines():
        assert line.count("default") <= 1, line
    with pytest.raises(SystemExit):
        T.main(["--compare", "ddp,bogus"])
    err = capsys.readouterr().err
    assert "argument --compare: unknown method(s) ['bogus']" in err and "--compare: --compare" not in err


def test_cli_split_keeps_entry_points():
    """The reporting half lives in slimcomm.train.report; slimcomm.train still exposes what callers import."""
    assert T.compare_table is R.compare_table and T.plot_results is R.plot_results
    assert T.RESULT_FORMAT == R.RESULT_FORMAT
    import tomllib
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        assert tomllib.load(f)["project"]["scripts"]["slimcomm-train"] == "slimcomm.train:main"
    r = subprocess.run(_cmd("--version"), env=_env(), capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 0 and r.stdout.startswith("slimcomm ")


def test_single_method_table_has_no_empty_ratio_columns():
    r = _fake_result("slimdp", 0)
    s = T.compare_table([r])
    assert "vs ddp" not in s.splitlines()[0]
    s2 = T.compare_table([_fake_result("ddp", 0), r])
    assert "MB vs ddp" in s2.splitlines()[0]


# ---------------------------------------------------------------------------
# --method local: no communication, the compute limit
# ---------------------------------------------------------------------------

def test_local_method_trains_alone(tmp_path):
    """2 gloo ranks, tiny MLP: no byte sent, evaluations at the same steps as the other methods
    (their all-reduce of the scores does not hang), accuracy above chance, nothing to project."""
    out = tmp_path / "local.json"
    r = subprocess.run(_cmd("--method", "local", "--world-size", "2", "--eval-every", "15", "--out", str(out),
                            "--link-times", "1gbit", *TINY),
                       env=_env(), capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    steps = res["steps"]
    assert res["method"] == "local" and steps == res["dataset"]["train_samples_per_rank"] // 16
    assert [e["step"] for e in res["evals"]] == list(range(15, steps, 15)) + [steps]
    assert all(e["bytes_sent_per_rank"] == 0 for e in res["evals"]) and res["final"]["bytes_sent_per_rank"] == 0
    assert res["config"]["lr"] == 0.05 and res["config"]["momentum"] == 0.9
    assert 0.3 < res["final"]["test_acc"] <= 1.0
    assert res["stats"] == {}
    # no collective in a step: the projection onto a link adds nothing to the measured time
    lt = res["link_times"]
    assert lt["collectives_per_step"] == 0
    assert lt["links"]["1gbit"]["train_time_s"] == pytest.approx(res["final"]["train_time_s"], rel=1e-12)


def test_local_method_on_gpt(tmp_path, small_text):
    out = tmp_path / "local.json"
    r = subprocess.run(_cmd("--method", "local", "--world-size", "2", "--text-file", small_text,
                            "--out", str(out), "--link-times", "none", *GPT_TINY),
                       env=_env(), capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    vocab = len(set(open(small_text).read()))
    assert [e["step"] for e in res["evals"]] == [4, 8] and res["final"]["bytes_sent_per_rank"] == 0
    assert res["final"]["val_loss"] < math.log(vocab)


def test_evaluation_of_rank_own_models(tmp_path):
    """split=False (local): this rank's model on the WHOLE test set (the all-reduce then averages over
    ranks); split=True: this rank's 1/W share. One rank in the group, world_size 2 in the call."""
    import torch.nn.functional as F
    from slimcomm.train.tasks import _evaluate

    torch.manual_seed(0)
    model = T.build_model(5, (7,), 3)
    x, y = torch.randn(40, 5), torch.randint(0, 3, (40,))
    with torch.no_grad():
        out = model(x)
    full = float((out.argmax(1) == y).float().mean())
    half = float((out[0::2].argmax(1) == y[0::2]).float().mean())
    dist.init_process_group("gloo", init_method="file://" + str(tmp_path / "store"), rank=0, world_size=1)
    try:
        acc, loss = _evaluate(model, x, y, 0, 2, torch.device("cpu"), split=False)
        assert acc == pytest.approx(full) and loss == pytest.approx(float(F.cross_entropy(out, y)))
        acc2, _ = _evaluate(model, x, y, 0, 2, torch.device("cpu"))
        assert acc2 == pytest.approx(half)
    finally:
        dist.destroy_process_group()


def test_local_method_has_no_ddp(tmp_path):
    import torch.nn.functional as F

    args = T.apply_method_defaults(T.build_parser().parse_args(["--method", "local", "--dataset", "digits"]))
    args.device = "cpu"
    dist.init_process_group("gloo", init_method="file://" + str(tmp_path / "store"), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = T.build_model(5, (7,), 3)
        m = T._Method(args, model, 2, F.cross_entropy, total_steps=4, classify=True)
        assert m.ddp is None and m.forward_model is model and not m.sync_optimizer and not m.eval_split
        before = [p.detach().clone() for p in model.parameters()]
        m.train_step(torch.randn(8, 5), torch.randint(0, 3, (8,)))
        assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
        assert m.bytes_sent() == 0  # 2 ranks in the accounting, still nothing sent
    finally:
        dist.destroy_process_group()


def test_no_error_feedback_reaches_the_hook_and_is_refused_where_it_does_nothing():
    # it used to reach only SlimDPOptimizer: the slimdp/topk hooks kept error feedback silently
    from slimcomm.train.methods import _Method

    def parse(*argv):
        return T.apply_method_defaults(T.build_parser().parse_args(list(argv)))
    for m in ("ddp", "fp16", "powersgd", "local", "ist"):
        with pytest.raises(SystemExit, match="--no-error-feedback"):
            parse("--method", m, "--no-error-feedback")
    for m in ("slimdp", "topk", "diloco", "slimdp-local"):
        assert parse("--method", m, "--no-error-feedback").no_error_feedback
    import torch.distributed as dist
    from torch import nn

    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        for flag, want in (([], True), (["--no-error-feedback"], False)):
            args = parse("--method", "slimdp", *flag)
            model = nn.Sequential(nn.Linear(4, 3))
            meth = _Method(args, model, 1, nn.functional.cross_entropy, total_steps=2, classify=True)
            assert meth.hook_state.error_feedback is want
    finally:
        dist.destroy_process_group()


def test_fuse_sgd_default_where_it_applies_and_refusals():
    def parse(*argv):
        return T.apply_method_defaults(T.build_parser().parse_args(list(argv)))
    assert parse("--method", "slimdp").fuse_sgd is True                      # plain SGD, lr 0.6
    assert parse("--method", "slimdp", "--model", "cnn").fuse_sgd is True
    for argv in (["--momentum", "0.9"], ["--weight-decay", "1e-4"], ["--grad-clip", "1"],
                 ["--delay-steps", "1"], ["--model", "gpt"], ["--no-fuse-sgd"]):
        assert parse("--method", "slimdp", *argv).fuse_sgd is False, argv
    for m in ("ddp", "topk", "diloco", "local"):
        assert parse("--method", m).fuse_sgd is None
        with pytest.raises(SystemExit, match="--fuse-sgd"):
            parse("--method", m, "--fuse-sgd")
    for argv in (["--momentum", "0.9"], ["--grad-clip", "1"], ["--model", "gpt"]):
        with pytest.raises(SystemExit, match="--fuse-sgd"):
            parse("--method", "slimdp", "--fuse-sgd", *argv)
    x = parse("--method", "slimdp")
    assert T.apply_method_defaults(argparse.Namespace(**vars(x))) == x   # idempotent
    from slimcomm.train.methods import _Method
    import torch.distributed as dist
    from torch import nn

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for flag, fused in (([], True), (["--no-fuse-sgd"], False)):
            meth = _Method(parse("--method", "slimdp", *flag), nn.Sequential(nn.Linear(4, 3)), 1,
                           nn.functional.cross_entropy, total_steps=2, classify=True)
            assert (meth.hook_state._fused is not None) is fused
    finally:
        dist.destroy_process_group()
