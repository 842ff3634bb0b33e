"""The monarch_kernel error tree.

Every failure the controller can report is one of these; lower-layer errors
(ZeroMQ, pickling, the operating system) are mapped to them with
``raise ... from`` so the original cause stays attached. The tree follows the
style of httpx's ``_exceptions.py``::

    MonarchError
    ├── ProtocolError          a frame that is not a valid, signed message
    ├── TransportError         a socket could not bind, connect or send
    ├── MeshError              the mesh cannot do what was asked
    │   ├── NoMeshError        no mesh has been spawned yet
    │   ├── RankSpecError      a ``--ranks`` spec names no valid rank
    │   └── MeshFailure        a rank died, stopped, or stopped answering
    ├── SerializationError     a value could not be pickled or unpickled
    └── RemoteError            an exception raised on a rank
        └── ActorError         an exception raised in an actor endpoint

``RemoteError`` instances built by :func:`remote_exception` are also instances
of the original exception's type, so ``except ZeroDivisionError`` works on the
controller (the idea comes from ipyparallel's ``RemoteError`` and
``CompositeError``; here the type itself is kept as well).
"""

from __future__ import annotations

import re
import sys
import threading
import traceback
from typing import Any, Protocol, TypeVar, cast, overload

__all__ = [
    "ActorError",
    "MeshError",
    "MeshFailure",
    "MonarchError",
    "NoMeshError",
    "ProtocolError",
    "RankSpecError",
    "RemoteError",
    "RemoteFailure",
    "SerializationError",
    "SpawnInterrupted",
    "TransportError",
    "compact_ranks",
    "group_failures",
    "raise_request_failures",
    "ranks_label",
    "remote_exception",
]


#: what a call on a stopped mesh says (procmesh, supervision)
MESH_STOPPED = (
    "this mesh was stopped; spawn a new one (spawn_procs(...), or %mesh spawn N in the kernel)")


class MonarchError(Exception):
    """Base class of every error raised by monarch_kernel."""


class ProtocolError(MonarchError):
    """A message frame is malformed, unsigned, wrongly signed or replayed."""


class TransportError(MonarchError):
    """A ZeroMQ socket could not bind, connect, send or receive."""


class MeshError(MonarchError):
    """The mesh cannot do what was asked (bad shape, no such rank, ...)."""


class NoMeshError(MeshError):
    """No mesh exists yet; spawn one with ``%mesh spawn N``."""


class RankSpecError(MeshError, ValueError):
    """A rank specification (``0``, ``1,3``, ``0:2``) is invalid for the mesh."""


class MeshFailure(MeshError):
    """A rank died, was stopped, or stopped answering.

    Parameters
    ----------
    message : str
        What happened, naming the rank, host, pid and exit code or signal.
    rank : int or None
        The failed rank.
    host, pid, exitcode : optional
        Where it ran and how it ended (negative exit code: killed by signal).
    last_output : str
        The last lines the rank printed before it failed.
    """

    def __init__(
        self,
        message: str,
        rank: int | None = None,
        host: str | None = None,
        pid: int | None = None,
        exitcode: int | None = None,
        last_output: str = "",
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.host = host
        self.pid = pid
        self.exitcode = exitcode
        self.last_output = last_output
        self.others: list[BaseException] = []
        #: ranks of the same call that were interrupted because of this failure
        self.stopped: list[int] = []

    def stopped_text(self) -> str:
        """``"ranks 0, 2, 3 were stopped because rank 1 died"``, or ``""``."""
        if not self.stopped:
            return ""
        were = "was" if len(set(self.stopped)) == 1 else "were"
        cause = (f"{ranks_label([self.rank])} died" if self.rank is not None
                 else "the mesh failed")
        return f"{ranks_label(self.stopped)} {were} stopped because {cause}"

    def _render_traceback_(self) -> list[str]:
        """What IPython shows: the failure, the ranks stopped because of it, then
        what other ranks raised."""
        lines = [f"\x1b[1;31mMeshFailure\x1b[0m: {self}"]
        if self.stopped:
            lines.append(self.stopped_text())
        for other in self.others:
            lines.append("")
            render = getattr(other, "_render_traceback_", None)
            lines.extend(render() if render else [f"{type(other).__name__}: {other}"])
        return lines


class SpawnInterrupted(KeyboardInterrupt):
    """Ctrl-C (a kernel interrupt) while a mesh was starting; its workers are stopped.

    A ``KeyboardInterrupt`` (``except KeyboardInterrupt`` still catches it) whose
    message says in one line what was interrupted and what is left, e.g.
    ``"spawn interrupted: 2 of 4 ranks had started; nothing is left running"``;
    IPython shows that line instead of a traceback through the spawn's waits.
    """

    def _render_traceback_(self) -> list[str]:
        return [f"\x1b[1;31mKeyboardInterrupt\x1b[0m: {self}"]


class SerializationError(MonarchError):
    """A value could not be pickled (to send) or unpickled (on arrival)."""


class RemoteError(MonarchError):
    """An exception raised on one or more ranks.

    Attributes
    ----------
    ranks : list of int
        The ranks that raised it (several when identical failures are grouped).
    remote_type : str
        Qualified name of the original exception type.
    remote_traceback : str
        The traceback formatted on the rank, with the cell's own source lines.
    others : list of BaseException
        Set only on the first of several groups of failures: the errors of the
        other groups (shown after this one).
    """

    ranks: list[int]
    remote_type: str
    remote_traceback: str
    actor: str | None = None
    others: list[BaseException]  # (no class attribute: read with getattr(err, "others", ()))

    def __str__(self) -> str:
        base = self._remote_message()
        label = f"{ranks_label(getattr(self, 'ranks', []))}: "
        # an error let through the rank it came from (another actor of that rank, or
        # a wait cycle's way back) is labelled once: "rank 1: rank 1: x" reads "rank 1: x"
        return base if base.startswith(label) else label + base

    def _remote_message(self) -> str:
        return getattr(self, "_message", "") or ""

    def __reduce__(self) -> tuple:
        # the class made by remote_exception (also an instance of the original type)
        # is not importable: rebuild it from its parts (an endpoint that lets a
        # remote error through, to an actor or the controller, keeps its type)
        cls = type(self)
        base = getattr(cls, "_monarch_base", cls)
        # the remote traceback's note is made again where it lands (from the traceback
        # of the failure there, which may be longer); notes added to it travel aside
        state = {k: v for k, v in self.__dict__.items()
                 if k not in ("__notes__", "_auto_note", "_added_notes")}
        added = self._added_notes()
        if added:
            state["_added_notes"] = added
        return (_rebuild_remote, (base, getattr(cls, "_monarch_original", None), self.args,
                                  state))

    def __getattr__(self, name: str) -> Any:
        # ``__notes__`` (PEP 678), made when first asked for, which is when Python
        # prints an uncaught exception or traceback.format_exception formats it: the
        # remote traceback, which IPython shows through _render_traceback_, shown in a
        # plain script too. Kept in the instance, so add_note() adds to it.
        if name == "__notes__":
            auto = "\n".join(_ANSI.sub("", line) for line in self._render_traceback_())
            self.__dict__["_auto_note"] = auto
            notes = self.__dict__["__notes__"] = [auto, *self.__dict__.get("_added_notes", ())]
            return notes
        raise AttributeError(name)

    def format_exception_only(self) -> list[str]:
        """:func:`traceback.format_exception_only` of this error without the
        remote traceback among its notes (a rank that lets it through shows
        that traceback itself, after its own frames); notes added with
        ``add_note`` stay."""
        te = traceback.TracebackException(type(self), self, None)
        if sys.version_info >= (3, 11):  # (3.10 formats no notes)
            te.__notes__ = self._added_notes() or None  # (this error unchanged)
        return list(te.format_exception_only())

    def _added_notes(self) -> list[str]:
        """The notes added with ``add_note`` (here, or on the ranks it came through)."""
        d = self.__dict__
        notes = d["__notes__"] if "__notes__" in d else d.get("_added_notes", ())
        return [n for n in notes if n is not d.get("_auto_note")]

    def _render_traceback_(self) -> list[str]:
        """Lines IPython shows instead of the local traceback."""
        head = f"{ranks_label(self.ranks)}"
        if self.actor:
            head += f" (actor {self.actor})"
        lines = [f"\x1b[1;31m{head} raised {self.remote_type}\x1b[0m"]
        lines.extend(self.remote_traceback.rstrip("\n").splitlines()
                     or [f"{self.remote_type}: {self._remote_message()}"])
        for other in getattr(self, "others", ()):
            lines.append("")
            lines.extend(other._render_traceback_())
        return lines


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


class ActorError(RemoteError):
    """An exception raised inside an actor endpoint (see :class:`RemoteError`)."""


def ranks_label(ranks: list[int]) -> str:
    """How messages name ``ranks``: ``"rank 3"``, ``"ranks 0-3"``, ``"ranks 0, 2, 3"``,
    ``"remote"`` (none); each rank once, in order (see :func:`compact_ranks`)."""
    rs = sorted(set(ranks))
    if not rs:
        return "remote"
    if len(rs) == 1:
        return f"rank {rs[0]}"
    return "ranks " + compact_ranks(rs)


def compact_ranks(ranks: list[int]) -> str:
    """Ranks as people write them: ``[0, 1, 2, 3]`` -> ``"0-3"``; ``[0, 2, 3]`` ->
    ``"0, 2, 3"``; ``[0, 1, 2, 5, 7, 8, 9]`` -> ``"0-2, 5, 7-9"``.

    Runs of three or more consecutive ranks are written ``first-last`` (both
    included); each rank appears once, in increasing order. The one way ranks
    are written in every message (errors, output tags, the debugger, the
    dashboard).
    """
    out: list[str] = []
    rs = sorted(set(ranks))
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        if j - i >= 2:
            out.append(f"{rs[i]}-{rs[j]}")
        else:
            out.extend(str(r) for r in rs[i:j + 1])
        i = j + 1
    return ", ".join(out)


_subclass_cache: dict[tuple[type, type], type[RemoteError] | None] = {}
_subclass_lock = threading.Lock()


def _remote_subclass(base: type[RemoteError],
                     exc_type: type[BaseException]) -> type[RemoteError] | None:
    key = (base, exc_type)
    with _subclass_lock:
        if key in _subclass_cache:
            return _subclass_cache[key]
        cls: type[RemoteError] | None
        try:
            cls = cast("type[RemoteError]", type(
                exc_type.__name__,
                (base, exc_type),
                {"__module__": exc_type.__module__, "__str__": RemoteError.__str__,
                 "__reduce__": RemoteError.__reduce__,
                 "_monarch_base": base, "_monarch_original": exc_type},
            ))
        except TypeError:  # layout conflict (e.g. two C-level exception bases)
            cls = None
        _subclass_cache[key] = cls
        return cls


def _rebuild_remote(base: type[RemoteError], exc_type: type[BaseException] | None,
                    args: tuple, state: dict[str, Any]) -> RemoteError:
    """Unpickle a :class:`RemoteError` (see ``RemoteError.__reduce__``)."""
    cls = (_remote_subclass(base, exc_type) if exc_type is not None else None) or base
    err = cls.__new__(cls)
    err.args = args
    err.__dict__.update(state)
    return err


def original_type(exc: BaseException) -> type[BaseException] | None:
    """The type a remote error stands for, else ``type(exc)``; None for a plain
    :class:`RemoteError` (the original type was lost)."""
    if isinstance(exc, RemoteError):
        return getattr(type(exc), "_monarch_original", None)
    return type(exc)


class RemoteFailure:
    """One rank's failure as it arrives on the controller (not an exception).

    Attributes
    ----------
    rank : int
    exc : BaseException or None
        The original exception, unpickled; None if it could not be.
    type_name : str
    message : str
    traceback : str
    """

    def __init__(
        self,
        rank: int,
        exc: BaseException | None,
        type_name: str,
        message: str,
        traceback: str,
        actor: str | None = None,
    ) -> None:
        self.rank = rank
        self.exc = exc
        self.type_name = type_name
        self.message = message
        self.traceback = traceback
        self.actor = actor

    def key(self) -> tuple[str, str, str]:
        """What makes two failures "alike" (type, message, traceback)."""
        return (self.type_name, self.message, self.traceback)


_R = TypeVar("_R", bound=RemoteError)


@overload
def remote_exception(failures: list[RemoteFailure]) -> RemoteError: ...


@overload
def remote_exception(failures: list[RemoteFailure], base: type[_R]) -> _R: ...


def remote_exception(
    failures: list[RemoteFailure], base: type[RemoteError] = RemoteError
) -> RemoteError:
    """Build one exception for failures that are alike.

    The result is an instance of ``base`` and, when the original exception
    could be unpickled, of the original type too.

    Parameters
    ----------
    failures : list of RemoteFailure
        One or more failures with the same :meth:`RemoteFailure.key`.
    base : type
        :class:`RemoteError` or :class:`ActorError`.
    """
    first = failures[0]
    ranks = sorted(f.rank for f in failures)
    original = first.exc
    err: Any = None
    # an error that came through several ranks (an endpoint that let another rank's
    # error through) stands for the innermost original type
    exc_type = original_type(original) if original is not None else None
    if exc_type is not None and original is not None:  # (exc_type implies original)
        cls = _remote_subclass(base, exc_type)
        if cls is not None:
            err = cls.__new__(cls)
            err.args = original.args
            try:
                err.__dict__.update(getattr(original, "__dict__", {}))
            except (AttributeError, TypeError):
                pass
            err.__dict__.pop("others", None)  # (of the inner error's group)
            for k in ("__notes__", "_auto_note", "_added_notes"):  # (the rank's traceback
                err.__dict__.pop(k, None)  # shows its notes: made again from it here)
    if err is None:
        err = base.__new__(base)
        err.args = (first.message,)
    err._message = first.message
    err.ranks = ranks
    err.remote_type = first.type_name
    err.remote_traceback = first.traceback
    err.actor = first.actor
    return err


def group_failures(failures: list[RemoteFailure]) -> list[list[RemoteFailure]]:
    """Group failures that are alike, keeping rank order within groups."""
    groups: dict[tuple[str, str, str], list[RemoteFailure]] = {}
    for f in sorted(failures, key=lambda f: f.rank):
        groups.setdefault(f.key(), []).append(f)
    return list(groups.values())


class FailedRequest(Protocol):
    """What :func:`raise_request_failures` reads of a request
    (:class:`monarch_kernel.controller.request.Request` is one)."""

    failure: MeshFailure | None

    def failures(self, actor: str | None = None) -> list[RemoteFailure]: ...


def raise_request_failures(req: FailedRequest, actor: str | None = None) -> None:
    """Raise what went wrong with ``req``, if anything (``ProcMesh.collect``, an actor spawn).

    Raises
    ------
    MeshFailure
        ``req.failure`` (a rank died, the mesh stopped): the ranks interrupted because
        of it in its ``stopped`` (shown as one line: "ranks 0, 2, 3 were stopped
        because rank 1 died"), the ranks that raised something else in its ``others``.
    RemoteError
        (:class:`ActorError` when ``actor`` is given) for the ranks that raised; an
        instance of the original exception type as well, other groups of ranks that
        raised alike in its ``others``.
    """
    failures = req.failures(actor)
    if req.failure is not None:
        failure = req.failure
        # ranks interrupted because of the failure (ProcMesh.collect stops the survivors)
        # are named in one line; what other ranks raised is shown with the failure
        stopped = [f.rank for f in failures if f.type_name.rsplit(".", 1)[-1]
                   == "KeyboardInterrupt" and f.rank != failure.rank]
        failures = [f for f in failures if f.rank not in stopped]
        if stopped and not failure.stopped:
            failure.stopped = sorted(stopped)
            if sys.version_info >= (3, 11):  # (a script shows it under the failure)
                failure.add_note(failure.stopped_text())
        if failures:  # ranks that failed too (often because of the dead one)
            failure.others = [remote_exception(g) for g in group_failures(failures)]
        raise failure
    if failures:
        base = ActorError if actor else RemoteError
        groups = group_failures(failures)
        if len(groups) == 1:
            raise remote_exception(groups[0], base)
        err = remote_exception(groups[0], base)
        err.others = [remote_exception(g, base) for g in groups[1:]]
        raise err
