"""Spawning actor meshes, and what the controller hears about them.

:func:`spawn_actor_mesh` (behind ``ProcMesh.spawn``) constructs one actor
per rank and returns the :class:`~monarch_kernel.actor.actor_mesh.ActorMesh`. A
listener on the controller reports broadcast failures (printed to stderr,
kept in :func:`~monarch_kernel.actor.actor_mesh.broadcast_failures` and the mesh's
``broadcast_failures``) and tells workers when a rank died, so calls they
make to it fail at once instead of waiting.
"""

from __future__ import annotations

import logging
import secrets
import sys
import weakref
from typing import Any

from monarch_kernel.actor.actor_mesh import Actor, ActorMesh, actor_record, note_broadcast_failure
from monarch_kernel.actor.future import Future
from monarch_kernel.actor.mesh_keys import note_peers, peer_address
from monarch_kernel.actor.replies import CallOutput
from monarch_kernel.errors import (
    ActorError,
    RemoteFailure,
    group_failures,
    raise_request_failures,
    remote_exception,
)
from monarch_kernel.wire.messages import ActorErrorEvent, Failure, RankDead, SpawnActor, StopActor
from monarch_kernel.wire.serialize import Packed
from monarch_kernel.wire.sources import sources_for

__all__ = ["existing_actor_mesh", "spawn_actor_mesh"]

log = logging.getLogger("monarch_kernel.actor.actor_mesh")


def _endpoint_names(cls: type) -> tuple[str, ...]:
    names: dict[str, None] = {}
    for klass in reversed(cls.__mro__):
        for k, v in vars(klass).items():
            f = getattr(v, "__func__", v)
            if getattr(f, "__monarch_endpoint__", False):
                names[k] = None
            elif k in names:
                del names[k]  # overridden without @endpoint
    return tuple(names)


def spawn_actor_mesh(procmesh: Any, name: str, cls: type, args: tuple,
                     kwargs: dict[str, Any], timeout: float | None = None) -> ActorMesh:
    """Construct ``cls(*args, **kwargs)`` on every rank of ``procmesh`` (see ``ProcMesh.spawn``).

    Raises
    ------
    TypeError
        If ``cls`` is not a subclass of :class:`Actor`.
    ValueError
        For a bad name, or one already used by a running actor on these ranks.
    ActorError
        If the constructor raised (an instance of the original type too);
        the actors that were constructed are stopped again.
    MeshFailure
        If the mesh is stopped or a rank died.
    """
    if not (isinstance(cls, type) and issubclass(cls, Actor)):
        raise TypeError(
            f"spawn() needs a subclass of monarch_kernel.Actor, got {cls!r}; define "
            "class MyActor(Actor) with @endpoint methods"
        )
    if not isinstance(name, str) or not name or name.startswith("_"):
        raise ValueError(f"actor mesh name {name!r}: give a non-empty name, e.g. 'trainer'")
    endpoints = _endpoint_names(cls)
    clash = [e for e in endpoints if hasattr(ActorMesh, e) or e == "shape" or e[:1] == "_"]
    if clash:
        raise ValueError(
            f"endpoint {clash[0]!r} of {cls.__qualname__} cannot be reached on an ActorMesh "
            "(an ActorMesh attribute has that name, or it starts with '_'); rename the method"
        )
    procmesh._check()
    ctl = procmesh.controller
    _listen(ctl)
    uid = secrets.token_hex(8)
    shape = procmesh.shape
    content = SpawnActor(name=name, uid=uid, dims=shape.dims, ranks=shape.ranks,
                         init=Packed.pack((cls, args, kwargs)), sources=sources_for([cls]))
    req = ctl.request(shape.ranks, "spawn_actor", content)
    fut: Future[None] = Future(pump=CallOutput(req))
    req.add_done_callback(lambda q: fut.set_result(None))
    fut.get(timeout)
    raise_request_failures(req, actor=name)
    failed = [RemoteFailure(r, _unpack_exc(v["failure"]), v["failure"]["type"],
                            v["failure"]["message"], v["failure"]["traceback"], name,
                            v["failure"].get("tree"))
              for r, (_, v) in sorted(req.replies.items()) if "failure" in v]
    if failed:
        built = [r for r, (_, v) in req.replies.items() if "failure" not in v]
        if built:
            ctl.request(built, "stop_actor", StopActor(name=name)).wait(10)
        groups = group_failures(failed)
        err = remote_exception(groups[0], ActorError)
        if len(groups) > 1:
            err.others = [remote_exception(g, ActorError) for g in groups[1:]]
        raise err
    rec = actor_record(uid, name, procmesh.root)
    peers = {r: v["peer"] for r, (_, v) in req.replies.items()}
    note_peers(ctl, peers)
    return ActorMesh(rec, shape, peers, endpoints, cls.__qualname__)


def existing_actor_mesh(procmesh: Any, name: str, uid: str, peers: dict[int, str],
                        endpoints: tuple[str, ...], class_name: str) -> ActorMesh:
    """A handle to actor mesh ``name`` (``uid``) that already runs on the ranks of
    ``procmesh`` (reported by them when a controller attached): ``peers`` are
    the ranks' peer addresses, ``endpoints`` the class's endpoint names."""
    ctl = procmesh.controller
    _listen(ctl)
    note_peers(ctl, peers)
    rec = actor_record(uid, name, procmesh.root)
    return ActorMesh(rec, procmesh.shape, peers, tuple(endpoints), class_name)


def _unpack_exc(failure: Failure) -> BaseException | None:
    exc = failure.get("exc")
    if isinstance(exc, Packed):
        try:
            return exc.unpack()
        except Exception:  # noqa: BLE001
            return None
    return exc


# -------------------------------------------------- controller listeners
_listening: weakref.WeakSet[Any] = weakref.WeakSet()


def _listen(ctl: Any) -> None:
    """Hear broadcast failures and dead ranks on ``ctl`` (once per controller)."""
    if ctl in _listening:
        return
    _listening.add(ctl)
    ref = weakref.ref(ctl)

    def listener(kind: str, rank: int, payload: Any) -> None:
        c = ref()
        if c is None:
            return
        if kind == "event" and isinstance(payload, dict) and payload.get("kind") == "actor_error":
            _on_broadcast_failure(rank, payload)
        elif kind == "dead":
            live = [r for r, i in c.ranks.items() if i.state not in ("dead", "stopped")]
            addr = peer_address(c, rank)
            try:
                c.notify(live, "rank_dead", RankDead(rank=rank, addr=addr, reason=str(payload)))
            except Exception as e:  # noqa: BLE001 - the mesh is closing
                log.debug("cannot tell the workers that rank %d died: %s", rank, e)

    ctl.listeners.append(listener)


def _on_broadcast_failure(rank: int, event: Any) -> None:
    p: ActorErrorEvent = event
    f = p["failure"]
    err = remote_exception(
        [RemoteFailure(rank, _unpack_exc(f), f["type"], f["message"], f["traceback"],
                       p["actor"], f.get("tree"))], ActorError)
    note_broadcast_failure(p.get("uid") or "", err)
    text = (f"broadcast {p['actor']}.{p['method']} failed on rank {rank}: "
            f"{f['type']}: {f['message']}")
    log.debug("%s", text)
    try:
        print(f"[monarch] {text}", file=sys.stderr, flush=True)
    except Exception as e:  # noqa: BLE001 - a closed stream must not break the I/O thread
        log.warning("%s (cannot print it: %s)", text, e)
