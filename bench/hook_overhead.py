#!/usr/bin/env python3
"""Step-time overhead of the Slim-DP comm hook against dense DDP and PowerSGD.

Two ranks (``torch.multiprocessing``, gloo over loopback, where communication
is nearly free so the table shows the *compute* cost of compression) train the
same MLP (784-2048-2048-10, about 5.8M parameters) with:

* ``dense``: DDP's built-in all-reduce (no hook);
* ``powersgd``: PyTorch's ``powerSGD_hook`` (rank ``--powersgd-rank``);
* ``slim_shared``: :func:`slimcomm.hooks.slim_dp_hook`, ``index_mode="shared"``;
* ``slim_local``: the same hook, ``index_mode="local"`` (top-k/DGC baseline).

For each method: median and mean step time (forward + backward + hook +
optimizer step) over ``--steps`` timed steps after ``--warmup`` untimed ones
(past every method's dense warm-up), the ratio to dense, and the bytes each
rank puts into collectives per step (dense: 4 x numel; PowerSGD: dense / its
compression rate; Slim-DP: ``state.stats["last"]["bytes_sent"]``).

``hook ops/step`` and ``host syncs/step`` count every dispatched ATen op and
every ``aten._local_scalar_dense`` inside the comm hook
(:class:`slimcomm._opcount.OpCounter`, untimed steps); ``hook ms/step`` is
the time spent inside the hook per step, collectives made synchronous (so it
includes the collective), from CUDA events on ``--device cuda`` and the host
clock on CPU.

``--device cuda`` puts the model and data on the GPU (rank r on device
``r % device_count``; two ranks may share one GPU over gloo); ``--backend
nccl`` needs one GPU per rank (at world size 1 on a one-GPU machine).

A second table times every stage of the shared hook in isolation on one rank
(same flat layout, same thread count), plus gloo all-reduce of the dense
gradient and of the packed Slim-DP buffer, so a slow step can be attributed.

Writes ``<results-dir>/hook_overhead-<YYYY-MM-DD>.md``: ``bench/out/`` (ignored
by git) unless ``--results-dir bench/results`` (the committed results) or
``--out FILE`` says otherwise.

Example (the committed table)::

    .venv/bin/python bench/hook_overhead.py --steps 60 --warmup 6 --results-dir bench/results
"""

import argparse
import datetime
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tabulate import tabulate
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
from torch.nn.parallel import DistributedDataParallel as DDP

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from slimcomm import compressor, ops  # noqa: E402
from slimcomm._opcount import OpCounter, synchronous_collectives  # noqa: E402
from slimcomm.hooks import (MIN_COMPRESS_NUMEL, SlimDPState, explore_rng_offset,  # noqa: E402
                            selection_sizes, slim_dp_hook)

METHODS = ("dense", "powersgd", "slim_shared", "slim_local")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="784,2048,2048,10",
                   help="MLP layer widths, comma separated (default: %(default)s, ~5.8M params)")
    p.add_argument("--batch", type=int, default=64, help="batch size per rank")
    p.add_argument("--steps", type=int, default=60, help="timed steps per method")
    p.add_argument("--warmup", type=int, default=6,
                   help="untimed steps per method (>= every method's dense warm-up)")
    p.add_argument("--methods", default=",".join(METHODS), help="subset of " + ",".join(METHODS))
    p.add_argument("--min-compress-numel", type=int, default=MIN_COMPRESS_NUMEL,
                   help="SlimDPState(min_compress_numel=): smaller parameters are sent whole")
    p.add_argument("--core-ratio", type=float, default=0.01)
    p.add_argument("--explore-ratio", type=float, default=0.01)
    p.add_argument("--core-refresh", type=int, default=50)
    p.add_argument("--powersgd-rank", type=int, default=4)
    p.add_argument("--bucket-cap-mb", type=float, default=25.0)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the model, data and hook run (default: %(default)s)")
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo",
                   help="process group backend (nccl: --device cuda, one GPU per rank)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds for the whole run")
    p.add_argument("--results-dir", metavar="DIR", default=os.path.join(REPO, "bench", "out"),
                   help="directory of hook_overhead-<date>.md (default bench/out/, ignored by git; "
                        "bench/results for the committed results)")
    p.add_argument("--out", default=None, help="markdown output path (overrides --results-dir)")
    args = p.parse_args(argv)
    args.sizes = [int(s) for s in args.sizes.split(",")]
    if len(args.sizes) < 2 or min(args.sizes) < 1:
        p.error("--sizes: need at least two positive widths")
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in args.methods if m not in METHODS]
    if bad:
        p.error(f"--methods: unknown {bad}; choose from {METHODS}")
    for name in ("batch", "steps", "threads", "world_size", "core_refresh", "powersgd_rank"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.backend == "nccl" and args.device != "cuda":
        p.error("--backend nccl needs --device cuda")
    if args.warmup < 3:
        p.error("--warmup must be >= 3 (Slim-DP's dense warm-up is 2 steps)")
    return args


def make_mlp(sizes):
    layers = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def device_of(rank, args):
    if args.device == "cuda":
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


def sync_device(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


class Runner:
    """One method's DDP model, hook and optimizer; ``step()`` returns seconds."""

    def __init__(self, method, rank, args):
        torch.manual_seed(0)
        self.method = method
        self.dev = device_of(rank, args)
        self.model = make_mlp(args.sizes).to(self.dev)
        self.numel = sum(p.numel() for p in self.model.parameters())
        self.ddp = DDP(self.model, bucket_cap_mb=args.bucket_cap_mb,
                       device_ids=[self.dev.index] if self.dev.type == "cuda" else None)
        self.state = None
        if method == "powersgd":
            self.state = psgd.PowerSGDState(
                process_group=None, matrix_approximation_rank=args.powersgd_rank,
                start_powerSGD_iter=2, use_error_feedback=True, warm_start=True)
            self.ddp.register_comm_hook(self.state, self._counted(psgd.powerSGD_hook))
        elif method.startswith("slim"):
            self.state = SlimDPState(
                core_ratio=args.core_ratio, explore_ratio=args.explore_ratio,
                core_refresh=args.core_refresh, warmup_steps=2,
                min_compress_numel=args.min_compress_numel,
                index_mode="shared" if method == "slim_shared" else "local", model=self.ddp)
            self.ddp.register_comm_hook(self.state, self._counted(slim_dp_hook))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        g = torch.Generator().manual_seed(rank)
        self.data = [(torch.randn(args.batch, args.sizes[0], generator=g).to(self.dev),
                      torch.randint(0, args.sizes[-1], (args.batch,), generator=g).to(self.dev))
                     for _ in range(4)]
        self.i = 0
        self.times, self.sent = [], []
        self.counter = None  # an OpCounter while count() runs
        self.spans = None    # (start, end) per hook call while time_hook() runs
        self.ops_step = self.syncs_step = self.hook_ms = None

    def _counted(self, hook):
        def wrapped(state, bucket):
            if self.spans is not None:
                return self._timed(hook, state, bucket)
            if self.counter is None:
                return hook(state, bucket)
            with self.counter:
                return hook(state, bucket)
        return wrapped

    def _timed(self, hook, state, bucket):
        if self.dev.type == "cuda":
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            fut = hook(state, bucket)
            end.record()
        else:
            start = time.perf_counter()
            fut = hook(state, bucket)
            end = time.perf_counter()
        self.spans.append((start, end))
        return fut

    def time_hook(self, steps=5):
        """Median milliseconds per step spent inside the comm hook (collectives made
        synchronous, so the futures' callbacks and the collective are inside it):
        CUDA events on the current stream on a GPU, the host clock on CPU."""
        if self.state is None:
            return
        per_step = []
        with synchronous_collectives(compressor):
            for _ in range(steps):
                self.spans = []
                self.step(record=False)
                sync_device(self.dev)
                if self.dev.type == "cuda":
                    per_step.append(sum(a.elapsed_time(b) for a, b in self.spans))
                else:
                    per_step.append(1e3 * sum(b - a for a, b in self.spans))
        self.spans = None
        self.hook_ms = statistics.median(per_step)

    def count(self, steps=3):
        """Dispatched ops and host syncs (``aten._local_scalar_dense``) per step inside
        the comm hook (untimed steps, collectives made synchronous so that the futures'
        callbacks are counted too); None for DDP's built-in all-reduce."""
        if self.state is None:
            return
        self.counter = OpCounter()
        with synchronous_collectives(compressor):
            for _ in range(steps):
                self.step(record=False)
        self.ops_step = self.counter.total / steps
        self.syncs_step = self.counter.host_syncs / steps
        self.counter = None

    def step(self, record):
        x, y = self.data[self.i % len(self.data)]
        self.i += 1
        sync_device(self.dev)
        t0 = time.perf_counter()
        self.opt.zero_grad()
        nn.functional.cross_entropy(self.ddp(x), y).backward()
        self.opt.step()
        sync_device(self.dev)
        dt = time.perf_counter() - t0
        if record:
            self.times.append(dt)
            if self.method.startswith("slim"):
                self.sent.append(self.state.stats["last"]["bytes_sent"])

    def result(self):
        dense_bytes = 4 * self.numel
        if self.method == "dense":
            bytes_step = dense_bytes
        elif self.method == "powersgd":
            bytes_step = dense_bytes / self.state.compression_stats()[0]
        else:
            bytes_step = statistics.mean(self.sent)
        return dict(method=self.method, median=statistics.median(self.times),
                    mean=statistics.mean(self.times), bytes=bytes_step,
                    dense_bytes=dense_bytes, numel=self.numel, ops=self.ops_step,
                    syncs=self.syncs_step, hook_ms=self.hook_ms)


def run_all(rank, args, block=5):
    """Interleave the methods in blocks of ``block`` steps so that background load
    on the machine affects them alike."""
    runners = [Runner(m, rank, args) for m in args.methods]
    for r in runners:
        for _ in range(args.warmup):
            r.step(record=False)
    done = 0
    while done < args.steps:
        n = min(block, args.steps - done)
        for r in runners:
            for _ in range(n):
                r.step(record=True)
        done += n
    for r in runners:
        r.count()
        r.time_hook()
    return [r.result() for r in runners]


def time_allreduce(n, dev, reps=10):
    t = torch.randn(n, device=dev)
    dist.all_reduce(t)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        dist.all_reduce(t)
        sync_device(dev)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _timeit(fn, reps=10, dev=torch.device("cpu")):
    fn()
    ts = []
    for _ in range(reps):
        sync_device(dev)
        t0 = time.perf_counter()
        fn()
        sync_device(dev)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def breakdown(args, dev=torch.device("cpu")):
    """Per-stage cost of the shared hook on the model's flat gradient, one rank."""
    with torch.device(dev):
        return _breakdown(args, dev)


def _breakdown(args, dev):
    def _timeit_dev(fn, reps=10):
        return _timeit(fn, reps, dev)

    torch.manual_seed(0)
    params = list(make_mlp(args.sizes).parameters())
    numels = [p.numel() for p in params]
    offsets = [0]
    for n in numels:
        offsets.append(offsets[-1] + n)
    N = offsets[-1]
    sizes = [selection_sizes(n, args.core_ratio, args.explore_ratio, args.min_compress_numel)
             for n in numels]
    ks = [0 if d else k for k, _, d in sizes]
    ms = [m for _, m, _ in sizes]
    grad = torch.randn(N)
    residual = torch.randn(N) * 0.1
    G = torch.randn(N)
    w = torch.cat([p.detach().reshape(-1) for p in params])
    core, _ = ops.significance_topk_segmented(w, G, offsets, ks)
    core_offsets = [0]
    for k in ks:
        core_offsets.append(core_offsets[-1] + k)
    rng = [explore_rng_offset(100, i) for i in range(len(numels))]
    explore = ops.explore_sample_segmented(offsets, core, core_offsets, ms, 0, rng)
    idx = torch.cat([core, explore])
    K = idx.numel()
    vals = torch.randn(K)

    off_t = torch.tensor(offsets, dtype=torch.int64)
    counter = torch.zeros(2, dtype=torch.int64)
    acc = torch.empty(N)
    S = len(numels)
    avg = torch.cat([vals, torch.ones(S)]).to(torch.bfloat16)

    def encode():  # as compressor.transports.shared: acc, flags, bf16 payload and next residual in one op
        return ops.step_encode(grad, idx, off_t, 2, torch.bfloat16, acc=acc, residual=residual)

    def commit():  # bucket, G and residual from the averaged payload in one op
        return ops.step_commit(grad, idx, off_t, avg, counter, G=G, acc=acc, residual=residual,
                               keep_all_zero=True, return_old_g=True)

    flat = torch.empty(N)
    views = [flat[offsets[s]:offsets[s + 1]] for s in range(len(params))]
    srcs = [p.detach().reshape(-1) for p in params]

    def flat_w():  # as SlimDPCompressor._flat_weight: one multi-tensor copy
        torch._foreach_copy_(views, srcs)
        return flat

    rows = [
        ("ops.explore_sample_segmented", _timeit_dev(
            lambda: ops.explore_sample_segmented(offsets, core, core_offsets, ms, 0, rng)), 1),
        ("cat core + explore", _timeit_dev(lambda: torch.cat([core, explore])), 1),
        ("ops.step_encode (acc, flags, bf16 payload, residual)", _timeit_dev(encode), 1),
        ("ops.step_commit (bucket, G, residual, flags)", _timeit_dev(commit), 1),
        ("flat weight copy (refresh steps only)", _timeit_dev(flat_w, 3), args.core_refresh),
        ("ops.significance_topk_segmented (refresh only)", _timeit_dev(
            lambda: ops.significance_topk_segmented(w, G, offsets, ks), 3), args.core_refresh),
    ]
    return rows, K, N


def worker(rank, world_size, args, init_file, q):
    try:
        torch.set_num_threads(args.threads)
        if args.device == "cuda":
            torch.cuda.set_device(device_of(rank, args))
        dist.init_process_group(args.backend, init_method=f"file://{init_file}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=args.timeout))
        results = run_all(rank, args)
        n = results[0]["numel"]
        k = sum(k + m for k, m, _ in (selection_sizes(p.numel(), args.core_ratio, args.explore_ratio,
                                                      args.min_compress_numel)
                                      for p in make_mlp(args.sizes).parameters()))
        dev = device_of(rank, args)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        comm = dict(dense=time_allreduce(n, dev), sparse=time_allreduce(k + 3, dev))
        bd = breakdown(args, dev) if rank == 0 else None
        dist.destroy_process_group()
        q.put((rank, "ok", (results, comm, bd)))
    except BaseException:  # noqa: BLE001
        q.put((rank, "error", traceback.format_exc()))


def main(argv=None):
    args = parse_args(argv)
    load0 = os.getloadavg()[0]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    tmp = tempfile.mkdtemp(prefix="hook_overhead_")
    init_file = os.path.join(tmp, "store")
    procs = [ctx.Process(target=worker, args=(r, args.world_size, args, init_file, q), daemon=True)
             for r in range(args.world_size)]
    for p in procs:
        p.start()
    got = {}
    deadline = time.monotonic() + args.timeout
    try:
        while len(got) < args.world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"benchmark did not finish within --timeout {args.timeout} s")
            try:
                rank, status, payload = q.get(timeout=min(left, 5.0))
            except Exception:  # queue.Empty
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in got]
                if dead:
                    raise RuntimeError(f"rank(s) {dead} died without reporting")
                continue
            if status != "ok":
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            got[rank] = payload
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
            p.join(5)
    results, comm, (bd_rows, K, N) = got[0]
    dense = next((r for r in results if r["method"] == "dense"), None)
    table = []
    for r in results:
        table.append([
            r["method"], f"{r['median'] * 1e3:.1f}", f"{r['mean'] * 1e3:.1f}",
            f"{r['median'] / dense['median']:.2f}x" if dense else "-",
            f"{r['bytes'] / 1e6:.3f}", f"{100 * r['bytes'] / r['dense_bytes']:.2f}%",
            "-" if r["ops"] is None else f"{r['ops']:.0f}",
            "-" if r["syncs"] is None else f"{r['syncs']:.0f}",
            "-" if r["hook_ms"] is None else f"{r['hook_ms']:.2f}",
        ])
    method_md = tabulate(table, headers=["method", "median step (ms)", "mean step (ms)",
                                         "vs dense (median)", "MB sent/rank/step",
                                         "% of dense bytes", "hook ops/step",
                                         "host syncs/step", "hook ms/step"], tablefmt="github")
    bd = [[name, f"{t * 1e3:.3f}", every, f"{t * 1e3 / every:.3f}"] for name, t, every in bd_rows]
    bd.append(["gloo all_reduce, dense gradient", f"{comm['dense'] * 1e3:.3f}", 1,
               f"{comm['dense'] * 1e3:.3f}"])
    bd.append(["gloo all_reduce, packed Slim-DP values", f"{comm['sparse'] * 1e3:.3f}", 1,
               f"{comm['sparse'] * 1e3:.3f}"])
    bd_md = tabulate(bd, headers=["stage (shared mode)", "ms per call", "every n steps",
                                  "ms per step"], tablefmt="github")
    numel = results[0]["numel"]
    gpu = f" ({torch.cuda.get_device_name(0)})" if args.device == "cuda" else ""
    today = datetime.date.today().isoformat()
    text = f"""# Slim-DP hook overhead ({today})

Command: `{' '.join([os.path.relpath(sys.argv[0], REPO)] + (argv if argv is not None else sys.argv[1:]))}`

Setup: {args.world_size} ranks, {args.backend} over loopback, {args.threads} torch thread(s) per rank,
{platform.processor() or platform.machine()} ({os.cpu_count()} cores), torch {torch.__version__},
device {args.device}{gpu}.
MLP {'-'.join(map(str, args.sizes))} ({numel:,} parameters), batch {args.batch} per rank,
SGD momentum 0.9, bucket_cap_mb {args.bucket_cap_mb}. Slim-DP: core {args.core_ratio},
explore {args.explore_ratio}, core_refresh {args.core_refresh}, warm-up 2 steps,
parameters under {args.min_compress_numel} elements sent whole;
PowerSGD rank {args.powersgd_rank} (error feedback, warm start).
Timed {args.steps} steps per method after {args.warmup} untimed steps, methods interleaved
in blocks of 5 steps (median and mean, rank 0; the timed window includes core refreshes,
which the mean shows). Load average (1 min) at the start: {load0:.1f} on {os.cpu_count()} cores.

{method_md}

Per-stage cost of the shared hook on the whole model as one flat buffer
({N:,} elements, {K:,} sent = core + explore), {args.threads} thread(s), rank 0:

{bd_md}
"""
    out = args.out or os.path.join(args.results_dir, f"hook_overhead-{today}.md")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        f.write(text)
    print(text)
    print(f"written to {out}")


if __name__ == "__main__":
    main()
