"""The controller's private directory for Unix sockets (``mk-PID-...``, holding
``up`` and ``down``) is gone once its kernel is: after a clean shutdown, and
after a SIGKILL of the kernel (``shutdown_kernel(now=True)``), which the kernel
cannot clean up after (its guardian does), also when a rank was restarted.

The kernel makes its directory under a temp directory of the test's own
(``TMPDIR``): the sweep of dead processes' directories that any other mesh's
start does under ``/tmp`` must not be what removes it here."""

from __future__ import annotations

import glob
import os
import shutil
import signal
import tempfile

import pytest

from monarch_kernel.testing.kernel import KernelSession, wait_for, worker_pids

#: the issue's bound for what a mesh leaves behind once its kernel is gone
GONE_BOUND_S = 10.0


@pytest.fixture
def own_tmp(monkeypatch):
    base = tempfile.mkdtemp(prefix="mkt-", dir="/tmp")  # (short: socket paths are bounded)
    monkeypatch.setenv("TMPDIR", base)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.parametrize("how", ["sigkill", "clean"])
def test_socket_directory_is_removed_when_the_kernel_ends(how, own_tmp):
    def _dirs(pid: int) -> list[str]:
        return glob.glob(os.path.join(own_tmp, f"mk-{pid}-*"))

    ks = KernelSession()
    pid = ks.pid
    try:
        r = ks.execute("%mesh spawn 2")
        assert r.status == "ok", r.error_text()
        made = wait_for(lambda: _dirs(pid), 10, what="the controller's socket directory")
        assert any(os.path.exists(os.path.join(d, "up")) for d in made), made
        # a rank killed and restarted on the way (as the report that found the leak did)
        r = ks.execute("%%mesh --ranks 1\nimport os\nos.getpid()")
        assert r.status == "ok", r.error_text()
        rank1 = [p for p in worker_pids(pid) if str(p) in r.result_text()]
        assert len(rank1) == 1, (rank1, r.result_text())
        os.kill(rank1[0], signal.SIGKILL)
        wait_for(lambda: ks.execute("%%mesh\nrank").status == "error", 15,
                 interval=0.2, what="the kernel to see rank 1 dead")
        r = ks.execute("%mesh restart 1")
        assert r.status == "ok", r.error_text()
        if how == "sigkill":
            ks.kc.stop_channels()
            ks.km.shutdown_kernel(now=True)  # (SIGKILL: the kernel cannot clean up)
        else:
            ks.shutdown()
        wait_for(lambda: not _dirs(pid), GONE_BOUND_S, interval=0.1,
                 what=f"no mk-{pid}-* directory left ({_dirs(pid)})")
        wait_for(lambda: not worker_pids(pid), GONE_BOUND_S, interval=0.1,
                 what="the workers gone")
    finally:
        if ks.km.has_kernel:
            ks.km.shutdown_kernel(now=True)
