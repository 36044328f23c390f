#!/usr/bin/env python3
"""Kernel benchmark: every slimcomm op against its plain-PyTorch path, same run.

For each size N and density (k or m as a fraction of N) the op and its
reference are timed alternately (op, reference, op, reference, ...) after a
warm-up, so background load hits both alike; the table reports medians.

| op | reference (what a pure-PyTorch Slim-DP / IST implementation does) |
|---|---|
| significance_topk | ``torch.topk(w.abs() * g.abs(), k)`` + sort of its indices + gather of g |
| significance_topk_segmented | a Python loop of ``torch.topk`` per parameter of an MLP-like bucket |
| explore_sample (exclude = a 1% core set) | mask + ``nonzero`` + ``randperm(...)[:m]`` + sort |
| pack | ``src.index_select(0, idx)`` |
| unpack / unpack (accumulate) | ``dst.index_copy_(0, idx, v)`` / ``dst.index_add_(0, idx, v)`` |
| gather_slices / scatter_slices | ``W[rows[:, None], cols]`` / ``W[rows[:, None], cols] = block`` (half the rows and columns, an IST subnet of 2 workers) |

Columns: ``ms`` (median of the op), ``GB/s`` (bytes every op must move --
inputs read once, outputs written once -- divided by ``ms``), ``ref ms``,
``speedup`` (= ref ms / ms). With ``--device cuda`` also ``copy %``: the op's
GB/s as a fraction of a device-to-device copy moving the same number of bytes
(times with CUDA events).

Writes ``<out>/<device>-kernels-<YYYY-MM-DD>.md`` and ``.json`` (with torch
version, thread count, CPU / GPU model) and prints the table.

Examples::

    .venv/bin/python bench/kernels.py --device cpu
    python bench/kernels.py --device cuda --sizes 1e5,1e6,1e7,1e8,5e8
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, List, Optional

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from slimcomm import ops  # noqa: E402

try:
    from tabulate import tabulate
except ImportError:  # pragma: no cover - tabulate is a dependency of slimcomm
    tabulate = None

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

# Issue 2 acceptance targets (CPU, 2 cores): (op, N, density) -> minimum speedup.
TARGETS = {("significance_topk", 10**7, 0.01): 5.0, ("explore_sample", 10**7, 0.01): 10.0}


@dataclass(frozen=True)
class Case:
    """One benchmark row: ``run`` and ``ref`` do the same job; ``nbytes`` is
    what must be read once and written once."""

    op: str
    n: int
    density: float
    nbytes: int
    run: Callable[[], object] = field(repr=False, compare=False)
    ref: Callable[[], object] = field(repr=False, compare=False)


@dataclass
class Row:
    op: str
    n: int
    density: float
    count: int
    ms: float
    gbps: float
    ref_ms: float
    speedup: float
    ms_iqr: List[float]
    ref_ms_iqr: List[float]
    copy_frac: Optional[float] = None


# ---------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------

class Clock:
    """Wall time of one call: perf_counter on CPU, CUDA events on a GPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn: Callable[[], object]) -> float:
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)
            stop = torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn()
            stop.record()
            torch.cuda.synchronize()
            return start.elapsed_time(stop)
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3


def quartiles(xs: List[float]) -> List[float]:
    if len(xs) < 4:
        return [min(xs), max(xs)]
    q = statistics.quantiles(xs, n=4)
    return [q[0], q[2]]


def time_pair(clock: Clock, case: Case, repeats: int, warmup: int):
    for _ in range(warmup):
        case.run()
        case.ref()
    a, b = [], []
    for _ in range(repeats):  # alternate, so load spikes hit both sides alike
        a.append(clock(case.run))
        b.append(clock(case.ref))
    return a, b


# ---------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------

def mlp_layout(n: int) -> List[int]:
    """Segment sizes of a DDP bucket holding an MLP 784-h-h-10 of about n parameters
    (weights and biases back to back: large and tiny segments mixed)."""
    # n = 784 h + h + h^2 + h + 10 h + 10  ->  solve for h.
    h = max(1, int((-796 + math.sqrt(796**2 + 4 * max(0, n - 10))) / 2))
    return [h * 784, h, h * h, h, 10 * h, 10]


def build_cases(n: int, density: float, dtype: torch.dtype, device: torch.device, which: set,
                with_slices: bool) -> List[Case]:
    """The cases of one (N, density); the slice ops (no density) only when with_slices."""
    g = torch.Generator(device="cpu").manual_seed(n)
    es = torch.empty((), dtype=dtype).element_size()
    w = torch.randn(n, generator=g).to(dtype).to(device)
    gr = (torch.randn(n, generator=g) * 1e-3).to(dtype).to(device)
    k = max(1, int(n * density))
    cases = []

    if "significance_topk" in which:
        def topk_ref():
            idx = torch.topk(w.abs() * gr.abs(), k, sorted=False).indices.sort().values
            return idx, gr[idx]
        cases.append(Case("significance_topk", n, density, 2 * n * es + k * (8 + es),
                          lambda: ops.significance_topk(w, gr, k), topk_ref))

    if "significance_topk_segmented" in which:
        sizes = mlp_layout(n)
        offsets = [0]
        for s in sizes:
            offsets.append(offsets[-1] + s)
        nn_ = offsets[-1]  # <= n by construction of mlp_layout
        ws, gs = w[:nn_], gr[:nn_]
        ks = [max(1, int(s * density)) if s else 0 for s in sizes]

        def seg_ref():
            score = ws.abs() * gs.abs()
            parts = [torch.topk(score[lo:hi], kk, sorted=False).indices.sort().values + lo
                     for lo, hi, kk in zip(offsets[:-1], offsets[1:], ks)]
            idx = torch.cat(parts)
            return idx, gs[idx]
        cases.append(Case("significance_topk_segmented", nn_, density, 2 * nn_ * es + sum(ks) * (8 + es),
                          lambda: ops.significance_topk_segmented(ws, gs, offsets, ks), seg_ref))

    if "explore_sample" in which:
        # Exclude a 1% core set (as Slim-DP does), sample m = density * n of the rest.
        core = torch.randperm(n, generator=g)[: n // 100].sort().values.to(device)
        m = min(k, n - core.numel())
        rg = torch.Generator(device=device).manual_seed(1)

        def explore_ref():
            mask = torch.ones(n, dtype=torch.bool, device=device)
            mask[core] = False
            cand = mask.nonzero().squeeze(1)
            pick = cand[torch.randperm(cand.numel(), generator=rg, device=device)[:m]]
            return pick.sort().values
        cases.append(Case("explore_sample", n, density, core.numel() * 8 + m * 8,
                          lambda: ops.explore_sample(n, core, m, 1234, 5), explore_ref))

    idx = torch.randperm(n, generator=g)[:k].sort().values.to(device)
    vals = gr[idx].clone()
    dst = w.clone()
    if "pack" in which:
        cases.append(Case("pack", n, density, k * (8 + 2 * es),
                          lambda: ops.pack(gr, idx), lambda: gr.index_select(0, idx)))
    if "unpack" in which:
        cases.append(Case("unpack", n, density, k * (8 + 2 * es),
                          lambda: ops.unpack(dst, idx, vals), lambda: dst.index_copy_(0, idx, vals)))
    if "unpack_acc" in which:
        cases.append(Case("unpack (accumulate)", n, density, k * (8 + 3 * es),
                          lambda: ops.unpack(dst, idx, vals, True), lambda: dst.index_add_(0, idx, vals)))

    if with_slices and {"gather_slices", "scatter_slices"} & which:
        side = int(math.isqrt(n))
        W = w[: side * side].view(side, side)
        rows = torch.randperm(side, generator=g)[: side // 2].to(device)
        cols = torch.randperm(side, generator=g)[: side // 2].to(device)
        blk = W[rows[:, None], cols].clone()
        nb = blk.numel() * es * 2 + (rows.numel() + cols.numel()) * 8
        if "gather_slices" in which:
            cases.append(Case("gather_slices", side * side, 0.25, nb,
                              lambda: ops.gather_slices(W, rows, cols), lambda: W[rows[:, None], cols]))
        if "scatter_slices" in which:
            def scatter_ref():
                W[rows[:, None], cols] = blk
            cases.append(Case("scatter_slices", side * side, 0.25, nb,
                              lambda: ops.scatter_slices(W, rows, cols, blk), scatter_ref))
    return cases


ALL_OPS = ["significance_topk", "significance_topk_segmented", "explore_sample", "pack", "unpack",
           "unpack_acc", "gather_slices", "scatter_slices"]


def copy_ms(clock: Clock, nbytes: int, device: torch.device, repeats: int) -> float:
    """Median time of a device-to-device copy that reads nbytes/2 and writes nbytes/2."""
    n = max(1, nbytes // 8)  # float32 elements per side
    a = torch.empty(n, device=device)
    b = torch.empty(n, device=device)
    b.copy_(a)
    return statistics.median(clock(lambda: b.copy_(a)) for _ in range(repeats))


# ---------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------

def machine_info(device: torch.device) -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        commit = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    info = {
        "date": dt.date.today().isoformat(),
        "device": str(device),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "cpu": cpu,
        "python": platform.python_version(),
        "git_commit": commit,
        "loadavg_start": list(os.getloadavg()),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def fmt_n(n: int) -> str:
    """1e7 for exact powers of ten (times a small integer), else the integer."""
    if n >= 10**5:
        e = int(math.log10(n))
        if n % 10**e == 0:
            return f"{n // 10**e}e{e}"
    return f"{n:,}"


def table(rows: List[Row], cuda: bool):
    headers = ["op", "N", "k/N", "count", "ms", "GB/s", "ref ms", "speedup"]
    if cuda:
        headers.append("copy %")
    body = []
    for r in rows:
        line = [r.op, fmt_n(r.n), f"{r.density:g}", r.count, f"{r.ms:.3f}", f"{r.gbps:.2f}",
                f"{r.ref_ms:.3f}", f"{r.speedup:.1f}x"]
        if cuda:
            line.append("" if r.copy_frac is None else f"{100 * r.copy_frac:.0f}%")
        body.append(line)
    if tabulate is not None:
        return tabulate(body, headers=headers, tablefmt="github", disable_numparse=True)
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(x) for x in b) + " |" for b in body]
    return "\n".join(lines)


def target_lines(rows: List[Row], device: torch.device) -> List[str]:
    out = []
    if device.type != "cpu":
        return out
    for (op, n, dens), want in TARGETS.items():
        hit = [r for r in rows if r.op == op and r.n == n and abs(r.density - dens) < 1e-12]
        if not hit:
            continue
        r = hit[0]
        verdict = "met" if r.speedup >= want else "MISSED"
        out.append(f"- {op} N={fmt_n(n)} k={dens:.0%}: {r.speedup:.1f}x faster than the reference "
                   f"({r.ms:.1f} ms vs {r.ref_ms:.1f} ms); target >= {want:g}x: {verdict}")
    return out


def parse_sizes(s: str) -> List[int]:
    return [int(float(x)) for x in s.split(",") if x.strip()]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--sizes", default="1e5,1e6,1e7", type=parse_sizes,
                   help="comma-separated N (default 1e5,1e6,1e7; on cuda e.g. up to 5e8)")
    p.add_argument("--densities", default="0.01,0.1",
                   type=lambda s: [float(x) for x in s.split(",")],
                   help="k (or m) as a fraction of N (default 0.01,0.1)")
    p.add_argument("--ops", default=",".join(ALL_OPS),
                   help=f"comma-separated subset of {','.join(ALL_OPS)}")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--repeats", type=int, default=11, help="timed repeats per case (median reported)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--results-dir", "--out", dest="out", metavar="DIR", default=os.path.join(REPO, "bench", "out"),
                   help="directory for the .md/.json results (default bench/out/, ignored by git; "
                        "--results-dir bench/results for the committed results; '' to skip writing)")
    p.add_argument("--tag", default="", help="suffix of the result file names (e.g. '1thread')")
    args = p.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available")
    if args.threads:
        torch.set_num_threads(args.threads)
    which = {o.strip() for o in args.ops.split(",") if o.strip()}
    unknown = which - set(ALL_OPS)
    if unknown:
        p.error(f"--ops: unknown {sorted(unknown)}; choose from {ALL_OPS}")
    dtype = DTYPES[args.dtype]
    clock = Clock(device)
    info = machine_info(device)
    print(f"slimcomm kernel benchmark on {info['device']} ({info.get('gpu', info['cpu'])}), "
          f"torch {info['torch']}, {info['threads']} threads, dtype {args.dtype}, "
          f"median of {args.repeats}", flush=True)

    rows: List[Row] = []
    for n in args.sizes:
        for j, dens in enumerate(args.densities):
            for case in build_cases(n, dens, dtype, device, which, with_slices=j == 0):
                a, b = time_pair(clock, case, args.repeats, args.warmup)
                ms, rms = statistics.median(a), statistics.median(b)
                row = Row(case.op, case.n, case.density, int(case.n * case.density), ms,
                          case.nbytes / (ms * 1e6), rms, rms / ms, quartiles(a), quartiles(b))
                if device.type == "cuda":
                    row.copy_frac = copy_ms(clock, case.nbytes, device, args.repeats) / ms
                rows.append(row)
                print(f"  {row.op:<28} N={fmt_n(row.n):>10} k/N={row.density:<5g} {ms:10.3f} ms "
                      f"(ref {rms:10.3f} ms, {row.speedup:6.1f}x)", flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()

    tab = table(rows, device.type == "cuda")
    targets = target_lines(rows, device)
    print()
    print(tab)
    if targets:
        print()
        print("\n".join(targets))

    if args.out:
        os.makedirs(args.out, exist_ok=True)
        stem = os.path.join(args.out, f"{device.type}-kernels-{info['date']}"
                            + (f"-{args.tag}" if args.tag else ""))
        meta = dict(info, loadavg_end=list(os.getloadavg()), dtype=args.dtype, repeats=args.repeats, warmup=args.warmup,
                    command=" ".join([os.path.basename(sys.argv[0])] + (argv if argv is not None else sys.argv[1:])))
        with open(stem + ".json", "w") as f:
            json.dump({"meta": meta, "rows": [asdict(r) for r in rows]}, f, indent=1)
        with open(stem + ".md", "w") as f:
            f.write(f"# slimcomm kernels on {device.type}, {info['date']}\n\n")
            f.write(f"`{meta['command']}` -- torch {info['torch']}, {info['threads']} threads "
                    f"({info['cpu_count']} CPUs, {info['cpu']}"
                    + (f"; GPU {info['gpu']}" if "gpu" in info else "")
                    + f"), dtype {args.dtype}, median of {args.repeats} alternating op/reference "
                    f"repeats after {args.warmup} warm-up, git {info['git_commit']}. "
                    f"Load average (1 min) {meta['loadavg_start'][0]:.1f} at the start, "
                    f"{meta['loadavg_end'][0]:.1f} at the end: above the CPU count, other "
                    f"processes competed for the cores and the times are inflated.\n\n"
                    if max(meta['loadavg_start'][0], meta['loadavg_end'][0]) > (info['cpu_count'] or 1)
                    else f"repeats after {args.warmup} warm-up, git {info['git_commit']}. "
                    f"Load average (1 min) {meta['loadavg_start'][0]:.1f} / {meta['loadavg_end'][0]:.1f} "
                    f"at start / end.\n\n")
            f.write("ms = median time of the slimcomm op; GB/s = bytes read once + written once / ms; "
                    "ref ms = the plain-PyTorch path (see bench/kernels.py); speedup = ref ms / ms. "
                    "count = k or m (for the slice ops: N/4, half the rows and columns).\n\n")
            f.write(tab + "\n")
            if targets:
                f.write("\nIssue 2 targets:\n\n" + "\n".join(targets) + "\n")
        print(f"\nwrote {stem}.md and {stem}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
