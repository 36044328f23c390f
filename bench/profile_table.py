#!/usr/bin/env python3
"""The step profile of ``slimcomm.train --profile`` runs as a table (issue 31, item 1).

Reads every results JSON with a ``"profile"`` in the given netbench results folders
(``bench/netbench.py ... -- --profile``) and prints, per link rate, one row per method:
the mean over the ranks of each phase (ms per step; ``slimcomm.train.profile`` defines
them), the step, and how far the step is above the step of ``--method local`` (no
communication, the same model and batch) when that method ran at the same rate.

    bench/profile_table.py bench/results/scale/profile_mlp_8ranks [--out FILE.md]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys

from tabulate import tabulate

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from slimcomm.train.profile import PHASES  # noqa: E402


def load(dirs):
    """``{rate: {label: result}}`` of the results with a profile (label: the file's)."""
    out = {}
    for d in dirs:
        for path in sorted(glob.glob(os.path.join(d, "*.json"))):
            with open(path) as f:
                try:
                    r = json.load(f)
                except json.JSONDecodeError:
                    continue
            if not isinstance(r, dict) or not r.get("profile"):
                continue
            stem = os.path.basename(path)[:-5]
            rate, sep, label = stem.partition("_")
            if not sep:  # slimcomm.train --profile's own --out-dir: METHOD.json, no rate
                rate, label = "loopback", stem
            m = re.fullmatch(r"(.+)_s(\d+)", label)  # netbench's per-seed files: LABEL_sSEED
            if m:
                label = m.group(1) if m.group(2) == "0" else f"{m.group(1)} (seed {m.group(2)})"
            out.setdefault(rate, {})[label] = r
    return out


def table(runs, fmt="github") -> str:
    rows = []
    local = runs.get("local")
    base = local["profile"]["mean"]["step"] if local else None
    for label, r in sorted(runs.items(), key=lambda kv: kv[1]["profile"]["mean"]["step"]):
        mean, mx = r["profile"]["mean"], r["profile"]["max"]
        row = [label] + [f"{mean[p]:.1f}" if p in mean else "-" for p in PHASES]
        row.append(f"{mx['wait']:.1f}" if "wait" in mx else "-")
        row.append(f"{mean['step'] - base:+.1f} ({mean['step'] / base:.2f}x)" if base else "-")
        rows.append(row)
    head = ["method"] + [f"{p} ms" for p in PHASES] + ["max wait ms", "vs local"]
    return tabulate(rows, head, tablefmt=fmt)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dirs", nargs="+", help="netbench results folders")
    ap.add_argument("--out", default=None, help="also write the tables to this Markdown file")
    args = ap.parse_args(argv)
    by_rate = load(args.dirs)
    if not by_rate:
        raise SystemExit(f"error: no results with a 'profile' in {', '.join(args.dirs)} "
                         f"(run slimcomm.train with --profile)")
    parts = []
    for rate in sorted(by_rate):
        any_run = next(iter(by_rate[rate].values()))
        prof = any_run["profile"]
        parts.append(f"### {rate} per link ({any_run['world_size']} ranks, mean over ranks of each "
                     f"rank's mean over {prof['steps'] - prof['skip']} steps)\n\n"
                     + table(by_rate[rate]) + "\n")
    text = "\n".join(parts)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
