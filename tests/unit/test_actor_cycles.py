"""Wait cycles between actors fail at once with a clear error instead of hanging
(monarch_kernel/actor_cycles.py); calls that only look alike still work."""

from __future__ import annotations

import os
import sys
import time

import cloudpickle
import pytest

from monarch_kernel import Actor, ActorError, ActorMesh, current_rank, endpoint, this_host
from monarch_kernel.actor.actor_mesh import WaitCycleError
from monarch_kernel.testing.kernel import wait_for, worker_pids

cloudpickle.register_pickle_by_value(sys.modules[__name__])

INNER = 20  # seconds an endpoint waits, at most (a regression fails, slowly)
OUTER = 60  # seconds the test waits, at most
QUICK = 10  # seconds a cycle may take to be found, at most (it takes ~30 ms)


class Node(Actor):
    """Calls the next node and waits; the last one calls back the first."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    @endpoint
    def hop(self, route: list, catch: bool = False, sleep: float = 0.0) -> str:
        """Call ``route[0].hop(route[1:])`` and wait; at the end of the route,
        record it and sleep."""
        me = current_rank().rank
        if not route:
            self.seen.append("hop")
            time.sleep(sleep)
            return f"end@{me}"
        nxt, rest = route[0], route[1:]
        try:
            return f"{me}>" + nxt.hop.call_one(rest, catch, sleep).get(timeout=INNER)
        except WaitCycleError as e:
            if not catch:
                raise
            return f"caught {type(e).__name__}: {e}"

    @endpoint
    def late_wait(self, route: list) -> str:
        """Call ``route[0].hop(route[1:])``, stay busy a while, then wait."""
        f = route[0].hop.call_one(route[1:])
        time.sleep(0.3)  # the call back arrives before this actor waits
        return f.get(timeout=INNER)

    @endpoint
    async def ahop(self, route: list) -> str:
        """``hop``, awaiting instead of get()."""
        me = current_rank().rank
        if not route:
            return f"end@{me}"
        nxt, rest = route[0], route[1:]
        return f"{me}>" + await nxt.hop.call_one(rest)

    @endpoint
    def ring(self, m: ActorMesh, first_sleep: float) -> str:
        time.sleep(first_sleep)
        nxt = (current_rank().rank + 1) % len(m)
        return m.slice(procs=nxt).ping.call_one().get(timeout=INNER)

    @endpoint
    def ping(self) -> str:
        self.seen.append("ping")
        return f"pong@{current_rank().rank}"

    @endpoint
    def call_and_wait(self, other: ActorMesh, first_sleep: float = 0.0) -> str:
        time.sleep(first_sleep)
        return other.ping.call_one().get(timeout=INNER)

    @endpoint
    def fire(self, other: ActorMesh, then_sleep: float = 0.0) -> str:
        """Call ``other`` without waiting for it (keeping the future), then stay busy."""
        self.pending = other.call_and_wait.call_one(self.me)
        time.sleep(then_sleep)
        return "fired"

    @endpoint
    def fire_and_return(self, other: ActorMesh, then_sleep: float = 0.0) -> str:
        other.ping.call_one()  # no wait: it runs later, and must not fail
        time.sleep(then_sleep)
        return "returned"

    @endpoint
    def wait_for_fire(self, other: ActorMesh) -> str:
        """Wait for ``other``, which calls this actor without waiting."""
        return other.fire_and_return.call_one(self.me, 0.3).get(timeout=INNER)

    @endpoint
    def fan(self, others: ActorMesh) -> list:
        """call() every actor of ``others``; each calls this actor back."""
        return others.hop.call([self.me]).get(timeout=INNER).values()

    @endpoint
    def give_up(self, other: ActorMesh) -> str:
        """Wait for ``other`` (which calls back later) only briefly, then stay busy."""
        self.pending = other.slow_then_call.call_one(self.me)
        try:
            self.pending.get(timeout=0.2)
        except TimeoutError:
            pass
        time.sleep(0.6)  # busy, not waiting, while the call back comes
        return "gave up"

    @endpoint
    def slow_then_call(self, other: ActorMesh) -> str:
        time.sleep(0.3)
        return other.ping.call_one().get(timeout=INNER)

    @endpoint
    def collect(self) -> str:
        return self.pending.get(timeout=INNER)

    @endpoint
    def remember(self, me: ActorMesh) -> None:
        self.me = me

    @endpoint
    def history(self) -> list:
        return list(self.seen)

    @endpoint
    def slow(self, seconds: float) -> str:
        time.sleep(seconds)
        return "slow"

    @endpoint
    def stream_back(self, others: ActorMesh) -> list:
        """Stream over ``others``; those on odd ranks call back this actor."""
        out = []
        for f in others.maybe_back.stream(self.me):
            try:
                out.append(f.get(timeout=INNER))
            except ActorError as e:
                out.append(f"cycle: {'wait cycle between actors' in str(e)}")
        return sorted(out)

    @endpoint
    def maybe_back(self, caller: ActorMesh) -> str:
        me = current_rank().rank
        if me % 2:
            return caller.ping.call_one().get(timeout=INNER)
        return f"plain@{me}"


@pytest.fixture(scope="module")
def procs():
    pm = this_host().spawn_procs(per_host={"procs": 3})
    try:
        yield pm
    finally:
        pm.stop()
        wait_for(lambda: not worker_pids(os.getpid()), 10, what="no worker processes left")


_names = iter(range(10**6))


def _spawn(procs, name: str):
    """A Node per rank of ``procs``; each remembers its own handle."""
    m = procs.spawn(f"{name}{next(_names)}", Node)
    for r in m.ranks:
        one = m.slice(procs=m.ranks.index(r))
        one.remember.call_one(one).get(timeout=OUTER)
    return m


@pytest.fixture
def nodes(procs):
    """One Node per rank, as meshes of one."""
    m = _spawn(procs, "node")
    try:
        yield [m.slice(procs=i) for i in range(3)]
    finally:
        m.stop()


def _fails_fast(fut, *needles: str) -> ActorError:
    t0 = time.monotonic()
    with pytest.raises(WaitCycleError) as info:  # through every hop, to the controller
        fut.get(timeout=OUTER)
    assert isinstance(info.value, ActorError)
    took = time.monotonic() - t0
    assert took < QUICK, f"the cycle took {took:.1f} s to fail"
    text = str(info.value)
    assert "wait cycle between actors" in text
    for n in needles:
        assert n in text, (n, text)
    return info.value


def test_two_actors_on_two_ranks(nodes):
    a, b = nodes[0], nodes[1]
    # a.hop waits for b.hop, which calls back a.hop and waits: a.hop is busy
    err = _fails_fast(a.hop.call_one([b, a]),
                      f"{a.name}.hop (rank 0) waits for {a.name}.hop (rank 1), which waits "
                      f"for {a.name}.hop (rank 0), which cannot start before")
    assert "broadcast()" in str(err)  # what to do instead
    # the caller that closed the cycle gets WaitCycleError itself
    got = a.hop.call_one([b, a], catch=True).get(timeout=OUTER)
    assert got.startswith("0>caught WaitCycleError: ") and "rank 0" in got, got
    # nothing is stuck afterwards; the failed call never ran
    assert a.ping.call_one().get(timeout=OUTER) == "pong@0"
    assert b.ping.call_one().get(timeout=OUTER) == "pong@1"
    assert "hop" not in a.history.call_one().get(timeout=OUTER)


def test_call_back_queued_before_the_wait(nodes):
    a, b = nodes[0], nodes[1]
    _fails_fast(a.late_wait.call_one([b, a]), ".late_wait (rank 0) waits for", ".hop (rank 1)")


def test_async_endpoint_awaiting(nodes):
    a, b = nodes[0], nodes[1]
    _fails_fast(a.ahop.call_one([b, a]), ".ahop (rank 0) waits for", ".hop (rank 1)")
    assert a.ping.call_one().get(timeout=OUTER) == "pong@0"


def test_three_cycle(nodes):
    a, b, c = nodes
    _fails_fast(a.hop.call_one([b, c, a]),
                "hop (rank 0) waits for", "hop (rank 1), which waits for",
                "hop (rank 2), which waits for")
    # the other way round, started from another rank
    _fails_fast(c.hop.call_one([b, a, c]), "hop (rank 2) waits for")


def test_cycle_within_one_rank(procs):
    one = procs.slice(procs=slice(1, 2))
    x = _spawn(one, "x")
    y = _spawn(one, "y")
    try:
        err = _fails_fast(x.hop.call_one([y, x]),
                          f"{x.name}.hop (rank 1) waits for {y.name}.hop (rank 1), "
                          f"which waits for {x.name}.hop (rank 1)")
        assert err.ranks == [1]
        assert x.ping.call_one().get(timeout=OUTER) == "pong@1"
    finally:
        x.stop()
        y.stop()


def test_cycle_of_independent_calls(nodes):
    """a waits for b while b waits for a, each called by the controller: the
    calls back are queued behind the waiting calls."""
    a, b = nodes[0], nodes[1]
    fa = a.call_and_wait.call_one(b, 0.3)  # (both run before either calls)
    fb = b.call_and_wait.call_one(a, 0.3)
    outcomes = []
    for f in (fa, fb):
        try:
            outcomes.append(f.get(timeout=OUTER))
        except ActorError as e:
            assert "wait cycle between actors" in str(e) and "is queued behind" in str(e)
            outcomes.append("cycle")
    assert sorted(outcomes) in (["cycle", "pong@0"], ["cycle", "pong@1"]), outcomes


def test_ring_of_independent_calls(procs):
    """Every rank waits for the next one, all at once: one call of the ring fails,
    the others then go through."""
    m = _spawn(procs, "ring")
    try:
        for _ in range(3):
            outcomes = []
            for f in m.ring.stream(m, 0.3):
                try:
                    outcomes.append(f.get(timeout=OUTER))
                except ActorError as e:
                    assert str(e).count("is queued behind") == 2, str(e)  # + the call failed
                    outcomes.append("cycle")
            assert sorted(outcomes, key=str).count("cycle") == 1, outcomes
    finally:
        m.stop()


def test_no_false_positives(nodes):
    a, b, c = nodes
    # a calls b without waiting (and stays busy); b calls a back and waits: fine
    assert a.fire.call_one(b, 0.3).get(timeout=OUTER) == "fired"
    assert a.collect.call_one().get(timeout=OUTER) == "pong@0"
    # a waits for b, which calls a without waiting: that call runs after a's returns
    assert a.wait_for_fire.call_one(b).get(timeout=OUTER) == "returned"
    wait_for(lambda: "ping" in a.history.call_one().get(timeout=OUTER), 30, what="a ping")
    # a chain of long waits (each link waits well over the watch delay), no cycle
    assert a.hop.call_one([b, c], sleep=0.3).get(timeout=OUTER) == "0>1>end@2"
    # a waits for a call queued behind a slow call of b (that does not wait): fine
    busy = b.slow.call_one(0.5)
    chained = a.call_and_wait.call_one(b)
    assert busy.get(timeout=OUTER) == "slow" and chained.get(timeout=OUTER) == "pong@1"
    # a stopped waiting (a timeout) before b called back: b's call waits, then runs
    assert a.give_up.call_one(b).get(timeout=OUTER) == "gave up"
    assert a.collect.call_one().get(timeout=OUTER) == "pong@0"
    # and the same actors still find a real cycle afterwards
    _fails_fast(a.hop.call_one([b, a]), "wait cycle")


def test_stream_and_call_from_an_actor(procs):
    """A stream waits for each pending call: those that call back fail, the others
    do not; call() over several ranks that all call back fails."""
    m = _spawn(procs, "s")
    try:
        me, others = m.slice(procs=0), m.slice(procs=slice(1, 3))
        got = me.stream_back.call_one(others).get(timeout=OUTER)
        assert got == ["cycle: True", "plain@2"], got
        _fails_fast(me.fan.call_one(others), ".fan (rank 0) waits for", "hop (rank 1)")
        assert me.ping.call_one().get(timeout=OUTER) == "pong@0"
    finally:
        m.stop()


def test_cycle_across_two_meshes_of_one_program(procs):
    """A cycle through the actors of two process meshes (generators calling
    trainers that call back) fails as fast as one within a mesh."""
    from monarch_kernel import this_host

    other = this_host().spawn_procs(per_host={"procs": 2})
    here = None
    try:
        here, there = _spawn(procs, "here"), _spawn(other, "there")
        a, c = here.slice(procs=0), here.slice(procs=1)
        b, d = there.slice(procs=0), there.slice(procs=1)
        _fails_fast(a.hop.call_one([b, a]),
                    f"{a.name}.hop (rank 0) waits for {b.name}.hop (rank 0), which waits "
                    f"for {a.name}.hop (rank 0), which cannot start before")
        # through both meshes twice: a -> b -> c -> d -> a
        _fails_fast(a.hop.call_one([b, c, d, a]), f"{b.name}.hop (rank 0), which waits for",
                    f"{c.name}.hop (rank 1), which waits for", f"{d.name}.hop (rank 1)")
        # started on the other mesh, and caught there
        got = b.hop.call_one([a, b], catch=True).get(timeout=OUTER)
        assert got.startswith("0>caught WaitCycleError: "), got
        # nothing is stuck afterwards, and calls across that only look alike still work
        for n in (a, b, c, d):
            assert n.ping.call_one().get(timeout=OUTER).startswith("pong@")
        assert a.hop.call_one([b, c]).get(timeout=OUTER) == "0>0>end@1"
        assert b.hop.call_one([a, d]).get(timeout=OUTER) == "0>0>end@1"
    finally:
        if here is not None:
            here.stop()
        other.stop()


class Spawner(Node):
    """A Node that spawns a mesh of its own and calls a Node there."""

    @endpoint
    def via_child(self, back: bool) -> str:
        """Call the child mesh's ``hop``, which calls this actor back (``back``)
        or ends there, and wait for it."""
        from monarch_kernel import this_host

        child = this_host().spawn_procs(per_host={"procs": 1})
        try:
            node = child.spawn("child", Node)
            try:
                return "spawner>" + node.hop.call_one([self.me] if back else []).get(
                    timeout=INNER)
            except WaitCycleError as e:
                return f"caught WaitCycleError: {e}"
        finally:
            child.stop()


def test_cycle_through_a_mesh_an_actor_spawned(procs):
    """An actor's calls to a mesh it spawned go through that mesh's controller
    (in the actor's own worker); a cycle through them fails fast all the same."""
    spawners = procs.spawn(f"spawner{next(_names)}", Spawner)
    try:
        s = spawners.slice(procs=0)
        s.remember.call_one(s).get(timeout=OUTER)
        t0 = time.monotonic()
        got = s.via_child.call_one(True).get(timeout=OUTER)
        assert got.startswith("caught WaitCycleError: "), got
        assert "waits for child.hop (rank 0), which waits for" in got, got
        assert time.monotonic() - t0 < QUICK, "the cycle took too long to fail"
        assert s.via_child.call_one(False).get(timeout=OUTER) == "spawner>end@0"
        assert s.ping.call_one().get(timeout=OUTER) == "pong@0"
    finally:
        spawners.stop()
