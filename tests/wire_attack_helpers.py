"""Helpers of the wire-attack tests (``tests/test_wire_attacks_*.py``).

Messages built and taken apart by hand (:func:`split`, :func:`fields`,
:func:`envelope`), a payload whose unpickling leaves a trace (:class:`Evil`),
a raw DEALER (:func:`dealer`), the controller's "dropped a message" warnings
(:func:`controller_drops`) and a 2-rank mesh for module fixtures
(:func:`two_rank_mesh`).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from monarch_kernel.wire import protocol as protocol

__all__ = ["Evil", "controller_drops", "count_drops", "dealer", "envelope", "fields", "split",
           "two_rank_mesh"]


def split(frames: list[Any]) -> tuple[bytes, bytes]:
    """(header bytes, payload) of a message's envelope frame (``frames[0]``)."""
    env = bytes(frames[0])
    assert env[:4] == protocol.MAGIC
    n = int.from_bytes(env[52:56], "little")
    assert 56 + n <= len(env)
    return env[56:56 + n], env[56 + n:]


def fields(header: bytes) -> dict:
    """The fields of binary header bytes (protocol._parse_header)."""
    t, mid, parent, sender, lengths, sh = protocol._parse_header(header)
    return {"t": t, "id": mid, "p": parent, "s": sender, "bl": list(lengths), "sh": list(sh)}


def envelope(header: bytes, payload: bytes, sig: bytes = b"\0" * 32,
             magic: bytes = protocol.MAGIC, epoch: int = 1, seq: int = 1) -> bytes:
    """An envelope frame built by hand, with whatever signature (unsigned variants)."""
    return (magic + sig + epoch.to_bytes(8, "little") + seq.to_bytes(8, "little")
            + len(header).to_bytes(4, "little") + header + payload)


class Evil:
    """Unpickling it creates ``path``: proof that something was unpickled."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (open, (self.path, "a"))


def dealer(ctx: zmq.Context, address: str, identity: bytes) -> zmq.Socket:
    """A DEALER with routing identity ``identity``, connected to ``address``
    (a send that cannot go within 5 s, no connection being up, raises
    ``zmq.Again`` rather than waiting for ever)."""
    s = ctx.socket(zmq.DEALER)
    s.linger = 0
    s.sndtimeo = 5000
    s.setsockopt(zmq.IDENTITY, identity)
    s.connect(address)
    return s


def count_drops(text: str, what: str = "message") -> int:
    """How many messages a log reports dropped: one per "dropped a <what>" line,
    N per summary line "dropped N more <what>s ..." (util.droplog)."""
    one = text.count(f"dropped a {what}")
    more = sum(int(n.replace(",", "")) for n in
               re.findall(rf"dropped ([\d,]+) more {re.escape(what)}", text))
    return one + more


def controller_drops(caplog) -> list[str]:
    """The controller's "dropped a message" warnings caught by ``caplog``."""
    return [r.getMessage() for r in caplog.records
            if r.name == "monarch_kernel.controller.controller"
            and "dropped a message" in r.getMessage()]


def two_rank_mesh() -> Iterator[Any]:
    """A 2-rank local mesh, stopped when the generator is closed (``yield from`` it
    in a fixture). Its workers use ZeroMQ (``MONARCH_LANES=0``), as workers on
    other hosts do: the attacks here go through the controller's sockets, and a
    lane (a socket pair a local worker inherits) has no address to attack."""
    from monarch_kernel.mesh.procmesh import spawn_procs

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MONARCH_LANES", "0")
        m = spawn_procs(2)
    try:
        yield m
    finally:
        m.stop()
