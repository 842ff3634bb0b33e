"""A worker of a detachable mesh: outliving its controller, and being attached again.

A mesh spawned with ``detach=True`` starts its workers with
``MONARCH_ATTACH_ENDPOINT`` (and ``MONARCH_DETACH_KEEP_ALIVE``). Such a
worker (:class:`Detachable`, the worker's :attr:`~Worker.detach`) differs
from an ordinary one in four ways:

* It never exits because its controller went away (pid gone, silence for
  ``--heartbeat-timeout`` seconds, or a clean ``detach`` message): it
  becomes *detached*: it drops its connections to the controller, keeps
  running what it runs, keeps the replies of requests that finish, and
  sends nothing. After ``keep_alive`` seconds detached it exits
  (:data:`~monarch_kernel.wire.messages.EXIT_KEEP_ALIVE`); the mesh's
  guardian (:mod:`monarch_kernel.launchers.guard`) then removes what is left.
* It keeps, per request, the output it sent (or would have sent) for that
  request while the request runs, and after it finished until a controller
  had its reply: a controller that was killed may never have shown its
  last messages, so a new one replays each unfinished request's output from
  its start (and a finished one's whose reply went to a controller that was
  killed before it sent anything else); output of no request (a background thread's) is kept while
  detached, and shown as background output at attach. All of it is bounded
  by ``MONARCH_DETACH_OUTPUT_BYTES`` bytes (default 8 MiB) per rank: beyond
  that the oldest output goes first and the dropped bytes are counted (per
  request and in all) and reported. The replies of requests that finish
  while detached are kept too, at most ``MONARCH_DETACH_REPLIES`` of them
  (default 1024) per rank: beyond that the oldest kept reply goes first, with
  its request's kept output (whose bytes count as dropped); the request is
  then not reported at attach, and the number of replies dropped is
  (``dropped_replies`` of the state reported at attach).
* Every message to the controller is encoded and sent under one lock
  (:attr:`Detachable.lock`), so that a take-over is atomic with respect to
  output: what was journalled before it is in the hello the new controller
  gets, what comes after it is sent to the new controller.
* It binds an *attach endpoint* (a ROUTER: ``ipc://`` in the mesh's own
  0700 directory for a local mesh; ``tcp://`` for others, a CurveZMQ server
  that admits only the mesh's client key), read by the thread that leads
  the I/O. A controller sends it one signed ``attach``
  message (:class:`AttachRequest`): its endpoints, the controller's new
  epoch and sequence floor, the epoch the rank signs with from then on,
  ``steal``, and the controller's pid and host. The worker refuses when a
  controller that is alive holds it (heard within the heartbeat timeout,
  and its pid runs where that can be checked) unless ``steal``; a steal
  first tells the old controller (an ``event`` of kind ``taken_over``).
  Accepting, it reconnects its two DEALERs to the new endpoints, takes the
  new epochs (the old controller's messages are refused from then on: the
  codec expects only the new controller's epoch, learnt from a signed
  attach whose timestamp is newer than every one accepted before), sends a
  ``hello`` whose ``resume`` holds its state (:meth:`Detachable.report`),
  and answers ``{"ok": True}`` on the attach endpoint.

Nothing here is imported by an ordinary worker's hot path: a worker without
``MONARCH_ATTACH_ENDPOINT`` has ``detach = None`` and behaves as before.
"""

from __future__ import annotations

import collections
import hmac
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq

from monarch_kernel.errors import ProtocolError
from monarch_kernel.transport.netaddr import address_towards, primary_address
from monarch_kernel.transport.sockets import (
    KeyGate,
    curve_attach_keypair,
    curve_client_keypair,
    drain,
    is_loopback,
    send_frames,
)
from monarch_kernel.util.procs import running
from monarch_kernel.wire import messages, protocol
from monarch_kernel.worker import handlers, telemetry
from monarch_kernel.worker.io import exit_process

log = logging.getLogger("monarch_kernel.worker.worker")

__all__ = ["ATTACH_ENV", "DEFAULT_OUTPUT_BYTES", "DEFAULT_REPLIES", "KEEP_ALIVE_ENV",
           "OUTPUT_BYTES_ENV", "REPLIES_ENV", "Detachable", "register_reporter"]

#: the environment variable holding a rank's attach endpoint (set: a detachable worker)
ATTACH_ENV = "MONARCH_ATTACH_ENDPOINT"
#: ``PID@HOST`` of the controller that spawned the rank
HOLDER_ENV = "MONARCH_DETACH_HOLDER"
#: seconds a detached worker waits for a controller before it exits
KEEP_ALIVE_ENV = "MONARCH_DETACH_KEEP_ALIVE"
#: bytes of output a worker keeps for replay (per rank)
OUTPUT_BYTES_ENV = "MONARCH_DETACH_OUTPUT_BYTES"
DEFAULT_OUTPUT_BYTES = 8 << 20
#: replies of requests finished while detached that a worker keeps (per rank)
REPLIES_ENV = "MONARCH_DETACH_REPLIES"
DEFAULT_REPLIES = 1024
DEFAULT_KEEP_ALIVE = 3600.0
#: requests with kept output beyond which those nobody waits for are forgotten
MAX_ENTRIES = 256
#: requests whose reply a controller got that a rank keeps (with their output)
MAX_DELIVERED = 32

#: functions adding to the state a worker reports at attach (``fn(worker) -> dict``),
#: registered by features above the worker (actors: their names and classes)
_reporters: list[Callable[[Any], dict[str, Any]]] = []


def register_reporter(fn: Callable[[Any], dict[str, Any]]) -> None:
    """Have ``fn(worker)`` add keys to the state reported at attach."""
    _reporters.append(fn)


@dataclass
class _Entry:
    """What a worker keeps of one request (see the module docstring)."""

    chunks: collections.deque[tuple[str, str]] = field(default_factory=collections.deque)
    nbytes: int = 0
    dropped: int = 0
    reply: dict[str, Any] | None = None  # its reply content, once it finished
    delivered: bool = False  # its reply went to the controller attached then
    delivered_at: float = 0.0  # monotonic time its reply was sent


def _holder_alive(holder: dict[str, Any] | None) -> bool:
    """Whether the controller ``holder`` ({pid, host}) runs, where this host can tell."""
    if not holder:
        return False
    if holder.get("host") != socket.gethostname():
        return True
    try:
        pid = int(holder.get("pid", 0))
    except (TypeError, ValueError):
        return True
    return running(pid)  # (a zombie, killed and not yet reaped, is gone)


class Detachable:
    """The detachable part of a worker (see the module docstring).

    Parameters
    ----------
    worker : Worker
        Its worker (connected with two DEALERs, ``dealer`` and ``up``).
    endpoint : str
        Where to bind the attach endpoint: ``ipc://PATH`` or ``tcp://HOST:PORT``
        (port 0: any).
    keep_alive : float
        Seconds detached before the worker exits.
    bound : int
        Bytes of output kept per rank.
    replies : int
        Replies of requests finished while detached kept per rank (the oldest
        beyond that are dropped and counted, see the module docstring).
    """

    def __init__(self, worker: Any, endpoint: str, keep_alive: float, bound: int,
                 replies: int = DEFAULT_REPLIES) -> None:
        self.w = worker
        self.keep_alive = keep_alive
        self.bound = max(0, bound)
        self.max_replies = max(0, replies)
        #: requests whose reply came while detached, oldest first (bounded: max_replies)
        self.kept: collections.deque[str] = collections.deque()
        self.dropped_replies = 0  # replies dropped since the last attach
        #: held while a message is encoded and sent, and while a controller takes over
        self.lock = threading.RLock()
        self.detached = False
        self.since = 0.0  # monotonic time it became detached
        self.journal: dict[str, _Entry] = {}  # request id -> kept output and reply, oldest first
        #: requests whose reply the controller got, newest last: kept (MAX_DELIVERED)
        #: because other ranks may still run them, and a controller that was killed
        #: may never have shown their output; a new one shows the whole request
        self.delivered: collections.deque[str] = collections.deque()
        self.total = 0  # bytes in the journal
        self.dropped = 0  # bytes dropped in all since the last attach
        #: the controller that holds the rank: {"pid": int, "host": str}
        self.holder: dict[str, Any] | None = None
        #: monotonic time of the controller's last message other than a heartbeat
        #: (set by the worker's I/O): it was alive, and went on, after that
        self.ordered = 0.0
        self._last_attach = 0.0  # the newest accepted attach's timestamp (epoch s)
        # verifies attach messages: their controllers' epochs are new to this worker
        self.codec = protocol.Codec(worker.codec.key, f"r{worker.rank}")
        #: the ZAP handler of a TCP attach endpoint (admits the mesh's client key only)
        self.gate: KeyGate | None = None
        self.sock = self._bind(endpoint)
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def _bind(self, endpoint: str) -> zmq.Socket:
        """The attach endpoint's ROUTER, bound at ``endpoint``. A TCP one is a
        CurveZMQ server (:func:`curve_attach_keypair` of the mesh key) in a
        context of its own, whose ZAP handler admits only the mesh's client key
        (:func:`curve_client_keypair`): another user who learns the address
        cannot even complete a handshake. Host ``*`` binds the address of this
        host that reaches the controller (a Slurm node's own address)."""
        key = self.w.codec.key
        if not endpoint.startswith("tcp://"):
            sock = self.w.ctx.socket(zmq.ROUTER)
            sock.linger = 0
            sock.setsockopt(zmq.MAXMSGSIZE, 1 << 20)
            sock.bind(endpoint)
            return sock
        host, _, port = endpoint[len("tcp://"):].rpartition(":")
        if host in ("", "*", "0.0.0.0"):
            ctl = str(self.w.address).split("//", 1)[-1].rsplit(":", 1)[0].strip("[]")
            host = "127.0.0.1" if is_loopback(ctl) else (address_towards(ctl)
                                                          or primary_address())
        client = curve_client_keypair(key)[0]
        ctx = zmq.Context()  # (one ZAP handler per context: the actor peers' is the worker's)
        self.gate = KeyGate(ctx, lambda k: hmac.compare_digest(k, client))
        sock = ctx.socket(zmq.ROUTER)
        sock.linger = 0
        sock.setsockopt(zmq.MAXMSGSIZE, 1 << 20)
        sock.curve_secretkey = curve_attach_keypair(key)[1]
        sock.curve_server = True
        sock.bind(f"tcp://{host}:{port or 0}")
        return sock

    def start(self) -> None:
        """Have the worker's I/O read the attach endpoint."""
        self.w.io.engine.add(self.sock, self._on_attach_socket, order=1)

    # ----------------------------------------------------------------- sending
    def send(self, type: str, content: Any, parent: str | None) -> None:
        """Journal and send one message to the controller (any thread); while
        detached, journal only.

        Raises
        ------
        SerializationError
            If ``content`` cannot be pickled.
        """
        with self.lock:
            if type == "stream" and (parent or self.detached):
                # (output of no request is kept only while detached, under "")
                self._keep(parent or "", content["name"], content["text"])
            elif type == "reply" and parent:
                self._reply(parent, content)
            elif type == "replies":
                for p, v in content:
                    self._reply(str(p), {"status": "ok", "value": v})
            if self.detached:
                return
            w = self.w
            frames = w.codec.encode(type, content, parent)
            try:
                w.send_encoded(frames)
            except zmq.ZMQError:
                return
            if type == "reply" and parent:  # the controller has it
                self._delivered(parent)
            elif type == "replies":
                for p, _ in content:
                    self._delivered(str(p))

    def _reply(self, parent: str, content: dict[str, Any]) -> None:
        """Keep the reply of request ``parent``; while detached, at most
        :attr:`max_replies` of them, the oldest dropped first (lock held)."""
        e = self.journal.setdefault(parent, _Entry())
        new = e.reply is None
        e.reply = content
        if not (new and self.detached):
            return
        self.kept.append(parent)
        while len(self.kept) > self.max_replies:
            old = self.kept.popleft()
            o = self.journal.get(old)
            if o is None or o.reply is None or o.delivered:
                continue
            self.dropped += o.nbytes
            self._forget(old)
            self.dropped_replies += 1

    def _keep(self, parent: str, name: str, text: str) -> None:
        e = self.journal.get(parent)
        if e is None:
            if len(self.journal) >= MAX_ENTRIES:
                self._prune()
            e = self.journal[parent] = _Entry()
        n = len(text.encode("utf-8", "surrogatepass")) if not text.isascii() else len(text)
        e.chunks.append((name, text))
        e.nbytes += n
        self.total += n
        while self.total > self.bound:  # drop the oldest output first
            for old in self.journal.values():
                if old.chunks:
                    oname, otext = old.chunks.popleft()
                    m = len(otext.encode("utf-8", "surrogatepass"))
                    old.nbytes -= m
                    old.dropped += m
                    self.total -= m
                    self.dropped += m
                    break
            else:
                break

    def _delivered(self, parent: str) -> None:
        e = self.journal.get(parent)
        if e is None:
            return
        e.delivered = True
        e.delivered_at = time.monotonic()
        if not e.chunks:  # (only the reply: kept a while, see _suspect and beat)
            return
        self.delivered.append(parent)
        while len(self.delivered) > MAX_DELIVERED:
            old = self.delivered.popleft()
            o = self.journal.get(old)
            if o is not None and o.delivered:
                self._forget(old)

    def _prune(self) -> None:
        """Forget the entries of requests that no thread serves, that have no reply
        and whose output was all dropped (one-way calls: nobody answers them), once
        there are many (lock held)."""
        serving = set(self.w.serving())
        for p in [p for p, e in self.journal.items()
                  if p and not e.chunks and e.reply is None and p not in serving]:
            del self.journal[p]

    def _forget(self, parent: str) -> None:
        e = self.journal.pop(parent, None)
        if e is not None:
            self.total -= e.nbytes

    # -------------------------------------------------------------- the I/O
    def beat(self, now: float) -> None:
        """Every heartbeat (the thread that leads): a heartbeat to the controller,
        or, detached, the keep-alive check; a controller on this host whose pid
        is gone detaches the worker at once."""
        if not self.detached:  # replies without output the controller outlived: not kept
            for p in [p for p, e in self.journal.items()
                      if p and e.delivered and not e.chunks and e.delivered_at < self.ordered]:
                self._forget(p)
        if self.detached:
            gone = time.monotonic() - self.since
            if gone > self.keep_alive:
                log.warning("rank %d: no controller attached for %.0f s (the mesh's "
                            "keep-alive); exiting", self.w.rank, gone)
                exit_process(messages.EXIT_KEEP_ALIVE)
            return
        if self.holder is not None and not _holder_alive(self.holder):
            self.lost("its process is gone")
            return
        try:
            self.send("heartbeat", None, None)
        except Exception:  # noqa: BLE001 - the connection is changing
            log.debug("heartbeat not sent", exc_info=True)

    def lost(self, why: str, clean: bool = False) -> None:
        """The controller is gone (or said ``detach``: ``clean``): keep running,
        detached. A controller that went away unannounced (killed) may never
        have read, let alone shown, the replies sent to it after the last
        message it sent other than a heartbeat (:attr:`ordered`): those count
        as not delivered (:meth:`_suspect`), so the next controller is given
        them, with their output."""
        with self.lock:
            if self.detached:
                return
            if not clean:
                self._suspect(self.ordered)
            log.info("rank %d: the controller left (%s); detached, waiting %.0f s for "
                     "another", self.w.rank, why, self.keep_alive)
            # (the connections stay until a controller takes over: a reply just sent
            # to a controller that detached on purpose still leaves)
            self.detached = True
            self.since = time.monotonic()

    def shown(self) -> None:
        """The controller that detached showed everything sent to it: drop the
        output kept so far (lock held), so that the next attach replays only
        what is printed from now on."""
        for p, e in list(self.journal.items()):
            if not p:
                self._forget(p)
                continue
            self.total -= e.nbytes
            e.chunks.clear()
            e.nbytes = e.dropped = 0
        self.dropped = 0

    def _suspect(self, since: float) -> None:
        """Count the replies sent at or after monotonic time ``since`` as not
        delivered (lock held)."""
        for p, e in self.journal.items():
            if p and e.delivered and e.delivered_at >= since:
                e.delivered = False

    def _disconnect(self) -> None:
        w = self.w
        for sock, addr in ((w.dealer, w.down_address), (w.up, w.address)):
            if sock is not None and addr:
                try:
                    sock.disconnect(addr)
                except zmq.ZMQError:
                    pass

    def _on_attach_socket(self, sock: zmq.Socket) -> None:
        for frames in drain(sock):
            try:
                msg = self.codec.decode(frames, router=True)
            except ProtocolError as e:
                self.w.io.drops.drop(getattr(e, "reason", "malformed"), str(e), b"attach")
                continue
            if msg.type != "attach" or not isinstance(msg.content, dict):
                continue
            try:
                answer = self.take(msg.content)
            except Exception as e:  # noqa: BLE001 - told to the controller that asked
                log.exception("rank %d: attach failed", self.w.rank)
                answer = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            try:
                send_frames(sock, [*msg.identity,
                                   *self.codec.encode("attach", answer, parent=msg.id)])
            except zmq.ZMQError:
                pass

    def take(self, c: dict[str, Any]) -> dict[str, Any]:
        """Let the controller described by ``c`` (an attach message's content)
        take this rank over, or say why not (the thread that leads the I/O)."""
        w = self.w
        with self.lock:
            t = float(c["t"])
            if t <= self._last_attach:
                return {"ok": False, "error": "a stale attach request (replayed?)"}
            now = time.monotonic()
            held = (not self.detached and now - w.io.last_heard < w.heartbeat_timeout
                    and _holder_alive(self.holder))
            gone = c.get("holder_gone")
            if held and isinstance(gone, dict) and self.holder is not None and (
                    gone.get("pid") == self.holder.get("pid")
                    and gone.get("host") == self.holder.get("host")):
                held = False  # (its host saw it gone; this one cannot look)
            if held and not c.get("steal"):
                return {"ok": False, "busy": True, "holder": self.holder}
            if held:  # taken over: the old controller is told, then left
                try:
                    w.send_encoded(w.codec.encode("event", {
                        "kind": "taken_over", "pid": c["pid"], "host": c["host"],
                        "stop": bool(c.get("stop"))}))
                except Exception:  # noqa: BLE001 - it learns anyway: its rank is silent
                    log.debug("could not tell the old controller", exc_info=True)
            self._last_attach = t
            self._disconnect()
            w.address, w.down_address = str(c["up"]), str(c["down"])
            key = c.get("curve_server_key")
            for sock in (w.dealer, w.up):
                if key:
                    sock.curve_serverkey = key
            w.dealer.connect(w.down_address)
            w.up.connect(w.address)
            w.codec.restart(int(c["rank_epoch"]))
            w.codec.expect("ctl", int(c["ctl_epoch"]), int(c["floor"]))
            self.holder = {"pid": int(c["pid"]), "host": str(c["host"])}
            self.detached = False
            w.io.last_heard = now
            state = self.report()
            self.send("hello", {"rank": w.rank, "pid": os.getpid(),
                                "host": socket.gethostname(), "down": True,
                                "attach": self.endpoint, "resume": state}, None)
            for p in [p for p, e in self.journal.items() if e.reply is not None or not p]:
                self._forget(p)  # (handed over in the hello)
            self.delivered.clear()
            self.kept.clear()
            self.dropped = 0
            self.dropped_replies = 0
            return {"ok": True, "pid": os.getpid()}

    def report(self) -> dict[str, Any]:
        """What this rank tells a controller that attaches (lock held)."""
        w = self.w
        running: dict[str, Any] = {}
        serving = w.serving()
        queued = [m.id for m in list(w.requests.queue) if m is not None]
        for pid_ in [*serving, *queued]:
            running.setdefault(pid_, {"output": [], "dropped": 0, "finished": False})
        background = list(self.journal[""].chunks) if "" in self.journal else []
        for p, e in list(self.journal.items()):
            if not p:
                continue
            if e.reply is None and p not in running:  # (a one-way call's: nobody waits)
                background.extend(e.chunks)
                self._forget(p)
                continue
            running[p] = {"output": list(e.chunks), "dropped": e.dropped,
                          "finished": e.reply is not None, "reply": e.reply,
                          "delivered": e.delivered}
        paused = False
        try:
            paused = telemetry.current_activity().startswith("paused")
        except Exception:  # noqa: BLE001 - telemetry is optional here
            pass
        state: dict[str, Any] = {"pid": os.getpid(), "requests": running,
                                 "background": background,
                                 "dropped": self.dropped, "paused": paused,
                                 "bound": self.bound,
                                 "dropped_replies": self.dropped_replies,
                                 "max_replies": self.max_replies}
        for fn in _reporters:
            try:
                state.update(fn(w))
            except Exception:  # noqa: BLE001 - one feature's state is missing, said so
                log.exception("rank %d: a state reporter failed", w.rank)
        return state


def from_environment(worker: Any) -> Detachable | None:
    """The :class:`Detachable` of ``worker`` if the environment makes it one
    (the variables are removed from the environment), else None.

    Raises
    ------
    ValueError
        For a keep-alive that is not a positive number, or an output or reply
        bound that is negative.
    """
    endpoint = os.environ.pop(ATTACH_ENV, "")
    holder = os.environ.pop(HOLDER_ENV, "")
    keep = os.environ.pop(KEEP_ALIVE_ENV, "")
    bound = os.environ.pop(OUTPUT_BYTES_ENV, "")
    replies = os.environ.pop(REPLIES_ENV, "")
    if not endpoint:
        return None
    keep_alive = float(keep) if keep else DEFAULT_KEEP_ALIVE
    nbytes = int(bound) if bound else DEFAULT_OUTPUT_BYTES
    nreplies = int(replies) if replies else DEFAULT_REPLIES
    if not keep_alive > 0 or nbytes < 0 or nreplies < 0:
        raise ValueError(f"{KEEP_ALIVE_ENV} must be > 0, {OUTPUT_BYTES_ENV} and "
                         f"{REPLIES_ENV} >= 0")
    d = Detachable(worker, endpoint, keep_alive, nbytes, nreplies)
    pid, _, host = holder.partition("@")
    if pid.isdigit():
        d.holder = {"pid": int(pid), "host": host}
    return d


def _on_detach(worker: Any, msg: protocol.Message) -> None:
    """The controller leaves on purpose (``ProcMesh.detach``, a kernel shutting down)."""
    d = getattr(worker, "detach", None)
    if d is not None:
        with d.lock:  # (the reply leaves before the rank stops sending)
            worker.send("reply", {"status": "ok", "value": None}, msg.id)
            d.lost("it detached", clean=True)
            if isinstance(msg.content, dict) and msg.content.get("shown"):
                d.shown()


handlers.register_io("detach", _on_detach)
