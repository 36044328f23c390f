"""Issue 23, part A: failed, timed-out and mismatched collectives of SlimDPOptimizer
and ISTTrainer raise on every surviving rank, within a bounded time, and never write
into the model; uneven inputs are handled by ``join()``; drifting sync counts raise.

The kill/hang cases use their own small spawn (below) instead of ``run_workers``,
which stops every rank as soon as one dies: here the dying rank must die and the
survivors must be observed. The process group's own timeout is 10 minutes, so a
bounded time-to-error can only come from the ``timeout`` argument under test.
"""

import io
import os
import queue as queue_mod
import shutil
import signal
import tempfile
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from _dist import run_workers
from slimcomm import ist
from slimcomm.optim import CollectiveError, SlimDPOptimizer

D_IN, D_OUT, BATCH = 16, 5, 8
PG_TIMEOUT = 600  # the process group's own timeout: far above every bound tested here


def _mlp(hidden=32):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D_IN, hidden), nn.ReLU(), nn.Linear(hidden, D_OUT))


def _batch(rank, t):
    g = torch.Generator().manual_seed(1000 * rank + t)
    x = torch.randn(BATCH, D_IN, generator=g)
    return x, (x[:, :D_OUT] * 3).argmax(1)


# ---------------------------------------------------------------------------
# A spawn in which ranks may die
# ---------------------------------------------------------------------------

def _entry(rank, world_size, init_file, fn, args, q):
    code = 0
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=PG_TIMEOUT))
        out = fn(rank, world_size, *args)
        buf = io.BytesIO()
        torch.save(out, buf)
        q.put((rank, "ok", buf.getvalue()))
        code = 1 if isinstance(out, dict) and out.get("raised") else 0
    except BaseException:  # noqa: BLE001
        q.put((rank, "error", traceback.format_exc()))
        code = 1
    q.close()
    q.join_thread()
    os._exit(code)  # no destroy_process_group: a peer may be gone


def _outcomes(fn, world_size, *args, timeout=90):
    """Every rank's ``(exit code, status, payload)``; ranks are never stopped early."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    tmp = tempfile.mkdtemp(prefix="slimcomm_fail_")
    procs = [ctx.Process(target=_entry, args=(r, world_size, os.path.join(tmp, "store"), fn,
                                               args, q), daemon=True)
             for r in range(world_size)]
    got = {}
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and (any(p.is_alive() for p in procs)
                                               or not q.empty()):
            try:
                r, status, payload = q.get(timeout=0.2)
                got[r] = (status, torch.load(io.BytesIO(payload), weights_only=False)
                          if status == "ok" else payload)
            except queue_mod.Empty:
                pass
        alive = [r for r, p in enumerate(procs) if p.is_alive()]
        assert not alive, f"ranks {alive} still running after {timeout} s (a hang)"
        return [(p.exitcode,) + got.get(r, ("died", None)) for r, p in enumerate(procs)]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        shutil.rmtree(tmp, ignore_errors=True)


def _die(how):
    if how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "hang":
        time.sleep(12)  # alive but not calling collectives; later collectives then fail
        return
    os._exit(3)


def _train_until_failure(rank, steps, step_fn, model, before_sync):
    """Run ``step_fn(t)``; on an error, record it, how long the failing step took and
    whether the model is intact: finite, and equal to ``before_sync()`` (its weights
    just before the failed synchronisation: nothing of it was written)."""
    for t in range(steps):
        t0 = time.monotonic()
        try:
            synced = step_fn(t)
        except Exception as exc:  # noqa: BLE001
            now = [p.detach() for p in model.parameters()]
            return dict(raised=True, type=type(exc).__name__, msg=str(exc),
                        seconds=time.monotonic() - t0, step=t,
                        finite=all(bool(torch.isfinite(p).all()) for p in now),
                        unchanged=all(torch.equal(a, b) for a, b in zip(now, before_sync())))
    return dict(raised=False, max_abs=max(float(p.abs().max()) for p in model.parameters()))


def _optim_victim(rank, world_size, compression, bits, how, timeout, delay=0, overlap=None):
    m = _mlp()
    compression, _, collective = compression.partition("-")  # "dense-all_gather"
    opt = SlimDPOptimizer(m, torch.optim.AdamW(m.parameters(), lr=1e-2), sync_every=2,
                          compression=compression, value_bits=bits, core_ratio=0.1,
                          explore_ratio=0.1, timeout=timeout,
                          lowbit_collective=collective or "all_reduce", delay_syncs=delay,
                          overlap_steps=overlap)
    dying = world_size - 1
    if rank == dying and how == "exit_mid_sync":
        # die after the per-sync agreement, inside the value collectives of sync 3
        real = SlimDPOptimizer._sync_collectives

        def sync(self):
            if self.syncs == 2:
                os._exit(3)
            return real(self)
        SlimDPOptimizer._sync_collectives = sync

    snap = {}

    def step(t):
        if rank == dying and t == 5 and how != "exit_mid_sync":
            _die(how)
        opt.zero_grad()
        x, y = _batch(rank, t)
        nn.functional.cross_entropy(m(x), y).backward()
        opt.inner.step()
        snap["w"] = [p.detach().clone() for p in m.parameters()]
        opt.advance()

    out = _train_until_failure(rank, 10, step, m, lambda: snap["w"])
    if out["raised"]:  # the optimizer refuses further use
        try:
            opt.step()
            out["reuse"] = None
        except CollectiveError as exc:
            out["reuse"] = str(exc)
    return out


def _check_survivors(outs, dying, bound):
    for r, (code, status, res) in enumerate(outs):
        if r == dying:
            assert code != 0, outs
            continue
        assert status == "ok", res
        assert res["raised"], f"rank {r} finished normally (weights max |w| {res['max_abs']})"
        assert code != 0
        assert res["type"] == "CollectiveError", res
        assert "a collective failed" in res["msg"] and "restart" in res["msg"], res["msg"]
        assert res["seconds"] < bound, res
        assert res["finite"] and res["unchanged"], res
        assert "cannot be used after a failed" in (res.get("reuse") or ""), res


MODES = [("shared", None), ("local", None), ("dense", None), ("shared", 2), ("dense", 2),
         ("dense-all_gather", 2)]


@pytest.mark.parametrize("compression,bits", MODES)
@pytest.mark.parametrize("how", ["exit_mid_sync", "sigkill"])
def test_optimizer_survivor_raises_when_a_rank_dies(compression, bits, how):
    outs = _outcomes(_optim_victim, 2, compression, bits, how, 20.0)
    _check_survivors(outs, 1, 20.0)


@pytest.mark.parametrize("compression,bits", [("shared", None), ("dense", None), ("dense", 2),
                                              ("dense-all_gather", 2)])
@pytest.mark.parametrize("how", ["exit_mid_sync", "sigkill"])
def test_optimizer_delayed_sync_survivor_raises_when_a_rank_dies(compression, bits, how):
    """delay_syncs=1: the collectives of a synchronisation are waited for one period later, and
    the failure is noticed there (or at the next agreement) before the model is written."""
    outs = _outcomes(_optim_victim, 2, compression, bits, how, 20.0, 1)
    _check_survivors(outs, 1, 20.0)


@pytest.mark.parametrize("how", ["exit_mid_sync", "sigkill"])
def test_optimizer_overlap_window_survivor_raises_when_a_rank_dies(how):
    """overlap_steps=1 of sync_every=2: the wait for the synchronisation in flight happens in
    the step after its launch (advance()), and a dead peer is an error there, unwritten."""
    outs = _outcomes(_optim_victim, 2, "dense", None, how, 20.0, 1, 1)
    _check_survivors(outs, 1, 20.0)


def test_optimizer_three_ranks_all_survivors_raise():
    outs = _outcomes(_optim_victim, 3, "dense", 2, "sigkill", 20.0)
    _check_survivors(outs, 2, 20.0)


def test_optimizer_hung_rank_raises_after_timeout():
    outs = _outcomes(_optim_victim, 2, "dense", 2, "hang", 2.0)
    code, status, res = outs[0]
    assert status == "ok" and res["raised"] and res["type"] == "CollectiveError", res
    assert "timeout=2 s" in res["msg"]
    assert 1.5 < res["seconds"] < 10, res  # bounded by the timeout argument, not gloo's
    assert res["finite"] and res["unchanged"], res
    assert outs[1][0] != 0  # the hung rank fails too once it resumes


def _ist_victim(rank, world_size, how, timeout):
    net = nn.Sequential(nn.Linear(D_IN, 8), nn.ReLU(), nn.Linear(8, D_OUT))
    torch.manual_seed(0)
    tr = ist.ISTTrainer(net, lambda p: torch.optim.SGD(p, lr=0.05), local_steps=2, seed=3,
                        timeout=timeout)

    snap = {}

    def step(t):
        if rank == world_size - 1 and t == 5:
            _die(how)
        snap["w"] = [p.detach().clone() for p in net.parameters()]  # full model: synced only
        tr.step(*_batch(rank, t), nn.functional.cross_entropy)

    out = _train_until_failure(rank, 10, step, net, lambda: snap["w"])
    return out


@pytest.mark.parametrize("how,bound", [("sigkill", 20.0), ("exit", 20.0), ("hang", 10.0)])
def test_ist_survivor_raises_when_a_rank_dies(how, bound):
    outs = _outcomes(_ist_victim, 2, how, 2.0 if how == "hang" else 20.0)
    code, status, res = outs[0]
    assert status == "ok" and res["raised"], res
    assert code != 0 and res["type"] == "CollectiveError", res
    assert "a collective failed" in res["msg"], res["msg"]
    assert res["seconds"] < bound and res["finite"] and res["unchanged"], res


# ---------------------------------------------------------------------------
# Drifting sync counts, uneven inputs, join()
# ---------------------------------------------------------------------------

def _catch(fn):
    try:
        fn()
    except CollectiveError as exc:
        return str(exc)
    return None


def _drift_case(rank, world_size, case, delay=0):
    m = _mlp()
    opt = SlimDPOptimizer(m, torch.optim.AdamW(m.parameters(), lr=1e-2), sync_every=4,
                          timeout=20.0, delay_syncs=delay)
    n = {"uneven": 5 if rank == 0 else 8, "join": 5 if rank == 0 else 11}.get(case, 8)

    def loop():
        for t in range(n):
            opt.zero_grad()
            x, y = _batch(rank, t)
            nn.functional.cross_entropy(m(x), y).backward()
            opt.step()
            if case == "sync_rank0" and t == 2 and rank == 0:
                opt.synchronize()  # e.g. an evaluation block on rank 0 only
        opt.synchronize()

    if case == "join":
        def loop_joined():
            with opt.join():
                for t in range(n):
                    opt.zero_grad()
                    x, y = _batch(rank, t)
                    nn.functional.cross_entropy(m(x), y).backward()
                    opt.step()
        err = _catch(loop_joined)
    else:
        err = _catch(loop)
    return dict(err=err, params=[p.detach().clone() for p in m.parameters()], syncs=opt.syncs)


@pytest.mark.parametrize("case", ["sync_rank0", "uneven"])
def test_optimizer_drifting_sync_counts_raise_on_every_rank(case):
    res = run_workers(_drift_case, 2, case, timeout=120)
    for r in range(2):
        assert res[r]["err"] is not None, f"rank {r} did not notice the drift"
        assert "different points" in res[r]["err"] and "join()" in res[r]["err"], res[r]["err"]
        assert "rank 0: local step" in res[r]["err"]


@pytest.mark.parametrize("delay", [0, 1])
def test_optimizer_join_handles_uneven_inputs(delay):
    res = run_workers(_drift_case, 2, "join", delay, timeout=120)
    assert res[0]["err"] is None and res[1]["err"] is None, res
    assert all(torch.equal(a, b) for a, b in zip(res[0]["params"], res[1]["params"]))
    assert res[0]["syncs"] == res[1]["syncs"] == 3  # steps 4, 8 and the last one at 11


def _scaler_case(rank, world_size):
    m = _mlp()
    opt = SlimDPOptimizer(m, torch.optim.SGD(m.parameters(), lr=0.1), sync_every=2,
                          timeout=20.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    for t in range(7):
        opt.zero_grad()
        x, y = _batch(rank, t)
        loss = nn.functional.cross_entropy(m(x), y)
        if rank == 1 and t == 3:
            loss = loss * float("inf")  # this rank's scaler skips the step
        scaler.scale(loss).backward()
        scaler.step(opt)  # not opt.inner: the skipped step must still be counted
        scaler.update()
    err = _catch(opt.synchronize)
    return dict(err=err, local=opt.local_step, params=[p.detach().clone() for p in m.parameters()])


def test_grad_scaler_step_on_the_optimizer_keeps_ranks_in_step():
    res = run_workers(_scaler_case, 2, timeout=120)
    assert res[0]["err"] is None and res[1]["err"] is None, res
    assert res[0]["local"] == res[1]["local"] == 7
    assert all(torch.equal(a, b) for a, b in zip(res[0]["params"], res[1]["params"]))
    assert all(bool(torch.isfinite(p).all()) for p in res[0]["params"])


def _ist_drift_case(rank, world_size, case):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(D_IN, 8), nn.ReLU(), nn.Linear(8, D_OUT))
    tr = ist.ISTTrainer(net, lambda p: torch.optim.SGD(p, lr=0.05), local_steps=3, seed=1,
                        timeout=20.0)
    n = {"sync_rank0": 6, "uneven": 4 if rank == 0 else 6, "join": 4 if rank == 0 else 8}[case]

    def loop():
        for t in range(n):
            tr.step(*_batch(rank, t), nn.functional.cross_entropy)
            if case == "sync_rank0" and t == 1 and rank == 0:
                tr.synchronize()
        tr.synchronize()

    def joined():
        with tr.join():
            for t in range(n):
                tr.step(*_batch(rank, t), nn.functional.cross_entropy)
    err = _catch(joined if case == "join" else loop)
    return dict(err=err, round=tr.round, params=[p.detach().clone() for p in net.parameters()])


@pytest.mark.parametrize("case", ["sync_rank0", "uneven"])
def test_ist_drifting_rounds_raise_on_every_rank(case):
    res = run_workers(_ist_drift_case, 2, case, timeout=120)
    for r in range(2):
        assert res[r]["err"] is not None and "different points" in res[r]["err"], res[r]


def test_ist_join_handles_uneven_inputs():
    res = run_workers(_ist_drift_case, 2, "join", timeout=120)
    assert res[0]["err"] is None and res[1]["err"] is None, res
    assert res[0]["round"] == res[1]["round"] == 3  # rounds at steps 3, 6 and the last at 8
    assert all(torch.equal(a, b) for a, b in zip(res[0]["params"], res[1]["params"]))


def _bad_timeouts(rank, world_size):
    m = _mlp()
    out = []
    for bad in (0, -1.0, float("inf"), True, "5"):
        try:
            SlimDPOptimizer(m, torch.optim.SGD(m.parameters(), lr=0.1), timeout=bad)
            out.append(None)
        except ValueError as exc:
            out.append(str(exc))
    return out


def test_timeout_argument_is_validated():
    for msg in run_workers(_bad_timeouts, 1, timeout=60)[0]:
        assert msg is not None and "timeout must be" in msg
