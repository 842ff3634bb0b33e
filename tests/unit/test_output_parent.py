"""Output is credited to the call that printed it, with two actors of one worker
printing at once (and a cell running beside an actor).

Real workers; the controller is this test process, and what a call's future
prints while it is waited on (rank-tagged) is what a notebook cell shows.
Both ways a worker's output travels are covered: a local worker whose pipes
the controller reads itself, and a worker that reads its own fds and sends
``stream`` messages (as remote workers do).
"""

from __future__ import annotations

import sys
import threading

import cloudpickle
import pytest

from monarch_kernel import Actor, endpoint, this_host
from monarch_kernel.launchers.local import LocalLauncher

cloudpickle.register_pickle_by_value(sys.modules[__name__])

WAIT_S = 30.0
STEPS = ("a_running", "b_running", "a_printed", "b_printed",
         "actor_running", "cell_running", "actor_printed", "cell_printed")


def _events() -> dict[str, threading.Event]:
    """Events shared by every thread of one worker process (kept on ``sys``,
    which every copy of this module's code sees alike)."""
    return sys.__dict__.setdefault("_monarch_test_output_events",
                                   {k: threading.Event() for k in STEPS})


def _step(wait: str | None = None, then: str | None = None) -> None:
    ev = _events()
    if wait is not None and not ev[wait].wait(WAIT_S):
        raise TimeoutError(f"{wait} did not happen in {WAIT_S} s")
    if then is not None:
        ev[then].set()


class Speaker(Actor):
    @endpoint
    def first(self) -> str:
        """Runs, lets B start, prints while B runs, waits for B to print."""
        _step(then="a_running")
        _step(wait="b_running")
        print("said by A")
        print("A on stderr", file=sys.stderr)
        _step(then="a_printed")
        _step(wait="b_printed")
        return "A"

    @endpoint
    def second(self) -> str:
        """Starts after A, prints after A printed, while A still runs."""
        _step(wait="a_running", then="b_running")
        _step(wait="a_printed")
        print("said by B")
        _step(then="b_printed")
        return "B"

    @endpoint
    def beside_a_cell(self) -> str:
        """Prints while a cell (started after this call) runs on the main thread,
        and runs until the cell printed too."""
        _step(then="actor_running")
        _step(wait="cell_running")
        print("said by the actor")
        _step(then="actor_printed")
        _step(wait="cell_printed")
        return "actor"

    @endpoint
    def reset(self) -> None:
        for e in _events().values():
            e.clear()


class _SelfReadingLauncher(LocalLauncher):
    """A local launcher whose workers read their own fds and send ``stream``
    messages (the controller is not handed their pipes), as remote ones do."""

    @property  # type: ignore[override]
    def on_pipes(self) -> None:
        return None

    @on_pipes.setter
    def on_pipes(self, value: object) -> None:
        pass


@pytest.fixture(scope="module", params=["controller-reads-pipes", "worker-reads-fds"])
def procs(request):
    launcher = LocalLauncher() if request.param == "controller-reads-pipes" \
        else _SelfReadingLauncher()
    m = this_host().spawn_procs(per_host={"procs": 1}, launcher=launcher)
    try:
        yield m
    finally:
        m.stop()


def test_two_actors_printing_at_once_each_get_their_own_output(procs, capsys):
    a = procs.spawn("speaker_a", Speaker)
    b = procs.spawn("speaker_b", Speaker)
    a.reset.call().get(timeout=WAIT_S)
    capsys.readouterr()
    fa = a.first.call()
    fb = b.second.call()
    assert fb.get(timeout=WAIT_S).item(hosts=0, procs=0) == "B"
    out_b = capsys.readouterr()
    assert fa.get(timeout=WAIT_S).item(hosts=0, procs=0) == "A"
    out_a = capsys.readouterr()
    assert "said by B" in out_b.out
    assert "said by A" not in out_b.out and "A on stderr" not in out_b.err
    assert "said by A" in out_a.out and "A on stderr" in out_a.err
    assert "said by B" not in out_a.out
    a.stop()
    b.stop()


def test_an_actor_printing_while_a_cell_runs_gets_its_own_output(procs, capsys):
    actor = procs.spawn("speaker_c", Speaker)
    actor.reset.call().get(timeout=WAIT_S)
    capsys.readouterr()
    fut = actor.beside_a_cell.call()
    # the cell starts once the actor's call runs (a first cell waits for that)
    procs.exec(f"import sys; assert sys._monarch_test_output_events['actor_running']"
               f".wait({WAIT_S})", timeout=WAIT_S)
    code = ("import sys\n"
            "ev = sys._monarch_test_output_events\n"
            "ev['cell_running'].set()\n"
            f"assert ev['actor_printed'].wait({WAIT_S})\n"
            "print('said by the cell')\n"
            "ev['cell_printed'].set()\n")
    cell = procs.run(code)
    assert fut.get(timeout=WAIT_S).item(hosts=0, procs=0) == "actor"
    out_actor = capsys.readouterr()
    procs.collect(cell, timeout=WAIT_S)
    out_cell = capsys.readouterr()
    assert "said by the actor" in out_actor.out
    assert "said by the cell" not in out_actor.out
    assert "said by the cell" in out_cell.out
    assert "said by the actor" not in out_cell.out
    actor.stop()
