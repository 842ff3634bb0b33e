"""``torch.distributed`` set-up of a mesh (``--dist gloo|nccl``).

The controller's side (:func:`setup_mesh`) picks MASTER_ADDR and MASTER_PORT
and sends each rank its ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` ... (the
variables ``torchrun`` sets); the rank's side (:func:`init_rank`) joins the
process group, and under NCCL checks that no two ranks share a GPU.

A collective cannot be interrupted: a rank blocked in ``dist.barrier()``
waits in C++ for its peers, and neither the kernel's interrupt nor
``ProcessGroup.abort()`` (which frees no waiter under gloo) ends it. When a
rank quits its debugger while its peers wait for it in a collective
(pytorch#154563), the controller (:func:`watch_quit`) asks the cell's ranks
still inside a ``torch.distributed`` call to abort it: a ``debug_input``
message with ``quit``, handled on the rank's I/O thread while its main thread
stays blocked (:func:`abort_collectives`). The rank shuts down the TCP
connections its process group made at set-up (:func:`init_rank` notes them),
so the blocked call fails at once with "Connection closed by peer" (under
NCCL it also aborts the communicators). The process group is then broken on
every rank, and :func:`restore_after_abort` sets it up again.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

from monarch_kernel.debug import server as debug_server
from monarch_kernel.debug.registry import registry_for
from monarch_kernel.errors import raise_request_failures, ranks_label
from monarch_kernel.tensors import store as tensor_store
from monarch_kernel.transport.sockets import endpoint_host
from monarch_kernel.util import gpu
from monarch_kernel.worker import handlers

__all__ = ["DIST_BACKENDS", "QuitWatch", "abort_collectives", "aborted_message", "init_rank",
           "restore_after_abort", "setup_mesh", "watch_quit"]

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

        if dist.is_initialized():  # a restart of the mesh, or a group aborted: a new group
            _links.clear()
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - the old group may be broken
                pass
        before = _socket_inodes()
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
        # the connections the group (and the DeviceMesh's groups) made: what an abort cuts
        store_port = int(os.environ.get("MASTER_PORT", "0") or 0)
        _links.clear()
        _links.update({fd: inode for fd, inode in _socket_inodes().items()
                       if before.get(fd) != inode})
        _links_store_port[0] = store_port


# ------------------------------------------------------------ aborting collectives (rank)
#: fd -> socket inode of the connections the process group made at set-up (this rank)
_links: dict[int, str] = {}
_links_store_port = [0]  # MASTER_PORT of that set-up: the TCPStore's connections stay


def _socket_inodes() -> dict[int, str]:
    """fd -> ``socket:[inode]`` of this process's sockets (Linux; {} elsewhere)."""
    out: dict[int, str] = {}
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for name in fds:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:"):
            out[int(name)] = target
    return out


def _cut_links() -> int:
    """Shut down (never close: the process group still owns the fds) the process
    group's connections to its peers; the number shut down."""
    now = _socket_inodes()
    cut = 0
    for fd, inode in list(_links.items()):
        if now.get(fd) != inode:  # closed since (the fd may be another socket now)
            continue
        try:
            dup = os.dup(fd)
        except OSError:
            continue
        with socket.socket(fileno=dup) as s:
            try:
                ends = (s.getsockname(), s.getpeername())
            except OSError:  # a listening socket: nobody waits on it
                continue
            if any(isinstance(e, tuple) and len(e) > 1 and e[1] == _links_store_port[0]
                   for e in ends):
                continue  # the TCPStore's: not a peer link
            try:
                s.shutdown(socket.SHUT_RDWR)
                cut += 1
            except OSError:
                pass
    return cut


def _collective_call(thread_id: int) -> tuple[str, Any] | None:
    """(function, process group or None) of the ``torch.distributed`` call that the
    thread ``thread_id`` is in, or None when it is in none."""
    frame = sys._current_frames().get(thread_id)
    found: tuple[str, Any] | None = None
    c10d = False  # (a frame of distributed_c10d names the call better than its wrappers)
    while frame is not None:
        module = str(frame.f_globals.get("__name__") or "")
        if module.startswith("torch.distributed") and not (
                c10d and module != "torch.distributed.distributed_c10d"):
            c10d = c10d or module == "torch.distributed.distributed_c10d"
            group = None
            for name in ("group", "pg", "process_group"):
                group = frame.f_locals.get(name) if name in frame.f_code.co_varnames else None
                if group is not None:
                    break
            # the outermost such frame is the call the user made
            found = (frame.f_code.co_name, group)
        frame = frame.f_back
    return found


def _waits_for(group: Any, ranks: list[int]) -> bool:
    """Whether a collective on ``group`` (None: the default group) needs one of
    ``ranks`` (True when that cannot be told)."""
    if group is None or not ranks:
        return True
    try:
        import torch.distributed as dist

        members = dist.get_process_group_ranks(group)
    except Exception:  # noqa: BLE001 - not a group this rank knows: assume it waits
        return True
    return any(r in members for r in ranks)


def abort_collectives(worker: Any, content: dict[str, Any]) -> None:
    """Ranks ``content["ranks"]`` of request ``content["request"]`` quit their
    debugger (a quit hook of :mod:`monarch_kernel.debug.server`, on the rank's I/O
    thread): if this rank's main thread is inside a ``torch.distributed`` call
    that needs one of them, make that call fail now, and tell the controller
    first with an ``event`` ``{kind: "collective_aborted", request, call}``.

    Nothing happens on a rank whose main thread is in no collective.
    """
    call = _collective_call(worker.main_thread_id)
    if call is None or not _waits_for(call[1], list(content.get("ranks", []))):
        return
    # said first: the call's error reply, which the cut brings, must come after it
    worker.send("event", {"kind": "collective_aborted", "request": content.get("request"),
                          "call": call[0]})
    _cut_links()
    dist = sys.modules.get("torch.distributed")
    if dist is not None:  # NCCL's communicators abort on their own
        try:
            if dist.is_initialized() and dist.get_backend() == "nccl":
                dist.distributed_c10d._abort_process_group()
        except Exception:  # noqa: BLE001, S110 - best effort: the cut links may do
            pass


# ------------------------------------------------------------ aborting collectives (controller)
@dataclass
class QuitWatch:
    """What :func:`watch_quit` saw and did for one request.

    Attributes
    ----------
    quit_ranks : list of int
        The ranks that quit their debugger.
    aborted : dict of int to str
        Rank -> the ``torch.distributed`` function whose call was aborted there.
    """

    quit_ranks: list[int]
    aborted: dict[int, str] = field(default_factory=dict)
    thread: threading.Thread | None = None


#: seconds after a quit before the ranks still running are asked; then every POLL_S
GRACE_S = 1.0
POLL_S = 0.5


def watch_quit(root: Any, req: Any, quit_ranks: list[int], grace: float = GRACE_S,
               poll: float = POLL_S) -> QuitWatch:
    """Abort the collectives that wait for ranks that quit their debugger.

    While ``req`` runs and none of its ranks is paused in pdb, every ``poll``
    seconds from ``grace`` seconds on, its ranks that still run (not those
    in ``quit_ranks``) are asked to abort the ``torch.distributed`` call
    their main thread is blocked in, if any (:func:`abort_collectives`).
    Returns at once; a daemon thread watches until ``req`` is done.
    """
    watch = QuitWatch(sorted(quit_ranks))
    ctl = root.controller
    registry = registry_for(ctl)

    def listen(kind: str, rank: int, payload: Any) -> None:
        if (kind == "event" and isinstance(payload, dict)
                and payload.get("kind") == "collective_aborted"
                and payload.get("request") == req.id):
            watch.aborted[rank] = str(payload.get("call", "?"))

    def run() -> None:
        ctl.listeners.append(listen)
        try:
            if req.wait(grace):
                return
            while True:
                running = [r for r in req.ranks if r not in req.replies
                           and r not in watch.quit_ranks and r not in watch.aborted]
                if running and not registry.sessions("paused", parent=req.id):
                    ctl.notify(running, "debug_input", {
                        "session": "", "line": None,
                        "quit": {"request": req.id, "ranks": watch.quit_ranks}})
                if req.wait(poll):
                    return
        finally:
            try:
                ctl.listeners.remove(listen)
            except ValueError:
                pass

    watch.thread = threading.Thread(target=run, name="monarch-quit-watch", daemon=True)
    watch.thread.start()
    return watch


def restore_after_abort(root: Any, timeout: float = 120.0) -> str | None:
    """Set ``torch.distributed`` up again on every rank of ``root`` after
    :func:`abort_collectives` broke its process group; None when it worked,
    else what went wrong (one line)."""
    try:
        setup_mesh(root, timeout)
    except Exception as e:  # noqa: BLE001 - said to the user, who can retry
        return (str(e).strip().splitlines() or [type(e).__name__])[0]
    return None


def aborted_message(quit_ranks: list[int], aborted: dict[int, str],
                    restore_error: str | None) -> str:
    """What the user reads when collectives that waited for ranks that quit
    their debugger were aborted (and whether the process group works again)."""
    calls = ", ".join(sorted({f"dist.{c}" for c in aborted.values()}))
    waited = sorted(aborted)
    text = (f"{ranks_label(quit_ranks)} quit the debugger while {ranks_label(waited)} waited for "
            f"{'it' if len(quit_ranks) == 1 else 'them'} in a collective ({calls}); "
            f"{'its call was' if len(waited) == 1 else 'their calls were'} aborted. ")
    if restore_error is None:
        return text + ("torch.distributed was set up again on every rank: dist works in the "
                       "next cell (groups made with dist.new_group must be made again).")
    return text + (f"torch.distributed could not be set up again ({restore_error}): run  "
                   "mesh.setup_dist()  to try again, or  %mesh restart all.")


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
debug_server.register_quit_hook(abort_collectives)  # (on the I/O thread: main is blocked)
