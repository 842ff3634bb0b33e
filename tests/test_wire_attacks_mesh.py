"""Attacks on a live mesh's sockets, with raw ZeroMQ sockets.

Two targets: the **controller** of a real mesh, reached by a DEALER that
claims to be a rank (forged, unsigned, oversized or replayed replies and
output; a connection that takes a rank's routing identity), and a worker's
**peer socket** (the ROUTER actors call each other through). Each bad message
must be dropped with a warning, reach nobody and run nothing, and the target
must still serve good requests (issue 9).
"""

from __future__ import annotations

import logging
import os
import sys
import time

import pytest
import zmq
from wire_attack_helpers import Evil, controller_drops, dealer, envelope, split, two_rank_mesh

from monarch_kernel import protocol
from monarch_kernel.testing import wait_for

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def mesh():
    """A 2-rank local mesh for this module (the test process is its controller)."""
    yield from two_rank_mesh()


# ---------------------------------------------------------- a controller
def test_forged_replies_and_output_to_the_controller_are_dropped(mesh, caplog):
    caplog.set_level(logging.WARNING, logger="monarch_kernel.controller")
    ctl = mesh.controller
    req = mesh.run("import time; time.sleep(1.0); 'genuine'", [0])
    ctx = zmq.Context()
    try:
        d = dealer(ctx, ctl.address, b"r0")
        wrong = protocol.Codec(protocol.new_key(), "r0")
        reply = {"status": "ok", "value": "FORGED"}
        stream = {"name": "stdout", "text": "FORGED output\n"}
        h, p = split(wrong.encode("reply", reply, parent=req.id))
        right = protocol.Codec(ctl.key, "r0")  # a signed message on the wrong connection
        signed = right.encode("reply", reply, parent=req.id)
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
        d = dealer(ctx, addr, b"attacker")
        wrong = protocol.Codec(protocol.new_key(), "r0")
        call = {"a": "target", "m": "ping", "args": (Evil(str(marker)),), "kwargs": {}}
        h, p = split(wrong.encode("call", call))
        attacks = [wrong.encode("call", call), [envelope(h, p, b"\0" * 32)], [b"garbage"],
                   [envelope(h, p)[:38]]]
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
