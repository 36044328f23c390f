"""Slim-DP for AdamW: local steps + a compressed outer step, in a plain training loop.

Launch two ranks on this machine (gloo on CPU, NCCL when every rank has a GPU)::

    torchrun --nproc-per-node 2 examples/adamw_local.py

(with the virtual environment active, ``. .venv/bin/activate``, or as
``.venv/bin/torchrun ...``). It trains a small character-level GPT
(``slimcomm.train.workloads.models.GPT``, 2 layers, 64-dim) with AdamW
(``slimcomm.LocalAdamW``: AdamW whose steps are normalised by the second
moment of the average gradient of the ranks, not of this rank's) on this
repository's own README and Python sources (so it needs no download), each
rank on its own windows of the text, for ``--steps`` steps (about 20 s on 2
CPU cores). Every 3 local AdamW steps the pseudo-gradients (outer parameters
minus local parameters) are sent as 2-bit codes with error feedback and
averaged, and an outer SGD step (lr 1) updates the outer parameters, which
every rank then loads: about 2% of DDP's bytes per step. It prints the
validation loss of the outer model and the communication statistics, and
saves one checkpoint per rank (the optimizer state holds this rank's
residuals, AdamW moments and local parameters).

No DDP wrapper: ``SlimDPOptimizer`` owns every collective. The slimcomm lines
are the imports, ``LocalAdamW(..., world_size=world)``, ``SlimDPOptimizer(model, inner, ...)``, ``opt.step()``,
``opt.outer_weights()``, ``opt.stats`` and ``opt.state_dict()``.
"""

import argparse
import glob
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from slimcomm import LocalAdamW, SlimDPOptimizer
from slimcomm.train.workloads.models import GPT

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_text():
    """This repository's README and Python sources as one string, and its character vocabulary."""
    parts = []
    for path in sorted(glob.glob(os.path.join(REPO, "README.md")) +
                       glob.glob(os.path.join(REPO, "slimcomm", "**", "*.py"), recursive=True)):
        with open(path, encoding="utf-8") as f:
            parts.append(f.read())
    text = "\n".join(parts)
    vocab = sorted(set(text))
    index = {c: i for i, c in enumerate(vocab)}
    ids = torch.tensor([index[c] for c in text], dtype=torch.long)
    return ids, len(vocab)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300, help="training steps (default %(default)s)")
    p.add_argument("--sync-every", type=int, default=3, help="local steps per sync (default %(default)s)")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per rank (default %(default)s)")
    p.add_argument("--checkpoint-dir", default=os.path.join("runs", "examples", "adamw_local"),
                   help="where each rank saves rank<R>.pt (default %(default)s)")
    args = p.parse_args()

    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else torch.device("cpu")

    ids, vocab = load_text()
    n_val = len(ids) // 10
    train, val = ids[:-n_val], ids[-n_val:]
    shard = train[rank * len(train) // world:(rank + 1) * len(train) // world]  # disjoint per rank
    block = 64
    gen = torch.Generator().manual_seed(1000 + rank)

    def batch(data, n, g):
        starts = torch.randint(0, len(data) - block - 1, (n,), generator=g)
        x = torch.stack([data[s:s + block] for s in starts])
        y = torch.stack([data[s + 1:s + block + 1] for s in starts])
        return x.to(device), y.to(device)

    val_batches = [batch(val, 16, torch.Generator().manual_seed(7 + i)) for i in range(4)]

    torch.manual_seed(0)
    model = GPT(vocab_size=vocab, block_size=block, n_layer=2, n_embd=64, n_head=2).to(device)
    # LocalAdamW: AdamW normalised as if it saw the average gradient of the `world` ranks
    inner = LocalAdamW(model.parameters(), lr=2e-3, betas=(0.9, 0.99), weight_decay=0.1, world_size=world)
    opt = SlimDPOptimizer(model, inner, sync_every=args.sync_every, compression="dense",
                          value_bits=2, outer_lr=1.0)
    if rank == 0:
        print(f"{world} ranks on {device.type}, {sum(q.numel() for q in model.parameters()):,} "
              f"parameters, {len(train):,} training characters", flush=True)

    def val_loss():
        with torch.no_grad(), opt.outer_weights():   # the outer model: identical on every rank
            model.eval()
            loss = sum(F.cross_entropy(model(x).flatten(0, 1), y.flatten()) for x, y in val_batches)
            model.train()
        return loss.item() / len(val_batches)

    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        x, y = batch(shard, args.batch_size, gen)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)   # the local gradient
        opt.step()                                                # every 3rd step also syncs
        if step % 100 == 0 or step == args.steps:
            v = val_loss()
            if rank == 0:
                print(f"step {step:5d}  train loss {loss.item():.4f}  val loss {v:.4f}", flush=True)
    opt.synchronize()   # replicas identical from here on
    st = opt.stats
    if rank == 0:
        tot = st["total"]
        print(f"slimdp-local: {st['local_steps']} local steps, {st['syncs']} syncs, sent "
              f"{tot['bytes_sent'] / 1e6:.2f} MB per rank vs {args.steps * 4 * sum(q.numel() for q in model.parameters()) / 1e6:.2f} MB "
              f"for DDP, {time.perf_counter() - t0:.1f} s", flush=True)
        print(f"final val loss {val_loss():.4f}", flush=True)
    else:
        val_loss()
    os.makedirs(args.checkpoint_dir, exist_ok=True)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()},
               os.path.join(args.checkpoint_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
