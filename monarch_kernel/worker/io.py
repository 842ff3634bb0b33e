"""A worker's I/O: its connection to the controller on the one I/O engine.

:class:`WorkerIO` is the part of a :class:`~monarch_kernel.worker.worker.Worker`
that does its I/O, on a :class:`~monarch_kernel.transport.engine.Engine`:
whoever leads reads the controller's messages and hands each verified one to
the worker's routing (``Worker.dispatch``: calls to actors' queues, requests
to the main thread's queue, interrupts, debugger input), sends heartbeats and
watches the controller (its process, its lane, its silence).

Leader/follower (POSA2): the I/O thread leads by default; the thread of the
worker's only actor leads while it is idle (:meth:`WorkerIO.lead_until`),
so a call is read by the thread that runs it, with no hand-off between
threads; so does the main thread, which runs cells, while the worker has no
actor. The I/O thread takes the lead again a short grace after the actor
stopped leading (while the actor runs a call).

Peer lanes (:mod:`monarch_kernel.actor.peers`) are watched by the followers'
poller too (:meth:`WorkerIO.share`), as well as by the peer I/O thread, with
``EPOLLEXCLUSIVE``, this worker's poller first: a call from a peer wakes the
idle actor's thread, which runs it with no hand-off; a thread that made a
peer call and waits for its reply leads while it waits
(:meth:`WorkerIO.lead_wait`) and reads the reply itself. The I/O thread's
poller does not watch peer lanes, so a buffer read never holds up its
heartbeats and interrupts. Whatever comes while nobody waits in the
followers' poller (the actor is busy, a worker of several actors) wakes the
peer I/O thread instead. ``MONARCH_PEER_LEAD=0`` turns this off.

A verified message goes to ``Worker.dispatch``, the one call from the I/O into
the routing (the handler registry, :mod:`monarch_kernel.worker.handlers`).
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import threading
import time
from collections.abc import Callable
from typing import Any, NoReturn, Protocol

import zmq

from monarch_kernel.errors import ProtocolError
from monarch_kernel.transport.engine import Engine, EngineSettings
from monarch_kernel.transport.lane import Lane
from monarch_kernel.transport.sockets import FdPoller, drain, send_frames
from monarch_kernel.util.droplog import DropLog
from monarch_kernel.util.flag import Flag
from monarch_kernel.util.procs import running
from monarch_kernel.util.switches import peer_lead_enabled
from monarch_kernel.wire import messages, protocol, shm
from monarch_kernel.wire.shm import NAME_RE
from monarch_kernel.worker import handlers

log = logging.getLogger("monarch_kernel.worker.worker")

__all__ = ["WorkerHost", "WorkerIO", "exit_process"]

#: the order of sources in a step: hand-offs for the dealer first, then the controller's
PULL_ORDER, CONTROLLER_ORDER, PEER_ORDER = 0, 1, 2


def _peer_lead() -> bool:
    """Whether threads that lead read peer lanes too (``MONARCH_PEER_LEAD``,
    checked when the mesh was spawned: a bad value here leaves them off)."""
    try:
        return peer_lead_enabled()
    except ValueError:
        return False


def exit_process(code: int) -> NoReturn:
    """Leave the process now (no atexit handlers), removing its shared-memory files."""
    try:
        shm.cleanup()
    finally:
        os._exit(code)



class WorkerHost(Protocol):
    """What :class:`WorkerIO` uses of its worker."""

    rank: int
    codec: protocol.Codec
    lane: Lane | None
    dealer: zmq.Socket | None
    up: zmq.Socket | None
    pull: zmq.Socket
    heartbeat: float
    heartbeat_timeout: float
    controller_pid: int | None
    stopping: threading.Event
    #: the worker's detachable part (worker.detach), or None: an ordinary worker
    detach: Any
    actors: dict[str, Any]

    def dispatch(self, msg: protocol.Message) -> None:
        """Route one verified message from the controller."""
        ...

    def leave_if_forked(self, strict: bool = True) -> None:
        """Exit at once in a child that user code forked."""
        ...

    def send_encoded(self, frames: list[Any]) -> None:
        """Send encoded frames to the controller (any thread)."""
        ...


class WorkerIO:
    """The I/O of a worker (see the module docstring); an
    :class:`~monarch_kernel.transport.engine.EngineUser`.

    Parameters
    ----------
    host : WorkerHost
        The worker.
    """

    def __init__(self, host: WorkerHost) -> None:
        self.host = host
        self.last_heard = time.monotonic()  # monotonic time of the last message
        self._lead_waits = 0  # threads in lead_wait
        self._waits_lock = threading.Lock()
        settings = EngineSettings(
            name="monarch-io", idle_ms=100, held_ms=20, backoff_s=0.02,
            held_backoff_s=0.02, max_gap_s=None, nested=False, yield_to_followers=True,
            acquire_limit_s=1.0, survive_step_errors=False,
            follower_poller=host.lane is not None and _peer_lead())
        self.engine = Engine(settings, self, host.stopping)
        self.engine.add(host.pull, self._on_pull, order=PULL_ORDER)
        if host.lane is not None:
            self.engine.add(host.lane.fileno(), self._on_lane, order=CONTROLLER_ORDER)
        else:
            assert host.dealer is not None
            self.engine.add(host.dealer, self._on_dealer, order=CONTROLLER_ORDER)
        self.engine.every(host.heartbeat, self._beat)
        self.engine.every(0, self._check_silence)
        #: messages refused, counted and reported in few lines (util.droplog)
        self.drops = DropLog(log, f"rank {host.rank}")
        self.engine.every(1.0, self.drops.tick)  # (the summary of a flood that ended)

    def start(self) -> None:
        """Start the I/O thread."""
        self.last_heard = time.monotonic()
        self.engine.start()

    @property
    def thread(self) -> threading.Thread:
        """The I/O thread."""
        return self.engine.thread

    # ------------------------------------------------------------ EngineUser
    def on_turn(self) -> bool:
        """Send actors' replies held too long; True if some are still held."""
        held = False
        for inst in list(self.host.actors.values()):
            try:
                held = inst.flush_stale() or held
            except Exception:  # the connection is closing
                log.debug("could not flush held replies", exc_info=True)
        return held

    def may_spin(self) -> bool:
        return False

    def before_step(self) -> None:
        self.host.leave_if_forked(strict=False)  # (a forked child never does the I/O)

    def on_failure(self, error: BaseException) -> None:
        # without this thread the rank is deaf: leave, loudly
        log.error("rank %d: the I/O thread failed; exiting", self.host.rank, exc_info=error)
        exit_process(1)

    def on_close(self) -> None:
        if self.host.dealer is not None:
            self.host.dealer.close(0)
        self.host.pull.close(0)

    # ------------------------------------------------------------ leading
    def wake(self) -> bool:
        """Wake the thread that leads from its poll (any thread; never blocks).
        False if the worker's I/O is closed."""
        return self.engine.wake()

    def lead_until(self, q: queue.Queue[Any], actors: int = 1) -> bool:
        """Do the I/O in this thread until ``q`` has an item (an idle thread:
        the only actor's, or the main thread's while no actor exists,
        ``actors=0``). Returns False, at once, when it cannot lead: more
        actors than ``actors`` run on this worker, or the worker is
        stopping; the caller then waits on ``q`` as usual."""
        running = self.host.actors
        return self.engine.lead(lambda: not q.empty(), None,
                                allowed=lambda: len(running) <= actors) is True

    def lead_wait(self, flag: Flag, timeout: float | None = None) -> bool:
        """Wait until ``flag`` is set, at most ``timeout`` seconds (None: no
        limit), doing the worker's I/O in this thread meanwhile where it may
        lead (a worker with at most one actor): the reply to a peer call that
        this thread made is then read here (a ``Future``'s waiter). True if
        ``flag`` was set.

        The main thread (a cell's call) does not lead here: a Ctrl-C raised in
        the middle of an I/O step could lose messages read in it."""
        if flag.is_set():
            return True
        if threading.current_thread() is threading.main_thread():
            return flag.wait(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        running = self.host.actors
        with self._waits_lock:
            self._lead_waits += 1
        try:
            if self.engine.lead(flag.is_set, deadline,
                                allowed=lambda: len(running) <= 1) is not None:
                return flag.is_set()
        finally:
            with self._waits_lock:
                self._lead_waits -= 1
        return flag.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def wake_leader(self) -> None:
        """Wake a thread that waits in :meth:`lead_wait` (from another thread:
        a request it may wait for was finished there)."""
        if self._lead_waits and self.engine.leader != threading.get_ident():
            self.engine.wake()

    # ------------------------------------------------------------ peer lanes
    @property
    def follower_poller(self) -> FdPoller | None:
        """The followers' poller, which watches shared peer lanes (None: lanes
        are not shared: ZeroMQ to the controller, no EPOLLEXCLUSIVE,
        ``MONARCH_PEER_LEAD=0``)."""
        return self.engine.follower_poller

    def share(self, fd: int, handler: Callable[[int], bool]) -> bool:
        """Watch peer lane ``fd`` in the followers' poller too (any thread;
        ``EPOLLEXCLUSIVE``, registered before the peer I/O thread's):
        ``handler(fd)`` reads it, False if it is no longer shared. False if it
        cannot be shared."""
        engine = self.engine

        def on_input(fd: int) -> None:
            if not handler(fd):
                engine.remove(fd)  # (a lane closed meanwhile: the fd is stale)

        return engine.add(fd, on_input, order=PEER_ORDER, shared=True)

    def unshare(self, fd: int) -> None:
        """Stop watching peer lane ``fd`` in the followers' poller (any thread)."""
        self.engine.remove(fd)

    # ------------------------------------------------------------ a step
    def _on_pull(self, pull: zmq.Socket) -> None:
        dealer = self.host.dealer
        assert dealer is not None  # (frames come here only without a lane or `up`)
        for frames in drain(pull):
            if len(frames) == 1 and not frames[0].buffer.nbytes:
                continue  # (a wake-up)
            send_frames(dealer, frames)  # (only without a lane or `up`)
            self.engine.touched(dealer)

    def _on_lane(self, fd: int) -> None:
        host = self.host
        lane = host.lane
        assert lane is not None
        if host.stopping.is_set():
            return
        self._handle(lane.read())
        if lane.eof and not host.stopping.is_set():
            log.warning("rank %d: the controller closed its lane (it is gone); exiting",
                        host.rank)
            exit_process(messages.EXIT_LANE_CLOSED)

    def _on_dealer(self, dealer: zmq.Socket) -> None:
        if self.host.stopping.is_set():
            return
        self._handle(drain(dealer, small=1))

    def _handle(self, incoming: Any) -> None:
        host = self.host
        for frames in incoming:  # [envelope, buffers...]
            try:
                msg = host.codec.decode(frames, lazy=True)
            except ProtocolError as e:
                self.drops.drop(getattr(e, "reason", "malformed"), str(e), b"controller")
                continue
            self.last_heard = time.monotonic()
            if host.detach is not None and msg.type != "heartbeat":
                host.detach.ordered = self.last_heard  # (see Detachable.lost)
            try:
                host.dispatch(msg)
            except Exception:
                log.exception("rank %d dropped a message it could not dispatch "
                              "(%s)", host.rank, msg.type)

    def _beat(self, now: float) -> None:
        host = self.host
        if host.detach is not None:  # a detachable worker never exits for its controller
            host.detach.beat(now)
            return
        beat = host.codec.encode("heartbeat")
        dealer = host.dealer
        if host.up is not None or host.lane is not None or dealer is None:
            host.send_encoded(beat)
        else:
            send_frames(dealer, beat)
            self.engine.touched(dealer)
        if not self._controller_alive():
            log.warning("rank %d: the controller process is gone; exiting", host.rank)
            exit_process(messages.EXIT_CONTROLLER_GONE)

    def _check_silence(self, now: float) -> None:
        if now - self.last_heard > self.host.heartbeat_timeout:
            if self.host.detach is not None:
                self.host.detach.lost(f"no word from it for {now - self.last_heard:.1f} s")
                return
            log.warning("rank %d: no word from the controller for %.1f s; exiting",
                        self.host.rank, now - self.last_heard)
            exit_process(messages.EXIT_SILENCE)

    def _controller_alive(self) -> bool:
        pid = self.host.controller_pid
        if pid is None:
            return True
        return running(pid)  # (a zombie, killed and not yet reaped, is gone)


def _on_interrupt(worker: Any, msg: protocol.Message) -> None:
    """Interrupt the main thread while it runs a request (SIGINT to it)."""
    if worker.busy:
        signal.pthread_kill(worker.main_thread_id, signal.SIGINT)


def _on_shm_done(worker: Any, msg: protocol.Message) -> None:
    """The controller copied a reply's pooled files: they may be reused."""
    worker.codec.release_shm([n for n in msg.content["names"] if NAME_RE.match(n)])


handlers.register_io("heartbeat", lambda worker, msg: None)  # (it was heard: enough)
handlers.register_io("interrupt", _on_interrupt)
handlers.register_io("shm_done", _on_shm_done)
