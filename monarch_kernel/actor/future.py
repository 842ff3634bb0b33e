"""Futures: the results of actor calls, from threads and from asyncio alike.

A :class:`Future` is completed by an I/O thread (the controller's, or a
worker's peer thread) and read by anyone: ``future.get(timeout=...)``
blocks the calling thread on a :class:`~monarch_kernel.util.flag.Flag`, and ``await
future`` suspends a coroutine on whatever asyncio loop is running (a
Jupyter kernel's, an actor's own). Neither needs the other: ``.get()`` in a
notebook cell, where the kernel's loop is running, neither deadlocks nor
warns, because completing a future never needs that loop.

The value is computed lazily, once, in the first thread that asks for it
(unpickling a large reply happens in the caller's thread, not in an I/O
thread). The idea of one future that is both blocking and awaitable comes
from PyTorch Monarch's ``Future``; its thread-safety model from
:class:`concurrent.futures.Future`.
"""

from __future__ import annotations

import asyncio
import numbers
import threading
import time
from collections.abc import Callable, Generator
from typing import Any, Generic, TypeVar

from monarch_kernel.util.flag import Flag

__all__ = ["Future", "check_timeout"]

T = TypeVar("T")

_NOT_YET = object()

#: seconds a wait lasts before the guard's ``watch`` is told (see Future)
WATCH_AFTER_S = 0.02


def check_timeout(timeout: Any) -> float | None:
    """``timeout`` as seconds (a float), or None (no limit).

    Raises
    ------
    TypeError
        If it is not a real number (or None).
    ValueError
        If it is negative, NaN or infinite.
    """
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise TypeError(f"timeout is a number of seconds, or None to wait as long as it "
                        f"takes; got {timeout!r} ({type(timeout).__name__})")
    # (numbers.Real declares only < and <=, its abstract methods; every concrete one has >=)
    if not timeout >= 0 or timeout == float("inf"):  # type: ignore[operator]
        raise ValueError(f"timeout is a finite number of seconds >= 0, or None to wait as "
                         f"long as it takes; got {timeout!r}")
    return float(timeout)


class Future(Generic[T]):
    """The eventual result of an actor call.

    Parameters
    ----------
    pump : callable(final: bool) -> None, optional
        Called about every 50 ms while a thread or coroutine waits, and once
        with ``final=True`` after completion (shows the endpoint's output).
    guard : callable() -> watch or None, optional
        Called before blocking; raises instead of waiting forever (an actor
        waiting for its own endpoint). It may return ``watch(on: bool)``,
        called with True once the wait has lasted :data:`WATCH_AFTER_S` and
        with False when that wait ends (an actor's thread waiting for a call:
        wait cycles between actors, :mod:`monarch_kernel.actor.cycles`).
    waiter : callable(event, timeout) -> bool, optional
        Blocks until the completion event is set or ``timeout`` seconds pass
        (default ``event.wait``); the controller's ``wait_for`` reads the
        reply in the waiting thread itself, as a worker's ``lead_wait`` does.
    resume : callable() -> None, optional
        Called before a coroutine awaits: it cannot read the reply itself,
        so the controller's I/O thread must (``Controller.resume_io``).
    what : str or callable() -> str, optional
        What it waits for (``"trainers.step on rank 1"``), named by the
        TimeoutError of :meth:`get` (a callable: made only then).

    Notes
    -----
    Futures are made by the adverbs of an endpoint (``call``,
    ``call_one``, ``choose``, ``stream``), not by users.
    """

    __slots__ = (
        "__weakref__",
        "_callbacks",
        "_event",
        "_finalizer",
        "_guard",
        "_lock",
        "_outcome",
        "_pump",
        "_resume",
        "_waiter",
        "_what",
    )

    def __init__(self, pump: Callable[[bool], None] | None = None,
                 guard: Callable[[], None] | None = None,
                 waiter: Callable[[Flag, float | None], bool] | None = None,
                 resume: Callable[[], None] | None = None,
                 what: str | Callable[[], str] = "") -> None:
        self._what = what  # what it waits for (``mesh.method on rank 1``), for a timeout
        self._event = Flag()
        self._waiter = waiter
        self._resume = resume
        self._lock = threading.Lock()
        self._finalizer: Callable[[], T] | None = None
        self._outcome: Any = _NOT_YET
        self._callbacks: list[Callable[[Future[T]], None]] = []
        self._pump = pump
        self._guard = guard

    # ------------------------------------------------------------ completion
    @classmethod
    def completed(cls, value: T) -> Future[T]:
        """A future that already holds ``value``."""
        f: Future[T] = cls()
        f.set_result(value)
        return f

    @classmethod
    def failed(cls, exc: BaseException) -> Future[Any]:
        """A future that already holds the exception ``exc``."""
        f: Future[Any] = cls()
        f.set_exception(exc)
        return f

    def set_result(self, value: T) -> None:
        """Complete with ``value`` (from any thread; only the first completion counts)."""
        self._complete(lambda: value)

    def set_exception(self, exc: BaseException) -> None:
        """Complete with the exception ``exc`` (raised by :meth:`get`)."""

        def fail() -> T:
            raise exc

        self._complete(fail)

    def _complete(self, finalizer: Callable[[], T]) -> None:
        """Complete; ``finalizer()`` computes the value (or raises) when first asked."""
        with self._lock:
            if self._event.is_set():
                return
            self._finalizer = finalizer
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            try:
                fn(self)
            except Exception:
                import logging

                logging.getLogger("monarch_kernel.actor.actor_mesh").exception(
                    "a future callback failed")

    def add_done_callback(self, fn: Callable[[Future[T]], None]) -> None:
        """Call ``fn(self)`` when done (at once, in this thread, if already done;
        otherwise in the thread that completes it)."""
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    # --------------------------------------------------------------- reading
    def done(self) -> bool:
        """True once a result or an exception is there."""
        return self._event.is_set()

    def _result(self) -> T:
        with self._lock:
            if self._outcome is _NOT_YET:
                fn = self._finalizer
                assert fn is not None
                try:
                    self._outcome = (True, fn())
                except BaseException as e:  # noqa: BLE001 - kept and re-raised to every reader
                    self._outcome = (False, e)
                self._finalizer = None
        ok, value = self._outcome
        if ok:
            return value
        raise value

    def get(self, timeout: float | None = None) -> T:
        """Wait for the result and return it.

        Parameters
        ----------
        timeout : float or None
            Seconds to wait; None waits as long as it takes.

        Returns
        -------
        The endpoint's value (a :class:`~monarch_kernel.mesh.shape.ValueMesh` for
        ``call``).

        Raises
        ------
        TimeoutError
            If ``timeout`` seconds passed first; the call goes on and the
            future stays usable (call ``get`` again).
        ActorError
            If the endpoint raised; also an instance of the original type.
        MeshFailure
            If the actor was stopped or its process died.
        ValueError
            If ``timeout`` is negative, NaN or infinite.
        TypeError
            If ``timeout`` is not a number.
        """
        timeout = check_timeout(timeout)
        ev = self._event
        if not ev.is_set():
            watch = self._guard() if self._guard is not None else None
            wait = self._waiter or Flag.wait
            if watch is not None:  # an actor's thread waits for a call (see guard)
                self._wait_watched(ev, wait, timeout, watch)
            elif self._pump is None:
                if not wait(ev, timeout):
                    raise _timeout(timeout, self._what)
            else:
                deadline = None if timeout is None else time.monotonic() + timeout
                while True:
                    step = 0.05
                    if deadline is not None:
                        step = max(0.0, min(step, deadline - time.monotonic()))
                    if wait(ev, step):
                        break
                    self._pump(False)
                    if deadline is not None and time.monotonic() >= deadline:
                        raise _timeout(timeout, self._what)
        if self._pump is not None:
            self._pump(True)
        return self._result()

    result = get

    def _wait_watched(self, ev: Flag, wait: Callable[[Flag, float | None], bool],
                      timeout: float | None, watch: Callable[[bool], None]) -> None:
        """Wait, telling ``watch`` after WATCH_AFTER_S (and calling the pump, if
        any, every 50 ms)."""
        now = time.monotonic()
        deadline = None if timeout is None else now + timeout
        watch_at: float | None = now + WATCH_AFTER_S
        try:
            while True:
                step = 0.05 if self._pump is not None else None
                if watch_at is not None:
                    step = watch_at - now if step is None else min(step, watch_at - now)
                if deadline is not None:
                    step = deadline - now if step is None else min(step, deadline - now)
                if wait(ev, None if step is None else max(0.0, step)):
                    return
                now = time.monotonic()
                if self._pump is not None:
                    self._pump(False)
                if deadline is not None and now >= deadline:
                    raise _timeout(timeout, self._what)
                if watch_at is not None and now >= watch_at:
                    watch_at = None
                    watch(True)
        finally:
            if watch_at is None:
                watch(False)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The exception the call ended with, or None (waits like :meth:`get`)."""
        try:
            self.get(timeout)
        except TimeoutError:
            if not self.done():
                raise
            return self._outcome[1]
        except BaseException as e:  # noqa: BLE001
            return e
        return None

    def __await__(self) -> Generator[Any, None, T]:
        return self._wait_async().__await__()

    async def _wait_async(self) -> T:
        if not self._event.is_set():
            watch = self._guard() if self._guard is not None else None
            loop = asyncio.get_running_loop()
            waiter = loop.create_future()

            def wake(_: Future[T]) -> None:
                try:
                    loop.call_soon_threadsafe(_resolve, waiter)
                except RuntimeError:  # the loop is closed: nobody is waiting any more
                    pass

            self.add_done_callback(wake)
            if self._resume is not None:
                self._resume()
            watching = False
            try:
                if watch is not None:  # an actor's thread, held while this coroutine waits
                    await asyncio.wait({waiter}, timeout=WATCH_AFTER_S)
                    if not waiter.done():
                        watching = True
                        watch(True)
                if self._pump is None:
                    await waiter
                else:
                    while not waiter.done():
                        await asyncio.wait({waiter}, timeout=0.1)
                        self._pump(False)
            finally:
                if watching:
                    assert watch is not None
                    watch(False)
        return self.get(0)

    def __repr__(self) -> str:
        if not self.done():
            return "<Future pending>"
        if self._outcome is _NOT_YET:
            return "<Future done>"
        ok, value = self._outcome
        return f"<Future {'value' if ok else 'exception'}={value!r:.60}>"


def _resolve(waiter: asyncio.Future[Any]) -> None:
    if not waiter.done():
        waiter.set_result(None)


def _timeout(timeout: float | None, what: str | Callable[[], str] = "") -> TimeoutError:
    if callable(what):  # (made only when needed: naming many ranks costs a little)
        what = what()
    return TimeoutError(
        f"no result{' from ' + what if what else ''} within {timeout:g} s; the call goes "
        "on: call get() again to keep waiting")
