"""End-to-end tests of the training command (python -m slimcomm.train) at 2 ranks on gloo."""

import json
import os
import socket
import subprocess
import sys

import pytest

from slimcomm import train as T

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METHODS = list(T.METHODS)
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
    rows = [ln for ln in lines if ln.startswith("| ")]
    assert rows[0].split("|")[1].strip() == "method"
    assert [ln.split("|")[1].strip() for ln in rows[1:]] == METHODS
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("method", METHODS)
def test_method_result_json(compare_run, method):
    r, out, _ = compare_run
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((out / f"{method}.json").read_text())
    assert res["format"] == T.RESULT_FORMAT and res["method"] == method
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


def test_same_seed_same_result(compare_run, tmp_path):
    """A rerun of one method with the same seed gives the same accuracy trajectory."""
    r, out, _ = compare_run
    first = json.loads((out / "slimdp.json").read_text())
    p = tmp_path / "again.json"
    r2 = subprocess.run(_cmd("--method", "slimdp", "--eval-every", "20", "--out", str(p), *TINY),
                        env=_env(), capture_output=True, text=True, timeout=200, cwd=REPO)
    assert r2.returncode == 0, r2.stderr[-3000:]
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
    (["--warmup-steps", "1"], "--warmup-steps"),
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
    monkeypatch.setattr(T, "_spawn_entry", _exit_without_writing)
    args = T.build_parser().parse_args(["--method", "ddp", "--world-size", "1", "--dataset", "digits",
                                        "--out", str(out)])
    T._resolve_launch(args)
    with pytest.raises(RuntimeError, match="without writing"):
        T.run(args)
    assert out.read_text() == '{"previous": true}'


def _exit_without_writing(rank, args, init_method):
    return None


@pytest.mark.parametrize("method,lr,momentum", [
    ("ddp", 0.05, 0.9), ("powersgd", 0.05, 0.9), ("ist", 0.05, 0.9), ("topk", 0.4, 0.0), ("slimdp", 0.6, 0.0),
])
def test_method_defaults(method, lr, momentum):
    args = T.apply_method_defaults(T.build_parser().parse_args(["--method", method]))
    assert (args.lr, args.momentum) == (lr, momentum)
    # the benchmark configuration is the default one: short warm-ups, bf16 wire, core refresh 10
    assert (args.warmup_steps, args.powersgd_start_iter, args.value_dtype, args.core_refresh) == (2, 2, "bf16", 10)
    explicit = T.apply_method_defaults(T.build_parser().parse_args(["--method", method, "--lr", "0.3",
                                                                    "--momentum", "0.5"]))
    assert (explicit.lr, explicit.momentum) == (0.3, 0.5)
