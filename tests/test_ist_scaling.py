"""ISTTrainer's gradient scaling (issue 24): one SGD learning rate for every world size.

* the exponents ``k`` (sliced dimensions) of every tensor;
* the claim behind them, exactly, on an MLP whose hidden neurons are
  interchangeable (so the rescaled subnet computes the full model's function):
  the scaled subnet gradients are the full model's, at world sizes 2, 4, 8;
* the trainer on real gloo ranks (2 and 3, uneven blocks): its subnet after
  local steps equals a reference built from :func:`extract_subnet` with the
  gradients multiplied by hand, also when the gradients are dropped
  mid-round; replicas identical after every synchronisation; bit-exact
  resume mid-round.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from _dist import run_workers
from slimcomm import ist


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_states_equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_grad_exponents_are_the_sliced_dimensions():
    model = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 6),
                          nn.LayerNorm(6), nn.Tanh(), nn.Linear(6, 3))
    plan = ist._build_plan(model)
    got = {(s.module, s.name): k for s, k in zip(plan.slices, ist._grad_exponents(plan))}
    assert got == {(0, "weight"): 1, (0, "bias"): 1, (3, "weight"): 2, (3, "bias"): 1,
                   (6, "weight"): 1, (1, "weight"): 1, (1, "bias"): 1,
                   (1, "running_mean"): 1, (1, "running_var"): 1,
                   (4, "weight"): 1, (4, "bias"): 1}
    assert ist._grad_exponents(plan)[len(plan.slices):] == [0]   # the shared output bias


def _symmetric_mlp(d=7, n=24, o=4, seed=0):
    """Every hidden neuron of a layer has the same weights: a subnet with inputs
    scaled by W computes exactly the full model's function (for n % W == 0)."""
    g = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Linear(d, n), nn.Tanh(), nn.Linear(n, n), nn.Tanh(), nn.Linear(n, o))
    with torch.no_grad():
        model[0].weight.copy_(torch.randn(1, d, generator=g).expand(n, d))
        model[0].bias.fill_(0.1)
        model[2].weight.fill_(0.7 / n)
        model[2].bias.fill_(-0.2)
        model[4].weight.copy_(torch.randn(o, 1, generator=g).expand(o, n))
        model[4].bias.copy_(torch.randn(o, generator=g))
    return model


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_scaled_subnet_gradients_are_the_full_models(world_size):
    # On a model whose neurons are interchangeable the rescaled subnet is exact, so its
    # gradients times world_size**-k must equal the full model's on the same entries, which
    # makes one SGD step of the subnet the full model's step (the lr then means the same at
    # every W). Unscaled, they are world_size**k times too large.
    model = _symmetric_mlp()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 7, generator=g), torch.randint(0, 4, (16,), generator=g)
    F.cross_entropy(model(x), y).backward()
    blocks = ist.partition([24, 24], world_size, 5, 2)
    plan = ist._build_plan(model)
    for rank in range(world_size):
        sub = ist.extract_subnet(model, blocks, rank)
        torch.testing.assert_close(sub(x), model(x), rtol=1e-5, atol=1e-6)
        F.cross_entropy(sub(x), y).backward()
        mods = [m for m in sub if type(m) is not ist.InputScale]
        for s, k in zip(plan.slices, ist._grad_exponents(plan)):
            full = getattr(model[s.module], s.name).grad
            if s.row_layer is not None:
                full = full[blocks[s.row_layer][rank]]
            if s.col_layer is not None:
                full = full[:, blocks[s.col_layer][rank]]
            got = getattr(mods[s.module], s.name).grad
            torch.testing.assert_close(got * float(world_size) ** -k, full, rtol=1e-4, atol=1e-7)
            if k and full.abs().max() > 1e-6:
                assert not torch.allclose(got, full, rtol=0.1), (s, k)
        torch.testing.assert_close(mods[4].bias.grad, model[4].bias.grad)   # shared, k = 0


DIST_SIZES = (6, 10, 8, 3)   # 10 and 8 hidden neurons: uneven blocks on 3 ranks


def _dist_model(seed=0):
    d, h1, h2, o = DIST_SIZES
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d, h1), nn.BatchNorm1d(h1), nn.ReLU(),
                         nn.Linear(h1, h2), nn.LayerNorm(h2), nn.Tanh(), nn.Linear(h2, o))


def _reference_subnet(model, blocks, rank, world_size, batches, factory, drop_at=None):
    """Rank's subnet trained by hand: extract_subnet, grads times world_size**-k, SGD."""
    sub = ist.extract_subnet(model, blocks, rank)
    plan = ist._build_plan(model)
    mods = [m for m in sub if type(m) is not ist.InputScale]
    factors = {}
    for s, k in zip(plan.slices, ist._grad_exponents(plan)):
        factors[id(getattr(mods[s.module], s.name))] = float(world_size) ** -k
    opt = factory(sub.parameters())
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(sub(x), y).backward()
        with torch.no_grad():
            for p in sub.parameters():
                f = factors.get(id(p), 1.0)
                if f != 1.0:
                    p.grad.mul_(f)
        opt.step()
    return _state(sub)


def _scaling_body(rank, world_size):
    factory = lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)  # noqa: E731
    model = _dist_model(seed=rank)
    trainer = ist.ISTTrainer(model, factory, local_steps=3, seed=11)
    assert trainer.scale_grads
    g = torch.Generator().manual_seed(100 + rank)
    data = [(torch.randn(8, DIST_SIZES[0], generator=g),
             torch.randint(0, DIST_SIZES[3], (8,), generator=g)) for _ in range(12)]
    out = {"rounds": []}
    for rnd in range(4):
        start = copy.deepcopy(model)
        blocks = [[b.clone() for b in layer] for layer in trainer.blocks]
        batches = data[3 * rnd:3 * rnd + 3]
        for i, (x, y) in enumerate(batches[:2]):
            if rnd == 2 and i == 1:
                trainer.subnet.zero_grad(set_to_none=True)   # dropped views: re-attached
            trainer.step(x, y, F.cross_entropy)
        sub = _state(trainer.subnet)
        want = _reference_subnet(start, blocks, rank, world_size, batches[:2], factory)
        if rnd == 1:    # mid-round checkpoint, resumed in a fresh trainer below
            out["mid_state"] = copy.deepcopy(trainer.state_dict())
            out["mid_rest"] = batches[2:]
        trainer.step(*batches[2], F.cross_entropy)          # ends the round: synchronize
        out["rounds"].append(dict(sub=sub, want=want, model=_state(model)))
    # Resume from the round-1 mid-round state on a fresh trainer (every rank its own state).
    fresh = ist.ISTTrainer(_dist_model(seed=50 + rank), factory, local_steps=3, seed=11)
    fresh.load_state_dict(out.pop("mid_state"))
    for x, y in out.pop("mid_rest"):
        fresh.step(x, y, F.cross_entropy)
    out["resumed"] = _state(fresh.model)
    # The unscaled trainer (the original IST update) differs after one round.
    raw_model = _dist_model(seed=0)
    raw = ist.ISTTrainer(raw_model, factory, local_steps=3, seed=11, scale_grads=False)
    for x, y in data[:3]:
        raw.step(x, y, F.cross_entropy)
    out["raw"] = _state(raw_model)
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_trainer_scaled_grads_match_reference_and_replicas_agree(world_size):
    res = run_workers(_scaling_body, world_size, timeout=240)
    for rank, r in enumerate(res):
        for rnd, rec in enumerate(r["rounds"]):
            _assert_states_equal(rec["want"], rec["sub"])   # bit-exact vs the hand-made reference
    for r in res[1:]:
        for a, b in zip(res[0]["rounds"], r["rounds"]):
            _assert_states_equal(a["model"], b["model"])    # replicas identical after every sync
        _assert_states_equal(res[0]["raw"], r["raw"])
    # Resuming round 1 mid-way reproduces the model after round 1 exactly.
    for r in res:
        _assert_states_equal(res[0]["rounds"][1]["model"], r["resumed"])
    # Scaling changes training (the test would pass trivially if it were a no-op).
    assert not torch.equal(res[0]["raw"]["3.weight"], res[0]["rounds"][0]["model"]["3.weight"])
