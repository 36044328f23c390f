"""``SlimDPState.fuse_sgd`` (issue 31): the hook applies plain SGD at the index set itself.

The oracle is the unfused hook followed by ``torch.optim.SGD`` (no momentum, no weight
decay) on the same gradients: fused, the parameters must come out bit for bit the same,
on every rank, whatever the bucketing (several buckets, some of dense parameters only,
which the optimizer still steps), with an lr scheduler, and after a non-finite gradient
(which the fused step leaves out where the unfused one writes NaN). Multi-rank runs use
gloo through ``_dist.run_workers``.
"""

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from _dist import run_workers
from test_hooks import BASE, Net, batch, loss_fn, make_model
from slimcomm import ops
from slimcomm import reference as ref
from slimcomm.hooks import SlimDPState, slim_dp_hook

SMALL_BUCKETS = dict(bucket_cap_mb=0.001)  # several buckets, some of dense parameters only
STEPS = 10


def _train(rank, fused, ddp_kw, sched=False, nan_at=None, view=False, momentum_at=None,
           step_twice=False):
    model = make_model()
    ddp = DDP(model, gradient_as_bucket_view=view, **ddp_kw)
    state = SlimDPState(**BASE).attach(ddp)
    ddp.register_comm_hook(state, slim_dp_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    if fused:
        state.fuse_sgd(opt)
    lr_sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5) if sched else None
    if nan_at is not None and rank == 1:
        box = {"t": -1}
        model.fc1.weight.register_hook(
            lambda g: g * float("nan") if box["t"] == nan_at else g)
    history = []
    for t in range(STEPS):
        if nan_at is not None and rank == 1:
            box["t"] = t
        opt.zero_grad(set_to_none=True)
        x, y = batch(rank, t)
        loss_fn(ddp(x), y).backward()
        opt.step()
        if step_twice:
            opt.step()  # the fused parameters stay skipped until the next synchronised step
        if lr_sched is not None:
            lr_sched.step()
        if momentum_at is not None and t == momentum_at:
            opt.param_groups[0]["momentum"] = 0.9  # from here on the hook falls back, unfused
        history.append([p.detach().clone() for p in model.parameters()])
    return dict(history=history, nonfinite=state.stats["total"].get("nonfinite_params"),
                stats=state.stats["total"])


def _cases(rank, world_size):
    out = {}
    for key, kw in (("small", dict(ddp_kw=SMALL_BUCKETS)), ("one", dict(ddp_kw={})),
                    ("view", dict(ddp_kw={}, view=True)),
                    ("sched", dict(ddp_kw=SMALL_BUCKETS, sched=True))):
        out[key] = {f: _train(rank, f, **kw) for f in (False, True)}
    out["nan"] = {f: _train(rank, f, dict(), nan_at=6) for f in (False, True)}
    out["momentum"] = {f: _train(rank, f, SMALL_BUCKETS, momentum_at=5) for f in (False, True)}
    out["twice"] = {f: _train(rank, f, {}, step_twice=True) for f in (False, True)}
    return out


@pytest.fixture(scope="module")
def two():
    return run_workers(_cases, 2, timeout=300)


@pytest.mark.parametrize("key", ["small", "one", "view", "sched", "momentum"])
def test_fused_equals_unfused_bit_for_bit_on_every_rank(two, key):
    for rank in range(2):
        plain, fused = two[rank][key][False]["history"], two[rank][key][True]["history"]
        for t, (a, b) in enumerate(zip(plain, fused)):
            for i, (pa, pb) in enumerate(zip(a, b)):
                assert torch.equal(pa, pb), (key, rank, t, i)
    for t in range(STEPS):  # replicas identical
        for pa, pb in zip(two[0][key][True]["history"][t], two[1][key][True]["history"][t]):
            assert torch.equal(pa, pb)
    # the fused runs trained (not a no-op): every parameter moved
    first, last = two[0][key][True]["history"][0], two[0][key][True]["history"][-1]
    assert all(not torch.equal(a, b) for a, b in zip(first, last))


def test_step_called_twice_keeps_the_replicas_identical(two):
    # unfused, a second step() applies the average again; fused, the fused parameters stay
    # skipped until the next synchronised step (never this rank's own gradient)
    for t in range(STEPS):
        for pa, pb in zip(two[0]["twice"][True]["history"][t], two[1]["twice"][True]["history"][t]):
            assert torch.equal(pa, pb), t


def test_nonfinite_parameter_left_unchanged_where_unfused_writes_nan(two):
    names = [n for n, _ in make_model().named_parameters()]
    w = names.index("fc1.weight")
    for rank in range(2):
        plain, fused = two[rank]["nan"][False]["history"], two[rank]["nan"][True]["history"]
        for t in range(6):
            assert all(torch.equal(a, b) for a, b in zip(plain[t], fused[t]))
        assert torch.isnan(plain[6][w]).all()              # unfused: SGD applied the NaN
        assert torch.equal(fused[6][w], fused[5][w])       # fused: left out at step 6
        assert torch.isfinite(fused[-1][w]).all()
        for i in range(len(names)):                        # the others still stepped
            if i != w:
                assert not torch.equal(fused[6][i], fused[5][i])
    assert two[0]["nan"][True]["stats"] == two[1]["nan"][True]["stats"]


# ---------------------------------------------------------------------------
# The op against its reference and against torch's SGD
# ---------------------------------------------------------------------------


def _case(seed, pdtype, wdtype, keep_all_zero, flags):
    g = torch.Generator().manual_seed(seed)
    shapes = [(6, 7), (9,), (2, 3, 4, 5), (4,)]
    params = [torch.randn(s, generator=g).to(pdtype) for s in shapes]
    params[2] = params[2].contiguous(memory_format=torch.channels_last)
    sizes = [p.numel() for p in params]
    offsets = torch.tensor([0] + torch.tensor(sizes).cumsum(0).tolist())
    n = int(offsets[-1])
    core, explore = [], []
    for s, size in enumerate(sizes):  # two ascending runs, as the selection ops give
        perm = torch.randperm(size, generator=g)[: max(1, size // 3)] + offsets[s]
        core.append(perm[: len(perm) // 2].sort().values)
        explore.append(perm[len(perm) // 2:].sort().values)
    idx = torch.cat(core + explore)
    vals = torch.randn(idx.numel(), generator=g)
    avg = torch.cat([vals, torch.tensor(flags, dtype=torch.float32)]).to(wdtype)
    assert idx.unique().numel() == idx.numel() and int(idx.max()) < n
    return params, idx, offsets, avg


FLAGS = [[1.0, 1.0, 1.0, 1.0], [1.0, float("nan"), 0.0, 2.0], [0.0, 0.0, 1.0, float("inf")]]


@pytest.mark.parametrize("pdtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("keep_all_zero", [False, True])
@pytest.mark.parametrize("flags", FLAGS)
def test_op_matches_reference(pdtype, wdtype, keep_all_zero, flags):
    params, idx, offsets, avg = _case(3, pdtype, wdtype, keep_all_zero, flags)
    want = [p.clone() for p in params]
    ref.sgd_apply_indexed(want, idx, offsets, avg, 0.37, keep_all_zero)
    got = [p.clone() for p in params]
    for p, q in zip(got, params):
        assert p.stride() == q.stride()
    ops.sgd_apply_indexed(got, idx, offsets, avg, 0.37, keep_all_zero)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("order", ["ascending runs", "shuffled"])
def test_op_matches_reference_large_any_order(order):
    """Past the parallel grain (several chunks, each with its own segment cursor and
    prefetch window) and with an empty segment: ascending runs as the selection ops give,
    or every index in random order (the op's contract allows any order)."""
    g = torch.Generator().manual_seed(11)
    sizes = [70_000, 0, 3, 50_000, 1]
    params = [torch.randn(n, generator=g) for n in sizes]
    offsets = torch.tensor([0] + torch.tensor(sizes).cumsum(0).tolist())
    n = int(offsets[-1])
    idx = torch.randperm(n, generator=g)[: n // 3]
    idx = idx.sort().values if order == "ascending runs" else idx
    S = len(sizes)
    avg = torch.cat([torch.randn(idx.numel(), generator=g), torch.ones(S)]).bfloat16()
    avg[S] = float("nan")  # a non-finite value: its segment is left unchanged
    want = [p.clone() for p in params]
    ref.sgd_apply_indexed(want, idx, offsets, avg, 0.37, False)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = [p.clone() for p in params]
        ops.sgd_apply_indexed(got, idx, offsets, avg, 0.37, False)
    finally:
        torch.set_num_threads(threads)
    for a, b, p in zip(got, want, params):
        assert torch.equal(a, b)
    assert sum(not torch.equal(a, p) for a, p in zip(got, params)) >= 2


def test_op_matches_torch_sgd_on_the_committed_bucket():
    """fp32: the fused update equals step_commit's bucket stepped by torch.optim.SGD."""
    params, idx, offsets, avg = _case(5, torch.float32, torch.bfloat16, True, FLAGS[1])
    fused = [p.clone() for p in params]
    ops.sgd_apply_indexed(fused, idx, offsets, avg, 0.37, keep_all_zero=True)
    n = int(offsets[-1])
    buf = torch.empty(n)
    ops.step_commit(buf, idx, offsets, avg, torch.zeros(2, dtype=torch.int64), keep_all_zero=True)
    plain = [nn.Parameter(p.clone()) for p in params]
    for s, p in enumerate(plain):  # the bucket's segment in the parameter's memory order
        seg = buf[int(offsets[s]):int(offsets[s + 1])]
        p.grad = torch.empty_like(p)
        ref_flat = p.grad.permute(sorted(range(p.dim()), key=lambda d: -p.stride(d))) \
            if p.dim() > 1 else p.grad
        ref_flat.view(-1).copy_(seg)
    torch.optim.SGD(plain, lr=0.37).step()
    for s, (a, b) in enumerate(zip(fused, plain)):
        if s == 1:  # flagged NaN on some rank: unfused it becomes NaN, fused it is left alone
            assert torch.isnan(b).all() and torch.equal(a, params[s])
        else:
            assert torch.equal(a, b.detach()), s


@pytest.mark.parametrize("mutate,needle", [
    (lambda a: a.update(params=a["params"][:-1]), "params"),
    (lambda a: a["params"].__setitem__(0, a["params"][0].double()), "params"),
    (lambda a: a["params"].__setitem__(1, torch.zeros(8)), "params"),
    (lambda a: a["params"].__setitem__(0, torch.zeros(7, 12)[:, ::2]), "params"),
    (lambda a: a.update(avg=a["avg"][:-1]), "avg"),
    (lambda a: a["idx"].__setitem__(0, 10_000), "indices"),
    (lambda a: a.update(idx=a["idx"].int()), "indices"),
])
def test_op_bad_arguments_name_the_argument(mutate, needle):
    params, idx, offsets, avg = _case(1, torch.float32, torch.float32, False, FLAGS[0])
    a = dict(params=params, idx=idx.clone(), avg=avg)
    mutate(a)
    before = [p.clone() for p in params]
    with pytest.raises(RuntimeError, match=needle):
        ops.sgd_apply_indexed(a["params"], a["idx"], offsets, a["avg"], 0.1)
    assert all(torch.equal(p, q) for p, q in zip(params, before))  # nothing written


# ---------------------------------------------------------------------------
# fuse_sgd's refusals (one rank: no collective needed to check them)
# ---------------------------------------------------------------------------


def test_fuse_sgd_refusals():
    model = make_model()
    with pytest.raises(RuntimeError, match="attach"):
        SlimDPState(**BASE).fuse_sgd(torch.optim.SGD(model.parameters(), lr=0.1))
    state = SlimDPState(**BASE).attach(model)
    with pytest.raises(TypeError, match="torch.optim.SGD"):
        state.fuse_sgd(torch.optim.AdamW(model.parameters(), lr=0.1))
    for kw, needle in ((dict(momentum=0.9), "momentum"), (dict(weight_decay=1e-4), "weight_decay"),
                       (dict(momentum=0.9, nesterov=True), "momentum"),
                       (dict(maximize=True), "maximize"),
                       (dict(lr=torch.tensor(0.1)), "a tensor")):
        with pytest.raises(ValueError, match=needle):
            state.fuse_sgd(torch.optim.SGD(model.parameters(), **{"lr": 0.1, **kw}))
    with pytest.raises(ValueError, match="scale"):  # the first parameter, by name
        state.fuse_sgd(torch.optim.SGD(list(model.parameters())[1:], lr=0.1))
    with pytest.raises(ValueError, match="index_mode"):
        SlimDPState(**{**BASE, "index_mode": "local"}).attach(model).fuse_sgd(
            torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="delay_steps"):
        SlimDPState(**{**BASE, "delay_steps": 1}).attach(model).fuse_sgd(
            torch.optim.SGD(model.parameters(), lr=0.1))
    scaled = SlimDPState(**BASE).attach(model).attach_grad_scaler(torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match="GradScaler"):
        scaled.fuse_sgd(torch.optim.SGD(model.parameters(), lr=0.1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state.fuse_sgd(opt)
    with pytest.raises(ValueError, match="GradScaler"):
        state.attach_grad_scaler(torch.amp.GradScaler("cpu"))
    # at each step: a group that is no longer plain SGD falls back to the unfused path
    opt.param_groups[0]["momentum"] = 0.9
    assert state._fused.for_layout((0, 1), torch.float32) is None
    opt.param_groups[0]["momentum"] = 0.0
    assert state._fused.for_layout((0, 1), torch.float32)[1] == 0.1
    assert state._fused.for_layout((0, 1), torch.bfloat16) is None       # fp32 only
    groups = [{"params": [p], "lr": 0.1 * (i + 1)} for i, p in enumerate(model.parameters())]
    state.fuse_sgd(torch.optim.SGD(groups, lr=0.1))
    assert state._fused.for_layout((0, 1), torch.float32) is None       # two lrs in one bucket
    assert state._fused.for_layout((1,), torch.float32)[1] == pytest.approx(0.2)
    kept = state._fused
    with pytest.raises(ValueError, match="momentum"):   # a refused re-fuse keeps the old one
        state.fuse_sgd(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    assert state._fused is kept
    state.attach(make_model())                           # re-attach drops the fusion
    assert state._fused is None
    state.fuse_sgd(None)
    assert state._fused is None and state._fused_sgd(None) is None
    frozen = make_model()
    frozen.fc1.bias.requires_grad_(False)                # an optimizer over trainable ones only
    SlimDPState(**BASE).attach(frozen).fuse_sgd(
        torch.optim.SGD([p for p in frozen.parameters() if p.requires_grad], lr=0.1))
    with pytest.raises(TypeError, match="subclass"):
        class MySGD(torch.optim.SGD):
            pass
        SlimDPState(**BASE).attach(frozen).fuse_sgd(MySGD(frozen.parameters(), lr=0.1))


def test_step_skips_only_the_fused_groups_and_restores_the_lists():
    model = make_model()
    state = SlimDPState(**BASE).attach(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    state.fuse_sgd(opt)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)  # wraps opt.step too
    params = list(model.parameters())
    for p in params:
        p.grad = torch.ones_like(p)
    before = [p.detach().clone() for p in params]
    state._fused.for_layout((0, 1), torch.float32)   # the hook fused fc1 in this backward
    state._fused.end_step()
    opt.step()
    assert torch.equal(params[0], before[0]) and torch.equal(params[1], before[1])
    assert all(not torch.equal(p, b) for p, b in zip(params[2:], before[2:]))
    assert opt.param_groups[0]["params"] == params   # the full list is back
    sched.step()
    with pytest.raises(RuntimeError, match="closure"):
        opt.step(lambda: 0.0)
    assert opt.param_groups[0]["params"] == params

    def boom(o, args, kwargs):
        raise KeyError("user pre-hook")
    h = opt.register_step_pre_hook(boom)
    with pytest.raises(KeyError):
        opt.step()
    h.remove()
    assert opt.param_groups[0]["params"] == params   # restored although step() raised
    opt.step()                                         # same synchronised step: still skipped
    assert torch.equal(params[0], before[0])
    state._fused.end_step()                            # a step in which nothing was fused
    opt.step()
    assert not torch.equal(params[0], before[0])
    state._fused.for_layout((0, 1), torch.float32)
    state._fused.end_step()
    state.fuse_sgd(None)  # the wrapper (under the scheduler's) now passes every call through
    mid = params[0].detach().clone()
    opt.step()
    assert not torch.equal(params[0], mid)


def test_two_states_on_one_optimizer_keep_its_lists():
    a, b = make_model(), make_model()
    opt = torch.optim.SGD(list(a.parameters()) + list(b.parameters()), lr=0.5)
    sa = SlimDPState(**BASE).attach(a).fuse_sgd(opt)
    sb = SlimDPState(**BASE).attach(b)
    with pytest.raises(ValueError, match="trainable parameters"):
        sb.fuse_sgd(torch.optim.SGD(a.parameters(), lr=0.5))
    sb.fuse_sgd(opt)
    full = list(opt.param_groups[0]["params"])
    for p in full:
        p.grad = torch.ones_like(p)
    sa._fused.for_layout((0, 1), torch.float32)
    sa._fused.end_step()
    sb._fused.for_layout((2, 3), torch.float32)
    sb._fused.end_step()
    before = [p.detach().clone() for p in full]
    opt.step()
    assert opt.param_groups[0]["params"] == full
    moved = [not torch.equal(p, q) for p, q in zip(full, before)]
    n = len(list(a.parameters()))
    assert moved[:2] == [False, False] and moved[n + 2:n + 4] == [False, False]
    assert all(moved[2:n]) and moved[n:n + 2] == [True, True]
    sa.fuse_sgd(None)
    sb.fuse_sgd(None)
    opt.step()
    assert all(not torch.equal(p, q) for p, q in zip(full, before))
