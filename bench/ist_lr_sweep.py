#!/usr/bin/env python3
"""IST learning-rate sweep over world sizes: is there one lr that works at every W?

Runs ``slimcomm.train --method ist`` on the Fashion-MNIST MLP (784-2048-2048-10)
for every (world size, lr, update) of the grid, on gloo ranks of this host
(loopback; accuracy and steps, not time, are what this measures), with the
per-rank work fixed across world sizes as in ``bench/scale_sweep.sh`` (batch 32
and a 7,500-image shard per rank). ``update`` is ``scaled`` (the default
``ISTTrainer(scale_grads=True)``: each sliced tensor's gradient times its
share of the tensor) or ``raw`` (``--no-scale-grads``: the original IST
update). Writes ``<out-dir>/lr_sweep.md`` (test accuracy after each
evaluation, NaN marked ``diverged``) and the raw JSONs under
``<out-dir>/lr_sweep/``; runs whose JSON exists are reused.

Example (the committed table)::

    .venv/bin/python bench/ist_lr_sweep.py --out-dir bench/results/ist_scaling \\
        --worlds 2,4,8 --lrs 0.02,0.05,0.1,0.2 --raw-lrs 0.01,0.05 -- --epochs 2 --eval-every 117
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import sys
from typing import Any, Dict, List, Optional, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from slimcomm import train  # noqa: E402


def _floats(s: str) -> List[float]:
    return [float(v) for v in s.split(",") if v.strip()]


def _ints(s: str) -> List[int]:
    return [int(v) for v in s.split(",") if v.strip()]


def run_name(world: int, lr: float, update: str) -> str:
    return f"w{world}_lr{lr:g}_{update}"


def _cell(res: Optional[Dict[str, Any]]) -> str:
    if res is None:
        return "-"
    if "diverged" in res:
        m = re.search(r"at step (\d+)", res["diverged"])
        return f"diverged (loss NaN/inf at step {m.group(1)})" if m else "diverged"
    evals = res.get("evals") or []
    accs = [e.get("test_acc") for e in evals]
    losses = [e.get("test_loss") for e in evals]
    if any(v is None or (isinstance(v, float) and not math.isfinite(v)) for v in losses) \
            or not math.isfinite(res["final"].get("test_loss", float("nan"))):
        first = next((e["step"] for e, v in zip(evals, losses)
                      if v is None or not math.isfinite(v)), res["steps"])
        return f"diverged (NaN by step {first})"
    return " / ".join(f"{a:.3f}" for a in accs)


def summarise(results: Dict[str, Dict[str, Any]], worlds: Sequence[int], lrs: Sequence[float],
              raw_lrs: Sequence[float], command: str, extra: Sequence[str]) -> str:
    any_res = next(r for r in results.values() if "diverged" not in r)
    steps = [e["step"] for e in any_res.get("evals", [])]
    lines = [
        "# IST: one learning rate for every world size",
        "",
        f"Fashion-MNIST MLP 784-2048-2048-10, batch {any_res['config']['batch_size']} and "
        f"{any_res['dataset']['train_samples_per_rank']} training images per rank at every W, SGD momentum "
        f"{any_res['config']['momentum']} (re-created every round), local_steps "
        f"{any_res['config']['local_steps']}, seed {any_res['config']['seed']}, gloo on one host. "
        f"Cells: test accuracy at steps {' / '.join(map(str, steps))}. `scaled` = ISTTrainer's default "
        "(`scale_grads=True`: each sliced tensor's gradient times its share of the tensor, "
        "W**-k); `raw` = `--no-scale-grads` (the original IST update).",
        "",
        f"Command: `{command}`",
        "",
        "| update | lr | " + " | ".join(f"W={w}" for w in worlds) + " |",
        "|---|---|" + "---|" * len(worlds),
    ]
    for update, grid in (("scaled", lrs), ("raw", raw_lrs)):
        for lr in grid:
            cells = [_cell(results.get(run_name(w, lr, update))) for w in worlds]
            lines.append(f"| {update} | {lr:g} | " + " | ".join(cells) + " |")
    lines.append("")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: List[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", type=_ints, default=[2, 4, 8])
    p.add_argument("--lrs", type=_floats, default=[0.02, 0.05, 0.1, 0.2])
    p.add_argument("--raw-lrs", type=_floats, default=[0.01, 0.05])
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--shard", type=int, default=7500, help="training images per rank")
    p.add_argument("--out-dir", default=os.path.join(REPO, "bench", "out", "ist_scaling"))
    args = p.parse_args(argv)
    raw_dir = os.path.join(args.out_dir, "lr_sweep")
    os.makedirs(raw_dir, exist_ok=True)
    results: Dict[str, Dict[str, Any]] = {}
    jobs = [(w, lr, "scaled") for lr in args.lrs for w in args.worlds]
    jobs += [(w, lr, "raw") for lr in args.raw_lrs for w in args.worlds]
    for w, lr, update in jobs:
        name = run_name(w, lr, update)
        out = os.path.join(raw_dir, f"{name}.json")
        if not os.path.exists(out):
            cmd = ["--method", "ist", "--world-size", str(w), "--lr", str(lr),
                   "--batch-size", str(args.batch_size), "--train-subset", str(args.shard * w),
                   "--out", out, "--no-progress", "--quiet", *extra]
            if update == "raw":
                cmd.append("--no-scale-grads")
            print(f"ist_lr_sweep: {name}", flush=True)
            try:
                train.main(cmd)
            except (SystemExit, Exception) as exc:  # noqa: BLE001 - a diverged run must not stop the sweep
                print(f"ist_lr_sweep: {name} failed: {exc!r}", flush=True)
                if "became" in str(exc):   # train.py: "training loss became nan at step N"
                    with open(out + ".diverged", "w") as f:
                        f.write(str(exc))
        if os.path.exists(out):
            with open(out) as f:
                results[name] = json.load(f)
        elif os.path.exists(out + ".diverged"):
            with open(out + ".diverged") as f:
                results[name] = {"diverged": f.read()}
    if not results:
        raise SystemExit("no run finished")
    command = "bench/ist_lr_sweep.py " + " ".join(shlex.quote(a) for a in argv)
    if extra:
        command += " -- " + " ".join(shlex.quote(a) for a in extra)
    report = summarise(results, args.worlds, args.lrs, args.raw_lrs, command, extra)
    path = os.path.join(args.out_dir, "lr_sweep.md")
    with open(path, "w") as f:
        f.write(report)
    print(report)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
