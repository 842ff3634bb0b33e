"""The comm target ``monarch.mesh``: what JupyterLab's mesh sidebar shows and does.

The sidebar (``extensions/monarch-jupyterlab/src/sidebar.ts``) opens a comm to
target :data:`TARGET` on the notebook's kernel. From then on the kernel sends,
every ``interval`` seconds from a thread of its own (``monarch-sidebar-N``), the
state of its meshes (:func:`kernel_state`; less often when they hold more than
:data:`RANKS_PER_SECOND` ranks in all), which reaches the browser while cells
run, and answers the actions the sidebar asks for. The thread ends when the
comm closes (either side) or the kernel exits.

Messages, kernel -> frontend (``comm.send`` data)::

    {"type": "state", "seq": N, "interval": S, "current": NAME or None,
     "meshes": [mesh...]}                                   (see kernel_state)
    {"type": "reply", "id": ID, "ok": true, "message": TEXT}
    {"type": "reply", "id": ID, "ok": false, "error": TEXT}

frontend -> kernel::

    {"action": "restart", "mesh": NAME, "rank": R, "id": ID}   restart rank R
    {"action": "stop", "mesh": NAME, "id": ID}                 stop mesh NAME
    {"action": "refresh", "id": ID}                            send the state now

Every action is checked before anything is done: an unknown action, mesh or
rank, or a malformed message, gets an error reply naming what was wrong; the
kernel carries on. Restart and stop run on the sidebar's own thread (one at a
time, in order), not on the thread that received them, so the kernel's shell
stays free; state messages keep coming meanwhile.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from typing import Any

from monarch_kernel.debug.registry import DebugSession, registry_for
from monarch_kernel.errors import ranks_label
from monarch_kernel.mesh.procmesh import ProcMesh
from monarch_kernel.ui.status import state_text
from monarch_kernel.util.cells import cell_label, location

log = logging.getLogger("monarch_kernel.kernel.sidebar")

__all__ = ["ACTIONS", "DEFAULT_INTERVAL", "RANKS_PER_SECOND", "TARGET", "MeshSidebar",
           "check_action", "kernel_state", "mesh_state"]

#: the comm target the sidebar opens
TARGET = "monarch.mesh"
#: seconds between state messages
DEFAULT_INTERVAL = 1.0
#: ranks whose state is sent each ``interval``, at most: bigger meshes are sent less often
RANKS_PER_SECOND = 256
#: what the sidebar may ask for
ACTIONS = ("restart", "stop", "refresh")

_counter = itertools.count(1)


class ActionError(ValueError):
    """An action request that cannot be carried out (its message is the reply's error)."""


# ------------------------------------------------------------------- state
def _rank_state(info: Any, activity: str, running: tuple[Any, int] | None,
                paused: Any) -> tuple[str, str]:
    """``(kind, text)`` of one rank: kind is idle, running, endpoint, paused, dead,
    starting or stopped; text says it in words (``"running cell In[3]"``,
    ``"paused at Cell In[3], line 4"``, ``"dead (exit code 1)"``)."""
    if info.state in ("dead", "stopped", "starting"):
        return info.state, state_text(info.state, None, info.exitcode)
    if paused is not None:
        return "paused", f"paused at {location(paused.filename, paused.lineno)}"
    if running is not None:
        req, count = running
        if info.rank in req.ranks and info.rank not in req.replies and not req.done():
            return "running", f"running cell In[{count}]"
    text = state_text(info.state, activity, info.exitcode)
    if text.startswith("running endpoint "):
        return "endpoint", "in endpoint " + text[len("running endpoint "):]
    if text == "idle":
        return "idle", "idle"
    return "running", text


def mesh_state(name: str, mesh: ProcMesh, running: tuple[Any, int] | None = None,
               current: bool = False) -> dict[str, Any]:
    """The sidebar's view of one mesh, JSON-ready.

    Parameters
    ----------
    name : str
        The mesh's name in the notebook.
    mesh : ProcMesh
    running : (Request, int) or None
        The ``%%mesh`` cell's request running now and its execution count.
    current : bool
        Whether it is the magics' current mesh.

    Returns
    -------
    dict
        ``name``, ``shape`` (``{"hosts": 1, "procs": 4}``), ``status``
        (``"live"`` or ``"stopped"``), ``current``, ``size``, ``detached`` (a
        durable mesh, ``%mesh spawn --detach``: it outlives the kernel),
        ``keep_alive`` (its keep-alive in seconds, else None), and ``hosts``: a
        list of ``{"host": NAME, "ranks": [rank...]}`` in order of their first
        rank, each rank ``{"rank", "pid", "kind", "text", "exitcode", "cpu"
        (% of one core), "rss", "mem_total", "mem_limit" (bytes), "gpu_util" (%),
        "gpu_mem", "gpu_mem_total" (bytes), "where" (paused: Cell In[3], line 4),
        "function", "debug_in_cell" (paused in the running cell: its prompt is
        in that cell)}``; figures are None where unknown.
    """
    stopped = mesh.root._stopped
    ctl = mesh.controller
    reg = registry_for(ctl)
    paused: dict[int, DebugSession] = {}
    for s in reg.sessions("paused", ranks=mesh.ranks):
        paused.setdefault(s.rank, s)
    hosts: dict[str, list[dict[str, Any]]] = {}
    for r in mesh.ranks:
        info = ctl.ranks.get(r)
        if info is None:
            continue
        tel = info.telemetry or {}
        ps = paused.get(r)
        if stopped:
            kind, text = "stopped", "stopped"
        else:
            kind, text = _rank_state(info, str(tel.get("activity") or ""), running, ps)
        alive = kind not in ("dead", "stopped", "starting") and "cpu" in tel
        gpu = (tel.get("gpu") or {}) if alive else {}
        row = {
            "rank": r, "pid": info.pid, "kind": kind, "text": text,
            "exitcode": info.exitcode if kind == "dead" else None,
            "cpu": tel.get("cpu") if alive else None,
            "rss": tel.get("rss") if alive else None,
            "mem_total": tel.get("mem_total") if alive else None,
            "mem_limit": tel.get("mem_limit") if alive else None,
            "gpu_util": gpu.get("util"), "gpu_mem": gpu.get("mem_used"),
            "gpu_mem_total": gpu.get("mem_total"),
            "where": location(ps.filename, ps.lineno) if ps is not None else None,
            "function": ps.function if ps is not None else None,
            "cell": cell_label(ps.filename) if ps is not None else None,
            "debug_in_cell": bool(ps is not None and running is not None
                                  and ps.parent == running[0].id and not running[0].done()),
        }
        hosts.setdefault(info.host or "?", []).append(row)
    root = mesh.root
    return {"name": name, "shape": dict(mesh.shape.dims), "size": len(mesh.ranks),
            "status": "stopped" if stopped else "live", "current": current,
            "detached": bool(getattr(root, "detached", False)),
            "keep_alive": getattr(root, "keep_alive", None) if getattr(root, "detached", False)
            else None,
            "hosts": [{"host": h, "ranks": rows} for h, rows in hosts.items()]}


def kernel_state(magics: Any, seq: int = 0, interval: float = DEFAULT_INTERVAL
                 ) -> dict[str, Any]:
    """The ``state`` message for every mesh the ``%mesh`` magics know (see the module
    docstring); a mesh that cannot be read is left out (logged)."""
    running = getattr(magics, "running_cell", None)
    meshes = []
    for name, m in list(magics.meshes.items()):
        if m.root._stopped or getattr(m.root, "_gone", None):  # (detached, taken over)
            continue
        try:
            run = running if running is not None and running[0] is m.root else None
            meshes.append(mesh_state(name, m, run[1:] if run else None,
                                     current=name == magics.current))
        except Exception:  # noqa: BLE001 - one broken mesh must not blank the sidebar
            log.exception("sidebar: cannot read mesh %r", name)
    return {"type": "state", "seq": seq, "interval": interval, "current": magics.current,
            "meshes": meshes}


# ----------------------------------------------------------------- actions
def check_action(magics: Any, data: Any) -> tuple[str, ProcMesh | None, str, int | None]:
    """``(action, mesh, mesh name, rank)`` of a valid action request ``data``.

    Raises
    ------
    ActionError
        Naming what is wrong: not an object, an unknown action, no such mesh
        (or a stopped one), a missing or bad rank, or a rank the mesh does not
        have.
    """
    if not isinstance(data, dict):
        raise ActionError(f"an action is an object with an 'action' key, not {type(data).__name__}")
    action = data.get("action")
    if action not in ACTIONS:
        raise ActionError(f"unknown action {action!r}; the actions are {', '.join(ACTIONS)}")
    if action == "refresh":
        return action, None, "", None
    name = data.get("mesh")
    if not isinstance(name, str):
        raise ActionError(f"{action}: 'mesh' must be a mesh's name, not {name!r}")
    names = [n for n, pm in magics.meshes.items() if not pm.root._stopped]
    m = magics.meshes.get(name)
    if m is None or m.root._stopped:
        raise ActionError(f"no running mesh named {name!r} (running: "
                          f"{', '.join(repr(n) for n in names) or 'none'})")
    if action == "stop":
        return str(action), m, name, None
    rank = data.get("rank")
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise ActionError(f"restart: 'rank' must be a rank number, not {rank!r}")
    if rank not in m.ranks:
        raise ActionError(f"restart: mesh {name!r} has no rank {rank} (its ranks: "
                          f"0 to {len(m.ranks) - 1})" if m.ranks == list(range(len(m.ranks)))
                          else f"restart: mesh {name!r} has no rank {rank}")
    return str(action), m, name, rank


class _Channel:
    """One open sidebar comm: its sender thread and its queue of actions."""

    def __init__(self, sidebar: MeshSidebar, comm: Any) -> None:
        self.sidebar, self.comm = sidebar, comm
        self.closed = threading.Event()
        self.actions: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
        self.wake = threading.Event()
        self.seq = 0
        self._send_lock = threading.Lock()
        comm.on_msg(self.on_msg)
        comm.on_close(lambda msg: self.close())
        self.thread = threading.Thread(target=self.run, name=f"monarch-sidebar-{next(_counter)}",
                                       daemon=True)
        self.thread.start()

    def send(self, data: dict[str, Any]) -> None:
        if self.closed.is_set():
            return
        with self._send_lock:
            try:
                self.comm.send(data)
            except Exception:  # noqa: BLE001 - the kernel is going away
                self.closed.set()

    def on_msg(self, msg: dict[str, Any]) -> None:
        """A message from the sidebar (the shell's thread, or a subshell's): checked
        here, carried out on the channel's thread."""
        data = (msg.get("content") or {}).get("data")
        rid = data.get("id") if isinstance(data, dict) else None
        try:
            action, m, name, rank = check_action(self.sidebar.magics, data)
        except ActionError as e:
            self.send({"type": "reply", "id": rid, "ok": False, "error": str(e)})
            return
        self.actions.put({"id": rid, "action": action, "mesh": m, "name": name, "rank": rank})
        self.wake.set()

    def close(self) -> None:
        self.closed.set()
        self.wake.set()

    def run(self) -> None:
        interval = self.sidebar.interval
        while not self.closed.is_set():
            while True:
                try:
                    a = self.actions.get_nowait()
                except queue.Empty:
                    break
                self.do(a)
            self.seq += 1
            try:
                state = kernel_state(self.sidebar.magics, self.seq, interval)
            except Exception:  # noqa: BLE001 - keep the thread: the next tick may work
                log.exception("sidebar: cannot collect the state")
            else:
                self.send(state)
                # big meshes: fewer messages, so the bytes sent stay about those of
                # RANKS_PER_SECOND ranks a second
                ranks = sum(m["size"] for m in state["meshes"])
                interval = self.sidebar.interval * max(1.0, ranks / RANKS_PER_SECOND)
            self.wake.wait(interval)
            self.wake.clear()
        self.sidebar.channels.discard(self)

    def do(self, a: dict[str, Any]) -> None:
        m, name, rank = a["mesh"], a["name"], a["rank"]
        t0 = time.monotonic()
        try:
            if a["action"] == "restart":
                m.restart([rank])
                text = (f"restarted {ranks_label([rank])} of mesh {name!r} in "
                        f"{time.monotonic() - t0:.1f} s")
            elif a["action"] == "stop":
                self.sidebar.stop_mesh(name, m)
                text = f"mesh {name!r} stopped ({len(m)} ranks)"
            else:
                text = "ok"
        except Exception as e:  # noqa: BLE001 - told to the sidebar, in words
            self.send({"type": "reply", "id": a["id"], "ok": False,
                       "error": f"{a['action']} failed: {type(e).__name__}: {e}"})
            return
        self.send({"type": "reply", "id": a["id"], "ok": True, "message": text})


class MeshSidebar:
    """The kernel's side of the mesh sidebar: registers :data:`TARGET` and serves
    every comm the frontend opens to it.

    Parameters
    ----------
    magics : MeshMagics
        The kernel's ``%mesh`` magics (its ``meshes``, ``current`` and the
        running cell).
    interval : float
        Seconds between state messages.
    """

    def __init__(self, magics: Any, interval: float = DEFAULT_INTERVAL) -> None:
        self.magics = magics
        self.interval = interval
        self.channels: set[_Channel] = set()

    def register(self, comm_manager: Any) -> None:
        """Register the comm target with ``comm_manager`` (ipykernel's)."""
        comm_manager.register_target(TARGET, self.on_open)

    def on_open(self, comm: Any, msg: dict[str, Any]) -> None:
        """The frontend opened a comm: start sending it the state."""
        self.channels.add(_Channel(self, comm))

    def stop_mesh(self, name: str, m: ProcMesh) -> None:
        """Stop mesh ``name`` and forget it, as ``%mesh stop`` does."""
        m.stop()
        if self.magics.meshes.get(name) is m:
            self.magics.meshes.pop(name, None)

    def close(self) -> None:
        """End every channel's thread (kernel shutdown)."""
        for ch in list(self.channels):
            ch.close()
