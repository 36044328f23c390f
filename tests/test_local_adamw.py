"""LocalAdamW: the formula (float64 oracle in slimcomm.reference), AdamW at world size 1,
argument errors, resume, no host sync, and as SlimDPOptimizer's inner optimizer on gloo."""

import io

import pytest
import torch
from torch import nn

from _dist import run_workers
from slimcomm import reference
from slimcomm._opcount import OpCounter
from slimcomm.optim import LocalAdamW, SlimDPOptimizer
from test_optim import batch, make_model, params_of


def _params(seed=0, shapes=((7, 5), (5,), (3, 4, 2))):
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=g)) for s in shapes]


def _grads(params, step, scale=1.0):
    g = torch.Generator().manual_seed(1000 + step)
    # a common signal plus per-step noise of very different sizes per coordinate, so the
    # estimate's clamps (s^2 >= 0 and v_W >= v / W) are both active somewhere
    out = []
    for p in params:
        mu = torch.linspace(-1, 1, p.numel()).reshape(p.shape)
        noise = torch.randn(p.shape, generator=g) * torch.logspace(-2, 1, p.numel()).reshape(p.shape)
        out.append(scale * (mu + noise))
    return out


@pytest.mark.parametrize("world_size", [1, 2, 8])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_matches_the_float64_oracle(world_size, wd):
    params = _params()
    betas, eps = (0.9, 0.99), 1e-8
    opt = LocalAdamW([{"params": params[:2], "weight_decay": wd},
                      {"params": params[2:], "weight_decay": 0.0}],
                     lr=1e-2, betas=betas, eps=eps, world_size=world_size)
    ref = [p.detach().double().clone() for p in params]
    states = [dict(step=0, m=torch.zeros_like(r), v=torch.zeros_like(r), u=torch.zeros_like(r))
              for r in ref]
    for t in range(30):
        lr = 1e-2 * (1 - t / 40)  # a schedule: the group lr changes every step
        for grp in opt.param_groups:
            grp["lr"] = lr
        for p, g in zip(params, _grads(params, t)):
            p.grad = g.clone()
        opt.step()
        for i, g in enumerate(_grads(params, t)):
            d = wd if i < 2 else 0.0
            ref[i] = reference.local_adamw_step(ref[i], g, states[i], lr, betas, eps, d, world_size)
    for p, r in zip(params, ref):
        torch.testing.assert_close(p.detach().double(), r, rtol=1e-5, atol=1e-6)


def test_beta1_zero_is_adamw_at_any_world_size():
    """No momentum, no noise estimate (c would be 1): the step is AdamW's, not a division by 0."""
    a, b = _params(), _params()
    o1 = LocalAdamW(a, lr=1e-2, betas=(0.0, 0.99), weight_decay=0.1, world_size=8)
    o2 = torch.optim.AdamW(b, lr=1e-2, betas=(0.0, 0.99), weight_decay=0.1)
    ref = [p.detach().double().clone() for p in a]
    states = [dict(step=0, m=torch.zeros_like(r), v=torch.zeros_like(r), u=torch.zeros_like(r))
              for r in ref]
    for t in range(10):
        for p, q, g in zip(a, b, _grads(a, t)):
            p.grad, q.grad = g.clone(), g.clone()
        o1.step()
        o2.step()
        for i, g in enumerate(_grads(a, t)):
            ref[i] = reference.local_adamw_step(ref[i], g, states[i], 1e-2, (0.0, 0.99), 1e-8, 0.1, 8)
    for p, q, r in zip(a, b, ref):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(p.detach().double(), r, rtol=1e-5, atol=1e-6)


def test_the_estimate_changes_the_step_where_noise_dominates():
    """At world size 8 the noise-dominated coordinates move further than AdamW moves them,
    the signal-dominated ones about as far (the test would pass for no-op code otherwise)."""
    a, b = _params(), _params()
    o1 = LocalAdamW(a, lr=1e-3, weight_decay=0.0, world_size=1)
    o8 = LocalAdamW(b, lr=1e-3, weight_decay=0.0, world_size=8)
    start = [p.detach().clone() for p in a]
    for t in range(60):
        for p, q, g in zip(a, b, _grads(a, t)):
            p.grad, q.grad = g.clone(), g.clone()
        o1.step()
        o8.step()
    d1 = (a[0].detach() - start[0]).abs().flatten()
    d8 = (b[0].detach() - start[0]).abs().flatten()
    n = d1.numel()
    assert (d8[n // 2:] / d1[n // 2:]).mean() > 1.5     # large noise: larger steps
    torch.testing.assert_close(d8[:3], d1[:3], rtol=0.25, atol=0)   # small noise: the same


def test_world_size_one_is_adamw():
    a, b = _params(), _params()
    o1 = LocalAdamW(a, lr=3e-3, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.05, world_size=1)
    o2 = torch.optim.AdamW(b, lr=3e-3, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.05)
    for t in range(25):
        for p, q, g in zip(a, b, _grads(a, t)):
            p.grad, q.grad = g.clone(), g.clone()
        o1.step()
        o2.step()
    for p, q in zip(a, b):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kw, needle", [
    (dict(lr=-1.0), "lr"), (dict(lr=True), "lr"), (dict(betas=(0.9,)), "betas"),
    (dict(betas=(1.0, 0.99)), "betas[0]"), (dict(betas=(0.9, -0.1)), "betas[1]"),
    (dict(eps=-1e-8), "eps"), (dict(weight_decay=-0.1), "weight_decay"),
    (dict(world_size=0), "world_size"), (dict(world_size=2.0), "world_size"),
    (dict(world_size=True), "world_size"),
])
def test_bad_arguments_name_the_argument(kw, needle):
    params = _params()
    before = [p.detach().clone() for p in params]
    with pytest.raises((ValueError, TypeError), match=needle.replace("[", r"\[").replace("]", r"\]")):
        LocalAdamW(params, **kw)
    for p, q in zip(params, before):
        assert torch.equal(p.detach(), q)


def test_resume_from_state_dict_is_bit_exact():
    a = _params()
    opt = LocalAdamW(a, lr=1e-2, world_size=4)
    for t in range(5):
        for p, g in zip(a, _grads(a, t)):
            p.grad = g
        opt.step()
    buf = io.BytesIO()
    torch.save({"params": [p.detach().clone() for p in a], "opt": opt.state_dict()}, buf)
    for t in range(5, 12):
        for p, g in zip(a, _grads(a, t)):
            p.grad = g
        opt.step()
    buf.seek(0)
    blob = torch.load(buf)
    b = [nn.Parameter(t) for t in blob["params"]]
    opt2 = LocalAdamW(b, lr=1e-2, world_size=4)
    opt2.load_state_dict(blob["opt"])
    for t in range(5, 12):
        for p, g in zip(b, _grads(b, t)):
            p.grad = g
        opt2.step()
    for p, q in zip(a, b):
        assert torch.equal(p.detach(), q.detach())


@pytest.mark.parametrize("n_params", [3, 12])
def test_no_host_sync_and_ops_independent_of_the_parameter_count(n_params):
    params = [nn.Parameter(torch.randn(4, 3)) for _ in range(n_params)]
    opt = LocalAdamW(params, lr=1e-3, weight_decay=0.1, world_size=8)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()  # state creation
    with OpCounter() as c:
        opt.step()
    assert c.host_syncs == 0, c.ops
    test_no_host_sync_and_ops_independent_of_the_parameter_count.seen[n_params] = c.total
    seen = test_no_host_sync_and_ops_independent_of_the_parameter_count.seen
    if len(seen) == 2:
        assert seen[3] == seen[12], seen


test_no_host_sync_and_ops_independent_of_the_parameter_count.seen = {}


def _inner_run(rank, world_size, steps):
    model = make_model(rank)
    inner = LocalAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, world_size=world_size)
    opt = SlimDPOptimizer(model, inner, sync_every=3, compression="dense", value_bits=2)
    outs = []
    for t in range(steps):
        opt.zero_grad()
        x, y = batch(rank, t)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if (t + 1) % 3 == 0:
            outs.append(params_of(model))
    return outs


def test_as_the_inner_optimizer_of_slimdp_local_replicas_stay_identical():
    res = run_workers(_inner_run, 3, 9, timeout=120)
    for sync in range(3):
        for r in (1, 2):
            for p, q in zip(res[0][sync], res[r][sync]):
                assert torch.equal(p, q)
    # and training moved the model
    assert any(not torch.equal(p, q) for p, q in zip(res[0][0], res[0][-1]))
