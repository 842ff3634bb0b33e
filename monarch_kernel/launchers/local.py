"""The ``local`` launcher: workers are subprocesses of the controller's host."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import warnings
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

__all__ = ["WORKER_PRELOAD", "LocalLauncher"]

#: what the template process of local workers imports besides ``monarch_kernel.__main__``:
#: what a worker imports at its first actor call and its first telemetry sample (by name:
#: a head start for the workers, not a dependency of the launcher)
WORKER_PRELOAD = ("monarch_kernel.actor.actor_mesh", "monarch_kernel.actor.peers",
                  "monarch_kernel.actor.host", "monarch_kernel.controller.controller",
                  "monarch_kernel.tensors.store", "psutil", "pynvml")


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

    def attach(self, controller: object) -> None:
        """Remember the controller; its private directory for Unix sockets (if it
        has one) is removed by the guardian should this process be killed."""
        super().attach(controller)
        ipc_dir = getattr(controller, "ipc_dir", None)
        if isinstance(ipc_dir, str):
            self.guard.remove_on_exit(ipc_dir)

    def launch(self, spec: LaunchSpec) -> None:
        spec.controller_pid = os.getpid()
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
        log_fd = os.dup(2)
        env["MONARCH_LOG_FD"] = str(log_fd)
        if self.on_pipes is not None:
            env["MONARCH_OUTPUT_PIPES"] = "controller"
            keep: tuple[int, ...] = (log_fd,)
        else:
            env["MONARCH_CAPTURE_FDS"] = f"{r1},{r2}"
            keep = (r1, r2, log_fd)
        ours = theirs = None
        if self.on_lane is not None:  # this rank's messages go through a socket pair
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
            if self.on_pipes is None:
                self.pipes[rank] = (r1, r2)
        if self.on_pipes is not None:
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
