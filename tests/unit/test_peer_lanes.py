"""A worker's peer lanes (actor_peers) under hostile or scarce conditions: a
listener that is not the peer's, a forked child, running out of fds, a
claim of a huge message under an address-space limit. Each case runs in a
child interpreter of its own (it changes resource limits, forks or switches
user) around a real :class:`PeerHost`, with a stand-in for its worker."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="peer lanes use Linux's abstract socket names")

_PRELUDE = """
import logging, os, socket, struct, sys, threading, time, types
import zmq
from monarch_kernel.wire import protocol as protocol
from monarch_kernel.actor.peers import PeerHost

warnings = []
class _Count(logging.Handler):
    def emit(self, record):
        warnings.append(record.getMessage())
logging.getLogger("monarch_kernel").addHandler(_Count(logging.WARNING))

def make_host(rank=0):
    worker = types.SimpleNamespace(rank=rank, codec=protocol.Codec(b"k" * 32, f"w{rank}"),
                                   ctx=zmq.Context(), address="tcp://127.0.0.1:1",
                                   curve_server_key=None, actors={})
    return PeerHost(worker)
"""


def _run(body: str, timeout: float = 60) -> str:
    """Run ``body`` after the prelude in a fresh interpreter; its stdout."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
         os.environ.get("PYTHONPATH", "")]))
    env.pop("MONARCH_LANES", None)
    r = subprocess.run([sys.executable, "-c", _PRELUDE + textwrap.dedent(body)],
                       capture_output=True, text=True, timeout=timeout, env=env, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def test_a_listener_that_is_not_the_peers_process_is_refused():
    """A caller checks with SO_PEERCRED that the process listening on a peer's
    lane name is the peer (the pid in the name) and of this user; else it
    keeps ZeroMQ for that address."""
    out = _run("""
        from monarch_kernel.transport.peer_lanes import dial as _dial
        h = make_host()
        # a listener of this process under a name that claims another pid
        fake = f"monarch-peer-{os.getpid() + 1}-00112233aabbccdd"
        s = socket.socket(socket.AF_UNIX); s.bind("\\0" + fake); s.listen(1)
        print("other pid:", _dial(fake, "t", 1 << 20))
        addr = f"tcp://127.0.0.1:5555;{fake}"
        print("lane to it:", h._connect(addr), "kept:", h.lane_to[addr])
        # a peer on another host is never dialled, whatever its name
        far = f"tcp://10.99.99.99:5555;{h.listener[1]}"
        print("lane to another host:", h._connect(far))
        real = _dial(h.listener[1], "t", 1 << 20)  # (the control: the real listener)
        print("real:", type(real).__name__)
        if os.geteuid() == 0:  # another user's listener, named with its own pid
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:
                try:
                    os.setgid(65534); os.setuid(65534)
                    t = socket.socket(socket.AF_UNIX)
                    t.bind(f"\\0monarch-peer-{os.getpid()}-0011223344556677"); t.listen(1)
                    os.write(w, b"1"); time.sleep(5)
                finally:
                    os._exit(0)
            os.read(r, 1)
            print("other user:", _dial(f"monarch-peer-{pid}-0011223344556677", "t", 1 << 20))
            os.kill(pid, 9); os.waitpid(pid, 0)
        else:
            print("other user: None")
    """)
    assert "other pid: None" in out
    assert "lane to it: None kept: None" in out
    assert "lane to another host: None" in out
    assert "real: Lane" in out
    assert "other user: None" in out


def test_a_forked_child_does_not_keep_the_listener():
    """After a worker that forked (a DataLoader) is gone, its lane name takes no
    connection (the child closed its copy of the listener at the fork)."""
    out = _run("""
        r, w = os.pipe()
        r2, w2 = os.pipe()
        pid = os.fork()
        if pid == 0:  # the worker
            try:
                h = make_host()
                os.write(w, h.listener[1].encode())
                if os.fork() == 0:  # its user code's long-lived child
                    os.write(w2, b"1")  # (past the fork hooks)
                    time.sleep(5)
                    os._exit(0)
            finally:
                os._exit(0)  # the worker is gone; its child lives on
        name = os.read(r, 200).decode()
        os.waitpid(pid, 0)
        os.read(r2, 1)
        s = socket.socket(socket.AF_UNIX); s.settimeout(5)
        try:
            s.connect("\\0" + name)
            print("connected")
        except ConnectionRefusedError:
            print("refused")
    """)
    assert out.strip() == "refused"


def test_out_of_fds_the_listener_waits_instead_of_spinning():
    """accept() failing with EMFILE leaves the connection in the backlog: the
    I/O thread stops watching the listener for a moment instead of being
    woken at once, again and again."""
    out = _run("""
        import resource
        h = make_host()
        name = h.listener[1]
        time.sleep(0.3)
        stat = os.open(f"/proc/self/task/{h._thread.native_id}/stat", os.O_RDONLY)
        def cpu():
            f = os.pread(stat, 4096, 0).decode().rsplit(")", 1)[1].split()
            return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
        nfd = len(os.listdir("/proc/self/fd"))
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (nfd + 2, hard))
        hog = []
        try:
            while True:
                hog.append(os.open("/dev/null", os.O_RDONLY))
        except OSError:
            pass
        pid = os.fork()
        if pid == 0:  # a peer connecting (its fds are its own)
            for fd in hog:
                os.close(fd)
            s = socket.socket(socket.AF_UNIX); s.connect("\\0" + name)
            time.sleep(3)
            os._exit(0)
        c0, n0 = cpu(), len(warnings)
        time.sleep(2)
        print(f"cpu {cpu() - c0:.2f} warnings {len(warnings) - n0}")
        for fd in hog:
            os.close(fd)
        os.waitpid(pid, 0)
    """)
    cpu, n = float(out.split()[1]), int(out.split()[3])
    assert cpu < 0.5, out  # (it spun at 2 s of CPU in 2 s before)
    assert 1 <= n <= 8, out  # one warning per retry, every 0.5 s


def test_a_huge_claim_under_a_memory_limit_loses_that_lane_only():
    """A connection claiming a 1 GiB message under an address-space limit: room
    is made as bytes come, so nothing fails; the I/O thread lives on and
    takes other connections."""
    out = _run("""
        import resource
        h = make_host()
        with open("/proc/self/status") as f:
            vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize"))
        resource.setrlimit(resource.RLIMIT_AS,
                           (vm + (600 << 20), resource.getrlimit(resource.RLIMIT_AS)[1]))
        u = socket.socket(socket.AF_UNIX); u.settimeout(5); u.connect("\\0" + h.listener[1])
        u.sendall(struct.pack("<IQ", 1, 1 << 30) + bytes(1 << 18))
        time.sleep(1.0)
        v = socket.socket(socket.AF_UNIX); v.settimeout(5); v.connect("\\0" + h.listener[1])
        deadline = time.monotonic() + 10
        while len(h.accepted) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        print("alive", h._thread.is_alive(), "accepted", len(h.accepted))
    """)
    assert out.strip() == "alive True accepted 2"


def test_a_rank_declared_dead_has_its_lane_closed():
    """fail_rank (the controller says a rank is gone, e.g. a hung one that
    missed its heartbeats) closes this worker's lane to it, and calls to it
    fail at once."""
    out = _run("""
        a, b = make_host(0), make_host(1)
        addr = b.address
        lane = a._connect(addr)
        deadline = time.monotonic() + 10
        while len(b.accepted) < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        a.fail_rank(1, addr, "rank 1 missed its heartbeats")
        while (addr in a.lane_to or len(b.accepted)) and time.monotonic() < deadline:
            time.sleep(0.02)
        print("closed", lane.eof and addr not in a.lane_to, "callee saw eof", not b.accepted)
        try:
            a.request([1], {1: addr}, {"a": "x", "m": "y"}, oneway=False)
        except Exception as e:
            print(type(e).__name__, e)
    """)
    assert "closed True callee saw eof True" in out, out
    assert "MeshFailure rank 1 missed its heartbeats" in out, out
