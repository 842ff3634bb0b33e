"""Worker-to-worker actor calls: a worker's peer socket (``monarch-peer``).

:class:`PeerHost` owns this worker's *peer* ROUTER socket, where other
workers' actors call this worker's actors directly (never through the
controller), and one DEALER per peer this worker calls. Messages are signed
with the mesh key like every other message
(:meth:`~monarch_kernel.protocol.Codec.fork`). Other threads hand it frames
through an :class:`~monarch_kernel.transport.Outbox`. Calls it receives go to
the actors' queues (:mod:`monarch_kernel.actor_host`).
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
from typing import Any

import zmq

from . import actor_cycles
from . import shm as _shm
from .controller import Request
from .errors import MeshFailure, ProtocolError
from .transport import (
    Outbox,
    bind_router,
    connect_dealer,
    drain,
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
    """Counts of peer-to-peer messages of this worker (``in``, ``out``)."""
    h = _host
    return {"in": h.messages_in, "out": h.messages_out} if h else {"in": 0, "out": 0}


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
        self._lock = threading.Lock()
        self._ident = f"p{worker.rank}-{os.getpid()}-{secrets.token_hex(3)}".encode()
        self._thread = threading.Thread(target=self._loop, name="monarch-peer", daemon=True)
        self._thread.start()

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
            self.outbox.send([b"d", peers[r].encode(), *frames])
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
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self.pull, zmq.POLLIN)
        dealers: dict[str, zmq.Socket] = {}
        socks: set[zmq.Socket] = set()
        try:
            while True:
                events = dict(poller.poll(1000))
                if self.pull in events:
                    for frames in drain(self.pull):
                        self._forward(frames, dealers, socks, poller)
                if self.router in events:
                    for frames in drain(self.router, small=2):  # [identity, envelope, ...]
                        self._incoming(frames)
                for s in socks:
                    if s in events:
                        for frames in drain(s, small=1):  # [envelope, buffers...]
                            self._reply(frames)
        except Exception:
            log.exception("the peer I/O thread of rank %d failed", self.rank)

    def _forward(self, frames: list[Any], dealers: dict[str, zmq.Socket],
                 socks: set[zmq.Socket], poller: zmq.Poller) -> None:
        kind = frames[0].bytes
        try:
            if kind == b"r":
                send_frames(self.router, frames[1:], zmq.NOBLOCK)
            else:
                addr = frames[1].bytes.decode()
                s = dealers.get(addr)
                if s is None:
                    endpoint, _, key = addr.partition("|")
                    s = dealers[addr] = connect_dealer(self.ctx, endpoint, self._ident,
                                                       key.encode() or None)
                    socks.add(s)
                    poller.register(s, zmq.POLLIN)
                send_frames(s, frames[2:], zmq.NOBLOCK)
            self.messages_out += 1
        except zmq.ZMQError as e:  # the peer is gone or not reading: never block here
            log.warning("rank %d dropped a message to a peer: %s", self.rank, e)

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


