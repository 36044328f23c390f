"""Extra memory of SlimDPOptimizer per parameter, measured.

Each configuration runs in fresh gloo processes (2 ranks on this machine): a model
of ``--params`` fp32 parameters (a stack of square Linear layers), AdamW, and
``--steps`` training steps (``sync_every`` 3, so several synchronisations), then
``state_dict()``. Per rank it reads the peak resident set size (``VmHWM`` of
``/proc/self/status``) after training and after ``state_dict()``, and the bytes of
the tensors the optimizer keeps between steps (outer copy, scratch, momentum, the
compressor's residuals, ``G``, core indices, owner-side residuals). "extra" = the
configuration's peak minus the peak of the same loop with plain AdamW (``ddp``-free
baseline ``inner``), divided by the number of parameters: what SlimDPOptimizer adds.

    python bench/optim_memory.py --params 50000000

writes bench/results/optim_memory.md (and .json).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from datetime import date

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tabulate import tabulate
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernels import vm_hwm  # noqa: E402  (bench/kernels.py: peak RSS from /proc/self/status)

CONFIGS = {
    "adamw (baseline)": None,
    "dense 2-bit, all_gather, no error feedback (before)": dict(lowbit_collective="all_gather",
                                                               error_feedback=False),
    "dense 2-bit, all_gather, error feedback": dict(lowbit_collective="all_gather"),
    "dense 2-bit, all_reduce, error feedback (default)": dict(lowbit_collective="all_reduce"),
    "dense 2-bit, all_reduce, error feedback, bucket_cap_mb 8": dict(lowbit_collective="all_reduce",
                                                                    bucket_cap_mb=8),
}


def _kept_bytes(opt) -> int:
    seen, total = set(), 0

    def add(t):
        nonlocal total
        if t is None:
            return
        st = t.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()

    for g in opt._groups:
        add(g.outer), add(g.scratch), add(g.momentum)
    for lay in opt.compressor._layouts.values():
        add(lay.residual), add(lay.spare), add(lay.G), add(lay.core), add(lay.server)
    return total


def _model(n_params: int, width: int) -> nn.Module:
    layers = max(1, round(n_params / (width * width + width)))
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def _worker(rank, world_size, store_dir, cfg, n_params, width, steps, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(store_dir, "store"),
                                                          world_size),
                            rank=rank, world_size=world_size)
    from slimcomm.optim import SlimDPOptimizer

    model = _model(n_params, width)
    n = sum(p.numel() for p in model.parameters())
    inner = torch.optim.AdamW(model.parameters(), lr=1e-4)
    opt = inner if cfg is None else SlimDPOptimizer(
        model, inner, sync_every=3, compression="dense", value_bits=2, outer_lr=1.4, **cfg)
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        opt.zero_grad()
        x = torch.randn(8, width, generator=g)
        model(x).square().mean().backward()
        opt.step()
    after_train = vm_hwm()
    sd = opt.state_dict()
    after_sd = vm_hwm()
    del sd
    kept = 0 if cfg is None else _kept_bytes(opt)
    dist.barrier()
    dist.destroy_process_group()
    torch.save(dict(rank=rank, params=n, peak_train=after_train, peak_state_dict=after_sd,
                    kept=kept), os.path.join(out, f"r{rank}.pt"))


def measure(cfg, n_params, width, steps, fixed_mmap, world_size=2):
    """Rank 0's measurement in fresh processes. ``fixed_mmap``: glibc's mmap threshold
    held at 128 KiB (``MALLOC_MMAP_THRESHOLD_``), so every large block is returned to
    the OS when freed and the peak counts what was allocated at once; otherwise glibc's
    default (the threshold grows with freed blocks, whose pages the heap may keep)."""
    old = os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
    if fixed_mmap:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)
    try:
        with tempfile.TemporaryDirectory() as d:
            mp.start_processes(_worker, args=(world_size, d, cfg, n_params, width, steps, d),
                               nprocs=world_size, start_method="spawn")
            return torch.load(os.path.join(d, "r0.pt"))
    finally:
        os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
        if old is not None:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = old


def _median(runs, key):
    return sorted(r[key] for r in runs)[len(runs) // 2]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--params", type=int, default=50_000_000, help="model parameters (about)")
    p.add_argument("--width", type=int, default=2048, help="width of the square Linear layers")
    p.add_argument("--steps", type=int, default=7, help="training steps (synchronisations at 3, 6)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                 "optim_memory"))
    p.add_argument("--only", default="", help="run only the configurations whose name holds this "
                                                "(and the baseline)")
    p.add_argument("--repeats", type=int, default=3, help="runs per configuration (medians)")
    a = p.parse_args(argv)
    rows, raw = [], {}
    for fixed in (True, False):
        malloc = "mmap threshold 128 KiB" if fixed else "glibc default"
        base = None
        for name, cfg in CONFIGS.items():
            if cfg is not None and a.only not in name:
                continue
            runs = [measure(cfg, a.params, a.width, a.steps, fixed) for _ in range(a.repeats)]
            raw[f"{malloc}: {name}"] = runs
            n = runs[0]["params"]
            train, sd = _median(runs, "peak_train"), _median(runs, "peak_state_dict")
            if cfg is None:
                base = (train, sd)
                rows.append([malloc, name, n, f"{train / 2**20:.0f}", "-", "-", "-"])
            else:
                rows.append([malloc, name, n, f"{train / 2**20:.0f}",
                             f"{(train - base[0]) / n:.2f}", f"{(sd - base[1]) / n:.2f}",
                             f"{runs[0]['kept'] / n:.2f}"])
            print(rows[-1], flush=True)
    head = ["malloc", "configuration", "parameters", "peak RSS training (MiB, median)",
            "extra B/param (training peak)", "extra B/param (peak with state_dict)",
            "kept between steps B/param"]
    table = tabulate(rows, head, tablefmt="github")
    text = (f"## SlimDPOptimizer: extra memory per parameter (rank 0 of 2, gloo, CPU)\n\n"
            f"{date.today()}, torch {torch.__version__}. Model: square Linear layers of width "
            f"{a.width}, AdamW, {a.steps} steps with sync_every=3 (dense 2-bit codes, outer lr 1.4), "
            f"then `state_dict()`; medians of {a.repeats} fresh runs. Peak = VmHWM of rank 0; "
            f"extra = peak minus the plain-AdamW peak of the same loop, per parameter; kept = "
            f"bytes of the tensors the optimizer holds between steps (outer copy, residuals, "
            f"scratch, G, core indices, owner-side residual). With glibc's default the heap keeps "
            f"pages of freed blocks, so the peak there also depends on the order of allocations "
            f"(the baseline's own peak varied by about 100 MiB between runs); the 128 KiB mmap "
            f"threshold returns every large freed block, so its peak counts what was allocated "
            f"at once.\n\nCommand: `python bench/optim_memory.py --params {a.params} --width "
            f"{a.width} --steps {a.steps} --repeats {a.repeats}`\n\n{table}\n")
    print(text)
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out + ".md", "w") as f:
        f.write(text)
    with open(a.out + ".json", "w") as f:
        json.dump(raw, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
