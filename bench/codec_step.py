"""Median ms of SlimDPOptimizer.step() with 2-bit value codes (the codec hot path).

2 gloo ranks (torch.multiprocessing), 1 thread per rank, a ~1.65M-parameter
model, sync_every=1, compression="dense", value_bits=2, fp32 values; random
gradients. Run with PYTHONPATH pointing at the slimcomm tree to measure:

    PYTHONPATH=. python bench/codec_step.py [--steps 10] [--bits 2]
"""

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn


def worker(rank, world, port, steps, bits, out):
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import slimcomm
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1000, 1000), nn.Linear(1000, 650))
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt = slimcomm.SlimDPOptimizer(model, inner, sync_every=1, value_bits=bits, warmup_syncs=0,
                                   compression="dense", value_dtype=torch.float32)
    g = torch.Generator().manual_seed(rank)
    times = []
    for t in range(steps + 2):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g)
        dist.barrier()
        t0 = time.perf_counter()
        opt.step()
        times.append((time.perf_counter() - t0) * 1e3)
    if rank == 0:
        n = sum(p.numel() for p in model.parameters())
        out.put((n, times[2:], float(sum(p.detach().double().sum() for p in model.parameters()))))
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--bits", type=int, default=2)
    a = ap.parse_args()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = 29500 + os.getpid() % 1000
    ps = [ctx.Process(target=worker, args=(r, 2, port, a.steps, a.bits, q)) for r in range(2)]
    for p in ps:
        p.start()
    n, times, chk = q.get()
    for p in ps:
        p.join()
    import slimcomm
    print(f"{slimcomm.__file__}: {n} params, bits={a.bits}: median step {statistics.median(times):.2f} ms "
          f"(min {min(times):.2f}, max {max(times):.2f}) over {len(times)} steps; checksum {chk!r}")


if __name__ == "__main__":
    main()
