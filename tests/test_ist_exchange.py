"""ISTTrainer's subnets and coded exchange (issue 24): ``subnets=G`` (rank r trains subnet
r % G, a subnet's ranks averaged) and ``exchange_bits=b`` (the round's update as per-chunk
scaled b-bit codes).

The oracle rebuilds every synchronisation from what each rank held (the round's start,
its trained subnet, the partition) with :mod:`slimcomm.reference`'s codec and checks the
written model bit for bit, on real gloo ranks (2, 3 and 4; uneven blocks and an uneven
number of ranks per subnet; tensors of more than one 4096-value chunk). Also: replicas
identical after every synchronisation, bit-exact resume mid-round, the bytes, the exact
exchange's mean over a subnet's ranks, argument checks, and ranks that disagree on the
settings.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from _dist import run_workers
from slimcomm import ist, reference
from slimcomm.ist.rounds import EXCHANGE_CHUNK

SIZES = (64, 80, 72, 3)   # the first Linear holds 5120 values: two chunks when unsliced


def _model(seed=0):
    d, h1, h2, o = SIZES
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d, h1), nn.BatchNorm1d(h1), nn.ReLU(),
                         nn.Linear(h1, h2), nn.LayerNorm(h2), nn.Tanh(), nn.Linear(h2, o))


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_states_equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _batches(rank, n):
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(8, SIZES[0], generator=g), torch.randint(0, SIZES[3], (8,), generator=g))
            for _ in range(n)]


def _body(rank, world_size, subnets, bits, rounds=3, local_steps=3):
    factory = lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)  # noqa: E731
    model = _model(seed=rank)   # different on purpose: the trainer broadcasts rank 0's
    trainer = ist.ISTTrainer(model, factory, local_steps=local_steps, seed=5, subnets=subnets,
                             exchange_bits=bits)
    seen = []
    real = trainer.synchronize

    def capture():   # step() calls synchronize() after the round's last local step
        seen.append(dict(start=_state(model),
                         trained=[_state(m) for m in _modules(trainer.subnet)],
                         blocks=[[b.clone() for b in layer] for layer in trainer.blocks],
                         stats=trainer.stats))
        real()
        seen[-1]["model"] = _state(model)
        seen[-1]["after"] = trainer.stats

    trainer.synchronize = capture
    out = {"subnets": trainer.subnets}
    for rnd in range(rounds):
        for i in range(local_steps):
            if rnd == 1 and i == local_steps - 1:
                out["mid"] = copy.deepcopy(trainer.state_dict())
            trainer.step(*_batches(rank, rounds * local_steps)[rnd * local_steps + i],
                         F.cross_entropy)
    out["rounds"] = seen
    if "mid" not in out:
        return out
    fresh = ist.ISTTrainer(_model(seed=77), factory, local_steps=local_steps, seed=5,
                           subnets=subnets, exchange_bits=bits)
    fresh.load_state_dict(out.pop("mid"))
    fresh.step(*_batches(rank, rounds * local_steps)[2 * local_steps - 1], F.cross_entropy)
    out["resumed"] = _state(fresh.model)
    return out


def _modules(net):
    """The Linear / norm layers of an MLP or its subnet, in order (InputScale skipped)."""
    return [m for m in net if type(m) in (nn.Linear, nn.BatchNorm1d, nn.LayerNorm)]


def _slice_index(model, blocks, g):
    """(module position among _modules, name, rows, cols) of every tensor subnet g slices,
    plus the shared ones (rows = cols = None)."""
    plan = ist._build_plan(model)
    pos = {i: k for k, i in enumerate(
        [i for i, m in enumerate(model) if type(m) in (nn.Linear, nn.BatchNorm1d, nn.LayerNorm)])}
    out = []
    for s in plan.slices:
        rows = None if s.row_layer is None else blocks[s.row_layer][g]
        cols = None if s.col_layer is None else blocks[s.col_layer][g]
        out.append((pos[s.module], s.name, rows, cols))
    return out, [(pos[i], a) for i, a in plan.shared]


def _block(t, rows, cols):
    if rows is not None:
        t = t[rows]
    if cols is not None:
        t = t[:, cols]
    return t


def _code_mean(deltas, bits):
    """The reference codec: every delta (fp32, one tensor's block, value order) coded per
    4096-value chunk, decoded and averaged in list order."""
    n = deltas[0].numel()
    offsets = torch.tensor([0, n])
    nch = -(-n // EXCHANGE_CHUNK)
    coded = [reference.quantize_chunks(d.reshape(-1), offsets, EXCHANGE_CHUNK, bits, nch)
             for d in deltas]
    packed = torch.stack([c[0] for c in coded])
    scales = torch.stack([c[1] for c in coded])
    return reference.dequantize_chunks_mean(packed, scales, offsets, EXCHANGE_CHUNK, bits, n,
                                            float(len(deltas)))


def _expected(res, rnd, bits):
    """The full model after round ``rnd``'s exchange, rebuilt from every rank's start and
    trained subnet with the reference codec (or exact means with bits None)."""
    w = len(res)
    G = res[0]["subnets"]
    r0 = res[0]["rounds"][rnd]
    start = r0["start"]
    model = _model()
    model.load_state_dict(start)
    mods = _modules(model)
    keys = {id(t): k for k, t in model.state_dict(keep_vars=True).items()}
    assert len(res[0]["rounds"][rnd]["trained"]) == len(mods)
    expect = dict(start)

    def trained_tensor(rank, pos, name):
        return res[rank]["rounds"][rnd]["trained"][pos][name]

    for g in range(G):
        members = list(range(g, w, G))
        sliced, _ = _slice_index(model, r0["blocks"], g)
        for pos, name, rows, cols in sliced:
            full = getattr(mods[pos], name).detach()
            s = _block(full, rows, cols)
            vals = [trained_tensor(r, pos, name) for r in members]
            if bits is None:
                acc = vals[0].float()
                for v in vals[1:]:
                    acc = acc + v.float()
                new = vals[0] if len(vals) == 1 else (acc / len(vals)).to(s.dtype)
            else:
                upd = _code_mean([v.float() - s.float() for v in vals], bits)
                new = (s.float().reshape(-1) + upd).to(s.dtype).view(s.shape)
            t = expect[keys[id(getattr(mods[pos], name))]].clone()
            if rows is not None and cols is not None:
                t[rows[:, None], cols[None, :]] = new
            elif rows is not None:
                t[rows] = new
            else:
                t[:, cols] = new
            expect[keys[id(getattr(mods[pos], name))]] = t
    for pos, m in enumerate(mods):   # BatchNorm counters: copied from the subnet
        if type(m) is nn.BatchNorm1d:
            expect[keys[id(m.num_batches_tracked)]] = trained_tensor(0, pos, "num_batches_tracked")
    _, shared = _slice_index(model, r0["blocks"], 0)
    for pos, name in shared:
        full = getattr(mods[pos], name).detach()
        vals = [trained_tensor(r, pos, name) for r in range(w)]
        if bits is None:
            acc = vals[0].float()
            for v in vals[1:]:
                acc = acc + v.float()
            new = (acc / w).to(full.dtype)
        else:
            new = (full.float() + _code_mean([v.float() - full.float() for v in vals], bits)
                   ).to(full.dtype)
        expect[keys[id(getattr(mods[pos], name))]] = new
    return expect


def _code_bytes(counts, bits):
    """Bytes of one coded payload: codes padded to an even count, then bf16 scales."""
    k = sum(counts)
    return ((k * bits + 7) // 8 + 1) // 2 * 2 + 2 * sum(-(-c // EXCHANGE_CHUNK) for c in counts)


CASES = [  # world size, subnets, exchange_bits
    (2, None, 4),    # the defaults: 2 subnets, 4-bit codes
    (3, 2, 4),       # ranks 0 and 2 share subnet 0, rank 1 alone: uneven groups
    (4, 2, 2),
    (2, 1, 8),       # one subnet: local SGD with a coded average; unsliced 2-chunk tensors
    (3, None, 1),    # scaled-sign codes (the fp32 sum of |x| in value order)
    (4, 2, None),    # exact values: the mean over a subnet's two ranks
]


@pytest.mark.parametrize("world_size, subnets, bits", CASES)
def test_exchange_matches_the_reference_bit_for_bit(world_size, subnets, bits):
    res = run_workers(_body, world_size, subnets, bits, timeout=240)
    G = res[0]["subnets"]
    assert G == (min(world_size, 4) if subnets is None else subnets)
    model = _model()
    for rnd in range(3):
        for r in res[1:]:   # every rank started the round from the same model and ended equal
            _assert_states_equal(res[0]["rounds"][rnd]["start"], r["rounds"][rnd]["start"])
            _assert_states_equal(res[0]["rounds"][rnd]["model"], r["rounds"][rnd]["model"])
        _assert_states_equal(res[0]["rounds"][rnd]["model"], _expected(res, rnd, bits))
        # the round moved the model (a test that cannot fail otherwise)
        assert not torch.equal(res[0]["rounds"][rnd]["model"]["3.weight"],
                               res[0]["rounds"][rnd]["start"]["3.weight"])
        if bits is not None:   # bytes: this rank's coded payload, (W-1) x the widest one
            blocks = res[0]["rounds"][rnd]["blocks"]
            per_group = []
            for g in range(G):
                sliced, shared = _slice_index(model, blocks, g)
                counts = [_block(torch.empty(getattr(_modules(model)[pos], name).shape),
                                 rows, cols).numel() for pos, name, rows, cols in sliced]
                shared_counts = [getattr(_modules(model)[pos], name).numel() for pos, name in shared]
                per_group.append(_code_bytes(shared_counts, bits) + _code_bytes(counts, bits))
            for rank, r in enumerate(res):
                before, after = r["rounds"][rnd]["stats"], r["rounds"][rnd]["after"]
                assert after.payload_bytes - before.payload_bytes == per_group[rank % G]
                assert after.bytes_sent - before.bytes_sent == (world_size - 1) * max(per_group)
    for r in res:   # bit-exact resume from a mid-round checkpoint of round 1
        _assert_states_equal(r["resumed"], res[0]["rounds"][1]["model"])


def test_coded_exchange_sends_a_fraction_of_the_exact_bytes():
    res = {b: run_workers(_body, 2, None, b, 1, 2, timeout=240)[0] for b in (None, 4)}
    exact = res[None]["rounds"][0]["after"].bytes_sent
    coded = res[4]["rounds"][0]["after"].bytes_sent
    assert 0.12 < coded / exact < 0.15, (coded, exact)   # 4/32 of fp32 plus scales and padding


def test_bad_arguments_name_the_argument():
    sgd = lambda p: torch.optim.SGD(p, lr=0.1)  # noqa: E731
    for kwargs, err, match in (
            (dict(subnets=0), ValueError, "subnets must be >= 1"),
            (dict(subnets=2), ValueError, r"subnets must be <= world_size = 1"),
            (dict(subnets=1.5), TypeError, "subnets must be an int"),
            (dict(subnets=True), TypeError, "subnets must be an int"),
            (dict(exchange_bits=3), ValueError, "exchange_bits must be None"),
            (dict(exchange_bits=True), ValueError, "exchange_bits must be None"),
            (dict(exchange_bits="4"), ValueError, "exchange_bits must be None")):
        model = _model()
        before = _state(model)
        with pytest.raises(err, match=match):
            ist.ISTTrainer(model, sgd, **kwargs)
        _assert_states_equal(before, _state(model))
    t = ist.ISTTrainer(_model(), sgd, subnets=1, exchange_bits=8)
    assert (t.subnets, t.exchange_bits) == (1, 8)


def _disagree_body(rank, world_size):
    sgd = lambda p: torch.optim.SGD(p, lr=0.1)  # noqa: E731
    try:
        ist.ISTTrainer(_model(), sgd, exchange_bits=4 if rank == 0 else 8, timeout=30)
    except RuntimeError as exc:
        return str(exc)
    return None


def test_ranks_with_different_exchange_settings_raise_on_every_rank():
    msgs = run_workers(_disagree_body, 2, timeout=120)
    for m in msgs:
        assert m is not None and "ranks grouped by fingerprint: [[0], [1]]" in m, m


def _other_subnets_body(rank, world_size):
    sgd = lambda p: torch.optim.SGD(p, lr=0.1)  # noqa: E731
    a = ist.ISTTrainer(_model(), sgd, local_steps=3, subnets=2, timeout=30)
    a.step(*_batches(rank, 1)[0], F.cross_entropy)
    state = copy.deepcopy(a.state_dict())
    b = ist.ISTTrainer(_model(), sgd, local_steps=3, subnets=1, timeout=30)
    before = _state(b.model)
    try:
        b.load_state_dict(state)
    except ValueError as exc:
        return str(exc), torch.equal(before["0.weight"], _state(b.model)["0.weight"])
    return None, None


def test_mid_round_state_needs_the_same_subnets():
    for msg, untouched in run_workers(_other_subnets_body, 2, timeout=120):
        assert msg is not None and "state_dict['subnets'] = 2 differs from 1" in msg, msg
        assert untouched


def _diverged_body(rank, world_size, subnets, bits, shared):
    sgd = lambda p: torch.optim.SGD(p, lr=0.1)  # noqa: E731
    model = _model()
    trainer = ist.ISTTrainer(model, sgd, local_steps=2, seed=3, subnets=subnets,
                             exchange_bits=bits, shared=shared, timeout=60)
    data = _batches(rank, 4)
    trainer.step(*data[0], F.cross_entropy)
    start = _state(model)
    blocks = [[b.clone() for b in layer] for layer in trainer.blocks]
    if rank == 1:   # rank 1's subnet diverges in its last local step
        with torch.no_grad():
            for p in trainer.subnet.parameters():
                p.view(-1)[::3] = float("nan")
                p.view(-1)[1::3] = float("inf")
    trainer.step(*data[1], F.cross_entropy)   # ends the round: the exchange
    after = _state(model)
    trainer.step(*data[2], F.cross_entropy)   # the next round trains on
    trainer.step(*data[3], F.cross_entropy)
    return dict(start=start, after=after, blocks=blocks, later=_state(model),
                subnets=trainer.subnets)


@pytest.mark.parametrize("subnets, bits, shared", [
    (None, 4, 0.0), (2, 4, 0.0), (3, None, 0.0), (2, None, 0.0), (3, 4, 0.3)])
def test_a_diverged_rank_writes_nothing_non_finite(subnets, bits, shared):
    res = run_workers(_diverged_body, 3, subnets, bits, shared, timeout=180)
    for r in res:
        _assert_states_equal(r["after"], res[0]["after"])    # replicas identical
        _assert_states_equal(r["later"], res[0]["later"])
        for k, v in r["after"].items():
            assert torch.isfinite(v.float()).all(), k
        for k, v in r["later"].items():
            assert torch.isfinite(v.float()).all(), k
    G = res[0]["subnets"]
    # the other ranks' subnets were still applied: the model moved outside rank 1's subnet
    start, after = res[0]["start"], res[0]["after"]
    rows0 = res[0]["blocks"][0][0 % G]
    assert not torch.equal(start["0.weight"][rows0], after["0.weight"][rows0])
    if G == 3 and not shared and bits is not None:
        # rank 1 alone trained subnet 1 and every chunk of it holds nan/inf: all kept the start
        rows1 = res[0]["blocks"][0][1]
        assert torch.equal(start["0.weight"][rows1], after["0.weight"][rows1])
