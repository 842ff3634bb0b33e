"""The bounded spin of a caller waiting for its reply (transport.engine, controller.io).

A waiting caller looks for its reply for up to ``spin_s`` before it sleeps
in poll(2), only after a message was sent or came in on the ROUTER, at most
MAX_MISSES fruitless spins in a row: a long call, or one that prints a lot,
must cost next to no CPU while it is waited for.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import cloudpickle
import pytest

from monarch_kernel import Actor, endpoint
from monarch_kernel.transport import engine as engine_mod
from monarch_kernel.transport.engine import MAX_MISSES, SPIN_US, spin_seconds
from monarch_kernel.mesh.procmesh import spawn_procs
from monarch_kernel.testing.kernel import wait_for, worker_pids

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers need not import it


class Sleeper(Actor):
    @endpoint
    def nap(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    @endpoint
    def noop(self) -> None:
        return None

    @endpoint
    def chatter(self, seconds: float) -> int:
        """Print a line every 2 ms for ``seconds``."""
        n = 0
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            print("line", n, flush=True)
            n += 1
            time.sleep(0.002)
        return n


def test_spin_seconds_reads_the_environment() -> None:
    assert spin_seconds({}) == SPIN_US / 1e6
    assert spin_seconds({"MONARCH_SPIN_US": ""}) == SPIN_US / 1e6
    assert spin_seconds({"MONARCH_SPIN_US": "0"}) == 0.0
    assert spin_seconds({"MONARCH_SPIN_US": " 250 "}) == pytest.approx(250e-6)
    for bad in ("abc", "-1", "1e9", "nan"):
        with pytest.raises(ValueError, match="MONARCH_SPIN_US must be a number of "
                                             "microseconds from 0 to 10000"):
            spin_seconds({"MONARCH_SPIN_US": bad})


def test_a_bad_spin_setting_fails_before_any_worker_starts(monkeypatch) -> None:
    monkeypatch.setenv("MONARCH_SPIN_US", "fast")
    with pytest.raises(ValueError, match="not 'fast'"):
        spawn_procs(1)
    assert not worker_pids(os.getpid())


def _count_spins(ctl, monkeypatch) -> list[tuple[float, int]]:
    """Record each spin: its length and how many local ranks were busy."""
    spins: list[tuple[float, int]] = []
    real = ctl.engine.spin

    def spin(seconds: float) -> bool:
        busy = sum(1 for r in ctl.local_ranks if ctl.ranks[r].state == "busy")
        spins.append((seconds, busy))
        return real(seconds)

    monkeypatch.setattr(ctl.engine, "spin", spin)
    return spins


@pytest.fixture
def sleeper():
    pm = spawn_procs(1)
    try:
        yield pm, pm.spawn("sleeper", Sleeper).slice(procs=0)
    finally:
        pm.stop()
        wait_for(lambda: not worker_pids(os.getpid()), 10, what="no worker processes left")


def test_a_long_wait_stops_spinning(sleeper, monkeypatch) -> None:
    pm, one = sleeper
    ctl = pm.controller
    assert ctl.spin_s == SPIN_US / 1e6
    one.noop.call_one().get(timeout=30)
    spins = _count_spins(ctl, monkeypatch)
    t0, wall0 = time.thread_time(), time.monotonic()
    assert one.nap.call_one(1.0).get(timeout=30) == 1.0
    cpu, wall = time.thread_time() - t0, time.monotonic() - wall0
    # about 20 steps of 50 ms went by; only the wait after the send and after a
    # heartbeat or telemetry message spun, and none after MAX_MISSES misses
    assert 1 <= len(spins) <= MAX_MISSES, spins
    assert all(s <= ctl.spin_s for s, _ in spins)
    assert cpu < 0.2 * wall, f"waiting {wall:.2f} s for a reply cost {cpu:.3f} s of CPU"


def test_output_read_from_pipes_does_not_spin(sleeper, monkeypatch) -> None:
    """A rank's printed lines come through its pipe, never as the reply: no spin."""
    pm, one = sleeper
    spins = _count_spins(pm.controller, monkeypatch)
    lines = one.chatter.call_one(0.5).get(timeout=30)
    assert lines > 50
    assert len(spins) <= MAX_MISSES, f"{len(spins)} spins for {lines} lines of output"


def test_the_spin_yields_between_looks(sleeper, monkeypatch) -> None:
    """Between two looks at the ROUTER the spinning caller gives its core away
    (a thread it woke may wait behind it)."""
    pm, one = sleeper
    ctl = pm.controller
    monkeypatch.setattr(ctl.io, "cores", 8)  # (whatever this machine has)
    looks: list[int] = []
    yields: list[int] = []
    real_look, real_yield = engine_mod.has_input, engine_mod._yield

    def look(sock) -> bool:
        looks.append(threading.get_ident())
        return real_look(sock)

    def counted() -> None:
        yields.append(threading.get_ident())
        real_yield()

    monkeypatch.setattr(engine_mod, "has_input", look)
    monkeypatch.setattr(engine_mod, "_yield", counted)
    spins = _count_spins(ctl, monkeypatch)
    ctl.spin_s = 0.002  # a fruitless 2 ms spin: the reply takes 50 ms
    assert one.nap.call_one(0.05).get(timeout=30) == 0.05
    assert spins and yields, "the spin never yielded"
    # a yield between each two looks of a spin: one look more than yields per spin
    # (a spin cut short by a contended core, below, ends with a look too)
    assert len(looks) - len(yields) == len(spins), (len(looks), len(yields), len(spins))
    assert set(yields) == {threading.get_ident()}  # (the caller led and spun)


def test_a_yield_that_loses_the_core_turns_the_spin_off(sleeper, monkeypatch) -> None:
    """A yield that kept the core away for CONTENDED_S (another task runnable on
    the caller's core: each yield could cost its whole time slice) ends the
    spin, and no wait spins for CONTENDED_OFF_S."""
    pm, one = sleeper
    ctl = pm.controller
    monkeypatch.setattr(ctl.io, "cores", 8)
    monkeypatch.setattr(engine_mod, "_yield",
                        lambda: time.sleep(engine_mod.CONTENDED_S * 2))
    spins = _count_spins(ctl, monkeypatch)
    ctl.spin_s = 0.05
    t0 = time.monotonic()
    assert one.nap.call_one(0.2).get(timeout=30) == 0.2
    assert len(spins) == 1, spins
    assert ctl.engine.spin_off_until >= t0 + engine_mod.CONTENDED_OFF_S
    spins.clear()
    for _ in range(20):
        one.noop.call_one().get(timeout=30)
    if time.monotonic() < ctl.engine.spin_off_until:
        assert not spins, f"{len(spins)} spins while the spin was off"
    ctl.engine.spin_off_until = 0.0  # the cool-down over: spins again
    for _ in range(20):
        one.noop.call_one().get(timeout=30)
    assert spins, "no spin after the cool-down"


def test_spin_off_still_answers(sleeper, monkeypatch) -> None:
    pm, one = sleeper
    ctl = pm.controller
    ctl.spin_s = 0.0
    monkeypatch.setattr(ctl.engine, "spin", lambda s: pytest.fail("spun with spin_s = 0"))
    assert [one.noop.call_one().get(timeout=30) for _ in range(50)] == [None] * 50
    assert one.nap.call_one(0.01).get(timeout=30) == 0.01


def test_no_spin_on_one_core(sleeper, monkeypatch) -> None:
    """On one core (the busy rank needs it) the caller sleeps at once."""
    pm, one = sleeper
    ctl = pm.controller
    spins = _count_spins(ctl, monkeypatch)
    monkeypatch.setattr(ctl.io, "cores", 8)  # (whatever this machine has)
    for _ in range(20):
        one.noop.call_one().get(timeout=30)
    # (a call whose reply the I/O thread read first needs no spin: most do spin)
    assert spins, "no call spun on an idle machine"
    spins.clear()
    monkeypatch.setattr(ctl.io, "cores", 1)
    assert [one.noop.call_one().get(timeout=30) for _ in range(20)] == [None] * 20
    assert not spins


def test_no_spin_while_busy_ranks_outnumber_the_cores(monkeypatch) -> None:
    # (this test is about the busy-ranks rule: a yield kept long by a loaded machine
    # must not turn the spin off for a second, the contended-core rule, meanwhile)
    monkeypatch.setattr(engine_mod, "CONTENDED_S", 10.0)
    pm = spawn_procs(3)
    try:
        ctl = pm.controller
        mesh = pm.spawn("sleepers", Sleeper)
        spins = _count_spins(ctl, monkeypatch)
        monkeypatch.setattr(ctl.io, "cores", 2)  # 3 busy ranks, 2 cores: sleep at once
        for _ in range(10):
            mesh.noop.call().get(timeout=30)
        # (once a rank answered, 2 busy ranks on 2 cores may spin)
        assert all(busy <= 2 for _, busy in spins), spins
        spins.clear()
        monkeypatch.setattr(ctl.io, "cores", 3)
        for _ in range(10):
            mesh.noop.call().get(timeout=30)
        assert any(busy == 3 for _, busy in spins), spins
    finally:
        pm.stop()
        wait_for(lambda: not worker_pids(os.getpid()), 10, what="no worker processes left")
