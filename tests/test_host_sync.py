"""No host syncs in the steady-state hot paths, on the device itself (issue 12).

On CUDA, every steady step of the Slim-DP comm hook (shared and local index
modes), of ``SlimDPOptimizer.synchronize`` and of ``ISTTrainer.synchronize``
runs under ``torch.cuda.set_sync_debug_mode("error")``: any
``cudaStreamSynchronize``, blocking device-to-host copy or ``.item()`` -- in
Python, in ATen or inside the extension's kernels -- raises. The group is
NCCL at world size 1 (gloo moves CUDA tensors through the host with its own
stream synchronisations, which the debug mode would flag). The ranks run with
the library's defaults: the hot paths wrap their ops in
``slimcomm.ops.trusted_indices()``, so the ops validate index VALUES on the
device (a trap on a bad one) instead of reading the check's result back, the
one host sync the CUDA kernels keep by default for direct calls
(csrc/cuda/cuda_utils.cuh); a separate test checks that such a bad index does
stop the stream. A second CUDA
test runs the hook and IST on CUDA tensors with 2 processes on one GPU over
gloo and checks that the replicas agree.

Without a GPU the same bodies run on CPU with gloo, counting
``aten._local_scalar_dense`` (:class:`slimcomm._opcount.OpCounter`) instead,
so the harness itself is checked everywhere.
"""

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from _dist import run_workers

from slimcomm import compressor
from slimcomm._opcount import OpCounter, synchronous_collectives

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


def _device(device):
    if device == "cuda":
        torch.cuda.set_device(0)
        return torch.device("cuda", 0)
    return torch.device("cpu")


@contextlib.contextmanager
def _no_host_sync(dev, counter):
    """Raise on any host sync inside (CUDA debug mode on a GPU); count the
    dispatched ``_local_scalar_dense`` calls in ``counter`` everywhere."""
    if dev.type == "cuda":
        torch.cuda.set_sync_debug_mode("error")
    try:
        with counter:
            yield
    finally:
        if dev.type == "cuda":
            torch.cuda.set_sync_debug_mode(0)


def _mlp(dev, width=32, depth=3):
    torch.manual_seed(0)
    layers = [nn.Linear(12, width), nn.ReLU()]
    for _ in range(depth - 2):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 5)).to(dev)


def _hook_body(rank, world_size, device, mode, steps=9, warmup=2, refresh=3):
    from slimcomm.hooks import SlimDPState, slim_dp_hook
    dev = _device(device)
    model = _mlp(dev)
    ddp = DDP(model, bucket_cap_mb=1, device_ids=[0] if dev.type == "cuda" else None)
    state = SlimDPState(core_ratio=0.1, explore_ratio=0.05, core_refresh=refresh,
                        warmup_steps=warmup, index_mode=mode, min_compress_numel=0)
    state.attach(ddp)
    counter = OpCounter()
    checked = []

    def hook(st, bucket):
        # warm-up steps and the first compressed step (which builds the per-bucket
        # layout state) may synchronise; every later step may not
        if st.step > warmup:
            checked.append(st.step)
            with _no_host_sync(dev, counter):
                return slim_dp_hook(st, bucket)
        return slim_dp_hook(st, bucket)

    ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    with synchronous_collectives(compressor):
        for _ in range(steps):
            x = torch.randn(8, 12, generator=g).to(dev)
            opt.zero_grad()
            ddp(x).square().sum().backward()
            opt.step()
    return dict(syncs=counter.host_syncs, checked=sorted(set(checked)),
                params=[p.detach().cpu() for p in model.parameters()])


def _opt_body(rank, world_size, device, compression, steps=6):
    from slimcomm.optim import SlimDPOptimizer
    dev = _device(device)
    model = _mlp(dev)
    inner = torch.optim.SGD(model.parameters(), lr=0.01)
    bits = 2 if compression == "dense-2bit" else None  # the two-stage low-bit all-reduce
    opt = SlimDPOptimizer(model, inner, sync_every=1, compression=compression.split("-")[0],
                          core_ratio=0.1, explore_ratio=0.05, core_refresh=2,
                          outer_momentum=0.9, value_bits=bits)
    counter = OpCounter()
    real_sync = opt._synchronize   # what step() -> advance() calls every sync_every steps
    calls = []

    def checked_sync(final):
        calls.append(1)
        if len(calls) == 1:   # the first sync builds the compressor's state
            return real_sync(final)
        with _no_host_sync(dev, counter):
            return real_sync(final)

    opt._synchronize = checked_sync
    g = torch.Generator().manual_seed(rank)
    with synchronous_collectives(compressor):
        for _ in range(steps):
            inner.zero_grad()
            model(torch.randn(8, 12, generator=g).to(dev)).square().sum().backward()
            opt.step()
    return dict(syncs=counter.host_syncs, checked=len(calls) - 1)


def _ist_body(rank, world_size, device, rounds=4, local_steps=2):
    from slimcomm.ist import ISTTrainer
    dev = _device(device)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 32), nn.BatchNorm1d(32), nn.ReLU(),
                          nn.Linear(32, 32), nn.LayerNorm(32), nn.ReLU(),
                          nn.Linear(32, 5)).to(dev)
    trainer = ISTTrainer(model, lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
                         local_steps=local_steps, seed=1)
    counter = OpCounter()
    real_sync = trainer.synchronize
    calls = []

    def checked_sync():
        calls.append(1)
        with _no_host_sync(dev, counter):
            return real_sync()

    trainer.synchronize = checked_sync
    g = torch.Generator().manual_seed(rank)
    for _ in range(rounds * local_steps):
        x = torch.randn(8, 12, generator=g).to(dev)
        y = torch.randint(0, 5, (8,), generator=g).to(dev)
        trainer.step(x, y, nn.functional.cross_entropy)
    return dict(syncs=counter.host_syncs, checked=len(calls),
                state={k: v.detach().cpu() for k, v in model.state_dict().items()})


def _run(body, device, *args, world_size=1, monkeypatch=None):
    backend = "nccl" if device == "cuda" and world_size == 1 else "gloo"
    return run_workers(body, world_size, device, *args, timeout=240, backend=backend)


DEVICES = ["cuda"] if CUDA else ["cpu"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["shared", "local"])
def test_hook_steady_steps_have_no_host_sync(device, mode, monkeypatch):
    res = _run(_hook_body, device, mode, monkeypatch=monkeypatch)[0]
    assert len(res["checked"]) >= 5, res["checked"]   # compressed and refresh steps
    assert res["syncs"] == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("compression", ["shared", "local", "dense-2bit"])
def test_optimizer_sync_has_no_host_sync(device, compression, monkeypatch):
    res = _run(_opt_body, device, compression, monkeypatch=monkeypatch)[0]
    assert res["checked"] >= 4 and res["syncs"] == 0, res


@pytest.mark.parametrize("device", DEVICES)
def test_ist_synchronize_has_no_host_sync(device, monkeypatch):
    res = _run(_ist_body, device, monkeypatch=monkeypatch)[0]
    assert res["checked"] == 4 and res["syncs"] == 0, res


@needs_cuda
def test_hook_and_ist_on_cuda_tensors_over_gloo_two_processes():
    """2 processes share the one GPU; gloo moves the CUDA tensors. Replicas agree."""
    for mode in ("shared", "local"):
        a, b = run_workers(_hook_body_plain, 2, mode, timeout=240)
        for x, y in zip(a, b):
            assert torch.equal(x, y), mode
    a, b = run_workers(_ist_body_plain, 2, timeout=240)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _hook_body_plain(rank, world_size, mode):
    from slimcomm.hooks import SlimDPState, slim_dp_hook
    dev = _device("cuda")
    model = _mlp(dev)
    ddp = DDP(model, bucket_cap_mb=1, device_ids=[0])
    state = SlimDPState(core_ratio=0.1, explore_ratio=0.05, core_refresh=3,
                        warmup_steps=2, index_mode=mode, min_compress_numel=0)
    state.attach(ddp)
    ddp.register_comm_hook(state, slim_dp_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    for _ in range(8):
        opt.zero_grad()
        ddp(torch.randn(8, 12, generator=g).to(dev)).square().sum().backward()
        opt.step()
    torch.cuda.synchronize()
    return [p.detach().cpu() for p in model.parameters()]


def _ist_body_plain(rank, world_size):
    from slimcomm.ist import ISTTrainer
    dev = _device("cuda")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 32), nn.BatchNorm1d(32), nn.ReLU(),
                          nn.Linear(32, 5)).to(dev)
    trainer = ISTTrainer(model, lambda p: torch.optim.SGD(p, lr=0.05), local_steps=2, seed=1)
    g = torch.Generator().manual_seed(rank)
    for _ in range(6):
        x = torch.randn(8, 12, generator=g).to(dev)
        y = torch.randint(0, 5, (8,), generator=g).to(dev)
        trainer.step(x, y, nn.functional.cross_entropy)
    dist.barrier()
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def _bad_index_body(rank, world_size, op, trusted=False):
    from slimcomm import ops
    dev = _device("cuda")
    x = torch.randn(100, device=dev)
    bad = torch.tensor([3, 100], device=dev)
    ctx = ops.trusted_indices() if trusted else contextlib.nullcontext()
    try:
        with ctx:
            if op == "pack":
                ops.pack(x, bad)
            elif op == "unpack":
                ops.unpack(x, bad, torch.ones(2, device=dev))
            else:
                ops.explore_sample(50, torch.tensor([7, 7], device=dev), 3, 0, 0)
            torch.cuda.synchronize()
    except RuntimeError as e:
        return str(e)
    return None


@needs_cuda
@pytest.mark.parametrize("how", ["env", "trusted_indices"])
@pytest.mark.parametrize("op", ["pack", "unpack", "explore_sample"])
def test_device_checks_stop_the_stream_on_a_bad_value(op, how, monkeypatch):
    """SLIMCOMM_CUDA_CHECKS=device or ops.trusted_indices(): no host sync, but a bad index
    still never passes silently: the device traps and the next synchronisation raises
    (the CUDA context is lost, so each case runs in its own process)."""
    if how == "env":
        monkeypatch.setenv("SLIMCOMM_CUDA_CHECKS", "device")
    err = run_workers(_bad_index_body, 1, op, how == "trusted_indices", timeout=120)[0]
    assert err is not None and "CUDA" in err, err


def test_trusted_indices_is_thread_local_nested_and_restored():
    import threading

    from slimcomm import ops
    mode = torch.ops.slimcomm._cuda_checks
    assert mode("env") == "env"
    with ops.trusted_indices():
        assert mode("device") == "device"
        with ops.trusted_indices():
            seen = []
            t = threading.Thread(target=lambda: seen.append(mode("env")))
            t.start()
            t.join()
            assert seen == ["env"]  # another thread keeps its own mode
        assert mode("device") == "device"  # the inner block restored the outer one
    assert mode("env") == "env"
    wrapped = ops.run_trusted(lambda: mode("device"))
    assert wrapped() == "device" and mode("env") == "env"
    with pytest.raises(RuntimeError, match="argument 'mode' must be 'env', 'host' or 'device'"):
        mode("off")
