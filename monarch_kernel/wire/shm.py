"""The same-host data plane: large buffers through shared memory.

Between processes on one host, a large buffer (a tensor's or an array's
bytes, at least :data:`MIN_BYTES`) is not pushed through a TCP socket: the
sender copies it once into a fresh POSIX shared-memory file
(``/dev/shm/monarch-<random>``, mode 0600) and the message carries only its
name and size (signed like the rest of the message). The receiver maps the
file copy-on-write (``MAP_PRIVATE``, pre-faulted with ``MAP_POPULATE``) and
rebuilds the array on that mapping without another copy; several receivers
of one broadcast map the same file, and a receiver's writes stay its own.

Who removes the file: for a request, the sender, once every receiver has
answered (the receivers mapped it before answering); for a reply, the
receiver, right after mapping it. Files a process created and never saw
removed are removed when it exits.

Fresh files cost page faults on both sides (about as much as the copy
itself), so a sender that sends requests keeps a :class:`Pool` of files it
reuses once a request is answered (``/dev/shm/monarch-p<random>``, each held
with a shared ``flock`` while its pool lives, so that a process killed
outright, whose ``atexit`` never ran, leaves files that the next controller
on the host recognizes as nobody's and removes: :func:`sweep_stale`); the
receiver keeps those files mapped and copies the bytes out into memory of
its own while decoding (one copy on each side, no socket, no hashing of the
bytes).

That memory of its own is recycled too: the receiver keeps the buffers it
copied into (:data:`RECV_MAX_BYTES` at most) and copies the next buffer of
the same size into one that nothing refers to any more (the array and every
tensor or view made from it are gone), so a steady stream of transfers
touches no fresh memory. Fresh memory costs page faults, and far more than
that on a virtual machine that hands memory freed for a while back to its
host (free page reporting): touching it again then costs the host's faults
too, many times the copy itself.
"""

from __future__ import annotations

import atexit
import contextlib
import mmap
import os
import re
import secrets
import stat
import sys
import threading
import time

try:
    import fcntl
except ImportError:  # (not POSIX: no pooled files are swept)
    fcntl = None  # type: ignore[assignment]

__all__ = ["MIN_BYTES", "NAME_RE", "RECV_MAX_BYTES", "ShmBuffer", "create", "forget", "open_buffer",
           "sweep_stale", "unlink"]

#: buffers at least this large travel through shared memory on one host
MIN_BYTES = 1 << 20
DIRECTORY = "/dev/shm"
NAME_RE = re.compile(r"^monarch-(?:p[0-9a-f]{23}|[0-9a-f]{24})$")
POOL_PREFIX = "monarch-p"  # (a pooled file: locked by its owner, see sweep_stale)

_created: set[str] = set()
_lock = threading.Lock()


def available() -> bool:
    """True where POSIX shared memory (``/dev/shm``) can be used."""
    return os.path.isdir(DIRECTORY) and os.access(DIRECTORY, os.W_OK)


class ShmBuffer:
    """A buffer copied into a shared-memory file (the sender's side)."""

    __slots__ = ("name", "nbytes")

    def __init__(self, name: str, nbytes: int) -> None:
        self.name = name
        self.nbytes = nbytes

    def descriptor(self, mode: str) -> bytes:
        """The frame that stands for the buffer in a message: ``mode`` is "1"
        (the receiver removes the file), "0" (the sender does) or "p" (a pooled
        file: the receiver copies the bytes out and leaves the file)."""
        return f"{self.name}:{self.nbytes}:{mode}".encode()


class Pool:
    """Reusable shared-memory files of a sender (at most ``max_bytes`` in all).

    :meth:`put` copies a buffer into a free file (a new one if none fits);
    :meth:`release` returns files once the receivers have copied them.
    """

    def __init__(self, max_bytes: int = 1 << 30) -> None:
        self.max_bytes = max_bytes
        self._free: list[tuple[str, int, mmap.mmap]] = []
        self._busy: dict[str, tuple[str, int, mmap.mmap]] = {}
        self._lock = threading.Lock()

    def _total(self) -> int:
        return sum(s for _, s, _ in self._free) + sum(s for _, s, _ in self._busy.values())

    def put(self, view: memoryview) -> ShmBuffer | None:
        """Copy ``view`` into a pooled file; None when the pool is full."""
        n = view.nbytes
        src = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        leased = self.lease(n)
        if leased is None:
            return None
        leased[1][:n] = src
        return ShmBuffer(leased[0], n)

    def lease(self, n: int) -> tuple[str, mmap.mmap] | None:
        """A pooled file of at least ``n`` bytes and its mapping (``MAP_SHARED``,
        writable), busy until :meth:`release`; None when the pool is full.

        Raises
        ------
        OSError
            If a new file cannot be created or filled (``/dev/shm`` full, ...).
        """
        with self._lock:
            fit = [f for f in self._free if f[1] >= n]
            if fit:
                seg = min(fit, key=lambda f: f[1])
                self._free.remove(seg)
            else:
                gone = []
                while self._free and self._total() + n > self.max_bytes:
                    gone.append(self._free.pop(0))  # free files too small: make room
                if self._total() + n > self.max_bytes:
                    self._free.extend(gone)
                    return None
                seg = None
                for name, _, mm in gone:
                    mm.close()
                    unlink(name)
        if seg is None:
            name = POOL_PREFIX + secrets.token_hex(12)[:23]
            fd = os.open(os.path.join(DIRECTORY, name), os.O_RDWR | os.O_CREAT | os.O_EXCL,
                         0o600)
            with _lock:
                _created.add(name)
            try:
                # a shared lock, held while the mapping lives (sweep_stale): it belongs
                # to the open file, which the mapping's own copy of the fd keeps open
                if fcntl is not None:
                    fcntl.flock(fd, fcntl.LOCK_SH)
                _allocate(fd, n)
                mm = mmap.mmap(fd, n, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
            except BaseException:
                unlink(name)
                raise
            finally:
                os.close(fd)
            seg = (name, n, mm)
        with self._lock:
            self._busy[seg[0]] = seg
        return seg[0], seg[2]

    def release(self, name: str, discard: bool = False) -> bool:
        """Return a file to the pool (``discard``: remove it). False if not ours."""
        with self._lock:
            seg = self._busy.pop(name, None)
            if seg is not None and not discard:
                self._free.append(seg)
        if seg is not None and discard:
            seg[2].close()
            unlink(name)
        return seg is not None

    def close(self) -> None:
        with self._lock:
            segs = [*self._free, *self._busy.values()]
            self._free, self._busy = [], {}
        for name, _, mm in segs:
            mm.close()
            unlink(name)


def sweep_stale(min_age: float = 10.0) -> list[str]:
    """Remove pooled files (``monarch-p*``) of this host that no living process
    holds: their pool's process was killed outright (SIGKILL, the OOM killer),
    so its ``atexit`` never removed them. A pool holds a shared ``flock`` on
    each of its files; a file on which an exclusive lock can be taken at once
    is nobody's. Files younger than ``min_age`` seconds are left alone (one
    being created may not be locked yet), and so are other users' files.

    Returns
    -------
    list of str
        The names removed.
    """
    if fcntl is None or not available():
        return []
    removed = []
    now = time.time()
    try:
        names = os.listdir(DIRECTORY)
    except OSError:
        return []
    for name in names:
        if not (name.startswith(POOL_PREFIX) and NAME_RE.match(name)):
            continue
        path = os.path.join(DIRECTORY, name)
        try:  # (O_NONBLOCK: a FIFO planted under such a name must not block us)
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:  # gone meanwhile, or another user's
            continue
        try:
            st = os.fstat(fd)
            if (not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid()
                    or now - st.st_ctime < min_age):
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # held: its pool lives
                continue
            with contextlib.suppress(OSError):
                os.unlink(path)
                removed.append(name)
        finally:
            os.close(fd)
    return removed


def create(view: memoryview) -> ShmBuffer:
    """Copy ``view`` into a new shared-memory file.

    Raises
    ------
    OSError
        If the file cannot be created or filled (``/dev/shm`` full, ...).
    """
    name = f"monarch-{secrets.token_hex(12)}"
    path = os.path.join(DIRECTORY, name)
    n = view.nbytes
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    with _lock:
        _created.add(name)
    try:
        _allocate(fd, n)
        with mmap.mmap(fd, n, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)) as mm:
            mm[:] = view.cast("B") if view.format != "B" or view.ndim != 1 else view
    except BaseException:
        os.close(fd)
        unlink(name)
        raise
    os.close(fd)
    return ShmBuffer(name, n)


def _allocate(fd: int, n: int) -> None:
    """Reserve ``n`` bytes for real (``ftruncate`` alone would let a full /dev/shm
    kill the writer with SIGBUS; this raises OSError ENOSPC instead)."""
    if n and hasattr(os, "posix_fallocate"):
        os.posix_fallocate(fd, 0, n)
    else:
        os.ftruncate(fd, n)


def parse(frame: memoryview) -> tuple[str, int, str]:
    """``(name, nbytes, mode)`` from a descriptor frame (mode ``"0"``: the sender
    removes the file, ``"1"``: the receiver does, ``"p"``: a sender's pooled file).

    Raises
    ------
    ValueError
        For anything that is not a well-formed descriptor of our own files.
    """
    text = bytes(frame[:128]).decode("ascii")
    name, size, flag = text.split(":")
    if not NAME_RE.match(name) or flag not in ("0", "1", "p") or not size.isdigit():
        raise ValueError(f"bad shared-memory descriptor {text!r}")
    return name, int(size), flag


_maps: dict[str, mmap.mmap] = {}  # pooled files of senders, kept mapped (LRU)
_MAX_MAPS = 16


def open_buffer(name: str, nbytes: int, mode: str) -> memoryview:
    """The bytes of a shared-memory file, for the receiver.

    ``mode`` "p" (pooled): copied out of a cached mapping into memory of this
    process, recycled (:func:`_recv_buffer`).
    Otherwise the file is mapped copy-on-write and the view keeps the mapping
    alive; with "1" the file is removed at once.

    Raises
    ------
    OSError
        If the file is gone or smaller than ``nbytes``.
    """
    if mode == "p":
        mm = _map_cached(_maps, name, nbytes, writable=False)
        try:
            import numpy as np  # its copy is several times faster than bytearray's

            dst = _recv_buffer(nbytes)
            np.copyto(dst, np.frombuffer(mm, np.uint8, count=nbytes))
            return memoryview(dst)
        finally:
            _keep_map(_maps, name, mm)
    unlink_after = mode == "1"
    path = os.path.join(DIRECTORY, name)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    try:
        if os.fstat(fd).st_size < nbytes:
            raise OSError(f"shared-memory file {name} is smaller than {nbytes} bytes")
        if nbytes == 0:
            return memoryview(b"")
        mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_PRIVATE | getattr(mmap, "MAP_POPULATE", 0),
                       prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
        if unlink_after:
            unlink(name)
    return memoryview(mm)


_wmaps: dict[str, mmap.mmap] = {}  # files other processes lent us to write into (LRU)


def forget(names: set[str] | list[str]) -> None:
    """Drop this process's cached mappings of other processes' files (their
    memory stays pinned while mapped, even once the files are removed)."""
    with _lock:
        maps = [m.pop(n) for m in (_maps, _wmaps) for n in list(names) if n in m]
    for mm in maps:
        try:
            mm.close()
        except BufferError:  # a view still uses it: it goes with that view
            pass


def map_writable(name: str, nbytes: int) -> mmap.mmap:
    """A shared, writable mapping of another process's pooled file (of at least
    ``nbytes``), kept mapped for the next time (:mod:`monarch_kernel.tensors.buffer`
    writes a registered buffer's bytes straight into a reader's file).

    Raises
    ------
    ValueError
        If ``name`` is not one of our shared-memory file names.
    OSError
        If the file is gone or smaller than ``nbytes``.
    """
    if not NAME_RE.match(name):
        raise ValueError(f"bad shared-memory file name {name!r}")
    mm = _map_cached(_wmaps, name, nbytes, writable=True)
    _keep_map(_wmaps, name, mm)
    return mm


def _map_cached(cache: dict[str, mmap.mmap], name: str, nbytes: int,
                writable: bool) -> mmap.mmap:
    """``cache``'s shared mapping of file ``name`` (taken out of it; the caller
    puts it back with :func:`_keep_map`), or a new one of the whole file.

    Raises
    ------
    OSError
        If the file is gone or smaller than ``nbytes``.
    """
    with _lock:
        mm = cache.pop(name, None)
    if mm is not None and len(mm) >= nbytes:
        return mm
    fd = os.open(os.path.join(DIRECTORY, name),
                 (os.O_RDWR if writable else os.O_RDONLY) | getattr(os, "O_NOFOLLOW", 0))
    try:
        size = os.fstat(fd).st_size
        if size < nbytes:
            raise OSError(f"shared-memory file {name} is smaller than {nbytes} bytes")
        if writable:
            return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    finally:
        os.close(fd)


def _keep_map(cache: dict[str, mmap.mmap], name: str, mm: mmap.mmap) -> None:
    """Put a mapping (back) into ``cache``, forgetting the least recently used."""
    with _lock:
        cache[name] = mm
        while len(cache) > _MAX_MAPS:
            cache.pop(next(iter(cache))).close()


#: the most bytes of receive buffers a process keeps for reuse (see the module docstring)
RECV_MAX_BYTES = 256 << 20
_recv: list = []  # receive buffers (numpy uint8 arrays), least recently used first


def _refs(buffers: list, i: int) -> int:
    return sys.getrefcount(buffers[i])


#: what :func:`_refs` says of an object that only its list refers to (measured, so
#: that an interpreter counting the call's own references differently changes nothing)
_ALONE = _refs([object()], 0)


def _recv_buffer(nbytes: int):
    """A uint8 array of ``nbytes`` to copy a received buffer into: one of
    :data:`_recv` that nothing else refers to any more, else a new one (kept
    for reuse when it fits in :data:`RECV_MAX_BYTES`).

    Only references prove that a buffer is free: the arrays, tensors and
    memoryviews made from it all refer to it (numpy views to the array that
    owns the memory, ``torch.from_numpy`` to its array), so one that only
    :data:`_recv` refers to can be overwritten.
    """
    import numpy as np

    with _lock:
        for i in range(len(_recv) - 1, -1, -1):
            if _recv[i].nbytes == nbytes and _refs(_recv, i) == _ALONE:
                buf = _recv.pop(i)
                _recv.append(buf)
                return buf
    buf = np.empty(nbytes, np.uint8)
    if nbytes <= RECV_MAX_BYTES:
        with _lock:
            _recv.append(buf)
            total = sum(b.nbytes for b in _recv)
            while total > RECV_MAX_BYTES:  # forget the least recently used
                total -= _recv.pop(0).nbytes
    return buf


def unlink(name: str) -> None:
    """Remove a shared-memory file (no error if it is already gone)."""
    with _lock:
        _created.discard(name)
    try:
        os.unlink(os.path.join(DIRECTORY, name))
    except FileNotFoundError:
        pass


def _after_fork_in_child() -> None:
    """A forked child owns none of its parent's files: its exit, atexit or
    SIGTERM handler must not remove them."""
    global _lock
    _lock = threading.Lock()  # (a thread of the parent may have held it)
    _created.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


@atexit.register
def cleanup() -> None:
    """Remove every shared-memory file this process created and still owns.

    Takes no lock, so a signal handler may call it (the code it interrupted
    may hold :data:`_lock`); it runs only as the process ends.
    """
    names: list[str] = []
    for _ in range(3):
        try:
            names = list(_created)
            break
        except RuntimeError:  # the set changed meanwhile (another thread): again
            continue
    for name in names:
        try:
            os.unlink(os.path.join(DIRECTORY, name))
        except OSError:
            pass


