"""Mean over ranks of bench/hook_breakdown/sitecustomize.py's per-rank files, as a table."""

import argparse
import collections
import pathlib
import statistics

from tabulate import tabulate


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("dir", type=pathlib.Path, help="the SLIMPROF_DIR of the run")
    args = p.parse_args()
    ms, calls = collections.defaultdict(list), {}
    for f in sorted(args.dir.glob("rank*.txt")):
        for line in f.read_text().splitlines():
            name, mean, n = line.split("\t")
            ms[name].append(float(mean))
            calls[name] = int(n)
    rows = [(k, f"{statistics.mean(v):.2f}", f"{max(v):.2f}", calls[k]) for k, v in ms.items()]
    print(tabulate(rows, headers=("phase", "ms per call, mean over ranks", "max over ranks", "calls (rank 0)"),
                   tablefmt="github"))


if __name__ == "__main__":
    main()
