"""A worker's CPU scheduling policy: Linux's ``SCHED_BATCH``, unless
``MONARCH_SCHED_BATCH=0`` (:func:`batch_scheduling`)."""

from __future__ import annotations

import logging
import os

from monarch_kernel.util.switches import sched_batch_enabled

log = logging.getLogger("monarch_kernel.worker.worker")

__all__ = ["batch_scheduling"]


def batch_scheduling() -> bool:
    """Put the calling thread, and so the threads and processes it starts
    afterwards, under Linux's ``SCHED_BATCH`` policy, unless
    ``MONARCH_SCHED_BATCH=0``. A worker calls it before it starts any thread.
    True if the policy was set.

    A ``SCHED_BATCH`` task has the CPU share of an ordinary one (the same
    nice weight), but a waking one does not preempt the task running on its
    core (``check_preempt_wakeup_fair`` in Linux's ``kernel/sched/fair.c``
    returns early for a policy other than ``SCHED_NORMAL``, under CFS and
    EEVDF alike; it still preempts a ``SCHED_IDLE`` task): it gets the core
    when the running task blocks or its slice ends. So a worker woken by a
    broadcast no longer stalls the controller in the middle of sending to
    the next ranks, which helps broadcasts where workers outnumber cores.
    Where cores are free (a worker per core or GPU) nothing changes.

    Only an ordinary (``SCHED_OTHER``) process is changed: a policy chosen
    for the kernel on purpose (``chrt``, systemd's ``CPUSchedulingPolicy``),
    which its workers inherit, is kept. Nothing is changed off Linux; where
    the policy cannot be set (a seccomp profile that forbids it), a warning
    says so and the worker goes on as an ordinary process.
    """
    try:
        on = sched_batch_enabled()
    except ValueError as e:  # (the controller refuses such a value before it spawns)
        log.warning("%s: SCHED_BATCH off", e)
        return False
    if not on or not hasattr(os, "SCHED_BATCH"):
        return False
    try:
        if os.sched_getscheduler(0) != os.SCHED_OTHER:
            return False
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except OSError as e:
        log.warning("cannot use SCHED_BATCH (%s); scheduled as an ordinary process", e)
        return False
    return True
