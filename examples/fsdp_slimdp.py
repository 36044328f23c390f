"""Slim-DP on FSDP2 / HSDP: FSDP inside each replica group, the replicate all-reduce compressed.

Launch four ranks on this machine (gloo on CPU, NCCL when every rank has a GPU)::

    torchrun --nproc-per-node 4 examples/fsdp_slimdp.py
    torchrun --nproc-per-node 4 examples/fsdp_slimdp.py --resume   # continue from the checkpoints

(with the virtual environment active, ``. .venv/bin/activate``, or as
``.venv/bin/torchrun ...``). The four ranks form a ``(replicate, shard)`` mesh
of 2 x 2 (``--replicas`` sets the first size): ranks {0, 1} and {2, 3} are two
replica groups ("nodes"), each holding the model sharded with
``fully_shard`` over its own 2 ranks; FSDP's reduce-scatter and all-gather stay
inside a group, and the one collective between the groups, the all-reduce of
every gradient shard with the rank holding the same shard in the other group,
is Slim-DP through ``slimcomm.register_slim_dp_hook``. It trains an MLP
64-256-256-10 on scikit-learn's digits (random data if scikit-learn is
missing), each rank on its own part of the data, for ``--steps`` steps, prints
the loss, the bytes sent between the replica groups, the per-rank memory of the
hook state and the test accuracy, and saves one checkpoint per rank (the model
shard, the optimizer and the hook state: residuals are per rank and per shard,
so every rank saves and loads its own).

The slimcomm lines are the import, ``register_slim_dp_hook(...)``,
``state.stats`` and ``state.state_dict()`` / ``state.load_state_dict()``.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from slimcomm import SlimDPFSDPState


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
    return (x[n_test:] - mean) / std, y[n_test:], (x[:n_test] - mean) / std, y[:n_test]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300, help="training steps (default %(default)s)")
    p.add_argument("--replicas", type=int, default=2,
                   help="replica groups; the world size must be a multiple (default %(default)s)")
    p.add_argument("--batch-size", type=int, default=32, help="per rank (default %(default)s)")
    p.add_argument("--lr", type=float, default=0.1, help="plain SGD (default %(default)s)")
    p.add_argument("--core-ratio", type=float, default=0.02,
                   help="Slim-DP core set per gradient shard (default %(default)s)")
    p.add_argument("--checkpoint-dir", default=os.path.join("runs", "examples", "fsdp_slimdp"),
                   help="where each rank saves rank<R>.pt (default %(default)s)")
    p.add_argument("--resume", action="store_true", help="load the checkpoints and continue")
    args = p.parse_args()

    use_cuda = torch.cuda.is_available() and \
        torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.replicas < 1 or world % args.replicas:
        raise SystemExit(f"--replicas {args.replicas} does not divide the world size {world}")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda \
        else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    mesh = init_device_mesh(device.type, (args.replicas, world // args.replicas),
                            mesh_dim_names=("replicate", "shard"))

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                          nn.Linear(256, 10)).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh["shard"])     # 1-D: FSDP inside the replica group
    fully_shard(model, mesh=mesh["shard"])
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    # Core set 2% + explore set 2% of every gradient shard per step, averaged with the
    # replica peers; see SlimDPFSDPState for every hyperparameter.
    state = SlimDPFSDPState(replicate_group=mesh["replicate"], core_ratio=args.core_ratio,
                            explore_ratio=args.core_ratio, timeout=300)

    ckpt_path = os.path.join(args.checkpoint_dir, f"rank{rank}.pt")
    ckpt = torch.load(ckpt_path, map_location=device, weights_only=False) if args.resume else None
    if ckpt is not None:
        with torch.no_grad():
            for p, w in zip(model.parameters(), ckpt["model_shard"]):
                p.to_local().copy_(w)               # the same mesh: this rank's own shard
        opt.load_state_dict(ckpt["optimizer"])
        state.load_state_dict(ckpt["slim_dp"])    # this rank's residuals and step counter
    state.attach(model)                          # installs the hook on every FSDP module

    x_train, y_train, x_test, y_test = load_data()
    start = ckpt["step"] if ckpt is not None else 0
    if rank == 0:
        print(f"{world} ranks on {device.type} as {args.replicas} replica groups x "
              f"{world // args.replicas} shards, {n_params:,} parameters"
              + (f", resumed from step {start}" if ckpt is not None else ""), flush=True)

    g = torch.Generator().manual_seed(rank)
    t0 = time.perf_counter()
    for step in range(start + 1, start + args.steps + 1):
        g.manual_seed(1_000_003 * rank + step)   # this rank's batch of this step
        idx = torch.randint(len(x_train), (args.batch_size,), generator=g)
        x, y = x_train[idx].to(device), y_train[idx].to(device)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()     # reduce-scatter in the group, then the hook: Slim-DP across groups
        opt.step()
        if step % 50 == 0 or step == start + args.steps:
            avg = loss.detach().clone()
            dist.all_reduce(avg)
            if rank == 0:
                print(f"step {step:5d}  loss {avg.item() / world:.4f}", flush=True)

    stats = state.stats
    total = stats["total"]
    sd = state.state_dict()
    held = sum(e["G"].numel() + (0 if e["residual"] is None else e["residual"].numel())
               for e in sd["params"].values()) * 4
    local = 4 * sum(p.to_local().numel() for p in model.parameters())
    model.eval()
    with torch.no_grad():                        # every rank: FSDP all-gathers in forward
        acc = (model(x_test.to(device)).argmax(1).cpu() == y_test).float().mean().item()
    if rank == 0:
        print(f"trained {args.steps} steps in {time.perf_counter() - t0:.1f} s")
        print(f"slim_dp: {stats['steps']} synchronised steps, sent {total['bytes_sent'] / 1e6:.3f} "
              f"MB per rank to its replica peers vs {total['bytes_dense'] / 1e6:.3f} MB for the "
              f"dense replicate all-reduce "
              f"({100 * total['bytes_sent'] / total['bytes_dense']:.1f}%, dense warm-up included)")
        print(f"hook state (residual + G) per rank: {held / 1e6:.3f} MB for a {local / 1e6:.3f} MB "
              f"fp32 model shard (unsharded model: {4 * n_params / 1e6:.3f} MB)")
        print(f"test accuracy {acc:.4f}", flush=True)

    os.makedirs(args.checkpoint_dir, exist_ok=True)
    torch.save({"model_shard": [p.to_local().detach().cpu() for p in model.parameters()],
                "optimizer": opt.state_dict(), "slim_dp": sd, "step": start + args.steps},
               ckpt_path)
    dist.barrier()
    if rank == 0:
        print(f"saved one checkpoint per rank: {os.path.join(args.checkpoint_dir, 'rank*.pt')}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
