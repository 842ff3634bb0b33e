"""Actor meshes driven from this test process (the test is the controller)."""

from __future__ import annotations

import asyncio
import os
import pickle
import signal
import sys
import threading
import time

import cloudpickle
import pytest

from monarch_kernel import (
    Actor,
    ActorError,
    ActorMesh,
    Future,
    MeshFailure,
    Point,
    ValueMesh,
    current_rank,
    current_size,
    endpoint,
    this_host,
)
from monarch_kernel.testing.kernel import wait_for, worker_pids

# the workers cannot import this test module: ship its classes by value, like a notebook's
cloudpickle.register_pickle_by_value(sys.modules[__name__])

_flags: dict[str, threading.Event] = {}  # per worker process (actors share it)


class Boom(Exception):
    """A user-defined exception type."""


class Counter(Actor):
    def __init__(self, start: int = 0) -> None:
        self.value = start
        self.log: list = []
        self.active = 0
        self.max_active = 0

    @endpoint
    def incr(self, by: int = 1) -> int:
        self.value += by
        return self.value

    @endpoint
    def record(self, item: object) -> None:
        self.log.append(item)

    @endpoint
    def history(self) -> list:
        return list(self.log)

    @endpoint
    def where(self) -> tuple:
        return current_rank(), current_size(), os.getpid()

    @endpoint
    async def async_where(self) -> int:
        await asyncio.sleep(0.01)
        return current_rank().rank

    @endpoint
    def sleep(self, seconds: float) -> int:
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        time.sleep(seconds)
        self.active -= 1
        return current_rank().rank

    @endpoint
    def max_concurrency(self) -> int:
        return self.max_active

    @endpoint
    def countdown(self, step: float) -> int:
        me = current_rank()
        time.sleep(step * (current_size()["procs"] - 1 - me["procs"]))
        return me.rank

    @endpoint
    def fail(self, kind: str) -> None:
        if kind == "key":
            return {}["missing"]
        if kind == "boom":
            raise Boom("custom", 42)
        raise ValueError(f"bad value on rank {current_rank().rank}")

    @endpoint
    def unpicklable(self) -> object:
        return threading.Lock()

    @endpoint
    def wait_flag(self, timeout: float) -> bool:
        return _flags.setdefault("f", threading.Event()).wait(timeout)

    @endpoint
    def set_flag(self) -> None:
        _flags.setdefault("f", threading.Event()).set()

    @endpoint
    def call_self(self) -> int:
        me = current_rank().rank
        return self.me.slice(procs=me).incr.call_one().get(timeout=5)

    @endpoint
    def remember(self, handle: ActorMesh) -> None:
        self.me = handle

    def not_an_endpoint(self) -> None:
        pass


class Relay(Actor):
    """Calls other actor meshes from inside a worker."""

    @endpoint
    def relay(self, target: ActorMesh, n: int) -> list:
        return [target.incr.call_one(1).get(timeout=30) for _ in range(n)]

    @endpoint
    async def relay_async(self, target: ActorMesh) -> list:
        vm = await target.async_where.call()
        return vm.values()

    @endpoint
    def catch(self, target: ActorMesh) -> str:
        try:
            target.fail.call_one("key").get(timeout=30)
        except KeyError as e:
            return f"caught {type(e).__name__} from rank {e.ranks}"
        return "not raised"

    @endpoint
    def call_stopped(self, target: ActorMesh) -> str:
        try:
            target.incr.call_one().get(timeout=30)
        except MeshFailure as e:
            return str(e)
        return "not raised"

    @endpoint
    def spray(self, target: ActorMesh, n: int) -> None:
        futures = [target.record.call_one(i) for i in range(n)]  # all sent before any reply
        for f in futures:
            f.get(timeout=60)

    @endpoint
    def fire(self, target: ActorMesh) -> None:
        target.fail.broadcast("value")

    @endpoint
    def peer_stats(self) -> dict:
        from monarch_kernel.actor.host import stats

        return stats()


class BadInit(Actor):
    def __init__(self, x: int) -> None:
        if current_rank().rank == 1:
            raise ZeroDivisionError(f"cannot build with {x}")

    @endpoint
    def ok(self) -> bool:
        return True


def _no_workers() -> None:
    wait_for(lambda: not worker_pids(os.getpid()), 10, what="no worker processes left")


@pytest.fixture(scope="module")
def procs():
    pm = this_host().spawn_procs(per_host={"procs": 4})
    try:
        yield pm
    finally:
        pm.stop()
        _no_workers()


_names = iter(range(10**6))


@pytest.fixture
def counters(procs):
    m = procs.spawn(f"counters{next(_names)}", Counter, 0)
    try:
        yield m
    finally:
        m.stop()


# ---------------------------------------------------------------- adverbs
def test_call_returns_a_value_mesh(counters):
    fut = counters.incr.call(2)
    assert isinstance(fut, Future)
    vm = fut.get(timeout=30)
    assert isinstance(vm, ValueMesh) and vm.values() == [2, 2, 2, 2]
    assert vm.item(hosts=0, procs=3) == 2
    points = [p for p, _ in vm.items()]
    assert [p.rank for p in points] == [0, 1, 2, 3] and points[2]["procs"] == 2
    assert "ValueMesh" in repr(vm) and "<table>" in vm._repr_html_()


def test_a_broadcast_to_part_of_the_mesh_runs_there_only(counters):
    """One message for ranks 1-2 (signed once, naming them): the others never run it,
    the values come back in rank order, each from its own rank."""
    part = counters.slice(procs=slice(1, 3))
    assert part.incr.call(5).get(timeout=30).values() == [5, 5]
    assert counters.incr.call(0).get(timeout=30).values() == [0, 5, 5, 0]
    fut = counters.countdown.call(0.05)  # the last rank answers first
    assert fut.get(timeout=30).values() == [0, 1, 2, 3]
    with pytest.raises(ValueError) as ei:  # each rank's own error, named by rank
        part.fail.call("value").get(timeout=30)
    errs = [ei.value, *ei.value.others]
    assert sorted(r for e in errs for r in e.ranks) == [1, 2]
    assert sorted(str(e).split("bad value on rank ")[1][:1] for e in errs) == ["1", "2"]


def test_shape_and_slicing(counters):
    assert len(counters) == 4 and counters.sizes == {"hosts": 1, "procs": 4}
    assert counters.shape.ranks == [0, 1, 2, 3]
    one = counters.slice(procs=2)
    assert len(one) == 1 and one.sizes == {"hosts": 1}
    assert one.incr.call_one(5).get(timeout=30) == 5
    pair = counters.slice(procs=slice(1, 3))
    assert pair.sizes == {"hosts": 1, "procs": 2} and pair.ranks == [1, 2]
    assert pair.incr.call(1).get(timeout=30).values() == [1, 6]
    with pytest.raises(Exception, match="out of range"):
        counters.slice(procs=7)


def test_call_one_needs_a_mesh_of_one(counters):
    with pytest.raises(ValueError, match=r"exactly 1 actor.*slice\(procs=0\)"):
        counters.incr.call_one()


def test_choose_prefers_the_least_busy(counters):
    busy = counters.slice(procs=0).sleep.call_one(1.5)
    chosen = [counters.where.choose().get(timeout=30)[0].rank for _ in range(6)]
    assert 0 not in chosen and set(chosen) == {1, 2, 3}  # round robin among the idle ones
    assert busy.get(timeout=30) == 0


def test_broadcast_is_ordered_before_later_calls(counters):
    assert counters.record.broadcast("b") is None
    assert [h[-1] for h in counters.history.call().get(timeout=30).values()] == ["b"] * 4


def test_broadcast_failures_are_reported(counters, capfd):
    counters.fail.broadcast("value")
    wait_for(lambda: len(counters.broadcast_failures) == 4, 30, what="4 broadcast failures")
    errs = counters.broadcast_failures
    assert all(isinstance(e, ValueError) and isinstance(e, ActorError) for e in errs)
    assert sorted(e.ranks[0] for e in errs) == [0, 1, 2, 3]
    assert "raise ValueError" in errs[0].remote_traceback
    err = capfd.readouterr().err
    assert f"[monarch] broadcast {counters.name}.fail failed on rank" in err


def test_stream_yields_in_completion_order(counters):
    futures = counters.countdown.stream(0.4)
    values = [f.get(timeout=30) for f in futures]
    assert values == [3, 2, 1, 0]


def test_async_endpoint_and_await_in_a_script(counters):
    async def main() -> tuple:
        vm = await counters.async_where.call()
        one = await counters.slice(procs=1).async_where.call_one()
        return vm.values(), one

    assert asyncio.run(main()) == ([0, 1, 2, 3], 1)


def test_current_rank_and_size(counters):
    vm = counters.where.call().get(timeout=30)
    point, sizes, _ = vm.item(hosts=0, procs=2)
    assert isinstance(point, Point) and point.rank == 2 and dict(point) == {"hosts": 0,
                                                                             "procs": 2}
    assert sizes == {"hosts": 1, "procs": 4}
    sub = counters.slice(procs=slice(2, 4))
    assert sub.where.call().get(timeout=30).values()[0][0].rank == 2
    with pytest.raises(RuntimeError, match="inside an actor"):
        current_rank()


# -------------------------------------------------------------- semantics
def test_a_thousand_calls_arrive_in_order(counters):
    one = counters.slice(procs=1)
    futures = [one.record.call_one(i) for i in range(1000)]
    for f in futures:
        f.get(timeout=60)
    assert one.history.call_one().get(timeout=30) == list(range(1000))


class Pacer(Actor):
    @endpoint
    def nap(self, seconds: float = 0.0) -> float:
        time.sleep(seconds)
        return seconds


def test_a_reply_is_never_held_behind_a_slow_call(procs):
    """Replies to quick calls may leave together (a batch), but a held reply never
    waits for a later call that turns out slow."""
    m = procs.spawn(f"pacer{next(_names)}", Pacer)
    try:
        one = m.slice(procs=2)
        for _ in range(5):
            one.nap.call_one().get(timeout=10)
        block = one.nap.call_one(0.3)  # the next two queue up behind it
        quick = one.nap.call_one(0.0)  # runs quick: its reply may be held for the next...
        slow = one.nap.call_one(3.0)  # ...which the worker expects quick, and is not
        block.get(timeout=10)
        assert quick.get(timeout=10) == 0.0
        assert not slow.done(), "a reply waited for the next (slow) call"
        assert slow.get(timeout=10) == 3.0
    finally:
        m.stop()


def test_one_message_at_a_time_and_actors_run_concurrently(procs, counters):
    futures = [counters.slice(procs=0).sleep.call_one(0.05) for _ in range(5)]
    [f.get(timeout=30) for f in futures]
    assert counters.slice(procs=0).max_concurrency.call_one().get(timeout=30) == 1
    other = procs.spawn(f"other{next(_names)}", Counter)
    try:  # two actors in one process: one blocks until the other sets a flag
        waiting = counters.slice(procs=3).wait_flag.call_one(20)
        other.slice(procs=3).set_flag.call_one().get(timeout=30)
        assert waiting.get(timeout=30) is True
    finally:
        other.stop()


def test_timeout_leaves_the_future_usable(counters):
    fut = counters.slice(procs=0).sleep.call_one(0.5)
    with pytest.raises(TimeoutError, match=rf"no result from {counters.name}\.sleep on rank 0 "
                       "within 0.01 s; the call goes on: call get\\(\\) again"):
        fut.get(timeout=0.01)
    assert not fut.done()
    for bad, err in ((-1, ValueError), (float("nan"), ValueError), ("1", TypeError),
                     (True, TypeError)):
        with pytest.raises(err, match="timeout is .*seconds"):
            fut.get(timeout=bad)
    assert fut.get(timeout=30) == 0
    assert fut.get(timeout=0) == 0  # a done future answers at once, any number of times


def test_a_plain_script_shows_the_remote_traceback(counters):
    # IPython shows it through _render_traceback_; Python's own printing of an
    # uncaught exception, and traceback.format_exception, through __notes__
    import traceback

    with pytest.raises(KeyError) as ei:
        counters.slice(procs=1).fail.call_one("key").get(timeout=30)
    text = "".join(traceback.format_exception(ei.value))
    assert "rank 1 (actor " in text and "raised KeyError" in text, text
    assert 'return {}["missing"]' in text and "in fail" in text, text
    ei.value.add_note("and a note of the caller's")  # (notes stay a list one can add to)
    assert "and a note of the caller's" in "".join(traceback.format_exception(ei.value))



def test_an_error_through_two_ranks_shows_each_ones_traceback_once(procs, counters):
    """Rank 0's endpoint lets rank 1's KeyError through: what is printed shows
    rank 0's frames, then rank 1's, each once (the notes a rank made for the
    error it got are made again where it lands), and a note added on the way
    travels with it."""
    import traceback

    relay = procs.spawn(f"through{next(_names)}", LetThrough).slice(procs=0)
    try:
        for note in (False, True):
            with pytest.raises(KeyError) as ei:
                relay.relay.call_one(counters.slice(procs=1), note).get(timeout=30)
            text = "".join(traceback.format_exception(ei.value))
            assert "rank 0 (actor through" in text and "which came from rank 1 (actor " in text
            assert text.count("in relay") == 1 and text.count("in fail") == 1, text
            assert text.count('return {}["missing"]') == 1, text
            assert text.count("a note rank 0 added") == int(note), text
        # ranks that failed differently (three groups), let through: each one's traceback
        with pytest.raises(ValueError) as ei:
            relay.relay_all.call_one(counters.slice(procs=slice(1, 4)), "value").get(timeout=30)
        text = "".join(traceback.format_exception(ei.value))
        assert text.count("in relay_all") == 1 and text.count("in fail") == 3, text
        for r in (1, 2, 3):
            assert text.count(f"ValueError: bad value on rank {r}") == 1, text
        assert "which came from rank 1 " in text and "and from rank 3 " in text, text
    finally:
        relay.stop()

# --------------------------------------------------------------- errors
def test_an_error_let_through_its_own_rank_is_labelled_once() -> None:
    from monarch_kernel.errors import RemoteError

    e = RemoteError.__new__(RemoteError)
    e.ranks, e._message = [1], "rank 1: x"  # (another actor of rank 1 let it through)
    assert str(e) == "rank 1: x"
    e._message = "rank 0: x"  # (from rank 0): the way it came is kept
    assert str(e) == "rank 1: rank 0: x"
    e.ranks = [1, 2]
    assert str(e) == "ranks 1, 2: rank 0: x"


def test_exceptions_keep_their_type(counters):
    with pytest.raises(KeyError) as ei:
        counters.fail.call("key").get(timeout=30)
    e = ei.value
    assert isinstance(e, ActorError) and e.ranks == [0, 1, 2, 3] and e.actor == counters.name
    assert 'return {}["missing"]' in e.remote_traceback  # the source line, from this file
    try:
        counters.slice(procs=0).fail.call_one("boom").get(timeout=30)
    except Boom as b:
        assert b.args == ("custom", 42) and b.ranks == [0]
    # ranks that fail differently are all reported
    with pytest.raises(ValueError) as ei2:
        counters.fail.call("value").get(timeout=30)
    assert len(ei2.value.others) == 3


class LetThrough(Actor):
    @endpoint
    def relay(self, other: ActorMesh, note: bool = False) -> object:
        """``other``'s fail, its error let through (with a note of ours)."""
        try:
            return other.fail.call_one("key").get(timeout=30)
        except KeyError as e:
            if note:
                e.add_note("a note rank 0 added")
            raise

    @endpoint
    def relay_all(self, other: ActorMesh, kind: str) -> object:
        """``other``'s fail on all its ranks, their errors let through."""
        return other.fail.call(kind).get(timeout=30)


def test_an_error_let_through_another_actor_keeps_its_type(procs, counters):
    relay = procs.slice(procs=1).spawn(f"through{next(_names)}", LetThrough)
    try:
        with pytest.raises(KeyError) as info:  # raised on rank 0, let through on rank 1
            relay.relay.call_one(counters.slice(procs=0)).get(timeout=60)
        err = info.value
        assert isinstance(err, ActorError) and err.ranks == [1]
        assert err.remote_type == "KeyError"
        tb = err.remote_traceback
        # where it was let through, then where it was raised; no library plumbing
        assert "in relay" in tb and "which came from rank 0 (actor counters" in tb
        assert "in fail" in tb and "future.py" not in tb, tb
        # and such an error pickles (to travel on) as its own type
        again = pickle.loads(pickle.dumps(err))
        assert isinstance(again, KeyError) and isinstance(again, ActorError)
        assert again.ranks == [1] and again.remote_traceback == tb
    finally:
        relay.stop()


def test_unpicklable_result_is_an_error(counters):
    with pytest.raises(ActorError, match="cannot be sent back"):
        counters.slice(procs=0).unpicklable.call_one().get(timeout=30)


def test_bad_use_gives_clear_errors(procs, counters):
    with pytest.raises(AttributeError, match="no endpoint 'not_an_endpoint'.*incr"):
        counters.not_an_endpoint  # noqa: B018
    with pytest.raises(TypeError, match=r"use \.call\(\.\.\.\)"):
        counters.incr(1)
    with pytest.raises(TypeError, match="subclass of monarch_kernel.Actor"):
        procs.spawn("x", dict)
    with pytest.raises(ValueError, match="already runs on rank 0"):
        procs.spawn(counters.name, Counter)


def test_constructor_failure(procs):
    with pytest.raises(ZeroDivisionError) as ei:
        procs.spawn("badinit", BadInit, 7)
    assert isinstance(ei.value, ActorError) and ei.value.ranks == [1]
    assert "cannot build with 7" in str(ei.value) and "raise ZeroDivisionError" in (
        ei.value.remote_traceback)
    ok = procs.slice(procs=0).spawn("badinit", BadInit, 7)  # the name is free again
    try:
        assert ok.ok.call_one().get(timeout=30) is True
    finally:
        ok.stop()


def test_self_call_raises_instead_of_deadlocking(procs):
    c = procs.slice(procs=slice(0, 1)).spawn("selfcall", Counter)
    try:
        c.remember.call(c).get(timeout=30)
        with pytest.raises(RuntimeError, match="its own endpoint"):
            c.slice(procs=0).call_self.call_one().get(timeout=30)
    finally:
        c.stop()


def test_stopped_actor_raises_mesh_failure(procs):
    c = procs.spawn("stopme", Counter)
    relay = procs.slice(procs=0).spawn("relay_stop", Relay)
    try:
        with c:
            assert c.incr.call().get(timeout=30).values() == [1] * 4
        with pytest.raises(MeshFailure, match="actor 'stopme' on rank 0 was stopped"):
            c.incr.call().get(timeout=30)
        with pytest.raises(MeshFailure, match="rank 2"):
            c.slice(procs=2).incr.call_one().get(timeout=30)
        with pytest.raises(MeshFailure):
            c.incr.broadcast()
        # from another actor (worker to worker) too
        msg = relay.call_stopped.call_one(c.slice(procs=3)).get(timeout=30)
        assert "actor 'stopme' on rank 3 was stopped" in msg
        again = procs.spawn("stopme", Counter, 5)  # the name can be reused
        assert again.incr.call().get(timeout=30).values() == [6] * 4
        again.stop()
    finally:
        relay.stop()


# ------------------------------------------------------- actor to actor
def test_nested_calls_go_worker_to_worker(procs, counters):
    relay = procs.slice(procs=0).spawn(f"relay{next(_names)}", Relay)
    try:
        ctl = procs.controller
        peers_before = relay.peer_stats.call_one().get(timeout=30)
        before = {r: (i.messages_in, i.messages_out) for r, i in ctl.ranks.items()}
        values = relay.relay.call_one(counters.slice(procs=3), 200).get(timeout=60)
        after = {r: (i.messages_in, i.messages_out) for r, i in ctl.ranks.items()}
        peers_after = relay.peer_stats.call_one().get(timeout=30)
        assert values == list(range(1, 201))
        # the controller sent 1 request to rank 0 (relay) and none to rank 3
        assert after[0][1] - before[0][1] == 1
        assert after[3][1] == before[3][1]
        # it received 1 reply plus heartbeats, not 400 messages
        assert after[0][0] - before[0][0] < 100 and after[3][0] - before[3][0] < 100
        assert peers_after["out"] - peers_before["out"] >= 200
        assert peers_after["in"] - peers_before["in"] >= 200
        # async endpoints await other actors; handles pass as arguments
        assert relay.relay_async.call_one(counters).get(timeout=30) == [0, 1, 2, 3]
        assert relay.catch.call_one(counters.slice(procs=2)).get(timeout=30) == (
            "caught KeyError from rank [2]")
        # ordering holds worker to worker too
        relay.spray.call_one(counters.slice(procs=1), 1000).get(timeout=60)
        assert counters.slice(procs=1).history.call_one().get(timeout=30) == list(range(1000))
        # a broadcast from a worker that fails is reported to the controller
        relay.fire.call_one(counters).get(timeout=30)
        wait_for(lambda: len(counters.broadcast_failures) == 4, 30, what="4 failures")
    finally:
        relay.stop()


def test_handles_pickle_on_the_controller(counters):
    copy = pickle.loads(pickle.dumps(counters))
    assert copy.name == counters.name and copy.sizes == counters.sizes
    assert copy.incr.call(1).get(timeout=30).values() == [1] * 4


def test_dead_rank_raises_mesh_failure():
    with this_host().spawn_procs(per_host={"procs": 3}) as pm:
        mine = {p.pid for p in pm.launcher.placements().values()}
        c = pm.spawn("victim", Counter)
        relay = pm.slice(procs=0).spawn("relay", Relay)
        pids = [w[2] for w in c.where.call().get(timeout=30).values()]
        pending = c.slice(procs=1).sleep.call_one(60)
        assert relay.relay.call_one(c.slice(procs=2), 1).get(timeout=30) == [1]
        os.kill(pids[1], signal.SIGKILL)
        with pytest.raises(MeshFailure, match=r"rank 1 .*SIGKILL"):
            pending.get(timeout=30)
        with pytest.raises(MeshFailure, match="rank 1"):
            c.incr.call().get(timeout=30)
        os.kill(pids[2], signal.SIGKILL)
        wait_for(lambda: pm.controller.ranks[2].state == "dead", 30, what="rank 2 dead")
        with pytest.raises(MeshFailure, match="rank 2") as ei:  # fails fast in the relay too
            relay.relay.call_one(c.slice(procs=2), 1).get(timeout=30)
        assert isinstance(ei.value, ActorError) and ei.value.ranks == [0]  # raised by relay
    with pytest.raises(MeshFailure):
        c.slice(procs=0).incr.call_one().get(timeout=30)
    wait_for(lambda: not mine & set(worker_pids()), 10, what="the mesh's workers gone")


def test_encrypted_mesh_encrypts_peer_sockets_too():
    from monarch_kernel.mesh.procmesh import spawn_procs

    with spawn_procs(2, encrypt=True, bind="127.0.0.1") as pm:  # (TCP: a local mesh is ipc)
        mine = {p.pid for p in pm.launcher.placements().values()}
        c = pm.slice(procs=1).spawn("target", Counter)
        relay = pm.slice(procs=0).spawn("relay", Relay)
        assert "|" in c._peers[1]  # the CurveZMQ public key travels with the address
        assert relay.relay.call_one(c, 3).get(timeout=30) == [1, 2, 3]
    wait_for(lambda: not mine & set(worker_pids()), 10, what="the mesh's workers gone")
