"""Issue 9: attacks on the wire, with raw ZeroMQ sockets.

Three targets:

* a **worker**, started by hand and pointed at a ROUTER this test binds (the
  test is its controller, with the right key for the good requests);
* a **controller** of a real mesh, reached by a DEALER that claims to be
  rank 0;
* a worker's **peer socket** (the ROUTER actors call each other through).

Every bad message carries an ``execute`` (or a ``call``) whose code, or
whose pickle when unpickled, would create a marker file. After each attack
the marker must be absent, a warning must have been logged ("dropped a
message") and the target must still serve a good request.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import stat
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import zmq

from monarch_kernel import protocol, serialize
from monarch_kernel.testing import wait_for

pytestmark = pytest.mark.timeout(120)

SMALL = 64 * 1024  # the worker's --max-header / --max-buffers in these tests (bytes)


def _split(frames: list[Any]) -> tuple[bytes, bytes]:
    """(header bytes, payload) of a message's envelope frame (``frames[0]``)."""
    env = bytes(frames[0])
    assert env[:4] == protocol.MAGIC
    n = int.from_bytes(env[36:40], "little")
    assert 40 + n <= len(env)
    return env[40:40 + n], env[40 + n:]


def _fields(header: bytes) -> dict:
    """The fields of binary header bytes (protocol._parse_header)."""
    t, mid, parent, sender, lengths, sh = protocol._parse_header(header)
    return {"t": t, "id": mid, "p": parent, "s": sender, "bl": list(lengths), "sh": list(sh)}


def _envelope(header: bytes, payload: bytes, sig: bytes = b"\0" * 32,
              magic: bytes = protocol.MAGIC) -> bytes:
    """An envelope frame built by hand, with whatever signature (unsigned variants)."""
    return magic + sig + len(header).to_bytes(4, "little") + header + payload


class Evil:
    """Unpickling it creates ``path``: proof that something was unpickled."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (open, (self.path, "a"))


class FakeController:
    """A ROUTER bound on loopback and one worker process connected to it.

    Parameters
    ----------
    tmp : Path
        Where the worker's stderr (its log) goes.
    limits : bool
        Start the worker with ``--max-header`` / ``--max-buffers`` of :data:`SMALL`.
    """

    def __init__(self, tmp: Path, limits: bool = True) -> None:
        self.key = protocol.new_key()
        self.codec = protocol.Codec(self.key, "ctl")
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.linger = 0
        port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        self.errpath = tmp / "worker-stderr.txt"
        self._err = open(self.errpath, "wb")
        cmd = [sys.executable, "-m", "monarch_kernel.worker", "--controller", self.address,
               "--rank", "0", "--world-size", "1", "--heartbeat-timeout", "120",
               "--telemetry-interval", "0"]
        if limits:
            cmd += ["--max-header", str(SMALL), "--max-buffers", str(SMALL)]
        env = dict(os.environ, MONARCH_MESH_KEY=self.key.hex())
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=self._err)
        hello = self.recv(60)
        assert hello.type == "hello", hello
        self.identity = hello.identity[0]

    def recv(self, timeout: float) -> protocol.Message:
        """The next message from the worker that is not a heartbeat."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.router.poll(int(left * 1000)):
                raise TimeoutError(f"no message from the worker within {timeout} s")
            msg = self.codec.decode(self.router.recv_multipart(), router=True)
            if msg.type not in ("heartbeat", "state"):
                return msg

    def send_raw(self, frames: list[Any]) -> None:
        self.router.send_multipart([self.identity, *frames])

    def execute(self, code: str, timeout: float = 30) -> tuple[dict, str]:
        """Run ``code`` (correctly signed); its reply content and stdout."""
        frames = self.codec.encode("execute", {"code": code})
        mid = _fields(_split(frames)[0])["id"]
        self.send_raw(frames)
        out = []
        while True:
            msg = self.recv(timeout)
            if msg.parent != mid:
                continue
            if msg.type == "stream":
                out.append(msg.content["text"])
            elif msg.type == "reply":
                return msg.content, "".join(out)

    def log(self) -> str:
        return self.errpath.read_bytes().decode(errors="replace")

    def dropped(self) -> int:
        return self.log().count("dropped a message")

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.send_raw(self.codec.encode("stop", {}))
                try:
                    self.proc.wait(10)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(10)
        finally:
            self._err.close()
            self.router.close(0)
            self.ctx.term()


@pytest.fixture(scope="module")
def fake(tmp_path_factory):
    fc = FakeController(tmp_path_factory.mktemp("fake-controller"))
    try:
        yield fc
    finally:
        fc.close()


@pytest.fixture
def marker(tmp_path):
    return tmp_path / "ran"


def _marker_code(marker: Path) -> str:
    return f"open({str(marker)!r}, 'a').write('ran\\n')"


def _attack(fake: FakeController, marker: Path, messages: list[list[Any]],
            expect: str | None = None) -> None:
    """Send each bad message; check nothing ran, each was logged, the worker still works."""
    before = fake.dropped()
    for frames in messages:
        fake.send_raw(frames)
    reply, out = fake.execute("print('still here'); rank + 41")
    assert reply == {"status": "ok", "value": 41}, reply
    assert out == "still here\n"
    # the I/O thread logged before it handed the good request on; the log is unbuffered
    wait_for(lambda: fake.dropped() >= before + len(messages), 10,
             what=f"{len(messages)} 'dropped a message' warnings")
    assert fake.dropped() == before + len(messages), fake.log()
    if expect is not None:
        assert expect in fake.log()
    assert not marker.exists(), "a bad message was executed or unpickled"
    assert fake.proc.poll() is None


# ------------------------------------------------------------------ a worker
def test_good_request_runs(fake, marker):
    """The control: a correctly signed execute does create the marker."""
    reply, _ = fake.execute(_marker_code(marker))
    assert reply["status"] == "ok" and marker.read_text() == "ran\n"


def test_unsigned_messages_are_dropped(fake, marker):
    frames = fake.codec.encode("execute", {"code": _marker_code(marker),
                                           "evil": Evil(str(marker))})
    assert len(frames) == 1
    header, payload = _split(frames)
    _attack(fake, marker, [
        [protocol.MAGIC + len(header).to_bytes(4, "little") + header + payload],  # no signature
        [_envelope(header, payload, b"\0" * 32)],  # a zero signature
        [_envelope(header, payload, os.urandom(32))],  # a made-up signature
        [_envelope(header, payload, b"0" * 64)],  # a version 1 (hex) signature's size
        [_envelope(header, payload, b"not hex at all \xff")],
    ], expect="bad message signature")


def test_wrongly_signed_message_is_dropped_before_unpickling(fake, marker):
    other = protocol.Codec(protocol.new_key(), "ctl")  # another mesh's key
    frames = other.encode("execute", {"code": _marker_code(marker), "evil": Evil(str(marker))})
    _attack(fake, marker, [frames], expect="bad message signature")


def test_tampered_message_is_dropped(fake, marker):
    frames = [bytes(f) for f in fake.codec.encode("execute", {"code": "None"})]
    assert len(frames) == 1
    sig = frames[0][4:36]  # made for the harmless code
    h, _ = _split(frames)
    payload = bytes(serialize.dumps({"code": _marker_code(marker)})[0])
    swapped = [_envelope(h, payload, sig)]
    header = _fields(h)
    assert header["t"] == "execute"
    stop = protocol.pack_header("stop", header["id"], header["p"], header["s"])
    assert stop != h and len(stop) == len(h) and _fields(stop)["t"] == "stop"
    retyped = [_envelope(stop, payload, sig)]
    _attack(fake, marker, [swapped, retyped], expect="bad message signature")


def test_replayed_message_runs_once(fake, marker):
    frames = [bytes(f) for f in fake.codec.encode("execute", {"code": _marker_code(marker)})]
    fake.send_raw(frames)
    wait_for(marker.exists, 10, what="the first (genuine) execution")
    _attack(fake, marker.with_name("unused"), [frames, frames], expect="replayed message id")
    assert marker.read_text() == "ran\n", "the replayed execute ran again"


def test_truncated_messages_are_dropped(fake, marker):
    good = [bytes(f) for f in fake.codec.encode(
        "execute", {"code": _marker_code(marker), "arr": np.arange(1000.0)})]
    assert len(good) == 2  # envelope, one buffer
    env, buf = good
    header, _ = _split(good)
    _attack(fake, marker, [
        good[:1],  # the buffer frame missing
        [env, buf[:-1]],  # the buffer cut short
        [env[:-1], buf],  # the payload cut short
        [env[:40 + len(header)], buf],  # no payload
        [env[:40], buf],  # no header
        [env[:36]],  # no header length
        [env[:20]],  # half a signature
        [env[:4]],  # the magic alone
        [protocol.MAGIC + env[36:], buf],  # no signature
        [env[4:], buf],  # no magic
        [buf],  # no envelope
    ])


def test_oversized_header_is_dropped_before_hashing_or_unpickling(fake, marker):
    content = {"code": _marker_code(marker) + "  # " + "x" * SMALL, "evil": Evil(str(marker))}
    frames = fake.codec.encode("execute", content)  # correctly signed, but too big
    _attack(fake, marker, [frames], expect=f"exceeds the limit of {SMALL} bytes")


def test_oversized_buffers_are_dropped(fake, marker):
    content = {"code": _marker_code(marker), "evil": Evil(str(marker)),
               "blob": np.zeros(SMALL // 8 + 1)}
    frames = fake.codec.encode("execute", content)
    assert len(frames) == 2
    _attack(fake, marker, [frames], expect=f"exceed the limit of {SMALL} bytes")


def test_garbage_frames_are_dropped(fake, marker):
    rng = np.random.default_rng(9)
    evil = pickle.dumps({"code": _marker_code(marker), "evil": Evil(str(marker))})
    head = protocol.pack_header("execute", "other-version", None, "ctl")
    sealed = bytes(fake.codec.seal(head, evil)[0])  # signed with the right key...
    messages: list[list[Any]] = [
        [b""],
        [b"garbage"],
        [evil],  # a bare pickle, as an old or naive protocol would send
        [protocol.MAGIC],
        [protocol.MAGIC, b"", b"", b""],
        [protocol.MAGIC + bytes(36)],  # zero signature, empty header
        [b"MK/1", b"0" * 64, b"{}", evil],  # version 1 framing
        [_envelope(head, evil, magic=b"MK/3")],  # another protocol version
        [b"MK/1" + sealed[4:]],  # ... even correctly signed, a wrong magic is refused
        [rng.bytes(int(n)) for n in rng.integers(0, 300, size=7)],
        [protocol.MAGIC + rng.bytes(300), *(rng.bytes(int(n)) for n in rng.integers(0, 300, size=4))],
    ]
    _attack(fake, marker, messages)


def test_signed_but_malformed_headers_are_dropped(fake, marker):
    """Even with the right key (a buggy sender), a bad header is a ProtocolError,
    never a crash of the worker's I/O thread."""
    payload = bytes(serialize.dumps({"code": _marker_code(marker)})[0])
    pack = protocol.pack_header

    def signed(header: bytes, buffers: tuple = ()) -> list[bytes]:
        return fake.codec.seal(header, payload, buffers)

    def raw(code: int = protocol.TYPE_CODES.index("execute"), sender: bytes = b"ctl",
            mid: bytes = b"x", parent: bytes | None = None, lengths: tuple = (),
            sh: tuple = (), declared: dict | None = None) -> bytes:
        """A header by hand, with whatever bytes and declared lengths and counts."""
        d = {"ls": len(sender), "li": len(mid), "lp": 255 if parent is None else len(parent),
             "nb": len(lengths), "nsh": len(sh), **(declared or {})}
        return b"".join((struct.pack("<BBBBHH", code, d["ls"], d["li"], d["lp"], d["nb"],
                                     d["nsh"]),
                         sender, mid, parent or b"", struct.pack(f"<{len(lengths)}Q", *lengths),
                         struct.pack(f"<{len(sh)}H", *sh)))

    def beyond(header: bytes) -> list[bytes]:  # a header length past the end of the frame
        body = (len(header) + len(payload) + 1).to_bytes(4, "little") + header + payload
        return [protocol.MAGIC + fake.codec._sign(body) + body]

    # the controls: the hand-built header is the packed one, and it is accepted
    assert raw(mid=b"m0") == pack("execute", "m0", None, "ctl")
    assert _fields(raw(mid=b"m0", parent=b"p", lengths=(3,), sh=(0,))) == {
        "t": "execute", "id": "m0", "p": "p", "s": "ctl", "bl": [3], "sh": [0]}
    messages = [
        signed(pack(len(protocol.TYPE_CODES), "m1", None, "ctl")),  # unknown type code
        signed(pack(255, "m2", None, "ctl")),
        signed(pack("execute", "m3", None, "ctl", (0, 0, 0))),  # buffer count mismatch
        signed(pack("execute", "m3b", None, "ctl"), (b"abc",)),  # buffer lengths missing
        signed(pack("execute", "m3c", None, "ctl", (4,)), (b"abc",)),  # ... or wrong
        signed(pack("execute", "m3d", None, "ctl", (3, 0)), (b"abc",)),  # ... or too many
        signed(pack("execute", "m3e", None, "ctl", (3,), (1,)), (b"abc",)),  # shm index too big
        signed(pack("execute", "m3f", None, "ctl", (3,), (0,)), (b"abc",)),  # not a descriptor
        signed(raw(mid=b"m\xe94")),  # id not ASCII
        signed(raw(mid=b"m5", parent=b"\xff")),  # parent not ASCII
        signed(raw(mid=b"m6", sender=b"r\x800")),  # sender not ASCII
        signed(raw(mid=b"m7", declared={"li": 9})),  # lengths that do not add up: too long
        signed(raw(mid=b"m7b", declared={"ls": 0})),  # ... too short
        signed(raw(mid=b"m7c", declared={"lp": 0}, parent=b"p")),
        signed(raw(mid=b"m7d", declared={"nb": 1})),  # a buffer length that is not there
        signed(raw(mid=b"m7e", declared={"nsh": 2}, sh=(0,))),
        signed(raw(mid=b"m7f") + b"\0"),  # a byte beyond the declared fields
        signed(pack("execute", "m8", None, "ctl")[:7]),  # truncated: not even the fixed part
        signed(pack("execute", "m8b", "p", "ctl")[:-1]),  # truncated in the names
        signed(pack("execute", "m8c", None, "ctl", (3,))[:-1], (b"abc",)),  # in the lengths
        signed(b""),
        signed(json.dumps({"t": "execute", "id": "m9", "p": None, "s": "ctl",
                           "nb": 0}).encode()),  # a version 1 (JSON) header
        signed(b"\xff{"),
        beyond(pack("execute", "m10", None, "ctl")),
    ]
    _attack(fake, marker, messages, expect="malformed message header")
    assert "malformed shared-memory descriptor" in fake.log()
    fake.send_raw(signed(pack("execute", "m0", None, "ctl")))  # the control
    wait_for(marker.exists, 10, what="the well-formed execute")


def test_default_header_limit_is_64_mib(tmp_path, marker):
    fc = FakeController(tmp_path, limits=False)
    try:
        big = {"code": _marker_code(marker), "pad": b"x" * protocol.DEFAULT_MAX_HEADER,
               "evil": Evil(str(marker))}
        frames = fc.codec.encode("execute", big)
        assert len(frames) == 1  # bytes stay in the pickle stream: counts toward the header
        _attack(fc, marker, [frames], expect="exceeds the limit of 67108864 bytes")
    finally:
        fc.close()


def test_worker_limits_are_configurable():
    out = subprocess.run([sys.executable, "-m", "monarch_kernel.worker", "--help"],
                         capture_output=True, text=True, timeout=60)
    assert "--max-header" in out.stdout and "--max-buffers" in out.stdout


# ---------------------------------------------------------- a controller
@pytest.fixture(scope="module")
def mesh():
    from monarch_kernel.procmesh import spawn_procs

    m = spawn_procs(2)
    try:
        yield m
    finally:
        m.stop()


def _dealer(ctx: zmq.Context, address: str, identity: bytes) -> zmq.Socket:
    s = ctx.socket(zmq.DEALER)
    s.linger = 0
    s.setsockopt(zmq.IDENTITY, identity)
    s.connect(address)
    return s


def _controller_drops(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "monarch_kernel.controller" and "dropped a message" in r.getMessage()]


def test_forged_replies_and_output_to_the_controller_are_dropped(mesh, caplog):
    caplog.set_level(logging.WARNING, logger="monarch_kernel.controller")
    ctl = mesh.controller
    req = mesh.run("import time; time.sleep(1.0); 'genuine'", [0])
    ctx = zmq.Context()
    try:
        d = _dealer(ctx, ctl.address, b"r0")
        wrong = protocol.Codec(protocol.new_key(), "r0")
        reply = {"status": "ok", "value": "FORGED"}
        stream = {"name": "stdout", "text": "FORGED output\n"}
        h, p = _split(wrong.encode("reply", reply, parent=req.id))
        right = protocol.Codec(ctl.key, "r0")  # a signed message on the wrong connection
        signed = right.encode("reply", reply, parent=req.id)
        attacks = [
            wrong.encode("reply", reply, parent=req.id),  # wrong key
            wrong.encode("stream", stream, parent=req.id),
            [protocol.MAGIC + len(h).to_bytes(4, "little") + h + p],  # unsigned
            [_envelope(h, p, b"\0" * 32)],
            [_envelope(h, p, os.urandom(32))],
            [_envelope(h, p)[:38]],  # truncated
            [b"garbage"],
            [protocol.MAGIC + os.urandom(36 + 100), os.urandom(1000)],
            signed,
            signed,  # ... and replayed
        ]
        for frames in attacks:
            d.send_multipart(frames)
        wait_for(lambda: len(_controller_drops(caplog)) >= len(attacks), 10,
                 what="the controller's warnings")
        drops = _controller_drops(caplog)
        assert len(drops) == len(attacks), drops
        assert any("signature" in m for m in drops)
        assert any("replayed" in m for m in drops)
        assert any("does not match its connection" in m for m in drops)
        assert not d.poll(200), "the attacker's connection received traffic meant for rank 0"
        vm = mesh.collect(req, timeout=30)
        assert list(vm.values()) == ["genuine"]
        events = []
        while not req.events.empty():
            events.append(req.events.get())
        assert not any("FORGED" in str(e) for e in events)
        d.close(0)
    finally:
        ctx.destroy(linger=0)
    assert list(mesh.collect(mesh.run("rank * 10")).values()) == [0, 10]


def test_oversized_message_to_the_controller_is_dropped(mesh, caplog):
    caplog.set_level(logging.WARNING, logger="monarch_kernel.controller")
    ctx = zmq.Context()
    try:
        d = _dealer(ctx, mesh.controller.address, b"r1")
        head = protocol.pack_header("reply", "big", None, "r1")
        d.send_multipart([_envelope(head, b"x" * protocol.DEFAULT_MAX_HEADER)])
        wait_for(lambda: _controller_drops(caplog), 20, what="the controller's warning")
        assert "exceeds the limit of 67108864 bytes" in _controller_drops(caplog)[0]
    finally:
        ctx.destroy(linger=0)
    assert list(mesh.collect(mesh.run("rank")).values()) == [0, 1]


def test_a_connection_claiming_a_ranks_identity_does_not_take_its_traffic(mesh, caplog):
    """A DEALER that connects with rank 0's routing identity must not receive
    rank 0's requests or heartbeats, nor cut rank 0 off (ROUTER_HANDOVER)."""
    ctl = mesh.controller
    ctx = zmq.Context()
    try:
        d = _dealer(ctx, ctl.address, b"r0")
        d1 = _dealer(ctx, ctl.address, b"r1")
        time.sleep(0.3)
        vm = mesh.collect(mesh.run("import time; time.sleep(2.5 * 1.0); rank"), timeout=30)
        assert list(vm.values()) == [0, 1]  # > 2 heartbeats went by meanwhile
        got = [s.recv_multipart() for s in (d, d1) if s.poll(100)]
        assert not got, f"an impostor received {len(got)} messages meant for a rank"
        d.close(0)
        d1.close(0)
    finally:
        ctx.destroy(linger=0)
    assert all(ctl.ranks[r].state == "idle" for r in (0, 1))
    assert list(mesh.collect(mesh.run("rank")).values()) == [0, 1]


# ------------------------------------------------------ a worker's peer socket
def test_bad_frames_to_a_workers_peer_socket_are_dropped(tmp_path, capfd):
    import cloudpickle

    from monarch_kernel import Actor, endpoint
    from monarch_kernel.procmesh import spawn_procs

    cloudpickle.register_pickle_by_value(sys.modules[__name__])

    class Target(Actor):
        @endpoint
        def ping(self) -> str:
            return "pong"

    marker = tmp_path / "ran"
    m = spawn_procs(2)  # spawned here so that its workers log into capfd
    ctx = zmq.Context()
    try:
        am = m.spawn("target", Target)
        assert list(am.ping.call().get(timeout=30).values()) == ["pong", "pong"]
        addr = am._peers[1]
        assert addr.startswith("tcp://127.0.0.1:")
        d = _dealer(ctx, addr, b"attacker")
        wrong = protocol.Codec(protocol.new_key(), "r0")
        call = {"a": "target", "m": "ping", "args": (Evil(str(marker)),), "kwargs": {}}
        h, p = _split(wrong.encode("call", call))
        attacks = [wrong.encode("call", call), [_envelope(h, p, b"\0" * 32)], [b"garbage"],
                   [_envelope(h, p)[:38]]]
        for frames in attacks:
            d.send_multipart(frames)
        err = ""

        def logged() -> bool:
            nonlocal err
            err += capfd.readouterr().err
            return err.count("dropped a peer message") >= len(attacks)

        wait_for(logged, 10, what="the peer socket's warnings")
        assert not marker.exists()
        assert not d.poll(200)  # no answer to an attacker
        d.close(0)
        assert list(am.ping.call().get(timeout=30).values()) == ["pong", "pong"]
    finally:
        ctx.destroy(linger=0)
        m.stop()


# ------------------------------------------------------------- keys, files, ports
def test_keys_are_random_per_mesh_and_never_in_argv(mesh):
    from monarch_kernel.procmesh import spawn_procs

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
    from monarch_kernel import shm

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


def test_ports_bind_loopback_by_default(mesh):
    ctl = mesh.controller
    assert ctl.address.startswith("tcp://127.0.0.1:")
    port = int(ctl.address.rsplit(":", 1)[1])
    listening = [c for c in psutil.Process().net_connections(kind="tcp")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
    assert [c.laddr.ip for c in listening] == ["127.0.0.1"]
    # no worker listens beyond loopback either (peer sockets for actors)
    for pl in mesh.launcher.placements().values():
        for c in psutil.Process(pl.pid).net_connections(kind="tcp"):
            if c.status == psutil.CONN_LISTEN:
                assert c.laddr.ip == "127.0.0.1", c


# --------------------------------------- beyond loopback: CurveZMQ (issue 9, lead's feature)
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
    from monarch_kernel.netaddr import primary_address
    from monarch_kernel.transport import is_loopback

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


def test_beyond_loopback_traffic_is_encrypted(capfd):
    """bind=<eth0 address>: the ROUTER is a CurveZMQ server, the workers are
    CURVE clients, and a sniffer on the wire sees none of the code, output or
    results; with encrypt=False the same sniffer sees them in clear (so it does
    look at the right traffic), and a warning says so."""
    import secrets

    from monarch_kernel.procmesh import spawn_procs

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


def test_loopback_is_not_encrypted_by_default(mesh):
    assert mesh.controller.curve_public_key is None
    assert mesh.controller.router.getsockopt(zmq.CURVE_SERVER) == 0


def test_encrypted_controller_refuses_plain_and_wrongly_keyed_clients(caplog):
    """A plain (NULL mechanism) client never gets through the CURVE handshake; a
    CURVE client that knows the server's public key (it is on the workers' command
    line) gets through, but without the mesh key its messages are dropped."""
    from monarch_kernel.procmesh import spawn_procs

    caplog.set_level(logging.WARNING, logger="monarch_kernel.controller")
    m = spawn_procs(1, bind=_non_loopback_address(), timeout=30)
    ctx = zmq.Context()
    try:
        ctl = m.controller
        wrong = protocol.Codec(protocol.new_key(), "r0")
        plain = _dealer(ctx, ctl.address, b"r0")
        plain.send_multipart(wrong.encode("reply", {"status": "ok", "value": "FORGED"}))
        curve = ctx.socket(zmq.DEALER)
        curve.linger = 0
        curve.setsockopt(zmq.IDENTITY, b"r0")
        curve.curve_serverkey = ctl.curve_public_key
        curve.curve_publickey, curve.curve_secretkey = zmq.curve_keypair()
        curve.connect(ctl.address)
        curve.send_multipart(wrong.encode("stream", {"name": "stdout", "text": "FORGED\n"}))
        wait_for(lambda: _controller_drops(caplog), 10, what="the forged CURVE message dropped")
        time.sleep(0.5)
        drops = _controller_drops(caplog)
        assert len(drops) == 1 and "signature" in drops[0], drops  # the plain one never arrived
        assert not plain.poll(100) and not curve.poll(100)
        assert list(m.collect(m.run("rank + 1")).values()) == [1]
    finally:
        ctx.destroy(linger=0)
        m.stop()


def test_wildcard_bind_listens_everywhere_encrypted():
    from monarch_kernel.procmesh import spawn_procs

    m = spawn_procs(2, bind="0.0.0.0", timeout=30)
    try:
        ctl = m.controller
        port = int(ctl.address.rsplit(":", 1)[1])
        listening = [c.laddr.ip for c in psutil.Process().net_connections(kind="tcp")
                     if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
        assert listening == ["0.0.0.0"]
        assert ctl.curve_public_key is not None
        assert ctl.router.getsockopt(zmq.CURVE_SERVER) == 1
        assert list(m.collect(m.run("rank")).values()) == [0, 1]
    finally:
        m.stop()
