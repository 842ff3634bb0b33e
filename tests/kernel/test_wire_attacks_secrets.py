"""What an eavesdropper or another local user could get at.

Mesh keys are random per mesh and never in a command line; key files,
shared-memory files and the kernel's connection file are 0600; a local mesh
binds Unix sockets in a 0700 directory, no TCP port. A TCP endpoint is a
CurveZMQ server: a sniffer on the wire (:class:`LoopbackSniffer`, needs root)
sees no code, output or results, and a client without the mesh key is refused
at the handshake.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import time

import psutil
import pytest
import zmq
from wire_attack_helpers import controller_drops, dealer, two_rank_mesh

from monarch_kernel.testing.kernel import wait_for
from monarch_kernel.wire import protocol as protocol

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def mesh():
    """A 2-rank local mesh for this module (the test process is its controller)."""
    yield from two_rank_mesh()


# ------------------------------------------------------------- keys, files, ports
def test_keys_are_random_per_mesh_and_never_in_argv(mesh):
    from monarch_kernel.mesh.procmesh import spawn_procs

    other = spawn_procs(1)
    try:
        assert len(mesh.controller.key) == len(other.controller.key) == 32
        assert mesh.controller.key != other.controller.key
        for m in (mesh, other):
            key = m.controller.key
            for pl in m.launcher.placements().values():
                cmd = psutil.Process(pl.pid).cmdline()
                text = " ".join(cmd)
                assert key.hex() not in text.lower() and key.hex().upper() not in text
                assert "MONARCH_MESH_KEY" not in text
    finally:
        other.stop()


def test_key_file_of_the_slurm_launcher_is_0600(tmp_path):
    from monarch_kernel.launchers.slurm import SlurmLauncher

    la = SlurmLauncher(key_dir=str(tmp_path / "keys"))
    path = la._write_key(protocol.new_key())
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(tmp_path / "keys").st_mode) & 0o077 == 0
    finally:
        os.unlink(path)


def test_shared_memory_files_are_0600():
    from monarch_kernel.wire import shm as shm

    if not shm.available():
        pytest.skip("no /dev/shm here")
    buf = shm.create(memoryview(b"x" * 8192))
    try:
        path = os.path.join(shm.DIRECTORY, buf.name)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    finally:
        shm.unlink(buf.name)
    pool = shm.Pool()
    try:
        pooled = pool.put(memoryview(b"y" * (1 << 20)))
        if pooled is not None:
            path = os.path.join(shm.DIRECTORY, pooled.name)
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    finally:
        pool.close()


def test_kernel_connection_file_is_0600(kernel):
    assert stat.S_IMODE(os.stat(kernel.km.connection_file).st_mode) == 0o600


def _tcp_connections(proc: psutil.Process) -> list:
    """``proc``'s TCP sockets (``net_connections``; psutil before 6.0 names it ``connections``)."""
    method = getattr(proc, "net_connections", None) or proc.connections
    return method(kind="tcp")


def test_a_local_mesh_binds_unix_sockets_in_a_private_directory(mesh):
    ctl = mesh.controller
    assert ctl.address.startswith("ipc://") and ctl.down_address.startswith("ipc://")
    where = os.path.dirname(ctl.address[len("ipc://"):])
    assert stat.S_IMODE(os.stat(where).st_mode) == 0o700
    # no worker listens on TCP either (peer sockets for actors)
    for pl in mesh.launcher.placements().values():
        assert not [c for c in _tcp_connections(psutil.Process(pl.pid))
                    if c.status == psutil.CONN_LISTEN]


# --------------------------------------- beyond loopback: CurveZMQ
class LoopbackSniffer:
    """Records the TCP payload bytes of one port seen on the ``lo`` interface
    (an AF_PACKET socket: needs root). Traffic between two addresses of this
    host, e.g. to the eth0 address, goes over ``lo`` too."""

    def __init__(self, port: int) -> None:
        import socket
        import threading

        self.port = port
        self.data = bytearray()
        self.packets = 0
        self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))
        self.sock.bind(("lo", 0))
        self.sock.settimeout(0.1)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import struct

        while not self._stop.is_set():
            try:
                pkt = self.sock.recv(1 << 18)
            except OSError:
                continue
            if len(pkt) < 34 or pkt[12:14] != b"\x08\x00" or pkt[23] != 6:  # IPv4, TCP
                continue
            ihl = (pkt[14] & 0x0F) * 4
            tcp = pkt[14 + ihl:]
            sport, dport = struct.unpack("!HH", tcp[:4])
            if self.port in (sport, dport):
                self.packets += 1
                self.data += tcp[(tcp[12] >> 4) * 4:]

    def stop(self) -> bytes:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()
        return bytes(self.data)


def _non_loopback_address() -> str:
    from monarch_kernel.transport.netaddr import primary_address
    from monarch_kernel.transport.sockets import is_loopback

    addr = primary_address()
    if is_loopback(addr):
        pytest.skip("this machine has no address beyond loopback")
    return addr


def _sniff_a_cell(m, token: str) -> tuple[bytes, int]:
    """Run a cell that prints ``token`` while sniffing the controller's port."""
    try:
        sniffer = LoopbackSniffer(int(m.controller.address.rsplit(":", 1)[1]))
    except PermissionError:
        pytest.skip("sniffing lo needs root (AF_PACKET)")
    try:
        vm = m.collect(m.run(f"print('{token}', rank); '{token}-result'"))
        assert list(vm.values()) == [f"{token}-result"] * len(m)
        time.sleep(0.3)
    finally:
        data = sniffer.stop()
    return data, sniffer.packets


def test_beyond_loopback_traffic_is_encrypted(capfd, monkeypatch):
    """bind=<eth0 address>: the ROUTER is a CurveZMQ server, the workers are
    CURVE clients, and a sniffer on the wire sees none of the code, output or
    results; with encrypt=False the same sniffer sees them in clear (so it does
    look at the right traffic), and a warning says so.

    The local workers here stand in for workers on other hosts, so they use
    ZeroMQ too (``MONARCH_LANES=0``): with lanes, the default, local workers
    send nothing over the network at all."""
    import secrets

    from monarch_kernel.mesh.procmesh import spawn_procs

    monkeypatch.setenv("MONARCH_LANES", "0")
    addr = _non_loopback_address()
    token = "tok" + secrets.token_hex(8)
    m = spawn_procs(2, bind=addr, timeout=30)
    try:
        ctl = m.controller
        assert ctl.address.startswith(f"tcp://{addr}:")
        assert ctl.curve_public_key is not None
        assert ctl.router.getsockopt(zmq.CURVE_SERVER) == 1
        for pl in m.launcher.placements().values():
            cmd = psutil.Process(pl.pid).cmdline()
            assert f"--curve-server-key={ctl.curve_public_key.decode()}" in cmd
        data, packets = _sniff_a_cell(m, token)
        assert packets > 0
        assert token.encode() not in data, "mesh traffic beyond loopback travels in clear"
        assert protocol.MAGIC not in data and ctl.codec._prefix.encode() not in data
    finally:
        m.stop()
    assert "NOT encrypted" not in capfd.readouterr().err

    m = spawn_procs(2, bind=addr, encrypt=False, timeout=30)
    try:
        err = capfd.readouterr().err
        assert "warning" in err and "NOT encrypted" in err and addr in err, err
        assert m.controller.curve_public_key is None
        assert m.controller.router.getsockopt(zmq.CURVE_SERVER) == 0
        data, _ = _sniff_a_cell(m, token)
        assert token.encode() in data and protocol.MAGIC in data  # the control: clear text is seen
        assert m.controller.codec._prefix.encode() in data  # ... and so are header fields
    finally:
        m.stop()


def test_a_local_mesh_is_not_encrypted(mesh):
    """(Unix sockets only this user can connect: nobody on a wire to read.)"""
    assert mesh.controller.address.startswith("ipc://")
    assert mesh.controller.curve_public_key is None
    assert mesh.controller.router.getsockopt(zmq.CURVE_SERVER) == 0


def test_encrypted_controller_refuses_plain_and_wrongly_keyed_clients(caplog):
    """A plain (NULL mechanism) client never gets through the CURVE handshake; nor
    does a CURVE client that knows the server's public key (it is on the workers'
    command line) but not the mesh's client key: the ZAP handler refuses it, so
    none of its messages is read."""
    from monarch_kernel.mesh.procmesh import spawn_procs

    caplog.set_level(logging.WARNING, logger="monarch_kernel.controller.controller")
    m = spawn_procs(1, bind=_non_loopback_address(), timeout=30)
    ctx = zmq.Context()
    try:
        ctl = m.controller
        wrong = protocol.Codec(protocol.new_key(), "r0")
        plain = dealer(ctx, ctl.address, b"r0")
        # (its connection may already be refused by the CURVE server: nowhere to send)
        with contextlib.suppress(zmq.Again):
            plain.send_multipart(wrong.encode("reply", {"status": "ok", "value": "FORGED"}))
        curve = ctx.socket(zmq.DEALER)
        curve.linger = 0
        curve.setsockopt(zmq.IDENTITY, b"r0")
        curve.curve_serverkey = ctl.curve_public_key
        curve.curve_publickey, curve.curve_secretkey = zmq.curve_keypair()
        curve.connect(ctl.address)
        with contextlib.suppress(zmq.Again):  # (refused: maybe nowhere to send)
            curve.send_multipart(wrong.encode("stream", {"name": "stdout",
                                                         "text": "FORGED\n"}))
        wait_for(lambda: ctl.gate.refused >= 1, 10, what="the CURVE handshake refused")
        time.sleep(0.5)
        assert controller_drops(caplog) == []  # neither message was read
        assert not plain.poll(100) and not curve.poll(100)
        assert list(m.collect(m.run("rank + 1")).values()) == [1]
    finally:
        ctx.destroy(linger=0)
        m.stop()


def test_wildcard_bind_listens_everywhere_encrypted():
    from monarch_kernel.mesh.procmesh import spawn_procs

    m = spawn_procs(2, bind="0.0.0.0", timeout=30)
    try:
        ctl = m.controller
        port = int(ctl.address.rsplit(":", 1)[1])
        listening = [c.laddr.ip for c in _tcp_connections(psutil.Process())
                     if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
        assert listening == ["0.0.0.0"]
        assert ctl.curve_public_key is not None
        assert ctl.router.getsockopt(zmq.CURVE_SERVER) == 1
        assert list(m.collect(m.run("rank")).values()) == [0, 1]
    finally:
        m.stop()
