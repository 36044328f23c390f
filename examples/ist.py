"""Independent subnet training (IST) of an MLP with slimcomm.ISTTrainer.

Launch two ranks on this machine (gloo on CPU, NCCL when every rank has a GPU)::

    torchrun --nproc-per-node 2 examples/ist.py

(with the virtual environment active, ``. .venv/bin/activate``, or as
``.venv/bin/torchrun ...``). The hidden neurons of an MLP 64-512-512-10 are
split across the ranks every round; each rank trains its narrow subnet on its
own shard of scikit-learn's digits (random data if scikit-learn is missing)
for ``--local-steps`` steps without any communication, then one all-gather
writes every rank's slices back into the full model (Yuan et al., arXiv
1910.02120). It prints the loss, the bytes exchanged against what dense DDP
would have sent, and the test accuracy of the full model, and saves one
checkpoint (right after a synchronisation every rank holds the same state).
About 10 s on 2 CPU cores.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from slimcomm import ISTTrainer


def load_data():
    """(x_train, y_train, x_test, y_test): digits standardised, 1/6 held out."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:  # random, learnable data: labels from a fixed linear map
        g = torch.Generator().manual_seed(0)
        x = torch.randn(1800, 64, generator=g)
        y = (x @ torch.randn(64, 10, generator=g)).argmax(1)
    else:
        d = load_digits()
        x, y = torch.tensor(d.data, dtype=torch.float32), torch.tensor(d.target)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    n_test = len(x) // 6
    mean, std = x[n_test:].mean(0), x[n_test:].std(0) + 1e-6
    x = (x - mean) / std
    return x[n_test:], y[n_test:], x[:n_test], y[:n_test]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=400, help="local steps in all (default %(default)s)")
    p.add_argument("--local-steps", type=int, default=10,
                   help="steps per round between synchronisations (default %(default)s)")
    p.add_argument("--batch-size", type=int, default=32, help="per rank (default %(default)s)")
    p.add_argument("--lr", type=float, default=0.03,
                   help="SGD, momentum 0.9; the same at any world size (default %(default)s)")
    p.add_argument("--checkpoint", default=os.path.join("runs", "examples", "ist.pt"),
                   help="where rank 0 saves the trainer state (default %(default)s)")
    args = p.parse_args()

    # torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT.
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)

    x_train, y_train, x_test, y_test = load_data()
    shard = torch.arange(rank, len(x_train), world)          # each rank reads its own data
    x_mine, y_mine = x_train[shard].to(device), y_train[shard].to(device)

    model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                          nn.Linear(512, 10)).to(device)
    # Collective: checks that every rank has the same architecture and settings,
    # then broadcasts rank 0's weights. The optimizer is re-created every round
    # for the new subnet, hence a factory.
    trainer = ISTTrainer(model, lambda params: torch.optim.SGD(params, lr=args.lr, momentum=0.9),
                         local_steps=args.local_steps, seed=0)
    if rank == 0:
        print(f"{world} ranks on {device.type}, full model {sum(p.numel() for p in model.parameters()):,} "
              f"parameters, subnet of rank 0 {sum(p.numel() for p in trainer.subnet.parameters()):,}",
              flush=True)

    g = torch.Generator().manual_seed(rank)
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        batch = torch.randint(len(x_mine), (args.batch_size,), generator=g).to(device)
        loss = trainer.step(x_mine[batch], y_mine[batch], F.cross_entropy)   # syncs every local_steps
        if rank == 0 and (step % 50 == 0 or step == args.steps):
            print(f"step {step:5d}  round {trainer.round:4d}  loss {loss:.4f} (rank 0's subnet)", flush=True)
    trainer.synchronize()                       # every rank now holds the same full model

    s = trainer.stats
    if rank == 0:
        print(f"trained {s.steps} steps in {s.rounds} rounds in {time.perf_counter() - t0:.1f} s")
        print(f"IST: sent {s.bytes_sent / 1e6:.2f} MB per rank vs {s.dense_bytes_sent / 1e6:.2f} MB "
              f"for dense DDP ({100 * s.bytes_sent / s.dense_bytes_sent:.1f}%)")
        print(f"trainer.stats = {s}")
        model.eval()
        with torch.no_grad():
            acc = (model(x_test.to(device)).argmax(1).cpu() == y_test).float().mean().item()
        print(f"test accuracy {acc:.4f}", flush=True)
        # Right after synchronize() the state is the same on every rank: one file serves all.
        # Resume with trainer.load_state_dict(torch.load(path)) on every rank.
        os.makedirs(os.path.dirname(args.checkpoint) or ".", exist_ok=True)
        torch.save(trainer.state_dict(), args.checkpoint)
        print(f"saved {args.checkpoint}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
