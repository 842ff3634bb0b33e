"""Process meshes: spawning worker processes and driving them.

:func:`spawn_procs` starts a controller and a launcher, waits until every
worker connected, and (with ``dist``) runs ``torch.distributed`` set-up on
every rank. The :class:`ProcMesh` it returns runs cells, moves variables,
spawns actors (:meth:`ProcMesh.spawn`), and is stopped with
:meth:`ProcMesh.stop` or a ``with`` block. A script that forgets to stop
its meshes has them stopped at exit.

A mesh spawned with a name and ``detach=True`` outlives this controller
(:meth:`ProcMesh.detach`, a crash, the program's end): another controller
finds it in the per-user registry (:mod:`monarch_kernel.mesh.registry`) and
attaches (:func:`attach`, :mod:`monarch_kernel.mesh.durable`); the ranks'
side is :mod:`monarch_kernel.worker.detach`.
"""

from __future__ import annotations

import atexit
import os
import secrets
import shutil
import signal
import socket
import sys
import threading
import time
import weakref
from typing import Any

from monarch_kernel.actor import mesh_keys
from monarch_kernel.actor.host import supervise_from_current_actor
from monarch_kernel.actor.spawn import existing_actor_mesh, spawn_actor_mesh
from monarch_kernel.controller.controller import Controller, Request
from monarch_kernel.controller.output import RankPrinter, write_stream
from monarch_kernel.debug.registry import registry_for
from monarch_kernel.errors import (
    MESH_STOPPED,
    MeshBusyError,
    MeshError,
    MeshFailure,
    NoMeshError,
    RankSpecError,
    SerializationError,
    SpawnInterrupted,
    compact_ranks,
    raise_request_failures,
    ranks_label,
)
from monarch_kernel.launchers import Launcher, LaunchSpec, get_launcher
from monarch_kernel.launchers.local import AdoptedLauncher, DetachPlan
from monarch_kernel.mesh import durable, registry
from monarch_kernel.mesh.dist_setup import DIST_BACKENDS, setup_mesh
from monarch_kernel.mesh.durable import HelloStates, Resumed
from monarch_kernel.mesh.shape import Shape, ValueMesh, parse_ranks
from monarch_kernel.mesh.supervision import (
    RESTART_POLICIES,
    Supervisor,
    dead_hint,
    restart_ranks,
    stop_survivors,
)
from monarch_kernel.tensors.handles import ref_of
from monarch_kernel.transport.netaddr import is_wildcard, resolve_bind
from monarch_kernel.transport.sockets import is_loopback
from monarch_kernel.util.numbers import check_number
from monarch_kernel.util.sigint import DeferredSigint
from monarch_kernel.wire.serialize import Packed, cuda_ipc, find_unpicklable

__all__ = ["MAX_RANKS_PER_CPU", "WORKER_MEMORY", "HostMesh", "ProcMesh", "Resumed", "attach",
           "check_spawn", "host_capacity", "live_meshes", "spawn_procs", "stop_mesh",
           "this_host"]

#: a local mesh may have at most this many ranks per CPU of this host without ``force``
MAX_RANKS_PER_CPU = 8
#: bytes an idle worker holds (its resident set: the interpreter, pyzmq, cloudpickle);
#: a local mesh whose ranks need more than the host's available memory needs ``force``
WORKER_MEMORY = 32 << 20

_live: weakref.WeakSet[ProcMesh] = weakref.WeakSet()


def live_meshes() -> list[ProcMesh]:
    """The root meshes this process spawned and did not stop yet."""
    return list(_live)

class ProcMesh:
    """A mesh of worker processes with named dimensions.

    Created by :func:`spawn_procs`, ``this_host().spawn_procs(...)`` or the
    ``%mesh spawn`` magic. Slices (:meth:`slice`) share the processes.

    Attributes
    ----------
    shape : Shape
    controller : Controller
    launcher : Launcher
    dist : str or None
        The ``torch.distributed`` backend set up on every rank, if any.
    """

    def __init__(self, controller: Controller, launcher: Launcher, shape: Shape,
                 dist: str | None = None, root: ProcMesh | None = None) -> None:
        self.controller = controller
        self.launcher = launcher
        self.shape = shape
        self.dist = dist
        self._root = root
        self._stopped = False
        self._cell = 0
        self._lock = threading.Lock()
        self.spec: LaunchSpec | None = None  # how the root mesh was launched
        self.ready = threading.Event()  # cleared while ranks are being restarted
        self.ready.set()
        self.supervisor: Any = None
        #: the mesh's name (a named, registered mesh), or None
        self.name: str | None = None
        #: spawned detachable (outlives this controller; see detach())
        self.detached = False
        #: seconds the ranks of a detachable mesh live with no controller (None: not one)
        self.keep_alive: float | None = None
        #: True when spawn_procs(name=...) found the mesh alive and attached to it
        self.attached_existing = False
        #: what the ranks reported at attach: one row per request they ran (Resumed)
        self.resumed: list[Resumed] = []
        #: replies of requests finished while detached that the ranks dropped beyond
        #: their bound (``MONARCH_DETACH_REPLIES`` per rank), summed over the ranks
        self.dropped_replies = 0
        self.record: registry.MeshRecord | None = None
        self._gone: str | None = None  # why this handle no longer drives the mesh
        self._actor_meshes: dict[str, Any] = {}  # name -> ActorMesh (spawned or reported)
        self._reported_actors: dict[int, dict[str, Any]] = {}  # rank -> {name: info}
        self._paused: list[int] = []

    # --------------------------------------------------------------- shape
    @property
    def root(self) -> ProcMesh:
        return self._root or self

    @property
    def sizes(self) -> dict[str, int]:
        """``{dimension: size}``."""
        return self.shape.dims

    @property
    def ranks(self) -> list[int]:
        """Global ranks of this mesh, row-major."""
        return list(self.shape.ranks)

    @property
    def transport(self) -> str:
        """How this mesh's workers talk to its controller: ``"lanes"`` (Unix
        socket pairs, :mod:`monarch_kernel.transport.lane`: workers the controller
        started on its own host, the default), ``"zeromq"``, ``"mixed"``, or
        ``"stopped"``."""
        if self.root._stopped:
            return "stopped"
        ctl = self.root.controller
        laned = sum(1 for r in self.ranks if r in ctl.lane_of)
        return "lanes" if laned == len(self.ranks) else "zeromq" if not laned else "mixed"

    @property
    def world_size(self) -> int:
        """Ranks in the whole (root) mesh."""
        return len(self.root.shape)

    def __len__(self) -> int:
        return len(self.shape)

    def __repr__(self) -> str:
        state = "stopped" if self.root._stopped else self.launcher.name
        return f"<ProcMesh {self.shape.dims} ({state})>"

    def slice(self, **selectors: int | slice) -> ProcMesh:
        """A sub-mesh over the same processes (``procs=0``, ``procs=slice(0, 2)``)."""
        return ProcMesh(self.controller, self.launcher, self.shape.slice(**selectors),
                        self.dist, self.root)

    # ------------------------------------------------------------ requests
    def _check(self) -> None:
        root = self.root
        if root._gone is not None:
            raise MeshError(root._gone)
        if root._stopped:
            raise MeshFailure(MESH_STOPPED)
        if not root.ready.is_set() and not root.ready.wait(root.controller.restart_timeout):
            raise MeshFailure("ranks of this mesh are still being restarted after "
                              f"{root.controller.restart_timeout:.0f} s")

    def request(self, type: str, content: Any = None, ranks: list[int] | None = None
                ) -> Request:
        """Send a request to ``ranks`` (default: this mesh's ranks)."""
        self._check()
        return self.controller.request(self.ranks if ranks is None else ranks, type, content)

    def run(self, code: str, ranks: list[int] | None = None, *, filename: str | None = None,
            prefix: str = "") -> Request:
        """Start running ``code`` as a cell on ``ranks``; returns the :class:`Request`.

        ``filename``: the name tracebacks and pdb give the code (default
        ``<mesh-cell-N>``, N counting this mesh's cells); ``prefix``: the lines
        of the notebook cell above ``code`` (its ``%%mesh`` line), so that line
        numbers are the editor's (see :mod:`monarch_kernel.util.cells`).
        """
        if filename is None:
            with self._lock:
                self.root._cell += 1
                filename = f"<mesh-cell-{self.root._cell}>"
        content = {"code": code, "filename": filename}
        if prefix:
            content["prefix"] = prefix
        return self.request("execute", content, ranks)

    def collect(self, req: Request, ranks: list[int] | None = None,
                timeout: float | None = None) -> ValueMesh:
        """Wait for ``req`` and return its values as a :class:`ValueMesh`.

        Raises
        ------
        MeshFailure
            If a rank died before answering.
        RemoteError
            If ranks raised; an instance of the original exception type when
            all failing ranks raised alike.
        TimeoutError
            If ``timeout`` seconds passed first.
        MeshError
            For a ``timeout`` that is not a positive, finite number of seconds.

        Output the ranks print meanwhile is written to ``sys.stdout`` /
        ``sys.stderr`` live, tagged by rank.
        """
        if timeout is not None:
            timeout = _seconds(timeout, "timeout")
        if not show_output(req, timeout):
            raise TimeoutError(f"no answer from {ranks_label(req.ranks)} within {timeout:g} s")
        if req.failure is not None and self.root._gone is None:  # fail fast: stop the rest
            printer = RankPrinter(write_stream)
            try:
                killed = stop_survivors(self, req, lambda ev: _print_event(printer, ev))
            finally:
                printer.close()
            failure = req.failure
            if killed:  # (a rank that did not stop: named in one line under the failure)
                failure.killed = sorted(set(failure.killed) | set(killed))
            if failure.killed:
                failure.restart = dead_hint(self)
        raise_request_failures(req)
        shape = self._shape_for(req.ranks if ranks is None else ranks)
        return ValueMesh(shape, [req.replies[r][1] for r in shape.ranks])

    def _shape_for(self, ranks: list[int]) -> Shape:
        if sorted(ranks) == sorted(self.shape.ranks):
            return self.shape
        return Shape({"ranks": len(ranks)}, sorted(ranks))

    def exec(self, code: str, timeout: float | None = None) -> ValueMesh:
        """Run ``code`` on every rank and return the last expression's values.

        Raises
        ------
        MeshError
            For a ``timeout`` that is not a positive, finite number of seconds
            (before ``code`` runs); else as :meth:`collect`.
        """
        if timeout is not None:
            timeout = _seconds(timeout, "timeout")
        return self.collect(self.run(code), timeout=timeout)

    def push(self, **values: Any) -> None:
        """Copy ``values`` into every rank's namespace.

        Each value is pickled on its own, so an error names it.

        Raises
        ------
        SerializationError
            If a value cannot be pickled: the message names the variable and the
            part of it that fails (``f.__closure__[0].cell_contents -> _thread.lock``).
        RemoteError
            (also a :class:`SerializationError`) if a value cannot be unpickled on
            the ranks: the message names the variable and the class that is missing.
        """
        self._check()
        ranks = self.ranks
        ctl = self.controller
        packed: dict[str, Any] = {}
        # (one process on this host: large CUDA tensors may go by IPC handle, as a
        # request's content would)
        with cuda_ipc(len(ranks) == 1 and ranks[0] in ctl.local_ranks):
            for name, value in values.items():
                try:
                    packed[name] = Packed.pack(value)
                except SerializationError as e:
                    raise SerializationError(unsendable(name, value, e), brief=True) from None
        self.collect(self.request("push", packed))

    def pull(self, name: str) -> ValueMesh:
        """A variable from every rank's namespace, as a :class:`ValueMesh`.

        Raises
        ------
        RemoteError
            (also a ``NameError``) if a rank has no such variable.
        """
        vm = self.collect(self.request("pull", {"names": [name]}))
        return ValueMesh(vm.shape, [v[0] for v in vm.values()])

    def interrupt(self, ranks: list[int] | None = None) -> None:
        """Interrupt the code running on ``ranks`` (KeyboardInterrupt there)."""
        ranks = self.ranks if ranks is None else ranks
        if self.launcher.local:
            import signal

            self.launcher.signal(ranks, signal.SIGINT)
        else:
            self.controller.notify(ranks, "interrupt")

    def status(self) -> list[dict[str, Any]]:
        """One row per rank: rank, host, pid, state, exit code, message counts."""
        rows = []
        placements = self.launcher.placements()
        for r in self.ranks:
            info = self.controller.ranks[r]
            p = placements.get(r)
            rows.append({
                "rank": r,
                "host": info.host or (p.host if p else ""),
                "pid": info.pid or (p.pid if p else None),
                "job": p.job if p else None,
                "state": "stopped" if self.root._stopped else info.state,
                "exitcode": info.exitcode,
                "messages_in": info.messages_in,
                "messages_out": info.messages_out,
                **info.telemetry,
            })
        return rows

    def setup_dist(self, timeout: float = 120.0) -> None:
        """Run ``torch.distributed`` set-up on every rank of the root mesh.

        MASTER_ADDR is the host of rank 0 (the controller's address for local
        meshes; for other launchers rank 0's address on the interface that
        routes to the controller, which its peers can reach whatever its host
        name resolves to); MASTER_PORT a free port there.
        """
        setup_mesh(self.root, _seconds(timeout, "timeout"))

    # ---------------------------------------------------------------- actors
    def spawn(self, name: str, actor_class: type, *args: Any, **kwargs: Any) -> Any:
        """Construct ``actor_class(*args, **kwargs)`` on every rank: an ActorMesh."""
        am = spawn_actor_mesh(self, name, actor_class, args, kwargs)
        if self.shape.ranks == self.root.shape.ranks:
            self.root._actor_meshes[name] = am
        return am

    def actors(self, name: str) -> Any:
        """A handle to the actor mesh ``name`` that runs on this mesh's ranks (spawned
        by this controller, or found on the ranks when it attached).

        Raises
        ------
        MeshError
            If no actor of that name runs on these ranks.
        """
        self._check()
        root = self.root
        am = root._actor_meshes.get(name)
        if am is None:
            infos = {r: a[name] for r, a in root._reported_actors.items() if name in a}
            if not infos:
                known = sorted({n for a in root._reported_actors.values() for n in a}
                               | set(root._actor_meshes))
                raise MeshError(f"no actor mesh named {name!r} runs on this mesh"
                                + (f" (there is: {', '.join(known)})" if known else ""))
            first = next(iter(infos.values()))
            am = existing_actor_mesh(root, name, first["uid"],
                                     {r: i["peer"] for r, i in infos.items()},
                                     tuple(first["endpoints"]), first["cls"])
            root._actor_meshes[name] = am
        return am

    def paused_ranks(self) -> list[int]:
        """The ranks that were stopped in the debugger (pdb) when this controller
        attached, and those paused since (as far as this controller heard)."""
        root = self.root
        paused = set(root._paused)
        paused.update(r for r, i in root.controller.ranks.items() if i.state == "paused")
        return sorted(r for r in paused if r in self.ranks)

    def follow(self, timeout: float | None = None) -> Any:
        """Wait for the requests the ranks still ran when this controller attached
        (or finished while detached) to end, their output shown as a cell's is
        (rank-tagged on ``sys.stdout``/``sys.stderr``, the kept output first).

        Returns
        -------
        ValueMesh, list of ValueMesh, or None
            The result of the one resumed request (its ranks' values), a list when
            there were several, None when there was none.

        Raises
        ------
        RemoteError, MeshFailure
            As :meth:`collect`, for the first request that failed.
        TimeoutError
            If ``timeout`` seconds passed first.
        """
        root = self.root
        reqs = [q for q in root.controller.resumed.values()]
        deadline = None if timeout is None else time.monotonic() + _seconds(timeout, "timeout")
        out = []
        for req in reqs:
            left = None if deadline is None else max(0.001, deadline - time.monotonic())
            out.append(self.collect(req, req.ranks, timeout=left))
        root.controller.resumed.clear()
        if not out:
            return None
        return out[0] if len(out) == 1 else out

    def ref(self, name: str) -> Any:
        """A handle to variable ``name`` of every rank of this mesh; the values stay on
        the ranks (see :class:`monarch_kernel.tensors.handles.Ref`).

        Raises
        ------
        RemoteError
            (also a NameError) if a rank has no such variable.
        """
        return ref_of(self, name)

    def dashboard(self, interval: float = 1.0, history: float = 60.0, layout: str = "auto"
                  ) -> Any:
        """A live ipywidgets dashboard of this mesh's ranks (CPU, memory, GPU).

        See :class:`monarch_kernel.ui.dashboard.Dashboard` for the parameters.

        Raises
        ------
        MeshFailure
            If the mesh was stopped.
        """
        self._check()
        from monarch_kernel.ui.dashboard import Dashboard  # (ipywidgets: heavy, loaded on use)

        return Dashboard(self, interval=interval, history=history, layout=layout)

    # ------------------------------------------------------------- recovery
    def restart(self, ranks: int | str | list[int] | None = None, timeout: float = 120.0
                ) -> None:
        """Replace ``ranks`` (default: this mesh's ranks) with fresh processes.

        Parameters
        ----------
        ranks : int, str, list of int or None
            A rank, a rank spec as ``%mesh restart`` takes (``"1,2"``,
            ``"0:4"``, ``"all"``), or a list of ranks.
        timeout : float
            Seconds to wait for the new processes.

        Raises
        ------
        RankSpecError
            For a rank spec that does not parse or names no rank of the mesh.

        See :func:`monarch_kernel.mesh.supervision.restart_ranks`.
        """
        if ranks is None:
            ranks = self.ranks
        elif isinstance(ranks, str):
            # ("all": this mesh's ranks, which a slice has fewer of than the root)
            ranks = (self.ranks if ranks.strip() in ("all", "*", "")
                     else parse_ranks(ranks, self.world_size))
            mine = set(self.ranks)
            outside = [r for r in ranks if r not in mine]
            if outside:
                raise RankSpecError(f"{ranks_label(outside)} {'is' if len(outside) == 1 else 'are'}"
                                    f" not part of this mesh (its ranks: "
                                    f"{compact_ranks(self.ranks)})")
        elif isinstance(ranks, int):
            ranks = [ranks]
        restart_ranks(self, list(ranks), _seconds(timeout, "timeout"))

    # --------------------------------------------------------------- closing
    def detach(self, timeout: float = 5.0, *, shown: bool = False) -> None:
        """Leave a detachable mesh running and close this controller's side: the
        ranks keep their state and go on with what they run, keeping its output,
        until a controller attaches (``monarch_kernel.attach(name)``) or their
        keep-alive passes. This handle is unusable afterwards.

        ``shown``: this controller showed all the output it received; the ranks
        then drop what they had sent, and the next attach replays only the
        output printed after the detach. Without it the next attach replays
        each running request's output from its start.

        Raises
        ------
        MeshError
            If the mesh was not spawned with ``detach=True``.
        """
        root = self.root
        if root._gone is not None or root._stopped:
            return
        if not root.detached or root.record is None:
            raise MeshError("this mesh was not spawned detachable; spawn it with "
                            "spawn_procs(..., name='NAME', detach=True) to detach it")
        ctl = root.controller
        live = [r for r, i in ctl.ranks.items() if i.state not in ("dead", "stopped",
                                                                   "starting")]
        told = time.time()  # (the ranks' keep-alive starts after this)
        try:  # (a reply each: the ranks heard it before this side closes)
            req = ctl.request(live, "detach", {"shown": shown}) if live else None
            if req is not None:
                req.wait(timeout)
        except MeshFailure:
            pass
        root._gone = (f"this handle detached from mesh {root.name!r}; attach again with "
                      f"monarch_kernel.attach({root.name!r}) (or %mesh attach {root.name})")
        ctl.stopping = True
        mesh_keys.unregister(ctl)
        ctl.close()
        release = getattr(root.launcher, "release", None)
        if release is not None:
            release()
        durable.mark_detached(root.record, at=told)
        _live.discard(root)

    def _taken_over(self, pid: Any, host: Any, stopped: bool = False) -> None:
        """The ranks were taken over by another controller (steal), or by one that
        stops the mesh (``stopped``): this handle is done."""
        root = self.root
        if root._gone is not None:
            return
        if stopped:
            root._gone = (f"mesh {root.name!r} was stopped by pid {pid} on host {host}, "
                          "from outside this process; its ranks are gone: spawn a new mesh "
                          "to go on")
        else:
            root._gone = (f"mesh {root.name!r} was taken over by pid {pid} on host {host}; "
                          f"attach again with monarch_kernel.attach({root.name!r}, "
                          "steal=True) to take it back")
        root.controller.fail_pending(root._gone)
        _live.discard(root)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop every worker of the (root) mesh and close the controller; a named
        mesh's registry record, directory and guardian go too.

        Idempotent. Workers that do not exit within ``timeout`` seconds are
        terminated, then killed.
        """
        root = self.root
        if root._gone is not None:
            raise MeshError(root._gone)
        if root._stopped:
            return
        root._stopped = True
        mesh_keys.unregister(root.controller)  # the other meshes' workers forget its key
        root.controller.stopping = True  # exits from here on are "stopped", not "dead"
        live = [r for r, i in root.controller.ranks.items() if i.state not in ("dead", "stopped")]
        # ranks still starting (never said hello) get no request: it would wait for them
        started = [r for r in live if root.controller.ranks[r].state != "starting"]
        try:
            reqs = root.controller.request(started, "stop") if started else None
            if reqs is not None:
                reqs.wait(timeout)
        except MeshFailure:
            pass
        root.launcher.stop(timeout=timeout)
        for r in live:
            root.controller.mark_dead(r, 0, state="stopped")
        root.controller.close()
        _live.discard(root)
        if root.record is not None:
            _remove_traces(root.record)

    def __enter__(self) -> ProcMesh:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _seconds(value: Any, name: str) -> float:
    """``value`` as a positive, finite number of seconds, else MeshError."""
    try:
        return float(check_number(value, name, above=True, seconds=True))
    except ValueError as e:
        raise MeshError(str(e)) from None


def show_output(req: Request, timeout: float | None = None) -> bool:
    """Print ``req``'s rank-tagged output live until it is done; True if done."""
    printer = RankPrinter(write_stream)
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while True:
            done = req.done()
            ev = req.next_event(0.02)
            if ev is None:
                printer.flush_lines()
                if done:
                    return True
                if deadline is not None and time.monotonic() > deadline:
                    return False
                continue
            _print_event(printer, ev)
    finally:
        printer.close()


def _print_event(printer: Any, ev: tuple) -> None:
    if ev[0] == "stream":
        printer.feed(ev[1], ev[2], ev[3])
    elif ev[0] == "display":
        text = ev[2].get("data", {}).get("text/plain")
        if text:
            printer.feed(ev[1], "stdout", text + "\n")


def unsendable(name: str, value: Any, e: BaseException) -> str:
    """What a user is told when variable ``name`` cannot be sent (``e``: why)."""
    found = find_unpicklable(value, name)
    if found is None:  # (it failed with others, or only now and then)
        return f"cannot send {name!r} to the ranks: {e.__cause__ or e}"
    path, kind, reason = found
    return (f"cannot send {name!r} to the ranks: {path} -> {kind} cannot be pickled "
            f"({reason}); create that on the ranks instead (in a %%mesh cell), or leave "
            "it out of what you send")


def _remove_traces(rec: registry.MeshRecord, timeout: float = 5.0) -> None:
    """Remove what a stopped named mesh leaves: its registry record, its directory,
    and (waited for) its guardian."""
    registry.remove(rec.name, rec.mesh_id)
    if rec.mesh_dir and os.path.basename(rec.mesh_dir).startswith("mkm-"):
        shutil.rmtree(rec.mesh_dir, ignore_errors=True)
    if rec.guardian_pid and rec.host == socket.gethostname():
        deadline = time.monotonic() + timeout
        while _alive(rec.guardian_pid) and time.monotonic() < deadline:
            time.sleep(0.02)


def attach(name: str, *, steal: bool = False, timeout: float = 30.0,
           on_output: Any = None) -> ProcMesh:
    """Attach this process, as the controller, to the running detachable mesh ``name``.

    The returned mesh drives the same processes (their namespaces and actors
    intact); :attr:`ProcMesh.resumed` lists what they ran meanwhile and
    :meth:`ProcMesh.follow` follows it to its end.

    Parameters
    ----------
    name : str
    steal : bool
        Take the mesh over from another controller that is alive (which is told).
    timeout : float
        Seconds to wait for the ranks.
    on_output : callable(rank, name, text) or None
        As for :func:`spawn_procs`.

    Raises
    ------
    NoMeshError
        If there is no live mesh of that name.
    MeshBusyError
        If another live controller holds it and ``steal`` is False.
    MeshError, TimeoutError
        If the ranks cannot be reached.
    """
    try:
        return _attach(name, steal=steal, timeout=timeout, on_output=on_output)
    except MeshError as e:  # (raised here: the user's frames only, not ours)
        raise e.with_traceback(None) from None


def _attach(name: str, *, steal: bool, timeout: float, on_output: Any,
            stop: bool = False) -> ProcMesh:
    """:func:`attach`; ``stop``: the ranks are taken over only to be stopped (a
    controller that holds them is told so)."""
    rec = registry.load(name) if registry.valid_name(name) else None
    if rec is None or not registry.alive(rec):
        if rec is not None:
            registry.remove(name, rec.mesh_id)
        raise NoMeshError(f"no mesh named {name!r} is running for this user (spawn one "
                          f"with spawn_procs(..., name={name!r}, detach=True); `%mesh list` "
                          "shows the meshes there are)")
    timeout = _seconds(timeout, "timeout")
    if rec.launcher == "local" and rec.host == socket.gethostname():
        ended = sorted(r for r, p in rec.pids.items() if not registry.pid_alive(p))
        if ended:
            raise MeshError(f"mesh {name!r} cannot be attached: {ranks_label(ended)} "
                            f"ended while it was detached; end the rest with "
                            f"monarch_kernel.stop_mesh({name!r}, force=True) "
                            f"(%mesh stop {name} --force) and spawn it again")
    la = durable.adopted_launcher(rec)
    heartbeat = float(rec.extra.get("heartbeat", 1.0))
    world = list(range(rec.world_size))
    addr = None if la.local else la.default_bind()
    ctl = _controller_for(la, addr, heartbeat, on_output, key=bytes.fromhex(rec.key_hex))
    try:
        mesh = ProcMesh(ctl, la, Shape(rec.shape))
        mesh.name, mesh.detached, mesh.keep_alive, mesh.record = (
            rec.name, True, rec.keep_alive, rec)
        _watch_take_over(mesh)
        ctl.expect(world, local=la.local)
        states = HelloStates(ctl, world)
        ctl.listeners.append(states)
        la.attach(ctl)
        gone = rec.controller if rec.controller and not registry.controller_alive(rec) \
            else None
        durable.attach_ranks(ctl, rec, steal, timeout, holder_gone=gone, stop=stop)
        ctl.wait_ready(world, timeout)
        states.wait(world, timeout)
        pids = {r: int(i.pid) for r, i in ctl.ranks.items() if i.pid}
        known = getattr(la, "pids", None)
        if isinstance(known, dict):
            known.update(pids)  # (what the ranks said: the record may be older)
        ctl.poll_exits = la.poll
        ctl.listeners.remove(states)
        ctl.settle_resumed()
        mesh.resumed = states.resumed()
        mesh.dropped_replies = sum(int(st.get("dropped_replies") or 0)
                                   for st in states.states.values())
        for r, st in states.states.items():
            mesh._reported_actors[r] = st.get("actors") or {}
            if st.get("paused"):
                mesh._paused.append(r)
            for content in st.get("debug") or ():  # (pdb sessions paused while detached)
                registry_for(ctl).update(r, content)
        mesh_keys.register(ctl)
        mesh_keys.introduce(ctl, world)
    except BaseException:
        ctl.close()
        if isinstance(la, AdoptedLauncher):
            la.close_guard()
        raise
    rec.controller = {"pid": os.getpid(), "host": socket.gethostname()}
    rec.last_seen = time.time()
    rec.pids = {r: int(i.pid) for r, i in ctl.ranks.items() if i.pid} or rec.pids
    cur = registry.load(name)
    if cur is not None and cur.mesh_id == rec.mesh_id:
        registry.save(rec)
    _live.add(mesh)
    return mesh


def stop_mesh(name: str, timeout: float = 10.0, force: bool = False) -> None:
    """End the named mesh without keeping it attached: every rank stops and every
    trace goes (processes, sockets, registry record).

    Raises
    ------
    NoMeshError
        If there is no live mesh of that name.
    MeshBusyError
        If another live controller holds it (``force=True`` takes it over first).
    """
    for m in live_meshes():
        if m.name == name:
            m.stop(timeout=timeout)
            return
    rec = registry.load(name) if registry.valid_name(name) else None
    if (rec is not None and rec.launcher == "local" and rec.host == socket.gethostname()
            and any(not registry.pid_alive(p) for p in rec.pids.values())):
        # (some ranks ended while detached: it cannot be attached whole; end the rest)
        if not force and registry.controller_alive(rec):
            raise MeshBusyError(f"mesh {name!r} is attached to another controller; stop it "
                                f"there, or here with force=True (%mesh stop {name} --force)")
        AdoptedLauncher(rec.pids).stop(timeout=0.0)
        _remove_traces(rec, timeout)
        return
    try:
        mesh = _attach(name, steal=force, timeout=timeout, on_output=None, stop=True)
    except MeshBusyError as e:
        err = MeshBusyError(f"mesh {name!r} is attached to another controller (pid "
                            f"{e.holder_pid} on host {e.holder_host}); stop it there, or "
                            f"here with force=True (%mesh stop {name} --force)")
        err.holder_pid, err.holder_host = e.holder_pid, e.holder_host
        raise err from None
    mesh.stop(timeout=timeout)


def _watch_take_over(mesh: ProcMesh) -> None:
    """Have ``mesh`` hear that another controller took its ranks over (steal)."""
    ref = weakref.ref(mesh)

    def listener(kind: str, rank: int, payload: Any) -> None:
        m = ref()
        if m is None or not isinstance(payload, dict):
            return
        if kind == "event" and payload.get("kind") == "taken_over":
            m._taken_over(payload.get("pid"), payload.get("host"), bool(payload.get("stop")))
        elif kind == "hello" and m.record is not None and payload.get("pid"):
            rec = m.record  # a restarted rank: the record names its new process
            if rec.pids.get(rank) != payload["pid"]:
                rec.pids[rank] = int(payload["pid"])
                if payload.get("attach"):
                    rec.endpoints[rank] = str(payload["attach"])
                cur = registry.load(rec.name)
                if cur is not None and cur.mesh_id == rec.mesh_id:
                    cur.pids, cur.endpoints = dict(rec.pids), dict(rec.endpoints)
                    registry.save(cur)

    mesh.controller.listeners.append(listener)


def spawn_procs(
    shape: dict[str, int] | int = 1,
    *,
    dist: str | None = None,
    launcher: str | Launcher = "local",
    bind: str | None = None,
    heartbeat: float = 1.0,
    timeout: float = 120.0,
    on_output: Any = None,
    launcher_options: dict[str, Any] | None = None,
    telemetry_interval: float = 1.0,
    restart: str = "never",
    max_restarts: int = 3,
    encrypt: bool | None = None,
    force: bool = False,
    name: str | None = None,
    detach: bool = False,
    keep_alive: float | None = None,
    attach_existing: bool = True,
) -> ProcMesh:
    """Start a mesh of worker processes.

    Parameters
    ----------
    shape : dict of str to int, or int
        Named dimensions (``{"hosts": 1, "procs": 4}``); an int ``N`` means
        ``{"hosts": 1, "procs": N}``.
    dist : {"gloo", "nccl", "none"} or None
        Set up ``torch.distributed`` on every rank (MASTER_ADDR,
        MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK and
        ``init_process_group``); with ``nccl`` LOCAL_RANK picks the GPU.
    launcher : str or Launcher
        ``"local"`` (subprocesses of this host) or ``"slurm"``.
    bind : str, optional
        Address the controller binds: an IPv4 address, an interface name,
        a host name or ``0.0.0.0``: the controller listens on TCP there.
        Default: for the local launcher, no TCP at all (Unix sockets in a
        directory only this user can enter); else the launcher's
        ``default_bind()`` (for Slurm: the address that routes to the
        cluster). TCP traffic is encrypted with CurveZMQ and only workers
        holding the mesh's key are admitted (see ``encrypt``).
    heartbeat : float
        Seconds between heartbeats.
    timeout : float
        Seconds to wait for every worker to connect (and set up).
    telemetry_interval : float
        Seconds between each worker's telemetry samples (CPU, memory, GPU;
        see :mod:`monarch_kernel.worker.telemetry`); 0 turns telemetry off.

    restart : {"never", "on-failure"}
        Restart ranks that die automatically (:mod:`.supervision`).
    max_restarts : int
        Restart budget of the whole mesh with ``restart="on-failure"``.
    encrypt : bool or None
        Encrypt controller/worker TCP traffic with CurveZMQ and admit only
        the mesh's workers at connect. Default: on for every TCP endpoint;
        turning it off beyond loopback prints a warning (messages are still
        signed).
    force : bool
        Start a local mesh even if it is far bigger than this host allows
        (see :func:`host_capacity`).
    name : str or None
        Name the mesh (1-64 letters, digits, ``_.-``). With a name of a live
        mesh in this user's registry (:mod:`monarch_kernel.mesh.registry`) and
        ``attach_existing``, that mesh is attached instead of a new one spawned
        (get-or-spawn; the result has ``attached_existing = True``); a record of
        a mesh that is gone is removed first.
    detach : bool
        Spawn the mesh detachable (needs ``name``): its workers outlive this
        controller (see :meth:`ProcMesh.detach`), keeping their state, what they
        run and its output (at most ``MONARCH_DETACH_OUTPUT_BYTES`` bytes per
        rank, 8 MiB by default; what is dropped beyond that is counted) and the
        replies of what finished (at most ``MONARCH_DETACH_REPLIES`` per rank,
        1024 by default; the oldest beyond that are dropped, counted in the
        attached mesh's ``dropped_replies``), until
        a controller attaches (:func:`attach`) or ``keep_alive`` passes.
        Without it (the default) the workers end with this controller, as ever.
    keep_alive : float or None
        Seconds a detached mesh lives with no controller (default 3600).
    attach_existing : bool
        Attach to a live mesh of the same name (else: MeshError if one lives).

    Returns
    -------
    ProcMesh

    Every argument is checked (:func:`check_spawn`) before anything starts.

    Raises
    ------
    MeshError
        For a bad shape, backend, restart policy, a number that is NaN,
        infinite, negative (or zero where that means nothing), an address
        this host cannot listen on, or (without ``force``) a local mesh far
        bigger than this host's CPUs or memory allow.
    SpawnInterrupted
        (a ``KeyboardInterrupt``) on Ctrl-C while the workers start; they are
        stopped first, and the message says how many had started.
    MeshFailure
        If a worker died while starting.
    TimeoutError
        If workers did not connect in time.
    ValueError
        If ``MONARCH_SPIN_US`` is set to something other than 0-10000
        microseconds (see :mod:`monarch_kernel.controller.io`), or
        ``MONARCH_LANES``, ``MONARCH_PEER_LEAD`` or ``MONARCH_SCHED_BATCH`` to
        something other than 0 or 1 (see :mod:`monarch_kernel.util.switches`),
        or ``MONARCH_MAX_MESSAGE_BYTES`` to something other than a number of
        bytes of at least 1 MiB (:mod:`monarch_kernel.transport.sockets`).
    """
    if name is not None and not registry.valid_name(name):
        raise MeshError(f"mesh name {name!r}: use 1-64 letters, digits, '_', '.' or '-', "
                        "starting with a letter or digit")
    if detach and name is None:
        raise ValueError("a detachable mesh needs a name: spawn_procs(..., name='train', "
                         "detach=True)")
    if keep_alive is not None:
        try:
            keep_alive = float(check_number(keep_alive, "keep_alive", above=True,
                                            seconds=True))
        except ValueError as e:
            raise MeshError(str(e)) from None
    if name is not None:
        rec = registry.load(name)
        if rec is not None and registry.alive(rec):
            if not attach_existing:
                raise MeshError(f"a mesh named {name!r} is running already; attach to it "
                                f"(monarch_kernel.attach({name!r})) or stop it first")
            found = attach(name, timeout=timeout, on_output=on_output)
            found.attached_existing = True
            print(f"[monarch] mesh {name!r} is running already: attached to it "
                  f"({len(found)} ranks)", file=sys.stderr, flush=True)
            return found
        if rec is not None:
            registry.remove(name, rec.mesh_id)
    sh, la, addr = check_spawn(
        shape, dist=dist, launcher=launcher, bind=bind, heartbeat=heartbeat, timeout=timeout,
        launcher_options=launcher_options, telemetry_interval=telemetry_interval,
        restart=restart, max_restarts=max_restarts, force=force)
    n = len(sh)
    ranks = list(range(n))
    ctl: Controller | None = None
    mesh: ProcMesh | None = None
    plan: DetachPlan | None = None
    states: HelloStates | None = None
    if detach:
        make = getattr(la, "make_detachable", None)
        if make is None:
            raise MeshError(f"the {la.name!r} launcher cannot spawn detachable meshes")
        if keep_alive is None:
            keep_alive = registry.DEFAULT_KEEP_ALIVE
        assert name is not None
        plan = DetachPlan(durable.mesh_dir(), keep_alive, _output_bytes(),
                          str(registry.record_path(name)), secrets.token_hex(8))
        make(plan)
    try:
        ctl = _controller_for(la, addr, heartbeat, on_output, encrypt)
        mesh_keys.register(ctl)  # this program's meshes: their actors may call each other
        mesh = ProcMesh(ctl, la, sh, dist if dist != "none" else None)
        ctl.expect(ranks, local=la.local)
        spec = LaunchSpec(ctl.address, ctl.key, sh.dims, ranks, env=ctl.launch_env(ranks),
                          heartbeat=heartbeat, telemetry_interval=telemetry_interval,
                          curve_server_key=ctl.curve_public_key, down_address=ctl.down_address)
        mesh.spec = spec
        ctl.poll_exits = la.poll
        ctl.leftover_output = la.leftover_output
        if hasattr(la, "on_pipes"):  # local workers: their output pipes are read here
            la.on_pipes = ctl.adopt_pipes
        if hasattr(la, "on_lane") and la.local and ctl.use_lanes:  # ... and their messages
            la.on_lane = ctl.adopt_lane
        la.attach(ctl)
        if plan is not None:
            states = HelloStates(ctl, ranks)
            ctl.listeners.append(states)
        with DeferredSigint():  # (Ctrl-C after the processes start: each one is recorded)
            la.launch(spec)
        la.wait_started(timeout)
        ctl.wait_ready(ranks, timeout)
        mesh_keys.introduce(ctl, ranks)  # (before anything else reaches them)
        if mesh.dist:
            mesh.setup_dist(timeout)
    except KeyboardInterrupt:
        started, left = _abandon(mesh, ctl, la)
        what = "torch.distributed set-up" if started == n and mesh and mesh.dist else "spawn"
        raise SpawnInterrupted(
            f"{what} interrupted: {started} of {n} rank{'s' if n != 1 else ''} had started; "
            + ("nothing is left running" if not left else
               f"worker processes {', '.join(map(str, left))} did not exit")) from None
    except BaseException:
        _abandon(mesh, ctl, la)
        if plan is not None:
            shutil.rmtree(plan.mesh_dir, ignore_errors=True)
        raise
    mesh.name = name
    if plan is not None and states is not None:
        assert name is not None and keep_alive is not None
        ctl.listeners.remove(states)
        mesh.detached, mesh.keep_alive = True, keep_alive
        guard = getattr(la, "guard", None)
        endpoints = {r: states.endpoints.get(r) or plan.endpoint(r) for r in ranks}
        mesh.record = durable.record_for(name, la, ctl, sh.dims, n, keep_alive, endpoints,
                                         plan.mesh_id, plan.mesh_dir,
                                         guard.pid if guard is not None else None)
        registry.save(mesh.record)
        _watch_take_over(mesh)
    if restart == "on-failure":
        mesh.supervisor = Supervisor(mesh, max_restarts)
    supervise_from_current_actor(ctl)  # spawned by an actor: its __supervise__ sees failures
    _live.add(mesh)
    return mesh


def _output_bytes() -> int:
    """``MONARCH_DETACH_OUTPUT_BYTES`` (bytes of output a detached rank keeps), or 8 MiB.

    Raises
    ------
    MeshError
        If it is set to something other than a whole number of bytes.
    """
    text = os.environ.get("MONARCH_DETACH_OUTPUT_BYTES", "")
    if not text:
        return 8 << 20
    try:
        n = int(text)
        if n < 0:
            raise ValueError
    except ValueError:
        raise MeshError(f"MONARCH_DETACH_OUTPUT_BYTES must be a whole number of bytes, "
                        f"not {text!r}") from None
    return n


def _abandon(mesh: ProcMesh | None, ctl: Controller | None, la: Launcher
             ) -> tuple[int, list[int]]:
    """Stop what a failed or interrupted spawn started (a second Ctrl-C meanwhile is
    ignored: nothing may be left half-stopped); the ranks that had started (said
    hello), and the pids of local workers still alive after it."""
    started = 0
    left: list[int] = []
    try:
        with DeferredSigint():
            if ctl is not None:
                starting = [r for r, i in ctl.ranks.items() if i.state == "starting"]
                started = sum(1 for i in ctl.ranks.values()
                              if i.state not in ("starting", "dead", "stopped"))
                if la.local and starting:  # (they would not hear a stop request)
                    la.signal(starting, signal.SIGTERM)
            if mesh is not None:
                mesh.stop(timeout=2)
            else:
                la.stop(timeout=2)
                if ctl is not None:
                    ctl.close()
            if la.local:
                left = [p.pid for p in la.placements().values() if p.pid and _alive(p.pid)]
    except KeyboardInterrupt:  # (the second Ctrl-C, handed on at the block's end)
        pass
    return started, left


def _alive(pid: int | None) -> bool:
    """Whether a local process ``pid`` still runs (a zombie does not)."""
    if not pid:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except OSError:
            return False
        return True


def check_spawn(
    shape: dict[str, int] | int = 1,
    *,
    dist: str | None = None,
    launcher: str | Launcher = "local",
    bind: str | None = None,
    heartbeat: float = 1.0,
    timeout: float = 120.0,
    launcher_options: dict[str, Any] | None = None,
    telemetry_interval: float = 1.0,
    restart: str = "never",
    max_restarts: int = 3,
    force: bool = False,
) -> tuple[Shape, Launcher, str | None]:
    """Check the arguments of :func:`spawn_procs` (the same names) without starting
    anything; ``%mesh spawn`` calls it before it stops the running mesh.

    Returns
    -------
    (Shape, Launcher, str or None)
        The mesh's shape, its launcher, and the address the controller will bind
        (``None``: a local mesh, on Unix sockets).

    Raises
    ------
    MeshError
        Naming the argument that is wrong and what it must be (see :func:`spawn_procs`).
    """
    if isinstance(shape, int) and not isinstance(shape, bool):
        shape = {"hosts": 1, "procs": shape}
    if not isinstance(shape, dict):
        raise MeshError(f"a mesh shape is a number of ranks or a dict like {{'procs': 4}}; "
                        f"got {shape!r}")
    sh = Shape(shape)
    if dist not in (None, *DIST_BACKENDS):
        raise MeshError(f"unknown --dist backend {dist!r}; use gloo, nccl or none")
    if restart not in RESTART_POLICIES:
        raise MeshError(f"unknown restart policy {restart!r}; use never or on-failure")
    try:
        check_number(heartbeat, "heartbeat", above=True, seconds=True)
        check_number(timeout, "timeout", above=True, seconds=True)
        check_number(telemetry_interval, "telemetry_interval", seconds=True, zero="off")
        check_number(max_restarts, "max_restarts", integer=True)
    except ValueError as e:
        raise MeshError(str(e)) from None
    n = len(sh)
    if n > 4096:
        raise MeshError(f"{n} ranks is more than this controller supports (4096)")
    try:
        la = get_launcher(launcher, **(launcher_options or {}))
    except TypeError as e:
        raise MeshError(f"bad launcher options: {e}") from None
    try:
        addr = resolve_bind(bind) if bind else None if la.local else la.default_bind()
    except ValueError as e:
        raise MeshError(str(e)) from None
    if addr is not None:
        _check_bindable(addr, bind)
    if la.local and not force:
        problem = host_capacity(n)
        if problem:
            raise MeshError(f"{problem}; spawn fewer ranks, or start them anyway with "
                            "force=True (%mesh spawn ... --force)")
    return sh, la, addr


def _check_bindable(addr: str, bind: str | None) -> None:
    """Raise MeshError unless this host can listen on ``addr`` (a TCP port of it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((addr, 0))
        except OSError as e:
            raise MeshError(
                f"cannot listen on {bind or addr!r} ({addr}): {e.strerror or e}; give an "
                "address of this host (e.g. --bind 127.0.0.1), an interface name (eth0) "
                "or 0.0.0.0") from None


def host_capacity(n: int) -> str:
    """Why ``n`` local ranks are far more than this host allows, or ``""``.

    The rule: more than :data:`MAX_RANKS_PER_CPU` ranks per CPU this process may
    run on, or ``n`` x :data:`WORKER_MEMORY` (an idle worker's resident memory)
    above the memory available now.
    """
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    if n > MAX_RANKS_PER_CPU * cpus:
        return (f"{n} ranks is more than {MAX_RANKS_PER_CPU} per CPU of this host "
                f"({cpus} CPU{'s' if cpus != 1 else ''}: at most "
                f"{MAX_RANKS_PER_CPU * cpus} ranks)")
    try:
        import psutil  # (a dependency; imported here: only spawning needs it)

        available = int(psutil.virtual_memory().available)
    except Exception:  # noqa: BLE001 - no figure: no memory rule
        return ""
    if n * WORKER_MEMORY > available:
        return (f"{n} ranks need about {n * WORKER_MEMORY / 2**30:.1f} GiB "
                f"({WORKER_MEMORY >> 20} MiB each when idle) but this host has "
                f"{available / 2**30:.1f} GiB available")
    return ""


def _controller_for(la: Launcher, addr: str | None, heartbeat: float, on_output: Any,
                    encrypt: bool | None = None, key: bytes | None = None) -> Controller:
    """A Controller bound to ``addr``, where ``la``'s workers can reach it (see
    spawn_procs); ``None``: a local mesh, on Unix sockets only this user can
    connect to. Any TCP endpoint is encrypted and admits only the mesh's
    workers, unless ``encrypt=False``."""
    ctl = Controller(bind=addr, heartbeat=heartbeat, on_output=on_output, encrypt=encrypt,
                     key=key)
    if addr is None:
        return ctl
    if is_wildcard(addr):  # listen everywhere, advertise the address that reaches the hosts
        ctl.address = ctl.address.replace("0.0.0.0", la.default_bind(), 1)
        ctl.down_address = ctl.down_address.replace("0.0.0.0", la.default_bind(), 1)
    if not is_loopback(addr) and encrypt is False:
        print(f"warning: the mesh controller listens on {ctl.address} (not loopback) with "
              "encryption turned off: mesh traffic is signed (HMAC) but NOT encrypted, so "
              "anyone on that network can read it; use only trusted networks",
              file=sys.stderr, flush=True)
    return ctl


class HostMesh:
    """The hosts a mesh can be spawned on (Monarch's ``this_host()``)."""

    def __init__(self, launcher: str | Launcher = "local", hosts: int = 1) -> None:
        self.launcher = launcher
        self.hosts = hosts

    def spawn_procs(self, per_host: dict[str, int] | None = None, **kwargs: Any) -> ProcMesh:
        """Spawn ``per_host`` processes on each host, e.g. ``per_host={"procs": 4}``.

        Other keyword arguments go to :func:`spawn_procs`.
        """
        per_host = dict(per_host or {"procs": 1})
        shape = {"hosts": self.hosts, **per_host}
        kwargs.setdefault("launcher", self.launcher)
        return spawn_procs(shape, **kwargs)


def this_host() -> HostMesh:
    """This machine as a one-host mesh (``this_host().spawn_procs(...)``)."""
    return HostMesh("local", 1)


@atexit.register
def _stop_all() -> None:
    for m in list(_live):
        try:
            if m.detached:  # (a detachable mesh outlives the program that drove it)
                m.detach(timeout=2)
            else:
                m.stop(timeout=2)
        except Exception:  # noqa: BLE001 - best effort at exit
            pass

