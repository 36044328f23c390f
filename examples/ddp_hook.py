"""Slim-DP as a DDP communication hook, in a plain DistributedDataParallel training loop.

Launch two ranks on this machine (gloo on CPU, NCCL when every rank has a GPU)::

    torchrun --nproc-per-node 2 examples/ddp_hook.py
    torchrun --nproc-per-node 2 examples/ddp_hook.py --resume    # continue from the checkpoints

(with the virtual environment active, ``. .venv/bin/activate``, or as
``.venv/bin/torchrun ...``). It trains an MLP 64-256-256-10 on scikit-learn's
digits (8x8 images of handwritten digits; random data if scikit-learn is
missing), each rank on its own shard, for ``--steps`` steps (about 10 s on 2
CPU cores), prints the loss, the hook's communication statistics and the test
accuracy, and saves one checkpoint per rank: the hook state holds this rank's
error-feedback residuals, so every rank saves and loads its own.

The only slimcomm lines are the import, ``SlimDPState(...)``,
``ddp.register_comm_hook(state, slim_dp_hook)``, ``state.stats`` and
``state.state_dict()`` / ``state.load_state_dict()``; everything else is
ordinary PyTorch.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from slimcomm import SlimDPState, slim_dp_hook


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
    p.add_argument("--steps", type=int, default=300, help="training steps (default %(default)s)")
    p.add_argument("--batch-size", type=int, default=32, help="per rank (default %(default)s)")
    p.add_argument("--lr", type=float, default=0.1,
                   help="plain SGD, no momentum: momentum on top of error feedback over-shoots "
                        "(default %(default)s)")
    p.add_argument("--checkpoint-dir", default=os.path.join("runs", "examples", "ddp_hook"),
                   help="where each rank saves rank<R>.pt (default %(default)s)")
    p.add_argument("--resume", action="store_true", help="load the checkpoints and continue")
    args = p.parse_args()

    # torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT.
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)

    x_train, y_train, x_test, y_test = load_data()
    sampler = DistributedSampler(TensorDataset(x_train, y_train), num_replicas=world, rank=rank,
                                 shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(TensorDataset(x_train, y_train), batch_size=args.batch_size,
                        sampler=sampler, drop_last=True)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                          nn.Linear(256, 10)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    ckpt_path = os.path.join(args.checkpoint_dir, f"rank{rank}.pt")
    ckpt = torch.load(ckpt_path, map_location=device) if args.resume else None
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])

    ddp = DDP(model, device_ids=[device.index] if use_cuda else None)
    # Core set 2% + explore set 2% of every parameter per step; see SlimDPState's
    # docstring for every hyperparameter (warm-up, core refresh, wire dtype, ...).
    state = SlimDPState(core_ratio=0.02, explore_ratio=0.02, model=ddp)
    if ckpt is not None:
        state.load_state_dict(ckpt["slim_dp"])   # this rank's residuals and step counter
    ddp.register_comm_hook(state, slim_dp_hook)

    start_step = ckpt["step"] if ckpt is not None else 0
    if rank == 0:
        print(f"{world} ranks on {device.type}, {sum(p.numel() for p in model.parameters()):,} "
              f"parameters, {len(x_train)} training samples"
              + (f", resumed from step {start_step}" if ckpt is not None else ""), flush=True)

    step, epoch, t0 = start_step, 0, time.perf_counter()
    while step < start_step + args.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            loss = F.cross_entropy(ddp(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()                      # the hook all-reduces the packed core+explore values
            opt.step()
            step += 1
            if step % 50 == 0 or step == start_step + args.steps:
                avg = loss.detach().clone()
                dist.all_reduce(avg)
                if rank == 0:
                    print(f"step {step:5d}  loss {avg.item() / world:.4f}", flush=True)
            if step == start_step + args.steps:
                break
        epoch += 1

    stats = state.stats                          # this rank's bytes, cumulative and of the last step
    total = stats["total"]
    if rank == 0:
        print(f"trained {args.steps} steps in {time.perf_counter() - t0:.1f} s")
        print(f"slim_dp: {stats['steps']} synchronised steps, sent {total['bytes_sent'] / 1e6:.2f} MB "
              f"per rank vs {total['bytes_dense'] / 1e6:.2f} MB for dense all-reduce "
              f"({100 * total['bytes_sent'] / total['bytes_dense']:.1f}%, dense warm-up included)")
        print(f"state.stats['last'] = {stats['last']}")
        model.eval()
        with torch.no_grad():
            acc = (model(x_test.to(device)).argmax(1).cpu() == y_test).float().mean().item()
        print(f"test accuracy {acc:.4f}", flush=True)

    os.makedirs(args.checkpoint_dir, exist_ok=True)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                "slim_dp": state.state_dict(), "step": step}, ckpt_path)
    dist.barrier()
    if rank == 0:
        print(f"saved one checkpoint per rank: {os.path.join(args.checkpoint_dir, 'rank*.pt')}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
