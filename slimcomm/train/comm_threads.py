"""Scheduling priority of the collective transport's polling threads (gloo on CPU).

Gloo's TCP transport runs one event-loop thread per device (named ``gloo_tcp_loop``).
When a peer's bytes arrive before this rank has posted the matching buffer (the peer
entered the collective first: rank skew), that thread busy-polls ``epoll_wait`` until
the buffer is posted. On a machine of its own a rank's spare core absorbs the spin; when
several ranks share the cores (a world emulated on one host, ``bench/netbench.py``: 8
ranks on 2 cores), the spinning threads of the early ranks take the CPU that the late
rank needs to finish its step, and every per-step collective pays for it (measured on
the 8-rank MLP: ~2.3e5 ``epoll_wait`` calls a second, 10-15 % of the machine; the Slim-DP
hook's step went from 185 to 159-166 ms with the threads lowered, DiLoCo's from 126 to
123 ms; the numbers trained are bit-identical).

:func:`set_comm_thread_priority` lowers those threads only; the training thread, torch's
intra-op threads and the process group's worker threads keep their priority. Linux only
(threads found through ``/proc/self/task``); elsewhere, and with NCCL, there is no such
thread and it does nothing.
"""

from __future__ import annotations

import logging
import os
from typing import List

log = logging.getLogger("slimcomm.train")

#: thread names of the transports' event loops whose priority is changed
LOOP_THREAD_NAMES = ("gloo_tcp_loop",)

#: accepted policies: ``normal`` leaves the threads alone, ``low`` sets nice 19 (they
#: still get a small share of a busy core), ``idle`` sets ``SCHED_IDLE`` (they run only
#: on a core nothing else wants)
POLICIES = ("normal", "low", "idle")


def _loop_threads() -> List[int]:
    tids = []
    try:
        entries = os.listdir("/proc/self/task")
    except OSError:
        return tids
    for tid in entries:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:  # the thread ended meanwhile
            continue
        if name in LOOP_THREAD_NAMES:
            tids.append(int(tid))
    return tids


def set_comm_thread_priority(policy: str) -> int:
    """Give this process's transport event-loop threads the scheduling ``policy``.

    Call after the process groups exist (each gloo group starts its own loop thread);
    calling again covers threads started since and re-applies the policy to the others.

    Args:
        policy: ``"normal"`` (no change), ``"low"`` (nice 19) or ``"idle"``
            (``SCHED_IDLE``), see :data:`POLICIES`.

    Returns:
        the number of threads whose priority was set (0 for ``"normal"``, with NCCL, or
        off Linux).

    Raises:
        ValueError: ``policy`` is not one of :data:`POLICIES`.
    """
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    if policy == "normal":
        return 0
    done = 0
    for tid in _loop_threads():
        try:
            if policy == "idle":
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            else:
                os.setpriority(os.PRIO_PROCESS, tid, 19)
            done += 1
        except (OSError, AttributeError) as e:  # thread gone, or no such call on this OS
            log.debug("comm thread %d: priority %s not set: %s", tid, policy, e)
    return done


def thread_policy(tid: int) -> str:
    """The :data:`POLICIES` name a thread of this process runs under (for tests and logs):
    ``"idle"`` for ``SCHED_IDLE``, ``"low"`` for nice 19, else ``"normal"``."""
    if os.sched_getscheduler(tid) == os.SCHED_IDLE:
        return "idle"
    return "low" if os.getpriority(os.PRIO_PROCESS, tid) == 19 else "normal"
