"""Who can connect to a mesh, and how much one message may carry.

A local mesh listens on no TCP port: its controller's two endpoints and its
workers' actor peer sockets are Unix sockets in a private 0700 directory,
removed when the mesh stops. A TCP endpoint is a CurveZMQ server whose ZAP
handler admits only the mesh's client key. Every socket and lane has a
maximum message size (``MONARCH_MAX_MESSAGE_BYTES``). Attacks from another
Unix user: ``tests/system/test_other_users.py``.
"""

from __future__ import annotations

import os
import socket
import stat
import sys

import psutil
import pytest
import zmq

from monarch_kernel.controller.controller import Controller
from monarch_kernel.errors import ProtocolError
from monarch_kernel.testing.kernel import wait_for
from monarch_kernel.transport import lane as lane_mod
from monarch_kernel.transport.sockets import (
    DEFAULT_MAX_MESSAGE,
    curve_client_keypair,
    endpoint_host,
    max_message_bytes,
)

pytestmark = pytest.mark.timeout(120)


def _tcp_listening(pid: int) -> list:
    proc = psutil.Process(pid)
    # psutil before 6.0 names it connections
    method = getattr(proc, "net_connections", None) or proc.connections
    return [c.laddr for c in method(kind="tcp") if c.status == psutil.CONN_LISTEN]


def test_a_local_mesh_listens_on_no_tcp_port():
    """Controller (this process) and workers, actor peer sockets included, listen
    on no TCP port; the endpoints are in one 0700 directory, gone after stop."""
    import cloudpickle

    from monarch_kernel import Actor, endpoint
    from monarch_kernel.mesh.procmesh import spawn_procs

    cloudpickle.register_pickle_by_value(sys.modules[__name__])

    class Echo(Actor):
        @endpoint
        def echo(self, x: int) -> int:
            return x

    before = set(_tcp_listening(os.getpid()))
    m = spawn_procs(2, timeout=60)
    try:
        ctl = m.controller
        am = m.spawn("echo", Echo)  # (starts each worker's peer socket)
        assert list(am.echo.call(3).get(timeout=30).values()) == [3, 3]
        where = ctl.ipc_dir
        assert where and stat.S_IMODE(os.stat(where).st_mode) == 0o700
        assert os.stat(where).st_uid == os.getuid()
        assert ctl.address == f"ipc://{where}/up"
        assert ctl.down_address == f"ipc://{where}/down"
        assert all(p.startswith(f"ipc://{where}/") for p in am._peers.values()), am._peers
        assert set(_tcp_listening(os.getpid())) == before
        for pl in m.launcher.placements().values():
            assert _tcp_listening(pl.pid) == [], pl
        for cmd in (psutil.Process(pl.pid).cmdline() for pl in m.launcher.placements().values()):
            assert not any(a.startswith("tcp://") for a in cmd), cmd
    finally:
        m.stop()
    assert not os.path.exists(where)


def test_tcp_endpoints_admit_only_the_mesh_client_key():
    """bind=127.0.0.1 (TCP asked for): both ROUTERs are CurveZMQ servers; a client
    with the mesh's client key completes the handshake, one with any other key is
    refused by ZAP (counted) and never gets a message read."""
    ctl = Controller(bind="127.0.0.1")
    ctx = zmq.Context()
    try:
        assert ctl.ipc_dir is None and ctl.address.startswith("tcp://127.0.0.1:")
        assert ctl.router.getsockopt(zmq.CURVE_SERVER) == 1
        assert ctl.router_down.getsockopt(zmq.CURVE_SERVER) == 1
        assert ctl.gate is not None

        def client(keys: tuple[bytes, bytes], address: str) -> tuple[zmq.Socket, zmq.Socket]:
            s = ctx.socket(zmq.DEALER)
            s.linger = 0
            s.curve_serverkey = ctl.curve_public_key
            s.curve_publickey, s.curve_secretkey = keys
            mon = s.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED
                                       | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
            s.connect(address)
            return s, mon

        def first_event(mon: zmq.Socket) -> int:
            from zmq.utils.monitor import recv_monitor_message

            assert mon.poll(10_000), "no handshake event within 10 s"
            return recv_monitor_message(mon)["event"]

        for address in (ctl.address, ctl.down_address):
            good, gmon = client(curve_client_keypair(ctl.key), address)
            assert first_event(gmon) == zmq.EVENT_HANDSHAKE_SUCCEEDED
            bad, bmon = client(zmq.curve_keypair(), address)
            assert first_event(bmon) == zmq.EVENT_HANDSHAKE_FAILED_AUTH
            for s in (good, bad):
                s.disable_monitor()
                s.close(0)
            gmon.close(0)
            bmon.close(0)
        assert ctl.gate.refused >= 2
        # another mesh's client key is refused too
        assert not ctl.gate.callback("*", curve_client_keypair(os.urandom(32))[0])
    finally:
        ctx.destroy(linger=0)
        ctl.close()


def test_a_frame_over_the_bound_closes_the_connection(monkeypatch):
    """MONARCH_MAX_MESSAGE_BYTES=1 MiB: a same-user client that sends a 4 MiB frame
    to ``up`` is disconnected by ZeroMQ before the frame is kept; the "down"
    ROUTER (which workers never send on) disconnects at a few kilobytes."""
    from zmq.utils.monitor import recv_monitor_message

    monkeypatch.setenv("MONARCH_MAX_MESSAGE_BYTES", str(1 << 20))
    ctl = Controller()
    ctx = zmq.Context()
    try:
        for address, size in ((ctl.address, 4 << 20), (ctl.down_address, 64 << 10)):
            s = ctx.socket(zmq.DEALER)
            s.linger = 0
            mon = s.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            s.connect(address)
            s.send(b"x" * size)
            assert mon.poll(10_000), f"{address}: not disconnected after a {size}-byte frame"
            assert recv_monitor_message(mon)["event"] == zmq.EVENT_DISCONNECTED
            s.disable_monitor()
            mon.close(0)
            s.close(0)
        assert not ctl.router.poll(100)
    finally:
        ctx.destroy(linger=0)
        ctl.close()
    assert not os.path.exists(ctl.ipc_dir)


def test_the_message_bound_is_read_from_the_environment(monkeypatch):
    monkeypatch.delenv("MONARCH_MAX_MESSAGE_BYTES", raising=False)
    assert max_message_bytes() == DEFAULT_MAX_MESSAGE
    monkeypatch.setenv("MONARCH_MAX_MESSAGE_BYTES", "4_000_000_000")
    assert max_message_bytes() == 4_000_000_000
    for bad in ("lots", "-1", "1000", "1e9"):
        monkeypatch.setenv("MONARCH_MAX_MESSAGE_BYTES", bad)
        with pytest.raises(ValueError, match="MONARCH_MAX_MESSAGE_BYTES"):
            max_message_bytes()


def test_a_lane_refuses_a_length_over_the_bound(monkeypatch):
    """An inherited lane (no explicit limit) refuses a u64 length over
    MONARCH_MAX_MESSAGE_BYTES before making room for it."""
    monkeypatch.setenv("MONARCH_MAX_MESSAGE_BYTES", str(1 << 20))
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    lane = lane_mod.Lane(a, "test lane")
    try:
        assert lane.bound == 1 << 20
        b.sendall((1).to_bytes(4, "little") + (1 << 62).to_bytes(8, "little") + b"x" * 100)
        wait_for(lambda: _raises(lane), 5, what="the lane's refusal")
        assert len(lane._buf) < 1 << 20
    finally:
        lane.close()
        b.close()


def _raises(lane: lane_mod.Lane) -> bool:
    try:
        lane.read()
    except ProtocolError as e:
        assert "over the limit of 1048576 bytes" in str(e)
        return True
    return False


def test_endpoint_host():
    assert endpoint_host("ipc:///tmp/mk-abc/p0-12;monarch-peer-1") == "127.0.0.1"
    assert endpoint_host("tcp://10.0.0.2:5555|KEY;NAME") == "10.0.0.2"


def test_actors_of_two_tcp_meshes_call_each_other(monkeypatch):
    """Two meshes of one program on TCP (CurveZMQ, ZeroMQ between workers): a
    caller connects to the other mesh's peer sockets with that mesh's client
    key, which their ZAP handlers admit."""
    import cloudpickle

    from monarch_kernel import Actor, endpoint
    from monarch_kernel.mesh.procmesh import spawn_procs

    cloudpickle.register_pickle_by_value(sys.modules[__name__])

    class Echo(Actor):
        @endpoint
        def echo(self, x: int) -> int:
            return x

        @endpoint
        def ask(self, other, x: int) -> int:
            return other.echo.call_one(x).get(timeout=30)

    monkeypatch.setenv("MONARCH_LANES", "0")
    a = spawn_procs(2, bind="127.0.0.1", timeout=60)
    b = spawn_procs(2, bind="127.0.0.1", timeout=60)
    try:
        ea, eb = a.spawn("ea", Echo), b.spawn("eb", Echo)
        assert all("|" in p for p in list(ea._peers.values()) + list(eb._peers.values()))
        assert ea.ask.call(eb.slice(procs=1), 3).get(timeout=60).values() == [3, 3]
        assert eb.ask.call(ea.slice(procs=0), 4).get(timeout=60).values() == [4, 4]
    finally:
        a.stop()
        b.stop()


def test_private_dirs_of_killed_processes_are_swept(monkeypatch):
    """A private directory is made under $XDG_RUNTIME_DIR, mode 0700, named with
    the process id; making one removes those of this user's dead processes."""
    import shutil
    import subprocess
    import tempfile

    from monarch_kernel.transport.sockets import private_dir, remove_private_dir

    base = tempfile.mkdtemp(prefix="mkt-", dir="/tmp")
    try:
        monkeypatch.setenv("XDG_RUNTIME_DIR", base)
        p = subprocess.Popen(["true"])
        p.wait()
        dead = os.path.join(base, f"mk-{p.pid}-abcdefgh")
        os.mkdir(dead, 0o700)
        open(os.path.join(dead, "up"), "w").close()
        alive = os.path.join(base, f"mk-{os.getppid()}-abcdefgh")
        os.mkdir(alive, 0o700)
        made = private_dir()
        assert os.path.dirname(made) == base
        assert os.path.basename(made).startswith(f"mk-{os.getpid()}-")
        assert stat.S_IMODE(os.stat(made).st_mode) == 0o700
        assert not os.path.exists(dead) and os.path.exists(alive)
        remove_private_dir(made)
        assert not os.path.exists(made)
    finally:
        shutil.rmtree(base, ignore_errors=True)
