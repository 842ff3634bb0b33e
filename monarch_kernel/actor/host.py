"""The worker side of actors: one thread per actor, and a peer socket.

Threads of a worker that hosts actors (see :mod:`monarch_kernel.worker.worker`
for the others):

``monarch-actor-<name>``
    One per actor. Takes messages from the actor's queue one at a time, in
    arrival order: the constructor first, then endpoint calls. Async
    endpoints run to completion on the actor's own event loop before the
    next message starts. Different actors run concurrently.
``monarch-peer``
    Owns this worker's *peer* socket, where other workers' actors call this
    worker's actors directly (see :mod:`monarch_kernel.actor.peers`), and
    where wait notices arrive: calls an actor makes are tracked while queued
    or running here, and one that would close a wait cycle between actors
    is answered at once with an error (see :mod:`monarch_kernel.actor.cycles`).

Calls from the controller arrive on the worker's own DEALER and are handed
to the actor's queue by :func:`dispatch_call` (from the worker's I/O thread,
which must not block). Replies to the controller go through
:meth:`Worker.reply`; replies to peers through the peer socket.

Arguments and results travel as :class:`Packed` pickles inside the message:
they are unpickled by the thread that needs them (the actor's, the
caller's), so a value that cannot be unpickled becomes an error reply
instead of a dropped message, and no I/O thread spends time unpickling.
"""

from __future__ import annotations

import asyncio
import linecache
import logging
import queue
import threading
import time
from typing import Any

from monarch_kernel.actor import cycles as actor_cycles
from monarch_kernel.actor import mesh_keys
from monarch_kernel.actor import peers as actor_peers
from monarch_kernel.actor.context import context
from monarch_kernel.actor.peers import answer, failure_of, peer_host, reject, stats
from monarch_kernel.actor.rref import keep_result
from monarch_kernel.errors import SerializationError
from monarch_kernel.mesh.shape import Point, Shape
from monarch_kernel.util import gpu
from monarch_kernel.wire.messages import (
    ACTOR,
    IPC,
    KEEP,
    METHOD,
    ONEWAY,
    PAYLOAD,
    REFS,
    SOURCES,
    WAITED,
    Call,
    RankDead,
    SpawnActor,
    SpawnReply,
    SupervisionEvent,
)
from monarch_kernel.wire.serialize import Packed, cuda_ipc
from monarch_kernel.worker import handlers, telemetry
from monarch_kernel.worker.detach import register_reporter
from monarch_kernel.worker.worker import current_worker

log = logging.getLogger("monarch_kernel.actor.actor_mesh")

__all__ = [
    "Packed",
    "context",
    "dispatch_call",
    "dispatch_rank_dead",
    "peer_host",
    "register_sources",
    "spawn_local",
    "stats",
    "stop_local",
]

# (``context``: per thread, ``.actor`` is the _ActorInstance whose thread this is)
actor_peers.hide_frames_of(__file__)  # failures: the user's frames first

def register_sources(sources: dict[str, list[str]] | None) -> None:
    """Make shipped source files known to :mod:`linecache` (remote tracebacks
    then show the lines of notebook cells and scripts)."""
    for name, lines in (sources or {}).items():
        linecache.cache[name] = (sum(map(len, lines)), None, lines, name)


# ------------------------------------------------------------------ actors
_NOTHING = object()
FAST_S = 0.0002  # seconds: an endpoint this quick may have its reply batched
MAX_HELD = 64  # replies in one batch, at most
HOLD_S = 0.001  # seconds a reply may wait for its batch, at most


class _ActorInstance:
    """One actor on this worker: its object, queue, thread and event loop."""

    def __init__(self, worker: Any, name: str, uid: str, point: Point,
                 sizes: dict[str, int]) -> None:
        self.worker = worker
        self.name = name
        self.uid = uid
        self.point = point
        self.sizes = sizes
        self.obj: Any = None
        self.queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.leading = False  # the thread reads the worker's messages (while idle)
        # adaptive batching of replies (see _may_hold)
        self._held: list[tuple[str, Packed]] = []  # (call id, value) not sent yet
        self._held_at = 0.0
        self._held_lock = threading.Lock()
        self._ahead: Any = _NOTHING  # the next queued item, taken out to look at it
        self._fast: dict[str, bool] = {}  # endpoint -> its last call ran under FAST_S
        self.loop: asyncio.AbstractEventLoop | None = None
        # wait cycles (actor_cycles): the message being handled, calls made by actors
        # that are queued or running here, calls this thread has waited for a while
        self.current: Any = None
        self.tracked: dict[str, Any] = {}
        self.waits: dict[str, Any] = {}
        self.wait_lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name=f"monarch-actor-{name}",
                                       daemon=True)
        self.thread.start()

    def post(self, item: Any) -> None:
        """Queue ``item`` for this actor's thread (any thread); wakes the thread
        when it is idle and reading the worker's messages (``lead_until``)."""
        self.queue.put(item)
        me = threading.get_ident()  # (the thread that leads checks the queue itself)
        if self.leading and me != self.thread.ident and getattr(
                self.worker, "leader", None) != me:
            wake = getattr(self.worker, "wake", None)
            if wake is not None:
                wake()

    def deliver(self, mid: str, c: Call, route: list[bytes] | None) -> None:
        """Queue call ``mid`` (content ``c``; ``route``: the calling peer's identity, None
        for the controller); a call an actor made is tracked for wait cycles
        (:mod:`monarch_kernel.actor.cycles`) while queued or running. Any thread."""
        if WAITED in c:
            actor_cycles.track(self, mid, c, route)
        self.post(("call", mid, c, route))

    def _run(self) -> None:
        context.actor = self
        try:
            gpu.enter_thread()  # the rank's GPU is this thread's current device too
            lead = getattr(self.worker, "lead_until", None)
            while True:
                item = self._ahead
                if item is _NOTHING:
                    if self.queue.empty():
                        self._flush()  # nothing queued: held replies leave now
                        if lead is not None:
                            self.leading = True
                            try:
                                lead(self.queue)  # idle: read the worker's messages here
                            finally:
                                self.leading = False
                    item = self.queue.get()
                else:
                    self._ahead = _NOTHING
                if item is None or item[0] != "call":
                    self._flush()
                if item is None:
                    break
                self.current = item
                if item[0] == "init":
                    self._construct(item[1], item[2])
                elif item[0] == "supervise":
                    self._supervise(item[1])
                elif WAITED not in item[2]:
                    self._call(item[1], item[2], item[3])
                elif actor_cycles.begin(self, item[1]):  # a call an actor made (tracked)
                    try:
                        self._call(item[1], item[2], item[3])
                    finally:
                        actor_cycles.end(self, item[1])
                # (otherwise it was answered already: it would have closed a wait cycle)
                self.current = None  # (and its arguments may go)
                leave = getattr(self.worker, "leave_if_forked", None)
                if leave is not None:  # a constructor or __supervise__ that forked
                    leave()
        finally:
            if self.loop is not None:
                self.loop.close()

    def _may_hold(self) -> bool:
        """Whether an ok reply may wait to leave with the next ones (one message
        for several replies: a burst of small calls then costs one send, one
        signature and one receive per batch).

        Only while the next call is already queued and its endpoint ran in
        under FAST_S last time (a prediction, as in adaptive batching: a reply
        is never held behind a call expected to be slow), at most MAX_HELD
        replies and HOLD_S seconds.
        """
        if len(self._held) >= MAX_HELD or (
                self._held and time.perf_counter() - self._held_at > HOLD_S):
            return False
        if self._ahead is _NOTHING:
            if self.queue.empty():
                return False
            try:
                self._ahead = self.queue.get_nowait()
            except queue.Empty:
                return False
        nxt = self._ahead
        return (nxt is not None and nxt[0] == "call" and nxt[3] is None
                and not nxt[2].get(ONEWAY) and self._fast.get(nxt[2].get(METHOD), False))

    def _flush(self) -> None:
        """Send the held replies (one message for several)."""
        if not self._held:
            return
        with self._held_lock:  # the worker's I/O thread may flush too (flush_stale)
            held, self._held = self._held, []
            if len(held) == 1:
                self.worker.reply(held[0][0], "ok", held[0][1])
            elif held:
                self.worker.reply_many(held)

    def flush_stale(self) -> bool:
        """Send held replies older than HOLD_S (the worker's I/O thread, while
        this actor runs a call that turned out slow: a held reply then waits
        for at most one turn of that thread, about 20 ms, not for the call).
        True if younger replies are still held."""
        if self._held and time.perf_counter() - self._held_at > HOLD_S:
            self._flush()
        return bool(self._held)

    def _run_maybe_async(self, value: Any) -> Any:
        if asyncio.iscoroutine(value):
            if self.loop is None:
                self.loop = asyncio.new_event_loop()
                asyncio.set_event_loop(self.loop)
            value = self.loop.run_until_complete(value)
        return value

    def _supervise(self, failure: Any) -> None:
        """A mesh this actor spawned lost a rank: ``__supervise__(failure)`` decides.

        Runs on the actor's thread, between messages (one at a time, like
        calls). A falsy result, no ``__supervise__``, or an exception in it
        leaves the failure unhandled: it is reported to this worker's
        controller, which shows it (see ``Controller.unhandled``).
        """
        handler = getattr(self.obj, "__supervise__", None)
        handled, note = False, ""
        if handler is not None:
            try:
                handled = bool(self._run_maybe_async(handler(failure)))
            except BaseException as e:  # noqa: BLE001 - reported below
                note = f"; __supervise__ raised {type(e).__name__}: {e}"
        if not handled:
            try:
                self.worker.send("event", SupervisionEvent(
                    kind="supervision", actor=self.name, rank=self.worker.rank,
                    failure=f"{failure}{note}"))
            except Exception:  # noqa: BLE001 - the connection is going away
                log.warning("could not report an unhandled failure: %s", failure)

    def _construct(self, packed: Packed, done: list[Any]) -> None:
        try:
            cls, args, kwargs = packed.unpack()
            self.obj = cls(*args, **kwargs)
            done.append(None)
        except BaseException as e:  # noqa: BLE001 - reported to the controller
            done.append(failure_of(self.worker, e))
        done[0].set()

    def _call(self, mid: str, c: Call, route: list[bytes] | None) -> None:
        w = self.worker
        method = c[METHOD]
        oneway = c.get(ONEWAY, False)
        prev = w.current_parent
        attribute = route is None and not oneway
        if attribute:  # output written during the call goes to the caller's request
            w.current_parent = mid
        telemetry.set_activity(f"running endpoint {self.name}.{method}")
        out: Any  # the packed value, or a failure (dict) where status is "error"
        try:
            if SOURCES in c:
                register_sources(c[SOURCES])
            args, kwargs = c[PAYLOAD].unpack()
            fn = getattr(self.obj, method, None)
            if fn is None or not getattr(fn, "__monarch_endpoint__", False):
                raise AttributeError(
                    f"actor {self.name!r} ({type(self.obj).__qualname__}) has no endpoint "
                    f"{method!r}"
                )
            t0 = time.perf_counter()
            try:
                value = self._run_maybe_async(fn(*args, **kwargs))
            finally:
                w.leave_if_forked()  # (a child the endpoint forked and that came back)
            self._fast[method] = time.perf_counter() - t0 < FAST_S
            if KEEP in c:  # .rref(): the value stays here; only its description goes back
                value = keep_result(c[KEEP], value)
            try:  # to the controller on this host: big CUDA tensors go by IPC handle
                with cuda_ipc(bool(not c.get(ONEWAY) and (c.get(IPC) if route is not None
                                                           else w.controller_pid is not None))):
                    status, out = "ok", Packed.pack(value)
            except SerializationError as e:
                status, out = "error", failure_of(w, e, with_traceback=False)
                out["message"] = (  # (the rank is named where the error is shown)
                    f"{type(self.obj).__qualname__}.{method} returned a "
                    f"{type(value).__qualname__}, which cannot be sent back "
                    f"({e.__cause__ or e}); return something picklable"
                )
        except BaseException as e:  # noqa: BLE001 - every failure goes back to the caller
            status, out = "error", failure_of(w, e)
        telemetry.set_activity(None)
        try:
            if (status == "ok" and route is None and not oneway and not out.buffers
                    and len(out.payload) < 4096 and self._may_hold()):
                with self._held_lock:
                    if not self._held:
                        self._held_at = time.perf_counter()
                    self._held.append((mid, out))
            else:
                self._flush()
                answer(w, mid, c, route, status, out)
        finally:
            if attribute and w.current_parent in (mid, None):
                w.current_parent = prev


def dispatch_call(worker: Any, msg: Any) -> None:
    """Hand a ``call`` message from the controller to its actor (worker I/O thread).

    Never blocks: the actor's thread runs the call and replies.
    """
    c: Call = msg.content
    inst = worker.actors.get(c[ACTOR])
    if inst is None:
        reject(worker, msg.id, c, None)
        return
    if REFS in c:  # a one-way call with handles: take their values now (see _Unpacked)
        if SOURCES in c:
            register_sources(c[SOURCES])
        c[PAYLOAD] = _Unpacked(c[PAYLOAD])
    inst.deliver(msg.id, c, None)


def dispatch_rank_dead(worker: Any, msg: Any) -> None:
    """A ``rank_dead`` notice (worker I/O thread): a rank of this worker's mesh, or of
    another mesh of the program, died. Calls this worker's actors wait on it fail at
    once, and the meshes this worker spawned itself hear of it too."""
    c: RankDead = msg.content
    host = actor_peers.current_host()
    if host is not None:
        host.fail_rank(c["rank"], c.get("addr"), c["reason"], c.get("mesh"))
    # meshes this worker spawned wait on it too, maybe
    mesh_keys.pass_down_death(RankDead(rank=c["rank"], addr=c.get("addr"), reason=c["reason"],
                                       mesh=c.get("mesh") or worker.codec.fingerprint))


class _Call:
    """One call of a ``calls`` message, shaped as :func:`dispatch_call` reads it."""

    __slots__ = ("content", "id")

    def __init__(self, id: str, content: Call) -> None:
        self.id, self.content = id, content


def dispatch_calls(worker: Any, msg: Any) -> None:
    """Hand each call of a ``calls`` message (a batch of pipelined calls the
    controller held, :mod:`monarch_kernel.controller.batching`) to its actor, in order.

    A malformed batch is dropped whole, with a warning (it was signed by the
    controller, so only a bug makes one).
    """
    try:
        calls = [_Call(str(mid), c) for mid, c in msg.content]
        if not all(isinstance(call.content, dict) and ACTOR in call.content for call in calls):
            raise ValueError("a call without an actor name")
    except (TypeError, ValueError) as e:
        log.warning("rank %d dropped a malformed batch of calls: %s", worker.rank, e)
        return
    for call in calls:
        dispatch_call(worker, call)


class _Unpacked:
    """A call's arguments unpickled when the call arrives, not when it runs.

    For a one-way call (``broadcast``) that carries handles
    (:class:`~monarch_kernel.tensors.handles.Ref`): nobody keeps them alive until the
    call ran, and a ``free`` the controller sends after the call may arrive
    before the actor gets to it. The handles resolve to their values here,
    in message order, so that such a ``free`` drops nothing the call uses.
    """

    __slots__ = ("error", "value")

    def __init__(self, packed: Packed) -> None:
        self.value: Any = None
        self.error: BaseException | None = None
        try:
            self.value = packed.unpack()
        except Exception as e:  # noqa: BLE001 - raised where the call runs
            self.error = e

    def unpack(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.value


def spawn_local(worker: Any, content: SpawnActor) -> SpawnReply:
    """Construct one actor on this worker (worker main thread).

    Returns
    -------
    dict
        ``{"peer": address}`` (this worker's peer socket), plus
        ``"failure"`` when the constructor raised (a failure dict, reported
        as an ActorError by the controller).

    Raises
    ------
    ValueError
        If an actor of that name already runs here.
    """
    name = content["name"]
    if name in worker.actors:
        raise ValueError(
            f"an actor named {name!r} already runs on rank {worker.rank}; stop it first "
            "(actor_mesh.stop()) or pick another name"
        )
    host = peer_host(worker)
    register_sources(content.get("sources"))
    shape = Shape(content["dims"], content["ranks"])
    point = next(p for p in shape.points() if p.rank == worker.rank)
    inst = _ActorInstance(worker, name, content["uid"], point, shape.dims)
    done: list[Any] = [threading.Event()]
    inst.post(("init", content["init"], done))
    done[0].wait()
    if done[1] is not None:
        inst.post(None)
        return SpawnReply(peer=host.address, failure=done[1])
    worker.actors[name] = inst
    host.stopped.pop(name, None)
    return SpawnReply(peer=host.address)


def stop_local(worker: Any, name: str, timeout: float = 10.0) -> None:
    """Stop actor ``name`` after the messages already queued for it (main thread)."""
    inst = worker.actors.pop(name, None)
    host = peer_host(worker)
    host.stopped[name] = "was stopped (ActorMesh.stop())"
    if inst is None:
        return
    inst.post(None)
    inst.thread.join(timeout)


def supervise_from_current_actor(controller: Any) -> None:
    """If this thread is an actor's, route failures of ``controller``'s mesh
    (a mesh the actor spawns) to that actor's ``__supervise__``."""
    inst = getattr(context, "actor", None)
    if inst is None:
        return

    def on_event(kind: str, rank: int, payload: Any) -> None:
        if kind == "dead" and not controller.stopping:
            inst.post(("supervise", payload))

    controller.listeners.append(on_event)


def actor_point() -> tuple[Point, dict[str, int]] | None:
    """The point and mesh sizes of the actor whose thread this is, if any."""
    inst = getattr(context, "actor", None)
    if inst is not None:
        return inst.point, inst.sizes
    w = current_worker()
    if w is not None:
        shape = Shape(w.shape)
        return next(p for p in shape.points() if p.rank == w.rank), shape.dims
    return None


# ------------------------------------------------- the worker's handlers (plug-in)
def _stop_actor(worker: Any, content: dict[str, Any]) -> None:
    stop_local(worker, content["name"])


handlers.register_io("call", dispatch_call)  # to the actor's queue
handlers.register_io("calls", dispatch_calls)  # a batch (controller.batching), in order
handlers.register_io("rank_dead", dispatch_rank_dead)  # calls waiting on a dead rank fail
handlers.register_request("spawn_actor", spawn_local)  # {"peer": this worker's actor address}
handlers.register_request("stop_actor", _stop_actor)


def actor_report(worker: Any) -> dict[str, Any]:
    """The actors running on ``worker``, for a controller that attaches to its
    (detachable) mesh: ``{"actors": {name: {uid, cls, endpoints, peer}}}``."""
    out: dict[str, Any] = {}
    for name, inst in list(worker.actors.items()):
        obj = getattr(inst, "obj", None)
        if obj is None:
            continue
        names: dict[str, None] = {}
        for klass in reversed(type(obj).__mro__):
            for k, v in vars(klass).items():
                if getattr(getattr(v, "__func__", v), "__monarch_endpoint__", False):
                    names[k] = None
                elif k in names:
                    del names[k]
        out[name] = {"uid": inst.uid, "cls": type(obj).__qualname__,
                     "endpoints": list(names), "peer": peer_host(worker).address}
    return {"actors": out}


register_reporter(actor_report)
