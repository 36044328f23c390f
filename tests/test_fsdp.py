"""Issue 26, item 2: the Slim-DP hook on FSDP2 (slimcomm.fsdp), on 4 gloo ranks as a
2 x 2 (replicate, shard) mesh: ranks {0, 1} and {2, 3} are the replica groups (FSDP
inside), {0, 2} and {1, 3} the replicate groups the hook averages over.

The model has odd sizes, so shard 1 of every parameter is shorter than shard 0 and
FSDP pads it: the hook sees padded shards.
"""

import io

import pytest
import torch
import torch.distributed as dist
from torch import nn

from _dist import run_workers

MESH = (2, 2)
D_IN, HID, D_OUT, BATCH = 8, 13, 3, 6


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", MESH, mesh_dim_names=("replicate", "shard"))


def _model(layers=2):
    torch.manual_seed(0)
    mods = [nn.Linear(D_IN, HID), nn.Tanh()]
    for _ in range(layers - 1):
        mods += [nn.Linear(HID, HID), nn.Tanh()]
    mods.append(nn.Linear(HID, D_OUT))
    return nn.Sequential(*mods)


def _shard(model, mesh, per_layer=True):
    from torch.distributed.fsdp import fully_shard
    if per_layer:
        for m in model:
            if isinstance(m, nn.Linear):
                fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _batch(rank, t):
    g = torch.Generator().manual_seed(1000 * rank + t)
    x = torch.randn(BATCH, D_IN, generator=g)
    return x, (x[:, :D_OUT] * 2).argmax(1)


def _train(model, opt, rank, steps, start=0):
    losses = []
    for t in range(start, start + steps):
        x, y = _batch(rank, t)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def _local(model):
    return [p.to_local().detach().clone() for p in model.parameters()]


def _full(model):
    return [p.full_tensor().detach().clone() for p in model.parameters()]


def _hooked(mesh, per_layer=True, layers=2, **kw):
    from slimcomm import register_slim_dp_hook
    model = _shard(_model(layers), mesh["shard"], per_layer)
    state = register_slim_dp_hook(model, replicate_group=mesh["replicate"], **kw)
    return model, state


# ---------------------------------------------------------------------------
# dense ratios = plain HSDP = the DDP hook
# ---------------------------------------------------------------------------

def _dense_case(rank, world_size, steps):
    from torch.nn.parallel import DistributedDataParallel as DDP
    from slimcomm import SlimDPState, register_slim_dp_hook
    mesh = _mesh()
    out = {}
    model, state = _hooked(mesh, core_ratio=1.0, explore_ratio=0.0, warmup_steps=1)
    out["hook_loss"] = _train(model, torch.optim.SGD(model.parameters(), lr=0.2), rank, steps)
    out["hook"] = _full(model)
    out["stats"] = state.stats

    hsdp = _shard(_model(), mesh)  # the 2-D mesh: FSDP's own HSDP
    try:
        register_slim_dp_hook(hsdp, replicate_group=mesh["replicate"])
        out["hsdp_refused"] = None
    except ValueError as exc:
        out["hsdp_refused"] = str(exc)
    out["hsdp_loss"] = _train(hsdp, torch.optim.SGD(hsdp.parameters(), lr=0.2), rank, steps)
    out["hsdp"] = _full(hsdp)

    wrong = _shard(_model(), mesh["shard"])
    try:  # the shard dimension given as the replicate group
        register_slim_dp_hook(wrong, replicate_group=mesh["shard"])
        out["wrong_refused"] = None
    except ValueError as exc:
        out["wrong_refused"] = str(exc)

    plain = _model()
    ddp = DDP(plain)
    ddp.register_comm_hook(SlimDPState(core_ratio=1.0, explore_ratio=0.0, model=ddp),
                           __import__("slimcomm").slim_dp_hook)
    out["ddp_loss"] = _train(ddp, torch.optim.SGD(plain.parameters(), lr=0.2), rank, steps)
    out["ddp"] = [p.detach().clone() for p in plain.parameters()]
    return out


def test_dense_ratios_equal_plain_hsdp_and_the_ddp_hook():
    res = run_workers(_dense_case, 4, 5, timeout=240)
    for r in res:
        assert r["hsdp_refused"] and "2-D (HSDP) mesh" in r["hsdp_refused"], r["hsdp_refused"]
        assert r["wrong_refused"] and "replicate_group" in r["wrong_refused"]
        assert r["stats"]["steps"] == 5 and r["stats"]["total"]["density"] == 1.0
        for a, b, c in zip(r["hook"], r["hsdp"], r["ddp"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)
        for name in ("hsdp_loss", "ddp_loss"):
            torch.testing.assert_close(torch.tensor(r["hook_loss"]), torch.tensor(r[name]),
                                       rtol=1e-5, atol=1e-6)
    assert res[0]["hook_loss"][-1] < res[0]["hook_loss"][0]
    for a, b in zip(res[0]["hook"], res[3]["hook"]):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------
# sparse: replicas identical, layout invariance, residual memory per shard
# ---------------------------------------------------------------------------

CONFIGS = {
    "shared": dict(core_ratio=0.15, explore_ratio=0.1, core_refresh=2, warmup_steps=1),
    "local": dict(core_ratio=0.15, explore_ratio=0.1, index_mode="local", warmup_steps=1),
    "bits2": dict(core_ratio=0.3, explore_ratio=0.1, value_bits=2, quant_chunk=16,
                  warmup_steps=1),
    "dense_bits2": dict(core_ratio=1.0, explore_ratio=0.0, value_bits=2, warmup_steps=1),
}


def _sparse_case(rank, world_size, steps):
    mesh = _mesh()
    out = {}
    for name, kw in CONFIGS.items():
        for per_layer in (True, False):
            model, state = _hooked(mesh, per_layer=per_layer, **kw)
            loss = _train(model, torch.optim.SGD(model.parameters(), lr=0.2), rank, steps)
            sd = state.state_dict()
            out[name, per_layer] = dict(
                local=_local(model), loss=loss, stats=state.stats,
                residual=sum(e["residual"].numel() for e in sd["params"].values()),
                full=sum(p.numel() for p in model.parameters()))
    return out


def test_sparse_replicas_identical_and_layout_invariant():
    res = run_workers(_sparse_case, 4, 6, timeout=300)
    for name in CONFIGS:
        for rank in range(4):
            a, b = res[rank][name, True], res[rank][name, False]
            # one FSDP module per layer or one for the whole model: bit-identical
            for x, y in zip(a["local"], b["local"]):
                assert torch.equal(x, y), (name, rank)
            st = a["stats"]
            assert st["steps"] == 6
            last = st["last"]
            if name == "dense_bits2":  # every coordinate, 2 bits + a bf16 scale per chunk
                assert last["density"] == 1.0
                assert last["bytes_sent"] - last["check_bytes"] < last["bytes_dense"] / 4, last
            else:
                assert last["density"] < 0.6, (name, last)
            # residuals of the padded local shard: about half the model per rank
            assert a["residual"] < 0.6 * a["full"], (name, a["residual"], a["full"])
        for peer_a, peer_b in ((0, 2), (1, 3)):  # replicate peers hold identical shards
            for x, y in zip(res[peer_a][name, True]["local"], res[peer_b][name, True]["local"]):
                assert torch.equal(x, y), name
        # and it trains
        assert res[0][name, True]["loss"][-1] < res[0][name, True]["loss"][0] + 0.5


# ---------------------------------------------------------------------------
# checkpoint + resume = uninterrupted, bit for bit
# ---------------------------------------------------------------------------

KW = dict(core_ratio=0.15, explore_ratio=0.1, core_refresh=3, warmup_steps=2)


def _resume_case(rank, world_size, steps, cut):
    from slimcomm import SlimDPFSDPState
    mesh = _mesh()
    model, state = _hooked(mesh, **KW)
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    _train(model, opt, rank, steps)
    straight = _local(model)

    model, state = _hooked(mesh, **KW)
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    _train(model, opt, rank, cut)
    buf = io.BytesIO()
    torch.save({"model": _local(model), "opt": opt.state_dict(), "slim_dp": state.state_dict()},
               buf)
    del model, state, opt
    ck = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)

    model = _shard(_model(), mesh["shard"])
    for p, w in zip(model.parameters(), ck["model"]):
        with torch.no_grad():
            p.to_local().copy_(w)
    state = SlimDPFSDPState(replicate_group=mesh["replicate"], **KW)
    state.load_state_dict(ck["slim_dp"])
    state.attach(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    opt.load_state_dict(ck["opt"])
    _train(model, opt, rank, steps - cut, start=cut)
    resumed = _local(model)

    # another rank's file is refused at once, naming the rank
    other = dict(ck["slim_dp"], fsdp=dict(ck["slim_dp"]["fsdp"], rank=(rank + 1) % world_size,
                                          shard_rank=1 - dist.get_rank(mesh["shard"].get_group())))
    fresh = SlimDPFSDPState(replicate_group=mesh["replicate"], **KW).attach(
        _shard(_model(), mesh["shard"]))
    try:
        fresh.load_state_dict(other)
        refused = None
    except ValueError as exc:
        refused = str(exc)
    return dict(straight=straight, resumed=resumed, step=state.step, refused=refused)


def test_checkpoint_resume_is_bit_exact():
    res = run_workers(_resume_case, 4, 8, 4, timeout=240)
    for r in res:
        assert r["step"] == 8
        for a, b in zip(r["straight"], r["resumed"]):
            assert torch.equal(a, b)
        assert r["refused"] and "every rank must load the file it saved" in r["refused"]


# ---------------------------------------------------------------------------
# a replica peer dies: the survivors raise, no gradient is written
# ---------------------------------------------------------------------------

def _victim(rank, world_size, timeout):
    import os
    import time
    from slimcomm.fsdp import CollectiveError
    mesh = _mesh()
    model, state = _hooked(mesh, timeout=timeout, **KW)
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    for t in range(6):
        x, y = _batch(rank, t)
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x), y)
        if rank == 3 and t == 3:
            os._exit(3)  # after its forward: rank 1 waits for it in the hook's all-reduce
        t0 = time.monotonic()
        try:
            loss.backward()
        except Exception as exc:  # noqa: BLE001
            out = dict(raised=True, type=type(exc).__name__, msg=str(exc), step=t,
                       seconds=time.monotonic() - t0,
                       grads_none=all(p.grad is None for p in model.parameters()))
            out["reuse"] = None
            if state._failed is not None:  # the hook's own collective failed: refused now
                try:
                    state._reduce(0, torch.zeros(state._groups[0].numel))
                except CollectiveError as again:
                    out["reuse"] = str(again)
            return out
        opt.step()
    return dict(raised=False)


def test_killed_replica_peer_raises_on_survivors():
    from test_collective_failures import _outcomes
    outs = _outcomes(_victim, 4, 10.0, timeout=120)
    assert outs[3][0] != 0
    code, status, res = outs[1]  # rank 3's replicate peer: fails in the hook's collective
    assert status == "ok" and res["raised"], outs[1]
    assert res["type"] == "CollectiveError" and "a collective failed" in res["msg"], res
    assert res["step"] == 3 and res["seconds"] < 15 and res["grads_none"], res
    assert "cannot be used after a failed" in (res["reuse"] or ""), res
    for r in (0, 2):  # the others fail in FSDP's or the hook's collectives, never hang
        code, status, res = outs[r]
        assert code != 0 and (status == "error" or res["raised"]), (r, outs[r])


# ---------------------------------------------------------------------------
# hot path: no host sync, ops per FSDP group independent of its parameter count
# ---------------------------------------------------------------------------

def _hook_counts(rank, world_size, layers, mode, steps=8, refresh=4):
    from torch.distributed.device_mesh import init_device_mesh
    from slimcomm import compressor
    from slimcomm._opcount import OpCounter, synchronous_collectives
    from slimcomm import register_slim_dp_hook
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    model = _shard(_model(layers), mesh["shard"], per_layer=False)  # one group
    state = register_slim_dp_hook(model, replicate_group=mesh["replicate"], core_ratio=0.2,
                                  explore_ratio=0.1, core_refresh=refresh, warmup_steps=2,
                                  index_mode=mode)
    counter = OpCounter()
    rows = []
    hook = state._hooks[0]

    def counted(buf):
        with counter:
            hook(buf)
        rows[-1]["buckets"] += 1

    model.set_all_reduce_hook(counted)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with synchronous_collectives(compressor):
        for t in range(steps):
            counter.reset()
            rows.append(dict(step=state.step, buckets=0))
            x, y = _batch(rank, t)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            rows[-1].update(total=counter.total, syncs=counter.host_syncs,
                            ops=dict(counter.ops))
    return rows


@pytest.mark.parametrize("mode", ["shared", "local"])
def test_hook_step_has_no_host_sync_and_constant_ops(mode):
    from test_hot_path import _check
    results = {n: run_workers(_hook_counts, 2, n, mode, timeout=200)[0] for n in (2, 40)}
    # the SIZES of test_hot_path are the keys _check compares
    from test_hot_path import SIZES
    _check(dict(zip(SIZES, results.values())), warmup=2, refresh=4)
