"""Tests of the Slim-DP DDP communication hook (slimcomm.hooks).

Multi-rank runs use gloo on CPU through ``_dist.run_workers``. Several
scenarios share one process spawn (module-scoped fixtures) to keep the file
fast; each test then checks its own scenario's result.

The oracle is a single-process simulation of the algorithm (``_Sim``) built
from ``slimcomm.reference``: per parameter, per step, on the same model, data
and optimizer, it computes every rank's local gradient, the core/explore
index sets and the averaged gradient. With 2 ranks every sum is of two
values, so DDP and the simulation agree bit for bit; with 3 ranks gloo's
summation order differs and the comparison uses a tolerance.
"""

import copy
import io
import pickle

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from _dist import WorkerError, run_workers
from slimcomm import reference as ref
from slimcomm.hooks import SlimDPState, explore_rng_offset, selection_sizes, slim_dp_hook

# ---------------------------------------------------------------------------
# Shared model, data and configuration
# ---------------------------------------------------------------------------


class Net(nn.Module):
    """Has a big matrix, 1-d biases, a 3-element parameter and a 0-d parameter."""

    def __init__(self, d_in=12, hidden=40, d_out=5, dropout=0.0, unused=False):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, d_out)
        self.scale = nn.Parameter(torch.tensor(1.0))
        self.tiny = nn.Parameter(torch.linspace(-0.1, 0.1, 3))
        self.drop = nn.Dropout(dropout) if dropout else nn.Identity()
        self.unused = nn.Linear(hidden, 7) if unused else None

    def forward(self, x):
        h = self.drop(torch.relu(self.fc1(x)))
        out = self.fc2(h) * self.scale
        return out + torch.cat([self.tiny, self.tiny[:2]])


D_IN, D_OUT, BATCH = 12, 5, 16
# min_compress_numel=0: these small test tensors are compressed too (the hook's default,
# 2048, would send all of them dense)
BASE = dict(core_ratio=0.05, explore_ratio=0.05, core_refresh=3, warmup_steps=2, seed=7,
            min_compress_numel=0)


def make_model(dtype=torch.float32, **kw):
    torch.manual_seed(0)
    return Net(**kw).to(dtype)


def batch(rank, step, micro=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(100_000 * rank + 100 * step + micro)
    x = torch.randn(BATCH, D_IN, generator=g).to(dtype)
    y = torch.randint(0, D_OUT, (BATCH,), generator=g)
    return x, y


def loss_fn(out, y):
    return nn.functional.cross_entropy(out.float(), y)


def make_opt(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def train_until_a_rank_dies(rank, cfg, victim, at_step, before_backward, timeout=None,
                            steps=8):
    """Train the hooked Net; rank ``victim`` calls ``os._exit(3)`` at step ``at_step``
    (before its backward, i.e. before its first collective of the step, or after it, with
    the step's collectives issued). Returns ``dict(raised=False)`` or, for the step that
    raised, ``dict(raised=True, msg, step, unchanged)`` (``unchanged``: the parameters are
    those from before the step)."""
    import os

    model = make_model()
    ddp = DDP(model)
    state = SlimDPState(**{**BASE, **cfg}).attach(ddp)
    if timeout is not None:
        state._timeout = timeout
    ddp.register_comm_hook(state, slim_dp_hook)
    opt = make_opt(model.parameters())
    for t in range(steps):
        before = [p.detach().clone() for p in model.parameters()]
        try:
            opt.zero_grad()
            x, y = batch(rank, t)
            if rank == victim and t == at_step and before_backward:
                os._exit(3)
            loss_fn(ddp(x), y).backward()
            if rank == victim and t == at_step:
                os._exit(3)
            opt.step()
        except Exception as exc:  # noqa: BLE001
            now = list(model.parameters())
            return dict(raised=True, msg=str(exc), step=t,
                        unchanged=all(torch.equal(a, b) for a, b in zip(before, now)))
    return dict(raised=False)


def train_ddp(rank, steps, cfg=None, ddp_kw=None, model_kw=None, dtype=torch.float32,
              micro=1, hook=True, record=True, model=None, opt=None, state=None, start=0,
              grad_hook=None):
    """Train a DDP-wrapped Net for ``steps`` steps; return per-step grads and more."""
    model = model if model is not None else make_model(dtype, **(model_kw or {}))
    ddp = DDP(model, **(ddp_kw or {}))
    if hook:
        state = state if state is not None else SlimDPState(**{**BASE, **(cfg or {})})
        state.attach(ddp)
        ddp.register_comm_hook(state, slim_dp_hook)
    opt = opt if opt is not None else make_opt(model.parameters())
    grads = []
    for t in range(start, start + steps):
        opt.zero_grad(set_to_none=False)
        for mi in range(micro):
            x, y = batch(rank, t, mi, dtype)
            if mi < micro - 1:
                with ddp.no_sync():
                    loss_fn(ddp(x), y).backward()
            else:
                if grad_hook is not None:
                    grad_hook(model, t)
                loss_fn(ddp(x), y).backward()
        if record:
            grads.append([None if p.grad is None else p.grad.detach().clone()
                          for p in model.parameters()])
        opt.step()
    return dict(grads=grads, params=[p.detach().clone() for p in model.parameters()],
                state=state.state_dict() if hook else None,
                stats=state.stats if hook else None, model=model, opt=opt, hstate=state)


def strip(res):
    """Drop the live objects before sending a result to the parent."""
    return {k: v for k, v in res.items() if k not in ("model", "opt", "hstate")}


# ---------------------------------------------------------------------------
# Single-process simulation from slimcomm.reference (the oracle)
# ---------------------------------------------------------------------------


class _Sim:
    def __init__(self, world_size, cfg, dtype=torch.float32, micro=1, model_kw=None):
        self.ws = world_size
        self.cfg = {**BASE, **cfg}
        self.dtype = dtype
        self.micro = micro
        self.model = make_model(dtype, **(model_kw or {}))
        self.opt = make_opt(self.model.parameters())
        self.params = list(self.model.parameters())
        n = [p.numel() for p in self.params]
        self.res = [[torch.zeros(k) for k in n] for _ in range(world_size)]
        self.G = [torch.zeros(k) for k in n]
        self.core = [None] * len(n)
        self.wire = self.cfg.get("value_dtype") or dtype
        self.grads = []

    def local_grads(self, rank, t):
        self.model.zero_grad(set_to_none=False)
        for mi in range(self.micro):
            x, y = batch(rank, t, mi, self.dtype)
            loss_fn(self.model(x), y).backward()
        return [p.grad.detach().reshape(-1).clone() for p in self.params]

    def _sum(self, parts):
        acc = parts[0].float()
        for v in parts[1:]:
            acc = acc + v.float()
        return acc

    def step(self, t):
        c = self.cfg
        ws = self.ws
        local = [self.local_grads(r, t) for r in range(ws)]
        out = []
        for i, p in enumerate(self.params):
            n = p.numel()
            k, m, dense = selection_sizes(n, c["core_ratio"], c["explore_ratio"],
                                          c.get("min_compress_numel", 0))
            g = [local[r][i] for r in range(ws)]
            if t < c["warmup_steps"] and self.wire != torch.bfloat16:
                avg = self._sum([x / ws for x in g]).to(self.dtype)
                self.G[i] = avg.float()
                out.append(avg.view_as(p))
                continue
            if dense or t < c["warmup_steps"]:  # the warm-up travels in a bf16 wire too
                avg = self._sum([(x.float() / ws).to(self.wire) for x in g]).to(self.wire)
                avg = avg.to(self.dtype)
                self.G[i] = avg.float()
                out.append(avg.view_as(p))
                continue
            acc = [self.res[r][i] + g[r].float() for r in range(ws)]
            w = p.detach().reshape(-1).float()
            if c.get("index_mode", "shared") == "shared":
                since = t - c["warmup_steps"]
                if since % c["core_refresh"] == 0:
                    self.core[i] = ref.significance_topk(w, self.G[i], k, c.get("score", "product"))[0]
                core = self.core[i]
                ex = ref.explore_sample(n, core, m, c["seed"], (t << 32) + i)
                idx = torch.cat([core, ex])
                vals = self._sum([(a[idx] / ws).to(self.wire) for a in acc]).to(self.wire)
                o = torch.zeros(n, dtype=self.dtype)
                o[idx] = vals.to(self.dtype)
                self.G[i][idx] = vals.float()
                for r in range(ws):
                    acc[r][idx] = 0
                    if c.get("error_feedback", True):
                        self.res[r][i] = acc[r]
            else:
                o32 = torch.zeros(n)
                for r in range(ws):
                    core = ref.significance_topk(w, acc[r], k, c.get("score", "product"))[0]
                    ex = ref.explore_sample(n, core, m, c["seed"], (t << 32) + i)
                    idx = torch.cat([core, ex])
                    o32[idx] += (acc[r][idx] / ws).to(self.wire).float()
                    acc[r][idx] = 0
                    if c.get("error_feedback", True):
                        self.res[r][i] = acc[r]
                o = o32.to(self.dtype)
            out.append(o.view_as(p))
        for p, o in zip(self.params, out):
            p.grad = o.clone()
        self.grads.append([o.clone() for o in out])
        self.opt.step()


def simulate(world_size, steps, cfg, **kw):
    sim = _Sim(world_size, cfg, **kw)
    for t in range(steps):
        sim.step(t)
    return sim


def assert_grads_match(ddp_grads, sim, exact, rtol=1e-5, atol=1e-7):
    for t, (a_step, b_step) in enumerate(zip(ddp_grads, sim.grads)):
        for i, (a, b) in enumerate(zip(a_step, b_step)):
            # Same index set: the zero pattern must agree exactly.
            assert torch.equal(a == 0, b == 0), f"step {t} param {i}: index sets differ"
            if exact:
                assert torch.equal(a, b), f"step {t} param {i}: max diff {(a - b).abs().max()}"
            else:
                torch.testing.assert_close(a, b, rtol=rtol, atol=atol,
                                           msg=lambda s: f"step {t} param {i}: {s}")


# ---------------------------------------------------------------------------
# Worker bodies (module level so they pickle)
# ---------------------------------------------------------------------------

STEPS = 8


def _two_rank_cases(rank, world_size):
    r = {}
    r["shared"] = strip(train_ddp(rank, STEPS, dict(check_agreement_every=1),
                                  ddp_kw=dict(bucket_cap_mb=0.001)))
    r["local"] = strip(train_ddp(rank, STEPS, dict(index_mode="local")))
    r["no_sync"] = strip(train_ddp(rank, 6, micro=3))
    r["no_ef"] = strip(train_ddp(rank, 6, dict(error_feedback=False)))
    r["score_grad"] = strip(train_ddp(rank, 6, dict(score="grad")))
    # fc1.bias (40), fc2.bias, tiny and scale dense; fc1.weight (480), fc2.weight (200) sparse
    r["min_compress"] = strip(train_ddp(rank, 6, dict(min_compress_numel=41)))
    # One dense step: the first sparse step runs on DDP's rebuilt buckets, G carried over.
    r["warmup1"] = strip(train_ddp(rank, 6, dict(warmup_steps=1, check_agreement_every=1),
                                   ddp_kw=dict(bucket_cap_mb=0.001)))
    r["warmup1_cap25"] = strip(train_ddp(rank, 6, dict(warmup_steps=1),
                                         ddp_kw=dict(bucket_cap_mb=25)))
    r["local_weight"] = strip(train_ddp(rank, 6, dict(index_mode="local", score="weight",
                                                     explore_ratio=0.0)))
    # Layout invariance: one run per DDP configuration, same algorithm.
    for name, kw in {
        "cap_small": dict(bucket_cap_mb=0.0005),
        "cap_0.05": dict(bucket_cap_mb=0.05),
        "cap_25": dict(bucket_cap_mb=25),
        "as_view": dict(bucket_cap_mb=0.001, gradient_as_bucket_view=True),
        "static": dict(bucket_cap_mb=0.001, static_graph=True),
    }.items():
        r[name] = strip(train_ddp(rank, STEPS, ddp_kw=kw, record=False))
    # Ratios covering everything == DDP's default all-reduce.
    r["full"] = strip(train_ddp(rank, 5, dict(core_ratio=0.5, explore_ratio=0.5)))
    r["default"] = strip(train_ddp(rank, 5, hook=False))
    # Half precision gradients.
    r["bf16"] = strip(train_ddp(rank, 6, dtype=torch.bfloat16))
    r["fp16_wire_bf16"] = strip(train_ddp(rank, 6, dict(value_dtype=torch.bfloat16),
                                          dtype=torch.float16))
    r["bf16_wire"] = strip(train_ddp(rank, 6, dict(value_dtype=torch.bfloat16)))
    # Unused parameters.
    r["unused"] = strip(train_ddp(rank, 6, dict(check_agreement_every=1),
                                  ddp_kw=dict(find_unused_parameters=True, bucket_cap_mb=0.001),
                                  model_kw=dict(unused=True)))
    # Dropout: ranks consume torch's global RNG differently.
    torch.manual_seed(1234 + rank)
    r["dropout"] = strip(train_ddp(rank, 6, dict(check_agreement_every=1),
                                   model_kw=dict(dropout=0.3), record=False))
    r["checkpoint"] = _checkpoint_case(rank)
    r["nonfinite"] = _nonfinite_case(rank)
    r["sparse"] = _sparse_case(rank)
    r["not_attached"] = _not_attached_case(rank)
    return r


def _checkpoint_case(rank):
    cfg = dict(core_refresh=4, warmup_steps=3)
    straight = train_ddp(rank, 15, cfg, ddp_kw=dict(bucket_cap_mb=0.001), record=False)
    first = train_ddp(rank, 10, cfg, ddp_kw=dict(bucket_cap_mb=0.001), record=False)
    buf = io.BytesIO()  # every rank saves its own
    torch.save({"model": first["model"].state_dict(), "opt": first["opt"].state_dict(),
                "slim": first["hstate"].state_dict()}, buf)
    buf.seek(0)
    ck = torch.load(buf, weights_only=False)
    model = Net()  # different init on purpose; the checkpoint overwrites it
    model.load_state_dict(ck["model"])
    opt = make_opt(model.parameters())
    opt.load_state_dict(ck["opt"])
    state = SlimDPState(**{**BASE, **cfg})
    state.load_state_dict(ck["slim"])
    # A different bucketing in the new DDP: state must follow the parameters.
    resumed = train_ddp(rank, 5, ddp_kw=dict(bucket_cap_mb=25), record=False,
                        model=model, opt=opt, state=state, start=10)
    return dict(straight=straight["params"], resumed=resumed["params"],
                straight_state=straight["state"], resumed_state=resumed["state"])


NAN_STEP = 4
FC1W = 2  # position of fc1.weight in Net.parameters()


def _nonfinite_case(rank):
    state = SlimDPState(**BASE)
    model = make_model()
    ddp = DDP(model, bucket_cap_mb=0.001)
    state.attach(ddp)
    ddp.register_comm_hook(state, slim_dp_hook)
    opt = make_opt(model.parameters())
    grads, before, after = [], None, None
    handle = None
    for t in range(NAN_STEP + 3):
        opt.zero_grad()
        if t == NAN_STEP:
            before = copy.deepcopy(state.state_dict())
            if rank == 1:
                handle = model.fc1.weight.register_hook(
                    lambda g: g.index_fill(1, torch.tensor([0]), float("nan")))
        x, y = batch(rank, t)
        loss_fn(ddp(x), y).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        if t == NAN_STEP:
            after = copy.deepcopy(state.state_dict())
            if handle is not None:
                handle.remove()
            continue  # what GradScaler would do: skip the step
        opt.step()
    return dict(grads=grads, before=before, after=after, stats=state.stats,
                params=[p.detach().clone() for p in model.parameters()])


class _SparseNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(30, 8, sparse=True)
        self.fc = nn.Linear(8, D_OUT)

    def forward(self, ids):
        return self.fc(self.emb(ids).mean(1))


def _sparse_case(rank):
    """Embedding(sparse=True) + Linear. With ratios covering everything the whole
    run must equal DDP's default hook; with compression it must still run."""
    out = {}
    for name, cfg in (("full", dict(core_ratio=0.5, explore_ratio=0.5)), ("default", None),
                      ("compressed", {})):
        torch.manual_seed(0)
        model = _SparseNet()
        ddp = DDP(model)
        if cfg is not None:
            state = SlimDPState(**{**BASE, **cfg}, model=ddp)
            ddp.register_comm_hook(state, slim_dp_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        embs = []
        for t in range(5):
            g = torch.Generator().manual_seed(rank * 100 + t)
            ids = torch.randint(0, 30, (BATCH, 4), generator=g)
            y = torch.randint(0, D_OUT, (BATCH,), generator=g)
            opt.zero_grad()
            loss_fn(ddp(ids), y).backward()
            assert model.emb.weight.grad.is_sparse
            embs.append(model.emb.weight.grad.to_dense().clone())
            opt.step()
        out[name] = dict(emb=embs, params=[p.detach().clone() for p in model.parameters()])
    return out


def _not_attached_case(rank):
    model = make_model()
    ddp = DDP(model)
    ddp.register_comm_hook(SlimDPState(**BASE), slim_dp_hook)
    x, y = batch(rank, 0)
    try:
        loss_fn(ddp(x), y).backward()
    except RuntimeError as e:
        return str(e)
    return None


def _three_rank_cases(rank, world_size):
    return {
        "shared": strip(train_ddp(rank, STEPS, dict(check_agreement_every=2),
                                  ddp_kw=dict(bucket_cap_mb=0.001))),
        "local": strip(train_ddp(rank, STEPS, dict(index_mode="local"))),
    }


def _diverged_case(rank, world_size):
    """Rank 1's Slim-DP state is edited by hand (its G of fc1.weight permuted) between
    a save and a load: a divergence slimcomm cannot prevent, which must become an error.
    (Ranks whose *weights* differ, as while a rank is joined, keep agreeing index sets.)"""
    first = train_ddp(rank, 4, record=False)
    sd = first["hstate"].state_dict()
    if rank == 1:
        g = sd["params"][FC1W]["G"]
        sd["params"][FC1W]["G"] = g.flip(0)
    state = SlimDPState(**{**BASE, "check_agreement_every": 1})
    state.load_state_dict(sd)
    train_ddp(rank, 3, record=False, model=first["model"], opt=first["opt"], state=state,
              start=4)


def _convergence_case(rank, world_size):
    def run(use_hook):
        torch.manual_seed(0)
        teacher = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 10))
        torch.manual_seed(1)
        model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                              nn.Linear(128, 10))
        ddp = DDP(model)
        state = None
        if use_hook:
            # At 5% + 5% this task lags dense by ~20% after 300 steps (see the
            # hook benchmark notes); 10% + 10% is the density this test pins.
            state = SlimDPState(core_ratio=0.1, explore_ratio=0.1, core_refresh=20,
                                warmup_steps=5, min_compress_numel=0, model=ddp)
            ddp.register_comm_hook(state, slim_dp_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        g = torch.Generator().manual_seed(rank)
        for _ in range(300):
            x = torch.randn(32, 32, generator=g)
            with torch.no_grad():
                y = teacher(x).argmax(1)
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
        ge = torch.Generator().manual_seed(999)
        xe = torch.randn(2000, 32, generator=ge)
        with torch.no_grad():
            loss = nn.functional.cross_entropy(model(xe), teacher(xe).argmax(1)).item()
        return loss, (state.stats["total"]["density"] if state else 1.0)

    return dict(dense=run(False), slim=run(True))


# ---------------------------------------------------------------------------
# Fixtures: one spawn per group of scenarios
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two():
    return run_workers(_two_rank_cases, 2, timeout=240)


@pytest.fixture(scope="module")
def three():
    return run_workers(_three_rank_cases, 3, timeout=120)


@pytest.fixture(scope="module")
def sim_shared_2():
    return simulate(2, STEPS, {})


# ---------------------------------------------------------------------------
# Tests without processes
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "numel,cr,er,expected,min_numel",
    [
        (300, 0.01, 0.01, (3, 3, False), 0),  # 0.01 * 300 = 3.0000000000000004 must not round up
        (1000, 0.01, 0.01, (10, 10, False), 0),
        (1001, 0.01, 0.01, (11, 11, False), 0),
        (5, 0.05, 0.05, (1, 1, False), 0),  # smaller than 1/ratio: at least 1 each
        (2, 0.05, 0.05, (2, 0, True), 0),  # k + m >= numel: dense
        (1, 0.01, 0.01, (1, 0, True), 0),  # 0-d parameter
        (0, 0.01, 0.01, (0, 0, True), 0),
        (100, 0.5, 0.5, (100, 0, True), 0),
        (100, 0.1, 0.0, (10, 0, False), 0),
        (2047, 0.01, 0.01, (2047, 0, True), 2048),  # below min_compress_numel: dense
        (2048, 0.01, 0.01, (21, 21, False), 2048),
        (0, 0.01, 0.01, (0, 0, True), 2048),
    ],
)
def test_selection_sizes(numel, cr, er, expected, min_numel):
    assert selection_sizes(numel, cr, er, min_numel) == expected
    if not min_numel:
        assert selection_sizes(numel, cr, er) == expected


def test_min_compress_numel_defaults_and_checkpoints():
    from slimcomm.compressor import SlimDPCompressor

    assert SlimDPState().min_compress_numel == 2048  # the DDP hook sends small tensors whole
    assert SlimDPCompressor().min_compress_numel == 0
    assert "min_compress_numel" in SlimDPState._HYPERPARAMETERS
    with pytest.raises(ValueError, match="min_compress_numel"):
        SlimDPState(min_compress_numel=0).load_state_dict(SlimDPState().state_dict())
    with pytest.raises(AttributeError):
        SlimDPState().min_compress_numel = 1
    # a pickle from before the hyperparameter existed (no key in it nor in its state_dict)
    # compressed every parameter: it comes back with 0 and loads
    old = SlimDPState().__getstate__()
    del old["hyperparameters"]["min_compress_numel"], old["state"]["min_compress_numel"]
    back = SlimDPState.__new__(SlimDPState)
    back.__setstate__(old)
    assert back.min_compress_numel == 0
    for bad in (-1, 1.5, True, "8"):
        with pytest.raises(ValueError, match="min_compress_numel"):
            SlimDPState(min_compress_numel=bad)


@pytest.mark.parametrize("args,name", [
    ((-1, 0.01, 0.01), "numel"), ((1.5, 0.01, 0.01), "numel"),
    ((100, 0.0, 0.01), "core_ratio"), ((100, 1.01, 0.0), "core_ratio"),
    ((100, 0.01, -0.5), "explore_ratio"), ((100, 0.01, float("nan")), "explore_ratio"),
    ((100, 0.01, 0.01, -1), "min_compress_numel"), ((100, 0.01, 0.01, True), "min_compress_numel"),
])
def test_selection_sizes_bad_arguments(args, name):
    with pytest.raises(ValueError, match=name):
        selection_sizes(*args)


def test_explore_rng_offset_distinct_per_step_and_position():
    assert explore_rng_offset(0, 0) == 0
    assert explore_rng_offset(3, 5) == 3 * 2**32 + 5  # the documented formula
    offs = {explore_rng_offset(t, p) for t in range(50) for p in range(300)}
    assert len(offs) == 50 * 300


@pytest.mark.parametrize(
    "kw,name",
    [
        (dict(core_ratio=0.0), "core_ratio"),
        (dict(core_ratio=1.5), "core_ratio"),
        (dict(explore_ratio=-0.1), "explore_ratio"),
        (dict(core_refresh=0), "core_refresh"),
        (dict(warmup_steps=0), "warmup_steps"),
        (dict(score="abs"), "score"),
        (dict(index_mode="global"), "index_mode"),
        (dict(value_dtype=torch.int8), "value_dtype"),
        (dict(seed=1.5), "seed"),
        (dict(seed=2**64), "seed"),  # would only fail at the first compressed step
        (dict(seed=True), "seed"),
        (dict(check_agreement_every=-1), "check_agreement_every"),
        (dict(model="not a module"), "model"),
    ],
)
def test_bad_hyperparameters_name_the_argument(kw, name):
    with pytest.raises(ValueError, match=name):
        SlimDPState(**kw)


def _fake_state_dict(model, step=3):
    st = SlimDPState(**BASE, model=model)
    sd = {
        "version": 2, "step": step,
        "owner": {"rank": None, "world_size": None, "kind": "SlimDPState"},
        **{k: getattr(st, k) for k in (
            "seed", "core_ratio", "explore_ratio", "core_refresh", "warmup_steps", "score",
            "index_mode")},
        "stats": None,
        "params": {i: {"name": n, "numel": p.numel(), "residual": torch.zeros(p.numel()),
                       "G": torch.zeros(p.numel()), "core": None}
                   for i, (n, p) in enumerate(model.named_parameters())},
    }
    return sd


def test_load_state_dict_never_misapplies():
    sd = _fake_state_dict(Net())
    # Same architecture: fine, before or after attach.
    SlimDPState(**BASE, model=Net()).load_state_dict(sd)
    st = SlimDPState(**BASE)
    st.load_state_dict(sd)
    st.attach(Net())
    # Different sizes at the same positions.
    with pytest.raises(ValueError, match=r"position \d+ was .fc1.weight"):
        SlimDPState(**BASE, model=Net(hidden=41)).load_state_dict(sd)
    st = SlimDPState(**BASE)
    st.load_state_dict(sd)
    with pytest.raises(ValueError, match="model"):
        st.attach(Net(hidden=41))
    # Different names at the same positions.
    other = nn.Sequential(*[nn.Linear(12, 40), nn.Linear(40, 5)])
    with pytest.raises(ValueError, match="state_dict"):
        SlimDPState(**BASE, model=other).load_state_dict(sd)
    # Hyperparameters that determine the index sets must match.
    with pytest.raises(ValueError, match="seed"):
        SlimDPState(**{**BASE, "seed": 8}).load_state_dict(sd)
    with pytest.raises(ValueError, match="version"):
        SlimDPState(**BASE).load_state_dict({**sd, "version": 99})


def test_pickle_without_process_group():
    st = SlimDPState(**BASE, value_dtype=torch.bfloat16)
    st.load_state_dict(_fake_state_dict(Net(), step=5))
    back = pickle.loads(pickle.dumps(st))
    assert back.step == 5 and back.value_dtype == torch.bfloat16 and back.process_group is None
    back.attach(Net())


# ---------------------------------------------------------------------------
# Multi-rank tests against the simulation
# ---------------------------------------------------------------------------


def test_shared_two_ranks_matches_simulation(two, sim_shared_2):
    for rank in range(2):
        assert_grads_match(two[rank]["shared"]["grads"], sim_shared_2, exact=True)
    # The core sets kept in the state equal the simulation's, and so do residuals.
    st = two[0]["shared"]["state"]
    for i, core in enumerate(sim_shared_2.core):
        if core is not None:  # None for dense parameters
            assert torch.equal(st["params"][i]["core"], core), f"param {i}: core set differs"
    for rank in range(2):
        for i, res in enumerate(sim_shared_2.res[rank]):
            assert torch.equal(two[rank]["shared"]["state"]["params"][i]["residual"], res)


def test_replicas_bit_identical(two):
    for case in ("shared", "local", "no_sync", "bf16", "fp16_wire_bf16", "unused", "dropout"):
        for a, b in zip(two[0][case]["params"], two[1][case]["params"]):
            assert torch.equal(a, b), case


def test_local_mode_matches_simulation(two):
    sim = simulate(2, STEPS, dict(index_mode="local"))
    for rank in range(2):
        assert_grads_match(two[rank]["local"]["grads"], sim, exact=True)


@pytest.mark.parametrize("case,cfg", [
    ("no_ef", dict(error_feedback=False)),
    ("score_grad", dict(score="grad")),
    ("min_compress", dict(min_compress_numel=41)),
    ("warmup1", dict(warmup_steps=1)),
    ("warmup1_cap25", dict(warmup_steps=1)),
    ("local_weight", dict(index_mode="local", score="weight", explore_ratio=0.0)),
])
def test_options_match_simulation(two, case, cfg):
    sim = simulate(2, 6, cfg)
    for rank in range(2):
        assert_grads_match(two[rank][case]["grads"], sim, exact=True)
    if case == "no_ef":
        assert all(p["residual"] is None for p in two[0][case]["state"]["params"].values())
    if case == "min_compress":  # the small parameters travel whole at compressed steps
        for step in two[0][case]["grads"][2:]:
            by_size = {g.numel(): g for g in step if g is not None}
            assert by_size[40].count_nonzero() == 40 and by_size[480].count_nonzero() < 480


def test_three_ranks_match_simulation(three):
    sim = simulate(3, STEPS, dict(check_agreement_every=2))
    sim_local = simulate(3, STEPS, dict(index_mode="local"))
    for rank in range(3):
        assert_grads_match(three[rank]["shared"]["grads"], sim, exact=False)
        assert_grads_match(three[rank]["local"]["grads"], sim_local, exact=False)
    for case in ("shared", "local"):
        for r in (1, 2):
            for a, b in zip(three[0][case]["params"], three[r][case]["params"]):
                assert torch.equal(a, b)


def test_layout_invariance(two):
    ref_params = two[0]["cap_25"]["params"]
    for case in ("cap_small", "cap_0.05", "as_view", "static", "shared"):
        for rank in range(2):
            for a, b in zip(two[rank][case]["params"], ref_params):
                assert torch.equal(a, b), f"{case} rank {rank} differs from bucket_cap_mb=25"


# ---------------------------------------------------------------------------
# Layout invariance of a dense parameter alone in a bucket (issue 23, item 11)
# ---------------------------------------------------------------------------


class _Gated(nn.Module):
    """``gain`` (2 elements: dense, ``k + m >= numel``) is the last gradient DDP sees, so a
    tiny ``bucket_cap_mb`` gives it a bucket of its own; with 25 MB it shares the one
    bucket with the sparse matrices."""

    def __init__(self):
        super().__init__()
        self.lin1 = nn.Linear(16, 32)
        self.lin2 = nn.Linear(32, 4)
        self.gain = nn.Parameter(torch.tensor([1.0, -0.5]))

    def forward(self, x):
        return self.lin2(torch.relu(self.lin1(x * self.gain.repeat(8))))


WIRES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
DENSE_ALONE_CAPS = (0.0001, 25)


def _dense_alone_cases(rank, world_size, steps=6):
    out = {}
    for mode in ("local", "shared"):
        for wname, wire in WIRES.items():
            for cap in DENSE_ALONE_CAPS:
                torch.manual_seed(0)
                model = _Gated()
                names = {id(p): n for n, p in model.named_parameters()}
                ddp = DDP(model, bucket_cap_mb=cap)
                state = SlimDPState(**{**BASE, "index_mode": mode, "value_dtype": wire})
                state.attach(ddp)
                buckets = set()

                def hook(st, bucket):
                    buckets.add(tuple(sorted(names[id(p)] for p in bucket.parameters())))
                    return slim_dp_hook(st, bucket)

                ddp.register_comm_hook(state, hook)
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
                grads = []
                for t in range(steps):
                    g = torch.Generator().manual_seed(1000 * rank + t)
                    x = torch.randn(8, 16, generator=g)
                    y = torch.randint(0, 4, (8,), generator=g)
                    opt.zero_grad()
                    nn.functional.cross_entropy(ddp(x), y).backward()
                    grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
                    opt.step()
                out[mode, wname, cap] = dict(
                    grads=grads, buckets=buckets,
                    params={n: p.detach().clone() for n, p in model.named_parameters()})
    return out


@pytest.fixture(scope="module")
def dense_alone():
    return run_workers(_dense_alone_cases, 2, timeout=240)


@pytest.mark.parametrize("wire", list(WIRES))
@pytest.mark.parametrize("mode", ["local", "shared"])
def test_dense_parameter_alone_in_a_bucket_is_layout_invariant(dense_alone, mode, wire):
    """A dense parameter averages to the same bits alone in a bucket (tiny
    ``bucket_cap_mb``) as beside sparse parameters (one bucket), in every wire dtype.
    Local mode used to send a bucket of dense parameters through a plain all-reduce (sums
    rounded to the fp16/bf16 wire) but a dense parameter in a mixed bucket through the
    fp32 scatter-add: 0.03759765625 vs 0.03753662109375 on ``gain`` with a bf16 wire."""
    small, big = DENSE_ALONE_CAPS
    res = dense_alone[0]
    assert ("gain",) in res[mode, wire, small]["buckets"]  # gain alone: a dense bucket
    assert len(res[mode, wire, big]["buckets"]) == 1       # one bucket, dense and sparse
    for t, (ga, gb) in enumerate(zip(res[mode, wire, small]["grads"],
                                     res[mode, wire, big]["grads"])):
        for n in ga:
            assert torch.equal(ga[n], gb[n]), (
                f"step {t} {n}: bucket_cap_mb={small} gives {ga[n].flatten().tolist()[:4]}, "
                f"{big} gives {gb[n].flatten().tolist()[:4]}")
    for cap in DENSE_ALONE_CAPS:  # replicas bit-identical
        for n, p in dense_alone[0][mode, wire, cap]["params"].items():
            assert torch.equal(p, dense_alone[1][mode, wire, cap]["params"][n]), (cap, n)


def test_full_density_equals_ddp_default(two):
    for rank in range(2):
        for sa, sb in zip(two[rank]["full"]["grads"], two[rank]["default"]["grads"]):
            for a, b in zip(sa, sb):
                assert torch.equal(a, b)
    assert two[0]["full"]["stats"]["total"]["density"] == 1.0


def test_no_sync_error_feedback_once_per_synchronised_step(two):
    sim = simulate(2, 6, {}, micro=3)
    for rank in range(2):
        assert_grads_match(two[rank]["no_sync"]["grads"], sim, exact=True)
    assert two[0]["no_sync"]["stats"]["steps"] == 6


def test_half_precision_gradients(two):
    sim = simulate(2, 6, {}, dtype=torch.bfloat16)
    for rank in range(2):
        assert_grads_match(two[rank]["bf16"]["grads"], sim, exact=True)
        for p in two[rank]["bf16"]["state"]["params"].values():
            assert p["residual"].dtype == torch.float32 and p["G"].dtype == torch.float32
    sim = simulate(2, 6, dict(value_dtype=torch.bfloat16), dtype=torch.float16)
    assert_grads_match(two[0]["fp16_wire_bf16"]["grads"], sim, exact=True)
    sim = simulate(2, 6, dict(value_dtype=torch.bfloat16))
    assert_grads_match(two[0]["bf16_wire"]["grads"], sim, exact=True)
    # bf16 on the wire halves the bytes: same elements, 2 bytes each instead of 4
    # (both runs: one default-size bucket; the wire holds
    # the packed values plus one flag element per parameter; agreement checksums
    # are counted apart in check_bytes).
    full = two[0]["no_ef"]["stats"]["last"]
    half = two[0]["bf16_wire"]["stats"]["last"]
    n_params = len(list(Net().parameters()))
    assert half["elements_sent"] == full["elements_sent"]
    assert full["bytes_sent"] - full["check_bytes"] == 4 * (full["elements_sent"] + n_params)
    assert half["bytes_sent"] - half["check_bytes"] == 2 * (half["elements_sent"] + n_params)


def test_unused_parameters(two):
    res = two[0]["unused"]
    # The unused layer never gets a gradient and never moves.
    torch.manual_seed(0)
    init = Net(unused=True)
    assert torch.equal(res["params"][-2], init.unused.weight.detach())
    assert all(g[-2] is None or not g[-2].any() for g in res["grads"])


def test_checkpoint_into_new_ddp_is_bit_identical(two):
    for rank in range(2):
        ck = two[rank]["checkpoint"]
        for a, b in zip(ck["straight"], ck["resumed"]):
            assert torch.equal(a, b), f"rank {rank}"
        for i, d in ck["straight_state"]["params"].items():
            e = ck["resumed_state"]["params"][i]
            assert torch.equal(d["residual"], e["residual"])
            assert torch.equal(d["G"], e["G"])


def test_nonfinite_reaches_every_rank_and_not_the_state(two):
    for rank in range(2):
        nf = two[rank]["nonfinite"]
        g = nf["grads"][NAN_STEP]
        # Positions: scale, tiny, fc1.weight, fc1.bias, fc2.weight, fc2.bias.
        assert torch.isnan(g[FC1W]).all(), f"rank {rank}: fc1.weight average must be NaN"
        for i in range(len(g)):
            if i != FC1W:
                assert torch.isfinite(g[i]).all(), f"rank {rank}: param {i} must stay finite"
        # The GradScaler-style skipped step is undone for EVERY parameter: nothing of it
        # was applied, so no residual or G may change (issue 13, item 2).
        b, a = nf["before"]["params"], nf["after"]["params"]
        for i in b:
            assert torch.equal(b[i]["residual"], a[i]["residual"]), i
            assert torch.equal(b[i]["G"], a[i]["G"]), i
        assert nf["stats"]["voided_steps"] == 1
        for p in a.values():
            assert torch.isfinite(p["residual"]).all() and torch.isfinite(p["G"]).all()
        assert nf["stats"]["nonfinite_fallbacks"] == 1
        for t in range(NAN_STEP + 1, NAN_STEP + 3):
            assert all(torch.isfinite(x).all() for x in nf["grads"][t])
    for a, b in zip(two[0]["nonfinite"]["params"], two[1]["nonfinite"]["params"]):
        assert torch.equal(a, b)


def test_sparse_gradients_pass_through_as_allreduce(two):
    for rank in range(2):
        sp = two[rank]["sparse"]
        for a, b in zip(sp["full"]["emb"], sp["default"]["emb"]):
            assert torch.equal(a, b)
    for a, b in zip(two[0]["sparse"]["compressed"]["params"], two[1]["sparse"]["compressed"]["params"]):
        assert torch.equal(a, b)


def test_unattached_state_raises_clearly(two):
    for rank in range(2):
        assert "attach" in two[rank]["not_attached"]


def test_stats_bytes_and_density(two):
    st = two[0]["shared"]["stats"]
    last = st["last"]
    assert st["steps"] == STEPS
    n = sum(p.numel() for p in Net().parameters())
    assert last["elements"] == n and last["bytes_dense"] == 4 * n
    expected = 0
    for p in Net().parameters():
        k, m, dense = selection_sizes(p.numel(), BASE["core_ratio"], BASE["explore_ratio"])
        expected += k + m
    assert last["elements_sent"] == expected
    assert last["core"] + last["explore"] == expected
    assert last["bytes_sent"] > 4 * expected  # flags and agreement checksums ride along
    assert 0 < last["density"] < 0.2


def test_diverged_ranks_raise_naming_the_bucket():
    with pytest.raises(WorkerError, match=r"index sets or G differ across ranks in bucket \d+"):
        run_workers(_diverged_case, 2, timeout=90)


def test_convergence_close_to_dense():
    res = run_workers(_convergence_case, 2, timeout=120)[0]
    dense, (slim, density) = res["dense"][0], res["slim"]
    assert density < 0.25
    assert slim <= 1.10 * dense, f"slim_dp loss {slim:.4f} vs dense {dense:.4f}"


def _mismatch_case(rank, world_size):
    train_ddp(rank, 3, dict(core_ratio=0.05 if rank == 0 else 0.1), record=False)


def test_rank_mismatched_hyperparameters_raise_not_hang():
    with pytest.raises(WorkerError, match="differs across ranks.*hyperparameters"):
        run_workers(_mismatch_case, 2, timeout=60)


def _one_rank_mistake_case(rank, world_size, mistake, flag_file):
    """Rank 1 makes a mistake only it can see; it then stays alive (as a process
    that catches the error would) until rank 0 has raised, so a rank 0 blocked
    in a collective shows up as a timeout instead of a broken connection."""
    import os
    import time
    model = make_model()
    ddp = DDP(model)
    if rank == 1 and mistake == "not_attached":
        state = SlimDPState(**BASE)
    elif rank == 1 and mistake == "other_model":
        state = SlimDPState(**BASE, model=make_model())
    else:
        state = SlimDPState(**BASE, model=ddp)
    ddp.register_comm_hook(state, slim_dp_hook)
    x, y = batch(rank, 0)
    t0 = time.monotonic()
    try:
        loss_fn(ddp(x), y).backward()
        err = None
    except RuntimeError as e:
        err = str(e)
    elapsed = time.monotonic() - t0
    if rank == 0:
        open(flag_file, "w").close()
    else:
        deadline = time.monotonic() + 20
        while not os.path.exists(flag_file) and time.monotonic() < deadline:
            time.sleep(0.05)
    return err, elapsed


@pytest.mark.parametrize("mistake", ["not_attached", "other_model"])
def test_rank_local_state_mistake_raises_on_every_rank(mistake, tmp_path):
    res = run_workers(_one_rank_mistake_case, 2, mistake, str(tmp_path / "done"), timeout=60)
    (err0, t0), (err1, _) = res
    assert err1 is not None and "attach" in err1
    assert err0 is not None and "another rank" in err0, err0
    assert t0 < 15, f"rank 0 waited {t0:.1f} s for the failed rank"
