"""The two-shot all-reduce (issue 31): ``slimcomm._comm.two_shot_all_reduce`` and the
hook's ``allreduce_algorithm``.

The collective against the sum of every rank's vector in fp32 in rank order (the
reference it promises: bit for bit), for sizes that do and do not divide by the world
size, in fp32/fp16/bf16; the hook with ``"two_shot"``: replicas bit-identical, the same
trajectory whatever the bucketing (each value is summed by one rank in rank order), close
to the backend's ring; the projection's hop count; a dead rank in the middle of the exchange; bad
arguments named; ranks constructed with different algorithms refused on every rank.
"""

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from _dist import run_workers
from test_collective_failures import _outcomes
from test_hooks import BASE, batch, loss_fn, make_model, strip, train_ddp, \
    train_until_a_rank_dies
from slimcomm import _comm
from slimcomm.compressor import SlimDPCompressor
from slimcomm.hooks import SlimDPState, slim_dp_hook

SIZES = (0, 1, 5, 12, 1001)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _vector(rank, n, dtype):
    g = torch.Generator().manual_seed(100 * rank + n)
    return (torch.randn(n, generator=g) * (1 + rank)).to(dtype)


def _collective_cases(rank, world_size):
    out = {}
    for dtype in DTYPES:
        for n in SIZES:
            x = _vector(rank, n, dtype)
            before = x.clone()
            got = _comm.two_shot_all_reduce(x, timeout=60).wait()[0]
            ref = _vector(0, n, dtype).float()
            for r in range(1, world_size):
                ref += _vector(r, n, dtype).float()
            out[str(dtype), n] = dict(got=got.clone(), ref=ref.to(dtype),
                                      untouched=torch.equal(x, before))
    return out


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_two_shot_equals_the_fp32_sum_in_rank_order(world_size):
    outs = run_workers(_collective_cases, world_size, timeout=120)
    for key, res in outs[0].items():
        assert res["untouched"], key
        assert res["got"].dtype == res["ref"].dtype and res["got"].shape == res["ref"].shape
        assert torch.equal(res["got"], res["ref"]), key
        for other in outs[1:]:  # the same bits on every rank
            assert torch.equal(other[key]["got"], res["got"]), key


def _hook_cases(rank, world_size):
    out = {}
    for algo in ("two_shot", "backend"):
        for cap in (0.001, 25):
            cfg = dict(allreduce_algorithm=algo, check_agreement_every=1)
            res = train_ddp(rank, 8, cfg, ddp_kw=dict(bucket_cap_mb=cap), record=False)
            out[algo, cap] = strip(res)
    out["bf16"] = strip(train_ddp(rank, 8, dict(allreduce_algorithm="two_shot",
                                                value_dtype=torch.bfloat16), record=False))
    for fuse in (False, True):  # the fused SGD step reads the two-shot sum like the ring's
        model = make_model()
        ddp = DDP(model, bucket_cap_mb=0.001)
        state = SlimDPState(**BASE, allreduce_algorithm="two_shot").attach(ddp)
        ddp.register_comm_hook(state, slim_dp_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if fuse:
            state.fuse_sgd(opt)
        for t in range(8):
            opt.zero_grad()
            x, y = batch(rank, t)
            loss_fn(ddp(x), y).backward()
            opt.step()
        out["fused", fuse] = [p.detach().clone() for p in model.parameters()]
    return out


@pytest.fixture(scope="module")
def four():
    return run_workers(_hook_cases, 4, timeout=300)


def test_two_shot_hook_replicas_identical_and_layout_invariant(four):
    ref = four[0]["two_shot", 25]["params"]
    assert all(torch.isfinite(p).all() for p in ref)
    for rank in range(4):
        for cap in (0.001, 25):
            for a, b in zip(four[rank]["two_shot", cap]["params"], ref):
                assert torch.equal(a, b), (rank, cap)
        for a, b in zip(four[rank]["bf16"]["params"], four[0]["bf16"]["params"]):
            assert torch.equal(a, b), rank


def test_two_shot_with_the_fused_sgd_step_is_bit_identical(four):
    for rank in range(4):
        for a, b in zip(four[rank]["fused", True], four[rank]["fused", False]):
            assert torch.equal(a, b), rank
        for a, b in zip(four[rank]["fused", True], four[0]["fused", True]):
            assert torch.equal(a, b), rank


def test_two_shot_hook_close_to_the_ring(four):
    # the same algorithm; only the summation order of the four fp32 values differs
    for a, b in zip(four[0]["two_shot", 25]["params"], four[0]["backend", 25]["params"]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    checks = four[0]["two_shot", 25]["stats"]["total"]["checks"]
    assert checks > 0  # the index sets were checked across ranks at every compressed step


@pytest.mark.parametrize("bad", ["ring", "auto", "", None, 2, "TWO_SHOT"])
def test_bad_algorithm_names_the_argument(bad):
    with pytest.raises(ValueError, match="allreduce_algorithm"):
        SlimDPState(allreduce_algorithm=bad)
    with pytest.raises(ValueError, match="allreduce_algorithm"):
        SlimDPCompressor(allreduce_algorithm=bad)


@pytest.mark.parametrize("kw", [dict(delay_steps=1), dict(index_mode="local")])
def test_two_shot_refuses_the_paths_it_does_not_serve(kw):
    with pytest.raises(ValueError, match="allreduce_algorithm='two_shot'"):
        SlimDPState(allreduce_algorithm="two_shot", **kw)
    SlimDPState(allreduce_algorithm="backend", **kw)  # the default path takes them
    with pytest.raises(ValueError, match="allreduce_algorithm='two_shot'"):
        SlimDPCompressor(allreduce_algorithm="two_shot", value_bits=2)


def test_algorithm_is_frozen_and_pickled():
    st = SlimDPState(allreduce_algorithm="two_shot")
    with pytest.raises(AttributeError, match="allreduce_algorithm"):
        st.allreduce_algorithm = "backend"
    assert SlimDPCompressor().allreduce_algorithm == "backend"
    assert SlimDPState().allreduce_algorithm == "backend"
    assert st._two_shot(4) and not st._two_shot(1) and not SlimDPState()._two_shot(8)
    assert "allreduce_algorithm" in SlimDPState._HYPERPARAMETERS


def _mixed(rank, world_size):
    algo = "two_shot" if rank == 0 else "backend"
    try:
        train_ddp(rank, 4, dict(allreduce_algorithm=algo), record=False)
    except RuntimeError as exc:
        return str(exc)
    return None


def test_ranks_with_different_algorithms_are_refused_on_every_rank():
    msgs = run_workers(_mixed, 4, timeout=120)
    for m in msgs:
        assert m is not None and "hyperparameters" in m, m


def _victim(rank, world_size):
    # rank 2 dies before its step-4 exchange
    return train_until_a_rank_dies(rank, dict(allreduce_algorithm="two_shot"), victim=2,
                                   at_step=4, before_backward=True, timeout=20.0)


def test_dead_rank_in_the_two_shot_exchange_raises_on_every_survivor():
    outs = _outcomes(_victim, 3, timeout=150)
    assert outs[2][0] == 3
    for rank in (0, 1):
        code, status, res = outs[rank]
        assert status == "ok" and res["raised"], outs[rank]
        assert "a collective failed" in res["msg"] or "collective" in res["msg"], res["msg"]
        assert res["step"] == 4 and res["unchanged"], res


def test_two_shot_needs_a_process_group():
    assert not dist.is_initialized()
    with pytest.raises((RuntimeError, ValueError)):
        _comm.two_shot_all_reduce(torch.ones(4))


def test_projection_counts_two_hops_per_two_shot_call():
    from slimcomm.train import projection as P
    assert P.ring_hops("two_shot", 8) == 2 and P.ring_hops("two_shot", 1) == 0
    run = dict(method="slimdp", world_size=8, steps=100, dense_bytes_per_step=1e6,
               config=dict(core_refresh=10, allreduce_algorithm="two_shot"))
    ring = dict(run, config=dict(core_refresh=10, allreduce_algorithm="backend"))
    old = dict(run, config=dict(core_refresh=10))  # made before the option existed
    assert P.two_shot(run) and not P.two_shot(ring) and not P.two_shot(old)
    calls = P.collective_calls(run)
    assert calls["two_shot"] == 1.0 and calls["allreduce"] == pytest.approx(0.11)
    assert P.hops_per_step(run) == pytest.approx(2 + 0.11 * 14)
    assert P.hops_per_step(ring) == P.hops_per_step(old) == pytest.approx(1.11 * 14)
