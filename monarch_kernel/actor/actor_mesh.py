"""Actors: the single-controller actor API of PyTorch Monarch, in pure Python.

::

    from monarch_kernel import Actor, endpoint, this_host, current_rank

    class Counter(Actor):
        def __init__(self, start: int) -> None:
            self.n = start

        @endpoint
        def incr(self, by: int = 1) -> int:
            self.n += by
            return self.n

        @endpoint
        async def where(self) -> int:
            return current_rank().rank

    procs = this_host().spawn_procs(per_host={"procs": 4})
    counters = procs.spawn("counter", Counter, 0)         # an ActorMesh, 1 actor per rank
    counters.incr.call(2).get()                            # ValueMesh of 2, 2, 2, 2
    counters.slice(procs=1).incr.call_one().get()          # 3
    await counters.where.choose()                          # the least busy rank
    counters.incr.broadcast()                              # fire and forget
    for f in counters.incr.stream(): print(f.get())        # completion order
    procs.stop()

Adverbs of an endpoint (Monarch's names): ``call`` (every actor ->
``Future[ValueMesh]``), ``call_one`` (a mesh of exactly one actor ->
``Future[value]``), ``choose`` (the least busy actor: fewest calls in flight
from this caller), ``broadcast`` (no result; a failure is printed and kept
in :attr:`ActorMesh.broadcast_failures`), ``stream`` (one future per actor,
in completion order); and ``rref`` (every actor; the results stay on the
ranks and the caller gets a handle, :class:`monarch_kernel.tensors.handles.Ref`).

Semantics: messages from one sender to one actor arrive in order; an actor
handles one message at a time, on its own thread (async endpoints run on
its own event loop); different actors run concurrently. Calls made from the
controller go through the controller's socket; calls an actor (or a
``%%mesh`` cell) makes go worker to worker over the workers' peer sockets
(:mod:`monarch_kernel.actor.host`). Handles are picklable: pass them to
other actors as arguments.

An endpoint that waits for a call holds its actor meanwhile. A wait that
could never end raises instead of hanging: a wait for a call to the
actor's own endpoint (``RuntimeError``), and the call that would close a
wait cycle between actors (``a.p`` waits for ``b.x``, which waits for
``a.y``, queued behind ``a.p``): :class:`WaitCycleError`, see
:mod:`monarch_kernel.actor.cycles`.

What an endpoint prints during a call from the controller is shown, tagged
by rank, when its future is waited on; failures reach the caller as an
:class:`~monarch_kernel.errors.ActorError` that is also an instance of the
original exception type (both: :mod:`monarch_kernel.actor.replies`).
"""

from __future__ import annotations

import itertools
import logging
import sys
import threading
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from monarch_kernel.actor import cycles as actor_cycles
from monarch_kernel.actor.adverbs import Endpoint
from monarch_kernel.actor.context import current_actor
from monarch_kernel.actor.cycles import WaitCycleError
from monarch_kernel.actor.future import Future
from monarch_kernel.actor.host import actor_point, dispatch_call, spawn_local, stop_local
from monarch_kernel.actor.mesh_keys import check_known
from monarch_kernel.actor.peers import address_host, peer_host
from monarch_kernel.actor.replies import CallOutput
from monarch_kernel.actor.rref import pickled_count
from monarch_kernel.controller.controller import Request
from monarch_kernel.errors import (
    ActorError,
    MeshError,
    MeshFailure,
    SerializationError,
    ranks_label,
)
from monarch_kernel.mesh.shape import Point, Shape
from monarch_kernel.wire.messages import (
    ACTOR,
    IPC,
    KEEP,
    METHOD,
    ONEWAY,
    PAYLOAD,
    REFS,
    SOURCES,
    UID,
    WAITED,
    Call,
    StopActor,
)
from monarch_kernel.wire.serialize import Packed, cuda_ipc, find_unpicklable
from monarch_kernel.wire.sources import has_code, sources_for
from monarch_kernel.worker.worker import current_worker

log = logging.getLogger("monarch_kernel.actor.actor_mesh")

__all__ = [
    "Actor",
    "ActorMesh",
    "Endpoint",
    "Future",
    "WaitCycleError",
    "actor_record",
    "broadcast_failures",
    "current_rank",
    "current_size",
    "dispatch_call",
    "endpoint",
    "note_broadcast_failure",
    "on_a_rank",
    "spawn_local",
    "stop_local",
]

A = TypeVar("A")
_EMPTY = Packed.pack(((), {}))
_MAX_SOURCE = 2 * 1024 * 1024  # bytes of source shipped per file, at most

#: failures of broadcasts made from this process, newest last
_broadcast_failures: deque[ActorError] = deque(maxlen=1000)


class Actor:
    """Base class of actors.

    Subclass it, mark methods with :func:`endpoint`, and spawn one instance
    per rank with ``proc_mesh.spawn(name, MyActor, *args, **kwargs)``. The
    constructor runs on each rank, on the actor's own thread;
    :func:`current_rank` and :func:`current_size` tell it where it is.
    Classes defined in a notebook cell or in ``__main__`` are shipped by
    value (cloudpickle).
    """


def endpoint(fn: Callable | None = None) -> Any:
    """Mark a method of an :class:`Actor` as an endpoint (``@endpoint`` or ``@endpoint()``).

    Sync and ``async def`` methods both work. Inside the actor the method
    stays an ordinary method; on an :class:`ActorMesh` it becomes an
    :class:`Endpoint` with the adverbs ``call``, ``call_one``, ``choose``,
    ``broadcast`` and ``stream``.
    """
    def mark(f: Callable) -> Callable:
        if not callable(f):
            raise TypeError(f"@endpoint decorates methods, not {type(f).__name__} objects")
        f.__monarch_endpoint__ = True  # type: ignore[attr-defined]
        return f

    return mark if fn is None else mark(fn)


def current_rank() -> Point:
    """The :class:`Point` of the calling actor in its mesh (coordinates and global rank).

    On a worker outside an actor (a ``%%mesh`` cell), the worker's point.

    Raises
    ------
    RuntimeError
        On the controller (it is no rank of a mesh).
    """
    where = actor_point()
    if where is None:
        raise RuntimeError("current_rank() works inside an actor (or a %%mesh cell), "
                           "not on the controller")
    return where[0]


def current_size() -> dict[str, int]:
    """The sizes of the calling actor's mesh, e.g. ``{"hosts": 1, "procs": 4}``.

    Raises
    ------
    RuntimeError
        On the controller.
    """
    where = actor_point()
    if where is None:
        raise RuntimeError("current_size() works inside an actor (or a %%mesh cell), "
                           "not on the controller")
    return dict(where[1])


def broadcast_failures() -> list[ActorError]:
    """Failures of every broadcast made from this process (newest last, at most 1000)."""
    return list(_broadcast_failures)


# ------------------------------------------------------------ shared state
class _Record:
    """What every handle of one actor mesh shares within a process."""

    def __init__(self, uid: str, name: str, procmesh: Any = None) -> None:
        self.uid = uid
        self.name = name
        self.procmesh = procmesh
        self.stopped: dict[int, str] = {}
        self.inflight: dict[int, int] = {}
        self.failures: deque[ActorError] = deque(maxlen=1000)
        self.lock = threading.Lock()
        self.turn = itertools.count()


_records: weakref.WeakValueDictionary[str, _Record] = weakref.WeakValueDictionary()
_records_lock = threading.Lock()


def actor_record(uid: str, name: str, procmesh: Any = None) -> _Record:
    """What every handle of actor mesh ``uid`` shares in this process (made on first
    use; ``procmesh``: the mesh that spawned it, in the controller that did)."""
    with _records_lock:
        rec = _records.get(uid)
        if rec is None:
            rec = _records[uid] = _Record(uid, name, procmesh)
        return rec


def note_broadcast_failure(uid: str, err: ActorError) -> None:
    """Keep the failure of a broadcast to actor mesh ``uid`` (:func:`broadcast_failures`,
    ``ActorMesh.broadcast_failures``)."""
    _broadcast_failures.append(err)
    rec = _records.get(uid)
    if rec is not None:
        rec.failures.append(err)


def on_a_rank() -> bool:
    """Whether this process is a worker of a mesh (a rank), not a controller."""
    return current_worker() is not None


# -------------------------------------------------------------- the mesh
class ActorMesh(Generic[A]):
    """One actor per rank of a process mesh (returned by ``ProcMesh.spawn``).

    Endpoints are attributes: ``mesh.step.call(...)``. Handles are
    picklable and can be passed to other actors, which then call the
    endpoints worker to worker.

    Attributes
    ----------
    name : str
    shape : Shape
        Named dimensions and the global ranks of the actors.
    """

    def __init__(self, record: _Record, shape: Shape, peers: dict[int, str],
                 endpoints: tuple[str, ...], class_name: str, mesh: str | None = None) -> None:
        self._record = record
        self.shape = shape
        self._peers = peers
        self._endpoints = endpoints
        self._class_name = class_name
        self._mesh = mesh  # the fingerprint of its mesh's key, once it travelled

    @property
    def name(self) -> str:
        return self._record.name

    @property
    def sizes(self) -> dict[str, int]:
        """``{dimension: size}``."""
        return self.shape.dims

    @property
    def ranks(self) -> list[int]:
        """Global ranks of the actors, row-major."""
        return list(self.shape.ranks)

    def __len__(self) -> int:
        return len(self.shape)

    def __repr__(self) -> str:
        stopped = " (stopped)" if all(r in self._record.stopped for r in self.shape.ranks) else ""
        return f"<ActorMesh {self.name!r} {self._class_name} {self.shape.dims}{stopped}>"

    def slice(self, **selectors: int | slice) -> ActorMesh[A]:
        """The actors of a sub-mesh: ``procs=0`` (drops the dimension), ``procs=slice(0, 2)``.

        Raises
        ------
        MeshError
            For an unknown dimension, an index out of range or an empty slice.
        """
        return ActorMesh(self._record, self.shape.slice(**selectors), self._peers,
                         self._endpoints, self._class_name, self._mesh)

    def __getattr__(self, name: str) -> Endpoint:
        if name.startswith("_"):
            raise AttributeError(name)
        if name not in self._endpoints:
            known = ", ".join(self._endpoints) or "none"
            raise AttributeError(
                f"{self._class_name} (actor mesh {self.name!r}) has no endpoint {name!r}; "
                f"its endpoints: {known} (mark methods with @endpoint)"
            )
        ep = Endpoint(self, name)
        self.__dict__[name] = ep
        return ep

    @property
    def broadcast_failures(self) -> list[ActorError]:
        """Failures of broadcasts to this actor mesh seen by this process, newest last."""
        return list(self._record.failures)

    def __reduce__(self) -> tuple:
        return (_rebuild, (self._record.uid, self.name, self.shape.dims, self.shape.ranks,
                           self._peers, self._endpoints, self._class_name,
                           self._mesh_fingerprint()))

    def _mesh_fingerprint(self) -> str | None:
        """The fingerprint of the key of the mesh this actor mesh runs on."""
        pm = self._record.procmesh
        if pm is not None:  # (spawned by this process: its controller holds the key)
            return pm.controller.codec.fingerprint
        return self._mesh

    def _caller_worker(self) -> Any:
        """The worker that calls this actor mesh peer to peer: this process's, when
        it is a worker and did not spawn the actor mesh itself (an actor calls the
        actors of its own mesh, or of another mesh of its program:
        :mod:`monarch_kernel.actor.mesh_keys`); None when this process is the actor
        mesh's controller.

        Raises
        ------
        MeshError
            When the actor mesh runs on a mesh whose key this worker does not
            have (another program's): its processes could never accept the call.
        """
        if self._record.procmesh is not None:
            return None
        w = current_worker()
        if w is not None:
            check_known(w, self._mesh, f"actor mesh {self.name!r}")
        return w

    def _foreign(self, w: Any) -> str | None:
        """The key fingerprint of this actor mesh's mesh when it is not worker ``w``'s."""
        m = self._mesh
        return m if m is not None and m != w.codec.fingerprint else None

    # ------------------------------------------------------------- stopping
    def stop(self, timeout: float = 10.0) -> None:
        """Stop the actors of this mesh (after the messages already sent to them).

        Later calls raise :class:`MeshFailure`. Idempotent.

        Raises
        ------
        RuntimeError
            When called inside a worker (stop actor meshes from the controller).
        """
        rec = self._record
        if rec.procmesh is None:
            raise RuntimeError("stop actor meshes from the controller that spawned them")
        ranks = [r for r in self.shape.ranks if r not in rec.stopped]
        pm = rec.procmesh
        if ranks and not pm.root._stopped:
            ctl = pm.controller
            live = [r for r in ranks if ctl.ranks[r].state not in ("dead", "stopped")]
            if live:
                req = ctl.request(live, "stop_actor", StopActor(name=self.name))
                if not req.wait(timeout):
                    log.warning("actor %r did not stop within %s s", self.name, timeout)
        for r in ranks:
            rec.stopped[r] = "was stopped (ActorMesh.stop())"

    def __enter__(self) -> ActorMesh[A]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -------------------------------------------------------------- sending
    def _send(self, ranks: list[int], method: str, args: tuple, kwargs: dict,
              oneway: bool, keep: str | None = None) -> Request | None:
        """Send one call to ``ranks``; the Request that collects the replies
        (``keep``: the ranks keep the results under this id, ``Endpoint.rref``)."""
        rec = self._record
        for r in ranks:
            cause = rec.stopped.get(r)
            if cause:
                raise MeshFailure(f"actor {rec.name!r} on rank {r} {cause}", rank=r)
        handles = pickled_count() if oneway else 0
        payload = _EMPTY
        w = self._caller_worker()  # (None: this process is the actor mesh's controller)
        # to one other process on this host, big CUDA tensors go by IPC handle (both ways)
        one_here = (not oneway and len(ranks) == 1 and "torch" in sys.modules
                    and self._on_this_host(ranks[0], w))
        if args or kwargs:
            with cuda_ipc(one_here):
                try:
                    payload = Packed.pack((args, kwargs))
                except SerializationError as e:
                    found = (find_unpicklable(args, "args")
                             or find_unpicklable(kwargs, "kwargs"))
                    what = (f"{found[0]} -> {found[1]} cannot be pickled ({found[2]})"
                            if found else str(e.__cause__ or e))
                    raise SerializationError(
                        f"cannot send the arguments of {rec.name}.{method}(): {what}; "
                        "create that on the ranks instead, or leave it out of the call",
                        brief=True) from None
        content: Call = {ACTOR: rec.name, METHOD: method, UID: rec.uid, PAYLOAD: payload}
        if one_here and w is not None:
            content[IPC] = 1  # a worker calls: its reply may hold IPC handles too
        if oneway:
            content[ONEWAY] = True
            if pickled_count() != handles:
                # it carries handles (tensors.Ref) that nobody keeps alive until it ran:
                # the rank takes their values on arrival, before a later "free"
                content[REFS] = True
        if keep:
            content[KEEP] = keep
        if (args or kwargs) and has_code(args, kwargs):
            content[SOURCES] = sources_for([*args, *kwargs.values()])
        if not oneway and current_actor() is not None:
            content[WAITED] = 1  # made by an actor: tracked for wait cycles (actor_cycles)
        if w is not None:
            foreign = self._foreign(w)
            return peer_host(w).request(ranks, self._peers, content, oneway, mesh=foreign)
        pm = rec.procmesh
        if pm is None:
            raise MeshError(
                f"this handle of actor mesh {rec.name!r} lives in a process that is neither "
                "the controller that spawned it nor a worker of its mesh; it cannot call it"
            )
        pm._check()
        ctl = pm.controller
        if oneway:
            for r in ranks:
                if ctl.ranks[r].state in ("dead", "stopped"):
                    raise ctl.rank_failure(r)
            ctl.notify(ranks, "call", content)
            return None
        return ctl.request(ranks, "call", content)

    def _on_this_host(self, rank: int, w: Any) -> bool:
        """Whether ``rank`` runs on this host, in another process (``w``: the calling
        worker, None in the controller)."""
        if w is not None:  # (not this very process: an IPC handle cannot be opened there)
            here = peer_host(w).address
            return (self._peers[rank] != here
                    and address_host(self._peers[rank]) == address_host(here))
        pm = self._record.procmesh
        return pm is not None and rank in pm.controller.local_ranks

    def _future(self, ranks: list[int], method: str, args: tuple, kwargs: dict,
                finish: Callable[[Request], Any], keep: str | None = None) -> Future[Any]:
        """Send a call and return the Future that ``finish(request)`` completes."""
        rec = self._record
        try:
            req = self._send(ranks, method, args, kwargs, False, keep)
        except MeshFailure as e:
            return Future.failed(e)
        assert req is not None
        with rec.lock:
            for r in ranks:
                rec.inflight[r] = rec.inflight.get(r, 0) + 1
        def what() -> str:  # (named by a timeout)
            return f"{rec.name}.{method} on {ranks_label(ranks)}"

        if rec.procmesh is not None:  # its controller's process: this thread reads its reply
            ctl = rec.procmesh.controller
            ctl.defer_io()
            guard = None
            if current_actor() is not None:  # an actor of a worker waits:
                # its notices go to the ranks it called, signed with their mesh's key
                guard = actor_cycles.call_guard(rec.uid, rec.name, ranks, req, self._peers,
                                                codec=ctl.codec)
            fut: Future[Any] = Future(pump=CallOutput(req), waiter=ctl.wait_for,
                                      resume=ctl.resume_io, what=what, guard=guard)
        else:  # (req.waiter: worker_io.lead_wait, or None)
            guard = actor_cycles.call_guard(rec.uid, rec.name, ranks, req, self._peers)
            fut = Future(guard=guard, waiter=req.waiter, what=what)

        def done(q: Request, pinned: tuple = (args, kwargs)) -> None:
            # ``pinned``: handles (tensors.Ref) among the arguments stay alive, so their
            # values stay on the ranks, until the call is done
            with rec.lock:
                for r in ranks:
                    rec.inflight[r] -= 1
            fut._complete(lambda: finish(q))

        req.add_done_callback(done)
        return fut


def _rebuild(uid: str, name: str, dims: dict[str, int], ranks: list[int],
             peers: dict[int, str], endpoints: tuple[str, ...], class_name: str,
             mesh: str | None = None) -> ActorMesh:
    return ActorMesh(actor_record(uid, name), Shape(dims, ranks), peers, endpoints, class_name,
                     mesh)

