"""File-descriptor-level capture of a worker's stdout and stderr.

fd 1 and fd 2 are replaced by pipes, so ``print``, C extensions and child
processes all write into them. A reader thread forwards what arrives as it
arrives; :meth:`FdCapture.drain` lets the main thread push out everything
written so far before it sends a reply, so a reply never overtakes the
output that came before it.

With ``passive=True`` (the ``local`` launcher) the worker reads nothing:
fds 1 and 2 are pipes whose read ends only the controller holds, so what a
rank wrote just before dying is never lost in the worker; the controller
reads everything a rank wrote before handling its reply. Here, the worker
only makes Python's streams write straight through to those fds.

Python's ``sys.stdout`` and ``sys.stderr`` become :class:`DivertingStream`
objects: each write is first offered to ``divert`` (when given), which may
send it itself -- the worker does so for a thread whose output must be
credited to its own request while others run (fds cannot tell threads
apart); what it declines is written to the fd.
"""

from __future__ import annotations

import io
import os
import select
import sys
import threading
from collections.abc import Callable

__all__ = ["DivertingStream", "FdCapture"]

CHUNK = 65536


class DivertingStream(io.TextIOWrapper):
    """A write-through text stream on fd 1 or 2 whose writes ``divert`` may take.

    Parameters
    ----------
    fd : int
        1 (``"stdout"``) or 2 (``"stderr"``).
    errors : str
        The encoder's error handler.
    divert : callable(name: str, text: str) -> bool, optional
        Called with the stream's name and each text written; True means it
        sent the text itself, which is then not written to the fd. Must not
        write to this stream.
    """

    def __init__(self, fd: int, errors: str,
                 divert: Callable[[str, str], bool] | None = None) -> None:
        super().__init__(io.FileIO(fd, "w", closefd=False), encoding="utf-8", errors=errors,
                         line_buffering=True, write_through=True)
        self.stream_name = "stdout" if fd == 1 else "stderr"
        self.divert = divert

    def write(self, s: str) -> int:
        divert = self.divert
        if divert is not None and s and divert(self.stream_name, s):
            return len(s)
        return super().write(s)


class FdCapture:
    """Capture fds 1 and 2 into pipes.

    Parameters
    ----------
    on_output : callable(name: str, data: bytes) -> None
        Called (from the reader thread, or from :meth:`drain`) with
        ``"stdout"`` or ``"stderr"`` and the bytes read.
    read_fds : tuple of (int, int), optional
        Read ends of pipes that fds 1 and 2 already write to (made by the
        launcher); when None, new pipes are made here.
    log_fd : int, optional
        Where the worker's own log goes; the original fd 2 by default.
    passive : bool
        fds 1 and 2 are read by the controller: read nothing here.
    divert : callable(name: str, text: str) -> bool, optional
        Offered each Python-level write first (see :class:`DivertingStream`).
    """

    def __init__(self, on_output: Callable[[str, bytes], None],
                 read_fds: tuple[int, int] | None = None, log_fd: int | None = None,
                 passive: bool = False,
                 divert: Callable[[str, str], bool] | None = None) -> None:
        self._on_output = on_output
        self._lock = threading.Lock()
        self.original: dict[int, int] = {}
        self._read: dict[int, str] = {}
        for fd, name in ((1, "stdout"), (2, "stderr")) if not passive else ():
            sys_stream = sys.stdout if fd == 1 else sys.stderr
            try:
                sys_stream.flush()
            except (AttributeError, ValueError, OSError):
                pass
            if read_fds is not None:
                r = read_fds[fd - 1]
            else:
                self.original[fd] = os.dup(fd)
                r, w = os.pipe()
                os.dup2(w, fd)
                os.close(w)
            os.set_blocking(r, False)
            self._read[r] = name
        self._log_fd = log_fd if log_fd is not None else self.original.get(2, 2)
        # Python-level streams write straight through to the captured fds
        sys.stdout = DivertingStream(1, "replace", divert)
        sys.stderr = DivertingStream(2, "backslashreplace", divert)
        self._wake_r, self._wake_w = os.pipe()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="monarch-capture", daemon=True)
        if self._read:
            self._thread.start()

    def log_stream(self) -> io.TextIOWrapper:
        """A text stream on the worker's original stderr (for its own logs)."""
        return io.TextIOWrapper(
            io.FileIO(self._log_fd, "w", closefd=False), line_buffering=True,
            write_through=True,
        )

    def _read_all(self, fds: list[int]) -> None:
        for r in fds:
            while True:
                try:
                    data = os.read(r, CHUNK)
                except BlockingIOError:
                    break
                except OSError:
                    break
                if not data:
                    break
                self._on_output(self._read[r], data)
                if len(data) < CHUNK:
                    break

    def _loop(self) -> None:
        fds = list(self._read)
        while not self._stopping:
            try:
                ready, _, _ = select.select([*fds, self._wake_r], [], [], 1.0)
            except (OSError, ValueError):
                return
            if self._wake_r in ready:
                os.read(self._wake_r, 4096)
            ready = [r for r in ready if r in self._read]
            if ready:
                with self._lock:
                    self._read_all(ready)

    def drain(self) -> None:
        """Forward everything written to fds 1 and 2 so far (call from any thread)."""
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (ValueError, OSError):
                pass
        if self._read:  # (passive: the controller reads the pipes itself)
            with self._lock:
                self._read_all(list(self._read))

    def close(self) -> None:
        """Restore the original fds; forward what is left."""
        self.drain()
        self._stopping = True
        os.write(self._wake_w, b"x")
        if self._thread.is_alive():
            self._thread.join(timeout=2)
        for fd, orig in self.original.items():
            os.dup2(orig, fd)
