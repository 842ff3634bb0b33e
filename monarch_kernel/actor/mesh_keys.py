"""Introductions between the meshes of one program, so that their actors can
call each other worker to worker (PyTorch Monarch's generators on one process
mesh calling trainers on another).

Each mesh signs its messages with a random key of its own, and a
worker can sign a call for another mesh's actor only with that mesh's key.
The meshes that one process controls (a kernel's, a script's) are introduced
to each other here, in signed ``keys`` control messages:

* the ranks of a mesh get the keys of this process's other live meshes once
  they are up (:func:`introduce`, called by the thread that spawned or
  restarted them, after their hello and before it sends them anything else);
* the ranks of the other meshes get a new mesh's key as it is made, and are
  told to drop it when it stops (their calls waiting on it then fail; a
  worker ignores a key that arrives after its drop);
* a rank of one mesh that dies fails the calls that other meshes' workers
  wait on it, as its own mesh's do (a ``rank_dead`` notice with the mesh's
  fingerprint: ``PeerHost.fail_rank``);
* in a worker that spawns meshes of its own (an actor's), its own mesh's key
  and key ring are handed down, and what the worker later learns (keys,
  drops, deaths) is passed down to them (:func:`pass_down`,
  :func:`pass_down_death`), so that the child mesh's actors can call up.

Keys travel only in signed control messages, and only to meshes whose
control channel is encrypted (CurveZMQ) or loopback: a mesh spawned beyond
loopback with ``encrypt=False`` is not introduced (its actors cannot call
the others', nor theirs it: :class:`~monarch_kernel.errors.MeshError`).
Actor handles carry a key's fingerprint (``Codec.fingerprint``), from which
the key cannot be learned. A handle of a mesh that no introduction covered
(another program's) is refused at once with a ``MeshError``.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

from monarch_kernel.errors import MeshError, MeshFailure
from monarch_kernel.transport.sockets import endpoint_host, is_loopback
from monarch_kernel.wire.messages import Keys, RankDead
from monarch_kernel.worker.worker import current_worker

log = logging.getLogger("monarch_kernel.actor.mesh_keys")

__all__ = ["check_known", "introduce", "note_peers", "pass_down", "pass_down_death", "peer_address",
           "register", "ring_for", "unregister"]

_live: weakref.WeakSet[Any] = weakref.WeakSet()  # this process's live controllers
_lock = threading.Lock()
#: per controller: the peer address of each rank's worker (from actor spawns)
_peer_addrs: weakref.WeakKeyDictionary[Any, dict[int, str]] = weakref.WeakKeyDictionary()


def note_peers(ctl: Any, peers: dict[int, str]) -> None:
    """Remember the peer addresses of ranks of ``ctl``'s mesh (an actor spawn's replies)."""
    _peer_addrs.setdefault(ctl, {}).update(peers)


def peer_address(ctl: Any, rank: int) -> str | None:
    """The peer address of rank ``rank`` of ``ctl``'s mesh (None before an actor
    was spawned there)."""
    return _peer_addrs.get(ctl, {}).get(rank)


def check_known(w: Any, mesh: str | None, what: str) -> None:
    """Raise unless worker ``w`` may sign for the mesh whose key's fingerprint
    is ``mesh`` (None or its own mesh: always; another: once introduced).

    Raises
    ------
    MeshFailure
        If that mesh was one of this program's and was stopped (as the
        controller raises for a stopped mesh).
    MeshError
        Naming ``what`` (an actor mesh, a buffer) and what to do instead.
    """
    if mesh is None or mesh == w.codec.fingerprint or mesh in getattr(w, "keyring", {}):
        return
    if mesh in getattr(w, "dropped_keys", ()):
        raise MeshFailure(f"{what} is on a process mesh of this program that was stopped "
                          "(spawn a new one: spawn_procs(...))")

    raise MeshError(
        f"{what} runs on another process mesh than this worker (rank {w.rank}), one that "
        "this worker's program did not spawn (another program's, or one that is "
        "stopped): a worker reaches its own program's meshes only (each mesh signs its "
        "messages with a key of its own). Have the controller relay: return the data to "
        "it and go on from there")


def _others(ctl: Any) -> list[Any]:
    """This process's live controllers, but ``ctl``."""
    with _lock:
        return [c for c in _live if c is not ctl and not c.stopping and not c.closed]


def _secure(ctl: Any) -> bool:
    """Whether keys may travel on ``ctl``'s control channel: encrypted, or loopback."""
    if getattr(ctl, "curve_public_key", None) is not None:
        return True
    return is_loopback(endpoint_host(ctl.address))  # (ipc://: a Unix socket, this host)


def _live_ranks(ctl: Any) -> list[int]:
    return [r for r, i in list(ctl.ranks.items()) if i.state not in ("dead", "stopped",
                                                                      "starting")]


def ring_for(ctl: Any) -> dict[str, bytes]:
    """The keys the ranks of ``ctl``'s mesh may sign calls with, by fingerprint:
    this process's other live meshes', and in a worker its own mesh's and
    those it was introduced to (none when ``ctl``'s channel is not secure)."""
    if not _secure(ctl):
        return {}
    ring = {c.codec.fingerprint: c.key for c in _others(ctl) if _secure(c)}
    w = current_worker()
    if w is not None:
        ring.update(getattr(w, "keyring", {}))
        ring[w.codec.fingerprint] = w.codec.key
    ring.pop(ctl.codec.fingerprint, None)
    return ring


def register(ctl: Any) -> None:
    """Introduce the new controller ``ctl``'s mesh to this process's other meshes
    (before any handle of it can exist), and pass its ranks' deaths on to them."""
    others = _others(ctl)
    with _lock:
        _live.add(ctl)
    ref = weakref.ref(ctl)

    def listener(kind: str, rank: int, payload: Any) -> None:
        c = ref()
        if c is not None and kind == "dead" and not c.stopping:
            _pass_on_death(c, rank, payload)

    ctl.listeners.append(listener)
    if _secure(ctl):
        for other in others:
            if _secure(other):  # (never over another mesh's unencrypted network link)
                _tell(other, Keys(add={ctl.codec.fingerprint: ctl.key}))


def introduce(ctl: Any, ranks: list[int]) -> None:
    """Give ``ranks`` of ``ctl``'s mesh, just up (spawned or restarted: a fresh
    process knows no other mesh), the keys of this program's other meshes.
    Called by the thread that started them, after their hello and before it
    sends them anything else, so no call can reach them first."""
    ring = ring_for(ctl)
    live = [r for r in ranks if r in _live_ranks(ctl)]
    if ring and live:
        try:
            ctl.notify(live, "keys", Keys(add=ring))
        except Exception as e:  # noqa: BLE001 - the mesh is closing
            log.debug("cannot introduce ranks %s: %s", live, e)


def pass_down(content: Keys) -> None:
    """In a worker: the ``keys`` it got from its controller (added or dropped) go on
    to the meshes this worker spawned itself (those whose channel is secure)."""
    for c in _others(None):
        if _secure(c):
            _tell(c, content)


def pass_down_death(content: RankDead) -> None:
    """In a worker: a ``rank_dead`` notice it got from its controller (``mesh``: the
    dead rank's mesh) goes on to the meshes this worker spawned itself."""
    for c in _others(None):
        _tell(c, content, "rank_dead")


def unregister(ctl: Any) -> None:
    """``ctl``'s mesh stops: the other meshes' workers forget its key, and their
    calls still waiting on it fail."""
    with _lock:
        was = ctl in _live
        _live.discard(ctl)
    if was:
        for other in _others(ctl):
            _tell(other, {"drop": [ctl.codec.fingerprint]})


def _tell(ctl: Any, content: Keys | RankDead, type: str = "keys") -> None:
    """A one-way ``type`` message to the live ranks of ``ctl``'s mesh."""
    ranks = _live_ranks(ctl)
    if ranks:
        try:
            ctl.notify(ranks, type, content)
        except Exception as e:  # noqa: BLE001 - that mesh is closing
            log.debug("cannot pass %s on: %s", type, e)


def _pass_on_death(ctl: Any, rank: int, failure: Any) -> None:
    addr = peer_address(ctl, rank)
    if addr is None:  # (no actor ever ran there: no other mesh can be waiting on it)
        return
    content = RankDead(rank=rank, addr=addr, reason=str(failure), mesh=ctl.codec.fingerprint)
    for other in _others(ctl):
        _tell(other, content, "rank_dead")
