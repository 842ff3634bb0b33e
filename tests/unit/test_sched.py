"""Workers run under SCHED_BATCH unless MONARCH_SCHED_BATCH=0 (monarch_kernel.worker.sched)."""

from __future__ import annotations

import os
import subprocess
import sys

import cloudpickle
import pytest

from monarch_kernel import Actor, endpoint, spawn_procs
from monarch_kernel.util.switches import sched_batch_enabled

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers need not import it

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux only")


class Policy(Actor):
    @endpoint
    def threads(self) -> list[int]:
        """The policy of each thread of this worker, this one included."""
        me, out = os.getpid(), []
        for tid in os.listdir(f"/proc/{me}/task"):
            try:
                out.append(os.sched_getscheduler(int(tid)))
            except ProcessLookupError:  # (a thread that ended meanwhile)
                pass
        return out

    @endpoint
    def child(self) -> int:
        """The policy a process this worker starts runs under."""
        out = subprocess.run([sys.executable, "-c", "import os; print(os.sched_getscheduler(0))"],
                             capture_output=True, text=True, timeout=60, check=True)
        return int(out.stdout)


#: the policy pytest runs under (workers inherit it where they do not change it)
_MINE = os.sched_getscheduler(0) if hasattr(os, "sched_getscheduler") else None
_ORDINARY = pytest.mark.skipif(_MINE != getattr(os, "SCHED_OTHER", None),
                               reason="pytest is not an ordinary process here")


def _policies(procs) -> tuple[list[list[int]], list[int]]:
    actors = procs.spawn("policy", Policy)
    return (list(actors.threads.call().get(timeout=60)),
            list(actors.child.call().get(timeout=120)))


def test_the_switch_reads_0_or_1() -> None:
    assert sched_batch_enabled({}) is True
    assert sched_batch_enabled({"MONARCH_SCHED_BATCH": " 1 "}) is True
    assert sched_batch_enabled({"MONARCH_SCHED_BATCH": "0"}) is False
    for bad in ("off", "batch", "2"):
        with pytest.raises(ValueError, match="MONARCH_SCHED_BATCH must be 0 .* or 1"):
            sched_batch_enabled({"MONARCH_SCHED_BATCH": bad})


@_ORDINARY
def test_every_thread_of_a_worker_and_its_children_run_under_sched_batch() -> None:
    procs = spawn_procs(2, telemetry_interval=1.0)
    try:
        threads, children = _policies(procs)
    finally:
        procs.stop()
    assert len(threads) == 2
    for rank in threads:  # the I/O, actor, telemetry and ZeroMQ threads among them
        assert len(rank) >= 4
        assert set(rank) == {os.SCHED_BATCH}, rank
    assert children == [os.SCHED_BATCH] * 2
    assert os.sched_getscheduler(0) == _MINE  # the controller is left as it was


def test_zero_leaves_workers_ordinary_and_a_bad_value_is_refused_at_spawn(monkeypatch) -> None:
    monkeypatch.setenv("MONARCH_SCHED_BATCH", "0")
    procs = spawn_procs(1, telemetry_interval=0)
    try:
        threads, children = _policies(procs)
    finally:
        procs.stop()
    assert set(threads[0]) == {_MINE}
    assert children == [_MINE]
    monkeypatch.setenv("MONARCH_SCHED_BATCH", "yes")
    with pytest.raises(ValueError, match="MONARCH_SCHED_BATCH must be 0"):
        spawn_procs(1)


def _batch_scheduling_in_a_child(setup: str, env: dict[str, str] | None = None
                                 ) -> tuple[str, str]:
    """Run ``setup`` then :func:`batch_scheduling` in a fresh interpreter: its
    return value and the policy after it (names), and what it logged."""
    code = (
        "import logging, os\n"
        f"{setup}\n"
        "from monarch_kernel.worker.sched import batch_scheduling\n"
        "names = {getattr(os, n): n for n in ('SCHED_OTHER', 'SCHED_BATCH', 'SCHED_IDLE')}\n"
        "print(batch_scheduling(), names[os.sched_getscheduler(0)])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, env={**os.environ, **(env or {})}, check=True)
    return out.stdout.strip(), out.stderr


@_ORDINARY
def test_only_an_ordinary_process_is_changed_and_a_refusal_is_said() -> None:
    got, _ = _batch_scheduling_in_a_child("")
    assert got == "True SCHED_BATCH"
    got, _ = _batch_scheduling_in_a_child("", {"MONARCH_SCHED_BATCH": "0"})
    assert got == "False SCHED_OTHER"
    # a policy chosen on purpose (chrt -i, systemd's CPUSchedulingPolicy=idle) is kept
    got, _ = _batch_scheduling_in_a_child(
        "os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))")
    assert got == "False SCHED_IDLE"
    # a system that refuses the call (a seccomp profile): a warning, an ordinary process
    got, err = _batch_scheduling_in_a_child(
        "def no(*a): raise PermissionError(1, 'Operation not permitted')\n"
        "os.sched_setscheduler = no")
    assert got == "False SCHED_OTHER"
    assert "cannot use SCHED_BATCH" in err and "Operation not permitted" in err, err
