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


# ---------------------------------------------------------------------------
# Shared neurons (overlapping subnets)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("world_size, frac", [(2, 0.25), (3, 0.5), (8, 0.3)])
def test_partition_with_shared_neurons(world_size, frac):
    sizes = [40, 23]
    counts = ist.shared_counts(sizes, world_size, frac)
    assert counts == [min(int(frac * n), n - world_size) for n in sizes]
    blocks = ist.partition(sizes, world_size, 7, 3, shared=frac)
    for l, (n, m) in enumerate(zip(sizes, counts)):
        head = blocks[l][0][:m]
        assert torch.equal(head, torch.sort(head).values)
        own = []
        for b in blocks[l]:
            assert torch.equal(b[:m], head)                        # same shared prefix everywhere
            assert torch.equal(b[m:], torch.sort(b[m:]).values)    # own chunk sorted
            own.append(b[m:])
        every = torch.cat([head] + own)
        assert torch.equal(torch.sort(every).values, torch.arange(n))   # shared + own = a partition
        assert max(o.numel() for o in own) - min(o.numel() for o in own) <= 1
    # shared = 0 is the plain partition, bit for bit
    plain, zero = ist.partition(sizes, world_size, 7, 3), ist.partition(sizes, world_size, 7, 3, shared=0.0)
    assert all(torch.equal(a, b) for la, lb in zip(plain, zero) for a, b in zip(la, lb))
    with pytest.raises(ValueError, match="shared"):
        ist.partition(sizes, world_size, 7, 3, shared=1.0)
    assert ist.shared_counts(sizes, 1, 0.5) == [0, 0]


def test_overlapping_blocks_are_validated():
    model = _symmetric_mlp()
    blocks = ist.partition([24, 24], 4, 1, 0, shared=0.25)
    counts = ist.shared_counts([24, 24], 4, 0.25)
    ist.extract_subnet(model, blocks, 1, shared=counts)
    with pytest.raises(ValueError, match="holds 42 indices"):
        ist.extract_subnet(model, blocks, 1)        # overlapping blocks without shared counts
    bad = [[b.clone() for b in layer] for layer in blocks]
    bad[0][2][0] = (bad[0][2][0] + 1) % 24
    with pytest.raises(ValueError, match="same 6 shared"):
        ist.extract_subnet(model, bad, 0, shared=counts)


@pytest.mark.parametrize("world_size, frac", [(2, 0.5), (4, 0.25), (8, 0.25)])
def test_shared_subnet_gradients_are_the_full_models(world_size, frac):
    # Per-neuron scale c (1 shared, W own); gradient (i, j) times 1 / (c_i c_j) = the full model's.
    model = _symmetric_mlp(n=32)
    counts = ist.shared_counts([32, 32], world_size, frac)
    assert all((32 - m) % world_size == 0 for m in counts)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 7, generator=g), torch.randint(0, 4, (16,), generator=g)
    F.cross_entropy(model(x), y).backward()
    blocks = ist.partition([32, 32], world_size, 5, 2, shared=frac)
    for rank in range(world_size):
        sub = ist.extract_subnet(model, blocks, rank, shared=counts)
        scales = [m for m in sub if type(m) is ist.InputScale]
        assert [s.scale[:counts[i]].unique().tolist() for i, s in enumerate(scales)] == [[1.0], [1.0]]
        torch.testing.assert_close(sub(x), model(x), rtol=1e-5, atol=1e-6)
        F.cross_entropy(sub(x), y).backward()
        lin = [m for m in sub if type(m) is nn.Linear]
        c = [torch.cat([torch.ones(m), torch.full(((32 - m) // world_size,), float(world_size))])
             for m in counts]
        b0, b1 = blocks[0][rank], blocks[1][rank]
        pairs = [(lin[0].weight, model[0].weight.grad[b0], c[0][:, None]),
                 (lin[0].bias, model[0].bias.grad[b0], c[0]),
                 (lin[1].weight, model[2].weight.grad[b1][:, b0], c[1][:, None] * c[0][None, :]),
                 (lin[1].bias, model[2].bias.grad[b1], c[1]),
                 (lin[2].weight, model[4].weight.grad[:, b1], c[1][None, :])]
        for p, full, cc in pairs:
            torch.testing.assert_close(p.grad / cc, full, rtol=1e-4, atol=1e-7)


def _shared_body(rank, world_size, frac, depth=1):
    factory = lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)  # noqa: E731
    model = _dist_model(seed=rank)
    # exact exchange: the test checks the written values against the subnets' own
    trainer = ist.ISTTrainer(model, factory, local_steps=3, seed=11, shared=frac,
                             exchange_bits=None)
    counts = ist.shared_counts(list(DIST_SIZES[1:3]), world_size, frac)
    g = torch.Generator().manual_seed(100 + rank)
    data = [(torch.randn(8, DIST_SIZES[0], generator=g),
             torch.randint(0, DIST_SIZES[3], (8,), generator=g)) for _ in range(9)]
    out = {"rounds": [], "counts": counts}
    for rnd in range(3):
        before = _state(model)
        blocks = [[b.clone() for b in layer] for layer in trainer.blocks]
        for i, (x, y) in enumerate(data[3 * rnd:3 * rnd + 2]):
            trainer.step(x, y, F.cross_entropy)
        if rnd == 1:
            out["mid_state"] = copy.deepcopy(trainer.state_dict())
        trained = _state(trainer.subnet)
        mine = trainer.payload_numel(rank)
        widest = max(trainer.payload_numel(q) for q in range(world_size))
        trainer.synchronize()
        out["rounds"].append(dict(before=before, blocks=blocks, model=_state(model), trained=trained,
                                  mine=mine, widest=widest))
    fresh = ist.ISTTrainer(_dist_model(seed=9), factory, local_steps=3, seed=11, shared=frac,
                           exchange_bits=None)
    fresh.load_state_dict(out.pop("mid_state"))
    fresh.synchronize()
    out["resumed"] = _state(fresh.model)
    out["stats"] = trainer.stats
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_trainer_with_shared_neurons_averages_the_shared_region(world_size):
    frac = 0.4
    res = run_workers(_shared_body, world_size, frac, timeout=240)
    counts = res[0]["counts"]
    assert all(counts)
    for r in res[1:]:
        for a, b in zip(res[0]["rounds"], r["rounds"]):
            _assert_states_equal(a["model"], b["model"])      # replicas identical after every sync
        _assert_states_equal(res[0]["rounds"][1]["model"], r["resumed"])  # bit-exact resume
    _assert_states_equal(res[0]["rounds"][1]["model"], res[0]["resumed"])
    # The last round, by hand: the hidden Linear's shared x shared block is the mean of every
    # rank's trained subnet (fp32 sum over ranks / W); the own rows are the owning rank's.
    m0, m1 = counts
    rnd = -1
    blocks = res[0]["rounds"][rnd]["blocks"]
    final = res[0]["rounds"][rnd]["model"]
    subs = [r["rounds"][rnd]["trained"] for r in res]   # subnet keys: 4 = hidden Linear, 8 = last
    mean = sum(sub["4.weight"][:m1, :m0].float() for sub in subs) / world_size
    torch.testing.assert_close(final["3.weight"][blocks[1][0][:m1]][:, blocks[0][0][:m0]], mean,
                               rtol=1e-6, atol=1e-7)
    mean_first = sum(sub["0.weight"][:m0] for sub in subs) / world_size
    torch.testing.assert_close(final["0.weight"][blocks[0][0][:m0]], mean_first, rtol=1e-6, atol=1e-7)
    for r, sub in enumerate(subs):        # own rows (x the whole block): exactly the owner's values
        own1, blk0 = blocks[1][r][m1:], blocks[0][r]
        assert torch.equal(final["3.weight"][own1][:, blk0], sub["4.weight"][m1:])
        assert torch.equal(final["6.weight"][:, own1], sub["8.weight"][:, m1:])
        assert torch.equal(final["0.weight"][blocks[0][r][m0:]], sub["0.weight"][m0:])
    before = res[0]["rounds"][rnd]["before"]
    s0, s1 = blocks[0][0][:m0], blocks[1][0][:m1]
    # Untrained cross-block weights (own rows of one rank x own columns of another) keep their value.
    for r in range(world_size):
        for q in range(world_size):
            if r != q:
                rows, cols = blocks[1][r][m1:], blocks[0][q][m0:]
                assert torch.equal(final["3.weight"][rows][:, cols], before["3.weight"][rows][:, cols])
    assert not torch.equal(final["3.weight"][s1][:, s0], before["3.weight"][s1][:, s0])
    # Bytes: the all-gather and the fp32 all-reduce of the shared region are both counted.
    d, h1, h2, o = DIST_SIZES
    n_shared = d * m0 + m0 + 4 * m0 + m1 * m0 + m1 + 2 * m1 + o * m1   # Linear, BN, Linear, LN, Linear
    w = world_size
    for rank, r in enumerate(res):
        st = r["stats"]
        assert st.rounds == 3
        assert st.payload_bytes == sum(4 * (x["mine"] + n_shared) for x in r["rounds"])
        assert st.bytes_sent == sum(4 * (w - 1) * x["widest"] + 2 * (w - 1) * n_shared * 4 // w
                                    for x in r["rounds"])


def _shared_sync_ops(rank, world_size, hidden_layers):
    from slimcomm._opcount import OpCounter
    torch.manual_seed(0)
    layers = [nn.Linear(5, 8)]
    for l in range(hidden_layers):
        layers += [nn.LayerNorm(8), nn.ReLU(), nn.Linear(8, 8 if l < hidden_layers - 1 else 3)]
    trainer = ist.ISTTrainer(nn.Sequential(*layers), lambda p: torch.optim.SGD(p, lr=0.05),
                             local_steps=2, seed=1, shared=0.5)
    counter = OpCounter()
    part = {"ops": 0}
    real_partition = ist.rounds.partition  # looked up in slimcomm.ist.rounds

    def counted_partition(*args, **kwargs):
        before = counter.total
        out = real_partition(*args, **kwargs)
        part["ops"] += counter.total - before
        return out

    real_sync = trainer.synchronize
    rows = []

    def counted_sync():
        counter.reset()
        part["ops"] = 0
        with counter:
            real_sync()
        rows.append((counter.total - part["ops"], counter.host_syncs, dict(counter.ops)))

    trainer.synchronize = counted_sync
    ist.rounds.partition = counted_partition
    try:
        g = torch.Generator().manual_seed(rank)
        for _ in range(8):
            trainer.step(torch.randn(4, 5, generator=g), torch.randint(0, 3, (4,), generator=g),
                         F.cross_entropy)
    finally:
        ist.rounds.partition = real_partition
    return rows


def test_shared_synchronize_ops_constant_in_depth_and_no_host_sync():
    per = {}
    for depth in (2, 5):
        rows = run_workers(_shared_sync_ops, 2, depth, timeout=240)[0]
        assert all(s == 0 for _, s, _ in rows), rows
        per[depth] = {t for t, _, _ in rows}
        assert len(per[depth]) == 1, rows
    assert per[2] == per[5], per
