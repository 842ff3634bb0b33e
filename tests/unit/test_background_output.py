"""BackgroundOutput: output nothing waits for, as whole rank-tagged lines."""

from __future__ import annotations

import threading
import time

from monarch_kernel.controller.output import BackgroundOutput


def _collect(partial_s: float = 60.0):
    """A BackgroundOutput writing into a list (unfinished lines wait ``partial_s``)."""
    lines: list[tuple[str, str]] = []
    lock = threading.Lock()

    def write(name: str, text: str) -> None:
        with lock:
            lines.append((name, text))

    out = BackgroundOutput(write)
    out.PARTIAL_S = partial_s
    return out, lines


def test_chunks_of_two_ranks_do_not_interleave_inside_a_line() -> None:
    out, written = _collect()
    # print("hello from", rank) arrives as several chunks, the two ranks' mixed
    out(1, "stdout", "hello from")
    out(0, "stdout", "hello from")
    out(0, "stdout", " 0\n")
    out(1, "stdout", " 1\n")
    assert "".join(t for _, t in written) == "[0] hello from 0\n[1] hello from 1\n"


def test_streams_are_apart_and_several_lines_in_one_chunk() -> None:
    out, written = _collect()
    out(2, "stderr", "warn")
    out(2, "stdout", "a\nb\nc")
    out(2, "stderr", "ing\n")
    out(2, "stdout", "\n")
    assert written == [("stdout", "[2] a\n[2] b\n"), ("stderr", "[2] warning\n"),
                       ("stdout", "[2] c\n")]


def test_an_unfinished_line_is_written_after_a_while_and_continued_untagged() -> None:
    out, written = _collect(0.1)
    out(3, "stdout", "progress: ")
    deadline = time.monotonic() + 5
    while not written and time.monotonic() < deadline:
        time.sleep(0.01)
    assert written == [("stdout", "[3] progress: ")]
    out(3, "stdout", "done\n")
    out(3, "stdout", "next\n")
    assert [t for _, t in written] == ["[3] progress: ", "done\n", "[3] next\n"]
