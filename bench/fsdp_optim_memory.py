"""SlimDPOptimizer on FSDP2: the optimizer's state per rank at shard counts S = 1, 2, 4.

Four gloo ranks on the CPU as a (replicate, shard) mesh of 4 x 1, 2 x 2 and 1 x 4: a
stack of ``--layers`` square Linear layers of width ``--width`` sharded with
``fully_shard`` over ``mesh["shard"]``, AdamW inside, SlimDPOptimizer over
``mesh["replicate"]`` (Slim-DP shared index sets, outer Nesterov momentum), a few
training steps (so every lazily allocated buffer exists), then per rank the bytes of
the tensors the optimizer keeps between steps, counted from the tensors themselves (each
storage once; not the process's RSS):

* ``outer``: SlimDPOptimizer's outer copy, scratch and outer momentum (fp32);
* ``compressor``: the residuals, ``G``, spare buffers, core index sets and owner-side
  residuals of the compressor;
* ``inner``: the inner optimizer's state (AdamW's two moments: local shards).

The model's own parameters and gradients are FSDP's and not counted.

    python bench/fsdp_optim_memory.py --results-dir bench/results

writes ``<results-dir>/fsdp_optim_memory.md``: ``bench/out/`` (ignored by git) unless
``--results-dir bench/results`` (the committed results).
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import date
from typing import Dict

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))


def state_bytes(opt) -> Dict[str, int]:
    """Bytes of the tensors ``opt`` (a SlimDPOptimizer) keeps between steps on this rank,
    by owner (``outer``, ``compressor``, ``inner``) and ``total``; each storage counted
    once (``nbytes`` of the untyped storage: a view counts its whole base)."""
    seen: set = set()
    out = {"outer": 0, "compressor": 0, "inner": 0}

    def add(key, t):
        if t is None or not torch.is_tensor(t):
            return
        if hasattr(t, "to_local"):
            t = t.to_local()
        st = t.untyped_storage()
        ident = (st.data_ptr(), st.nbytes()) if st.data_ptr() else ("empty", id(st))
        if ident not in seen:
            seen.add(ident)
            out[key] += st.nbytes()

    for g in opt._groups:
        add("outer", g.outer), add("outer", g.scratch), add("outer", g.momentum)
    for lay in opt.compressor._layouts.values():
        for t in (lay.residual, lay.spare, lay.G, lay.core, lay.server):
            add("compressor", t)
    for st in opt.inner.state.values():
        for v in st.values():
            add("inner", v)
    out["total"] = sum(out.values())
    return out


def _worker(rank, world_size, layers, width, steps):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from slimcomm.optim import SlimDPOptimizer
    rows = []
    for S in (1, 2, 4):
        mesh = init_device_mesh("cpu", (world_size // S, S),
                                mesh_dim_names=("replicate", "shard"))
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
        for m in model:
            fully_shard(m, mesh=mesh["shard"])
        fully_shard(model, mesh=mesh["shard"])
        n = sum(p.numel() for p in model.parameters())
        local = sum(p.to_local().numel() for p in model.parameters())
        opt = SlimDPOptimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                              process_group=mesh["replicate"], sync_every=2,
                              compression="shared", core_ratio=0.05, explore_ratio=0.05,
                              outer_momentum=0.9, nesterov=True)
        g = torch.Generator().manual_seed(rank)
        for _ in range(steps):
            opt.zero_grad()
            model(torch.randn(8, width, generator=g)).square().mean().backward()
            opt.step()
        rows.append(dict(S=S, R=world_size // S, params=n, local=local, **state_bytes(opt)))
        del opt, model
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=255)  # odd: uneven shards at S = 2, 4
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--results-dir", metavar="DIR", default=os.path.join(HERE, "out"),
                    help="directory of fsdp_optim_memory.md (default bench/out/, ignored by git; "
                         "--results-dir bench/results for the committed results)")
    args = ap.parse_args(argv)
    out = os.path.join(args.results_dir, "fsdp_optim_memory.md")
    sys.path.insert(0, os.path.join(HERE, "..", "tests"))
    from _dist import run_workers  # tests/_dist.py: gloo ranks that never hang

    res = run_workers(_worker, 4, args.layers, args.width, args.steps, timeout=600)
    lines = [
        "# SlimDPOptimizer on FSDP2: optimizer state per rank vs shard count",
        "",
        f"Measured {date.today().isoformat()} with `python bench/fsdp_optim_memory.py "
        f"--results-dir bench/results` "
        f"(4 gloo ranks on the CPU, torch {torch.__version__}): {args.layers} x "
        f"Linear({args.width}, {args.width}) = {res[0][0]['params']:,} fp32 parameters, "
        f"`fully_shard` over `mesh['shard']`, AdamW inside, SlimDPOptimizer over "
        f"`mesh['replicate']` (shared, core 5% + explore 5%, outer Nesterov momentum 0.9, "
        f"`sync_every` 2), {args.steps} steps. Bytes of the tensors the optimizer keeps "
        f"between steps, counted from the tensors (each storage once), not RSS: `outer` = "
        f"outer copy + scratch + outer momentum, `compressor` = residuals, `G`, spare "
        f"buffers, core index sets, `inner` = AdamW's moments. Max and min over the ranks "
        f"(uneven shards: the last shard of a 255-row weight is shorter).",
        "",
        "| mesh (R x S) | local params / rank (max) | outer (max) | compressor (max) | "
        "inner (max) | total (max) | total (min) | bytes / local param | total vs S=1 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    base = None
    for i in range(len(res[0])):
        rows = [r[i] for r in res]
        hi = {k: max(r[k] for r in rows) for k in ("local", "outer", "compressor", "inner",
                                                   "total")}
        lo = min(r["total"] for r in rows)
        base = base or hi["total"]
        S, R = rows[0]["S"], rows[0]["R"]
        lines.append(
            f"| {R} x {S} | {hi['local']:,} | {hi['outer']:,} | {hi['compressor']:,} | "
            f"{hi['inner']:,} | {hi['total']:,} | {lo:,} | "
            f"{hi['total'] / hi['local']:.1f} | {hi['total'] / base:.3f} |")
    lines += ["", "Every buffer is the size of the rank's local shard, so the state per rank "
              "falls as 1/S at a constant number of bytes per local parameter.", ""]
    os.makedirs(args.results_dir, exist_ok=True)
    with open(out, "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
