"""Two builds of slimcomm on the same 8-rank training command, interleaved (issue 31).

A kernel change shows in a one-core microbenchmark (``bench/kernels.py``); what it does to
a training step where eight ranks share this machine's cores is measured here: the
training command runs from each checkout in turn (base, head, base, head, ...), so a
change in the machine's speed hits both alike, and the table reports per build the
median over the rounds of the ms per training step (train time over steps, start-up
included, evaluation excluded) and of the CPU seconds every rank used together (user +
system time of the whole job, a measure that does not depend on how the ranks were
scheduled).

    git worktree add /tmp/base <commit> && (cd /tmp/base && ln -s $PWD/.venv .venv && \\
        SLIMCOMM_SKIP_CUDA=1 .venv/bin/python setup.py build_ext --inplace)
    .venv/bin/python bench/hook_breakdown/builds.py --base /tmp/base --rounds 3 \\
        --out bench/results/hook_builds_8ranks.md -- --method slimdp --lr 0.6 --momentum 0

Each checkout runs with its own ``slimcomm`` package and extension (the command runs
with the checkout as working directory). Run it on an otherwise idle machine.
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from typing import List, Optional, Sequence, Tuple

from tabulate import tabulate

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
BASE_FLAGS = ["--world-size", "8", "--steps", "120", "--batch-size", "32", "--train-subset", "60000",
              "--eval-every", "1000", "--no-progress", "--quiet"]


def _checkout(path: str, what: str) -> str:
    path = os.path.abspath(path)
    pkg = os.path.join(path, "slimcomm")
    if not os.path.isdir(pkg):
        raise SystemExit(f"{what}: {path} has no slimcomm package")
    if not any(f.startswith("_C") and f.endswith(".so") for f in os.listdir(pkg)):
        raise SystemExit(f"{what}: {path}/slimcomm has no built extension (_C*.so); build it there "
                         f"(SLIMCOMM_SKIP_CUDA=1 .venv/bin/python setup.py build_ext --inplace)")
    return path


def run_once(checkout: str, python: str, flags: Sequence[str], port: int) -> Tuple[float, float]:
    """(ms per step, CPU seconds of the whole job) of one training run from ``checkout``."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "run.json")
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        r = subprocess.run([python, "-m", "slimcomm.train", *BASE_FLAGS, "--out", out,
                            "--master-port", str(port), *flags], cwd=checkout,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if r.returncode != 0:
            raise SystemExit(f"the training command failed in {checkout}:\n{r.stderr[-2000:]}")
        with open(out) as f:
            d = json.load(f)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return d["final"]["train_time_s"] / d["steps"] * 1000.0, cpu


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    flags: List[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, flags = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base", required=True, help="checkout of the base build (extension built in it)")
    p.add_argument("--head", default=REPO, help="checkout of the new build (default: this repository)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved runs per build")
    p.add_argument("--python", default=sys.executable, help="interpreter of the runs (default: this one)")
    p.add_argument("--port", type=int, default=29870, help="first master port (one per run)")
    p.add_argument("--out", default=None, help="markdown file to write (default: print only)")
    a = p.parse_args(argv)
    if a.rounds < 1:
        p.error(f"--rounds must be >= 1, got {a.rounds}")
    builds = {"base": _checkout(a.base, "--base"), "head": _checkout(a.head, "--head")}
    runs = {k: [] for k in builds}
    port = a.port
    for r in range(a.rounds):
        for name, path in builds.items():
            ms, cpu = run_once(path, a.python, flags, port)
            port += 1
            runs[name].append((ms, cpu))
            print(f"[builds] round {r} {name}: {ms:.1f} ms/step, {cpu:.1f} CPU s", flush=True)
    rows = []
    for name, path in builds.items():
        ms = [x for x, _ in runs[name]]
        cpu = [c for _, c in runs[name]]
        rev = subprocess.run(["git", "-C", path, "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True).stdout.strip() or "?"
        rows.append([name, rev, f"{statistics.median(ms):.1f}", ", ".join(f"{x:.0f}" for x in ms),
                     f"{statistics.median(cpu):.1f}", ", ".join(f"{c:.0f}" for c in cpu)])
    table = tabulate(rows, headers=["build", "commit", "ms/step (median)", "per round",
                                    "CPU s of all ranks (median)", "per round"], tablefmt="github")
    text = (f"Training command flags: `{' '.join(BASE_FLAGS + flags)}`; {a.rounds} interleaved "
            f"round(s).\n\n{table}\n")
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
