"""Source lines of code shipped by value, for remote tracebacks.

Classes and functions defined in a notebook cell or in a ``__main__``
script travel by value (cloudpickle), and :mod:`monarch_kernel.wire.serialize`
keeps their code objects' real file names. The workers have no such files
(an IPython cell lives only in the kernel's :mod:`linecache`), so the
controller sends the lines along and the worker registers them in its own
:mod:`linecache`: tracebacks formatted there then show the cell's lines.
"""

from __future__ import annotations

import linecache
import os
import sys
import types
import weakref
from typing import Any

__all__ = ["by_value", "has_code", "sources_for"]

_MAX_SOURCE = 2 * 1024 * 1024  # bytes of source shipped per file, at most


def has_code(args: tuple, kwargs: dict) -> bool:
    """True if an argument is a function or a class (it may be shipped by value)."""
    return any(isinstance(a, (types.FunctionType, type)) for a in args) or any(
        isinstance(a, (types.FunctionType, type)) for a in kwargs.values())


def by_value(module: str | None) -> bool:
    """True if objects of ``module`` are pickled by value (``__main__``, no file)."""
    if module in (None, "__main__"):
        return True
    mod = sys.modules.get(module)
    return mod is None or getattr(mod, "__file__", None) is None


_source_cache: weakref.WeakKeyDictionary[Any, dict[str, list[str]]] = (
    weakref.WeakKeyDictionary())


def sources_for(objs: list[Any]) -> dict[str, list[str]]:
    """Source lines (from linecache) of the files where code shipped by value was
    defined: notebook cells, ``__main__`` scripts. Remote tracebacks show them."""
    files: set[str] = set()
    seen: set[int] = set()

    def code_files(co: types.CodeType) -> None:
        files.add(co.co_filename)
        for c in co.co_consts:
            if isinstance(c, types.CodeType):
                code_files(c)

    def walk(obj: Any, depth: int) -> None:
        if id(obj) in seen or depth > 6:
            return
        seen.add(id(obj))
        if isinstance(obj, (staticmethod, classmethod)):
            walk(obj.__func__, depth)
        elif isinstance(obj, property):
            for f in (obj.fget, obj.fset, obj.fdel):
                if f is not None:
                    walk(f, depth)
        elif isinstance(obj, type):
            if not by_value(obj.__module__):
                return
            for v in vars(obj).values():
                walk(v, depth + 1)
            for b in obj.__bases__:
                walk(b, depth + 1)
        elif isinstance(obj, types.FunctionType):
            if not by_value(obj.__module__):
                return
            code_files(obj.__code__)
            g = obj.__globals__
            for n in obj.__code__.co_names:
                v = g.get(n)
                if isinstance(v, (types.FunctionType, type)):
                    walk(v, depth + 1)

    out: dict[str, list[str]] = {}
    for obj in objs:
        try:
            cached = _source_cache.get(obj) if isinstance(obj, type) else None
        except TypeError:
            cached = None
        if cached is not None:
            out.update(cached)
            continue
        files.clear()
        walk(obj, 0)
        found = {}
        for f in files:
            lines = linecache.getlines(f)
            if lines and sum(map(len, lines)) <= _MAX_SOURCE and (
                    not os.path.isabs(f) or not f.startswith(sys.prefix)):
                found[f] = lines
        if isinstance(obj, type):
            try:
                _source_cache[obj] = found
            except TypeError:
                pass
        out.update(found)
    return out
