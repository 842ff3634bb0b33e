"""An actor mesh's endpoints and their adverbs: ``call``, ``call_one``,
``choose``, ``broadcast``, ``rref`` and ``stream`` (the names and meanings
of PyTorch Monarch's endpoint adverbs). ``mesh.method`` is an
:class:`Endpoint`; the calls themselves go through
:class:`~monarch_kernel.actor.actor_mesh.ActorMesh`."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from monarch_kernel.actor import cycles as actor_cycles
from monarch_kernel.actor.future import Future
from monarch_kernel.actor.replies import raise_failures
from monarch_kernel.mesh.shape import ValueMesh

if TYPE_CHECKING:
    from monarch_kernel.actor.actor_mesh import ActorMesh
    from monarch_kernel.controller.request import Request

__all__ = ["Endpoint", "set_rref"]

#: what ``Endpoint.rref`` runs: ``rref(endpoint, args, kwargs)``, set by the module of
#: the handles it returns (:mod:`monarch_kernel.tensors.handles`) when it is imported
_rref: Callable[[Endpoint, tuple, dict[str, Any]], Any] | None = None


def set_rref(rref: Callable[[Endpoint, tuple, dict[str, Any]], Any]) -> None:
    """Make ``rref(endpoint, args, kwargs)`` the implementation of :meth:`Endpoint.rref`."""
    global _rref
    _rref = rref


class Endpoint:
    """An endpoint of an :class:`ActorMesh`, with its adverbs.

    Parameters
    ----------
    mesh : ActorMesh
    name : str
        The method's name.
    """

    def __init__(self, mesh: ActorMesh, name: str) -> None:
        self._mesh = mesh
        self._name = name

    def __repr__(self) -> str:
        return f"<Endpoint {self._mesh._class_name}.{self._name} of {self._mesh!r}>"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            f"an endpoint is not called directly; use .call(...) (every actor), .call_one(...), "
            f".choose(...), .broadcast(...) or .stream(...) on {self._name!r}"
        )

    def call(self, *args: Any, **kwargs: Any) -> Future[ValueMesh]:
        """Call every actor of the mesh.

        Returns
        -------
        Future of ValueMesh
            One value per actor, in the mesh's shape.
        """
        mesh = self._mesh
        shape = mesh.shape
        name = mesh.name

        def finish(req: Request) -> ValueMesh:
            raise_failures(req, name, self._name, shape)
            return ValueMesh(shape, [req.replies[r][1].unpack() for r in shape.ranks])

        return mesh._future(shape.ranks, self._name, args, kwargs, finish)

    def call_one(self, *args: Any, **kwargs: Any) -> Future[Any]:
        """Call the only actor of a mesh of size 1 (slice first: ``mesh.slice(procs=0)``).

        Raises
        ------
        ValueError
            If the mesh has more than one actor.
        """
        mesh = self._mesh
        if len(mesh) != 1:
            raise ValueError(
                f"call_one() needs an actor mesh of exactly 1 actor, but {mesh.name!r} has "
                f"{len(mesh)} {mesh.sizes}; slice it first (e.g. .slice(procs=0)) or use "
                "call() or choose()"
            )
        return self._one(mesh.shape.ranks[0], args, kwargs)

    def _one(self, rank: int, args: tuple, kwargs: dict) -> Future[Any]:
        name = self._mesh.name

        def finish(req: Request) -> Any:
            raise_failures(req, name, self._name)
            return req.replies[rank][1].unpack()

        return self._mesh._future([rank], self._name, args, kwargs, finish)

    def choose(self, *args: Any, **kwargs: Any) -> Future[Any]:
        """Call one actor: the one with the fewest calls in flight from this process
        (ties go round robin).

        Returns
        -------
        Future
            That actor's value.
        """
        mesh = self._mesh
        rec = mesh._record
        ctl = rec.procmesh.controller if rec.procmesh is not None else None
        ranks = [r for r in mesh.shape.ranks if r not in rec.stopped and (
            ctl is None or ctl.ranks[r].state not in ("dead", "stopped"))] or mesh.shape.ranks
        with rec.lock:
            start = next(rec.turn) % len(ranks)
            order = ranks[start:] + ranks[:start]
            rank = min(order, key=lambda r: rec.inflight.get(r, 0))
        return self._one(rank, args, kwargs)

    def broadcast(self, *args: Any, **kwargs: Any) -> None:
        """Call every actor without waiting for results (fire and forget).

        A failure on a rank is not lost: it is logged, printed to stderr and
        kept in :attr:`ActorMesh.broadcast_failures` (and
        :func:`broadcast_failures`) of the controller.

        Raises
        ------
        MeshFailure
            If an actor is already stopped or its process is dead.
        """
        self._mesh._send(self._mesh.shape.ranks, self._name, args, kwargs, True)

    def rref(self, *args: Any, **kwargs: Any) -> Any:
        """Call every actor (from the controller) and keep the results on the ranks;
        returns a handle to them, :class:`monarch_kernel.tensors.handles.Ref` (raises like
        :meth:`call`).

        Raises
        ------
        RuntimeError
            Outside a controller that spawned the actors (no handles there).
        """
        if _rref is None:  # (no handles module loaded: no ProcMesh in this process either)
            raise RuntimeError("rref() makes handles for the controller; call it from the "
                               "controller that spawned the actors")
        return _rref(self, args, kwargs)

    def stream(self, *args: Any, **kwargs: Any) -> Iterator[Future[Any]]:
        """Call every actor; return an iterator of one future per actor, in completion
        order (the k-th future holds the k-th value to arrive; ``.get()`` or ``await``).

        The calls are sent at once, before the iterator is used.
        """
        inner = [self._one(r, args, kwargs) for r in self._mesh.shape.ranks]
        pumps = [f._pump for f in inner if f._pump is not None]

        def pump(final: bool) -> None:
            for p in pumps:
                p(final)

        guard = (actor_cycles.any_of_guard(inner)
                 if any(f._guard is not None for f in inner) else None)
        slots: list[Future[Any]] = [Future(pump=pump if pumps else None, guard=guard)
                                    for _ in inner]
        counter = itertools.count()

        def arrived(f: Future[Any]) -> None:
            slots[next(counter)]._complete(lambda: f.get(0))

        for f in inner:
            f.add_done_callback(arrived)
        return iter(slots)
