"""A local lane: a Unix socket pair between the controller and a worker it
started on the same host, carrying their messages instead of ZeroMQ.

Why: a ZeroMQ message crosses two I/O threads (the sender's, which writes
the TCP socket, and the receiver's, which reads it and wakes the reader),
so a round trip wakes four threads besides the two that do the work. The
lane writes and reads the socket from the thread that sends or leads the
I/O, with no thread in between (docs/benchmarks.md compares the two). It
exists only between a controller and a worker it spawned itself (the
worker inherits its end, so nothing else can connect to it); workers on
other hosts, or started by Slurm, keep ZeroMQ. Setting
``MONARCH_LANES=0`` turns lanes off.

Framing (a stream socket, so a message of any size fits): each multipart
message is ``<u32 n> <u64 len> * n`` (little-endian) followed by the ``n``
frames. Messages are still signed and checked by :mod:`protocol`, which
owns what is inside the frames.

A send never blocks: it writes what the socket takes now (a non-blocking
``sendmsg`` gathering the frames without joining them, ``MSG_NOSIGNAL``: a
gone peer is an error, never a SIGPIPE) and queues the rest for a flusher
thread started on first need, so two sides that both send large messages
cannot deadlock (what ZeroMQ's I/O thread gives, paid only under
back-pressure). Order is kept: while anything is queued, later messages
queue behind it. Received frames are fresh, writable ``bytearray`` objects
(arrays unpickled from them are writable, as from ZeroMQ frames).

A process forked from one that holds a lane (``multiprocessing``, a
DataLoader's workers) closes its copy at once and cannot send on it
(:class:`~monarch_kernel.errors.TransportError`): its messages would
interleave with its parent's, and the lane would outlive the parent.
"""

from __future__ import annotations

import collections
import errno
import itertools
import os
import select
import socket
import struct
import threading
import time
import weakref
from typing import Any

from monarch_kernel.errors import ProtocolError, TransportError
from monarch_kernel.transport.sockets import max_message_bytes
from monarch_kernel.util.sigint import DeferredSigint

__all__ = ["Lane", "pair", "prepare", "send_all", "set_buffers"]

_COUNT = struct.Struct("<I")
#: structs of frame lengths, by (prefix, number of frames): "<I" for a message's
#: whole header (``<u32 n><u64 len>*n``), "<" for its lengths alone
_STRUCTS: dict[tuple[str, int], struct.Struct] = {}
_CACHED = 64  # frame counts whose structs are kept


def _lengths_struct(prefix: str, n: int) -> struct.Struct:
    s = _STRUCTS.get((prefix, n))
    if s is None:
        s = struct.Struct(f"{prefix}{n}Q")
        if n <= _CACHED:
            _STRUCTS[prefix, n] = s
    return s


#: bytes read from the socket at a time (one read takes every small message waiting)
CHUNK = 1 << 18
#: what a socket is asked to buffer each way (bytes; the kernel may cap it)
SOCKET_BUFFER = 1 << 22
_IOV_MAX = 512  # frames gathered by one sendmsg at most (Linux allows 1024)
#: frames a message may have on a lane with a limit (a protocol message has one
#: envelope and at most 65535 buffers)
MAX_FRAMES = 1 << 16


def pair() -> tuple[socket.socket, socket.socket]:
    """A connected pair of Unix stream sockets: (controller's end, worker's end).

    Neither is inheritable: pass the worker's end with
    ``subprocess.Popen(pass_fds=...)``, which makes it so in that child only.
    """
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    for s in (a, b):
        set_buffers(s)
    return a, b


def set_buffers(sock: socket.socket) -> None:
    """Ask the kernel for :data:`SOCKET_BUFFER` bytes of buffer each way (it may cap it)."""
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER)
        except OSError:
            pass


class Lane:
    """One end of a lane (see the module docstring).

    :meth:`send` may be called from any thread; :meth:`read` by one thread
    at a time (the one that leads the I/O).

    Parameters
    ----------
    sock : socket.socket
        A connected Unix stream socket (made non-blocking here).
    name : str
        For error messages and the flusher thread's name.
    identity : bytes
        The routing identity the controller gives the lane's messages.
    limit : int, optional
        The largest message (bytes, framing included) that :meth:`read` takes;
        a larger one, or one of more than :data:`MAX_FRAMES` frames, is a
        :class:`~monarch_kernel.errors.ProtocolError` before any room is made
        for it, and room for a message is made as its bytes come, not all at
        once (for a lane that any process of this user can connect,
        :mod:`monarch_kernel.actor.peers`). None: the bound of every socket
        (:func:`~monarch_kernel.transport.sockets.max_message_bytes`, about
        1.1 GiB unless ``MONARCH_MAX_MESSAGE_BYTES`` says otherwise), with room
        made for a message at once.
    """

    def __init__(self, sock: socket.socket, name: str = "lane", identity: bytes = b"",
                 limit: int | None = None) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.name = name
        self.identity = identity
        self.limit = limit
        #: the largest message read (bytes, framing included): a larger length is refused
        #: before any room is made for it
        self.bound = limit if limit is not None else max_message_bytes()
        self.eof = False
        self._fd = sock.fileno()  # (kept: a closed socket's fileno() is -1)
        self._pid = os.getpid()
        self._lock = threading.Lock()
        #: held by whoever reads (and handles what it read): a lane that two threads
        #: watch (a worker's peer lanes, monarch_kernel.actor.peers) is read by one at a time
        self.read_lock = threading.Lock()
        #: a thread gave up waiting for read_lock: its holder reads again before letting
        #: go (decided under miss_lock; see actor_peers.PeerHost._drain)
        self.missed = False
        self.miss_lock = threading.Lock()
        self._backlog: collections.deque[memoryview] = collections.deque()
        self._flusher: threading.Thread | None = None
        self._wake = threading.Condition(self._lock)
        self._closed = False
        self._buf = bytearray(CHUNK)
        self._start = 0  # first byte not parsed yet
        self._end = 0  # first byte not filled yet
        self._need = 0  # bytes the partial message at _start needs in all (0: unknown)
        _lanes.add(self)

    def fileno(self) -> int:
        """The socket's file descriptor (still the same number once closed)."""
        return self._fd

    # ---------------------------------------------------------------- send
    def send(self, frames: list[Any]) -> None:
        """Send ``frames`` as one message (any thread; never blocks).

        Parameters
        ----------
        frames : list of bytes-like
            C-contiguous buffers (bytes, memoryview, numpy arrays, zmq.Frame).

        Raises
        ------
        TransportError
            If the lane is closed, its other end is gone, or this process is
            a fork of the one that made the lane.
        TypeError, BufferError
            If a frame is not a C-contiguous buffer (nothing is sent then).
        """
        self.send_prepared(prepare(frames))

    def send_prepared(self, prepared: tuple[list[Any], int]) -> None:
        """Send a message made by :func:`prepare` (one message sent on several
        lanes, a broadcast, is prepared once). Raises as :meth:`send`."""
        # a KeyboardInterrupt between a partial write and queueing the rest would
        # leave half a message on the stream: Ctrl-C waits until this is done
        with DeferredSigint():
            self._send_now(prepared)

    def _send_now(self, prepared: tuple[list[Any], int]) -> None:
        """:meth:`send_prepared` with SIGINT deferred by the caller."""
        parts, total = prepared
        with self._lock:
            if self._closed:
                raise TransportError(
                    f"{self.name} is closed" if self._pid == os.getpid() else
                    f"{self.name} belongs to process {self._pid}, which this one was forked "
                    "from; a forked child cannot send on it")
            if self._backlog:  # queued messages go first
                self._queue(parts, 0)
                return
            try:
                sent = self.sock.sendmsg(parts if len(parts) <= _IOV_MAX else parts[:_IOV_MAX],
                                         (), _FLAGS)
            except BlockingIOError:
                sent = 0
            except OSError as e:
                raise TransportError(f"cannot send on {self.name}: {e}") from e
            if sent < total:
                self._queue(parts, sent)

    def _queue(self, parts: list[Any], skip: int) -> None:
        """Queue ``parts`` minus their first ``skip`` bytes for the flusher (lock
        held; ``parts`` are bytes or 1-byte memoryviews, so nothing here raises
        but a failure to start the flusher, which then writes here)."""
        for p in parts:
            n = len(p) if type(p) is bytes else p.nbytes
            if skip >= n:
                skip -= n
                continue
            v = memoryview(p) if type(p) is bytes else p
            self._backlog.append(v[skip:] if skip else v)
            skip = 0
        if self._flusher is None:
            t = threading.Thread(target=self._flush, name=f"monarch-{self.name}", daemon=True)
            try:
                t.start()
            except RuntimeError:  # no thread to be had (shutting down): write it here
                self._write_backlog_here()
                return
            self._flusher = t
        self._wake.notify()

    def _write_backlog_here(self) -> None:
        """Write the whole backlog from this thread, waiting for the socket (lock
        held; only when no flusher thread can be started); the lane closes if
        the other end does not take it within 10 s."""
        out = select.poll()
        out.register(self._fd, select.POLLOUT)
        deadline = time.monotonic() + 10.0
        while self._backlog and time.monotonic() < deadline:
            out.poll(100)
            if not self._send_some():
                break
        if self._backlog:
            self._closed = True
            self._backlog.clear()
            raise TransportError(f"{self.name}: the other end takes nothing; closed")

    def _send_some(self) -> bool:
        """One write of the backlog's head (lock held); False if the other end is gone."""
        try:
            sent = self.sock.sendmsg(list(itertools.islice(self._backlog, _IOV_MAX)), (),
                                     _FLAGS)
        except BlockingIOError:
            return True
        except OSError:  # the other end is gone: what is queued is lost with it
            self._backlog.clear()
            return False
        backlog = self._backlog
        while sent and backlog:
            n = backlog[0].nbytes
            if sent >= n:
                backlog.popleft()
                sent -= n
            else:
                backlog[0] = backlog[0][sent:]
                sent = 0
        return True

    def _flush(self) -> None:
        """Write the backlog as the socket takes it (the flusher thread)."""
        out = select.poll()
        out.register(self._fd, select.POLLOUT)
        while True:
            with self._lock:
                while not self._backlog and not self._closed:
                    self._wake.wait()
                if self._closed or not self._send_some():
                    return
                if not self._backlog:
                    continue
            try:
                out.poll(100)  # (outside the lock: senders queue meanwhile)
            except OSError:
                return

    # ---------------------------------------------------------------- read
    def read(self) -> list[list[bytearray]]:
        """The messages that have fully arrived (each a list of frames, as
        writable ``bytearray``); sets :attr:`eof` when the other end closed. Reads the
        socket once (poll is level-triggered: what is left is read next time)
        unless a message is bigger than what was read.

        Raises
        ------
        ProtocolError
            If a message is larger than :attr:`limit` (the lane cannot be read
            further: close it).
        """
        out: list[list[bytearray]] = []
        if self._closed:
            self.eof = True
            return out
        while True:
            buf = self._buf
            if self._end == len(buf):  # full: make room (move the partial message down)
                partial = self._end - self._start
                need = self._need
                if self._start:
                    buf[:partial] = buf[self._start:self._end]
                    self._start, self._end = 0, partial
                if need > len(buf) or self._end == len(buf):
                    # room for the whole message at once; on a lane with a limit (that
                    # other processes can connect), only as its bytes come: doubling
                    size = (max(need, 2 * len(buf)) if self.limit is None else
                            max(min(need, 2 * len(buf)), self._end + CHUNK))
                    buf.extend(bytes(size - len(buf)))
            try:
                n = self.sock.recv_into(memoryview(buf)[self._end:])
            except (BlockingIOError, InterruptedError):
                return out
            except OSError as e:  # (EBADF: closed meanwhile by another thread)
                if e.errno not in (errno.ECONNRESET, errno.EPIPE, errno.EBADF, None):
                    raise
                n = 0
            if n == 0:
                self.eof = True
                return out
            self._end += n
            self._parse(out)
            if self._end < len(self._buf):  # the socket had no more than this
                if self._start == self._end:
                    self._start = self._end = 0
                    if len(self._buf) > CHUNK:  # a big message passed: shrink back
                        self._buf = bytearray(CHUNK)
                return out

    def _parse(self, out: list[list[bytearray]]) -> None:
        """Append the complete messages from ``_start`` to ``out``; for a partial
        one left, note in ``_need`` how many bytes it needs (as far as known)."""
        buf, pos, end = self._buf, self._start, self._end
        self._need = 0
        while end - pos >= 4:
            (n,) = _COUNT.unpack_from(buf, pos)
            at = pos + 4 + 8 * n
            if at - pos > self.bound or (self.limit is not None and n > MAX_FRAMES):
                self._too_big(4 + 8 * n, n)
            if at > end:
                self._need = at - pos
                break
            lens = _lengths_struct("<", n).unpack_from(buf, pos + 4)
            stop = at + sum(lens)  # (where this message ends)
            if stop - pos > self.bound:
                self._too_big(stop - pos)
            if stop > end:
                self._need = stop - pos
                break
            frames = []
            for ln in lens:
                frames.append(buf[at:at + ln])  # (a copy: writable, and buf may move)
                at += ln
            out.append(frames)
            pos = at
        self._start = pos

    def _too_big(self, nbytes: int, frames: int = 0) -> None:
        self._start = self._end = 0
        if frames > MAX_FRAMES:
            raise ProtocolError(f"{self.name}: a message of {frames} frames, over the limit "
                                f"of {MAX_FRAMES}")
        raise ProtocolError(f"{self.name}: a message of {nbytes} bytes, over the limit of "
                            f"{self.bound} bytes (MONARCH_MAX_MESSAGE_BYTES)")

    def drain(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for queued data to leave; True if none is left."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                if not self._backlog or self._closed:
                    return not self._backlog
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.001)

    def close(self) -> None:
        """Close this end (idempotent); the flusher stops, queued data is dropped."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._backlog.clear()
            self._wake.notify_all()
        try:
            self.sock.close()
        except OSError:
            pass


_FLAGS = socket.MSG_NOSIGNAL if hasattr(socket, "MSG_NOSIGNAL") else 0

#: every lane of this process (closed in a forked child, see _after_fork)
_lanes: weakref.WeakSet[Lane] = weakref.WeakSet()


def _after_fork() -> None:
    """In a forked child: close its copies of the lanes (they stay the parent's)."""
    for lane in list(_lanes):
        lane._lock = threading.Lock()  # (a thread of the parent may have held it)
        lane._wake = threading.Condition(lane._lock)
        lane._closed = True
        lane._backlog.clear()
        lane._flusher = None
        try:
            lane.sock.close()
        except OSError:
            pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


def send_all(lanes: list[Lane], prepared: tuple[list[Any], int]
             ) -> tuple[Lane, TransportError] | None:
    """Send one message made by :func:`prepare` on each of ``lanes`` (a
    broadcast: the same buffers are written to every lane, nothing is copied
    or framed again per lane), Ctrl-C deferred once for all of them.

    Returns
    -------
    (Lane, TransportError) or None
        None when every lane took the message; else the first lane that could
        not (closed, or its other end gone) and why, after which nothing more
        was sent.
    """
    with DeferredSigint():
        for lane in lanes:
            try:
                lane._send_now(prepared)
            except TransportError as e:
                return lane, e
    return None


def prepare(frames: list[Any]) -> tuple[list[Any], int]:
    """The parts of one message on a lane (its framing header, then its frames
    as flat views) and their total size in bytes, for :meth:`Lane.send_prepared`.

    Raises
    ------
    TypeError, BufferError
        If a frame is not a C-contiguous buffer.
    """
    # (bytes or memoryview; Any: `type(v) is bytes` does not narrow the other way)
    views: list[Any] = [f if type(f) is bytes else _bytes_view(f) for f in frames]
    lens = [len(v) if type(v) is bytes else v.nbytes for v in views]
    head = _lengths_struct("<I", len(views)).pack(len(views), *lens)
    return [head, *views], len(head) + sum(lens)


def _bytes_view(frame: Any) -> memoryview:
    """A flat view of ``frame``'s bytes (raises for a non-contiguous buffer)."""
    buf = getattr(frame, "buffer", None)  # zmq.Frame
    v = buf if buf is not None else memoryview(frame)
    if not v.c_contiguous:
        raise BufferError("a frame must be a C-contiguous buffer (copy it first)")
    return v if v.format == "B" and v.ndim == 1 else v.cast("B")
