"""Rank-tagged output: turning per-rank stream chunks into notebook lines.

Chunks from one rank are joined into whole lines, and each line is written
with its rank's tag (``[2] loss 0.31``). Identical lines that several ranks
print in one burst are folded into one line naming the ranks
(``[0:4] epoch 1``), as the design asks. A line that ends in ``\\r``
(a progress bar redrawing itself) is kept per rank and replaced, not
repeated.
"""

from __future__ import annotations

from collections.abc import Callable

from .errors import _compact

__all__ = ["RankPrinter"]


class RankPrinter:
    """Collects stream chunks per rank and emits tagged lines.

    Parameters
    ----------
    write : callable(name: str, text: str) -> None
        Where tagged text goes (``name`` is ``"stdout"`` or ``"stderr"``).
    fold : bool
        Fold identical lines from several ranks into one.
    """

    def __init__(self, write: Callable[[str, str], None], fold: bool = True) -> None:
        self._write = write
        self._partial: dict[tuple[int, str], str] = {}
        self._fold = fold
        self._held: list[tuple[str, str, list[int]]] = []  # (name, line, ranks)

    def feed(self, rank: int, name: str, text: str) -> None:
        """Add a chunk of ``name`` output from ``rank``."""
        key = (rank, name)
        text = self._partial.pop(key, "") + text
        *lines, rest = text.split("\n")
        if rest:
            self._partial[key] = rest
        for line in lines:
            if "\r" in line:
                line = line.rstrip("\r").rsplit("\r", 1)[-1]
            self._add(rank, name, line)

    def _add(self, rank: int, name: str, line: str) -> None:
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
            if len(self._held) > 64:
                self.flush_lines()
        else:
            self._write(name, f"[{rank}] {line}\n")

    def flush_lines(self) -> None:
        """Write every complete line held for folding."""
        held, self._held = self._held, []
        by_name: dict[str, list[str]] = {}
        for name, line, ranks in held:
            tag = str(ranks[0]) if len(ranks) == 1 else _compact(ranks)
            by_name.setdefault(name, []).append(f"[{tag}] {line}\n")
        for name, lines in by_name.items():
            self._write(name, "".join(lines))

    def close(self) -> None:
        """Write everything, including unfinished lines."""
        for (rank, name), rest in sorted(self._partial.items()):
            self._add(rank, name, rest.rsplit("\r", 1)[-1])
        self._partial.clear()
        self.flush_lines()
