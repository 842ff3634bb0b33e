"""The I/O engine alone (monarch_kernel.transport.engine), over real sockets:
sources and handlers, wake-ups, duties, the lead taken by a waiting thread,
the spin and its rules. Every wait has a timeout; nothing asserts a wall time."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import pytest
import zmq

from monarch_kernel.transport import engine as engine_mod
from monarch_kernel.transport.engine import Engine, EngineSettings, spin_seconds
from monarch_kernel.transport.sockets import drain

TIMEOUT = 10.0


class User:
    """A minimal EngineUser that records what the engine asked of it."""

    def __init__(self) -> None:
        self.turns = 0
        self.spin_ok = True
        self.failures: list[BaseException] = []
        self.closed = threading.Event()

    def on_turn(self) -> bool:
        self.turns += 1
        return False

    def may_spin(self) -> bool:
        return self.spin_ok

    def before_step(self) -> None:
        pass

    def on_failure(self, error: BaseException) -> None:
        self.failures.append(error)

    def on_close(self) -> None:
        self.closed.set()


def _until(cond: Any, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.001)


def _steps(e: Engine, n: int) -> None:
    """Wake the engine's leader ``n`` times, each time until it stepped."""
    for _ in range(n):
        stepped = e.stepped_at
        e.wake()
        _until(lambda stepped=stepped: e.stepped_at != stepped, "a step")


@pytest.fixture
def made():
    """Engines made by a test, stopped and joined at its end."""
    engines: list[tuple[Engine, threading.Event]] = []

    def make(**kw: Any) -> tuple[Engine, User]:
        user = User()
        stop = threading.Event()
        e = Engine(EngineSettings(name="test-engine", **kw), user, stop)
        engines.append((e, stop))
        return e, user

    yield make
    for e, stop in engines:
        stop.set()
        e.wake()
        e.join(TIMEOUT)
        assert not e.thread.is_alive()


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    yield a, b
    a.close()
    b.close()


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.term()


def test_spin_seconds() -> None:
    assert spin_seconds({}) == engine_mod.SPIN_US / 1e6
    assert spin_seconds({"MONARCH_SPIN_US": "0"}) == 0.0
    with pytest.raises(ValueError, match="MONARCH_SPIN_US"):
        spin_seconds({"MONARCH_SPIN_US": "-3"})


def test_fd_source_is_handled_by_the_io_thread(made, pair) -> None:
    e, _ = made()
    a, b = pair
    got: list[tuple[bytes, str]] = []
    e.add(a.fileno(), lambda fd: got.append((a.recv(100), threading.current_thread().name)))
    e.start()
    b.send(b"hi")
    _until(lambda: got, "the handler")
    assert got == [(b"hi", "test-engine")]


def test_source_added_from_another_thread_and_removed(made, pair) -> None:
    e, _ = made(idle_ms=10_000)  # (the I/O thread sleeps long: only a wake-up helps)
    e.start()
    a, b = pair
    got: list[bytes] = []
    e.add(a.fileno(), lambda fd: got.append(a.recv(100)))
    b.send(b"x")
    _until(lambda: got == [b"x"], "a source added while the leader sleeps")
    e.remove(a.fileno())  # (from the next step on: one goes by)
    _steps(e, 2)
    b.send(b"y")
    _steps(e, 2)
    assert got == [b"x"]


def test_zmq_source_and_order(made, ctx, pair) -> None:
    e, _ = made()
    pull = ctx.socket(zmq.PULL)
    pull.linger = 0
    pull.bind("inproc://engine-test")
    push = ctx.socket(zmq.PUSH)
    push.linger = 0
    push.connect("inproc://engine-test")
    a, b = pair
    order: list[str] = []
    e.add(pull, lambda s: order.extend("zmq" for _ in drain(s)), order=2)
    e.add(a.fileno(), lambda fd: order.append("fd") if a.recv(100) else None, order=1)
    try:
        push.send(b"m")
        b.send(b"f")
        time.sleep(0.01)  # (both ready before the first step)
        e.start()
        _until(lambda: len(order) == 2, "both sources")
        assert order == ["fd", "zmq"]
    finally:
        e.stop_event.set()
        e.wake()
        e.join(TIMEOUT)
        push.close(0)
        pull.close(0)


def test_duties_run(made) -> None:
    e, _ = made(idle_ms=10_000)
    runs: list[float] = []
    e.every(0.01, runs.append)  # (it bounds the poll: no wake-up needed)
    e.start()
    _until(lambda: len(runs) >= 3, "three runs of a duty")


def test_a_waiting_thread_leads_and_handles_its_reply(made, pair) -> None:
    e, _ = made(idle_ms=10_000)
    a, b = pair
    handled_by: list[int] = []
    done = threading.Event()

    def handler(fd: int) -> None:
        if a.recv(100):
            handled_by.append(threading.get_ident())
            done.set()

    e.add(a.fileno(), handler)
    e.start()
    threading.Timer(0.02, lambda: b.send(b"reply")).start()
    assert e.lead(done.is_set, time.monotonic() + TIMEOUT) is True
    assert handled_by == [threading.get_ident()]
    assert e.leader is None


def test_lead_times_out_and_is_interrupted(made) -> None:
    e, _ = made()
    e.start()
    never = threading.Event()
    assert e.lead(never.is_set, time.monotonic() + 0.01) is False
    assert e.lead(never.is_set, None, interrupted=lambda: True) is False
    assert e.lead(never.is_set, None, allowed=lambda: False) is None


def test_lead_refused_when_stopped(made) -> None:
    e, user = made()
    assert e.lead(lambda: False, time.monotonic() + 1) is None  # (not started)
    e.start()
    e.stop_event.set()
    e.wake()
    e.join(TIMEOUT)
    assert user.closed.is_set()
    assert e.lead(lambda: False, time.monotonic() + 1) is None
    assert e.wake() is False


def test_nested_lead(made) -> None:
    e, _ = made(nested=False)
    e.start()
    inner: list[Any] = []
    ev = threading.Event()

    def outer_done() -> bool:
        if not inner:
            inner.append(e.lead(lambda: True, time.monotonic() + 1))
        return True

    assert e.lead(outer_done, time.monotonic() + TIMEOUT) is True
    assert inner == [None]  # (leading already, nested off)
    e.settings.nested = True
    inner.clear()
    assert e.lead(outer_done, time.monotonic() + TIMEOUT) is True
    assert inner == [True]
    ev.set()


def test_step_errors_are_survived(made, pair) -> None:
    e, user = made()
    a, b = pair
    calls: list[bytes] = []

    def bad(fd: int) -> None:
        calls.append(a.recv(100))
        raise RuntimeError("boom")

    e.add(a.fileno(), bad)
    e.start()
    b.send(b"1")
    _until(lambda: len(calls) == 1, "the first message")
    b.send(b"2")
    _until(lambda: len(calls) == 2, "the second message")
    assert e.thread.is_alive() and not user.failures


def test_step_errors_end_the_thread_when_asked(made, pair) -> None:
    e, user = made(survive_step_errors=False)
    a, b = pair

    def bad(fd: int) -> None:
        a.recv(100)
        raise RuntimeError("boom")

    e.add(a.fileno(), bad)
    e.start()
    b.send(b"1")
    e.join(TIMEOUT)
    assert isinstance(user.failures[0], RuntimeError) and user.closed.is_set()


def test_the_spin_finds_input_and_follows_its_rules(made, pair, monkeypatch) -> None:
    e, user = made(spin_s=0.5, idle_ms=10_000)
    a, b = pair
    got: list[bytes] = []
    e.add(a.fileno(), lambda fd: got.append(a.recv(100)), spin=True)
    e.start()
    spins: list[bool] = []
    real = e.spin

    def counted(seconds: float) -> bool:
        spins.append(real(seconds))
        return spins[-1]

    monkeypatch.setattr(e, "spin", counted)
    e.expect_input()
    threading.Timer(0.005, lambda: b.send(b"r")).start()
    assert e.lead(lambda: bool(got), time.monotonic() + TIMEOUT) is True
    assert spins and spins[0] in (True, False)
    # no spin without expect_input, and none when the user says no core is free
    spins.clear()
    e.spin_s = 0.001
    assert e.lead(lambda: False, time.monotonic() + 0.02) is False
    assert len(spins) <= 1
    spins.clear()
    user.spin_ok = False
    e.expect_input()
    assert e.lead(lambda: False, time.monotonic() + 0.02) is False
    assert not spins
    # at most MAX_MISSES fruitless spins in a row
    user.spin_ok = True
    for _ in range(engine_mod.MAX_MISSES + 3):
        e._spin_next = True  # (as input on a spin source does)
        e.lead(lambda: False, time.monotonic() + 0.005)
    assert len(spins) <= engine_mod.MAX_MISSES


def test_a_contended_yield_turns_the_spin_off(made, pair, monkeypatch) -> None:
    e, _ = made(spin_s=0.05)
    a, _b = pair
    e.add(a.fileno(), lambda fd: a.recv(100), spin=True)
    e.start()
    monkeypatch.setattr(engine_mod, "_yield", lambda: time.sleep(engine_mod.CONTENDED_S * 2))
    assert e.spin(0.05) is False
    assert e.spin_contended == 1 and e.spin_off_until > time.monotonic()


def test_shared_fds_are_read_by_followers_only(made, pair) -> None:
    e, _ = made(follower_poller=True, max_gap_s=None, idle_ms=20)
    if e.follower_poller is None:
        pytest.skip("no EPOLLEXCLUSIVE here")
    a, b = pair
    readers: list[str] = []
    assert e.add(a.fileno(), lambda fd: readers.append(
        threading.current_thread().name) if a.recv(100) else None, shared=True)
    e.start()
    b.send(b"1")
    _steps(e, 3)  # (the I/O thread's poller does not watch it)
    assert readers == []
    assert e.lead(lambda: bool(readers), time.monotonic() + TIMEOUT) is True
    assert readers == [threading.current_thread().name]
    e.remove(a.fileno())  # (any thread, at once)
    b.send(b"2")
    assert e.lead(lambda: False, time.monotonic() + 0.05) is False
    assert len(readers) == 1


def test_a_source_closed_before_it_is_watched_is_dropped(made) -> None:
    import socket as socket_mod

    e, user = made(idle_ms=10_000)
    e.start()
    a, b = socket_mod.socketpair()
    fd = a.fileno()
    a.close()  # (before the leader's next step registers it)
    e.add(fd, lambda fd: None)
    b.close()
    _steps(e, 2)
    assert e.thread.is_alive() and not user.failures
