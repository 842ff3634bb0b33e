"""The launcher interface: how worker processes are started, watched and stopped.

A launcher starts ``python -m monarch_kernel worker`` once per rank on some
engine (local subprocesses, Slurm, ...). Workers connect back to the
controller's address; the launcher only has to start them, say where they
run, signal them, report exits it can see, and clean up. Adding Kubernetes
or SSH means one more subclass of :class:`Launcher`.
"""

from __future__ import annotations

import abc
import os
import signal
import sys
from dataclasses import dataclass, field

from monarch_kernel.transport.netaddr import primary_address
from monarch_kernel.wire.messages import heartbeat_timeout

__all__ = ["LaunchSpec", "Launcher", "Placement", "worker_command"]


@dataclass
class LaunchSpec:
    """What to start.

    Attributes
    ----------
    address : str
        The controller's endpoint: ``ipc://PATH`` for a local mesh (Unix
        sockets in a directory only this user can enter), else ``tcp://host:port``.
    key : bytes
        The mesh key (passed to workers through the environment, never argv).
    shape : dict of str to int
        Named dimensions, e.g. ``{"hosts": 1, "procs": 4}``; ranks are
        numbered row-major (host-major).
    ranks : list of int
        The ranks to start now (all of them, or one being restarted).
    env : dict of int to dict of str to str
        Extra environment per rank.
    heartbeat : float
        Seconds between heartbeats.
    controller_pid : int or None
        Set when workers run on the controller's host.
    telemetry_interval : float
        Seconds between a worker's telemetry samples; 0 turns telemetry off.
    """

    address: str
    key: bytes
    shape: dict[str, int]
    ranks: list[int]
    env: dict[int, dict[str, str]] = field(default_factory=dict)
    heartbeat: float = 1.0
    controller_pid: int | None = None
    #: the controller's second endpoint, for controller -> worker traffic
    down_address: str = ""
    #: the controller's CurveZMQ public key (Z85), when traffic is encrypted
    curve_server_key: bytes | None = None
    telemetry_interval: float = 1.0

    @property
    def world_size(self) -> int:
        n = 1
        for s in self.shape.values():
            n *= s
        return n


@dataclass
class Placement:
    """Where one rank runs."""

    rank: int
    host: str
    pid: int | None = None
    job: str | None = None  # scheduler job (and step) id, if any


def worker_command(spec: LaunchSpec, rank: int | None = None, python: str | None = None
                   ) -> list[str]:
    """The argv of one worker (``rank`` None: taken from the environment)."""
    cmd = [python or sys.executable, "-m", "monarch_kernel", "worker",
           "--controller", spec.address,
           "--world-size", str(spec.world_size),
           "--shape", ",".join(f"{k}={v}" for k, v in spec.shape.items()),
           "--heartbeat", str(spec.heartbeat),
           "--heartbeat-timeout", str(heartbeat_timeout(spec.heartbeat)),
           "--telemetry-interval", str(spec.telemetry_interval)]
    if rank is not None:
        cmd += ["--rank", str(rank)]
    if spec.controller_pid is not None:
        cmd += ["--controller-pid", str(spec.controller_pid)]
    if spec.down_address:
        cmd += ["--controller-down", spec.down_address]
    if spec.curve_server_key:  # a public key: fine on a command line
        # "=": a Z85 key may start with "-", which argparse would take for an option
        cmd += [f"--curve-server-key={spec.curve_server_key.decode()}"]
    return cmd


class Launcher(abc.ABC):
    """Starts, watches and stops worker processes for one mesh."""

    #: short name used by ``--launcher NAME``
    name: str = ""
    #: True when workers run on this host as child processes
    local: bool = False
    #: False when :meth:`launch` cannot start ranks again (a mesh attached to, whose
    #: processes another controller started): restarts are refused before any rank ends
    can_relaunch: bool = True

    @abc.abstractmethod
    def launch(self, spec: LaunchSpec) -> None:
        """Start workers for ``spec.ranks`` (returns without waiting for them)."""

    @abc.abstractmethod
    def placements(self) -> dict[int, Placement]:
        """Where each started rank runs."""

    @abc.abstractmethod
    def poll(self) -> dict[int, int]:
        """Ranks whose process has exited since the last call, with exit codes
        (negative: killed by that signal). Cheap; called ~20 times a second."""

    @abc.abstractmethod
    def signal(self, ranks: list[int], sig: int = signal.SIGINT) -> None:
        """Send ``sig`` to the processes of ``ranks``."""

    def forget(self, ranks: list[int]) -> None:  # noqa: B027 - optional hook, default: no-op
        """Stop reporting exits of the current processes of ``ranks``: they are
        about to be replaced by :meth:`launch` (a restart)."""

    def leftover_output(self, rank: int) -> list[tuple[str, bytes]]:
        """Output a dead rank wrote that never reached the controller, as
        ``(stream name, bytes)`` pairs (launchers that cannot know return [])."""
        return []

    def attach(self, controller: object) -> None:
        """Called before :meth:`launch` with the mesh's Controller (whose
        ``ranks[r].host`` / ``.pid`` a launcher may use for placements)."""
        self.controller = controller

    def wait_started(self, timeout: float) -> None:  # noqa: B027 - optional hook; default: no wait
        """Called after :meth:`launch`: block while the workers cannot start
        yet (a queued scheduler job), reporting progress; raise if they never
        will. Interruptible (KeyboardInterrupt). Default: return at once."""

    def default_bind(self) -> str:
        """The address the controller binds when the user gives none: loopback
        for local launchers, else the address that reaches the workers' hosts."""
        if self.local:
            return "127.0.0.1"
        return primary_address()

    @abc.abstractmethod
    def stop(self, ranks: list[int] | None = None, timeout: float = 5.0) -> None:
        """Make sure the processes of ``ranks`` (all if None) have exited:
        SIGTERM, then SIGKILL after ``timeout`` seconds; cancel jobs."""


def stop_processes(procs: list, timeout: float, grace: float = 2.0) -> None:
    """Wait up to ``timeout`` seconds for ``subprocess.Popen`` objects to exit,
    then SIGTERM them, then SIGKILL those still alive after ``grace`` seconds."""
    import subprocess
    import time

    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.terminate()
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)


def default_threads(nprocs_here: int) -> str:
    """OMP_NUM_THREADS per worker when the user set none (as torchrun does)."""
    return str(max(1, (os.cpu_count() or 1) // max(1, nprocs_here)))
