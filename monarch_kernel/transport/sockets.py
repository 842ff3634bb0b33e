"""ZeroMQ sockets, and the mapping of ``zmq.ZMQError`` to :mod:`errors`.

(Workers that the controller started on its own host use a lane instead,
:mod:`monarch_kernel.transport.lane`; ZeroMQ carries everything else.)

ZeroMQ sockets are not thread-safe; two patterns keep them safe here:

* a socket that is read is owned by one thread (an I/O thread), the only
  one to poll or receive on it;
* a socket that is only written (the controller's ``router_down``, a
  worker's ``up`` connection) is written by any thread under one lock, so
  messages from all threads keep one order; where a read socket must also
  be written by other threads (actor peer sockets), they hand frames to its
  I/O thread through an :class:`Outbox` (an ``inproc://`` PUSH socket
  guarded by a lock).

Sockets are closed with ``linger=0`` (as in pyzmq's own tests).

Who can connect (see the guide's security page):

* a mesh on one host binds ``ipc://`` endpoints (Unix sockets) inside a
  private directory (:func:`private_dir`, mode 0700): only processes of the
  same user (and root) can connect; no TCP port is open;
* every TCP endpoint (a mesh whose workers run on other hosts, or TCP asked
  for with ``--bind``) is a CurveZMQ server, and its ZAP handler
  (:class:`KeyGate`) admits only clients that present the mesh's client key
  (:func:`curve_client_keypair`, derived from the mesh key, which workers
  already hold): an unknown peer costs a refused handshake, before any of its
  messages is read.

Every socket that reads from a peer has a maximum message size
(``ZMQ_MAXMSGSIZE``, :func:`max_message_bytes`): a larger frame closes the
connection before it is kept.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import ipaddress
import itertools
import logging
import os
import select
import shutil
import stat
import tempfile
import threading
from collections.abc import Callable, Iterator
from typing import Any, cast

import zmq
from zmq.utils import z85

from monarch_kernel.errors import TransportError

__all__ = ["DOWN_MAX_MESSAGE", "MAX_MESSAGE_ENV", "RECEIVE_QUEUE", "FdPoller", "KeyGate", "Outbox",
           "bind_router", "connect_dealer", "curve_attach_keypair", "curve_client_keypair",
           "drain", "endpoint_host",
           "has_input", "inproc_pair", "is_ipc", "is_loopback", "max_message_bytes",
           "private_dir", "remove_private_dir", "send_frames"]

log = logging.getLogger("monarch_kernel.transport.sockets")

#: the environment variable that sets the largest frame (bytes) a socket or lane takes
MAX_MESSAGE_ENV = "MONARCH_MAX_MESSAGE_BYTES"
#: its default: the codec's limits (64 MiB of header and payload, 1 GiB of buffers,
#: :mod:`monarch_kernel.wire.protocol`) and 1 MiB of framing; a larger message would be
#: dropped by the codec anyway, after it was received whole
DEFAULT_MAX_MESSAGE = (64 << 20) + (1 << 30) + (1 << 20)
#: the largest frame the controller's "down" ROUTER takes (workers send nothing there;
#: the ZMTP handshake's commands, a few hundred bytes, count too)
DOWN_MAX_MESSAGE = 4096
#: the longest path of a Unix socket (sun_path is 108 bytes, with its terminating NUL)
_SUN_PATH_MAX = 107
#: the longest private directory made under $XDG_RUNTIME_DIR or the temp dir (leaves room
#: for socket names of up to 24 bytes)
_DIR_MAX = _SUN_PATH_MAX - 25

_counter = itertools.count()

# pyzmq's multipart helpers spend a few microseconds of Python per frame (enum
# flag arithmetic, type checks); the hot path calls the Cython methods directly
_send = zmq.backend.Socket.send
_recv = zmq.backend.Socket.recv
# (asked only for integer options here; pyzmq types the result int | bytes)
_get = cast("Callable[[zmq.Socket, int], int]", zmq.backend.Socket.get)
_SNDMORE = int(zmq.SNDMORE)
_NOBLOCK = int(zmq.NOBLOCK)
_RCVMORE = int(zmq.RCVMORE)
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)


def send_frames(sock: zmq.Socket, frames: list[Any], flags: int = 0) -> None:
    """Send ``frames`` as one multipart message, without copying large frames
    (as ``send_multipart(frames, flags, copy=False)``, faster).

    Raises
    ------
    zmq.ZMQError
        As :meth:`zmq.Socket.send` (e.g. ``EHOSTUNREACH`` on a ROUTER with
        ``router_mandatory``, ``EAGAIN`` with ``NOBLOCK``).
    """
    last = len(frames) - 1
    more = int(flags) | _SNDMORE
    for i in range(last):
        _send(sock, frames[i], more, False)
    _send(sock, frames[last], int(flags), False)


def is_loopback(host: str) -> bool:
    """True when ``host`` is a loopback address or ``localhost``."""
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_ipc(address: str) -> bool:
    """Whether ``address`` (a ZeroMQ endpoint, maybe followed by ``|KEY`` or
    ``;NAME``) is an ``ipc://`` endpoint: a Unix socket on this host."""
    return address.startswith("ipc://")


def endpoint_host(address: str) -> str:
    """The host part of a ZeroMQ endpoint (``tcp://10.0.0.2:5555|KEY;NAME`` ->
    ``10.0.0.2``); ``127.0.0.1`` for an ``ipc://`` endpoint (a socket of this host)."""
    if is_ipc(address):
        return "127.0.0.1"
    return (address.split(";", 1)[0].split("|", 1)[0].split("//", 1)[-1]
            .rsplit(":", 1)[0].strip("[]"))


def max_message_bytes() -> int:
    """The largest frame (bytes) a socket or lane reads from a peer: the
    environment variable ``MONARCH_MAX_MESSAGE_BYTES``, else
    :data:`DEFAULT_MAX_MESSAGE` (about 1.1 GiB).

    Raises
    ------
    ValueError
        If the variable is set to something other than a whole number of bytes
        of at least 1 MiB.
    """
    raw = os.environ.get(MAX_MESSAGE_ENV, "").strip()
    if not raw:
        return DEFAULT_MAX_MESSAGE
    try:
        n = int(raw.replace("_", ""))
    except ValueError:
        n = -1
    if n < (1 << 20):
        raise ValueError(f"{MAX_MESSAGE_ENV}={raw!r}: give the largest message in bytes, "
                         f"a whole number of at least 1048576 (1 MiB); unset, it is "
                         f"{DEFAULT_MAX_MESSAGE}")
    return n


def _usable_base(path: str | None) -> bool:
    if not path or len(path) > _DIR_MAX - 20:  # ("/mk-PID-" and 8 characters)
        return False
    try:
        st = os.stat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and os.access(path, os.W_OK | os.X_OK)


def private_dir() -> str:
    """Make a directory only this user can enter (mode 0700) for Unix sockets.

    It is made under ``$XDG_RUNTIME_DIR`` when that is set, usable and short
    enough, else under the temp directory (``$TMPDIR``), else under ``/tmp``;
    its path leaves room for a socket name of 24 bytes within the 107 bytes a
    Unix socket's path may have. The caller removes it
    (:func:`remove_private_dir`); those of this user's processes that were
    killed first (the process id is in the name) are removed here.

    Raises
    ------
    TransportError
        If no such directory can be made.
    """
    for base in (os.environ.get("XDG_RUNTIME_DIR"), tempfile.gettempdir(), "/tmp"):
        if not _usable_base(base):
            continue
        assert base is not None
        _sweep(base)
        try:  # (named with this process's id: a later sweep removes it if it was killed)
            path = tempfile.mkdtemp(prefix=f"mk-{os.getpid()}-", dir=base)  # (mode 0700)
        except OSError:
            continue
        os.chmod(path, 0o700)  # (mkdtemp's mode already; said again against odd umasks)
        return path
    raise TransportError("cannot make a private directory for the mesh's sockets under "
                         "$XDG_RUNTIME_DIR, $TMPDIR or /tmp; make one of them writable")


def _sweep(base: str) -> None:
    """Remove this user's private directories in ``base`` whose process is gone
    (killed before it could remove them); best effort."""
    try:
        names = [n for n in os.listdir(base) if n.startswith("mk-")]
    except OSError:
        return
    uid = os.getuid()
    for name in names:
        pid = name[3:].partition("-")[0]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        path = os.path.join(base, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) and st.st_uid == uid:
            shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # (EPERM: someone else's process)
        return True
    return True


def remove_private_dir(path: str | None) -> None:
    """Remove a directory made by :func:`private_dir` and the sockets in it
    (None, or one gone already: nothing)."""
    if path:
        shutil.rmtree(path, ignore_errors=True)


def _bounded(sock: zmq.Socket, max_message: int | None) -> None:
    """Set ``ZMQ_MAXMSGSIZE``: a peer that sends a larger frame is disconnected."""
    sock.setsockopt(zmq.MAXMSGSIZE, max_message if max_message is not None
                    else max_message_bytes())


def curve_client_keypair(mesh_key: bytes) -> tuple[bytes, bytes]:
    """The CurveZMQ client key pair (public, secret; Z85) of the mesh whose key is
    ``mesh_key``: derived from it, so that whoever holds the mesh key (its
    workers, which get it through their environment) holds it, and no other
    secret has to travel."""
    raw = hmac.new(mesh_key, b"monarch-curve-client-v1", hashlib.sha256).digest()
    secret = z85.encode(raw)
    return zmq.curve_public(secret), secret


def curve_attach_keypair(mesh_key: bytes) -> tuple[bytes, bytes]:
    """The CurveZMQ server key pair (public, secret; Z85) of the TCP attach
    endpoints of the detachable mesh whose key is ``mesh_key``: derived from it,
    so that a controller that holds the mesh key (read from the user's 0600
    registry) knows the public key to connect with, and nobody else can serve
    as those endpoints."""
    raw = hmac.new(mesh_key, b"monarch-curve-attach-v1", hashlib.sha256).digest()
    secret = z85.encode(raw)
    return zmq.curve_public(secret), secret


class KeyGate:
    """A ZAP handler for one ZeroMQ context: its CurveZMQ servers admit only
    clients whose public key ``allowed(key)`` accepts (``key``: Z85 bytes);
    any other client's handshake is refused before it can send a message.

    Start it before binding the servers it guards; :meth:`stop` it before the
    context is terminated. Refused handshakes are counted (:attr:`refused`).
    """

    def __init__(self, ctx: zmq.Context, allowed: Callable[[bytes], bool]) -> None:
        from zmq.auth.thread import ThreadAuthenticator

        self.refused = 0
        self._allowed = allowed
        self._auth = ThreadAuthenticator(ctx, log=logging.getLogger(
            "monarch_kernel.transport.sockets.zap"))
        self._auth.start()
        self._auth.configure_curve_callback(domain="*", credentials_provider=self)

    def callback(self, domain: str, key: bytes) -> bool:
        """(Called by the ZAP thread for each CurveZMQ handshake.)"""
        try:
            ok = bool(self._allowed(key))
        except Exception:
            log.exception("the CurveZMQ key check failed; the client is refused")
            ok = False
        if not ok:
            self.refused += 1
        return ok

    def stop(self) -> None:
        """Stop the ZAP thread (idempotent)."""
        with contextlib.suppress(Exception):
            self._auth.stop()


#: messages a ROUTER of :func:`bind_router` queues per connection before it stops
#: reading that connection (ZeroMQ's receive high-water mark)
RECEIVE_QUEUE = 4096


def bind_router(ctx: zmq.Context, host: str = "127.0.0.1",
                curve_secret_key: bytes | None = None, *, ipc_dir: str | None = None,
                name: str = "r", max_message: int | None = None) -> tuple[zmq.Socket, str]:
    """Bind a ROUTER socket: to a Unix socket ``name`` in ``ipc_dir`` (a
    :func:`private_dir`), or to a random TCP port on ``host``.

    With ``curve_secret_key`` (Z85, from :func:`zmq.curve_keypair`) the socket
    is a CurveZMQ server: every connection is encrypted (RFC 26 / CurveZMQ),
    and admitted by the context's ZAP handler where one runs (:class:`KeyGate`).
    A peer that sends a frame larger than ``max_message`` bytes (default
    :func:`max_message_bytes`) is disconnected.

    Returns
    -------
    socket : zmq.Socket
    address : str
        ``ipc://DIR/NAME`` or ``tcp://host:port`` for workers to connect to.

    Raises
    ------
    TransportError
        If the address cannot be bound (not an address of this machine, ...).
    """
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    _bounded(sock, max_message)
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
    # no send high-water mark: a burst of pipelined calls must neither be dropped nor
    # block the I/O thread (which would stop it draining replies: a deadlock). What a
    # peer sends is queued here up to RECEIVE_QUEUE messages per connection; beyond it
    # ZeroMQ stops reading that connection, so the sender queues (a worker's DEALER has
    # no limit, so it never blocks) and a flood costs this process bounded memory.
    sock.sndhwm = 0
    sock.rcvhwm = RECEIVE_QUEUE
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    if curve_secret_key is not None:
        sock.curve_secretkey = curve_secret_key
        sock.curve_server = True
    if ipc_dir is not None:
        address = f"ipc://{ipc_dir}/{name}"
        if len(address) - len("ipc://") > _SUN_PATH_MAX:
            sock.close(0)
            raise TransportError(f"the socket path {address[6:]!r} is longer than a Unix "
                                 f"socket allows ({_SUN_PATH_MAX} bytes); set "
                                 "XDG_RUNTIME_DIR or TMPDIR to a shorter directory")
        try:
            sock.bind(address)
        except zmq.ZMQError as e:
            sock.close(0)
            raise TransportError(f"cannot bind a socket at {address!r}: {e}") from e
        return sock, address
    try:
        port = sock.bind_to_random_port(f"tcp://{host}")
    except zmq.ZMQError as e:
        sock.close(0)
        raise TransportError(
            f"cannot bind the controller to {host!r}: {e}; "
            "pass an address of this machine (e.g. --bind 127.0.0.1)"
        ) from e
    return sock, f"tcp://{host}:{port}"


def connect_dealer(ctx: zmq.Context, address: str, identity: bytes,
                   curve_server_key: bytes | None = None,
                   client_keypair: tuple[bytes, bytes] | None = None,
                   max_message: int | None = None) -> zmq.Socket:
    """Connect a DEALER with a fixed routing identity to ``address``.

    With ``curve_server_key`` (the server's Z85 public key) the connection is
    encrypted with CurveZMQ, with ``client_keypair`` (public, secret; Z85: the
    mesh's, :func:`curve_client_keypair`, which the server admits), else a
    fresh one (which a server guarded by a :class:`KeyGate` refuses). A frame
    larger than ``max_message`` bytes (default :func:`max_message_bytes`)
    from the server closes the connection.

    Raises
    ------
    TransportError
        If ``address`` is not a valid ZeroMQ endpoint.
    """
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.sndhwm = sock.rcvhwm = 0  # see bind_router
    sock.setsockopt(zmq.IDENTITY, identity)
    _bounded(sock, max_message)
    if curve_server_key is not None:
        public, secret = client_keypair or zmq.curve_keypair()
        sock.curve_serverkey = curve_server_key
        sock.curve_publickey = public
        sock.curve_secretkey = secret
    try:
        sock.connect(address)
    except zmq.ZMQError as e:
        sock.close(0)
        raise TransportError(f"cannot connect to {address!r}: {e}") from e
    return sock


def drain(sock: zmq.Socket, small: int = 0) -> Iterator[list[Any]]:
    """Every message already waiting on ``sock`` (without blocking).

    The first ``small`` frames of each message come as ``bytes`` (a copy:
    for the few hundred bytes of a routing identity and a signed envelope,
    pyzmq's ``bytes`` cost less per message than a ``zmq.Frame``, counting
    the decoding); the rest as zero-copy
    ``zmq.Frame`` objects (the buffers of arrays and tensors).
    """
    while _get(sock, _EVENTS) & _POLLIN:  # no exception per empty read
        parts = [_recv(sock, _NOBLOCK, small > 0)]
        i = 1
        while _get(sock, _RCVMORE):
            parts.append(_recv(sock, _NOBLOCK, i < small))
            i += 1
        yield parts


def has_input(sock: zmq.Socket) -> bool:
    """Whether a message waits on ``sock`` (no syscall when none does).

    Raises
    ------
    zmq.ZMQError
        If ``sock`` is closed.
    """
    return bool(_get(sock, _EVENTS) & _POLLIN)


def inproc_pair(ctx: zmq.Context) -> tuple[zmq.Socket, str]:
    """A bound inproc PULL socket (for the I/O thread) and its address."""
    addr = f"inproc://monarch-{os.getpid()}-{next(_counter)}"
    pull = ctx.socket(zmq.PULL)
    pull.linger = 0
    pull.bind(addr)
    return pull, addr


class FdPoller:
    """:class:`zmq.Poller`'s ``register`` / ``unregister`` / ``poll`` over one
    epoll_wait(2) call (poll(2) where there is no epoll), for ZeroMQ sockets
    and plain file descriptors together.

    Why: ``zmq_poll`` with two ZeroMQ sockets among the fds costs 3 poll(2)
    and 2 getpid(2) calls even when nothing is ready (a first pass with no
    wait, then each socket's command mailbox), and poll(2) visits each of
    the controller's fds (two pipes and a lane per local rank) on the way
    into a wait and out of it. On the hot path, where messages come on lanes
    (:mod:`~monarch_kernel.transport.lane`) and the ZeroMQ sockets are mostly idle, one
    epoll_wait does.

    A ZeroMQ socket is watched through its ``ZMQ_FD``, which signals that the
    socket's state changed, not that a message waits (it is edge-triggered,
    as libzmq's documentation of ``ZMQ_FD`` says): a socket counts as ready
    when its fd fired, or when ``ZMQ_EVENTS``, asked before the wait, shows
    input. That is asked for a socket just registered, for one reported
    ready by the previous poll (whoever handles it may stop before it is
    drained) and for one marked with :meth:`touched` (this thread sent on it
    or asked its events: that may have consumed the fd's signal while a
    message still waits). One poller is used by one thread at a time, the
    thread that owns its ZeroMQ sockets.
    """

    def __init__(self) -> None:
        # epoll where there is one (Linux): a wait costs the same for 2 fds or 20,
        # where poll(2) visits every fd on the way in and out
        self._epoll = select.epoll() if hasattr(select, "epoll") else None
        self._poll = self._epoll if self._epoll is not None else select.poll()
        self._socks: dict[int, zmq.Socket] = {}  # ZMQ_FD -> socket
        self._fd_of: dict[zmq.Socket, int] = {}
        self._check: set[zmq.Socket] = set()  # sockets whose ZMQ_EVENTS are asked first

    @property
    def exclusive(self) -> bool:
        """Whether :meth:`register` can watch an fd with ``exclusive=True``
        (epoll's ``EPOLLEXCLUSIVE``: Linux 4.5 and later)."""
        return self._epoll is not None and hasattr(select, "EPOLLEXCLUSIVE")

    def register(self, obj: zmq.Socket | int, flags: int = zmq.POLLIN,
                 exclusive: bool = False) -> None:
        """Watch ``obj`` (a ZeroMQ socket or an fd) for input (``flags`` must be POLLIN).

        With ``exclusive`` (an fd, where :attr:`exclusive` holds), the fd is
        watched with ``EPOLLEXCLUSIVE``: when it is watched so by several
        pollers, input wakes one thread, the first poller (in the order
        they registered it) that has a thread waiting in it; another thread
        that waits in one of them may still see it ready later, so whoever
        reads it must cope with finding nothing (and two readers must not
        read it at once). Any thread may register an fd while another
        waits in :meth:`poll` (``epoll_ctl(2)`` is thread-safe).

        Raises
        ------
        ValueError
            If ``flags`` is not ``zmq.POLLIN``, or ``exclusive`` is asked of a
            socket or where it cannot be had.
        """
        if flags != zmq.POLLIN:
            raise ValueError("FdPoller watches for input (zmq.POLLIN) only")
        if isinstance(obj, zmq.Socket):
            if exclusive:
                raise ValueError("exclusive applies to plain fds, not ZeroMQ sockets")
            fd = cast(int, obj.getsockopt(zmq.FD))  # (an integer option)
            self._socks[fd] = obj
            self._fd_of[obj] = fd
            self._check.add(obj)
        else:
            fd = obj
        if exclusive:
            if not self.exclusive:
                raise ValueError("EPOLLEXCLUSIVE needs epoll on Linux 4.5 or later")
            # (it cannot be changed by EPOLL_CTL_MOD: an fd watched already keeps its mode)
            try:
                self._poll.register(fd, select.EPOLLIN | select.EPOLLEXCLUSIVE)
            except FileExistsError:
                pass
            return
        try:
            self._poll.register(fd, select.POLLIN)  # (EPOLLIN == POLLIN)
        except FileExistsError:  # (epoll: registered already)
            self._poll.modify(fd, select.POLLIN)

    def unregister(self, obj: zmq.Socket | int) -> None:
        """Stop watching ``obj`` (an fd closed already, or not registered, is
        ignored under epoll).

        Raises
        ------
        KeyError
            If ``obj`` is a socket that is not registered (or, under poll(2),
            an fd that is not).
        """
        if isinstance(obj, zmq.Socket):
            fd = self._fd_of.pop(obj)
            del self._socks[fd]
            self._check.discard(obj)
        else:
            fd = obj
        try:
            self._poll.unregister(fd)
        except (OSError, ValueError):  # (epoll: the fd closed already, which unregistered
            pass  # it; ValueError: this poller was closed, by a thread that stopped)

    def close(self) -> None:
        """Release the epoll fd, if any (idempotent)."""
        if self._epoll is not None:
            self._epoll.close()

    def touched(self, sock: zmq.Socket) -> None:
        """Say that this thread used ``sock`` (sent on it, asked its events)
        other than by draining it: the next :meth:`poll` asks its events first."""
        if sock in self._fd_of:
            self._check.add(sock)

    def poll(self, timeout_ms: int | None = None) -> list[tuple[Any, int]]:
        """Wait up to ``timeout_ms`` milliseconds (None: no limit) for input.

        Returns
        -------
        list of (socket or fd, int)
            What is ready, with ``zmq.POLLIN`` for a socket and the poll(2)
            events for an fd (as :meth:`zmq.Poller.poll`). A socket reported
            here should be drained (:func:`drain`).

        Raises
        ------
        zmq.ZMQError
            If a registered socket was closed.
        """
        ready: dict[Any, int] = {}
        check = self._check
        if check:
            for sock in list(check):
                if _get(sock, _EVENTS) & _POLLIN:
                    # (it stays in `check`, asked again before the next wait, even
                    # if an exception, a KeyboardInterrupt, cuts this call short:
                    # asking took its fd's signal)
                    ready[sock] = _POLLIN
                else:  # no input: its fd signals the next
                    check.discard(sock)
        if self._epoll is not None:  # (seconds, -1: no limit)
            wait = 0 if ready else -1 if timeout_ms is None else timeout_ms / 1000
            events = self._epoll.poll(wait)
        else:
            events = self._poll.poll(0 if ready else timeout_ms)
        socks = self._socks
        for fd, ev in events:
            fired = socks.get(fd)
            if fired is None:
                ready[fd] = ev
            else:  # its state changed: maybe input (the drain asks ZMQ_EVENTS)
                check.add(fired)  # (asked again before the next wait)
                ready[fired] = _POLLIN
        return list(ready.items())


class Outbox:
    """Thread-safe, order-keeping hand-off of frames to an I/O thread.

    Parameters
    ----------
    ctx : zmq.Context
    address : str
        The inproc address the I/O thread's PULL socket is bound to.
    """

    def __init__(self, ctx: zmq.Context, address: str) -> None:
        self._sock = ctx.socket(zmq.PUSH)
        self._sock.linger = 0
        self._sock.connect(address)
        self._lock = threading.Lock()
        self._closed = False

    def send(self, frames: list[Any]) -> None:
        """Queue ``frames`` for the I/O thread (never blocks on the network)."""
        with self._lock:
            if self._closed:
                raise TransportError("the connection is closed")
            send_frames(self._sock, frames)

    def try_send(self, frames: list[Any]) -> bool:
        """As :meth:`send`, but never blocking: False if the pipe is full (its
        high-water mark: the I/O thread has that many messages to read already;
        for a wake-up, one more would add nothing).

        Raises
        ------
        TransportError
            If the outbox is closed.
        """
        if not self._lock.acquire(blocking=False):
            return False  # (another thread is sending: that message wakes the reader too)
        try:
            if self._closed:
                raise TransportError("the connection is closed")
            try:
                send_frames(self._sock, frames, _NOBLOCK)
            except zmq.Again:
                return False
            return True
        finally:
            self._lock.release()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._sock.close(0)
