"""The per-user registry of named (durable) meshes.

A detachable mesh (``spawn_procs(..., name="train", detach=True)``) is
recorded here so that another controller of the same user (a new kernel, a
script, ``python -m monarch_kernel meshes list``) can find it and attach:
one JSON file per mesh, ``<directory()>/<name>.json``, mode 0600, written
atomically (a temporary file in the same directory, then ``os.replace``).

The directory is ``$MONARCH_MESH_REGISTRY`` when that is set (tests use a
directory of their own), else ``jupyter_core.paths.jupyter_runtime_dir() /
"monarch-meshes"``; it is made with mode 0700 and must belong to this user
(a directory of another user, or one others can enter, is refused).

A record holds the mesh key (``key_hex``): only this user can read it, and
it is what lets a controller sign for the mesh. The attach endpoints of the
ranks (``endpoints``) are launcher-neutral strings (``ipc://PATH`` for a
local mesh, ``tcp://host:port`` elsewhere).

Liveness: :func:`alive` asks the function registered for the record's
launcher (:func:`register_liveness`; the Slurm launcher plugs in its
``squeue`` check from above); local records are alive while one of their
pids runs as this user. This module imports nothing above ``util`` and
``errors``.
"""

from __future__ import annotations

import json
import os
import re
import socket
import stat
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["ENV", "MeshInfo", "MeshRecord", "alive", "directory", "job_state", "list_meshes",
           "load", "record_path", "records", "register_liveness", "remove", "save", "valid_name"]

#: the environment variable that overrides the registry's directory
ENV = "MONARCH_MESH_REGISTRY"
#: keep-alive of a detached mesh when none is given (seconds)
DEFAULT_KEEP_ALIVE = 3600.0

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def valid_name(name: str) -> bool:
    """Whether ``name`` may name a mesh: 1-64 letters, digits, ``_``, ``.``, ``-``,
    starting with a letter or digit."""
    return isinstance(name, str) and bool(_NAME.match(name))


@dataclass
class MeshRecord:
    """What a controller needs to find, trust and attach to a named mesh.

    Attributes
    ----------
    name : str
    user : int
        The owner's uid.
    host : str
        The host of the controller side (where the local ranks run).
    launcher : str
        ``"local"`` or ``"slurm"``.
    shape : dict of str to int
    world_size : int
    pids : dict of int to int
        Rank -> pid (may be empty for Slurm).
    endpoints : dict of int to str
        Rank -> the attach endpoint a new controller contacts.
    key_hex : str
        The mesh key (hex).
    created : float
        Epoch seconds.
    keep_alive : float
        Seconds the mesh lives with no controller attached.
    controller : dict or None
        ``{"pid": int, "host": str}`` of the attached controller; None while detached.
    last_seen : float
        Epoch seconds of the last time a controller confirmed it was attached
        (or detached from it); while ``controller`` is None, a moment no later
        than the one the ranks started their keep-alive (the mesh's guardian
        sets it, with ``controller`` None, when the controller dies without
        detaching).
    slurm_job : str or None
    mesh_id : str
        A random id of this mesh (a later mesh of the same name has another).
    mesh_dir : str or None
        The mesh's own directory (attach sockets), removed with the mesh.
    guardian_pid : int or None
        The local process that cleans up after the ranks end.
    extra : dict
        Launcher-specific fields (Slurm's).
    """

    name: str
    user: int
    host: str
    launcher: str
    shape: dict[str, int]
    world_size: int
    pids: dict[int, int]
    endpoints: dict[int, str]
    key_hex: str
    created: float
    keep_alive: float
    controller: dict[str, Any] | None = None
    last_seen: float = 0.0
    slurm_job: str | None = None
    mesh_id: str = ""
    mesh_dir: str | None = None
    guardian_pid: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MeshRecord:
        """A record from its JSON dict (rank keys back to ints).

        Raises
        ------
        KeyError, TypeError, ValueError
            For a dict that is not a record.
        """
        d = dict(d)
        d["pids"] = {int(k): int(v) for k, v in (d.get("pids") or {}).items()}
        d["endpoints"] = {int(k): str(v) for k, v in (d.get("endpoints") or {}).items()}
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in d.items() if k in known})


@dataclass
class MeshInfo:
    """One row of :func:`list_meshes`."""

    name: str
    shape: dict[str, int]
    state: str  # "attached" | "detached" | "gone"
    age_s: float
    attached_to: str | None  # "pid@host"
    keep_alive_left_s: float | None
    launcher: str
    slurm_job: str | None
    #: what the launcher says of the mesh's job (Slurm: ``RUNNING``, ``PENDING``,
    #: ``GONE``...), None where it says nothing or cannot be asked
    job_state: str | None = None


def directory() -> Path:
    """The registry directory of this user (made, mode 0700, if missing).

    Raises
    ------
    PermissionError
        If it exists but belongs to another user or others can enter it.
    """
    env = os.environ.get(ENV)
    if env:
        path = Path(env)
    else:
        from jupyter_core.paths import jupyter_runtime_dir

        path = Path(jupyter_runtime_dir()) / "monarch-meshes"
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid != os.getuid():
        raise PermissionError(f"the mesh registry {path} belongs to another user; set "
                              f"{ENV} to a directory of yours")
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(path, 0o700)
    return path


def record_path(name: str) -> Path:
    """The file of mesh ``name``.

    Raises
    ------
    ValueError
        For a name that may not name a mesh (:func:`valid_name`).
    """
    if not valid_name(name):
        raise ValueError(f"mesh name {name!r}: use 1-64 letters, digits, '_', '.' or '-', "
                         "starting with a letter or digit")
    return directory() / f"{name}.json"


def save(rec: MeshRecord) -> None:
    """Write ``rec`` (mode 0600, atomically: readers see the old or the new file)."""
    path = record_path(rec.name)
    fd, tmp = tempfile.mkstemp(prefix=f".{rec.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(rec.to_json())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def load(name: str) -> MeshRecord | None:
    """The record of mesh ``name``, or None (none, or not readable as one)."""
    try:
        path = record_path(name)
        with open(path) as f:
            st = os.fstat(f.fileno())
            if st.st_uid != os.getuid():
                return None
            return MeshRecord.from_dict(json.load(f))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def remove(name: str, mesh_id: str | None = None) -> None:
    """Remove the record of ``name`` (only if it is still mesh ``mesh_id``'s, when given)."""
    if mesh_id is not None:
        rec = load(name)
        if rec is not None and rec.mesh_id != mesh_id:
            return
    try:
        os.unlink(record_path(name))
    except (OSError, ValueError):
        pass


def records() -> list[MeshRecord]:
    """Every readable record of this user, by name."""
    out = []
    for p in sorted(directory().glob("*.json")):
        rec = load(p.stem)
        if rec is not None:
            out.append(rec)
    return out


_liveness: dict[str, Callable[[MeshRecord], bool]] = {}
_job_state: dict[str, Callable[[MeshRecord], str | None]] = {}


def register_liveness(launcher: str, fn: Callable[[MeshRecord], bool],
                      state: Callable[[MeshRecord], str | None] | None = None) -> None:
    """Have :func:`alive` ask ``fn(record)`` for records of ``launcher`` (e.g. the
    Slurm launcher's ``squeue`` check), and :func:`list_meshes` ask ``state(record)``
    for the :attr:`MeshInfo.job_state` of their rows."""
    _liveness[launcher] = fn
    if state is not None:
        _job_state[launcher] = state


def job_state(rec: MeshRecord) -> str | None:
    """The launcher's word on the job of ``rec`` (None: no word)."""
    fn = _job_state.get(rec.launcher)
    return fn(rec) if fn is not None else None


def pid_alive(pid: int) -> bool:
    """Whether local process ``pid`` runs as this user (not a zombie)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            text = f.read()
    except OSError:
        try:
            os.kill(pid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    if fields.get("State", "").strip().startswith(("Z", "X")):
        return False
    uid = fields.get("Uid", "").split()
    return bool(uid) and int(uid[0]) == os.getuid()


def alive(rec: MeshRecord) -> bool:
    """Whether the mesh of ``rec`` still runs: the launcher's hook decides where
    one is registered; otherwise, for a local mesh, whether one of its pids runs
    as this user on this host (a mesh of another launcher, whose hook this
    process did not load, counts as alive: its record is never removed blind)."""
    fn = _liveness.get(rec.launcher)
    if fn is not None:
        return bool(fn(rec))
    if rec.launcher != "local":
        return True  # (no hook registered in this process: it cannot tell; kept)
    if rec.host != socket.gethostname():
        return True  # (cannot tell from here)
    return any(pid_alive(p) for p in rec.pids.values())


def controller_alive(rec: MeshRecord) -> bool:
    """Whether the controller the record names (if any) runs (on this host; a
    controller elsewhere counts as alive while its record was confirmed within
    a minute)."""
    c = rec.controller
    if not c:
        return False
    if c.get("host") == socket.gethostname():
        return pid_alive(int(c.get("pid", 0)))
    return time.time() - rec.last_seen < 60.0


def list_meshes() -> list[MeshInfo]:
    """The user's named meshes (stale records are removed and listed as ``gone``)."""
    now = time.time()
    out = []
    for rec in records():
        if not alive(rec):
            remove(rec.name, rec.mesh_id)
            out.append(MeshInfo(rec.name, rec.shape, "gone", now - rec.created, None, None,
                                rec.launcher, rec.slurm_job, job_state(rec)))
            continue
        attached = controller_alive(rec)
        c = rec.controller
        left = None if attached else max(0.0, rec.keep_alive - (now - rec.last_seen))
        out.append(MeshInfo(rec.name, rec.shape, "attached" if attached else "detached",
                            now - rec.created,
                            f"{c['pid']}@{c['host']}" if attached and c else None,
                            left, rec.launcher, rec.slurm_job, job_state(rec)))
    return out
