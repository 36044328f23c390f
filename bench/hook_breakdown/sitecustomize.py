"""Wall-clock breakdown of the Slim-DP hook's internals on every rank (issue 31, item 1).

Not part of the library: put this directory on ``PYTHONPATH`` and set ``SLIMPROF_DIR``
to a directory; every process of a ``slimcomm.train`` run then wraps the compressor's
internal steps (index set, core refresh, its checksum all-reduce, explore sampling,
error-feedback encode, the delayed transport's resolve/write, collective launch and
waits) with ``time.perf_counter`` timers and, every 10 steps, writes
``rank<R>.txt`` there: per name, the mean ms per call and the number of calls.
``bench/hook_breakdown/summarize.py SLIMPROF_DIR`` prints the mean over ranks.
The timers add two ``perf_counter`` calls per wrapped call and nothing else.
"""

import collections
import importlib
import os
import time

_DIR = os.environ.get("SLIMPROF_DIR")
if _DIR:
    _acc = collections.defaultdict(float)
    _cnt = collections.Counter()

    def _wrap(owner, name, key):
        f = getattr(owner, name)

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                _acc[key] += time.perf_counter() - t
                _cnt[key] += 1

        setattr(owner, name, timed)

    def _dump():
        import torch.distributed as dist

        if not dist.is_initialized():
            return
        with open(os.path.join(_DIR, f"rank{dist.get_rank()}.txt"), "w") as fh:
            for k, v in _acc.items():
                fh.write(f"{k}\t{1000 * v / max(_cnt[k], 1):.3f}\t{_cnt[k]}\n")

    def _install():
        comm = importlib.import_module("slimcomm._comm")
        sel = importlib.import_module("slimcomm.compressor.selection")
        fb = importlib.import_module("slimcomm.compressor.feedback")
        core = importlib.import_module("slimcomm.compressor.core")
        delayed = importlib.import_module("slimcomm.compressor.transports.delayed")
        shared = importlib.import_module("slimcomm.compressor.transports.shared")
        hooks = importlib.import_module("slimcomm.hooks")
        _wrap(core.SlimDPCompressor, "synchronize", "hook: synchronize (whole call)")
        _wrap(sel._SelectionMixin, "_refresh_core", "core refresh (every core_refresh steps)")
        _wrap(sel._SelectionMixin, "_flat_weight", "  flat weight copy")
        _wrap(sel.ops, "significance_topk_segmented", "  top-k op")
        _wrap(sel, "max_min_across_ranks", "  checksum all-reduce (blocking)")
        _wrap(sel.ops, "explore_sample_segmented", "explore sampling op")
        _wrap(fb.ops, "step_encode", "step_encode op (error feedback + pack)")
        _wrap(fb.ops, "step_commit", "step_commit op")
        for mod in (delayed, shared):
            if hasattr(mod, "_index_set"):
                _wrap(mod, "_index_set", f"index set ({mod.__name__.rsplit('.', 1)[1]})")
        _wrap(delayed, "_resolve", "delayed: resolve (wait previous + commit)")
        _wrap(delayed, "_write", "delayed: write bucket")
        _wrap(comm, "all_reduce", "collective launch")
        _wrap(comm, "wait", "collective wait")
        end = hooks.SlimDPState.end_step

        def end_step(self, *a, **k):
            out = end(self, *a, **k)
            _cnt["steps"] += 1
            if _cnt["steps"] % 10 == 0:
                _dump()
            return out

        hooks.SlimDPState.end_step = end_step

    _install()
