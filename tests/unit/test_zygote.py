"""Workers forked from the template process (monarch_kernel.launchers.zygote):
what a forked worker gets (session, fds, environment, argv, output, random
state), what its launcher sees (pid, exit codes, signals), the zygote's death
and end, and a whole local mesh started through it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import warnings

import psutil
import pytest

from monarch_kernel import MeshError, spawn_procs
from monarch_kernel.launchers import zygote
from monarch_kernel.launchers.zygote import UNKNOWN_STATUS, WorkerProcess, start_worker
from monarch_kernel.testing.kernel import wait_for

#: the stand-in worker: reports what it got, writes a line on stderr, then does as argv says
PROBE = textwrap.dedent("""
    import json, os, random, sys, time
    print(json.dumps({"pid": os.getpid(), "sid": os.getsid(0), "pgid": os.getpgid(0),
                      "probe": os.environ.get("PROBE"), "argv": sys.argv,
                      "rand": random.random(), "cwd": os.getcwd(),
                      "fds": sorted(int(f) for f in os.listdir("/proc/self/fd")),
                      "threading": "threading" in sys.modules}), flush=True)
    print("a line on stderr", file=sys.stderr, flush=True)
    if sys.argv[1] == "exit":
        sys.exit(int(sys.argv[2]))
    time.sleep(120)
""")


@pytest.fixture
def probe(tmp_path, monkeypatch):
    """``start(mode, *args, probe=...)`` starts the probe module (forked when it
    can be) and returns ``(handle, first stdout line as dict, stderr read end)``."""
    (tmp_path / "zyg_probe.py").write_text(PROBE)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path),
                                                       env.get("PYTHONPATH", "")]))
    env.pop("MONARCH_ZYGOTE", None)
    monkeypatch.chdir(tmp_path)
    started: list = []
    zygote.shutdown()

    def start(*args: str, probe_value: str = "x", extra_env: dict | None = None):
        r1, w1 = os.pipe()
        r2, w2 = os.pipe()
        rx, wx = os.pipe()  # an fd passed under its own number
        e = {**env, "PROBE": probe_value, **(extra_env or {})}
        try:
            h = start_worker([sys.executable, "-m", "zyg_probe", *args], e, w1, w2, (wx,))
        finally:
            for fd in (w1, w2, wx):
                os.close(fd)
        started.append(h)
        with os.fdopen(r1) as out:
            info = json.loads(out.readline())
        info["passed_fd"] = wx
        os.close(rx)
        return h, info, r2

    yield start
    for h in started:
        if h.poll() is None:
            h.kill()
            h.wait(10)
    z = zygote.current()
    zygote.shutdown()
    if z is not None:
        assert not psutil.pid_exists(z.pid) or psutil.Process(z.pid).status() == "zombie"


def _read_all(fd: int) -> bytes:
    with os.fdopen(fd, "rb") as f:
        return f.read()


def test_forked_worker_gets_what_popen_would_give(probe):
    a, ia, err_a = probe("sleep", probe_value="rank0")
    b, ib, err_b = probe("sleep", probe_value="rank1")
    z = zygote.current()
    assert z is not None and isinstance(a, WorkerProcess) and isinstance(b, WorkerProcess)
    for h, info in ((a, ia), (b, ib)):
        assert info["pid"] == h.pid
        assert psutil.Process(h.pid).ppid() == z.pid  # forked, not a new Python
        assert info["sid"] == info["pgid"] == h.pid  # a session of its own
        assert info["argv"][1:] == ["sleep"]
        assert psutil.Process(h.pid).cmdline()[:4] == [sys.executable, "-m", "zyg_probe",
                                                       "sleep"]
        assert psutil.Process(h.pid).environ().get("PROBE") == info["probe"]
        # only stdin, stdout, stderr, the fd passed (same number) and listdir's own fd
        assert len(set(info["fds"]) - {0, 1, 2, info["passed_fd"]}) <= 1
        assert info["passed_fd"] in info["fds"]
        assert info["cwd"] == os.getcwd()
    assert (ia["probe"], ib["probe"]) == ("rank0", "rank1")  # the environment per worker
    assert ia["rand"] != ib["rand"]  # random state re-seeded in each child
    a.kill()
    assert a.wait(10) == -signal.SIGKILL and a.returncode == -signal.SIGKILL
    b.send_signal(signal.SIGTERM)
    assert b.wait(10) == -signal.SIGTERM
    assert _read_all(err_a) == b"a line on stderr\n"  # stderr went where it was asked
    _read_all(err_b)
    b.kill()  # (never a reused pid: it ended)


def test_exit_codes_and_wait_timeout(probe):
    h, _, err = probe("exit", "7")
    assert h.wait(10) == 7 and h.poll() == 7
    _read_all(err)
    s, _, err2 = probe("sleep")
    with pytest.raises(subprocess.TimeoutExpired):
        s.wait(0.2)
    s.terminate()
    assert s.wait(10) == -signal.SIGTERM
    _read_all(err2)


def test_switch_off_and_startup_env_use_popen(probe, monkeypatch):
    h, info, err = probe("exit", "0", extra_env={"MONARCH_ZYGOTE": "0"})
    assert isinstance(h, subprocess.Popen) and h.wait(10) == 0
    assert info["sid"] == info["pgid"] == h.pid
    _read_all(err)
    with pytest.raises(ValueError, match="MONARCH_ZYGOTE must be 0"):
        probe("exit", "0", extra_env={"MONARCH_ZYGOTE": "yes"})


def test_zygote_death_warns_restarts_and_reports_orphans(probe):
    a, _, err_a = probe("sleep")
    z = zygote.current()
    assert z is not None
    os.kill(z.pid, signal.SIGKILL)
    z.proc.wait(10)
    with pytest.warns(RuntimeWarning, match="template process that starts workers ended"):
        b, _, err_b = probe("exit", "3")
    assert isinstance(b, WorkerProcess) and zygote.current() is not None
    assert zygote.current().pid != z.pid  # type: ignore[union-attr]
    assert b.wait(10) == 3
    assert psutil.pid_exists(a.pid)  # the zygote's end did not end its worker
    a.kill()
    assert a.wait(10) == UNKNOWN_STATUS  # (its status went with its parent)
    _read_all(err_a)
    _read_all(err_b)


def test_workers_outlive_their_zygote(probe):
    h, _, err = probe("sleep")
    z = zygote.current()
    assert z is not None
    zygote.shutdown()  # as when the kernel ends: the zygote goes, its workers run on
    wait_for(lambda: z.proc.poll() is not None, 10, what="the zygote ended")
    assert psutil.Process(h.pid).status() != psutil.STATUS_ZOMBIE
    with contextlib.suppress(ProcessLookupError):
        os.kill(h.pid, signal.SIGKILL)
    wait_for(lambda: not psutil.pid_exists(h.pid)
             or psutil.Process(h.pid).status() == psutil.STATUS_ZOMBIE, 10,
             what="the orphan ended")
    _read_all(err)


def test_mesh_through_the_zygote(monkeypatch):
    monkeypatch.delenv("MONARCH_ZYGOTE", raising=False)
    zygote.shutdown()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fallback
        m = spawn_procs(3, telemetry_interval=0)
    try:
        z = zygote.current()
        assert z is not None
        pids = {r: m.controller.ranks[r].pid for r in m.ranks}
        for pid in pids.values():
            p = psutil.Process(pid)
            assert p.ppid() == z.pid and os.getsid(pid) == pid
            assert p.cmdline()[:4] == [sys.executable, "-m", "monarch_kernel", "worker"]
        assert sorted(m.exec("rank").values()) == [0, 1, 2]
        seeds = m.exec("import random; random.random()").values()
        assert len(set(seeds)) == 3
        assert m.exec("import os; os.getsid(0) == os.getpid()").values() == [True] * 3
        os.kill(pids[1], signal.SIGKILL)
        with pytest.raises(MeshError) as e:
            m.exec("import time; time.sleep(60)", timeout=60)
        assert "SIGKILL" in str(e.value) and "rank 1" in str(e.value)
        assert str(pids[1]) in str(e.value)
        m.restart([1], timeout=60)
        new = m.controller.ranks[1].pid
        assert new != pids[1] and psutil.Process(new).ppid() == z.pid
        assert sorted(m.exec("rank").values()) == [0, 1, 2]
    finally:
        m.stop()
    for pid in (*pids.values(), new):
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie"
    zygote.shutdown()
