"""Rank-tagged output: turning per-rank stream chunks into notebook lines.

Chunks from one rank are joined into whole lines, and each line is written
with its rank's tag (``[2] loss 0.31``). Identical lines that several ranks
print in one burst are folded into one line naming the ranks as people
write them (``[0-3] epoch 1``, ``[0, 2] done``: see
:func:`~monarch_kernel.errors.compact_ranks`), as the design asks. A line
that ends in ``\\r`` (a progress bar redrawing itself) is kept per rank and
replaced, not repeated.
"""

from __future__ import annotations

import re
import sys
import threading
import time
from collections.abc import Callable

from monarch_kernel.errors import compact_ranks

__all__ = ["BackgroundOutput", "RankPrinter", "tagged_line", "write_stream"]

#: a line with its end: ``\n``, ``\r\n`` or a lone ``\r`` (a progress bar's redraw)
_LINE = re.compile(r"[^\r\n]*(?:\r\n?|\n)")


def tagged_line(ranks: list[int], line: str) -> str:
    """One output line as the notebook shows it: ``[2] loss 0.31\n``, ``[0-3] epoch 1\n``."""
    tag = str(ranks[0]) if len(ranks) == 1 else compact_ranks(ranks)
    return f"[{tag}] {line}\n"


def write_stream(name: str, text: str) -> None:
    """Write ``text`` to this process's ``sys.stdout`` or ``sys.stderr`` (``name``)
    and flush (in a kernel: one stream message)."""
    stream = sys.stdout if name == "stdout" else sys.stderr
    stream.write(text)
    stream.flush()


class BackgroundOutput:
    """Where output that belongs to no request goes: what a ``broadcast``
    endpoint or a rank's background thread prints while nothing waits for
    that rank. Written as whole lines (any thread), each tagged with its rank.

    In a kernel it lands where ipykernel puts any thread's output: from
    ipykernel 7 on, the cell that runs, else the latest one; with ipykernel 6,
    the cell that started the thread, here the one that ran ``%mesh spawn``
    (the ``Controller``'s ``on_output``; set by ``%mesh spawn``).

    A rank's chunks are joined into lines first: ``print("a", x)`` reaches
    the controller as several chunks, and two ranks printing at once must
    not interleave inside a line. A line still unfinished after
    :data:`PARTIAL_S` is written as it is (a prompt, a progress dot); its
    continuation then goes on without a second tag.

    Parameters
    ----------
    write : callable(name: str, text: str) -> None
        Default :func:`write_stream`.
    """

    #: seconds an unfinished line waits for the rest of it
    PARTIAL_S = 0.1

    def __init__(self, write: Callable[[str, str], None] = write_stream) -> None:
        self._write = write
        self._lock = threading.Lock()
        # (rank, stream) -> the chunks of its unfinished line, joined once it ends
        self._partial: dict[tuple[int, str], list[str]] = {}
        #: characters scanned or copied so far: at most twice those received (each
        #: chunk is searched for a line end once, and copied once when its line ends)
        self.chars_scanned = 0
        self._midline: set[tuple[int, str]] = set()  # its beginning was written already
        self._timer: threading.Timer | None = None

    def __call__(self, rank: int, name: str, text: str) -> None:
        key = (rank, name)
        with self._lock:
            self.chars_scanned += len(text)
            end = max(text.rfind("\n"), text.rfind("\r"))
            if end < 0:  # no line ends here: the unfinished line grows (no copy made)
                if text:
                    self._partial.setdefault(key, []).append(text)
            else:
                parts = self._partial.pop(key, [])
                parts.append(text[:end + 1])
                head = "".join(parts)
                self.chars_scanned += len(head)
                out = []
                for piece in _LINE.findall(head):
                    out.append(piece if key in self._midline else f"[{rank}] {piece}")
                    self._midline.discard(key)
                if end + 1 < len(text):  # the unfinished end: wait for the rest
                    self._partial[key] = [text[end + 1:]]
                self._write(name, "".join(out))
            if self._partial and self._timer is None:
                self._timer = threading.Timer(self.PARTIAL_S, self._flush_partial)
                self._timer.daemon = True
                self._timer.start()

    def _flush_partial(self) -> None:
        """Write the lines still unfinished (the timer's thread)."""
        with self._lock:
            self._timer = None
            partial, self._partial = self._partial, {}
            for (rank, name), parts in partial.items():
                piece = "".join(parts)
                self._write(name, piece if (rank, name) in self._midline else f"[{rank}] {piece}")
                self._midline.add((rank, name))


class RankPrinter:
    """Collects stream chunks per rank and emits tagged lines.

    Complete lines are written in batches, not one write per line: everything
    ready is written by :meth:`flush_lines` (its callers call it when no output
    is waiting and before anything else is shown), by :meth:`feed` once the
    oldest unwritten line has waited :attr:`WRITE_S` seconds, and whenever
    :attr:`WRITE_CHARS` characters are ready. So a rank printing many short
    lines costs about as many writes (in a kernel: iopub stream messages) as
    one long line of the same bytes, and a line is written at the next
    :meth:`flush_lines` or the first chunk fed :attr:`WRITE_S` after it,
    whichever comes first. Each rank's lines keep their order; stdout and
    stderr keep their order relative to each other too. A run of lines from
    one rank that nothing can fold with is kept as one list and tagged with
    one ``str.join``: no work per line beyond ``str.split`` and ``str.join``.

    Parameters
    ----------
    write : callable(name: str, text: str) -> None
        Where tagged text goes (``name`` is ``"stdout"`` or ``"stderr"``).
    fold : bool
        Fold identical lines from several ranks into one.
    on_progress : callable(rank, name, text, first) or None
        Receives a rank's progress line (text after the last ``\r`` of an
        unfinished line, and the finished line that ends it) so a frontend
        can show one line per rank updated in place. Without it, progress
        lines are printed once finished.
    on_lines : callable(entries) or None
        Receives the complete lines instead of ``write``, as a list of
        ``(name, ranks, line)`` in the order they were printed (``ranks``: the
        ranks that printed that line, folded; ``line`` without its ``\n``), so
        a frontend can tell ranks apart. :func:`tagged_line` gives the text
        ``write`` would have received.
    """

    def __init__(self, write: Callable[[str, str], None], fold: bool = True,
                 on_progress: Callable[[int, str, str, bool], None] | None = None,
                 on_lines: Callable[[list[tuple[str, list[int], str]]], None] | None = None,
                 ) -> None:
        self._write = write
        self._on_progress = on_progress
        self._on_lines = on_lines
        self._progress: dict[tuple[int, str], str] = {}
        # (rank, stream) -> the chunks of its unfinished line, joined once it ends
        self._partial: dict[tuple[int, str], list[str]] = {}
        #: characters scanned or copied so far (see :meth:`feed`)
        self.chars_scanned = 0
        self._fold = fold
        self._held: list[tuple[str, str, list[int]]] = []  # (name, line, ranks)
        # (rank, name, lines): complete lines of one rank after every held line, none of
        # which can fold (nothing of another rank comes after them); kept as one list so
        # a rank printing many lines costs no work per line here
        self._run: tuple[int, str, list[str]] | None = None
        self._run_chars = 0
        # lines past folding, not written yet: [name, [tagged lines]] runs in order
        self._out: list[tuple[str, list[str]]] = []
        self._out_entries: list[tuple[str, list[int], str]] = []  # the same for on_lines
        self._out_chars = 0
        self._since = 0.0  # time.monotonic() when the oldest unwritten complete line came
        #: writes made so far (each a ``write`` call or an ``on_lines`` call)
        self.writes = 0

    #: seconds the oldest complete line waits before :meth:`feed` writes it (with
    #: every complete line after it)
    WRITE_S = 0.1
    #: characters of complete lines that are written at once, without waiting
    WRITE_CHARS = 1 << 20
    #: complete lines held for folding before they are moved on to be written
    FOLD_LINES = 64
    #: characters of one rank's run of lines kept before all but its last
    #: :attr:`FOLD_LINES` lines are moved on to be written
    RUN_CHARS = 1 << 16

    def feed(self, rank: int, name: str, text: str) -> None:
        """Add a chunk of ``name`` output from ``rank``.

        Linear in the output: each chunk is searched for line ends once and
        copied once more when its line ends (see :attr:`chars_scanned`), however
        long the line (a 50 MB line arrives as hundreds of chunks).
        """
        key = (rank, name)
        self.chars_scanned += len(text)
        end = text.rfind("\n")
        lines: list[str] = []
        if end >= 0:
            parts = self._partial.pop(key, [])
            parts.append(text[:end])
            head = "".join(parts)
            self.chars_scanned += len(head)
            lines = head.split("\n")
            rest = text[end + 1:]
        else:
            rest = text
        if lines and not (self._held or self._run is not None or self._out_chars):
            self._since = time.monotonic()
        if lines and "\r" not in head and (self._on_progress is None
                                           or key not in self._progress):
            self._add_lines(rank, name, lines, len(head) + 1)
            lines = []
        for line in lines:
            if "\r" in line:
                line = line.rstrip("\r").rsplit("\r", 1)[-1]
            if key in self._progress and self._on_progress is not None:
                # the progress bar finished: its last state stays where it was drawn
                del self._progress[key]
                self._on_progress(rank, name, line, False)
                continue
            self._add(rank, name, line)
        if ((self._held or self._run is not None or self._out_chars)
                and time.monotonic() - self._since >= self.WRITE_S):
            self.flush_lines()
        if not rest:
            return
        if "\r" in rest and self._on_progress is not None:
            # (an unfinished line kept with a progress reporter holds no "\r")
            redrawn = rest.rstrip("\r")
            if "\r" in redrawn:
                current = redrawn.rsplit("\r", 1)[-1]
            else:
                current = "".join([*self._partial.get(key, []), redrawn])
                self.chars_scanned += len(current)
            self._partial[key] = [current]
            if current and self._progress.get(key) != current:
                first = key not in self._progress
                self._progress[key] = current
                self.flush_lines()
                self._on_progress(rank, name, current, first)
        else:
            self._partial.setdefault(key, []).append(rest)

    def _add_lines(self, rank: int, name: str, lines: list[str], chars: int) -> None:
        """Add complete lines without ``\\r`` (``chars``: their length with their ends)."""
        if not self._fold:
            self._ready_block(name, rank, lines)
        else:
            run = self._run
            if run is not None and run[0] == rank and run[1] == name:
                run[2].extend(lines)
                self._run_chars += chars
            elif run is None and all(ranks == [rank] for _, _, ranks in self._held):
                # nothing held comes after a line of another rank: nothing to fold with
                self._run = (rank, name, list(lines))
                self._run_chars = chars
            else:
                for line in lines:
                    self._add(rank, name, line)
                return
            if self._run_chars < self.RUN_CHARS:
                return
            self._settle_run(self.FOLD_LINES)
        if self._out_chars >= self.WRITE_CHARS:
            self._write_out()

    def _settle_run(self, keep: int) -> None:
        """Hold the run's last ``keep`` lines for folding; queue the lines before them."""
        assert self._run is not None
        rank, name, lines = self._run
        self._run = None
        self._run_chars = 0
        if len(lines) > keep:
            self._spill()  # (the held lines come before the run)
            self._ready_block(name, rank, lines[:len(lines) - keep])
            lines = lines[len(lines) - keep:]
        self._held.extend((name, line, [rank]) for line in lines)
        if len(self._held) > self.FOLD_LINES:
            self._spill()

    def _ready_block(self, name: str, rank: int, lines: list[str]) -> None:
        """Queue complete lines of one rank to be written (after those queued before)."""
        if not lines:
            return
        if self._on_lines is not None:
            self._out_entries.extend((name, [rank], line) for line in lines)
            self._out_chars += len(lines) + sum(map(len, lines))
            return
        prefix = f"[{rank}] "
        text = prefix + ("\n" + prefix).join(lines) + "\n"  # tagged_line's text, per line
        if self._out and self._out[-1][0] == name:
            self._out[-1][1].append(text)
        else:
            self._out.append((name, [text]))
        self._out_chars += len(text)

    def _add(self, rank: int, name: str, line: str) -> None:
        if self._run is not None:
            self._settle_run(self.FOLD_LINES)
        if self._fold:
            # a line may join a held line only after this rank's last held line,
            # so every rank's own order is kept
            start = 0
            for i in range(len(self._held) - 1, -1, -1):
                if rank in self._held[i][2]:
                    start = i + 1
                    break
            for held_name, held_line, ranks in self._held[start:]:
                if held_name == name and held_line == line:
                    ranks.append(rank)
                    return
            self._held.append((name, line, [rank]))
            if len(self._held) > self.FOLD_LINES:
                self._spill()
        else:
            self._ready(name, [rank], line)
            if self._out_chars >= self.WRITE_CHARS:
                self._write_out()

    def _ready(self, name: str, ranks: list[int], line: str) -> None:
        """Queue one complete line to be written (after the lines queued before it)."""
        if self._on_lines is not None:
            self._out_entries.append((name, ranks, line))
            self._out_chars += len(line) + 1
            return
        text = tagged_line(ranks, line)
        if self._out and self._out[-1][0] == name:
            self._out[-1][1].append(text)
        else:
            self._out.append((name, [text]))
        self._out_chars += len(text)

    def _spill(self) -> None:
        """Move the lines held for folding on to be written; write if enough are ready."""
        held, self._held = self._held, []
        for name, line, ranks in held:
            self._ready(name, ranks, line)
        if self._out_chars >= self.WRITE_CHARS:
            self._write_out()

    def _write_out(self) -> None:
        """Write the queued lines: one ``write`` per run of one stream, or one ``on_lines``."""
        out, self._out = self._out, []
        entries, self._out_entries = self._out_entries, []
        self._out_chars = 0
        if entries:
            self.writes += 1
            assert self._on_lines is not None
            self._on_lines(entries)
        for name, texts in out:
            self.writes += 1
            self._write(name, "".join(texts))

    def flush_lines(self) -> None:
        """Write every complete line: those held for folding and those queued."""
        if self._run is not None:
            self._settle_run(0)
        if self._held:
            self._spill()
        if self._out_chars:
            self._write_out()

    def close(self) -> None:
        """Write everything, including unfinished lines."""
        for (rank, name), parts in sorted(self._partial.items()):
            if (rank, name) in self._progress:
                continue  # already shown in place
            rest = "".join(parts)
            if not rest:
                continue
            self._add(rank, name, rest.rsplit("\r", 1)[-1])
        self._partial.clear()
        self._progress.clear()
        self.flush_lines()
