"""Worker-to-worker actor calls under load (actor_peers): many threads of two
workers call each other's actors at once, both ways; every reply arrives, to
the thread that waits for it."""

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
        from monarch_kernel.actor_peers import stats

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


def test_many_threads_call_peers_both_ways_at_once():
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
    finally:
        procs.stop()
