"""Tests of the optimizer-side Slim-DP sync (slimcomm.optim.SlimDPOptimizer).

Multi-rank runs use gloo on CPU through ``_dist.run_workers``. The oracle for
the dense mode (DiLoCo) is a single-process simulation of every rank's inner
AdamW steps and the outer Nesterov step; with 2 ranks every average is of two
values, so it agrees bit for bit with the real run.
"""

import copy
import io

import pytest
import torch
import torch.distributed as dist
from torch import nn

from _dist import WorkerError, run_workers
from slimcomm.optim import SlimDPOptimizer

D_IN, D_OUT, BATCH = 10, 4, 8


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(D_IN, 32)
        self.fc2 = nn.Linear(32, D_OUT)
        self.scale = nn.Parameter(torch.tensor(1.0))

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x))) * self.scale


def make_model(seed=0):
    torch.manual_seed(seed)
    return Net()


def batch(rank, step, micro=0):
    g = torch.Generator().manual_seed(10_000 * rank + 10 * step + micro)
    return torch.randn(BATCH, D_IN, generator=g), torch.randint(0, D_OUT, (BATCH,), generator=g)


def make_inner(model, kind="adamw"):
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1)
    return torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)


CFG = dict(sync_every=3, compression="shared", core_ratio=0.1, explore_ratio=0.1,
           value_dtype=torch.float32, seed=3)


def train(rank, steps, cfg, model=None, opt=None, start=0, inner="adamw", micro=1,
          init_seed=None, clip=True):
    model = model if model is not None else make_model(rank if init_seed is None else init_seed)
    if opt is None:
        opt = SlimDPOptimizer(model, make_inner(model, inner), **cfg)
    for t in range(start, start + steps):
        opt.zero_grad()
        for mb in range(micro):
            x, y = batch(rank, t, mb)
            (nn.functional.cross_entropy(model(x), y) / micro).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return model, opt


def params_of(model):
    return [p.detach().clone() for p in model.parameters()]


# ---------------------------------------------------------------------------
# Replicas identical, across modes and world sizes
# ---------------------------------------------------------------------------

def _replicas(rank, world_size, cfg):
    # Each rank starts from its own init: the constructor broadcasts rank 0's.
    model, opt = train(rank, 10, cfg)
    opt.synchronize()
    return params_of(model), opt.stats


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("mode", ["shared", "local", "dense"])
def test_replicas_bit_identical(world_size, mode):
    cfg = {**CFG, "compression": mode}
    if mode == "local":
        cfg["error_decay"] = 0.95
    res = run_workers(_replicas, world_size, cfg)
    for r in range(1, world_size):
        for a, b in zip(res[0][0], res[r][0]):
            assert torch.equal(a, b), f"{mode}: rank {r} differs from rank 0"
    st = res[0][1]
    assert st["syncs"] == 4 and st["local_steps"] == 10  # 3 by sync_every + the final one
    if mode == "dense":
        assert st["total"]["density"] == 1.0
    else:
        assert 0 < st["total"]["density"] < 0.5


# ---------------------------------------------------------------------------
# Dense mode = DiLoCo, against a single-process simulation
# ---------------------------------------------------------------------------

def _dense_case(rank, world_size):
    cfg = dict(sync_every=2, compression="dense", value_dtype=torch.float32, outer_lr=0.7,
               outer_momentum=0.9, nesterov=True, warmup_syncs=0)
    model, _ = train(rank, 6, cfg, init_seed=0)
    return params_of(model)


def inner_steps(models, inners, t):
    """Step ``t`` of every simulated rank's inner optimizer (clipped, as ``train`` does)."""
    for r, (m, o) in enumerate(zip(models, inners)):
        o.zero_grad()
        x, y = batch(r, t)
        nn.functional.cross_entropy(m(x), y).backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        o.step()


def _simulate_diloco(world_size, steps, H, lr, mu):
    models = [make_model(0) for _ in range(world_size)]
    inners = [make_inner(m) for m in models]
    outer = [p.detach().clone() for p in models[0].parameters()]
    mom = [torch.zeros_like(p) for p in outer]
    for t in range(steps):
        inner_steps(models, inners, t)
        if (t + 1) % H == 0:
            with torch.no_grad():
                for i, p0 in enumerate(outer):
                    deltas = [p0 - list(m.parameters())[i] for m in models]
                    avg = sum(d / world_size for d in deltas)
                    mom[i].mul_(mu).add_(avg)
                    p0.sub_(avg.add(mom[i], alpha=mu), alpha=lr)
                    for m in models:
                        list(m.parameters())[i].copy_(p0)
    return [p.detach().clone() for p in models[0].parameters()]


def test_dense_mode_is_diloco():
    res = run_workers(_dense_case, 2)
    sim = _simulate_diloco(2, 6, 2, 0.7, 0.9)
    for a, b in zip(res[0], sim):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)


def _sgd_h1(rank, world_size, mode):
    cfg = dict(sync_every=1, compression=mode, core_ratio=1.0, explore_ratio=0.0,
               value_dtype=torch.float32, warmup_syncs=0)
    model, _ = train(rank, 5, cfg, inner="sgd", init_seed=0, clip=False)
    return params_of(model)


def _sgd_ddp(rank, world_size):
    model = make_model(0)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for t in range(5):
        opt.zero_grad()
        x, y = batch(rank, t)
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    return params_of(model)


def test_full_ratios_with_sgd_h1_equal_data_parallel_sgd():
    # SGD is linear in the gradient, so averaging the local updates = averaging gradients.
    ddp = run_workers(_sgd_ddp, 2)
    for mode in ("shared", "dense"):
        ours = run_workers(_sgd_h1, 2, mode)
        for a, b in zip(ours[0], ddp[0]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------
# Checkpoint / resume, gradient accumulation, layout invariance
# ---------------------------------------------------------------------------

def _save(rank, world_size, cfg, steps):
    model, opt = train(rank, steps, cfg, init_seed=0)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    return buf.getvalue(), params_of(model)


def _resume(rank, world_size, cfg, blobs, start, steps):
    ck = torch.load(io.BytesIO(blobs[rank]), weights_only=False)
    model = make_model(99)  # a different init: everything must come from the checkpoint
    model.load_state_dict(ck["model"])
    opt = SlimDPOptimizer(model, make_inner(model), **cfg)
    opt.load_state_dict(ck["opt"])
    model, opt = train(rank, steps, cfg, model=model, opt=opt, start=start)
    return params_of(model)


def test_checkpoint_resume_bit_exact():
    cfg = {**CFG, "outer_momentum": 0.5, "nesterov": True}
    full = run_workers(_save, 2, cfg, 20)
    # Step 10 is not a sync step (sync_every=3): local parameters differ from the outer ones.
    half = run_workers(_save, 2, cfg, 10)
    resumed = run_workers(_resume, 2, cfg, [half[0][0], half[1][0]], 10, 10)
    for r in range(2):
        for a, b in zip(resumed[r], full[r][1]):
            assert torch.equal(a, b), f"rank {r}: resumed run differs"


def _accum(rank, world_size, micro):
    model, _ = train(rank, 6, CFG, micro=micro, init_seed=0)
    return params_of(model)


def test_gradient_accumulation_runs_and_stays_identical():
    res = run_workers(_accum, 2, 2)
    for a, b in zip(res[0], res[1]):
        assert torch.equal(a, b)
    single = run_workers(_accum, 2, 1)
    assert any(not torch.equal(a, b) for a, b in zip(res[0], single[0]))


def _bucketed(rank, world_size, cap):
    model, opt = train(rank, 9, {**CFG, "bucket_cap_mb": cap}, init_seed=0)
    return params_of(model), len(opt._groups)


def test_layout_invariance_across_group_sizes():
    one = run_workers(_bucketed, 2, 25.0)
    many = run_workers(_bucketed, 2, 0.0005)
    assert one[0][1] == 1 and many[0][1] > 2
    for a, b in zip(one[0][0], many[0][0]):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------
# Non-finite gradients on one rank, GradScaler
# ---------------------------------------------------------------------------

def _nonfinite(rank, world_size):
    model = make_model(0)
    inner = make_inner(model)
    opt = SlimDPOptimizer(model, inner, **{**CFG, "sync_every": 2})
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    skipped = 0
    for t in range(8):
        opt.zero_grad()
        x, y = batch(rank, t)
        if rank == 1 and t == 3:
            x = x * float("inf")
        scaler.scale(nn.functional.cross_entropy(model(x), y)).backward()
        scale_before = scaler.get_scale()
        scaler.step(opt.inner)
        scaler.update()
        skipped += scaler.get_scale() < scale_before
        opt.advance()
    opt.synchronize()
    return params_of(model), skipped


def test_inf_on_one_rank_with_grad_scaler():
    res = run_workers(_nonfinite, 2)
    assert res[1][1] == 1 and res[0][1] == 0
    for a, b in zip(res[0][0], res[1][0]):
        assert torch.equal(a, b)
        assert torch.isfinite(a).all()


# ---------------------------------------------------------------------------
# Bad arguments
# ---------------------------------------------------------------------------

def _bad(rank, world_size, kw):
    model = make_model(0)
    SlimDPOptimizer(model, make_inner(model), **(kw if rank == 0 else {}))


@pytest.mark.parametrize("kw,msg", [
    (dict(sync_every=0), "sync_every"),
    (dict(compression="zip"), "compression"),
    (dict(outer_lr=float("nan")), "outer_lr"),
    (dict(outer_momentum=1.0), "outer_momentum"),
    (dict(core_ratio=0.0), "core_ratio"),
    (dict(error_decay=1.5), "error_decay"),
])
def test_bad_argument_on_one_rank_raises_everywhere(kw, msg):
    with pytest.raises(WorkerError, match=msg):
        run_workers(_bad, 2, kw, timeout=180)


def _foreign_inner(rank, world_size):
    model = make_model(0)
    SlimDPOptimizer(model, torch.optim.AdamW(Net().parameters()))


def test_inner_over_other_parameters_refused():
    with pytest.raises(WorkerError, match="inner must optimize exactly"):
        run_workers(_foreign_inner, 2, timeout=180)


def _mismatch(rank, world_size):
    model = make_model(0)
    SlimDPOptimizer(model, make_inner(model), sync_every=2 + rank)


def test_different_hyperparameters_across_ranks_refused():
    with pytest.raises(WorkerError, match="different hyperparameters"):
        run_workers(_mismatch, 2, timeout=180)


# ---------------------------------------------------------------------------
# Low-bit values
# ---------------------------------------------------------------------------

def _quant_case(rank, world_size, mode, bits, collective):
    cfg = dict(CFG, compression=mode, value_bits=bits, quant_chunk=64, outer_lr=2.0,
               lowbit_collective=collective)
    model, opt = train(rank, 9, cfg)
    return params_of(model), opt.stats


@pytest.mark.parametrize("mode,bits,world_size,collective", [
    ("dense", 2, 2, "all_reduce"), ("dense", 1, 3, "all_reduce"), ("dense", 2, 2, "all_gather"),
    ("dense", 1, 3, "all_gather"), ("shared", 4, 2, "all_reduce")])
def test_low_bit_values_replicas_identical_and_bytes(mode, bits, world_size, collective):
    res = run_workers(_quant_case, world_size, mode, bits, collective)
    for r in range(1, world_size):
        for a, b in zip(res[0][0], res[r][0]):
            assert torch.equal(a, b)
            assert torch.isfinite(a).all()
    st = res[0][1]["total"]
    # codes + bf16 scales per 64 values + 4-byte flags, against fp32 dense (the per-sync
    # agreement all-reduce, 80 bytes, is counted apart in check_bytes: this model is tiny);
    # the two-stage all-reduce pads each rank's shard (at most one chunk + 4-byte alignment)
    pad = 3 * world_size * 24 if (mode, collective) == ("dense", "all_reduce") else 0
    assert st["bytes_sent"] - st["check_bytes"] < \
        st["bytes_dense"] * (bits / 32 + 2 / 64 / 4 + 0.02) + pad


# ---------------------------------------------------------------------------
# Low-bit codes at the shared index set: the cross-rank agreement check runs there too
# ---------------------------------------------------------------------------

def _diverged_codes(rank, world_size):
    """Rank 1's G of one parameter permuted between a save and a load (a divergence
    slimcomm cannot prevent): its index set differs, and each rank would decode the others'
    all-gathered codes at its own index set. The agreement check must turn it into an error."""
    cfg = {**CFG, "value_bits": 2, "core_refresh": 1, "check_agreement_every": 1}
    model, opt = train(rank, 6, cfg, init_seed=0)
    sd = copy.deepcopy(opt.state_dict())
    if rank == 1:   # the largest parameter's G
        p0 = max(sd["compressor"]["params"].values(), key=lambda e: e["numel"])
        p0["G"] = p0["G"].flip(0)
    opt2 = SlimDPOptimizer(model, make_inner(model), **cfg)
    opt2.load_state_dict(sd)
    train(rank, 6, cfg, model=model, opt=opt2, start=6)


def test_diverged_index_sets_of_low_bit_codes_raise():
    with pytest.raises(WorkerError, match=r"index sets or G differ across ranks"):
        run_workers(_diverged_codes, 2, timeout=90)
