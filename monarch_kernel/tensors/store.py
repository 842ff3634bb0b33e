"""The rank side of distributed values: the value store and the DeviceMesh.

Each worker keeps the values that controller-side handles
(:class:`monarch_kernel.tensors.handles.Ref`) point to in a process-wide store,
keyed by the handle's id. The controller asks for them with ``ref``
requests (run on the worker's main thread, in arrival order with cells)::

    {"op": "keep",   "id": ID, "name": NAME}          namespace[NAME] -> store[ID]
    {"op": "meta",   "id": ID | "name": NAME, "preview": K}   type, shape, dtype, device
    {"op": "get",    "id": ID}                         the value (a DTensor: its local shard)
    {"op": "full",   "id": ID, "send": RANK}           DTensor.full_tensor() (a collective)
    {"op": "reduce", "id": ID, "new": ID2, "dims": [...], "reduce_op": "sum"}
    {"op": "dtensor", "id": ID, "new": ID2, "placements": [...], "dims": [...], "local": bool}
    {"op": "map",    "id": ID, "new": ID2, "fn": f, "args": (...), "kwargs": {...}}

and drops them with one-way ``free`` messages (``{"ids": [...]}``), handled
on the worker's I/O thread. An actor endpoint called with ``.rref()`` keeps
its result here through :func:`keep` (from the actor's thread).

A handle that travels to a rank (a ``%%mesh`` cell's binding, a push, an
endpoint argument) is unpickled by :func:`resolve` into the rank's local
value: no bytes of the value move.

With ``--dist``, :func:`init_device_mesh` builds a
:class:`torch.distributed.device_mesh.DeviceMesh` over the mesh's own named
dimensions (the idea and the API are PyTorch's: ``init_device_mesh``,
``DeviceMesh.get_group(dim)``, ``device_mesh["procs"]``).
"""

from __future__ import annotations

import math
import sys
import threading
from collections.abc import Callable
from typing import Any

from monarch_kernel.actor.rref import set_result_keeper
from monarch_kernel.errors import MeshError, MeshFailure, ranks_label
from monarch_kernel.wire.messages import Ref
from monarch_kernel.worker import handlers
from monarch_kernel.worker.worker import current_worker

__all__ = ["describe", "device_mesh", "free", "handle", "init_device_mesh", "keep", "local_ids",
           "resolve", "set_controller_rebuild"]

_store: dict[str, Any] = {}
_lock = threading.Lock()
_device_mesh: Any = None
_backend: str | None = None

#: reduce operations of ``Ref.reduce``; "avg" is a sum divided by the group size
REDUCE_OPS = ("sum", "avg", "prod", "min", "max")


# ------------------------------------------------------------ device mesh
def init_device_mesh(shape: dict[str, int], backend: str) -> Any:
    """Build this rank's DeviceMesh over the mesh's named dimensions (after
    ``init_process_group``; a collective: every rank calls it).

    Parameters
    ----------
    shape : dict of str to int
        The mesh's dimensions, outermost first, e.g. ``{"hosts": 1, "procs": 4}``;
        ranks are numbered row-major, as ``init_device_mesh`` numbers them.
    backend : str
        ``"gloo"`` (device type ``cpu``) or ``"nccl"`` (``cuda``).

    Returns
    -------
    torch.distributed.device_mesh.DeviceMesh
        Also kept for :func:`device_mesh`.
    """
    global _device_mesh, _backend
    from torch.distributed.device_mesh import init_device_mesh as _init

    device_type = "cuda" if backend == "nccl" else "cpu"
    _device_mesh = _init(device_type, tuple(shape.values()), mesh_dim_names=tuple(shape))
    _backend = backend
    return _device_mesh


def device_mesh() -> Any:
    """The rank's :class:`~torch.distributed.device_mesh.DeviceMesh`, whose
    dimension names and sizes are the mesh's own (``("hosts", "procs")``).

    Works in ``%%mesh`` cells (where it is also the variable ``device_mesh``)
    and in actors. ``device_mesh()["procs"]`` is the sub-mesh of one
    dimension; ``device_mesh().get_group("procs")`` its process group.

    Raises
    ------
    RuntimeError
        On the controller, or on a mesh spawned without ``--dist``.
    """
    if _device_mesh is None:
        if current_worker() is None:
            raise RuntimeError("device_mesh() works on the ranks of a mesh (in a %%mesh cell "
                               "or an actor), not on the controller")
        raise RuntimeError("this mesh has no torch.distributed set-up; spawn it with "
                           "--dist gloo (CPU) or --dist nccl (GPU)")
    return _device_mesh


# ------------------------------------------------------------------ store
def keep(id: str, value: Any) -> dict[str, Any]:
    """Store ``value`` under ``id`` (any thread); returns its description."""
    with _lock:
        _store[id] = value
    return describe(value)


def free(ids: list[str]) -> None:
    """Drop the values of ``ids`` (missing ones are ignored; any thread)."""
    with _lock:
        for i in ids:
            _store.pop(i, None)


def local_ids() -> list[str]:
    """Ids of the values this rank holds for handles (for tests and inspection)."""
    with _lock:
        return list(_store)


def _current_rank() -> int | None:
    w = current_worker()
    return None if w is None else w.rank


def _get(id: str, label: str = "", ranks: list[int] | None = None) -> Any:
    with _lock:
        if id in _store:
            return _store[id]
    rank = _current_rank()
    what = f"handle {label!r}" if label else f"handle {id}"
    if ranks is not None and rank not in ranks:
        raise MeshError(f"{what} has no value on rank {rank}: it lives on {ranks_label(ranks)}; "
                        "use it only there (e.g. %%mesh --ranks)")
    raise MeshFailure(f"rank {rank} no longer holds the value of {what} (it was freed, or "
                      "the rank was restarted)", rank=rank)


#: what a handle unpickled outside the ranks (on its controller) becomes:
#: ``rebuild(id, label)``, set by :mod:`monarch_kernel.tensors.handles` when imported
_controller_rebuild: Callable[[str, str], Any] | None = None


def set_controller_rebuild(rebuild: Callable[[str, str], Any]) -> None:
    """Make ``rebuild(id, label)`` what :func:`resolve` returns off the ranks."""
    global _controller_rebuild
    _controller_rebuild = rebuild


def resolve(id: str, ranks: list[int], label: str, controller: str = "") -> Any:
    """Unpickle a handle: on a rank, its local value; on the controller, the handle.

    ``controller``: the address of the handle's controller (a rank of another
    mesh refuses it).

    Raises
    ------
    MeshError
        On a rank the handle does not live on, or of another mesh.
    MeshFailure
        When the rank no longer holds the value (freed, or the rank restarted).
    """
    w = current_worker()
    if w is None:
        if _controller_rebuild is None:  # (no handle was ever made in this process)
            raise MeshError(f"handle {label!r} was freed; its values are gone")
        return _controller_rebuild(id, label)
    if controller and controller != w.address:
        raise MeshError(f"handle {label!r} belongs to another mesh (controller {controller}); "
                        f"this is rank {w.rank} of the mesh of {w.address}")
    return _get(id, label, ranks)


# --------------------------------------------------------------- requests
def handle(worker: Any, c: Ref) -> Any:
    """Run one ``ref`` request (worker main thread); see the module docstring."""
    op = c.get("op")
    if op == "keep":
        name = c["name"]
        if name not in worker.namespace:
            raise NameError(f"name {name!r} is not defined")
        return keep(c["id"], worker.namespace[name])
    if op == "meta":
        if "name" in c:
            if c["name"] not in worker.namespace:
                raise NameError(f"name {c['name']!r} is not defined")
            value = worker.namespace[c["name"]]
        else:
            value = _get(c["id"], c.get("label", ""))
        return describe(value, int(c.get("preview", 0)))
    if op == "get":
        return _plain(_get(c["id"], c.get("label", "")))
    if op == "full":
        value = _get(c["id"], c.get("label", ""))
        if not _is_dtensor(value):
            raise TypeError(f"full_tensor() needs a DTensor, but rank {worker.rank} holds a "
                            f"{_type_name(value)}; use fetch() or gather()")
        full = _plain(value.full_tensor())
        return full if worker.rank == c["send"] else None
    if op == "reduce":
        out = _reduce(_get(c["id"], c.get("label", "")), c["dims"], c["reduce_op"])
        return keep(c["new"], out)
    if op == "dtensor":
        return keep(c["new"], _to_dtensor(_get(c["id"], c.get("label", "")), c["placements"],
                                          c["dims"], c["local"]))
    if op == "map":
        value = _get(c["id"], c.get("label", ""))
        return keep(c["new"], c["fn"](value, *c.get("args", ()), **c.get("kwargs", {})))
    raise ValueError(f"unknown ref operation {op!r}")


def _is_dtensor(value: Any) -> bool:
    mod = sys.modules.get("torch.distributed.tensor")
    cls = getattr(mod, "DTensor", None) if mod is not None else None
    return cls is not None and isinstance(value, cls)


def _plain(value: Any) -> Any:
    """A value that can be sent: a DTensor's local shard as a plain tensor."""
    if _is_dtensor(value):
        value = value.to_local()
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor) and type(value) is not torch.Tensor:
        if hasattr(value, "wait"):  # an AsyncCollectiveTensor: its result
            value = value.wait()
        if type(value) is not torch.Tensor:
            value = value.as_subclass(torch.Tensor)
    return value


def _group(dim: str) -> Any:
    dm = device_mesh()
    if dim not in (dm.mesh_dim_names or ()):
        raise MeshError(f"the device mesh has no dimension {dim!r}; its dimensions: "
                        f"{dm.mesh_dim_names}")
    return dm.get_group(dim)


def _reduce(value: Any, dims: list[str], op: str) -> Any:
    """All-reduce ``value`` over the process groups of ``dims`` (a new value)."""
    import torch
    import torch.distributed as dist

    scalar = isinstance(value, (int, float, bool)) and not _is_dtensor(value)
    if scalar:
        t = torch.tensor(value)
    elif isinstance(value, torch.Tensor) and not _is_dtensor(value):
        t = _plain(value).detach().clone()
    else:
        raise TypeError(f"reduce() works on tensors and numbers, not on a {_type_name(value)}"
                        + ("; reduce its local shard with .map(lambda t: t.to_local()) first, "
                           "or use DTensor redistribute()" if _is_dtensor(value) else ""))
    device = t.device
    if _backend == "nccl" and device.type == "cpu":
        t = t.cuda()
    name = {"sum": "SUM", "avg": "SUM", "prod": "PRODUCT", "min": "MIN", "max": "MAX"}[op]
    size = 1
    for d in dims:
        group = _group(d)
        dist.all_reduce(t, op=getattr(dist.ReduceOp, name), group=group)
        size *= dist.get_world_size(group)
    if op == "avg":
        t = t / size
    t = t.to(device)
    return t.item() if scalar else t


def _placements(spec: list[tuple]) -> list[Any]:
    from torch.distributed.tensor import Partial, Replicate, Shard

    out: list[Any] = []
    for p in spec:
        if p[0] == "shard":
            out.append(Shard(int(p[1])))
        elif p[0] == "replicate":
            out.append(Replicate())
        else:
            out.append(Partial(p[1]))
    return out


def _to_dtensor(value: Any, placements: list[tuple], dims: list[str], local: bool) -> Any:
    import torch
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(value, torch.Tensor) or _is_dtensor(value):
        raise TypeError(f"to_dtensor() needs a plain tensor on every rank, not a "
                        f"{_type_name(value)}")
    dm = device_mesh()
    mesh = dm if list(dims) == list(dm.mesh_dim_names) else (
        dm[dims[0]] if len(dims) == 1 else dm[tuple(dims)])
    if _backend == "nccl" and value.device.type == "cpu":
        value = value.cuda()
    if local:
        return DTensor.from_local(value, mesh, _placements(placements), run_check=False)
    return distribute_tensor(value, mesh, _placements(placements))


# ---------------------------------------------------------------- describe
def _type_name(v: Any) -> str:
    t = type(v)
    return t.__qualname__ if t.__module__ in ("builtins", "__main__") else \
        f"{t.__module__}.{t.__qualname__}"


def describe(value: Any, preview: int = 0) -> dict[str, Any]:
    """What ``%mesh show`` and ``Ref.shape`` report of a value (no data but
    ``preview`` leading values).

    Returns
    -------
    dict
        ``type``; for tensors and arrays ``shape`` (a DTensor: its local
        shard's), ``dtype``, ``device``, ``nbytes``; for a DTensor also
        ``global_shape``, ``placements`` and ``mesh_dims``; ``values`` (up to
        ``preview`` leading values, flattened) when ``preview`` > 0; for other
        values ``repr`` (shortened).
    """
    d: dict[str, Any] = {"type": type(value).__name__}
    torch = sys.modules.get("torch")
    np = sys.modules.get("numpy")
    local = None
    if torch is not None and isinstance(value, torch.Tensor):
        if _is_dtensor(value):
            d["global_shape"] = tuple(value.shape)
            d["placements"] = [repr(p) for p in value.placements]
            d["mesh_dims"] = tuple(value.device_mesh.mesh_dim_names or ())
        local = _plain(value)
        d.update(shape=tuple(local.shape), dtype=str(local.dtype).replace("torch.", ""),
                 device=str(local.device), nbytes=local.numel() * local.element_size())
        if preview > 0:
            d["values"] = local.detach().reshape(-1)[:preview].cpu().tolist()
    elif np is not None and isinstance(value, np.ndarray):
        d.update(shape=tuple(value.shape), dtype=str(value.dtype), device="cpu",
                 nbytes=int(value.nbytes))
        if preview > 0:
            d["values"] = value.reshape(-1)[:preview].tolist()
    else:
        try:
            text = repr(value)
        except Exception as e:  # noqa: BLE001 - a broken __repr__ must not break show
            text = f"<unrepresentable: {e}>"
        d["repr"] = text if len(text) <= 200 else text[:197] + "..."
        d["shape"] = None
        if hasattr(value, "shape"):
            try:
                d["shape"] = tuple(value.shape)
            except TypeError:
                pass
    return d


set_result_keeper(keep)  # the results of .rref() calls stay here


def group_ranks(dims: dict[str, int], rank: int, over: list[str]) -> list[int]:
    """Global ranks that share ``rank``'s coordinates except along ``over``
    (the members of ``rank``'s process group for those dimensions), row-major."""
    names, sizes = list(dims), list(dims.values())
    coords = []
    rest = rank
    for s in reversed(sizes):
        coords.append(rest % s)
        rest //= s
    coords.reverse()
    strides = [math.prod(sizes[i + 1:]) for i in range(len(sizes))]
    out = [0]
    for name, size, c, st in zip(names, sizes, coords, strides, strict=True):
        idx = range(size) if name in over else [c]
        out = [o + i * st for o in out for i in idx]
    return sorted(out)


# ------------------------------------------------- the worker's handlers (plug-in)
def _on_free(worker: Any, msg: Any) -> None:
    free(msg.content["ids"])  # handles gone on the controller: drop their kept values


handlers.register_io("free", _on_free)
handlers.register_request("ref", handle)  # values kept for handles (tensors.handles)
