"""The controller's I/O: its sockets and lanes on the one I/O engine.

:class:`ControllerIO` is the part of a
:class:`~monarch_kernel.controller.controller.Controller` that does its I/O,
on a :class:`~monarch_kernel.transport.engine.Engine`: whoever leads reads
the ROUTER socket ``router``, the inproc ``pull`` socket (frames other
threads hand over for the ROUTER, and nothing else), the lanes
(:mod:`~monarch_kernel.transport.lane`) and output pipes
(:mod:`~monarch_kernel.controller.output_pipes`) of local workers, checks
ranks and sends heartbeats.

The I/O thread leads by default; a thread that waits for a reply
(:meth:`ControllerIO.wait_for`, used by futures and requests) takes the lead
and reads its reply itself, so a call costs no thread hand-off on the
controller's side (leader/follower, Schmidt et al., POSA2). The I/O thread
steps back while a caller leads and takes the lead again a short grace
after the last one (back-to-back calls then need no wake-up of this
thread), never letting a heartbeat check go by without a step of its own.

A caller that leads looks for its reply on the ROUTER and the lanes for up
to ``spin_s`` (``MONARCH_SPIN_US``, :func:`spin_seconds`) before it sleeps:
the bounded spin of the engine, under its rules (see
:mod:`monarch_kernel.transport.engine`); here a core is to spare
(:meth:`ControllerIO.may_spin`) with at least 2 cores and no more busy local
ranks than cores (``busy`` meaning a request of this controller is pending
there, not measured CPU). Output read from a worker's pipe does not count
as input for the spin.

A SIGINT in the main thread is held back while it leads (bookkeeping
included): ``KeyboardInterrupt`` is raised once the lead is given back.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Protocol

import zmq

from monarch_kernel.controller.request import RankInfo
from monarch_kernel.errors import TransportError
from monarch_kernel.transport.engine import (
    CONTENDED_OFF_S,
    CONTENDED_S,
    MAX_MISSES,
    SPIN_US,
    Engine,
    EngineSettings,
    spin_seconds,
)
from monarch_kernel.transport.lane import Lane
from monarch_kernel.transport.sockets import drain, send_frames
from monarch_kernel.util.droplog import DropLog
from monarch_kernel.util.flag import Flag
from monarch_kernel.util.sigint import DeferredSigint

log = logging.getLogger("monarch_kernel.controller.controller")

__all__ = ["CONTENDED_OFF_S", "CONTENDED_S", "MAX_MISSES", "SPIN_US", "ControllerIO", "IOHost",
           "spin_seconds"]

#: seconds between two checks of the ranks (exits, missed heartbeats)
CHECK_S = 0.05
#: messages read from the ROUTER socket in one step at most (the rest: next step)
READ_MAX = 256
#: the order of sources in a step: output pipes (output_pipes.PIPE_ORDER, 0) come
#: before lanes and sockets, so a reply never overtakes its output
LANE_ORDER, PULL_ORDER, ROUTER_ORDER = 1, 2, 3


class IOHost(Protocol):
    """What :class:`ControllerIO` uses of its controller."""

    ranks: dict[int, RankInfo]
    local_ranks: set[int]
    heartbeat: float
    codec: Any
    drops: DropLog

    def receive(self, frames: list[Any], lane: bytes | None = None) -> None:
        """Handle one message from the ROUTER, or from the lane of identity ``lane``."""
        ...

    def check_ranks(self, now: float) -> None:
        """Watch the ranks (exits, missed heartbeats); ``now``: monotonic seconds."""
        ...

    def send_down(self, ident: bytes, frames: list[Any], retry: float = 2.0) -> bool:
        """Send on the controller -> worker socket."""
        ...

    def held_calls(self) -> bool:
        """Whether calls are held for a batch."""
        ...

    def flush_batches(self, stale_only: bool = False) -> None:
        """Send held calls (``stale_only``: those held long enough)."""
        ...

    def io_ended(self) -> None:
        """The I/O thread ends: fail what is pending, close the output pipes."""
        ...


class ControllerIO:
    """The I/O of a controller (see the module docstring); an
    :class:`~monarch_kernel.transport.engine.EngineUser`.

    Parameters
    ----------
    host : IOHost
        The controller.
    router : zmq.Socket
        The ROUTER socket workers send to (read here only).
    pull : zmq.Socket
        The inproc PULL socket other threads hand ROUTER frames to.
    closed : threading.Event
        Set when the controller closes.
    spin_s : float
        Seconds a waiting caller spins (:func:`spin_seconds`).
    """

    def __init__(self, host: IOHost, router: zmq.Socket, pull: zmq.Socket,
                 closed: threading.Event, spin_s: float) -> None:
        self.host = host
        self.router = router
        self.pull = pull
        self.closed = closed
        #: cores this process may run on (the spin needs 2)
        self.cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
            else (os.cpu_count() or 1)
        self.lanes: dict[int, Lane] = {}  # fd -> lane (the thread that leads only)
        self.lane_of: dict[int, Lane] = {}  # rank -> its current lane
        self.engine = Engine(EngineSettings(name="monarch-controller", spin_s=spin_s),
                             self, closed)
        self.engine.add(router, self._on_router, order=ROUTER_ORDER, spin=True)
        self.engine.add(pull, self._on_pull, order=PULL_ORDER)
        self.engine.every(CHECK_S, host.check_ranks)
        self.engine.every(host.heartbeat, self._beat)
        self.engine.every(1.0, host.drops.tick)  # (the summary of a flood that ended)
        self._lock = threading.Lock()

    def start(self) -> None:
        """Start the I/O thread."""
        self.engine.start()

    # ------------------------------------------------------------ EngineUser
    def on_turn(self) -> bool:
        """Calls held for a batch leave within HOLD_S (the I/O thread)."""
        host = self.host
        if host.held_calls():
            try:
                host.flush_batches(stale_only=True)
            except Exception:  # must not stop the I/O thread
                log.exception("sending held calls failed")
            return host.held_calls()
        return False

    def may_spin(self) -> bool:
        """Whether the spin may run: at least 2 cores, and no more busy local
        ranks than cores. A heuristic ("busy": a request of this controller is
        pending there, not measured CPU): on one core the spin would take the
        time the rank needs, and with more busy ranks than cores a spinning
        caller competes with them."""
        cores = self.cores
        if cores < 2:
            return False
        local = self.host.local_ranks
        if len(local) <= cores:
            return True
        busy = 0
        ranks = self.host.ranks
        for r in list(local):  # (a snapshot: a spawn may add ranks meanwhile)
            info = ranks.get(r)
            if info is not None and info.state == "busy":
                busy += 1
                if busy > cores:
                    return False
        return True

    def before_step(self) -> None:
        pass

    def on_failure(self, error: BaseException) -> None:
        log.error("the controller I/O thread failed", exc_info=error)

    def on_close(self) -> None:
        self.host.io_ended()
        self.router.close(0)
        self.pull.close(0)

    # ------------------------------------------------------------ waiting
    def wait_for(self, event: Flag | threading.Event, timeout: float | None = None) -> bool:
        """Wait until ``event`` is set, doing the controller's I/O meanwhile.

        The calling thread leads the I/O (see above) while it waits, so the
        reply it waits for is read and handled in this thread. Falls back to
        a plain wait when the controller is closed.

        Parameters
        ----------
        event : Flag or threading.Event
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
        if self.host.held_calls():  # calls held for a batch leave before anyone waits
            self.host.flush_batches()
        deadline = None if timeout is None else time.monotonic() + timeout
        engine = self.engine
        if engine.leads_here():
            # nested (a callback waits, on a thread that leads): go on leading here
            engine.lead(event.is_set, deadline)
            return event.is_set()
        # a SIGINT in the main thread is held back over all of this (bookkeeping
        # included): KeyboardInterrupt is raised when the lead is given back
        with DeferredSigint() as sigint:
            led = engine.lead(event.is_set, deadline, interrupted=lambda: sigint.hit is not None)
        if led is None:  # closed (or closing): the I/O thread fails what is pending
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            return event.wait(left)
        return led or event.is_set()

    def defer_io(self) -> None:
        """Keep the I/O thread from reading for a short grace: the calling
        thread sent a request it will wait for (an actor call), and reads the
        replies itself then. During a burst of calls, replies then wait in
        their socket's queue instead of being handled by a second thread that
        competes with the sender for the GIL."""
        self.engine.defer()

    def resume_io(self) -> None:
        """Let the I/O thread read again at once (undoes :meth:`defer_io`): a
        coroutine that awaits a reply cannot lead, the I/O thread reads it."""
        self.engine.resume()
        if self.host.held_calls():  # (the coroutine awaits: held calls leave now)
            self.host.flush_batches()

    # ------------------------------------------------------------ lanes
    def adopt_lane(self, rank: int, sock: Any) -> None:
        """Take the controller's end of a lane to local worker ``rank``
        (:mod:`monarch_kernel.transport.lane`; any thread): its messages go that way
        from now on, and the thread that leads reads it. A lane the rank
        had before (a restart) is read to its end, then closed."""
        # routed with an identity of its own (learnt from the signed hello, as a socket's)
        ident = f"lane.{rank}.{sock.fileno()}.{time.monotonic_ns()}".encode()
        lane = Lane(sock, f"lane-r{rank}", ident)
        fd = lane.fileno()
        with self._lock:
            self.lane_of[rank] = lane
            self.lanes[fd] = lane
        self.engine.add(fd, self._on_lane, order=LANE_ORDER, spin=True)

    def _on_lane(self, fd: int) -> None:
        """Handle what came on a lane; close it at its end (the rank exited)."""
        lane = self.lanes.get(fd)
        if lane is None:
            return
        try:
            messages = lane.read()
        except Exception:  # (out of memory for a huge message, ...): the lane is lost
            log.exception("the controller cannot read %s; closing it", lane.name)
            messages = []
            lane.eof = True
        for frames in messages:
            try:
                self.host.receive(frames, lane.identity)
            except Exception:
                log.exception("the controller dropped a message it could not handle")
        if lane.eof:
            with self._lock:
                if self.lanes.get(fd) is lane:
                    del self.lanes[fd]
            self.engine.remove(fd)
            lane.close()

    def close_lanes(self) -> None:
        """Close every lane (holding the lead, or once nobody leads)."""
        with self._lock:
            lanes = [*self.lane_of.values(), *self.lanes.values()]
        for lane in lanes:
            lane.close()

    # ------------------------------------------------------------ sockets
    def _on_pull(self, pull: zmq.Socket) -> None:
        router = self.router
        for frames in drain(pull):
            if len(frames) == 1:  # (a wake-up)
                continue
            self.engine.touched(router)  # (a send may take the signal of an input)
            try:
                send_frames(router, frames)
            except zmq.ZMQError as e:  # host unreachable: the rank is gone
                log.debug("cannot send to %r: %s", frames[0].bytes, e)

    def _on_router(self, router: zmq.Socket) -> None:
        # at most READ_MAX messages a step: what is left is read at the next step (the
        # poller asks the socket again before it waits), after the duties of this
        # one, so a flood of messages never holds up heartbeats and checks of ranks
        for n, frames in enumerate(drain(router, small=2), 1):  # [identity, envelope, ...]
            try:
                self.host.receive(frames)
            except Exception:
                log.exception("the controller dropped a message it could not handle")
            if n >= READ_MAX:
                break

    def _beat(self, now: float) -> None:
        """Send a heartbeat to every rank that is up (the thread that leads)."""
        host = self.host
        beat = host.codec.encode("heartbeat")
        for info in list(host.ranks.values()):
            if info.state not in ("dead", "stopped", "starting") and info.identity:
                lane = self.lane_of.get(info.rank)
                if lane is not None:
                    try:
                        lane.send(beat)
                    except TransportError:
                        pass
                    continue
                if info.down:
                    host.send_down(info.identity, beat, retry=0)
                    continue
                self.engine.touched(self.router)
                try:
                    send_frames(self.router, [info.identity, *beat])
                except zmq.ZMQError:
                    pass

