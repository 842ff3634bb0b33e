"""The I/O of a worker's :class:`~monarch_kernel.actor.peers.PeerHost`.

:class:`PeerIO` is the part of a ``PeerHost`` that does its I/O, on a
:class:`~monarch_kernel.transport.engine.Engine` whose thread
(``monarch-peer``) reads the peer ROUTER, the DEALERs to peers on other
hosts, the lane listener and the peer lanes, and sends what other threads
hand it through the outbox. Nobody else leads this engine; instead, the peer
lanes are shared with the thread that leads the *worker's* I/O (an idle
actor's, a caller's waiting for its reply: :mod:`monarch_kernel.worker.io`):
each lane is watched by both with ``EPOLLEXCLUSIVE``, the worker's
followers' poller first (:meth:`PeerIO.watch`), and read by one thread at a
time (:meth:`PeerIO.drain`). A leader/follower pair across two engines.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Protocol

import zmq

from monarch_kernel.errors import TransportError
from monarch_kernel.transport import lane as _lane
from monarch_kernel.transport import peer_lanes
from monarch_kernel.transport.engine import Engine, EngineSettings
from monarch_kernel.transport.sockets import (
    FdPoller,
    connect_dealer,
    curve_client_keypair,
    drain,
    send_frames,
)

log = logging.getLogger("monarch_kernel.actor.actor_mesh")

__all__ = ["READ_WAIT_S", "PeerIO", "PeerIOHost"]

#: seconds a thread waits for a peer lane that the other thread watching it reads
READ_WAIT_S = 0.005
#: messages read from the peer ROUTER socket in one step at most (the rest: next step)
READ_MAX = 256


class PeerIOHost(Protocol):
    """What :class:`PeerIO` uses of its :class:`~monarch_kernel.actor.peers.PeerHost`
    (the lane bookkeeping it shares with the host's callers, under ``lanes_lock``)."""

    rank: int
    worker: Any
    codec: Any
    ctx: zmq.Context
    router: zmq.Socket
    pull: zmq.Socket
    listener: tuple[Any, str] | None
    outbox: Any
    messages_out: int
    messages_led: int
    lanes_lock: threading.Lock  # (replaced in a forked child: read it each time)
    lane_to: dict[str, _lane.Lane | None]
    lane_addrs: dict[_lane.Lane, str]
    new_lanes: list[_lane.Lane]
    accepted: dict[bytes, _lane.Lane]
    codec_of_addr: dict[str, Any]
    identity: bytes

    def incoming(self, frames: list[Any], lane: bytes | None = None) -> None:
        """Handle a call (or event) from a peer: by the ROUTER, or on lane ``lane``."""
        ...

    def reply(self, frames: list[Any], codec: Any = None) -> None:
        """Handle a reply from a peer."""
        ...

    def lane_limit(self) -> int:
        """The largest message a peer lane takes (bytes)."""
        ...


class PeerIO:
    """The peer I/O of a ``PeerHost`` (see the module docstring); an
    :class:`~monarch_kernel.transport.engine.EngineUser`.

    Parameters
    ----------
    host : PeerIOHost
    """

    def __init__(self, host: PeerIOHost) -> None:
        self.host = host
        self.stop = threading.Event()  # (a peer host lives as long as its worker)
        self.engine = Engine(EngineSettings(name="monarch-peer", idle_ms=1000, max_gap_s=None,
                                            survive_step_errors=False), self, self.stop)
        self.dealers: dict[str, zmq.Socket] = {}  # peer address -> DEALER
        self._addr_of: dict[zmq.Socket, str] = {}  # DEALER -> the peer address
        self.lanes: dict[int, _lane.Lane] = {}  # fd -> lane (both ways; the I/O thread)
        #: lanes the worker's leading thread watches too (fd -> lane; see watch)
        self.shared: dict[int, _lane.Lane] = {}
        self._dead_lanes: list[_lane.Lane] = []  # lanes to ranks declared dead: to close
        self._lanes_due = False  # the I/O thread owes itself an "n" (see to_io)
        self.engine.add(host.router, self._on_router)
        self.engine.add(host.pull, self._on_pull)
        self._listen_fd = -1
        if host.listener is not None:
            self._listen_fd = host.listener[0].fileno()
            self.engine.add(self._listen_fd, self._accept)
        # (out of fds: the listener is unwatched for a while, then watched again)
        self._listen_again = self.engine.every(peer_lanes.ACCEPT_RETRY_S, self._listen,
                                               active=False)
        drops = getattr(host, "drops", None)
        if drops is not None:  # (the summary of a flood of bad messages that ended)
            self.engine.every(1.0, drops.tick)

    @property
    def thread(self) -> threading.Thread:
        """The peer I/O thread."""
        return self.engine.thread

    def start(self) -> None:
        """Start the peer I/O thread."""
        self.engine.start()

    # ------------------------------------------------------------ EngineUser
    def on_turn(self) -> bool:
        return False

    def may_spin(self) -> bool:
        return False

    def before_step(self) -> None:
        if self._lanes_due:  # (asked for by this thread: to_io)
            self._lanes_due = False
            self._update_lanes()

    def on_failure(self, error: BaseException) -> None:
        log.error("the peer I/O thread of rank %d failed", self.host.rank, exc_info=error)

    def on_close(self) -> None:
        pass

    # ------------------------------------------------------------ hand-offs
    def to_io(self, parts: list[Any]) -> None:
        """Hand ``parts`` to the I/O thread (any thread): through the outbox, or
        at once when this is the I/O thread (serving a buffer read that came on
        the ROUTER, say): through the outbox it would wait on itself once the
        pipe is full, after some 2,000 such reads came at once.

        Raises
        ------
        TransportError
            If the outbox is closed.
        """
        if threading.current_thread() is self.engine.thread and self.engine.running:
            if parts[0] == b"n":  # (lanes to watch or close: at the top of the next turn,
                self._lanes_due = True  # not from inside the handling of one of them)
                return
            self._forward([p if isinstance(p, zmq.Frame) else zmq.Frame(p) for p in parts])
        else:
            self.host.outbox.send(parts)

    def close_later(self, lane: _lane.Lane) -> None:
        """Have the I/O thread close ``lane`` (any thread)."""
        with self.host.lanes_lock:
            self._dead_lanes.append(lane)
        try:
            self.to_io([b"n"])
        except TransportError:  # (closing: the I/O thread closes them all)
            pass

    # ------------------------------------------------------------ sources
    def _on_pull(self, pull: zmq.Socket) -> None:
        for frames in drain(pull):
            self._forward(frames)

    def _on_router(self, router: zmq.Socket) -> None:
        for n, frames in enumerate(drain(router, small=2), 1):  # [identity, envelope, ...]
            self.host.incoming(frames)
            if n >= READ_MAX:  # (the rest at the next step: the poller asks again)
                break

    def _on_dealer(self, sock: zmq.Socket) -> None:
        h = self.host
        codec = h.codec_of_addr.get(self._addr_of[sock], h.codec)
        for frames in drain(sock, small=1):  # [envelope, buffers...]
            h.reply(frames, codec)

    def _forward(self, frames: list[Any]) -> None:
        h = self.host
        kind = frames[0].bytes
        try:
            if kind == b"n":
                self._update_lanes()
                return
            if kind == b"r":
                send_frames(h.router, frames[1:], zmq.NOBLOCK)
                self.engine.touched(h.router)
            else:
                addr = frames[1].bytes.decode()
                s = self.dealers.get(addr)
                if s is None:
                    endpoint, _, key = addr.partition(";")[0].partition("|")
                    # (the client key of the callee's mesh, which its peer socket admits)
                    client = (curve_client_keypair(h.codec_of_addr.get(addr, h.codec).key)
                              if key else None)
                    s = self.dealers[addr] = connect_dealer(h.ctx, endpoint, h.identity,
                                                            key.encode() or None, client)
                    self._addr_of[s] = addr
                    self.engine.add(s, self._on_dealer)
                send_frames(s, frames[2:], zmq.NOBLOCK)
                self.engine.touched(s)
            h.messages_out += 1
        except zmq.ZMQError as e:  # the peer is gone or not reading: never block here
            log.warning("rank %d dropped a message to a peer: %s", h.rank, e)

    def _update_lanes(self) -> None:
        """Watch the peer lanes that callers made; close those to dead ranks (the
        I/O thread, told by an ``n``)."""
        h = self.host
        with h.lanes_lock:
            new, h.new_lanes[:] = list(h.new_lanes), []
            dead, self._dead_lanes = self._dead_lanes, []
        for lane in new:
            self.watch(lane)
        for lane in dead:
            if self.lanes.get(lane.fileno()) is lane:
                lane.eof = True
                self._read_lane(lane)  # (at eof: forgets and closes it)

    def _accept(self, listen_fd: int) -> None:
        """Take the connections waiting on the lane listener (the I/O thread)."""
        h = self.host
        assert h.listener is not None
        while True:
            try:
                sock, _ = h.listener[0].accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # out of fds, say: the connection waits in the backlog,
                # so the listener, level-triggered, would be ready again at once
                log.warning("rank %d cannot accept a peer lane (%s); trying again in "
                            "%.1f s", h.rank, e, peer_lanes.ACCEPT_RETRY_S)
                self.engine.remove(listen_fd)
                self._listen_again.last = time.monotonic()
                self._listen_again.active = True
                return
            if peer_lanes.peer_uid(sock) != os.getuid():  # another user's process
                log.warning("rank %d refused a peer lane from another user", h.rank)
                sock.close()
                continue
            _lane.set_buffers(sock)
            ident = peer_lanes.LANE_IDENT + str(next(peer_lanes.accepted_ids)).encode()
            lane = _lane.Lane(sock, f"peer lane {ident!r}", identity=ident,
                              limit=h.lane_limit())
            h.accepted[ident] = lane
            self.watch(lane)

    def _listen(self, now: float) -> None:
        """Watch the lane listener again (a while after it ran out of fds)."""
        self._listen_again.active = False
        self.engine.add(self._listen_fd, self._accept)

    # ------------------------------------------------------------ lanes
    def worker_poller(self) -> FdPoller | None:
        """The worker's followers' poller, where peer lanes are watched too (None:
        the worker has none: ZeroMQ to its controller, no EPOLLEXCLUSIVE,
        MONARCH_PEER_LEAD=0)."""
        io = getattr(self.host.worker, "io", None)
        return None if io is None else io.follower_poller

    def watch(self, lane: _lane.Lane) -> None:
        """Watch a new peer lane (the I/O thread): in the worker's followers'
        poller first, then in this thread's, both with ``EPOLLEXCLUSIVE``. So
        a thread of the worker that leads its I/O and waits in its poll (an
        idle actor's thread, a caller waiting for a reply:
        :mod:`monarch_kernel.worker.io`) is the one woken by a message on the
        lane, and reads it itself, with no hand-off to or from this thread;
        this thread reads it when nobody waits there (the actor is busy:
        buffer reads are served at once all the same)."""
        h = self.host
        fd = lane.fileno()
        shared = False
        if self.worker_poller() is not None:
            with h.lanes_lock:
                self.shared[fd] = lane
            shared = h.worker.io.share(fd, self.read_shared)
            if not shared:  # (the worker is stopping: its poller is closed)
                with h.lanes_lock:
                    self.shared.pop(fd, None)
        self.lanes[fd] = lane
        self.engine.add(fd, self._on_lane, exclusive=shared)

    def read_shared(self, fd: int) -> bool:
        """Read and handle the peer lane ``fd`` (the thread that leads the
        worker's I/O, whose poll found it ready); False if ``fd`` is not a
        shared peer lane. A lane at its end is left to this host's I/O
        thread to close (it is unwatched there at once)."""
        lane = self.shared.get(fd)
        if lane is None:
            return False
        n = self.drain(lane)
        if n is None:
            return True  # (the other thread reads it: it sees the end, if that is it)
        self.host.messages_led += n
        if lane.eof and self._unshare(lane, fd):
            self.close_later(lane)
        return True

    def _unshare(self, lane: _lane.Lane, fd: int) -> bool:
        """Stop the worker's leading threads watching ``lane`` (at its end: else
        they would be woken by it at every poll); False if they did not."""
        h = self.host
        with h.lanes_lock:  # (only this lane: its fd may be another's by now)
            if self.shared.get(fd) is not lane:
                return False
            del self.shared[fd]
        if self.worker_poller() is not None:
            h.worker.io.unshare(fd)
        return True

    def drain(self, lane: _lane.Lane, wait: bool = False) -> int | None:
        """Read ``lane`` and handle its messages, holding its ``read_lock``
        all along (messages of one lane are handled in order, whichever of
        two threads reads them); how many it handled, or None, having read
        nothing, if another thread held it for READ_WAIT_S (``wait``: as
        long as it takes).

        A thread that gives up says so (``lane.missed``), and the holder
        reads again before it lets go: with ``EPOLLEXCLUSIVE`` the input
        that woke the one that gave up woke no other thread, and would
        wait for the next message on the lane. Both sides decide under
        ``lane.miss_lock``, so either the holder sees the flag or the other
        gets the lane."""
        h = self.host
        if not lane.read_lock.acquire(timeout=-1 if wait else READ_WAIT_S):
            with lane.miss_lock:
                if not lane.read_lock.acquire(blocking=False):
                    lane.missed = True
                    return None
        count = 0
        held = True
        codec = h.codec if lane.identity else h.codec_of_addr.get(
            h.lane_addrs.get(lane, ""), h.codec)
        try:
            while True:
                messages: list[Any] = []
                if not lane.eof:
                    try:
                        messages = lane.read()
                    except Exception as e:  # noqa: BLE001 - over the limit, out of memory
                        log.warning("rank %d dropped a peer lane: %s", h.rank, e)
                        lane.eof = True
                for frames in messages:
                    if lane.identity:
                        h.incoming(frames, lane.identity)
                    else:
                        h.reply(frames, codec)
                count += len(messages)
                with lane.miss_lock:
                    if not lane.missed:
                        held = False
                        lane.read_lock.release()
                        return count
                    lane.missed = False
        finally:
            if held:
                lane.read_lock.release()

    def _on_lane(self, fd: int) -> None:
        lane = self.lanes.get(fd)
        if lane is not None:
            self._read_lane(lane)

    def _read_lane(self, lane: _lane.Lane) -> None:
        """Handle what came on a peer lane: calls on a lane a peer made to this
        worker, replies on one this worker made (the I/O thread)."""
        h = self.host
        if self.drain(lane, wait=lane.eof) is None:
            return  # (the worker's leading thread reads it now: ready again later)
        if lane.eof:  # the other process is gone (or closed it)
            fd = lane.fileno()
            self._unshare(lane, fd)
            self.engine.remove(fd)
            del self.lanes[fd]
            lane.close()
            if lane.identity:
                h.accepted.pop(lane.identity, None)
            else:
                with h.lanes_lock:  # a later message tries again, else ZeroMQ
                    h.lane_addrs.pop(lane, None)
                    for addr, other in list(h.lane_to.items()):
                        if other is lane:
                            del h.lane_to[addr]
