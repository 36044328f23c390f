"""examples/ run as a user starts them: 2 ranks under torchrun, checked by exit status and output.

Each example is launched as ``python -m torch.distributed.run --nproc-per-node 2
--master-port <free port> examples/X.py --steps N`` from a temporary working
directory (so its checkpoints land there), with this checkout on PYTHONPATH.
"""

import os
import re
import socket
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(REPO, "examples")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(script, *args, cwd, timeout=300, nproc=2):
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    for _ in range(3):  # another process may take the free port before torchrun binds it
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--master-port", str(_free_port()), os.path.join(EXAMPLES, script), *args]
        r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
        if r.returncode == 0 or "address already in use" not in (r.stdout + r.stderr).lower():
            break
    assert r.returncode == 0, f"{' '.join(cmd)} exited {r.returncode}\n{r.stdout}\n{r.stderr}"
    return r.stdout


def _accuracy(out):
    m = re.search(r"^test accuracy (\d\.\d+)$", out, re.M)
    assert m, out
    return float(m.group(1))


@pytest.mark.parametrize("script", ["ddp_hook.py", "ist.py", "adamw_local.py"])
def test_every_example_has_a_launch_line(script):
    with open(os.path.join(EXAMPLES, script)) as f:
        src = f.read()
    doc = src.split('"""')[1]
    assert f"torchrun --nproc-per-node 2 examples/{script}" in doc
    assert "slimcomm.hooks" not in src and "slimcomm.ist" not in src   # public top-level API only
    assert "slimcomm.optim" not in src


def test_ddp_hook_example_trains_saves_and_resumes(tmp_path):
    out = _launch("ddp_hook.py", "--steps", "60", cwd=tmp_path)
    assert "2 ranks on" in out and re.search(r"^step +60  loss \d", out, re.M), out
    assert re.search(r"slim_dp: 60 synchronised steps, sent [\d.]+ MB per rank vs [\d.]+ MB", out), out
    assert "state.stats['last'] = {" in out
    assert _accuracy(out) > 0.5
    ckpts = sorted(p.name for p in (tmp_path / "runs" / "examples" / "ddp_hook").iterdir())
    assert ckpts == ["rank0.pt", "rank1.pt"]

    out = _launch("ddp_hook.py", "--steps", "20", "--resume", cwd=tmp_path)
    assert "resumed from step 60" in out, out
    assert "slim_dp: 80 synchronised steps" in out, out     # the hook state was restored too
    assert re.search(r"^step +80  loss \d", out, re.M), out


def test_ist_example_trains_and_saves(tmp_path):
    out = _launch("ist.py", "--steps", "60", "--local-steps", "10", cwd=tmp_path)
    assert re.search(r"trained 60 steps in 6 rounds", out), out
    m = re.search(r"IST: sent ([\d.]+) MB per rank vs ([\d.]+) MB for dense DDP", out)
    assert m and float(m.group(1)) < float(m.group(2)) / 4, out
    assert _accuracy(out) > 0.5
    assert (tmp_path / "runs" / "examples" / "ist.pt").is_file()


def test_adamw_local_example_trains_with_few_bytes(tmp_path):
    out = _launch("adamw_local.py", "--steps", "60", cwd=tmp_path)
    m = re.search(r"slimdp-local: 60 local steps, 20 syncs, sent ([\d.]+) MB per rank vs ([\d.]+) MB", out)
    assert m, out
    assert float(m.group(1)) < 0.03 * float(m.group(2))
    first = float(re.search(r"^step +60  train loss [\d.]+  val loss ([\d.]+)", out, re.M).group(1))
    assert first < 4.0   # log(vocab ~ 100) = 4.6 at initialisation
    ckpts = sorted(p.name for p in (tmp_path / "runs" / "examples" / "adamw_local").iterdir())
    assert ckpts == ["rank0.pt", "rank1.pt"]


def test_fsdp_example_trains_saves_and_resumes(tmp_path):
    with open(os.path.join(EXAMPLES, "fsdp_slimdp.py")) as f:
        src = f.read()
    assert "torchrun --nproc-per-node 4 examples/fsdp_slimdp.py" in src.split('"""')[1]
    assert "slimcomm.fsdp" not in src   # the public top-level API only
    out = _launch("fsdp_slimdp.py", "--steps", "60", cwd=tmp_path, nproc=4)
    assert "4 ranks on cpu as 2 replica groups x 2 shards" in out, out
    m = re.search(r"slim_dp: 60 synchronised steps, sent ([\d.]+) MB per rank to its replica "
                  r"peers vs ([\d.]+) MB", out)
    assert m and float(m.group(1)) < 0.15 * float(m.group(2)), out
    m = re.search(r"hook state \(residual \+ G\) per rank: ([\d.]+) MB for a ([\d.]+) MB fp32 "
                  r"model shard \(unsharded model: ([\d.]+) MB\)", out)
    assert m and float(m.group(1)) <= 2 * float(m.group(2)) + 1e-3, out
    assert float(m.group(2)) < 0.55 * float(m.group(3)), out   # the state is per shard
    assert _accuracy(out) > 0.5
    ckpts = sorted(p.name for p in (tmp_path / "runs" / "examples" / "fsdp_slimdp").iterdir())
    assert ckpts == [f"rank{r}.pt" for r in range(4)]

    out = _launch("fsdp_slimdp.py", "--steps", "20", "--resume", cwd=tmp_path, nproc=4)
    assert "resumed from step 60" in out and "slim_dp: 80 synchronised steps" in out, out
    assert re.search(r"^step +80  loss \d", out, re.M), out


@pytest.mark.parametrize("method,max_share", [("slimdp", 0.15), ("slimdp-local", 0.02)])
def test_fsdp_gpt_example_trains_with_few_bytes_between_nodes(method, max_share, tmp_path):
    with open(os.path.join(EXAMPLES, "fsdp_gpt.py")) as f:
        src = f.read()
    assert "torchrun --nproc-per-node 4 examples/fsdp_gpt.py" in src.split('"""')[1]
    assert "slimcomm.fsdp" not in src and "slimcomm.optim" not in src   # the public top-level API only
    out = _launch("fsdp_gpt.py", "--method", method, "--steps", "40", cwd=tmp_path, nproc=4)
    assert f"4 ranks on cpu as 2 nodes x 2 shards" in out and f"method {method}" in out, out
    m = re.search(rf"{method}: sent ([\d.]+) MB per rank across the replicate dimension vs ([\d.]+) MB", out)
    assert m and 0 < float(m.group(1)) < max_share * float(m.group(2)), out
    m = re.search(r"^validation loss (\d+\.\d+) \(uniform: (\d+\.\d+)\)$", out, re.M)
    assert m and float(m.group(1)) < float(m.group(2)) - 0.5, out


def _readme_snippets():
    """The README's Python blocks that start with '# Save as NAME.py, launch with: torchrun ...'."""
    with open(os.path.join(REPO, "README.md")) as f:
        text = f.read()
    blocks = re.findall(r"```python\n(# Save as (\w+\.py), launch with: (torchrun [^\n]+)\n.*?)```", text, re.S)
    return [(name, launch, src) for src, name, launch in blocks]


def test_readme_has_the_snippets():
    assert [name for name, _, _ in _readme_snippets()] == ["slimdp_snippet.py", "adamw_snippet.py",
                                                          "ist_snippet.py"]


@pytest.mark.parametrize("name,launch,src", _readme_snippets(), ids=lambda v: v if v.endswith(".py") else "")
def test_readme_snippet_runs_as_pasted(name, launch, src, tmp_path):
    """Each API snippet, saved under its own name and launched with its own torchrun line, exits 0."""
    (tmp_path / name).write_text(src)
    assert launch == f"torchrun --nproc-per-node 2 {name}"
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    for _ in range(3):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-port", str(_free_port()), name]
        r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        if r.returncode == 0 or "address already in use" not in (r.stdout + r.stderr).lower():
            break
    assert r.returncode == 0, f"{name} exited {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
