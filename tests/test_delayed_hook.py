"""Issue 31, item 2: the DDP hook with ``delay_steps=1`` (each step's all-reduce applied one
step later, overlapping the next step's computation).

The oracle is the undelayed hook itself: with a learning rate of 0 the weights never move,
so both runs see the same gradients, derive the same index sets and ``G`` and keep the
same residuals; the delayed hook must then hand DDP at step ``t`` exactly (bit for bit)
what the undelayed hook handed it at step ``t - 1``, zeros at the first compressed step,
and the same dense warm-up. The rest (replicas, layout invariance, resume, a dead rank,
argument checks) runs the delayed hook with a real learning rate on gloo processes.
"""

import io

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from _dist import run_workers
from test_collective_failures import _outcomes
from test_hooks import BASE, Net, make_model, make_opt, train_ddp, train_until_a_rank_dies
from slimcomm.compressor import SlimDPCompressor
from slimcomm.hooks import SlimDPState
from slimcomm.optim import SlimDPOptimizer

DELAY = dict(delay_steps=1)
SMALL_BUCKETS = dict(bucket_cap_mb=0.001)  # several buckets, some of dense parameters only


def _frozen_grads(rank, cfg, ddp_kw):
    """Per-step gradients with lr 0 (weights fixed), undelayed and delayed."""
    out = {}
    for name, extra in (("plain", {}), ("delayed", DELAY)):
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        res = train_ddp(rank, 9, {**cfg, **extra}, ddp_kw=ddp_kw, model=model, opt=opt)
        out[name] = res["grads"]
    return out


def _two_rank_cases(rank, world_size):
    out = {}
    for key, cfg, ddp_kw in (("fp32", {}, SMALL_BUCKETS),
                             ("bf16_one_bucket", dict(value_dtype=torch.bfloat16), {}),
                             ("no_ef", dict(error_feedback=False), SMALL_BUCKETS)):
        out[key] = _frozen_grads(rank, cfg, ddp_kw)
    # real training: layout invariance (bucketing) and the resumed run
    cfg = dict(core_refresh=4, warmup_steps=3, **DELAY)
    out["small"] = train_ddp(rank, 14, cfg, ddp_kw=SMALL_BUCKETS, record=False)["params"]
    out["large"] = train_ddp(rank, 14, cfg, ddp_kw=dict(bucket_cap_mb=25), record=False)["params"]
    first = train_ddp(rank, 9, cfg, ddp_kw=SMALL_BUCKETS, record=False)
    buf = io.BytesIO()  # every rank saves its own, with step 8's values still to apply
    torch.save({"model": first["model"].state_dict(), "opt": first["opt"].state_dict(),
                "slim": first["hstate"].state_dict()}, buf)
    buf.seek(0)
    ck = torch.load(buf, weights_only=False)
    model = Net()
    model.load_state_dict(ck["model"])
    opt = make_opt(model.parameters())
    opt.load_state_dict(ck["opt"])
    state = SlimDPState(**{**BASE, **cfg})
    state.load_state_dict(ck["slim"])
    resumed = train_ddp(rank, 5, ddp_kw=dict(bucket_cap_mb=25), record=False, model=model,
                        opt=opt, state=state, start=9)
    out["resumed"] = resumed["params"]
    out["saved_keys"] = sorted(ck["slim"]["params"][0])
    return out


@pytest.fixture(scope="module")
def two():
    return run_workers(_two_rank_cases, 2, timeout=300)


@pytest.mark.parametrize("key", ["fp32", "bf16_one_bucket", "no_ef"])
def test_delayed_hands_ddp_the_previous_steps_average(two, key):
    warm = BASE["warmup_steps"]
    for rank in range(2):
        plain, delayed = two[rank][key]["plain"], two[rank][key]["delayed"]
        for t in range(len(plain)):
            for p, (a, b) in enumerate(zip(plain[t], delayed[t])):
                if t < warm:
                    want = a  # dense warm-up: synchronous
                elif t == warm:
                    want = torch.zeros_like(a)  # nothing in flight yet
                else:
                    want = plain[t - 1][p]
                assert torch.equal(b, want), (key, rank, t, p)
        # the test is not vacuous: consecutive steps differ
        assert not all(torch.equal(a, b) for a, b in zip(plain[warm], plain[warm + 1]))


def test_delayed_replicas_identical_and_layout_invariant(two):
    for key in ("small", "large", "resumed"):
        for a, b in zip(two[0][key], two[1][key]):
            assert torch.equal(a, b), key
    for a, b in zip(two[0]["small"], two[0]["large"]):
        assert torch.equal(a, b)


def test_delayed_resume_is_bit_exact(two):
    assert "delayed_result" in two[0]["saved_keys"]
    for a, b in zip(two[0]["small"], two[0]["resumed"]):
        assert torch.equal(a, b)


def _three_rank_case(rank, world_size):
    res = train_ddp(rank, 10, dict(value_dtype=torch.bfloat16, **DELAY), ddp_kw=SMALL_BUCKETS,
                    record=False)
    return res["params"], res["stats"]["total"]["bytes_sent"]


def test_delayed_three_ranks_replicas_identical():
    outs = run_workers(_three_rank_case, 3, timeout=180)
    for other in outs[1:]:
        for a, b in zip(outs[0][0], other[0]):
            assert torch.equal(a, b)
    assert all(torch.isfinite(p).all() for p in outs[0][0])
    assert outs[0][1] > 0


def _victim(rank, world_size):
    # rank 1 dies with its step-4 all-reduce in flight
    return train_until_a_rank_dies(rank, DELAY, victim=1, at_step=4, before_backward=False)


def test_delayed_dead_rank_raises_on_the_survivor():
    outs = _outcomes(_victim, 2, timeout=120)
    code, status, res = outs[0]
    assert status == "ok" and res["raised"], outs[0]
    assert "a collective failed" in res["msg"], res["msg"]
    assert res["step"] in (4, 5) and res["unchanged"]
    assert outs[1][0] == 3


@pytest.mark.parametrize("kw,name", [
    (dict(delay_steps=2), "delay_steps"),
    (dict(delay_steps=True), "delay_steps"),
    (dict(delay_steps=1, index_mode="local"), "delay_steps"),
])
def test_bad_delay_names_the_argument(kw, name):
    with pytest.raises(ValueError, match=name):
        SlimDPState(**kw)


def test_delay_is_a_hook_option():
    with pytest.raises(ValueError, match="DDP comm hook"):
        SlimDPCompressor(delay_steps=1)
    with pytest.raises(TypeError):
        SlimDPOptimizer(nn.Linear(2, 2), torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1),
                        delay_steps=1)


def test_delay_refuses_a_grad_scaler():
    state = SlimDPState(delay_steps=1)
    with pytest.raises(ValueError, match="scaler"):
        state.attach_grad_scaler(torch.amp.GradScaler("cpu"))


def test_delay_mismatch_on_load_is_refused():
    saved = SlimDPState(delay_steps=1).state_dict()
    with pytest.raises(ValueError, match="delay_steps"):
        SlimDPState().load_state_dict(saved)


class _EveryOther(nn.Module):
    """``b`` is used at even steps only (on every rank)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(12, 5)
        self.b = nn.Linear(12, 5)

    def forward(self, x, t):
        out = self.a(x)
        return out + self.b(x) if t % 2 == 0 else out


def _unused_case(rank, world_size):
    out = {}
    for name, ddp_kw in (("unused", dict(find_unused_parameters=True)), ("plain", {})):
        ddp = DDP(_EveryOther(), **ddp_kw)
        try:
            SlimDPState(**{**BASE, **DELAY}).attach(ddp)
            out[name] = "ok"
        except ValueError as e:
            out[name] = str(e)
    return out


def test_delay_refuses_find_unused_parameters():
    # Found by the breaker: delayed, the bucket value DDP discards for a parameter no rank
    # used at step t is step t - 1's average, so a parameter used every other step never
    # received any gradient after the warm-up (silently frozen).
    res = run_workers(_unused_case, 2, timeout=120)
    for r in res:
        assert "find_unused_parameters" in r["unused"] and "delay_steps" in r["unused"]
        assert r["plain"] == "ok"
