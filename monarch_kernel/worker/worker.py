"""The worker process: one per rank (``python -m monarch_kernel worker``).

The worker core runs cells (``execute``), ``push``, ``pull`` and ``stop``;
every feature above it (actors, tensor handles, the remote debugger,
torch.distributed set-up) plugs in through :mod:`monarch_kernel.worker.handlers`
when the process's composition root (:mod:`monarch_kernel.plugins`) imports it.

Threads
-------
main
    Runs requests one at a time, in arrival order: cells (``execute``),
    ``push``, ``pull``, distributed set-up, actor construction. User code
    runs here, so signals (interrupts) reach it.
I/O (``monarch-io``)
    Reads the receiving DEALER (``dealer``) while it leads (see
    :mod:`monarch_kernel.worker.io`: an idle actor's thread leads instead):
    verifies messages and routes them, sends heartbeats, and exits the
    process when the controller is gone (its pid vanished, or no heartbeat
    for ``--heartbeat-timeout`` seconds). Any thread sends on the second
    DEALER (``up``) under a lock.
capture (``monarch-capture``)
    Forwards what user code writes to fds 1 and 2, live -- only for remote
    workers; a local worker's fds are pipes the controller reads itself.
actors
    One thread per actor (see :mod:`monarch_kernel.actor.actor_mesh`): an actor handles
    one message at a time, different actors run concurrently. Replies to a
    burst of quick calls leave several to a message (``replies``).

Whose output is it
------------------
Each thread that serves a request (the main thread running a cell, an
actor's thread running a call) sets its own parent, the request's id
(:attr:`Worker.current_parent`, per thread). Output is credited so:

* Python-level writes (``print``, ``sys.stdout``/``sys.stderr``, tracebacks)
  of a thread that serves a request go to that request. While it has been
  the only request running on the worker since it began they are written
  to fd 1 or 2 (the cheap path, credited as below); once another request
  ran at the same time, they are sent as ``stream`` messages tagged with
  the thread's own request (until it ends), after everything written to
  the fds before them.
* What reaches fds 1 and 2 otherwise (C extensions, child processes,
  threads that serve no request) cannot be told apart by thread: it goes to
  the oldest request running on the worker when it is read (remote workers:
  the worker reads it; it reads everything before each reply, so a reply
  never overtakes it), or, with the controller reading a local worker's
  pipes, to the rank's oldest unanswered request. With no request running
  it is background output (rank-tagged lines in the notebook).
* ``display()`` and debugger messages go to the calling thread's request.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import builtins
import codecs
import linecache
import logging
import os
import queue
import secrets
import signal
import socket
import sys
import threading
import traceback
import types
from typing import Any

import zmq

from monarch_kernel.errors import RemoteError, SerializationError, ranks_label
from monarch_kernel.transport.lane import Lane
from monarch_kernel.transport.sockets import (
    Outbox,
    connect_dealer,
    curve_client_keypair,
    inproc_pair,
    send_frames,
)
from monarch_kernel.util.cells import rewrite_traceback
from monarch_kernel.util.droplog import INTERVAL_S
from monarch_kernel.wire import exctree, protocol, serialize
from monarch_kernel.wire import shm as _shm
from monarch_kernel.wire.serialize import Packed, cuda_ipc, reply_content
from monarch_kernel.worker import detach, display, handlers, telemetry
from monarch_kernel.worker.capture import FdCapture
from monarch_kernel.worker.detach import Detachable
from monarch_kernel.worker.io import WorkerIO, exit_process
from monarch_kernel.worker.sched import batch_scheduling

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
log = logging.getLogger("monarch_kernel.worker.worker")

_CO_COROUTINE = 0x0080

#: this process's pid, kept current across os.fork (getpid(2) is a system call, and
#: the I/O asks at each step: leave_if_forked(strict=False))
_pid = os.getpid()


def _forked() -> None:
    global _pid
    _pid = os.getpid()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)

#: the running worker of this process (None outside a worker); see current_worker()
current: Worker | None = None


def current_worker() -> Worker | None:
    """The :class:`Worker` of this process, or None outside a worker process
    (on the controller, in a test) and before the worker's main made it."""
    return current


class Worker:
    """State and loops of one worker process.

    Its I/O is :attr:`io` (:class:`~monarch_kernel.worker.io.WorkerIO`, on the
    one I/O engine); a verified message from the controller goes to
    :meth:`dispatch`, which looks its type up in the handler registry
    (:mod:`monarch_kernel.worker.handlers`).

    Parameters
    ----------
    address : str
        The controller's endpoint: ``ipc://PATH`` on this host, else
        ``tcp://host:port``.
    key : bytes
        The mesh's HMAC key.
    rank, world_size : int
    shape : dict of str to int
        The mesh's named dimensions, e.g. ``{"hosts": 1, "procs": 4}``.
    controller_pid : int or None
        The controller's pid when it runs on this host (watched for exit).
    heartbeat : float
        Seconds between heartbeats.
    heartbeat_timeout : float
        Exit after this many seconds without hearing from the controller.
    curve_server_key : bytes or None
        The controller's CurveZMQ public key; the connection is encrypted,
        with the mesh's client key pair (derived from ``key``, which the
        controller admits).
    down_address : str or None
        The controller's second endpoint (controller -> worker traffic); with
        it, sending and receiving use separate connections.
    lane_fd : int or None
        This worker's end of a lane to a controller on this host (a Unix
        socket it inherited, :mod:`monarch_kernel.transport.lane`): every message to
        and from the controller then goes through it, not ZeroMQ.
    streams : (int, int, int) or None
        This run's epoch, the controller's epoch, and the controller's sequence
        number when it started this run (:func:`protocol.parse_streams`): the
        worker signs with that epoch and accepts the controller's messages of
        that epoch above that number only. None (a worker started by hand): a
        random epoch, and the controller's first epoch seen is accepted.
    """

    def __init__(
        self,
        address: str,
        key: bytes,
        rank: int,
        world_size: int,
        shape: dict[str, int],
        controller_pid: int | None = None,
        heartbeat: float = 1.0,
        heartbeat_timeout: float = 6.0,
        curve_server_key: bytes | None = None,
        down_address: str | None = None,
        lane_fd: int | None = None,
        streams: tuple[int, int, int] | None = None,
    ) -> None:
        self.address = address
        self.down_address = down_address or ""
        self.pid = os.getpid()  # (a child forked by user code has another: leave_if_forked)
        self.rank = rank
        self.world_size = world_size
        self.shape = shape
        self.controller_pid = controller_pid
        self.heartbeat = heartbeat
        self.heartbeat_timeout = heartbeat_timeout
        self.curve_server_key = curve_server_key  # set: encrypted mesh (actor peers too)
        self.codec = protocol.Codec(key, f"r{rank}", epoch=streams[0] if streams else None)
        if streams is not None:  # the controller's messages from before this run: refused
            self.codec.expect("ctl", streams[1], streams[2])
        if controller_pid is not None:  # the controller is on this host: pooled replies
            self.codec.pool = _shm.Pool()
        self.ctx = zmq.Context()
        # a random routing identity: the controller learns it from the signed hello
        ident = f"r{rank}.{secrets.token_hex(8)}".encode()
        self.up: zmq.Socket | None = None
        self.lane: Lane | None = None
        if lane_fd is not None:  # a controller on this host: no ZeroMQ connection to it
            sock = socket.socket(fileno=lane_fd)
            # programs it starts must not hold it (a forked child closes its copy: lane.py)
            sock.set_inheritable(False)
            self.lane = Lane(sock, f"lane-r{rank}")
            self.dealer = None
        elif down_address:
            client = curve_client_keypair(key) if curve_server_key is not None else None
            # two connections: `dealer` (controller -> worker) is read by the I/O thread
            # only; `up` (worker -> controller) is written by any thread under a lock,
            # so a reply leaves without a hand-off to the I/O thread
            self.dealer = connect_dealer(self.ctx, down_address, ident, curve_server_key, client)
            self.up = connect_dealer(self.ctx, address, ident, curve_server_key, client)
        else:  # one connection, written by the I/O thread only (through the outbox)
            self.dealer = connect_dealer(self.ctx, address, ident, curve_server_key,
                                         curve_client_keypair(key) if curve_server_key
                                         else None)
        self._up_lock = threading.Lock()
        self.pull, inproc = inproc_pair(self.ctx)
        self.outbox = Outbox(self.ctx, inproc)
        self.requests: queue.Queue[protocol.Message | None] = queue.Queue()
        #: thread ident -> the request it serves, oldest first (see current_parent)
        self._parents: dict[int, str] = {}
        #: requests that ran at the same time as another one, while they run
        self._overlapped: set[str] = set()
        self._parents_lock = threading.Lock()
        self.busy = False
        self.stopping = threading.Event()
        self.exit_code = 0
        self.main_thread_id = threading.get_ident()
        self.cell_count = 0
        self.telemetry_interval = telemetry.DEFAULT_INTERVAL  # seconds; 0: off
        self.telemetry: telemetry.TelemetryThread | None = None
        self.actors: dict[str, Any] = {}
        #: keys of the other meshes of this worker's program, by fingerprint (mesh_keys.py)
        self.keyring: dict[str, bytes] = {}
        self.dropped_keys: set[str] = set()  # fingerprints of meshes that stopped
        self._decoders = {
            n: codecs.getincrementaldecoder("utf-8")(errors="replace")
            for n in ("stdout", "stderr")
        }
        self.module = types.ModuleType("__main__")
        self.module.__dict__.update(
            {"__builtins__": builtins, "rank": rank, "world_size": world_size}
        )
        self.namespace = self.module.__dict__
        self.loop: asyncio.AbstractEventLoop | None = None
        self.capture: FdCapture | None = None
        #: the I/O: the connection to the controller, leader/follower (worker.io)
        self.io = WorkerIO(self)
        self.io_thread = self.io.thread
        #: set for a worker of a detachable mesh (worker.detach): it outlives its controller
        self.detach: Detachable | None = None

    # ------------------------------------------------------------------ I/O
    @property
    def leader(self) -> int | None:
        """The ident of the thread that leads the I/O now (None: nobody)."""
        return self.io.engine.leader

    def wake(self) -> bool:
        """Wake the thread that leads from its poll (:meth:`WorkerIO.wake`)."""
        return self.io.wake()

    def lead_until(self, q: Any, actors: int = 1) -> bool:
        """Lead the I/O until ``q`` has an item (:meth:`WorkerIO.lead_until`)."""
        return self.io.lead_until(q, actors)

    def lead_wait(self, flag: Any, timeout: float | None = None) -> bool:
        """Wait for ``flag``, leading the I/O meanwhile (:meth:`WorkerIO.lead_wait`)."""
        return self.io.lead_wait(flag, timeout)

    def wake_leader(self) -> None:
        """Wake a thread in :meth:`lead_wait` (:meth:`WorkerIO.wake_leader`)."""
        self.io.wake_leader()

    def dispatch(self, msg: protocol.Message) -> None:
        """Route a verified message from the controller (the thread that leads
        the I/O): its I/O-thread handler runs now; anything else is a request for
        the main thread's queue (see :mod:`monarch_kernel.worker.handlers`)."""
        handler = handlers.lookup(msg.type)
        if handler is not None and handler.thread is handlers.Thread.IO:
            handler.fn(self, msg)
        else:
            self.requests.put(msg)

    def send_encoded(self, frames: list[Any]) -> None:
        """Send encoded ``frames`` to the controller (any thread)."""
        self._send_frames(frames)

    def serving(self) -> list[str]:
        """The ids of the requests the worker's threads serve now, oldest first."""
        with self._parents_lock:
            return list(self._parents.values())

    # ---------------------------------------------------------------- sending
    def send(self, type: str, content: Any = None, parent: str | None = None) -> None:
        """Send a message to the controller from any thread.

        Large buffers of a reply go through shared memory when the controller
        is on this host (:mod:`monarch_kernel.wire.shm`).

        Raises
        ------
        SerializationError
            If ``content`` cannot be pickled.
        """
        if self.detach is not None:  # journalled (and held while detached): worker.detach
            self.detach.send(type, content, parent)
            return
        shm = "reply" if type == "reply" and self.controller_pid is not None else None
        with cuda_ipc(shm is not None):  # one receiver on this host: CUDA IPC handles
            # large buffers in pooled files, reused once the controller says shm_done
            frames = self.codec.encode(type, content, parent, shm=shm)
        self._send_frames(frames)

    def _send_frames(self, frames: list[Any]) -> None:
        if self.lane is not None:
            self.lane.send(frames)
        elif self.up is not None:
            with self._up_lock:
                send_frames(self.up, frames)
        else:
            self.outbox.send(frames)

    # ----------------------------------------------------------------- output
    @property
    def current_parent(self) -> str | None:
        """The id of the request the calling thread serves (a cell, an actor's
        call), or None; its output, displays and debugger messages are credited
        to it (see the module docstring). Each thread has its own: setting it
        (to None when the request ends) changes only the calling thread's."""
        return self._parents.get(threading.get_ident())

    @current_parent.setter
    def current_parent(self, parent: str | None) -> None:
        me = threading.get_ident()
        with self._parents_lock:
            old = self._parents.pop(me, None)
            if old is not None and old not in self._parents.values():
                self._overlapped.discard(old)
            if parent is not None:
                self._parents[me] = parent  # (last: the newest)
                if len(self._parents) > 1:  # from now on each one's output goes apart
                    self._overlapped.update(self._parents.values())

    def output_parent(self) -> str | None:
        """Where the calling thread's output goes: the request it serves, else
        (a thread that serves none) the one fd-level output is credited to."""
        return self._parents.get(threading.get_ident()) or self.fd_parent()

    def fd_parent(self) -> str | None:
        """The request that output read from fds 1 and 2 is credited to: the
        oldest one running on this worker, or None (background output)."""
        with self._parents_lock:
            return next(iter(self._parents.values()), None)

    def _on_output(self, name: str, data: bytes) -> None:
        text = self._decoders[name].decode(data)
        if text:
            try:
                self.send("stream", {"name": name, "text": text}, self.fd_parent())
            except Exception:  # the connection is closing; nowhere to send it
                pass

    def _divert(self, name: str, text: str) -> bool:
        """A Python-level write of ``text`` to ``name`` (stdout, stderr) by the
        calling thread: if its request ran at the same time as another one,
        send it as that request's output and return True; otherwise return
        False (it is written to the fd)."""
        if not self._overlapped:  # (a lock-free look: the usual case costs a set read)
            return False
        parent = self._parents.get(threading.get_ident())
        if parent is None or parent not in self._overlapped:
            return False  # a request alone since it began, or none: the fd's credit
        try:
            if self.capture is not None:
                self.capture.drain()  # what reached the fds before comes first
            self.send("stream", {"name": name, "text": text}, parent)
        except Exception:  # noqa: BLE001 - the connection is closing: the fd takes it
            return False
        return True

    # ----------------------------------------------------------- main thread
    def serve(self) -> int:
        """Run the main loop until a ``stop`` request; returns the exit code."""
        if self.detach is not None:
            self.detach.start()
        self.io.start()
        hello: dict[str, Any] = {"rank": self.rank, "pid": os.getpid(),
                                 "host": socket.gethostname(),
                                 "down": self.up is not None or self.lane is not None}
        if self.detach is not None:
            hello["attach"] = self.detach.endpoint
        self.send("hello", hello)
        self.telemetry = telemetry.start(self, self.telemetry_interval)
        while True:
            try:
                if not self.actors and self.requests.empty():
                    # no actor: this thread reads the next request itself (worker.io)
                    self.lead_until(self.requests, actors=0)
                msg = self.requests.get()
            except KeyboardInterrupt:  # an interrupt that arrived while idle
                continue
            if msg is None:
                break
            try:
                self._handle(msg)
            except KeyboardInterrupt:
                pass
            if msg.type == "stop":
                break
        return self.exit_code

    def leave_if_forked(self, strict: bool = True) -> None:
        """Exit at once if this is a child that user code forked (``os.fork()``
        in a cell or an endpoint) and that came back into the worker's code
        instead of ending with ``os._exit``: it must not answer for the
        worker, nor keep serving (its parent does), nor remove the parent's
        shared-memory files. Says so on stderr, which the notebook shows.

        ``strict`` asks getpid(2), which also catches a fork made in C without
        Python's at-fork hooks; otherwise the pid those hooks keep is compared
        (no system call: each I/O step asks, where user code never ran)."""
        if (os.getpid() if strict else _pid) == self.pid:
            return
        try:
            os.write(2, (f"[monarch] rank {self.rank}: process {os.getpid()}, forked by user "
                         "code, came back to the worker's loop and exits; end forked "
                         "children with os._exit()\n").encode())
        finally:
            os._exit(0)

    def _handle(self, msg: protocol.Message) -> None:
        handler = handlers.lookup(msg.type)
        self.current_parent = msg.id
        self.busy = True
        telemetry.set_activity(telemetry.request_activity(msg.type))
        status, value = "ok", None
        try:
            try:
                if handler is None or handler.thread is not handlers.Thread.MAIN:
                    raise ValueError(f"unknown request type {msg.type!r}")
                value = handler.fn(self, msg.content)
            except BaseException as e:  # noqa: BLE001 - every failure goes back to the caller
                if isinstance(e, Exception) and type(e).__name__ != "BdbQuit":
                    # kept for `%mesh debug --post-mortem` (describe_failure clears it)
                    self.last_exception, self.last_traceback = e, e.__traceback__
                status, value = "error", None
                value = self.describe_failure(e)
            finally:
                self.busy = False
                telemetry.set_activity(None)
        except KeyboardInterrupt:  # an interrupt that landed just after the work ended
            if status == "error" and value is None:
                value = {"type": "KeyboardInterrupt", "message": "interrupted",
                         "traceback": "", "exc": None}
        self.leave_if_forked()
        names = msg.content.get("names") if msg.type == "pull" and status == "ok" else None
        self.reply(msg.id, status, value, names)

    def reply(self, parent: str, status: str, value: Any, names: list[str] | None = None
              ) -> None:
        """Send a reply after every output written so far (thread-safe).

        ``names``: for a pull, the names of the values in ``value`` (a list),
        to name the one that cannot be pickled.
        """
        if self.capture is not None:
            self.capture.drain()
        # (a detachable worker serves the request until its reply left: a controller
        # that takes over meanwhile learns it runs, and waits for that reply)
        later = self.detach is not None
        if self.current_parent == parent and not later:
            self.current_parent = None
        try:
            self._send_reply(parent, status, value, names)
        finally:
            if later and self.current_parent == parent:
                self.current_parent = None

    def _send_reply(self, parent: str, status: str, value: Any, names: list[str] | None
                    ) -> None:
        try:
            self.send("reply", reply_content(status, value), parent)
        except SerializationError as e:
            if status == "ok":
                failure = self.describe_failure(e, with_traceback=False)
                # no "rank N:" here: the controller names the ranks (and groups alike ones)
                failure["message"] = (
                    f"{_unsendable(value, names)}, which cannot be sent to the controller "
                    f"({e.__cause__ or e}); {'pull' if names else 'return'} something picklable"
                )
            else:
                failure = dict(value, exc=None, tree=None)
            self.send("reply", {"status": "error", "value": failure}, parent)

    def reply_many(self, items: list[tuple[str, Any]]) -> None:
        """Send several ok replies, ``(call id, value)``, in one ``replies``
        message, after every output written so far (thread-safe)."""
        if self.capture is not None:
            self.capture.drain()
        self.send("replies", items)

    def describe_failure(self, e: BaseException, with_traceback: bool = True) -> dict[str, Any]:
        """A description of exception ``e`` that unpickles anywhere (a
        :class:`~monarch_kernel.wire.messages.Failure`; see errors.RemoteFailure):
        its type, message and traceback text, and in ``tree`` the description
        (:mod:`monarch_kernel.wire.exctree`) the controller rebuilds it from, with
        its cause, context and group members."""
        tb = e.__traceback__
        # drop this module's own frames from the top of the traceback
        while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
            tb = tb.tb_next
        if isinstance(e, KeyboardInterrupt):  # maybe raised in a paused pdb: hide its frames
            tb = cut_debugger_frames(tb)
            if not e.args:
                e.args = ("interrupted",)
        e.__traceback__ = tb

        try:
            tree: Any = exctree.describe(e, _own_text if with_traceback else None)
        except Exception:  # noqa: BLE001 - the type and message still go back
            log.exception("rank %s: cannot describe a failure", self.rank)
            tree = None
        e.__traceback__ = None
        return {
            "type": _type_name(e),
            "message": tree["message"] if tree else str(e),
            "traceback": tree["traceback"] if tree else "",
            "exc": None,
            "tree": tree,
        }

    # ------------------------------------------------------------- requests
    def _do_execute(self, content: dict[str, Any]) -> Any:
        self.cell_count += 1
        filename = content.get("filename") or f"<mesh-cell-{self.cell_count}>"
        for name, lines in (content.get("sources") or {}).items():
            linecache.cache[name] = (sum(map(len, lines)), None, lines, name)
        return self.run_cell(content["code"], filename, content.get("prefix") or "")

    def run_cell(self, code: str, filename: str, prefix: str = "") -> Any:
        """Run ``code`` in the rank's namespace; return its last expression's value.

        ``prefix``: the lines of the notebook cell above ``code`` (its ``%%mesh``
        line), each ending in a newline: :mod:`linecache` holds the cell as the
        editor shows it under ``filename``, and line numbers (tracebacks, pdb)
        are the editor's. Top-level ``await`` is allowed (run on the worker's
        event loop).
        """
        if prefix and not prefix.endswith("\n"):
            prefix += "\n"
        lines = (prefix + code).splitlines(True)
        linecache.cache[filename] = (len(prefix) + len(code), None, lines, filename)
        flags = ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
        # (blank lines in place of the prefix: the parser counts lines as the editor does)
        tree = ast.parse("\n" * prefix.count("\n") + code if prefix else code, filename, "exec")
        last = None
        if tree.body and isinstance(end := tree.body[-1], ast.Expr):
            tree.body.pop()
            last = ast.Expression(end.value)
        value = None
        if tree.body:
            self._run_code(compile(tree, filename, "exec", flags=flags))
        if last is not None:
            value = self._run_code(compile(last, filename, "eval", flags=flags))
        return value

    def _run_code(self, co: types.CodeType) -> Any:
        result = eval(co, self.namespace)
        if co.co_flags & _CO_COROUTINE:
            if self.loop is None:
                self.loop = asyncio.new_event_loop()
            result = self.loop.run_until_complete(result)
        return result

    def _do_push(self, content: dict[str, Any]) -> None:
        values = {}
        for name, value in content.items():
            if isinstance(value, Packed):  # (each value pickled on its own: see ProcMesh.push)
                try:
                    value = value.unpack()
                except Exception as e:  # noqa: BLE001 - told to the controller, in words
                    why = serialize.load_failure(e, value.payload, "on the ranks")
                    raise SerializationError(f"cannot load {name!r}: {why}") from None
            values[name] = value
        self.namespace.update(values)

    def _do_pull(self, content: dict[str, Any]) -> list[Any]:
        out = []
        for name in content["names"]:
            if name not in self.namespace:
                raise NameError(f"name {name!r} is not defined")
            out.append(self.namespace[name])
        return out

    def _do_stop(self, content: Any) -> None:
        dist = sys.modules.get("torch.distributed")
        if dist is not None and dist.is_available() and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - best effort at exit
                pass

    def shutdown(self) -> None:
        """Flush what is queued and close the connection."""
        if self.capture is not None:
            self.capture.drain()
        self.stopping.set()
        self.io_thread.join(timeout=2)
        if self.lane is not None:
            self.lane.drain(2.0)  # let the last reply leave
            self.lane.close()
        if self.up is not None:
            with self._up_lock:
                self.up.close(linger=2000)  # let the last reply leave


handlers.register_request("execute", Worker._do_execute)
handlers.register_request("push", Worker._do_push)
handlers.register_request("pull", Worker._do_pull)
handlers.register_request("stop", Worker._do_stop)


def cut_debugger_frames(tb: types.TracebackType | None) -> types.TracebackType | None:
    """``tb`` without the debugger's frames (from the first ``bdb`` frame on).

    An exception raised while a thread is paused in pdb (an interrupt)
    travels out through pdb's own frames; the user wants to see the line
    where the code was paused. Returns a new chain; ``tb`` is not changed.
    """
    entries = []
    t = tb
    while t is not None and t.tb_frame.f_globals.get("__name__") != "bdb":
        entries.append(t)
        t = t.tb_next
    if t is None:
        return tb
    out = None
    for e in reversed(entries):
        out = types.TracebackType(out, e.tb_frame, e.tb_lasti, e.tb_lineno)
    return out


def _own_text(e: BaseException) -> str:
    """The text of one exception raised on this rank: its frames (less the worker's
    own) and its ``Type: message`` line; an error that came from other ranks (a
    :class:`RemoteError` let through) says where it was raised too."""
    # this module's frames (e.g. the SIGINT handler that raised) are not the user's
    frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename != __file__]
    if isinstance(e, RemoteError) or type(e).__module__.partition(".")[0] == "monarch_kernel":
        # raised by a future's get() or another part of this package: hide its plumbing
        frames = [f for f in frames if not f.filename.startswith(_PACKAGE_DIR)]
    only = (e.format_exception_only() if isinstance(e, RemoteError)
            else traceback.format_exception_only(type(e), e))
    text = "".join(["Traceback (most recent call last):\n",
                    *traceback.format_list(frames), *only]) if frames else "".join(only)
    text = rewrite_traceback(text)  # cells named as the notebook shows them: Cell In[3]
    inner = getattr(e, "remote_traceback", "") if isinstance(e, RemoteError) else ""
    if text and inner:  # it came from other ranks: show where it was raised too
        for i, part in enumerate([e, *getattr(e, "others", ())]):  # (ranks that failed
            who = f" (actor {part.actor})" if getattr(part, "actor", None) else ""  # alike)
            text += (f"\n{'which came from' if i == 0 else 'and from'} "
                     f"{ranks_label(getattr(part, 'ranks', []))}{who}:\n"
                     + getattr(part, "remote_traceback", "").rstrip("\n") + "\n")
    return text


def _type_name(obj: Any) -> str:
    t = obj if isinstance(obj, type) else type(obj)
    mod = t.__module__
    return t.__qualname__ if mod in ("builtins", "__main__") else f"{mod}.{t.__qualname__}"


def _unsendable(value: Any, names: list[str] | None = None) -> str:
    """Which part of ``value`` cannot be pickled, in words ("the result is a generator")."""
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            try:
                serialize.dumps(item)
            except SerializationError:
                if names is not None and i < len(names):
                    return f"{names[i]!r} is a {_type_name(item)}"
                return (f"the result is a {_type_name(value)} whose item {i} is a "
                        f"{_type_name(item)}")
    return f"the result is a {_type_name(value)}"


def _sigint(signum: int, frame: Any) -> None:
    w = current
    if w is not None and not w.busy:
        return  # idle: nothing to interrupt
    raise KeyboardInterrupt


def _sigterm(signum: int, frame: Any) -> None:
    """SIGTERM (a restart, a launcher's stop): remove this process's shared-memory
    files (the pools of replies and of RDMABuffer reads), then die of the signal."""
    try:
        _shm.cleanup()  # (takes no lock: the interrupted code may hold shm's)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)


def main(argv: list[str] | None = None) -> int:
    """Run a worker process until it stops (never returns: the process exits).

    The entry point of ``python -m monarch_kernel worker``, which loads the
    rank-side features (:mod:`monarch_kernel.plugins`) first; without them the
    worker answers only ``execute``, ``push``, ``pull`` and ``stop``. The start
    hooks that features registered run with the new worker before it serves.

    The mesh key is read from the environment variable ``MONARCH_MESH_KEY``
    (hex) and removed from the environment before any user code runs.
    """
    global current
    p = argparse.ArgumentParser(prog="python -m monarch_kernel worker")
    p.add_argument("--controller", required=True,
                   help="the controller's endpoint (ipc://PATH or tcp://host:port)")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--shape", default="", help='e.g. "hosts=1,procs=4"')
    p.add_argument("--controller-pid", type=int, default=None)
    p.add_argument("--heartbeat", type=float, default=1.0, help="seconds")
    p.add_argument("--heartbeat-timeout", type=float, default=6.0, help="seconds")
    p.add_argument("--controller-down", default=None,
                   help="the endpoint the controller sends on (a second connection)")
    p.add_argument("--curve-server-key", default=None,
                   help="the controller's CurveZMQ public key (Z85): encrypt the connection")
    p.add_argument("--telemetry-interval", type=float, default=telemetry.DEFAULT_INTERVAL,
                   help="seconds between telemetry samples; 0 turns telemetry off")
    p.add_argument("--max-header", type=int, default=protocol.DEFAULT_MAX_HEADER,
                   help="bytes: larger header+payload of a message is dropped (default 64 MiB)")
    p.add_argument("--max-buffers", type=int, default=protocol.DEFAULT_MAX_BUFFERS,
                   help="bytes: larger out-of-band buffers of a message are dropped (1 GiB)")
    p.add_argument("--drops-every", type=float, default=INTERVAL_S,
                   help="seconds over which refused messages beyond the first 3 are summed "
                   "up in one line of the log; 0: each on its own line")
    args = p.parse_args(argv)
    if not 0 <= args.drops_every < float("inf"):  # (nan too)
        p.error(f"--drops-every must be 0 or more seconds, not {args.drops_every}")
    key_hex = os.environ.pop("MONARCH_MESH_KEY", "")
    if not key_hex:
        p.error("MONARCH_MESH_KEY is not set; workers are started by a launcher")
    streams_text = os.environ.pop(protocol.STREAMS_ENV, "")
    try:
        streams = protocol.parse_streams(streams_text) if streams_text else None
    except ValueError as e:
        p.error(str(e))
    shape = {}
    for part in filter(None, args.shape.split(",")):
        name, _, size = part.partition("=")
        shape[name] = int(size)
    logging.basicConfig(
        level=logging.WARNING, format=f"[monarch worker {args.rank}] %(levelname)s %(message)s"
    )
    batch_scheduling()  # (before any thread starts: they inherit the policy)
    w = Worker(
        args.controller,
        bytes.fromhex(key_hex),
        args.rank,
        args.world_size,
        shape or {"procs": args.world_size},
        controller_pid=args.controller_pid,
        heartbeat=args.heartbeat,
        heartbeat_timeout=args.heartbeat_timeout,
        curve_server_key=args.curve_server_key.encode() if args.curve_server_key else None,
        down_address=args.controller_down,
        lane_fd=int(lane) if (lane := os.environ.pop("MONARCH_LANE_FD", "")) else None,
        streams=streams,
    )
    try:
        w.detach = detach.from_environment(w)
    except (ValueError, zmq.ZMQError) as e:
        p.error(f"cannot make this worker detachable: {e}")
    w.telemetry_interval = args.telemetry_interval
    w.io.drops.interval_s = args.drops_every
    w.codec.max_header, w.codec.max_buffers = args.max_header, args.max_buffers
    current = w
    sys.modules["__main__"] = w.module
    handlers.run_start_hooks(w)  # e.g. breakpoint() prompts in the notebook (debug/)
    fds = os.environ.pop("MONARCH_CAPTURE_FDS", "")
    log_fd = os.environ.pop("MONARCH_LOG_FD", "")
    passive = os.environ.pop("MONARCH_OUTPUT_PIPES", "") == "controller"
    read_fds = None
    if fds:
        out_fd, err_fd = (int(x) for x in fds.split(","))
        read_fds = (out_fd, err_fd)
    w.capture = FdCapture(w._on_output, read_fds=read_fds,
                          log_fd=int(log_fd) if log_fd else None, passive=passive,
                          divert=w._divert)
    handler = logging.getLogger().handlers[0]
    if isinstance(handler, logging.StreamHandler):
        handler.setStream(w.capture.log_stream())
    signal.signal(signal.SIGINT, _sigint)
    signal.signal(signal.SIGTERM, _sigterm)
    display.install(w)
    code = w.serve()
    w.shutdown()
    exit_process(code)


if __name__ == "__main__":
    # without the features (actors, tensors, the debugger...) this would be half a worker
    sys.exit("run a worker with  python -m monarch_kernel worker ...  (it loads the rank-side "
             "features first); monarch_kernel.worker.worker is not a program")
