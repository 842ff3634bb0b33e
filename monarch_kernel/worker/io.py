"""A worker's I/O: leader/follower over its connection to the controller.

Whoever holds ``_lead`` reads the controller's messages and dispatches
them (calls to actors' queues, requests to the main thread's queue,
interrupts, debugger input), sends heartbeats and watches the controller.
The I/O thread leads by default; the thread of the worker's only actor
leads while it is idle (:meth:`WorkerIO.lead_until`), so a call is read by
the thread that runs it, with no hand-off between threads; so does the main
thread, which runs cells, while the worker has no actor. The I/O thread
takes the lead again 10-30 ms after the actor stopped leading (while the
actor runs a call).

Peer lanes (actors' calls between workers) are watched here too, as well
as by the peer I/O thread, with ``EPOLLEXCLUSIVE``, this worker's poller
first: a call from a peer wakes the idle actor's thread, which runs it with
no hand-off; a thread that made a peer call and waits for its reply leads
while it waits (:meth:`WorkerIO.lead_wait`) and reads the reply itself.
They use a poller of their own (``_lead_poller``, the same fds and the peer
lanes); the I/O thread's does not watch peer lanes, so a buffer read never
holds up its heartbeats and interrupts. Whatever comes while nobody waits
in the lead poller (the actor is busy, a worker of several actors) wakes
the peer I/O thread instead, as before. ``MONARCH_PEER_LEAD=0`` turns this
off. :class:`WorkerIO` is a mixin of
:class:`~monarch_kernel.worker.worker.Worker` and uses its sockets and queues.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Any, NoReturn

import zmq

from monarch_kernel.errors import ProtocolError
from monarch_kernel.transport.sockets import FdPoller, drain, send_frames
from monarch_kernel.util.switches import peer_lead_enabled
from monarch_kernel.wire import protocol, shm
from monarch_kernel.wire.shm import NAME_RE
from monarch_kernel.worker import handlers

log = logging.getLogger("monarch_kernel.worker.worker")

__all__ = ["WorkerIO"]


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


class WorkerIO:
    """The I/O half of a worker (see the module docstring)."""

    def _io_loop(self) -> None:
        self._last_heard = self._last_sent = time.monotonic()
        try:
            lead_poller = None
            if self.lane is not None:  # one epoll_wait a step (transport.FdPoller)
                poller: Any = FdPoller()
                poller.register(self.lane.fileno(), zmq.POLLIN)
                if poller.exclusive and _peer_lead():
                    # the one actor's or a waiting caller's: the same, and peer lanes
                    lead_poller = FdPoller()
                    lead_poller.register(self.lane.fileno())
                    lead_poller.register(self.pull)
            else:
                poller = zmq.Poller()
                poller.register(self.dealer, zmq.POLLIN)
            poller.register(self.pull, zmq.POLLIN)
            self._lead_poller = lead_poller
            self._poller = poller
            while not self.stopping.is_set():
                if self._want or time.monotonic() - self._led_at < 0.01:
                    time.sleep(0.02)  # an actor leads, or led just now
                    self._flush_stale_replies()
                    continue
                with self._lead:
                    if not self._want:
                        held = self._flush_stale_replies()
                        self._leader = threading.get_ident()
                        if self._lead_poller is not None:
                            poller.touched(self.pull)  # (see _lead_while)
                        try:
                            self._io_step(20 if held else 100)
                        finally:
                            self._leader = None
        except BaseException:  # without this thread the rank is deaf: leave, loudly
            log.exception("rank %d: the I/O thread failed; exiting", self.rank)
            exit_process(1)
        finally:
            with self._lead:
                if isinstance(self._poller, FdPoller):
                    self._poller.close()
                lead_poller, self._lead_poller = self._lead_poller, None
                if lead_poller is not None:  # (peer threads may still touch it: see
                    lead_poller.close()  # FdPoller.unregister; _watch stops sharing)
                if self.dealer is not None:
                    self.dealer.close(0)
                self.pull.close(0)

    def _flush_stale_replies(self) -> bool:
        """Send actors' replies held too long; True if some are still held."""
        held = False
        for inst in list(self.actors.values()):
            try:
                held = inst.flush_stale() or held
            except Exception:  # noqa: BLE001 - the connection is closing
                log.debug("could not flush held replies", exc_info=True)
        return held

    def wake(self) -> bool:
        """Wake the thread that leads from its poll (any thread; never blocks:
        with as many wake-ups queued as the pipe holds, the leader has enough
        to wake it, and it is the only thread that reads them). False if the
        worker is closing."""
        try:
            self.outbox.try_send([b""])
        except Exception:  # noqa: BLE001 - closing: nobody to wake
            return False
        return True

    def lead_until(self, q: Any, actors: int = 1) -> bool:
        """Do the I/O in this thread until ``q`` has an item (an idle thread:
        the only actor's, or the main thread's while no actor exists,
        ``actors=0``). Returns False, at once, when it cannot lead: more
        actors than ``actors`` run on this worker, or the worker is
        stopping; the caller then waits on ``q`` as usual."""
        return self._lead_while(lambda: q.empty(), actors, None) is True

    def lead_wait(self, flag: Any, timeout: float | None = None) -> bool:
        """Wait until ``flag`` (a :class:`~monarch_kernel.util.flag.Flag`) is set, at
        most ``timeout`` seconds (None: no limit), doing the worker's I/O in
        this thread meanwhile where it may lead (a worker with at most one
        actor): the reply to a peer call that this thread made is then read
        here (a ``Future``'s waiter). True if ``flag`` was set.

        The main thread (a cell's call) does not lead here: a Ctrl-C raised in
        the middle of an I/O step could lose messages read in it."""
        if flag.is_set():
            return True
        if threading.current_thread() is threading.main_thread():
            return flag.wait(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._want_lock:
            self._lead_waits += 1
        try:
            if self._lead_while(lambda: not flag.is_set(), 1, deadline) is not None:
                return flag.is_set()
        finally:
            with self._want_lock:
                self._lead_waits -= 1
        return flag.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def wake_leader(self) -> None:
        """Wake a thread that waits in :meth:`lead_wait` (from another thread:
        a request it may wait for was finished there)."""
        if self._lead_waits and self._leader != threading.get_ident():
            self.wake()

    def _lead_while(self, more: Any, actors: int, deadline: float | None) -> bool | None:
        """Lead the I/O while ``more()`` (an idle or waiting thread): True once it
        is false, False at the deadline; None when this thread cannot lead
        (more actors than ``actors``, another thread wants to, stopping)."""
        if len(self.actors) > actors or self.stopping.is_set() or self._poller is None:
            return None
        if self._leader == threading.get_ident():
            return None  # (nested: it leads already, further up its stack)
        with self._want_lock:
            self._want += 1
        try:
            if not self._lead.acquire(blocking=False):
                if not self.wake():  # the I/O thread leaves its poll and steps back
                    return None
                wait_s = 1.0 if deadline is None else min(1.0, deadline - time.monotonic())
                if not self._lead.acquire(timeout=max(0.0, wait_s)):
                    return None
            outer, self._leader = self._leader, threading.get_ident()
            poller = self._lead_poller or self._poller
            if poller is not self._poller:
                poller.touched(self.pull)  # (the other poller may have taken its signal)
            try:
                while more():
                    if self.stopping.is_set() or len(self.actors) > actors or self._want > 1:
                        return None  # (another actor thread wants to lead: let it)
                    wait_ms = 50
                    if deadline is not None:
                        left = deadline - time.monotonic()
                        if left <= 0:
                            return False
                        wait_ms = max(1, min(50, int(left * 1000)))
                    self._io_step(wait_ms, poller)
                return True
            finally:
                self._leader = outer
                self._led_at = time.monotonic()
                self._lead.release()
        finally:
            with self._want_lock:
                self._want -= 1

    def _io_step(self, timeout_ms: int, poller: Any = None) -> None:
        """One turn of the I/O (by whichever thread leads; ``poller``: the
        I/O thread's, by default, or the one that watches peer lanes too)."""
        self.leave_if_forked(strict=False)  # (a forked child never does the worker's I/O)
        poller = poller or self._poller
        events = dict(poller.poll(timeout_ms))
        if self.pull in events:
            for frames in drain(self.pull):
                if len(frames) == 1 and not frames[0].buffer.nbytes:
                    continue  # a wake-up (an actor thread that leads)
                send_frames(self.dealer, frames)  # (only without a lane or `up`)
        if self.stopping.is_set():
            return
        if self.lane is not None:
            lane_fd = self.lane.fileno()
            incoming = self.lane.read() if events.get(lane_fd) else []
            if len(events) > (self.pull in events) + (lane_fd in events):
                for obj in events:  # peer lanes (see the module docstring)
                    if isinstance(obj, int) and obj != lane_fd and not \
                            handlers.read_shared_fd(obj):
                        poller.unregister(obj)  # (a lane closed meanwhile: the fd is stale)
        else:
            incoming = drain(self.dealer, small=1) if self.dealer in events else ()
        for frames in incoming:  # [envelope, buffers...]
            try:
                msg = self.codec.decode(frames, lazy=True)
            except ProtocolError as e:
                log.warning("rank %d dropped a message: %s", self.rank, e)
                continue
            self._last_heard = time.monotonic()
            try:
                self._dispatch(msg)
            except Exception:
                log.exception("rank %d dropped a message it could not dispatch "
                              "(%s)", self.rank, msg.type)
        if self.lane is not None and self.lane.eof and not self.stopping.is_set():
            log.warning("rank %d: the controller closed its lane (it is gone); exiting",
                        self.rank)
            exit_process(0)
        now = time.monotonic()
        if now - self._last_sent >= self.heartbeat:
            self._last_sent = now
            beat = self.codec.encode("heartbeat")
            if self.up is not None or self.lane is not None:
                self._send_frames(beat)
            else:
                send_frames(self.dealer, beat)
            if not self._controller_alive():
                log.warning("rank %d: the controller process is gone; exiting", self.rank)
                exit_process(0)
        if now - self._last_heard > self.heartbeat_timeout:
            log.warning(
                "rank %d: no word from the controller for %.1f s; exiting",
                self.rank, now - self._last_heard,
            )
            exit_process(0)

    def _controller_alive(self) -> bool:
        if self.controller_pid is None:
            return True
        try:
            os.kill(self.controller_pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def _dispatch(self, msg: protocol.Message) -> None:
        """Route ``msg``: its I/O-thread handler runs now; anything else is a
        request for the main thread's queue (see :mod:`monarch_kernel.worker.handlers`)."""
        handler = handlers.lookup(msg.type)
        if handler is not None and handler.thread is handlers.Thread.IO:
            handler.fn(self, msg)
        else:
            self.requests.put(msg)


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
