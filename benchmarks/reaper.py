"""Run a command so that nothing it starts outlives it (Linux):
``python -m benchmarks.reaper CMD [ARG ...]``.

Why: the suite starts other systems' processes (ipyparallel's controller
and engines, Ray's raylet and GCS, torchmonarch's host agents, Jupyter
kernels), several of which daemonize or lead sessions of their own. The
suite stops them in ``finally`` blocks, which a benchmark killed outright
(SIGKILL, the OOM killer) never runs, and they would live on.

How: this process makes itself a *child subreaper*
(``prctl(PR_SET_CHILD_SUBREAPER)``, Linux 3.4 and later; the mechanism of
systemd's service manager and of ``tini -s``): a process orphaned anywhere
below it is re-parented to it rather than to init. So when the command
ends, however it ends, whatever it left behind is still a descendant of
this process, and gets SIGTERM, then SIGKILL after :data:`GRACE_S`.
``python -m benchmarks`` runs itself this way (:func:`run_reaped`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence

import psutil

__all__ = ["GRACE_S", "reap", "run_reaped", "set_subreaper"]

#: seconds the command's leftovers get between SIGTERM and SIGKILL
GRACE_S = 5.0
_PR_SET_CHILD_SUBREAPER = 36


def set_subreaper() -> bool:
    """Make this process the subreaper of its descendants; False where the
    system cannot (not Linux, or no ``prctl``)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def reap(grace: float = GRACE_S, timeout: float = 30.0) -> list[int]:
    """End every descendant of this process: SIGTERM, then SIGKILL to those
    left after ``grace`` seconds, until none is left (a dying process's own
    children are re-parented here meanwhile) or ``timeout`` seconds passed.

    Returns
    -------
    list of int
        The pids that were signalled.
    """
    me = psutil.Process()
    deadline = time.monotonic() + timeout
    signalled: list[int] = []
    while time.monotonic() < deadline:
        procs = me.children(recursive=True)
        if not procs:
            break
        for p in procs:
            try:
                p.terminate()
                signalled.append(p.pid)
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(
            procs, timeout=min(grace, max(0.0, deadline - time.monotonic())))
        for p in alive:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(alive, timeout=5)
        _collect_zombies()
    return signalled


def _collect_zombies() -> None:
    """Wait for any child re-parented here that has exited (subreaper duty)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def run_reaped(cmd: Sequence[str], env: Mapping[str, str] | None = None) -> int:
    """Run ``cmd`` with this process as subreaper; when it ends, end what it
    left behind (:func:`reap`). SIGTERM is passed on to the command; SIGINT
    (Ctrl-C reaches the whole foreground process group) is left to it.

    Returns
    -------
    int
        The command's exit status (128 + the signal's number if a signal
        ended it, as a shell reports it).
    """
    set_subreaper()
    proc = subprocess.Popen(list(cmd), env=None if env is None else dict(env))

    def pass_on(signum: int, _frame: object) -> None:
        if signum == signal.SIGTERM:
            try:
                proc.send_signal(signum)
            except ProcessLookupError:
                pass

    old = {s: signal.signal(s, pass_on) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while True:
            try:
                rc = proc.wait()
                break
            except KeyboardInterrupt:  # (a handler-less moment): the command decides
                continue
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        reap()
    return 128 - rc if rc < 0 else rc


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] == "--":
        args = args[1:]
    if not args:
        print("usage: python -m benchmarks.reaper CMD [ARG ...]", file=sys.stderr)
        return 2
    return run_reaped(args)


if __name__ == "__main__":
    sys.exit(main())
