"""monarch_kernel: a Jupyter kernel that is the single controller of a mesh.

Public API (the shape PyTorch Monarch users know)::

    from monarch_kernel import this_host, spawn_procs, ValueMesh

    procs = this_host().spawn_procs(per_host={"procs": 4})
    procs.exec("rank * 2")          # ValueMesh of 0, 2, 4, 6
    procs.stop()

Names are imported lazily so that ``python -m monarch_kernel install`` and
the worker start fast.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "Shape": "mesh.shape", "Point": "mesh.shape", "ValueMesh": "mesh.shape",
    "ProcMesh": "mesh.procmesh", "spawn_procs": "mesh.procmesh", "this_host": "mesh.procmesh",
    "HostMesh": "mesh.procmesh", "attach": "mesh.procmesh", "stop_mesh": "mesh.procmesh",
    "Actor": "actor.actor_mesh", "ActorMesh": "actor.actor_mesh", "endpoint": "actor.actor_mesh",
    "Future": "actor.actor_mesh", "current_rank": "actor.actor_mesh",
    "current_size": "actor.actor_mesh", "WaitCycleError": "actor.cycles",
    "Ref": "tensors.handles", "device_mesh": "tensors.store", "RDMABuffer": "tensors.buffer",
    "MonarchError": "errors", "MeshError": "errors", "MeshFailure": "errors",
    "RemoteError": "errors", "ActorError": "errors", "ProtocolError": "errors",
    "SerializationError": "errors", "TransportError": "errors", "NoMeshError": "errors",
    "MeshBusyError": "errors",
    "RankSpecError": "errors", "SpawnInterrupted": "errors", "CollectiveAborted": "errors",
}

__all__ = [  # noqa: RUF022 - grouped like _EXPORTS
    "Shape", "Point", "ValueMesh", "ProcMesh", "spawn_procs", "this_host", "HostMesh",
    "attach", "stop_mesh",
    "Actor", "ActorMesh", "endpoint", "Future", "current_rank", "current_size",
    "WaitCycleError", "Ref", "device_mesh", "RDMABuffer",
    "MonarchError", "MeshError", "MeshFailure", "RemoteError", "ActorError", "ProtocolError",
    "SerializationError", "TransportError", "NoMeshError", "MeshBusyError", "RankSpecError",
    "SpawnInterrupted", "CollectiveAborted",
]


def __getattr__(name: str) -> Any:
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'monarch_kernel' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{mod}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
