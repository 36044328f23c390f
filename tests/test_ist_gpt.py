"""IST for transformer blocks (slimcomm.ist.transformer, GPTISTTrainer): slicing, round trip,
replicas after every synchronisation, world size 1 = plain training, resume, bytes per rank,
bad arguments, a killed rank, the training command's ``--method ist --model gpt``."""

from __future__ import annotations

import copy
import io
import json
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from _dist import run_workers
from slimcomm import _comm
from slimcomm._comm import CollectiveError
from slimcomm.ist import GPTISTTrainer, extract_gpt_subnet, partition, write_back_gpt
from slimcomm.ist.transformer import _build_gpt_plan
from slimcomm.train.workloads.models import GPT

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
V, T, B = 23, 8, 2


def _gpt(seed=0, n_layer=2, n_embd=16, n_head=4, dropout=0.0):
    torch.manual_seed(seed)
    return GPT(V, block_size=T, n_layer=n_layer, n_embd=n_embd, n_head=n_head, dropout=dropout)


def _batch(rank, t):
    g = torch.Generator().manual_seed(7919 * rank + t)
    x = torch.randint(0, V, (B, T), generator=g)
    return x, torch.roll(x, -1, dims=1)


def _loss(logits, y):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _adamw(params):
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1)


# ---------------------------------------------------------------------------
# Slicing (one process)
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_extract_then_write_back_is_bit_exact_identity(world_size):
    m = _gpt()
    before = _state(m)
    blocks = partition(_build_gpt_plan(m).widths, world_size, 5, 2)
    subs = [extract_gpt_subnet(m, blocks, r) for r in range(world_size)]
    with torch.no_grad():  # training a subnet leaves the model alone
        for s in subs:
            s.flat.add_(1.0)
    assert _equal(before, _state(m))
    for r, s in enumerate(subs):
        with torch.no_grad():
            s.flat.sub_(1.0)
        write_back_gpt(m, extract_gpt_subnet(m, blocks, r), blocks, r)
    assert _equal(before, _state(m))


def test_write_back_writes_exactly_the_ranks_slices():
    m = _gpt()
    plan = _build_gpt_plan(m)
    blocks = partition(plan.widths, 2, 1, 0)
    s = extract_gpt_subnet(m, blocks, 1)
    with torch.no_grad():
        s.flat.fill_(7.0)
    before = _state(m)
    write_back_gpt(m, s, blocks, 1)
    after = _state(m)
    hd, d = plan.head_dim, plan.d
    for l in range(plan.n_layer):
        heads, ffn = blocks[l][1], blocks[plan.n_layer + l][1]
        cols = (heads[:, None] * hd + torch.arange(hd)).reshape(-1)
        rows = torch.cat([p * d + cols for p in range(3)])
        p = f"blocks.{l}."
        mask = torch.zeros(3 * d, d, dtype=torch.bool)
        mask[rows] = True
        w = after[p + "attn.qkv.weight"]
        assert (w[mask] == 7).all() and torch.equal(w[~mask], before[p + "attn.qkv.weight"][~mask])
        pw = after[p + "attn.proj.weight"]
        assert (pw[:, cols] == 7).all()
        keep = torch.ones(d, dtype=torch.bool)
        keep[cols] = False
        assert torch.equal(pw[:, keep], before[p + "attn.proj.weight"][:, keep])
        assert (after[p + "mlp.0.weight"][ffn] == 7).all() and (after[p + "mlp.2.weight"][:, ffn] == 7).all()
        other = torch.ones(plan.ffn, dtype=torch.bool)
        other[ffn] = False
        assert torch.equal(after[p + "mlp.0.bias"][other], before[p + "mlp.0.bias"][other])
    for name in plan.shared:  # copied whole by write_back_gpt
        assert (after[name] == 7).all()


@pytest.mark.parametrize("rescale", [True, False])
def test_subnet_forward_equals_masked_full_model(rescale):
    """The subnet computes the full model with the other ranks' heads and FFN neurons removed
    from the residual branches and the kept ones scaled by n / |set|."""
    m = _gpt(n_head=4)
    plan = _build_gpt_plan(m)
    blocks = partition(plan.widths, 3, 2, 1)
    sub = extract_gpt_subnet(m, blocks, 2, rescale=rescale)
    ref = copy.deepcopy(m)
    hd = plan.head_dim
    with torch.no_grad():
        for l, blk in enumerate(ref.blocks):
            heads, ffn = blocks[l][2], blocks[plan.n_layer + l][2]
            ca = plan.n_head / heads.numel() if rescale else 1.0
            cf = plan.ffn / ffn.numel() if rescale else 1.0
            cols = (heads[:, None] * hd + torch.arange(hd)).reshape(-1)
            keep = torch.zeros(plan.d, dtype=torch.bool)
            keep[cols] = True
            blk.attn.proj.weight[:, ~keep] = 0
            blk.attn.proj.weight[:, keep] *= ca
            keepf = torch.zeros(plan.ffn, dtype=torch.bool)
            keepf[ffn] = True
            blk.mlp[2].weight[:, ~keepf] = 0
            blk.mlp[2].weight[:, keepf] *= cf
    x, _ = _batch(0, 0)
    torch.testing.assert_close(sub(x), ref(x), rtol=1e-5, atol=1e-5)


def test_world_size_one_subnet_is_the_model_bit_for_bit():
    m = _gpt()
    sub = extract_gpt_subnet(m, partition(_build_gpt_plan(m).widths, 1, 0, 0), 0)
    x, _ = _batch(0, 3)
    assert torch.equal(sub(x), m(x))
    assert sub.attn_scale == [1.0, 1.0] and sub.ffn_scale == [1.0, 1.0]


def test_world_size_one_equals_plain_training():
    """One rank: GPTISTTrainer = plain AdamW training of the full model with the optimizer
    re-created every local_steps steps (its documented reset), bit for bit."""
    m, ref = _gpt(), _gpt()
    tr = GPTISTTrainer(m, _adamw, local_steps=3)
    opt = None
    for t in range(8):
        if t % 3 == 0:
            opt = _adamw(ref.parameters())
        x, y = _batch(0, t)
        opt.zero_grad(set_to_none=True)
        lref = _loss(ref(x), y)
        lref.backward()
        opt.step()
        assert tr.step(x, y, _loss) == float(lref.detach())
    tr.synchronize()
    assert tr.stats.rounds == 3 and tr.stats.steps == 8
    assert _equal(_state(ref), _state(m))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_round_trip_and_training(dtype):
    m = _gpt().to(dtype)
    before = _state(m)
    blocks = partition(_build_gpt_plan(m).widths, 2, 3, 0)
    for r in range(2):
        sub = extract_gpt_subnet(m, blocks, r)
        assert sub.flat.dtype == dtype
        write_back_gpt(m, sub, blocks, r)
    assert _equal(before, _state(m))
    tr = GPTISTTrainer(m, lambda p: torch.optim.SGD(p, lr=0.1), local_steps=2, max_grad_norm=1.0)
    for t in range(4):
        assert math.isfinite(tr.step(*_batch(0, t), lambda lo, y: _loss(lo.float(), y)))
    assert tr.stats.rounds == 2 and tr.skipped_steps == 0
    assert all(p.dtype == dtype and bool(torch.isfinite(p).all()) for p in m.parameters())
    assert not _equal(before, _state(m))


def test_non_finite_step_is_skipped_and_leaves_weights_finite():
    m = _gpt()
    tr = GPTISTTrainer(m, _adamw, local_steps=4)
    x, y = _batch(0, 0)
    tr.step(x, y, _loss)
    before = tr.subnet.flat.clone()
    value = tr.step(x, y, lambda lo, yy: _loss(lo, yy) * float("nan"))
    assert math.isnan(value) and tr.skipped_steps == 1
    assert torch.equal(tr.subnet.flat, before)   # no update from the NaN step
    tr.step(x, y, _loss)
    tr.step(x, y, _loss)  # synchronises
    assert all(bool(torch.isfinite(p).all()) for p in m.parameters())


def test_bad_arguments_raise_naming_them():
    m = _gpt()
    with pytest.raises(ValueError, match="local_steps"):
        GPTISTTrainer(m, _adamw, local_steps=0)
    with pytest.raises(TypeError, match="optimizer_factory"):
        GPTISTTrainer(m, "adam")
    with pytest.raises(ValueError, match="max_grad_norm"):
        GPTISTTrainer(m, _adamw, max_grad_norm=-1.0)
    with pytest.raises(TypeError, match="rescale"):
        GPTISTTrainer(m, _adamw, rescale=1)
    with pytest.raises(ValueError, match="timeout"):
        GPTISTTrainer(m, _adamw, timeout=0)
    with pytest.raises(TypeError, match="model.tok_emb"):
        GPTISTTrainer(nn.Linear(3, 3), _adamw)
    bad = _gpt()
    bad.blocks[1].mlp[1] = nn.ReLU()
    with pytest.raises(TypeError, match=r"model.blocks\[1\].mlp"):
        GPTISTTrainer(bad, _adamw)
    tr = GPTISTTrainer(m, _adamw)
    with pytest.raises(ValueError, match="inputs"):
        tr.step(torch.zeros(B, T), torch.zeros(B, T, dtype=torch.long), _loss)
    with pytest.raises(ValueError, match="loss_fn"):
        tr.step(*_batch(0, 0), lambda lo, y: lo)
    blocks = partition(_build_gpt_plan(m).widths, 2, 0, 0)
    with pytest.raises(ValueError, match="rank"):
        extract_gpt_subnet(m, blocks, 2)
    with pytest.raises(ValueError, match="blocks"):
        extract_gpt_subnet(m, blocks[:-1], 0)
    with pytest.raises(ValueError, match="model.n_head = 4"):   # 4 heads, a partition for 5 ranks
        extract_gpt_subnet(m, [partition([5], 5, 0, 0)[0]] * 2 + partition([64, 64], 5, 0, 0), 0)
    with pytest.raises(TypeError, match="GPTSubnet"):
        write_back_gpt(m, nn.Linear(2, 2), blocks, 0)


# ---------------------------------------------------------------------------
# Distributed (gloo)
# ---------------------------------------------------------------------------

def _flat_model(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _replicas_body(rank, world_size, steps, local_steps):
    m = _gpt(seed=rank)   # different on purpose: the trainer broadcasts rank 0's model
    tr = GPTISTTrainer(m, _adamw, local_steps=local_steps, seed=11, max_grad_norm=1.0, timeout=60)
    identical = []
    for t in range(steps):
        tr.step(*_batch(rank, t), _loss)
        if tr._local_step == 0:   # just synchronised
            mine = _flat_model(m)
            every = [torch.empty_like(mine) for _ in range(world_size)]
            dist.all_gather(every, mine)
            identical.append(all(torch.equal(every[0], e) for e in every))
    return dict(identical=identical, rounds=tr.stats.rounds, final=_flat_model(m))


@pytest.mark.parametrize("world_size", [2, 3])
def test_replicas_identical_after_every_synchronisation(world_size):
    res = run_workers(_replicas_body, world_size, 9, 3, timeout=120)
    for r in res:
        assert r["identical"] == [True, True, True] and r["rounds"] == 3
        assert torch.isfinite(r["final"]).all()
    assert not torch.equal(res[0]["final"], _flat_model(_gpt(seed=0)))   # it trained


def _roundtrip_body(rank, world_size):
    m = _gpt(seed=0)
    before = _state(m)
    tr = GPTISTTrainer(m, lambda p: torch.optim.SGD(p, lr=0.0), local_steps=2, timeout=60)
    for t in range(2):
        tr.step(*_batch(rank, t), _loss)
    return _equal(before, _state(m)), tr.stats.rounds


@pytest.mark.parametrize("world_size", [2, 3])
def test_synchronisation_without_training_leaves_the_model_unchanged(world_size):
    assert run_workers(_roundtrip_body, world_size, timeout=120) == [(True, 1)] * world_size


def _resume_body(rank, world_size):
    def make(seed):
        m = _gpt(seed=seed)
        return m, GPTISTTrainer(m, _adamw, local_steps=3, seed=4, max_grad_norm=0.5, timeout=60)

    m, tr = make(0)
    for t in range(8):
        tr.step(*_batch(rank, t), _loss)
    tr.synchronize()
    straight = _state(m)

    m, tr = make(0)
    for t in range(5):                       # stop mid-round (local step 2 of 3)
        tr.step(*_batch(rank, t), _loss)
    buf = io.BytesIO()
    torch.save(tr.state_dict(), buf)
    del m, tr
    m, tr = make(99)                         # other initial weights: the checkpoint must win
    tr.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=False))
    for t in range(5, 8):
        tr.step(*_batch(rank, t), _loss)
    tr.synchronize()
    return _equal(straight, _state(m)), tr.stats.rounds, tr.stats.steps


def test_bit_exact_resume_mid_round():
    assert run_workers(_resume_body, 2, timeout=180) == [(True, 3, 8)] * 2


def _uneven_body(rank, world_size, case):
    m = _gpt(seed=0)
    tr = GPTISTTrainer(m, _adamw, local_steps=3, timeout=30)
    n = 5 if rank == 0 else 8

    def loop():
        for t in range(n):
            if t == 4:
                tr.optimizer.zero_grad(set_to_none=True)   # the trainer re-attaches its views
            tr.step(*_batch(rank, t), _loss)

    try:
        if case == "join":
            with tr.join():
                loop()
        else:
            loop()
            tr.synchronize()
        err = None
    except CollectiveError as exc:
        err = str(exc)
    return dict(err=err, round=tr.round, final=_flat_model(m))


def test_uneven_inputs_raise_on_every_rank_and_join_handles_them():
    res = run_workers(_uneven_body, 2, "plain", timeout=120)
    assert all(r["err"] is not None and "different points" in r["err"] for r in res), res
    res = run_workers(_uneven_body, 2, "join", timeout=120)
    assert res[0]["err"] is None and res[1]["err"] is None, res
    assert res[0]["round"] == res[1]["round"] == 3     # rounds end at steps 3, 6 and 8
    assert torch.equal(res[0]["final"], res[1]["final"])


def _grad_scale_body(rank, world_size):
    m = _gpt(seed=0, n_head=4)
    tr = GPTISTTrainer(m, lambda p: torch.optim.SGD(p, lr=0.0), local_steps=5, timeout=30)
    x, y = _batch(rank, 0)
    tr.step(x, y, _loss)
    ref = extract_gpt_subnet(m, tr.blocks, rank)          # the same subnet, unscaled gradients
    _loss(ref(x), y).backward()
    out = {}
    for name in ref._names:
        got, raw = tr.subnet.tensor(name).grad, ref.tensor(name).grad
        out[name] = (torch.equal(got, raw * 0.5), torch.equal(got, raw), bool(raw.abs().sum() > 0))
    return out


def test_gradients_of_sliced_tensors_are_scaled_by_their_share():
    """2 ranks, 4 heads and 64 FFN neurons: c = 2 everywhere, so every sliced tensor's
    gradient is exactly half the subnet's raw gradient and every shared one is unscaled."""
    for res in run_workers(_grad_scale_body, 2, timeout=120):
        plan = _build_gpt_plan(_gpt(n_head=4))
        for s in plan.sliced:
            assert res[s.name][0] and res[s.name][2], s.name
        for name in plan.shared:
            assert res[name][1] and res[name][2], name


def _bytes_body(rank, world_size):
    handed = []
    real = _comm.all_gather

    def counting(output, input, group=None, timeout=None):
        handed.append(input.numel() * input.element_size())
        return real(output, input, group, timeout)

    _comm.all_gather = counting
    m = _gpt(n_head=4, n_embd=16)
    tr = GPTISTTrainer(m, _adamw, local_steps=2, timeout=60)
    for t in range(4):
        tr.step(*_batch(rank, t), _loss)
    plan = _build_gpt_plan(m)
    params = dict(m.named_parameters())
    sliced = sum(params[s.name].numel() for s in plan.sliced)
    shared = sum(params[n].numel() for n in plan.shared)
    return dict(handed=handed, stats=tr.stats, sliced=sliced, shared=shared)


def test_bytes_per_rank_per_round_shrink_with_world_size():
    per_round = {}
    for w in (2, 4):
        res = run_workers(_bytes_body, w, timeout=180)
        for r in res:
            st = r["stats"]
            assert len(r["handed"]) == st.rounds == 2
            assert sum(r["handed"]) == st.bytes_sent // (w - 1) == st.payload_bytes   # widths divide W
            # analytic: this rank's 1/W of every block's sliced tensors, plus the shared tensors whole
            assert r["handed"][0] == 4 * (r["sliced"] // w + r["shared"])
        per_round[w] = res[0]["handed"][0]
        full = 4 * (res[0]["sliced"] + res[0]["shared"])
    assert full > per_round[2] > per_round[4]


def _bad_heads_body(rank, world_size):
    try:
        GPTISTTrainer(_gpt(n_head=2, n_embd=16) if rank == 0 else _gpt(n_head=4, n_embd=16), _adamw,
                      timeout=30)
    except Exception as exc:  # noqa: BLE001
        return type(exc).__name__, str(exc)
    return None


def test_too_few_heads_raise_on_every_rank_without_hanging():
    res = run_workers(_bad_heads_body, 3, timeout=120)
    assert res[0][0] == "ValueError" and "model.n_head = 2" in res[0][1]
    for kind, msg in res[1:]:
        assert kind == "RuntimeError" and "another rank" in msg


def _victim(rank, world_size, how):
    from test_collective_failures import _die, _train_until_failure

    m = _gpt(seed=0)
    tr = GPTISTTrainer(m, _adamw, local_steps=2, seed=3, timeout=20.0)
    snap = {}

    def step(t):
        if rank == world_size - 1 and t == 5:
            _die(how)
        snap["w"] = [p.detach().clone() for p in m.parameters()]
        tr.step(*_batch(rank, t), _loss)

    out = _train_until_failure(rank, 10, step, m, lambda: snap["w"])
    if out["raised"]:
        try:
            tr.step(*_batch(rank, 0), _loss)
            out["reuse"] = None
        except CollectiveError as exc:
            out["reuse"] = str(exc)
    return out


@pytest.mark.parametrize("how", ["sigkill", "exit"])
def test_survivor_raises_when_a_rank_dies(how):
    from test_collective_failures import _outcomes

    outs = _outcomes(_victim, 2, how)
    code, status, res = outs[0]
    assert status == "ok" and res["raised"], res
    assert code != 0 and res["type"] == "CollectiveError", res
    assert "GPTISTTrainer.synchronize" in res["msg"] and "a collective failed" in res["msg"], res["msg"]
    assert res["seconds"] < 20 and res["finite"] and res["unchanged"], res
    assert "cannot be used after a failed" in (res.get("reuse") or ""), res
    assert outs[1][0] != 0


# ---------------------------------------------------------------------------
# The training command
# ---------------------------------------------------------------------------

def test_training_command_ist_gpt(tmp_path):
    text = tmp_path / "story.txt"
    text.write_text("The quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs.\n" * 60)
    out = tmp_path / "ist.json"
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    r = subprocess.run([sys.executable, "-m", "slimcomm.train", "--method", "ist", "--model", "gpt",
                        "--world-size", "2", "--text-file", str(text), "--out", str(out),
                        "--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--block-size", "16",
                        "--batch-size", "4", "--steps", "8", "--eval-every", "4", "--val-batches", "2",
                        "--local-steps", "2", "--no-progress", "--threads", "1", "--timeout", "60"],
                       env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["method"] == "ist" and res["model"]["name"] == "gpt" and res["steps"] == 8
    assert res["config"]["grad_clip"] == 1.0 and res["stats"]["rounds"] == 4
    sent = res["final"]["bytes_sent_per_rank"]
    assert 0 < sent < res["final"]["dense_bytes_per_rank"]
    assert sent == res["stats"]["bytes_sent"]   # (W - 1) = 1
    assert all(math.isfinite(e["val_loss"]) for e in res["evals"])


def test_report_script_reads_the_committed_results():
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    dirs = [os.path.join("bench", "results", "ist_gpt", d) for d in ("w2_s300", "w4_s200")]
    r = subprocess.run([sys.executable, os.path.join("bench", "ist_gpt_report.py"), *dirs], env=env,
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 0, r.stderr
    committed = open(os.path.join(REPO, "bench", "results", "ist_gpt.md")).read()
    assert r.stdout.strip() in committed    # the committed tables are this script's output
    assert r.stdout.count("| 100mbit |") == 4


def _sync_op_counts(rank, world_size, n_layer):
    from slimcomm._opcount import OpCounter
    from slimcomm.ist import transformer_trainer as tt

    m = _gpt(n_layer=n_layer, n_head=4)
    tr = GPTISTTrainer(m, lambda p: torch.optim.SGD(p, lr=0.01), local_steps=2, timeout=60)
    counter = OpCounter()
    part = {"ops": 0}
    real_partition = tt.partition

    def counted_partition(*args, **kwargs):
        before = counter.total
        out = real_partition(*args, **kwargs)
        part["ops"] += counter.total - before
        return out

    real_sync = tr.synchronize
    rows = []

    def counted_sync():
        counter.reset()
        part["ops"] = 0
        with counter:
            real_sync()
        rows.append((counter.total - part["ops"], counter.host_syncs))

    tr.synchronize = counted_sync
    tt.partition = counted_partition
    try:
        for t in range(8):
            tr.step(*_batch(rank, t), _loss)
    finally:
        tt.partition = real_partition
    return rows


def test_synchronize_ops_do_not_grow_with_depth():
    """Every synchronize after the first (whose subnet widths were not cached yet): the same
    number of dispatched ops (partition's host ops excluded) at 1 and 3 blocks, and one
    ``_local_scalar_dense`` (the finiteness check of the gathered buffer; the agreement's
    counter read is a ``.tolist()`` of a CPU tensor, not dispatched)."""
    steady = {}
    for n_layer in (1, 3):
        rows = run_workers(_sync_op_counts, 2, n_layer, timeout=120)[0]
        assert len(rows) == 4
        assert {r[1] for r in rows} == {1}, rows
        assert len({r[0] for r in rows[1:]}) == 1, rows
        steady[n_layer] = rows[1][0]
    assert steady[1] == steady[3], steady


def test_refused_checkpoint_leaves_the_model_unwritten():
    # Found by the breaker: a checkpoint of a deeper model was refused by
    # model.load_state_dict only after it had copied every tensor that fit (embeddings,
    # block 0), so the "failed" load changed 17 of the model's tensors.
    src = GPTISTTrainer(_gpt(n_layer=2), _adamw, local_steps=3)
    x, y = _batch(0, 0)
    src.step(x, y, _loss)
    saved = src.state_dict()
    model = _gpt(seed=1, n_layer=1)
    trainer = GPTISTTrainer(model, _adamw, local_steps=3)
    before = _state(model)
    with pytest.raises(RuntimeError, match="blocks.1"):
        trainer.load_state_dict(saved)
    assert _equal(_state(model), before)
