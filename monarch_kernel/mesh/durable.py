"""Durable meshes, controller side: the attach handshake and what it resumes.

A detachable mesh's ranks (:mod:`monarch_kernel.worker.detach`) each bind
an attach endpoint, recorded in the registry
(:mod:`monarch_kernel.mesh.registry`). A new controller attaches so
(:func:`attach_ranks`):

1. It binds fresh endpoints (an ordinary :class:`Controller`: Unix sockets
   in its own private directory for a local mesh, CurveZMQ TCP elsewhere),
   registers every rank with a fresh epoch (:meth:`Controller.expect`) and
   marks its own sequence number (the ranks refuse what it signed before).
2. It sends each rank's attach endpoint one ``attach`` message, signed with
   the mesh key by a codec of its own (a DEALER per rank, connected only
   for the handshake): its endpoints, its epoch and floor, the rank's new
   epoch, ``steal``, its pid and host, and a timestamp.
3. Each rank answers ``{"ok": True}`` (it reconnected to the new
   endpoints and sent a ``hello`` whose ``resume`` is its state), or
   ``{"busy": True, "holder": {...}}`` (:class:`~monarch_kernel.errors.MeshBusyError`).
4. The hellos' states become pending requests with their output replayed
   (:meth:`Controller.resume`, :meth:`Controller.settle_resumed`), and
   :class:`Resumed` rows for the user.

Nothing here knows how the ranks were launched: the endpoints are strings
from the registry, the launcher that watches the adopted processes comes
from :func:`adopted_launcher` (local pids; others register theirs with
:func:`register_adopter`).
"""

from __future__ import annotations

import os
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq

from monarch_kernel.controller.controller import Controller
from monarch_kernel.errors import MeshBusyError, MeshError, ProtocolError
from monarch_kernel.launchers import Launcher, get_launcher
from monarch_kernel.launchers.local import AdoptedLauncher
from monarch_kernel.mesh import registry
from monarch_kernel.mesh.registry import MeshRecord
from monarch_kernel.transport.sockets import curve_attach_keypair, curve_client_keypair
from monarch_kernel.wire import protocol
from monarch_kernel.wire.messages import Attach

__all__ = ["Resumed", "adopted_launcher", "attach_ranks", "mesh_dir", "register_adopter"]


@dataclass
class Resumed:
    """A request the ranks reported when this controller attached.

    Attributes
    ----------
    parent : str
        The request's id (the parent of its output and replies).
    ranks : list of int
        The ranks that still run it (or have it queued).
    finished_ranks : list of int
        The ranks that finished it while no controller was attached (or whose
        reply the previous controller got while other ranks still ran it).
    replayed_bytes : int
        Bytes of its output replayed (kept by the ranks since it started).
    dropped_bytes : int
        Bytes of its output the ranks dropped (beyond their bound).
    """

    parent: str
    ranks: list[int] = field(default_factory=list)
    finished_ranks: list[int] = field(default_factory=list)
    replayed_bytes: int = 0
    dropped_bytes: int = 0

    @property
    def finished_while_detached(self) -> bool:
        """Whether every rank that reported it had finished it."""
        return not self.ranks and bool(self.finished_ranks)


_adopters: dict[str, Callable[[MeshRecord], Launcher]] = {}


def register_adopter(launcher: str, fn: Callable[[MeshRecord], Launcher]) -> None:
    """Have :func:`adopted_launcher` use ``fn(record)`` for records of ``launcher``."""
    _adopters[launcher] = fn


def adopted_launcher(rec: MeshRecord) -> Launcher:
    """The launcher that watches the ranks of ``rec`` for an attaching controller.

    Raises
    ------
    MeshError
        If no launcher can adopt meshes of that kind here.
    """
    fn = _adopters.get(rec.launcher)
    if fn is not None:
        return fn(rec)
    if rec.launcher == "local":
        if rec.host != socket.gethostname():
            raise MeshError(f"mesh {rec.name!r} runs on host {rec.host}; attach from there")
        return AdoptedLauncher(rec.pids)
    try:  # a launcher that adopts its own records (Slurm: the job of the record)
        la = get_launcher(rec.launcher)
    except ValueError:
        la = None
    adopt = getattr(la, "adopt_record", None)
    if la is not None and adopt is not None:
        adopt(rec)
        return la
    raise MeshError(f"cannot attach to a mesh of launcher {rec.launcher!r} here")


def mesh_dir() -> str:
    """A new directory (0700, named ``mkm-...``) for a detachable mesh's sockets,
    short enough for Unix socket paths (under ``$XDG_RUNTIME_DIR`` or the temp
    directory)."""
    for base in (os.environ.get("XDG_RUNTIME_DIR"), tempfile.gettempdir(), "/tmp"):
        if not base or len(base) > 60 or not os.path.isdir(base):
            continue
        try:
            path = tempfile.mkdtemp(prefix="mkm-", dir=base)
        except OSError:
            continue
        os.chmod(path, 0o700)
        return path
    raise MeshError("cannot make a directory for the mesh's sockets (no writable short "
                    "temporary directory)")


def attach_ranks(ctl: Controller, rec: MeshRecord, steal: bool, timeout: float,
                 holder_gone: dict[str, Any] | None = None, stop: bool = False) -> None:
    """Hand every rank of ``rec`` over to ``ctl`` (steps 2-3 of the module docstring;
    ``ctl`` has :meth:`Controller.expect`-ed them and listens for their hellos).
    ``holder_gone``: the controller (``{"pid", "host"}``) this side saw is gone;
    a rank that still counts it as its holder (a rank on another host, which
    cannot look, within its heartbeat timeout) lets go of it at once.
    ``stop``: the ranks are taken over only to be stopped (a holder is told so).

    Raises
    ------
    MeshBusyError
        If a rank is held by another live controller and ``steal`` is False.
    MeshError
        If a rank refused for another reason.
    TimeoutError
        If a rank did not answer within ``timeout`` seconds.
    """
    key = bytes.fromhex(rec.key_hex)
    codec = protocol.Codec(key, "ctl")
    floor = ctl.codec.mark()
    ctx: zmq.Context = zmq.Context.instance()
    socks: dict[int, zmq.Socket] = {}
    poller = zmq.Poller()
    try:
        for r in range(rec.world_size):
            endpoint = rec.endpoints.get(r)
            if not endpoint:
                raise MeshError(f"mesh {rec.name!r}: rank {r} has no attach endpoint in "
                                "its record")
            s = ctx.socket(zmq.DEALER)
            s.linger = 0
            s.setsockopt(zmq.MAXMSGSIZE, 1 << 20)
            if endpoint.startswith("tcp://"):  # a CurveZMQ server of the mesh's (worker.detach)
                s.curve_serverkey = curve_attach_keypair(key)[0]
                s.curve_publickey, s.curve_secretkey = curve_client_keypair(key)
            s.connect(endpoint)
            socks[r] = s
            poller.register(s, zmq.POLLIN)
            content: Attach = {"up": ctl.address, "down": ctl.down_address,
                       "curve_server_key": ctl.curve_public_key,
                       "ctl_epoch": ctl.codec.epoch, "floor": floor,
                       "rank_epoch": ctl.ranks[r].epoch, "steal": steal,
                       "pid": os.getpid(), "host": socket.gethostname(), "t": time.time(),
                       "holder_gone": holder_gone, "stop": stop}
            s.send_multipart(codec.encode("attach", content), copy=False)
        answers: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + timeout
        by_sock = {s: r for r, s in socks.items()}
        while len(answers) < len(socks):
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(socks) - set(answers))
                raise TimeoutError(f"mesh {rec.name!r}: ranks {missing} did not answer the "
                                   f"attach request within {timeout:g} s")
            for s, _ in poller.poll(int(min(left, 0.5) * 1000) + 1):
                try:
                    msg = codec.decode(s.recv_multipart(copy=False))
                except ProtocolError:
                    continue
                if isinstance(msg.content, dict):
                    answers[by_sock[s]] = msg.content
    finally:
        for s in socks.values():
            s.close(0)
    busy = [a for a in answers.values() if a.get("busy")]
    if busy:
        holder = busy[0].get("holder") or {}
        err = MeshBusyError(
            f"mesh {rec.name!r} is attached to another controller (pid {holder.get('pid')} "
            f"on host {holder.get('host')}); take it over with monarch_kernel.attach("
            f"{rec.name!r}, steal=True) (%mesh attach {rec.name} --steal), or detach it "
            "there first")
        err.holder_pid, err.holder_host = holder.get("pid"), holder.get("host")
        raise err
    bad = {r: a for r, a in answers.items() if not a.get("ok")}
    if bad:
        r, a = next(iter(sorted(bad.items())))
        raise MeshError(f"mesh {rec.name!r}: rank {r} refused the attach: "
                        f"{a.get('error', 'no reason given')}")


class HelloStates:
    """Collects the ``resume`` states of the ranks' hellos (a controller listener)."""

    def __init__(self, ctl: Controller, world: list[int]) -> None:
        self.ctl = ctl
        self.world = world
        self.states: dict[int, dict[str, Any]] = {}
        self.endpoints: dict[int, str] = {}
        self.dropped: dict[int, dict[str, int]] = {}
        self.cond = threading.Condition()

    def __call__(self, kind: str, rank: int, payload: Any) -> None:
        if kind != "hello" or not isinstance(payload, dict):
            return
        if payload.get("attach"):
            self.endpoints[rank] = str(payload["attach"])
        state = payload.get("resume")
        if state is not None:
            dropped = self.ctl.resume(rank, state, self.world)
            with self.cond:
                self.states[rank] = state
                self.dropped[rank] = dropped
                self.cond.notify_all()

    def wait(self, ranks: list[int], timeout: float) -> None:
        """Wait until every rank of ``ranks`` reported its state.

        Raises
        ------
        TimeoutError
        """
        deadline = time.monotonic() + timeout
        with self.cond:
            while any(r not in self.states for r in ranks):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"ranks {[r for r in ranks if r not in self.states]} "
                                       "did not report their state after the attach")
                self.cond.wait(min(left, 0.1))

    def resumed(self) -> list[Resumed]:
        """The :class:`Resumed` rows of what the ranks reported."""
        rows: dict[str, Resumed] = {}
        live = {str(rid) for state in self.states.values()
                for rid, r in (state.get("requests") or {}).items() if not r.get("delivered")}
        for rank, state in sorted(self.states.items()):
            for rid, r in (state.get("requests") or {}).items():
                if str(rid) not in live:
                    continue  # (answered in full to the previous controller)
                row = rows.setdefault(str(rid), Resumed(str(rid)))
                (row.finished_ranks if r.get("reply") is not None else row.ranks).append(rank)
                row.replayed_bytes += sum(len(t.encode()) for _, t in r.get("output") or ())
                row.dropped_bytes += int(r.get("dropped") or 0)
        return list(rows.values())


def record_for(name: str, la: Any, ctl: Controller, shape: dict[str, int], world: int,
               keep_alive: float, endpoints: dict[int, str], mesh_id: str,
               directory: str | None, guardian_pid: int | None) -> MeshRecord:
    """The registry record of a detachable mesh ``ctl`` just spawned."""
    now = time.time()
    fields = getattr(la, "record_fields", None)  # (Slurm: its job, and what adopts it)
    own: dict[str, Any] = fields() if fields is not None else {}
    return MeshRecord(
        name=name, user=os.getuid(), host=socket.gethostname(), launcher=la.name,
        shape=dict(shape), world_size=world,
        pids={r: int(i.pid) for r, i in ctl.ranks.items() if i.pid},
        endpoints=dict(endpoints), key_hex=ctl.key.hex(), created=now,
        keep_alive=keep_alive, controller={"pid": os.getpid(), "host": socket.gethostname()},
        last_seen=now, mesh_id=mesh_id, mesh_dir=directory, guardian_pid=guardian_pid,
        slurm_job=own.get("slurm_job"), extra={"heartbeat": ctl.heartbeat,
                                               **own.get("extra", {})})


def mark_detached(rec: MeshRecord, at: float | None = None) -> None:
    """Record that no controller holds ``rec``'s mesh since ``at`` (epoch seconds,
    default now; pass the moment before the ranks were told, so that the keep-alive
    the record implies is never longer than the ranks' own), if the record is still
    that mesh's."""
    cur = registry.load(rec.name)
    if cur is None or cur.mesh_id != rec.mesh_id:
        return
    cur.controller = None
    cur.last_seen = time.time() if at is None else at
    registry.save(cur)
