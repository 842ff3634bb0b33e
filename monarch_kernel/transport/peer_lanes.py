"""Peer lanes: the Unix sockets that same-host workers' actors call each other
over (:mod:`monarch_kernel.actor.peers` uses them; see its docstring).

A worker listens on a socket in Linux's abstract namespace,
``@monarch-peer-<pid>-<64 random bits>`` (gone with the process), whose
name it puts in its peer address. The listener refuses connections from
other users, and a caller checks that the listener is the peer's own
process, both with ``SO_PEERCRED``. What travels is framed and read as on
the controller's lanes (:class:`~monarch_kernel.transport.lane.Lane`, with a size
limit), and signed by :mod:`monarch_kernel.wire.protocol` as on ZeroMQ.
"""

from __future__ import annotations

import itertools
import logging
import os
import secrets
import socket
import struct
import sys

from monarch_kernel.transport import lane as _lane
from monarch_kernel.util.switches import lanes_enabled

log = logging.getLogger("monarch_kernel.actor.actor_mesh")

__all__ = ["ACCEPT_RETRY_S", "CONNECT_TIMEOUT_S", "LANE_IDENT", "dial", "enabled", "listen",
           "peer_cred", "peer_uid"]

#: seconds the lane listener is left unwatched after an accept failed (out of fds)
ACCEPT_RETRY_S = 0.5
#: seconds a caller waits for a peer's lane listener to take its connection
CONNECT_TIMEOUT_S = 1.0

#: the routing identity of a peer lane's messages starts with this (a ZeroMQ
#: identity that a worker sets never starts with a zero byte)
LANE_IDENT = b"\0lane-"
accepted_ids = itertools.count()
_PEERCRED = struct.Struct("3i")  # (pid, uid, gid) of SO_PEERCRED


def enabled() -> bool:
    """Whether this worker listens for peer lanes: on Linux (abstract socket
    names), unless ``MONARCH_LANES=0``."""
    if not sys.platform.startswith("linux") or not hasattr(socket, "SO_PEERCRED"):
        return False
    try:
        return lanes_enabled()
    except ValueError as e:  # (the controller refuses such a value before it spawns)
        log.warning("%s: peer lanes off", e)
        return False


def listen() -> tuple[socket.socket, str] | None:
    """A listening Unix socket in the abstract namespace and its name; None if
    one cannot be made (peers use ZeroMQ then)."""
    name = f"monarch-peer-{os.getpid()}-{secrets.token_hex(8)}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind("\0" + name)
        sock.listen(128)
        sock.setblocking(False)
    except OSError as e:
        log.info("no peer lane listener (%s): peers use ZeroMQ", e)
        sock.close()
        return None
    return sock, name


def peer_cred(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end of a Unix socket ((-1, -1) if unknown)."""
    try:
        pid, uid, _gid = _PEERCRED.unpack(sock.getsockopt(
            socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
        return pid, uid
    except OSError:
        return -1, -1


def peer_uid(sock: socket.socket) -> int:
    return peer_cred(sock)[1]


def dial(name: str, label: str, limit: int) -> _lane.Lane | None:
    """A lane to the listener ``name`` (``monarch-peer-PID-HEX``) if the process
    listening there is PID and of this user; else None."""
    try:
        pid = int(name.split("-")[2])
    except (IndexError, ValueError):
        return None
    sock = None
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(CONNECT_TIMEOUT_S)
        sock.connect("\0" + name)
        if peer_cred(sock) != (pid, os.getuid()):  # another process took the name
            log.warning("refused %s: the listener is not the peer's process", label)
            sock.close()
            return None
        _lane.set_buffers(sock)
        return _lane.Lane(sock, label, limit=limit)
    except OSError as e:  # not on this host (or network namespace), out of fds, ...
        log.debug("no %s (%s): ZeroMQ it is", label, e)
        if sock is not None:
            sock.close()
        return None
