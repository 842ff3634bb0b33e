"""Which address the controller binds, so that workers on other hosts reach it.

A controller whose workers run elsewhere must listen on an address of the
interface that routes to them. :func:`address_towards` asks the kernel's
routing table which source address it would use for a destination (a UDP
socket is "connected", which sends nothing: the trick ``ip route get``
uses, and which e.g. torch.distributed's ``get_local_ip`` helpers use too).
:func:`resolve_bind` turns what a user typed after ``--bind`` (an address,
an interface name, a host name, ``0.0.0.0``) into an address to bind.
"""

from __future__ import annotations

import ipaddress
import socket

__all__ = ["address_towards", "is_wildcard", "primary_address", "resolve_bind"]

#: a TEST-NET-1 address (RFC 5737): "routed" to find the default route's source
_PROBE = "192.0.2.1"


def address_towards(host: str, port: int = 9) -> str | None:
    """The local IPv4 address this machine would use to reach ``host``.

    Parameters
    ----------
    host : str
        A host name or IPv4 address.
    port : int
        Any port (nothing is sent).

    Returns
    -------
    str or None
        None when ``host`` does not resolve or no route leads to it.
    """
    try:
        infos = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_DGRAM)
    except (OSError, UnicodeError):
        return None
    for *_, sockaddr in infos:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                s.connect(sockaddr)
                addr = s.getsockname()[0]
            except OSError:
                continue
        if addr and addr != "0.0.0.0":
            return addr
    return None


def primary_address() -> str:
    """This host's main IPv4 address: the source of its default route, else
    the address its host name resolves to, else ``127.0.0.1``."""
    addr = address_towards(_PROBE)
    if addr:
        return addr
    try:
        addr = socket.gethostbyname(socket.gethostname())
    except OSError:
        addr = ""
    return addr or "127.0.0.1"


def is_wildcard(bind: str) -> bool:
    """True for "every interface" (``0.0.0.0``, ``*``)."""
    return bind in ("0.0.0.0", "*")


def resolve_bind(bind: str) -> str:
    """The IPv4 address to bind for ``bind``.

    Parameters
    ----------
    bind : str
        An IPv4 address, ``0.0.0.0`` / ``*`` (every interface), a network
        interface name (``eth0``) or a host name of this machine.

    Returns
    -------
    str
        An IPv4 address (``0.0.0.0`` for every interface).

    Raises
    ------
    ValueError
        If ``bind`` is none of these (a one-line message saying what to pass).
    """
    bind = bind.strip()
    if is_wildcard(bind):
        return "0.0.0.0"
    try:
        ip = ipaddress.ip_address(bind)
    except ValueError:
        pass
    else:
        if ip.version != 4:
            raise ValueError(f"--bind {bind}: only IPv4 addresses are supported; "
                             "give an IPv4 address of this machine")
        return bind
    try:
        import psutil

        for fam in psutil.net_if_addrs().get(bind, []):
            if fam.family == socket.AF_INET:
                return fam.address
    except ImportError:  # pragma: no cover - psutil is a dependency
        pass
    try:
        return socket.gethostbyname(bind)
    except OSError:
        raise ValueError(
            f"--bind {bind!r} is not an IPv4 address, interface or host name of this "
            "machine; pass e.g. --bind 10.0.0.5 or --bind eth0"
        ) from None
