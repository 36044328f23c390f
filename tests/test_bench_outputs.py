"""Benchmarks write to the ignored bench/out/ unless told to write the committed bench/results/."""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = ["kernels.py", "hook_overhead.py", "ist_fmnist.py", "netbench.py", "fsdp_optim_memory.py"]


def _run(*args, cwd=REPO):
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def test_bench_out_is_ignored_by_git():
    with open(os.path.join(REPO, ".gitignore")) as f:
        assert "bench/out/" in f.read().split()


@pytest.mark.parametrize("script", SCRIPTS)
def test_default_output_is_bench_out(script):
    r = _run(os.path.join(REPO, "bench", script), "--help")
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())
    assert "--results-dir DIR" in text and "bench/out/" in text, text


def test_kernels_writes_where_told(tmp_path):
    """A tiny run with --results-dir writes there and leaves bench/results/ alone."""
    before = set(os.listdir(os.path.join(REPO, "bench", "results")))
    r = _run(os.path.join(REPO, "bench", "kernels.py"), "--sizes", "1e4", "--densities", "0.01",
             "--ops", "pack", "--repeats", "3", "--warmup", "1", "--results-dir", str(tmp_path),
             cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    written = sorted(p.name for p in tmp_path.iterdir())
    assert len(written) == 2 and written[0].startswith("cpu-kernels-"), written
    assert set(os.listdir(os.path.join(REPO, "bench", "results"))) == before


def test_kernels_every_op_runs(tmp_path):
    """Every op of the kernel benchmark runs beside its reference at a tiny size (the cases
    share inputs; one case must not disturb another's) and lands in the table."""
    r = _run(os.path.join(REPO, "bench", "kernels.py"), "--sizes", "1e4", "--densities", "0.02",
             "--repeats", "1", "--warmup", "0", "--no-peak", "--tied", "", "--results-dir",
             str(tmp_path), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    md = next(p for p in tmp_path.iterdir() if p.suffix == ".md").read_text()
    for name in ["significance_topk", "explore_sample", "pack", "unpack (accumulate)",
                 "sgd_apply_indexed", "step_commit (old G)", "gather_slices", "scatter_slices"]:
        assert f"| {name} " in md, (name, md)
