"""Worker-to-worker actor calls: a worker's peer socket (``monarch-peer``).

:class:`PeerHost` owns this worker's *peer* ROUTER socket, where other
workers' actors call this worker's actors directly (never through the
controller), and one DEALER per peer this worker calls. Messages are signed
with the mesh key like every other message
(:meth:`~monarch_kernel.protocol.Codec.fork`). Calls it receives go to the
actors' queues (:mod:`monarch_kernel.actor_host`).

Threads: the peer thread (``monarch-peer``) reads the sockets; a thread that
calls a peer, or replies to one, sends on the socket itself, under that
socket's lock (ZeroMQ sockets are not thread-safe, and are used here by one
thread at a time), instead of handing the frames to the peer thread: that
hand-off cost a thread wake-up on each side of a call. The peer thread
waits on the sockets' ``ZMQ_FD`` in one epoll (poll(2) without epoll), no
ZeroMQ call in the wait; ``ZMQ_FD`` is edge-triggered, and a send may take
the signal of an input that came meanwhile, so a sender asks ``ZMQ_EVENTS``
after its send (lock held) and wakes the peer thread if input waits. Other
threads may still hand frames to the peer thread through an
:class:`~monarch_kernel.transport.Outbox` (``[b"d", address, ...]`` to a
peer, ``[b"r", identity, ...]`` back through the ROUTER).
"""

from __future__ import annotations

import logging
import os
import secrets
import select
import socket
import threading
from typing import Any

import zmq

from . import actor_cycles
from . import shm as _shm
from .controller import Request
from .errors import MeshFailure, ProtocolError, TransportError
from .sigint import DeferredSigint
from .transport import (
    Outbox,
    bind_router,
    connect_dealer,
    drain,
    has_input,
    inproc_pair,
    is_loopback,
    send_frames,
)

log = logging.getLogger("monarch_kernel.actor")

_host: PeerHost | None = None
_host_lock = threading.Lock()


def peer_host(worker: Any) -> PeerHost:
    """This worker's :class:`PeerHost`, started on first use."""
    global _host
    h = _host
    if h is None:
        with _host_lock:
            if _host is None:
                _host = PeerHost(worker)
            h = _host
    return h


def stats() -> dict[str, int]:
    """Counts of peer-to-peer messages of this worker (``in``, ``out``), and of the
    times the peer thread found input only in its once-a-second look at every
    socket (``late``: a lost wake-up, which should never happen)."""
    h = _host
    if h is None:
        return {"in": 0, "out": 0, "late": 0}
    return {"in": h.messages_in, "out": h.messages_out, "late": h.late}


def _bind_host(controller_address: str) -> str:
    host = controller_address.split("//", 1)[-1].rsplit(":", 1)[0].strip("[]")
    if is_loopback(host):
        return "127.0.0.1"
    try:  # the address this machine uses to reach the controller
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return s.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


class PeerHost:
    """A worker's peer-to-peer endpoint for actor calls (see module docstring).

    Attributes
    ----------
    address : str
        ``tcp://host:port`` of the peer ROUTER; on an encrypted mesh (the
        worker's controller connection uses CurveZMQ) followed by ``|`` and
        the socket's CurveZMQ public key (Z85), which callers connect with.
    stopped : dict of str to str
        Names of actors stopped here, with the cause.
    dead : dict of str to MeshFailure
        Peer addresses of workers known to be gone (a restarted rank gets a
        new address), with the failure that calls to them raise.
    """

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.rank = worker.rank
        self.codec = worker.codec.fork(f"r{worker.rank}")
        self.codec.pool = _shm.Pool()
        self.ctx = worker.ctx
        secret = None
        public = b""
        if getattr(worker, "curve_server_key", None) is not None:  # an encrypted mesh
            public, secret = zmq.curve_keypair()
        self.router, address = bind_router(self.ctx, _bind_host(worker.address), secret)
        # callers need the public key to connect: it travels with the address
        self.address = address + ("|" + public.decode() if public else "")
        self.pull, inproc = inproc_pair(self.ctx)
        self.outbox = Outbox(self.ctx, inproc)
        self.pending: dict[str, Request] = {}
        self.dead: dict[str, MeshFailure] = {}
        self.stopped: dict[str, str] = {}
        self.messages_in = 0
        self.messages_out = 0
        self.late = 0  # input found only by the once-a-second look (see stats())
        self._lock = threading.Lock()  # pending, dead, the sockets' maps, _check
        self._ident = f"p{worker.rank}-{os.getpid()}-{secrets.token_hex(3)}".encode()
        self._dealers: dict[str, zmq.Socket] = {}  # peer address -> DEALER
        self._sock_lock: dict[zmq.Socket, threading.Lock] = {self.router: threading.Lock()}
        self._fd_sock: dict[int, zmq.Socket] = {}  # ZMQ_FD -> socket
        self._check: set[zmq.Socket] = set()  # sockets to read whatever their fd says
        self._epoll = hasattr(select, "epoll")
        self._poll: Any = select.epoll() if self._epoll else select.poll()
        with self._lock:
            self._watch(self.router)
            self._watch(self.pull)
        self._thread = threading.Thread(target=self._loop, name="monarch-peer", daemon=True)
        self._thread.start()

    def _watch(self, sock: zmq.Socket) -> None:
        """Let the peer thread read ``sock`` (``_lock`` held)."""
        fd = sock.getsockopt(zmq.FD)
        self._fd_sock[fd] = sock
        self._check.add(sock)
        self._poll.register(fd, select.POLLIN)

    def _wake(self) -> None:
        """Bring the peer thread out of its wait (any thread)."""
        try:
            self.outbox.send([b""])
        except TransportError:  # closing
            pass

    def _dealer(self, address: str) -> zmq.Socket:
        """The DEALER connected to the peer at ``address`` (made on first use)."""
        with self._lock:
            s = self._dealers.get(address)
            if s is not None:
                return s
            endpoint, _, key = address.partition("|")
            s = connect_dealer(self.ctx, endpoint, self._ident, key.encode() or None)
            self._dealers[address] = s
            self._sock_lock[s] = threading.Lock()
            self._watch(s)
        self._wake()  # (a poll(2) under way would not watch it yet)
        return s

    def send(self, sock: zmq.Socket, frames: list[Any]) -> None:
        """Send ``frames`` on peer socket ``sock`` (any thread), never blocking: a
        peer that is gone or not reading loses the message (logged)."""
        waiting = False
        with DeferredSigint(), self._sock_lock[sock]:
            try:
                send_frames(sock, frames, zmq.NOBLOCK)
                self.messages_out += 1
            except zmq.ZMQError as e:
                log.warning("rank %d dropped a message to a peer: %s", self.rank, e)
            try:  # (the send may have taken the fd's signal of an input)
                waiting = has_input(sock)
            except zmq.ZMQError:
                waiting = False
        if waiting:
            with self._lock:
                self._check.add(sock)
            self._wake()

    def send_to(self, address: str, frames: list[Any]) -> None:
        """Send ``frames`` to the peer at ``address`` (any thread)."""
        self.send(self._dealer(address), frames)

    def reply(self, route: list[bytes], frames: list[Any]) -> None:
        """Send ``frames`` back through the ROUTER to ``route`` (any thread)."""
        self.send(self.router, [*route, *frames])

    def request(self, ranks: list[int], peers: dict[int, str], content: dict[str, Any],
                oneway: bool, type: str = "call") -> Request | None:
        """Send a call (or a message of another ``type``: ``buffer``, see
        :mod:`monarch_kernel.buffer_ops`) to ``ranks`` (any thread of this worker).

        Raises
        ------
        MeshFailure
            If one of the ranks is known to be dead.
        """
        for r in ranks:
            failure = self.dead.get(peers[r])
            if failure is not None:
                raise failure
        mid = self.codec.new_id()
        names: list[str] = []
        # same host (the peers bind the same address as this worker): large buffers go
        # through shared memory (monarch_kernel.shm), given back once every peer answered
        here = _addr_host(self.address)
        local = not oneway and all(_addr_host(peers[r]) == here for r in ranks)
        frames = self.codec.encode(type, content, id=mid, shm="sender" if local else None,
                                   shm_out=names)
        req = None
        if not oneway:
            req = Request(mid, ranks)
            if names:
                req.add_done_callback(lambda r: self.codec.release_shm(
                    names, discard=r.failure is not None))
            with self._lock:
                self.pending[mid] = req
        for r in ranks:
            self.send_to(peers[r], frames)
        return req

    def fail_rank(self, rank: int, address: str | None, reason: str) -> None:
        """Rank ``rank`` (peer ``address``) is gone: fail every call waiting on it,
        and later calls to that address (any thread)."""
        failure = MeshFailure(reason, rank=rank)
        with self._lock:
            if address:
                self.dead[address] = failure
            waiting = [q for q in self.pending.values() if q._reply_pending(rank)]
            for q in waiting:
                self.pending.pop(q.id, None)
        for q in waiting:
            q._fail(failure)

    def _loop(self) -> None:
        wait = 1.0 if self._epoll else 1000  # (epoll: seconds; poll(2): ms)
        try:
            while True:
                with self._lock:
                    check, self._check = self._check, set()
                events = self._poll.poll(0 if check else wait)
                quiet = not events and not check
                with self._lock:
                    ready = check | {self._fd_sock[fd] for fd, _ in events
                                     if fd in self._fd_sock}
                    if quiet:  # a quiet second: read them all once (a safety net)
                        ready = set(self._fd_sock.values())
                for sock in ready:
                    if sock is self.pull:
                        for frames in drain(self.pull):
                            if len(frames) > 1:  # (else a wake-up)
                                self._forward(frames)
                        continue
                    router = sock is self.router
                    with self._sock_lock[sock]:  # (read to the end: its fd signals the next)
                        got = list(drain(sock, small=2 if router else 1))
                    if quiet and got:
                        self.late += 1
                        log.debug("rank %d: peer input found only by the periodic look",
                                  self.rank)
                    for frames in got:
                        if router:  # [identity, envelope, ...]
                            self._incoming(frames)
                        else:  # [envelope, buffers...]
                            self._reply(frames)
        except Exception:
            log.exception("the peer I/O thread of rank %d failed", self.rank)

    def _forward(self, frames: list[Any]) -> None:
        """Send what another thread handed over through the outbox."""
        if frames[0].bytes == b"r":
            self.send(self.router, frames[1:])
        else:
            self.send_to(frames[1].bytes.decode(), frames[2:])

    def _incoming(self, frames: list[Any]) -> None:
        try:
            msg = self.codec.decode(frames, router=True)
        except ProtocolError as e:
            log.warning("rank %d dropped a peer message: %s", self.rank, e)
            return
        self.messages_in += 1
        if msg.type == "buffer":  # an RDMABuffer read or write: answered right here
            from .buffer_ops import serve

            serve(self, msg)
            return
        if msg.type != "call":
            if msg.type == "event" and isinstance(msg.content, dict) and (
                    msg.content.get("kind") == "wait"):  # an actor waits for a call: cycles?
                actor_cycles.on_notice(self.worker, msg.content)
            return
        c = msg.content
        inst = self.worker.actors.get(c["a"])
        if inst is None:
            from .actor_host import _reject  # (that module imports this one)

            _reject(self.worker, msg.id, c, msg.identity)
        else:
            if "w" in c:  # made by an actor: tracked while queued or running (actor_cycles)
                actor_cycles.track(inst, msg.id, c, msg.identity)
            inst.post(("call", msg.id, c, msg.identity))

    def _reply(self, frames: list[Any]) -> None:
        try:
            msg = self.codec.decode(frames)
        except ProtocolError as e:
            log.warning("rank %d dropped a peer reply: %s", self.rank, e)
            return
        self.messages_in += 1
        if msg.type != "reply" or not msg.sender.startswith("r"):
            return
        rank = int(msg.sender[1:])
        with self._lock:
            req = self.pending.get(msg.parent or "")
            if req is None or not req._reply_pending(rank):
                return
            c = msg.content
            req.replies[rank] = (c["status"], c["value"])
            finished = len(req.replies) >= len(req.ranks)
            if finished:
                self.pending.pop(req.id, None)
        if finished:
            req._finish()  # completes the caller's future (outside the lock)



def _addr_host(address: str) -> str:
    """``tcp://10.0.0.2:5555|KEY`` -> ``10.0.0.2``."""
    return address.split("|", 1)[0].split("//", 1)[-1].rsplit(":", 1)[0]


