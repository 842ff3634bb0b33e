"""The ``MONARCH_*`` on/off switches read from the environment.

Each is 1, empty or unset (on, the default) or 0 (off), spaces around
ignored; anything else is refused with a ``ValueError`` that says what each
value means. Workers read theirs when they start, so a controller checks
them all before it spawns a mesh (a typo is refused there, not silently
taken as "on" in every worker).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["batching_enabled", "lanes_enabled", "peer_lead_enabled", "sched_batch_enabled",
           "zero_or_one", "zygote_enabled"]


def zero_or_one(environ: Mapping[str, str], name: str, off: str, on: str) -> bool:
    """An on/off switch from the environment (see the module docstring).

    Parameters
    ----------
    environ : Mapping[str, str]
        Where to read it (``os.environ``).
    name : str
        The variable.
    off, on : str
        What 0 and 1 mean, for the error message.

    Raises
    ------
    ValueError
        If the variable holds something other than 0 or 1.
    """
    raw = environ.get(name, "").strip()
    if raw in ("", "1"):
        return True
    if raw == "0":
        return False
    raise ValueError(f"{name} must be 0 ({off}) or 1 ({on}, the default), not {raw!r}")


def lanes_enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether local workers get a lane (``MONARCH_LANES``, :mod:`~monarch_kernel.transport.lane`).

    Raises
    ------
    ValueError
        If ``MONARCH_LANES`` is set to something other than 0 or 1.
    """
    return zero_or_one(environ, "MONARCH_LANES", "local workers use ZeroMQ", "lanes")


def peer_lead_enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether a worker's waiting threads read its peer lanes themselves
    (``MONARCH_PEER_LEAD``, :mod:`monarch_kernel.worker.io`).

    Raises
    ------
    ValueError
        If ``MONARCH_PEER_LEAD`` is set to something other than 0 or 1.
    """
    return zero_or_one(environ, "MONARCH_PEER_LEAD",
                       "only a worker's peer thread reads its peer lanes",
                       "its waiting threads too")


def sched_batch_enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether workers run under Linux's ``SCHED_BATCH`` policy
    (``MONARCH_SCHED_BATCH``; see :func:`monarch_kernel.worker.sched.batch_scheduling`).

    Raises
    ------
    ValueError
        If ``MONARCH_SCHED_BATCH`` is set to something other than 0 or 1.
    """
    return zero_or_one(environ, "MONARCH_SCHED_BATCH",
                       "workers are scheduled as ordinary processes",
                       "SCHED_BATCH: a waking worker does not preempt the controller")


def zygote_enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether local workers are forked from a pre-imported template process
    (``MONARCH_ZYGOTE``, :mod:`monarch_kernel.launchers.zygote`).

    Raises
    ------
    ValueError
        If ``MONARCH_ZYGOTE`` is set to something other than 0 or 1.
    """
    return zero_or_one(environ, "MONARCH_ZYGOTE", "each worker starts a new Python",
                       "workers are forked from a template process")


def batching_enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether pipelined calls and their replies may travel several to a message
    (``MONARCH_BATCHING``: the controller's request batching,
    :mod:`monarch_kernel.controller.batching`, and a worker's reply batching,
    :mod:`monarch_kernel.actor.host`).

    Raises
    ------
    ValueError
        If ``MONARCH_BATCHING`` is set to something other than 0 or 1.
    """
    return zero_or_one(environ, "MONARCH_BATCHING", "every call and reply is a message of its own",
                       "calls and replies may share a message")
