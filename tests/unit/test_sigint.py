"""DeferredSigint with a real SIGINT sent to this process (main thread)."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from monarch_kernel.util.sigint import DeferredSigint


def _sigint() -> None:
    os.kill(os.getpid(), signal.SIGINT)


def test_sigint_is_held_until_the_block_ends():
    reached = []
    with pytest.raises(KeyboardInterrupt), DeferredSigint() as d:
        _sigint()
        reached.append(d.hit is not None)
    assert reached == [True]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_nested_blocks_hold_it_until_the_outermost_ends():
    seen = []
    with pytest.raises(KeyboardInterrupt), DeferredSigint() as outer:
        with DeferredSigint() as inner:
            _sigint()
            seen.append(("inner", inner.hit is not None))
        seen.append(("outer", outer.hit is not None))  # not raised at the inner end
    assert seen == [("inner", True), ("outer", True)]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with DeferredSigint() as fresh:  # nothing left over from the blocks before
        assert fresh.hit is None


def test_a_nested_block_sees_only_what_came_during_it():
    seen = []
    with pytest.raises(KeyboardInterrupt), DeferredSigint() as outer:
        _sigint()
        with DeferredSigint() as inner:
            seen.append(inner.hit)  # the outer block's, from before: not this one's
            _sigint()
            seen.append(inner.hit is not None)
        seen.append(outer.hit is not None)
    assert seen == [None, True, True]


def test_an_exception_in_the_block_wins_and_the_handler_comes_back():
    with pytest.raises(ValueError), DeferredSigint():
        _sigint()
        raise ValueError("boom")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with pytest.raises(KeyboardInterrupt):  # and SIGINT raises again as usual
        _sigint()


def test_other_threads_do_nothing():
    out = []

    def run():
        with DeferredSigint() as d:
            out.append((d.prev, d.hit))

    t = threading.Thread(target=run)
    t.start()
    t.join(5)
    assert out == [(None, None)]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
