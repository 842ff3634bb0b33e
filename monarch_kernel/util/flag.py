"""A one-shot event flag made of one C lock.

:class:`threading.Event` is a Python object holding a Condition and a
lock; creating, setting and waiting on one costs several microseconds of
Python, twice per actor call (the request and its future). :class:`Flag`
keeps the same interface (``is_set``, ``set``, ``wait``, ``clear``) on a
single ``_thread.lock``: the lock is held while the flag is clear, ``set``
releases it, and ``wait`` acquires it and passes it on at once, so every
waiter wakes.
"""

from __future__ import annotations

import _thread

__all__ = ["Flag"]


class Flag:
    """A flag threads wait for; drop-in for :class:`threading.Event`.

    Notes
    -----
    ``wait(timeout)`` returns True once the flag is set, False when
    ``timeout`` seconds passed first (None: no limit); it is interruptible
    by signals in the main thread, as :meth:`threading.Lock.acquire` is.
    ``is_set`` reads a plain attribute, so it never misses a set flag while
    a waiter briefly holds the lock. After ``clear``, a waiter that was
    already waking may return True once (callers re-check what they wait
    for, as with a condition variable).
    """

    __slots__ = ("_flag", "_lock")

    def __init__(self) -> None:
        self._flag = False
        self._lock = _thread.allocate_lock()
        self._lock.acquire()  # held while clear

    def is_set(self) -> bool:
        return self._flag

    def set(self) -> None:
        """Set the flag (idempotent); wakes every waiter."""
        if not self._flag:
            self._flag = True
            try:
                self._lock.release()
            except RuntimeError:  # another thread set it at the same moment
                pass

    def clear(self) -> None:
        """Clear the flag (the next ``wait`` blocks)."""
        if self._flag:
            self._flag = False
            self._lock.acquire(False)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the flag is set or ``timeout`` seconds pass."""
        if self._flag:
            return True
        if self._lock.acquire(True, -1 if timeout is None else max(0.0, timeout)):
            try:
                self._lock.release()  # pass it on: every waiter wakes
            except RuntimeError:
                pass
            return True
        return self._flag
