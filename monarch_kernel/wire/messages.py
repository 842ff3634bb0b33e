"""The content of every message type: one schema each, read and written by both ends.

This module is the one list of message types (:mod:`monarch_kernel.wire.protocol`
carries them and knows only their names, :data:`protocol.TYPES`). A content is
a plain ``dict`` (or list, or None) pickled as it is: the schemas are
:class:`typing.TypedDict` classes, checked by the type checker where a
content is built or read, and cost nothing at run time (no validation
layer, no object per message). A sender annotates what it builds
(``content: Call = {...}``), a receiver what it reads (``c: Call =
msg.content``).

Messages of the hot path use one-letter keys (a key's bytes travel in every
message, and a short dict pickles faster); each key has a named constant
here, which senders and receivers use instead of the letter.

Message types and their content
-------------------------------

======================  ==========================  ====================================
type                    direction                   content
======================  ==========================  ====================================
``hello``               worker -> controller        :class:`Hello`
``reply``               worker -> controller,       :class:`Reply`
                        worker -> worker
``replies``             worker -> controller        :data:`Replies`
``stream``              worker -> controller        :class:`Stream`
``display``             worker -> controller        :class:`Display`
``state``               worker -> controller        :data:`State`
``event``               worker -> controller,       :class:`ActorErrorEvent`,
                        worker -> worker (wait)     :class:`SupervisionEvent`,
                                                    :class:`WaitNotice`
``debug``               worker -> controller        :class:`Debug`
``execute``             controller -> worker        :class:`Execute`
``push``                controller -> worker        :data:`Push`
``pull``                controller -> worker        :class:`Pull`
``setup``               controller -> worker        :class:`Setup`
``interrupt``           controller -> worker        None
``stop``                controller -> worker        None
``spawn_actor``         controller -> worker        :class:`SpawnActor`
``call``                controller -> worker,       :class:`Call`
                        worker -> worker
``calls``               controller -> worker        :data:`Calls`
``stop_actor``          controller -> worker        :class:`StopActor`
``rank_dead``           controller -> worker        :class:`RankDead`
``debug_input``         controller -> worker        :class:`DebugInput`
``ref``                 controller -> worker        :class:`Ref`
``free``                controller -> worker        :class:`Free`
``shm_done``            controller -> worker        :class:`ShmDone`
``keys``                controller -> worker        :class:`Keys`
``buffer``              worker -> worker            :class:`Buffer`
``attach``              controller -> worker        :class:`Attach` (on the rank's attach
                        (attach endpoint)           endpoint; the answer comes back there)
``detach``              controller -> worker        None (the controller leaves; the rank
                                                    of a detachable mesh waits for another)
``heartbeat``           both ways                   None
======================  ==========================  ====================================

The keys of a :class:`Call` (``call``, and each call of a ``calls``)
------------------------------------------------------------------

====  ================  =======================================================
key   constant          value
====  ================  =======================================================
a     :data:`ACTOR`     str: the actor mesh's name (the actor on the rank)
m     :data:`METHOD`    str: the endpoint's name
u     :data:`UID`       str: the actor mesh's unique id (names its failures)
p     :data:`PAYLOAD`   :class:`~monarch_kernel.wire.serialize.Packed`
                        ``(args, kwargs)``
i     :data:`IPC`       1, optional: the caller, a worker on the callee's host,
                        takes CUDA IPC handles in the reply
o     :data:`ONEWAY`    True, optional: nobody waits (``broadcast``); a
                        failure goes back as an ``actor_error`` event
r     :data:`REFS`      True, optional: one-way and carrying handles: the
                        arguments are unpickled on arrival, before a later
                        ``free``
k     :data:`KEEP`      str, optional: ``.rref()``: the rank keeps the result
                        under this id and replies with its description
s     :data:`SOURCES`   dict, optional: source lines of code sent by value
                        (:mod:`monarch_kernel.wire.sources`)
w     :data:`WAITED`    1, optional: made on an actor's thread, which may wait
                        for it: tracked for wait cycles
                        (:mod:`monarch_kernel.actor.cycles`)
====  ================  =======================================================

The keys of a wait notice (an ``event`` of kind ``"wait"``, worker to worker)
----------------------------------------------------------------------------

====  ====================  ====================================================
key   constant              value
====  ====================  ====================================================
a     :data:`WAIT_ACTOR`    str: the actor the waited-for call is queued for
i     :data:`WAIT_CALL`     str: the message id of that call
n     :data:`WAIT_SEQ`      int: sequence number (a newer notice wins)
r     :data:`WAIT_ENTRIES`  list of 6-tuples: what cannot finish before that
                            call does (:data:`monarch_kernel.actor.cycles.Entry`)
====  ====================  ====================================================

A ``buffer`` message (:class:`Buffer`) names its byte count
(:data:`BUF_NBYTES`, ``n``) and route (:data:`BUF_ROUTE`, ``m``) with one
letter too; its other keys are words.
"""

import sys
from typing import Any, Final, Literal, TypedDict

if sys.version_info >= (3, 11):
    from typing import NotRequired
else:  # Python 3.10 (typing_extensions comes with torch)
    from typing_extensions import NotRequired

__all__ = [
    "EXIT_CONTROLLER_GONE", "EXIT_KEEP_ALIVE", "EXIT_LANE_CLOSED", "EXIT_SILENCE",
    "WORKER_EXITS",
    "heartbeat_timeout", "ACTOR", "BUF_NBYTES", "BUF_ROUTE", "IPC", "KEEP", "METHOD", "ONEWAY",
    "PAYLOAD", "REFS",
    "SOURCES", "UID", "WAITED", "WAIT_ACTOR", "WAIT_CALL", "WAIT_ENTRIES", "WAIT_SEQ",
    "ActorErrorEvent", "Attach", "Buffer", "Call", "Calls", "Debug", "DebugInput", "Display",
    "Execute",
    "Failure", "Free", "Hello", "Keys", "Pull", "Push", "RankDead", "Ref", "Replies", "Reply",
    "Setup", "ShmDone", "SpawnActor", "SpawnReply", "State", "StopActor", "Stream",
    "SupervisionEvent", "WaitNotice",
]

# ------------------------------------------------- how a worker left by itself
#: exit code of a worker that heard nothing from its controller for its heartbeat
#: timeout (:func:`heartbeat_timeout`)
EXIT_SILENCE: Final = 85
#: exit code of a worker whose controller's process is gone (same host)
EXIT_CONTROLLER_GONE: Final = 86
#: exit code of a worker whose controller closed its lane (same host)
EXIT_LANE_CLOSED: Final = 87
#: exit code of a worker of a detached mesh that no controller attached to within
#: its keep-alive time
EXIT_KEEP_ALIVE: Final = 88
#: why a worker that exited with one of these codes left ("{timeout}": seconds)
WORKER_EXITS: Final = {
    EXIT_KEEP_ALIVE: "no controller attached to the detached mesh within its keep-alive",
    EXIT_SILENCE: "no word from the controller for {timeout:.1f} s",
    EXIT_CONTROLLER_GONE: "its controller's process is gone",
    EXIT_LANE_CLOSED: "the controller closed its connection",
}


def heartbeat_timeout(heartbeat: float) -> float:
    """Seconds without a word from the controller after which a worker whose
    heartbeat is ``heartbeat`` seconds leaves (``--heartbeat-timeout``)."""
    return max(6.0, 6 * heartbeat)


# ----------------------------------------------------------------- call keys
ACTOR: Final = "a"
METHOD: Final = "m"
UID: Final = "u"
PAYLOAD: Final = "p"
IPC: Final = "i"
ONEWAY: Final = "o"
REFS: Final = "r"
KEEP: Final = "k"
SOURCES: Final = "s"
WAITED: Final = "w"

# ---------------------------------------------------------- wait-notice keys
WAIT_ACTOR: Final = "a"
WAIT_CALL: Final = "i"
WAIT_SEQ: Final = "n"
WAIT_ENTRIES: Final = "r"

# --------------------------------------------------------------- buffer keys
BUF_NBYTES: Final = "n"
BUF_ROUTE: Final = "m"


# ====================================================== worker -> controller
class Hello(TypedDict):
    """``hello``: a worker connected (its first message)."""

    rank: int
    pid: int
    host: str  # the worker's host name
    down: bool  # it reads its controller through a relay or a lane (not the DEALER)


class Attach(TypedDict):
    """``attach``: a controller takes a rank of a detachable mesh over (sent to the
    rank's attach endpoint, signed with the mesh key; see
    :mod:`monarch_kernel.worker.detach`). The rank answers with an ``attach``
    message too: ``{"ok": True, "pid": int}``, ``{"ok": False, "busy": True,
    "holder": {"pid", "host"}}`` or ``{"ok": False, "error": str}``."""

    up: str  # the controller's endpoint for worker -> controller traffic
    down: str  # ... and for controller -> worker traffic
    curve_server_key: bytes | None  # its CurveZMQ public key (TCP), or None
    ctl_epoch: int  # the controller's epoch: only its messages are accepted from now on
    floor: int  # ... above this sequence number
    rank_epoch: int  # the epoch the rank signs with from now on
    steal: bool  # take the rank over even from a live controller (which is told)
    pid: int  # the controller's pid
    host: str  # ... and host
    t: float  # epoch seconds; an attach no newer than the last one accepted is refused
    holder_gone: dict[str, Any] | None  # {pid, host}: a holder the controller saw is gone
    stop: bool  # it takes the rank over only to stop the mesh (the old holder is told so)


class Failure(TypedDict):
    """The value of an error :class:`Reply`: a picklable description of an
    exception (``Worker.describe_failure``; :class:`monarch_kernel.errors.RemoteFailure`)."""

    type: str  # qualified name of the exception type
    message: str
    traceback: str
    exc: Any  # Packed exception, or None (see tree)
    #: the exception's description (monarch_kernel.wire.exctree.ExcNode): rebuilt on
    #: arrival with its cause, context and group members (errors.remote_exception)
    tree: NotRequired[Any]
    rejected: NotRequired[bool]  # the call never ran (no such actor)
    code: NotRequired[str]  # "noipc": a buffer owner refused CUDA IPC


class Reply(TypedDict):
    """``reply``: the answer to the request named by the message's parent id."""

    status: Literal["ok", "error"]
    value: Any  # the result (a Packed for calls), or a Failure when status is "error"


#: ``replies``: ok answers to several calls at once, ``[(parent id, value), ...]``
Replies = list[tuple[str, Any]]


class Stream(TypedDict):
    """``stream``: text a rank wrote (credited to the message's parent request)."""

    name: Literal["stdout", "stderr"]
    text: str


class Display(TypedDict):
    """``display``: rich output of a rank (Jupyter's display_data fields)."""

    data: dict[str, Any]
    metadata: dict[str, Any]
    transient: dict[str, Any]


#: ``state``: a telemetry record (:mod:`monarch_kernel.worker.telemetry`):
#: activity, cpu, rss, uss, gpu, ...
State = dict[str, Any]


class ActorErrorEvent(TypedDict):
    """``event`` of kind ``actor_error``: a one-way call (``broadcast``) failed."""

    kind: Literal["actor_error"]
    actor: str
    method: str
    uid: str | None
    rank: int
    failure: Failure


class SupervisionEvent(TypedDict):
    """``event`` of kind ``supervision``: an actor did not handle the failure of a
    mesh it spawned (``__supervise__``)."""

    kind: Literal["supervision"]
    actor: str
    rank: int
    failure: str


class WaitNotice(TypedDict):
    """``event`` of kind ``wait``, worker to worker: an actor's thread waits for a
    call (keys: see the module docstring)."""

    kind: Literal["wait"]
    a: str
    i: str
    n: int
    r: Any  # tuple of 6-tuples


class Debug(TypedDict):
    """``debug``: a remote pdb session changed (:mod:`monarch_kernel.debug.server`)."""

    kind: str  # paused | running | ended | note
    session: str
    text: str
    thread: str
    parent: str | None
    reason: NotRequired[str]


# ====================================================== controller -> worker
class Execute(TypedDict):
    """``execute``: run a cell."""

    code: str
    filename: NotRequired[str]
    sources: NotRequired[dict[str, Any]]  # source lines of code sent by value


#: ``push``: names to bind in the rank's namespace, ``{name: value}``
Push = dict[str, Any]


class Pull(TypedDict):
    """``pull``: the values of these names (the reply's value)."""

    names: list[str]


class Setup(TypedDict):
    """``setup``: torch.distributed set-up (:mod:`monarch_kernel.mesh.dist_setup`)."""

    dist: str  # the backend
    env: dict[str, str]
    timeout: float  # seconds


class SpawnActor(TypedDict):
    """``spawn_actor``: construct one actor of a mesh on the rank."""

    name: str
    uid: str
    dims: Any  # the mesh's dimensions (Shape.dims)
    ranks: list[int]
    init: Any  # Packed (cls, args, kwargs)
    sources: Any  # source lines of code sent by value, or None


class SpawnReply(TypedDict):
    """The value of the reply to ``spawn_actor``."""

    peer: str  # the worker's peer address
    failure: NotRequired[Failure]  # the constructor raised


class Call(TypedDict):
    """``call``: an endpoint call (keys: see the module docstring)."""

    a: str
    m: str
    u: str
    p: Any  # Packed (args, kwargs)
    i: NotRequired[int]
    o: NotRequired[bool]
    r: NotRequired[bool]
    k: NotRequired[str]
    s: NotRequired[Any]
    w: NotRequired[int]


#: ``calls``: several calls to one rank at once, in order,
#: ``[(message id, Call), ...]`` (:mod:`monarch_kernel.controller.batching`)
Calls = list[tuple[str, Call]]


class StopActor(TypedDict):
    """``stop_actor``: stop the actor after the messages queued for it."""

    name: str


class RankDead(TypedDict):
    """``rank_dead``, one-way: a rank of this mesh (no ``mesh``) or of another mesh of
    the program (``mesh``: its key's fingerprint) died; calls waiting on it fail."""

    rank: int
    addr: str | None  # its peer address (None: no actor ever ran there)
    reason: str
    mesh: NotRequired[str | None]


class DebugInput(TypedDict):
    """``debug_input``: a pdb command line (``line`` None: release the session); with
    ``quit`` ``{"request": id, "ranks": [...]}`` (and ``session`` ""), no line: those
    ranks of the request quit their debugger (a collective waiting for them is aborted)."""

    session: str
    line: str | None
    quit: NotRequired[dict[str, Any]]


class Ref(TypedDict):
    """``ref``: an operation on values kept on the ranks for handles
    (:mod:`monarch_kernel.tensors.store` lists the operations and their keys)."""

    op: str  # keep | meta | get | full | reduce | dtensor | map
    id: NotRequired[str]
    label: NotRequired[str]
    name: NotRequired[str]
    preview: NotRequired[int]
    send: NotRequired[int]
    new: NotRequired[str]
    dims: NotRequired[Any]
    reduce_op: NotRequired[str]
    placements: NotRequired[Any]
    local: NotRequired[bool]
    fn: NotRequired[Any]
    args: NotRequired[tuple]
    kwargs: NotRequired[dict[str, Any]]


class Free(TypedDict):
    """``free``, one-way: drop these kept values."""

    ids: list[str]


class ShmDone(TypedDict):
    """``shm_done``, one-way: the controller copied these pooled shared-memory files."""

    names: list[str]


class Keys(TypedDict, total=False):
    """``keys``: other meshes' keys (:mod:`monarch_kernel.actor.mesh_keys`)."""

    add: dict[str, bytes]  # fingerprint -> key
    drop: list[str]  # fingerprints


# ========================================================== worker -> worker
class Buffer(TypedDict):
    """``buffer``: an RDMABuffer operation (:mod:`monarch_kernel.tensors.buffer_ops`)."""

    op: str  # read | write | drop
    id: str
    n: int  # bytes
    m: str  # route: ipc | shm | band
    shm: NotRequired[str]  # the reader's pooled file (route shm)
    data: NotRequired[Any]  # the bytes, an array (route band, write)
