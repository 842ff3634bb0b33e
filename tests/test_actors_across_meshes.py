"""Actor handles across process meshes: an actor calls the actors of a mesh
it spawned itself; a handle of another program's mesh is refused at once
with a clear error (its processes check another key: the call could never
be answered)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import cloudpickle
import pytest

from monarch_kernel import Actor, MeshError, endpoint, this_host

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers need not import it

pytestmark = pytest.mark.timeout(180)

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Echo(Actor):
    @endpoint
    def echo(self, x: int) -> int:
        return x


class Parent(Actor):
    @endpoint
    def spawn_and_call(self) -> list:
        """Spawn a mesh of this actor's own, call its actors, stop it."""
        from monarch_kernel import spawn_procs

        m = spawn_procs(2, telemetry_interval=0)
        try:
            kids = m.spawn("kids", Echo)
            return kids.echo.call(5).get(timeout=30).values()
        finally:
            m.stop()


class Caller(Actor):
    @endpoint
    def call(self, other) -> str:
        try:
            return repr(other.echo.call(1).get(timeout=30).values())
        except Exception as e:  # noqa: BLE001 - reported to the test
            return f"{type(e).__name__}: {e}"


def test_an_actor_calls_the_actors_of_a_mesh_it_spawned():
    """(Before, its calls went worker to worker, signed with its own mesh's key,
    and the child mesh dropped them: a hang.)"""
    with this_host().spawn_procs(per_host={"procs": 1}) as pm:
        parent = pm.spawn("parent", Parent)
        assert parent.spawn_and_call.call_one().get(timeout=120) == [5, 5]


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
        """), os.path.join(_ROOT, "tests")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=_ROOT)
    try:
        line = other.stdout.readline()
        assert line.strip(), "the other program printed no handle"
        theirs = cloudpickle.loads(bytes.fromhex(line.strip()))
        with this_host().spawn_procs(per_host={"procs": 1}) as pm:
            caller = pm.spawn("caller", Caller)
            said = caller.call.call_one(theirs).get(timeout=30)
            assert said.startswith("MeshError") and "another process mesh" in said, said
            with pytest.raises(MeshError, match="another process mesh|neither"):
                theirs.echo.call(1)  # nor can this controller call it
    finally:
        other.stdin.write("\n")
        other.stdin.flush()
        other.wait(timeout=60)
