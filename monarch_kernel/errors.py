"""The monarch_kernel error tree.

Every failure the controller can report is one of these; lower-layer errors
(ZeroMQ, pickling, the operating system) are mapped to them with
``raise ... from`` so the original cause stays attached. The tree follows the
style of httpx's ``_exceptions.py``::

    MonarchError
    ├── ProtocolError          a frame that is not a valid, signed message
    ├── TransportError         a socket could not bind, connect or send
    ├── MeshError              the mesh cannot do what was asked
    │   ├── NoMeshError        no mesh has been spawned yet (or none of that name)
    │   ├── MeshBusyError      a named mesh is attached to another live controller
    │   ├── RankSpecError      a ``--ranks`` spec names no valid rank
    │   └── MeshFailure        a rank died, stopped, or stopped answering
    ├── SerializationError     a value could not be pickled or unpickled
    ├── RemoteError            an exception raised on a rank
    │   └── ActorError         an exception raised in an actor endpoint
    └── CollectiveAborted      a torch.distributed call waited for a rank that quit
                               its debugger, and was aborted (also a RuntimeError)

Each public class is exported at the top of the package and names itself so
(``__module__`` is ``"monarch_kernel"``): messages and tracebacks read
``monarch_kernel.SerializationError``, never an internal module path.

``RemoteError`` instances built by :func:`remote_exception` are also instances
of the original exception's type, so ``except ZeroDivisionError`` works on the
controller (the idea comes from ipyparallel's ``RemoteError`` and
``CompositeError``; here the type itself is kept as well). A rank sends an
exception as a description that always unpickles
(:mod:`monarch_kernel.wire.exctree`); it is rebuilt here with its cause,
context and group members, each a remote error of its own with the rank's
traceback. Where the original type cannot be had or instantiated here, a
plain :class:`RemoteError` stands for it (``remote_type`` names it; a group's
members are then in its ``exceptions``).
"""

from __future__ import annotations

import re
import sys
import threading
import traceback
from typing import Any, Protocol, TypeVar, cast, overload

__all__ = [
    "ActorError",
    "CollectiveAborted",
    "MeshBusyError",
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
    "restart_hint",
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


class MeshBusyError(MeshError):
    """A named mesh is attached to another controller that is alive: attach with
    ``steal=True`` (``%mesh attach NAME --steal``) to take it over.

    Attributes
    ----------
    holder_pid : int or None
        The pid of the controller that holds the mesh.
    holder_host : str or None
        The host that controller runs on.
    """

    holder_pid: int | None = None
    holder_host: str | None = None


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

    Attributes
    ----------
    endpoint : str or None
        For an endpoint call that failed because a rank died: ``"actor.method"``.
    partial : ValueMesh or None
        For such a call to every actor of a mesh: the values of the ranks that
        answered, :data:`~monarch_kernel.mesh.shape.MISSING` for the others.
    cancelled : list of int
        For such a call: the ranks that had not answered when it failed (the
        call stopped waiting for them).
    others : list of BaseException
        What other ranks raised meanwhile.
    stopped : list of int
        Other ranks of the same cell or call that were stopped because of this
        failure (interrupted, or killed when they did not stop).
    killed : list of int
        Ranks of the same cell that the mesh killed (SIGTERM, then SIGKILL)
        because they did not stop when interrupted: they were running C code or
        ignored SIGINT. May include :attr:`rank` (an interrupt or a timeout that
        had to kill it). They are dead: :attr:`restart` says how to replace them.
    restart : str
        How to replace the dead ranks of the mesh (``"%mesh restart 0,2  (or
        mesh.restart('0,2'))"``), or ``""``.
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
        self.endpoint: str | None = None
        self.partial: Any = None
        self.cancelled: list[int] = []
        #: ranks of the same call that were interrupted because of this failure
        self.stopped: list[int] = []
        #: ranks of the same call that the mesh killed because they did not stop
        self.killed: list[int] = []
        #: how to replace the dead ranks (``%mesh restart ...``), or ""
        self.restart = ""
        self._noted = False  # (stopped_text added as a note once)

    def stopped_text(self) -> str:
        """What happened to the other ranks of the call, in one line each:
        ``"ranks 0, 2, 3 were stopped because rank 1 died"``; ``"ranks 0, 2 did
        not stop after rank 1 died and were killed (...); restart ..."``; or ``""``."""
        out = []
        by_interrupt = self.rank is not None and self.rank in self.killed
        cause = ("the interrupt" if by_interrupt else
                 f"{ranks_label([self.rank])} died" if self.rank is not None
                 else "the mesh failed")
        stopped = sorted(set(self.stopped) - set(self.killed))
        if stopped:
            were = "was" if len(stopped) == 1 else "were"
            out.append(f"{ranks_label(stopped)} {were} stopped "
                       f"{'by' if by_interrupt else 'because'} {cause}")
        if self.killed:
            were = "was" if len(set(self.killed)) == 1 else "were"
            they = "it was" if len(set(self.killed)) == 1 else "they were"
            if by_interrupt:
                line = f"{ranks_label(self.killed)} ignored the interrupt and {were} killed"
            else:
                line = (f"{ranks_label(self.killed)} did not stop after {cause} and {were} "
                        f"killed ({they} running C code or ignored the interrupt)")
            if self.restart:
                line += f"; restart with  {self.restart}"
            out.append(line)
        return "\n".join(out)

    def _render_traceback_(self) -> list[str]:
        """What IPython shows: the failure, the ranks stopped because of it, then
        what other ranks raised."""
        lines = [f"\x1b[1;31mMeshFailure\x1b[0m: {self}"]
        if self.stopped or self.killed:
            lines.extend(self.stopped_text().split("\n"))
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
    IPython shows ``SpawnInterrupted: `` and that line instead of a traceback
    through the spawn's waits.
    """

    def _render_traceback_(self) -> list[str]:
        return [f"\x1b[1;31mSpawnInterrupted\x1b[0m: {self}"]


class SerializationError(MonarchError):
    """A value could not be pickled (to send) or unpickled (on arrival).

    One made with ``brief=True`` (a value the user sent that cannot be pickled:
    the message names the variable and the part that fails) is shown in IPython
    as its message alone, without the frames of this package it went through.
    """

    def __init__(self, *args: Any, brief: bool = False) -> None:
        super().__init__(*args)
        if brief:
            self.brief = True

    @property
    def _render_traceback_(self) -> Any:  # (an attribute only where brief: see hasattr)
        if not self.__dict__.get("brief"):
            raise AttributeError("_render_traceback_")
        return lambda: [f"\x1b[1;31m{type(self).__name__}\x1b[0m: {self}"]


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
        if getattr(type(self), "_names_ranks", False):  # (CollectiveAborted)
            return base
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
        if name == "__notes__" and self.__dict__.get("_nested"):
            # a member or cause of another remote error: that one's note shows it
            notes = self.__dict__["__notes__"] = list(self.__dict__.get("_added_notes", ()))
            return notes
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


class CollectiveAborted(MonarchError, RuntimeError):
    """A ``torch.distributed`` call on a rank waited for a rank that quit its
    debugger, and was aborted (it could never have finished).

    Its message names both the ranks that quit and the ranks whose calls were
    aborted, so a remote error of this type is shown without a second rank
    list in front of it. A ``RuntimeError``, as the aborted call's own error was.
    """

    #: the message names the ranks itself (see RemoteError.__str__)
    _names_ranks = True


# the public classes name the package, where users import them from (exported there)
for _cls in (MonarchError, ProtocolError, TransportError, MeshError, NoMeshError,
             MeshBusyError, RankSpecError, MeshFailure, SpawnInterrupted, SerializationError,
             RemoteError, ActorError, CollectiveAborted):
    _cls.__module__ = "monarch_kernel"
del _cls


def ranks_label(ranks: list[int]) -> str:
    """How messages name ``ranks``: ``"rank 3"``, ``"ranks 0-3"``, ``"ranks 0, 2, 3"``,
    ``"remote"`` (none); each rank once, in order (see :func:`compact_ranks`)."""
    rs = sorted(set(ranks))
    if not rs:
        return "remote"
    if len(rs) == 1:
        return f"rank {rs[0]}"
    return "ranks " + compact_ranks(rs)


def restart_hint(dead: list[int], world_size: int) -> str:
    """How to replace ranks ``dead`` of a mesh of ``world_size`` ranks, in a rank
    spec that ``%mesh restart`` and ``ProcMesh.restart`` accept: ``"%mesh restart 1
    (or mesh.restart(1))"``, ``"%mesh restart 0,2  (or mesh.restart('0,2'))"``,
    ``"%mesh restart all  (or mesh.restart())"`` when every rank is dead; ``""``
    for none."""
    rs = sorted(set(dead))
    if not rs:
        return ""
    if len(rs) >= world_size and rs == list(range(world_size)):
        return "%mesh restart all  (or mesh.restart())"
    if len(rs) == 1:
        return f"%mesh restart {rs[0]}  (or mesh.restart({rs[0]}))"
    spec = ",".join(str(r) for r in rs)
    return f"%mesh restart {spec}  (or mesh.restart({spec!r}))"


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


class _RemoteClass(type):
    """The metaclass of the classes :func:`remote_exception` makes: such a class has
    the original's name (``except`` clauses, IPython's ``ename`` and tracebacks
    read as on the rank) and says in its repr that it stands for the remote one,
    e.g. ``<remote class 'shards.ShardCorrupt'>``, so that its ``__mro__``
    (``remote ShardCorrupt, RemoteError, MonarchError, ShardCorrupt, ...``) does
    not seem to name one class twice."""

    def __repr__(cls) -> str:
        mod = cls.__module__
        name = cls.__qualname__ if mod in ("builtins", "__main__") else \
            f"{mod}.{cls.__qualname__}"
        return f"<remote class {name!r}>"


def _remote_subclass(base: type[RemoteError],
                     exc_type: type[BaseException]) -> type[RemoteError] | None:
    key = (base, exc_type)
    with _subclass_lock:
        if key in _subclass_cache:
            return _subclass_cache[key]
        cls: type[RemoteError] | None = None
        ns = {"__module__": exc_type.__module__, "__qualname__": exc_type.__qualname__,
              "__str__": RemoteError.__str__, "__reduce__": RemoteError.__reduce__,
              "_monarch_base": base, "_monarch_original": exc_type}
        # (plain type where the original has a metaclass of its own)
        for meta in (_RemoteClass, type):
            try:
                cls = cast("type[RemoteError]", meta(exc_type.__name__, (base, exc_type),
                                                     dict(ns)))
                break
            except TypeError:  # layout conflict (e.g. two C-level exception bases)
                cls = None
        _subclass_cache[key] = cls
        return cls


def _rebuild_remote(base: type[RemoteError], exc_type: type[BaseException] | None,
                    args: tuple, state: dict[str, Any]) -> RemoteError:
    """Unpickle a :class:`RemoteError` (see ``RemoteError.__reduce__``)."""
    cls = (_remote_subclass(base, exc_type) if exc_type is not None else None) or base
    err = _instantiate(cls, args)
    if err is None:
        err = base.__new__(base)
        err.args = args
    err.__dict__.update(state)
    return err


def _instantiate(cls: type[RemoteError], args: tuple) -> RemoteError | None:
    """An instance of ``cls`` with ``args``, without calling ``__init__`` (which
    may want other arguments); None if neither ``__new__`` accepts them.

    Each ``__new__`` of the classes of ``cls.__mro__`` is tried in turn (a group's
    keeps its members, an ``OSError``'s reads ``errno``): C's refuses the ones of
    other layouts (``MemoryError.__new__`` of a class whose first base is not a
    ``MemoryError``, ``Exception.__new__`` of a group), and one of them fits."""
    news: list[Any] = []
    for c in cls.__mro__:
        if "__new__" in vars(c) and c.__new__ not in news:
            news.append(c.__new__)
    for new in news:
        try:
            err = new(cls, *args)
        except Exception:  # noqa: BLE001, S112 - try the next way
            continue
        if isinstance(err, cls):
            try:
                if err.args != tuple(args) and not hasattr(err, "exceptions"):
                    err.args = tuple(args)
            except Exception:  # noqa: BLE001, S110 - the args __new__ kept stay
                pass
            return err
    return None


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
    actor : str or None
        The actor whose endpoint raised it.
    tree : dict or None
        The exception's description (:mod:`monarch_kernel.wire.exctree`), from
        which :func:`remote_exception` rebuilds it with its cause, context and
        group members; None for failures made without one (then ``exc`` is used).
    """

    def __init__(
        self,
        rank: int,
        exc: BaseException | None,
        type_name: str,
        message: str,
        traceback: str,
        actor: str | None = None,
        tree: Any = None,
    ) -> None:
        self.rank = rank
        self.exc = exc
        self.type_name = type_name
        self.message = message
        self.traceback = traceback
        self.actor = actor
        self.tree = tree

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

    The result is an instance of ``base`` and, when the original type can be
    had here (unpickled, or already imported), of the original type too; built
    from the first failure's description (``tree``) when it has one, with its
    ``__cause__``, ``__context__`` and, for a group, its members.

    Parameters
    ----------
    failures : list of RemoteFailure
        One or more failures with the same :meth:`RemoteFailure.key`.
    base : type
        :class:`RemoteError` or :class:`ActorError`.
    """
    first = failures[0]
    ranks = sorted(f.rank for f in failures)
    err: Any = None
    if isinstance(first.tree, dict):
        try:
            err = _from_tree(first.tree, base, ranks, first.actor, [_MAX_REBUILT])
        except Exception:  # noqa: BLE001 - a malformed description: the text still tells
            err = None
        if err is not None:
            err.__dict__.pop("_nested", None)
    original = first.exc if err is None else None
    # an error that came through several ranks (an endpoint that let another rank's
    # error through) stands for the innermost original type
    exc_type = original_type(original) if original is not None else None
    if exc_type is not None and original is not None:  # (exc_type implies original)
        cls = _remote_subclass(base, exc_type)
        if cls is not None:
            err = _instantiate(cls, _ctor_args(original))
            if err is not None:
                _copy_state(err, getattr(original, "__dict__", {}))
    if err is None:
        err = base.__new__(base)
        err.args = (first.message,)
    err._message = first.message
    err.ranks = ranks
    err.remote_type = first.type_name
    err.remote_traceback = first.traceback
    err.actor = first.actor
    return err


#: the most exceptions rebuilt from one description
_MAX_REBUILT = 256
_NOTHING = object()


def _copy_state(err: BaseException, state: Any) -> None:
    """Copy an original exception's ``__dict__`` into ``err``, less what belongs to
    the error it came through (its group, its notes: made again from the rank's text)."""
    try:
        err.__dict__.update(state)
    except (AttributeError, TypeError, ValueError):
        return
    err.__dict__.pop("others", None)  # (of the inner error's group)
    for k in ("__notes__", "_auto_note", "_added_notes", "_nested"):  # (the rank's traceback
        err.__dict__.pop(k, None)  # shows its notes: made again from it here)


def _ctor_args(exc: BaseException) -> tuple:
    """The arguments ``exc`` is rebuilt from: those of its ``__reduce__`` when that
    calls its type (an ``OSError``'s adds the file name), else its ``args``."""
    try:
        r = exc.__reduce__()
        if isinstance(r, tuple) and len(r) >= 2 and r[0] is type(exc) and isinstance(r[1],
                                                                                   tuple):
            return r[1]
    except Exception:  # noqa: BLE001, S110 - its args, then
        pass
    return tuple(exc.args)


def _open(blob: Any) -> Any:
    """What a pickled part of a description holds, or ``_NOTHING``."""
    if blob is None:
        return _NOTHING
    try:
        return blob.unpack()
    except BaseException:  # noqa: BLE001 - any unpickling failure: that part is lost
        return _NOTHING


def _find_type(module: Any, qualname: Any) -> type[BaseException] | None:
    """The exception type ``module.qualname`` when that module is imported here
    already (nothing is imported on behalf of a rank)."""
    obj: Any = sys.modules.get(module) if isinstance(module, str) else None
    for part in qualname.split(".") if isinstance(qualname, str) and obj is not None else ():
        obj = getattr(obj, part, None)
    return obj if isinstance(obj, type) and issubclass(obj, BaseException) else None


def _from_tree(node: dict[str, Any], base: type[RemoteError], ranks: list[int],
               actor: str | None, budget: list[int]) -> RemoteError:
    """Rebuild one described exception (see :mod:`monarch_kernel.wire.exctree`):
    an instance of ``base`` and, where the type can be had here and instantiated,
    of the original type; its cause, context and group members rebuilt alike."""
    budget[0] -= 1
    message = str(node.get("message", ""))

    def sub(n: Any) -> RemoteError | None:
        if not isinstance(n, dict) or budget[0] <= 0:
            return None
        return _from_tree(n, base, ranks, actor, budget)

    children: list[RemoteError] | None = None
    if node.get("children") is not None:
        children = [c for c in map(sub, node["children"]) if c is not None]
    original = _NOTHING if children is not None else _open(node.get("exc"))
    exc_type: Any
    if isinstance(original, BaseException):
        exc_type = original_type(original)
        args: tuple = _ctor_args(original)
        state: Any = getattr(original, "__dict__", {})
    else:
        exc_type = _open(node.get("cls"))
        if not (isinstance(exc_type, type) and issubclass(exc_type, BaseException)):
            exc_type = _find_type(node.get("module"), node.get("qualname"))
        a = _open(node.get("args"))
        args = tuple(a) if isinstance(a, tuple) else (message,)
        s = _open(node.get("state"))
        state = s if isinstance(s, dict) else {}
    err: Any = None
    cls = _remote_subclass(base, exc_type) if exc_type is not None else None
    if cls is not None:
        if children is None:
            err = _instantiate(cls, args)
        elif children:  # (a group needs members)
            err = _instantiate(cls, (args[0] if args else message, children))
    if err is None:  # the type cannot be had or made here: a RemoteError that names it
        err = base.__new__(base)
        err.args = (message,)
        if children is not None:
            err.exceptions = tuple(children)
    _copy_state(err, state)
    err._message = message
    err.ranks = ranks
    err.remote_type = str(node.get("type", "")) or getattr(exc_type, "__name__", "?")
    err.remote_traceback = str(node.get("traceback", ""))
    err.actor = actor
    err._nested = True
    cause = sub(node.get("cause"))
    if cause is not None:
        err.__cause__ = cause
    context = sub(node.get("context"))
    if context is not None:
        err.__context__ = context
    err.__suppress_context__ = bool(node.get("suppress_context")) or cause is not None
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
        stopped = sorted(set(stopped) | (set(failure.killed) - {failure.rank}))
        if (stopped or failure.killed) and not getattr(failure, "_noted", False):
            failure.stopped = stopped
            failure._noted = True
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
