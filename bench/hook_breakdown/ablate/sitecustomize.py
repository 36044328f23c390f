"""Ablations of the Slim-DP hook's step (issue 31): what each part of it costs.

Not part of the library. ``bench/hook_breakdown/ablations.py`` puts this directory on
``PYTHONPATH`` with ``SLIMCOMM_ABLATE`` set to one of the names below; every process of the
``slimcomm.train`` run then replaces one piece of the method and nothing else:

``hook-none``       the DDP comm hook hands the bucket back at once (no compressor, no
                    collective): DDP's own cost over a step without it.
``hook-barrier``    the hook only all-reduces one bf16 value (checked, bounded wait), then
                    hands the bucket back: what any per-step collective costs by itself.
``hook-payload``    the hook all-reduces as many bf16 zeros as Slim-DP's payload of the
                    bucket (``k + m`` values per parameter, one flag each), no compressor.
``no-collective``   the whole compressor, but the values all-reduce is replaced by a
                    completed future of this rank's own payload (the replicas drift apart:
                    keep the run shorter than the agreement check, 100 steps).
``no-optimizer``    the whole method; the optimizer's ``step`` does nothing.
``no-bucket-write`` the whole method; ``step_commit`` keeps ``G`` and the residual but does
                    not write the bucket (``write_buf=False``), and the optimizer's ``step``
                    does nothing: the dense work a sparse SGD step fused into the commit
                    (``param[idx] -= lr * avg``) would leave, without that sparse update.

The numbers trained under an ablation are meaningless (except ``hook-*`` timing); only the
ms per step is read.
"""

import importlib
import os

_MODE = os.environ.get("SLIMCOMM_ABLATE")
_MODES = ("hook-none", "hook-barrier", "hook-payload", "no-collective", "no-optimizer",
          "no-bucket-write")


def _completed(value):
    import torch

    fut = torch.futures.Future()
    fut.set_result(value)
    return fut


def _install(mode):
    import torch

    hooks = importlib.import_module("slimcomm.hooks")
    comm = importlib.import_module("slimcomm._comm")
    if mode.startswith("hook-"):
        def hook(state, bucket):
            buf = bucket.buffer()
            if mode == "hook-none":
                return _completed(buf)
            if mode == "hook-barrier":
                n = 1
            else:
                n = len(bucket.parameters())  # the flags
                for p in bucket.parameters():
                    k, m, dense = hooks.selection_sizes(p.numel(), state.core_ratio,
                                                        state.explore_ratio,
                                                        state.min_compress_numel)
                    n += p.numel() if dense else k + m
            wire = torch.zeros(n, dtype=torch.bfloat16, device=buf.device)
            fut = comm.all_reduce(wire, state.group, timeout=state._timeout).get_future()
            return fut.then(lambda f: buf)

        hooks.slim_dp_hook = hook
    if mode == "no-collective":
        shared = importlib.import_module("slimcomm.compressor.transports.shared")

        class _Local:
            def __getattr__(self, name):
                return getattr(comm, name)

            @staticmethod
            def all_reduce(tensor, group=None, timeout=None):
                class _Work:
                    def get_future(self):
                        return _completed([tensor])
                return _Work()

        shared._comm = _Local()
    if mode in ("no-optimizer", "no-bucket-write"):
        torch.optim.SGD.step = lambda self, closure=None: None
    if mode == "no-bucket-write":
        fb = importlib.import_module("slimcomm.compressor.feedback")
        commit = fb.ops.step_commit

        def step_commit(*a, **k):
            k["write_buf"] = False
            return commit(*a, **k)

        ops = fb.ops

        class _Proxy:
            def __getattr__(self, name):
                return step_commit if name == "step_commit" else getattr(ops, name)

        fb.ops = _Proxy()


if _MODE:
    if _MODE not in _MODES:
        raise SystemExit(f"SLIMCOMM_ABLATE must be one of {_MODES}, got {_MODE!r}")
    _install(_MODE)
