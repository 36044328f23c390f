"""The per-step floor of a synchronous comm hook at 8 ranks on emulated links (issue 31).

``bench/hook_breakdown/ablations.py`` splits the hook's step on loopback gloo; this script
measures the same pieces on the links of ``bench/netbench.py`` (one network namespace per
rank, tbf-limited veth links), where the payload also pays the link. Each configuration
is one netbench run (its own result directory ``<results-dir>/<name>_<configuration>``):

``local``          every rank trains alone (the compute limit's step),
``hook-barrier``   DDP with a hook that all-reduces one bf16 value a step,
``hook-payload``   ... that all-reduces bf16 zeros of Slim-DP's payload size,
``slimdp``         the hook as it is (``allreduce_algorithm="backend"``),
``slimdp@ts``      the hook with the two-shot all-reduce.

The two ``hook-*`` rows are the ablations of ``bench/hook_breakdown/ablate/sitecustomize.py``
(installed through ``PYTHONPATH`` with ``SLIMCOMM_ABLATE``) and run with ``--lr 0.02
--momentum 0`` (they hand DDP the raw local gradient; the step's cost does not depend on
the rate). ``hook-payload`` is what any per-step synchronous hook that sends Slim-DP's
bytes pays before doing any work of its own: its ratio to ``local`` bounds how close to
the compute limit such a hook can get on this machine.

    .venv/bin/python bench/hook_breakdown/floor.py --out bench/results/hook_floor_8ranks.md

Needs root, as bench/netbench.py does (``ip netns``, ``tc``). The table holds,
per timed rate, the median over seeds of the steady ms per step of each configuration's
timed run and its ratio to ``local``'s.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

from tabulate import tabulate

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(REPO, "bench"))

from netbench_projection import timed_args  # noqa: E402

sys.path.insert(0, HERE)
from ablations import emit  # noqa: E402

#: (name, netbench method, SLIMCOMM_ABLATE or None, extra training flags, what it measures)
CONFIGS = [
    ("local", "local", None, [], "each rank trains alone: no DDP, no collective"),
    ("hook-barrier", "slimdp", "hook-barrier", ["--lr", "0.02", "--momentum", "0"],
     "DDP + a hook that all-reduces one bf16 value per step"),
    ("hook-payload", "slimdp", "hook-payload", ["--lr", "0.02", "--momentum", "0"],
     "DDP + a hook that all-reduces bf16 zeros of Slim-DP's payload size"),
    ("slimdp", "slimdp", None, [], "the Slim-DP hook (ring all-reduce)"),
    ("slimdp@ts", "slimdp", None, ["--allreduce-algorithm", "two_shot"],
     "the Slim-DP hook, two-shot all-reduce"),
]

DEFAULT_TRAIN = ["--epochs", "2", "--batch-size", "32", "--train-subset", "60000", "--eval-every", "20"]


def netbench_cmd(args, name, method, extra, train):
    """The netbench command line of one configuration."""
    rates = [args.trajectory_rate] + args.rates
    return ([sys.executable, os.path.join(REPO, "bench", "netbench.py"),
             "--world-size", str(args.world_size), "--rates", ",".join(rates),
             "--timed-rates", ",".join(args.rates), "--timed-steps", str(args.timed_steps),
             "--methods", method, "--seeds", args.seeds, "--reuse", "--port", str(args.port),
             "--results-dir", args.results_dir, "--name", name, "--"]
            + timed_args(train, args.trajectory_steps) + extra)


def timed_ms(results_dir, name, rate, method, seeds):
    """Per-seed steady ms per step of the timed runs (``projected.ms_per_step``)."""
    out = []
    for s in seeds:
        with open(os.path.join(results_dir, name, f"{rate}_{method}_s{s}.json")) as fh:
            out.append(json.load(fh)["projected"]["ms_per_step"])
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world-size", type=int, default=8)
    p.add_argument("--rates", default="1gbit,100mbit", help="timed link rates, comma-separated")
    p.add_argument("--trajectory-rate", default="10gbit",
                   help="rate of the short full runs netbench projects from (not in the table)")
    p.add_argument("--trajectory-steps", type=int, default=40,
                   help="length of the full runs (replaces --epochs/--steps of the training flags)")
    p.add_argument("--timed-steps", type=int, default=60)
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--port", type=int, default=29720)
    p.add_argument("--results-dir", default=os.path.join(REPO, "bench", "results", "scale"))
    p.add_argument("--name", default="floor_mlp_8ranks")
    p.add_argument("--only", default=None, help="comma-separated configuration names")
    p.add_argument("--out", default=None, help="also write the table (markdown) here")
    p.add_argument("train", nargs=argparse.REMAINDER,
                   help="training flags after '--' (default: the issue-31 MLP: "
                        + " ".join(DEFAULT_TRAIN) + ")")
    args = p.parse_args(argv)
    args.rates = [r.strip() for r in args.rates.split(",") if r.strip()]
    if not args.rates:
        p.error("--rates: give at least one rate")
    if args.trajectory_rate in args.rates:
        p.error(f"--trajectory-rate {args.trajectory_rate} is also in --rates")
    train = args.train[1:] if args.train[:1] == ["--"] else args.train
    train = train or DEFAULT_TRAIN
    names = [c[0] for c in CONFIGS]
    chosen = args.only.split(",") if args.only else names
    bad = [n for n in chosen if n not in names]
    if bad:
        p.error(f"--only: unknown configuration(s) {bad}; choose from {names}")
    seeds = [s.strip() for s in args.seeds.split(",") if s.strip()]

    times = {}
    for name, method, ablate, extra, _ in CONFIGS:
        if name not in chosen:
            continue
        env = dict(os.environ)
        env.pop("SLIMCOMM_ABLATE", None)
        if ablate:
            env["SLIMCOMM_ABLATE"] = ablate
            env["PYTHONPATH"] = os.pathsep.join(
                [os.path.join(HERE, "ablate")] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        run_name = f"{args.name}_{name}"
        cmd = netbench_cmd(args, run_name, method, extra, train)
        print("[floor] " + " ".join(cmd), file=sys.stderr, flush=True)
        subprocess.run(cmd, cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL)
        times[name] = {r: timed_ms(args.results_dir, run_name, r, method, seeds) for r in args.rates}

    base = {r: statistics.median(times["local"][r]) for r in args.rates} if "local" in times else None
    rows = []
    for name, _, _, _, what in CONFIGS:
        if name not in times:
            continue
        row = [name, what]
        for r in args.rates:
            med = statistics.median(times[name][r])
            row += [f"{med:.0f} ({', '.join(f'{t:.0f}' for t in times[name][r])})",
                    "-" if base is None else f"{med / base[r]:.2f}"]
        rows.append(row)
    headers = ["configuration", "what runs"]
    for r in args.rates:
        headers += [f"{r}: ms/step (per seed)", "x local"]
    table = tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True)
    head = (f"{args.world_size} ranks, one network namespace each (bench/netbench.py), timed runs of "
            f"{args.timed_steps} steps at {', '.join(args.rates)}, seeds {', '.join(seeds)} (medians); "
            f"training flags `{' '.join(train)}` (their length replaced: {args.trajectory_steps}-step "
            f"full runs at {args.trajectory_rate}, {args.timed_steps}-step timed runs).\n"
            f"Command: `bench/hook_breakdown/floor.py {' '.join(argv if argv is not None else sys.argv[1:])}`\n\n")
    emit(head + table, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
