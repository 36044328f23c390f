"""The two-stage low-bit all-reduce (``lowbit_collective="all_reduce"``): against a
single-process oracle built from ``slimcomm.reference``, bytes bounded in the world
size, non-finite values, checkpoints, and its use by SlimDPOptimizer."""

import pytest
import torch
from torch import nn

from _dist import run_workers
from slimcomm import reference as ref
from slimcomm.compressor import SlimDPCompressor
from slimcomm.compressor.transports.reduce_scatter import ShardPlan
from slimcomm.optim import SlimDPOptimizer

SIZES = [300, 1, 37, 1029, 64, 5]
CHUNK = 64


def _buf(rank, t, sizes=SIZES):
    g = torch.Generator().manual_seed(1000 * rank + t)
    return torch.randn(sum(sizes), generator=g) * (1 + t)


def _compressor(bits, collective="all_reduce", chunk=CHUNK, sizes=SIZES, ef=True):
    comp = SlimDPCompressor(core_ratio=1.0, explore_ratio=0.0, value_bits=bits, quant_chunk=chunk,
                            lowbit_collective=collective, error_feedback=ef, warmup_steps=0)
    comp.attach_parameters([(f"p{i}", torch.zeros(n)) for i, n in enumerate(sizes)])
    layout = comp.layout_for(lambda: tuple(range(len(sizes))),
                             lambda key: (torch.device("cpu"), torch.float32), "group",
                             torch.device("cpu"))
    return comp, layout


def _shard_offsets(sizes, lo, hi):
    bounds = [0]
    for n in sizes:
        bounds.append(bounds[-1] + n)
    pieces = [min(hi, b) - max(lo, a) for a, b in zip(bounds[:-1], bounds[1:])]
    o = [0]
    for p in pieces:
        if p > 0:
            o.append(o[-1] + p)
    return torch.tensor(o, dtype=torch.int64)


def _quant(vals, offs, bits):
    n = sum(-(-int(c) // CHUNK) for c in (offs[1:] - offs[:-1]).tolist())
    return ref.quantize_chunks(vals, offs, CHUNK, bits, n)


def _oracle(world_size, bits, syncs, ef=True):
    """Every rank's worker and owner steps simulated with the reference codec."""
    K = sum(SIZES)
    cuts = ShardPlan(SIZES, CHUNK, world_size, bits, torch.device("cpu")).cuts
    res = [torch.zeros(K) for _ in range(world_size)]
    server = [torch.zeros(hi - lo) for lo, hi in zip(cuts[:-1], cuts[1:])]
    outs = []
    for t in range(syncs):
        accs = [_buf(r, t) + (res[r] if ef else 0) for r in range(world_size)]
        out = torch.empty(K)
        for j, (lo, hi) in enumerate(zip(cuts[:-1], cuts[1:])):
            offs = _shard_offsets(SIZES, lo, hi)
            codes = [_quant(accs[r][lo:hi], offs, bits) for r in range(world_size)]
            for r in range(world_size):
                res[r][lo:hi] = codes[r][2]
            avg = ref.dequantize_chunks_mean(torch.stack([c[0] for c in codes]),
                                             torch.stack([c[1] for c in codes]), offs, CHUNK,
                                             bits, hi - lo, world_size)
            if ef:
                avg = avg + server[j]
            packed, scales, lost = _quant(avg, offs, bits)
            server[j] = lost
            out[lo:hi] = ref.dequantize_chunks_mean(packed[None], scales[None], offs, CHUNK, bits,
                                                    hi - lo, 1.0)
        outs.append(out)
    return outs


def _run(rank, world_size, bits, syncs, ef=True, deferred=False):
    comp, layout = _compressor(bits, ef=ef)
    outs = []
    for t in range(syncs):
        buf = _buf(rank, t)
        res = comp.synchronize(layout, buf, deferred=deferred).wait()
        if deferred:
            res = res(torch.empty_like(buf))
        comp.end_step()
        outs.append(res.clone())
    return outs, comp.stats


@pytest.mark.parametrize("world_size,bits", [(2, 2), (3, 1), (4, 4), (3, 8)])
def test_matches_reference_oracle_bit_for_bit(world_size, bits):
    res = run_workers(_run, world_size, bits, 3)
    want = _oracle(world_size, bits, 3)
    for r in range(world_size):
        for t in range(3):
            assert torch.equal(res[r][0][t], want[t]), f"rank {r} sync {t}"


def test_without_error_feedback_matches_oracle_and_deferred_decode_is_the_same():
    res = run_workers(_run, 3, 2, 2, False)
    want = _oracle(3, 2, 2, ef=False)
    for t in range(2):
        assert torch.equal(res[0][0][t], want[t])
    deferred = run_workers(_run, 3, 2, 2, True, True)
    for t in range(2):
        assert torch.equal(deferred[2][0][t], _oracle(3, 2, 2)[t])


def test_shard_cuts_lie_on_chunk_boundaries_near_equal_shares():
    sizes = [1000, 3, 4096, 77, 1]
    bounds = {0}
    off = 0
    for n in sizes:
        bounds |= {off + min(s + CHUNK, n) for s in range(0, n, CHUNK)}
        off += n
    for W in (1, 2, 3, 5, 8):
        p = ShardPlan(sizes, CHUNK, W, 2, torch.device("cpu"))
        assert len(p.cuts) == W + 1 and p.cuts[0] == 0 and p.cuts[-1] == off
        assert all(c in bounds for c in p.cuts) and p.cuts == sorted(p.cuts)
        assert all(abs(c - j * off / W) <= CHUNK for j, c in enumerate(p.cuts))
        assert sum(q.numel for q in p.plans) == off
    tiny = ShardPlan([3], CHUNK, 4, 2, torch.device("cpu"))  # fewer chunks than ranks
    assert tiny.cuts[-1] == 3 and sum(q.numel for q in tiny.plans) == 3


def _bytes(rank, world_size, collective, sizes):
    comp, layout = _compressor(2, collective, chunk=256, sizes=sizes)
    comp.synchronize(layout, _buf(rank, 0, sizes)).wait()
    comp.end_step()
    return comp.stats["last"]["bytes_sent"]


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_bytes_per_rank_bounded_in_world_size(world_size):
    """Link payload per rank: (W-1) (P1 + P2) for the two-stage all-reduce (counted as
    W (P1 + P2) / 2 in bytes_sent), within 10% of 2 (W-1)/W x one rank's code size
    (the all-gather path's bytes_sent, which a ring all-gather sends W-1 times)."""
    sizes = [40000, 300, 25000, 7]
    red = run_workers(_bytes, world_size, "all_reduce", sizes)[0]
    gat = run_workers(_bytes, world_size, "all_gather", sizes)[0]
    link_reduce = 2 * (world_size - 1) / world_size * red
    bound = 2 * (world_size - 1) / world_size * gat
    assert link_reduce <= 1.1 * bound, (link_reduce, bound)
    assert link_reduce >= 0.9 * bound
    assert (world_size - 1) * gat / link_reduce >= world_size / 2 * 0.9  # all-gather: ~W/2x


def _nonfinite(rank, world_size):
    comp, layout = _compressor(2)
    outs = []
    for t in range(3):
        buf = _buf(rank, t)
        if rank == 1 and t == 1:
            buf[300] = float("nan")  # parameter 1 (one element)
            buf[400] = float("inf")  # parameter 3
        outs.append(comp.synchronize(layout, buf).wait().clone())
        comp.end_step()
    return outs, comp.stats["nonfinite_fallbacks"], layout.residual.clone()


def test_nonfinite_parameter_comes_back_nan_everywhere_then_recovers():
    res = run_workers(_nonfinite, 2)
    o = [0, 300, 301, 338, 1367]
    for r in range(2):
        out = res[r][0][1]
        assert torch.isnan(out[o[1]:o[2]]).all() and torch.isnan(out[o[3]:o[4]]).all()
        assert torch.isfinite(out[:o[1]]).all() and torch.isfinite(out[o[2]:o[3]]).all()
        assert torch.isfinite(res[r][0][2]).all()  # the next sync is finite again
        assert torch.isfinite(res[r][2]).all()     # residuals too
        assert res[r][1] == 2
    for t in range(3):
        assert torch.equal(res[0][0][t].nan_to_num(), res[1][0][t].nan_to_num())


def test_refused_where_it_cannot_apply():
    with pytest.raises(ValueError, match="lowbit_collective must be one of"):
        SlimDPCompressor(value_bits=2, lowbit_collective="ring")
    from slimcomm.hooks import SlimDPState
    assert "lowbit_collective" not in SlimDPState.__init__.__code__.co_varnames


# ---------------------------------------------------------------------------
# SlimDPOptimizer: dense codes through the two-stage all-reduce
# ---------------------------------------------------------------------------

D_IN, D_OUT = 10, 4


def _net(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(D_IN, 64), nn.ReLU(), nn.Linear(64, 40), nn.ReLU(),
                         nn.Linear(40, D_OUT))


def _batch(rank, t):
    g = torch.Generator().manual_seed(10_000 * rank + t)
    return torch.randn(8, D_IN, generator=g), torch.randint(0, D_OUT, (8,), generator=g)


CFG = dict(sync_every=3, compression="dense", value_bits=2, quant_chunk=64, outer_lr=1.4)


def _train(rank, steps, cfg, model=None, opt=None, start=0):
    model = model if model is not None else _net(rank)
    opt = opt or SlimDPOptimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-2), **cfg)
    for t in range(start, start + steps):
        opt.zero_grad()
        x, y = _batch(rank, t)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model, opt


def _optim(rank, world_size, cfg, steps):
    model, opt = _train(rank, steps, cfg)
    return [p.detach().clone() for p in model.parameters()], opt.state_dict()


def _resume(rank, world_size, cfg, states, start, steps):
    model = _net(rank)
    opt = SlimDPOptimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-2), **cfg)
    opt.load_state_dict(states[rank])
    _train(rank, steps, cfg, model, opt, start)
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("cap", [25.0, 0.004])
def test_optimizer_replicas_identical_and_resume_bit_exact(cap):
    cfg = dict(CFG, bucket_cap_mb=cap)
    full = run_workers(_optim, 3, cfg, 15)  # ends on a synchronisation
    for r in (1, 2):
        for a, b in zip(full[0][0], full[r][0]):
            assert torch.equal(a, b) and torch.isfinite(a).all()
    assert full[0][1]["compressor"]["server_residuals"]  # the owners' residuals are saved
    half = run_workers(_optim, 3, cfg, 7)  # not a sync step: local != outer
    resumed = run_workers(_resume, 3, cfg, [h[1] for h in half], 7, 8)
    for r in range(3):
        for a, b in zip(resumed[r], full[r][0]):
            assert torch.equal(a, b), f"rank {r}: resumed run differs"


def test_optimizer_layout_invariant():
    """Codes are chunked per tensor and summed in rank order: which rank owns which
    chunk, and how tensors are grouped, change nothing."""
    one = run_workers(_optim, 2, dict(CFG, bucket_cap_mb=25.0), 9)
    many = run_workers(_optim, 2, dict(CFG, bucket_cap_mb=0.004), 9)
    for a, b in zip(one[0][0], many[0][0]):
        assert torch.equal(a, b)


def _scratch(rank, world_size, collective):
    model = _net(0)
    opt = SlimDPOptimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                          **dict(CFG, bucket_cap_mb=0.004, lowbit_collective=collective))
    ptrs = {g.scratch.untyped_storage().data_ptr() for g in opt._groups}
    return len(opt._groups), len(ptrs)


def test_groups_share_one_scratch_only_with_the_two_stage_all_reduce():
    groups, shared = run_workers(_scratch, 2, "all_reduce")[0]
    assert groups > 2 and shared == 1
    groups, own = run_workers(_scratch, 2, "all_gather")[0]
    assert own == groups


def _state_after(rank, world_size, collective):
    model = _net(0)
    opt = SlimDPOptimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                          **dict(CFG, bucket_cap_mb=0.004, lowbit_collective=collective))
    _train(rank, 6, CFG, model, opt)
    n = sum(p.numel() for p in model.parameters())
    seen, kept = set(), 0
    for t in [g.outer for g in opt._groups] + [g.scratch for g in opt._groups] + \
            [g.momentum for g in opt._groups] + \
            [getattr(lay, f) for lay in opt.compressor._layouts.values()
             for f in ("residual", "spare", "G", "core", "server")]:
        if t is not None and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            kept += t.untyped_storage().nbytes()
    lays = list(opt.compressor._layouts.values())
    residuals = [e["residual"] for e in opt.compressor.state_dict()["params"].values()]
    return dict(per_param=kept / n, largest=max(g.outer.numel() for g in opt._groups) / n,
                groups=len(opt._groups), n=n,
                G=[lay.G is None for lay in lays], core=[lay.core is None for lay in lays],
                residual_nonzero=all(r is not None and bool(r.abs().sum() > 0) for r in residuals))


@pytest.mark.parametrize("collective", ["all_reduce", "all_gather"])
def test_dense_codes_keep_error_feedback(collective):
    """Issue 23, item 8: dense low-bit codes keep the rounding error (residual) on every
    rank; before, ``error_feedback and not dense`` dropped it."""
    res = run_workers(_state_after, 2, collective)
    assert all(r["residual_nonzero"] for r in res)


def test_dense_codes_memory_outer_residual_and_a_shared_scratch():
    """Issue 23, item 9: what the optimizer keeps per parameter with dense 2-bit codes,
    error feedback and the two-stage all-reduce: outer copy 4 B + residual 4 B + this
    rank's shard of the owner-side residual 4/W B + one scratch of the largest group; no
    G and no int64 index per coordinate."""
    for r in run_workers(_state_after, 2, "all_reduce"):
        assert all(r["G"]) and all(r["core"])
        # (an owner's shard may exceed 1/W of its group by up to one code chunk)
        owner_slack = 4 * CFG["quant_chunk"] * r["groups"] / r["n"]
        assert r["per_param"] <= 4 + 4 + 4 / 2 + 4 * r["largest"] + owner_slack, r


class _Tensors(nn.Module):
    """Parameters of the given shapes and a loss that touches each of them."""

    def __init__(self, shapes, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.ps = nn.ParameterList([nn.Parameter(torch.randn(*s)) for s in shapes])

    def loss(self, rank, t):
        g = torch.Generator().manual_seed(100 * rank + t)
        return sum((p * torch.randn(p.shape, generator=g)).sum() ** 2 for p in self.ps)


def _shapes_run(rank, world_size, shapes, cfg, steps):
    model = _Tensors(shapes, 0)
    opt = SlimDPOptimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-2), **cfg)
    for t in range(steps):
        opt.zero_grad()
        model.loss(rank, t).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_sparse_codes_layout_invariant_beside_dense_groups():
    """compression="shared" with value_bits: a group of dense (small) tensors only is
    all-gathered like the same tensors beside sparse ones (the two-stage path is only
    for core_ratio 1), so bucket_cap_mb changes nothing."""
    shapes = [(1,), (5,), (3, 7), (130,), (1,), (40,), (2, 2, 3)]
    cfg = dict(sync_every=3, compression="shared", core_ratio=0.2, explore_ratio=0.1,
               value_bits=2, quant_chunk=8, outer_lr=1.4)
    big = run_workers(_shapes_run, 2, shapes, dict(cfg, bucket_cap_mb=25.0), 12)[0]
    tiny = run_workers(_shapes_run, 2, shapes, dict(cfg, bucket_cap_mb=1e-6), 12)[0]
    assert all(torch.equal(a, b) for a, b in zip(big, tiny))


@pytest.mark.parametrize("compression", ["dense", "shared", "local"])
def test_empty_parameter_alone_in_a_group(compression):
    """A zero-element parameter alone in a group (after one larger than bucket_cap_mb)."""
    cfg = dict(sync_every=1, compression=compression, bucket_cap_mb=0.0005,
               value_bits=2 if compression == "dense" else None)
    res = run_workers(_shapes_run, 2, [(300,), (0,), (300,)], cfg, 3)
    for a, b in zip(res[0], res[1]):
        assert torch.equal(a, b) and torch.isfinite(a).all()


def test_ddp_hook_refuses_a_plain_compressor():
    from slimcomm.hooks import slim_dp_hook
    with pytest.raises(TypeError, match="state must be a SlimDPState"):
        slim_dp_hook(SlimDPCompressor(), None)
