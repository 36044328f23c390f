"""bench/hook_breakdown/ablations.py (issue 31): its argument checks, and one real run of two
ablations on 2 ranks (each replaces a piece of the method in every rank's process)."""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "bench", "hook_breakdown", "ablations.py")


def _run(*argv, env=None):
    return subprocess.run([sys.executable, SCRIPT, *argv], cwd=REPO, capture_output=True,
                          text=True, env=env, timeout=600)


@pytest.mark.parametrize("argv,needle", [(["--only", "slimdp,bogus"], "bogus"),
                                         (["--steps", "101"], "--steps")])
def test_bad_arguments(argv, needle):
    r = _run(*argv)
    assert r.returncode == 2 and needle in r.stderr


def test_unknown_ablation_is_refused_in_the_rank_process():
    env = dict(os.environ, SLIMCOMM_ABLATE="bogus",
               PYTHONPATH=os.path.join(REPO, "bench", "hook_breakdown", "ablate"))
    r = subprocess.run([sys.executable, "-c", "print('ran')"], capture_output=True, text=True,
                       env=env, timeout=120)
    assert "SLIMCOMM_ABLATE must be one of" in r.stderr


def test_two_ablations_run_on_two_ranks(tmp_path):
    out = tmp_path / "t.md"
    r = _run("--world-size", "2", "--steps", "40", "--eval-every", "20", "--repeats", "1",
             "--only", "no-bucket-write,hook-payload", "--out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    text = out.read_text()
    rows = [line for line in text.splitlines() if line.startswith("| no-bucket-write")
            or line.startswith("| hook-payload")]
    assert len(rows) == 2
    for row in rows:
        assert float(row.split("|")[3]) > 0  # ms/step measured


FLOOR = os.path.join(REPO, "bench", "hook_breakdown", "floor.py")


@pytest.mark.parametrize("argv,needle", [(["--only", "local,bogus"], "bogus"),
                                         (["--rates", "1gbit", "--trajectory-rate", "1gbit"],
                                          "--trajectory-rate"),
                                         (["--rates", ","], "--rates")])
def test_floor_bad_arguments(argv, needle):
    r = subprocess.run([sys.executable, FLOOR, *argv], cwd=REPO, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and needle in r.stderr
