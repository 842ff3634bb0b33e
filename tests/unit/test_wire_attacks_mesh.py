"""Attacks on a live mesh's sockets, with raw ZeroMQ sockets.

Two targets: the **controller** of a real mesh, reached by a DEALER that
claims to be a rank (forged, unsigned, oversized or replayed replies and
output; a connection that takes a rank's routing identity), and a worker's
**peer socket** (the ROUTER actors call each other through). Each bad message
must be dropped with a warning, reach nobody and run nothing, and the target
must still serve good requests.
"""

from __future__ import annotations

import logging
import os
import sys
import time

import pytest
import zmq
from wire_attack_helpers import (
    Evil,
    controller_drops,
    count_drops,
    dealer,
    envelope,
    split,
    two_rank_mesh,
)

from monarch_kernel.testing.kernel import wait_for
from monarch_kernel.wire import protocol as protocol

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def mesh():
    """A 2-rank local mesh for this module (the test process is its controller),
    whose controller reports each dropped message on a line of its own."""
    for m in two_rank_mesh():
        m.controller.drops.interval_s = 0
        yield m


# ---------------------------------------------------------- a controller
def test_forged_replies_and_output_to_the_controller_are_dropped(mesh, caplog):
    caplog.set_level(logging.WARNING, logger="monarch_kernel.controller.controller")
    ctl = mesh.controller
    req = mesh.run("import time; time.sleep(1.0); 'genuine'", [0])
    ctx = zmq.Context()
    try:
        d = dealer(ctx, ctl.address, b"r0")
        wrong = protocol.Codec(protocol.new_key(), "r0")
        reply = {"status": "ok", "value": "FORGED"}
        stream = {"name": "stdout", "text": "FORGED output\n"}
        h, p = split(wrong.encode("reply", reply, parent=req.id))
        # a signed message of rank 0's stream, on the wrong connection
        right = protocol.Codec(ctl.key, "r0", epoch=ctl.ranks[0].epoch)
        signed = right.seal(*split(right.encode("reply", reply, parent=req.id)), seq=1 << 40)
        earlier = protocol.Codec(ctl.key, "r0")  # ... of an earlier run of rank 0
        attacks = [
            wrong.encode("reply", reply, parent=req.id),  # wrong key
            wrong.encode("stream", stream, parent=req.id),
            [protocol.MAGIC + len(h).to_bytes(4, "little") + h + p],  # unsigned
            [envelope(h, p, b"\0" * 32)],
            [envelope(h, p, os.urandom(32))],
            [envelope(h, p)[:38]],  # truncated
            [b"garbage"],
            [protocol.MAGIC + os.urandom(36 + 100), os.urandom(1000)],
            signed,
            signed,  # ... and replayed
            earlier.encode("reply", reply, parent=req.id),
        ]
        for frames in attacks:
            d.send_multipart(frames)
        wait_for(lambda: len(controller_drops(caplog)) >= len(attacks), 10,
                 what="the controller's warnings")
        drops = controller_drops(caplog)
        assert len(drops) == len(attacks), drops
        assert any("signature" in m for m in drops)
        assert any("replayed" in m for m in drops)
        assert any("does not match its connection" in m for m in drops)
        assert any("from another run of it" in m for m in drops)
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
    caplog.set_level(logging.WARNING, logger="monarch_kernel.controller.controller")
    ctx = zmq.Context()
    try:
        d = dealer(ctx, mesh.controller.address, b"r1")
        head = protocol.pack_header("reply", "big", None, "r1")
        d.send_multipart([envelope(head, b"x" * protocol.DEFAULT_MAX_HEADER)])
        wait_for(lambda: controller_drops(caplog), 20, what="the controller's warning")
        assert "exceeds the limit of 67108864 bytes" in controller_drops(caplog)[0]
    finally:
        ctx.destroy(linger=0)
    assert list(mesh.collect(mesh.run("rank")).values()) == [0, 1]


def test_a_connection_claiming_a_ranks_identity_does_not_take_its_traffic(mesh, caplog):
    """A DEALER that connects with rank 0's routing identity must not receive
    rank 0's requests or heartbeats, nor cut rank 0 off (ROUTER_HANDOVER)."""
    ctl = mesh.controller
    ctx = zmq.Context()
    try:
        d = dealer(ctx, ctl.address, b"r0")
        d1 = dealer(ctx, ctl.address, b"r1")
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
@pytest.mark.parametrize("via", ["zeromq", "peer-lane"])
def test_bad_frames_to_a_workers_peer_socket_are_dropped(tmp_path, capfd, via):
    """Forged, unsigned and malformed messages to a worker's peer ROUTER, or on a
    peer lane (a Unix socket a same-user process connected), run nothing, get no
    answer and leave the worker serving."""
    import socket

    import cloudpickle

    from monarch_kernel import Actor, endpoint
    from monarch_kernel.mesh.procmesh import spawn_procs
    from monarch_kernel.transport.lane import prepare

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
        assert addr.startswith("ipc://")  # (a local mesh: a Unix socket, no TCP port)
        endpoint_, _, lane_name = addr.partition(";")
        assert lane_name.startswith("monarch-peer-"), addr
        wrong = protocol.Codec(protocol.new_key(), "r0")
        call = {"a": "target", "m": "ping", "args": (Evil(str(marker)),), "kwargs": {}}
        h, p = split(wrong.encode("call", call))
        attacks = [wrong.encode("call", call), [envelope(h, p, b"\0" * 32)], [b"garbage"],
                   [envelope(h, p)[:38]]]
        if via == "zeromq":
            d = dealer(ctx, endpoint_, b"attacker")
            for frames in attacks:
                d.send_multipart(frames)
        else:
            u = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            u.settimeout(5)
            u.connect("\0" + lane_name)
            for frames in attacks:
                u.sendall(b"".join(bytes(x) for x in prepare(frames)[0]))
        err = ""

        def logged() -> bool:
            nonlocal err
            err += capfd.readouterr().err
            return count_drops(err, "peer message") >= len(attacks)

        wait_for(logged, 10, what="the peer socket's warnings")
        assert not marker.exists()
        if via == "zeromq":
            assert not d.poll(200)  # no answer to an attacker
            d.close(0)
        else:
            u.settimeout(0.2)
            with pytest.raises(socket.timeout):
                u.recv(1)  # no answer to an attacker
            u.close()
        assert list(am.ping.call().get(timeout=30).values()) == ["pong", "pong"]
    finally:
        ctx.destroy(linger=0)
        m.stop()


def test_a_peer_lane_claiming_a_huge_message_or_of_another_user_is_dropped(capfd):
    """On a worker's peer-lane listener: a connection whose first message claims
    1 PiB is closed before room is made for it; a connection from another user
    (root only: a child switches to uid 65534) is refused; the worker's
    peer-to-peer calls go on."""
    import socket
    import struct

    import cloudpickle

    from monarch_kernel import Actor, endpoint
    from monarch_kernel.mesh.procmesh import spawn_procs

    cloudpickle.register_pickle_by_value(sys.modules[__name__])

    class Peer(Actor):
        @endpoint
        def ping(self) -> str:
            return "pong"

        @endpoint
        def ask(self, other) -> str:
            return other.ping.call_one().get(timeout=30)

    m = spawn_procs(2)
    try:
        am = m.spawn("peer", Peer)
        lane_name = am._peers[1].partition(";")[2]
        assert am.slice(procs=0).ask.call_one(am.slice(procs=1)).get(timeout=30) == "pong"
        u = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        u.settimeout(10)
        u.connect("\0" + lane_name)
        u.sendall(struct.pack("<IQ", 1, 1 << 50))
        try:
            got = u.recv(1)
        except ConnectionResetError:  # (closed with bytes unread)
            got = b""
        assert got == b""  # closed by the worker, nothing answered
        u.close()
        err = ""

        def logged(text: str) -> bool:
            nonlocal err
            err += capfd.readouterr().err
            return text in err

        try:
            wait_for(lambda: logged("dropped a peer lane"), 10, what="the lane's warning")
        except TimeoutError:
            raise AssertionError(f"no warning of the dropped lane in: {err[-3000:]!r}") from None
        assert "over the limit" in err, err[-3000:]
        if os.geteuid() == 0:
            pid = os.fork()
            if pid == 0:  # the child: another user, connecting and asking
                code = 1
                try:
                    os.setgid(65534)
                    os.setuid(65534)
                    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    s.settimeout(10)
                    s.connect("\0" + lane_name)
                    try:
                        s.sendall(struct.pack("<IQ", 1, 3) + b"abc")
                        code = 0 if s.recv(1) == b"" else 2  # closed, nothing answered
                    except (ConnectionResetError, BrokenPipeError):  # (closed already,
                        code = 0  # or with the bytes unread)
                except BaseException as e:  # noqa: BLE001 - said, then the exit code
                    os.write(2, f"child: {e!r}\n".encode())
                finally:
                    os._exit(code)
            _, status = os.waitpid(pid, 0)
            assert os.waitstatus_to_exitcode(status) == 0, capfd.readouterr().err[-3000:]
            try:
                wait_for(lambda: logged("refused a peer lane from another user"), 10,
                         what="the refusal's warning")
            except TimeoutError:
                raise AssertionError(f"no refusal warning in: {err[-3000:]!r}") from None
        # the worker still takes peer calls, on its lanes
        assert am.slice(procs=0).ask.call_one(am.slice(procs=1)).get(timeout=30) == "pong"
        assert list(am.ping.call().get(timeout=30).values()) == ["pong", "pong"]
    finally:
        m.stop()
