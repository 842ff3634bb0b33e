"""Lanes: the Unix socket pair between a controller and a local worker.

The framing is tested on real socket pairs (small and large messages, frames
of every buffer kind, back-pressure in both directions at once, the end of
the other side); the mesh tests check that local workers use lanes, that a
rank's death and restart go through them, and that ``MONARCH_LANES=0``
falls back to ZeroMQ.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import cloudpickle
import numpy as np
import pytest
import zmq

from monarch_kernel import Actor, endpoint
from monarch_kernel.errors import TransportError
from monarch_kernel.mesh.procmesh import spawn_procs
from monarch_kernel.testing.kernel import wait_for, worker_pids
from monarch_kernel.transport.lane import Lane, pair
from monarch_kernel.util.switches import lanes_enabled

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers need not import it


def _lanes() -> tuple[Lane, Lane]:
    a, b = pair()
    return Lane(a, "a"), Lane(b, "b")


def _read(lane: Lane, count: int, timeout: float = 10.0) -> list[list[bytes]]:
    """``count`` messages from ``lane``, waiting for them (at most ``timeout`` s)."""
    import select

    p = select.poll()
    p.register(lane.fileno(), select.POLLIN)
    got: list[list[bytes]] = []
    deadline = time.monotonic() + timeout
    while len(got) < count:
        left = deadline - time.monotonic()
        assert left > 0, f"only {len(got)} of {count} messages arrived"
        if p.poll(min(left, 0.1) * 1000):
            got.extend(lane.read())
        assert not lane.eof or len(got) >= count, "the other end closed early"
    return got


def test_lanes_enabled_reads_the_environment() -> None:
    assert lanes_enabled({}) is True
    assert lanes_enabled({"MONARCH_LANES": "1"}) is True
    assert lanes_enabled({"MONARCH_LANES": " 0 "}) is False
    with pytest.raises(ValueError, match="MONARCH_LANES must be 0"):
        lanes_enabled({"MONARCH_LANES": "yes"})


def test_peer_lead_is_0_or_1_and_a_mesh_with_another_value_is_refused(monkeypatch) -> None:
    from monarch_kernel import spawn_procs
    from monarch_kernel.util.switches import peer_lead_enabled

    assert peer_lead_enabled({}) is True
    assert peer_lead_enabled({"MONARCH_PEER_LEAD": " 1"}) is True
    assert peer_lead_enabled({"MONARCH_PEER_LEAD": "0 "}) is False
    for bad in ("off", "false", "2"):
        with pytest.raises(ValueError, match="MONARCH_PEER_LEAD must be 0"):
            peer_lead_enabled({"MONARCH_PEER_LEAD": bad})
    monkeypatch.setenv("MONARCH_PEER_LEAD", "off")  # (it read as on, silently, before)
    with pytest.raises(ValueError, match="MONARCH_PEER_LEAD must be 0"):
        spawn_procs(1)


def test_small_messages_keep_their_frames_and_order() -> None:
    a, b = _lanes()
    try:
        msgs = [[b"env%d" % i, b"", b"x" * i] for i in range(200)]
        for m in msgs:
            a.send(m)
        assert _read(b, 200) == msgs
        b.send([b"back"])
        assert _read(a, 1) == [[b"back"]]
    finally:
        a.close()
        b.close()


def test_a_message_over_the_limit_is_refused_before_room_is_made() -> None:
    """A lane with a limit refuses a message whose framing claims more bytes
    (a count of frames, or frame lengths) than it, before allocating them."""
    import struct

    from monarch_kernel.errors import ProtocolError

    for head in (struct.pack("<I", 1 << 31),  # 2**31 frames: 16 GiB of lengths alone
                 struct.pack("<IQ", 1, 1 << 40)):  # one frame of 1 TiB
        a, b = pair()
        lane = Lane(b, "limited", limit=1 << 20)
        try:
            a.sendall(head)
            with pytest.raises(ProtocolError, match="over the limit of (1048576 bytes|65536)"):
                _read(lane, 1)
            assert len(lane._buf) <= 1 << 18  # no room was made for it
        finally:
            a.close()
            lane.close()
    from monarch_kernel.transport.lane import MAX_FRAMES

    a, b = pair()
    lane = Lane(b, "limited", limit=1 << 40)
    try:  # more frames than a protocol message has, even if small
        a.sendall(struct.pack("<I", MAX_FRAMES + 1))
        with pytest.raises(ProtocolError, match=f"over the limit of {MAX_FRAMES}"):
            _read(lane, 1)
    finally:
        a.close()
        lane.close()
    a, b = pair()
    lane = Lane(b, "limited", limit=1 << 40)
    try:  # under the limit, claiming 1 GiB: room is made as the bytes come, not at once
        a.setblocking(False)
        a.sendall(struct.pack("<IQ", 1, 1 << 30) + b"x" * 600_000)
        deadline = time.monotonic() + 10
        while lane._end < 12 + 600_000 and time.monotonic() < deadline:
            lane.read()
        assert lane._end == 12 + 600_000
        assert len(lane._buf) < 4 << 20, len(lane._buf)
    finally:
        a.close()
        lane.close()
    a, b = pair()
    lane = Lane(b, "limited", limit=1 << 20)
    sender = Lane(a, "sender")
    try:  # under the limit: taken as ever
        big = [b"h", b"x" * ((1 << 20) - 100)]
        sender.send(big)
        assert _read(lane, 1) == [big]
    finally:
        sender.close()
        lane.close()


def test_frames_of_every_buffer_kind() -> None:
    a, b = _lanes()
    try:
        arr = np.arange(1000, dtype=np.float32).reshape(10, 100)
        frame = zmq.Frame(b"a zmq frame")
        a.send([b"head", memoryview(b"view"), bytearray(b"ba"), arr, frame])
        (got,) = _read(b, 1)
        assert got[:4] == [b"head", b"view", b"ba", arr.tobytes()]
        assert got[4] == b"a zmq frame"
    finally:
        a.close()
        b.close()


def test_large_messages_both_ways_at_once_do_not_deadlock() -> None:
    """Each side sends far more than the sockets buffer before it reads: the
    sends must return (the rest queued for the flusher), and everything must
    arrive whole and in order."""
    a, b = _lanes()
    try:
        big = [np.full(3 << 20, i, dtype=np.uint8) for i in range(6)]  # 6 x 3 MiB
        t0 = time.monotonic()
        for i, x in enumerate(big):
            a.send([b"m%d" % i, x])
            b.send([b"m%d" % i, x])
            a.send([b"small%d" % i])  # behind the big one, never ahead of it
        assert time.monotonic() - t0 < 5, "a send blocked"
        got_b = _read(b, 12, timeout=30)
        got_a = _read(a, 6, timeout=30)
        expect_b = []
        for i, x in enumerate(big):
            expect_b += [[b"m%d" % i, x.tobytes()], [b"small%d" % i]]
        assert got_b == expect_b
        assert got_a == [[b"m%d" % i, x.tobytes()] for i, x in enumerate(big)]
        assert a.drain(5) and b.drain(5)
    finally:
        a.close()
        b.close()


def test_the_end_of_the_other_side_is_seen_and_sends_then_fail() -> None:
    a, b = _lanes()
    b.close()
    assert _read(a, 0) == []
    deadline = time.monotonic() + 5
    while not a.eof:
        assert time.monotonic() < deadline, "EOF not seen"
        a.read()
        time.sleep(0.01)
    with pytest.raises(TransportError, match="cannot send on a"):
        for _ in range(10):  # (the first may still be taken by the kernel)
            a.send([b"x" * 100_000])
    a.close()
    with pytest.raises(TransportError, match="a is closed"):
        a.send([b"x"])


class Echo(Actor):
    @endpoint
    def echo(self, x):
        return x

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def shout(self, n: int) -> int:
        for i in range(n):
            print("line", i, flush=True)
        return n


def test_a_local_mesh_talks_through_lanes_with_output_and_big_values() -> None:
    m = spawn_procs(2)
    try:
        ctl = m.controller
        assert m.transport == "lanes"
        assert sorted(ctl.lane_of) == [0, 1]
        assert all(ctl.ranks[r].identity.startswith(b"lane.") for r in (0, 1))
        am = m.spawn("echo", Echo)
        payload = list(range(300_000))  # a big pickle (no out-of-band buffer)
        assert am.echo.call(payload).get().values() == [payload, payload]
        arr = np.ones(4 << 20, dtype=np.float32)  # 16 MiB (through shared memory)
        assert [float(v.sum()) for v in am.echo.call(arr).get().values()] == [4 << 20] * 2
        r = m.run("print('from', rank)")
        assert r.wait(30)
        assert r.failure is None and not r.failures()
        assert am.shout.call(500).get().values() == [500, 500]
    finally:
        m.stop()
    assert all(lane._closed for lane in [*ctl.lanes.values(), *ctl.lane_of.values()])
    wait_for(lambda: not worker_pids(os.getpid()), 10)


def test_a_killed_rank_is_seen_and_its_restart_gets_a_new_lane() -> None:
    m = spawn_procs(2)
    try:
        ctl = m.controller
        am = m.spawn("echo", Echo)
        old = ctl.lane_of[1]
        pid = am.slice(procs=1).pid.call_one().get()
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: ctl.ranks[1].state == "dead", 10)
        wait_for(lambda: old.fileno() not in ctl.lanes, 10)  # read to its end, closed
        m.restart("1")  # (a rank spec, as %mesh restart takes)
        assert ctl.lane_of[1] is not old
        am = m.spawn("echo2", Echo)
        assert am.echo.call("again").get().values() == ["again", "again"]
    finally:
        m.stop()


def test_lanes_off_falls_back_to_zeromq(monkeypatch) -> None:
    monkeypatch.setenv("MONARCH_LANES", "0")
    m = spawn_procs(2)
    try:
        ctl = m.controller
        assert m.transport == "zeromq"
        assert not ctl.lane_of
        assert not any(ctl.ranks[r].identity.startswith(b"lane.") for r in (0, 1))
        am = m.spawn("echo", Echo)
        assert am.echo.call(7).get().values() == [7, 7]
    finally:
        m.stop()


def test_workers_leave_at_once_when_the_controller_is_killed(tmp_path) -> None:
    """The end of the lane tells a worker its controller is gone (no waiting
    for missed heartbeats, 6 s)."""
    script = tmp_path / "ctl.py"
    script.write_text(textwrap.dedent("""
        import sys, time
        from monarch_kernel.mesh.procmesh import spawn_procs
        m = spawn_procs(2, heartbeat=5.0)
        print(",".join(str(m.controller.ranks[r].pid) for r in (0, 1)), flush=True)
        time.sleep(60)
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line, "the controller script did not start its mesh"
        pids = [int(p) for p in line.split(",")]
        proc.kill()
        proc.wait(10)
        t0 = time.monotonic()

        def gone() -> bool:
            for pid in pids:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    continue
                return False
            return True

        wait_for(gone, 10)
        assert time.monotonic() - t0 < 5, "workers waited for missed heartbeats"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        proc.stdout.close()


def test_a_thread_that_leads_and_senders_share_a_lane() -> None:
    """Many threads sending at once: every message arrives whole."""
    a, b = _lanes()
    try:
        def sender(k: int) -> None:
            for i in range(300):
                a.send([b"t%d" % k, b"%d" % i, b"y" * (i * 37 % 5000)])

        threads = [threading.Thread(target=sender, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        got = _read(b, 1200, timeout=30)
        for t in threads:
            t.join(10)
        for k in range(4):
            mine = [int(f[1]) for f in got if f[0] == b"t%d" % k]
            assert mine == list(range(300))  # each thread's messages in its order
        assert all(len(f[2]) == int(f[1]) * 37 % 5000 for f in got)
    finally:
        a.close()
        b.close()


def test_received_frames_are_writable_and_arrays_from_them_too() -> None:
    """Arrays unpickled from a lane's frames can be changed in place (as from
    ZeroMQ frames): between 4 KiB and the shared-memory size they are frames."""
    a, b = _lanes()
    try:
        a.send([b"env", np.ones(50_000, np.float32)])
        (got,) = _read(b, 1)
        x = np.frombuffer(got[1], dtype=np.float32)
        x += 1  # would raise on a read-only buffer
        assert float(x.sum()) == 100_000
    finally:
        a.close()
        b.close()


class Probe(Actor):
    @endpoint
    def writable(self, x) -> tuple:
        return x.flags.writeable, np.ones(50_000, np.float32)


def test_arrays_through_a_mesh_stay_writable_both_ways() -> None:
    m = spawn_procs(1)
    try:
        (on_worker, back), = m.spawn("p", Probe).writable.call(
            np.ones(50_000, np.float32)).get().values()
        assert on_worker and back.flags.writeable
    finally:
        m.stop()


def test_a_non_contiguous_frame_is_refused_and_nothing_is_sent() -> None:
    a, b = _lanes()
    try:
        with pytest.raises((TypeError, BufferError)):
            a.send([b"env", np.ones((10, 10), np.float32)[:, 1]])
        a.send([b"next"])  # the stream is still whole
        assert _read(b, 1) == [[b"next"]]
    finally:
        a.close()
        b.close()


def test_a_forked_child_closes_its_copy_and_cannot_send() -> None:
    """A fork (multiprocessing, a DataLoader) must not write into its parent's
    lane (its messages would interleave with the parent's), nor keep the lane
    open after the parent is gone."""
    a, b = _lanes()
    try:
        pid = os.fork()
        if pid == 0:  # the child: sending must fail, clearly
            code = 3
            try:
                a.send([b"from the child"])
            except TransportError as e:
                code = 0 if "forked" in str(e) else 4
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        a.send([b"from the parent"])
        assert _read(b, 1) == [[b"from the parent"]]
        a.close()  # the parent's end is the only one: the other side sees the end
        wait_for(lambda: (b.read(), b.eof)[1], 5, what="EOF after the parent closed")
    finally:
        a.close()
        b.close()


def test_a_dead_peer_is_an_error_not_a_sigpipe(tmp_path) -> None:
    """With SIGPIPE at its default (common in scripts), writing to a lane whose
    worker died must raise TransportError, not kill the controller."""
    script = tmp_path / "pipe.py"
    script.write_text(textwrap.dedent("""
        import signal
        from monarch_kernel.errors import TransportError
        from monarch_kernel.transport.lane import Lane, pair
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        a, b = pair()
        lane = Lane(a, "a")
        b.close()
        try:
            for _ in range(10):
                lane.send([b"x" * 100_000])
        except TransportError:
            print("raised")
    """))
    r = subprocess.run([sys.executable, str(script)], check=False, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "raised", (r.returncode, r.stderr)


FORK_AND_RETURN = """
import os
pid = os.fork()
if pid == 0:
    print("child", os.getpid(), flush=True)  # ... and no os._exit: back to the worker
else:
    os.waitpid(pid, 0)
pid
"""


class Forker(Actor):
    @endpoint
    def fork_and_return(self) -> int:
        pid = os.fork()
        if pid:
            os.waitpid(pid, 0)
        return pid


class ForkInInit(Actor):
    def __init__(self) -> None:
        time.sleep(0.5)  # (the worker's I/O thread holds the lead when it forks)
        pid = os.fork()  # (the child comes back into the actor's thread)
        if pid:
            os.waitpid(pid, 0)

    @endpoint
    def ping(self) -> str:
        return "pong"


@pytest.mark.parametrize("lanes", ["1", "0"])
def test_a_forked_child_that_comes_back_to_the_worker_exits(monkeypatch, lanes) -> None:
    """A child forked by a cell or an endpoint that does not end with os._exit
    comes back into the worker's code: it leaves at once (saying so), and the
    cell, the endpoint and the mesh go on (over ZeroMQ it used to spin at full
    CPU for ever, and the cell waited for it)."""
    monkeypatch.setenv("MONARCH_LANES", lanes)
    m = spawn_procs(1)
    try:
        r = m.run(FORK_AND_RETURN)
        assert r.wait(30), "the cell waited for its forked child"
        assert r.failure is None and not r.failures()
        text = ""
        deadline = time.monotonic() + 10
        while "came back to the worker's loop and exits" not in text:
            assert time.monotonic() < deadline, f"no word of the child: {text!r}"
            ev = r.next_event(0.1)
            if ev is not None:
                text += "".join(str(x) for x in ev)
        assert "child" in text and "os._exit()" in text
        am = m.spawn("forker", Forker)
        child2 = am.fork_and_return.call_one().get(timeout=30)
        assert child2 > 0
        assert m.spawn("init_forker", ForkInInit).ping.call_one().get(timeout=30) == "pong"
        r = m.run("1 + 1")
        assert r.wait(30) and not r.failures()
    finally:
        m.stop()
    wait_for(lambda: not worker_pids(os.getpid()), 10)
