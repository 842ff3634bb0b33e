"""Handles to values that live on the ranks: the controller side.

The mesh should feel like one device: tensors stay on the ranks, the
controller holds handles to them, and PyTorch's own DTensor works over the
mesh's named dimensions (the rank side is :mod:`monarch_kernel.tensors.store`)::

    %mesh spawn 4 --dist gloo
    %%mesh
    x = torch.full((2, 3), float(rank))

    r = %mesh ref x                  # or mesh.ref("x"), or actors.endpoint.rref(...)
    r.shape                          # ValueMesh of (2, 3): metadata only
    r.fetch(procs=1)                 # one rank's value, to the controller
    r.gather()                       # every rank's value, a ValueMesh
    s = r.reduce("procs", "sum")     # all_reduce on the ranks: a new handle
    d = r.to_dtensor([Shard(0)])     # a DTensor over device_mesh["procs"]
    %mesh show r                     # a table: shape, dtype, device, a few values

    %%mesh
    y = r * 2                        # in a cell, a handle's name is the rank's own value

A :class:`Ref` passed to a cell, to :meth:`ProcMesh.push` or to an actor
endpoint travels as its id alone and becomes each rank's local value (no
bytes of the value move). Values are dropped on the ranks when the last
handle to them is garbage-collected on the controller (or :meth:`Ref.free`).
A handle whose rank died or was restarted raises
:class:`~monarch_kernel.errors.MeshFailure` on use.

Ideas from PyTorch's ``torch.distributed.rpc.RRef`` (a reference to a
remote value, freed when the owner's last reference goes) and PyTorch
Monarch's single-controller tensors.
"""

from __future__ import annotations

import ast
import html
import queue
import secrets
import threading
import weakref
from typing import Any

from monarch_kernel.actor.actor_mesh import on_a_rank
from monarch_kernel.actor.adverbs import set_rref
from monarch_kernel.actor.replies import raise_failures
from monarch_kernel.actor.rref import note_pickled
from monarch_kernel.errors import MeshError, MeshFailure, ranks_label
from monarch_kernel.mesh.shape import Shape, ValueMesh
from monarch_kernel.tensors.store import REDUCE_OPS, group_ranks, resolve, set_controller_rebuild
from monarch_kernel.wire.messages import Free
from monarch_kernel.wire.messages import Ref as RefRequest

__all__ = ["Ref", "RefTable", "bind_refs", "rebuild_local", "ref_of", "rref_call", "show"]

_entries: weakref.WeakValueDictionary[str, _Entry] = weakref.WeakValueDictionary()


class _Entry:
    """What every :class:`Ref` to one set of rank-side values shares; freeing
    the values is tied to its life."""

    def __init__(self, root: Any, shape: Shape, label: str) -> None:
        ranks = shape.ranks
        self.id = secrets.token_hex(8)
        self.root = root
        self.shape = shape
        self.label = label
        ctl = root.controller
        #: the worker process behind each rank when the values were made
        self.incarnation = {r: ctl.ranks[r].identity for r in ranks}
        self.freed = False
        _entries[self.id] = self
        _start_free_thread()
        self._finalizer = weakref.finalize(self, _queue_free, root, list(ranks), self.id)
        self._finalizer.atexit = False

    def free(self) -> None:
        self.freed = True
        self._finalizer()


# gc may run a finalizer in any thread, even one holding a lock the sender needs:
# finalizers only queue (SimpleQueue.put is reentrant), a daemon thread sends.
_free_queue: queue.SimpleQueue[tuple[Any, list[int], str]] = queue.SimpleQueue()
_free_thread: threading.Thread | None = None
_free_lock = threading.Lock()


def _queue_free(root: Any, ranks: list[int], id: str) -> None:
    _free_queue.put((root, ranks, id))


def _free_loop() -> None:
    while True:
        root, ranks, key = _free_queue.get()
        batch = {key: (root, ranks)}
        while True:  # send what else is queued in as few messages as possible
            try:
                root2, ranks2, id2 = _free_queue.get_nowait()
            except queue.Empty:
                break
            batch[id2] = (root2, ranks2)
        by_target: dict[tuple[int, tuple[int, ...]], tuple[Any, list[str]]] = {}
        for i, (rt, rk) in batch.items():
            by_target.setdefault((id(rt), tuple(rk)), (rt, []))[1].append(i)
        for (_, target), (rt, ids) in by_target.items():
            if rt._stopped:
                continue
            try:
                rt.controller.notify(list(target), "free", Free(ids=ids))
            except Exception:  # noqa: BLE001 - the mesh is closing: the values go with it
                pass


def _start_free_thread() -> None:
    global _free_thread
    with _free_lock:
        if _free_thread is None or not _free_thread.is_alive():
            _free_thread = threading.Thread(target=_free_loop, name="monarch-ref-free",
                                            daemon=True)
            _free_thread.start()


def rebuild_local(id: str, label: str) -> Ref:
    """A handle unpickled on the controller (a copy): the same values."""
    entry = _entries.get(id)
    if entry is None or entry.freed:
        raise MeshError(f"handle {label!r} was freed; its values are gone")
    return Ref(entry, entry.shape)


def _parse_placement(p: Any) -> tuple:
    """``Shard(0)``, ``Replicate()``, ``Partial()`` or ``"S(0)"``, ``"R"``, ``"P"``."""
    name = type(p).__name__
    if name == "Shard" and hasattr(p, "dim"):
        return ("shard", int(p.dim))
    if name == "Replicate":
        return ("replicate",)
    if name == "Partial":
        return ("partial", getattr(p, "reduce_op", "sum"))
    if isinstance(p, str):
        s = p.strip().lower().replace(" ", "")
        for prefix in ("shard(dim=", "shard(", "s(", "shard", "s"):
            if s.startswith(prefix) and s[len(prefix):].rstrip(")").lstrip("-").isdigit():
                return ("shard", int(s[len(prefix):].rstrip(")")))
        if s in ("r", "replicate", "replicate()"):
            return ("replicate",)
        if s in ("p", "partial", "partial()"):
            return ("partial", "sum")
    raise ValueError(f"{p!r} is not a placement; use Shard(dim), Replicate() or Partial() "
                     "(from torch.distributed.tensor), or 'S(0)', 'R', 'P'")


class Ref:
    """A handle to one value per rank, kept on the ranks (values never move
    unless asked for).

    Made by ``%mesh ref NAME``, :meth:`ProcMesh.ref`, an endpoint's
    ``.rref(...)``, and the methods below that return new handles.

    Attributes
    ----------
    id : str
        The key of the values in the ranks' stores.
    mesh_shape : Shape
        The named dimensions and global ranks the values live on.
    label : str
        Where the values came from (a variable name, an endpoint, an operation).
    """

    def __init__(self, entry: _Entry, shape: Shape) -> None:
        self._entry = entry
        self.mesh_shape = shape

    # --------------------------------------------------------------- basics
    @property
    def id(self) -> str:
        return self._entry.id

    @property
    def label(self) -> str:
        return self._entry.label

    @property
    def ranks(self) -> list[int]:
        """Global ranks holding a value, row-major."""
        return list(self.mesh_shape.ranks)

    def __len__(self) -> int:
        return len(self.mesh_shape)

    def __repr__(self) -> str:
        state = " (freed)" if self._entry.freed else ""
        return f"<Ref {self.label!r} on {self.mesh_shape.dims}{state}>"

    def __reduce__(self) -> tuple:
        # a handle travels as its id: on a rank it unpickles to that rank's value
        note_pickled()  # (a one-way call that carries handles is unpickled on arrival)
        return (resolve, (self.id, self.ranks, self.label, self._entry.root.controller.address))

    def slice(self, **selectors: int | slice) -> Ref:
        """The same values on a sub-mesh (``procs=0``, ``procs=slice(0, 2)``).

        Raises
        ------
        MeshError
            For an unknown dimension or an index out of range.
        """
        return Ref(self._entry, self.mesh_shape.slice(**selectors))

    def free(self) -> None:
        """Drop the values on the ranks now (every handle to them becomes unusable)."""
        self._entry.free()

    def _check(self, ranks: list[int] | None = None) -> None:
        """Raise unless every rank of ``ranks`` (default: this handle's) still holds
        its value.

        Raises
        ------
        MeshError
            If the handle was freed.
        MeshFailure
            If the mesh was stopped, or a rank died or was restarted.
        """
        e = self._entry
        if e.freed:
            raise MeshError(f"handle {self.label!r} was freed; its values are gone")
        e.root._check()
        ctl = e.root.controller
        for r in self.mesh_shape.ranks if ranks is None else ranks:
            info = ctl.ranks[r]
            if info.state in ("dead", "stopped"):
                err = ctl.rank_failure(r)
                err.args = (f"handle {self.label!r} lost its value on rank {r}: {err.args[0]}",)
                raise err
            if info.state != "starting" and info.identity != e.incarnation[r]:
                raise MeshFailure(f"handle {self.label!r}: rank {r} was restarted after the "
                                  "handle was made; the value it held there is lost", rank=r)

    def _ask(self, op: str, ranks: list[int] | None = None, **content: Any) -> dict[int, Any]:
        """Run one ``ref`` request on ``ranks`` (default: all); the replies per rank."""
        ranks = self.ranks if ranks is None else ranks
        self._check(ranks)
        root = self._entry.root
        req = root.request("ref", RefRequest(  # (content: the keys of this op's request)
            op=op, id=self.id, label=self.label, **content), ranks)  # type: ignore[typeddict-item]
        root.collect(req, ranks)
        return {r: req.replies[r][1] for r in ranks}

    def _derived(self, op: str, label: str, **content: Any) -> Ref:
        entry = _Entry(self._entry.root, self.mesh_shape, label)
        try:
            self._ask(op, new=entry.id, **content)
        except BaseException:
            entry.free()  # ranks that made their value drop it again
            raise
        return Ref(entry, self.mesh_shape)

    def _mesh_dims(self) -> dict[str, int]:
        root = self._entry.root
        if not root.dist:
            raise MeshError("this needs torch.distributed on the mesh; spawn it with "
                            "--dist gloo (CPU) or --dist nccl (GPU)")
        return root.shape.dims

    def _need_groups(self, over: list[str], what: str) -> None:
        dims = self._mesh_dims()
        for d in over:
            if d not in dims:
                raise MeshError(f"{what}: the mesh has no dimension {d!r}; its dimensions: "
                                f"{list(dims)}")
        mine = set(self.ranks)
        for r in self.ranks:
            missing = [g for g in group_ranks(dims, r, over) if g not in mine]
            if missing:
                raise MeshError(f"{what} over {over} needs {ranks_label(missing)}, which this "
                                f"handle does not live on (it lives on "
                                f"{ranks_label(self.ranks)})")

    # ------------------------------------------------------------- metadata
    def meta(self, preview: int = 0) -> ValueMesh:
        """Per rank: type, shape, dtype, device, bytes (and ``preview`` leading
        values), without moving the values.

        Returns
        -------
        ValueMesh of dict
            See :func:`monarch_kernel.tensors.store.describe`.
        """
        got = self._ask("meta", preview=preview)
        return ValueMesh(self.mesh_shape, [got[r] for r in self.ranks])

    @property
    def shape(self) -> ValueMesh:
        """Each rank's value's shape (a tuple; None for values without one; a
        DTensor: its local shard's), asked of the ranks: no data moves."""
        return ValueMesh(self.mesh_shape, [m.get("shape") for m in self.meta()])

    @property
    def dtype(self) -> ValueMesh:
        """Each rank's value's dtype name (``"float32"``), or None."""
        return ValueMesh(self.mesh_shape, [m.get("dtype") for m in self.meta()])

    # --------------------------------------------------------------- values
    def fetch(self, **coords: int) -> Any:
        """One rank's value, moved to the controller (a DTensor: its local shard).

        Parameters
        ----------
        **coords : int
            The point, e.g. ``procs=1``; dimensions of size 1 may be left out.

        Raises
        ------
        MeshError
            Unless ``coords`` pick exactly one rank.
        """
        sub = self.mesh_shape.slice(**coords) if coords else self.mesh_shape
        if len(sub) != 1:
            raise MeshError(f"fetch() needs one point of {self.mesh_shape.dims}; got {coords} "
                            "(e.g. fetch(procs=1)); gather() fetches every rank's value")
        rank = sub.ranks[0]
        return self._ask("get", [rank])[rank]

    def gather(self) -> ValueMesh:
        """Every rank's value, moved to the controller (DTensors: local shards)."""
        got = self._ask("get")
        return ValueMesh(self.mesh_shape, [got[r] for r in self.ranks])

    def full_tensor(self) -> Any:
        """The whole tensor behind a DTensor handle (``DTensor.full_tensor()`` run on
        the ranks, a collective; only the first rank's copy is sent).

        Raises
        ------
        RemoteError
            (also a TypeError) if the values are not DTensors.
        """
        first = self.ranks[0]
        return self._ask("full", send=first)[first]

    # ------------------------------------------------------------ operations
    def reduce(self, dims: str | list[str] | tuple[str, ...], op: str = "sum") -> Ref:
        """All-reduce over mesh dimension(s), run on the ranks (with the
        DeviceMesh's process group of each dimension); the result stays there.

        Parameters
        ----------
        dims : str or sequence of str
            ``"procs"``, or ``("hosts", "procs")``.
        op : {"sum", "avg", "prod", "min", "max"}

        Returns
        -------
        Ref
            A new handle: each rank holds the reduction over its group (ranks
            that differ only along ``dims`` hold equal values).

        Raises
        ------
        MeshError
            Without ``--dist``, for an unknown dimension, or when the handle
            does not live on every rank of the groups.
        ValueError
            For an unknown ``op``.
        """
        over = [dims] if isinstance(dims, str) else list(dims)
        if not over:
            raise ValueError("reduce() needs at least one dimension, e.g. reduce('procs')")
        if op not in REDUCE_OPS:
            raise ValueError(f"unknown reduce op {op!r}; use one of {', '.join(REDUCE_OPS)}")
        self._need_groups(over, "reduce()")
        return self._derived("reduce", f"{self.label}.reduce({','.join(over)}, {op})",
                             dims=over, reduce_op=op)

    def to_dtensor(self, placements: Any, dims: str | list[str] | None = None, *,
                   local: bool = True) -> Ref:
        """Make a DTensor of each rank's tensor, on the DeviceMesh of ``dims``.

        Parameters
        ----------
        placements : sequence
            One per mesh dimension used: ``Shard(d)``, ``Replicate()``,
            ``Partial()`` (``torch.distributed.tensor``) or ``"S(0)"``, ``"R"``, ``"P"``.
        dims : str or list of str, optional
            The device-mesh dimensions; by default every dimension if there
            are as many placements, else the dimensions of size > 1 (so on a
            1x4 mesh ``[Shard(0)]`` means ``device_mesh["procs"]``).
        local : bool
            True: each rank's tensor is its local shard
            (``DTensor.from_local``). False: each rank holds the whole tensor
            and the first rank of each device-mesh group distributes its copy
            (``distribute_tensor``).

        Returns
        -------
        Ref
            A handle to the DTensors.

        Raises
        ------
        MeshError
            Without ``--dist``, or when placements and dimensions do not match.
        """
        if not isinstance(placements, (list, tuple)):
            placements = [placements]
        spec = [_parse_placement(p) for p in placements]
        mesh_dims = self._mesh_dims()
        if dims is None:
            if len(spec) == len(mesh_dims):
                use = list(mesh_dims)
            else:
                use = [d for d, s in mesh_dims.items() if s > 1] or list(mesh_dims)[-1:]
        else:
            use = [dims] if isinstance(dims, str) else list(dims)
        if len(use) != len(spec):
            raise MeshError(f"to_dtensor(): {len(spec)} placements for the device-mesh "
                            f"dimensions {use}; give one placement per dimension, or name "
                            "the dimensions with dims=")
        self._need_groups(use, "to_dtensor()")
        text = ", ".join(f"{p[0]}({p[1]})" if len(p) > 1 else p[0] for p in spec)
        return self._derived("dtensor", f"{self.label}.to_dtensor([{text}])",
                             placements=spec, dims=use, local=local)

    def map(self, fn: Any, *args: Any, **kwargs: Any) -> Ref:
        """``fn(value, *args, **kwargs)`` on every rank; a handle to the results
        (they stay on the ranks). ``fn`` may be a lambda or a notebook function."""
        name = getattr(fn, "__name__", type(fn).__name__)
        return self._derived("map", f"{self.label}.map({name})", fn=fn, args=args,
                             kwargs=kwargs)

    # -------------------------------------------------------------- display
    def table(self, preview: int = 6) -> RefTable:
        """A per-rank table (shape, dtype, device, a few values): ``%mesh show``."""
        return RefTable(self.label, self.meta(preview))


def ref_of(procmesh: Any, name: str) -> Ref:
    """A handle to variable ``name`` of every rank of ``procmesh`` (``ProcMesh.ref``).

    Raises
    ------
    ValueError
        If ``name`` is not an identifier.
    RemoteError
        (also a NameError) if a rank has no such variable.
    """
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"{name!r} is not a variable name; e.g. mesh.ref('x')")
    procmesh._check()
    entry = _Entry(procmesh.root, procmesh.shape, name)
    try:
        req = procmesh.request("ref", RefRequest(op="keep", id=entry.id, name=name))
        procmesh.collect(req)
    except BaseException:
        entry.free()
        raise
    return Ref(entry, procmesh.shape)


def rref_call(ep: Any, args: tuple, kwargs: dict[str, Any]) -> Ref:
    """Run endpoint ``ep`` on every actor of its mesh and keep the results there
    (``Endpoint.rref``)."""
    mesh = ep._mesh
    rec = mesh._record
    if rec.procmesh is None or on_a_rank():
        raise RuntimeError("rref() makes handles for the controller; call it from the "
                           "controller that spawned the actors")

    entry = _Entry(rec.procmesh.root, mesh.shape, f"{mesh._class_name}.{ep._name}")
    name = mesh.name

    def finish(req: Any) -> None:
        raise_failures(req, name)

    try:
        mesh._future(mesh.shape.ranks, ep._name, args, kwargs, finish, keep=entry.id).get()
    except BaseException:
        entry.free()
        raise
    return Ref(entry, mesh.shape)


set_rref(rref_call)  # Endpoint.rref
set_controller_rebuild(rebuild_local)  # a handle unpickled on its controller: a handle


# ------------------------------------------------------------------ cells

def _names_in(code: str) -> set[str]:
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return set()  # the ranks report it
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}


def bind_refs(procmesh: Any, ranks: list[int], code: str, user_ns: dict[str, Any]) -> list[str]:
    """Before a ``%%mesh`` cell: make every notebook name that the cell uses and
    that holds a :class:`Ref` mean that handle's local value on each rank
    (a push of handle ids: no bytes of the values move).

    Returns
    -------
    list of str
        The names bound.

    Raises
    ------
    MeshError
        If a handle does not live on every rank of the cell.
    MeshFailure
        If a handle's rank died or was restarted.
    """
    refs = {n: v for n in sorted(_names_in(code)) if isinstance(v := user_ns.get(n), Ref)}
    if not refs:
        return []
    for name, r in refs.items():
        if r._entry.root is not procmesh.root:
            raise MeshError(f"{name!r} is a handle to values of another (or a stopped) mesh; "
                            f"make a new one (%mesh ref NAME) or  del {name}")
        held = set(r.ranks)
        missing = [k for k in ranks if k not in held]
        if missing:
            raise MeshError(f"{name!r} is a handle to values on {ranks_label(r.ranks)}; this "
                            f"cell also runs on {ranks_label(missing)} (use %%mesh --ranks)")
        r._check(ranks)
    procmesh.collect(procmesh.request("push", refs, ranks), ranks)
    return list(refs)


# ---------------------------------------------------------------- display
class RefTable:
    """Per-rank description of a handle's values (``%mesh show``): text and HTML.

    Parameters
    ----------
    label : str
    meta : ValueMesh of dict
        From :meth:`Ref.meta` with a preview.
    """

    COLUMNS = ("type", "shape", "dtype", "device", "values")

    def __init__(self, label: str, meta: ValueMesh) -> None:
        self.label = label
        self.meta = meta

    def rows(self) -> list[list[str]]:
        out = []
        for p, m in self.meta.items():
            kind = m["type"]
            if "placements" in m:
                kind += f"[{', '.join(m['placements'])}] global {_dims(m['global_shape'])}"
            values = m.get("values")
            if values is not None:
                text = ", ".join(_num(v) for v in values)
                nelem = 1
                for s in m.get("shape") or ():
                    nelem *= s
                text = f"[{text}{', ...' if nelem > len(values) else ''}]"
            else:
                text = m.get("repr", "")
            shape = m.get("shape")
            out.append([str(p.rank), *(str(p[k]) for k in self.meta.shape.labels), kind,
                        "" if shape is None else _dims(shape), m.get("dtype", ""),
                        m.get("device", ""), text])
        return out

    def _head(self) -> list[str]:
        return ["rank", *self.meta.shape.labels, *self.COLUMNS]

    def __repr__(self) -> str:
        head, rows = self._head(), self.rows()
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
        lines = [f"{self.label} on {self.meta.shape.dims}:",
                 "  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)).rstrip()]
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                  for r in rows]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{html.escape(h)}</th>" for h in self._head())
        body = "".join("<tr>" + "".join(f"<td style='text-align:left'>{html.escape(c)}</td>"
                                        for c in r) + "</tr>" for r in self.rows())
        return (f"<div><b>{html.escape(self.label)}</b> on "
                f"{html.escape(str(self.meta.shape.dims))}<table><thead><tr>{head}</tr>"
                f"</thead><tbody>{body}</tbody></table></div>")


def _dims(shape: Any) -> str:
    return "x".join(str(s) for s in shape) if len(shape) else "scalar"


def _num(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def show(procmesh: Any, target: Any, preview: int = 6) -> RefTable:
    """The table of ``%mesh show``: of a :class:`Ref`, or of a variable named
    ``target`` on every rank of ``procmesh``."""
    if isinstance(target, Ref):
        return target.table(preview)
    if not isinstance(target, str) or not target.isidentifier():
        raise ValueError(f"{target!r} is neither a handle nor a variable name")
    req = procmesh.request("ref", RefRequest(op="meta", name=target, preview=preview))
    vm = procmesh.collect(req)
    return RefTable(target, ValueMesh(procmesh.shape, vm.values()))
