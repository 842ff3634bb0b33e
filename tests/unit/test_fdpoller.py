"""transport.FdPoller: ZeroMQ sockets (by ZMQ_FD, edge-triggered) and plain fds
in one epoll/poll wait, with real sockets and pipes; no input is missed."""

from __future__ import annotations

import os
import threading
import time

import pytest
import zmq

from monarch_kernel.transport.sockets import FdPoller, drain, has_input, send_frames


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.term()


@pytest.fixture
def push_pull(ctx):
    pull = ctx.socket(zmq.PULL)
    pull.linger = 0
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push = ctx.socket(zmq.PUSH)
    push.linger = 0
    push.connect(f"tcp://127.0.0.1:{port}")
    yield push, pull
    push.close(0)
    pull.close(0)


def _wait(poller, timeout_s):
    t0 = time.monotonic()
    ready = dict(poller.poll(int(timeout_s * 1000)))
    return ready, time.monotonic() - t0


def test_socket_and_fd_together(push_pull):
    push, pull = push_pull
    r, w = os.pipe()
    poller = FdPoller()
    try:
        poller.register(pull, zmq.POLLIN)
        poller.register(r, zmq.POLLIN)
        ready, _ = _wait(poller, 0.05)  # (the fd may fire for the connection itself)
        assert r not in ready and list(drain(pull)) == []
        push.send(b"hello")
        ready, took = _wait(poller, 5)
        assert pull in ready and took < 4
        assert [f[0] for f in drain(pull, small=1)] == [b"hello"]
        os.write(w, b"x")
        ready, _ = _wait(poller, 5)
        assert r in ready and pull not in ready
        os.read(r, 1)
        # (the socket reported last time has its events asked once more: nothing now)
        ready, took = _wait(poller, 0.1)
        assert ready == {} and took >= 0.05
    finally:
        poller.close()
        os.close(r)
        os.close(w)


def test_input_taken_by_an_events_check_is_not_missed(push_pull):
    """Asking ZMQ_EVENTS takes the fd's signal: a socket marked touched is asked
    again before the wait, so a waiting message is reported at once."""
    push, pull = push_pull
    poller = FdPoller()
    try:
        poller.register(pull, zmq.POLLIN)
        for _ in dict(poller.poll(0)):  # (the fd may fire for the connection itself)
            assert list(drain(pull)) == []
        push.send(b"one")
        deadline = time.monotonic() + 5
        while not has_input(pull):  # this takes the signal of the fd
            assert time.monotonic() < deadline
            time.sleep(0.001)
        poller.touched(pull)
        ready, took = _wait(poller, 5)
        assert pull in ready and took < 1
        assert [f[0] for f in drain(pull, small=1)] == [b"one"]
    finally:
        poller.close()


class _RaisesOnce:
    """A poll object whose next poll() raises KeyboardInterrupt (a Ctrl-C that
    lands inside FdPoller.poll, after it asked a socket's events)."""

    def __init__(self, inner):
        self.inner, self.armed = inner, True

    def poll(self, *args):
        if self.armed:
            self.armed = False
            raise KeyboardInterrupt
        return self.inner.poll(*args)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_an_interrupted_poll_does_not_lose_a_socket(push_pull):
    """Asking ZMQ_EVENTS took the fd's signal; a KeyboardInterrupt before the poll
    returned must leave the socket to be asked again, not forgotten."""
    push, pull = push_pull
    poller = FdPoller()
    try:
        poller.register(pull, zmq.POLLIN)
        push.send(b"one")
        deadline = time.monotonic() + 5
        while not has_input(pull):
            assert time.monotonic() < deadline
            time.sleep(0.001)
        poller.touched(pull)
        raising = _RaisesOnce(poller._poll)
        poller._poll = raising
        if poller._epoll is not None:
            poller._epoll = raising
        with pytest.raises(KeyboardInterrupt):
            poller.poll(1000)
        ready, took = _wait(poller, 2)
        assert pull in ready and took < 1
        assert [f[0] for f in drain(pull, small=1)] == [b"one"]
        push.send(b"two")  # and the fd signals the next message
        ready, took = _wait(poller, 5)
        assert pull in ready and took < 4
        assert [f[0] for f in drain(pull, small=1)] == [b"two"]
    finally:
        poller._poll = getattr(poller._poll, "inner", poller._poll)
        if poller._epoll is not None:
            poller._epoll = poller._poll
        poller.close()


def test_sends_on_a_polled_router_do_not_hide_replies(ctx):
    """The owner sends on a ROUTER it polls (a send may take the signal of an
    input); replies that came meanwhile are all read, none waits for a timeout."""
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer = ctx.socket(zmq.DEALER)
    dealer.linger = 0
    dealer.identity = b"d"
    dealer.connect(f"tcp://127.0.0.1:{port}")
    stop = threading.Event()

    def echo():
        while not stop.is_set():
            if dealer.poll(50):
                dealer.send(dealer.recv())

    t = threading.Thread(target=echo, daemon=True)
    t.start()
    poller = FdPoller()
    try:
        poller.register(router, zmq.POLLIN)
        deadline = time.monotonic() + 10
        got = 0
        sent = 0
        slow = 0
        dealer_known = False
        while got < 500:
            assert time.monotonic() < deadline, f"{got} of {sent} replies after 10 s"
            if not dealer_known:  # (until the dealer's connection is attached)
                dealer.send(b"hi")
            if sent < 500 and dealer_known:
                for _ in range(3):
                    if sent < 500:
                        poller.touched(router)
                        send_frames(router, [b"d", str(sent).encode()])
                        sent += 1
            t0 = time.monotonic()
            ready = dict(poller.poll(1000))
            if time.monotonic() - t0 > 0.5:
                slow += 1
            if router in ready:
                for frames in drain(router):
                    if frames[1].bytes == b"hi":
                        dealer_known = True
                    else:
                        got += 1
        assert slow == 0
    finally:
        stop.set()
        t.join(5)
        poller.close()
        dealer.close(0)
        router.close(0)


def test_unregister_after_close_and_register_twice():
    r, w = os.pipe()
    poller = FdPoller()
    try:
        poller.register(r, zmq.POLLIN)
        poller.register(r, zmq.POLLIN)  # (twice: the second is a no-op)
        os.write(w, b"x")
        assert r in dict(poller.poll(1000))
        os.close(r)
        poller.unregister(r)  # closed already: no error
        assert dict(poller.poll(0)) == {}
        with pytest.raises(ValueError):
            poller.register(w, zmq.POLLOUT)
    finally:
        poller.close()
        os.close(w)
