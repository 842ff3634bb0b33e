"""Worker-to-worker actor calls: a worker's peer socket (``monarch-peer``).

:class:`PeerHost` owns this worker's *peer* ROUTER socket, where other
workers' actors call this worker's actors directly (never through the
controller), and one DEALER per peer this worker calls. Messages are signed
with the mesh key like every other message
(:meth:`~monarch_kernel.wire.protocol.Codec.fork`). Other threads hand it frames
through an :class:`~monarch_kernel.transport.sockets.Outbox`. Calls it receives go to
the actors' queues (:mod:`monarch_kernel.actor.host`).

**Same-host peers talk over peer lanes** (:mod:`monarch_kernel.transport.peer_lanes`).
A worker also listens on a Unix socket in Linux's abstract namespace
(``@monarch-peer-<pid>-<random>``, gone with the process; connections from
other users are refused, checked with ``SO_PEERCRED``), named in its peer
address after a ``;``. A caller that
can connect to it (same host and network namespace) sends its calls there
on a :class:`~monarch_kernel.transport.lane.Lane`, from its own thread, and the
callee's actor thread writes the reply on the same lane: no ZeroMQ I/O
thread and no hand-off through the outbox on either side (the reason lanes
exist, :mod:`monarch_kernel.transport.lane`). The lanes are read by the thread
that leads the worker's I/O when one waits in its poll (an idle actor's
thread, a caller's waiting for its reply), else by this worker's peer I/O
thread (:mod:`monarch_kernel.actor.peer_io`). Messages are signed as on
ZeroMQ. A caller that cannot connect (another host) uses ZeroMQ to that
address from then on.
``MONARCH_LANES=0`` turns peer lanes off too.

The peer ROUTER of a worker of a local mesh (its controller on ``ipc://``)
is a Unix socket in the controller's private directory: only this user can
connect. On a TCP mesh it is a CurveZMQ server that admits only the client
keys of this worker's meshes (ZAP, :class:`~monarch_kernel.transport.sockets.KeyGate`).

A peer address reads ``tcp://HOST:PORT[|CURVE_KEY][;LANE_NAME]`` or
``ipc://PATH[;LANE_NAME]`` (``;`` is
in neither an endpoint nor the Z85 alphabet of a key).
"""

from __future__ import annotations

import asyncio
import atexit
import hmac
import logging
import os
import secrets
import socket
import threading
import weakref
from collections.abc import Callable
from typing import Any

import zmq

from monarch_kernel.actor import mesh_keys
from monarch_kernel.actor.mesh_keys import check_known
from monarch_kernel.actor.peer_io import PeerIO
from monarch_kernel.controller.controller import Request
from monarch_kernel.errors import MeshFailure, ProtocolError, SerializationError, TransportError
from monarch_kernel.transport import lane as _lane
from monarch_kernel.transport import peer_lanes
from monarch_kernel.transport.sockets import (
    KeyGate,
    Outbox,
    bind_router,
    curve_client_keypair,
    endpoint_host,
    inproc_pair,
    is_ipc,
    is_loopback,
    private_dir,
    remove_private_dir,
)
from monarch_kernel.util.droplog import DropLog
from monarch_kernel.wire import shm as _shm
from monarch_kernel.wire.messages import (
    ACTOR,
    METHOD,
    ONEWAY,
    UID,
    ActorErrorEvent,
    Buffer,
    Call,
    Failure,
    Reply,
)
from monarch_kernel.wire.serialize import Packed, reply_content
from monarch_kernel.worker import handlers

log = logging.getLogger("monarch_kernel.actor.actor_mesh")

#: ``lane_to``'s answer for a peer not dialled yet (None: dialled, no lane to be had)
_NOT_DIALLED: Any = object()

_host: PeerHost | None = None
_host_lock = threading.Lock()
_hosts: weakref.WeakSet[PeerHost] = weakref.WeakSet()  # (for the fork hook)

#: what handles a peer message of a type other than ``call`` and ``reply``, by type
#: (filled by the features that send them: :func:`register_handler`)
_handlers: dict[str, Callable[[PeerHost, Any], None]] = {}


def register_handler(msg_type: str, handler: Callable[[PeerHost, Any], None]) -> None:
    """Have ``handler(host, msg)`` handle the peer messages of type ``msg_type``.

    Called by the modules that send such messages, when they are imported
    (``buffer``: :mod:`monarch_kernel.tensors.buffer_ops`; ``event``:
    :mod:`monarch_kernel.actor.cycles`). It runs on the thread that read the
    message and must not block. Messages of a type nobody registered are dropped.
    """
    _handlers[msg_type] = handler


def current_host() -> PeerHost | None:
    """This worker's :class:`PeerHost`, if it was started (never starts one)."""
    return _host


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
    """Counts of this worker's peer-to-peer messages (``in``, ``out``; ``led``:
    of those in, the ones read by the thread leading the worker's I/O, an
    idle actor's or a waiting caller's, rather than by the peer I/O thread)
    and of its open peer lanes (``lanes_out``: to peers it calls,
    ``lanes_in``: from peers that call it)."""
    h = _host
    if h is None:
        return {"in": 0, "out": 0, "led": 0, "lanes_out": 0, "lanes_in": 0}
    return {"in": h.messages_in, "out": h.messages_out, "led": h.messages_led,
            "lanes_out": sum(1 for v in list(h.lane_to.values()) if v is not None),
            "lanes_in": len(h.accepted)}


def _socket_dir(controller_address: str) -> str:
    """Where this worker's peer socket goes on a local mesh: the controller's
    private directory (removed with it) when it is this user's and closed to
    others (mode 0700), else a private directory of this worker's own
    (removed at exit)."""
    where = os.path.dirname(controller_address[len("ipc://"):])
    try:
        st = os.stat(where)
        if st.st_uid == os.getuid() and not st.st_mode & 0o077:
            return where
    except OSError:
        pass
    own = private_dir()
    atexit.register(remove_private_dir, own)
    return own


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
    """A worker's peer-to-peer endpoint for actor calls (see module docstring;
    its I/O, :attr:`io`: :class:`~monarch_kernel.actor.peer_io.PeerIO`).

    Attributes
    ----------
    address : str
        ``ipc://PATH`` (a local mesh) or ``tcp://host:port`` of the peer
        ROUTER; on an encrypted mesh (the worker's controller connection
        uses CurveZMQ) followed by ``|`` and
        the socket's CurveZMQ public key (Z85), which callers connect with;
        then, where peer lanes are on, ``;`` and the name of this worker's
        lane listener.
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
        #: peer messages refused, counted and reported in few lines (util.droplog)
        self.drops = DropLog(log, f"rank {worker.rank}", "peer message")
        self.codec.pool = _shm.Pool()
        self.ctx = worker.ctx
        secret = None
        public = b""
        #: the ZAP handler of an encrypted peer socket (admits the keys of this worker's
        #: meshes only); None on a local mesh or an unencrypted one
        self.gate: KeyGate | None = None
        if is_ipc(worker.address):  # a mesh on one host: a Unix socket, no TCP port
            where = _socket_dir(worker.address)
            self.router, address = bind_router(
                self.ctx, ipc_dir=where, name=f"p{worker.rank}-{os.getpid()}")
        else:
            if getattr(worker, "curve_server_key", None) is not None:  # an encrypted mesh
                public, secret = zmq.curve_keypair()
                self.gate = KeyGate(self.ctx, self._admits)
            self.router, address = bind_router(self.ctx, _bind_host(worker.address), secret)
        self.listener = peer_lanes.listen() if peer_lanes.enabled() else None
        # callers need the public key to connect: it travels with the address
        self.address = (address + ("|" + public.decode() if public else "")
                        + (";" + self.listener[1] if self.listener else ""))
        self.pull, inproc = inproc_pair(self.ctx)
        self.outbox = Outbox(self.ctx, inproc)
        self.pending: dict[str, Request] = {}
        self.dead: dict[str, MeshFailure] = {}
        self.stopped: dict[str, str] = {}
        self.messages_in = 0
        self.messages_out = 0
        self.messages_led = 0  # of messages_in: those the worker's leading thread read
        self._lock = threading.Lock()
        # peer lanes: this worker's connections to peers' listeners (address -> lane,
        # None where none can be made), those that peers made to it (identity -> lane),
        # and connections made by callers' threads that the I/O thread has yet to watch
        self.lane_to: dict[str, _lane.Lane | None] = {}
        #: codecs of other meshes of this program, by fingerprint (mesh_keys.py), and the
        #: one that checks the replies coming from each peer address of those meshes
        self._codecs: dict[str, Any] = {}
        self.codec_of_addr: dict[str, Any] = {}
        self.lane_addrs: dict[_lane.Lane, str] = {}  # lanes this worker made -> address
        self.accepted: dict[bytes, _lane.Lane] = {}
        self.new_lanes: list[_lane.Lane] = []
        self.lanes_lock = threading.Lock()
        self.identity = f"p{worker.rank}-{os.getpid()}-{secrets.token_hex(3)}".encode()
        #: the I/O: the peer thread, sockets and lanes (monarch_kernel.actor.peer_io)
        self.io = PeerIO(self)
        self._thread = self.io.thread
        self.io.start()
        _hosts.add(self)

    def _admits(self, client_key: bytes) -> bool:
        """Whether a CurveZMQ client with public key ``client_key`` (Z85) may connect
        to the peer socket: it holds the client key of this worker's mesh or of a
        mesh this worker was introduced to (the ZAP thread)."""
        keys = [self.worker.codec.key, *list(self.worker.keyring.values())]
        return any(hmac.compare_digest(curve_client_keypair(k)[0], client_key) for k in keys)

    def request(self, ranks: list[int], peers: dict[int, str], content: Call | Buffer,
                oneway: bool, type: str = "call", mesh: str | None = None) -> Request | None:
        """Send a call (or a message of another ``type``: ``buffer``, see
        :mod:`monarch_kernel.tensors.buffer_ops`) to ``ranks`` (any thread of this worker),
        of this worker's mesh or of the mesh whose key's fingerprint is ``mesh``
        (signed with that mesh's key: :mod:`monarch_kernel.actor.mesh_keys`).

        Raises
        ------
        MeshFailure
            If one of the ranks is known to be dead.
        MeshError
            If ``mesh`` is a mesh this worker was not introduced to.
        """
        codec = self.codec_for(mesh)
        for r in ranks:
            failure = self.dead.get(peers[r])
            if failure is not None:
                raise failure
        if codec is not self.codec:
            for r in ranks:  # (replies from there are checked with that mesh's key)
                self.codec_of_addr[peers[r]] = codec
        mid = codec.new_id()
        names: list[str] = []
        # same host (the peers bind the same address as this worker): large buffers go
        # through shared memory (monarch_kernel.wire.shm), given back once every peer answered
        here = address_host(self.address)
        local = not oneway and all(address_host(peers[r]) == here for r in ranks)
        frames = codec.encode(type, content, id=mid, shm="sender" if local else None,
                              shm_out=names)
        req = None
        if not oneway:
            req = Request(mid, ranks)
            if codec is not self.codec:
                req.mesh = mesh
            if names:
                req.add_done_callback(lambda r: self.codec.release_shm(
                    names, discard=r.failure is not None))
            with self._lock:
                self.pending[mid] = req
        for r in ranks:
            self.send_to(peers[r], frames)
        if req is not None and self.io.worker_poller() is not None and all(
                self.lane_to.get(peers[r]) for r in ranks):
            # the replies come on lanes: the caller's thread may read them itself while
            # it waits (worker_io.lead_wait), woken if another thread read them first
            req.waiter = self.worker.lead_wait
            req.wake = self.worker.wake_leader
        return req

    def codec_for(self, mesh: str | None) -> Any:
        """The codec that signs for the mesh whose key's fingerprint is ``mesh``
        (None, or this worker's own: its own codec).

        Raises
        ------
        MeshError
            If no introduction gave this worker that mesh's key.
        """
        if mesh is None or mesh == self.codec.fingerprint:
            return self.codec
        codec = self._codecs.get(mesh)
        if codec is None:
            check_known(self.worker, mesh, "the callee")
            key = self.worker.keyring[mesh]
            with self.lanes_lock:
                codec = self._codecs.get(mesh)
                if codec is None:
                    codec = self._codecs[mesh] = self.codec.rekeyed(key)
        return codec

    def forget(self, mesh: str) -> None:
        """The mesh whose key's fingerprint is ``mesh`` stopped: fail the calls
        still waiting on it (any thread)."""
        codec = self._codecs.pop(mesh, None)
        if codec is not None:  # (the addresses of that mesh: their codec goes with it)
            for addr, c in list(self.codec_of_addr.items()):
                if c is codec:
                    self.codec_of_addr.pop(addr, None)
        failure = MeshFailure("the process mesh of that actor mesh was stopped")
        with self._lock:
            waiting = [q for q in self.pending.values() if q.mesh == mesh]
            for q in waiting:
                self.pending.pop(q.id, None)
        for q in waiting:
            q._fail(failure)

    def send_to(self, address: str, frames: list[Any]) -> None:
        """Send signed ``frames`` to the peer at ``address`` (any thread): on its
        peer lane where one can be had, else through the I/O thread's DEALER.
        A message to a peer that is gone is dropped (its callers learn of the
        death from the controller, :meth:`fail_rank`)."""
        lane = self.lane_to.get(address, _NOT_DIALLED)
        if lane is _NOT_DIALLED:
            lane = self._connect(address)
        if lane is None:
            self.io.to_io([b"d", address.encode(), *frames])
            return
        try:
            lane.send(frames)
            self.messages_out += 1
        except TransportError as e:
            log.info("rank %d dropped a message to a peer that is gone: %s", self.rank, e)

    def reply_to(self, route: list[bytes], frames: list[Any]) -> None:
        """Send signed ``frames`` back where the message that came by ``route``
        came from (any thread): its peer lane, or the ROUTER's identity."""
        if len(route) == 1 and route[0].startswith(peer_lanes.LANE_IDENT):
            lane = self.accepted.get(route[0])
            if lane is not None:
                try:
                    lane.send(frames)
                    self.messages_out += 1
                except TransportError:  # the caller is gone: nobody waits for this
                    pass
            return
        self.io.to_io([b"r", *route, *frames])

    def _connect(self, address: str) -> _lane.Lane | None:
        """The peer lane to ``address``, made now if it can be; None (kept, so
        that messages to one address never switch transport and overtake each
        other) where it cannot: another host or network namespace, lanes off,
        or a listener that is not the peer's (its process id, in the name, and
        this user, both checked with ``SO_PEERCRED``)."""
        name = address.partition(";")[2]
        lane = None
        if (name and self.listener is not None
                and address_host(address) == address_host(self.address)):
            lane = peer_lanes.dial(name, f"peer lane to {address}", self.lane_limit())
        with self.lanes_lock:  # (two threads may have dialled at once: one lane is kept)
            kept = self.lane_to.get(address, _NOT_DIALLED)
            if kept is _NOT_DIALLED:
                self.lane_to[address] = kept = lane
                if lane is not None:
                    self.new_lanes.append(lane)
                    self.lane_addrs[lane] = address  # (its replies' codec: codec_of_addr)
        if kept is not lane and lane is not None:
            lane.close()
        elif lane is not None:
            self.io.to_io([b"n"])  # the I/O thread watches it from now on
        return kept

    def lane_limit(self) -> int:
        """The largest message a peer lane takes (bytes): what the codec takes,
        and room for the framing of a message of many buffers."""
        return self.codec.max_header + self.codec.max_buffers + (1 << 20)

    def fail_rank(self, rank: int, address: str | None, reason: str,
                  mesh: str | None = None) -> None:
        """Rank ``rank`` (peer ``address``) of this worker's mesh, or of the mesh
        whose key's fingerprint is ``mesh``, is gone: fail every call waiting on
        it, and later calls to that address (any thread)."""
        failure = MeshFailure(reason, rank=rank)
        if mesh == self.codec.fingerprint:
            mesh = None
        if mesh is not None and address:  # (no reply comes from there any more)
            self.codec_of_addr.pop(address, None)
        lane = self.lane_to.get(address) if address else None
        if lane is not None:  # (a hung process's lane: closed by the I/O thread)
            self.io.close_later(lane)
        with self._lock:
            if address:
                self.dead[address] = failure
            waiting = [q for q in self.pending.values()
                       if q.mesh == mesh and q._reply_pending(rank)]
            for q in waiting:
                self.pending.pop(q.id, None)
        for q in waiting:
            q._fail(failure)

    def incoming(self, frames: list[Any], lane: bytes | None = None) -> None:
        """Handle a message from a peer: by the ROUTER, or on the lane ``lane``."""
        try:
            if lane is None:
                msg = self.codec.decode(frames, router=True)
            else:
                msg = self.codec.decode(frames, identity=[lane])
        except ProtocolError as e:
            peer = lane if lane is not None else bytes(frames[0]) if frames else b""
            self.drops.drop(getattr(e, "reason", "malformed"), str(e), peer)
            return
        self.messages_in += 1
        if msg.type != "call":  # an RDMABuffer operation, a wait notice, ...
            handler = _handlers.get(msg.type)
            if handler is not None:
                handler(self, msg)
            return
        c: Call = msg.content
        inst = self.worker.actors.get(c[ACTOR])
        if inst is None:
            reject(self.worker, msg.id, c, msg.identity)
        else:
            inst.deliver(msg.id, c, msg.identity)

    def reply(self, frames: list[Any], codec: Any = None) -> None:
        """Handle a reply from a peer (checked with ``codec``, or this host's)."""
        try:
            msg = (codec or self.codec).decode(frames)
        except ProtocolError as e:
            self.drops.drop(getattr(e, "reason", "malformed"), f"(a reply) {e}", b"reply")
            return
        self.messages_in += 1
        if msg.type != "reply" or not msg.sender.startswith("r"):
            return
        rank = int(msg.sender[1:])
        with self._lock:
            req = self.pending.get(msg.parent or "")
            if req is None or not req._reply_pending(rank):
                return
            c: Reply = msg.content
            req.replies[rank] = (c["status"], c["value"])
            finished = len(req.replies) >= len(req.ranks)
            if finished:
                self.pending.pop(req.id, None)
        if finished:
            req._finish()  # completes the caller's future (outside the lock)


def _after_fork_in_child() -> None:
    """A forked child (a DataLoader's worker) does not keep the lane listener:
    the name would outlive the worker, taking connections nobody reads."""
    for h in list(_hosts):
        h.lanes_lock = threading.Lock()
        h._lock = threading.Lock()
        if h.listener is not None:
            h.listener[0].close()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def answer(w: Any, mid: str, c: Call, route: list[bytes] | None, status: str,
           value: Any) -> None:
    """Send the result of call ``mid`` (content ``c``) of worker ``w`` where it must go:
    nowhere for a one-way call (but a failure is reported to the controller as an
    ``actor_error`` event), to the controller (``route`` None) or back to the peer
    that made it (``route``: its ROUTER identity). ``status``: ``"ok"`` or ``"error"``;
    ``value``: a :class:`~monarch_kernel.wire.serialize.Packed` or a failure dict."""
    if c.get(ONEWAY):  # broadcast: nobody waits; a failure is still reported
        if status == "error":
            if w.capture is not None:
                w.capture.drain()
            w.send("event", ActorErrorEvent(kind="actor_error", actor=c[ACTOR], method=c[METHOD],
                                            uid=c.get(UID), rank=w.rank, failure=value))
        return
    if route is None:
        w.reply(mid, status, value)
    else:
        host = peer_host(w)
        try:
            frames = host.codec.encode("reply", reply_content(status, value), parent=mid)
        except SerializationError as e:  # (too large, say): the caller gets why, not a hang
            frames = host.codec.encode("reply", Reply(status="error", value=Failure(
                type="monarch_kernel.SerializationError", traceback="",
                message=f"the result of {c.get(METHOD)!r} cannot be sent "
                        f"back: {e}", exc=None)), parent=mid)
        host.reply_to(route, frames)


def failure_of(worker: Any, e: BaseException, with_traceback: bool = True) -> dict[str, Any]:
    """The failure dict an error reply carries for ``e`` (``Worker.describe_failure``:
    the exception's description, which unpickles anywhere); ``e``'s traceback loses
    its frames of the actor host and of asyncio."""
    e.__traceback__ = _user_traceback(e.__traceback__)
    f: dict[str, Any] = worker.describe_failure(e, with_traceback)
    return f


#: frames of these files are dropped from the top of a failure's traceback
_INNER_FILES: set[str] = {__file__}
_ASYNCIO_DIR = os.path.dirname(asyncio.__file__)


def hide_frames_of(filename: str) -> None:
    """Drop the frames of ``filename`` from the top of the tracebacks of failures
    (the actor host's, where endpoints are called)."""
    _INNER_FILES.add(filename)


def _user_traceback(tb: Any) -> Any:
    """Drop the actor host's and asyncio's frames from the top of a traceback."""
    while tb is not None:
        f = tb.tb_frame.f_code.co_filename
        if f not in _INNER_FILES and not f.startswith(_ASYNCIO_DIR):
            break
        tb = tb.tb_next
    return tb


def missing_actor(w: Any, name: str) -> MeshFailure:
    """The error of a call to actor ``name``, which worker ``w`` does not run."""
    host = _host
    cause = host.stopped.get(name) if host is not None else None
    if cause:
        return MeshFailure(f"actor {name!r} on rank {w.rank} {cause}", rank=w.rank)
    return MeshFailure(f"rank {w.rank} has no actor named {name!r}: it was not spawned there, "
                       "or the rank was restarted since (a fresh process: spawn the actor "
                       "mesh again)", rank=w.rank)


def reject(w: Any, mid: str, c: Call, route: list[bytes] | None) -> None:
    """Answer call ``mid`` to an actor that worker ``w`` does not run (see :func:`answer`)."""
    e = missing_actor(w, c[ACTOR])
    failure = Failure(type="monarch_kernel.errors.MeshFailure", message=str(e),
                      traceback="", exc=Packed.pack(e), rejected=True)
    answer(w, mid, c, route, "error", failure)


def address_host(address: str) -> str:
    """``tcp://10.0.0.2:5555|KEY;NAME`` -> ``10.0.0.2``; ``127.0.0.1`` for an
    ``ipc://`` address (a peer on the controller's host)."""
    return endpoint_host(address)


# ------------------------------------------------- the worker's handlers (plug-in)
def _on_keys(worker: Any, msg: Any) -> None:
    """``keys``: keys of this program's other meshes added or dropped (mesh_keys.py)."""
    c = msg.content
    dropped = list(c.get("drop") or ())
    worker.dropped_keys.update(dropped)
    worker.keyring.update({fp: k for fp, k in (c.get("add") or {}).items()
                           if fp not in worker.dropped_keys})  # (a late add: ignored)
    host = _host
    for fp in dropped:
        worker.keyring.pop(fp, None)
        if host is not None:
            host.forget(fp)
    mesh_keys.pass_down(c)  # to meshes this worker spawned, if any


handlers.register_io("keys", _on_keys)
