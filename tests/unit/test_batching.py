"""Request batching (monarch_kernel/batching.py): pipelined calls to a rank leave
in ``calls`` messages, in order, never later than HOLD_S, never lost."""

from __future__ import annotations

import asyncio
import contextlib
import dis
import io
import os
import signal
import sys
import time

import cloudpickle
import pytest

from monarch_kernel import Actor, MeshFailure, endpoint
from monarch_kernel.controller import batching as batching
from monarch_kernel.controller.controller import Controller
from monarch_kernel.controller.io import ControllerIO
from monarch_kernel.errors import TransportError
from monarch_kernel.mesh.procmesh import spawn_procs
from monarch_kernel.testing.kernel import wait_for, worker_pids

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


def _interrupt_each_line(funcs: list, action) -> int:
    """Run ``action(i)`` once per line of ``funcs``, a real SIGINT raised in this (the
    main) thread as line i starts (where ``action`` reaches it); returns how many
    runs a KeyboardInterrupt ended."""
    targets = [(f.__code__, line) for f in funcs
               for _, line in dis.findlinestarts(f.__code__) if line is not None]
    interrupted = 0
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        for i, (code, line) in enumerate(targets):
            fired: list = []

            def local(frame, event, arg, line=line, fired=fired):
                if event == "line" and frame.f_lineno == line and not fired:
                    fired.append(True)
                    signal.raise_signal(signal.SIGINT)
                return local

            def tracer(frame, event, arg, code=code, local=local):
                return local if frame.f_code is code else None

            sys.settrace(tracer)
            try:
                action(i)
            except KeyboardInterrupt:
                interrupted += 1
            finally:
                sys.settrace(None)
    finally:
        signal.signal(signal.SIGINT, previous)
    return interrupted


@pytest.mark.skipif(sys.gettrace() is not None, reason="needs sys.settrace")
def test_ctrl_c_while_calling_never_leaves_a_request_unsent(procs, logs, monkeypatch):
    """A KeyboardInterrupt at any line of sending a call (held or not) either stops it
    before it counts as sent or lets it leave: no request waits forever for a rank
    that never got it (which would keep the rank 'busy' and swallow its output)."""
    one = logs.slice(procs=0)
    ctl = procs.controller
    sent: dict[int, object] = {}

    def call(i: int) -> None:
        sent[i] = one.record.call_one(i)
        if i % 2:  # (a wait sends what is held)
            sent[i].get(timeout=30)

    funcs = [Controller.request, Controller._send, Controller._send_after_held,
             ControllerIO.wait_for, batching.Batcher.held_request,
             batching.Batcher.send_batch, batching.Batcher.flush]
    monkeypatch.setattr(batching, "MIN_PENDING", 0)  # every call is held
    held = _interrupt_each_line(funcs, call)
    monkeypatch.setattr(batching, "MIN_PENDING", 10**9)  # no call is held
    direct = _interrupt_each_line(funcs, lambda i: call(10_000 + i))
    monkeypatch.undo()
    assert held > 5 and direct > 5, (held, direct)
    for f in sent.values():
        f.get(timeout=30)
    history = one.history.call_one().get(timeout=30)
    assert history == sorted(history) and set(sent) <= set(history)
    wait_for(lambda: not [q for q in list(ctl.pending.values()) if 0 in q.ranks], 10,
             what="no request to rank 0 left unanswered")
    assert ctl.ranks[0].state == "idle"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        procs.collect(procs.run("print('still heard', rank)", ranks=[0]), timeout=30)
    assert "[0] still heard 0" in out.getvalue()


def test_a_callback_of_a_failed_batch_does_not_overtake_held_calls(monkeypatch):
    """A held call that cannot be sent fails during a flush, and its done-callbacks run
    then; what a callback sends to another rank leaves after the calls held for that
    rank before it, not ahead of them."""
    pm = spawn_procs(2)
    try:
        ctl = pm.controller
        logs = pm.spawn("log", Log)
        r0, r1 = logs.slice(procs=0), logs.slice(procs=1)
        r0.record.call_one("warm").get(timeout=30)
        r1.record.call_one("warm").get(timeout=30)
        # rank 0 dies unseen (its exit is not polled): sending to it fails instead
        monkeypatch.setattr(ctl, "poll_exits", None)
        monkeypatch.setattr(ctl.ranks[0], "hello_at", 0.0)  # (no retry of the send)
        os.kill(ctl.ranks[0].pid, signal.SIGKILL)
        beat = ctl.codec.encode("heartbeat")

        def connection_gone() -> bool:
            lane = ctl.lane_of.get(0)  # (a local rank's lane, monarch_kernel.transport.lane)
            if lane is None:
                return not ctl.send_down(ctl.ranks[0].identity, beat, retry=0)
            try:
                lane.send(beat)
            except TransportError:
                return True
            return False

        wait_for(connection_gone, 10, what="rank 0's connection gone")
        monkeypatch.setattr(batching, "MIN_PENDING", 0)  # every call is held ...
        monkeypatch.setattr(batching, "HOLD_S", 60.0)  # ... until someone waits
        doomed = r0.record.call_one("lost")
        doomed.add_done_callback(lambda f: r1.record.broadcast("after"))
        before = r1.record.call_one("before")  # issued before the callback runs
        with pytest.raises(MeshFailure, match="rank 0"):
            doomed.get(timeout=30)
        before.get(timeout=30)
        monkeypatch.undo()
        assert r1.history.call_one().get(timeout=30) == ["warm", "before", "after"]
        wait_for(lambda: ctl.ranks[0].state == "dead", 10, what="rank 0 seen dead")
    finally:
        pm.stop()


def test_a_batch_rejects_calls_to_a_missing_actor_one_by_one(procs, logs, monkeypatch):
    """Each call of a batch is handled as if it came alone: one to an actor the rank
    does not have fails (naming it), the others run, in order; a malformed batch is
    dropped and the rank goes on."""
    from monarch_kernel.actor.host import Packed

    ctl = procs.controller
    one = logs.slice(procs=0)
    monkeypatch.setattr(batching, "MIN_PENDING", 0)  # every call is held
    sent = ctl.batches.calls_batched
    reqs = [ctl.request([0], "call", {"a": logs.name if i % 3 else "nobody", "m": "record",
                                      "u": logs._record.uid, "p": Packed.pack(((i,), {}))})
            for i in range(12)]
    for q in reqs:
        assert q.wait(30)
    assert ctl.batches.calls_batched - sent >= 2, "the calls should have left in batches"
    for i, q in enumerate(reqs):
        status, value = q.replies[0]
        if i % 3:
            assert status == "ok"
        else:
            assert status == "error" and "no actor named 'nobody'" in value["message"]
    for bad in (None, 5, [("x",)], [("x", 5)], [("x", {"m": "record"})]):
        ctl._send([0], ctl.codec.encode("calls", bad))
    monkeypatch.undo()
    assert one.history.call_one().get(timeout=30) == [i for i in range(12) if i % 3]


def test_a_rank_that_dies_while_a_request_is_made_fails_it():
    # the rank dies between request()'s first look at it and the registration:
    # the request must fail at once, not wait for ever on a rank marked busy over dead
    pm = spawn_procs(1)
    try:
        ctl = pm.controller
        real = ctl.codec.encode

        def encode_after_death(*args, **kwargs):
            ctl.codec.encode = real
            os.kill(ctl.ranks[0].pid, signal.SIGKILL)
            wait_for(lambda: ctl.ranks[0].state == "dead", 10, what="rank 0 marked dead")
            return real(*args, **kwargs)

        ctl.codec.encode = encode_after_death
        with pytest.raises(MeshFailure, match="rank 0"):
            req = ctl.request([0], "execute", {"code": "1", "filename": "<t>"})
            req.wait(10)  # (before the fix: registered, never answered)
            raise AssertionError("the request to a dead rank neither failed nor finished")
        assert ctl.ranks[0].state == "dead"
    finally:
        pm.stop()


def test_batching_switched_off_sends_every_call_alone(monkeypatch):
    """MONARCH_BATCHING=0: no call waits for a batch, and the calls still run in order."""
    monkeypatch.setenv("MONARCH_BATCHING", "0")
    pm = spawn_procs(1)
    try:
        one = pm.spawn("log", Log).slice(procs=0)
        assert pm.controller.batching is False
        futures = [one.record.call_one(i) for i in range(300)]
        assert [f.get(timeout=30) for f in futures] == [None] * 300
        assert one.history.call_one().get(timeout=30) == list(range(300))
        assert pm.controller.batches.calls_batched == 0
    finally:
        pm.stop()
    monkeypatch.setenv("MONARCH_BATCHING", "2")
    with pytest.raises(ValueError, match="MONARCH_BATCHING"):
        spawn_procs(1)
