"""Counted, summarised reports of refused messages.

A flood of bad messages must neither cost a log line each (a line costs far
more than refusing the message, and the controller's lines reach the
notebook) nor go unseen. :class:`DropLog` reports the first few drops of an
interval one by one, as they happen, with their detail, and the rest as one
summary line at the end of the interval, counted by reason and by peer::

    the controller dropped 19,874 more messages from 1 peer in the last 5 s:
    19,874 bad signature

Guarantees: at most ``first`` + 1 lines per ``interval_s`` seconds, and one
per interval while a flood goes on (the
summary is written by the first :meth:`DropLog.drop` or :meth:`DropLog.tick`
after the interval ended; an owner calls ``tick`` periodically so that the
last summary of a flood is not held back); every dropped message is counted
in :attr:`DropLog.total`. Thread-safe.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable

__all__ = ["INTERVAL_S", "DropLog"]

#: seconds over which drops beyond the first few are summed up in one line
INTERVAL_S = 5.0
#: drops of an interval reported one by one, before the rest are summed up
FIRST = 3
#: peers counted apart per interval at most (the others are counted as one)
MAX_PEERS = 1024


class DropLog:
    """Counts refused messages and reports them in few lines (see the module
    docstring).

    Parameters
    ----------
    logger : logging.Logger
        Where the lines go (at WARNING).
    who : str
        The subject of the lines, e.g. ``"the controller"``, ``"rank 2"``.
    what : str
        What is dropped, e.g. ``"message"``, ``"peer message"``.
    interval_s : float
        Seconds of one interval (default :data:`INTERVAL_S`); 0: every drop
        is reported on its own line.
    first : int
        Drops of an interval reported one by one (default :data:`FIRST`).
    clock : callable() -> float
        Monotonic seconds (tests pass their own).
    """

    def __init__(self, logger: logging.Logger, who: str, what: str = "message",
                 interval_s: float = INTERVAL_S, first: int = FIRST,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.log = logger
        self.who = who
        self.what = what
        self.interval_s = interval_s
        self.first = first
        self.clock = clock
        #: every message dropped so far, and per reason
        self.total = 0
        self.by_reason: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._start: float | None = None  # when the interval began (None: no drop in it)
        self._told = 0  # drops of this interval reported one by one
        self._ended = -float("inf")  # when the last interval was summed up
        self._reasons: Counter[str] = Counter()  # not yet reported, by reason
        self._peers: set[bytes] = set()  # ... their peers

    def drop(self, reason: str, detail: str, peer: bytes = b"") -> None:
        """Count one dropped message: ``reason`` names why, in a few words
        ("bad signature"); ``detail`` says it in full (reported for the first
        few of an interval); ``peer`` names where it came from (a routing
        identity)."""
        now = self.clock()
        with self._lock:
            self.total += 1
            self.by_reason[reason] += 1
            if self._start is not None and now - self._start >= self.interval_s:
                self._summarise(now)
            if self._start is None:
                self._start = now
                if now - self._ended >= self.interval_s:  # (not a flood that goes on)
                    self._told = 0
            if self._told < self.first or self.interval_s <= 0:
                self._told += 1
                tell = True
            else:
                tell = False
                self._reasons[reason] += 1
                if len(self._peers) < MAX_PEERS:
                    self._peers.add(peer)
        if tell:
            self.log.warning("%s dropped a %s: %s", self.who, self.what, detail)

    def tick(self, now: float | None = None) -> None:
        """Write the summary of an interval that ended (an owner calls this
        every second or so; ``now``: the clock's time)."""
        if self._start is None:
            return
        now = self.clock() if now is None else now
        with self._lock:
            if self._start is not None and now - self._start >= self.interval_s:
                self._summarise(now)

    def _summarise(self, now: float) -> None:
        """Report what the interval held back (lock held) and end the interval."""
        n = sum(self._reasons.values())
        start = now if self._start is None else self._start
        if n:
            peers = len(self._peers)
            reasons = ", ".join(f"{c:,} {r}" for r, c in self._reasons.most_common())
            self.log.warning("%s dropped %s more %s%s from %s peer%s in the last %.0f s: %s",
                             self.who, f"{n:,}", self.what, "" if n == 1 else "s",
                             f"{peers:,}" if peers < MAX_PEERS else f"{peers:,}+",
                             "" if peers == 1 else "s", now - start, reasons)
        self._start = None
        # a flood that goes on is summed up from its first drop of the next interval
        self._told = self.first if n else 0
        self._ended = now
        self._reasons.clear()
        self._peers.clear()
