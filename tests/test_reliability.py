"""Reliability cases of issue 13: silent divergence and lost updates found by
driving the Slim-DP hook (and the optimizer-side sync, the IST trainer) the way
users do. Every multi-rank scenario runs in ONE 2-rank gloo spawn (module
fixture); each test then checks its own scenario's result.

1. DDP ``join()`` with uneven inputs: replicas identical afterwards.
2. fp16 wire + GradScaler: the loss scale stays healthy, training converges,
   a skipped step loses no parameter's residual.
3. Another rank's state_dict (hook, SlimDPOptimizer, ISTTrainer mid-round):
   refused on every rank.
4. A parameter unused on every rank keeps its residual.
5. channels_last parameters: results equal the contiguous run.
7./8. Frozen hyperparameters, strict types, validated state_dict entries.
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from _dist import run_workers
from slimcomm import ist
from slimcomm.hooks import SlimDPState, slim_dp_hook
from slimcomm.optim import SlimDPOptimizer

D_IN, D_OUT, BATCH = 16, 5, 16


def _mlp(seed=0, hidden=64):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(D_IN, hidden), nn.ReLU(), nn.Linear(hidden, hidden),
                         nn.ReLU(), nn.Linear(hidden, D_OUT))


def _batch(rank, t):
    g = torch.Generator().manual_seed(1000 * rank + t)
    x = torch.randn(BATCH, D_IN, generator=g)
    return x, (x[:, :D_OUT] * 3).argmax(1)


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


CFG = dict(core_ratio=0.05, explore_ratio=0.05, core_refresh=3, warmup_steps=2, seed=11,
           min_compress_numel=0)  # the small test tensors compressed too


# ---------------------------------------------------------------------------
# 1. join with uneven inputs
# ---------------------------------------------------------------------------

def _join_case(rank, hook):
    model = _mlp()
    ddp = DDP(model, bucket_cap_mb=0.01)
    state = None
    if hook:
        state = SlimDPState(**CFG, model=ddp)
        ddp.register_comm_hook(state, slim_dp_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # no momentum: plain DDP gives 0
    n = 12 if rank == 0 else 21  # rank 0 joins early, across several core refreshes
    with ddp.join():
        for t in range(n):
            opt.zero_grad()
            x, y = _batch(rank, t)
            nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
    after_join = _params(model)
    for t in range(30, 40):  # training on together afterwards
        opt.zero_grad()
        x, y = _batch(rank, t)
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    return dict(after_join=after_join, end=_params(model),
                stats=state.stats if state else None)


# ---------------------------------------------------------------------------
# 2. fp16 wire + GradScaler
# ---------------------------------------------------------------------------

def _fp16_scaler_case(rank, attach, steps=300, wire=torch.float16):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D_IN, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                          nn.Linear(128, D_OUT))
    ddp = DDP(model)
    # warm-up 2 (the default until issue 31): the 1.25x tolerance below was set with it
    state = SlimDPState(core_ratio=0.01, explore_ratio=0.01, value_dtype=wire, warmup_steps=2,
                        min_compress_numel=0, model=ddp)
    scaler = torch.amp.GradScaler("cpu")
    if attach:
        state.attach_grad_scaler(scaler)
    ddp.register_comm_hook(state, slim_dp_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.2)  # stable at 1% density on bf16 too
    losses = []
    for t in range(steps):
        opt.zero_grad()
        x, y = _batch(rank, t)
        loss = nn.functional.cross_entropy(ddp(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(float(loss.detach()))
    return dict(scale=float(scaler.get_scale()), first=sum(losses[:20]) / 20,
                last=sum(losses[-20:]) / 20, params=_params(model), stats=state.stats)


def _skipped_step_case(rank):
    """GradScaler skips a step in which one rank's gradient of one parameter is inf:
    no parameter may lose its already-sent residual (and G must not change)."""
    model = _mlp()
    ddp = DDP(model, bucket_cap_mb=25)  # one bucket: the inf and the rest commit together
    state = SlimDPState(**CFG, model=ddp)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    state.attach_grad_scaler(scaler)
    ddp.register_comm_hook(state, slim_dp_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = after = None
    for t in range(8):
        opt.zero_grad()
        x, y = _batch(rank, t)
        handle = None
        if t == 6:
            before = state.state_dict()
            if rank == 1:
                handle = model[2].weight.register_hook(lambda g: g.index_fill(0, torch.tensor([0]),
                                                                              float("inf")))
        loss = nn.functional.cross_entropy(ddp(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        if t == 6:
            after = state.state_dict()
            if handle is not None:
                handle.remove()
    return dict(before=before, after=after, params=_params(model), stats=state.stats)


# ---------------------------------------------------------------------------
# 3. another rank's state
# ---------------------------------------------------------------------------

def _exchange(obj, world_size):
    out = [None] * world_size
    dist.all_gather_object(out, obj)
    return out


def _hook_train(rank, steps, state, start=0):
    model = _mlp()
    ddp = DDP(model)
    state.attach(ddp)
    ddp.register_comm_hook(state, slim_dp_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for t in range(start, start + steps):
        opt.zero_grad()
        x, y = _batch(rank, t)
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    return state


def _try(fn):
    try:
        fn()
    except (RuntimeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def _ownership_case(rank, world_size):
    out = {}
    sds = _exchange(_hook_train(rank, 6, SlimDPState(**CFG)).state_dict(), world_size)

    def load_and_train(sd):
        st = SlimDPState(**CFG)
        st.load_state_dict(sd)
        _hook_train(rank, 2, st, start=6)

    out["hook_own"] = _try(lambda: load_and_train(sds[rank]))
    out["hook_rank1_everywhere"] = _try(lambda: load_and_train(sds[1]))
    out["hook_swapped"] = _try(lambda: load_and_train(sds[1 - rank]))
    # Hyperparameters stay frozen on a live state (item 7).
    live = _hook_train(rank, 3, SlimDPState(**CFG))
    out["live_assign"] = None
    try:
        live.core_ratio = 0.5
    except AttributeError as e:
        out["live_assign"] = str(e)

    # SlimDPOptimizer: its state (compressor residuals, local parameters) is per rank.
    def make_opt():
        m = _mlp()
        return m, SlimDPOptimizer(m, torch.optim.AdamW(m.parameters(), lr=1e-2), sync_every=2,
                                  core_ratio=0.1, explore_ratio=0.1, value_dtype=torch.float32)

    m, opt = make_opt()
    for t in range(5):
        opt.zero_grad()
        x, y = _batch(rank, t)
        nn.functional.cross_entropy(m(x), y).backward()
        opt.step()
    out["optim_assign"] = None
    try:
        opt.outer_lr = 0.5
    except AttributeError as e:
        out["optim_assign"] = str(e)
    out["optim_bad_type"] = _try(lambda: SlimDPOptimizer(
        m, torch.optim.SGD(m.parameters(), lr=0.1), error_feedback="no"))
    osds = _exchange(opt.state_dict(), world_size)
    out["optim_own"] = _try(lambda: make_opt()[1].load_state_dict(osds[rank]))
    out["optim_rank1_everywhere"] = _try(lambda: make_opt()[1].load_state_dict(osds[1]))
    out["optim_swapped"] = _try(lambda: make_opt()[1].load_state_dict(osds[1 - rank]))

    # ISTTrainer mid-round: the state holds this rank's subnet and optimizer.
    def make_ist():
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(D_IN, 8), nn.ReLU(), nn.Linear(8, D_OUT))
        return ist.ISTTrainer(net, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
                              local_steps=4, seed=3)

    tr = make_ist()
    for t in range(2):
        tr.step(*_batch(rank, t), nn.functional.cross_entropy)
    isds = _exchange(tr.state_dict(), world_size)
    out["ist_own"] = _try(lambda: make_ist().load_state_dict(isds[rank]))
    out["ist_rank1_everywhere"] = _try(lambda: make_ist().load_state_dict(isds[1]))
    return out


# ---------------------------------------------------------------------------
# 4. a parameter unused on every rank
# ---------------------------------------------------------------------------

class _Sometimes(nn.Module):
    """``extra`` is used on even steps only; ``mode="skip"`` leaves it out of the graph on
    odd steps (unused on every rank), ``mode="zero"`` uses it times 0 (exact zero grads)."""

    def __init__(self, mode):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(D_IN, D_OUT)
        self.extra = nn.Linear(D_IN, D_OUT)
        self.mode = mode
        self.t = 0

    def forward(self, x):
        out = self.body(x)
        if self.t % 2 == 0:
            return out + self.extra(x)
        return out + 0.0 * self.extra(x) if self.mode == "zero" else out


def _unused_run(rank, mode, as_view, set_to_none):
    model = _Sometimes(mode)
    ddp = DDP(model, find_unused_parameters=True, gradient_as_bucket_view=as_view)
    state = SlimDPState(**{**CFG, "core_ratio": 0.1, "explore_ratio": 0.1}, model=ddp)
    ddp.register_comm_hook(state, slim_dp_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for t in range(12):
        model.t = t
        opt.zero_grad(set_to_none=set_to_none)
        x, y = _batch(rank, t)
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    return _params(model)


def _unused_case(rank):
    out = {}
    for as_view in (False, True):
        for set_to_none in (False, True):
            out[(as_view, set_to_none)] = {m: _unused_run(rank, m, as_view, set_to_none)
                                           for m in ("skip", "zero")}
    return out


# ---------------------------------------------------------------------------
# 5. channels_last parameters
# ---------------------------------------------------------------------------

class _Conv(nn.Module):
    def __init__(self, channels_last):
        super().__init__()
        torch.manual_seed(0)
        w = torch.randn(6, 4, 3, 3) * 0.2
        self.w = nn.Parameter(w.to(memory_format=torch.channels_last) if channels_last else w)
        self.b = nn.Parameter(torch.zeros(6))
        self.head = nn.Linear(6, D_OUT)

    def forward(self, x):
        x = x.repeat(1, 3)[:, :36]  # [B, 36] = 4 * 3 * 3
        return self.head(torch.tanh(x @ self.w.reshape(6, 36).t() + self.b))


def _channels_last_case(rank):
    out = {}
    for mode in ("shared", "local"):
        for cl in (False, True):
            model = _Conv(cl)
            assert model.w.is_contiguous() != cl
            ddp = DDP(model)
            state = SlimDPState(core_ratio=0.1, explore_ratio=0.0, score="weight",
                                index_mode=mode, core_refresh=2, min_compress_numel=0,
                                model=ddp)
            ddp.register_comm_hook(state, slim_dp_hook)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for t in range(8):
                opt.zero_grad()
                x, y = _batch(rank, t)
                nn.functional.cross_entropy(ddp(x), y).backward()
                opt.step()
            out[(mode, cl)] = _params(model)
    return out


# ---------------------------------------------------------------------------
# The spawn
# ---------------------------------------------------------------------------

def _cases(rank, world_size):
    return {
        "join": _join_case(rank, True),
        "join_plain_ddp": _join_case(rank, False),
        "fp16": _fp16_scaler_case(rank, attach=False),
        "fp16_attached": _fp16_scaler_case(rank, attach=True),
        "bf16_reference": _fp16_scaler_case(rank, attach=True, wire=torch.bfloat16),
        "skipped": _skipped_step_case(rank),
        "ownership": _ownership_case(rank, world_size),
        "unused": _unused_case(rank),
        "channels_last": _channels_last_case(rank),
    }


@pytest.fixture(scope="module")
def two():
    return run_workers(_cases, 2, timeout=400)


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def test_join_uneven_inputs_keeps_replicas_identical(two):
    ctrl = [two[r]["join_plain_ddp"] for r in range(2)]
    assert _same(ctrl[0]["end"], ctrl[1]["end"])  # the scenario itself is sound
    res = [two[r]["join"] for r in range(2)]
    assert _same(res[0]["after_join"], res[1]["after_join"])
    assert _same(res[0]["end"], res[1]["end"]), "replicas drifted apart after join()"
    # The joined rank's stale weights did disagree, and every rank fell back alike.
    assert res[0]["stats"]["core_fallbacks"] > 0
    assert res[0]["stats"]["core_fallbacks"] == res[1]["stats"]["core_fallbacks"]


def test_default_agreement_check_is_cheap_and_counted(two):
    st = two[0]["join"]["stats"]["total"]
    assert SlimDPState().check_agreement_every == 100
    assert st["checks"] > 0 and 64 * st["checks"] <= st["check_bytes"] <= 96 * st["checks"]
    assert st["check_bytes"] < 0.05 * st["bytes_sent"]


@pytest.mark.parametrize("case", ["fp16", "fp16_attached"])
def test_fp16_wire_with_grad_scaler_trains(two, case):
    for r in range(2):
        res = two[r][case]
        # Before the fix the scale fell below 1e-7 and the loss exploded within 300 steps.
        assert res["scale"] >= 1.0, f"loss scale collapsed to {res['scale']}"
        ref = two[r]["bf16_reference"]
        assert ref["last"] < 0.9 * ref["first"], ref  # the task is learnable at this density
        assert res["last"] == res["last"] and res["last"] < 1.25 * ref["last"], (res, ref)
    assert _same(two[0][case]["params"], two[1][case]["params"])


def test_skipped_step_loses_no_residual(two):
    for r in range(2):
        res = two[r]["skipped"]
        b, a = res["before"]["params"], res["after"]["params"]
        assert res["stats"]["voided_steps"] == 1
        for i in b:
            assert torch.equal(b[i]["residual"], a[i]["residual"]), f"rank {r} param {i}"
            assert torch.equal(b[i]["G"], a[i]["G"]), f"rank {r} param {i}"
        assert a[0]["residual"].abs().sum() > 0  # there was a residual to lose
    assert _same(two[0]["skipped"]["params"], two[1]["skipped"]["params"])


def test_other_ranks_state_is_refused_on_every_rank(two):
    o = [two[r]["ownership"] for r in range(2)]
    for kind in ("hook", "optim", "ist"):
        assert o[0][f"{kind}_own"] is None and o[1][f"{kind}_own"] is None, kind
        # Rank 1's file on every rank: rank 0 names the cause, rank 1 is told to stop.
        assert "saved by rank 1" in o[0][f"{kind}_rank1_everywhere"], o[0]
        assert "another rank" in o[1][f"{kind}_rank1_everywhere"], o[1]
    assert "every rank must" in o[0]["hook_rank1_everywhere"]
    for kind in ("hook", "optim"):
        assert "saved by rank 1" in o[0][f"{kind}_swapped"]
        assert "saved by rank 0" in o[1][f"{kind}_swapped"]
    assert "cannot be changed" in o[0]["live_assign"]
    assert "cannot be changed" in o[0]["optim_assign"]
    assert "error_feedback must be a bool" in o[0]["optim_bad_type"]


def test_parameter_unused_on_every_rank_keeps_its_residual(two):
    for r in range(2):
        for setting, runs in two[r]["unused"].items():
            assert _same(runs["skip"], runs["zero"]), f"rank {r} (as_view, set_to_none)={setting}"
    for setting in two[0]["unused"]:
        assert _same(two[0]["unused"][setting]["skip"], two[1]["unused"][setting]["skip"])


@pytest.mark.parametrize("mode", ["shared", "local"])
def test_channels_last_parameters_match_contiguous(two, mode):
    for r in range(2):
        res = two[r]["channels_last"]
        assert _same(res[(mode, False)], res[(mode, True)]), f"rank {r}"


# ---------------------------------------------------------------------------
# Items 7 and 8 without processes
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("name,value", [
    ("core_ratio", 0.5), ("explore_ratio", 0.5), ("seed", 3), ("core_refresh", 5),
    ("value_dtype", torch.float16), ("error_feedback", False), ("process_group", None),
])
def test_hyperparameters_are_frozen(name, value):
    st = SlimDPState(**CFG)
    before = getattr(st, name)
    with pytest.raises(AttributeError, match=f"{name} cannot be changed.*construct a new"):
        setattr(st, name, value)
    assert getattr(st, name) == before


@pytest.mark.parametrize("kw,name", [
    (dict(error_feedback="no"), "error_feedback"), (dict(error_feedback="False"), "error_feedback"),
    (dict(error_feedback=1), "error_feedback"), (dict(core_ratio=True), "core_ratio"),
    (dict(explore_ratio=False), "explore_ratio"), (dict(core_refresh=True), "core_refresh"),
    (dict(warmup_steps=True), "warmup_steps"), (dict(error_decay=True), "error_decay"),
    (dict(check_agreement_every=True), "check_agreement_every"),
    (dict(process_group="world"), "process_group"), (dict(score=["product"]), "score"),
    (dict(value_dtype="float16"), "value_dtype"),
])
def test_wrong_types_are_refused(kw, name):
    with pytest.raises(ValueError, match=name):
        SlimDPState(**kw)


def _sd(model):
    st = SlimDPState(**CFG, model=model)
    return st, {
        "version": 2, "step": 4,
        "owner": {"rank": None, "world_size": None, "kind": "SlimDPState"},
        **{k: getattr(st, k) for k in ("seed", "core_ratio", "explore_ratio", "core_refresh",
                                        "warmup_steps", "score", "index_mode")},
        "stats": None,
        "params": {i: {"name": n, "numel": p.numel(), "residual": torch.zeros(p.numel()),
                       "G": torch.zeros(p.numel()), "core": None}
                   for i, (n, p) in enumerate(model.named_parameters())},
    }


@pytest.mark.parametrize("edit,match", [
    (lambda sd: sd.update(step=-5), "step must be an int >= 0"),
    (lambda sd: sd.update(step="ten"), "step must be an int >= 0"),
    (lambda sd: sd.update(step=True), "step must be an int >= 0"),
    (lambda sd: sd["params"][0].update(core=torch.tensor([3, 10_000])), "outside"),
    (lambda sd: sd["params"][0].update(core=torch.tensor([-1, 3])), "outside"),
    (lambda sd: sd["params"][0].update(core=torch.tensor([3, 3])), "distinct"),
    (lambda sd: sd["params"][0].update(core=torch.tensor([1.0, 2.0])), "int64"),
    (lambda sd: sd["params"][0].update(G=torch.zeros(3)), "G must be"),
    (lambda sd: sd.pop("owner"), "owner"),
    (lambda sd: sd.update(version=1), "version"),
])
def test_load_state_dict_validates_entries(edit, match):
    st, sd = _sd(_mlp())
    edit(sd)
    with pytest.raises(ValueError, match=match):
        st.load_state_dict(sd)


