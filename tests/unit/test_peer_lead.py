"""Peer lanes read by the thread that leads the worker's I/O (worker_io):
an idle actor's thread reads the calls its peers make to it, and a thread
that waits for a peer's reply reads the reply itself, with the peer I/O
thread as the fallback reader (both watch each lane, ``EPOLLEXCLUSIVE``).
Real workers on one host; ``MONARCH_PEER_LEAD=0`` leaves every lane to the
peer I/O thread, as before, for comparison."""

from __future__ import annotations

import sys
import threading
import time

import cloudpickle
import pytest
from test_peer_calls import Caller

from monarch_kernel import Actor, endpoint, spawn_procs

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers need not import it

pytestmark = pytest.mark.timeout(300)


class Peer(Actor):
    """One actor per worker (the case where its thread may lead)."""

    def __init__(self) -> None:
        self.log: list[int] = []

    @endpoint
    def echo(self, x: int) -> int:
        return x

    @endpoint
    def record(self, i: int, busy_s: float) -> None:
        if busy_s:
            time.sleep(busy_s)  # busy: what comes meanwhile is read by the peer I/O thread
        self.log.append(i)

    @endpoint
    def logged(self) -> list[int]:
        """What ``record`` logged since the last time this was asked."""
        log, self.log = self.log, []
        return log

    @endpoint
    def nap(self, seconds: float) -> str:
        time.sleep(seconds)
        return "done"

    @endpoint
    def stats(self) -> dict:
        from monarch_kernel.actor.peers import stats

        return stats()

    @endpoint
    def ping(self, other, calls: int) -> int:
        return sum(other.echo.call_one(i).get(timeout=60) for i in range(calls))

    @endpoint
    def bursts(self, other, calls: int) -> None:
        """``calls`` calls to ``other.record`` in bursts of 10, not waiting for
        each (every 7th keeps ``other`` busy 3 ms); then waits for them all."""
        futures = []
        for i in range(calls):
            futures.append(other.record.call_one(i, 0.003 if i % 7 == 0 else 0.0))
            if i % 10 == 9:
                time.sleep(0.005)  # (``other`` goes idle now and then: its thread leads)
        for f in futures:
            f.get(timeout=120)

    storm = Caller.storm  # threads of this worker call ``other`` at once (they take
    # turns leading the I/O while they wait; test_peer_calls' storm has two actors)

    @endpoint
    def wait_briefly(self, other) -> list[str]:
        """A peer call's ``get`` with a timeout shorter than the call, then again."""
        f = other.nap.call_one(1.0)
        out = []
        t0 = time.monotonic()
        try:
            f.get(timeout=0.2)
            out.append("returned")
        except TimeoutError:
            out.append(f"timed out after {time.monotonic() - t0:.2f} s")
        out.append(f.get(timeout=30))
        return out


@pytest.mark.parametrize("lead", ["1", "0"], ids=["leaders-read", "peer-thread-reads"])
def test_idle_callee_and_waiting_caller_read_their_own_messages(lead, monkeypatch):
    monkeypatch.setenv("MONARCH_PEER_LEAD", lead)  # (the workers inherit it)
    calls = 400
    procs = spawn_procs(2, telemetry_interval=0)
    try:
        peers = procs.spawn("peer", Peer)
        a, b = peers.slice(procs=0), peers.slice(procs=1)
        before = peers.stats.call().get(timeout=30).values()
        assert a.ping.call_one(b, calls).get(timeout=120) == sum(range(calls))
        after = peers.stats.call().get(timeout=30).values()
        got = [{k: y[k] - x[k] for k in ("in", "out", "led")}
               for x, y in zip(before, after, strict=True)]
        assert got[0]["in"] == calls and got[1]["in"] == calls, got  # replies; calls
        if lead == "1":
            # most replies read by the caller's own waiting thread, most calls by the
            # callee's idle actor thread (the rest: whoever was not yet back in its poll)
            assert got[0]["led"] >= calls // 4 and got[1]["led"] >= calls // 4, got
        else:
            assert got[0]["led"] == 0 and got[1]["led"] == 0, got
    finally:
        procs.stop()


def test_calls_keep_their_order_when_both_readers_take_turns():
    calls = 300
    procs = spawn_procs(2, telemetry_interval=0)
    try:
        peers = procs.spawn("peer", Peer)
        a, b = peers.slice(procs=0), peers.slice(procs=1)
        led = by_peer_thread = 0
        for _ in range(5):  # (rounds until each reader has had a share: timing decides)
            before = b.stats.call_one().get(timeout=30)
            a.bursts.call_one(b, calls).get(timeout=180)
            assert b.logged.call_one().get(timeout=30) == list(range(calls))
            after = b.stats.call_one().get(timeout=30)
            assert after["in"] - before["in"] == calls, (before, after)
            led += after["led"] - before["led"]
            by_peer_thread += (after["in"] - before["in"]) - (after["led"] - before["led"])
            if led and by_peer_thread:
                break
        # both readers had a share: the idle actor's thread and the peer I/O thread
        assert led > 0 and by_peer_thread > 0, (led, by_peer_thread)
    finally:
        procs.stop()


def test_threads_waiting_at_once_all_get_their_replies():
    threads, calls = 6, 100
    procs = spawn_procs(2, telemetry_interval=0)
    try:
        peers = procs.spawn("peer", Peer)
        a, b = peers.slice(procs=0), peers.slice(procs=1)
        expected = [sum(range(i * calls, (i + 1) * calls)) for i in range(threads)]
        # (one way at a time: the callee's only actor answers while the caller's storms)
        assert a.storm.call_one(b, threads, calls).get(timeout=240) == expected
        assert b.storm.call_one(a, threads, calls).get(timeout=240) == expected
    finally:
        procs.stop()


def test_a_waiting_caller_times_out_on_time_and_can_wait_again():
    procs = spawn_procs(2, telemetry_interval=0)
    try:
        peers = procs.spawn("peer", Peer)
        first, second = peers.slice(procs=0).wait_briefly.call_one(
            peers.slice(procs=1)).get(timeout=60)
        assert first.startswith("timed out after"), first
        assert float(first.split()[3]) >= 0.15, first  # not early; before the reply
        assert second == "done"
    finally:
        procs.stop()


class Hog(Actor):
    def __init__(self) -> None:
        self.n = 0

    @endpoint
    def hog(self, n: int) -> int:
        return sum(range(n))  # one C call: the GIL stays held throughout

    @endpoint
    def rec(self, i: int) -> None:
        self.n += 1

    @endpoint
    def count(self) -> int:
        return self.n

    @endpoint
    def flood(self, other, calls: int, hog: int) -> int:
        return _flood(other, calls, hog)


def _flood(other, calls: int, hog: int) -> int:
    """Keep ``other``'s thread in a GIL-holding call while ``calls`` calls
    arrive for it (from a worker's actor, or from the controller); then wait
    for them all."""
    busy = other.hog.call_one(hog)
    time.sleep(0.05)
    futures = [other.rec.call_one(i) for i in range(calls)]
    busy.get(timeout=60)
    for f in futures:
        f.get(timeout=60)
    return calls


@pytest.mark.parametrize("caller", ["peer", "controller"])
def test_a_flood_of_calls_to_an_actor_holding_the_gil_is_all_answered(caller):
    # Thousands of calls came while the callee's thread held the GIL: whoever read
    # them queued a wake-up for the actor's thread per call. Wake-ups blocked once
    # the worker's wake pipe was full (2,000), in the very thread that would read
    # them: the worker hung for good, deaf to its controller.
    calls, hog = 6000, 30_000_000
    procs = spawn_procs(2, telemetry_interval=0)
    try:
        hogs = procs.spawn("hog", Hog)
        a, b = hogs.slice(procs=0), hogs.slice(procs=1)
        for rnd in range(2):
            if caller == "peer":
                assert a.flood.call_one(b, calls, hog).get(timeout=120) == calls
            else:
                assert _flood(b, calls, hog) == calls
            assert b.count.call_one().get(timeout=30) == calls * (rnd + 1)
    finally:
        procs.stop()


def test_input_that_woke_a_thread_which_gave_up_the_lane_is_read_by_its_holder():
    # Each lane is watched with EPOLLEXCLUSIVE: a message wakes one thread only.
    # When that thread finds the lane held by the other reader (handling a long
    # message) for READ_WAIT_S, it gives up; nothing would wake anyone for that
    # message until the next one came. The holder must read again before it lets
    # go. Real lanes over a socket pair; the host's handlers only record and, for
    # the first message, take long (PeerIO.drain is what is tested).
    import types

    from monarch_kernel.actor.peer_io import PeerIO
    from monarch_kernel.transport import lane as lane_mod

    class Host:  # what PeerIO.drain uses of a PeerHost
        rank = 0
        codec = None

        def __init__(self) -> None:
            self.codec_of_addr: dict = {}
            self.lane_addrs: dict = {}
            self.got: list[bytes] = []
            self.first = threading.Event()
            self.go_on = threading.Event()

        def incoming(self, frames, identity) -> None:
            self.got.append(bytes(frames[0]))
            if len(self.got) == 1:
                self.first.set()
                assert self.go_on.wait(30)

    a, b = lane_mod.pair()
    sender = lane_mod.Lane(a, "sender")
    reader = lane_mod.Lane(b, "reader", identity=b"\0lane-test")
    host = Host()
    io = types.SimpleNamespace(host=host)  # (a PeerIO's part that drain uses)
    counts: list = []
    try:
        sender.send([b"first"])
        holder = threading.Thread(target=lambda: counts.append(PeerIO.drain(io, reader)))
        holder.start()
        assert host.first.wait(30)  # the holder handles "first" and holds the lane
        sender.send([b"second"])
        time.sleep(0.05)  # (it has arrived)
        assert PeerIO.drain(io, reader) is None  # gave up after READ_WAIT_S
        assert reader.missed
        host.go_on.set()
        holder.join(30)
        assert host.got == [b"first", b"second"] and counts == [2], (host.got, counts)
        assert not reader.missed and not reader.read_lock.locked()
    finally:
        host.go_on.set()
        sender.close()
        reader.close()
