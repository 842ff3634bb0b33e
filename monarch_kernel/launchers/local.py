"""The ``local`` launcher: workers are subprocesses of the controller's host."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any

from monarch_kernel.launchers.base import (
    Launcher,
    LaunchSpec,
    Placement,
    default_threads,
    stop_processes,
    worker_command,
)
from monarch_kernel.launchers.guard import Guardian
from monarch_kernel.launchers.zygote import WorkerProcess, start_worker
from monarch_kernel.transport import lane

#: what the template process of local workers imports besides ``monarch_kernel.__main__``:
#: what a worker imports at its first actor call and its first telemetry sample (by name:
#: a head start for the workers, not a dependency of the launcher)
WORKER_PRELOAD = ("monarch_kernel.actor.actor_mesh", "monarch_kernel.actor.peers",
                  "monarch_kernel.actor.host", "monarch_kernel.controller.controller",
                  "monarch_kernel.tensors.store", "psutil", "pynvml")

__all__ = ["WORKER_PRELOAD", "AdoptedLauncher", "DetachPlan", "LocalLauncher"]


@dataclass
class DetachPlan:
    """How a local launcher starts the workers of a detachable mesh.

    Attributes
    ----------
    mesh_dir : str
        The mesh's own 0700 directory (named ``mkm-...``): each rank binds its
        attach endpoint there (``ipc://<mesh_dir>/a<rank>``). Removed, with
        ``record``, by the mesh's detached guardian when the last rank ended.
    keep_alive : float
        Seconds a detached rank waits for a controller.
    output_bytes : int
        Bytes of output each rank keeps for replay.
    record : str or None
        The registry file removed with the mesh (if it still names ``mesh_id``).
    mesh_id : str
    """

    mesh_dir: str
    keep_alive: float
    output_bytes: int
    record: str | None = None
    mesh_id: str = ""

    def endpoint(self, rank: int) -> str:
        return f"ipc://{self.mesh_dir}/a{rank}"


class LocalLauncher(Launcher):
    """Start each rank as ``python -m monarch_kernel worker`` on this host.

    Workers get their own session (so a Ctrl-C meant for the controller is
    not delivered to them directly: interrupts are routed) and watch the
    controller's pid, exiting by themselves if it disappears. A guardian
    process (:mod:`.guard`) also watches them: when a worker ends, what is
    left of its session (processes user code started) ends within
    :data:`~.guard.DEFAULT_GRACE` seconds; when the controller ends, however
    it ends, the workers do too, even one whose Python is stuck in C code.
    Workers are forked from a pre-imported template process when they can be
    (:func:`.zygote.start_worker`; ``MONARCH_ZYGOTE=0``: each starts a new Python).
    """

    name = "local"
    local = True

    def __init__(self) -> None:
        self.procs: dict[int, subprocess.Popen | WorkerProcess] = {}
        self.pipes: dict[int, tuple[int, int]] = {}
        #: set by the controller: callable(rank, stdout_fd, stderr_fd) taking the
        #: read ends of each new worker's output pipes
        self.on_pipes: Any = None
        #: set by the controller when local workers get lanes: callable(rank, socket)
        #: taking the controller's end of each new worker's lane (monarch_kernel.transport.lane)
        self.on_lane: Any = None
        self._reported: set[int] = set()
        self._lock = threading.Lock()
        self.host = socket.gethostname()
        self.guard = Guardian()
        #: set before launch for a detachable mesh: no lanes, no controller-read pipes,
        #: no controller pid given to the workers, and a guardian of the mesh's own
        self.detach: DetachPlan | None = None

    def make_detachable(self, plan: DetachPlan) -> None:
        """Start the workers of the next :meth:`launch` detachable (see :class:`DetachPlan`)."""
        self.detach = plan
        self.guard = Guardian(detached=True)
        self.guard.remove_on_exit(plan.mesh_dir)
        if plan.record:
            self.guard.remove_file_at_end(plan.record, plan.mesh_id)

    def release(self) -> None:
        """Leave the workers of a detachable mesh running (this process detaches):
        the output pipes close here, the guardian goes on by itself."""
        with self._lock:
            for r in list(self.pipes):
                self._close_pipes(r)
            self._reported.update(self.procs)
        self.guard.release()

    def attach(self, controller: object) -> None:
        """Remember the controller; its private directory for Unix sockets (if it
        has one) is removed by the guardian should this process be killed."""
        super().attach(controller)
        ipc_dir = getattr(controller, "ipc_dir", None)
        if isinstance(ipc_dir, str):
            self.guard.remove_on_exit(ipc_dir)

    def launch(self, spec: LaunchSpec) -> None:
        spec.controller_pid = None if self.detach is not None else os.getpid()
        base = dict(os.environ)
        base["MONARCH_MESH_KEY"] = spec.key.hex()
        base.setdefault("OMP_NUM_THREADS", default_threads(spec.world_size))
        started: list[int] = []
        try:
            for rank in spec.ranks:
                started.append(self._launch_one(spec, base, rank))
        finally:
            if started:
                self._guard_workers(started)

    def _guard_workers(self, pids: list[int]) -> None:
        """Have the guardian watch ``pids`` (all live workers if it had to be
        started again)."""
        try:
            if self.guard.ensure():
                with self._lock:
                    pids = [p.pid for p in self.procs.values() if p.poll() is None]
        except OSError as e:  # (the workers run; only the guarantee is lost)
            warnings.warn(f"could not start the process that ends workers with the kernel: "
                          f"{e}", RuntimeWarning, stacklevel=3)
            return
        self.guard.watch(pids)

    def _launch_one(self, spec: LaunchSpec, base: dict[str, str], rank: int) -> int:
        env = dict(base)
        env.update(spec.env.get(rank, {}))
        # fds 1 and 2 of the worker are pipes. With a controller to hand them to
        # (on_pipes), only the controller reads them: nothing a rank wrote is lost
        # in the worker when it dies. Otherwise both sides keep the read ends: the
        # worker reads them while it lives, we read what is left if it dies.
        r1, w1 = os.pipe()
        r2, w2 = os.pipe()
        plan = self.detach
        # (a detachable worker logs to its own stderr: the kernel's may be gone tomorrow)
        log_fd = os.dup(2) if plan is None else os.open(
            os.environ.get("MONARCH_DETACH_LOG") or os.devnull,
            os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        env["MONARCH_LOG_FD"] = str(log_fd)
        if plan is not None:
            env["MONARCH_ATTACH_ENDPOINT"] = plan.endpoint(rank)
            env["MONARCH_DETACH_KEEP_ALIVE"] = repr(plan.keep_alive)
            env["MONARCH_DETACH_OUTPUT_BYTES"] = str(plan.output_bytes)
            env["MONARCH_DETACH_HOLDER"] = f"{os.getpid()}@{self.host}"
        if self.on_pipes is not None and plan is None:
            env["MONARCH_OUTPUT_PIPES"] = "controller"
            keep: tuple[int, ...] = (log_fd,)
        else:
            env["MONARCH_CAPTURE_FDS"] = f"{r1},{r2}"
            keep = (r1, r2, log_fd)
        ours = theirs = None
        if self.on_lane is not None and plan is None:  # messages go through a socket pair
            ours, theirs = lane.pair()
            env["MONARCH_LANE_FD"] = str(theirs.fileno())
            keep = (*keep, theirs.fileno())
        try:
            proc = start_worker(worker_command(spec, rank), env, w1, w2, keep, WORKER_PRELOAD)
        except BaseException:
            if ours is not None:
                ours.close()
            raise
        finally:
            os.close(w1)
            os.close(w2)
            os.close(log_fd)
            if theirs is not None:
                theirs.close()
        os.set_blocking(r1, False)
        os.set_blocking(r2, False)
        with self._lock:
            old = self.procs.get(rank)
            if old is not None and old.poll() is None:
                old.kill()
                old.wait(5)
            self._close_pipes(rank)
            self.procs[rank] = proc
            self._reported.discard(rank)
            if self.on_pipes is None or plan is not None:
                self.pipes[rank] = (r1, r2)
        if self.on_pipes is not None and plan is None:
            self.on_pipes(rank, r1, r2)  # the controller owns (and closes) them now
        if ours is not None:
            self.on_lane(rank, ours)  # (and this one)
        return proc.pid

    def leftover_output(self, rank: int) -> list[tuple[str, bytes]]:
        """What a dead rank wrote that its own reader never forwarded."""
        out: list[tuple[str, bytes]] = []
        with self._lock:
            fds = self.pipes.get(rank)
            if fds is None:
                return out
            for name, fd in zip(("stdout", "stderr"), fds, strict=True):
                chunks = []
                while True:
                    try:
                        data = os.read(fd, 65536)
                    except (BlockingIOError, OSError):
                        break
                    if not data:
                        break
                    chunks.append(data)
                if chunks:
                    out.append((name, b"".join(chunks)))
            self._close_pipes(rank)
        return out

    def _close_pipes(self, rank: int) -> None:
        for fd in self.pipes.pop(rank, ()):
            try:
                os.close(fd)
            except OSError:
                pass

    def forget(self, ranks: list[int]) -> None:
        """Never report the current processes of ``ranks`` as exited (they are
        being replaced)."""
        with self._lock:
            self._reported.update(ranks)

    def placements(self) -> dict[int, Placement]:
        return {r: Placement(r, self.host, p.pid) for r, p in self.procs.items()}

    def poll(self) -> dict[int, int]:
        out = {}
        with self._lock:
            for rank, p in self.procs.items():
                if rank not in self._reported:
                    code = p.poll()
                    if code is not None:
                        self._reported.add(rank)
                        out[rank] = code
        return out

    def signal(self, ranks: list[int], sig: int = signal.SIGINT) -> None:
        for r in ranks:
            p = self.procs.get(r)
            if p is not None and p.poll() is None:
                try:
                    p.send_signal(sig)
                except ProcessLookupError:
                    pass

    def stop(self, ranks: list[int] | None = None, timeout: float = 5.0) -> None:
        with self._lock:
            procs = [p for r, p in self.procs.items() if ranks is None or r in ranks]
        stop_processes(procs, timeout)
        with self._lock:
            for r in list(self.pipes):
                if ranks is None or r in ranks:
                    self._close_pipes(r)
        if ranks is None:  # the mesh is over: what its ranks started ends now
            self.guard.close()


class AdoptedLauncher(Launcher):
    """The launcher of a local mesh this process attached to (its workers are
    not its children): it knows their pids, signals them, sees them exit and
    stops them; their guardian (the mesh's own) cleans up after them. A
    guardian of this process's own (watching no worker) removes the
    controller's private socket directory should this process be killed.

    Parameters
    ----------
    pids : dict of int to int
        Rank -> pid.
    """

    name = "local"
    local = True

    can_relaunch = False

    def __init__(self, pids: dict[int, int]) -> None:
        self.pids = dict(pids)
        self.host = socket.gethostname()
        self._reported: set[int] = set()
        self._lock = threading.Lock()
        self.guard: Guardian | None = None

    def attach(self, controller: object) -> None:
        """Remember the controller; its private directory for Unix sockets (if it
        has one) is removed by a guardian of this process's should it be killed."""
        super().attach(controller)
        ipc_dir = getattr(controller, "ipc_dir", None)
        if isinstance(ipc_dir, str):
            self.guard = Guardian()
            self.guard.remove_on_exit(ipc_dir)
            try:
                self.guard.ensure()
            except OSError:  # (the directory is then swept by a later process)
                self.guard = None

    def close_guard(self) -> None:
        """Stop this process's guardian (the controller removed its directory)."""
        guard, self.guard = self.guard, None
        if guard is not None:
            guard.close()

    def launch(self, spec: LaunchSpec) -> None:
        raise NotImplementedError("the ranks of an attached mesh cannot be started again "
                                  "from here; stop the mesh and spawn a new one")

    def placements(self) -> dict[int, Placement]:
        return {r: Placement(r, self.host, p) for r, p in self.pids.items()}

    def poll(self) -> dict[int, int]:
        out = {}
        with self._lock:
            for rank, pid in self.pids.items():
                if rank not in self._reported and not _running(pid):
                    self._reported.add(rank)
                    out[rank] = 0  # (not a child: its exit code cannot be had)
        return out

    def signal(self, ranks: list[int], sig: int = signal.SIGINT) -> None:
        for r in ranks:
            pid = self.pids.get(r)
            if pid is not None and _running(pid):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass

    def release(self) -> None:
        """Let go of the workers (not this process's); this process's guardian ends."""
        with self._lock:
            self._reported.update(self.pids)
        self.close_guard()

    def stop(self, ranks: list[int] | None = None, timeout: float = 5.0) -> None:
        try:
            self._end([p for r, p in self.pids.items() if ranks is None or r in ranks],
                      timeout)
        finally:
            if ranks is None:
                self.close_guard()

    @staticmethod
    def _end(pids: list[int], timeout: float) -> None:
        """End processes ``pids`` (the stop request sent first): waits ``timeout``
        seconds, then SIGTERM, then SIGKILL."""
        deadline = time.monotonic() + timeout
        for sig, wait in ((None, timeout), (signal.SIGTERM, 2.0), (signal.SIGKILL, 5.0)):
            left = [p for p in pids if _running(p)]
            if not left:
                return
            if sig is not None:
                for p in left:
                    try:
                        os.kill(p, sig)
                    except ProcessLookupError:
                        pass
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and any(_running(p) for p in left):
                time.sleep(0.02)


def _running(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True
