"""Whether a local process runs: a zombie (ended, not yet reaped by its parent) does not."""

from __future__ import annotations

import os

__all__ = ["running"]


def running(pid: int) -> bool:
    """Whether process ``pid`` of this host runs.

    A process that ended but that its parent has not reaped yet (a zombie,
    ``/proc/PID/stat`` state ``Z``, or ``X``) counts as gone, although
    ``os.kill(pid, 0)`` still succeeds for it. A process of another user
    counts as running. Pids below 1 never run.

    Returns
    -------
    bool
    """
    if pid < 1:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
