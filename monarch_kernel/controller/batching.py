"""Request batching: many pipelined actor calls to one rank in one message.

A caller that issues calls faster than a rank answers them (``futures =
[a.f.call_one() for _ in range(1000)]``) pays, per call, a message header,
a signature, a socket send on the controller and a receive and a check on
the worker. While enough requests are already unanswered, a small call
can instead wait in a per-rank :class:`Batches` buffer and leave with the
next ones as one ``calls`` message; nothing is lost in latency that the
queue on the rank did not already impose.

When a call may wait (:meth:`Batches.hold`): it is a plain call (no
shared-memory buffers, a small payload) to a single rank, and at least
:data:`MIN_PENDING` requests are unanswered. A held batch leaves
(:meth:`Batches.take`) before anything else is sent to that rank (order is
kept), when it reaches :data:`MAX_CALLS` calls, when any thread starts to
wait for a reply, and at the latest :data:`HOLD_S` after its first call
(the controller's I/O thread). Nagle's algorithm for TCP (RFC 896) holds
small segments while earlier ones are unacknowledged in the same spirit.

The worker hands each call of a ``calls`` message to its actor in order,
exactly as if they had come one by one.

``MONARCH_BATCHING=0`` (:func:`~monarch_kernel.util.switches.batching_enabled`)
turns batching off, here and for the workers' replies: every call and reply
is then a message of its own.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Protocol

from monarch_kernel.controller.request import RankInfo, Request
from monarch_kernel.errors import MeshFailure, TransportError
from monarch_kernel.util.flag import Flag
from monarch_kernel.util.sigint import DeferredSigint
from monarch_kernel.wire.messages import KEEP, ONEWAY, PAYLOAD

__all__ = ["HOLD_S", "MAX_CALLS", "MIN_PENDING", "BatchHost", "Batcher", "Batches", "may_hold"]

#: unanswered requests (all ranks) before calls start to wait for a batch
MIN_PENDING = 8
#: calls in one batch, at most
MAX_CALLS = 64
#: seconds a held call waits, at most
HOLD_S = 0.001
#: a call's pickled arguments of at most this many bytes may be held
MAX_PAYLOAD = 16 * 1024


class Batches:
    """Per-rank buffers of held calls (thread-safe).

    Attributes
    ----------
    lock : threading.RLock
    calls_batched : int
        Calls sent in ``calls`` messages so far.

    The caller of :meth:`take` sends what it took; :attr:`lock` is held by
    callers around "take and send" so that two senders never reorder a rank's
    messages.
    """

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self._held: dict[int, list[tuple[str, Any]]] = {}
        self._since: dict[int, float] = {}
        self.calls_batched = 0  # calls sent in ``calls`` messages so far

    def __bool__(self) -> bool:
        return bool(self._held)

    def holds(self, rank: int) -> bool:
        """True if calls for ``rank`` are held (a cheap check, no lock)."""
        return rank in self._held

    def hold(self, rank: int, mid: str, content: Any) -> int:
        """Keep call ``mid`` for ``rank``; returns how many calls are held for it now
        (1: a new batch, whose HOLD_S starts; MAX_CALLS: full, take it now). Call
        with :attr:`lock` held."""
        held = self._held.get(rank)
        if held is None:
            held = self._held[rank] = []
            self._since[rank] = time.monotonic()
        held.append((mid, content))
        return len(held)

    def take(self, rank: int) -> list[tuple[str, Any]]:
        """The calls held for ``rank`` (and forget them). Call with :attr:`lock` held."""
        self._since.pop(rank, None)
        return self._held.pop(rank, [])

    def held_ranks(self, now: float | None = None) -> list[int]:
        """The ranks calls are held for (with ``now``: held for :data:`HOLD_S` or
        longer). Call with :attr:`lock` held."""
        if now is None:
            return list(self._held)
        return [r for r, t in self._since.items() if now - t >= HOLD_S]


def may_hold(type: str, ranks: list[int], content: Any, pending: int,
             enabled: bool = True) -> bool:
    """Whether a request may wait in a batch (see the module docstring;
    ``enabled``: the controller's ``MONARCH_BATCHING``)."""
    if not enabled or type != "call" or len(ranks) != 1 or pending < MIN_PENDING:
        return False
    if not isinstance(content, dict) or ONEWAY in content or KEEP in content:
        return False
    p = content.get(PAYLOAD)
    return p is not None and not p.buffers and len(p.payload) <= MAX_PAYLOAD


class BatchHost(Protocol):
    """What a :class:`Batcher` uses of its controller."""

    ranks: dict[int, RankInfo]
    pending: dict[str, Request]
    codec: Any
    lock: threading.RLock

    def register(self, req: Request) -> None:
        """Record ``req`` as pending (raises MeshFailure for a dead rank)."""
        ...

    def send_to(self, ranks: list[int], frames: list[Any]) -> None:
        """Send ``frames`` to ``ranks`` now (raises TransportError)."""
        ...

    def wait_for(self, event: Flag | threading.Event, timeout: float | None = None) -> bool:
        """Wait for ``event`` doing the controller's I/O."""
        ...

    def nudge_io(self) -> None:
        """Have the controller's I/O thread take a turn soon (any thread)."""
        ...


class Batcher:
    """The controller's side of batching: holds calls in :attr:`batches` and
    sends them (see the module docstring).

    Parameters
    ----------
    host : BatchHost
        The controller.
    batches : Batches
        The per-rank buffers (the controller's ``batches``).
    """

    def __init__(self, host: BatchHost, batches: Batches) -> None:
        self.host = host
        self.batches = batches

    def held_request(self, mid: str, rank: int, content: Any) -> Request:
        """A call that waits in a batch for ``rank`` (see the module docstring)."""
        host = self.host
        req = Request(mid, [rank])
        req.waiter = host.wait_for
        b = self.batches
        # Ctrl-C waits until the call is both registered and held: a request registered
        # but never sent would wait forever, keep the rank busy and take its output
        with DeferredSigint():
            host.register(req)
            with b.lock:
                n = b.hold(rank, mid, content)
                if n >= MAX_CALLS:  # full: it leaves now
                    self.send_batch(rank, b.take(rank))
            if n == 1:  # a new batch: the I/O thread sends it within HOLD_S at the latest
                host.nudge_io()
        return req

    def send_batch(self, rank: int, calls: list[tuple[str, Any]]) -> None:
        """Send held calls as one ``calls`` message (``batches.lock`` held); their
        requests fail if the rank cannot be reached."""
        host = self.host
        info = host.ranks.get(rank)
        if info is None or info.state in ("dead", "stopped"):
            return  # (a dead rank's requests failed already)
        with host.lock:  # only calls still waited for (not failed by a death meanwhile)
            calls = [(m, c) for m, c in calls
                     if (q := host.pending.get(m)) is not None and q.failure is None]
        if not calls:
            return
        try:
            if len(calls) == 1:
                mid, content = calls[0]
                frames = host.codec.encode("call", content, id=mid, to=(rank,))
            else:
                frames = host.codec.encode("calls", calls, to=(rank,))
            host.send_to([rank], frames)
            if len(calls) > 1:
                self.batches.calls_batched += len(calls)
        except TransportError as e:
            failure = MeshFailure(f"cannot reach the mesh: {e}", rank=rank)
            for mid, _ in calls:
                with host.lock:
                    req = host.pending.pop(mid, None)
                if req is not None:
                    req._fail(failure)

    def flush(self, stale_only: bool = False) -> None:
        """Send the held calls now (``stale_only``: those held for HOLD_S)."""
        b = self.batches
        if not b:
            return
        with DeferredSigint(), b.lock:
            # each rank's calls are taken just before they leave: what a done-callback
            # of a failed batch sends to a rank finds the calls held for it before
            for rank in b.held_ranks(time.monotonic() if stale_only else None):
                if b.holds(rank):
                    self.send_batch(rank, b.take(rank))
