"""The priority of gloo's event-loop threads (slimcomm.train.comm_threads): only those
threads change, collectives still complete, bad policies are refused."""

import os
import subprocess
import sys
import threading

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from _dist import run_workers  # noqa: E402

from slimcomm.train import comm_threads as C  # noqa: E402

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="thread priorities are read through /proc (Linux)")


def _policies():
    return sorted(C.thread_policy(t) for t in C._loop_threads())


def _body(rank, world_size, policy):
    main = threading.get_native_id()
    before = _policies()
    n = C.set_comm_thread_priority(policy)
    after = _policies()
    t = torch.full((1000,), float(rank + 1))
    dist.all_reduce(t)  # the lowered loop thread still moves the bytes
    return {"before": before, "n": n, "after": after, "sum": t[0].item(),
            "main": C.thread_policy(main)}


@pytest.mark.parametrize("policy", ["idle", "low", "normal"])
def test_only_loop_threads_change(policy):
    out = run_workers(_body, 2, policy, timeout=120)
    for r in out:
        assert r["before"] and set(r["before"]) == {"normal"}  # gloo started its loop thread(s)
        assert r["n"] == (0 if policy == "normal" else len(r["before"]))
        assert set(r["after"]) == {policy} and len(r["after"]) == len(r["before"])
        assert r["main"] == "normal"  # the training thread keeps its priority
        assert r["sum"] == 3.0


def test_without_gloo_nothing_changes():
    """A process with no gloo group (NCCL, or before init) has no loop thread to lower."""
    code = ("from slimcomm.train import comm_threads as C; "
            "assert C._loop_threads() == []; print(C.set_comm_thread_priority('idle'))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "0"


@pytest.mark.parametrize("bad", ["high", "", None, 19])
def test_bad_policy_names_the_argument(bad):
    with pytest.raises(ValueError, match="policy must be one of normal, low, idle"):
        C.set_comm_thread_priority(bad)
