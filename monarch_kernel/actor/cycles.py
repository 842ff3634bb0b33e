"""Wait cycles between actors: the call that would close one fails at once.

An actor handles one message at a time, so an endpoint that waits for a
call (``future.get()``, or ``await future``: an async endpoint too runs to
completion before the next message) holds its actor until that call
returns. When the call it waits for waits, directly or through other calls,
for a call queued for that same actor, nothing can move any more: a *wait
cycle*. ``a.p`` waits for ``b.x``, which calls ``a.y`` and waits for it,
but ``a.y`` cannot start before ``a.p`` returns. Longer cycles
(``a -> b -> c -> a``), cycles between actors of one process, and cycles of
calls started independently (``a.p`` waits for ``b.q``, queued behind
``b.p``, which waits for ``a.q``) are alike.

The call that closes the cycle (a queued one) is answered at once with a
:class:`WaitCycleError` that names the calls of the cycle, and never runs.
Its caller's ``get()`` raises that error and, unless it is caught, so does
every call of the cycle in turn: the chain unwinds instead of hanging. (A
wait for a call to the waiting actor itself is refused before it starts:
``call_guard``.)

How they are found. Calls from the controller take no part and pay
nothing; a call an actor makes carries one more key, and a wait that ends
within :data:`WATCH_AFTER_S` costs nothing more.

* A call made on an actor's thread carries ``"w"``
  (:data:`~monarch_kernel.wire.messages.WAITED`): the worker that gets it
  tracks it (:class:`_Tracked`) while it is queued or running. Calls to the
  actors of another mesh of the program are alike: the notices below go to
  that mesh's ranks, signed with its key as the call was
  (:mod:`~monarch_kernel.actor.mesh_keys`), so a cycle through several meshes is
  found as one within a mesh. So are the calls an actor makes to a mesh it
  spawned itself, which go through that mesh's controller in the actor's
  own worker: the notices are signed with that controller's key.
* An actor's thread that has waited :data:`WATCH_AFTER_S` for such a call
  sends the call's ranks a *wait notice* (an ``event`` message on the peer
  socket, behind the call itself): the calls that cannot finish before that
  call does. Those are the call the thread serves (which waits for it), the
  calls queued behind that one whose callers wait for them, and, from the
  notices this worker got for those calls, whatever waits for them in turn.
  Each entry names the call it waits for (``via``).
* Whenever that set changes while the thread waits, the notice goes again
  (newer notices win: a sequence number); when the thread stops waiting
  before the call is done (a timeout), an empty one goes.
* A worker that gets a notice for a call still queued for one of its
  actors looks in the set for the call that actor serves now, waiting
  (still) for what the entry says: if it is there, the queued call closes a
  cycle and is answered with the error. When a cycle holds several queued
  calls (calls started independently), the workers that see it fail the
  same one (the smallest id), the others wait for that to unwind.

No false positives: an actor that calls another without waiting for it (or
that stopped waiting) is in no set, and only a queued call whose callers
all wait, link by link, is failed. Limits: a wait for one of several calls
(a ``stream``'s next future, ``asyncio.wait(..., FIRST_COMPLETED)``) counts
as a wait for each of them; a cycle that also runs through a wait this
module does not see (a lock, a queue, polling ``done()``) still hangs; and
a set holds at most :data:`MAX_ENTRIES` entries.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from typing import Any, cast

from monarch_kernel.actor import peers as actor_peers
from monarch_kernel.actor.context import current_actor
from monarch_kernel.actor.future import (
    WATCH_AFTER_S,  # an actor's thread tells a call's ranks after that long
)
from monarch_kernel.errors import MeshError
from monarch_kernel.wire.messages import (
    METHOD,
    WAIT_ACTOR,
    WAIT_CALL,
    WAIT_ENTRIES,
    WAIT_SEQ,
    Call,
    WaitNotice,
)

log = logging.getLogger("monarch_kernel.actor.actor_mesh")

__all__ = ["MAX_ENTRIES", "WATCH_AFTER_S", "WaitCycleError", "any_of_guard", "call_guard",
           "on_notice", "watcher"]

#: entries in one wait notice, at most
MAX_ENTRIES = 256

_seq = itertools.count(1)  # notice numbers of this process (newer wins)

# An entry of a notice: (call id, actor, endpoint, rank, via, queued): that call
# cannot finish before call ``via`` does; ``queued``: because it is queued behind it.
Entry = tuple[str, str, str, int, str, bool]


class WaitCycleError(RuntimeError):
    """A call would close a wait cycle between actors, which would hang forever.

    Raised by the ``get()`` (or ``await``) of the call that closes the cycle;
    the message names the actors, endpoints and ranks of the cycle.
    """


WaitCycleError.__module__ = "monarch_kernel"  # (exported there: what tracebacks name)


class _Tracked:
    """A call made by an actor, queued or running on an actor of this worker."""

    __slots__ = ("c", "method", "mid", "route", "running", "seq", "waiters")

    def __init__(self, mid: str, c: Call, route: list[bytes] | None) -> None:
        self.mid = mid
        self.c = c
        self.method = c.get(METHOD, "?")
        self.route = route
        self.running = False
        self.seq = 0  # number of the newest notice taken
        self.waiters: tuple[Entry, ...] = ()  # what cannot finish before this call does


class _Wait:
    """A call an actor's thread has waited for longer than WATCH_AFTER_S."""

    __slots__ = ("actor", "codec", "count", "mesh", "mid", "req", "sent", "targets")

    def __init__(self, req: Any, actor: str, targets: list[tuple[int, str]],
                 codec: Any = None) -> None:
        self.req = req
        self.mid: str = req.id
        self.actor = actor
        self.targets = targets
        self.mesh: str | None = req.mesh  # the callee's mesh, if not this worker's
        self.codec = codec  # the codec that signs for the callee's mesh, when given
        self.count = 1  # waits on it now (one thread; several coroutines may await it)
        self.sent: tuple[Entry, ...] = ()


# ------------------------------------------------------ the serving side
def track(inst: Any, mid: str, c: Call, route: list[bytes] | None) -> None:
    """A call made by an actor arrived for ``inst`` (the thread that read it, before
    it is queued; ``route``: the calling peer's identity, None for the controller)."""
    with inst.wait_lock:
        inst.tracked[mid] = _Tracked(mid, c, route)


def begin(inst: Any, mid: str) -> bool:
    """The actor's thread takes tracked call ``mid``: False if it was answered
    already (it would have closed a cycle)."""
    with inst.wait_lock:
        t = inst.tracked.get(mid)
        if t is None:
            return False
        t.running = True
        return True


def end(inst: Any, mid: str) -> None:
    """Tracked call ``mid`` is over (the actor's thread)."""
    with inst.wait_lock:
        inst.tracked.pop(mid, None)


def on_notice(worker: Any, content: WaitNotice) -> None:
    """A wait notice arrived (read by the peer thread, or the worker's leading
    thread); fail the call it shows to close a cycle."""
    try:
        inst = worker.actors.get(content[WAIT_ACTOR])
        if inst is None:
            return
        err = t = None
        with inst.wait_lock:
            t = inst.tracked.get(content[WAIT_CALL])
            if t is None or content[WAIT_SEQ] <= t.seq:
                return  # done already, or an older notice
            t.seq = content[WAIT_SEQ]
            entries = content[WAIT_ENTRIES][:MAX_ENTRIES]
            t.waiters = tuple(tuple(e) for e in entries
                              if isinstance(e, (tuple, list)) and len(e) == 6)
            if not t.running:
                path = _cycle(inst, t)
                if path is not None and _victim(t, path):
                    del inst.tracked[t.mid]  # the actor's thread skips it (begin)
                    err = WaitCycleError(_describe(inst, t, path))
            if inst.waits:
                _resend(inst)
    except Exception:  # a bad notice must not stop the thread that read it
        log.exception("rank %s: a wait notice could not be handled", worker.rank)
        return
    if err is not None:
        actor_peers.answer(worker, t.mid, t.c, t.route, "error",
                           actor_peers.failure_of(worker, err, False))


def _on_event(host: Any, msg: Any) -> None:
    """A peer ``event`` message: a wait notice (an actor waits for a call) is
    checked for wait cycles; other events are dropped."""
    if isinstance(msg.content, dict) and msg.content.get("kind") == "wait":
        on_notice(host.worker, cast("WaitNotice", msg.content))


actor_peers.register_handler("event", _on_event)


def _serving(inst: Any) -> tuple[str, str] | None:
    """(call id, endpoint) of the call ``inst`` runs now (None between calls)."""
    item = inst.current
    if item is None or item[0] != "call":
        return None
    return item[1], item[2].get(METHOD, "?")


def _cycle(inst: Any, t: _Tracked) -> list[Entry] | None:
    """The calls from the one ``inst`` serves to queued call ``t``, if ``t`` closes a cycle."""
    s = _serving(inst)
    if s is None:
        return None
    first = next((e for e in t.waiters if e[0] == s[0] and not e[5] and _waits(inst, e[4])),
                 None)
    if first is None:
        return None
    # the way from that call to ``t`` through the entries (breadth first), for the message
    edges: dict[str, list[Entry]] = {}
    for e in t.waiters:
        edges.setdefault(e[0], []).append(e)
    came: dict[str, Entry] = {}
    todo = [first]
    while todo and t.mid not in came:
        nxt: list[Entry] = []
        for e in todo:
            if e[4] not in came and e[4] != first[0]:
                came[e[4]] = e
                nxt.extend(edges.get(e[4], ()))
        todo = nxt
    if t.mid not in came:
        return [first]  # (known in part)
    path = [came[t.mid]]
    while path[-1] is not first:
        path.append(came[path[-1][0]])
    return path[::-1]


def _victim(t: _Tracked, path: list[Entry]) -> bool:
    """Whether ``t`` is the call of the cycle to fail: of the queued calls of a
    cycle known whole, the one with the smallest id (each worker that sees the
    cycle picks the same one, so one call fails, not one per worker)."""
    if path[-1][4] != t.mid or len(t.waiters) >= MAX_ENTRIES:
        return True  # known in part: fail this one
    return all(t.mid <= e[0] for e in path if e[5])


def _waits(inst: Any, mid: str) -> bool:
    """Whether ``inst``'s thread waits for call ``mid`` now (not done yet)."""
    w = inst.waits.get(mid)
    return w is not None and not w.req.done()


def _describe(inst: Any, t: _Tracked, path: list[Entry]) -> str:
    def name(e: Entry) -> str:
        return f"{e[1]}.{e[2]} (rank {e[3]})"

    here = f"{inst.name}.{t.method} (rank {inst.worker.rank})"
    text = name(path[0])
    for i, e in enumerate(path):
        last = i + 1 == len(path)
        verb = "is queued behind" if e[5] else "waits for"
        if last and e[4] != t.mid:  # (a part of the way is not in the set)
            verb = "waits (through other calls) for"
        text += f" {verb} {here if last else name(path[i + 1])}" + ("" if last else ", which")
    return (
        f"wait cycle between actors: {text}, which cannot start before "
        f"{path[0][1]}.{path[0][2]} returns (an actor handles one message at a time), so "
        f"the call to {inst.name}.{t.method} fails instead of hanging forever. Do not wait "
        "inside an endpoint for a call that may call back into a waiting actor: return "
        "without waiting (keep the future and ask for its value in a later call, or use "
        "broadcast() when the result is not needed), or restructure so no call back is needed"
    )


# ------------------------------------------------------- the waiting side
def watcher(inst: Any, req: Any, actor: str, ranks: list[int], peers: dict[int, str],
            codec: Any = None) -> Callable[[bool], None]:
    """What the future of call ``req`` (to actor ``actor`` on ``ranks``, whose
    peer addresses ``peers`` holds) tells when ``inst``'s thread has waited for
    it a while (``True``) and when it stops (``False``); see :meth:`Future.get`.
    ``codec`` signs the notices (the controller's of a mesh this worker
    spawned); by default the peer host's for the callee's mesh."""

    def watch(on: bool) -> None:
        with inst.wait_lock:
            w = inst.waits.get(req.id)
            if on:
                if w is not None:
                    w.count += 1
                    return
                w = inst.waits[req.id] = _Wait(req, actor, [(r, peers[r]) for r in ranks],
                                               codec)
                w.sent = _blocked(inst, req.id)
                if w.sent:
                    _notify(w, w.sent)
                return
            if w is None:
                return
            w.count -= 1
            if w.count:
                return
            del inst.waits[req.id]
            if w.sent and not req.done():  # gave up waiting (a timeout): forget the set
                _notify(w, ())

    return watch


def _blocked(inst: Any, via: str) -> tuple[Entry, ...]:
    """The calls that cannot finish before call ``via``, which ``inst``'s thread
    waits for, does (under ``inst.wait_lock``)."""
    s = _serving(inst)
    if s is None:
        return ()
    rank = inst.worker.rank
    out: list[Entry] = [(s[0], inst.name, s[1], rank, via, False)]
    seen = {(s[0], via)}

    def add(entries: tuple[Entry, ...]) -> None:
        for e in entries:
            key = (e[0], e[4])
            if key not in seen and len(out) < MAX_ENTRIES:
                seen.add(key)
                out.append(e)

    t = inst.tracked.get(s[0])
    if t is not None:
        add(t.waiters)
    for q in inst.tracked.values():
        if not q.running and q.waiters:  # queued behind the call served, and waited for
            add(((q.mid, inst.name, q.method, rank, s[0], True),))
            add(q.waiters)
    return tuple(out)


def _resend(inst: Any) -> None:
    """What waits for the call ``inst`` serves changed: tell the calls its thread
    waits for (under ``inst.wait_lock``)."""
    for w in inst.waits.values():
        entries = _blocked(inst, w.mid)
        if set(entries) != set(w.sent):  # (in a cycle the sets go round: until they settle)
            w.sent = entries
            _notify(w, entries)


def _notify(w: _Wait, entries: tuple[Entry, ...]) -> None:
    host = actor_peers.current_host()
    if host is None:
        return
    try:  # (signed with the key of the callee's mesh, as the call was)
        codec = w.codec or host.codec_for(w.mesh)
    except MeshError:  # that mesh was stopped meanwhile: its calls fail anyway
        return
    notice: WaitNotice = {"kind": "wait", WAIT_ACTOR: w.actor, WAIT_CALL: w.mid,
                          WAIT_SEQ: next(_seq), WAIT_ENTRIES: entries}
    frames = codec.encode("event", notice)
    for _rank, addr in w.targets:
        if addr not in host.dead:
            host.send_to(addr, frames)


def call_guard(uid: str, name: str, ranks: list[int], req: Any,
               peers: dict[int, str], codec: Any = None) -> Callable[[], Any]:
    """The guard of the future of a call to actor mesh ``name`` (``uid``) made
    on a worker (see :class:`~monarch_kernel.actor.future.Future`); ``codec``: as
    for :func:`watcher`.

    On an actor's thread (the actor cannot handle other messages while it
    waits): a wait for a call to that actor itself raises at once; any other
    wait is watched for wait cycles (:mod:`monarch_kernel.actor.cycles`).
    """

    def guard() -> Callable[[bool], None] | None:
        inst = current_actor()  # the waiting thread's actor
        if inst is None:
            return None
        if inst.uid == uid and inst.point.rank in ranks:
            raise WaitCycleError(
                f"actor {name!r} on rank {inst.point.rank} waits for a call to its own "
                "endpoint, which cannot run until the current one returns (one message at a "
                "time); call the method directly (self.method(...)) or use broadcast()"
            )
        return watcher(inst, req, name, ranks, peers, codec)

    return guard


def any_of_guard(inner: list[Any]) -> Callable[[], Any]:
    """The guard of a ``stream``'s futures: the wait ends when any pending call
    is done, so it raises only when none of them can be (each is a call to the
    waiting actor itself), and it watches each of them."""

    def guard() -> Callable[[bool], None] | None:
        pending = [f for f in inner if not f.done()]
        watches: list[Callable[[bool], None]] = []
        refused: list[RuntimeError] = []
        for f in pending:
            try:
                w = f._guard() if f._guard is not None else None
            except RuntimeError as e:
                refused.append(e)
                continue
            if w is not None:
                watches.append(w)
        if pending and len(refused) == len(pending):
            raise refused[0]
        if not watches:
            return None

        def watch(on: bool) -> None:
            for w in watches:
                w(on)

        return watch

    return guard
