"""The kernel's ``sys.stdout`` / ``sys.stderr``: ipykernel's OutStream, minus idle flushes.

ipykernel flushes both streams several times around every cell (before and
after ``execute_request``, after each shell message). Each
:meth:`OutStream.flush` hands two callbacks to the IOPub thread and waits
for it, even when nothing was written: round trips to another thread on
every cell's path. :class:`OutStream` skips a
flush when nothing was written since the last flush that completed, which
is when the stock flush would publish nothing.

Why that keeps output order: a completed flush has let the IOPub thread
publish (queue) every write buffered before it started. A write counts
only once it is buffered; if the count has not moved since then, every
write that finished before this flush was covered by that earlier one, and
whatever the caller publishes next (the reply, the idle status) is queued
after that output.

Used through ipykernel's own hook: ``IPKernelApp.outstream_class``
(see :mod:`monarch_kernel.kernel.__main__`).
"""

from __future__ import annotations

import threading
from typing import Any

from ipykernel import iostream

__all__ = ["OutStream"]


class OutStream(iostream.OutStream):
    """:class:`ipykernel.iostream.OutStream` whose flush is free when nothing was written.

    Parameters are those of :class:`ipykernel.iostream.OutStream`.

    Attributes
    ----------
    flushes_skipped : int
        Flushes that had nothing to publish and returned at once.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._count_lock = threading.Lock()
        self._written = 0  # writes buffered so far
        self._flushed = -1  # ``_written`` when the last completed flush started
        self.flushes_skipped = 0
        super().__init__(*args, **kwargs)

    def write(self, string: str) -> int | None:  # type: ignore[override]
        """As :meth:`ipykernel.iostream.OutStream.write`; then counts the write."""
        n = super().write(string)
        with self._count_lock:  # counted after it is buffered (see the module docstring)
            self._written += 1
        return n

    def flush(self) -> None:
        """As :meth:`ipykernel.iostream.OutStream.flush`, unless nothing was written
        since the last flush finished."""
        with self._count_lock:
            written = self._written
        if written == self._flushed:
            self.flushes_skipped += 1
            return
        super().flush()
        self._flushed = written
