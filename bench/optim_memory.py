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

CONFIGS = {
    "adamw (baseline)": None,
    "dense 2-bit, all_gather, no error feedback (before)": dict(lowbit_collective="all_gather",
                                                               error_feedback=False),
    "dense 2-bit, all_gather, error feedback": dict(lowbit_collective="all_gather"),
    "dense 2-bit, all_reduce, error feedback (default)": dict(lowbit_collective="all_reduce"),
}


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


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
    after_train = _peak_rss()
    sd = opt.state_dict()
    after_sd = _peak_rss()
    del sd
    kept = 0 if cfg is None else _kept_bytes(opt)
    dist.barrier()
    dist.destroy_process_group()
    torch.save(dict(rank=rank, params=n, peak_train=after_train, peak_state_dict=after_sd,
                    kept=kept), os.path.join(out, f"r{rank}.pt"))


def measure(cfg, n_params, width, steps, world_size=2):
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(_worker, args=(world_size, d, cfg, n_params, width, steps, d),
                           nprocs=world_size, start_method="spawn")
        return [torch.load(os.path.join(d, f"r{r}.pt")) for r in range(world_size)]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--params", type=int, default=50_000_000, help="model parameters (about)")
    p.add_argument("--width", type=int, default=2048, help="width of the square Linear layers")
    p.add_argument("--steps", type=int, default=7, help="training steps (synchronisations at 3, 6)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                 "optim_memory"))
    a = p.parse_args(argv)
    rows, raw = [], {}
    base = None
    for name, cfg in CONFIGS.items():
        res = measure(cfg, a.params, a.width, a.steps)
        r0 = res[0]
        raw[name] = res
        n = r0["params"]
        if cfg is None:
            base = r0
            rows.append([name, n, f"{r0['peak_train'] / 2**20:.0f}", "-", "-", "-", "-"])
            continue
        rows.append([name, n, f"{r0['peak_train'] / 2**20:.0f}",
                     f"{(r0['peak_train'] - base['peak_train']) / n:.2f}",
                     f"{(r0['peak_state_dict'] - base['peak_state_dict']) / n:.2f}",
                     f"{r0['kept'] / n:.2f}",
                     f"{(r0['peak_train'] - base['peak_train'] - r0['kept']) / n:.2f}"])
        print(rows[-1], flush=True)
    head = ["configuration", "parameters", "peak RSS training (MiB)",
            "extra B/param (training peak)", "extra B/param (peak with state_dict)",
            "kept between steps B/param", "transient B/param"]
    table = tabulate(rows, head, tablefmt="github")
    text = (f"## SlimDPOptimizer: extra memory per parameter (rank 0 of 2, gloo, CPU)\n\n"
            f"{date.today()}, torch {torch.__version__}. Model: square Linear layers of width "
            f"{a.width}, AdamW, {a.steps} steps with sync_every=3 (dense 2-bit codes, outer lr 1.4), "
            f"then `state_dict()`. Peak RSS = VmHWM; extra = peak minus the plain-AdamW peak of the "
            f"same loop, per parameter; kept = bytes of the tensors the optimizer holds between "
            f"steps.\n\nCommand: `python bench/optim_memory.py --params {a.params} --width {a.width} "
            f"--steps {a.steps}`\n\n{table}\n")
    print(text)
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out + ".md", "w") as f:
        f.write(text)
    with open(a.out + ".json", "w") as f:
        json.dump(raw, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
