"""Recovery: restarting ranks by hand or automatically.

Fail fast is the default: a dead rank fails the cell or future that waited
on it (:class:`~monarch_kernel.errors.MeshFailure`) and the mesh keeps the
rank marked dead. Recovery is opt-in:

* :func:`restart_ranks` (``ProcMesh.restart(R)``, ``%mesh restart R``)
  replaces dead or live ranks with fresh processes holding the same ranks
  and shape, and re-runs ``torch.distributed`` set-up on the whole mesh
  when the mesh has one (survivors leave the old process group and join the
  new one);
* a :class:`Supervisor` (``spawn_procs(..., restart="on-failure",
  max_restarts=K)``, ``%mesh spawn ... --restart on-failure --max-restarts
  K``) does the same automatically for ranks that die, at most K times.

The idea follows Erlang/OTP supervisors and torchelastic's restart budget.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from .errors import MeshError

if TYPE_CHECKING:
    from .procmesh import ProcMesh

log = logging.getLogger("monarch_kernel.supervision")

__all__ = ["restart_ranks", "Supervisor", "RESTART_POLICIES"]

RESTART_POLICIES = ("never", "on-failure")


def restart_ranks(mesh: ProcMesh, ranks: list[int], timeout: float = 120.0) -> None:
    """Replace ``ranks`` of ``mesh`` with fresh worker processes.

    Live ranks are terminated first (SIGTERM, then SIGKILL after 2 s).
    Their namespaces are lost; other ranks keep theirs.

    Parameters
    ----------
    mesh : ProcMesh
    ranks : list of int
        Global ranks to replace.
    timeout : float
        Seconds to wait for the new workers (and the distributed set-up).

    Raises
    ------
    MeshError
        If the mesh was stopped or a rank is not part of it.
    MeshFailure
        If a new worker dies while starting.
    TimeoutError
        If the new workers do not connect in time.
    """
    root = mesh.root
    if root._stopped:
        raise MeshError("this mesh was stopped; spawn a new one (%mesh spawn N)")
    for r in ranks:
        if r not in root.controller.ranks:
            raise MeshError(f"rank {r} is not part of this mesh (ranks 0 to "
                            f"{len(root.shape) - 1})")
    ctl, la = root.controller, root.launcher
    la.forget(ranks)
    live = [r for r in ranks if ctl.ranks[r].state not in ("dead", "stopped")]
    if live:
        la.signal(live, signal.SIGTERM)
        la.stop(live, timeout=2.0)
        for r in live:
            ctl.mark_dead(r, -signal.SIGTERM)
    ctl.expect(ranks, local=la.local)
    spec = dataclasses.replace(root.spec, ranks=list(ranks))
    la.launch(spec)
    ctl.wait_ready(ranks, timeout)
    if root.dist:
        root.setup_dist(timeout)


class Supervisor:
    """Restarts ranks of a mesh that die, at most ``max_restarts`` times.

    Parameters
    ----------
    mesh : ProcMesh
    max_restarts : int
        Restart budget for the whole mesh.
    notify : callable(str) or None
        Where progress messages go (default: stderr).
    """

    def __init__(self, mesh: ProcMesh, max_restarts: int, notify: Any = None) -> None:
        if max_restarts < 0:
            raise MeshError("--max-restarts must be >= 0")
        self.mesh = mesh
        self.max_restarts = max_restarts
        self.restarts = 0
        self.history: list[tuple[float, int, str]] = []  # (time, rank, cause)
        self._notify = notify or (lambda text: print(text, file=sys.stderr, flush=True))
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        mesh.controller.listeners.append(self._on_event)

    def _on_event(self, kind: str, rank: int, payload: Any) -> None:
        if kind != "dead" or self.mesh.root._stopped:
            return
        with self._lock:
            if self.restarts >= self.max_restarts:
                self._notify(f"rank {rank} died and the restart budget "
                             f"({self.max_restarts}) is spent; not restarting it")
                return
            self.restarts += 1
            n = self.restarts
            self.history.append((time.time(), rank, str(payload).split(";")[0]))
        # mark it as starting now, so requests wait for the new process
        self.mesh.launcher.forget([rank])
        self.mesh.controller.expect([rank], local=self.mesh.launcher.local)
        self._notify(f"rank {rank} died ({str(payload).split(';')[0]}); restarting it "
                     f"({n} of {self.max_restarts})")
        t = threading.Thread(target=self._restart, args=(rank,), daemon=True,
                             name=f"monarch-restart-{rank}")
        self._threads.append(t)
        t.start()

    def _restart(self, rank: int) -> None:
        root = self.mesh.root
        try:
            spec = dataclasses.replace(root.spec, ranks=[rank])
            root.launcher.launch(spec)
            root.controller.wait_ready([rank], 120)
            if root.dist:
                root.setup_dist(120)
            self._notify(f"rank {rank} restarted")
        except Exception as e:  # noqa: BLE001 - reported, and the rank stays dead
            if not root._stopped:
                self._notify(f"restarting rank {rank} failed: {e}")
                root.controller.mark_dead(rank, None)
