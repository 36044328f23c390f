"""bench/hook_breakdown/sitecustomize.py and summarize.py (issue 31, item 1): the timers
still find every private name they wrap, and a real 2-rank run writes per-rank files that
summarize.py turns into the table of bench/results/hook_breakdown_8ranks.md."""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HB = os.path.join(REPO, "bench", "hook_breakdown")


def _env(tmp_path):
    return dict(os.environ, SLIMPROF_DIR=str(tmp_path), PYTHONPATH=HB)


def test_every_wrapped_name_exists(tmp_path):
    # sitecustomize runs at interpreter start-up: a renamed private function fails here
    r = subprocess.run([sys.executable, "-c", "import sitecustomize, slimcomm._comm as c; "
                        "print(c.all_reduce.__name__)"],
                       capture_output=True, text=True, env=_env(tmp_path), cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "timed"  # wrapped


@pytest.mark.parametrize("delay", ["0", "1"])
def test_a_two_rank_run_gives_the_table(tmp_path, delay):
    prof = tmp_path / "prof"
    prof.mkdir()
    r = subprocess.run([sys.executable, "-m", "slimcomm.train", "--world-size", "2", "--method",
                        "slimdp", "--dataset", "digits", "--steps", "30", "--batch-size", "16",
                        "--delay-steps", delay, "--eval-every", "30", "--no-progress", "--quiet",
                        "--out", str(tmp_path / "r.json")],
                       capture_output=True, text=True, env=_env(prof), cwd=REPO, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(p.name for p in prof.iterdir()) == ["rank0.txt", "rank1.txt"]
    s = subprocess.run([sys.executable, os.path.join(HB, "summarize.py"), str(prof)],
                       capture_output=True, text=True, cwd=REPO, timeout=120)
    assert s.returncode == 0, s.stderr
    rows = {line.split("|")[1].strip(): line.split("|")[2:5] for line in s.stdout.splitlines()
            if line.startswith("| ") and "phase" not in line}
    assert "hook: synchronize (whole call)" in rows and "step_encode op (error feedback + pack)" in rows
    assert int(rows["hook: synchronize (whole call)"][2]) >= 20  # calls on rank 0 (dumped every 10)
    assert float(rows["step_encode op (error feedback + pack)"][0]) > 0
    if delay == "1":
        assert "delayed: resolve (wait previous + commit)" in rows


def _builds(*args, cwd=None):
    return subprocess.run([sys.executable, os.path.join(HB, "builds.py"), *args], cwd=cwd or REPO,
                          capture_output=True, text=True, timeout=120)


def test_builds_refuses_a_checkout_without_a_build(tmp_path):
    """builds.py names the argument whose checkout has no package or no built extension,
    before any run."""
    r = _builds("--base", str(tmp_path))
    assert r.returncode != 0 and "--base" in r.stderr and "no slimcomm package" in r.stderr
    (tmp_path / "slimcomm").mkdir()
    r = _builds("--base", str(tmp_path))
    assert r.returncode != 0 and "no built extension" in r.stderr
    r = _builds("--base", REPO, "--rounds", "0")
    assert r.returncode != 0 and "--rounds must be >= 1" in r.stderr


def test_builds_two_rank_run(tmp_path):
    """One round of the same checkout as base and head on 2 ranks: a table with both."""
    out = tmp_path / "t.md"
    r = _builds("--base", REPO, "--rounds", "1", "--out", str(out), "--port", "29893", "--",
                "--world-size", "2", "--steps", "4", "--method", "slimdp", "--train-subset", "512")
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    assert "| base " in text and "| head " in text and "--world-size 2" in text
