#!/usr/bin/env python3
"""IST vs dense DDP on Fashion-MNIST: bytes per rank per step and test accuracy.

The acceptance measurement of slimcomm's IST trainer (Yuan et al., arXiv
1910.02120): an MLP 784-2048-2048-10 on Fashion-MNIST, ``W`` gloo ranks on
this host, trained with ``slimcomm.train --method ddp`` and ``--method ist``
under the same seed, data shards, optimizer (SGD + momentum, re-created every
IST round) and number of steps. It reports, per method,

* bytes per rank per training step: the payload each rank hands to
  collectives (``slimcomm.train``'s definition: the all-reduce input for DDP,
  the rank's own all-gather buffer for IST), divided by the steps;
* the same for IST from the analytic subnet size (first and last layer
  ``1/W`` of the weights, hidden-to-hidden ``1/W**2``, hidden biases ``1/W``,
  the shared output bias whole), per round divided by ``local_steps``,
  which must equal the measurement;
* test accuracy after every epoch, training time.

and checks the issue's targets: IST bytes per step at most 1/8 of DDP's (at
``local_steps = 10``) and IST's final test accuracy within 1.5 points of DDP's.

Outputs ``<results-dir>/ist_fmnist.md`` (tables) and the raw result JSONs in
``<results-dir>/ist_fmnist/``, where ``<results-dir>`` is ``bench/out/``
(ignored by git) unless ``--results-dir bench/results`` (the committed
results). ``--from-json DDP.json IST.json`` summarises existing results
without training.

Example (the numbers in bench/results/ist_fmnist.md)::

    .venv/bin/python bench/ist_fmnist.py --epochs 5 --local-steps 10 --results-dir bench/results
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from typing import Any, Dict, List, Sequence

from tabulate import tabulate

from slimcomm import train

MAX_BYTES_RATIO = 1 / 8
MAX_ACC_GAP = 0.015


def ist_payload_numel(features: int, hidden: Sequence[int], classes: int, world: int) -> int:
    """Elements one rank sends per IST round (even blocks), from the slicing rules."""
    if any(h % world for h in hidden):
        raise ValueError(
            f"--hidden {list(hidden)}: the closed form needs widths divisible by {world}")
    n = features * hidden[0] // world + hidden[0] // world          # first Linear rows + bias
    for a, b in zip(hidden, hidden[1:]):
        n += a * b // (world * world) + b // world                 # hidden-to-hidden block + bias
    n += hidden[-1] * classes // world + classes   # last Linear columns + shared bias
    return n


def summarise(ddp: Dict[str, Any], ist: Dict[str, Any]) -> str:
    """Markdown report of the two runs; raises if they are not comparable."""
    for key in ("world_size", "steps", "steps_per_epoch"):
        if ddp[key] != ist[key]:
            raise ValueError(f"runs differ in {key}: ddp {ddp[key]} vs ist {ist[key]}")
    for key in ("hidden", "epochs", "batch_size", "lr", "momentum", "seed"):
        if ddp["config"][key] != ist["config"][key]:
            raise ValueError(
                f"runs differ in --{key}: {ddp['config'][key]} vs {ist['config'][key]}")
    world, steps = ist["world_size"], ist["steps"]
    local_steps = ist["config"]["local_steps"]
    hidden = ist["model"]["hidden"]
    features, classes = ist["dataset"]["features"], 10
    per_step = {r["method"]: r["final"]["bytes_sent_per_rank"] / r["steps"] for r in (ddp, ist)}
    analytic_round = 4 * ist_payload_numel(features, hidden, classes, world)
    rounds = ist["stats"]["rounds"]
    analytic_total = analytic_round * rounds
    ratio = per_step["ist"] / per_step["ddp"]
    gap = ddp["final"]["test_acc"] - ist["final"]["test_acc"]

    rows = []
    for r in (ddp, ist):
        f = r["final"]
        rows.append([
            r["method"], f"{f['test_acc']:.4f}", f"{per_step[r['method']] / 1e6:.3f}",
            f"{per_step[r['method']] / per_step['ddp']:.4f}",
            f"{f['bytes_sent_per_rank'] / 1e9:.2f}", f"{f['train_time_s']:.1f}",
            f"{1e3 * f['train_time_s'] / r['steps']:.1f}",
        ])
    head = ["method", "test acc", "MB/rank/step", "vs ddp", "GB/rank total", "train s", "ms/step"]
    epochs = [[e["epoch"], f"{d['test_acc']:.4f}", f"{e['test_acc']:.4f}"]
              for d, e in zip(ddp["epochs"], ist["epochs"])]
    cfg = ist["config"]
    lines = [
        "# IST vs DDP on Fashion-MNIST",
        "",
        f"MLP {features}-{'-'.join(map(str, hidden))}-{classes} "
        f"({ist['model']['num_params']:,} parameters, fp32), {world} ranks on gloo "
        f"(one host, loopback, {ist['env'].get('threads_per_rank')} thread(s) per rank), "
        f"{ist['dataset']['name']} ({ist['dataset']['train_samples_per_rank']} training samples "
        f"per rank, {ist['dataset']['test_samples']} test), {cfg['epochs']} epochs of "
        f"{ist['steps_per_epoch']} steps, batch {cfg['batch_size']} per rank, SGD lr {cfg['lr']} "
        f"momentum {cfg['momentum']}, seed {cfg['seed']}; IST local_steps = {local_steps} "
        f"({rounds} rounds, optimizer re-created each round, inputs of hidden/output layers "
        f"scaled by world_size in the subnets). torch {ist['env'].get('torch')}.",
        "",
        tabulate(rows, headers=head, tablefmt="github"),
        "",
        "Bytes: payload each rank hands to collectives (DDP: the all-reduce input, IST: its "
        "own all-gather buffer) per training step; a ring all-reduce puts 2(W-1)/W times "
        "this on each link, an all-gather (W-1) times. Times are wall-clock on the machine "
        "that ran this (see env in the JSONs); on a shared machine compare them only roughly.",
        "",
        f"IST analytic payload per round: {analytic_round:,} B (first/last layer 1/{world}, "
        f"hidden-to-hidden 1/{world}^2, biases sliced, output bias whole); x {rounds} rounds = "
        f"{analytic_total:,} B; measured {ist['final']['bytes_sent_per_rank']:,} B: "
        f"{'match' if analytic_total == ist['final']['bytes_sent_per_rank'] else 'MISMATCH'}.",
        "",
        "Test accuracy after each epoch:",
        "",
        tabulate(epochs, headers=["epoch", "ddp", "ist"], tablefmt="github"),
        "",
        "Targets (issue 4):",
        "",
        f"* IST bytes/rank/step <= 1/8 of DDP's: {ratio:.4f} (1/{1 / ratio:.1f}) -> "
        f"{'PASS' if ratio <= MAX_BYTES_RATIO else 'FAIL'}",
        f"* IST test accuracy within 1.5 points of DDP: gap {100 * gap:+.2f} points -> "
        f"{'PASS' if gap <= MAX_ACC_GAP else 'FAIL'}",
        "",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--hidden", default="2048,2048")
    p.add_argument("--local-steps", type=int, default=10)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train-subset", type=int, default=None,
                   help="use only this many training samples (all ranks together)")
    p.add_argument("--results-dir", "--out-dir", dest="out_dir", metavar="DIR",
                   default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out"),
                   help="output directory (bench/out/ is ignored by git; bench/results holds the "
                        "committed results)")
    p.add_argument("--from-json", nargs=2, metavar=("DDP_JSON", "IST_JSON"), default=None,
                   help="summarise these slimcomm.train results instead of training")
    args = p.parse_args(argv)

    raw_dir = os.path.join(args.out_dir, "ist_fmnist")
    os.makedirs(raw_dir, exist_ok=True)
    results: List[Dict[str, Any]] = []
    for method in ("ddp", "ist"):
        out = os.path.join(raw_dir, f"{method}.json")
        if args.from_json:
            src = args.from_json[0 if method == "ddp" else 1]
            if os.path.abspath(src) != os.path.abspath(out):
                shutil.copyfile(src, out)
        else:
            cmd = ["--method", method, "--dataset", "fashion-mnist", "--hidden", args.hidden,
                   "--epochs", str(args.epochs), "--world-size", str(args.world_size),
                   "--batch-size", str(args.batch_size), "--lr", str(args.lr),
                   "--momentum", str(args.momentum), "--seed", str(args.seed),
                   "--local-steps", str(args.local_steps), "--out", out, "--no-progress"]
            if args.train_subset:
                cmd += ["--train-subset", str(args.train_subset)]
            train.main(cmd)
        with open(out) as f:
            results.append(json.load(f))
        if results[-1]["method"] != method:
            raise ValueError(f"{out} holds a {results[-1]['method']!r} run, expected {method!r}")
    report = summarise(*results)
    path = os.path.join(args.out_dir, "ist_fmnist.md")
    with open(path, "w") as f:
        f.write(report)
    print(report)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
