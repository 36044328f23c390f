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
| sgd_apply_indexed (MLP-like bucket, core + explore runs) | ``flat.index_add_(0, idx, v, alpha=-lr)`` |
| step_commit (old G; the hook's commit under ``fuse_sgd``) | ``old = G.index_select(0, idx)`` + ``G.index_copy_(0, idx, v)`` |
| gather_slices / scatter_slices | ``W[rows[:, None], cols]`` / ``W[rows[:, None], cols] = block`` (half the rows and columns, an IST subnet of 2 workers) |

significance_topk also runs on tied scores (``--tied``, default
``zero_grad,zero_weight``: an all-zero gradient, and an all-zero weight as in a
zero-initialised layer; both make every product score 0), the rows
``significance_topk [zero grad]`` / ``[zero weight]`` beside the random-data
row. Every significance_topk row also reports its peak memory (``--peak``,
on by default): on CPU the peak RSS above the inputs of ONE call in a fresh
subprocess (the peak mark is reset through ``/proc/self/clear_refs`` just
before the call, so it counts everything the kernel allocates, C++ included,
and the outputs), on CUDA ``torch.cuda.max_memory_allocated`` above the
inputs; the same for the reference. ``vs random`` is a tied row's time and
peak memory as multiples of the random row's (same N, density, run).

Columns: ``ms`` (median of the op), ``GB/s`` (bytes every op must move --
inputs read once, outputs written once -- divided by ``ms``), ``ref ms``,
``speedup`` (= ref ms / ms). With ``--device cuda`` also ``copy ms`` (a
device-to-device copy moving the same number of bytes, the bandwidth floor)
and ``copy %``: the op's GB/s as a fraction of that copy's (times with CUDA
events). For significance_topk the reference is the ``torch.topk`` path. A
``cub::DeviceTopK`` column needs a CUB that has it (CCCL 3.1+; the CUDA 13.0
toolkit's does not): the result header says whether the toolkit has one.

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
# Issue 13: tied scores cost at most this multiple of random data's time and peak memory.
TIED_TARGET = 1.5
TIED_KINDS = {"zero_grad": "zero grad", "zero_weight": "zero weight"}


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
    inputs: str = ""  # significance_topk: "random" or a TIED_KINDS key (peak memory measured)


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
    inputs: str = ""
    peak_mb: Optional[float] = None      # peak memory of one call above the inputs (MB)
    ref_peak_mb: Optional[float] = None
    time_vs_random: Optional[float] = None  # tied rows: ms / ms of the random row
    mem_vs_random: Optional[float] = None   # tied rows: peak_mb / peak_mb of the random row


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


def base_inputs(n: int, dtype: torch.dtype, device: torch.device):
    """(generator, weight, grad) of the random-data cases of size n."""
    g = torch.Generator(device="cpu").manual_seed(n)
    w = torch.randn(n, generator=g).to(dtype).to(device)
    gr = (torch.randn(n, generator=g) * 1e-3).to(dtype).to(device)
    return g, w, gr


def topk_inputs(n: int, dtype: torch.dtype, device: torch.device, inputs: str):
    """(weight, grad) of a significance_topk row: random, or tied (TIED_KINDS)."""
    _, w, gr = base_inputs(n, dtype, device)
    if inputs == "zero_grad":
        gr = torch.zeros_like(gr)
    elif inputs == "zero_weight":
        w = torch.zeros_like(w)
    elif inputs != "random":
        raise ValueError(inputs)
    return w, gr


def topk_pair(w: torch.Tensor, gr: torch.Tensor, k: int):
    """(op, reference) callables of significance_topk on (w, gr)."""
    def ref():
        idx = torch.topk(w.abs() * gr.abs(), k, sorted=False).indices.sort().values
        return idx, gr[idx]
    return (lambda: ops.significance_topk(w, gr, k)), ref


def build_cases(n: int, density: float, dtype: torch.dtype, device: torch.device, which: set,
                with_slices: bool, tied: List[str] = ()) -> List[Case]:
    """The cases of one (N, density); the slice ops (no density) only when with_slices;
    significance_topk also on each input kind of ``tied``."""
    g, w, gr = base_inputs(n, dtype, device)
    es = torch.empty((), dtype=dtype).element_size()
    k = max(1, int(n * density))
    cases = []

    if "significance_topk" in which:
        for inputs in ["random"] + list(tied):
            tw, tg = (w, gr) if inputs == "random" else topk_inputs(n, dtype, device, inputs)
            run, ref = topk_pair(tw, tg, k)
            name = "significance_topk" + ("" if inputs == "random" else f" [{TIED_KINDS[inputs]}]")
            cases.append(Case(name, n, density, 2 * n * es + k * (8 + es), run, ref, inputs))

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

    if {"sgd_apply_indexed", "step_commit"} & which:
        # The hook's index set over an MLP-like bucket: a core and an explore set, each
        # ascending (two runs, as the selection ops give), k values each, sparse enough that
        # nearly every index touches its own cache line of the parameters or G.
        sizes = mlp_layout(n)
        nn_ = sum(sizes)
        offs = torch.tensor([0] + torch.tensor(sizes).cumsum(0).tolist(), device=device)
        pick = torch.randperm(nn_, generator=g)[: 2 * max(1, int(nn_ * density) // 2)]
        half = pick.numel() // 2
        hidx = torch.cat([pick[:half].sort().values, pick[half:].sort().values]).to(device)
        kk = hidx.numel()
        S = len(sizes)
        avg = torch.cat([gr[:kk], torch.ones(S, dtype=dtype, device=device)])
        flat = w[:nn_].clone()
        params = list(torch.split(flat, sizes))
        if "sgd_apply_indexed" in which:
            cases.append(Case("sgd_apply_indexed", nn_, density, kk * (8 + 3 * es),
                              lambda: ops.sgd_apply_indexed(params, hidx, offs, avg, 1e-3),
                              lambda: flat.index_add_(0, hidx, avg[:kk], alpha=-1e-3)))
        if "step_commit" in which:
            G = torch.zeros(nn_, dtype=torch.float32, device=device)
            cnt = torch.zeros(2, dtype=torch.int64, device=device)
            gbuf = gr[:nn_]
            gvals = avg[:kk].float()

            def commit_ref():
                old = G.index_select(0, hidx)
                G.index_copy_(0, hidx, gvals)
                return old
            # the DDP hook's commit under fuse_sgd: G <- the averages at the index set and the
            # old values returned for the undo of a void step; the bucket is not written
            cases.append(Case("step_commit (old G)", nn_, density, kk * (8 + es + 8),
                              lambda: ops.step_commit(gbuf, hidx, offs, avg, cnt, G=G,
                                                      return_old_g=True, keep_all_zero=True,
                                                      write_buf=False),
                              commit_ref))

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
           "unpack_acc", "sgd_apply_indexed", "step_commit", "gather_slices", "scatter_slices"]


def vm_hwm() -> int:
    """Peak resident set size of this process (bytes), from /proc/self/status."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise OSError("no VmHWM in /proc/self/status")


def _peak_child(spec: str) -> int:
    """Child side of peak_bytes: one call of the op or reference named by spec
    (``side,inputs,n,k,dtype``) on CPU; prints its peak RSS above the inputs.
    VmHWM, not getrusage's ru_maxrss: the latter also keeps the peak of the
    (forked) parent's image from before exec."""
    side, inputs, n, k, dtype = spec.split(",")
    w, gr = topk_inputs(int(n), DTYPES[dtype], torch.device("cpu"), inputs)
    run, ref = topk_pair(w, gr, int(k))
    fn = run if side == "op" else ref
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak-RSS mark (VmHWM) to the current RSS
    with open("/proc/self/statm") as f:
        base = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    out = fn()
    peak = vm_hwm()
    del out
    print(peak - base)
    return 0


def peak_bytes(side: str, inputs: str, n: int, k: int, dtype: str, device: torch.device,
               threads: Optional[int]) -> Optional[int]:
    """Peak memory of one significance_topk call ('op') or of its reference
    ('ref') above the inputs: CUDA allocator peak on a GPU; on CPU the peak
    RSS of a fresh subprocess (None where /proc/self/clear_refs is missing)."""
    if device.type == "cuda":
        w, gr = topk_inputs(n, DTYPES[dtype], device, inputs)
        run, ref = topk_pair(w, gr, k)
        (run if side == "op" else ref)()  # warm the allocator and the kernels
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        out = (run if side == "op" else ref)()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(device) - base
        del out, w, gr
        torch.cuda.empty_cache()
        return peak
    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    try:
        res = subprocess.run([sys.executable, os.path.abspath(__file__), "--peak-child",
                              f"{side},{inputs},{n},{k},{dtype}"],
                             capture_output=True, text=True, timeout=1800, env=env, check=True)
        return int(res.stdout.split()[-1])
    except (subprocess.SubprocessError, OSError, ValueError, IndexError):
        return None


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
        info["cub_device_topk"] = cub_device_topk()
    return info


def cub_device_topk() -> str:
    """Whether the CUDA toolkit's CUB has ``cub::DeviceTopK`` (CCCL >= 3.1; not in the
    CUDA 13.0 toolkit): the header's path, or a note. slimcomm does not build
    against it; the column stays empty until a toolkit ships it."""
    from torch.utils.cpp_extension import CUDA_HOME
    roots = [r for r in (CUDA_HOME, os.environ.get("CUDA_HOME"), "/usr/local/cuda") if r]
    for root in roots:
        for sub in ("include/cub/device/device_topk.cuh", "include/cccl/cub/device/device_topk.cuh"):
            path = os.path.join(root, sub)
            if os.path.exists(path):
                return path
    return "absent from this toolkit's CUB (" + ", ".join(sorted(set(roots))) + ")"


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
        headers += ["copy ms", "copy %"]
    peaks = any(r.peak_mb is not None for r in rows)
    if peaks:
        headers += ["peak MB", "ref peak MB", "vs random (time, memory)"]
    body = []
    for r in rows:
        line = [r.op, fmt_n(r.n), f"{r.density:g}", r.count, f"{r.ms:.3f}", f"{r.gbps:.2f}",
                f"{r.ref_ms:.3f}", f"{r.speedup:.1f}x"]
        if cuda:
            line += ["" if r.copy_frac is None else f"{r.copy_frac * r.ms:.3f}",
                     "" if r.copy_frac is None else f"{100 * r.copy_frac:.0f}%"]
        if peaks:
            line += ["" if r.peak_mb is None else f"{r.peak_mb:.1f}",
                     "" if r.ref_peak_mb is None else f"{r.ref_peak_mb:.1f}",
                     "" if r.time_vs_random is None else
                     f"{r.time_vs_random:.2f}x, "
                     + ("n/a" if r.mem_vs_random is None else f"{r.mem_vs_random:.2f}x")]
        body.append(line)
    if tabulate is not None:
        return tabulate(body, headers=headers, tablefmt="github", disable_numparse=True)
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(x) for x in b) + " |" for b in body]
    return "\n".join(lines)


def tied_lines(rows: List[Row]) -> List[str]:
    """Issue 13: each tied significance_topk row against the random row."""
    out = []
    for r in rows:
        if r.time_vs_random is None:
            continue
        ok = r.time_vs_random <= TIED_TARGET and (r.mem_vs_random is None or r.mem_vs_random <= TIED_TARGET)
        mem = "memory not measured" if r.mem_vs_random is None else (
            f"{r.mem_vs_random:.2f}x the memory ({r.peak_mb:.1f} MB)")
        out.append(f"- {r.op} N={fmt_n(r.n)} k={r.density:g}: {r.time_vs_random:.2f}x the time "
                   f"({r.ms:.1f} ms) and {mem} of random data; target <= {TIED_TARGET:g}x: "
                   + ("met" if ok else "MISSED"))
    return out


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
    p.add_argument("--tied", default=",".join(TIED_KINDS),
                   help=f"significance_topk also on these tied inputs (comma-separated subset of "
                        f"{','.join(TIED_KINDS)}; '' for none)")
    p.add_argument("--no-peak", dest="peak", action="store_false",
                   help="skip the peak-memory measurement of the significance_topk rows")
    p.add_argument("--peak-child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.peak_child:
        return _peak_child(args.peak_child)
    tied = [t.strip() for t in args.tied.split(",") if t.strip()]
    bad = set(tied) - set(TIED_KINDS)
    if bad:
        p.error(f"--tied: unknown {sorted(bad)}; choose from {list(TIED_KINDS)}")

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
            random_row = None
            for case in build_cases(n, dens, dtype, device, which, with_slices=j == 0, tied=tied):
                a, b = time_pair(clock, case, args.repeats, args.warmup)
                ms, rms = statistics.median(a), statistics.median(b)
                row = Row(case.op, case.n, case.density, int(case.n * case.density), ms,
                          case.nbytes / (ms * 1e6), rms, rms / ms, quartiles(a), quartiles(b),
                          inputs=case.inputs)
                if device.type == "cuda":
                    row.copy_frac = copy_ms(clock, case.nbytes, device, args.repeats) / ms
                if case.inputs and args.peak:
                    k = max(1, int(n * dens))
                    pk = peak_bytes("op", case.inputs, n, k, args.dtype, device, args.threads)
                    rpk = peak_bytes("ref", case.inputs, n, k, args.dtype, device, args.threads)
                    row.peak_mb = None if pk is None else pk / 1e6
                    row.ref_peak_mb = None if rpk is None else rpk / 1e6
                if case.inputs == "random":
                    random_row = row
                elif case.inputs and random_row is not None:
                    row.time_vs_random = ms / random_row.ms
                    if row.peak_mb is not None and random_row.peak_mb:
                        row.mem_vs_random = row.peak_mb / random_row.peak_mb
                rows.append(row)
                mem = "" if row.peak_mb is None else f", peak {row.peak_mb:.1f} MB (ref {row.ref_peak_mb or 0:.1f} MB)"
                print(f"  {row.op:<28} N={fmt_n(row.n):>10} k/N={row.density:<5g} {ms:10.3f} ms "
                      f"(ref {rms:10.3f} ms, {row.speedup:6.1f}x){mem}", flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()

    tab = table(rows, device.type == "cuda")
    targets = target_lines(rows, device)
    tied_targets = tied_lines(rows)
    print()
    print(tab)
    if targets:
        print()
        print("\n".join(targets))
    if tied_targets:
        print()
        print("\n".join(tied_targets))

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
                    + (f"; GPU {info['gpu']}; CUB DeviceTopK: {info['cub_device_topk']}"
                       if "gpu" in info else "")
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
            if any(r.peak_mb is not None for r in rows):
                f.write("\npeak MB = peak memory of one call above its inputs ("
                        + ("CUDA allocator peak" if device.type == "cuda" else
                           "peak RSS in a fresh subprocess, mark reset just before the call")
                        + "), op and reference; vs random = a tied row's time and peak memory "
                        "over the random row's.\n")
            if targets:
                f.write("\nIssue 2 targets:\n\n" + "\n".join(targets) + "\n")
            if tied_targets:
                f.write("\nIssue 13 (tied scores within " f"{TIED_TARGET:g}" "x of random data):\n\n"
                        + "\n".join(tied_targets) + "\n")
        print(f"\nwrote {stem}.md and {stem}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
