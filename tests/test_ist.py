"""Tests of slimcomm.ist: partition, subnet extraction/write-back, ISTTrainer.

Distributed cases run real gloo process groups through ``_dist.run_workers``
(spawned ranks, FileStore rendezvous, a timeout on everything).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from _dist import run_workers
from slimcomm import ist

# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------


def _mlp(kind: str, sizes=(5, 7, 6, 3), bias: bool = True, seed: int = 0) -> nn.Sequential:
    """An MLP exercising one supported layer type between the Linear layers."""
    torch.manual_seed(seed)
    d, h1, h2, o = sizes
    between = {
        "relu": lambda n: [nn.ReLU()],
        "gelu": lambda n: [nn.GELU()],
        "tanh": lambda n: [nn.Tanh()],
        "silu": lambda n: [nn.SiLU()],
        "leaky": lambda n: [nn.LeakyReLU(0.2)],
        "dropout": lambda n: [nn.ReLU(), nn.Dropout(0.3)],
        "batchnorm": lambda n: [nn.BatchNorm1d(n), nn.ReLU()],
        "batchnorm_noaffine": lambda n: [nn.BatchNorm1d(n, affine=False), nn.Tanh()],
        "layernorm": lambda n: [nn.LayerNorm(n), nn.GELU()],
        "layernorm_nobias": lambda n: [nn.LayerNorm(n, bias=False), nn.SiLU()],
    }[kind]
    model = nn.Sequential(
        nn.Linear(d, h1, bias=bias), *between(h1),
        nn.Linear(h1, h2, bias=bias), *between(h2),
        nn.Linear(h2, o, bias=bias),
    )
    with torch.no_grad():  # non-trivial affine parameters and running statistics
        for m in model:
            if isinstance(m, (nn.BatchNorm1d, nn.LayerNorm)):
                if m.weight is not None:
                    m.weight.uniform_(0.5, 1.5)
                if m.bias is not None:
                    m.bias.uniform_(-0.5, 0.5)
            if isinstance(m, nn.BatchNorm1d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
                m.num_batches_tracked.fill_(7)
    return model


KINDS = ["relu", "gelu", "tanh", "silu", "leaky", "dropout", "batchnorm",
         "batchnorm_noaffine", "layernorm", "layernorm_nobias"]


def _state(model: nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_states_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _masked_forward(model, blocks, rank, x, rescale):
    """Oracle: the FULL model's forward with every neuron outside rank's block
    zeroed before it feeds the next Linear (and multiplied by world_size when
    ``rescale``); LayerNorm statistics over the block's neurons only."""
    world = len(blocks[0])
    masks = []
    for l, layer in enumerate(blocks):
        n = sum(b.numel() for b in layer)
        mask = torch.zeros(n, dtype=x.dtype)
        mask[layer[rank]] = 1.0
        masks.append(mask)
    h, layer = x, -1
    for m in model:
        if type(m) is nn.Linear:
            layer += 1
            if layer > 0:
                h = h * masks[layer - 1]
                if rescale:
                    h = h * world
            h = m(h)
        elif type(m) is nn.LayerNorm:
            sel = masks[layer].bool()
            mean = h[:, sel].mean(dim=1, keepdim=True)
            var = h[:, sel].var(dim=1, unbiased=False, keepdim=True)
            h = (h - mean) / torch.sqrt(var + m.eps)
            if m.weight is not None:
                h = h * m.weight
            if m.bias is not None:
                h = h + m.bias
        else:
            h = m(h)
    return h


# ---------------------------------------------------------------------------
# partition
# ---------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    world_size=st.integers(1, 6),
    seed=st.integers(-(2**70), 2**70),
    rnd=st.integers(0, 2**40),
)
def test_partition_properties(data, world_size, seed, rnd):
    sizes = data.draw(st.lists(st.integers(world_size, 70), min_size=0, max_size=4))
    blocks = ist.partition(sizes, world_size, seed, rnd)
    assert len(blocks) == len(sizes)
    again = ist.partition(list(sizes), world_size, seed, rnd)
    for l, n in enumerate(sizes):
        assert len(blocks[l]) == world_size
        lens = [b.numel() for b in blocks[l]]
        assert max(lens) - min(lens) <= 1                      # balanced
        allidx = torch.cat(blocks[l])
        assert torch.equal(torch.sort(allidx).values, torch.arange(n))  # disjoint + covering
        for b, b2 in zip(blocks[l], again[l]):
            assert b.dtype == torch.int64 and b.dim() == 1
            assert torch.all(b[1:] > b[:-1])                   # sorted ascending
            assert torch.equal(b, b2)                          # pure function


def test_partition_differs_per_round_layer_and_seed():
    base = ist.partition([64, 64], 2, 7, 0)
    other_round = ist.partition([64, 64], 2, 7, 1)
    other_seed = ist.partition([64, 64], 2, 8, 0)
    assert not torch.equal(base[0][0], other_round[0][0])
    assert not torch.equal(base[0][0], other_seed[0][0])
    assert not torch.equal(base[0][0], base[1][0])   # layers are drawn independently
    # which ranks get the larger block rotates with the round
    sizes = [[b.numel() for b in ist.partition([7], 3, 0, r)[0]] for r in range(3)]
    assert sizes == [[3, 2, 2], [2, 3, 2], [2, 2, 3]]


def test_partition_leaves_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    ist.partition([50, 40], 3, 1, 2)
    assert torch.equal(torch.rand(4), expected)


def test_partition_bad_arguments():
    with pytest.raises(ValueError, match=r"hidden_sizes\[1\] = 2 is smaller than world_size = 3"):
        ist.partition([8, 2], 3, 0, 0)
    with pytest.raises(ValueError, match="world_size"):
        ist.partition([8], 0, 0, 0)
    with pytest.raises(ValueError, match="round"):
        ist.partition([8], 2, 0, -1)
    with pytest.raises(TypeError, match="seed"):
        ist.partition([8], 2, 1.5, 0)
    with pytest.raises(TypeError, match=r"hidden_sizes\[0\]"):
        ist.partition([8.0], 2, 0, 0)
    with pytest.raises(TypeError, match="hidden_sizes"):
        ist.partition(8, 2, 0, 0)


# ---------------------------------------------------------------------------
# extract_subnet / write_back
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_extract_then_write_back_is_bit_exact_identity(kind, world_size):
    model = _mlp(kind, bias=kind != "relu")
    before = _state(model)
    blocks = ist.partition([7, 6], world_size, 3, 1)
    for rank in range(world_size):
        sub = ist.extract_subnet(model, blocks, rank)
        ist.write_back(model, sub, blocks, rank)
        _assert_states_equal(before, _state(model))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_extract_write_back_half_precision(dtype):
    model = _mlp("layernorm").to(dtype)
    before = _state(model)
    blocks = ist.partition([7, 6], 2, 0, 0)
    sub = ist.extract_subnet(model, blocks, 1)
    assert all(p.dtype == dtype for p in sub.parameters())
    ist.write_back(model, sub, blocks, 1)
    _assert_states_equal(before, _state(model))


def test_subnet_shapes_slices_and_independence():
    model = _mlp("batchnorm", sizes=(5, 9, 8, 4))
    blocks = ist.partition([9, 8], 3, 11, 2)
    b0, b1 = blocks[0][2], blocks[1][2]
    sub = ist.extract_subnet(model, blocks, 2)
    lins = [m for m in sub if type(m) is nn.Linear]
    assert torch.equal(lins[0].weight, model[0].weight[b0])
    assert torch.equal(lins[0].bias, model[0].bias[b0])
    assert torch.equal(lins[1].weight, model[3].weight[b1][:, b0])
    assert torch.equal(lins[2].weight, model[6].weight[:, b1])
    assert torch.equal(lins[2].bias, model[6].bias)       # output bias shared, whole
    bn = sub[1]
    assert torch.equal(bn.running_var, model[1].running_var[b0])
    assert int(bn.num_batches_tracked) == 7
    scales = [m.factor for m in sub if type(m) is ist.InputScale]
    assert scales == [3.0, 3.0]
    assert not any(type(m) is ist.InputScale for m in ist.extract_subnet(model, blocks, 2,
                                                                         rescale=False))
    # The subnet owns its tensors: changing it leaves the model alone.
    before = _state(model)
    with torch.no_grad():
        for p in sub.parameters():
            p.add_(1.0)
    _assert_states_equal(before, _state(model))


def test_write_back_writes_only_the_ranks_slices():
    model = _mlp("layernorm", sizes=(5, 9, 8, 4))
    before = _state(model)
    blocks = ist.partition([9, 8], 3, 4, 0)
    rank = 1
    sub = ist.extract_subnet(model, blocks, rank)
    with torch.no_grad():
        for p in sub.parameters():
            p.add_(torch.randn_like(p))
    ist.write_back(model, sub, blocks, rank)
    b0, b1 = blocks[0][rank], blocks[1][rank]
    after = model.state_dict()
    lins = [m for m in sub if type(m) is nn.Linear]
    expect = {k: v.clone() for k, v in before.items()}
    expect["0.weight"][b0] = lins[0].weight.detach()
    expect["0.bias"][b0] = lins[0].bias.detach()
    expect["1.weight"][b0] = sub[1].weight.detach()
    expect["1.bias"][b0] = sub[1].bias.detach()
    expect["3.weight"][b1.unsqueeze(1), b0.unsqueeze(0)] = lins[1].weight.detach()
    expect["3.bias"][b1] = lins[1].bias.detach()
    expect["4.weight"][b1] = sub[5].weight.detach()
    expect["4.bias"][b1] = sub[5].bias.detach()
    expect["6.weight"][:, b1] = lins[2].weight.detach()
    expect["6.bias"] = lins[2].bias.detach()
    _assert_states_equal(expect, {k: v.clone() for k, v in after.items()})


@pytest.mark.parametrize("kind", KINDS + ["nobias"])
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("rescale", [True, False])
def test_subnet_forward_equals_masked_full_forward(kind, world_size, rescale):
    model = _mlp("relu" if kind == "nobias" else kind, sizes=(6, 11, 9, 4), bias=kind != "nobias")
    model.eval()   # BatchNorm1d on running statistics, Dropout off
    blocks = ist.partition([11, 9], world_size, 5, 3)
    x = torch.randn(16, 6, generator=torch.Generator().manual_seed(1))
    for rank in range(world_size):
        sub = ist.extract_subnet(model, blocks, rank, rescale=rescale)
        assert not sub.training
        with torch.no_grad():
            got = sub(x)
            want = _masked_forward(model, blocks, rank, x, rescale)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_batchnorm_train_mode_running_stats_are_the_blocks():
    model = _mlp("batchnorm", sizes=(6, 11, 9, 4))
    model.train()
    blocks = ist.partition([11, 9], 3, 2, 0)
    x = torch.randn(32, 6, generator=torch.Generator().manual_seed(2))
    rank = 2
    sub = ist.extract_subnet(model, blocks, rank)
    assert sub.training
    reference = copy.deepcopy(model)
    before = _state(model)
    with torch.no_grad():
        got = sub(x)
        want = _masked_forward(reference, blocks, rank, x, True)   # full-width BN, train mode
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    ist.write_back(model, sub, blocks, rank)
    after = model.state_dict()
    for i, j, layer in ((1, 1, 0), (4, 5, 1)):   # BatchNorm1d in model / in subnet
        blk = blocks[layer][rank]
        rest = torch.ones(model[i].num_features, dtype=torch.bool)
        rest[blk] = False
        for name in ("running_mean", "running_var"):
            full = after[f"{i}.{name}"]
            torch.testing.assert_close(full[blk], reference.state_dict()[f"{i}.{name}"][blk],
                                       rtol=1e-5, atol=1e-6)
            assert torch.equal(full[blk], getattr(sub[j], name))
            assert torch.equal(full[rest], before[f"{i}.{name}"][rest])    # others untouched
            assert not torch.equal(full[blk], before[f"{i}.{name}"][blk])  # they did move
        assert int(after[f"{i}.num_batches_tracked"]) == 8


def test_extract_draws_no_random_numbers():
    model = _mlp("dropout")
    blocks = ist.partition([7, 6], 2, 0, 0)
    torch.manual_seed(9)
    expected = torch.rand(3)
    torch.manual_seed(9)
    ist.extract_subnet(model, blocks, 0)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize(
    "model, error, pattern",
    [
        (lambda: nn.Sequential(nn.Linear(4, 6), nn.Sigmoid(), nn.Linear(6, 2)),
         TypeError, r"model\[1\] \(Sigmoid\)"),
        (lambda: nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Conv1d(1, 1, 1)),
         TypeError, r"model\[2\] \(Conv1d\)"),
        (lambda: nn.Sequential(nn.Linear(4, 6), nn.Sequential(nn.ReLU()), nn.Linear(6, 2)),
         TypeError, r"model\[1\] \(Sequential\)"),
        (lambda: nn.ModuleList([nn.Linear(4, 6), nn.Linear(6, 2)]),
         TypeError, "model must be an nn.Sequential"),
        (lambda: nn.Sequential(nn.Linear(4, 2), nn.ReLU()),
         ValueError, "IST needs at least 2"),
        (lambda: nn.Sequential(nn.BatchNorm1d(4), nn.Linear(4, 6), nn.Linear(6, 2)),
         ValueError, r"model\[0\] \(BatchNorm1d\) comes before the first Linear"),
        (lambda: nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2), nn.LayerNorm(2)),
         ValueError, r"model\[2\] \(LayerNorm\) acts on the output"),
        (lambda: nn.Sequential(nn.Linear(4, 6), nn.Linear(5, 2)),
         ValueError, r"model\[1\] \(Linear\) has in_features=5"),
        (lambda: nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(5), nn.Linear(6, 2)),
         ValueError, r"model\[1\] \(BatchNorm1d\) has num_features=5"),
        (lambda: nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2)).double(),
         TypeError, "float64"),
        (lambda: nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2).half()),
         ValueError, "share one dtype"),
    ],
)
def test_unsupported_models_raise_naming_the_module(model, error, pattern):
    m = model()
    with pytest.raises(error, match=pattern):
        ist.extract_subnet(m, [[torch.arange(6)]], 0)
    with pytest.raises(error, match=pattern):
        ist.ISTTrainer(m, lambda p: torch.optim.SGD(p, lr=0.1))


def test_bad_blocks_rank_and_subnet():
    model = _mlp("relu")
    blocks = ist.partition([7, 6], 2, 0, 0)
    with pytest.raises(ValueError, match="rank must be < world_size = 2"):
        ist.extract_subnet(model, blocks, 2)
    with pytest.raises(ValueError, match=r"blocks\[1\] holds 5 indices"):
        ist.extract_subnet(model, [blocks[0], [blocks[1][0], blocks[1][1][:-1]]], 0)
    with pytest.raises(ValueError, match="one list per hidden layer"):
        ist.extract_subnet(model, blocks[:1], 0)
    out_of_range = torch.cat([blocks[1][1][:-1], torch.tensor([500])])
    with pytest.raises(ValueError, match=r"blocks\[1\] is not a partition.*500"):
        ist.extract_subnet(model, [blocks[0], [blocks[1][0], out_of_range]], 1)
    # Right sizes but not a partition: a neuron in two blocks (and one in none)
    # would be trained twice and written back by two ranks.
    overlap = torch.cat([blocks[1][1][:-1], blocks[1][0][:1]])
    for r in (0, 1):
        with pytest.raises(ValueError, match=r"blocks\[1\] is not a partition of the 6 neurons"):
            ist.extract_subnet(model, [blocks[0], [blocks[1][0], overlap]], r)
    with pytest.raises(ValueError, match=r"blocks\[1\] is not a partition"):
        ist.write_back(model, ist.extract_subnet(model, blocks, 0),
                       [blocks[0], [blocks[1][0], overlap]], 0)
    with pytest.raises(ValueError, match=r"blocks\[1\] is not a partition.*500"):
        ist.extract_subnet(model, [blocks[0], [blocks[1][0], out_of_range]], 0)
    sub = ist.extract_subnet(model, blocks, 0)
    before = _state(model)
    # rank 1's block of the first hidden layer has 3 neurons, rank 0's has 4
    with pytest.raises(ValueError, match=r"model\[0\]\)\.weight has shape \(4, 5\), expected \(3"):
        ist.write_back(model, sub, blocks, 1)    # rank 1's block has other sizes
    with pytest.raises(ValueError, match="subnet does not match model"):
        ist.write_back(model, nn.Sequential(nn.Linear(1, 1)), blocks, 0)
    _assert_states_equal(before, _state(model))


# ---------------------------------------------------------------------------
# ISTTrainer, single process
# ---------------------------------------------------------------------------


def _data(n, d, classes, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g), torch.randint(0, classes, (n,), generator=g)


@pytest.mark.parametrize("momentum, local_steps", [(0.0, 3), (0.9, 100)])
def test_world_size_one_equals_plain_training(momentum, local_steps):
    model = nn.Sequential(nn.Linear(5, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.2),
                          nn.Linear(16, 12), nn.LayerNorm(12), nn.Tanh(), nn.Linear(12, 3))
    plain = copy.deepcopy(model)
    factory = lambda p: torch.optim.SGD(p, lr=0.05, momentum=momentum)  # noqa: E731
    x, y = _data(7 * 8, 5, 3, 0)
    torch.manual_seed(42)       # Dropout draws from the global RNG, in the same order
    opt = factory(plain.parameters())
    plain_losses = []
    for i in range(7):
        opt.zero_grad()
        loss = F.cross_entropy(plain(x[i * 8:(i + 1) * 8]), y[i * 8:(i + 1) * 8])
        loss.backward()
        opt.step()
        plain_losses.append(loss.item())
    torch.manual_seed(42)
    trainer = ist.ISTTrainer(model, factory, local_steps=local_steps, seed=3)
    assert trainer.world_size == 1 and trainer.rank == 0
    losses = [trainer.step(x[i * 8:(i + 1) * 8], y[i * 8:(i + 1) * 8], F.cross_entropy)
              for i in range(7)]
    trainer.synchronize()
    assert losses == plain_losses
    _assert_states_equal(_state(plain), _state(model))
    s = trainer.stats
    assert s.steps == 7 and s.rounds == (7 + local_steps - 1) // local_steps
    assert s.bytes_sent == 0 and s.dense_bytes_sent == 0


def test_state_dict_resumes_mid_round_exactly():
    x, y = _data(96, 5, 3, 1)
    factory = lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)  # noqa: E731
    model = _mlp("layernorm", sizes=(5, 12, 10, 3))
    a = ist.ISTTrainer(model, factory, local_steps=4, seed=5)
    for i in range(6):                      # 1 full round + 2 steps into round 2
        a.step(x[i * 8:(i + 1) * 8], y[i * 8:(i + 1) * 8], F.cross_entropy)
    state = copy.deepcopy(a.state_dict())
    assert state["local_step"] == 2 and state["round"] == 1
    b = ist.ISTTrainer(_mlp("layernorm", sizes=(5, 12, 10, 3), seed=99), factory,
                       local_steps=4, seed=5)
    b.load_state_dict(state)
    for i in range(6, 12):
        la = a.step(x[i * 8:(i + 1) * 8], y[i * 8:(i + 1) * 8], F.cross_entropy)
        lb = b.step(x[i * 8:(i + 1) * 8], y[i * 8:(i + 1) * 8], F.cross_entropy)
        assert la == lb
    a.synchronize()
    b.synchronize()
    _assert_states_equal(_state(a.model), _state(b.model))
    assert a.stats == b.stats
    with pytest.raises(ValueError, match=r"state_dict\['seed'\]"):
        ist.ISTTrainer(_mlp("layernorm", sizes=(5, 12, 10, 3)), factory, seed=6).load_state_dict(
            state)
    with pytest.raises(KeyError, match="round"):
        b.load_state_dict({k: v for k, v in state.items() if k != "round"})


def test_trainer_bad_arguments():
    model = _mlp("relu")
    sgd = lambda p: torch.optim.SGD(p, lr=0.1)  # noqa: E731
    with pytest.raises(ValueError, match="local_steps"):
        ist.ISTTrainer(model, sgd, local_steps=0)
    with pytest.raises(TypeError, match="local_steps"):
        ist.ISTTrainer(model, sgd, local_steps=2.5)
    with pytest.raises(TypeError, match="optimizer_factory must be callable"):
        ist.ISTTrainer(model, None)
    with pytest.raises(TypeError, match="optimizer_factory must return"):
        ist.ISTTrainer(model, lambda p: list(p))
    with pytest.raises(TypeError, match="seed"):
        ist.ISTTrainer(model, sgd, seed="0")
    t = ist.ISTTrainer(model, sgd)
    with pytest.raises(ValueError, match="scalar"):
        t.step(torch.randn(4, 5), None, lambda out, _: out)
    # Inputs that cannot feed the model are named, before any state changes.
    for bad, match in ((torch.randn(4, 6), r"inputs.*\[4, 6\].*in_features = 5"),
                       (torch.randn(4, 5, dtype=torch.float64), r"inputs.*float64.*float32"),
                       ([[0.0] * 5], r"inputs must be a torch.Tensor")):
        with pytest.raises(ValueError, match=match):
            t.step(bad, torch.zeros(4, dtype=torch.long), F.cross_entropy)
    assert t.stats.steps == 0


# ---------------------------------------------------------------------------
# Distributed (gloo)
# ---------------------------------------------------------------------------

DIST_SIZES = (6, 10, 8, 3)   # 10 and 8 hidden neurons: uneven blocks on 3 ranks


def _dist_model(seed=0):
    d, h1, h2, o = DIST_SIZES
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d, h1), nn.BatchNorm1d(h1), nn.ReLU(),
                         nn.Linear(h1, h2), nn.LayerNorm(h2), nn.Tanh(), nn.Linear(h2, o))


def _sync_body(rank, world_size):
    model = _dist_model(seed=rank)     # different on purpose: the trainer broadcasts rank 0's
    factory = lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)  # noqa: E731
    # exact exchange: the test checks the written values against the subnets' own
    trainer = ist.ISTTrainer(model, factory, local_steps=4, seed=17, exchange_bits=None)
    initial = _state(model)
    x, y = _data(64, DIST_SIZES[0], DIST_SIZES[3], seed=100 + rank)   # each rank: own data
    for i in range(4):                  # round 0, synchronised automatically
        trainer.step(x[i * 8:(i + 1) * 8], y[i * 8:(i + 1) * 8], F.cross_entropy)
    assert trainer.round == 1
    mid = _state(model)
    for i in range(4, 7):               # 3 steps of round 1, then synchronise by hand
        trainer.step(x[i * 8:(i + 1) * 8], y[i * 8:(i + 1) * 8], F.cross_entropy)
    blocks = [[b.clone() for b in layer] for layer in trainer.blocks]
    subnet = _state(trainer.subnet)
    payloads = [trainer.payload_numel(r) for r in range(world_size)]
    trainer.synchronize()
    return dict(initial=initial, mid=mid, final=_state(model), blocks=blocks, subnet=subnet,
                payloads=payloads, stats=trainer.stats,
                partition=ist.partition([31, 9], world_size, 2**63 + 5, 12))


def _analytic_payload(b0, b1):
    """Elements one rank sends for _dist_model with blocks of sizes b0, b1."""
    d, h1, h2, o = DIST_SIZES
    first = d * b0 + b0                 # W[b0, :], bias[b0]
    bn = 4 * b0                         # weight, bias, running_mean, running_var
    hidden = b1 * b0 + b1               # W[b1, b0], bias[b1]
    ln = 2 * b1
    last = o * b1 + o                   # W[:, b1] and the shared output bias
    return first + bn + hidden + ln + last


def _two_rank_worker(rank, world_size):
    # One spawn for all 2-rank scenarios (starting ranks costs seconds each time).
    return dict(sync=_sync_body(rank, world_size), bad=_bad_body(rank, world_size),
                converge=_converge_body(rank, world_size))


@pytest.fixture(scope="module")
def two_ranks():
    return run_workers(_two_rank_worker, 2, timeout=240)


@pytest.mark.parametrize("world_size", [2, 3])
def test_distributed_synchronize(world_size, two_ranks):
    if world_size == 2:
        res = [r["sync"] for r in two_ranks]
    else:
        res = run_workers(_sync_body, world_size, timeout=120)
    r0 = res[0]
    # Same start (broadcast from rank 0) and bit-identical models after synchronize().
    for r in res[1:]:
        _assert_states_equal(r0["initial"], r["initial"])
        _assert_states_equal(r0["mid"], r["mid"])
        _assert_states_equal(r0["final"], r["final"])
        for la, lb in zip(r0["blocks"], r["blocks"]):
            assert all(torch.equal(a, b) for a, b in zip(la, lb))
    # The partition is the same in every process (including this one).
    here = ist.partition([31, 9], world_size, 2**63 + 5, 12)
    for r in res:
        for la, lb in zip(here, r["partition"]):
            assert all(torch.equal(a, b) for a, b in zip(la, lb))
    assert not torch.equal(r0["initial"]["0.weight"], r0["mid"]["0.weight"])

    final, mid, blocks = r0["final"], r0["mid"], r0["blocks"]
    trained = torch.zeros(DIST_SIZES[2], DIST_SIZES[1], dtype=torch.bool)
    bias_sum = None
    for rank, r in enumerate(res):
        b0, b1 = blocks[0][rank], blocks[1][rank]
        sub = r["subnet"]
        # subnet keys: 0 Linear, 1 BN, 2 ReLU, 3 InputScale, 4 Linear, 5 LN, 6 Tanh,
        # 7 InputScale, 8 Linear
        assert torch.equal(final["0.weight"][b0], sub["0.weight"])
        assert torch.equal(final["0.bias"][b0], sub["0.bias"])
        for name in ("weight", "bias", "running_mean", "running_var"):
            assert torch.equal(final[f"1.{name}"][b0], sub[f"1.{name}"])
        assert torch.equal(final["3.weight"][b1][:, b0], sub["4.weight"])
        assert torch.equal(final["3.bias"][b1], sub["4.bias"])
        assert torch.equal(final["4.weight"][b1], sub["5.weight"])
        assert torch.equal(final["6.weight"][:, b1], sub["8.weight"])
        trained[b1.unsqueeze(1), b0.unsqueeze(0)] = True
        bias_sum = sub["8.bias"].clone() if bias_sum is None else bias_sum + sub["8.bias"]
    # Cross-block hidden-to-hidden weights were not trained this round.
    assert torch.equal(final["3.weight"][~trained], mid["3.weight"][~trained])
    assert not torch.equal(final["3.weight"][trained], mid["3.weight"][trained])
    # Shared output bias: the mean over ranks.
    assert torch.equal(final["6.bias"], bias_sum / world_size)

    # Bytes: payload = analytic subnet size; wire = (W-1) x padded buffer.
    d, h1, h2, o = DIST_SIZES
    for rank, r in enumerate(res):
        b0, b1 = blocks[0][rank].numel(), blocks[1][rank].numel()
        assert r["payloads"][rank] == _analytic_payload(b0, b1)
        s = r["stats"]
        assert s.rounds == 2 and s.steps == 7
        n_params = sum(v.numel() for k, v in r0["final"].items()
                       if not k.endswith(("running_mean", "running_var", "num_batches_tracked")))
        assert s.dense_bytes_sent == 7 * 2 * (world_size - 1) * n_params * 4 // world_size
        assert s.bytes_sent == s.bytes_received
    if world_size == 2:
        # Even blocks: the closed form, 1/W for the input and output layer,
        # 1/W^2 between hidden layers (plus biases, norm parameters, shared output bias).
        w = world_size
        weights = d * h1 // w + h1 * h2 // (w * w) + h2 * o // w
        per_neuron = (1 + 4) * h1 // w + (1 + 2) * h2 // w
        assert res[0]["payloads"][0] == weights + per_neuron + o
        last_round = max(res[0]["payloads"]) * 4
        for r in res:
            assert r["stats"].bytes_sent > last_round      # two rounds were counted
            assert r["stats"].payload_bytes == r["stats"].bytes_sent  # W=2, even: no padding


def _bad_body(rank, world_size):
    sgd = lambda p: torch.optim.SGD(p, lr=0.1)  # noqa: E731
    outcomes = {}

    def attempt(name, make):
        try:
            make()
            outcomes[name] = ("ok", "")
        except Exception as exc:  # noqa: BLE001
            outcomes[name] = (type(exc).__name__, str(exc))

    # Rank 1 builds a wider hidden layer.
    attempt("mismatch", lambda: ist.ISTTrainer(
        nn.Sequential(nn.Linear(4, 8 + 2 * rank), nn.ReLU(), nn.Linear(8 + 2 * rank, 2)), sgd))
    # Only rank 1 has an unsupported module.
    attempt("unsupported", lambda: ist.ISTTrainer(
        nn.Sequential(nn.Linear(4, 8), nn.Softmax(dim=1) if rank == 1 else nn.ReLU(),
                      nn.Linear(8, 2)), sgd))
    # Hidden width smaller than the world size (every rank detects it).
    attempt("width", lambda: ist.ISTTrainer(
        nn.Sequential(nn.Linear(4, 1), nn.ReLU(), nn.Linear(1, 2)), sgd))
    # Different seeds would draw different partitions.
    attempt("seed", lambda: ist.ISTTrainer(
        nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), sgd, seed=rank))
    attempt("good", lambda: ist.ISTTrainer(
        nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), sgd, seed=1))
    # Checkpoints: a rank that loads another round's state (or one whose load
    # fails) must not silently train on a different partition or leave the
    # other ranks waiting in the next synchronisation.
    torch.manual_seed(0)
    tr = ist.ISTTrainer(nn.Sequential(nn.Linear(4, 9), nn.ReLU(), nn.Linear(9, 2)), sgd,
                        local_steps=2, seed=1)
    for _ in range(4):
        tr.step(torch.randn(3, 4), torch.randint(0, 2, (3,)), F.cross_entropy)
    sd = tr.state_dict()
    attempt("load_round", lambda: tr.load_state_dict({**sd, "round": 0} if rank == 1 else sd))
    attempt("load_seed", lambda: tr.load_state_dict({**sd, "seed": 5} if rank == 1 else sd))
    attempt("load_good", lambda: tr.load_state_dict(sd))
    # The group is still usable and in step after all of that.
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    outcomes["allreduce"] = float(t)
    return outcomes


def test_distributed_bad_inputs_raise_on_every_rank_without_hanging(two_ranks):
    res = [r["bad"] for r in two_ranks]
    for r in res:
        assert r["mismatch"][0] == "RuntimeError" and "disagree" in r["mismatch"][1]
        assert "[[0], [1]]" in r["mismatch"][1]
        assert r["width"][0] == "ValueError" and "hidden_sizes[0] = 1" in r["width"][1]
        assert r["seed"][0] == "RuntimeError" and "disagree" in r["seed"][1]
        assert r["good"] == ("ok", "")
        assert r["allreduce"] == 3.0
    for r in res:
        assert r["load_round"][0] == "RuntimeError" and "round" in r["load_round"][1]
        assert r["load_good"] == ("ok", "")
    assert res[1]["load_seed"][0] == "ValueError" and "seed" in res[1]["load_seed"][1]
    assert res[0]["load_seed"][0] == "RuntimeError" and "rank(s) [1]" in res[0]["load_seed"][1]
    assert res[1]["unsupported"][0] == "TypeError"
    assert "model[1] (Softmax)" in res[1]["unsupported"][1]
    assert res[0]["unsupported"][0] == "RuntimeError"
    assert "rank(s) [1]" in res[0]["unsupported"][1]


# ---------------------------------------------------------------------------
# Convergence on a fixed synthetic task
# ---------------------------------------------------------------------------


def _teacher_task(n, seed):
    """Labels from a fixed random teacher MLP: a non-linear 4-class problem
    (a plain MLP trained on 8000 samples for 2 epochs reaches about 0.88)."""
    g = torch.Generator().manual_seed(1234)
    w1, w2 = torch.randn(10, 4, generator=g), torch.randn(4, 4, generator=g)
    x = torch.randn(n, 10, generator=torch.Generator().manual_seed(seed))
    return x, torch.argmax(torch.tanh(x @ w1) @ w2, dim=1)


def _converge_body(rank, world_size):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                          nn.Linear(64, 4))
    trainer = ist.ISTTrainer(model, lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
                             local_steps=5, seed=3)
    x, y = _teacher_task(4000, seed=10 + rank)       # each rank: its own shard
    xt, yt = _teacher_task(2000, seed=99)
    with torch.no_grad():
        acc0 = (model(xt).argmax(1) == yt).float().mean().item()
    losses = []
    for epoch in range(4):
        perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(epoch))
        for i in range(0, len(x), 50):
            idx = perm[i:i + 50]
            losses.append(trainer.step(x[idx], y[idx], F.cross_entropy))
    trainer.synchronize()
    model.eval()
    with torch.no_grad():
        acc = (model(xt).argmax(1) == yt).float().mean().item()
    return dict(acc0=acc0, acc=acc, first=sum(losses[:20]) / 20, last=sum(losses[-20:]) / 20,
                state=_state(model))


def test_convergence_on_synthetic_task(two_ranks):
    res = [r["converge"] for r in two_ranks]
    _assert_states_equal(res[0]["state"], res[1]["state"])
    r = res[0]
    assert r["acc"] >= 0.85, r
    assert r["acc"] >= r["acc0"] + 0.4, r
    assert r["last"] < 0.5 * r["first"], r
