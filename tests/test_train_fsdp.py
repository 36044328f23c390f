"""The training command with ``--mesh R,S``: the GPT sharded with FSDP2 over a (replicate, shard) mesh,
4 ranks on gloo (2 replica groups of 2), every supported method, the bytes across the replicate
dimension in the results JSON, and the refused combinations."""

import json
import math
import os
import subprocess
import sys

import pytest

from slimcomm import train as T
from slimcomm.train import loop as train_loop
from slimcomm.train import sharding
from slimcomm.train.workloads import models as models_mod

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 6
# --val-batches 3 on 4 ranks: rank 3 has no validation batch of its own and must still run the sharded
# forwards with its replica group (TextTask.evaluate(lockstep=True)); without that the evaluation hangs
TINY = ["--model", "gpt", "--world-size", "4", "--mesh", "2,2", "--n-layer", "1", "--n-embd", "16",
        "--n-head", "2", "--block-size", "16", "--batch-size", "4", "--steps", str(STEPS), "--eval-every", "3",
        "--val-batches", "3", "--no-progress", "--threads", "1", "--timeout", "60"]


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def _no_env(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    p = tmp_path_factory.mktemp("text") / "story.txt"
    p.write_text("The quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs.\n" * 60)
    return str(p)


def _run(out, text, *extra):
    r = subprocess.run([sys.executable, "-m", "slimcomm.train", "--text-file", text, "--out-dir", str(out),
                        *TINY, *extra], capture_output=True, text=True, env=_env(), timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return r


def _padded_shard_bytes(model_info, shards):
    """FSDP2's padded dim-0 shard of every GPT parameter, fp32: one dense replicate all-reduce."""
    m = models_mod.GPT(model_info["vocab_size"], block_size=model_info["block_size"],
                       n_layer=model_info["n_layer"], n_embd=model_info["n_embd"], n_head=model_info["n_head"])
    return 4 * sum(math.ceil(p.shape[0] / shards) * math.prod(p.shape[1:]) for p in m.parameters())


def _check_common(res):
    assert res["world_size"] == 4
    mesh = res["mesh"]
    assert (mesh["replicate"], mesh["shard"]) == (2, 2)
    assert res["bytes_definition"] == mesh["replicate_bytes_definition"] == sharding.REPLICATE_BYTES_DEFINITION
    assert mesh["replicate_bytes_per_rank"] == res["final"]["bytes_sent_per_rank"]
    assert res["steps"] == STEPS
    assert len(res["evals"]) == 2 and all(math.isfinite(e["val_loss"]) for e in res["evals"])
    # the dense replicate all-reduce is of this rank's shard: about half the model's fp32 bytes
    dense = _padded_shard_bytes(res["model"], 2)
    assert mesh["dense_replicate_bytes_per_step"] == dense == res["dense_bytes_per_step"]
    assert dense < 4 * res["model"]["num_params"]
    return mesh


def test_hsdp_and_slimdp_hook(tmp_path, text):
    r = _run(tmp_path, text, "--compare", "ddp,slimdp")
    assert "across the replicate dimension" in r.stdout
    ddp = json.load(open(tmp_path / "ddp.json"))
    slim = json.load(open(tmp_path / "slimdp.json"))
    m = _check_common(ddp)
    assert m["fsdp"] == "hsdp-2d"
    assert m["replicate_bytes_per_rank"] == STEPS * m["dense_replicate_bytes_per_step"]
    m = _check_common(slim)
    assert m["fsdp"] == "shard-1d"
    # 1 dense warm-up step in the bf16 wire (half the fp32 dense bytes), then the compressed
    # payload: less than ddp, more than the warm-up alone
    warm = m["dense_replicate_bytes_per_step"] // 2
    assert warm < m["replicate_bytes_per_rank"] < ddp["mesh"]["replicate_bytes_per_rank"]
    assert slim["stats"]["total"]["bytes_sent"] == m["replicate_bytes_per_rank"]


def test_slimdp_optimizer_methods(tmp_path, text):
    _run(tmp_path, text, "--compare", "slimdp-local,diloco,sparseloco", "--sync-every", "2")
    sent = {}
    for name in ("slimdp-local", "diloco", "sparseloco"):
        res = json.load(open(tmp_path / f"{name}.json"))
        m = _check_common(res)
        assert m["fsdp"] == "shard-1d"
        sent[name] = m["replicate_bytes_per_rank"]
        assert sent[name] > 0
    # diloco: 3 dense synchronisations of the shard (values fp32 or bf16, plus small agreement messages)
    dense = m["dense_replicate_bytes_per_step"]
    assert sent["diloco"] >= 3 * dense // 2
    assert sent["slimdp-local"] < sent["diloco"] and sent["sparseloco"] < sent["diloco"]


@pytest.mark.parametrize("argv,needle", [
    (["--model", "mlp", "--world-size", "4", "--mesh", "2,2"], "--mesh shards the GPT"),
    (["--model", "cnn", "--world-size", "4", "--mesh", "2,2"], "needs --model gpt"),
    (["--model", "gpt", "--world-size", "4", "--mesh", "2,3"], "--mesh 2,3 has 6 ranks but --world-size is 4"),
    (["--model", "gpt", "--world-size", "4", "--mesh", "2,2", "--method", "topk"], "--mesh supports --method"),
    (["--model", "gpt", "--world-size", "4", "--mesh", "2,2", "--method", "ist"], "--mesh supports --method"),
    (["--model", "gpt", "--world-size", "4", "--mesh", "2,2", "--compare", "ddp,powersgd"], "--method powersgd"),
    (["--model", "gpt", "--world-size", "4", "--mesh", "2,2", "--method", "local"], "--mesh supports"),
    (["--model", "gpt", "--world-size", "4", "--mesh", "2,2", "--link-times", "100mbit"], "--link-times"),
    (["--model", "gpt", "--world-size", "4", "--mesh", "2,2", "--profile", "--method", "ddp"], "--profile"),
    (["--model", "gpt", "--world-size", "4", "--mesh", "2,2", "--delay-steps", "1"], "--delay-steps"),
    (["--model", "gpt", "--world-size", "4", "--mesh", "2,2", "--method", "slimdp",
      "--min-compress-numel", "0"], "--min-compress-numel"),
    (["--model", "gpt", "--world-size", "4", "--mesh", "4"], "--mesh"),
    (["--model", "gpt", "--world-size", "4", "--mesh", "2,x"], "--mesh"),
    (["--model", "gpt", "--world-size", "4", "--mesh", "0,4"], "--mesh"),
])
def test_bad_mesh_combinations(argv, needle, monkeypatch, capsys):
    _no_env(monkeypatch)
    monkeypatch.setattr(train_loop, "run", lambda args: pytest.fail("training started"))
    with pytest.raises(SystemExit) as ei:
        T.main(argv)
    assert ei.value.code != 0
    err = capsys.readouterr().err + str(ei.value.code)
    assert needle in err, err


def test_mesh_parsed():
    assert sharding.parse_mesh("2,2") == (2, 2)
    args = T.build_parser().parse_args(["--model", "gpt", "--mesh", "1,4", "--world-size", "4"])
    assert args.mesh == (1, 4)
