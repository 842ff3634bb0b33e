"""Which actor the calling thread runs, if any.

Each actor of a worker has a thread of its own (:mod:`monarch_kernel.actor.host`);
that thread sets ``context.actor`` to its actor instance when it starts. The
modules below the host (wait cycles, the call plumbing of an actor mesh) read it
here instead of importing the host.
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["context", "current_actor"]

#: per thread: ``.actor`` is the actor instance whose thread this is (unset elsewhere)
context = threading.local()


def current_actor() -> Any:
    """The actor instance whose thread calls this, or None (another thread)."""
    return getattr(context, "actor", None)
