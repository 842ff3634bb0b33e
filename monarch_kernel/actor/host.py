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
import os
import queue
import threading
import time
from typing import Any

from monarch_kernel.actor import cycles as actor_cycles
from monarch_kernel.actor import peers as actor_peers
from monarch_kernel.util import gpu
from monarch_kernel.worker import handlers, telemetry
from monarch_kernel.actor.peers import peer_host, stats  # noqa: F401 - stats: re-exported
from monarch_kernel.errors import MeshFailure, SerializationError
from monarch_kernel.mesh.shape import Point, Shape
from monarch_kernel.wire.serialize import Packed, cuda_ipc, reply_content

log = logging.getLogger("monarch_kernel.actor.actor_mesh")

__all__ = [
    "Packed",
    "context",
    "dispatch_call",
    "peer_host",
    "register_sources",
    "spawn_local",
    "stats",
    "stop_local",
]

#: per thread: ``.actor`` is the _ActorInstance whose thread this is
context = threading.local()

_ASYNCIO_DIR = os.path.dirname(asyncio.__file__)


def register_sources(sources: dict[str, list[str]] | None) -> None:
    """Make shipped source files known to :mod:`linecache` (remote tracebacks
    then show the lines of notebook cells and scripts)."""
    for name, lines in (sources or {}).items():
        linecache.cache[name] = (sum(map(len, lines)), None, lines, name)


def _user_traceback(tb: Any) -> Any:
    """Drop this module's and asyncio's frames from the top of a traceback."""
    while tb is not None:
        f = tb.tb_frame.f_code.co_filename
        if f != __file__ and not f.startswith(_ASYNCIO_DIR):
            break
        tb = tb.tb_next
    return tb


def _failure(worker: Any, e: BaseException, with_traceback: bool = True) -> dict[str, Any]:
    e.__traceback__ = _user_traceback(e.__traceback__)
    f = worker.describe_failure(e, with_traceback)
    exc = f.get("exc")
    try:
        f["exc"] = Packed.pack(exc) if exc is not None else None
    except SerializationError:
        f["exc"] = None
    return f


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
                self.worker, "_leader", None) != me:
            wake = getattr(self.worker, "wake", None)
            if wake is not None:
                wake()

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
                elif "w" not in item[2]:
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
                and not nxt[2].get("o") and self._fast.get(nxt[2].get("m"), False))

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
                self.worker.send("event", {
                    "kind": "supervision", "actor": self.name, "rank": self.worker.rank,
                    "failure": f"{failure}{note}"})
            except Exception:  # noqa: BLE001 - the connection is going away
                log.warning("could not report an unhandled failure: %s", failure)

    def _construct(self, packed: Packed, done: list[Any]) -> None:
        try:
            cls, args, kwargs = packed.unpack()
            self.obj = cls(*args, **kwargs)
            done.append(None)
        except BaseException as e:  # noqa: BLE001 - reported to the controller
            done.append(_failure(self.worker, e))
        done[0].set()

    def _call(self, mid: str, c: dict[str, Any], route: list[bytes] | None) -> None:
        w = self.worker
        method = c["m"]
        oneway = c.get("o", False)
        prev = w.current_parent
        attribute = route is None and not oneway
        if attribute:  # output written during the call goes to the caller's request
            w.current_parent = mid
        telemetry.set_activity(f"running endpoint {self.name}.{method}")
        try:
            if "s" in c:
                register_sources(c["s"])
            args, kwargs = c["p"].unpack()
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
            if "k" in c:  # .rref(): the value stays here; only its description goes back
                from monarch_kernel.tensors.store import keep

                value = keep(c["k"], value)
            try:  # to the controller on this host: big CUDA tensors go by IPC handle
                with cuda_ipc(not c.get("o") and (c.get("i") if route is not None
                                                  else w.controller_pid is not None)):
                    status, out = "ok", Packed.pack(value)
            except SerializationError as e:
                status, out = "error", _failure(w, e, with_traceback=False)
                out["message"] = (  # (the rank is named where the error is shown)
                    f"{type(self.obj).__qualname__}.{method} returned a "
                    f"{type(value).__qualname__}, which cannot be sent back "
                    f"({e.__cause__ or e}); return something picklable"
                )
        except BaseException as e:  # noqa: BLE001 - every failure goes back to the caller
            status, out = "error", _failure(w, e)
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
                _answer(w, mid, c, route, status, out)
        finally:
            if attribute and w.current_parent in (mid, None):
                w.current_parent = prev


def _answer(w: Any, mid: str, c: dict[str, Any], route: list[bytes] | None, status: str,
            value: Any) -> None:
    """Send the result of call ``mid`` where it must go."""
    if c.get("o"):  # broadcast: nobody waits; a failure is still reported
        if status == "error":
            if w.capture is not None:
                w.capture.drain()
            w.send("event", {"kind": "actor_error", "actor": c["a"], "method": c["m"],
                             "uid": c.get("u"), "rank": w.rank, "failure": value})
        return
    if route is None:
        w.reply(mid, status, value)
    else:
        host = peer_host(w)
        try:
            frames = host.codec.encode("reply", reply_content(status, value), parent=mid)
        except SerializationError as e:  # (too large, say): the caller gets why, not a hang
            frames = host.codec.encode("reply", {"status": "error", "value": {
                "type": "monarch_kernel.errors.SerializationError", "traceback": "",
                "message": f"rank {w.rank}: the result of {c.get('m')!r} cannot be sent "
                           f"back: {e}", "exc": None}}, parent=mid)
        host.reply_to(route, frames)


def _missing(w: Any, name: str) -> MeshFailure:
    host = actor_peers._host
    cause = host.stopped.get(name) if host is not None else None
    if cause:
        return MeshFailure(f"actor {name!r} on rank {w.rank} {cause}", rank=w.rank)
    return MeshFailure(f"rank {w.rank} has no actor named {name!r}: it was not spawned there, "
                       "or the rank was restarted since (a fresh process: spawn the actor "
                       "mesh again)", rank=w.rank)


def _reject(w: Any, mid: str, c: dict[str, Any], route: list[bytes] | None) -> None:
    e = _missing(w, c["a"])
    failure = {"type": "monarch_kernel.errors.MeshFailure", "message": str(e),
               "traceback": "", "exc": Packed.pack(e), "rejected": True}
    _answer(w, mid, c, route, "error", failure)


def dispatch_call(worker: Any, msg: Any) -> None:
    """Hand a ``call`` message from the controller to its actor (worker I/O thread).

    Never blocks: the actor's thread runs the call and replies.
    """
    c = msg.content
    if "sys" in c:
        host = actor_peers._host
        if c["sys"] == "dead":
            if host is not None:
                host.fail_rank(c["rank"], c.get("addr"), c["reason"], c.get("mesh"))
            from monarch_kernel.actor import mesh_keys  # (meshes this worker spawned may wait)

            mesh_keys.pass_down({**c, "mesh": c.get("mesh") or worker.codec.fingerprint})
        return
    inst = worker.actors.get(c["a"])
    if inst is None:
        _reject(worker, msg.id, c, None)
        return
    if "r" in c:  # a one-way call with handles: take their values now (see _Unpacked)
        if "s" in c:
            register_sources(c["s"])
        c["p"] = _Unpacked(c["p"])
    if "w" in c:  # an actor of the worker that spawned this mesh waits: tracked (actor_cycles)
        actor_cycles.track(inst, msg.id, c, None)
    inst.post(("call", msg.id, c, None))


class _Call:
    """One call of a ``calls`` message, shaped as :func:`dispatch_call` reads it."""

    __slots__ = ("content", "id")

    def __init__(self, id: str, content: dict[str, Any]) -> None:
        self.id, self.content = id, content


def dispatch_calls(worker: Any, msg: Any) -> None:
    """Hand each call of a ``calls`` message (a batch of pipelined calls the
    controller held, :mod:`monarch_kernel.controller.batching`) to its actor, in order.

    A malformed batch is dropped whole, with a warning (it was signed by the
    controller, so only a bug makes one).
    """
    try:
        calls = [_Call(str(mid), c) for mid, c in msg.content]
        if not all(isinstance(call.content, dict) and "a" in call.content for call in calls):
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


def spawn_local(worker: Any, content: dict[str, Any]) -> dict[str, Any]:
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
        return {"peer": host.address, "failure": done[1]}
    worker.actors[name] = inst
    host.stopped.pop(name, None)
    return {"peer": host.address}


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
    from monarch_kernel.worker import worker as _worker

    w = _worker.current
    if w is not None:
        shape = Shape(w.shape)
        return next(p for p in shape.points() if p.rank == w.rank), shape.dims
    return None


# ------------------------------------------------- the worker's handlers (plug-in)
def _stop_actor(worker: Any, content: dict[str, Any]) -> None:
    stop_local(worker, content["name"])


handlers.register_io("call", dispatch_call)  # to the actor's queue
handlers.register_io("calls", dispatch_calls)  # a batch (controller.batching), in order
handlers.register_request("spawn_actor", spawn_local)  # {"peer": this worker's actor address}
handlers.register_request("stop_actor", _stop_actor)
