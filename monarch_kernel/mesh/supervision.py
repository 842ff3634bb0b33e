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

from monarch_kernel.actor import mesh_keys
from monarch_kernel.errors import MESH_STOPPED, MeshError, ranks_label, restart_hint

if TYPE_CHECKING:
    from monarch_kernel.mesh.procmesh import ProcMesh

log = logging.getLogger("monarch_kernel.mesh.supervision")

__all__ = ["KILLED_BY", "KILL_AFTER_S", "RESTART_POLICIES", "Supervisor", "abort_survivors",
           "dead_hint", "kill_ranks", "restart_ranks", "stop_survivors"]

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
        If the mesh was stopped, a rank is not part of it, or the mesh was
        attached to (its processes were started by another controller, which
        this one cannot do again); nothing is ended then.
    MeshFailure
        If a new worker dies while starting.
    TimeoutError
        If the new workers do not connect in time.
    """
    root = mesh.root
    if root._stopped:
        raise MeshError(MESH_STOPPED)
    for r in ranks:
        if r not in root.controller.ranks:
            raise MeshError(f"rank {r} is not part of this mesh (ranks 0 to "
                            f"{len(root.shape) - 1})")
    if not root.launcher.can_relaunch:
        raise MeshError(f"mesh {root.name!r} was attached to, not spawned here: its ranks "
                        "cannot be restarted from this controller; stop it and spawn it "
                        "again to get fresh ranks")
    root.ready.clear()
    try:
        _relaunch(root, ranks, timeout)
    finally:
        root.ready.set()


def _relaunch(root: ProcMesh, ranks: list[int], timeout: float,
              notify: Any = None) -> list[int]:
    ctl, la = root.controller, root.launcher
    ranks = sorted(set(ranks))
    if root.dist:
        # survivors leave the old process group; ones stuck in a collective with a
        # dead rank cannot, so they are replaced too
        others = [r for r in root.ranks if r not in ranks
                  and ctl.ranks[r].state == "busy"]
        if others:
            root.interrupt(others)
            deadline = time.monotonic() + 3.0
            while time.monotonic() < deadline and any(
                    ctl.ranks[r].state == "busy" for r in others):
                time.sleep(0.05)
            stuck = [r for r in others if ctl.ranks[r].state == "busy"]
            if stuck:
                (notify or _stderr)(f"{ranks_label(stuck)} {'is' if len(stuck) == 1 else 'are'} "
                                    "stuck in a torch.distributed "
                                    "collective; restarting them too")
                ranks = sorted(set(ranks) | set(stuck))
    la.forget(ranks)
    live = [r for r in ranks if ctl.ranks[r].state not in ("dead", "stopped")]
    if live:
        la.signal(live, signal.SIGTERM)
        la.stop(live, timeout=2.0)
        for r in live:
            ctl.mark_dead(r, -signal.SIGTERM)
    ctl.expect(ranks, local=la.local)
    if root.spec is None:  # (spawn_procs gives every mesh it launches one)
        raise MeshError("this mesh was not launched by spawn_procs: it cannot restart ranks")
    # (each rank's new run: a new epoch, and the controller's messages until now refused)
    env = {r: dict(e) for r, e in root.spec.env.items()}
    for r, e in ctl.launch_env(ranks).items():
        env.setdefault(r, {}).update(e)
    spec = dataclasses.replace(root.spec, ranks=list(ranks), env=env)
    la.launch(spec)
    ctl.wait_ready(ranks, timeout)
    mesh_keys.introduce(ctl, ranks)  # a fresh process knows no other mesh's key
    if root.dist:
        root.setup_dist(timeout)
    return ranks


def _stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


#: seconds a rank may take to stop once interrupted before the mesh kills it
#: (SIGTERM, then SIGKILL): after a rank died (:func:`stop_survivors`), after the
#: stop button or a cell's timeout (the kernel's %%mesh magic)
KILL_AFTER_S = 5.0
#: seconds between the SIGTERM and the SIGKILL of :func:`kill_ranks`
TERM_GRACE_S = 0.5
#: how the failure of a rank that the mesh killed names its end
KILLED_BY = "the mesh after it ignored the interrupt"


def kill_ranks(mesh: ProcMesh, ranks: list[int], wait: Any = None,
               timeout: float = 5.0) -> list[int]:
    """Kill ``ranks`` of ``mesh`` that did not stop when interrupted: SIGTERM,
    then SIGKILL :data:`TERM_GRACE_S` later to those still alive, and wait until
    the controller has seen them die, at most ``timeout`` seconds.

    Their failures say that the mesh killed them (:data:`KILLED_BY`), not an
    outside signal. ``wait(seconds)``, when given, is called to pass time (to
    show what the ranks print meanwhile); else the thread sleeps.

    Returns
    -------
    list of int
        The ranks still not seen dead when ``timeout`` passed (normally none).
    """
    root = mesh.root
    ctl, la = root.controller, root.launcher
    pause = wait or time.sleep

    runs = {r: ctl.ranks.get(r) for r in ranks}  # (a rank restarted meanwhile is spared)

    def alive() -> list[int]:
        return [r for r in ranks if runs[r] is not None and ctl.ranks.get(r) is runs[r]
                and ctl.ranks[r].state not in ("dead", "stopped", "starting")]

    targets = alive()
    if not targets or root._stopped:
        return []
    for r in targets:
        ctl.ranks[r].killed_by = KILLED_BY
    try:
        la.signal(targets, signal.SIGTERM)
        deadline = time.monotonic() + TERM_GRACE_S
        while alive() and time.monotonic() < deadline:
            pause(0.02)
        if alive():
            la.signal(alive(), signal.SIGKILL)
    except Exception:  # noqa: BLE001 - a launcher that cannot signal: they stay alive
        log.exception("cannot kill %s", ranks_label(targets))
    deadline = time.monotonic() + timeout
    while alive() and time.monotonic() < deadline:
        pause(0.02)
    return alive()


def dead_hint(mesh: ProcMesh) -> str:
    """How to replace every dead rank of ``mesh``'s root mesh
    (:func:`monarch_kernel.errors.restart_hint`), or ``""``."""
    ctl = mesh.root.controller
    dead = [r for r, info in ctl.ranks.items() if info.state == "dead"]
    return restart_hint(dead, len(mesh.root.ranks))


def stop_survivors(mesh: ProcMesh, req: Any, on_event: Any,
                   grace: float = KILL_AFTER_S) -> list[int]:
    """After a rank of request ``req`` died: interrupt its ranks that still run
    (:func:`abort_survivors`) and hand their events (what they print) to
    ``on_event`` until they have stopped, at most ``grace`` seconds, so output
    they wrote just before is not lost with the failed request. Ranks still
    running it then (busy in C code, or ignoring SIGINT) are killed
    (:func:`kill_ranks`); so is every one still running at a Ctrl-C meanwhile.
    When this returns, no rank runs ``req`` any more (unless a launcher could
    not kill it within 5 s).

    Returns
    -------
    list of int
        The ranks that were killed.
    """
    ctl = mesh.root.controller
    runs = {r: ctl.ranks.get(r) for r in req.ranks}  # (a restarted rank is a new run)

    def running() -> list[int]:
        return [r for r in req.ranks if r not in req.replies and ctl.ranks.get(r) is runs[r]
                and ctl.ranks[r].state not in ("dead", "stopped", "starting")]

    def show(seconds: float) -> None:  # pass time, showing what the ranks print
        until = time.monotonic() + seconds
        while True:
            ev = req.next_event(0)  # (a failed request is done: no waiting; the I/O thread reads)
            if ev is not None:
                on_event(ev)
            if time.monotonic() >= until:
                return
            if ev is None:
                time.sleep(0.01)

    abort_survivors(mesh, running())
    deadline = time.monotonic() + grace
    try:
        while running() and time.monotonic() < deadline:
            show(0.02)
    except KeyboardInterrupt:  # interrupted again: kill what still runs now
        pass
    stuck = running()
    if stuck and not mesh.root._stopped:
        kill_ranks(mesh, stuck, wait=show)
    while (ev := req.next_event(0)) is not None:  # what came with their replies
        on_event(ev)
    return stuck


def abort_survivors(mesh: ProcMesh, ranks: list[int], grace: float = 3.0) -> None:
    """After a rank died: interrupt ``ranks`` that are still running.

    In a ``torch.distributed`` mesh, ranks still busy after ``grace`` seconds
    are stuck in a collective with the dead rank (SIGINT cannot reach code
    blocked in C++); they are killed, with a message, so nothing waits
    forever. Runs in a background thread; returns at once.
    """
    root = mesh.root
    ctl = root.controller
    running = [r for r in ranks if ctl.ranks[r].state == "busy"]
    if not running or root._stopped:
        return
    root.interrupt(running)
    return _watch_stuck(root, running, grace)


def _watch_stuck(root: ProcMesh, running: list[int], grace: float) -> None:
    ctl = root.controller
    if not root.dist:
        return

    def watch() -> None:
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if root._stopped or not any(ctl.ranks[r].state == "busy" for r in running):
                return
            time.sleep(0.05)
        stuck = [r for r in running if ctl.ranks[r].state == "busy"]
        if stuck and not root._stopped and root.ready.is_set():
            were = "was" if len(stuck) == 1 else "were"
            _stderr(f"{ranks_label(stuck)} {were} stuck in a torch.distributed collective with "
                    f"a dead rank and {were} stopped; run  %mesh restart all  (or mesh.restart())")
            root.launcher.signal(stuck, signal.SIGKILL)

    threading.Thread(target=watch, daemon=True, name="monarch-abort").start()


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
        self._restarting = False
        self._threads: list[threading.Thread] = []
        mesh.controller.listeners.append(self._on_event)

    def _on_event(self, kind: str, rank: int, payload: Any) -> None:
        root = self.mesh.root
        if kind != "dead" or root._stopped or self._restarting:
            return
        cause = str(payload).split(";")[0].split("\n")[0]
        with self._lock:
            if self.restarts >= self.max_restarts:
                self._notify(f"rank {rank} died and the restart budget "
                             f"({self.max_restarts}) is spent; not restarting it")
                return
            self.restarts += 1
            n = self.restarts
            self.history.append((time.time(), rank, cause))
            self._restarting = True
        root.ready.clear()  # requests wait for the restart
        # a torch.distributed group cannot lose a member: restart every rank, as
        # torchelastic does; otherwise only the dead one
        ranks = root.ranks if root.dist else [rank]
        what = "the whole mesh" if root.dist else "it"
        self._notify(f"rank {rank} died ({cause}); restarting {what} "
                     f"({n} of {self.max_restarts})")
        t = threading.Thread(target=self._restart, args=(ranks,), daemon=True,
                             name="monarch-restart")
        self._threads.append(t)
        t.start()

    def _restart(self, ranks: list[int]) -> None:
        root = self.mesh.root
        try:
            done = _relaunch(root, ranks, 120, self._notify)
            self._notify(f"{ranks_label(done)} restarted")
        except Exception as e:  # noqa: BLE001 - reported, and the ranks stay dead
            if not root._stopped:
                self._notify(f"restarting {ranks_label(ranks)} failed: {e}")
                for r in ranks:
                    root.controller.mark_dead(r, None)
        finally:
            self._restarting = False
            root.ready.set()
