"""SlimDPOptimizer(delay_syncs=1): the synchronisation of period k applied at the end of
period k+1 (slimcomm.optim.delayed). Real gloo ranks; the oracle is a single-process
simulation of every rank's inner steps, anchors and the one-period-late outer step (2
ranks: every average is of two values, as in test_optim's DiLoCo oracle)."""

import io

import pytest
import torch

from _dist import run_workers
from slimcomm.optim import SlimDPOptimizer
from test_optim import CFG, inner_steps, make_inner, make_model, params_of, train

DENSE = dict(sync_every=2, compression="dense", value_dtype=torch.float32, outer_lr=0.7,
             outer_momentum=0.9, nesterov=True)


def _dense_delayed(rank, world_size, steps, final, H=2, tau=None):
    cfg = {**DENSE, "sync_every": H, "delay_syncs": 1, "overlap_steps": tau}
    model, opt = train(rank, steps, cfg, init_seed=0)
    if final:
        opt.synchronize()
    with torch.no_grad(), opt.outer_weights() as m:
        outer = params_of(m)
    return params_of(model), outer, opt.syncs


def _simulate(world_size, steps, H, lr, mu, final, tau=None):
    """Every rank's AdamW steps; at the end of each period: the average launched a period ago
    steps the outer parameters (Nesterov), each rank sends anchor - local and continues from
    outer - (anchor - local); the final synchronize() launches the last period and drains.
    With ``tau`` < H the average is applied ``tau`` steps after its launch instead, each rank
    rebased: local += outer - anchor, anchor = outer."""
    models = [make_model(0) for _ in range(world_size)]
    inners = [make_inner(m) for m in models]
    outer = [p.detach().clone() for p in models[0].parameters()]
    mom = [torch.zeros_like(p) for p in outer]
    anchors = [[p.clone() for p in outer] for _ in models]
    inflight = None

    def apply():
        nonlocal inflight
        for i, avg in enumerate(inflight):
            mom[i].mul_(mu).add_(avg)
            outer[i].sub_(avg.add(mom[i], alpha=mu), alpha=lr)
        inflight = None

    def sync(launch):
        nonlocal inflight
        with torch.no_grad():
            if inflight is not None:
                apply()
            deltas = [[a - p for a, p in zip(anchors[r], m.parameters())]
                      for r, m in enumerate(models)]
            inflight = [sum(d[i] / world_size for d in deltas) for i in range(len(outer))] \
                if launch else None
            for r, m in enumerate(models):
                for i, p in enumerate(m.parameters()):
                    anchors[r][i] = outer[i] - deltas[r][i]
                    p.copy_(anchors[r][i])

    for t in range(steps):
        inner_steps(models, inners, t)
        if (t + 1) % H == 0:
            sync(launch=True)
        elif tau is not None and inflight is not None and (t + 1) % H == tau:
            with torch.no_grad():
                apply()
                for r, m in enumerate(models):
                    for i, p in enumerate(m.parameters()):
                        p.add_(outer[i] - anchors[r][i])
                        anchors[r][i] = outer[i].clone()
    if final:
        if steps % H:
            sync(launch=True)
        sync(launch=False)
    return [[p.detach().clone() for p in m.parameters()] for m in models], outer


@pytest.mark.parametrize("steps,final,H,tau", [(6, False, 2, None), (7, True, 2, None),
                                              (8, True, 2, None), (9, False, 3, 1),
                                              (10, False, 3, 1), (11, True, 3, 2), (8, False, 3, 3)])
def test_matches_the_simulation_of_the_delayed_outer_step(steps, final, H, tau):
    res = run_workers(_dense_delayed, 2, steps, final, H, tau)
    locs, outer = _simulate(2, steps, H, 0.7, 0.9, final, tau if tau != H else None)
    for r in range(2):
        for a, b in zip(res[r][0], locs[r]):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
        for a, b in zip(res[r][1], outer):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    if final:  # drained: every rank holds the outer parameters
        for a, b in zip(res[0][0], res[1][0]):
            assert torch.equal(a, b)
        for a, b in zip(res[0][0], res[0][1]):
            assert torch.equal(a, b)
    else:      # between synchronisations the ranks keep their own last period
        assert any(not torch.equal(a, b) for a, b in zip(res[0][0], res[1][0]))


def test_delayed_is_not_the_undelayed_run():
    """The oracle above is not trivially the undelayed DiLoCo: after 3 syncs they differ."""
    delayed = run_workers(_dense_delayed, 2, 6, False)
    locs, _ = _simulate(2, 6, 2, 0.7, 0.9, False)
    from test_optim import _simulate_diloco
    plain = _simulate_diloco(2, 6, 2, 0.7, 0.9)
    assert any((a - b).abs().max() > 1e-4 for a, b in zip(delayed[0][0], plain))


MODES = {
    "shared": dict(compression="shared"),
    "local": dict(compression="local", error_decay=0.95),
    "dense-2bit": dict(compression="dense", value_bits=2),
    "dense-2bit-all_gather": dict(compression="dense", value_bits=2,
                                  lowbit_collective="all_gather"),
    "dense-bf16-warmup": dict(compression="dense", value_dtype=torch.bfloat16, warmup_syncs=2),
}


def _replicas(rank, world_size, cfg, steps):
    model = make_model(rank)
    opt = SlimDPOptimizer(model, make_inner(model), **cfg)
    start = params_of(model)   # rank 0's, broadcast by the constructor
    outers = []
    for t in range(steps):
        _, opt = train(rank, 1, cfg, model=model, opt=opt, start=t)
        if (t + 1) % cfg["sync_every"] == 0:
            with torch.no_grad(), opt.outer_weights() as m:
                outers.append(params_of(m))
    last = params_of(model)
    opt.synchronize()
    return outers, last, params_of(model), opt.stats["syncs"], start


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_outer_parameters_identical_after_every_sync_and_replicas_after_the_drain(mode, world_size):
    cfg = {**CFG, **MODES[mode], "delay_syncs": 1}
    res = run_workers(_replicas, world_size, cfg, 10)
    for r in range(1, world_size):
        for k, (a, b) in enumerate(zip(res[0][0], res[r][0])):
            assert all(torch.equal(x, y) for x, y in zip(a, b)), f"sync {k + 1}: rank {r} differs"
        assert all(torch.equal(x, y) for x, y in zip(res[0][2], res[r][2])), f"rank {r} after drain"
        assert any(not torch.equal(x, y) for x, y in zip(res[0][1], res[r][1]))
    # the outer parameters move one synchronisation late: the first one applies nothing yet
    assert all(torch.equal(x, y) for x, y in zip(res[0][0][0], res[0][4]))
    assert any(not torch.equal(x, y) for x, y in zip(res[0][0][1], res[0][0][0]))
    assert res[0][3] == 4


def _save(rank, world_size, cfg, steps):
    model, opt = train(rank, steps, cfg, init_seed=0)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    after = params_of(model)
    opt.synchronize()
    return buf.getvalue(), after, params_of(model)


def _resume(rank, world_size, cfg, blobs, start, steps):
    ck = torch.load(io.BytesIO(blobs[rank]), weights_only=False)
    model = make_model(99)
    model.load_state_dict(ck["model"])
    opt = SlimDPOptimizer(model, make_inner(model), **cfg)
    opt.load_state_dict(ck["opt"])
    model, opt = train(rank, steps, cfg, model=model, opt=opt, start=start)
    after = params_of(model)
    opt.synchronize()
    return after, params_of(model)


@pytest.mark.parametrize("mode", ["shared", "dense-2bit", "dense-2bit-all_gather"])
def test_resume_with_a_sync_in_flight_is_bit_exact(mode):
    """Step 10 with sync_every=3: the synchronisation launched at step 9 is in flight (the
    two-stage all-reduce's deferred decode is resolved into the checkpoint)."""
    _check_resume({**CFG, **MODES[mode], "outer_momentum": 0.5, "nesterov": True,
                   "delay_syncs": 1}, 10, 20)


def _check_resume(cfg, cut, total):
    """A run checkpointed at step ``cut`` and resumed to ``total`` equals the straight run,
    bit for bit, before and after the final drain."""
    full = run_workers(_save, 2, cfg, total)
    half = run_workers(_save, 2, cfg, cut)
    resumed = run_workers(_resume, 2, cfg, [half[0][0], half[1][0]], cut, total - cut)
    for r in range(2):
        for a, b in zip(resumed[r][0], full[r][1]):
            assert torch.equal(a, b), f"rank {r}: resumed run differs"
        for a, b in zip(resumed[r][1], full[r][2]):
            assert torch.equal(a, b), f"rank {r}: resumed run differs after the drain"


def _load_other(rank, world_size, blob_cfg, cfg):
    model, opt = train(rank, 4, blob_cfg, init_seed=0)
    state = opt.state_dict()
    model2 = make_model(0)
    opt2 = SlimDPOptimizer(model2, make_inner(model2), **cfg)
    try:
        opt2.load_state_dict(state)
    except (ValueError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


@pytest.mark.parametrize("saved,loading", [(1, 0), (0, 1)])
def test_a_state_of_the_other_delay_is_refused(saved, loading):
    res = run_workers(_load_other, 2, {**CFG, "delay_syncs": saved}, {**CFG, "delay_syncs": loading})
    for msg in res:
        assert msg is not None and msg.startswith("ValueError") and \
            f"delay_syncs={saved}" in msg, msg


def _bad(rank, world_size, value):
    model = make_model(0)
    try:
        SlimDPOptimizer(model, make_inner(model), delay_syncs=value)
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("value", [2, -1, True, 0.5])
def test_bad_delay_syncs_is_refused(value):
    for msg in run_workers(_bad, 2, value):
        assert msg is not None and "delay_syncs must be 0 or 1" in msg, msg


def _frozen(rank, world_size):
    model = make_model(0)
    opt = SlimDPOptimizer(model, make_inner(model), delay_syncs=1)
    try:
        opt.delay_syncs = 0
    except AttributeError as exc:
        return str(exc)
    return None


def test_delay_syncs_is_fixed_at_construction():
    assert "cannot be changed" in run_workers(_frozen, 1)[0]


@pytest.mark.parametrize("mode", ["shared", "dense-2bit"])
def test_resume_inside_the_overlap_window_is_bit_exact(mode):
    """overlap_steps=2 of sync_every=4: the synchronisation launched at step 8 is applied at
    step 10, so the checkpoint at step 9 holds it in flight (inside the overlap window)."""
    _check_resume({**CFG, **MODES[mode], "sync_every": 4, "delay_syncs": 1, "overlap_steps": 2},
                  9, 20)


def _bad_overlap(rank, world_size, kw):
    model = make_model(0)
    try:
        SlimDPOptimizer(model, make_inner(model), sync_every=4, **kw)
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("kw,needle", [
    (dict(overlap_steps=2), "applies with delay_syncs=1"),
    (dict(delay_syncs=1, overlap_steps=5), "overlap_steps must be an int in [1, sync_every=4]"),
    (dict(delay_syncs=1, overlap_steps=0), "overlap_steps must be an int"),
    (dict(delay_syncs=1, overlap_steps=True), "overlap_steps must be an int"),
])
def test_bad_overlap_steps_is_refused(kw, needle):
    for msg in run_workers(_bad_overlap, 2, kw):
        assert msg is not None and needle in msg, msg
