"""The controller side's record of debugger sessions: which ranks are paused, where.

A :class:`DebugRegistry` listens to one :class:`~monarch_kernel.controller.controller.Controller`
(``controller.listeners``) and keeps a :class:`DebugSession` per remote pdb
session (one per paused thread of a rank). The controller's I/O thread
updates it from ``debug`` messages; the kernel's main thread reads it and
sends command lines back with :meth:`DebugRegistry.send`. A rank that dies
ends its sessions.

:func:`registry_for` gives the one registry of a controller, creating and
attaching it on first use; attach it before user code runs (the ``%mesh
spawn`` magic does) so that ranks paused by background work are known too.
"""

from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

__all__ = ["DebugRegistry", "DebugSession", "registry_for"]

#: ended sessions kept (their last output may still be read)
KEEP_ENDED = 256


@dataclass
class DebugSession:
    """One remote pdb session, as the controller last heard of it.

    Attributes
    ----------
    rank : int
    sid : str
        Session id (``"<rank>.<n>"``).
    state : str
        ``"paused"`` (waiting for a command), ``"running"`` (stepping or
        continuing with breakpoints set) or ``"ended"``.
    seq : int
        Number of messages received for this session (grows with each).
    parent : str or None
        Id of the request whose code paused, if any.
    prompt, function, filename, lineno, where, entry, thread, reason
        From the latest message: pdb's prompt, the paused frame, the
        ``> file(line)func()`` line, the thread's name, and why it ended.
    text : list of str
        pdb output not shown yet.
    since : float
        ``time.monotonic()`` of the latest state change.
    """

    rank: int
    sid: str
    state: str = "running"
    seq: int = 0
    parent: str | None = None
    prompt: str = ""
    function: str = "?"
    filename: str = "?"
    lineno: int = 0
    where: str = "?"
    entry: str = ""
    thread: str = ""
    reason: str = ""
    text: list[str] = field(default_factory=list)
    since: float = field(default_factory=time.monotonic)


class DebugRegistry:
    """Paused-rank sessions of one controller (thread-safe).

    Parameters
    ----------
    controller : Controller
        The mesh's controller; the registry adds itself to its listeners.
    """

    def __init__(self, controller: Any) -> None:
        self.controller = controller
        self._cond = threading.Condition()
        self._sessions: dict[str, DebugSession] = {}
        self.version = 0
        controller.listeners.append(self._listen)

    # ------------------------------------------------------------ updates
    def _listen(self, kind: str, rank: int, payload: Any) -> None:
        if kind == "debug" and isinstance(payload, dict):
            self.update(rank, payload)
        elif kind == "dead":
            with self._cond:
                for s in self._sessions.values():
                    if s.rank == rank and s.state != "ended":
                        s.state, s.reason, s.since = "ended", "the rank died", time.monotonic()
                        s.seq += 1
                self._changed()

    def update(self, rank: int, content: dict[str, Any]) -> DebugSession:
        """Record one ``debug`` message from ``rank`` (called by the I/O thread)."""
        sid = str(content.get("session", f"{rank}.?"))
        kind = content.get("kind", "")
        with self._cond:
            s = self._sessions.get(sid)
            if s is None:
                s = self._sessions[sid] = DebugSession(rank, sid)
                self._prune()
            s.seq += 1
            if content.get("text"):
                s.text.append(content["text"])
            s.parent = content.get("parent", s.parent)
            s.thread = content.get("thread", s.thread)
            if kind == "paused":
                s.state = "paused"
                for k in ("prompt", "function", "filename", "lineno", "where", "entry"):
                    if k in content:
                        setattr(s, k, content[k])
            elif kind == "running":
                s.state = "running"
            elif kind == "ended":
                s.state, s.reason = "ended", content.get("reason", "")
            s.since = time.monotonic()
            self._changed()
            return s

    def _changed(self) -> None:
        self.version += 1
        self._cond.notify_all()

    def _prune(self) -> None:
        ended = [k for k, s in self._sessions.items() if s.state == "ended"]
        for k in ended[: max(0, len(ended) - KEEP_ENDED)]:
            del self._sessions[k]

    # ------------------------------------------------------------ queries
    def get(self, sid: str) -> DebugSession | None:
        with self._cond:
            return self._sessions.get(sid)

    def sessions(self, state: str | None = "paused", ranks: Any = None,
                 parent: Any = ...) -> list[DebugSession]:
        """Sessions in ``state`` (None: any), on ``ranks`` (None: any), with ``parent``.

        Sorted by rank, then by when they reached their state.
        """
        rs = None if ranks is None else set(ranks)
        with self._cond:
            out = [s for s in self._sessions.values()
                   if (state is None or s.state == state)
                   and (rs is None or s.rank in rs)
                   and (parent is ... or s.parent == parent)]
        return sorted(out, key=lambda s: (s.rank, s.since))

    def take_text(self, s: DebugSession) -> str:
        """pdb output of ``s`` not shown yet (and forget it)."""
        with self._cond:
            text, s.text = "".join(s.text), []
        return text

    def wait(self, version: int, timeout: float) -> int:
        """Wait up to ``timeout`` seconds for a change after ``version``; the new version."""
        with self._cond:
            if self.version == version:
                self._cond.wait(timeout)
            return self.version

    # ------------------------------------------------------------ commands
    def send(self, s: DebugSession, line: str | None) -> None:
        """Send one pdb command line to session ``s`` (``None`` releases it)."""
        self.controller.notify([s.rank], "debug_input", {"session": s.sid, "line": line})

    def release(self, sessions: list[DebugSession]) -> None:
        """Let paused sessions run on without stopping again (interrupts, no stdin)."""
        for s in sessions:
            if s.state == "paused":
                self.send(s, None)


_registries: weakref.WeakKeyDictionary[Any, DebugRegistry] = weakref.WeakKeyDictionary()
_registries_lock = threading.Lock()


def registry_for(controller: Any) -> DebugRegistry:
    """The :class:`DebugRegistry` of ``controller`` (created and attached on first use)."""
    with _registries_lock:
        reg = _registries.get(controller)
        if reg is None:
            reg = _registries[controller] = DebugRegistry(controller)
        return reg
