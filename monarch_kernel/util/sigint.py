"""Holding back Ctrl-C over a block that must not be cut in two.

A ``SIGINT`` raises ``KeyboardInterrupt`` in the main thread between any two
bytecodes. Where that would lose a message or leave state half-changed (the
controller handling a reply while it leads the I/O, a request registered but
not sent, a paused rank's debugger sending its last message),
:class:`DeferredSigint` notes the signal instead and hands it to the
previous handler once the block is done.
"""

from __future__ import annotations

import _signal
import _thread
import os
import signal
import threading
from typing import Any

__all__ = ["DeferredSigint"]

_SIGINT = int(signal.SIGINT)


class DeferredSigint:
    """Context manager: a ``SIGINT`` during the block is noted, not raised, and
    the previous handler runs (``KeyboardInterrupt``) when the block ends
    without an exception. In other threads, which Python's signal handlers
    never interrupt, it does nothing. Nests: an inner block (a lane's send
    inside a request's) leaves the handler to the outermost one, whose
    :attr:`hit` it shares."""

    def __init__(self) -> None:
        self._hit: tuple[int, Any] | None = None
        self.prev: Any = None
        self._outer: DeferredSigint | None = None
        self._before: tuple[int, Any] | None = None  # the outer's hit when this began

    @property
    def hit(self) -> tuple[int, Any] | None:
        """(signum, frame) of a SIGINT noted during this block, else None (in a
        nested block, one the outermost noted before it began does not count)."""
        outer = self._outer
        if outer is None:
            return self._hit
        h = outer._hit
        return None if h is self._before else h

    def __enter__(self) -> DeferredSigint:
        global _active
        if _thread.get_ident() == _main_ident:
            if _active is not None:  # nested: the outermost block notes it
                self._outer = _active
                self._before = _active._hit
                return self
            # the C functions: signal.signal's enum wrapping costs ~6 us a call here
            prev = _signal.getsignal(_SIGINT)
            if callable(prev):
                self.prev = prev
                _signal.signal(_SIGINT, self._note)
                _active = self
        return self

    def _note(self, signum: int, frame: Any) -> None:
        self._hit = (signum, frame)

    def __exit__(self, *exc: object) -> None:
        global _active
        if self.prev is not None:
            _active = None
            _signal.signal(_SIGINT, self.prev)
            if self._hit is not None and exc[0] is None:
                self.prev(*self._hit)


#: the outermost DeferredSigint of the main thread now (None: none is active)
_active: DeferredSigint | None = None
#: the main thread's id (Python runs signal handlers there only); a fork made
#: in another thread makes that thread the child's main thread
_main_ident = threading.main_thread().ident


def _after_fork() -> None:
    global _main_ident, _active
    _main_ident = threading.main_thread().ident
    _active = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)
