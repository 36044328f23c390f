"""Run a function on ``world_size`` gloo ranks from a test, without ever hanging.

Usage::

    from _dist import run_workers

    def body(rank, world_size, n):      # module-level, so it can be pickled
        t = torch.full((n,), float(rank))
        dist.all_reduce(t)
        return t                        # anything torch.save can write

    results = run_workers(body, 2, 4, timeout=60)   # [result of rank 0, rank 1]

Each rank is a fresh process (``spawn`` start method, so no OpenMP/thread state
is inherited) that joins a gloo process group through a ``FileStore`` in a
private temporary directory (no TCP port to clash with other tests), calls
``fn(rank, world_size, *args)`` and sends the return value back serialised with
``torch.save`` (so tensors survive the child's exit).

Failure handling:

* An exception in any rank is re-raised in the parent as :class:`WorkerError`
  carrying that rank's traceback; the other ranks are terminated at once
  (they may be blocked in a collective waiting for the failed rank).
* A rank that dies without reporting (segfault, ``os._exit``) raises
  :class:`WorkerError` with its exit code.
* If the ranks have not all finished within ``timeout`` seconds, every
  remaining process is terminated (then killed) and :class:`TimeoutError`
  names the ranks still running. Collectives also carry the same timeout
  (``init_process_group(timeout=...)``).
"""

from __future__ import annotations

import io
import os
import queue as queue_mod
import shutil
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["run_workers", "WorkerError"]


class WorkerError(RuntimeError):
    """A rank raised an exception or died; the message holds its traceback."""

    def __init__(self, rank: int, detail: str):
        super().__init__(f"rank {rank} failed:\n{detail}")
        self.rank = rank
        self.detail = detail


def _dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _loads(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


def _entry(rank, world_size, init_file, timeout_s, backend, threads, fn, args, q):
    try:
        if threads is not None:
            torch.set_num_threads(threads)
        dist.init_process_group(
            backend,
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        try:
            result = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        q.put((rank, True, _dumps(result)))
    except BaseException:  # noqa: BLE001 - everything must reach the parent
        q.put((rank, False, traceback.format_exc()))


_SECONDARY = ("DistBackendError", "Connection closed by peer", "Connection reset by peer",
              "ECONNRESET", "Broken pipe")


def _collect_failures(q, rank: int, detail: str, grace: float = 1.5) -> WorkerError:
    """The first failure usually makes the other ranks fail in a collective; wait a
    moment for their reports and name as primary the rank whose error is not a
    broken connection (the root cause), with every rank's traceback attached."""
    failures = {rank: detail}
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        try:
            r, ok, payload = q.get(timeout=max(0.01, deadline - time.monotonic()))
        except queue_mod.Empty:
            break
        if not ok:
            failures[r] = payload
    primary = next(
        (r for r, d in failures.items() if not any(s in d for s in _SECONDARY)), rank
    )
    text = failures[primary]
    for r, d in sorted(failures.items()):
        if r != primary:
            text += f"\n--- rank {r} also failed (likely as a consequence) ---\n{d}"
    return WorkerError(primary, text)


def _stop(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 5.0
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(5.0)


def run_workers(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    backend: str = "gloo",
    threads: int | None = 1,
) -> List[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks; return the results.

    Args:
        fn: a picklable (module-level) function. It runs after the default
            process group is initialised and before it is destroyed.
        world_size: number of ranks, ``>= 1``.
        *args: extra positional arguments, pickled to every rank.
        timeout: seconds for the whole run (and for each collective).
        backend: ``torch.distributed`` backend (``"gloo"`` on CPU).
        threads: ``torch.set_num_threads`` in each rank (``None`` leaves the
            default); 1 keeps ranks from oversubscribing a small machine.

    Returns:
        list of the ``world_size`` return values, indexed by rank.

    Raises:
        ValueError: ``world_size < 1`` or ``timeout <= 0``.
        WorkerError: a rank raised or died (other ranks are terminated).
        TimeoutError: not every rank finished within ``timeout`` seconds.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if timeout <= 0:
        raise ValueError(f"timeout must be > 0, got {timeout}")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    tmpdir = tempfile.mkdtemp(prefix="slimcomm_dist_")
    init_file = os.path.join(tmpdir, "store")
    procs = [
        ctx.Process(
            target=_entry,
            args=(r, world_size, init_file, timeout, backend, threads, fn, args, q),
            daemon=True,
        )
        for r in range(world_size)
    ]
    results: dict[int, Any] = {}
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        dead_since: dict[int, float] = {}
        while len(results) < world_size:
            try:
                rank, ok, payload = q.get(timeout=0.2)
            except queue_mod.Empty:
                now = time.monotonic()
                for r, p in enumerate(procs):
                    if r in results or p.exitcode is None:
                        continue
                    # Exited without a message yet: give the pipe a moment to drain.
                    first = dead_since.setdefault(r, now)
                    if now - first > 2.0:
                        raise WorkerError(
                            r, f"process exited with code {p.exitcode} without reporting a result"
                        )
                if now > deadline:
                    pending = [r for r in range(world_size) if r not in results]
                    raise TimeoutError(
                        f"run_workers({getattr(fn, '__name__', fn)!r}): ranks {pending} "
                        f"did not finish within {timeout} s"
                    )
                continue
            if not ok:
                raise _collect_failures(q, rank, payload)
            results[rank] = _loads(payload)
        for p in procs:
            p.join(10.0)
        return [results[r] for r in range(world_size)]
    finally:
        _stop(procs)
        q.close()
        shutil.rmtree(tmpdir, ignore_errors=True)
