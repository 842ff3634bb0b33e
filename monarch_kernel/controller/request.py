"""What the controller keeps per rank and per request.

:class:`RankInfo` is the registry entry of one rank; :class:`Request` is one
request sent to some ranks, with everything that comes back for it (replies,
output events, failure); :class:`Pipe` is the read end of a local worker's
output pipe. :mod:`monarch_kernel.controller.controller` fills them in.
"""

from __future__ import annotations

import codecs
import collections
import logging
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from monarch_kernel.errors import MeshFailure, RemoteFailure
from monarch_kernel.util.flag import Flag
from monarch_kernel.wire import messages

log = logging.getLogger("monarch_kernel.controller.controller")

__all__ = ["Pipe", "RankInfo", "Request", "request_label"]


def request_label(type: str, content: Any) -> str:
    """What a request is, in a few words, for the dashboard's timeline.

    ``execute`` gives the ``label`` in the content, else ``"cell N"`` for a
    ``<mesh-cell-N>`` file name, else the file name without its brackets (a
    notebook cell's ``<Cell In[N]>`` gives ``"Cell In[N]"``); ``call`` gives
    ``"endpoint NAME"``; every other type gives ``""`` (not shown).
    """
    if not isinstance(content, dict):
        return ""
    if type == "execute":
        label = content.get("label")
        if isinstance(label, str) and label:
            return label
        name = str(content.get("filename") or "")
        if name.startswith("<mesh-cell-") and name.endswith(">"):
            return "cell " + name[len("<mesh-cell-"):-1]
        return name.strip("<>") or "cell"
    if type == "call":
        return f"endpoint {content.get('m', '?')}"
    return ""


@dataclass
class RankInfo:
    """What the controller knows about one rank."""

    rank: int
    host: str = ""
    pid: int | None = None
    state: str = "starting"  # starting, idle, busy, dead, stopped
    exitcode: int | None = None
    last_heard: float = field(default_factory=time.monotonic)
    hello_at: float = 0.0  # monotonic time of the rank's hello
    last_lines: collections.deque[str] = field(
        default_factory=lambda: collections.deque(maxlen=20)
    )
    partial: str = ""
    messages_in: int = 0
    messages_out: int = 0
    telemetry: dict[str, Any] = field(default_factory=dict)
    #: the rank's worker connected a second socket (controller -> worker traffic);
    #: also True for a worker on a lane (monarch_kernel.transport.lane), which is used first
    down: bool = False
    #: routing identity of the rank's connection, learnt from its signed hello
    #: (random per worker process, so no other connection can claim the rank's traffic)
    identity: bytes = b""
    #: the worker's pooled shared-memory files seen in its replies: removed by the
    #: controller if the worker dies without removing them itself (SIGKILL)
    shm_files: set[str] = field(default_factory=set)
    #: the epoch of this run of the rank (its messages carry it; wire.protocol)
    epoch: int = 0
    #: set when the mesh itself kills the rank (it did not stop when interrupted):
    #: who killed it and why, as the failure names it ("the mesh after it ignored
    #: the interrupt"); "" otherwise
    killed_by: str = ""

    def describe_exit(self, heartbeat: float = 1.0) -> str:
        """How the rank ended, in a few words (``heartbeat``: the mesh's, in seconds)."""
        if self.exitcode is None:
            return "stopped answering"
        why = messages.WORKER_EXITS.get(self.exitcode)
        if why is not None:  # the worker left by itself, having lost its controller
            return "stopped: " + why.format(timeout=messages.heartbeat_timeout(heartbeat))
        if self.exitcode < 0:
            try:
                name = signal.Signals(-self.exitcode).name
            except ValueError:
                name = f"signal {-self.exitcode}"
            if self.killed_by:
                return f"was killed by {self.killed_by} ({name})"
            return f"was killed by {name}"
        return f"exited with code {self.exitcode}"


class Pipe:
    """The read end of a local worker's stdout or stderr pipe."""

    __slots__ = ("decoder", "fd", "name", "rank")

    def __init__(self, rank: int, name: str, fd: int) -> None:
        self.rank, self.name, self.fd = rank, name, fd
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")


class Request:
    """A request sent to some ranks, and everything that comes back for it.

    Attributes
    ----------
    id : str
    ranks : list of int
    replies : dict of int to (str, Any)
        Per rank: ``("ok", value)`` or ``("error", failure dict)``.
    events : queue.SimpleQueue
        ``("stream", rank, name, text)`` and ``("display", rank, content)``
        tuples, in arrival order, while the request runs; ``("done",)`` last.
    failure : MeshFailure or None
        Set when a rank died before replying.
    label : str
        What it is, for people (``"cell 3"``, ``"endpoint step"``; see
        :func:`request_label`); empty for internal requests.
    sent_at : float
        ``time.monotonic()`` when it was made.
    reply_at : dict of int to float
        Per rank: ``time.monotonic()`` when its reply arrived.
    """

    def __init__(self, id: str, ranks: Iterable[int], label: str = "") -> None:
        self.id = id
        self.ranks = list(ranks)
        #: the ranks, as a set (membership: a reply per rank is checked against it)
        self.rankset = frozenset(self.ranks)
        self.label = label
        self.sent_at = time.monotonic()
        self.reply_at: dict[int, float] = {}
        #: the fingerprint of the mesh a worker's call went to, when not its own
        #: (mesh_keys.py); None for the controller's requests and a worker's own mesh
        self.mesh: str | None = None
        self.replies: dict[int, tuple[str, Any]] = {}
        self.events: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self.failure: MeshFailure | None = None
        self.failed_at: float | None = None  # monotonic time a rank's death failed it
        self._done = Flag()
        self._arrived: Flag | None = None  # set by put_event; made by next_event
        self._callbacks: list[Callable[[Request], None]] = []
        self._lock = threading.Lock()
        #: ``waiter(event, timeout) -> bool``: blocks until ``event`` is set, reading
        #: the controller's messages in the waiting thread (Controller.wait_for)
        self.waiter: Callable[[Flag, float | None], bool] | None = None
        #: called once done, after the callbacks: wakes a thread that waits for this
        #: in its own poll, when another thread finished it (WorkerIO.wake_leader)
        self.wake: Callable[[], None] | None = None

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every rank answered or failed; True if done."""
        if self.waiter is not None and not self._done.is_set():
            return self.waiter(self._done, timeout)
        return self._done.wait(timeout)

    def put_event(self, event: tuple) -> None:
        """Queue an event for whoever shows this request's output (any thread)."""
        self.events.put(event)
        arrived = self._arrived  # (read after the put: see next_event)
        if arrived is not None:
            arrived.set()

    def add_done_callback(self, fn: Callable[[Request], None]) -> None:
        """Call ``fn(self)`` once done (at once if already done)."""
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    def _finish(self) -> None:
        with self._lock:
            if self._done.is_set():
                return
            self._done.set()
            self.put_event(("done",))  # wakes whoever waits on the events
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            try:
                fn(self)
            except Exception:
                log.exception("a request callback failed")
        if self.wake is not None:
            self.wake()

    def _reply(self, rank: int, status: str, value: Any) -> bool:
        self.replies[rank] = (status, value)
        self.reply_at.setdefault(rank, time.monotonic())
        if len(self.replies) >= len(self.ranks):
            self._finish()
            return True
        return False

    def next_event(self, timeout: float) -> tuple | None:
        """The next event, waiting up to ``timeout`` seconds while the request
        runs (not at all once it is done); None when there is none."""
        try:
            if self.done():
                return self.events.get_nowait()
            if self.waiter is None:
                return self.events.get(timeout=timeout)
            arrived = self._arrived
            if arrived is None:  # only readers of events wait on it (cells)
                with self._lock:
                    if self._arrived is None:
                        self._arrived = Flag()
                    arrived = self._arrived
            arrived.clear()
            if self.events.empty():  # (checked after the clear: no event is missed)
                self.waiter(arrived, timeout)
            return self.events.get_nowait()
        except queue.Empty:
            return None

    def _reply_pending(self, rank: int) -> bool:
        return rank in self.rankset and rank not in self.replies

    def _fail(self, failure: MeshFailure) -> None:
        if self.failure is None:
            self.failure = failure
        self._finish()

    def failures(self, actor: str | None = None) -> list[RemoteFailure]:
        """The error replies, as :class:`RemoteFailure` objects."""
        out = []
        for rank, (status, v) in sorted(self.replies.items()):
            if status == "error":
                out.append(
                    RemoteFailure(rank, v.get("exc"), v["type"], v["message"], v["traceback"],
                                  actor, v.get("tree"))
                )
        return out
