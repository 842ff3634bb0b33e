"""What comes back from an actor call, as the caller sees it.

A call's :class:`~monarch_kernel.controller.controller.Request` collects one reply per
rank and, for calls from the controller, the events the ranks sent while the
call ran. Two things read them, for :mod:`monarch_kernel.actor.actor_mesh` (and for
:mod:`monarch_kernel.actor.spawn`, :mod:`monarch_kernel.tensors.handles` and the
kernel's debugger bridge):

* :func:`raise_failures`: the error replies become one
  :class:`~monarch_kernel.errors.ActorError` (also an instance of the
  original exception type; ranks that failed alike are grouped, other groups
  in its ``others``), or the request's own failure (a dead rank,
  :class:`~monarch_kernel.errors.MeshFailure`) is raised;
* :class:`CallOutput`: the pump of a call's future: while the future is
  waited on it shows what the ranks printed (rank-tagged, through
  :class:`~monarch_kernel.controller.output.RankPrinter`), their rich displays
  (:func:`show_display`), and hands a rank paused in pdb to the kernel's
  debug console.
"""

from __future__ import annotations

import queue
import sys
from collections.abc import Callable
from typing import Any

from monarch_kernel.controller.controller import Request
from monarch_kernel.controller.output import RankPrinter, write_stream
from monarch_kernel.errors import (
    ActorError,
    MeshFailure,
    RemoteFailure,
    group_failures,
    remote_exception,
)
from monarch_kernel.wire.serialize import Packed

__all__ = ["CallOutput", "raise_failures", "set_debug_handler", "show_display"]

#: who serves a rank that paused in pdb during a call: ``handler(request, event,
#: printer)``; set by the kernel's debugger bridge
#: (:mod:`monarch_kernel.kernel.debug_bridge`) when it is imported
_debug_handler: Callable[[Request, tuple, Any], None] | None = None


def set_debug_handler(handler: Callable[[Request, tuple, Any], None]) -> None:
    """Have ``handler(request, event, printer)`` serve the ``debug`` events of calls
    (a rank paused in pdb); without one they are dropped."""
    global _debug_handler
    _debug_handler = handler


def raise_failures(req: Request, actor: str) -> None:
    """Raise what went wrong with an actor call, if anything."""
    if req.failure is not None:
        raise req.failure
    errors = [(r, v) for r, (status, v) in sorted(req.replies.items()) if status == "error"]
    if not errors:
        return
    failures = []
    for rank, v in errors:
        exc = v.get("exc")
        if isinstance(exc, Packed):
            try:
                exc = exc.unpack()
            except Exception:  # noqa: BLE001 - the text still describes it
                exc = None
        if v.get("rejected") and isinstance(exc, MeshFailure):
            raise exc  # the actor is not there (stopped, never spawned)
        failures.append(RemoteFailure(rank, exc, v["type"], v["message"], v["traceback"], actor,
                                      v.get("tree")))
    groups = group_failures(failures)
    err = remote_exception(groups[0], ActorError)
    if len(groups) > 1:
        err.others = [remote_exception(g, ActorError) for g in groups[1:]]
    raise err


class CallOutput:
    """Shows what ranks printed during a call (rank-tagged), while it is waited on."""

    def __init__(self, req: Request) -> None:
        self.req = req
        self.printer: Any = None

    def __call__(self, final: bool) -> None:
        q = self.req.events
        if self.printer is None and (q.empty() or (final and q.qsize() == 1 and self.req.done())):
            return  # nothing printed (at the end, only the "done" mark is left)
        if self.printer is None:
            self.printer = RankPrinter(write_stream)
        while True:
            try:
                ev = q.get_nowait()
            except queue.Empty:
                break
            if ev[0] == "stream":
                self.printer.feed(ev[1], ev[2], ev[3])
            elif ev[0] == "display":
                show_display(ev[1], ev[2])
            elif ev[0] == "debug" and _debug_handler is not None:
                _debug_handler(self.req, ev, self.printer)  # paused in pdb: the kernel's console
        if final:
            self.printer.close()
        else:
            self.printer.flush_lines()


def show_display(rank: int, content: dict[str, Any]) -> None:
    """Publish a rank's rich display (``display_data`` content) in the notebook,
    with the rank in its metadata (nothing outside IPython)."""
    ip = sys.modules.get("IPython")
    shell = ip.get_ipython() if ip is not None else None
    if shell is None:
        return
    md = dict(content.get("metadata") or {})
    md["monarch_rank"] = rank
    shell.display_pub.publish(data=content["data"], metadata=md)
