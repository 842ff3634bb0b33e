"""Where handles to values kept on the ranks plug into actor calls.

Handles (:class:`monarch_kernel.tensors.handles.Ref`) live a layer above the
actors; the two places where an actor call deals with them are filled in from
there, when :mod:`monarch_kernel.tensors` is imported:

* the sender counts the handles pickled into a call's arguments: a handle
  notes itself when it is pickled (:func:`note_pickled`), and a one-way call
  compares two readings of :func:`pickled_count` around the pickling of its
  arguments (nobody keeps such handles alive until the call ran, so the rank
  takes their values on arrival: :mod:`monarch_kernel.actor.actor_mesh`);
* the rank keeps the result of a call made with ``.rref()`` under the
  handle's id (:func:`keep_result`, done by the keeper that
  :mod:`monarch_kernel.tensors.store` sets with :func:`set_result_keeper`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

__all__ = ["keep_result", "note_pickled", "pickled_count", "set_result_keeper"]

_pickling = threading.local()
_keeper: Callable[[str, Any], Any] | None = None


def note_pickled() -> None:
    """Count one handle pickled by this thread (``Ref.__reduce__``)."""
    _pickling.count = getattr(_pickling, "count", 0) + 1


def pickled_count() -> int:
    """Handles pickled by this thread so far (a sender compares two readings)."""
    return getattr(_pickling, "count", 0)


def set_result_keeper(keep: Callable[[str, Any], Any]) -> None:
    """Make ``keep(id, value)`` keep the results of ``.rref()`` calls on this rank; it
    returns what goes back to the caller instead of the value (a description)."""
    global _keeper
    _keeper = keep


def keep_result(id: str, value: Any) -> Any:
    """Keep ``value`` on this rank under handle id ``id``; returns its description.

    Raises
    ------
    RuntimeError
        If no keeper was set (:mod:`monarch_kernel.tensors.store` is not loaded).
    """
    if _keeper is None:
        raise RuntimeError("this rank cannot keep results for handles "
                           "(monarch_kernel.tensors.store is not loaded)")
    return _keeper(id, value)
