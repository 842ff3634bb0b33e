"""Workers run under SCHED_BATCH unless MONARCH_SCHED_BATCH=0 (monarch_kernel.sched)."""

from __future__ import annotations

import os
import subprocess
import sys

import cloudpickle
import pytest

from monarch_kernel import Actor, endpoint, spawn_procs
from monarch_kernel.switches import sched_batch_enabled

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers need not import it

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux only")


class Policy(Actor):
    @endpoint
    def threads(self) -> list[int]:
        """The policy of each thread of this worker, this one included."""
        me = os.getpid()
        return [os.sched_getscheduler(int(tid)) for tid in os.listdir(f"/proc/{me}/task")]

    @endpoint
    def child(self) -> int:
        """The policy a process this worker starts runs under."""
        out = subprocess.run([sys.executable, "-c", "import os; print(os.sched_getscheduler(0))"],
                             capture_output=True, text=True, timeout=60, check=True)
        return int(out.stdout)


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
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the controller is left as it was


def test_zero_leaves_workers_ordinary_and_a_bad_value_is_refused_at_spawn(monkeypatch) -> None:
    monkeypatch.setenv("MONARCH_SCHED_BATCH", "0")
    procs = spawn_procs(1, telemetry_interval=0)
    try:
        threads, children = _policies(procs)
    finally:
        procs.stop()
    assert set(threads[0]) == {os.SCHED_OTHER}
    assert children == [os.SCHED_OTHER]
    monkeypatch.setenv("MONARCH_SCHED_BATCH", "yes")
    with pytest.raises(ValueError, match="MONARCH_SCHED_BATCH must be 0"):
        spawn_procs(1)
