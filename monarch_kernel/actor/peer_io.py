"""The I/O half of a worker's :class:`~monarch_kernel.actor.peers.PeerHost`.

:class:`PeerIO` is a mixin of ``PeerHost`` (as :mod:`~monarch_kernel.worker.io`
is of the worker): the loop of the peer I/O thread (``monarch-peer``), which
reads the peer ROUTER, the DEALERs to peers on other hosts, the lane
listener and the peer lanes, and sends what other threads hand it through
the outbox; and the peer lanes it shares with the thread that leads the
worker's I/O (an idle actor's, a caller's waiting for its reply): each lane
is watched by both with ``EPOLLEXCLUSIVE``, the worker's lead poller first
(:meth:`PeerIO._watch`), and read by one thread at a time
(:meth:`PeerIO._drain`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import zmq

from monarch_kernel.transport import lane as _lane
from monarch_kernel.transport import peer_lanes
from monarch_kernel.errors import TransportError
from monarch_kernel.transport.sockets import FdPoller, connect_dealer, drain, send_frames

log = logging.getLogger("monarch_kernel.actor.actor_mesh")

__all__ = ["READ_WAIT_S", "PeerIO"]

#: seconds a thread waits for a peer lane that the other thread watching it reads
READ_WAIT_S = 0.005


class PeerIO:
    """The peer I/O thread's side of a :class:`~monarch_kernel.actor.peers.PeerHost`
    (see the module docstring); uses the host's sockets, lanes and locks."""

    def _to_io(self, parts: list[Any]) -> None:
        """Hand ``parts`` to the I/O thread (any thread): through the outbox, or
        at once when this is the I/O thread (serving a buffer read that came on
        the ROUTER, say): through the outbox it would wait on itself once the
        pipe is full, after some 2,000 such reads came at once."""
        if threading.get_ident() == self._thread.ident and self._io_state is not None:
            if parts[0] == b"n":  # (lanes to watch or close: at the top of the next turn,
                self._lanes_due = True  # not from inside the handling of one of them)
                return
            self._forward([p if isinstance(p, zmq.Frame) else zmq.Frame(p) for p in parts],
                          *self._io_state)
        else:
            self.outbox.send(parts)

    def _loop(self) -> None:
        poller = FdPoller()
        poller.register(self.router)
        poller.register(self.pull)
        listen_fd = -1
        if self.listener is not None:
            listen_fd = self.listener[0].fileno()
            poller.register(listen_fd)
        dealers: dict[str, zmq.Socket] = {}
        socks: dict[zmq.Socket, str] = {}  # dealer -> the peer address it is connected to
        lanes: dict[int, _lane.Lane] = {}  # fd -> lane (both ways)
        self._io_state = (dealers, socks, poller, lanes)  # (for _to_io, in this thread)
        try:
            while True:
                wait = 1000
                if self._lanes_due:  # (asked for by this thread: _to_io)
                    self._lanes_due = False
                    self._update_lanes(poller, lanes)
                if self._listen_paused:  # (out of fds a moment ago: see _accept)
                    left = self._listen_paused - time.monotonic()
                    if left <= 0:
                        self._listen_paused = 0.0
                        poller.register(listen_fd)
                    else:
                        wait = int(left * 1000) + 1
                for obj, _ev in poller.poll(wait):
                    if obj is self.pull:
                        for frames in drain(self.pull):
                            self._forward(frames, dealers, socks, poller, lanes)
                    elif obj is self.router:
                        for frames in drain(self.router, small=2):  # [identity, envelope, ...]
                            self._incoming(frames)
                    elif obj in socks:
                        codec = self._codec_of_addr.get(socks[obj], self.codec)
                        for frames in drain(obj, small=1):  # [envelope, buffers...]
                            self._reply(frames, codec)
                    elif obj == listen_fd:
                        self._accept(poller, lanes)
                    else:
                        lane = lanes.get(obj)
                        if lane is not None:
                            self._read_lane(lane, poller, lanes)
        except Exception:
            log.exception("the peer I/O thread of rank %d failed", self.rank)

    def _forward(self, frames: list[Any], dealers: dict[str, zmq.Socket],
                 socks: dict[zmq.Socket, str], poller: FdPoller,
                 lanes: dict[int, _lane.Lane]) -> None:
        kind = frames[0].bytes
        try:
            if kind == b"n":
                self._update_lanes(poller, lanes)
                return
            if kind == b"r":
                send_frames(self.router, frames[1:], zmq.NOBLOCK)
                poller.touched(self.router)
            else:
                addr = frames[1].bytes.decode()
                s = dealers.get(addr)
                if s is None:
                    endpoint, _, key = addr.partition(";")[0].partition("|")
                    s = dealers[addr] = connect_dealer(self.ctx, endpoint, self._ident,
                                                       key.encode() or None)
                    socks[s] = addr
                    poller.register(s)
                send_frames(s, frames[2:], zmq.NOBLOCK)
                poller.touched(s)
            self.messages_out += 1
        except zmq.ZMQError as e:  # the peer is gone or not reading: never block here
            log.warning("rank %d dropped a message to a peer: %s", self.rank, e)

    def _update_lanes(self, poller: FdPoller, lanes: dict[int, _lane.Lane]) -> None:
        """Watch the peer lanes that callers made; close those to dead ranks (the
        I/O thread, told by an ``n``)."""
        with self._lanes_lock:
            new, self._new_lanes = self._new_lanes, []
            dead, self._dead_lanes = self._dead_lanes, []
        for lane in new:
            self._watch(lane, poller, lanes)
        for lane in dead:
            if lanes.get(lane.fileno()) is lane:
                lane.eof = True
                self._read_lane(lane, poller, lanes)  # (at eof: forgets and closes it)

    def _close_later(self, lane: _lane.Lane) -> None:
        """Have the I/O thread close ``lane`` (any thread)."""
        with self._lanes_lock:
            self._dead_lanes.append(lane)
        try:
            self._to_io([b"n"])
        except TransportError:  # (closing: the I/O thread closes them all)
            pass

    def _accept(self, poller: FdPoller, lanes: dict[int, _lane.Lane]) -> None:
        """Take the connections waiting on the lane listener (the I/O thread)."""
        assert self.listener is not None
        while True:
            try:
                sock, _ = self.listener[0].accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # out of fds, say: the connection waits in the backlog,
                # so the listener, level-triggered, would be ready again at once
                log.warning("rank %d cannot accept a peer lane (%s); trying again in "
                            "%.1f s", self.rank, e, peer_lanes.ACCEPT_RETRY_S)
                poller.unregister(self.listener[0].fileno())
                self._listen_paused = time.monotonic() + peer_lanes.ACCEPT_RETRY_S
                return
            if peer_lanes.peer_uid(sock) != os.getuid():  # another user's process
                log.warning("rank %d refused a peer lane from another user", self.rank)
                sock.close()
                continue
            _lane.set_buffers(sock)
            ident = peer_lanes.LANE_IDENT + str(next(peer_lanes.accepted_ids)).encode()
            lane = _lane.Lane(sock, f"peer lane {ident!r}", identity=ident,
                              limit=self._limit())
            self._accepted[ident] = lane
            self._watch(lane, poller, lanes)

    def _worker_poller(self) -> Any:
        """The worker's followers' poller, where peer lanes are watched too (None:
        the worker has none: ZeroMQ to its controller, no EPOLLEXCLUSIVE,
        MONARCH_PEER_LEAD=0)."""
        io = getattr(self.worker, "io", None)
        return None if io is None else io.follower_poller

    def _watch(self, lane: _lane.Lane, poller: FdPoller, lanes: dict[int, _lane.Lane]) -> None:
        """Watch a new peer lane (the I/O thread): in the worker's poller first,
        then in this thread's, both with ``EPOLLEXCLUSIVE``. So a thread of
        the worker that leads its I/O and waits in its poll (an idle actor's
        thread, a caller waiting for a reply: :mod:`monarch_kernel.worker.io`)
        is the one woken by a message on the lane, and reads it itself,
        with no hand-off to or from this thread; this thread reads it when
        nobody waits there (the actor is busy: buffer reads are served at
        once all the same). A leader/follower pair, as in ``worker_io``."""
        fd = lane.fileno()
        shared = False
        if self._worker_poller() is not None:
            with self._lanes_lock:
                self._shared[fd] = lane
            shared = self.worker.io.share(fd, self.read_shared)
            if not shared:  # (the worker is stopping: its poller is closed)
                with self._lanes_lock:
                    self._shared.pop(fd, None)
        lanes[fd] = lane
        poller.register(fd, exclusive=shared)

    def read_shared(self, fd: int) -> bool:
        """Read and handle the peer lane ``fd`` (the thread that leads the
        worker's I/O, whose poll found it ready); False if ``fd`` is not a
        shared peer lane. A lane at its end is left to this host's I/O
        thread to close (it is unwatched here at once)."""
        lane = self._shared.get(fd)
        if lane is None:
            return False
        n = self._drain(lane)
        if n is None:
            return True  # (the other thread reads it: it sees the end, if that is it)
        self.messages_led += n
        if lane.eof and self._unshare(lane, fd):
            self._close_later(lane)
        return True

    def _unshare(self, lane: _lane.Lane, fd: int) -> bool:
        """Stop the worker's leading threads watching ``lane`` (at its end: else
        they would be woken by it at every poll); False if they did not."""
        with self._lanes_lock:  # (only this lane: its fd may be another's by now)
            if self._shared.get(fd) is not lane:
                return False
            del self._shared[fd]
        if self._worker_poller() is not None:
            self.worker.io.unshare(fd)
        return True

    def _drain(self, lane: _lane.Lane, wait: bool = False) -> int | None:
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
        if not lane.read_lock.acquire(timeout=-1 if wait else READ_WAIT_S):
            with lane.miss_lock:
                if not lane.read_lock.acquire(blocking=False):
                    lane.missed = True
                    return None
        count = 0
        held = True
        codec = self.codec if lane.identity else self._codec_of_addr.get(
            self._lane_addrs.get(lane, ""), self.codec)
        try:
            while True:
                messages: list[Any] = []
                if not lane.eof:
                    try:
                        messages = lane.read()
                    except Exception as e:  # noqa: BLE001 - over the limit, out of memory
                        log.warning("rank %d dropped a peer lane: %s", self.rank, e)
                        lane.eof = True
                for frames in messages:
                    if lane.identity:
                        self._incoming(frames, lane.identity)
                    else:
                        self._reply(frames, codec)
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

    def _read_lane(self, lane: _lane.Lane, poller: FdPoller,
                   lanes: dict[int, _lane.Lane]) -> None:
        """Handle what came on a peer lane: calls on a lane a peer made to this
        worker, replies on one this worker made (the I/O thread)."""
        if self._drain(lane, wait=lane.eof) is None:
            return  # (the worker's leading thread reads it now: ready again later)
        if lane.eof:  # the other process is gone (or closed it)
            fd = lane.fileno()
            self._unshare(lane, fd)
            poller.unregister(fd)
            del lanes[fd]
            lane.close()
            if lane.identity:
                self._accepted.pop(lane.identity, None)
            else:
                with self._lanes_lock:  # a later message tries again, else ZeroMQ
                    self._lane_addrs.pop(lane, None)
                    for addr, other in list(self._lane_to.items()):
                        if other is lane:
                            del self._lane_to[addr]
