#!/usr/bin/env python3
"""Single-process simulation of IST on the Fashion-MNIST MLP, for quick design sweeps.

Trains ``--W`` ranks' subnets of the MLP 784-2048-2048-10 one after another in
one process (no process group: each "rank" reads its own 7,500-image shard, as
``bench/scale_sweep.sh`` does), with the rules of :class:`slimcomm.ISTTrainer`
re-implemented in plain tensor code so that variants can be tried without
touching the library:

* ``--subnets G``: G distinct subnets per round (default W); rank ``r`` trains
  subnet ``r % G`` and the ranks of a subnet are averaged
  (``ISTTrainer(subnets=G)``);
* ``--rho``: a fraction of every hidden layer shared by all subnets (averaged
  at the synchronisation), the rest partitioned (``ISTTrainer(shared=rho)``);
* ``--bits b``: every rank's round update (trained minus start) passes through
  the per-chunk scaled b-bit codec (``slimcomm.codec.ChunkPlan``, chunks of
  4096) before it is written back, with error feedback (a residual per rank in
  the full model's shape, added the next time the rank trains those entries)
  unless ``--noef`` (``ISTTrainer(exchange_bits=b)`` has none);
* inputs of the hidden/output layers scaled by ``c`` = 1 (shared) or G (own,
  ``--scale W``; ``sqrtW`` for the variance-preserving alternative); gradients
  times ``1 / (c_i c_j)`` (``--noscale-grads``: the raw update); SGD + momentum
  re-created every ``--H`` steps; output bias averaged.

Prints one JSON line: the arguments and ``res`` = [step, test accuracy, test
loss] every ``--eval`` steps. The partitions come from ``torch.randperm`` (not
:func:`slimcomm.ist.partition`), so the numbers match the trainer's in
distribution, not bit for bit.

Examples (bench/results/ist_scaling/shared_sim.md, subnets_sim.md)::

    .venv/bin/python bench/ist_sim.py --W 8 --rho 0.25 --steps 1000
    .venv/bin/python bench/ist_sim.py --W 8 --subnets 4 --bits 4 --noef --lr 0.03 --steps 2000
"""
import argparse, json, math, os, sys, time
import torch, torch.nn.functional as F
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from slimcomm.train.workloads import data as D, models as M
p = argparse.ArgumentParser()
p.add_argument('--W', type=int, default=8); p.add_argument('--lr', type=float, default=0.05)
p.add_argument('--rho', type=float, default=0.0); p.add_argument('--H', type=int, default=10)
p.add_argument('--steps', type=int, default=1000); p.add_argument('--bs', type=int, default=32)
p.add_argument('--eval', type=int, default=250); p.add_argument('--seed', type=int, default=0)
p.add_argument('--scale', default='W')  # forward scale of partitioned neurons: W or sqrtW
p.add_argument('--subnets', type=int, default=0); p.add_argument('--bits', type=int, default=0)
p.add_argument('--noef', action='store_true'); p.add_argument('--noscale-grads', action='store_true'); p.add_argument('--mom', type=float, default=0.9)
a = p.parse_args()
torch.set_num_threads(1)
ds = D.load_fashion_mnist(D.find_fashion_mnist())
W = a.W
shards = [D.shard_indices(60000, r, W, seed=a.seed, subset=7500 * W) for r in range(W)]
xs = [ds.x_train[s] for s in shards]; ys = [ds.y_train[s] for s in shards]
torch.manual_seed(a.seed)
model = M.build_mlp(784, [2048, 2048], 10)
Ws = [model[0].weight.data, model[2].weight.data, model[4].weight.data]
Bs = [model[0].bias.data, model[2].bias.data, model[4].bias.data]
G = a.subnets or W
n = 2048; m = int(round(a.rho * n)); q = (n - m) // G
sc = G if a.scale == 'W' else math.sqrt(G)
def batches(r):
    ep = 0
    while True:
        for i in D.epoch_batches(7500, a.bs, ep, a.seed, r): yield i
        ep += 1
its = [batches(r) for r in range(W)]
c = torch.cat([torch.ones(m), torch.full((q,), float(sc))])   # per-neuron scale in the subnet
g = torch.Generator().manual_seed(a.seed)
from slimcomm.codec import ChunkPlan
resid = [[torch.zeros_like(Ws[0]), torch.zeros_like(Bs[0]), torch.zeros_like(Ws[1]), torch.zeros_like(Bs[1]), torch.zeros_like(Ws[2]), torch.zeros_like(Bs[2])] for _ in range(W)]
res = []; step = 0; t0 = time.time(); nan = False
while step < a.steps:
    perms = [torch.randperm(n, generator=g) for _ in range(2)]
    S = [pp[:m] for pp in perms]
    blk = [[torch.cat([S[l], perms[l][m + (r % G) * q: m + ((r % G) + 1) * q]]) for l in range(2)] for r in range(W)]
    new = [[] for _ in range(W)]
    for r in range(W):
        b0, b1 = blk[r]
        w0 = Ws[0][b0].clone().requires_grad_(); bb0 = Bs[0][b0].clone().requires_grad_()
        w1 = Ws[1][b1][:, b0].clone().requires_grad_(); bb1 = Bs[1][b1].clone().requires_grad_()
        w2 = Ws[2][:, b1].clone().requires_grad_(); bb2 = Bs[2].clone().requires_grad_()
        ps = [w0, bb0, w1, bb1, w2, bb2]
        start = [t.detach().clone() for t in ps]
        if a.noscale_grads or W == 1:
            gs = [None] * 6
        else:
            ic = 1.0 / c
            gs = [ic[:, None], ic, ic[:, None] * ic[None, :], ic, ic[None, :], None]
        opt = torch.optim.SGD(ps, lr=a.lr, momentum=a.mom)
        for _ in range(a.H):
            idx = next(its[r]); x = xs[r][idx]; y = ys[r][idx]
            h = F.relu(F.linear(x, w0, bb0)); h = F.relu(F.linear(h * c, w1, bb1))
            loss = F.cross_entropy(F.linear(h * c, w2, bb2), y)
            opt.zero_grad(); loss.backward()
            for pp, gg in zip(ps, gs):
                if gg is not None: pp.grad.mul_(gg)
            opt.step()
        if a.bits:
            R = resid[r]
            rsl = [R[0][b0], R[1][b0], R[2][b1][:, b0], R[3][b1], R[4][:, b1], R[5]]
            d = torch.cat([(t.detach() - s0).reshape(-1) + (0 if a.noef else rr.reshape(-1)) for t, s0, rr in zip(ps, start, rsl)])
            plan = ChunkPlan([t.numel() for t in ps], 4096, d.device)
            pk, scl, err = plan.quantize(d, a.bits)
            dec = plan.dequantize_mean(pk[None], scl[None], a.bits, 1.0)
            errs = err.split([t.numel() for t in ps]); decs = dec.split([t.numel() for t in ps])
            e = [x.view(t.shape) for x, t in zip(errs, ps)]
            R[0][b0] = e[0]; R[1][b0] = e[1]; R[2][b1[:, None], b0[None, :]] = e[2]; R[3][b1] = e[3]; R[4][:, b1] = e[4]; R[5].copy_(e[5])
            new[r] = [s0 + x.view(t.shape) for s0, x, t in zip(start, decs, ps)]
        else:
            new[r] = [t.detach() for t in ps]
    # write back: partitioned parts copy, shared parts mean
    k = W // G
    for gi in range(G):
        rs = [r for r in range(W) if r % G == gi]
        b0, b1 = blk[gi]
        w0, bb0, w1, bb1, w2, bb2 = [torch.stack([new[r][j] for r in rs]).mean(0) for j in range(6)]
        Ws[0][b0[m:]] = w0[m:]; Bs[0][b0[m:]] = bb0[m:]
        Ws[1][b1[m:, None], b0[None, :]] = w1[m:]; Ws[1][b1[:m, None], b0[None, m:]] = w1[:m, m:]
        Bs[1][b1[m:]] = bb1[m:]; Ws[2][:, b1[m:]] = w2[:, m:]
    if m:
        Ws[0][S[0]] = torch.stack([new[r][0][:m] for r in range(W)]).mean(0)
        Bs[0][S[0]] = torch.stack([new[r][1][:m] for r in range(W)]).mean(0)
        Ws[1][S[1][:, None], S[0][None, :]] = torch.stack([new[r][2][:m, :m] for r in range(W)]).mean(0)
        Bs[1][S[1]] = torch.stack([new[r][3][:m] for r in range(W)]).mean(0)
        Ws[2][:, S[1]] = torch.stack([new[r][4][:, :m] for r in range(W)]).mean(0)
    Bs[2].copy_(torch.stack([new[r][5] for r in range(W)]).mean(0))
    step += a.H
    if step % a.eval < a.H or step >= a.steps:
        with torch.no_grad():
            lo = model(ds.x_test); acc = (lo.argmax(1) == ds.y_test).float().mean().item(); tl = F.cross_entropy(lo, ds.y_test).item()
        res.append((step, round(acc, 4), round(tl, 4)))
        if not math.isfinite(tl): nan = True; break
print(json.dumps(dict(vars(a), res=res, nan=nan, best=max(x[1] for x in res), secs=round(time.time() - t0, 1))))
