"""Issue 26, item 1: SlimDPOptimizer on FSDP2 / HSDP, on 4 gloo ranks as a 2 x 2
(replicate, shard) mesh: ranks {0, 1} and {2, 3} are the replica groups (plain FSDP
inside, over mesh["shard"]), {0, 2} and {1, 3} the replicate groups the optimizer
synchronises over (process_group=mesh["replicate"]).

The model has odd sizes: its 13-row layers split 7 + 6 over the two shards, and the
last layer (1 output) leaves shard 1 with *empty* local tensors.
"""

import os
import sys

import torch
import torch.distributed as dist
from torch import nn

from _dist import run_workers

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))

D_IN, HID, BATCH = 8, 13, 6


def _mesh(shape=(2, 2)):
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D_IN, HID), nn.Tanh(), nn.Linear(HID, HID), nn.Tanh(),
                         nn.Linear(HID, 1))


def _shard(model, mesh):
    from torch.distributed.fsdp import fully_shard
    for m in model:
        if isinstance(m, nn.Linear):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _batch(rank, t):
    g = torch.Generator().manual_seed(1000 * rank + t)
    x = torch.randn(BATCH, D_IN, generator=g)
    return x, x[:, :2].sum(1, keepdim=True).sin()


def _train(model, opt, rank, start, stop):
    losses = []
    for t in range(start, stop):
        x, y = _batch(rank, t)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def _local(model):
    return [p.to_local().detach().clone() for p in model.parameters()]


def _slim(mesh, inner_cls=torch.optim.AdamW, inner_kw=None, **kw):
    from slimcomm.optim import SlimDPOptimizer
    model = _shard(_model(), mesh["shard"])
    inner = inner_cls(model.parameters(), **(inner_kw or dict(lr=1e-2)))
    return model, SlimDPOptimizer(model, inner, process_group=mesh["replicate"], **kw)


# ---------------------------------------------------------------------------
# everything sent, H = 1: plain HSDP
# ---------------------------------------------------------------------------

# Why this equality is exact up to rounding: with H = 1, outer_lr 1 and no outer
# momentum, each synchronisation sets the parameters to outer - mean_r(outer - local_r)
# = mean_r(local_r), the average over the replica groups of one inner step from the same
# point. Inner SGD (momentum, weight decay) is linear in the gradient, and its momentum
# buffer is a linear function of the past gradients, so mean_r of the updates = the update
# of the mean gradient = what HSDP does with its all-reduced gradient (FSDP averages over
# the shard group inside each replica group in both). AdamW is not linear (the mean of
# normalised updates is not the normalised mean update), so it is not tested for equality.
EVERYTHING = {
    "shared core_ratio=1": dict(compression="shared", core_ratio=1.0, explore_ratio=0.0),
    "dense": dict(compression="dense"),
}
SGD = dict(lr=0.1, momentum=0.9, weight_decay=0.01)


def _everything_case(rank, world_size, steps):
    mesh = _mesh()
    out = {}
    for name, kw in EVERYTHING.items():
        model, opt = _slim(mesh, torch.optim.SGD, SGD, sync_every=1,
                           value_dtype=torch.float32, **kw)
        out[name] = dict(loss=_train(model, opt, rank, 0, steps),
                         full=[p.full_tensor() for p in model.parameters()],
                         stats=opt.stats)
    hsdp = _shard(_model(), mesh)  # the 2-D mesh: FSDP's own HSDP
    sgd = torch.optim.SGD(hsdp.parameters(), **SGD)
    out["hsdp"] = dict(loss=_train(hsdp, sgd, rank, 0, steps),
                       full=[p.full_tensor() for p in hsdp.parameters()])
    return out


def test_everything_sent_with_h1_equals_plain_hsdp():
    res = run_workers(_everything_case, 4, 6, timeout=300)
    for r in res:
        for name in EVERYTHING:
            assert r[name]["stats"]["syncs"] == 6
            assert r[name]["stats"]["total"]["density"] == 1.0
            for a, b in zip(r[name]["full"], r["hsdp"]["full"]):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(torch.tensor(r[name]["loss"]),
                                       torch.tensor(r["hsdp"]["loss"]), rtol=1e-5, atol=1e-6)
    moved = [(a - b).abs().max() for a, b in zip(res[0]["hsdp"]["full"], _model().parameters())]
    assert min(moved) > 1e-3, moved  # not vacuous: every parameter trained


# ---------------------------------------------------------------------------
# compressed: replicas identical across the replicate dimension
# ---------------------------------------------------------------------------

COMPRESSED = {
    "shared sparse": dict(compression="shared", core_ratio=0.2, explore_ratio=0.1,
                          core_refresh=2, warmup_syncs=1),
    "local sparse": dict(compression="local", core_ratio=0.2, explore_ratio=0.1,
                         error_decay=0.95),
    "dense 2-bit (default collective)": dict(compression="dense", value_bits=2, quant_chunk=16,
                                             outer_momentum=0.5, nesterov=True),
    # groups of ~26 fp32 values: the layout of groups differs between the shard positions
    "shared sparse, tiny buckets": dict(compression="shared", core_ratio=0.2,
                                        explore_ratio=0.1, bucket_cap_mb=1e-4),
}


def _compressed_case(rank, world_size, syncs, H):
    mesh = _mesh()
    out = {}
    for name, kw in COMPRESSED.items():
        model, opt = _slim(mesh, sync_every=H, **kw)
        loss = _train(model, opt, rank, 0, syncs * H - 1)
        before = _local(model)  # one step before a synchronisation: replicas apart
        loss += _train(model, opt, rank, syncs * H - 1, syncs * H)
        with torch.no_grad(), opt.outer_weights() as m:
            outer = _local(m)
        out[name] = dict(before=before, after=_local(model), outer=outer, loss=loss,
                         stats=opt.stats, groups=[g.outer.numel() for g in opt._groups],
                         numel=[p.to_local().numel() for p in model.parameters()])
    return out


def test_compressed_replicas_identical_across_the_replicate_dimension():
    syncs, H = 4, 3
    res = run_workers(_compressed_case, 4, syncs, H, timeout=300)
    assert res[1]["shared sparse"]["numel"][-1] == 0  # shard 1 of the 1-row bias: empty
    # several groups, cut by the local shard sizes: the two shard positions' replicate
    # groups run different collectives, replicate peers the same
    tiny = [res[r]["shared sparse, tiny buckets"]["groups"] for r in range(4)]
    assert len(tiny[1]) > 1 and tiny[0] != tiny[1] and tiny[0] == tiny[2] and \
        tiny[1] == tiny[3], tiny
    for name in COMPRESSED:
        for r in res:
            st = r[name]["stats"]
            assert st["syncs"] == syncs and st["local_steps"] == syncs * H
            if name.startswith("dense"):
                assert st["last"]["bytes_sent"] < st["last"]["bytes_dense"] / 3, st["last"]
            else:
                assert st["last"]["density"] < 0.6, (name, st["last"])
            for a, b in zip(r[name]["after"], r[name]["outer"]):  # just synchronised
                assert torch.equal(a, b), name
        for peer_a, peer_b in ((0, 2), (1, 3)):
            a, b = res[peer_a][name], res[peer_b][name]
            for x, y in zip(a["after"], b["after"]):
                assert torch.equal(x, y), (name, peer_a, peer_b)
            # not vacuous: between synchronisations the replica groups had drifted apart
            assert any(not torch.equal(x, y) for x, y in zip(a["before"], b["before"])), name
        # shard peers inside a replica group hold different chunks of one model
        assert res[0][name]["after"][0].shape != res[1][name]["after"][0].shape
        first, last = res[0][name]["loss"][:H], res[0][name]["loss"][-H:]
        assert sum(last) < sum(first), (name, res[0][name]["loss"])


# ---------------------------------------------------------------------------
# checkpoint with torch.distributed.checkpoint at step 10, resume = uninterrupted
# ---------------------------------------------------------------------------

RESUME_KW = dict(compression="shared", core_ratio=0.2, explore_ratio=0.1, core_refresh=2,
                 sync_every=3, outer_momentum=0.6, nesterov=True, value_bits=4, quant_chunk=16)


def _resume_case(rank, world_size, path, steps, cut):
    import torch.distributed.checkpoint as dcp
    mesh = _mesh()
    model, opt = _slim(mesh, **RESUME_KW)
    _train(model, opt, rank, 0, steps)
    straight = _local(model)
    straight_stats = opt.stats

    model, opt = _slim(mesh, **RESUME_KW)
    _train(model, opt, rank, 0, cut)  # cut is not a multiple of sync_every: mid-interval
    dcp.save({"optim": opt.state_dict()}, checkpoint_id=path)
    del model, opt

    torch.manual_seed(123 + rank)  # a fresh model with other weights: restored by the load
    model, opt = _slim(mesh, **RESUME_KW)
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().normal_()
    dcp.load({"optim": opt}, checkpoint_id=path)  # Stateful: DCP calls load_state_dict
    assert opt.local_step == cut
    _train(model, opt, rank, cut, steps)
    resumed = _local(model)
    try:  # another rank's entry (e.g. its torch.save file) is refused
        sd = opt.state_dict()
        opt.load_state_dict(dict(sd, per_rank={f"rank{(rank + 1) % 4}": sd["per_rank"][
            f"rank{rank}"]}))
        other = None
    except ValueError as exc:
        other = str(exc)

    # the same checkpoint on another mesh (4 replica groups of 1 shard): a clear refusal
    mesh41 = _mesh((4, 1))
    model41, opt41 = _slim(mesh41, **RESUME_KW)
    sd = {"optim": opt41.state_dict()}
    dcp.load(sd, checkpoint_id=path)
    try:
        opt41.load_state_dict(sd["optim"])
        refused = None
    except ValueError as exc:
        refused = str(exc)
    return dict(straight=straight, resumed=resumed, refused=refused, other=other,
                stats=(straight_stats, opt.stats))


def test_dcp_checkpoint_at_step_10_resumes_like_an_uninterrupted_run(tmp_path):
    res = run_workers(_resume_case, 4, str(tmp_path / "ckpt"), 16, 10, timeout=300)
    for r in res:
        for a, b in zip(r["straight"], r["resumed"]):
            assert torch.equal(a, b)
        straight, resumed = r["stats"]
        assert straight["syncs"] == resumed["syncs"] == 5
        assert straight["total"]["bytes_sent"] == resumed["total"]["bytes_sent"]
        assert r["other"] and "holds no entry 'rank" in r["other"], r["other"]
        assert r["refused"] and "shard_size=2" in r["refused"] and \
            "shard_size=1" in r["refused"] and "another mesh" in r["refused"], r["refused"]


def _delayed_case(rank, world_size, path, steps, cut):
    """delay_syncs=1 on FSDP2 shards: straight run, and a DCP checkpoint at ``cut`` (a
    synchronisation in flight) resumed; both drained with synchronize() at the end."""
    import torch.distributed.checkpoint as dcp
    mesh, kw = _mesh(), dict(RESUME_KW, delay_syncs=1)
    model, opt = _slim(mesh, **kw)
    _train(model, opt, rank, 0, steps)
    apart = _local(model)
    opt.synchronize()
    straight = _local(model)

    model, opt = _slim(mesh, **kw)
    _train(model, opt, rank, 0, cut)
    dcp.save({"optim": opt.state_dict()}, checkpoint_id=path)
    del model, opt
    torch.manual_seed(321 + rank)
    model, opt = _slim(mesh, **kw)
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().normal_()
    dcp.load({"optim": opt}, checkpoint_id=path)
    _train(model, opt, rank, cut, steps)
    opt.synchronize()
    return dict(apart=apart, straight=straight, resumed=_local(model))


def test_delayed_sync_on_shards_drains_to_identical_replicas_and_resumes_bit_exactly(tmp_path):
    res = run_workers(_delayed_case, 4, str(tmp_path / "ckpt"), 16, 10, timeout=300)
    for r in res:
        for a, b in zip(r["straight"], r["resumed"]):
            assert torch.equal(a, b)
    for peer_a, peer_b in ((0, 2), (1, 3)):
        a, b = res[peer_a], res[peer_b]
        assert all(torch.equal(x, y) for x, y in zip(a["straight"], b["straight"]))
        # not vacuous: before the drain each replica group held its own last period
        assert any(not torch.equal(x, y) for x, y in zip(a["apart"], b["apart"]))


# ---------------------------------------------------------------------------
# bad input: clear errors naming the argument
# ---------------------------------------------------------------------------

def _bad_case(rank, world_size):
    from torch.distributed.fsdp import fully_shard
    from slimcomm.optim import SlimDPOptimizer
    mesh = _mesh()
    out = {}

    def attempt(name, model, process_group):
        inner = torch.optim.AdamW(model.parameters())
        try:
            SlimDPOptimizer(model, inner, process_group=process_group)
            out[name] = None
        except ValueError as exc:
            out[name] = str(exc)

    attempt("hsdp 2-D mesh", _shard(_model(), mesh), mesh["replicate"])
    attempt("world as process_group", _shard(_model(), mesh["shard"]), None)
    attempt("shard dim as process_group", _shard(_model(), mesh["shard"]), mesh["shard"])
    mixed = _model()
    fully_shard(mixed[0], mesh=mesh["shard"])
    fully_shard(mixed, mesh=mesh["replicate"])  # the rest over the other dimension
    attempt("two meshes", mixed, mesh["replicate"])
    part = _model()
    fully_shard(part[0], mesh=mesh["shard"])  # root not sharded: plain parameters
    attempt("dtensor and plain", part, mesh["replicate"])
    attempt("2-D mesh as process_group", _shard(_model(), mesh["shard"]), mesh)
    # replica peers at different shard positions (rank 0 holds shard 0, rank 3 shard 1):
    # each group meets the shard group in this rank only, so only the comparison of the
    # ranks' configurations (shard position, local shapes) can tell
    crossed = [dist.new_group([0, 3]), dist.new_group([1, 2])]
    model = _shard(_model(), mesh["shard"])
    try:
        SlimDPOptimizer(model, torch.optim.AdamW(model.parameters()),
                        process_group=crossed[rank in (1, 2)])
        out["crossed"] = None
    except RuntimeError as exc:
        out["crossed"] = str(exc)
    # a frozen sharded parameter: its local shard broadcast from the replicate group's rank 0
    frozen = _model()
    frozen[0].bias.requires_grad_(False)
    frozen = _shard(frozen, mesh["shard"])
    with torch.no_grad():
        frozen[0].bias.to_local().fill_(float(rank))
    SlimDPOptimizer(frozen, torch.optim.AdamW(p for p in frozen.parameters() if p.requires_grad),
                    process_group=mesh["replicate"])
    out["frozen"] = frozen[0].bias.to_local().clone()
    return out


def test_bad_meshes_and_groups_are_refused_naming_the_argument():
    res = run_workers(_bad_case, 4, timeout=240)
    for r in res:
        assert "2-D mesh" in r["hsdp 2-D mesh"] and "mesh['shard']" in r["hsdp 2-D mesh"]
        for name in ("world as process_group", "shard dim as process_group"):
            assert r[name] and r[name].startswith("process_group:"), (name, r[name])
        assert r["two meshes"] and r["two meshes"].startswith("model:") and \
            "one 1-D shard mesh" in r["two meshes"], r["two meshes"]
        assert r["dtensor and plain"] and "plain tensors" in r["dtensor and plain"]
        assert r["2-D mesh as process_group"] and \
            r["2-D mesh as process_group"].startswith("process_group"), \
            r["2-D mesh as process_group"]
        assert r["crossed"] and "process_group must join the ranks that hold the same " \
            "shard" in r["crossed"], r["crossed"]
    for rank, r in enumerate(res):  # replicate groups {0, 2} and {1, 3}: from ranks 0 and 1
        assert r["frozen"].numel() > 0 and torch.all(r["frozen"] == float(rank % 2)), r["frozen"]


# ---------------------------------------------------------------------------
# memory: the optimizer's state per rank falls with the shard count
# ---------------------------------------------------------------------------

def _memory_case(rank, world_size):
    from fsdp_optim_memory import state_bytes
    out = {}
    for S in (1, 2):
        mesh = _mesh((world_size // S, S))
        model, opt = _slim(mesh, sync_every=2, compression="shared", core_ratio=0.2,
                           explore_ratio=0.1, outer_momentum=0.9)
        _train(model, opt, rank, 0, 4)
        out[S] = state_bytes(opt)
    return out


def test_optimizer_state_per_rank_falls_with_the_shard_count():
    res = run_workers(_memory_case, 4, timeout=240)
    for r in res:
        assert r[2]["total"] < 0.7 * r[1]["total"], r
        for key in ("outer", "compressor", "inner"):
            assert r[2][key] < 0.7 * r[1][key], (key, r)


# ---------------------------------------------------------------------------
# hot path: the synchronisation of FSDP2 shards dispatches the same ops as of tensors
# ---------------------------------------------------------------------------

def _sync_ops(rank, world_size, fsdp, nparams=10, steps=6):
    from slimcomm import compressor
    from slimcomm._opcount import OpCounter, synchronous_collectives
    from slimcomm.optim import SlimDPOptimizer
    from test_hot_path import make_model
    model = make_model(nparams)
    group = None
    if fsdp:  # S = 1: the local shards are the whole tensors, so the ops must match
        mesh = _mesh((world_size, 1))
        model = _shard(model, mesh["shard"])
        group = mesh["replicate"]
    inner = torch.optim.SGD(model.parameters(), lr=0.01)
    opt = SlimDPOptimizer(model, inner, sync_every=1, core_ratio=0.2, explore_ratio=0.1,
                          core_refresh=3, outer_momentum=0.9, process_group=group)
    counter, rows, real_sync = OpCounter(), [], opt._synchronize   # advance() calls it

    def counted(final):
        with counter:
            real_sync(final)

    opt._synchronize = counted
    g = torch.Generator().manual_seed(rank)
    with synchronous_collectives(compressor):
        for _ in range(steps):
            counter.reset()
            inner.zero_grad()
            model(torch.randn(4, 6, generator=g)).square().sum().backward()
            opt.step()
            rows.append((counter.host_syncs, dict(counter.ops)))
    return rows


def test_sync_of_fsdp_shards_dispatches_the_same_ops_as_plain_tensors():
    plain = run_workers(_sync_ops, 2, False, timeout=200)[0]
    fsdp = run_workers(_sync_ops, 2, True, timeout=200)[0]
    assert all(syncs == 0 and ops for syncs, ops in fsdp), fsdp
    assert fsdp == plain


# ---------------------------------------------------------------------------
# a non-finite step in one replica group: its inner state (keyed by the DTensors) is reset
# ---------------------------------------------------------------------------

def _nonfinite_case(rank, world_size, H, bad_step, steps):
    import warnings
    mesh = _mesh()
    model, opt = _slim(mesh, sync_every=H, compression="shared", core_ratio=0.3,
                       explore_ratio=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for t in range(steps):
            x, y = _batch(rank, t)
            if t == bad_step and rank >= 2:  # replica group {2, 3}: FSDP averages the inf in
                x = x * float("inf")
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    return dict(local=_local(model), stats=opt.stats,
                warned=[str(w.message) for w in caught if "non-finite" in str(w.message)])


def test_nonfinite_step_in_one_replica_group_resets_its_inner_state_and_training_goes_on():
    res = run_workers(_nonfinite_case, 4, 3, 4, 12, timeout=240)
    for rank, r in enumerate(res):
        assert all(torch.isfinite(t).all() for t in r["local"]), rank
        # once (the reset took: the DTensor-keyed AdamW moments were dropped, or every
        # later synchronisation would be non-finite again)
        assert r["stats"]["nonfinite_syncs"] == (1 if rank >= 2 else 0), (rank, r["stats"])
        assert bool(r["warned"]) == (rank >= 2), r["warned"]
    for peer_a, peer_b in ((0, 2), (1, 3)):
        for x, y in zip(res[peer_a]["local"], res[peer_b]["local"]):
            assert torch.equal(x, y)


# ---------------------------------------------------------------------------
# GradScaler: scaler.step(opt) unscales the local gradient shards
# ---------------------------------------------------------------------------

def _scaler_case(rank, world_size, steps, bad_step):
    mesh = _mesh()
    model, opt = _slim(mesh, sync_every=2)
    _train(model, opt, rank, 0, steps)
    plain = _local(model)
    out = {}
    for bad in (None, bad_step):
        model, opt = _slim(mesh, sync_every=2)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=1000)
        for t in range(steps):
            x, y = _batch(rank, t)
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            if t == bad and rank >= 2:  # replica group {2, 3}: an overflow the scaler skips
                loss = loss * float("inf")
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        out[bad] = dict(local=_local(model), stats=opt.stats)
    return dict(plain=plain, scaled=out)


def test_grad_scaler_unscales_the_shards_and_skips_an_overflow():
    res = run_workers(_scaler_case, 4, 6, 3, timeout=240)
    for r in res:
        # a power-of-two scale: unscaled gradient shards are exact, the run is the same
        for a, b in zip(r["plain"], r["scaled"][None]["local"]):
            assert torch.equal(a, b)
        st = r["scaled"][3]["stats"]
        assert st["local_steps"] == 6 and st["syncs"] == 3 and st["nonfinite_syncs"] == 0, st
        assert all(torch.isfinite(t).all() for t in r["scaled"][3]["local"])
    for peer_a, peer_b in ((0, 2), (1, 3)):
        for x, y in zip(res[peer_a]["scaled"][3]["local"], res[peer_b]["scaled"][3]["local"]):
            assert torch.equal(x, y)
    # the skipped step changed the run of replica group {2, 3}, hence everyone's
    assert any(not torch.equal(x, y) for x, y in zip(res[0]["scaled"][None]["local"],
                                                     res[0]["scaled"][3]["local"]))
