"""benchmarks/reaper.py: a command run under the reaper leaves nothing behind,
even a daemon (double fork, own session) it started before it was killed
outright. Real processes, real signals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="PR_SET_CHILD_SUBREAPER is Linux's")

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# the command: starts a daemon (fork, setsid, fork: re-parented away from it),
# writes the daemon's pid, then ends as told
_CMD = textwrap.dedent("""
    import os, signal, sys, time
    r, w = os.pipe()
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            os.write(w, str(os.getpid()).encode())
            time.sleep(120)
        os._exit(0)
    pid = int(os.read(r, 20))
    with open(sys.argv[1], "w") as f:
        f.write(str(pid))
    if sys.argv[2] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(int(sys.argv[2]))
""")


def _gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("how, rc", [("kill", 128 + signal.SIGKILL), ("3", 3)])
def test_a_killed_or_finished_command_leaves_no_daemon(tmp_path, how, rc):
    pidfile = tmp_path / "daemon.pid"
    r = subprocess.run([sys.executable, "-m", "benchmarks.reaper", sys.executable, "-c", _CMD,
                        str(pidfile), how], cwd=_ROOT, timeout=60, check=False)
    assert r.returncode == rc
    daemon = int(pidfile.read_text())
    try:
        assert _gone(daemon, 10), f"the daemon {daemon} outlived the reaped command"
    finally:
        try:
            os.kill(daemon, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_without_the_reaper_the_daemon_would_live_on(tmp_path):
    """The control: the same command run plainly leaves its daemon running
    (so the test above shows the reaper's work)."""
    pidfile = tmp_path / "daemon.pid"
    r = subprocess.run([sys.executable, "-c", _CMD, str(pidfile), "kill"], timeout=60,
                       check=False)
    assert r.returncode == -signal.SIGKILL
    daemon = int(pidfile.read_text())
    try:
        assert not _gone(daemon, 1.0)
    finally:
        os.kill(daemon, signal.SIGKILL)
        _gone(daemon, 10)


def test_sigterm_to_the_reaper_reaches_the_command(tmp_path):
    """A SIGTERM sent to the reaper (``timeout``, a batch system) ends the
    command, then its leftovers."""
    pidfile = tmp_path / "daemon.pid"
    cmd = _CMD.replace("sys.exit(int(sys.argv[2]))", "time.sleep(120)")
    p = subprocess.Popen([sys.executable, "-m", "benchmarks.reaper", sys.executable, "-c", cmd,
                          str(pidfile), "0"], cwd=_ROOT)
    try:
        deadline = time.monotonic() + 30
        while not (pidfile.exists() and pidfile.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        daemon = int(pidfile.read_text())
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=30) == 128 + signal.SIGTERM
        assert _gone(daemon, 10)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)
