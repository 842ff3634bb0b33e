"""The one I/O engine: leader/follower over sockets, lanes and pipes.

An :class:`Engine` does the I/O of one endpoint (the controller, a worker,
a worker's peer host): it watches *sources* (ZeroMQ sockets and plain file
descriptors: lanes, pipes, listeners), calls the handler registered for each
source that has input, and runs periodic *duties* (heartbeats, checks of
ranks). Exactly one thread, the *leader*, does that at any time.

Leader/follower (Schmidt et al., *Pattern-Oriented Software Architecture*
vol. 2, "Leader/Followers"): the engine's own I/O thread leads by default.
A thread that waits for something the I/O brings (a caller waiting for its
reply, an idle actor waiting for its next call) may take the lead
(:meth:`Engine.lead`) and do the I/O itself until what it waits for is
there: the reply is then read and handled by the thread that wanted it,
with no hand-off between threads. The I/O thread steps back while a
follower wants the lead, and takes it again only ``grace_s`` after the last
follower let go (back-to-back calls then need no wake-up of the I/O thread);
with ``max_gap_s`` set it never lets that long pass without a step of its own,
so that heartbeats and the checks of ranks go on whatever followers do.

A leader sleeps in one poll (:class:`~monarch_kernel.transport.sockets.FdPoller`,
one ``epoll_wait``); :meth:`Engine.wake` makes it leave that poll (an
``eventfd`` written by any thread, watched by every poller of the engine).

A follower that leads may *spin* before it sleeps (``spin_s``): it looks for
input on the sources registered with ``spin=True`` for up to ``spin_s``,
yielding its core between two looks, and only then sleeps in the poll. A
reply that comes within that time is read without the thread going to sleep
and being woken. This is the bounded "spin, then block" of MPI progress
engines and of Linux's ``busy_poll``. Its rules bound the CPU it costs:

* it spins only when :meth:`Engine.expect_input` was called since the last
  spin (a message was sent, or came on a spin source): at most ``spin_s``
  of CPU per message, never more while nothing comes;
* at most :data:`MAX_MISSES` spins in a row that find nothing;
* only when the user says a core is to spare (:meth:`EngineUser.may_spin`);
* between two looks it yields its core with ``sched_yield(2)``, keeping the
  GIL (a thread it woke, or ZeroMQ's I/O thread, may be queued behind it on
  the same core); a yield that kept the core away for :data:`CONTENDED_S`
  (another task is runnable on this core: each yield may cost a whole time
  slice) ends the spin and turns it off for :data:`CONTENDED_OFF_S`;
* ``spin_s`` is read from ``MONARCH_SPIN_US`` (:func:`spin_seconds`); 0 turns it off.

Guarantees
----------
* Handlers and duties run on the thread that leads, one at a time, never
  two at once; a handler may register and unregister sources.
* Sources are handled in the order of their ``order`` (lower first) within
  one step (the controller reads a rank's output pipes before its replies).
* A source registered from a thread that does not lead is watched from the
  next step on (the leader is woken).
* :meth:`Engine.lead` never returns while this thread holds the lead.
"""

from __future__ import annotations

import logging
import os
import select
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import zmq

from monarch_kernel.transport.sockets import FdPoller, has_input

__all__ = ["CONTENDED_OFF_S", "CONTENDED_S", "MAX_MISSES", "SPIN_US", "Duty", "Engine",
           "EngineSettings", "EngineUser", "Handler", "spin_seconds"]

log = logging.getLogger("monarch_kernel.transport.engine")

#: microseconds a waiting caller looks for its reply before it sleeps (see above)
SPIN_US = 100
#: spins in a row that found nothing, after which followers sleep at once until
#: :meth:`Engine.expect_input` is called again
MAX_MISSES = 3
#: a yield that kept the core from the spinning thread this long (seconds) means
#: another task was runnable on its core; the spin is then off for CONTENDED_OFF_S
CONTENDED_S = 0.001
#: seconds the spin stays off after such a yield
CONTENDED_OFF_S = 1.0

#: what a handler is called with: the source that has input (a socket or an fd)
Handler = Callable[[Any], None]


def spin_seconds(environ: Mapping[str, str] = os.environ) -> float:
    """The spin of a waiting caller, in seconds, from ``MONARCH_SPIN_US``
    (microseconds; default :data:`SPIN_US`).

    Raises
    ------
    ValueError
        If ``MONARCH_SPIN_US`` is not a number of microseconds in 0..10000.
    """
    raw = environ.get("MONARCH_SPIN_US", "").strip()
    if not raw:
        return SPIN_US / 1e6
    try:
        us = float(raw)
    except ValueError:
        us = -1.0
    if not 0 <= us <= 10_000:
        raise ValueError(f"MONARCH_SPIN_US must be a number of microseconds from 0 to "
                         f"10000 (0 turns the spin off), not {raw!r}")
    return us / 1e6


def _gil_keeping_yield() -> Any:
    """``sched_yield(2)``, called through :class:`ctypes.PyDLL` so that the GIL
    stays held: the spin gives its core away, not the GIL (``os.sched_yield``
    releases it, and a CPU-bound Python thread may then keep it for a whole
    switch interval). Falls back to ``os.sched_yield``."""
    try:
        import ctypes

        fn = ctypes.PyDLL(None).sched_yield
        fn.restype = ctypes.c_int
        fn.argtypes = []
        return fn
    except (OSError, AttributeError, ImportError, TypeError):  # (TypeError: Windows)
        return getattr(os, "sched_yield", None) or (lambda: time.sleep(0))


#: what the spin calls between two looks (see the module docstring)
_yield = _gil_keeping_yield()


class EngineUser(Protocol):
    """What the owner of an :class:`Engine` provides (called by the engine)."""

    def on_turn(self) -> bool:
        """Called by the I/O thread at each of its turns, leading or not: send
        what was held back too long. Returns True while something is still held
        (the I/O thread then polls for ``held_ms`` at most)."""
        ...

    def may_spin(self) -> bool:
        """Whether a follower may spin now (a core is to spare)."""
        ...

    def before_step(self) -> None:
        """Called by the leader before each poll."""
        ...

    def on_failure(self, error: BaseException) -> None:
        """Called on the I/O thread when its loop failed (the engine then closes)."""
        ...

    def on_close(self) -> None:
        """Called on the I/O thread as it ends, holding the lead: release what
        the I/O owned (the engine closes its pollers after this)."""
        ...


@dataclass
class EngineSettings:
    """How an :class:`Engine` schedules its I/O.

    Attributes
    ----------
    name : str
        Name of the I/O thread.
    idle_ms : int
        Milliseconds the I/O thread waits in its poll when nothing is held.
    held_ms : int
        Milliseconds it waits at most while :meth:`EngineUser.on_turn` says
        something is held.
    backoff_s, held_backoff_s : float
        Seconds the I/O thread waits before it looks again while a follower
        leads (while nothing is held / while something is).
    grace_s : float
        Seconds after a follower let go before the I/O thread leads again.
    max_gap_s : float or None
        The I/O thread steps at least this often (seconds), with a poll of no
        wait, even while followers want the lead; None: never while they do.
    nested : bool
        A thread that leads already and calls :meth:`Engine.lead` again (a
        callback that waits) goes on leading in place; False: that call
        returns None at once.
    yield_to_followers : bool
        A follower stops leading (:meth:`Engine.lead` returns None) when
        another follower wants the lead.
    acquire_limit_s : float or None
        Seconds a follower waits for the lead at most before it gives up
        (:meth:`Engine.lead` returns None); None: as long as it waits.
    survive_step_errors : bool
        An exception in a step (a handler, a duty) is logged and the I/O goes
        on; False: it ends the I/O thread (:meth:`EngineUser.on_failure`) or
        reaches the follower that led.
    follower_poller : bool
        Followers poll with a poller of their own, which also watches the fds
        added with ``shared=True`` (where ``EPOLLEXCLUSIVE`` is to be had).
    spin_s : float
        Seconds a follower spins before it sleeps (see the module docstring).
    """

    name: str
    idle_ms: int = 50
    held_ms: int = 1
    backoff_s: float = 0.005
    held_backoff_s: float = 0.0005
    grace_s: float = 0.01
    max_gap_s: float | None = 0.05
    nested: bool = True
    yield_to_followers: bool = False
    acquire_limit_s: float | None = None
    survive_step_errors: bool = True
    follower_poller: bool = False
    spin_s: float = 0.0


@dataclass
class Duty:
    """A periodic duty of an :class:`Engine` (see :meth:`Engine.every`).

    Attributes
    ----------
    period_s : float
        Seconds between two runs; 0: after every step.
    fn : callable(now)
        Called by the leader with ``time.monotonic()``.
    last : float
        Monotonic time of its last run (or of its registration).
    active : bool
        False: it neither runs nor bounds the poll (a duty armed now and then).
    """

    period_s: float
    fn: Callable[[float], None]
    last: float
    active: bool = True


class _Source:
    __slots__ = ("exclusive", "handler", "order", "shared", "spin")

    def __init__(self, handler: Handler, order: int, spin: bool, shared: bool,
                 exclusive: bool = False) -> None:
        self.handler, self.order, self.spin, self.shared = handler, order, spin, shared
        self.exclusive = exclusive


#: what Engine._acquire returns once the calling thread holds the lead
_HELD = object()


def _order(item: tuple[Any, _Source]) -> int:
    return item[1].order


class Engine:
    """One leader/follower I/O engine (see the module docstring).

    Parameters
    ----------
    settings : EngineSettings
    user : EngineUser
    stop : threading.Event
        Set by the owner to end the I/O: the I/O thread leaves its loop within
        one poll, and :meth:`lead` returns None.
    """

    def __init__(self, settings: EngineSettings, user: EngineUser,
                 stop: threading.Event) -> None:
        self.settings = settings
        self.user = user
        self.stop_event = stop
        #: seconds a follower spins before it sleeps (0: off); may be changed at any time
        self.spin_s = settings.spin_s
        #: monotonic time until which the spin is off (a contended core)
        self.spin_off_until = 0.0
        #: how many times a contended core turned the spin off
        self.spin_contended = 0
        self._spin_next = True
        self._spin_misses = 0
        self._lock = threading.Lock()  # the lead
        self._want = 0  # followers that want the lead
        self._want_lock = threading.Lock()
        #: thread ident of the thread that leads now (None: nobody)
        self.leader: int | None = None
        self._led_at = 0.0  # monotonic time a follower last let go of the lead
        self.stepped_at = time.monotonic()  # monotonic time of the last step, by any thread
        self._resume = threading.Event()
        self._running = False
        self._sources: dict[Any, _Source] = {}
        self._socks: list[zmq.Socket] = []  # the zmq sources (both pollers)
        self._pending: list[tuple[bool, Any, _Source | None]] = []  # (add?, source, how)
        self._pending_lock = threading.Lock()
        self._duties: list[Duty] = []
        self._spin_socks: list[zmq.Socket] = []
        self._spin_fds = select.poll()
        self._spin_fd_count = 0
        self.poller = FdPoller()
        self.follower_poller: FdPoller | None = None
        if settings.follower_poller and self.poller.exclusive:
            self.follower_poller = FdPoller()
        self._last_poller: FdPoller | None = None
        self._wake_lock = threading.Lock()
        if hasattr(os, "eventfd"):
            self._wake_r = self._wake_w = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        else:  # (no eventfd: a pipe)
            self._wake_r, self._wake_w = os.pipe()
            os.set_blocking(self._wake_r, False)
            os.set_blocking(self._wake_w, False)
        self._sources[self._wake_r] = _Source(self._drain_wake, -1, False, False)
        for p in self._pollers():
            p.register(self._wake_r)
        self.thread = threading.Thread(target=self._run, name=settings.name, daemon=True)

    # ------------------------------------------------------------- sources
    def _pollers(self) -> list[FdPoller]:
        return [self.poller] if self.follower_poller is None else [self.poller,
                                                                   self.follower_poller]

    def add(self, source: zmq.Socket | int, handler: Handler, *, order: int = 0,
            spin: bool = False, shared: bool = False, exclusive: bool = False) -> bool:
        """Watch ``source`` and call ``handler(source)`` when it has input (any thread).

        Parameters
        ----------
        source : zmq.Socket or int
            A socket or a file descriptor.
        handler : callable(source)
            Run by the leader; it must read what is there (a socket: drain it).
        order : int
            Sources with input are handled lowest ``order`` first within a step.
        spin : bool
            A spinning follower looks at this source (and input on it counts as
            :meth:`expect_input`).
        shared : bool
            An fd watched by the followers' poller alone, with ``EPOLLEXCLUSIVE``
            (another thread watches it too, with its own poller registered
            after this one, and must cope with finding it read).
        exclusive : bool
            An fd watched with ``EPOLLEXCLUSIVE`` (``shared`` implies it): another
            thread's poller registered before this one is woken first.

        Returns
        -------
        bool
            False if ``shared`` cannot be had (no followers' poller, or the
            engine is closed); True otherwise.
        """
        how = _Source(handler, order, spin, shared, exclusive)
        if shared:
            fp = self.follower_poller
            if fp is None or isinstance(source, zmq.Socket):
                return False
            self._sources[source] = how  # (before the poll can report it)
            try:
                fp.register(source, exclusive=True)
            except (OSError, ValueError):  # closed: the engine ended
                self._sources.pop(source, None)
                return False
            return True
        if self._running and not self.leads_here():
            with self._pending_lock:
                self._pending.append((True, source, how))
            self.wake()
            return True
        self._add_now(source, how)
        return True

    def _add_now(self, source: Any, how: _Source) -> None:
        self._sources[source] = how
        for p in self._pollers():
            p.register(source, exclusive=how.exclusive)
        if isinstance(source, zmq.Socket):
            self._socks.append(source)
            if how.spin:
                self._spin_socks.append(source)
        elif how.spin:
            self._spin_fds.register(source, select.POLLIN)
            self._spin_fd_count += 1

    def remove(self, source: zmq.Socket | int) -> None:
        """Stop watching ``source`` (the leader, or any thread for a shared fd
        or before the engine started; else from the next step on). Unknown
        sources are ignored."""
        how = self._sources.get(source)
        if how is None:
            return
        if how.shared:
            if self._sources.get(source) is how:
                del self._sources[source]
            if self.follower_poller is not None:
                self.follower_poller.unregister(source)
            return
        if self._running and not self.leads_here():
            with self._pending_lock:
                self._pending.append((False, source, None))
            self.wake()
            return
        self._remove_now(source)

    def _remove_now(self, source: Any) -> None:
        how = self._sources.pop(source, None)
        if how is None:
            return
        for p in self._pollers():
            try:
                p.unregister(source)
            except KeyError:
                pass
        if isinstance(source, zmq.Socket):
            self._socks.remove(source)
            if source in self._spin_socks:
                self._spin_socks.remove(source)
        elif how.spin:
            try:
                self._spin_fds.unregister(source)
            except KeyError:
                pass
            self._spin_fd_count -= 1

    def touched(self, sock: zmq.Socket) -> None:
        """Say that the leader sent on ``sock`` (or asked its events): the next
        poll asks its events first (see :class:`FdPoller`)."""
        for p in self._pollers():
            p.touched(sock)

    def every(self, period_s: float, fn: Callable[[float], None],
              active: bool = True) -> Duty:
        """Run ``fn(now)`` every ``period_s`` seconds (0: after every step), by
        the leader after a step. An active duty with a period bounds the poll,
        so that it is never late by more than a poll of no wait. The leader may
        change the duty's ``active`` and ``last`` (to arm it for later).
        Register before :meth:`start`."""
        duty = Duty(period_s, fn, time.monotonic(), active)
        self._duties.append(duty)
        return duty

    # ------------------------------------------------------------- waking
    def wake(self) -> bool:
        """Make the leader leave its poll (any thread; never blocks). False if
        the engine is closed."""
        if not self._wake_lock.acquire(blocking=False):
            return True  # (another thread wakes it now, or it is closing)
        try:
            if self._wake_w < 0:
                return False
            try:
                os.write(self._wake_w, b"\x01\0\0\0\0\0\0\0")
            except BlockingIOError:  # (full: woken enough)
                pass
            except OSError:
                return False
            return True
        finally:
            self._wake_lock.release()

    def _drain_wake(self, fd: int) -> None:
        try:
            os.read(fd, 4096)
        except (BlockingIOError, OSError):
            pass

    def resume(self) -> None:
        """Let the I/O thread lead again at once (undoes :meth:`defer`)."""
        self._led_at = 0.0
        self._resume.set()

    def nudge(self) -> None:
        """Have the I/O thread take a turn soon (:meth:`EngineUser.on_turn`),
        without taking the lead from a follower, and wake the leader."""
        self._resume.set()
        self.wake()

    def defer(self) -> None:
        """Keep the I/O thread from leading for ``grace_s``: the calling thread
        will lead soon (it sent a request and will wait for the reply)."""
        self._led_at = time.monotonic()

    def expect_input(self) -> None:
        """A message was sent or came in: the next follower that waits spins first."""
        self._spin_next = True
        self._spin_misses = 0

    @property
    def running(self) -> bool:
        """Whether the I/O thread runs (started, not ended)."""
        return self._running

    def leads_here(self) -> bool:
        """Whether the calling thread leads now, or is the I/O thread."""
        return self.leader == threading.get_ident() or threading.current_thread() is self.thread

    def wanted(self) -> int:
        """How many followers want the lead now."""
        return self._want

    # ------------------------------------------------------------- the lead
    def start(self) -> None:
        """Start the I/O thread."""
        self._running = True
        self.thread.start()

    def join(self, timeout: float | None = None) -> None:
        """Wait for the I/O thread to end (after ``stop`` was set)."""
        if self.thread.ident is not None:
            self.thread.join(timeout)

    def hold(self, timeout: float) -> bool:
        """Take the lead, waiting up to ``timeout`` seconds (no step is done):
        True if taken; :meth:`release` gives it back."""
        return self._lock.acquire(timeout=timeout)

    def release(self) -> None:
        """Give back the lead taken with :meth:`hold`."""
        self._lock.release()

    def _run(self) -> None:
        s = self.settings
        me = threading.get_ident()
        try:
            while not self.stop_event.is_set():
                held = self.user.on_turn()
                now = time.monotonic()
                gap_ok = s.max_gap_s is None or now - self.stepped_at < s.max_gap_s
                if (self._want or now - self._led_at < s.grace_s) and gap_ok:
                    # a follower leads, or led just now: let it go on (resume() wakes)
                    self._resume.wait(s.held_backoff_s if held else s.backoff_s)
                    self._resume.clear()
                    continue
                if self._lock.acquire(timeout=0.05):
                    try:
                        if self._want and s.max_gap_s is None:
                            continue
                        self.leader = me
                        timeout = 0 if self._want else s.held_ms if held else s.idle_ms
                        self._guarded_step(self.poller, timeout)
                    finally:
                        self.leader = None
                        self._lock.release()
        except BaseException as e:  # noqa: BLE001 - reported to the user
            self.user.on_failure(e)
        finally:
            with self._lock:
                self._running = False
                try:
                    self.user.on_close()
                finally:
                    self._close()

    def _close(self) -> None:
        with self._wake_lock:
            for p in self._pollers():
                p.close()
            if self._wake_r >= 0:
                os.close(self._wake_r)
            if self._wake_w != self._wake_r and self._wake_w >= 0:
                os.close(self._wake_w)
            self._wake_r = self._wake_w = -1

    def lead(self, done: Callable[[], bool], deadline: float | None = None, *,
             interrupted: Callable[[], bool] | None = None,
             allowed: Callable[[], bool] | None = None) -> bool | None:
        """Lead the I/O in this thread until ``done()`` is true.

        Parameters
        ----------
        done : callable() -> bool
            What the thread waits for (checked before each step).
        deadline : float or None
            ``time.monotonic()`` time to give up at; None: no limit.
        interrupted : callable() -> bool, optional
            Checked before each step: true stops leading (a held-back SIGINT).
        allowed : callable() -> bool, optional
            Checked before taking the lead and before each step: false stops
            leading (more actors now run on a worker).

        Returns
        -------
        bool or None
            True once ``done()``; False at the deadline or when interrupted;
            None when this thread cannot lead (the engine is stopped or not
            running, ``allowed()`` is false, it leads already and ``nested`` is
            off, another follower wants the lead with ``yield_to_followers``,
            or the lead was not had within ``acquire_limit_s``).
        """
        s = self.settings
        if allowed is not None and not allowed():
            return None
        if self.stop_event.is_set() or not self._running:
            return None
        if self.leads_here():
            if not s.nested:
                return None
            return self._lead_steps(done, deadline, interrupted, allowed,
                                    self.follower_poller or self.poller)
        with self._want_lock:
            self._want += 1
        try:
            if not self._lock.acquire(blocking=False):
                if not self.wake():  # the I/O thread leaves its poll and steps back
                    return None
                got = self._acquire(done, deadline, interrupted)
                if got is not _HELD:
                    return got  # type: ignore[return-value]
            outer, self.leader = self.leader, threading.get_ident()
            try:
                if self.stop_event.is_set() or not self._running:
                    return None
                return self._lead_steps(done, deadline, interrupted, allowed,
                                        self.follower_poller or self.poller)
            finally:
                self.leader = outer
                self._led_at = time.monotonic()
                self._lock.release()
        finally:
            with self._want_lock:
                self._want -= 1

    def _acquire(self, done: Callable[[], bool], deadline: float | None,
                 interrupted: Callable[[], bool] | None) -> object:
        """Take the lead in slices of 5 ms, watching ``done`` (another thread may
        lead for long, and read what this one waits for): ``_HELD`` once it holds
        the lead, else what :meth:`lead` returns (not holding it)."""
        limit = self.settings.acquire_limit_s
        give_up = None if limit is None else time.monotonic() + limit
        while not self._lock.acquire(timeout=0.005):
            if done():
                return True
            if interrupted is not None and interrupted():
                return False
            if self.stop_event.is_set():
                return None
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return False
            if give_up is not None and now >= give_up:
                return None
        return _HELD

    def _lead_steps(self, done: Callable[[], bool], deadline: float | None,
                    interrupted: Callable[[], bool] | None,
                    allowed: Callable[[], bool] | None, poller: FdPoller) -> bool | None:
        s = self.settings
        while not done():
            if interrupted is not None and interrupted():
                return False
            if self.stop_event.is_set():
                return None
            if allowed is not None and not allowed():
                return None
            if s.yield_to_followers and self._want > 1:
                return None  # (another follower wants to lead: let it)
            left = 0.05 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                return False
            if (self._spin_next and self.spin_s and self._spin_misses < MAX_MISSES
                    and time.monotonic() >= self.spin_off_until and self.user.may_spin()):
                self._spin_next = False
                if self.spin(min(self.spin_s, left)):
                    self._spin_misses = 0
                else:
                    self._spin_misses += 1
            self._guarded_step(poller, max(1, int(min(left, 0.05) * 1000)))
        return True

    def spin(self, seconds: float) -> bool:
        """Look for input on the spin sources for up to ``seconds`` (the leader),
        yielding the core between looks; True if some came. A yield that kept
        the core away for :data:`CONTENDED_S` or more ends the spin and turns
        it off for :data:`CONTENDED_OFF_S`."""
        socks = self._spin_socks
        fds = self._spin_fds.poll if self._spin_fd_count else None
        clock = time.perf_counter
        end = clock() + seconds
        for sock in socks:  # (asking its events may take the signal of an input)
            self.touched(sock)

        def look() -> bool:
            for sock in socks:
                if has_input(sock):
                    return True
            return bool(fds and fds(0))

        try:
            while not look():
                now = clock()
                if now >= end:
                    return False
                _yield()
                if clock() - now >= CONTENDED_S:
                    self.spin_off_until = time.monotonic() + CONTENDED_OFF_S
                    self.spin_contended += 1
                    return look()
        except zmq.ZMQError:  # closed meanwhile: the step that follows sees it
            return False
        return True

    # ------------------------------------------------------------- a step
    def _guarded_step(self, poller: FdPoller, timeout_ms: int) -> None:
        if not self.settings.survive_step_errors:
            self._step(poller, timeout_ms)
            return
        try:
            self._step(poller, timeout_ms)
        except Exception:  # one bad step (a user's callback, ...) must not stop the I/O
            log.exception("%s: an I/O step failed; going on", self.settings.name)

    def _step(self, poller: FdPoller, timeout_ms: int) -> None:
        """One turn of the I/O, by the leader: poll ``poller`` up to ``timeout_ms``
        milliseconds, handle the sources with input, run the duties that are due."""
        if self._pending:
            with self._pending_lock:
                pending, self._pending = self._pending, []
            for add, source, how in pending:
                try:
                    if add:
                        self._add_now(source, how)  # type: ignore[arg-type]
                    else:
                        self._remove_now(source)
                except (OSError, ValueError) as e:  # (closed before it could be watched)
                    self._sources.pop(source, None)
                    log.debug("%s: cannot watch %r: %s", self.settings.name, source, e)
        if poller is not self._last_poller:  # (the other may have taken a socket's signal)
            self._last_poller = poller
            for sock in self._socks:
                poller.touched(sock)
        self.user.before_step()
        if timeout_ms:
            now = time.monotonic()
            for d in self._duties:
                if d.period_s and d.active:
                    due_ms = int((d.last + d.period_s - now) * 1000) + 1
                    if due_ms < timeout_ms:
                        timeout_ms = max(0, due_ms)
        events = poller.poll(timeout_ms)
        self.stepped_at = time.monotonic()
        sources = self._sources
        stop = self.stop_event
        if events:
            ready = []
            for obj, _ev in events:
                how = sources.get(obj)
                if how is None:  # (closed meanwhile, or forgotten: a stale fd)
                    if not isinstance(obj, zmq.Socket):
                        poller.unregister(obj)
                    continue
                ready.append((obj, how))
            if len(ready) > 1:
                ready.sort(key=_order)
            for obj, how in ready:
                how.handler(obj)
                if how.spin:
                    self._spin_next = True
                if stop.is_set():
                    return
        if stop.is_set():
            return
        now = time.monotonic()
        for d in self._duties:
            if d.active and now - d.last >= d.period_s:
                d.last = now
                d.fn(now)
