"""``torch.distributed`` set-up of a mesh (``--dist gloo|nccl``).

The controller's side (:func:`setup_mesh`) picks MASTER_ADDR and MASTER_PORT
and sends each rank its ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` ... (the
variables ``torchrun`` sets); the rank's side (:func:`init_rank`) joins the
process group, and under NCCL checks that no two ranks share a GPU.
"""

from __future__ import annotations

import datetime
import os
import socket
from typing import Any

from monarch_kernel.errors import raise_request_failures
from monarch_kernel.tensors import store as tensor_store
from monarch_kernel.transport.sockets import endpoint_host
from monarch_kernel.util import gpu
from monarch_kernel.worker import handlers

__all__ = ["DIST_BACKENDS", "init_rank", "setup_mesh"]

#: the backends ``spawn_procs(dist=...)`` and ``%mesh spawn --dist`` take
DIST_BACKENDS = ("gloo", "nccl", "none")


def setup_mesh(root: Any, timeout: float = 120.0) -> None:
    """Run ``torch.distributed`` set-up on every rank of the root mesh ``root``
    (:meth:`ProcMesh.setup_dist <monarch_kernel.mesh.procmesh.ProcMesh.setup_dist>`).

    MASTER_ADDR is the host of rank 0 (the controller's address for local
    meshes; for other launchers rank 0's address on the interface that
    routes to the controller, which its peers can reach whatever its host
    name resolves to); MASTER_PORT a free port there.

    Raises
    ------
    TimeoutError
        If a rank did not finish its set-up within ``timeout`` seconds.
    RemoteError
        If the set-up failed on a rank.
    """
    host = endpoint_host(root.controller.address)  # (127.0.0.1 for a local mesh's ipc://)
    if root.launcher.local:
        master, port = host, _free_port(host)
    else:
        master, port = _rank0_endpoint(root, host, timeout)
    env = _setup_env(root, master, port)
    reqs = [root.controller.request([r], "setup", {"dist": root.dist, "env": env[r],
                                                   "timeout": timeout})
            for r in root.ranks]
    for req in reqs:
        if not req.wait(timeout + 10):
            raise TimeoutError(f"torch.distributed set-up did not finish in {timeout} s")
        raise_request_failures(req)


def init_rank(worker: Any, content: dict[str, Any]) -> None:
    """Join the process group on this rank (a ``setup`` request; the worker's
    main thread), and put ``dist``, ``torch`` and ``device_mesh`` (the mesh's
    named dimensions as a DeviceMesh) in its namespace.

    Raises
    ------
    RuntimeError
        Under NCCL, on a rank without a GPU or whose GPU another rank uses.
    """
    os.environ.update(content.get("env", {}))
    backend = content.get("dist")
    if backend and backend != "none":
        import torch
        import torch.distributed as dist

        if dist.is_initialized():  # a restart of the mesh: join the new group
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - the old group may be broken
                pass
        if backend == "nccl":
            local_rank = int(os.environ.get("LOCAL_RANK", "0"))
            if not torch.cuda.is_available():
                raise RuntimeError(
                    f"--dist nccl needs a GPU, but rank {worker.rank} sees none; "
                    "use --dist gloo on CPU-only machines"
                )
            # every thread of the rank: actors, telemetry, arrivals
            gpu.assign(local_rank % torch.cuda.device_count())
        dist.init_process_group(
            backend,
            rank=worker.rank,
            world_size=worker.world_size,
            timeout=datetime.timedelta(seconds=float(content.get("timeout", 120))),
        )
        if backend == "nccl":
            _check_one_gpu_per_rank(dist, torch, worker.rank, worker.world_size)
        worker.namespace.setdefault("dist", dist)
        worker.namespace.setdefault("torch", torch)
        # the mesh's named dimensions as a DeviceMesh
        worker.namespace["device_mesh"] = tensor_store.init_device_mesh(worker.shape, backend)


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _rank0_endpoint(root: Any, controller_host: str, timeout: float) -> tuple[str, int]:
    """(address, free port) of rank 0, found on rank 0 without touching its namespace."""
    code = (
        "(lambda socket: (lambda u, s: (u.connect((%r, 9)), s.bind((u.getsockname()[0], 0)),"
        " (u.getsockname()[0], s.getsockname()[1]), u.close(), s.close())[2])"
        "(socket.socket(socket.AF_INET, socket.SOCK_DGRAM), socket.socket()))"
        "(__import__('socket'))"
    ).replace("%r", repr(controller_host))
    req = root.controller.request([0], "execute", {"code": code, "filename": "<monarch-dist>"})
    if not req.wait(timeout):
        raise TimeoutError(f"rank 0 did not say its address within {timeout} s")
    raise_request_failures(req)
    addr, port = req.replies[0][1]
    return addr, int(port)


def _setup_env(mesh: Any, master_addr: str, port: int) -> dict[int, dict[str, str]]:
    procs = mesh.shape.sizes[-1] if mesh.shape.sizes else 1
    n = len(mesh.root.shape)
    return {r: {"MASTER_ADDR": master_addr, "MASTER_PORT": str(port), "RANK": str(r),
                "WORLD_SIZE": str(n), "LOCAL_RANK": str(r % procs),
                "LOCAL_WORLD_SIZE": str(procs)} for r in mesh.root.ranks}


def _check_one_gpu_per_rank(dist: Any, torch: Any, rank: int, world_size: int) -> None:
    """Raise at set-up when ranks share a GPU under ``--dist nccl``.

    NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), but only at
    the first collective, deep inside a cell. Each rank counts the ranks on its
    GPU (by UUID, so any ``CUDA_VISIBLE_DEVICES`` scheme is judged by what it
    really selects) in the process group's own store: no NCCL communicator yet.

    Raises
    ------
    RuntimeError
        On every rank whose GPU another rank of the mesh uses too.
    """
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - private API gone: NCCL will say it at the first collective
        return
    device = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(device)
    gpu = str(getattr(props, "uuid", "") or "") or f"{socket.gethostname()}/{device}"
    key = "monarch/gpu-users/"
    store.add(key + gpu, 1)
    if store.add(key + "arrived", 1) == world_size:
        store.set(key + "all", "1")
    store.wait([key + "all"])  # every rank counted (the group's timeout applies)
    users = store.add(key + gpu, 0)
    if users > 1:
        count = torch.cuda.device_count()
        raise RuntimeError(
            f"--dist nccl needs one GPU per rank, but rank {rank} shares GPU cuda:{device} "
            f"({props.name}) on host {socket.gethostname()} with {users - 1} other rank(s), "
            f"and this host shows only {count} GPU(s); spawn at most {count} rank(s) per "
            "host, or use --dist gloo"
        )


handlers.register_request("setup", init_rank)  # torch.distributed on a rank (worker plug-in)
