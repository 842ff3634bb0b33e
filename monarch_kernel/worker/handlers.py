"""The worker's handler registry: message type -> the code that handles it.

The worker core handles only its own messages (``heartbeat``,
``interrupt``, ``shm_done``, ``execute``, ``push``, ``pull``, ``stop``).
Features plug in from above: the rank-side half of each one (actors,
tensor handles, the remote debugger, torch.distributed set-up) registers
its handlers when its module is imported, and the worker process's
composition root (:mod:`monarch_kernel.plugins`) imports them before the
worker serves.

Each handler says which thread runs it:

``Thread.IO``
    The thread that leads the worker's I/O, as soon as the message is
    read (:class:`IOHandler`). It must not block: it hands work to another
    thread (an actor's queue, a paused debugger's inbox) or does a short
    bookkeeping step. Exceptions are logged and the message is dropped.
``Thread.MAIN``
    The worker's main thread, one request at a time in arrival order
    (:class:`RequestHandler`). It may run user code for as long as it
    likes; its return value (or the exception it raises) is the reply.

A message type nobody registered goes to the main thread, which answers it
with ``ValueError("unknown request type ...")``.

Besides handlers, a feature may register a *start hook* (run with the
worker once, before it serves its first request). File descriptors a
feature wants the worker's leading thread to watch (actors' peer lanes) are
shared through the worker's I/O itself (``WorkerIO.share``), not here.
"""

from __future__ import annotations

import enum
import importlib
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from monarch_kernel.wire.protocol import Message
    from monarch_kernel.worker.worker import Worker

__all__ = [
    "Handler",
    "IOHandler",
    "RequestHandler",
    "StartHook",
    "Thread",
    "lookup",
    "register_deferred",
    "register_io",
    "register_request",
    "register_start",
    "run_start_hooks",
]


class Thread(enum.Enum):
    """Which worker thread runs a handler."""

    IO = "io"  #: the thread that leads the I/O; must not block
    MAIN = "main"  #: the main thread, one request at a time; its result is the reply


class IOHandler(Protocol):
    """Handles a message on the thread that leads the I/O (never blocks)."""

    def __call__(self, worker: Worker, msg: Message, /) -> None: ...


class RequestHandler(Protocol):
    """Handles a request's ``content`` on the main thread; returns the reply's value.

    An exception it raises becomes an error reply."""

    def __call__(self, worker: Worker, content: Any, /) -> Any: ...


class StartHook(Protocol):
    """Called once with the worker of this process, before it serves."""

    def __call__(self, worker: Worker, /) -> None: ...


@dataclass(frozen=True)
class Handler:
    """One registered handler.

    Attributes
    ----------
    type : str
        The message type it handles.
    thread : Thread
        Which thread runs it.
    fn : IOHandler or RequestHandler
        ``fn(worker, msg)`` for ``Thread.IO``, ``fn(worker, content)`` for ``Thread.MAIN``.
    """

    type: str
    thread: Thread
    fn: Callable[..., Any]


_lock = threading.Lock()
_handlers: dict[str, Handler] = {}
_start_hooks: list[StartHook] = []
#: message type -> the modules (by name) that register its handler, loaded on first use
_deferred: dict[str, tuple[str, ...]] = {}
_load_lock = threading.Lock()


def _name(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def _register(handler: Handler) -> None:
    with _lock:
        old = _handlers.get(handler.type)
        if old is not None and _name(old.fn) != _name(handler.fn):
            raise ValueError(f"a handler of {handler.type!r} messages is registered already "
                             f"({_name(old.fn)})")
        _handlers[handler.type] = handler


def register_io(type: str, fn: IOHandler) -> None:
    """Handle ``type`` messages with ``fn(worker, msg)`` on the thread that leads the I/O.

    Raises
    ------
    ValueError
        If another function handles ``type`` already (the same function
        again, e.g. from a reloaded module, replaces it).
    """
    _register(Handler(type, Thread.IO, fn))


def register_request(type: str, fn: RequestHandler) -> None:
    """Handle ``type`` requests with ``fn(worker, content)`` on the main thread.

    Raises
    ------
    ValueError
        If another function handles ``type`` already (the same function
        again, e.g. from a reloaded module, replaces it).
    """
    _register(Handler(type, Thread.MAIN, fn))


def register_deferred(types: Iterable[str], modules: Iterable[str]) -> None:
    """Load ``modules`` (importable names) when the first message of one of
    ``types`` arrives; importing them registers the handlers.

    This is how a worker process's composition root (:mod:`monarch_kernel.plugins`)
    plugs features in without the worker paying for their imports at start: a
    mesh that never runs an actor never imports the actor layer. The worker core
    itself names no feature.
    """
    mods = tuple(modules)
    with _lock:
        for t in types:
            _deferred[t] = mods


def _load_deferred(type: str) -> None:
    with _load_lock:  # (one thread imports; the others then find the handler)
        mods = _deferred.get(type)
        if mods is None:
            return
        for name in mods:
            importlib.import_module(name)
        with _lock:
            for t in [t for t, m in _deferred.items() if m == mods]:
                del _deferred[t]


def lookup(type: str) -> Handler | None:
    """The handler of ``type`` messages, or None (any thread). A type registered
    with :func:`register_deferred` loads its modules on the first lookup.

    Raises
    ------
    ImportError
        If a deferred module cannot be imported (a broken installation).
    """
    handler = _handlers.get(type)
    if handler is None and type in _deferred:
        _load_deferred(type)
        handler = _handlers.get(type)
    return handler


def register_start(hook: StartHook) -> None:
    """Run ``hook(worker)`` once when a worker process starts, before it serves
    (hooks run in registration order; registering one twice runs it once)."""
    with _lock:
        if hook not in _start_hooks:
            _start_hooks.append(hook)


def run_start_hooks(worker: Worker) -> None:
    """Run the start hooks with ``worker`` (the worker's main, once)."""
    with _lock:
        hooks = list(_start_hooks)
    for hook in hooks:
        hook(worker)
