"""The controller: registry, routing, heartbeats and supervision of one mesh.

A :class:`Controller` lives in the kernel process (or in the script that
drives a mesh). It binds two ZeroMQ ROUTER sockets: ``router`` (worker ->
controller, read by whichever thread leads the I/O, see
:mod:`~monarch_kernel.controller.io`) and ``router_down`` (controller ->
worker, read only to throw away what arrives; any thread sends on it under
``_down_lock``, so a request leaves without a hand-off). A mesh on this host
binds both as Unix sockets in a private directory (only this user can
connect); TCP endpoints are CurveZMQ servers that admit only the mesh's
client key (:class:`~monarch_kernel.transport.sockets.KeyGate`). Every
worker connects a DEALER to each, with one routing identity
``r<rank>.<random>``; the controller routes to the identity that carried
the rank's signed ``hello`` and drops messages from any other connection.
A worker this controller started on its own host talks through a *lane*
instead (a Unix socket pair it inherited, :mod:`~monarch_kernel.transport.lane`:
no ZeroMQ I/O thread on either side), routed the same way: its identity is
the lane's. Requests carry a message id; replies, output and rich display
carry that id as their parent and are routed to the :class:`Request` that is
waiting for them.

The thread that leads the I/O (the I/O thread, or a caller waiting for its
reply) reads ``router``, the lanes of local workers and their stdout/stderr
pipes (their output, read before each of their replies), sends heartbeats, and watches
the workers: a local worker's exit is seen through its process
within ~0.1 s, a remote worker's after three missed heartbeats. A dead rank
fails every request waiting on it with
:class:`~monarch_kernel.errors.MeshFailure`. Request callbacks run on the
thread that leads, outside the controller's lock; they must not block.
"""

from __future__ import annotations

import collections
import hmac
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import zmq

from monarch_kernel.controller import batching
from monarch_kernel.controller.batching import Batcher
from monarch_kernel.controller.io import ControllerIO, spin_seconds
from monarch_kernel.controller.output_pipes import RankOutput
from monarch_kernel.controller.request import RankInfo, Request, request_label
from monarch_kernel.errors import (
    MeshFailure,
    ProtocolError,
    SerializationError,
    TransportError,
    ranks_label,
    restart_hint,
)
from monarch_kernel.transport.engine import Engine
from monarch_kernel.transport.lane import prepare as lane_prepare
from monarch_kernel.transport.sockets import (
    DOWN_MAX_MESSAGE,
    KeyGate,
    Outbox,
    bind_router,
    curve_client_keypair,
    drain,
    inproc_pair,
    is_loopback,
    max_message_bytes,
    private_dir,
    remove_private_dir,
    send_frames,
)
from monarch_kernel.util.droplog import DropLog
from monarch_kernel.util.flag import Flag
from monarch_kernel.util.sigint import DeferredSigint
from monarch_kernel.util.switches import lanes_enabled, peer_lead_enabled, sched_batch_enabled
from monarch_kernel.wire import protocol, shm
from monarch_kernel.wire.serialize import cuda_ipc

log = logging.getLogger("monarch_kernel.controller.controller")

__all__ = ["Controller", "RankInfo", "Request"]

#: seconds after a local rank died at which the controller sweeps this host's
#: pooled shared-memory files that nobody holds (shm.sweep_stale): a worker
#: killed outright leaves the files of its peer and buffer pools, which the
#: controller never saw; the second sweep takes those that were younger than
#: SWEEP_MIN_AGE_S at the first
SWEEP_AFTER_DEATH_S = (0.0, 11.0)
#: files younger than this (seconds) are left by a sweep (one being made may not
#: be locked yet)
SWEEP_MIN_AGE_S = 10.0
#: cells and endpoint calls kept in Controller.recent (the dashboard's timeline)
RECENT_REQUESTS = 20


class Controller:
    """Owns the ROUTER socket of one mesh and routes its messages.

    Its parts: :attr:`io` (:class:`~monarch_kernel.controller.io.ControllerIO`,
    on the I/O engine :attr:`engine`), :attr:`output` (the output pipes of
    local workers, :class:`~monarch_kernel.controller.output_pipes.RankOutput`)
    and :attr:`batcher` (:class:`~monarch_kernel.controller.batching.Batcher`).

    Parameters
    ----------
    bind : str or None
        None (the default): a mesh on this host; both endpoints are Unix
        sockets (``ipc://``) in a directory only this user can enter, made
        for this controller and removed by :meth:`close`: no TCP port is
        opened. An address (``127.0.0.1``, ``10.0.0.5``, ``0.0.0.0``): TCP
        there, for workers on other hosts or when TCP is asked for.
    heartbeat : float
        Seconds between heartbeats, both ways.
    on_output : callable(rank, name, text) or None
        Receives output that belongs to no running request (background
        actor work). Default: logged.
    key : bytes or None
        The mesh key; a fresh random one by default.
    encrypt : bool or None
        Encrypt TCP traffic with CurveZMQ and admit only workers that hold
        the mesh's client key (derived from ``key``, checked by ZAP at
        connect). Default: on for every TCP endpoint (ignored for ``ipc://``).
        Turning it off beyond loopback prints a warning.

    Raises
    ------
    ValueError
        If the environment variable ``MONARCH_SPIN_US`` (how long, in
        microseconds, a caller looks for its reply before it sleeps; see
        :mod:`monarch_kernel.controller.io`) is not a number from 0 to 10000,
        or ``MONARCH_LANES``, ``MONARCH_PEER_LEAD`` or ``MONARCH_SCHED_BATCH``
        (:mod:`monarch_kernel.util.switches`) is not 0 or 1, or
        ``MONARCH_MAX_MESSAGE_BYTES`` is not a number of bytes of at least 1 MiB.
    """

    def __init__(
        self,
        bind: str | None = None,
        heartbeat: float = 1.0,
        on_output: Callable[[int, str, str], None] | None = None,
        key: bytes | None = None,
        encrypt: bool | None = None,
    ) -> None:
        spin_s = spin_seconds()
        #: local workers talk to this controller through lanes (monarch_kernel.transport.lane)
        self.use_lanes = lanes_enabled()
        peer_lead_enabled()  # (refused now, if set wrong: the workers read them)
        sched_batch_enabled()
        max_message_bytes()
        self.key = key or protocol.new_key()
        self.codec = protocol.Codec(self.key, "ctl")
        #: messages refused, counted and reported in few lines (util.droplog)
        self.drops = DropLog(log, "the controller")
        self.codec.pool = shm.Pool()
        self._sweeps_due: list[float] = []  # monotonic times of sweeps after deaths
        swept = shm.sweep_stale(SWEEP_MIN_AGE_S)  # files of processes killed outright
        if swept:
            log.info("removed %d shared-memory files left by killed processes", len(swept))
        self.heartbeat = heartbeat
        self.on_output = on_output
        self.ctx = zmq.Context()
        #: the private directory of this controller's Unix sockets (a mesh on this
        #: host), removed by close(); None: TCP
        self.ipc_dir: str | None = private_dir() if bind is None else None
        encrypt = bind is not None and (encrypt is None or encrypt)
        self.curve_public_key: bytes | None = None
        #: the ZAP handler that admits only this mesh's client key (TCP with CurveZMQ)
        self.gate: KeyGate | None = None
        secret = None
        if encrypt:
            self.curve_public_key, secret = zmq.curve_keypair()
            client = curve_client_keypair(self.key)[0]
            self.gate = KeyGate(self.ctx, lambda k: hmac.compare_digest(k, client))
        elif bind is not None and not is_loopback(bind):
            log.info("the controller binds %s, beyond loopback, with encryption turned "
                        "off: messages are signed but anyone on that network can read them",
                        bind)
        host = bind or ""
        try:
            self.router, self.address = bind_router(self.ctx, host, secret,
                                                    ipc_dir=self.ipc_dir, name="up")
            # controller -> worker traffic leaves on a second socket that no thread reads
            # but to throw away what arrives (check_ranks): any thread sends on it under
            # a lock, without a hand-off to the I/O thread. Workers send nothing there:
            # a frame of more than a few bytes closes the connection, one is queued at most
            self.router_down, self.down_address = bind_router(
                self.ctx, host, secret, ipc_dir=self.ipc_dir, name="down",
                max_message=DOWN_MAX_MESSAGE)
        except BaseException:
            if self.gate is not None:
                self.gate.stop()
            self.ctx.destroy(linger=0)
            remove_private_dir(self.ipc_dir)
            raise
        self.router_down.rcvhwm = 1
        self._down_lock = threading.Lock()
        self.pull, inproc = inproc_pair(self.ctx)
        self.outbox = Outbox(self.ctx, inproc)
        self.ranks: dict[int, RankInfo] = {}
        self.pending: dict[str, Request] = {}
        #: small pipelined calls held to leave together (see monarch_kernel.controller.batching)
        self.batches = batching.Batches()
        self.batcher = Batcher(self, self.batches)
        self._lock = threading.RLock()
        #: the registry's lock (ranks, pending)
        self.lock = self._lock
        self._hello = threading.Condition(self._lock)
        self._closed = threading.Event()
        self.poll_exits: Callable[[], dict[int, int]] | None = None  # set by the launcher
        self.leftover_output: Callable[[int], list[tuple[str, bytes]]] | None = None
        self.local_ranks: set[int] = set()
        self.restart_timeout = 120.0  # seconds a request waits for a restarting rank
        self.stopping = False  # set while the mesh is being stopped on purpose
        #: failures of meshes spawned by actors that no __supervise__ handled
        self.unhandled: list[str] = []
        self.listeners: list[Callable[[str, int, Any], None]] = []
        #: the last RECENT_REQUESTS cells and endpoint calls (requests with a label),
        #: oldest first, with their per-rank reply times (the dashboard's timeline)
        self.recent: collections.deque[Request] = collections.deque(maxlen=RECENT_REQUESTS)
        #: requests taken over from the ranks of a detachable mesh at attach (resume)
        self.resumed: dict[str, Request] = {}
        #: the I/O: sockets, lanes, heartbeats, leader/follower (monarch_kernel.controller.io)
        self.io = ControllerIO(self, self.router, self.pull, self._closed, spin_s)
        self.engine: Engine = self.io.engine
        #: the output pipes of local workers (monarch_kernel.controller.output_pipes)
        self.output = RankOutput(self, self.engine)
        self.lane_of = self.io.lane_of  # rank -> its current lane
        self.lanes = self.io.lanes  # fd -> lane
        self.io.start()

    # ------------------------------------------------------------ the I/O
    @property
    def spin_s(self) -> float:
        """Seconds a waiting caller looks for its reply before it sleeps
        (``MONARCH_SPIN_US``; 0: no spin; settable)."""
        return self.engine.spin_s

    @spin_s.setter
    def spin_s(self, value: float) -> None:
        self.engine.spin_s = value

    @property
    def spin_contended(self) -> int:
        """How many times a contended core turned the spin off."""
        return self.engine.spin_contended

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran (the controller's sockets are gone)."""
        return self._closed.is_set()

    def wait_for(self, event: Flag | threading.Event, timeout: float | None = None) -> bool:
        """Wait until ``event`` is set, leading the I/O meanwhile
        (:meth:`ControllerIO.wait_for <monarch_kernel.controller.io.ControllerIO.wait_for>`);
        True if it was set."""
        return self.io.wait_for(event, timeout)

    def defer_io(self) -> None:
        """Keep the I/O thread from reading a short while: this thread will
        wait for a reply (:meth:`ControllerIO.defer_io`)."""
        self.io.defer_io()

    def resume_io(self) -> None:
        """Let the I/O thread read again at once (:meth:`ControllerIO.resume_io`)."""
        self.io.resume_io()

    def nudge_io(self) -> None:
        """Have the I/O thread take a turn soon (held calls leave in time)."""
        self.engine.nudge()

    def adopt_lane(self, rank: int, sock: Any) -> None:
        """Take the controller's end of a lane to local worker ``rank`` (any
        thread; :meth:`ControllerIO.adopt_lane`)."""
        self.io.adopt_lane(rank, sock)

    def adopt_pipes(self, rank: int, stdout_fd: int, stderr_fd: int) -> None:
        """Take the read ends of a local worker's stdout/stderr pipes (any
        thread; :meth:`RankOutput.adopt_pipes`)."""
        self.output.adopt_pipes(rank, stdout_fd, stderr_fd)

    def held_calls(self) -> bool:
        """Whether calls are held for a batch."""
        return bool(self.batches)

    def flush_batches(self, stale_only: bool = False) -> None:
        """Send the held calls now (``stale_only``: those held for HOLD_S)."""
        self.batcher.flush(stale_only)

    def io_ended(self) -> None:
        """The I/O thread ends (holding the lead): nothing will answer what is
        pending; the output pipes close."""
        with self._lock:
            pending = list(self.pending.values())
            self.pending.clear()
        for req in pending:
            req._fail(MeshFailure("the mesh's controller stopped"))
        self.output.close()

    # -------------------------------------------------------------- sending
    def _send(self, ranks: Iterable[int], frames: list[Any]) -> None:
        with DeferredSigint():  # Ctrl-C never leaves half a message on a socket
            self._send_after_held(ranks, frames)

    def _send_after_held(self, ranks: Iterable[int], frames: list[Any]) -> None:
        """Send ``frames`` after the calls held for ``ranks`` (SIGINT deferred by the caller)."""
        b = self.batches
        with b.lock:
            if b:  # calls held for these ranks leave first (order is kept)
                for r in ranks:
                    if b.holds(r):
                        self.batcher.send_batch(r, b.take(r))
            self.send_to(ranks, frames)

    def send_to(self, ranks: Iterable[int], frames: list[Any]) -> None:
        """Send ``frames`` to ``ranks`` now, ahead of calls held for them (the
        caller sends those first, holding ``batches.lock``).

        Raises
        ------
        TransportError
            If a rank cannot be reached.
        """
        self.engine.expect_input()  # replies may come soon: a waiting caller looks first
        prepared = None  # the lane framing of `frames`, made once for all lanes
        for r in ranks:
            info = self.ranks.get(r)
            if info is not None and info.identity:  # else not connected yet: nowhere to send
                lane = self.lane_of.get(r)
                if lane is not None:
                    if prepared is None:
                        prepared = lane_prepare(frames)
                    try:
                        lane.send_prepared(prepared)
                    except TransportError as e:  # its process is gone
                        raise TransportError(f"cannot send to rank {r}: {e}") from e
                elif info.down:
                    # just after its hello, a rank's second connection may not be
                    # attached yet: wait for it then (never on the I/O thread, never
                    # while stopping)
                    fresh = time.monotonic() - info.hello_at < 5.0
                    wait = (fresh and not self.stopping
                            and not self.engine.leads_here())
                    if not self.send_down(info.identity, frames, retry=2.0 if wait else 0.0):
                        raise TransportError(f"cannot send to rank {r}: it is not connected")
                else:
                    self.outbox.send([info.identity, *frames])

    def send_down(self, ident: bytes, frames: list[Any], retry: float = 2.0) -> bool:
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
                    raise self._unavailable(r)
                if info.state == "starting":
                    starting.append(r)
        if starting:  # being restarted: wait for it rather than send into the void
            self.wait_ready(starting, self.restart_timeout)
        mid = self.codec.new_id()
        if batching.may_hold(type, ranks, content, len(self.pending)):
            return self.batcher.held_request(mid, ranks[0], content)
        local = all(r in self.local_ranks for r in ranks)
        names: list[str] = []
        with cuda_ipc(local and len(ranks) == 1):  # one process on this host
            frames = self.codec.encode(type, content, id=mid, shm="sender" if local else None,
                                       shm_out=names)
        req = Request(mid, ranks, request_label(type, content))
        req.waiter = self.wait_for
        if req.label:
            self.recent.append(req)
        if names:  # remove the shared-memory files once every rank answered
            codec = self.codec

            def release(r: Request) -> None:
                codec.release_shm(names, discard=r.failure is not None)

            req.add_done_callback(release)
        # Ctrl-C waits until it is registered and sent (registered only, it would hang)
        with DeferredSigint():
            try:
                self.register(req)
            except MeshFailure as e:  # its callbacks return its shared memory
                req._fail(e)
                raise
            try:
                self._send_after_held(ranks, frames)
            except TransportError as e:
                with self._lock:
                    self.pending.pop(req.id, None)
                raise MeshFailure(f"cannot reach the mesh: {e}") from e
        return req

    def _unavailable(self, rank: int) -> MeshFailure:
        """The error of a request to a dead or stopped rank (lock held)."""
        err = self.rank_failure(rank)
        if self.ranks[rank].state == "dead":
            dead = sorted(r for r, i in self.ranks.items() if i.state == "dead")
            them = "it" if dead == [rank] else f"{ranks_label(dead)}"
            err.args = (f"{err.args[0]}\nRestart {them} with  "
                        f"{restart_hint(dead, len(self.ranks))}.",)
            err.restart = restart_hint(dead, len(self.ranks))
        return err

    def register(self, req: Request) -> None:
        """Record ``req`` as pending, its ranks busy; a rank that died since the caller
        looked fails it now (marked busy over dead, it would wait for ever)."""
        with self._lock:
            for r in req.ranks:
                if self.ranks[r].state in ("dead", "stopped"):
                    raise self._unavailable(r)
            self.pending[req.id] = req
            for r in req.ranks:
                info = self.ranks[r]
                info.state = "busy"
                info.messages_out += 1

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
        """Register ranks that a launcher is starting: each run of a rank gets a
        fresh epoch, and only its messages are accepted from that rank from now
        on (those of an earlier run of it are refused). The launcher passes
        :meth:`launch_env` to the new processes."""
        with self._lock:
            for r in ranks:
                info = self.ranks[r] = RankInfo(r, epoch=protocol.new_epoch())
                self.codec.expect(f"r{r}", info.epoch)
                if local:
                    self.local_ranks.add(r)
                else:
                    self.local_ranks.discard(r)

    def launch_env(self, ranks: Iterable[int]) -> dict[int, dict[str, str]]:
        """The environment that the processes of ``ranks`` (registered with
        :meth:`expect`) start with, per rank: their epoch, and the
        controller's epoch and current sequence number, below which they
        refuse its messages (everything it signed before they started).

        Raises
        ------
        KeyError
            If a rank was not registered.
        """
        floor = self.codec.mark()
        return {r: {protocol.STREAMS_ENV: protocol.format_streams(
            self.ranks[r].epoch, self.codec.epoch, floor)} for r in ranks}

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
                        f"{ranks_label(missing)} did not connect to the controller at "
                        f"{self.address} "
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
            msg = f"rank {rank}{where}{pid} {info.describe_exit(self.heartbeat)}"
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
            files, info.shm_files = info.shm_files, set()
            if state == "dead" and rank in self.local_ranks:  # its unseen files: swept
                now = time.monotonic()
                self._sweeps_due.extend(now + d for d in SWEEP_AFTER_DEATH_S)
            failure = self.rank_failure(rank)
            waiting = [q for q in self.pending.values()
                       if rank in q.ranks and rank not in q.replies]
            self._hello.notify_all()
        shm.forget(files)  # (outside the lock) cached mappings would pin their memory
        for name in files:  # a worker that exited cleanly removed them already
            shm.unlink(name)
        for req in waiting:
            # the request fails now, but stays routable for a while: what the other
            # ranks print (and their replies, once interrupted) still reach it
            req.failed_at = time.monotonic()
            req._fail(failure)
            with self._lock:
                self._retire_if_settled(req)
        self._notify_listeners("dead", rank, failure)

    def check_ranks(self, now: float) -> None:
        """Watch the ranks (the thread that leads, every ``io.CHECK_S``): local
        workers' exits, remote ones' missed heartbeats; failed requests are
        forgotten 5 s after they failed; ``now``: monotonic seconds."""
        if self.stopping:
            return
        if self._sweeps_due:
            self._sweep_if_due(now)
        self._discard_down()
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
                self.output.drain(rank)
                if self.leftover_output is not None:
                    self.output.deliver_leftover(rank)
                self.mark_dead(rank, code)
        limit = 3 * self.heartbeat + 0.5
        for r, info in list(self.ranks.items()):
            if (r not in self.local_ranks and info.state in ("idle", "busy", "paused")
                    and now - info.last_heard > limit):
                log.warning("rank %d missed 3 heartbeats", r)
                self.mark_dead(r, None)

    def _discard_down(self) -> None:
        """Throw away whatever arrived on ``router_down`` (workers send nothing
        there; its frames are at most DOWN_MAX_MESSAGE bytes): no socket is
        left unread. Skipped while another thread sends on it."""
        if not self._down_lock.acquire(blocking=False):
            return
        try:
            if not self._closed.is_set():
                for n, _ in enumerate(drain(self.router_down)):
                    if n >= 1000:  # (the rest at the next check)
                        break
        except zmq.ZMQError:
            pass
        finally:
            self._down_lock.release()

    def _sweep_if_due(self, now: float) -> None:
        """Sweep nobody's pooled files, once a sweep after a rank's death is due
        (the thread that leads; see SWEEP_AFTER_DEATH_S)."""
        with self._lock:
            later = [t for t in self._sweeps_due if t > now]
            if len(later) == len(self._sweeps_due):  # none is due
                return
            self._sweeps_due = later
        try:
            swept = shm.sweep_stale(SWEEP_MIN_AGE_S)
        except Exception:  # best effort: the next controller sweeps too
            log.exception("sweeping shared-memory files failed")
            return
        if swept:
            log.info("removed %d shared-memory files of dead ranks", len(swept))

    def _retire_if_settled(self, req: Request) -> None:
        """Forget a failed request once every rank replied or is gone (lock held)."""
        if all(r in req.replies or self.ranks[r].state in ("dead", "stopped")
               for r in req.ranks):
            self.pending.pop(req.id, None)

    def _notify_listeners(self, kind: str, rank: int, payload: Any) -> None:
        for fn in list(self.listeners):
            try:
                fn(kind, rank, payload)
            except Exception:
                log.exception("a controller listener failed")

    def receive(self, frames: list[Any], lane: bytes | None = None) -> None:
        """Handle one message: from the ROUTER (``frames`` start with the identity)
        or from the lane whose identity is ``lane``."""
        try:
            if lane is None:
                msg = self.codec.decode(frames, router=True, lazy=True)
            else:
                msg = self.codec.decode(frames, lazy=True, identity=[lane])
        except ProtocolError as e:
            peer = lane if lane is not None else bytes(frames[0]) if frames else b""
            self.drops.drop(getattr(e, "reason", "malformed"), str(e), peer)
            return
        ident = msg.identity[0] if msg.identity else b""
        s = msg.sender
        info = self.ranks.get(int(s[1:])) if s[:1] == "r" and s[1:].isdigit() else None
        if info is None:
            self.drops.drop("unknown sender", f"from unknown sender {s!r}", ident)
            return
        rank = info.rank
        if msg.type == "hello":  # signed by a worker of this mesh: its connection is the rank's
            info.identity = ident
        elif ident != info.identity:
            self.drops.drop("wrong connection", f"sender {s!r} does not match its "
                            f"connection {ident!r}", ident)
            return
        info.last_heard = time.monotonic()
        info.messages_in += 1
        t = msg.type
        if t == "heartbeat":
            return
        if t == "reply":
            self.output.drain(rank)  # its output comes before its reply
            try:
                c = msg.content
                status, value = c["status"], c["value"]
            except (ProtocolError, KeyError, TypeError) as e:
                c = None
                # a signed reply that does not unpickle here (a CUDA tensor on a host
                # without GPU, an exception class only the workers have): an error
                # reply, never a request that waits forever
                # (the message names no rank: ranks that fail alike are shown as one)
                text = f"a reply cannot be decoded here: {e}"
                status, value = "error", {
                    "type": "monarch_kernel.SerializationError", "traceback": "",
                    "message": text, "exc": SerializationError(text)}
            if msg.pooled:  # copied out of the rank's pooled files: it may reuse them
                info.shm_files.update(msg.pooled)
                self.notify([rank], "shm_done", {"names": msg.pooled})
            self._on_reply(info, msg.parent, status, value)
            return
        if t == "replies":  # several ok replies in one message (a worker's batch)
            self.output.drain(rank)  # their output comes before them
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
            self.output.drain(rank)  # what it wrote to its fds before comes first
            c = msg.content
            self.output.deliver(rank, c["name"], c["text"], self.pending.get(msg.parent or ""))
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
                req.reply_at[rank] = time.monotonic()
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

    def fail_pending(self, message: str) -> None:
        """Fail every pending request with :class:`MeshFailure` ``message`` (the
        ranks were taken over by another controller: nothing will answer here)."""
        with self._lock:
            pending = list(self.pending.values())
            self.pending.clear()
        for req in pending:
            req._fail(MeshFailure(message))

    # ------------------------------------------------------- attach (resume)
    def resume(self, rank: int, state: dict[str, Any], world: list[int]) -> dict[str, int]:
        """Take what ``rank`` of a detachable mesh reported when this controller
        attached (the ``resume`` of its hello; the thread that leads, before its
        next message): each request it runs, ran or queued becomes a pending
        :class:`Request` (first over all of ``world``: :meth:`settle_resumed`
        narrows it to the ranks that reported it), its kept output is replayed
        into it in order, and a reply that came while detached is recorded.
        A request the rank answered to the previous controller (``delivered``)
        is resumed only if another rank had not. Returns the bytes of output the
        rank dropped per request id."""
        info = self.ranks[rank]
        dropped: dict[str, int] = {}
        for name, text in state.get("background") or ():  # (printed by no request)
            self.output.deliver(rank, name, text, None)
        for rid, r in (state.get("requests") or {}).items():
            rid = str(rid)
            with self._lock:
                req = self.pending.get(rid)
                if req is None:
                    req = Request(rid, list(world), "resumed")
                    req.waiter = self.wait_for
                    req.reported = set()  # type: ignore[attr-defined]
                    req.live = set()  # type: ignore[attr-defined]
                    self.pending[rid] = req
                    self.resumed[rid] = req
                reported = getattr(req, "reported", None)
                if reported is not None:
                    reported.add(rank)
                    if not r.get("delivered"):  # (not answered to the last controller)
                        req.live.add(rank)  # type: ignore[attr-defined]
                if r.get("reply") is None:
                    info.state = "busy"
            for name, text in r.get("output") or ():
                self.output.deliver(rank, name, text, req)
            if r.get("dropped"):
                dropped[rid] = int(r["dropped"])
            reply = r.get("reply")
            if reply is not None:
                self._on_reply(info, rid, reply["status"], reply["value"])
        return dropped

    def settle_resumed(self) -> list[Request]:
        """Once every rank's hello was taken (:meth:`resume`): each resumed
        request waits for the ranks that reported it only; those all of whose
        ranks replied finish now. Returns the resumed requests."""
        done = []
        with self._lock:
            for rid, req in list(self.resumed.items()):
                if not getattr(req, "live", True):  # answered in full before: not resumed
                    self.resumed.pop(rid, None)
                    self.pending.pop(rid, None)
            reqs = list(self.resumed.values())
            for req in reqs:
                reported = getattr(req, "reported", None)
                if reported is not None and not req.done():
                    req.ranks = sorted(reported)
                    if len(req.replies) >= len(req.ranks):
                        self.pending.pop(req.id, None)
                        done.append(req)
            for info in self.ranks.values():
                if info.state == "busy" and not any(
                        info.rank in q.ranks and info.rank not in q.replies
                        for q in self.pending.values()):
                    info.state = "idle"
        for req in done:
            req._finish()
        return reqs

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
        self.engine.join(timeout=5)
        # (a caller may still lead, for a moment: the lanes close once it stopped)
        led = self.engine.hold(timeout=5)
        try:
            self.io.close_lanes()
        finally:
            if led:
                self.engine.release()
        with self._down_lock:
            self.router_down.close(0)
        self.outbox.close()
        if self.gate is not None:
            self.gate.stop()
        self.ctx.term()
        remove_private_dir(self.ipc_dir)
        if self.codec.pool is not None:
            self.codec.pool.close()
        for info in self.ranks.values():
            shm.forget(info.shm_files)
