"""What each piece of the Slim-DP hook's step costs at 8 ranks (issue 31).

Runs the training command once per configuration (and ``--repeats`` times), each on
loopback gloo with every rank on this machine, and prints a markdown table of the steady
ms per step: the time between the first and the last evaluation over the steps between
them (the start-up and the first evaluation's steps are left out; evaluation time is not
training time). Configurations: ``local`` (no DDP, no collective), the ``slimdp`` method
as it is, and the ablations of ``bench/hook_breakdown/ablate/sitecustomize.py`` (each
replaces one piece of the method; see there).

    .venv/bin/python bench/hook_breakdown/ablations.py --out bench/results/hook_ablations_8ranks.md

Every run gets ``--lr`` (default 0.02: the ablations that hand DDP the raw local gradient
diverge at slimdp's lr 0.6; the step's cost does not depend on it) and ``--momentum 0``
(slimdp's SGD; ``local`` then runs the same optimizer, where the netbench's ``local`` runs
DDP's momentum 0.9, two more dense passes a step). Run it on an otherwise idle machine.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from tabulate import tabulate

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))

#: (name, method, SLIMCOMM_ABLATE or None, extra flags, what it measures); the ablations
#: of the hook's own work run the unfused hook (--no-fuse-sgd), as the step was before
CONFIGS = [
    ("local", "local", None, [], "no DDP, no collective: each rank steps alone (the compute limit's step)"),
    ("hook-none", "slimdp", "hook-none", [], "DDP with a hook that hands the bucket back at once"),
    ("hook-barrier", "slimdp", "hook-barrier", [], "... that all-reduces one bf16 value per step"),
    ("hook-payload", "slimdp", "hook-payload", [], "... that all-reduces zeros of Slim-DP's payload size"),
    ("no-collective", "slimdp", "no-collective", ["--no-fuse-sgd"],
     "the whole (unfused) hook, its values all-reduce a local no-op"),
    ("slimdp-unfused", "slimdp", None, ["--no-fuse-sgd"],
     "the whole hook, unfused: dense bucket write + optimizer.step()"),
    ("no-optimizer", "slimdp", "no-optimizer", ["--no-fuse-sgd"], "unfused, optimizer step skipped"),
    ("no-bucket-write", "slimdp", "no-bucket-write", ["--no-fuse-sgd"],
     "unfused, commit without the dense bucket write, optimizer step skipped"),
    ("slimdp", "slimdp", None, [], "the whole hook, fused SGD (the default): SGD at the index set inside the hook"),
]


def emit(text, out=None):
    """Print ``text`` (a markdown table with its heading) and, with ``out``, write it there."""
    print(text)
    if out:
        with open(out, "w") as fh:
            fh.write(text + "\n")


def run_one(method, ablate, extra, args, out_json):
    cmd = [sys.executable, "-m", "slimcomm.train", "--world-size", str(args.world_size),
           "--method", method, "--steps", str(args.steps), "--batch-size", str(args.batch_size),
           "--train-subset", "60000", "--eval-every", str(args.eval_every), "--lr", str(args.lr), "--momentum", "0",
           "--out", out_json, "--no-progress", "--quiet"] + extra
    env = dict(os.environ)
    if ablate:
        env["SLIMCOMM_ABLATE"] = ablate
        env["PYTHONPATH"] = os.pathsep.join(
            [os.path.join(HERE, "ablate"), REPO] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    subprocess.run(cmd, cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL)
    with open(out_json) as fh:
        evals = json.load(fh)["evals"]
    first, last = evals[0], evals[-1]
    return 1000 * (last["train_time_s"] - first["train_time_s"]) / (last["step"] - first["step"])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=100,
                   help="steps per run (keep no-collective below the agreement check's 100th step)")
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--only", default=None, help="comma-separated configuration names")
    p.add_argument("--out", default=None, help="also write the table (markdown) here")
    args = p.parse_args(argv)
    if args.steps > 100:
        p.error("--steps must be <= 100: the no-collective ablation fails the agreement check at step 101")
    names = [c[0] for c in CONFIGS]
    chosen = args.only.split(",") if args.only else names
    bad = [n for n in chosen if n not in names]
    if bad:
        p.error(f"--only: unknown configuration(s) {bad}; choose from {names}")
    times = {n: [] for n in chosen}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):  # interleaved, so that drift hits every configuration
            for name, method, ablate, extra, _ in CONFIGS:
                if name in chosen:
                    times[name].append(run_one(method, ablate, extra, args,
                                               os.path.join(tmp, f"{name}{r}.json")))
                    print(f"{name} run {r}: {times[name][-1]:.1f} ms/step", file=sys.stderr)
    base = statistics.median(times["local"]) if "local" in times else None
    rows = []
    for name, _, _, _, what in CONFIGS:
        if name not in chosen:
            continue
        med = statistics.median(times[name])
        rows.append([name, what, f"{med:.1f}", ", ".join(f"{t:.1f}" for t in times[name]),
                     "-" if base is None else f"{med - base:+.1f}"])
    table = tabulate(rows, headers=["configuration", "what runs", "ms/step (median)", "runs",
                                    "vs local"], tablefmt="github")
    head = (f"{args.world_size} ranks on loopback gloo, Fashion-MNIST MLP 784-2048-2048-10, batch "
            f"{args.batch_size} per rank, {args.steps} steps, ms/step between the evaluations at steps "
            f"{args.eval_every} and {args.steps}, SGD lr {args.lr} momentum 0, {args.repeats} runs each.\n"
            f"Command: `bench/hook_breakdown/ablations.py "
            f"{' '.join(argv if argv is not None else sys.argv[1:])}`\n\n")
    emit(head + table, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
