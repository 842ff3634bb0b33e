"""The ``%mesh`` line magic and the ``%%mesh`` cell magic.

``%mesh spawn N [--dist gloo|nccl|none]``, ``%%mesh [--ranks SPEC]``,
``%mesh push NAME...``, ``x = %mesh pull NAME``, ``%mesh status``,
``%mesh stop``, ...: the commands, their arguments, usage and help are
defined once in :mod:`monarch_kernel.kernel.commands`; this module runs them.
Bad input raises IPython's ``UsageError``: one line that says what to do, and
the kernel stays usable.
"""

from __future__ import annotations

import argparse
import queue
import re
import shlex
import sys
import threading
import time
import types
from typing import Any

import IPython
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell
from IPython.core.magic import Magics, line_cell_magic, magics_class

import monarch_kernel as mk
from monarch_kernel.controller.controller import Request
from monarch_kernel.controller.io import spin_seconds
from monarch_kernel.controller.output import BackgroundOutput, RankPrinter, write_stream
from monarch_kernel.debug.registry import registry_for
from monarch_kernel.errors import (
    MeshBusyError,
    MeshError,
    MonarchError,
    NoMeshError,
    RankSpecError,
    ranks_label,
)
from monarch_kernel.kernel.commands import CELL, COMMANDS, SLURM_OPTIONS, command, usage_text

# (debug_bridge also serves the calls of actors paused in pdb)
from monarch_kernel.kernel.debug_bridge import cell_console, debug_command, finish_cell
from monarch_kernel.kernel.meshlist import MeshTable, fmt_duration
from monarch_kernel.kernel.rankstream import RankStreamChannel, RankStreamDisplay
from monarch_kernel.mesh import registry as mesh_registry
from monarch_kernel.mesh.procmesh import ProcMesh, check_spawn, spawn_procs
from monarch_kernel.mesh.shape import ValueMesh, parse_ranks
from monarch_kernel.mesh.supervision import KILL_AFTER_S, dead_hint, kill_ranks
from monarch_kernel.tensors.handles import Ref, bind_refs, show
from monarch_kernel.transport.sockets import max_message_bytes
from monarch_kernel.ui.status import StatusTable, fmt_bytes, human_shape
from monarch_kernel.util.cells import cell_filename
from monarch_kernel.util.switches import lanes_enabled, peer_lead_enabled, sched_batch_enabled

__all__ = ["MeshMagics"]

#: IPython's major version (9 counts a cell's In[N] before running it)
IPYTHON_MAJOR = IPython.version_info[0]

#: ranks a local mesh may have (more is almost surely a typo)
MAX_LOCAL_RANKS = 1024

def parse_shape(text: str) -> dict[str, int]:
    """``"4"`` -> ``{"hosts": 1, "procs": 4}``; ``"2x4"`` -> ``{"hosts": 2, "procs": 4}``.

    Raises
    ------
    UsageError
        For anything that is not N or HxP with positive integers.
    """
    parts = text.lower().split("x")
    try:
        sizes = [int(p) for p in parts]
    except ValueError:
        raise UsageError(
            f"%mesh spawn: {text!r} is not a mesh size; write N (e.g. 4) or HOSTSxPROCS (2x4)"
        ) from None
    if len(sizes) not in (1, 2) or any(s < 1 for s in sizes):
        raise UsageError(
            f"%mesh spawn: {text!r} is not a mesh size; sizes must be positive integers: "
            "N (e.g. 4) or HOSTSxPROCS (2x4)"
        )
    dims = {"hosts": 1, "procs": sizes[0]} if len(sizes) == 1 else {
        "hosts": sizes[0], "procs": sizes[1]}
    if dims["hosts"] * dims["procs"] > MAX_LOCAL_RANKS:
        raise UsageError(
            f"%mesh spawn: {dims['hosts'] * dims['procs']} ranks is more than the "
            f"{MAX_LOCAL_RANKS} this kernel allows; spawn fewer ranks"
        )
    return dims


def slurm_options(a: argparse.Namespace) -> dict[str, Any]:
    """The launcher options of a parsed ``%mesh spawn`` (Slurm's, with --launcher slurm).

    Raises
    ------
    UsageError
        If a Slurm option is given with another launcher, or a count is not positive.
    """
    given = {opt: getattr(a, opt[2:].replace("-", "_")) for opt in SLURM_OPTIONS}
    given = {k: v for k, v in given.items() if v is not None}
    if a.launcher != "slurm":
        if given:
            raise UsageError(f"%mesh spawn: {', '.join(given)} need --launcher slurm")
        return {}
    for opt in ("--gpus-per-node", "--nodes"):
        if opt in given and given[opt] < (0 if opt == "--gpus-per-node" else 1):
            raise UsageError(f"%mesh spawn: {opt} must be a positive number")
    out = {k[2:].replace("-", "_"): v for k, v in given.items() if k != "--sbatch"}
    if "--sbatch" in given:
        try:
            out["extra_args"] = shlex.split(given["--sbatch"])
        except ValueError as e:
            raise UsageError(f"%mesh spawn: cannot parse --sbatch {given['--sbatch']!r}: {e}"
                             ) from None
    return out


def _lost(m: ProcMesh) -> str:
    """Why this kernel no longer drives durable mesh ``m`` (another kernel took it
    over with ``--steal``; it was detached), in the mesh's words, or ``""``."""
    gone = getattr(m.root, "_gone", None)
    return str(gone) if gone else ""


def _drives(m: ProcMesh) -> bool:
    """Whether this kernel drives mesh ``m``: not stopped, not detached, not taken over."""
    return not m.root._stopped and not _lost(m)


def _durable(m: ProcMesh) -> bool:
    """Whether ``m`` was spawned to outlive its controller (``--detach``)."""
    return bool(getattr(m.root, "detached", False))


def _unlike(m: ProcMesh, dims: dict[str, int]) -> str:
    """``", not the 8 ranks asked for"`` when mesh ``m`` has another shape than ``dims``."""
    if dict(m.shape.dims) == dict(dims):
        return ""
    return f"; not the {human_shape(dims)} asked for"


def _magic_words(message: str, name: str) -> str:
    """An API message in the magics' words (``%mesh spawn ... --detach``, not
    ``spawn_procs(..., detach=True)``)."""
    return re.sub(r"spawn_procs\([^)]*detach=True\)", f"%mesh spawn N --name {name} --detach",
                  message)


def _steal_hint(message: str, name: str) -> str:
    """A busy mesh's message in the magic's words (``--steal``, not ``steal=True``)."""
    text = re.sub(r"monarch_kernel\.attach\([^)]*steal=True\) \((%mesh [^)]*)\)", r"\1",
                  message)
    text = re.sub(r"steal=True \((%mesh [^)]*)\)", r"\1", text)
    text = text.replace("steal=True", f"%mesh attach {name} --steal")
    if "--steal" not in text:
        text += f"; take it over with  %mesh attach {name} --steal"
    return text


def _attach_hint() -> str:
    """How to drive a durable mesh again: ``"; or ... %mesh attach train"`` naming the
    live durable meshes of this user (at most three), or ``%mesh attach NAME``."""
    try:
        names = sorted(r.name for r in mesh_registry.records() if mesh_registry.alive(r))
    except (OSError, MonarchError):
        names = []
    if not names:
        return "; a durable mesh is driven again with  %mesh attach NAME  (%mesh list)"
    shown = ", ".join(f" %mesh attach {n} " for n in names[:3])
    more = " (%mesh list shows all)" if len(names) > 3 else ""
    return f"; or drive a durable mesh of yours again: {shown}{more}"


def _still_running(r: Any) -> bool:
    """Whether a ``ProcMesh.resumed`` entry names ranks still running its request."""
    return bool(getattr(r, "ranks", None))


def _force_hint(message: str) -> str:
    """A refused spawn's message in the magic's words (``--force``, not ``force=True``)."""
    return message.replace("force=True (%mesh spawn ... --force)", "--force")


@magics_class
class MeshMagics(Magics):
    """``%mesh`` and ``%%mesh``; holds the kernel's meshes by name."""

    @property
    def ip(self) -> InteractiveShell:
        """The shell these magics were registered with (IPython sets it)."""
        assert self.shell is not None, "the %mesh magics are used before IPython registered them"
        return self.shell

    def __init__(self, shell: Any, kernel: Any = None) -> None:
        super().__init__(shell)
        self.kernel = kernel
        self.meshes: dict[str, ProcMesh] = {}
        self.current: str | None = None
        self.running_cell: tuple[ProcMesh, Request, int] | None = None
        self._last_cell: tuple[int, int] = (0, 0)
        #: rank output as a MIME bundle once a frontend asks for it (comm monarch.rankstream)
        self.rankstream = RankStreamChannel(getattr(kernel, "comm_manager", None))
        self._rank_display: RankStreamDisplay | None = None
        #: set when the kernel shuts down or restarts (its control thread): a durable
        #: mesh's running cell is then left running, not interrupted
        self.shutting_down = threading.Event()

    # ------------------------------------------------------------ helpers
    def current_mesh(self) -> ProcMesh:
        """The current mesh.

        Raises
        ------
        UsageError
            If no mesh is running.
        """
        m = self.meshes.get(self.current or "")
        lost = _lost(m) if m is not None else ""
        if m is not None and lost:
            self.forget(self.current or "", m)
            name = self.current
            if "taken over" in lost:
                raise UsageError(f"{lost.split('; ')[0]}: this kernel lost it;  %mesh attach "
                                 f"{name} --steal  takes it back")
            if "was stopped by" in lost:  # (python -m monarch_kernel meshes stop, stop_mesh)
                raise UsageError(f"{lost.split(', from outside')[0]}, from outside this "
                                 f"kernel; start a new one with  %mesh spawn 4 --name {name} "
                                 "--detach")
            raise UsageError(f"mesh {name!r}: {lost}")
        if m is None or m.root._stopped:
            raise UsageError("no mesh is running; start one first with  %mesh spawn 4  (or "
                             "%mesh use NAME for a mesh made with spawn_procs in a cell)"
                             + _attach_hint())
        return m

    def forget(self, name: str, m: ProcMesh) -> None:
        """Drop mesh ``name`` that this kernel no longer drives (taken over by another
        kernel), closing its controller's side here; its ranks are not touched."""
        if self.meshes.get(name) is m:
            self.meshes.pop(name, None)
        try:
            m.root.controller.close()
        except Exception:  # noqa: BLE001 - closing what is left is best effort
            pass

    def stop_all(self) -> None:
        """Stop every mesh of the kernel (``%mesh stop --all``), durable ones too."""
        for m in list(self.meshes.values()):
            try:
                m.stop(timeout=3)
            except Exception:  # noqa: BLE001 - stopping must go on for the others
                pass
        self.meshes.clear()

    def release_all(self) -> None:
        """Kernel shutdown and restart: detach every durable mesh (``--detach``: its
        ranks keep running, ``%mesh attach`` finds them again) and stop every other."""
        for m in list(self.meshes.values()):
            try:
                if _durable(m) and _drives(m):
                    m.detach()
                else:
                    m.stop(timeout=3)
            except Exception:  # noqa: BLE001 - it must go on for the others
                pass
        self.meshes.clear()

    # -------------------------------------------------------------- magic
    @line_cell_magic
    def mesh(self, line: str, cell: str | None = None) -> Any:
        """Drive the mesh of worker processes (see ``%mesh help``)."""
        if cell is not None:
            return self._cell(line, cell)
        try:
            argv = shlex.split(line)
        except ValueError as e:
            raise UsageError(f"%mesh: cannot parse {line!r}: {e}") from None
        if not argv or argv[0] in ("help", "-h", "--help"):
            print(self._help(argv[1:2]))
            return None
        cmd, rest = argv[0], argv[1:]
        if cmd not in self._line_commands:
            raise UsageError(f"%mesh: unknown command {cmd!r}; use one of "
                             f"{', '.join(self._line_commands)} (see  %mesh help)")
        if rest and rest[0] in ("-h", "--help"):
            print(command(cmd).help_text())
            return None
        handler = getattr(self, f"_cmd_{cmd}")
        try:
            return handler(rest)
        except (UsageError, KeyboardInterrupt):
            raise
        except MonarchError as e:
            if isinstance(e, (MeshError,)) and not hasattr(e, "ranks"):
                raise UsageError(f"%mesh {cmd}: {e}") from None
            raise

    #: the commands of the %mesh line magic, as the user sees them listed
    _line_commands = tuple(c.name for c in COMMANDS if c is not CELL)

    @staticmethod
    def _help(names: list[str]) -> str:
        """``%mesh help``, or ``%mesh help CMD`` (one command's arguments)."""
        if names:
            try:
                return command(names[0]).help_text()
            except KeyError:
                return f"unknown command {names[0]!r}; the commands are:\n{usage_text()}"
        return usage_text()

    # ------------------------------------------------------------ commands
    def _cmd_spawn(self, argv: list[str]) -> Any:
        # every argument is checked before the previous mesh is stopped: a typo must not
        # cost the running mesh (and the ranks' state)
        a = command("spawn").parse(argv)  # (numbers: NaN, infinities, negatives refused)
        dims = parse_shape(a.size)
        launcher_options = slurm_options(a)
        name = a.name if a.name is not None else "mesh"
        if not name.isidentifier():
            raise UsageError(f"%mesh spawn: --name {name!r} is not a Python identifier")
        if a.detach and not mesh_registry.valid_name(name):
            raise UsageError(f"%mesh spawn: --name {name!r} cannot name a durable mesh; use "
                             "up to 64 letters, digits and _ starting with a letter")
        if a.detach and a.name is None:
            raise UsageError("%mesh spawn: --detach needs --name NAME: the name you attach "
                             "the mesh by later (e.g.  %mesh spawn 4 --name train --detach)")
        if a.keep_alive is not None and not a.detach:
            raise UsageError("%mesh spawn: --keep-alive is for a mesh that outlives the "
                             "kernel; add --detach (and --name NAME)")
        try:
            spin_seconds()  # (MONARCH_SPIN_US, read by the mesh's controller)
            lanes_enabled()  # (MONARCH_LANES, ...: likewise)
            peer_lead_enabled()
            sched_batch_enabled()
            max_message_bytes()  # (MONARCH_MAX_MESSAGE_BYTES: every socket's bound)
            _, launcher, _ = check_spawn(
                dims, dist=a.dist, launcher=a.launcher, launcher_options=launcher_options,
                bind=a.bind, restart=a.restart, max_restarts=a.max_restarts,
                heartbeat=a.heartbeat, timeout=a.timeout,
                telemetry_interval=a.telemetry_interval, force=a.force)
        except (ValueError, TypeError, MeshError) as e:
            raise UsageError(f"%mesh spawn: {_force_hint(str(e))}") from None
        held = self.meshes.get(name)
        if a.detach and held is not None and _drives(held) and _durable(held):
            self.current = name
            print(f"mesh {name!r} is attached to this kernel already "
                  f"({human_shape(held.shape.dims)}{_unlike(held, dims)}); "
                  f"%mesh stop {name} first to spawn a new one")
            return None
        old = self.meshes.pop(name, None)
        if old is not None and _drives(old):
            print(f"stopping the previous mesh {name!r} ({human_shape(old.shape.dims)})")
            old.stop()
        durable: dict[str, Any] = {}
        if a.detach:  # (get-or-spawn here: one line says so, the kernel's)
            durable = {"name": name, "detach": True, "keep_alive": a.keep_alive,
                       "attach_existing": False}
        t0 = time.monotonic()
        try:
            found = self._running(name, a.timeout) if a.detach else None
            m = found if found is not None else spawn_procs(
                dims, dist=a.dist, launcher=launcher, bind=a.bind, restart=a.restart,
                max_restarts=a.max_restarts, heartbeat=a.heartbeat, timeout=a.timeout,
                telemetry_interval=a.telemetry_interval, force=a.force,
                on_output=BackgroundOutput(),  # (broadcasts, background threads)
                **durable)
        except ValueError as e:
            raise UsageError(f"%mesh spawn: {e}") from None
        except MeshBusyError as e:
            raise UsageError(f"%mesh spawn: {_steal_hint(str(e), name)}") from None
        if getattr(m, "attached_existing", False):  # get-or-spawn: it was alive
            self._hold(name, m)
            print(f"mesh {name!r} is alive already: attached to it instead of spawning "
                  f"({len(m)} ranks, {human_shape(m.shape.dims)}{_unlike(m, dims)}) in "
                  f"{time.monotonic() - t0:.2f} s")
            return self._after_attach(name, m)
        self._hold(name, m)
        dist = f", torch.distributed {a.dist}" if a.dist != "none" else ""
        durable_text = ""
        if a.detach:
            durable_text = (f"; detached: it outlives this kernel (keep-alive "
                            f"{fmt_duration(getattr(m, 'keep_alive', None) or a.keep_alive)}"
                            f" without a kernel),  %mesh attach {name}  finds it again")
        print(f"mesh {name!r}: {len(m)} ranks ({human_shape(m.shape.dims)}) ready in "
              f"{time.monotonic() - t0:.2f} s{dist}{durable_text}")
        return None

    def _hold(self, name: str, m: ProcMesh) -> None:
        """Make ``m`` the kernel's mesh ``name`` (the current one, and a notebook variable)."""
        self.meshes[name] = m
        registry_for(m.controller)  # knows paused ranks from now on (%mesh debug)
        self.current = name
        self.ip.user_ns[name] = m

    def _cmd_stop(self, argv: list[str]) -> None:
        a = command("stop").parse(argv)
        if a.all:
            if a.name is not None:
                raise UsageError(f"%mesh stop: give a NAME or --all, not both. "
                                 f"Usage: {command('stop').usage()}")
            self.stop_all()
            print("stopped every mesh")
            return
        if a.name is None:
            m = self.current_mesh()
            name = self.current or ""
        else:
            name = a.name
            held = self.meshes.get(name)
            if held is None or not _drives(held):
                self._stop_elsewhere(name)
                return
            m = held
        m.stop()
        print(f"mesh {name!r} stopped ({len(m)} ranks)")
        self.meshes.pop(name, None)
        if self.current == name:
            self.current = None

    def _stop_elsewhere(self, name: str) -> None:
        """``%mesh stop NAME`` for a durable mesh this kernel does not hold."""
        try:
            mk.stop_mesh(name, force=True)  # (the user named it: attached elsewhere or not)
        except NoMeshError as e:
            raise UsageError(f"%mesh stop: {_magic_words(str(e), name)}") from None
        except MeshBusyError as e:
            raise UsageError(f"%mesh stop: {e}") from None
        self.meshes.pop(name, None)
        print(f"mesh {name!r} stopped")

    def _cmd_attach(self, argv: list[str]) -> Any:
        a = command("attach").parse(argv)
        name = a.name
        held = self.meshes.get(name)
        if held is not None and _drives(held):
            self.current = name
            print(f"mesh {name!r} is attached to this kernel already "
                  f"({len(held)} ranks, {human_shape(held.shape.dims)})")
            return None
        if held is not None:  # (taken over by another kernel, or detached)
            self.forget(name, held)
        t0 = time.monotonic()
        try:
            m = mk.attach(name, steal=a.steal, timeout=a.timeout,
                          on_output=BackgroundOutput())  # (as %mesh spawn's meshes)
        except NoMeshError as e:
            raise UsageError(f"%mesh attach: {_magic_words(str(e), name)}") from None
        except MeshBusyError as e:
            raise UsageError(f"%mesh attach: {_steal_hint(str(e), name)}") from None
        except TimeoutError as e:
            raise UsageError(f"%mesh attach: mesh {name!r} did not answer: {e}") from None
        self._hold(name, m)
        took = time.monotonic() - t0
        stole = " (taken over with --steal: the kernel that held it was told)" if a.steal else ""
        print(f"attached to mesh {name!r}: {len(m)} ranks ({human_shape(m.shape.dims)}) in "
              f"{took:.2f} s{stole}")
        return self._after_attach(name, m)

    def _after_attach(self, name: str, m: ProcMesh) -> Any:
        """What a mesh did while detached: paused ranks, output it dropped, and the
        requests still running, followed to their end (their output shown as it
        comes, their result returned, their error raised). An interrupt while
        following leaves the ranks running and detaches again."""
        resumed = list(getattr(m, "resumed", None) or [])
        dropped = sum(int(getattr(r, "dropped_bytes", 0) or 0) for r in resumed)
        if dropped:
            print(f"{fmt_bytes(dropped)} of output the ranks printed while detached was "
                  "dropped (beyond the bound kept per rank)", file=sys.stderr)
        lost = int(getattr(m, "dropped_replies", 0) or 0)
        if lost:
            print(f"{lost} repl{'y' if lost == 1 else 'ies'} of requests that finished while "
                  f"detached {'was' if lost == 1 else 'were'} dropped, the oldest first (beyond "
                  "the bound kept per rank, MONARCH_DETACH_REPLIES)", file=sys.stderr)
        paused = sorted(m.paused_ranks())
        if paused:
            where = sorted({s.where for s in registry_for(m.controller).sessions("paused")
                            if s.where != "?"})
            print(f"{ranks_label(paused)} {'is' if len(paused) == 1 else 'are'} paused in "
                  f"pdb{' at ' + '; '.join(where) if where else ''} (%mesh debug  "
                  "serves them)")
        reqs = list((getattr(m.controller, "resumed", None) or {}).values())
        if not reqs and not resumed:
            return None
        running = sorted({rk for q in reqs if not q.done() for rk in q.ranks
                          if rk not in q.replies}
                         or {rk for r in resumed if _still_running(r) for rk in r.ranks})
        if running:
            print(f"following what {ranks_label(running)} still run"
                  f"{'s' if len(running) == 1 else ''} (interrupt to leave "
                  f"{'it' if len(running) == 1 else 'them'} running and detach again)")
        reqs.sort(key=lambda q: not q.done())  # (those that ended first: their output is here)
        try:
            for req in reqs:
                self._show_request(m, req)
        except KeyboardInterrupt:
            if not self.shutting_down.is_set():  # (a kernel going away says nothing here)
                self._detach(name, m)
                self._show_rest(reqs)  # (the ranks count it shown: not replayed again)
                print(f"interrupted: the ranks keep running; mesh {name!r} is detached again "
                      f"(%mesh attach {name} to follow it again)", file=sys.stderr)
            return None
        # the results (an error of a rank is the cell's error, even a KeyboardInterrupt
        # the ranks got while detached: only one while following here detaches)
        value = None
        try:
            for req in reqs:
                value = m.collect(req, list(req.ranks))
        finally:
            m.controller.resumed.clear()  # (followed: not again at the next attach here)
        if isinstance(value, ValueMesh) and all(v is None for v in value.values()):
            return None
        return value

    def _show_request(self, m: ProcMesh, req: Request) -> None:
        """Show ``req``'s output until it is done, as :meth:`wait_cell` does, but
        an interrupt is not passed on to the ranks (it ends the waiting)."""
        self._progress_cell = getattr(self, "_progress_cell", 0) + 1
        shown = self._rank_display = self.rankstream.display(self.ip.display_pub.publish,
                                                             list(req.ranks))
        if shown is None:
            printer = RankPrinter(write_stream, on_progress=self._progress)
        else:
            printer = RankPrinter(write_stream, on_progress=shown.progress, on_lines=shown.lines)
        self._debug_console = cell_console(self, m, req, printer)  # ranks paused in pdb
        self.running_cell = (m.root, req, self._last_cell[0])  # (the sidebar: "running")
        try:
            self._debug_console.serve()  # (ranks of it paused in pdb while detached)
            self._replay(req, printer)
            self._pump(req, printer, time.monotonic(), None, None)
        finally:
            self.running_cell = None
            printer.close()
            if shown is not None:
                shown.close()
                self._rank_display = None
        finish_cell(m, req, lambda text: write_stream("stderr", text))

    @staticmethod
    def _running(name: str, timeout: float | None) -> ProcMesh | None:
        """Durable mesh ``name`` of this user attached, if one is alive, else None.

        Raises
        ------
        MeshBusyError
            If another live controller holds it.
        """
        rec = mesh_registry.load(name)
        if rec is None or not mesh_registry.alive(rec):
            return None
        try:
            m = mk.attach(name, timeout=timeout if timeout is not None else 30.0,
                          on_output=BackgroundOutput())
        except NoMeshError:  # (it ended just now)
            return None
        m.attached_existing = True
        return m

    @staticmethod
    def _show_rest(reqs: list[Request]) -> None:
        """Show the output of ``reqs`` that reached this kernel but was not shown yet."""
        printer = RankPrinter(write_stream)
        for req in reqs:
            while True:
                try:
                    ev = req.events.get_nowait()
                except queue.Empty:
                    break
                if ev[0] == "stream":
                    printer.feed(ev[1], ev[2], ev[3])
        printer.close()

    def _replay(self, req: Request, printer: RankPrinter) -> None:
        """Show the events already queued for resumed request ``req`` (the output
        the ranks kept, which came rank by rank) as live output comes: chunk
        ``i`` of every rank, ranks in order, then chunk ``i + 1``, so the printer
        folds identical lines of several ranks. Stops at the first event other
        than output (shown after the output before it), leaving the rest to
        :meth:`_pump`."""
        per_rank: dict[int, list[tuple]] = {}
        other = None
        while True:
            try:
                ev = req.events.get_nowait()
            except queue.Empty:
                break
            if ev[0] != "stream":
                other = ev
                break
            per_rank.setdefault(ev[1], []).append(ev)
        if per_rank:
            streams = [per_rank[r] for r in sorted(per_rank)]
            for i in range(max(map(len, streams))):
                for evs in streams:
                    if i < len(evs):
                        self.show_event(evs[i], printer)
            printer.flush_lines()
        if other is not None:
            if other[0] == "done":
                req.events.put(other)  # (the end: for _pump, after everything)
            else:
                self.show_event(other, printer)

    def _detach(self, name: str, m: ProcMesh) -> None:
        """Let go of durable mesh ``name``: its ranks keep running; what they sent
        so far was shown here (not replayed at the next attach)."""
        m.detach(shown=True)
        if self.meshes.get(name) is m:
            self.meshes.pop(name, None)
        if self.current == name:
            self.current = None

    def _cmd_detach(self, argv: list[str]) -> None:
        a = command("detach").parse(argv)
        if a.name is None:
            m = self.current_mesh()
            name = self.current or ""
        else:
            name = a.name
            held = self.meshes.get(name)
            if held is None or not _drives(held):
                raise UsageError(f"%mesh detach: this kernel holds no mesh named {name!r} "
                                 f"(held: {self._held_names() or 'none'})")
            m = held
        if not _durable(m):
            raise UsageError(f"%mesh detach: mesh {name!r} was spawned without --detach and "
                             "cannot outlive this kernel; stop it with  %mesh stop, or spawn "
                             f"it with  %mesh spawn N --name {name} --detach")
        keep = getattr(m, "keep_alive", None)
        self._detach(name, m)
        print(f"mesh {name!r} detached: its ranks keep running"
              + (f" (they end themselves after {fmt_duration(keep)} with no kernel)"
                 if keep else "") + f";  %mesh attach {name}  comes back to it")

    def _cmd_list(self, argv: list[str]) -> Any:
        if argv:
            raise UsageError(f"%mesh list: unexpected arguments {' '.join(argv)!r}. "
                             f"Usage: {command('list').usage()}")
        here = {n for n, m in self.meshes.items() if _drives(m)}
        return MeshTable(mesh_registry.list_meshes(), here=here)

    def _held_names(self) -> str:
        return ", ".join(repr(n) for n, pm in self.meshes.items() if _drives(pm))

    def _cmd_use(self, argv: list[str]) -> None:
        a = command("use").parse(argv)
        m = self.meshes.get(a.name)
        adopted = ""
        if m is None or m.root._stopped:
            m = self._adopt(a.name)
            adopted = " (made with spawn_procs: the %mesh magics use it from now on)"
        self.current = a.name
        print(f"mesh {a.name!r} ({len(m)} ranks, {human_shape(m.shape.dims)}) is now the current "
              f"mesh{adopted}")

    def _adopt(self, name: str) -> ProcMesh:
        """The running :class:`ProcMesh` that notebook variable ``name`` holds (one
        made in a cell with ``spawn_procs(...)``), now known to the magics.

        Raises
        ------
        UsageError
            If ``name`` is neither a mesh of ``%mesh spawn`` nor a variable that
            holds a running mesh of this kernel.
        """
        value = self.ip.user_ns.get(name)
        names = ", ".join(repr(n) for n, pm in self.meshes.items() if not pm.root._stopped)
        if not isinstance(value, ProcMesh) or value.root._stopped:
            what = ("is not defined" if name not in self.ip.user_ns else
                    "holds a stopped mesh" if isinstance(value, ProcMesh) else
                    f"holds a value of type {type(value).__name__}")
            raise UsageError(f"%mesh use: no running mesh named {name!r} ({name} {what}); "
                             f"running: {names or 'none'} (start one with  %mesh spawn N "
                             f"--name {name}, or pass the name of a variable that holds "
                             "a mesh made with spawn_procs)")
        self.meshes[name] = value
        registry_for(value.controller)  # (%mesh debug knows its paused ranks)
        return value

    def _cmd_restart(self, argv: list[str]) -> None:
        a = command("restart").parse(argv)
        m = self.current_mesh()
        try:
            ranks = parse_ranks(a.ranks, m.world_size)
        except RankSpecError as e:
            raise UsageError(f"%mesh restart: {e}") from None
        t0 = time.monotonic()
        m.restart(ranks, timeout=a.timeout)
        again = " and torch.distributed set up again" if m.dist else ""
        print(f"restarted {ranks_label(ranks)} in "
              f"{time.monotonic() - t0:.2f} s{again}")

    def _cmd_push(self, argv: list[str]) -> None:
        if not argv:
            raise UsageError("%mesh push: name the variables to copy, e.g.  %mesh push lr data")
        m = self.current_mesh()
        values = {}
        for name in argv:
            if name not in self.ip.user_ns:
                raise UsageError(f"%mesh push: {name!r} is not defined in the notebook; "
                                 "define it first")
            values[name] = self.ip.user_ns[name]
        m.push(**values)

    def _cmd_pull(self, argv: list[str]) -> Any:
        if not argv:
            raise UsageError("%mesh pull: name the variable to fetch, e.g.  x = %mesh pull loss")
        for name in argv:
            if not name.isidentifier():
                raise UsageError(f"%mesh pull: {name!r} is not a variable name; "
                                 "e.g.  x = %mesh pull loss")
        m = self.current_mesh()
        out = []
        for name in argv:
            req = m.request("pull", {"names": [name]})
            try:
                vm = m.collect(req)
            except NameError as e:  # one line, not a traceback per rank group
                first = (str(e).splitlines() or [repr(e)])[0]
                raise UsageError(f"%mesh pull: {first}; define {name} on the ranks first "
                                 f"(in a %%mesh cell, or  %mesh push {name})") from None
            out.append(ValueMesh(vm.shape, [v[0] for v in vm.values()]))
        return out[0] if len(out) == 1 else tuple(out)

    def _cmd_ref(self, argv: list[str]) -> Any:
        if len(argv) != 1 or not argv[0].isidentifier():
            raise UsageError("%mesh ref: name one variable of the ranks, e.g.  r = %mesh ref x")
        m = self.current_mesh()
        try:
            return m.ref(argv[0])
        except NameError as e:
            first = (str(e).splitlines() or [repr(e)])[0]
            raise UsageError(f"%mesh ref: {first}; define {argv[0]} on the ranks first "
                             "(in a %%mesh cell)") from None

    def _cmd_show(self, argv: list[str]) -> Any:
        a = command("show").parse(argv)
        if a.values < 0:
            raise UsageError("%mesh show: --values must be 0 or more")
        target = self.ip.user_ns.get(a.target)
        if not isinstance(target, Ref):
            if not a.target.isidentifier():
                raise UsageError(f"%mesh show: {a.target!r} is neither a handle nor a "
                                 "variable name; e.g.  %mesh show r")
            target = a.target
        try:
            return show(self.current_mesh(), target, a.values)
        except NameError as e:
            first = (str(e).splitlines() or [repr(e)])[0]
            raise UsageError(f"%mesh show: {first} on the ranks (nor is it a handle in the "
                             "notebook)") from None

    def _cmd_debug(self, argv: list[str]) -> None:
        debug_command(self, argv)

    def _cmd_status(self, argv: list[str]) -> Any:
        if argv:
            raise UsageError(f"%mesh status: unexpected arguments {' '.join(argv)!r}. "
                             f"Usage: {command('status').usage()}")
        return StatusTable(self.current_mesh(), name=self.current)

    def _cmd_dashboard(self, argv: list[str]) -> Any:
        a = command("dashboard").parse(argv)
        if a.interval <= 0 or a.history <= 0:
            raise UsageError("%mesh dashboard: --interval and --history must be positive seconds")
        return self.current_mesh().dashboard(interval=a.interval, history=a.history,
                                             layout=a.layout)

    # --------------------------------------------------------------- cells
    def _cell(self, line: str, cell: str) -> Any:
        if line.strip():
            try:
                a = CELL.parse(shlex.split(line))
            except ValueError as e:
                raise UsageError(f"%%mesh: cannot parse {line!r}: {e}") from None
        else:  # a bare %%mesh (the common case) needs no argparse (0.2 ms a cell)
            a = argparse.Namespace(ranks=None, timeout=None)
        m = self.current_mesh()
        try:
            ranks = m.ranks if a.ranks is None else parse_ranks(a.ranks, m.world_size)
        except RankSpecError as e:
            raise UsageError(f"%%mesh --ranks: {e}") from None
        if a.timeout is not None and a.timeout <= 0:
            raise UsageError("%%mesh --timeout: give a positive number of seconds")
        bind_refs(m, ranks, cell, self.ip.user_ns)  # handles used by the cell: local values
        filename, prefix = self.cell_source(cell)
        req = m.run(cell, ranks, filename=filename, prefix=prefix)
        #: (root mesh, request, execution count) of the %%mesh cell running now (the sidebar)
        self.running_cell = (m.root, req, self._last_cell[0])
        try:
            self.wait_cell(m, req, a.timeout)
        finally:
            self.running_cell = None
        finish_cell(m, req, lambda text: write_stream("stderr", text))  # pdb `q` is no failure
        vm = m.collect(req, ranks)  # (a rank died: it stops the others, showing what they print)
        if all(v is None for v in vm.values()):
            return None
        return vm

    def cell_source(self, cell: str) -> tuple[str, str]:
        """``(filename, prefix)`` the ranks run the body ``cell`` of the running
        ``%%mesh`` cell under: ``"<Cell In[N]>"``, N the execution count the
        notebook shows, and the editor's lines above the body (the ``%%mesh`` line),
        so that tracebacks and pdb name the cell and count lines as the editor
        does (:mod:`monarch_kernel.util.cells`). The prefix is ``""`` when the cell
        as typed cannot be found (a magic called from code)."""
        count = self._execution_count()
        last, serial = self._last_cell
        serial = serial + 1 if last == count else 1
        self._last_cell = (count, serial)
        return cell_filename(count, serial), _prefix_of(self._raw_cell(), cell)

    def _execution_count(self) -> int:
        """The execution count of the notebook cell running now (``In[N]``): that
        of the innermost frame of code IPython compiled for a cell (a ``%%mesh``
        cell, or a cell whose code called the magic), as IPython's own tracebacks
        name it; else the shell's count (IPython 9 counts the running cell before
        it runs, 8 after)."""
        name = getattr(self.ip.compile, "format_code_name", None)
        f: types.FrameType | None = sys._getframe(1)
        while name is not None and f is not None:
            found = name(f.f_code.co_filename)
            if found is not None and found[1].startswith("In[") and found[1][3:-1].isdigit():
                return int(found[1][3:-1])
            f = f.f_back
        count = int(self.ip.execution_count)
        return count - 1 if IPYTHON_MAJOR >= 9 and count > 1 else count

    def _raw_cell(self) -> list[str]:
        """Candidates for the cell as typed: the execute request's code, the
        history's last input."""
        out = []
        parent = getattr(self.ip, "parent_header", None)
        code = (parent.get("content") or {}).get("code") if isinstance(parent, dict) else None
        if isinstance(code, str):
            out.append(code)
        hist = getattr(getattr(self.ip, "history_manager", None), "input_hist_raw", None)
        if hist:
            out.append(hist[-1])
        return out

    def wait_cell(self, m: ProcMesh, req: Request, timeout: float | None) -> None:
        """Show the request's output live until it is done; handle interrupts."""
        self._progress_cell = getattr(self, "_progress_cell", 0) + 1
        shown = self._rank_display = self.rankstream.display(self.ip.display_pub.publish,
                                                             list(req.ranks))
        if shown is None:  # plain streams: every frontend shows them
            printer = RankPrinter(write_stream, on_progress=self._progress)
        else:  # the frontend renders rank output (it opened the comm monarch.rankstream)
            printer = RankPrinter(write_stream, on_progress=shown.progress, on_lines=shown.lines)
        self._debug_console = cell_console(self, m, req, printer)  # ranks paused in pdb
        start = time.monotonic()
        interrupted: float | None = None
        sent: list[int] = []  # the ranks interrupted
        killed: list[int] = []
        reason = "interrupted"
        leaving = False
        while True:
            try:
                self._pump(req, printer, start, timeout, interrupted)
                break
            except _Timeout:
                reason = f"timed out after {timeout:g} s"
                interrupted = self._interrupt(m, req, interrupted, sent, killed)
            except KeyboardInterrupt:
                if interrupted is None and _durable(m) and self._shutdown_follows():
                    leaving = True  # (Jupyter interrupts a kernel before it shuts it down)
                    break
                interrupted = self._interrupt(m, req, interrupted, sent, killed)
        printer.close()
        if shown is not None:
            shown.close()
            self._rank_display = None
        if leaving:
            print(f"the kernel is shutting down: mesh {self.current!r} is detached and the "
                  "cell goes on running on the ranks; %mesh attach follows it",
                  file=sys.stderr)
            raise _Leaving
        if interrupted is not None:
            if reason != "interrupted" and sent:
                print(f"%%mesh {reason}; {ranks_label(sent)} "
                      f"{'was' if len(sent) == 1 else 'were'} interrupted", file=sys.stderr)
            failure = req.failure
            if killed and failure is not None and failure.rank in killed:
                # named with the failure (the error of the cell): one line, and how to restart
                failure.killed = sorted(set(failure.killed) | set(killed))
                failure.restart = dead_hint(m)
            elif killed:
                print(f"{ranks_label(killed)} ignored the interrupt and "
                      f"{'was' if len(killed) == 1 else 'were'} killed; restart with  "
                      f"{dead_hint(m)}", file=sys.stderr)

    #: seconds an interrupt of a durable mesh's cell waits for a shutdown request to
    #: follow it (Jupyter interrupts a kernel just before it shuts it down or restarts it)
    SHUTDOWN_GRACE_S = 0.5

    def _shutdown_follows(self) -> bool:
        """Whether the kernel shuts down (or restarts) within :data:`SHUTDOWN_GRACE_S`."""
        return self.shutting_down.wait(self.SHUTDOWN_GRACE_S)

    def _interrupt(self, m: ProcMesh, req: Request, first: float | None, sent: list[int],
                   killed: list[int]) -> float:
        """Interrupt the ranks still running ``req`` (noted in ``sent``); at a second
        call (a second interrupt, or ranks ignoring the first one for
        :data:`KILL_AFTER_S`), kill them (noted in ``killed``). Returns the time of
        the first interrupt."""
        alive = [r for r in req.ranks if r not in req.replies
                 and m.controller.ranks[r].state not in ("dead", "stopped")]
        now = time.monotonic()
        if first is None:
            m.interrupt(alive)
            sent.extend(alive)
            return now
        kill_ranks(m, alive)  # (returns once the controller saw them die)
        killed.extend(r for r in alive if r not in killed)  # (each rank named once)
        return first

    def _pump(self, req: Request, printer: RankPrinter, start: float, timeout: float | None,
              interrupted: float | None) -> None:
        last_flush = time.monotonic()
        while True:
            done = req.done()
            ev = req.next_event(0.02)  # a finished request puts ("done",): no waiting
            if ev is None:
                printer.flush_lines()
                if self._rank_display is not None:
                    self._rank_display.tick()  # progress bars that waited
                last_flush = time.monotonic()
                if done:
                    return
                now = time.monotonic()
                paused_s = getattr(getattr(self, "_debug_console", None), "paused_s", 0.0)
                if interrupted is None and timeout is not None and now - start - paused_s > timeout:
                    raise _Timeout
                if interrupted is not None and now - interrupted > KILL_AFTER_S:
                    raise KeyboardInterrupt  # escalate
                continue
            self.show_event(ev, printer)
            if time.monotonic() - last_flush > 0.1:
                printer.flush_lines()
                last_flush = time.monotonic()

    def show_event(self, ev: tuple, printer: RankPrinter) -> None:
        """Show one event of a running cell (``Request.next_event``): rank output through
        ``printer``, displays in the notebook; a paused rank is served by the console."""
        kind = ev[0]
        if kind == "done":
            return
        if kind == "stream":
            _, rank, name, text = ev
            printer.feed(rank, name, text)
            return
        printer.flush_lines()
        shown = getattr(self, "_rank_display", None)
        if shown is not None:
            shown.seal()  # what follows comes below the rank output so far
        if kind == "display":
            _, rank, content = ev
            self.publish_display(rank, content)
        elif kind == "debug" and getattr(self, "_debug_console", None) is not None:
            self._debug_console.on_event(ev)  # prompts (Pdb rank R) / (mesh-debug)

    def publish_display(self, rank: int, content: dict[str, Any]) -> None:
        """Show a rank's ``display``/``clear_output`` in the notebook, tagged with
        the rank (metadata ``monarch_rank``; display ids are made per rank)."""
        pub = self.ip.display_pub
        if content.get("clear"):
            pub.clear_output(wait=content.get("wait", False))
            return
        md = dict(content.get("metadata") or {})
        md["monarch_rank"] = rank
        transient = dict(content.get("transient") or {})
        if "display_id" in transient:
            transient["display_id"] = f"monarch-r{rank}-{transient['display_id']}"
        pub.publish(data=content["data"], metadata=md, transient=transient or None,
                    update=bool(content.get("update")))

    def _progress(self, rank: int, name: str, text: str, first: bool) -> None:
        """A rank's ``\\r`` progress line: one display per rank, updated in place."""
        pub = self.ip.display_pub
        pub.publish(data={"text/plain": f"[{rank}] {text}"},
                    metadata={"monarch_rank": rank, "monarch_stream": name},
                    transient={"display_id": f"monarch-progress-{id(self)}-{rank}-{name}-"
                                             f"{self._progress_cell}"},
                    update=not first)

def _prefix_of(candidates: list[str], body: str) -> str:
    """The lines above ``body`` in the first candidate cell that is ``%%mesh``
    (after blank lines) followed by ``body``; ``""`` if none is."""
    for raw in candidates:
        lines = raw.splitlines(True)
        i = next((k for k, ln in enumerate(lines) if ln.strip()), None)
        if i is None or not lines[i].lstrip().startswith("%%mesh"):
            continue
        if "".join(lines[i + 1:]).rstrip() != body.rstrip():
            continue
        prefix = "".join(lines[:i + 1])
        return prefix if prefix.endswith("\n") else prefix + "\n"
    return ""


class _Timeout(Exception):
    pass


class _Leaving(KeyboardInterrupt):
    """The kernel shuts down while a durable mesh's cell runs: the cell ends here and
    goes on on the ranks."""
