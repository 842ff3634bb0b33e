"""The controller's I/O: leader/follower over its sockets and pipes.

Whoever holds ``_lead`` does the I/O duties of a :class:`Controller`: reads
the ROUTER socket ``router``, the inproc ``pull`` socket, and the lanes
(:mod:`~monarch_kernel.transport.lane`) and pipes of local workers, checks ranks,
sends heartbeats. The I/O thread leads by
default; a thread that waits for a reply (:meth:`ControllerIO.wait_for`,
used by futures and requests) takes the lead and reads its reply itself,
so a call costs no thread hand-off on the controller's side (the
leader/follower pattern of Schmidt et al., POSA2). The I/O thread steps
back while a caller leads, and takes the lead again 10-15 ms after the last
one (not at once: back-to-back calls then need no wake-up of this thread),
never letting 50 ms pass without a step.

A caller that leads looks for its reply on the ROUTER and the lanes for up to ``spin_s``
(100 us by default, ``MONARCH_SPIN_US``) before it sleeps in epoll_wait: a reply
that comes within that time is read without the thread going to sleep and
being woken (about 60 us of a no-op call's round trip on a 2-core VM). This is
the bounded "spin, then block" of MPI progress engines and of Linux's
``busy_poll``. Between two looks the spinning thread yields its core
(``sched_yield(2)``, keeping the GIL): a thread it woke (the worker it sent
to, or ZeroMQ's I/O thread carrying the request out) may have been queued
behind it on the same core. On 2 cores, a call after 1.5 ms of idleness took 397-418 us with a spin
that did not yield, 292-314 us with no spin, and 189-220 us with the yielding
spin. A yield that keeps the core away for CONTENDED_S (1 ms: another task is
runnable on the caller's core, and each yield could cost its whole time slice)
ends the spin and turns it off for CONTENDED_OFF_S (1 s): with a CPU-bound
process on the caller's core, calls took 2.4-4 ms with the yielding spin
before this rule, and 168-187 us with it. It spins only after a message was
sent, or one came in on the ROUTER or a lane, since the last spin (output read from a
worker's pipe does not count), at most MAX_MISSES spins in a row that find
nothing, and only with at least 2 cores and no more busy local ranks than
cores (``busy`` meaning a request of this controller is pending there, not
measured CPU). So a wait costs at most ``spin_s`` of CPU per message sent or
received, never more while nothing comes; ``MONARCH_SPIN_US=0`` turns it off.

:class:`ControllerIO` is a mixin of :class:`~monarch_kernel.controller.controller.Controller`
and uses its sockets, registry and locks.
"""

from __future__ import annotations

import logging
import os
import select
import threading
import time
from collections.abc import Mapping
from typing import Any

import zmq

from monarch_kernel.errors import MeshFailure, TransportError
from monarch_kernel.transport.lane import Lane
from monarch_kernel.util.sigint import DeferredSigint
from monarch_kernel.transport.sockets import FdPoller, drain, has_input, send_frames

#: microseconds a waiting caller looks for its reply before it sleeps (see above)
SPIN_US = 100
#: spins in a row that found nothing, after which callers sleep at once until
#: a message is sent or comes in on the ROUTER or a lane
MAX_MISSES = 3


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


#: a yield that kept the core from the spinning caller this long (seconds) means
#: another task was runnable on its core; the spin is then off for CONTENDED_OFF_S
CONTENDED_S = 0.001
#: seconds the spin stays off after such a yield
CONTENDED_OFF_S = 1.0


def _gil_keeping_yield() -> Any:
    """``sched_yield(2)``, called through :class:`ctypes.PyDLL` so that the GIL
    stays held: the spin gives its core away, not the GIL (``os.sched_yield``
    releases it, and a CPU-bound Python thread of the kernel then keeps it for a
    whole switch interval, 5 ms). Falls back to ``os.sched_yield``."""
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

log = logging.getLogger("monarch_kernel.controller.controller")

__all__ = ["ControllerIO"]


class ControllerIO:
    """The I/O half of the controller (see the module docstring)."""

    def _io_loop(self) -> None:
        self._last_beat = self._last_check = time.monotonic()
        poller = None
        try:
            poller = FdPoller()  # (one epoll_wait a step: transport.FdPoller)
            poller.register(self.router, zmq.POLLIN)
            poller.register(self.pull, zmq.POLLIN)
            self._poller = poller
            while not self._closed.is_set():
                if self.batches:  # calls held for a batch leave within HOLD_S
                    try:
                        self.flush_batches(stale_only=True)
                    except Exception:  # must not stop the I/O thread
                        log.exception("sending held calls failed")
                now = time.monotonic()
                if ((self._want or now - self._led_at < 0.01)
                        and now - self._stepped_at < 0.05):
                    # a caller leads, or led just now: let it go on (resume_io wakes);
                    # but never 50 ms without a step (heartbeats, exits, a burst of
                    # calls that are waited for later)
                    self._resume.wait(0.0005 if self.batches else 0.005)
                    self._resume.clear()
                    continue
                if self._lead.acquire(timeout=0.05):
                    try:
                        self._guarded_step(0 if self._want else 1 if self.batches else 50)
                    finally:
                        self._lead.release()
        except BaseException:
            log.exception("the controller I/O thread failed")
        finally:
            with self._lead:
                with self._lock:
                    pending = list(self.pending.values())
                    self.pending.clear()
                for req in pending:  # nothing will answer them now
                    req._fail(MeshFailure("the mesh's controller stopped"))
                for fd in list(self._pipes):
                    os.close(fd)
                self._pipes.clear()
                if poller is not None:
                    poller.close()
                self.router.close(0)
                self.pull.close(0)

    def _guarded_step(self, timeout_ms: int) -> None:
        try:
            self._io_step(self._poller, timeout_ms)
        except Exception:  # one bad step (a user's on_output, ...) must not stop I/O
            log.exception("the controller I/O hit an error; going on")

    def wait_for(self, event: threading.Event, timeout: float | None = None) -> bool:
        """Wait until ``event`` is set, doing the controller's I/O meanwhile.

        The calling thread leads the I/O (see above) while it waits, so the
        reply it waits for is read and handled in this thread. Falls back to
        a plain wait when the controller is closed.

        Parameters
        ----------
        event : threading.Event
            Set by a done-callback of the request waited for.
        timeout : float or None
            Seconds; None waits as long as it takes.

        Returns
        -------
        bool
            True if ``event`` was set.
        """
        if event.is_set():
            return True
        if self.batches:  # calls held for a batch leave before anyone waits
            self.flush_batches()
        deadline = None if timeout is None else time.monotonic() + timeout
        me = threading.get_ident()
        if self._leader == me or threading.current_thread() is self._thread:
            # nested (a callback waits, on a thread that leads): go on leading here
            self._lead_until(event, deadline, None)
            return event.is_set()
        # a SIGINT in the main thread is held back over all of this (bookkeeping
        # included): KeyboardInterrupt is raised when the lead is given back
        with DeferredSigint() as sigint:
            led = self._lead_for(event, deadline, sigint)
        if led is None:  # closed (or closing): the I/O thread fails what is pending
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            return event.wait(left)
        return led

    def _lead_for(self, event: threading.Event, deadline: float | None,
                  sigint: DeferredSigint) -> bool | None:
        """Take the lead (in 5 ms slices, watching ``event``) and lead until it
        is set; None when the controller is closed."""
        with self._want_lock:
            self._want += 1
        try:
            if not self._lead.acquire(blocking=False):
                try:  # the I/O thread leaves its poll and steps back
                    self.outbox.try_send([b""])
                except TransportError:
                    return None
                # another thread may lead for long: our reply may come through it
                while not self._lead.acquire(timeout=0.005):
                    if event.is_set():
                        return True
                    if sigint.hit is not None or self._closed.is_set():
                        return event.is_set() or (None if self._closed.is_set() else False)
                    if deadline is not None and time.monotonic() >= deadline:
                        return False
            try:
                if self._closed.is_set() or self._poller is None:
                    return None
                self._leader = threading.get_ident()
                return self._lead_until(event, deadline, sigint)
            finally:
                self._leader = None
                self._led_at = time.monotonic()
                self._lead.release()
        finally:
            with self._want_lock:
                self._want -= 1

    def _lead_until(self, event: threading.Event, deadline: float | None,
                    sigint: DeferredSigint | None) -> bool | None:
        """Do I/O steps until ``event`` is set (True), the deadline or a held-back
        SIGINT (False), or the controller closes (None)."""
        while not event.is_set():
            if sigint is not None and sigint.hit is not None:  # raised once leading stops
                return False
            if self._closed.is_set():
                return None
            left = 0.05 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                return False
            if (self._spin_next and self.spin_s and self._spin_misses < MAX_MISSES
                    and self._core_to_spare() and time.monotonic() >= self._spin_off_until):
                self._spin_next = False
                if self._spin(min(self.spin_s, left)):
                    self._spin_misses = 0
                else:
                    self._spin_misses += 1
            self._guarded_step(max(1, int(min(left, 0.05) * 1000)))
        return True

    def _core_to_spare(self) -> bool:
        """Whether the spin may run: at least 2 cores, and no more busy local
        ranks than cores. A heuristic ("busy": a request of this controller is
        pending there, not measured CPU), from measurements on 2 cores: a
        broadcast to 2 ranks gains 13% from the spin, to 4 ranks it loses;
        on 1 core the spin would take the time the rank needs."""
        cores = self._cores
        if cores < 2:
            return False
        local = self.local_ranks
        if len(local) <= cores:
            return True
        busy = 0
        ranks = self.ranks
        for r in list(local):  # (a snapshot: a spawn may add ranks meanwhile)
            info = ranks.get(r)
            if info is not None and info.state == "busy":
                busy += 1
                if busy > cores:
                    return False
        return True

    def _spin(self, seconds: float) -> bool:
        """Look for a message on the ROUTER or a lane for up to ``seconds`` (the leader),
        yielding the core between looks; True if one came. A yield that kept
        the core away for CONTENDED_S or more (another task is runnable on this
        core: each yield may cost its whole time slice) ends the spin and turns
        it off for CONTENDED_OFF_S."""
        router = self.router
        lanes = self._lane_poll.poll if self._lanes else None
        clock = time.perf_counter
        end = clock() + seconds
        poller = self._poller
        if poller is not None:  # (asking its events may take the signal of an input)
            poller.touched(router)
        try:
            while not has_input(router) and not (lanes and lanes(0)):
                now = clock()
                if now >= end:
                    return False
                _yield()
                if clock() - now >= CONTENDED_S:
                    self._spin_off_until = time.monotonic() + CONTENDED_OFF_S
                    self.spin_contended += 1
                    return has_input(router) or bool(lanes and lanes(0))
        except zmq.ZMQError:  # closed meanwhile: the step that follows sees it
            return False
        return True

    def defer_io(self) -> None:
        """Keep the I/O thread from reading for the next 10-15 ms: the calling
        thread sent a request it will wait for (an actor call), and reads the
        replies itself then. During a burst of calls, replies then wait in
        their socket's queue instead of being handled by a second thread that
        competes with the sender for the GIL."""
        self._led_at = time.monotonic()

    def resume_io(self) -> None:
        """Let the I/O thread read again at once (undoes :meth:`defer_io`): a
        coroutine that awaits a reply cannot lead, the I/O thread reads it."""
        self._led_at = 0.0
        self._resume.set()
        if self.batches:  # (the coroutine awaits: held calls leave now)
            self.flush_batches()

    def adopt_lane(self, rank: int, sock: Any) -> None:
        """Take the controller's end of a lane to local worker ``rank``
        (:mod:`monarch_kernel.transport.lane`; any thread): its messages go that way
        from now on, and the thread that leads reads it. A lane the rank
        had before (a restart) is read to its end, then closed."""
        # routed with an identity of its own (learnt from the signed hello, as a socket's)
        ident = f"lane.{rank}.{sock.fileno()}.{time.monotonic_ns()}".encode()
        lane = Lane(sock, f"lane-r{rank}", ident)
        with self._lock:
            self._lane_of[rank] = lane
            self._new_lanes.append(lane)
        self._wake_io()  # it registers the lane now

    def _wake_io(self) -> None:
        """Wake the thread that leads from its poll (any thread)."""
        try:
            self.outbox.try_send([b""])
        except TransportError:  # closed: nothing to wake
            pass

    def _register_lanes(self, poller: FdPoller) -> None:
        with self._lock:
            new, self._new_lanes = self._new_lanes, []
        for lane in new:
            fd = lane.fileno()
            self._lanes[fd] = lane
            poller.register(fd, zmq.POLLIN)
            self._lane_poll.register(fd, select.POLLIN)

    def _read_lane(self, lane: Lane, poller: FdPoller) -> None:
        """Handle what came on ``lane``; close it at its end (the rank exited)."""
        try:
            messages = lane.read()
        except Exception:  # (out of memory for a huge message, ...): the lane is lost
            log.exception("the controller cannot read %s; closing it", lane.name)
            messages = []
            lane.eof = True
        for frames in messages:
            try:
                self._receive(frames, lane.identity)
            except Exception:
                log.exception("the controller dropped a message it could not handle")
        if lane.eof:
            fd = lane.fileno()
            if self._lanes.pop(fd, None) is not None:
                poller.unregister(fd)
                self._lane_poll.unregister(fd)
            lane.close()

    def _io_step(self, poller: FdPoller, timeout_ms: int = 50) -> None:
        """One turn of the I/O: pipes, outbox, incoming messages, checks, beats
        (by whichever thread leads)."""
        if self._new_pipes:
            self._register_pipes(poller)
        if self._new_lanes:
            self._register_lanes(poller)
        events = dict(poller.poll(timeout_ms))
        self._stepped_at = time.monotonic()
        lanes = self._lanes
        for fd in [e for e in events if isinstance(e, int) and e in self._pipes]:
            self._read_pipe(self._pipes[fd], poller)
        for fd in [e for e in events if isinstance(e, int) and e in lanes]:
            self._read_lane(lanes[fd], poller)
            self._spin_next = True
        if self.pull in events:
            for frames in drain(self.pull):
                if len(frames) == 1:  # a wake-up (adopt_pipes, a caller that leads)
                    continue
                poller.touched(self.router)  # (a send may take the signal of an input)
                try:
                    send_frames(self.router, frames)
                except zmq.ZMQError as e:  # host unreachable: the rank is gone
                    log.debug("cannot send to %r: %s", frames[0].bytes, e)
        if self.router in events:
            for frames in drain(self.router, small=2):  # [identity, envelope, ...]
                try:
                    self._receive(frames)
                except Exception:
                    log.exception("the controller dropped a message it could not handle")
        now = time.monotonic()
        if now - self._last_check >= 0.05:
            self._last_check = now
            self._check_ranks(now)
        if now - self._last_beat >= self.heartbeat:
            self._last_beat = now
            beat = self.codec.encode("heartbeat")
            for info in list(self.ranks.values()):
                if info.state not in ("dead", "stopped", "starting") and info.identity:
                    lane = self._lane_of.get(info.rank)
                    if lane is not None:
                        try:
                            lane.send(beat)
                        except TransportError:
                            pass
                        continue
                    if info.down:
                        self._send_down(info.identity, beat, retry=0)
                        continue
                    poller.touched(self.router)
                    try:
                        send_frames(self.router, [info.identity, *beat])
                    except zmq.ZMQError:
                        pass
        if self.router in events:  # a reply may follow: the next wait looks first
            self._spin_next = True

    def _check_ranks(self, now: float) -> None:
        if self.stopping:
            return
        if self._sweeps_due:
            self._sweep_if_due(now)
        with self._lock:  # failed requests stay routable for 5 s at most
            for req in [q for q in self.pending.values()
                        if q.failed_at is not None and now - q.failed_at > 5.0]:
                self.pending.pop(req.id, None)
        if self.poll_exits is not None:
            try:
                exits = self.poll_exits()
            except Exception:
                log.exception("polling worker processes failed")
                exits = {}
            for rank, code in exits.items():
                self._drain_pipes(rank)
                if self.leftover_output is not None:
                    self._deliver_leftover(rank)
                self.mark_dead(rank, code)
        limit = 3 * self.heartbeat + 0.5
        for r, info in list(self.ranks.items()):
            if (r not in self.local_ranks and info.state in ("idle", "busy", "paused")
                    and now - info.last_heard > limit):
                log.warning("rank %d missed 3 heartbeats", r)
                self.mark_dead(r, None)
