"""The worker side of the distributed debugger: a pdb whose terminal is the controller.

:func:`install` (called once by the worker at start-up) makes
``breakpoint()``, ``pdb.set_trace()``, ``pdb.post_mortem()`` and
``pdb.pm()`` open a :class:`RemotePdb` in whatever thread calls them: the
main thread running a ``%%mesh`` cell, or an actor's thread running an
endpoint. That thread, and only that thread, stops; the worker's I/O thread
keeps heartbeats and messages moving.

A :class:`RemotePdb` never calls ``input()`` and never writes to the
process's stdout. What pdb writes is collected, and each time pdb wants a
command line the collected text travels to the controller in one ``debug``
message::

    worker -> controller  "debug"        {kind: "paused", session, prompt, text,
                                          function, filename, lineno, thread, where}
                                         {kind: "running" | "ended", session, text,
                                          reason}
    controller -> worker  "debug_input"  {session, line}   line None: release
                                         {quit: {request, ranks}}  ranks of request
                                         quit their debugger (:func:`register_quit_hook`)

The worker's I/O thread hands every ``debug_input`` to :func:`deliver`, which
puts the line in the paused session's queue (the paused thread is blocked
there). A ``line`` of ``None`` *releases* the session: tracing stops and the
code runs on, whatever breakpoints are set (used when the frontend cannot
answer prompts, and when the kernel is interrupted). A ``KeyboardInterrupt``
(the worker's interrupt) while paused ends the session and is raised in the
paused code, as it would be in running code.

The controller knows a session's state only from these messages, so a
session never leaves pdb without saying so: an interrupt is held back
while a session updates its state and sends its message
(:class:`~monarch_kernel.util.sigint.DeferredSigint`), and an interrupt that lands just after pdb's
command loop (e.g. right after a release or ``c``, before the message that
says so) still ends the session with an ``ended`` message. Otherwise the
controller would keep the session as ``paused`` while nothing waits for
its lines, and a console sending it a command would wait for an answer
that never comes.

Ideas from CPython 3.14's remote pdb (``pdb._PdbServer``): subclass
:class:`pdb.Pdb`, replace its stdin/stdout with message channels, turn each
prompt into one round trip, and keep ``SIGINT`` handling out of pdb
(``nosigint``) because the process's own handler owns interrupts.
"""

from __future__ import annotations

import bdb
import contextlib
import itertools
import os
import pdb  # noqa: T100 - this module *is* the remote pdb
import queue
import sys
import threading
import types
from typing import IO, Any, cast

from monarch_kernel.actor.context import current_actor
from monarch_kernel.util.cells import location
from monarch_kernel.util.sigint import DeferredSigint
from monarch_kernel.worker import handlers, telemetry
from monarch_kernel.worker.detach import register_reporter
from monarch_kernel.worker.worker import (
    cut_debugger_frames,  # (re-exported: the debugger's view of it)
)

__all__ = [
    "RemotePdb",
    "breakpointhook",
    "cut_debugger_frames",
    "deliver",
    "install",
    "pm",
    "post_mortem",
    "register_quit_hook",
    "remember_exception",
    "set_request_parent",
    "set_trace",
    "uninstall",
]

#: modules whose frames pdb never stops in (the worker's own machinery)
SKIP = ["monarch_kernel", "monarch_kernel.*"]

_worker: Any = None
_sessions: dict[str, RemotePdb] = {}
_lock = threading.Lock()
_counter = itertools.count(1)
_tls = threading.local()
_UNSET = object()
_original: dict[str, Any] = {}


class _Channel:
    """pdb's stdin and stdout: output is buffered, input comes from the controller."""

    def __init__(self, owner: RemotePdb) -> None:
        self._owner = owner

    # stdout
    def write(self, text: str) -> int:
        self._owner._out.append(text)
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False

    # stdin
    def readline(self) -> str:
        return self._owner._read_line()

    @property
    def encoding(self) -> str:
        return "utf-8"


class RemotePdb(pdb.Pdb):
    """A :class:`pdb.Pdb` whose input and output travel over the mesh's control channel.

    Parameters
    ----------
    worker : monarch_kernel.worker.worker.Worker
        The worker of this process (sends the messages).
    post_mortem : bool
        True for a post-mortem session (it ends when its prompt loop ends).

    Attributes
    ----------
    sid : str
        The session id, ``"<rank>.<n>"``, unique within the worker.
    """

    def __init__(self, worker: Any, post_mortem: bool = False) -> None:
        self._out: list[str] = []
        self._inbox: queue.Queue[str | None] = queue.Queue()
        # (pdb uses readline, write and flush only; typeshed asks for a whole IO[str])
        channel = cast("IO[str]", _Channel(self))
        super().__init__(stdin=channel, stdout=channel, skip=SKIP, nosigint=True, readrc=False)
        self.use_rawinput = False
        self.worker = worker
        self.sid = f"{worker.rank}.{next(_counter)}"
        self.prompt = f"(Pdb rank {worker.rank}) "
        self.post_mortem_mode = post_mortem
        self.thread_name = threading.current_thread().name
        self.thread_id = threading.get_ident()
        self.ended = False
        #: the last "paused" message while the session waits for a line, else None
        self.paused_content: dict[str, Any] | None = None
        self._released = False
        self._was_released = False
        with _lock:
            _sessions[self.sid] = self

    # ------------------------------------------------------------ messages
    def _parent(self) -> str | None:
        p: Any = getattr(_tls, "parent", _UNSET)
        if p is not _UNSET:
            return p
        if self.thread_id == self.worker.main_thread_id:
            return self.worker.current_parent
        if current_actor() is not None:
            return self.worker.current_parent  # an actor's thread: the call it serves
        return None

    def _send(self, kind: str, **content: Any) -> None:
        # an interrupt waits until the message is out (else it may never go)
        with DeferredSigint():
            capture = getattr(self.worker, "capture", None)
            if capture is not None:
                capture.drain()  # what the code printed comes before what pdb says
            text, self._out = "".join(self._out), []
            parent = self._parent()
            content.update(kind=kind, session=self.sid, text=text, thread=self.thread_name,
                           parent=parent)
            # (what a controller that attaches later is told: see paused_report)
            self.paused_content = dict(content) if kind == "paused" else None
            try:
                self.worker.send("debug", content, parent)
            except Exception:  # noqa: BLE001, S110 - the controller is gone; the I/O thread exits
                pass

    def _where(self) -> dict[str, Any]:
        frame = self.curframe
        if frame is None:
            return {"function": "?", "filename": "?", "lineno": 0, "where": "?"}
        code = frame.f_code
        lineno = frame.f_lineno
        if self.curindex < len(self.stack):
            lineno = self.stack[self.curindex][1]
        return {
            "function": code.co_name,
            "filename": code.co_filename,
            "lineno": lineno,
            "where": f"{location(code.co_filename, lineno)}, in {code.co_name}",
        }

    def _read_line(self) -> str:
        text = "".join(self._out)
        if text.endswith(self.prompt):
            self._out = [text[: -len(self.prompt)]]
        entry = ""
        if 0 <= self.curindex < len(self.stack):
            entry = "> " + self.format_stack_entry(self.stack[self.curindex], "\n-> ")
        where = self._where()
        self._send("paused", prompt=self.prompt, entry=entry, **where)
        with _activity(f"paused at {location(where['filename'], where['lineno'])}"):
            while True:
                try:
                    line = self._inbox.get(timeout=0.5)
                except queue.Empty:
                    continue
                if line is None:
                    self._released = True
                    return "\n"
                return line if line.endswith("\n") else line + "\n"

    # ------------------------------------------------------------ pdb hooks
    def onecmd(self, line: str) -> bool:
        """Run one pdb command; a release (``None`` from the controller) continues."""
        if self._released:
            self._released = False
            self._was_released = True
            self.message("released by the controller: this rank runs on without stopping")
            self._stop_tracing()
            return True
        return bool(super().onecmd(line))

    def _cmdloop(self) -> None:
        # pdb's own loop swallows KeyboardInterrupt and prompts again; an
        # interrupt of a paused rank must end the session and reach its code
        try:
            self.allow_kbdint = True
            self.cmdloop()
            self.allow_kbdint = False
        except KeyboardInterrupt:
            self._stop_tracing()
            self.message("--KeyboardInterrupt-- (the kernel was interrupted)")
            self._finish("interrupted")
            raise

    def interaction(self, frame: types.FrameType | None, traceback: Any) -> None:
        """Stop here and serve commands from the controller until told to go on."""
        if self.ended:
            return
        try:
            super().interaction(frame, traceback)
            if self.ended:
                return
            if self.post_mortem_mode:
                self._finish("post-mortem done")
            elif self.quitting:
                self._finish("quit")
            elif sys.gettrace() is None:
                self._finish("released" if self._was_released else "continue")
            else:
                self._send("running")
        except BaseException:
            # an interrupt that landed after pdb's command loop (just after a release
            # or `c`, before the message saying so): the session ends here, and the
            # controller hears it (else it keeps the session as paused for ever)
            with DeferredSigint():
                self._stop_tracing()
                self._finish("interrupted")
            raise

    def user_return(self, frame: types.FrameType, return_value: Any) -> None:
        """As in :class:`pdb.Pdb`, without leaving ``__return__`` in a cell's namespace."""
        try:
            super().user_return(frame, return_value)
        finally:
            if frame.f_code.co_name == "<module>":
                frame.f_globals.pop("__return__", None)

    def dispatch_return(self, frame: types.FrameType, arg: Any) -> Any:
        """As in :class:`bdb.Bdb`; stepping out of the user's code ends the session.

        When the frame that returns was called by the worker's own machinery
        (the end of a cell or of an endpoint), stepping further would only
        walk through the worker's loop, so tracing stops there (breakpoints
        set with ``b`` keep it on).
        """
        result = super().dispatch_return(frame, arg)
        caller = frame.f_back
        if (caller is not None and not self.quitting and not self.ended
                # (bdb takes None too, a module without a name; typeshed says str)
                and self.is_skipped_module(
                    caller.f_globals.get("__name__"))  # type: ignore[arg-type]
                and (self.stopframe is None or self.stopframe is frame
                     or self.stopframe is caller)):
            self.set_continue()
            if sys.gettrace() is None:
                self._finish("returned")
                return None
        return result

    def set_trace(self, frame: types.FrameType | None = None) -> None:
        """Start debugging in ``frame`` (default: the caller's)."""
        if frame is None:
            frame = sys._getframe().f_back
        self.ended = False
        self.paused_content = None
        self._released = False
        self._was_released = False
        # Python 3.13+ stops on the breakpoint() line itself; stop after it, as 3.10-3.12
        # do, so one script of commands works with every Python
        self._first_stop = ((frame, frame.f_lineno)
                            if frame is not None and sys.version_info >= (3, 13) else None)
        with _lock:
            _sessions[self.sid] = self
        super().set_trace(frame)

    def user_opcode(self, frame: types.FrameType) -> None:
        """As in :class:`pdb.Pdb` (3.13+), but the first stop of ``set_trace`` waits
        for the next line."""
        first, self._first_stop = getattr(self, "_first_stop", None), None
        if first is not None and frame is first[0] and frame.f_lineno == first[1]:
            self.set_step()
            return
        super().user_opcode(frame)  # type: ignore[misc]

    def get_stack(self, f: Any, t: Any) -> tuple[list[Any], int]:
        """As in :class:`bdb.Bdb`, without the worker's own frames below the user's code."""
        stack, i = super().get_stack(f, t)
        cut = -1
        for j in range(min(i, len(stack) - 1)):
            name = stack[j][0].f_globals.get("__name__")
            # (bdb takes None too, a module without a name; typeshed says str)
            if self.is_skipped_module(name) or name in (  # type: ignore[arg-type]
                    "runpy", "threading"):
                cut = j
        if cut >= 0:
            stack, i = stack[cut + 1:], i - cut - 1
        return stack, i

    def do_interact(self, arg: str) -> None:
        """interact is not available on a remote rank (it needs a terminal)."""
        self.error("interact needs a local terminal; use p / pp / ! statements instead")

    # ------------------------------------------------------------ ending
    def _stop_tracing(self) -> None:
        saved, self.breaks = self.breaks, {}
        try:
            self.set_continue()
        finally:
            self.breaks = saved

    def _finish(self, reason: str) -> None:
        with DeferredSigint():  # ended here means the controller hears it
            if self.ended:
                return
            self.ended = True
            with _lock:
                _sessions.pop(self.sid, None)
            if getattr(_tls, "active", None) is self:
                _tls.active = None
            self._send("ended", reason=reason)

    def deliver(self, line: str | None) -> None:
        """Queue one command line (``None``: release) for this session (any thread)."""
        self._inbox.put(line)


def _activity(text: str) -> Any:
    """telemetry's ``activity`` block (the dashboard shows the rank as paused)."""
    try:
        return telemetry.activity(text)
    except Exception:  # noqa: BLE001 - telemetry is optional here
        return contextlib.nullcontext()


# ---------------------------------------------------------------- routing
def deliver(content: dict[str, Any]) -> None:
    """Hand a ``debug_input`` message's content to its session (called by the I/O thread).

    Lines for sessions that already ended are dropped.
    """
    sid = content.get("session")
    with _lock:
        session = _sessions.get(sid) if isinstance(sid, str) else None
    if session is not None:
        session.deliver(content.get("line"))


def set_request_parent(parent: str | None) -> None:
    """Say which request the calling thread is serving (actor threads).

    ``debug`` messages of a session in this thread carry ``parent`` as their
    parent id, so the controller shows them in the cell that waits for that
    request. The main thread needs no call: it uses the worker's current
    request.
    """
    _tls.parent = parent


def remember_exception(exc: BaseException) -> None:
    """Keep ``exc`` (with its traceback) for ``%mesh debug --post-mortem``.

    Call it *before* the traceback is cleared (``Worker.describe_failure``
    clears it before pickling).
    """
    w = _worker
    if w is not None and exc.__traceback__ is not None:
        w.last_exception = exc
        w.last_traceback = exc.__traceback__


# ---------------------------------------------------------------- entry points
def _session() -> RemotePdb:
    active = getattr(_tls, "active", None)
    if active is not None and not active.ended:
        return active
    if _worker is None:
        raise RuntimeError("the remote debugger runs only inside a monarch_kernel worker")
    _tls.active = RemotePdb(_worker)
    return _tls.active


def set_trace(*, header: str | None = None) -> None:
    """``pdb.set_trace()`` on a worker: pause the calling thread for the controller."""
    if _worker is None:
        return _original["set_trace"](header=header)
    p = _session()
    if header is not None:
        p.message(header)
    p.set_trace(sys._getframe().f_back)


def breakpointhook(*args: Any, **kwargs: Any) -> None:
    """``sys.breakpointhook`` on a worker (honours ``PYTHONBREAKPOINT=0``)."""
    if os.environ.get("PYTHONBREAKPOINT") == "0":
        return None
    if _worker is None:
        return sys.__breakpointhook__(*args, **kwargs)  # noqa: T100
    p = _session()
    header = kwargs.get("header")
    if header is not None:
        p.message(header)
    p.set_trace(sys._getframe().f_back)
    return None


def _trim(tb: types.TracebackType | None) -> types.TracebackType | None:
    while tb is not None and (tb.tb_next is not None
                              and (tb.tb_frame.f_globals.get("__name__") or "").startswith(
                                  "monarch_kernel")):
        tb = tb.tb_next
    return tb


def post_mortem(t: Any = None) -> None:
    """Open a remote pdb in the frames of traceback ``t``.

    Parameters
    ----------
    t : traceback or BaseException or None
        Default: the exception being handled, else the worker's last
        uncaught exception (see :func:`remember_exception`).

    Raises
    ------
    RuntimeError
        If there is no exception to debug.
    """
    if _worker is None:
        return _original["post_mortem"](t)
    if isinstance(t, BaseException):
        t = t.__traceback__
    if t is None:
        t = sys.exc_info()[2]
    last = t is None
    if t is None:
        t = getattr(_worker, "last_traceback", None)
    if t is None:
        raise RuntimeError(
            f"rank {_worker.rank} has no uncaught exception to debug; run the failing code "
            "first, then  %mesh debug --post-mortem RANK"
        )
    t = _trim(t)
    p = RemotePdb(_worker, post_mortem=True)
    exc = getattr(_worker, "last_exception", None)
    if last and exc is not None:
        p.message(f"post-mortem of {type(exc).__name__}: {exc}")
    p.reset()
    try:
        p.interaction(None, t)
    finally:
        p._finish("post-mortem done")


def pm() -> None:
    """``pdb.pm()`` on a worker: post-mortem of the last uncaught exception."""
    post_mortem(getattr(_worker, "last_traceback", None) or getattr(sys, "last_traceback", None))


def paused_report(worker: Any) -> dict[str, Any]:
    """The sessions paused in this worker, as their last ``paused`` messages
    (``{"debug": [content, ...]}``): a detachable mesh's rank reports them to a
    controller that attaches, which then knows them as it would have live."""
    with _lock:
        sessions = list(_sessions.values())
    return {"debug": [dict(s.paused_content) for s in sessions
                      if s.paused_content is not None and not s.ended]}


register_reporter(paused_report)


def install(worker: Any) -> None:
    """Make ``breakpoint()`` and ``pdb.set_trace()`` talk to the controller.

    Called once by the worker process before any user code runs.
    """
    global _worker
    _worker = worker
    if not hasattr(worker, "last_traceback"):
        worker.last_traceback = None
        worker.last_exception = None
    if not _original:
        _original.update(set_trace=pdb.set_trace, post_mortem=pdb.post_mortem, pm=pdb.pm)
    sys.breakpointhook = breakpointhook
    pdb.set_trace = set_trace
    pdb.post_mortem = post_mortem
    pdb.pm = pm


def uninstall() -> None:
    """Undo :func:`install` (tests that drive a RemotePdb in their own process)."""
    global _worker
    _worker = None
    if _original:
        pdb.set_trace = _original["set_trace"]
        pdb.post_mortem = _original["post_mortem"]
        pdb.pm = _original["pm"]
    sys.breakpointhook = sys.__breakpointhook__


# BdbQuit is what ``q`` raises in the paused code; re-exported for callers
BdbQuit = bdb.BdbQuit


# ------------------------------------------------- ranks that quit (hooks from above)
_quit_hooks: list[Any] = []


def register_quit_hook(fn: Any) -> None:
    """Call ``fn(worker, content)`` on the I/O thread when the controller says that
    ranks of a request this rank still runs quit their debugger (a ``debug_input``
    whose ``quit`` is ``{"request": id, "ranks": [...]}``); ``fn`` must not block.

    This is how ``torch.distributed`` set-up (a higher layer) aborts the
    collectives that wait for those ranks (registering the same function
    twice registers it once).
    """
    if fn not in _quit_hooks:
        _quit_hooks.append(fn)


# ------------------------------------------------- the worker's handlers (plug-in)
def _on_debug_input(worker: Any, msg: Any) -> None:
    content = msg.content
    if isinstance(content, dict) and isinstance(content.get("quit"), dict):
        for fn in list(_quit_hooks):
            fn(worker, content["quit"])  # (an exception is logged by the I/O thread)
        return
    deliver(content)  # the paused thread waits in pdb: hand it the line


handlers.register_io("debug_input", _on_debug_input)
handlers.register_start(install)  # breakpoint() / pdb.set_trace() prompt in the notebook
