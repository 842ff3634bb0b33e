"""The controller: registry, routing, heartbeats and supervision of one mesh.

A :class:`Controller` lives in the kernel process (or in the script that
drives a mesh). It binds two ZeroMQ ROUTER sockets: ``router`` (worker ->
controller, read by the I/O thread only) and ``router_down`` (controller ->
worker, never read; any thread sends on it under ``_down_lock``, so a request
leaves without a hand-off). Every worker connects a DEALER to each, with one
routing identity ``r<rank>.<random>``; the controller routes to the identity
that carried the rank's signed ``hello`` and drops messages from any other
connection. Requests carry a message id; replies, output and rich display
carry that id as their parent and are routed to the :class:`Request` that is
waiting for them.

The I/O thread reads ``router`` and the stdout/stderr pipes of local workers
(their output, read before each of their replies), sends heartbeats, and
watches the workers: a local worker's exit is seen through its process
within ~0.1 s, a remote worker's after three missed heartbeats. A dead rank
fails every request waiting on it with
:class:`~monarch_kernel.errors.MeshFailure`. Request callbacks run on the
I/O thread, outside the controller's lock; they must not block.
"""

from __future__ import annotations

import _signal
import logging
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import zmq

from . import protocol, shm
from .errors import MeshFailure, ProtocolError, TransportError
from .request import RankInfo, Request, _Pipe
from .transport import Outbox, bind_router, drain, inproc_pair, is_loopback, send_frames

log = logging.getLogger("monarch_kernel.controller")
_SIGINT = int(signal.SIGINT)

__all__ = ["Controller", "RankInfo", "Request"]


class Controller:
    """Owns the ROUTER socket of one mesh and routes its messages.

    Parameters
    ----------
    bind : str
        Address to bind (default loopback, ``127.0.0.1``).
    heartbeat : float
        Seconds between heartbeats, both ways.
    on_output : callable(rank, name, text) or None
        Receives output that belongs to no running request (background
        actor work). Default: logged.
    key : bytes or None
        The mesh key; a fresh random one by default.
    encrypt : bool or None
        Encrypt traffic with CurveZMQ. Default: on when ``bind`` is not a
        loopback address. Turning it off there prints a warning.
    """

    def __init__(
        self,
        bind: str = "127.0.0.1",
        heartbeat: float = 1.0,
        on_output: Callable[[int, str, str], None] | None = None,
        key: bytes | None = None,
        encrypt: bool | None = None,
    ) -> None:
        self.key = key or protocol.new_key()
        self.codec = protocol.Codec(self.key, "ctl")
        self.codec.pool = shm.Pool()
        self.heartbeat = heartbeat
        self.on_output = on_output
        self.ctx = zmq.Context()
        if encrypt is None:
            encrypt = not is_loopback(bind)
        self.curve_public_key: bytes | None = None
        secret = None
        if encrypt:
            self.curve_public_key, secret = zmq.curve_keypair()
        elif not is_loopback(bind):
            log.info("the controller binds %s, beyond loopback, with encryption turned "
                        "off: messages are signed but anyone on that network can read them",
                        bind)
        self.router, self.address = bind_router(self.ctx, bind, secret)
        # controller -> worker traffic leaves on a second socket that no thread reads:
        # any thread sends on it under a lock, without a hand-off to the I/O thread
        self.router_down, self.down_address = bind_router(self.ctx, bind, secret)
        self.router_down.rcvhwm = 1  # nothing is read here: bound what a peer can queue
        self._down_lock = threading.Lock()
        self.pull, inproc = inproc_pair(self.ctx)
        self.outbox = Outbox(self.ctx, inproc)
        self.ranks: dict[int, RankInfo] = {}
        self.pending: dict[str, Request] = {}
        self._lock = threading.RLock()
        self._hello = threading.Condition(self._lock)
        self._closed = threading.Event()
        self.poll_exits: Callable[[], dict[int, int]] | None = None  # set by the launcher
        self.leftover_output: Callable[[int], list[tuple[str, bytes]]] | None = None
        # output pipes of local workers, read here only (see adopt_pipes)
        self._pipes: dict[int, _Pipe] = {}  # fd -> pipe (I/O thread only)
        self._new_pipes: list[tuple[int, int, int]] = []  # (rank, stdout fd, stderr fd)
        self._rank_polls: dict[int, select.poll] = {}  # rank -> poll of its pipes
        self.local_ranks: set[int] = set()
        self.restart_timeout = 120.0  # seconds a request waits for a restarting rank
        self.stopping = False  # set while the mesh is being stopped on purpose
        #: failures of meshes spawned by actors that no __supervise__ handled
        self.unhandled: list[str] = []
        self.listeners: list[Callable[[str, int, Any], None]] = []
        # leader/follower state (see _io_loop)
        self._lead = threading.Lock()
        self._leader: int | None = None  # thread ident of a caller that leads
        self._want = 0  # callers waiting to lead
        self._want_lock = threading.Lock()
        self._led_at = 0.0  # monotonic time a caller last stopped leading
        self._resume = threading.Event()  # wakes the I/O thread (resume_io)
        self._stepped_at = time.monotonic()  # last I/O step, by any thread
        self._poller: zmq.Poller | None = None
        self._last_beat = self._last_check = time.monotonic()
        self._thread = threading.Thread(target=self._io_loop, name="monarch-controller",
                                        daemon=True)
        self._thread.start()

    # -------------------------------------------------------------- sending
    def _send(self, ranks: Iterable[int], frames: list[Any]) -> None:
        with _DeferredSigint():  # Ctrl-C never leaves half a message on a socket
            self._send_to(ranks, frames)

    def _send_to(self, ranks: Iterable[int], frames: list[Any]) -> None:
        for r in ranks:
            info = self.ranks.get(r)
            if info is not None and info.identity:  # else not connected yet: nowhere to send
                if info.down:
                    # just after its hello, a rank's second connection may not be
                    # attached yet: wait for it then (never on the I/O thread, never
                    # while stopping)
                    fresh = time.monotonic() - info.hello_at < 5.0
                    wait = (fresh and not self.stopping
                            and threading.current_thread() is not self._thread
                            and self._leader != threading.get_ident())
                    if not self._send_down(info.identity, frames, retry=2.0 if wait else 0.0):
                        raise TransportError(f"cannot send to rank {r}: it is not connected")
                else:
                    self.outbox.send([info.identity, *frames])

    def _send_down(self, ident: bytes, frames: list[Any], retry: float = 2.0) -> bool:
        """Send on the second socket; a worker whose second connection is not
        attached yet (just after its hello) is retried for ``retry`` seconds."""
        deadline = time.monotonic() + retry
        with self._down_lock:  # held while retrying: nothing overtakes this message
            while True:
                if self._closed.is_set():
                    return False
                try:
                    send_frames(self.router_down, [ident, *frames])
                    return True
                except zmq.ZMQError as e:
                    if e.errno != zmq.EHOSTUNREACH:
                        log.debug("cannot send to %r: %s", ident, e)
                        return False
                if time.monotonic() > deadline:
                    log.debug("no second connection from %r", ident)
                    return False
                time.sleep(0.001)

    def request(self, ranks: Iterable[int], type: str, content: Any = None) -> Request:
        """Send one request to ``ranks`` and return the :class:`Request` to wait on.

        Raises
        ------
        MeshFailure
            If one of the ranks is already dead or stopped.
        SerializationError
            If ``content`` cannot be pickled.
        """
        ranks = list(ranks)
        with self._lock:
            starting = []
            for r in ranks:
                info = self.ranks.get(r)
                if info is None:
                    raise MeshFailure(f"rank {r} is not part of this mesh", rank=r)
                if info.state in ("dead", "stopped"):
                    err = self.rank_failure(r)
                    if info.state == "dead":
                        err.args = (f"{err.args[0]}\nRestart it with  %mesh restart {r}  "
                                    f"(or mesh.restart({r})).",)
                    raise err
                if info.state == "starting":
                    starting.append(r)
        if starting:  # being restarted: wait for it rather than send into the void
            self.wait_ready(starting, self.restart_timeout)
        mid = self.codec.new_id()
        local = all(r in self.local_ranks for r in ranks)
        names: list[str] = []
        frames = self.codec.encode(type, content, id=mid, shm="sender" if local else None,
                                   shm_out=names)
        req = Request(mid, ranks)
        req.waiter = self.wait_for
        if names:  # remove the shared-memory files once every rank answered
            req.add_done_callback(lambda r, names=names: self.codec.release_shm(
                names, discard=r.failure is not None))
        with self._lock:
            self.pending[req.id] = req
            for r in ranks:
                self.ranks[r].state = "busy"
                self.ranks[r].messages_out += 1
        try:
            self._send(ranks, frames)
        except TransportError as e:
            with self._lock:
                self.pending.pop(req.id, None)
            raise MeshFailure(f"cannot reach the mesh: {e}") from e
        return req

    def notify(self, ranks: Iterable[int], type: str, content: Any = None) -> None:
        """Send a one-way message (no reply expected) to ``ranks``."""
        ranks = [r for r in ranks if self.ranks.get(r) and self.ranks[r].state
                 not in ("dead", "stopped")]
        if ranks and not self.stopping:
            try:
                self._send(ranks, self.codec.encode(type, content))
            except TransportError as e:  # one-way: a rank that went away misses it
                log.debug("a one-way %r message was not delivered: %s", type, e)

    # ------------------------------------------------------------- registry
    def expect(self, ranks: Iterable[int], local: bool = True) -> None:
        """Register ranks that a launcher is starting."""
        with self._lock:
            for r in ranks:
                self.ranks[r] = RankInfo(r)
                if local:
                    self.local_ranks.add(r)
                else:
                    self.local_ranks.discard(r)

    def wait_ready(self, ranks: Iterable[int], timeout: float) -> None:
        """Wait until every rank in ``ranks`` said hello.

        Raises
        ------
        MeshFailure
            If a rank died while starting.
        TimeoutError
            If some ranks did not connect within ``timeout`` seconds.
        """
        ranks = list(ranks)
        deadline = time.monotonic() + timeout
        with self._hello:
            while True:
                for r in ranks:
                    if self.ranks[r].state in ("dead", "stopped"):
                        raise self.rank_failure(r, starting=True)
                missing = [r for r in ranks if self.ranks[r].state == "starting"]
                if not missing:
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"ranks {missing} did not connect to the controller at {self.address} "
                        f"within {timeout:.0f} s; check that workers can reach that address"
                    )
                self._hello.wait(min(left, 0.1))

    def rank_failure(self, rank: int, starting: bool = False) -> MeshFailure:
        """A :class:`MeshFailure` describing why ``rank`` is gone."""
        info = self.ranks[rank]
        where = f" on {info.host}" if info.host else ""
        pid = f" (pid {info.pid})" if info.pid else ""
        if info.state == "stopped":
            msg = f"rank {rank}{where}{pid} was stopped"
        else:
            msg = f"rank {rank}{where}{pid} {info.describe_exit()}"
            if starting:
                msg += " while starting"
        lines = list(info.last_lines)
        if info.partial:
            lines.append(info.partial)
        if lines:
            msg += "; its last output:\n" + "\n".join(f"  {ln}" for ln in lines[-10:])
        return MeshFailure(msg, rank=rank, host=info.host, pid=info.pid,
                           exitcode=info.exitcode, last_output="\n".join(lines))

    def mark_dead(self, rank: int, exitcode: int | None, state: str = "dead") -> None:
        """Record that ``rank`` is gone and fail every request waiting on it."""
        with self._lock:
            info = self.ranks.get(rank)
            if info is None or info.state in ("dead", "stopped"):
                return
            info.state = state
            info.exitcode = exitcode
            failure = self.rank_failure(rank)
            waiting = [q for q in self.pending.values()
                       if rank in q.ranks and rank not in q.replies]
            self._hello.notify_all()
        for req in waiting:
            # the request fails now, but stays routable for a while: what the other
            # ranks print (and their replies, once interrupted) still reach it
            req.failed_at = time.monotonic()
            req._fail(failure)
            with self._lock:
                self._retire_if_settled(req)
        self._notify_listeners("dead", rank, failure)

    def _retire_if_settled(self, req: Request) -> None:
        """Forget a failed request once every rank replied or is gone (lock held)."""
        if all(r in req.replies or self.ranks[r].state in ("dead", "stopped")
               for r in req.ranks):
            self.pending.pop(req.id, None)

    def adopt_pipes(self, rank: int, stdout_fd: int, stderr_fd: int) -> None:
        """Take the read ends of a local worker's stdout/stderr pipes (any thread).

        From then on the I/O thread alone reads them: live, before handling the
        rank's replies (so a reply never overtakes its output), and to the end
        when the rank dies (so nothing it wrote is lost); it closes them at EOF.
        """
        with self._lock:
            self._new_pipes.append((rank, stdout_fd, stderr_fd))
        try:  # wake the I/O thread so it registers them now
            self.outbox.send([b""])
        except TransportError:
            pass

    def _register_pipes(self, poller: zmq.Poller) -> None:
        with self._lock:
            new, self._new_pipes = self._new_pipes, []
        for rank, out_fd, err_fd in new:
            for fd, name in ((out_fd, "stdout"), (err_fd, "stderr")):
                self._pipes[fd] = _Pipe(rank, name, fd)
                poller.register(fd, zmq.POLLIN)
                if rank not in self._rank_polls:
                    self._rank_polls[rank] = select.poll()
                self._rank_polls[rank].register(fd, select.POLLIN)

    def _read_pipe(self, pipe: _Pipe, poller: zmq.Poller | None) -> None:
        """Forward what is in ``pipe`` now; close it at EOF."""
        while True:
            try:
                data = os.read(pipe.fd, 65536)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:  # every writer is gone
                if poller is not None:
                    poller.unregister(pipe.fd)
                rank_poll = self._rank_polls.get(pipe.rank)
                if rank_poll is not None:
                    rank_poll.unregister(pipe.fd)
                self._pipes.pop(pipe.fd, None)
                os.close(pipe.fd)
                return
            text = pipe.decoder.decode(data)
            if text:
                self._deliver_stream(pipe.rank, pipe.name, text, self._running_request(pipe.rank))
            if len(data) < 65536:
                return

    def _drain_pipes(self, rank: int) -> None:
        """Forward everything ``rank`` wrote so far (the thread that leads);
        one poll(2) of the rank's pipes when there is nothing to read."""
        rank_poll = self._rank_polls.get(rank)
        if rank_poll is None:
            return
        for fd, _ in rank_poll.poll(0):
            pipe = self._pipes.get(fd)
            if pipe is not None:
                self._read_pipe(pipe, self._poller)

    def _running_request(self, rank: int) -> Request | None:
        """The request ``rank`` is working on: its oldest unanswered one."""
        with self._lock:
            for q in self.pending.values():
                if rank in q.ranks and rank not in q.replies and q.failure is None:
                    return q
            for q in self.pending.values():  # failed, but still routable for a while
                if rank in q.ranks and rank not in q.replies:
                    return q
        return None

    def _notify_listeners(self, kind: str, rank: int, payload: Any) -> None:
        for fn in list(self.listeners):
            try:
                fn(kind, rank, payload)
            except Exception:
                log.exception("a controller listener failed")

    # ------------------------------------------------------------ I/O thread
    # Leader/follower: whoever holds ``_lead`` does the I/O duties (reads
    # ``router``, the outbox and the pipes, checks ranks, sends heartbeats).
    # The I/O thread leads by default; a thread that waits for a reply
    # (``wait_for``) takes the lead and reads its reply itself, so a call
    # costs no thread hand-off on this side (as in the leader/follower
    # pattern of Schmidt et al., POSA2). The I/O thread steps back while a
    # caller leads, and takes the lead again 10-15 ms after the last one (not at
    # once: back-to-back calls then need no wake-up of this thread).
    def _io_loop(self) -> None:
        self._poller = poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self.pull, zmq.POLLIN)
        self._last_beat = self._last_check = time.monotonic()
        try:
            while not self._closed.is_set():
                now = time.monotonic()
                if ((self._want or now - self._led_at < 0.01)
                        and now - self._stepped_at < 0.05):
                    # a caller leads, or led just now: let it go on (resume_io wakes);
                    # but never 50 ms without a step (heartbeats, exits, a burst of
                    # calls that are waited for later)
                    self._resume.wait(0.005)
                    self._resume.clear()
                    continue
                if self._lead.acquire(timeout=0.05):
                    try:
                        self._guarded_step(50 if not self._want else 0)
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
        deadline = None if timeout is None else time.monotonic() + timeout
        me = threading.get_ident()
        if self._leader == me or threading.current_thread() is self._thread:
            # nested (a callback waits, on a thread that leads): go on leading here
            while not event.is_set() and not self._closed.is_set():
                left = 0.05 if deadline is None else deadline - time.monotonic()
                if left <= 0:
                    return False
                self._guarded_step(max(1, int(min(left, 0.05) * 1000)))
            return event.is_set()
        # a SIGINT in the main thread is held back over all of this (bookkeeping
        # included): KeyboardInterrupt is raised when the lead is given back
        with _DeferredSigint() as sigint:
            led = self._lead_for(event, deadline, sigint)
        if led is None:  # closed (or closing): the I/O thread fails what is pending
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            return event.wait(left)
        return led

    def _lead_for(self, event: threading.Event, deadline: float | None,
                  sigint: _DeferredSigint) -> bool | None:
        """Take the lead (in 5 ms slices, watching ``event``) and lead until it
        is set; None when the controller is closed."""
        with self._want_lock:
            self._want += 1
        try:
            if not self._lead.acquire(blocking=False):
                try:  # the I/O thread leaves its poll and steps back
                    self.outbox.send([b""])
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
                    sigint: _DeferredSigint) -> bool | None:
        while not event.is_set():
            if sigint.hit is not None:  # raised as KeyboardInterrupt once leading stops
                return False
            if self._closed.is_set():
                return None
            left = 0.05 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                return False
            self._guarded_step(max(1, int(min(left, 0.05) * 1000)))
        return True

    def defer_io(self) -> None:
        """Keep the I/O thread from reading for the next 10-15 ms: the calling
        thread sent a request it will wait for (an actor call), and reads the
        replies itself then. During a burst of calls, replies then wait in
        ZeroMQ's queue instead of being handled by a second thread that
        competes with the sender for the GIL."""
        self._led_at = time.monotonic()

    def resume_io(self) -> None:
        """Let the I/O thread read again at once (undoes :meth:`defer_io`): a
        coroutine that awaits a reply cannot lead, the I/O thread reads it."""
        self._led_at = 0.0
        self._resume.set()

    def _io_step(self, poller: zmq.Poller, timeout_ms: int = 50) -> None:
        """One turn of the I/O: pipes, outbox, incoming messages, checks, beats
        (by whichever thread leads)."""
        if self._new_pipes:
            self._register_pipes(poller)
        events = dict(poller.poll(timeout_ms))
        self._stepped_at = time.monotonic()
        for fd in [e for e in events if isinstance(e, int) and e in self._pipes]:
            self._read_pipe(self._pipes[fd], poller)
        if self.pull in events:
            for frames in drain(self.pull):
                if len(frames) == 1:  # a wake-up (adopt_pipes, a caller that leads)
                    continue
                try:
                    send_frames(self.router, frames)
                except zmq.ZMQError as e:  # host unreachable: the rank is gone
                    log.debug("cannot send to %r: %s", frames[0].bytes, e)
        if self.router in events:
            for frames in drain(self.router):
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
                    if info.down:
                        self._send_down(info.identity, beat, retry=0)
                        continue
                    try:
                        send_frames(self.router, [info.identity, *beat])
                    except zmq.ZMQError:
                        pass

    def _check_ranks(self, now: float) -> None:
        if self.stopping:
            return
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

    def _receive(self, frames: list[Any]) -> None:
        try:
            msg = self.codec.decode(frames, router=True, lazy=True)
        except ProtocolError as e:
            log.warning("the controller dropped a message: %s", e)
            return
        ident = msg.identity[0] if msg.identity else b""
        s = msg.sender
        info = self.ranks.get(int(s[1:])) if s[:1] == "r" and s[1:].isdigit() else None
        if info is None:
            log.warning("the controller dropped a message from unknown sender %r", s)
            return
        rank = info.rank
        if msg.type == "hello":  # signed by a worker of this mesh: its connection is the rank's
            info.identity = ident
        elif ident != info.identity:
            log.warning("the controller dropped a message whose sender %r does not match "
                        "its connection %r", s, ident)
            return
        info.last_heard = time.monotonic()
        info.messages_in += 1
        t = msg.type
        if t == "heartbeat":
            return
        if t == "reply":
            self._drain_pipes(rank)  # its output comes before its reply
            try:
                c = msg.content
                status, value = c["status"], c["value"]
            except (ProtocolError, KeyError, TypeError) as e:
                # a signed reply that does not unpickle here (a CUDA tensor on a host
                # without GPU, an exception class only the workers have): an error
                # reply, never a request that waits forever
                status, value = "error", {
                    "type": "monarch_kernel.errors.SerializationError", "traceback": "",
                    "message": f"the reply of rank {rank} cannot be decoded here: {e}",
                    "exc": None}
            self._on_reply(info, msg.parent, status, value)
            return
        if t == "replies":  # several ok replies in one message (a worker's batch)
            self._drain_pipes(rank)  # their output comes before them
            try:
                items = [(str(p), "ok", v) for p, v in msg.content]
            except (ProtocolError, TypeError, ValueError) as e:
                log.warning("the controller dropped a malformed batch of replies from "
                            "rank %d: %s", rank, e)
                return
            for parent, status, value in items:
                self._on_reply(info, parent, status, value)
            return
        if t == "stream":
            c = msg.content
            self._deliver_stream(rank, c["name"], c["text"], self.pending.get(msg.parent or ""))
            return
        if t == "debug":  # a remote pdb paused / runs on / ended (see debug/server.py)
            c = msg.content
            with self._lock:
                if c.get("kind") == "paused":
                    info.state = "paused"
                elif info.state == "paused":
                    info.state = "busy" if any(rank in q.ranks and rank not in q.replies
                                               for q in self.pending.values()) else "idle"
            self._notify_listeners("debug", rank, c)  # the debug registry, first
            req = self.pending.get(msg.parent or "")
            if req is not None:
                req.put_event(("debug", rank, c))
            return
        if t == "display":
            req = self.pending.get(msg.parent or "")
            if req is not None:
                req.put_event(("display", rank, msg.content))
            return
        if t == "hello":
            with self._hello:
                c = msg.content
                info.host, info.pid = c["host"], c["pid"]
                info.down = bool(c.get("down"))
                info.hello_at = time.monotonic()
                if info.state == "starting":
                    info.state = "idle"
                self._hello.notify_all()
            self._notify_listeners("hello", rank, msg.content)
            return
        if t == "state":
            info.telemetry = msg.content
            self._notify_listeners("state", rank, msg.content)
            return
        if t == "event":
            c = msg.content
            if isinstance(c, dict) and c.get("kind") == "supervision":
                # an actor's child mesh failed and its __supervise__ did not handle it
                text = (f"unhandled failure in a mesh spawned by actor {c.get('actor')!r} "
                        f"on rank {rank}: {c.get('failure')}")
                self.unhandled.append(text)
                log.warning("%s", text)
                print(f"[monarch] {text}", file=sys.stderr, flush=True)
            self._notify_listeners("event", rank, msg.content)
            return

    def _on_reply(self, info: RankInfo, parent: str | None, status: str, value: Any) -> None:
        """Record one rank's reply to request ``parent``; finish it when complete."""
        rank = info.rank
        finished = None
        with self._lock:
            req = self.pending.get(parent or "")
            if req is not None and req._reply_pending(rank):
                req.replies[rank] = (status, value)
                if len(req.replies) >= len(req.ranks):
                    self.pending.pop(req.id, None)
                    finished = req
                elif req.failure is not None:
                    self._retire_if_settled(req)
            if info.state == "busy" and not any(
                rank in q.ranks and rank not in q.replies for q in self.pending.values()
            ):
                info.state = "idle"
        if finished is not None:
            finished._finish()  # callbacks run outside the controller's lock

    def _deliver_stream(self, rank: int, name: str, text: str, req: Request | None) -> None:
        self._remember_output(self.ranks[rank], text)
        if req is not None:
            req.put_event(("stream", rank, name, text))
        elif self.on_output is not None:
            self.on_output(rank, name, text)
        else:
            log.info("[%d] %s", rank, text.rstrip("\n"))

    def _deliver_leftover(self, rank: int) -> None:
        """Forward what a dead rank wrote but never sent (read from the launcher's pipes)."""
        try:
            chunks = self.leftover_output(rank) if self.leftover_output else []
        except Exception:
            log.exception("reading the output of dead rank %d failed", rank)
            return
        with self._lock:
            waiting = [q for q in self.pending.values()
                       if rank in q.ranks and rank not in q.replies]
        for name, data in chunks:
            text = data.decode("utf-8", errors="replace")
            if waiting:
                for q in waiting:
                    self._deliver_stream(rank, name, text, q)
            else:
                self._deliver_stream(rank, name, text, None)

    @staticmethod
    def _remember_output(info: RankInfo, text: str) -> None:
        text = info.partial + text
        *lines, info.partial = text.split("\n")
        info.last_lines.extend(lines)
        if len(info.partial) > 4096:
            info.partial = info.partial[-4096:]

    # --------------------------------------------------------------- closing
    def close(self) -> None:
        """Stop the I/O thread and close every socket (idempotent)."""
        if self._closed.is_set():
            return
        with self._lock:
            pending = list(self.pending.values())
            self.pending.clear()
        for req in pending:
            req._fail(MeshFailure("the mesh was stopped"))
        self._closed.set()
        self._thread.join(timeout=5)
        with self._down_lock:
            self.router_down.close(0)
        self.outbox.close()
        self.ctx.term()
        if self.codec.pool is not None:
            self.codec.pool.close()


class _DeferredSigint:
    """While the main thread leads the controller's I/O, a SIGINT is noted
    rather than raised in the middle of handling a message (which would lose
    it); the previous handler runs (KeyboardInterrupt) once leading stops."""

    def __init__(self) -> None:
        self.hit: tuple[int, Any] | None = None
        self.prev: Any = None

    def __enter__(self) -> _DeferredSigint:
        if threading.current_thread() is threading.main_thread():
            # the C functions: signal.signal's enum wrapping costs ~6 us a call here
            prev = _signal.getsignal(_SIGINT)
            if callable(prev):
                self.prev = prev
                _signal.signal(_SIGINT, self._note)
        return self

    def _note(self, signum: int, frame: Any) -> None:
        self.hit = (signum, frame)

    def __exit__(self, *exc: object) -> None:
        if self.prev is not None:
            _signal.signal(_SIGINT, self.prev)
            if self.hit is not None and exc[0] is None:
                self.prev(*self.hit)
