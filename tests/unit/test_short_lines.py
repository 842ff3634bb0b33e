"""Many short lines from a rank cost about as many writes as one long line.

A ``%%mesh`` cell whose rank prints 5 MB as 100-byte lines used to reach the
notebook as one iopub stream message per 64 lines (775 messages, each a round
trip to ipykernel's IOPub thread). :class:`RankPrinter` now writes whatever
complete lines are ready in one write, bounded by size and by how long the
oldest line has waited. The tests count writes, not time, and check that the
text (tags, each rank's order, folding) is unchanged.
"""

from __future__ import annotations

import re

from monarch_kernel.controller.output import RankPrinter

CHUNK = 4096  # the size of the chunks a rank's prints reach the controller in


def _lines(rank: int, n: int, width: int = 100) -> list[str]:
    return [f"r{rank} line {i} ".ljust(width - 1, "x") for i in range(n)]


def _feed(p: RankPrinter, rank: int, text: str, name: str = "stdout") -> None:
    for i in range(0, len(text), CHUNK):
        p.feed(rank, name, text[i:i + CHUNK])


def test_five_megabytes_of_short_lines_take_few_writes_with_the_same_text() -> None:
    written: list[tuple[str, str]] = []
    p = RankPrinter(lambda name, text: written.append((name, text)))
    p.WRITE_S = 3600.0  # only the size bound and the flushes below write
    lines = _lines(0, 50_000)
    data = "".join(line + "\n" for line in lines)
    _feed(p, 0, data)
    p.close()
    assert "".join(t for _, t in written) == "".join(f"[0] {line}\n" for line in lines)
    assert {n for n, _ in written} == {"stdout"}
    assert len(written) <= len(data) // 65536 + 2, len(written)
    assert p.writes == len(written)


def test_lines_ready_longer_than_write_s_are_written_by_the_next_chunk() -> None:
    written: list[str] = []
    p = RankPrinter(lambda name, text: written.append(text))
    p.WRITE_S = 0.0  # every chunk writes what is ready (after folding)
    for i in range(200):
        p.feed(1, "stdout", f"line {i}\n")
    assert written, "complete lines wait for no flush once WRITE_S has passed"
    p.close()
    assert "".join(written) == "".join(f"[1] line {i}\n" for i in range(200))


def test_ranks_interleaved_keep_their_order_and_fold_as_before() -> None:
    written: list[tuple[str, str]] = []
    p = RankPrinter(lambda name, text: written.append((name, text)))
    per_rank = {r: _lines(r, 3000, width=60) for r in range(4)}
    expected: dict[int, list[str]] = {r: [] for r in range(4)}
    for i in range(3000):
        for r in range(4):
            p.feed(r, "stdout", per_rank[r][i] + "\n")
            expected[r].append(per_rank[r][i])
        if i % 500 == 0:
            for r in range(4):  # the same line from every rank: folded
                p.feed(r, "stdout", f"epoch {i}\n")
                expected[r].append(f"epoch {i}")
    p.close()
    text = "".join(t for _, t in written)
    assert len(written) < 50, len(written)
    seen: dict[int, list[str]] = {r: [] for r in range(4)}
    for line in text.splitlines():
        m = re.fullmatch(r"\[([0-9, -]+)\] (.*)", line)
        assert m, line
        for r in _ranks(m.group(1)):
            seen[r].append(m.group(2))
    assert seen == expected
    assert text.count("[0-3] epoch ") >= 5  # (a group may straddle the fold window's end)


def _ranks(tag: str) -> list[int]:
    out: list[int] = []
    for part in tag.split(", "):
        a, _, b = part.partition("-")
        out.extend(range(int(a), int(b or a) + 1))
    return out


def test_stdout_and_stderr_keep_their_order_between_them() -> None:
    written: list[tuple[str, str]] = []
    p = RankPrinter(lambda name, text: written.append((name, text)))
    p.feed(0, "stdout", "a\nb\n")
    p.feed(0, "stderr", "c\n")
    p.feed(0, "stdout", "d\n")
    p.flush_lines()
    assert written == [("stdout", "[0] a\n[0] b\n"), ("stderr", "[0] c\n"), ("stdout", "[0] d\n")]


def test_lines_for_a_frontend_come_in_few_calls() -> None:
    calls: list[list[tuple[str, list[int], str]]] = []
    p = RankPrinter(lambda name, text: None, on_lines=calls.append)
    p.WRITE_S = 3600.0
    lines = _lines(2, 50_000)
    _feed(p, 2, "".join(line + "\n" for line in lines))
    p.close()
    assert [entry for call in calls for entry in call] == [("stdout", [2], x) for x in lines]
    assert len(calls) <= 50_000 * 100 // 65536 + 2, len(calls)
