"""Attacks on a worker's connection to its controller, with raw ZeroMQ sockets.

The worker is started by hand and pointed at a ROUTER this test binds
(:class:`FakeController`: the test is its controller, with the right key for
the good requests). Every bad message carries an ``execute`` whose code, or
whose pickle when unpickled, would create a marker file. After each attack
the marker must be absent, a warning must have been logged ("dropped a
message") and the worker must still serve a good request. The controller's
and the peer sockets: ``test_wire_attacks_mesh.py``; keys, file modes and
encryption: ``test_wire_attacks_secrets.py``.
"""

from __future__ import annotations

import json
import os
import pickle
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq
from wire_attack_helpers import Evil, count_drops, envelope, fields, split

from monarch_kernel.testing.kernel import wait_for
from monarch_kernel.util import droplog
from monarch_kernel.wire import protocol as protocol
from monarch_kernel.wire import serialize as serialize

pytestmark = pytest.mark.timeout(120)

SMALL = 64 * 1024  # the worker's --max-header / --max-buffers in these tests (bytes)


class FakeController:
    """A ROUTER bound on loopback and one worker process connected to it.

    Parameters
    ----------
    tmp : Path
        Where the worker's stderr (its log) goes.
    limits : bool
        Start the worker with ``--max-header`` / ``--max-buffers`` of :data:`SMALL`.
    """

    def __init__(self, tmp: Path, limits: bool = True,
                 codec: protocol.Codec | None = None, drops_every: float = 0) -> None:
        self.codec = codec or protocol.Codec(protocol.new_key(), "ctl")
        self.key = self.codec.key
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.linger = 0
        # (no send high-water mark, as the controller's: a ROUTER drops what it cannot queue,
        # and a test that sends a burst would lose the message it sends after it)
        self.router.sndhwm = 0
        port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        self.errpath = tmp / "worker-stderr.txt"
        self._err = open(self.errpath, "wb")  # noqa: SIM115 - closed by close()
        cmd = [sys.executable, "-m", "monarch_kernel", "worker", "--controller", self.address,
               "--rank", "0", "--world-size", "1", "--heartbeat-timeout", "120",
               "--telemetry-interval", "0", "--drops-every", str(drops_every)]
        if limits:
            cmd += ["--max-header", str(SMALL), "--max-buffers", str(SMALL)]
        # as a controller starts a rank: its epoch, and where the controller's stream stands
        self.epoch = protocol.new_epoch()
        self.codec.expect("r0", self.epoch)
        streams = protocol.format_streams(self.epoch, self.codec.epoch, self.codec.mark())
        env = dict(os.environ, MONARCH_MESH_KEY=self.key.hex(),
                   **{protocol.STREAMS_ENV: streams})
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
        mid = fields(split(frames)[0])["id"]
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
    header, payload = split(frames)
    _attack(fake, marker, [
        [protocol.MAGIC + len(header).to_bytes(4, "little") + header + payload],  # no signature
        [envelope(header, payload, b"\0" * 32)],  # a zero signature
        [envelope(header, payload, os.urandom(32))],  # a made-up signature
        [envelope(header, payload, b"0" * 64)],  # a version 1 (hex) signature's size
        [envelope(header, payload, b"not hex at all \xff")],
    ], expect="bad message signature")


def test_wrongly_signed_message_is_dropped_before_unpickling(fake, marker):
    other = protocol.Codec(protocol.new_key(), "ctl")  # another mesh's key
    frames = other.encode("execute", {"code": _marker_code(marker), "evil": Evil(str(marker))})
    _attack(fake, marker, [frames], expect="bad message signature")


def test_message_for_other_ranks_is_dropped(fake, marker):
    """A request signed for ranks 1-3 (a broadcast to a subset, which rank 0 never
    saw) copied to rank 0 is refused: its signed header names its addressees."""
    for_others = fake.codec.encode("execute", {"code": _marker_code(marker)}, to=[1, 2, 3])
    _attack(fake, marker, [for_others], expect="addressed to other ranks")
    reply = _execute_to(fake, "rank + 1", to=[0, 1])  # one that names rank 0 runs
    assert reply == {"status": "ok", "value": 1}


def _execute_to(fake: FakeController, code: str, to: list[int]) -> dict:
    frames = fake.codec.encode("execute", {"code": code}, to=to)
    mid = fields(split(frames)[0])["id"]
    fake.send_raw(frames)
    while True:
        msg = fake.recv(30)
        if msg.parent == mid and msg.type == "reply":
            return msg.content


def test_tampered_message_is_dropped(fake, marker):
    frames = [bytes(f) for f in fake.codec.encode("execute", {"code": "None"})]
    assert len(frames) == 1
    sig = frames[0][4:36]  # made for the harmless code
    h, _ = split(frames)
    payload = bytes(serialize.dumps({"code": _marker_code(marker)})[0])
    swapped = [envelope(h, payload, sig)]
    header = fields(h)
    assert header["t"] == "execute"
    stop = protocol.pack_header("stop", header["id"], header["p"], header["s"])
    assert stop != h and len(stop) == len(h) and fields(stop)["t"] == "stop"
    retyped = [envelope(stop, payload, sig)]
    _attack(fake, marker, [swapped, retyped], expect="bad message signature")


def test_replayed_message_runs_once(fake, marker):
    frames = [bytes(f) for f in fake.codec.encode("execute", {"code": _marker_code(marker)})]
    fake.send_raw(frames)
    wait_for(marker.exists, 10, what="the first (genuine) execution")
    _attack(fake, marker.with_name("unused"), [frames, frames], expect="replayed message")
    assert marker.read_text() == "ran\n", "the replayed execute ran again"


def test_a_message_signed_before_the_worker_started_is_refused(tmp_path, marker):
    """A rank (re)started with the mesh's key refuses what the controller
    signed before it started: a message captured earlier in the mesh's life."""
    codec = protocol.Codec(protocol.new_key(), "ctl")
    captured = [bytes(f) for f in codec.encode("execute", {"code": _marker_code(marker)})]
    fc = FakeController(tmp_path, codec=codec)
    try:
        _attack(fc, marker, [captured], expect="replayed message of 'ctl'")
    finally:
        fc.close()


def test_a_flood_at_a_worker_is_summed_up(tmp_path, marker):
    """With the default --drops-every, a worker logs the first few drops and
    then one summary line per interval, and goes on serving."""
    fc = FakeController(tmp_path, drops_every=droplog.INTERVAL_S)
    try:
        other = protocol.Codec(protocol.new_key(), "ctl")
        frames = [bytes(f) for f in other.encode("execute", {"code": _marker_code(marker)})]
        for _ in range(2000):
            fc.send_raw(frames)
        reply, _ = fc.execute("rank + 41")
        assert reply == {"status": "ok", "value": 41}
        wait_for(lambda: count_drops(fc.log()) >= 2000, 30, what="the summary of 2,000 drops")
        assert count_drops(fc.log()) == 2000
        lines = [ln for ln in fc.log().splitlines() if "dropped" in ln]
        assert len(lines) == droplog.FIRST + 1, lines
        assert (f"rank 0 dropped {2000 - droplog.FIRST:,} more messages from 1 peer in the "
                "last ") in lines[-1] and lines[-1].endswith("bad signature"), lines
        assert not marker.exists()
    finally:
        fc.close()


def test_truncated_messages_are_dropped(fake, marker):
    good = [bytes(f) for f in fake.codec.encode(
        "execute", {"code": _marker_code(marker), "arr": np.arange(1000.0)})]
    assert len(good) == 2  # envelope, one buffer
    env, buf = good
    header, _ = split(good)
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
        [envelope(head, evil, magic=b"MK/4")],  # another protocol version
        [b"MK/2" + sealed[4:]],  # ... even correctly signed, a wrong magic is refused
        [rng.bytes(int(n)) for n in rng.integers(0, 300, size=7)],
        [protocol.MAGIC + rng.bytes(300),
         *(rng.bytes(int(n)) for n in rng.integers(0, 300, size=4))],
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
            sh: tuple = (), declared: dict | None = None, to: tuple = ()) -> bytes:
        """A header by hand, with whatever bytes and declared lengths and counts."""
        d = {"ls": len(sender), "li": len(mid), "lp": 255 if parent is None else len(parent),
             "nb": len(lengths), "nsh": len(sh), "nto": len(to), **(declared or {})}
        return b"".join((struct.pack("<BBBBHHH", code, d["ls"], d["li"], d["lp"], d["nb"],
                                     d["nsh"], d["nto"]),
                         sender, mid, parent or b"", struct.pack(f"<{len(lengths)}Q", *lengths),
                         struct.pack(f"<{len(sh)}H", *sh),
                         *(struct.pack("<II", a, b) for a, b in to)))

    def beyond(header: bytes) -> list[bytes]:  # a header length past the end of the frame
        body = (fake.codec.epoch.to_bytes(8, "little") + fake.codec.mark().to_bytes(8, "little")
                + (len(header) + len(payload) + 1).to_bytes(4, "little") + header + payload)
        return [protocol.MAGIC + fake.codec._sign(body) + body]

    # the controls: the hand-built header is the packed one, and it is accepted
    assert raw(mid=b"m0") == pack("execute", "m0", None, "ctl")
    assert raw(mid=b"m0", to=((0, 2),)) == pack("execute", "m0", None, "ctl", to=((0, 2),))
    assert fields(raw(mid=b"m0", parent=b"p", lengths=(3,), sh=(0,))) == {
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
        signed(raw(mid=b"m7g", declared={"nto": 1})),  # an addressee range that is not there
        signed(raw(mid=b"m7h", to=((0, 0),))),  # an empty range of addressees
        signed(raw(mid=b"m7i", to=((0, 2),))[:-1]),  # truncated in the ranges
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
    out = subprocess.run([sys.executable, "-m", "monarch_kernel", "worker", "--help"],
                         check=False, capture_output=True, text=True, timeout=60)
    assert "--max-header" in out.stdout and "--max-buffers" in out.stdout
