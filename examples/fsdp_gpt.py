"""A GPT sharded with FSDP2 on two "nodes": HSDP, or Slim-DP between the nodes.

Launch four ranks on this machine (gloo on CPU, NCCL when every rank has a GPU)::

    torchrun --nproc-per-node 4 examples/fsdp_gpt.py                     # --method slimdp
    torchrun --nproc-per-node 4 examples/fsdp_gpt.py --method hsdp
    torchrun --nproc-per-node 4 examples/fsdp_gpt.py --method slimdp-local

(with the virtual environment active, ``. .venv/bin/activate``, or as
``.venv/bin/torchrun ...``). The four ranks form a ``(replicate, shard)`` mesh
of 2 x 2: ranks {0, 1} and {2, 3} are two nodes, each holding a small GPT
sharded with ``fully_shard`` over its own 2 ranks (every transformer block, then
the whole model). Inside a node FSDP all-gathers the parameters and
reduce-scatters the gradients (the fast links); between the nodes (the slow
link) each rank exchanges only its own gradient shard with the rank holding the
same shard on the other node:

* ``hsdp``: ``fully_shard`` over the 2-D mesh, FSDP's own dense all-reduce;
* ``slimdp``: ``fully_shard`` over the 1-D shard sub-mesh and
  ``slimcomm.register_slim_dp_hook(model, replicate_group=mesh["replicate"])``:
  that all-reduce sparsified by Slim-DP (a shared core set plus an explore set);
* ``slimdp-local``: ``fully_shard`` over the shard sub-mesh, plain AdamW steps
  inside each node, and ``slimcomm.SlimDPOptimizer(..., process_group=mesh["replicate"])``
  synchronising the nodes every ``--sync-every`` steps with 2-bit values.

The data is a synthetic language: token sequences of a fixed random Markov
chain over 32 symbols (each rank draws its own), so the loss falls from
ln 32 = 3.47 towards the chain's entropy. It prints the loss, the bytes each
rank sent across the replicate dimension against what a dense HSDP all-reduce
would have sent, and the validation loss. ``python -m slimcomm.train --mesh 2,2
--model gpt`` runs the same wiring on a text corpus with the command's
evaluation and results JSON.
"""

import argparse
import math
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from slimcomm import SlimDPOptimizer, register_slim_dp_hook
from slimcomm.train.workloads.models import GPT

VOCAB, BLOCK = 32, 32


def markov_batches(seed: int, batch: int):
    """An endless stream of (input, target) token batches of a fixed random Markov chain
    (the same chain everywhere, the draws from ``seed``)."""
    table = torch.Generator().manual_seed(1234)
    # each symbol is followed by one of 4 likely successors: an entropy of about ln 4 nats/token
    logits = torch.full((VOCAB, VOCAB), -4.0)
    for s in range(VOCAB):
        logits[s, torch.randperm(VOCAB, generator=table)[:4]] = 2.0
    probs = logits.softmax(1)
    g = torch.Generator().manual_seed(seed)
    while True:
        seq = torch.empty(batch, BLOCK + 1, dtype=torch.long)
        seq[:, 0] = torch.randint(VOCAB, (batch,), generator=g)
        for t in range(BLOCK):
            seq[:, t + 1] = torch.multinomial(probs[seq[:, t]], 1, generator=g).squeeze(1)
        yield seq[:, :-1], seq[:, 1:]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--method", choices=("hsdp", "slimdp", "slimdp-local"), default="slimdp",
                   help="what crosses between the nodes (default %(default)s)")
    p.add_argument("--steps", type=int, default=120, help="training steps (default %(default)s)")
    p.add_argument("--replicas", type=int, default=2,
                   help="nodes (replica groups); must divide the world size (default %(default)s)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank (default %(default)s)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW (default %(default)s)")
    p.add_argument("--sync-every", type=int, default=4,
                   help="slimdp-local: local steps between synchronisations (default %(default)s)")
    args = p.parse_args()

    use_cuda = torch.cuda.is_available() and \
        torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.replicas < 1 or world % args.replicas:
        raise SystemExit(f"--replicas {args.replicas} does not divide the world size {world}")
    shards = world // args.replicas
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda \
        else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    mesh = init_device_mesh(device.type, (args.replicas, shards), mesh_dim_names=("replicate", "shard"))

    torch.manual_seed(0)  # the same initial weights on every rank
    model = GPT(VOCAB, block_size=BLOCK, n_layer=2, n_embd=64, n_head=4).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    fsdp_mesh = mesh if args.method == "hsdp" else mesh["shard"]   # 2-D: HSDP; 1-D: inside a node
    for block in model.blocks:
        fully_shard(block, mesh=fsdp_mesh)
    fully_shard(model, mesh=fsdp_mesh)
    # one dense all-reduce across the nodes: this rank's (padded) fp32 gradient shard
    dense_step = 4 * sum(math.ceil(p.shape[0] / shards) * math.prod(p.shape[1:])
                         for p in model.parameters())

    inner = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    opt, hook = inner, None
    if args.method == "slimdp":
        hook = register_slim_dp_hook(model, replicate_group=mesh["replicate"], core_ratio=0.05,
                                     explore_ratio=0.05, value_dtype=torch.bfloat16, timeout=300)
    elif args.method == "slimdp-local":
        opt = SlimDPOptimizer(model, inner, sync_every=args.sync_every, compression="shared",
                              core_ratio=0.1, explore_ratio=0.1, value_bits=2, outer_lr=1.0,
                              process_group=mesh["replicate"], timeout=300)
    if rank == 0:
        print(f"{world} ranks on {device.type} as {args.replicas} nodes x {shards} shards, "
              f"GPT {n_params:,} parameters, method {args.method}", flush=True)

    batches = markov_batches(seed=rank, batch=args.batch_size)
    for step in range(1, args.steps + 1):
        x, y = (t.to(device) for t in next(batches))
        loss = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()   # reduce-scatter in the node; hsdp/slimdp: then the exchange between nodes
        opt.step()        # slimdp-local: every --sync-every steps, the exchange between nodes
        if step % 20 == 0 or step == args.steps:
            avg = loss.detach().clone()
            dist.all_reduce(avg)
            if rank == 0:
                print(f"step {step:4d}  loss {avg.item() / world:.4f}", flush=True)

    if args.method == "hsdp":
        sent = args.steps * dense_step if args.replicas > 1 else 0
    else:
        sent = int((hook.stats if hook is not None else opt.stats)["total"]["bytes_sent"])
    if rank == 0:
        print(f"{args.method}: sent {sent / 1e6:.3f} MB per rank across the replicate dimension vs "
              f"{args.steps * dense_step / 1e6:.3f} MB for dense HSDP", flush=True)

    # validation: every rank runs the forward (FSDP all-gathers inside the node); the local-step
    # method scores its outer (synchronised) weights
    val = markov_batches(seed=10_000 + rank, batch=args.batch_size)
    model.eval()
    with torch.no_grad(), (opt.outer_weights() if args.method == "slimdp-local" else _nothing()):
        total = torch.zeros(1, device=device)
        for _ in range(4):
            x, y = (t.to(device) for t in next(val))
            total += F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
    dist.all_reduce(total)
    if rank == 0:
        print(f"validation loss {total.item() / (4 * world):.4f} (uniform: {math.log(VOCAB):.4f})",
              flush=True)
    dist.barrier()
    dist.destroy_process_group()


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    main()
