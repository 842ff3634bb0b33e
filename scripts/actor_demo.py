#!/usr/bin/env python3
"""Drive actor meshes from a plain script: the script is the controller.

Usage::

    .venv/bin/python scripts/actor_demo.py [--procs 4]

Spawns a process mesh on this machine, one ``Counter`` actor per process
and one ``Relay`` actor, and uses every adverb: ``call``, ``call_one``,
``choose``, ``broadcast`` and ``stream``, plus ``await``, slicing, an
actor calling another actor directly (worker to worker), a remote
exception caught by its own type, and a timeout. Prints ``OK`` at the end;
exits non-zero on any failure.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

from monarch_kernel import (
    Actor,
    ActorError,
    MeshFailure,
    ValueMesh,
    current_rank,
    current_size,
    endpoint,
    this_host,
)


class Counter(Actor):
    """A counter per rank; classes of ``__main__`` travel by value."""

    def __init__(self, start: int) -> None:
        self.value = start
        self.log: list[int] = []

    @endpoint
    def incr(self, by: int = 1) -> int:
        self.value += by
        self.log.append(by)
        return self.value

    @endpoint
    def where(self) -> tuple[int, dict[str, int], int]:
        return current_rank().rank, current_size(), os.getpid()

    @endpoint
    async def slow(self, seconds: float) -> int:
        await asyncio.sleep(seconds)
        return current_rank().rank

    @endpoint
    def countdown(self, step: float) -> int:
        """Sleep ``step`` seconds per rank above this one; return the rank."""
        me = current_rank()
        time.sleep(step * (current_size()["procs"] - 1 - me["procs"]))
        return me.rank

    @endpoint
    def lookup(self, key: str) -> int:
        return {"a": 1}[key]  # KeyError for anything else

    @endpoint
    def history(self) -> list[int]:
        return list(self.log)


class Relay(Actor):
    """Calls another actor mesh directly (the handle arrives as an argument)."""

    def __init__(self, counters: Counter) -> None:
        self.counters = counters

    @endpoint
    def total(self, by: int) -> int:
        vm = self.counters.incr.call(by).get(timeout=30)
        return sum(vm.values())

    @endpoint
    async def first(self) -> int:
        return await self.counters.slice(procs=0).incr.call_one(0)


def main(argv: list[str] | None = None) -> int:
    """Run the demo; returns the exit status."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--procs", type=int, default=4, help="worker processes (default 4)")
    n = p.parse_args(argv).procs
    if n < 2:
        p.error("--procs must be at least 2")
    t0 = time.monotonic()
    with this_host().spawn_procs(per_host={"procs": n}) as procs:
        counters = procs.spawn("counters", Counter, 0)
        print(f"spawned {counters} on {procs}")

        # call: every actor, a ValueMesh
        values = counters.incr.call(1).get(timeout=30)
        assert isinstance(values, ValueMesh) and values.values() == [1] * n, values
        print("call ->", values.values())
        print(values)

        # call_one on a slice of one actor (an int index drops the dimension)
        one = counters.slice(procs=1).incr.call_one(10).get(timeout=30)
        assert one == 11, one
        print("call_one(procs=1) ->", one)
        pair = counters.slice(procs=slice(0, 2))
        assert len(pair) == 2 and pair.sizes == {"hosts": 1, "procs": 2}, pair.sizes
        try:
            counters.incr.call_one()
        except ValueError as e:
            print("call_one on", len(counters), "actors ->", e)

        # choose: the least busy actor (rank 0 is busy with a slow call)
        busy = counters.slice(procs=0).slow.call_one(1.0)
        chosen = {counters.where.choose().get(timeout=30)[0] for _ in range(2 * n)}
        assert 0 not in chosen, chosen
        print("choose while rank 0 is busy ->", sorted(chosen))
        assert busy.get(timeout=30) == 0

        # broadcast: fire and forget; the next call is ordered after it
        counters.incr.broadcast(100)
        after = counters.history.call().get(timeout=30)
        assert all(h[-1] == 100 for h in after.values()), after
        print("broadcast -> every history ends with", [h[-1] for h in after.values()])

        # stream: futures in completion order (higher ranks answer sooner)
        arrived = [fut.get(timeout=30) for fut in counters.countdown.stream(0.3)]
        print("stream (completion order) ->", arrived)
        assert arrived[0] == n - 1 and sorted(arrived) == list(range(n)), arrived

        # await, in a script too
        async def both() -> list[int]:
            a = counters.slice(procs=0).slow.call_one(0.05)
            b = counters.slice(procs=1).slow.call_one(0.05)
            return [await a, await b]

        assert asyncio.run(both()) == [0, 1]
        print("await -> ok")

        # errors keep their type
        try:
            counters.lookup.call("zzz").get(timeout=30)
        except KeyError as e:
            assert isinstance(e, ActorError)
            print("except KeyError ->", e)

        # timeouts leave the future usable
        slow = counters.slice(procs=0).slow.call_one(0.5)
        try:
            slow.get(timeout=0.01)
        except TimeoutError:
            print("timeout -> still running; then", slow.get(timeout=30))

        # actor to actor, worker to worker
        relay = procs.slice(procs=0).spawn("relay", Relay, counters)
        total = relay.total.call_one(1).get(timeout=30)
        print("relay.total ->", total, "| relay.first ->", relay.first.call_one().get(30))

        # stop: later calls raise MeshFailure naming the rank
        relay.stop()
        try:
            relay.total.call_one(1).get(timeout=30)
        except MeshFailure as e:
            print("after stop ->", e)
    print(f"OK ({time.monotonic() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
