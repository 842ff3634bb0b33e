"""Rank output for frontends that render it: the MIME type of :data:`MIME`.

A ``%%mesh`` cell's rank output is, by default, stream text with a rank tag per
line (``[2] loss 0.31``; :class:`~monarch_kernel.controller.output.RankPrinter`).
A frontend that renders the MIME type :data:`MIME` (the JupyterLab / Notebook 7
extension in ``extensions/monarch-jupyterlab``) says so by opening a comm to the
target :data:`COMM_TARGET`; from then on, in that kernel, a cell's rank output is
sent as ``display_data`` / ``update_display_data`` carrying :data:`MIME` (the lines
with their ranks and streams, progress bars per rank) *and* ``text/plain``: exactly
the text the streams would have carried, which is what every other frontend,
nbconvert and GitHub show of a saved notebook. Without that comm nothing changes.

Live and linear: a cell's lines go to a display that is updated in place while it
holds fewer than :attr:`RankStreamDisplay.MAX_LINES` lines and
:attr:`RankStreamDisplay.MAX_CHARS` characters; then it is left as it is and the
next lines start the next display ("part"). Each update re-sends only its own
part, so the bytes sent are at most a constant times the output's size. A cell's
progress bars (lines redrawn with ``\\r``, as tqdm draws) share one display, one
bar per (rank, stream), ordered by rank, updated at most every
:attr:`RankStreamDisplay.PROGRESS_INTERVAL_S`.

Payload (``version`` 1), one JSON object per display::

    {"version": 1, "cell": "<id shared by a cell's displays>", "part": 0,
     "ranks": [0, 1, 2, 3],                       # the ranks the cell runs on
     "lines": [{"ranks": [0, 1, 2, 3], "stream": "stdout", "text": "epoch 1"}, ...]}
    {"version": 1, "cell": ..., "part": 1, "ranks": [...],
     "progress": [{"rank": 0, "stream": "stderr", "text": " 50%|#####     | 5/10",
                   "done": false}, ...]}
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

from monarch_kernel.controller.output import tagged_line

__all__ = ["COMM_TARGET", "MIME", "RankStreamChannel", "RankStreamDisplay"]

#: the MIME type of rank output
MIME = "application/vnd.monarch.rankstream+json"
#: the comm target a frontend opens to say that it renders :data:`MIME`
COMM_TARGET = "monarch.rankstream"
#: the payload's version (the ``version`` key)
VERSION = 1

#: ``publish(data, metadata, transient, update)``: IPython's ``display_pub.publish``
Publish = Callable[..., None]


class RankStreamChannel:
    """Whether a frontend of this kernel renders :data:`MIME`: the comm target.

    A frontend opens a comm to :data:`COMM_TARGET` with data ``{"mimetypes": [...]}``
    (data without ``mimetypes`` counts as :data:`MIME`). The kernel answers on
    that comm with ``{"mime": MIME, "version": VERSION}``. :attr:`enabled` is true
    while at least one such comm is open.

    Parameters
    ----------
    comm_manager : object or None
        The kernel's comm manager (``register_target``); None: the target is not
        registered and :attr:`enabled` stays false.
    """

    def __init__(self, comm_manager: Any) -> None:
        self._open: set[str] = set()
        if comm_manager is not None:
            comm_manager.register_target(COMM_TARGET, self._on_open)

    @property
    def enabled(self) -> bool:
        """True while a frontend that renders :data:`MIME` has its comm open."""
        return bool(self._open)

    def _on_open(self, comm: Any, msg: dict[str, Any]) -> None:
        data = (msg.get("content") or {}).get("data") or {}
        mimetypes = data.get("mimetypes", [MIME]) if isinstance(data, dict) else []
        if not isinstance(mimetypes, list) or MIME not in mimetypes:
            comm.close({"error": f"this kernel sends rank output as {MIME} only"})
            return
        comm_id = comm.comm_id
        self._open.add(comm_id)

        def closed(_msg: Any) -> None:
            self._open.discard(comm_id)

        comm.on_close(closed)
        comm.send({"mime": MIME, "version": VERSION})

    def display(self, publish: Publish, ranks: list[int]) -> RankStreamDisplay | None:
        """A :class:`RankStreamDisplay` for one cell when :attr:`enabled`, else None."""
        return RankStreamDisplay(publish, ranks) if self.enabled else None


class RankStreamDisplay:
    """One cell's rank output as :data:`MIME` displays (with ``text/plain``).

    Feed it from a :class:`~monarch_kernel.controller.output.RankPrinter`
    (``on_lines=d.lines, on_progress=d.progress``); call :meth:`tick` while the cell
    runs (publishes progress that waited) and :meth:`close` at its end.

    Parameters
    ----------
    publish : callable(data, metadata, transient, update)
        IPython's ``display_pub.publish``.
    ranks : list of int
        The ranks the cell runs on (the renderer's filter offers these).
    clock : callable() -> float
        Seconds, monotonic (tests pass their own).
    """

    #: lines one display holds before the next lines start the next display
    MAX_LINES = 100
    #: characters of text one display holds (one longer line gets a display of its own)
    MAX_CHARS = 16_000
    #: seconds between two updates of the progress display
    PROGRESS_INTERVAL_S = 0.1

    def __init__(self, publish: Publish, ranks: list[int],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._publish = publish
        self._ranks = sorted(ranks)
        self._clock = clock
        self._cell = uuid.uuid4().hex[:12]
        self._parts = 0
        # the open part of lines: its display id (None: no part open), entries, plain text
        self._lines_id: str | None = None
        self._lines_part = 0
        self._lines: list[dict[str, Any]] = []
        self._plain: list[str] = []
        self._chars = 0
        # progress bars: (rank, stream) -> entry; their display
        self._bars: dict[tuple[int, str], dict[str, Any]] = {}
        self._bars_id: str | None = None
        self._bars_part = 0
        self._bars_dirty = False
        self._bars_sent = 0.0
        #: displays published and updated so far (messages sent)
        self.messages = 0

    # ----------------------------------------------------------------- lines
    def lines(self, entries: list[tuple[str, list[int], str]]) -> None:
        """Show complete lines: ``(stream, ranks, line)`` each, in printed order."""
        new = self._lines_id is None
        if new:
            self._lines_id = self._new_id()
            self._lines_part = self._next_part()
        dirty = False  # this part holds lines not sent yet
        for name, ranks, line in entries:
            if self._lines and (len(self._lines) >= self.MAX_LINES
                                or self._chars + len(line) > self.MAX_CHARS):
                if dirty:
                    self._send_lines(update=not new)
                self._lines, self._plain, self._chars = [], [], 0
                self._lines_id = self._new_id()
                self._lines_part = self._next_part()
                new = True
            self._lines.append({"ranks": list(ranks), "stream": name, "text": line})
            self._plain.append(tagged_line(ranks, line))
            self._chars += len(line)
            dirty = True
        if dirty:
            self._send_lines(update=not new)

    def _send_lines(self, update: bool) -> None:
        payload = {"version": VERSION, "cell": self._cell, "part": self._lines_part,
                   "ranks": self._ranks, "lines": list(self._lines)}
        self._send(payload, "".join(self._plain), self._lines_id, update)

    def _end_lines(self) -> None:
        """Lines from now on go to a new display (one below what comes next)."""
        self._lines_id = None
        self._lines, self._plain, self._chars = [], [], 0

    # -------------------------------------------------------------- progress
    def progress(self, rank: int, name: str, text: str, first: bool) -> None:
        """A rank's progress line (``RankPrinter``'s ``on_progress``): its bar's text now;
        ``first`` false and the line finished: the bar's last state."""
        self._bars[(rank, name)] = {"rank": rank, "stream": name, "text": text, "done": False}
        self._bars_dirty = True
        if self._bars_id is None:
            self._end_lines()  # lines after the bars appear below them
            self._bars_id = self._new_id()
            self._bars_part = self._next_part()
            self._send_bars(update=False)
        elif self._clock() - self._bars_sent >= self.PROGRESS_INTERVAL_S:
            self._send_bars(update=True)

    def _send_bars(self, update: bool) -> None:
        bars = [self._bars[k] for k in sorted(self._bars)]
        payload = {"version": VERSION, "cell": self._cell, "part": self._bars_part,
                   "ranks": self._ranks, "progress": bars}
        plain = "".join(f"[{b['rank']}] {b['text']}\n" for b in bars)
        self._send(payload, plain, self._bars_id, update)
        self._bars_dirty = False
        self._bars_sent = self._clock()

    # ----------------------------------------------------------------- common
    def tick(self) -> None:
        """Publish progress that waited for :attr:`PROGRESS_INTERVAL_S` (call it often)."""
        if self._bars_dirty and self._clock() - self._bars_sent >= self.PROGRESS_INTERVAL_S:
            self._send_bars(update=True)

    def seal(self) -> None:
        """Whatever the kernel shows next (a rank's display, a prompt) comes below."""
        if self._bars_dirty:
            self._send_bars(update=True)
        self._end_lines()

    def close(self) -> None:
        """The cell ended: publish what waited; the bars keep their last state."""
        for bar in self._bars.values():
            bar["done"] = True
        if self._bars:
            self._send_bars(update=True)
        self._end_lines()

    def _new_id(self) -> str:
        return f"monarch-rankstream-{self._cell}-{self._parts}"

    def _next_part(self) -> int:
        self._parts += 1
        return self._parts - 1

    def _send(self, payload: dict[str, Any], plain: str, display_id: str | None,
              update: bool) -> None:
        self._publish(data={MIME: payload, "text/plain": plain},
                      metadata={"monarch_rankstream": True},
                      transient={"display_id": display_id}, update=update)
        self.messages += 1
