"""The bounded spin of a caller waiting for its reply (controller_io).

A waiting caller looks for its reply for up to ``spin_s`` before it sleeps
in poll(2), and again only after a step that read something: a long call
must cost next to no CPU while it is waited for.
"""

from __future__ import annotations

import os
import sys
import time

import cloudpickle
import pytest

from monarch_kernel import Actor, endpoint
from monarch_kernel.controller_io import SPIN_US, spin_seconds
from monarch_kernel.procmesh import spawn_procs
from monarch_kernel.testing import wait_for, worker_pids

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers need not import it


class Sleeper(Actor):
    @endpoint
    def nap(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    @endpoint
    def noop(self) -> None:
        return None


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


@pytest.fixture
def sleeper():
    pm = spawn_procs(1)
    try:
        yield pm, pm.spawn("sleeper", Sleeper).slice(procs=0)
    finally:
        pm.stop()
        wait_for(lambda: not worker_pids(os.getpid()), 10, what="no worker processes left")


def test_a_long_wait_spins_once_then_sleeps(sleeper) -> None:
    pm, one = sleeper
    ctl = pm.controller
    assert ctl.spin_s == SPIN_US / 1e6
    one.noop.call_one().get(timeout=30)
    spins = []
    real = ctl._spin
    ctl._spin = lambda s: (spins.append(s), real(s))[1]  # count them, still spin
    try:
        t0 = time.thread_time()
        assert one.nap.call_one(1.0).get(timeout=30) == 1.0
        cpu = time.thread_time() - t0
    finally:
        del ctl._spin
    # about 20 steps of 50 ms went by (in 20 waits of 50 ms: the future pumps
    # output between them); only the first, after the send, spun
    assert 1 <= len(spins) <= 3, spins
    assert all(s <= ctl.spin_s for s in spins)
    assert cpu < 0.2, f"waiting 1 s for a reply cost {cpu:.3f} s of this thread's CPU"


def test_spin_off_still_answers(sleeper, monkeypatch) -> None:
    pm, one = sleeper
    ctl = pm.controller
    ctl.spin_s = 0.0
    monkeypatch.setattr(ctl, "_spin", lambda s: pytest.fail("spun with spin_s = 0"))
    assert [one.noop.call_one().get(timeout=30) for _ in range(50)] == [None] * 50
    assert one.nap.call_one(0.01).get(timeout=30) == 0.01


def test_no_spin_without_a_core_to_spare(sleeper, monkeypatch) -> None:
    """On one core (the busy rank needs it) the caller sleeps at once."""
    pm, one = sleeper
    ctl = pm.controller
    spins = []
    real = ctl._spin
    monkeypatch.setattr(ctl, "_spin", lambda s: (spins.append(s), real(s))[1])
    monkeypatch.setattr(ctl, "_cores", 8)  # (whatever this machine has)
    one.noop.call_one().get(timeout=30)
    assert spins, "a call on an idle machine should spin"
    spins.clear()
    monkeypatch.setattr(ctl, "_cores", 1)  # the one busy rank takes the only core
    assert [one.noop.call_one().get(timeout=30) for _ in range(20)] == [None] * 20
    assert not spins


def test_no_spin_when_busy_ranks_outnumber_the_cores(monkeypatch) -> None:
    pm = spawn_procs(3)
    try:
        ctl = pm.controller
        mesh = pm.spawn("sleepers", Sleeper)
        spins = []
        real = ctl._spin
        monkeypatch.setattr(ctl, "_spin", lambda s: (spins.append(s), real(s))[1])
        monkeypatch.setattr(ctl, "_cores", 2)  # 3 busy ranks, 2 cores: sleep at once
        for _ in range(10):
            mesh.noop.call().get(timeout=30)
        assert not spins
        monkeypatch.setattr(ctl, "_cores", 3)
        mesh.noop.call().get(timeout=30)
        assert spins
    finally:
        pm.stop()
        wait_for(lambda: not worker_pids(os.getpid()), 10, what="no worker processes left")
