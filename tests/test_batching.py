"""Request batching (monarch_kernel/batching.py): pipelined calls to a rank leave
in ``calls`` messages, in order, never later than HOLD_S, never lost."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time

import cloudpickle
import pytest

from monarch_kernel import Actor, MeshFailure, endpoint
from monarch_kernel.procmesh import spawn_procs
from monarch_kernel.testing import wait_for, worker_pids

cloudpickle.register_pickle_by_value(sys.modules[__name__])


class Log(Actor):
    def __init__(self) -> None:
        self.log: list = []

    @endpoint
    def record(self, item: object) -> None:
        self.log.append(item)

    @endpoint
    def history(self) -> list:
        return list(self.log)

    @endpoint
    def block(self, seconds: float) -> None:
        time.sleep(seconds)


@pytest.fixture(scope="module")
def procs():
    pm = spawn_procs(2)
    try:
        yield pm
    finally:
        pm.stop()
        wait_for(lambda: not worker_pids(os.getpid()), 10, what="workers gone")


_names = iter(range(10**6))


@pytest.fixture
def logs(procs):
    m = procs.spawn(f"log{next(_names)}", Log)
    try:
        yield m
    finally:
        m.stop()


def test_pipelined_calls_leave_in_batches_and_run_in_order(procs, logs):
    one = logs.slice(procs=0)
    b = procs.controller.batches
    before = b.calls_batched
    futures = [one.record.call_one(i) for i in range(1000)]
    assert [f.get(timeout=30) for f in futures] == [None] * 1000
    assert one.history.call_one().get(timeout=30) == list(range(1000))
    assert b.calls_batched - before > 500, "pipelined calls should mostly travel in batches"
    assert not b  # nothing left held


def test_other_messages_to_the_rank_keep_their_place(procs, logs):
    one = logs.slice(procs=0)
    futures = []
    for i in range(300):
        futures.append(one.record.call_one(i))
        if i % 50 == 25:  # a one-way call and a call to every rank, amid held calls
            one.record.broadcast(f"b{i}")
            futures.append(logs.record.call(f"all{i}"))
    for f in futures:
        f.get(timeout=30)
    expected = []
    for i in range(300):
        expected.append(i)
        if i % 50 == 25:
            expected += [f"b{i}", f"all{i}"]
    assert one.history.call_one().get(timeout=30) == expected
    assert logs.slice(procs=1).history.call_one().get(timeout=30) == [
        f"all{i}" for i in range(300) if i % 50 == 25]


def test_held_calls_leave_without_anyone_waiting(procs, logs):
    one = logs.slice(procs=0)
    futures = [one.record.call_one(i) for i in range(40)]  # the later ones are held
    # nobody calls get(): the controller's I/O thread sends what is held
    wait_for(lambda: all(f.done() for f in futures), 10, what="held calls answered")
    assert one.history.call_one().get(timeout=30) == list(range(40))


def test_await_sends_held_calls(procs, logs):
    one = logs.slice(procs=0)

    async def main() -> list:
        futures = [one.record.call_one(i) for i in range(40)]
        return [await f for f in futures]

    assert asyncio.run(asyncio.wait_for(main(), 30)) == [None] * 40


def test_held_calls_to_a_rank_that_dies_fail():
    pm = spawn_procs(1)
    try:
        log = pm.spawn("log", Log)
        log.record.call_one(0).get(timeout=30)
        busy = log.block.call_one(30.0)  # the rank is busy: the calls below queue up
        futures = [log.record.call_one(i) for i in range(40)]
        os.kill(pm.controller.ranks[0].pid, signal.SIGKILL)
        for f in [busy, *futures]:
            with pytest.raises(MeshFailure, match="rank 0"):
                f.get(timeout=30)
    finally:
        pm.stop()
