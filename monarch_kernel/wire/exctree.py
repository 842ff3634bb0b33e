"""Exceptions as they cross the wire: a description that always unpickles.

An exception raised on a rank does not always survive pickle: ``MemoryError``
and exception groups cannot be rebuilt by the generic route, a class whose
``__init__`` takes required arguments fails when unpickled (pickle calls it
with ``args``), a class defined only on the rank cannot be found by name
elsewhere. So a rank sends a *description* of the exception instead
(:func:`describe`): a tree of plain dicts, strings and lists, with the
parts that need pickle (the exception itself, its class, its ``args``, its
``__dict__``) each in a :class:`~monarch_kernel.wire.serialize.Packed` of its
own, kept only when it was shown to unpickle again on the rank. Receiving it
never fails; :func:`monarch_kernel.errors.remote_exception` rebuilds the best
exception it can from it (the original type where it can be rebuilt, a
:class:`~monarch_kernel.errors.RemoteError` naming the original type where it
cannot).

A node (:class:`ExcNode`) holds:

``type``        the type's name as messages show it (``MemoryError``, ``mod.Cls``)
``module``, ``qualname``  the type's ``__module__`` and ``__qualname__``
``message``     ``str(exc)``
``traceback``   the text of the exception as the rank formats it: its frames, its
                ``__cause__``/``__context__`` chain and, for a group, its members
``exc``         the whole exception pickled (not for groups), or None
``cls``, ``args``, ``state``  its class, ``args`` and ``__dict__``, each pickled,
                or None (sent when ``exc`` does not round-trip, and for groups)
``cause``, ``context``  nodes, or None; ``suppress_context``: bool
``children``    for an exception group: the nodes of its members, else None

A tree holds at most :data:`MAX_NODES` nodes and is at most :data:`MAX_DEPTH`
deep; a pickled part larger than :data:`MAX_BLOB` bytes is left out; each
``traceback`` is cut to :data:`MAX_TEXT` characters.
"""

from __future__ import annotations

import builtins
from collections.abc import Callable
from typing import Any, TypedDict

from monarch_kernel.wire.serialize import Packed

__all__ = ["MAX_BLOB", "MAX_DEPTH", "MAX_NODES", "MAX_TEXT", "ExcNode", "describe",
           "format_chain", "type_name"]

#: the most nodes (exceptions) one description holds
MAX_NODES = 64
#: the deepest nesting of causes, contexts and group members described
MAX_DEPTH = 16
#: a pickled part larger than this (bytes) is left out
MAX_BLOB = 1 << 20
#: each node's traceback text is cut to this many characters
MAX_TEXT = 64 * 1024

_GROUP: type | None = getattr(builtins, "BaseExceptionGroup", None)
_CAUSE = "\nThe above exception was the direct cause of the following exception:\n\n"
_CONTEXT = "\nDuring handling of the above exception, another exception occurred:\n\n"


class ExcNode(TypedDict):
    """One exception of a description tree (see the module docstring)."""

    type: str
    module: str
    qualname: str
    message: str
    traceback: str
    exc: Packed | None
    cls: Packed | None
    args: Packed | None
    state: Packed | None
    cause: ExcNode | None
    context: ExcNode | None
    suppress_context: bool
    children: list[ExcNode] | None


def type_name(t: type) -> str:
    """How messages name a type: ``MemoryError`` (builtins and ``__main__``), else
    ``module.Qualname``."""
    mod = getattr(t, "__module__", "") or ""
    qual = getattr(t, "__qualname__", t.__name__)
    return qual if mod in ("builtins", "__main__") else f"{mod}.{qual}"


def _is_group(e: BaseException) -> bool:
    """``e`` is an exception group (the built-in one, or the backport's on 3.10)."""
    if _GROUP is not None and isinstance(e, _GROUP):
        return True
    excs = getattr(e, "exceptions", None)
    return (type(e).__name__.endswith("ExceptionGroup") and isinstance(excs, tuple)
            and all(isinstance(x, BaseException) for x in excs))


def _safe_str(e: BaseException) -> str:
    try:
        return str(e)
    except Exception as x:  # noqa: BLE001 - a broken __str__ must not lose the failure
        return f"<str() of the exception failed: {type(x).__name__}: {x}>"


def _round_trip(value: Any) -> Packed | None:
    """``value`` pickled, if it unpickles again here and is not too large."""
    try:
        p = Packed.pack(value)
        if len(p.payload) + sum(memoryview(b).nbytes for b in p.buffers) > MAX_BLOB:
            return None
        Packed(p.payload, p.buffers).unpack()
        return p
    except BaseException:  # noqa: BLE001 - anything may fail in a user's __reduce__
        return None


def _children(e: BaseException) -> tuple[BaseException, ...]:
    excs = getattr(e, "exceptions", ())
    return tuple(x for x in excs if isinstance(x, BaseException))


def format_chain(e: BaseException, own_text: Callable[[BaseException], str],
                 _seen: set[int] | None = None, _depth: int = 0) -> str:
    """The text of ``e`` with its cause or context chain and, for a group, its
    members (indented, numbered as Python numbers them); ``own_text(x)`` formats one
    exception alone (its frames and its ``Type: message`` line)."""
    seen = _seen if _seen is not None else set()
    seen.add(id(e))
    parts: list[str] = []
    if _depth < MAX_DEPTH:
        cause, ctx = e.__cause__, e.__context__
        if cause is not None and id(cause) not in seen:
            parts += [format_chain(cause, own_text, seen, _depth + 1), _CAUSE]
        elif ctx is not None and not e.__suppress_context__ and id(ctx) not in seen:
            parts += [format_chain(ctx, own_text, seen, _depth + 1), _CONTEXT]
    parts.append(own_text(e))
    if _is_group(e) and _depth < MAX_DEPTH:
        for i, x in enumerate(_children(e), 1):
            sub = format_chain(x, own_text, seen, _depth + 1)
            parts.append(f"+---------------- {i} ----------------\n")
            parts.append("".join(f"| {ln}" if ln.strip() else "|\n"
                                 for ln in sub.splitlines(True)))
            if not parts[-1].endswith("\n"):
                parts.append("\n")
    return "".join(parts)


def describe(e: BaseException, own_text: Callable[[BaseException], str] | None = None
             ) -> ExcNode:
    """A description of ``e`` that unpickles anywhere (see the module docstring).

    Parameters
    ----------
    e : BaseException
    own_text : callable, optional
        ``own_text(x) -> str``: one exception's text (frames and ``Type: message``);
        without it, tracebacks are left empty.

    Never raises (a part that cannot be described is left out).
    """
    budget = [MAX_NODES]
    return _describe(e, own_text, set(), 0, budget)


def _describe(e: BaseException, own_text: Callable[[BaseException], str] | None,
              seen: set[int], depth: int, budget: list[int]) -> ExcNode:
    budget[0] -= 1
    seen.add(id(e))
    t = type(e)
    group = _is_group(e)
    text = ""
    if own_text is not None:
        try:
            text = format_chain(e, own_text, set(seen) - {id(e)})
        except Exception as fail:  # noqa: BLE001 - the text is a courtesy
            text = f"<the traceback could not be formatted: {type(fail).__name__}: {fail}>\n"
        if len(text) > MAX_TEXT:
            text = text[:MAX_TEXT // 2] + "\n[... cut ...]\n" + text[-MAX_TEXT // 2:]
    whole = None if group else _round_trip(e)
    cls = args = state = None
    if whole is None:
        cls = _round_trip(t)
        a: Any = (getattr(e, "message", _safe_str(e)),) if group else e.args
        args = _round_trip(tuple(a))
        d = {k: v for k, v in getattr(e, "__dict__", {}).items()
             if k not in ("__notes__", "_auto_note")}
        state = _round_trip(d) if d else None

    def sub(x: BaseException | None) -> ExcNode | None:
        if x is None or id(x) in seen or depth >= MAX_DEPTH or budget[0] <= 0:
            return None
        return _describe(x, own_text, seen, depth + 1, budget)

    cause = sub(e.__cause__)
    context = None if e.__suppress_context__ else sub(e.__context__)
    children = None
    if group:
        children = []
        for x in _children(e):
            node = sub(x)
            if node is None:
                break
            children.append(node)
    return ExcNode(
        type=type_name(t), module=getattr(t, "__module__", "") or "",
        qualname=getattr(t, "__qualname__", t.__name__), message=_safe_str(e),
        traceback=text, exc=whole, cls=cls, args=args, state=state, cause=cause,
        context=context, suppress_context=bool(e.__suppress_context__), children=children,
    )
