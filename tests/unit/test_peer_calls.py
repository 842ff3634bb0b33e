"""Worker-to-worker actor calls under load (actor_peers): many threads of two
workers call each other's actors at once, both ways; every reply arrives, to
the thread that waits for it. On peer lanes (Unix sockets, same host: the
default) and on ZeroMQ (``MONARCH_LANES=0``)."""

from __future__ import annotations

import sys
import threading

import cloudpickle
import pytest

from monarch_kernel import Actor, endpoint, spawn_procs

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers need not import it

pytestmark = pytest.mark.timeout(300)


class Echo(Actor):
    @endpoint
    def echo(self, x: int) -> int:
        return x


class Caller(Actor):
    @endpoint
    def peer_stats(self) -> dict:
        from monarch_kernel.actor.peers import stats

        return stats()

    @endpoint
    def storm(self, other, threads: int, calls: int) -> list[int]:
        """``threads`` threads of this worker each make ``calls`` calls to ``other``
        (one rank) at once; the values each got back, summed per thread."""
        sums = [0] * threads
        errors: list[BaseException] = []

        def run(i: int) -> None:
            try:
                for k in range(calls):
                    sums[i] += other.echo.call_one(i * calls + k).get(timeout=60)
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        ts = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(120)
        if errors:
            raise errors[0]
        return sums


@pytest.mark.parametrize("lanes", ["1", "0"], ids=["peer-lanes", "zeromq"])
def test_many_threads_call_peers_both_ways_at_once(lanes, monkeypatch):
    monkeypatch.setenv("MONARCH_LANES", lanes)  # (the workers inherit it)
    threads, calls = 6, 150
    procs = spawn_procs(2)
    try:
        m = procs.spawn("echo", Echo)
        c = procs.spawn("caller", Caller)  # (an actor of its own: echo answers meanwhile)
        # rank 0 storms rank 1's echo while rank 1 storms rank 0's
        fa = c.slice(procs=0).storm.call_one(m.slice(procs=1), threads, calls)
        fb = c.slice(procs=1).storm.call_one(m.slice(procs=0), threads, calls)
        expected = [sum(range(i * calls, (i + 1) * calls)) for i in range(threads)]
        assert fa.get(timeout=240) == expected
        assert fb.get(timeout=240) == expected
        # and a burst of calls from the controller meanwhile still answers
        assert m.echo.call(7).get(timeout=30).values() == [7, 7]
        for st in c.peer_stats.call().get(timeout=30).values():  # all went worker to worker
            assert st["out"] >= threads * calls, st
            if lanes == "1":  # one lane to the peer it calls, one from the peer calling it
                assert (st["lanes_out"], st["lanes_in"]) == (1, 1), st
            else:
                assert (st["lanes_out"], st["lanes_in"]) == (0, 0), st
    finally:
        procs.stop()


class Sleeper(Actor):
    @endpoint
    def sleep(self, seconds: float) -> None:
        import time

        time.sleep(seconds)


class Waiter(Actor):
    @endpoint
    def wait_on(self, other) -> str:
        """Call ``other``'s 60 s sleep and say how the wait ended."""
        try:
            other.sleep.call_one(60).get(timeout=90)
            return "returned"
        except Exception as e:  # noqa: BLE001 - reported to the test
            return f"{type(e).__name__}: {e}"


@pytest.mark.parametrize("lanes", ["1", "0"], ids=["peer-lanes", "zeromq"])
def test_a_peer_killed_while_called_fails_the_waiting_call(lanes, monkeypatch):
    import os
    import signal
    import time

    monkeypatch.setenv("MONARCH_LANES", lanes)
    procs = spawn_procs(2)
    try:
        s = procs.slice(procs=1).spawn("sleeper", Sleeper)
        w = procs.slice(procs=0).spawn("waiter", Waiter)
        pending = w.wait_on.call_one(s)
        time.sleep(0.5)  # (the call is on its way, or sleeping there)
        os.kill(procs.controller.ranks[1].pid, signal.SIGKILL)
        said = pending.get(timeout=60)
        assert said.startswith("MeshFailure") and "rank 1" in said, said
    finally:
        procs.stop()
