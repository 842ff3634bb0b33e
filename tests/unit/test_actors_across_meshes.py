"""Actor handles across process meshes (monarch_kernel/mesh_keys.py): the
actors of two meshes of one program call each other, both ways, over peer
lanes and over ZeroMQ; a death or a stop on one side fails the other's
waiting calls; a restarted rank is introduced again; an actor calls the
actors of a mesh it spawned itself, and those call up; a handle of another
program's mesh is refused at once with a clear error (its processes check
another key: the call could never be answered)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import cloudpickle
import pytest
from test_peer_calls import Sleeper, Waiter

from monarch_kernel import Actor, MeshError, MeshFailure, endpoint, this_host
from monarch_kernel.testing.kernel import wait_for

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers need not import it

pytestmark = pytest.mark.timeout(180)

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Echo(Actor):
    @endpoint
    def echo(self, x: int) -> int:
        return x

    @endpoint
    def ask(self, other, x: int) -> int:
        """``other``'s echo of ``x`` (a call from this actor to another mesh's)."""
        return other.echo.call_one(x).get(timeout=30)

    @endpoint
    def ask_back(self, other, me) -> int:
        """Calls ``other``'s ask, which calls ``me`` (this mesh's) back: 7 + 1."""
        return other.ask.call_one(me, 7).get(timeout=30) + 1

    sleep = Sleeper.sleep
    wait_on = Waiter.wait_on  # (other's 60 s sleep: how the wait ended)


@pytest.mark.parametrize("lanes", ["1", "0"], ids=["peer-lanes", "zeromq"])
def test_two_meshes_of_one_program_call_each_other(lanes, monkeypatch):
    monkeypatch.setenv("MONARCH_LANES", lanes)
    a = this_host().spawn_procs(per_host={"procs": 2})
    b = this_host().spawn_procs(per_host={"procs": 2})
    try:
        ea, eb = a.spawn("ea", Echo), b.spawn("eb", Echo)
        assert ea.ask.call(eb.slice(procs=1), 3).get(timeout=60).values() == [3, 3]
        assert eb.ask.call(ea.slice(procs=0), 4).get(timeout=60).values() == [4, 4]
        # B's actor calls A's back from inside the call A made to it
        got = ea.slice(procs=0).ask_back.call_one(eb.slice(procs=0), ea.slice(procs=1))
        assert got.get(timeout=60) == 8
    finally:
        a.stop()
        b.stop()


def test_a_death_or_a_stop_of_the_other_mesh_fails_the_waiting_call():
    a = this_host().spawn_procs(per_host={"procs": 1})
    b = this_host().spawn_procs(per_host={"procs": 2})
    c = this_host().spawn_procs(per_host={"procs": 1})
    try:
        ea, eb, ec = a.spawn("ea", Echo), b.spawn("eb", Echo), c.spawn("ec", Echo)
        pending = ea.wait_on.call_one(eb.slice(procs=1))
        time.sleep(0.5)  # (the call is there, sleeping)
        t0 = time.monotonic()
        os.kill(b.controller.ranks[1].pid, signal.SIGKILL)
        said = pending.get(timeout=60)
        assert said.startswith("MeshFailure") and "rank 1" in said, said
        assert time.monotonic() - t0 < 20
        # a stop: the waiting call fails, later calls are refused at once
        pending = ea.wait_on.call_one(ec)
        time.sleep(0.5)
        c.stop()
        said = pending.get(timeout=60)
        assert said.startswith("MeshFailure") and "stopped" in said, said
        # (as from the controller: MeshFailure, not "another program's mesh")
        with pytest.raises(MeshFailure, match="on a process mesh of this program that was stopped"):
            ea.ask.call_one(ec, 1).get(timeout=60)
    finally:
        a.stop()
        b.stop()
        c.stop()


def test_a_restarted_rank_is_introduced_again():
    a = this_host().spawn_procs(per_host={"procs": 1})
    b = this_host().spawn_procs(per_host={"procs": 1})
    try:
        ea, eb = a.spawn("ea", Echo), b.spawn("eb", Echo)
        assert ea.ask.call_one(eb, 1).get(timeout=60) == 1
        a.restart(0)
        ea = a.spawn("ea2", Echo)  # (a fresh process: its actors are spawned again)
        assert ea.ask.call_one(eb, 2).get(timeout=60) == 2
    finally:
        a.stop()
        b.stop()


class Parent(Actor):
    @endpoint
    def spawn_and_call(self, up) -> list:
        """Spawn a mesh of this actor's own, call its actors, have them call ``up``
        (an actor of this actor's mesh), stop it."""
        from monarch_kernel import spawn_procs

        m = spawn_procs(2, telemetry_interval=0)
        try:
            kids = m.spawn("kids", Echo)
            down = kids.echo.call(5).get(timeout=30).values()
            return [*down, *kids.ask.call(up, 6).get(timeout=30).values()]
        finally:
            m.stop()


def test_an_actor_calls_the_actors_of_a_mesh_it_spawned_and_they_call_up():
    """(Before, its calls went worker to worker, signed with its own mesh's key,
    and the child mesh dropped them: a hang.)"""
    with this_host().spawn_procs(per_host={"procs": 2}) as pm:
        parent = pm.slice(procs=0).spawn("parent", Parent)
        up = pm.slice(procs=1).spawn("up", Echo)
        assert parent.spawn_and_call.call_one(up).get(timeout=120) == [5, 5, 6, 6]


class Caller(Actor):
    @endpoint
    def call(self, other) -> str:
        try:
            return repr(other.echo.call(1).get(timeout=30).values())
        except Exception as e:  # noqa: BLE001 - reported to the test
            return f"{type(e).__name__}: {e}"


def test_a_handle_of_another_programs_mesh_is_refused_at_once():
    """Another program (a second notebook, a script) spawns a mesh and hands
    out a pickled actor handle; our actor's call fails at once, naming why."""
    other = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent("""
            import sys, cloudpickle
            sys.path.insert(0, sys.argv[1])
            import test_actors_across_meshes as t
            from monarch_kernel import this_host
            with this_host().spawn_procs(per_host={"procs": 1}) as pm:
                echo = pm.spawn("theirs", t.Echo)
                print(cloudpickle.dumps(echo).hex(), flush=True)
                sys.stdin.readline()  # until the test is done
        """), os.path.dirname(os.path.abspath(__file__))],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=_ROOT)
    try:
        line = other.stdout.readline()
        assert line.strip(), "the other program printed no handle"
        theirs = cloudpickle.loads(bytes.fromhex(line.strip()))
        with this_host().spawn_procs(per_host={"procs": 1}) as pm:
            caller = pm.spawn("caller", Caller)
            said = caller.call.call_one(theirs).get(timeout=30)
            assert said.startswith("MeshError") and "did not spawn" in said, said
            with pytest.raises(MeshError, match="neither the controller"):
                theirs.echo.call(1)  # nor can this controller call it
    finally:
        other.stdin.write("\n")
        other.stdin.flush()
        other.wait(timeout=60)
    wait_for(lambda: other.poll() is not None, 10, what="the other program's exit")


class Spawner(Actor):
    """Spawns a mesh of its own whose actor waits on a call up to this actor's mesh."""

    def __init__(self) -> None:
        self.m = self.fut = None

    @endpoint
    def start(self, up) -> str:
        from monarch_kernel import spawn_procs

        self.m = spawn_procs(1, telemetry_interval=0)
        kid = self.m.spawn("kid", Echo)
        self.fut = kid.wait_on.call_one(up)
        return "started"

    @endpoint
    def result(self) -> str:
        try:
            return self.fut.get(timeout=90)
        finally:
            self.m.stop()


def test_a_death_up_there_fails_a_sub_meshs_waiting_call_at_once():
    """The spawning worker passes what it learns (deaths, keys, stops) down to
    the meshes it spawned: the kid's call up fails when its callee dies."""
    with this_host().spawn_procs(per_host={"procs": 2}) as pm:
        spawner = pm.slice(procs=0).spawn("spawner", Spawner)
        up = pm.slice(procs=1).spawn("up", Echo)
        assert spawner.start.call_one(up).get(timeout=60) == "started"
        time.sleep(1.0)  # (the kid's call is up there, sleeping)
        os.kill(pm.controller.ranks[1].pid, signal.SIGKILL)
        t0 = time.monotonic()
        said = spawner.result.call_one().get(timeout=120)
        assert said.startswith("MeshFailure") and "rank 1" in said, said
        assert time.monotonic() - t0 < 20


class Keys(Actor):
    @endpoint
    def held(self) -> dict:
        """What this worker keeps for other meshes."""
        from monarch_kernel.actor import peers as actor_peers
        from monarch_kernel.worker import worker as worker

        h = actor_peers._host
        return {"keyring": len(worker.current.keyring),
                "codecs": len(h._codecs) if h else 0,
                "codec_of_addr": len(h.codec_of_addr) if h else 0}


def test_a_stopped_meshs_key_and_codecs_are_let_go():
    a = this_host().spawn_procs(per_host={"procs": 1})
    try:
        ka = a.spawn("ka", Keys)
        ea = a.spawn("ea", Echo)
        for _ in range(3):  # meshes come, are called, and go
            b = this_host().spawn_procs(per_host={"procs": 2})
            try:
                eb = b.spawn("eb", Echo)
                assert ea.ask.call_one(eb.slice(procs=1), 2).get(timeout=60) == 2
                assert ka.held.call_one().get(timeout=30) == {"keyring": 1, "codecs": 1,
                                                              "codec_of_addr": 1}
            finally:
                b.stop()
            wait_for(lambda: ka.held.call_one().get(timeout=30)
                     == {"keyring": 0, "codecs": 0, "codec_of_addr": 0}, 10,
                     what="the stopped mesh's key and codecs let go")
    finally:
        a.stop()
