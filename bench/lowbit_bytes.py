"""Wire bytes per rank of SlimDPOptimizer's dense 2-bit codes at 2, 4 and 8 ranks: the
two-stage all-reduce (``lowbit_collective="all_reduce"``) beside the all-gather.

For each world size it runs ``bench/netbench.py`` (root: network namespaces, one
veth per rank, the kernel's byte counters) on the GPT default with
``--method slimdp-local`` twice (``--lowbit-collective all_reduce`` / ``all_gather``)
for a short run, then reads, per run, the steady bytes of one synchronisation on
rank 0's interface (median over the synchronising steps, TX + RX, Ethernet/IP/TCP
headers included) and the payload of one rank's codes (the all-gather's
``bytes_sent`` per synchronisation: flags, bf16 scales and 2-bit codes). The bound
of a bandwidth-optimal all-reduce is ``2 (W-1)/W`` x that payload each way.

    sudo .venv/bin/python bench/lowbit_bytes.py

writes bench/results/lowbit_bytes.md (+ the runs under bench/results/lowbit_bytes/).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from tabulate import tabulate

HERE = os.path.dirname(os.path.abspath(__file__))
VARIANTS = {"slimdp-local": "all_reduce", "slimdp-local@gather": "all_gather"}


def run(world_size: int, steps: int, rate: str, out: str, port: int) -> None:
    cmd = [sys.executable, os.path.join(HERE, "netbench.py"), "--world-size", str(world_size),
           "--rates", rate, "--port", str(port), "--methods", ",".join(VARIANTS),
           "--method-args", "slimdp-local@gather=--lowbit-collective all_gather",
           "--results-dir", out, "--name", f"w{world_size}", "--",
           "--model", "gpt", "--steps", str(steps), "--eval-every", str(steps)]
    subprocess.run(cmd, check=True)


def summarise(path: str, sync_every: int):
    with open(path) as f:
        r = json.load(f)
    per = r["wire"][0]["per_step_bytes"]
    syncs = [b for i, b in enumerate(per, 1) if i % sync_every == 0]
    wire = statistics.median(syncs[2:])  # past the first connections
    payload = r["final"]["bytes_sent_per_rank"] / (r["steps"] // sync_every)
    return r["world_size"], wire, payload


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-sizes", default="2,4,8")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--rate", default="10gbit")
    p.add_argument("--reuse", action="store_true", help="only summarise existing runs")
    p.add_argument("--out", default=os.path.join(HERE, "results", "lowbit_bytes"))
    a = p.parse_args(argv)
    sizes = [int(w) for w in a.world_sizes.split(",")]
    if not a.reuse:
        for i, w in enumerate(sizes):
            run(w, a.steps, a.rate, a.out, 29900 + 10 * i)
    rows, base = [], {}
    for w in sizes:
        got = {}
        for label, coll in VARIANTS.items():
            got[coll] = summarise(os.path.join(a.out, f"w{w}", f"{a.rate}_{label}.json"), 3)
        code = got["all_gather"][2]  # one rank's codes, flags and scales per sync
        bound = 2 * (w - 1) / w * code
        for coll in ("all_reduce", "all_gather"):
            _, wire, payload = got[coll]
            base.setdefault(coll, wire / 2)
            rows.append([w, coll, f"{code / 1e6:.4f}", f"{payload / 1e6:.4f}",
                         f"{wire / 2 / 1e6:.4f}", f"{bound / 1e6:.4f}",
                         f"{wire / 2 / bound:.3f}", f"{wire / 2 / base[coll]:.2f}x"])
    head = ["W", "lowbit_collective", "one rank's codes MB/sync", "bytes_sent MB/sync",
            "wire MB/sync each way (rank 0, (TX+RX)/2)", "2(W-1)/W x codes MB",
            "wire / bound", "wire vs W=2"]
    text = ("## Dense 2-bit codes: wire bytes per rank per synchronisation, two-stage all-reduce "
            "vs all-gather\n\nGPT default (945,792 parameters), SlimDPOptimizer dense 2-bit codes, "
            f"H = 3, {a.steps} steps on tbf-limited veth links at {a.rate} "
            "(bench/netbench.py; one network namespace per rank, a bridge for W > 2). Wire = "
            "rank 0's interface counters over one synchronising step (median over the run "
            "past the first two), Ethernet/IP/TCP headers included, halved (TX + RX). The "
            "bound: a bandwidth-optimal all-reduce of one rank's codes, 2(W-1)/W x their "
            "size, each way.\n\nCommand: `sudo .venv/bin/python bench/lowbit_bytes.py "
            f"--world-sizes {a.world_sizes} --steps {a.steps} --rate {a.rate}`\n\n"
            + tabulate(rows, head, tablefmt="github") + "\n")
    print(text)
    with open(a.out + ".md", "w") as f:
        f.write(text)


if __name__ == "__main__":
    sys.exit(main())
