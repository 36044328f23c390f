"""The device-side fallbacks of the CUDA selection kernels, forced (needs a GPU).

With ``SLIMCOMM_CUDA_TEST_FALLBACKS=1`` (read once per process, so each case
runs in a fresh spawned process) the top-k candidate buffer shrinks to k / 2
and explore_sample's draws to t / 2, so the paths that normally run only
beyond 8 standard deviations -- the gated radix-select fallback and the
candidates + ties ending of top-k, the on-device continuation of the draw
sequence of explore_sample -- decide and run on the device. Their results
must equal the CPU kernels' exactly. (The numpy mirror of the same control
flow, tests/test_cuda_control_flow.py, runs without a GPU.)
"""

import pytest
import torch

from _dist import run_workers

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _body(rank, world_size):
    from slimcomm import ops
    torch.manual_seed(0)
    bad = []
    n = 200_003  # > the one-block segment limits: device-wide paths
    for kind in ("random", "zero_grad", "few"):
        w = torch.randn(n)
        g = {"random": torch.randn(n), "zero_grad": torch.zeros(n),
             "few": torch.randint(0, 4, (n,)).float()}[kind]
        for k in (1, 37, n // 100, n // 3, n - 5):
            ci, cv = ops.significance_topk(w, g, k)
            di, dv = ops.significance_topk(w.cuda(), g.cuda(), k)
            if not (torch.equal(ci, di.cpu()) and torch.equal(cv, dv.cpu())):
                bad.append(("topk", kind, k))
    ex = torch.arange(5, n, 101)
    for m in (1, 50, 2000, (n - ex.numel()) // 2, (n - ex.numel()) * 3 // 4, n - ex.numel() - 1):
        for seed, off in ((0, 0), (7, 3)):
            c = ops.explore_sample(n, ex, m, seed, off)
            d = ops.explore_sample(n, ex.cuda(), m, seed, off)
            if not torch.equal(c, d.cpu()):
                bad.append(("explore", m, seed, off))
    torch.cuda.synchronize()
    return bad


def test_forced_fallbacks_equal_cpu(monkeypatch):
    monkeypatch.setenv("SLIMCOMM_CUDA_TEST_FALLBACKS", "1")
    assert run_workers(_body, 1, timeout=300)[0] == []


def test_normal_paths_equal_cpu_on_the_same_cases():
    assert run_workers(_body, 1, timeout=300)[0] == []
