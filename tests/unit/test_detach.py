"""Detachable named meshes (spawn_procs(name=, detach=True), attach, steal, keep-alive,
the output bound): real worker processes, a real controller in a child script that is
killed or detaches, and this test process attaching as the next controller.

Each test has a registry directory of its own (MONARCH_MESH_REGISTRY) and a mesh name
of its own, and checks that nothing is left: processes, the mesh's directory, the
registry record."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest
import zmq

import monarch_kernel as mk
from monarch_kernel.mesh import registry
from monarch_kernel.wire import protocol

#: the child script: a controller that spawns a detachable 4-rank mesh, sets state on
#: every rank and in an actor, starts a request that prints a numbered line every 50 ms
#: for 10 s, says so, then (argv[2]) waits to be killed, detaches, or holds the mesh
CHILD = r"""
import json, os, sys, time
import monarch_kernel as mk
from monarch_kernel import Actor, endpoint

class Counter(Actor):
    def __init__(self):
        self.n = 0

    @endpoint
    def incr(self, k=1):
        self.n += k
        return self.n

name, mode, keep = sys.argv[1], sys.argv[2], float(sys.argv[3])
lines = int(sys.argv[4]) if len(sys.argv) > 4 else 200
m = mk.spawn_procs(4, name=name, detach=True, keep_alive=keep)
m.exec("state = rank * 7")
c = m.spawn("counter", Counter)
c.incr.call(5).get()
print("PIDS " + json.dumps({"pids": m.record.pids, "dir": m.record.mesh_dir,
                            "guardian": m.record.guardian_pid}), flush=True)
if mode != "idle":
    delay = float(os.environ.get("DETACH_TEST_DELAY", "0"))
    mark = os.environ.get("DETACH_TEST_MARK", "")
    short = int(os.environ.get("DETACH_TEST_SHORT", str(lines)))  # (rank 3's lines)
    m.run("import os, time\n"
          f"if {mark!r}:\n"
          f"    open(os.path.join({mark!r}, f'started{{rank}}'), 'w').close()\n"
          f"time.sleep({delay})\n"
          f"for i in range({lines} if rank != 3 else {short}):\n"
          "    print(f'r{rank} line {i} ' + 'x' * 40, flush=True)\n"
          "    time.sleep(0.05)\n"
          f"if {mark!r}:\n"
          f"    open(os.path.join({mark!r}, f'done{{rank}}'), 'w').close()\n"
          "'done'")
print("STARTED", flush=True)
if mode in ("detach", "idle"):
    time.sleep(0.5)
    m.detach()
    print("DETACHED", flush=True)
elif mode == "hold":
    while True:
        try:
            m.exec("1")
        except Exception as e:
            print("ERROR " + str(e).replace("\n", " "), flush=True)
            break
        time.sleep(0.2)
else:
    time.sleep(600)
"""

LINES = 200


@pytest.fixture
def reg(tmp_path, monkeypatch):
    """A registry directory of the test's own."""
    d = tmp_path / "reg"
    monkeypatch.setenv(registry.ENV, str(d))
    return d


def _name() -> str:
    return f"t-{uuid.uuid4().hex[:10]}"


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _workers() -> set[int]:
    """Pids of the worker processes running on this host."""
    out = set()
    for p in psutil.process_iter(["cmdline", "status"]):
        cmd = " ".join(p.info.get("cmdline") or [])
        if "monarch_kernel worker" in cmd and p.info.get("status") != psutil.STATUS_ZOMBIE:
            out.add(p.pid)
    return out


def _wait(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


class Child:
    """The child controller script (killed at the end, whatever happens)."""

    def __init__(self, name: str, mode: str, keep: float = 60.0, lines: int = LINES,
                 env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, name, mode, repr(keep), str(lines)],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            env={**os.environ, **(env or {})})
        self.info: dict = {}

    def read_until(self, prefix: str, timeout: float = 60.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()  # (the child prints within the timeout)
            if not line:
                raise AssertionError(f"the child ended before printing {prefix!r}")
            if line.startswith("PIDS "):
                self.info = json.loads(line[5:])
                self.info["pids"] = {int(k): v for k, v in self.info["pids"].items()}
            if line.startswith(prefix):
                return line
        raise AssertionError(f"no {prefix!r} from the child within {timeout} s")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        self.proc.stdout.close()


@contextlib.contextmanager
def child(name: str, mode: str, **kw):
    c = Child(name, mode, **kw)
    try:
        yield c
    finally:
        c.kill()
        info = c.info
        if info:  # never leave a mesh behind, even when the test failed
            for pid in info["pids"].values():
                if _running(pid):
                    os.kill(pid, signal.SIGKILL)


def _assert_gone(info: dict, name: str, timeout: float = 15.0) -> None:
    _wait(lambda: not any(_running(p) for p in info["pids"].values()), timeout,
          "the ranks to end")
    _wait(lambda: not os.path.exists(info["dir"]), timeout, "the mesh directory to go")
    _wait(lambda: registry.load(name) is None, timeout, "the registry record to go")
    if info.get("guardian"):
        _wait(lambda: not _running(info["guardian"]), timeout, "the guardian to end")


def _follow(m) -> tuple[object, str]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        result = m.follow(timeout=60)
    return result, buf.getvalue()


def _check_lines(out: str, ranks: int = 4, lines: int = LINES) -> None:
    for r in range(ranks):
        nums = [int(x) for x in re.findall(rf"r{r} line (\d+) ", out)]
        assert nums == list(range(lines)), (r, nums[:5], len(nums))


def _check_attached(m, info: dict) -> None:
    assert sorted(m.status()[r]["pid"] for r in range(4)) == sorted(info["pids"].values())
    assert [p for _, p in sorted(info["pids"].items())] == [
        row["pid"] for row in m.status()]
    assert list(m.exec("state").values()) == [0, 7, 14, 21]
    assert list(m.actors("counter").incr.call(1).get().values()) == [6] * 4


@pytest.mark.parametrize("how", ["sigkill", "detach"])
def test_attach_after_controller_ends(reg, how):
    """The controller is SIGKILLed (or detaches cleanly) while a request runs: a new
    controller attaches within 5 s to the same processes, with their state and actor,
    and follows the request: every line once, in order, then its end."""
    name = _name()
    with child(name, "kill" if how == "sigkill" else "detach") as c:
        c.read_until("STARTED")
        if how == "sigkill":
            time.sleep(1.5)
            c.kill()
        else:
            c.read_until("DETACHED")
            c.proc.wait(30)
            assert c.proc.returncode == 0
        t0 = time.monotonic()
        m = mk.attach(name)
        took = time.monotonic() - t0
        try:
            assert took < 5.0, took
            assert m.name == name and m.detached
            [res] = m.resumed
            assert res.ranks == [0, 1, 2, 3] and res.dropped_bytes == 0
            _check_attached(m, c.info)
            result, out = _follow(m)
            assert list(result.values()) == ["done"] * 4
            _check_lines(out)
        finally:
            m.stop()
        _assert_gone(c.info, name)


def test_keep_alive_expiry_leaves_nothing(reg):
    """With no controller for the keep-alive time, the ranks end and every trace goes."""
    name = _name()
    with child(name, "idle", keep=3.0) as c:
        c.read_until("DETACHED")
        c.proc.wait(30)
        assert registry.load(name) is not None
        [row] = [i for i in registry.list_meshes() if i.name == name]
        assert row.state == "detached" and row.keep_alive_left_s is not None
        _assert_gone(c.info, name, timeout=20.0)


def test_get_or_spawn_attaches(reg):
    """spawn_procs with the name of a live mesh attaches to it: no second set of
    processes; stop_mesh then ends it."""
    name = _name()
    with child(name, "idle") as c:
        c.read_until("DETACHED")
        c.proc.wait(30)
        m = mk.spawn_procs(4, name=name, detach=True)
        try:
            assert m.attached_existing
            _check_attached(m, c.info)
            mine = psutil.Process().children(recursive=True)
            assert not [p for p in mine if p.pid in _workers()]  # no second set
            m.detach()
            with pytest.raises(mk.MeshError, match="detached"):
                m.exec("1")
        finally:
            mk.stop_mesh(name)
        _assert_gone(c.info, name)


def test_second_attach_refused_then_steal(reg):
    """While its controller lives, a second attach is refused with MeshBusyError naming
    that controller; steal takes the mesh over and the first controller is told."""
    name = _name()
    with child(name, "hold") as c:
        c.read_until("STARTED")
        with pytest.raises(mk.MeshBusyError) as e:
            mk.attach(name, timeout=10)
        assert e.value.holder_pid == c.proc.pid
        assert f"pid {c.proc.pid}" in str(e.value) and "steal" in str(e.value)
        with pytest.raises(mk.MeshBusyError, match="force=True"):
            mk.stop_mesh(name, timeout=10)
        m = mk.attach(name, steal=True, timeout=10)
        try:
            line = c.read_until("ERROR", timeout=20)
            assert f"taken over by pid {os.getpid()}" in line
            _check_attached(m, c.info)
        finally:
            m.stop()
        _assert_gone(c.info, name)


def test_output_bound_drops_oldest_and_counts(reg):
    """Output beyond MONARCH_DETACH_OUTPUT_BYTES is dropped oldest first; the dropped
    bytes are reported at attach and what is left is the newest, in order."""
    name = _name()
    bound = 1500
    with child(name, "kill", lines=100, env={"MONARCH_DETACH_OUTPUT_BYTES": str(bound)}) as c:
        c.read_until("STARTED")
        time.sleep(2.5)  # (about 50 lines of 56 bytes per rank: beyond the bound)
        c.kill()
        m = mk.attach(name)
        try:
            [res] = m.resumed
            assert res.dropped_bytes > 0
            assert res.replayed_bytes <= 4 * bound
            result, out = _follow(m)
            assert list(result.values()) == ["done"] * 4
            for r in range(4):
                nums = [int(x) for x in re.findall(rf"r{r} line (\d+) ", out)]
                assert nums and nums[-1] == 99 and nums[0] > 0
                assert nums == list(range(nums[0], 100))  # the oldest went, in order
        finally:
            m.stop()
        _assert_gone(c.info, name)


def test_no_name_and_attach_errors(reg):
    """detach needs a name; attaching to a name nobody runs says how to find meshes."""
    with pytest.raises(ValueError, match="name"):
        mk.spawn_procs(1, detach=True)
    with pytest.raises(mk.NoMeshError, match="no mesh named"):
        mk.attach("nobody-runs-this")
    assert not list(Path(os.environ[registry.ENV]).glob("*.json"))


def test_request_finished_while_detached(reg, tmp_path):
    """A request that ends while no controller is attached: its output and its reply
    are kept, and follow() shows the output and returns the values."""
    name = _name()
    marks = tmp_path / "marks"
    marks.mkdir()
    env = {"DETACH_TEST_DELAY": "1.0", "DETACH_TEST_MARK": str(marks)}
    with child(name, "kill", lines=10, env=env) as c:
        c.read_until("STARTED")
        # (the request reached every rank before the kill: a send still queued in the
        # killed process would never arrive)
        _wait(lambda: len(list(marks.glob("started*"))) == 4, 30, "the ranks to start")
        c.kill()  # (within the request's first second: no rank has finished)
        _wait(lambda: len(list(marks.glob("done*"))) == 4, 30, "the ranks to finish")
        time.sleep(0.2)  # (their replies are kept just after the marks)
        m = mk.attach(name)
        try:
            [res] = m.resumed
            assert res.finished_while_detached and res.finished_ranks == [0, 1, 2, 3]
            result, out = _follow(m)
            assert list(result.values()) == ["done"] * 4
            _check_lines(out, lines=10)
            assert m.follow() is None  # (nothing left to follow)
        finally:
            m.stop()
        _assert_gone(c.info, name)


def test_same_process_detach_attach_and_stop(reg):
    """The spawning process detaches and attaches again (no busy refusal: it left on
    purpose), and a detachable mesh stopped by its spawner leaves nothing."""
    name = _name()
    m = mk.spawn_procs(2, name=name, detach=True, keep_alive=30)
    info = {"pids": dict(m.record.pids), "dir": m.record.mesh_dir,
            "guardian": m.record.guardian_pid}
    try:
        m.exec("v = rank + 100")
        m.detach()
        m2 = mk.attach(name, timeout=10)
        assert list(m2.exec("v").values()) == [100, 101]
        with pytest.raises(mk.MeshError, match="cannot be restarted"):
            m2.restart([0])  # (refused before any rank ends)
        assert dict(m2.record.pids) == info["pids"]
        assert list(m2.exec("v").values()) == [100, 101]
        m2.detach()
        m3 = mk.spawn_procs(2, name=name, detach=True)  # get-or-spawn, same process
        assert m3.attached_existing
        m3.stop()
    finally:
        for pid in info["pids"].values():
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
    _assert_gone(info, name)
    m4 = mk.spawn_procs(2, name=name, detach=True, keep_alive=30)
    info = {"pids": dict(m4.record.pids), "dir": m4.record.mesh_dir,
            "guardian": m4.record.guardian_pid}
    m4.stop()  # (the spawner's own stop)
    _assert_gone(info, name)


def test_attach_endpoint_refuses_stale_and_foreign_requests(reg):
    """A rank's attach endpoint answers an attach signed with the mesh key but no newer
    than the last one it accepted with a refusal (a replay), ignores one signed with
    another key, and the mesh is untouched by either."""
    name = _name()
    m = mk.spawn_procs(1, name=name, detach=True, keep_alive=30)
    info = {"pids": dict(m.record.pids), "dir": m.record.mesh_dir,
            "guardian": m.record.guardian_pid}
    rec = m.record
    try:
        m.exec("v = 5")
        m.detach()
        ctx = zmq.Context.instance()
        s = ctx.socket(zmq.DEALER)
        s.linger = 0
        s.connect(rec.endpoints[0])
        try:
            content = {"up": "ipc:///nonexistent/up", "down": "ipc:///nonexistent/down",
                       "curve_server_key": None, "ctl_epoch": 1, "floor": 0, "rank_epoch": 1,
                       "steal": True, "pid": 1, "host": "elsewhere", "t": 0.0}
            foreign = protocol.Codec(protocol.new_key(), "ctl")
            s.send_multipart(foreign.encode("attach", content))
            assert not s.poll(500)  # (a wrong key: dropped, no answer)
            codec = protocol.Codec(bytes.fromhex(rec.key_hex), "ctl")
            s.send_multipart(codec.encode("attach", content))
            assert s.poll(5000)
            answer = codec.decode(s.recv_multipart()).content
            assert not answer["ok"] and "stale" in answer["error"]
        finally:
            s.close(0)
        m2 = mk.attach(name, timeout=10)
        assert list(m2.exec("v").values()) == [5]
        m2.stop()
    finally:
        for pid in info["pids"].values():
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
    _assert_gone(info, name)


def test_background_output_while_detached_is_shown_at_attach(reg):
    """What a rank's background thread prints while no controller is attached reaches
    the next controller's on_output."""
    name = _name()
    m = mk.spawn_procs(1, name=name, detach=True, keep_alive=30)
    info = {"pids": dict(m.record.pids), "dir": m.record.mesh_dir,
            "guardian": m.record.guardian_pid}
    try:
        m.exec("import threading, time\n"
               "def later():\n"
               "    time.sleep(1.0)\n"
               "    print('from the background', flush=True)\n"
               "threading.Thread(target=later).start()")
        m.detach()
        time.sleep(2.0)
        got: list[str] = []
        m2 = mk.attach(name, timeout=10, on_output=lambda r, n, t: got.append(t))
        _wait(lambda: "from the background" in "".join(got), 10, "the background line")
        m2.stop()
    finally:
        for pid in info["pids"].values():
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
    _assert_gone(info, name)


def test_ranks_paused_in_pdb_are_listed_at_attach(reg):
    """A rank stopped at a breakpoint while the mesh is detached is listed by
    paused_ranks() after attach (and its cell is among the resumed requests)."""
    name = _name()
    m = mk.spawn_procs(2, name=name, detach=True, keep_alive=30)
    info = {"pids": dict(m.record.pids), "dir": m.record.mesh_dir,
            "guardian": m.record.guardian_pid}
    try:
        m.run("if rank == 1:\n    breakpoint()\n")
        _wait(lambda: m.paused_ranks() == [1], 10, "rank 1 to pause")
        m.detach()
        m2 = mk.attach(name, timeout=10)
        assert m2.paused_ranks() == [1]
        assert [r.ranks for r in m2.resumed] == [[1]]
        m2.stop(timeout=2)
    finally:
        for pid in info["pids"].values():
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
    _assert_gone(info, name)


def test_rank_that_ended_while_detached(reg):
    """A mesh one of whose ranks ended while detached is not attached half: the error
    names the rank and says how to end the rest; stop_mesh(force=True) does."""
    name = _name()
    m = mk.spawn_procs(2, name=name, detach=True, keep_alive=30)
    info = {"pids": dict(m.record.pids), "dir": m.record.mesh_dir,
            "guardian": m.record.guardian_pid}
    try:
        m.detach()
        os.kill(info["pids"][1], signal.SIGKILL)
        _wait(lambda: not _running(info["pids"][1]), 10, "rank 1 to end")
        with pytest.raises(mk.MeshError, match="rank 1 ended while it was detached"):
            mk.attach(name, timeout=10)
        mk.stop_mesh(name, force=True)
    finally:
        for pid in info["pids"].values():
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
    _assert_gone(info, name)


def test_rank_that_finished_before_the_kill_is_shown_too(reg):
    """Rank 3 finished (its reply went to the controller) before that controller was
    killed; the other ranks still run: the new controller shows the whole request,
    rank 3's lines included, once each."""
    name = _name()
    with child(name, "kill", env={"DETACH_TEST_SHORT": "5"}) as c:
        c.read_until("STARTED")
        time.sleep(1.5)  # (rank 3's 5 lines take 0.25 s)
        c.kill()
        m = mk.attach(name)
        try:
            [res] = m.resumed
            assert res.ranks == [0, 1, 2] and res.finished_ranks == [3]
            result, out = _follow(m)
            assert list(result.values()) == ["done"] * 4
            _check_lines(out, ranks=3)
            assert [int(x) for x in re.findall(r"r3 line (\d+) ", out)] == list(range(5))
        finally:
            m.stop()
        _assert_gone(c.info, name)


def _zombie() -> subprocess.Popen:
    """A child that ended and that this process has not reaped (the caller waits)."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    _wait(lambda: psutil.Process(p.pid).status() == psutil.STATUS_ZOMBIE, 30,
          "the child to end")
    return p


def test_a_zombie_controller_counts_as_gone():
    """A controller that was killed but not reaped yet (a zombie) counts as gone for
    the workers (their holder, an ordinary rank's controller) and the registry."""
    from monarch_kernel.util.procs import running
    from monarch_kernel.worker import detach

    p = _zombie()
    try:
        assert not running(p.pid)
        assert not detach._holder_alive({"pid": p.pid, "host": socket.gethostname()})
        assert not registry.pid_alive(p.pid)
        assert running(os.getpid()) and running(1)  # (pid 1: another user's counts)
    finally:
        p.wait(10)
    assert not running(p.pid)


def test_killed_controller_listed_detached_and_attachable_while_a_zombie(reg):
    """The controller is SIGKILLed and left unreaped (a zombie): the mesh's guardian
    marks the record detached (controller None, last_seen no later than the kill and
    later than the spawn), the listing says detached with a keep-alive never longer
    than the ranks', and an attach is not refused as busy."""
    name, keep = _name(), 120.0
    with child(name, "kill", keep=keep, lines=1) as c:
        c.read_until("STARTED")
        spawned = registry.load(name)
        assert spawned is not None and spawned.controller is not None
        assert spawned.controller["pid"] == c.proc.pid
        time.sleep(1.5)  # (the guardian looks at the record while the controller runs)
        t_kill = time.time()
        os.kill(c.proc.pid, signal.SIGKILL)  # (not reaped: a zombie)
        _wait(lambda: psutil.Process(c.proc.pid).status() == psutil.STATUS_ZOMBIE, 10,
              "the controller to be a zombie")
        _wait(lambda: (registry.load(name) or spawned).controller is None, 15,
              "the guardian to mark the record detached")
        rec = registry.load(name)
        assert rec is not None and spawned.last_seen < rec.last_seen <= t_kill
        t_list = time.time()
        [row] = [i for i in registry.list_meshes() if i.name == name]
        assert row.state == "detached" and row.attached_to is None
        left = row.keep_alive_left_s
        assert left is not None and 0 < left <= keep - (t_list - t_kill)
        assert psutil.Process(c.proc.pid).status() == psutil.STATUS_ZOMBIE
        m = mk.attach(name, timeout=20)
        try:
            assert sorted(int(s["pid"]) for s in m.status()) == sorted(
                c.info["pids"].values())
            rec = registry.load(name)
            assert rec is not None
            assert rec.controller == {"pid": os.getpid(), "host": socket.gethostname()}
        finally:
            m.stop()
        _assert_gone(c.info, name)


#: a controller that spawns a detachable 2-rank mesh and starts 12 requests that wait
#: for a mark file (argv[2]); the last one says it finished by a file per rank
MANY = r"""
import json, sys, time
import monarch_kernel as mk
name, mark = sys.argv[1], sys.argv[2]
m = mk.spawn_procs(2, name=name, detach=True, keep_alive=120)
print("PIDS " + json.dumps({"pids": m.record.pids, "dir": m.record.mesh_dir,
                            "guardian": m.record.guardian_pid}), flush=True)
for i in range(12):
    m.run("import os, time\n"
          f"while not os.path.exists({mark!r}): time.sleep(0.02)\n"
          f"if {i} == 11: open({mark!r} + f'.done{{rank}}', 'w').close()\n"
          f"{i}")
time.sleep(1.0)  # (the requests leave this process before the test kills it)
print("STARTED", flush=True)
time.sleep(600)
"""


def test_replies_beyond_the_bound_are_dropped_oldest_first_and_counted(reg, tmp_path):
    """Requests that finish while detached keep their replies up to
    MONARCH_DETACH_REPLIES per rank: the oldest beyond it are dropped, counted in
    dropped_replies at attach; the newest are followed as usual."""
    name = _name()
    mark = str(tmp_path / "go")
    c = Child.__new__(Child)
    c.proc = subprocess.Popen([sys.executable, "-c", MANY, name, mark],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                              env={**os.environ, "MONARCH_DETACH_REPLIES": "3"})
    c.info = {}
    try:
        c.read_until("STARTED")
        c.kill()  # (no request has finished: they wait for the mark)
        _wait(lambda: getattr(registry.load(name), "controller", 1) is None, 15,
              "the record to say detached")
        time.sleep(2.0)  # (the ranks notice within a heartbeat, 1 s)
        Path(mark).touch()
        _wait(lambda: all(os.path.exists(f"{mark}.done{r}") for r in range(2)), 60,
              "the requests to finish")
        time.sleep(0.5)  # (the last replies are kept just after the files)
        m = mk.attach(name, timeout=20)
        try:
            assert m.dropped_replies == 2 * 9
            assert len(m.resumed) == 3
            assert all(r.finished_while_detached for r in m.resumed)
            results = m.follow(timeout=30)
            assert sorted(v for vm in results for v in vm.values()) == [9, 9, 10, 10, 11, 11]
        finally:
            m.stop()
    finally:
        c.kill()
        for pid in c.info.get("pids", {}).values():
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
    _assert_gone(c.info, name)
