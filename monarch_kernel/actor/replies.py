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
    ranks_label,
    remote_exception,
)
from monarch_kernel.mesh.shape import MISSING, Shape, ValueMesh
from monarch_kernel.wire.serialize import Packed

__all__ = ["CallOutput", "call_failure", "raise_failures", "set_debug_handler", "show_display"]

#: who serves a rank that paused in pdb during a call: ``handler(request, event,
#: printer)``; set by the kernel's debugger bridge
#: (:mod:`monarch_kernel.kernel.debug_bridge`) when it is imported
_debug_handler: Callable[[Request, tuple, Any], None] | None = None


def set_debug_handler(handler: Callable[[Request, tuple, Any], None]) -> None:
    """Have ``handler(request, event, printer)`` serve the ``debug`` events of calls
    (a rank paused in pdb); without one they are dropped."""
    global _debug_handler
    _debug_handler = handler


def raise_failures(req: Request, actor: str, method: str | None = None,
                   shape: Shape | None = None) -> None:
    """Raise what went wrong with an actor call, if anything.

    Parameters
    ----------
    req : Request
    actor : str
        The actor mesh's name.
    method : str, optional
        The endpoint called: a rank that died during the call is then reported as
        a :class:`~monarch_kernel.errors.MeshFailure` that names the call (see
        :func:`call_failure`).
    shape : Shape, optional
        The shape of the call's result (for ``err.partial``).
    """
    if req.failure is not None:
        if method is not None:
            raise call_failure(req, actor, method, shape) from None
        raise req.failure
    failures = _failures(req, actor)
    if not failures:
        return
    groups = group_failures(failures)
    err = remote_exception(groups[0], ActorError)
    if len(groups) > 1:
        err.others = [remote_exception(g, ActorError) for g in groups[1:]]
    raise err


def _failures(req: Request, actor: str) -> list[RemoteFailure]:
    """The error replies of ``req``.

    Raises
    ------
    MeshFailure
        The first reply that says the actor is not there (stopped, never spawned).
    """
    failures = []
    for rank, (status, v) in sorted(req.replies.items()):
        if status != "error":
            continue
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
    return failures


def call_failure(req: Request, actor: str, method: str, shape: Shape | None) -> MeshFailure:
    """The error of endpoint call ``actor.method`` that failed because a rank died
    (``req.failure``): it names the call and the dead rank, and keeps what the
    others did.

    Returns
    -------
    MeshFailure
        ``rank``, ``host``, ``pid``, ``exitcode`` and ``last_output`` of the dead
        rank (as ``req.failure``), and:

        ``endpoint``   ``"actor.method"``
        ``partial``    a :class:`~monarch_kernel.mesh.shape.ValueMesh` of ``shape``
                       (None without one): the value of each rank that answered, and
                       :data:`~monarch_kernel.mesh.shape.MISSING` for the dead rank,
                       the cancelled ones and those that raised
        ``cancelled``  the ranks that had not answered when the call failed: the
                       call stopped waiting for them (their endpoint may still run;
                       its value is dropped)
        ``others``     the errors of ranks that raised (ActorError, grouped)
    """
    dead = req.failure
    assert dead is not None
    replies = dict(req.replies)
    ok = {r: v for r, (status, v) in replies.items() if status == "ok"}
    raised = sorted(r for r, (status, _) in replies.items() if status == "error")
    cancelled = [r for r in req.ranks if r not in replies and r != dead.rank]
    partial = None
    if shape is not None:
        values: list[Any] = []
        for r in shape.ranks:
            value: Any = MISSING
            if r in ok:
                try:
                    value = ok[r].unpack() if isinstance(ok[r], Packed) else ok[r]
                except Exception:  # noqa: BLE001 - its value is lost, not the error
                    value = MISSING
            values.append(value)
        partial = ValueMesh(shape, values)
    head, sep, last = str(dead).partition("; its last output:")
    parts = [f"{actor}.{method}() on {ranks_label(list(req.ranks))}: {head} during the call"]
    answered = sorted(ok)
    if answered:
        parts.append(f"{ranks_label(answered)} answered (err.partial holds "
                     f"{'its value' if len(answered) == 1 else 'their values'})")
    if cancelled:
        them = "it" if len(cancelled) == 1 else "them"
        parts.append(f"{ranks_label(cancelled)} cancelled (no answer yet; the call no longer "
                     f"waits for {them})")
    if raised:
        parts.append(f"{ranks_label(raised)} raised (below)")
    err = MeshFailure("; ".join(parts) + (sep + last if sep else ""), rank=dead.rank,
                      host=dead.host, pid=dead.pid, exitcode=dead.exitcode,
                      last_output=dead.last_output)
    err.endpoint = f"{actor}.{method}"
    err.partial = partial
    err.cancelled = cancelled
    failures = _failures(req, actor)
    if failures:
        err.others = [remote_exception(g, ActorError) for g in group_failures(failures)]
    return err


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
