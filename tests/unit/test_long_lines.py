"""A very long line from a rank costs work linear in its length.

The chunks of an unfinished line are kept apart and joined once, when the
line ends; they are not joined and split again for every chunk that arrives
(which made one 50 MB line take 36 s). The printers count the characters
they scan or copy (``chars_scanned``): the tests bound that count, not a time.
"""

from __future__ import annotations

from monarch_kernel.controller.output import BackgroundOutput, RankPrinter

CHUNK = 65536


def _feed(fn, data: str) -> None:
    for i in range(0, len(data), CHUNK):
        fn(0, "stdout", data[i:i + CHUNK])


def test_rank_printer_scans_a_long_line_a_bounded_number_of_times() -> None:
    written: list[str] = []
    p = RankPrinter(lambda name, text: written.append(text))
    data = "x" * (8 << 20)  # 128 chunks: quadratic work would scan it ~64 times
    _feed(p.feed, data + "\nafter\n")
    p.close()
    assert "".join(written) == f"[0] {data}\n[0] after\n"
    assert p.chars_scanned <= 3 * len(data), p.chars_scanned / len(data)


def test_rank_printer_progress_and_long_lines_together() -> None:
    progress: list[tuple[str, bool]] = []
    written: list[str] = []
    p = RankPrinter(lambda name, text: written.append(text),
                    on_progress=lambda rank, name, text, first: progress.append((text, first)))
    data = "y" * (4 << 20)
    _feed(p.feed, data)
    p.feed(0, "stdout", "\r 50%")
    p.feed(0, "stdout", "\r100%")
    p.feed(0, "stdout", "\n")
    _feed(p.feed, data + "\n")
    p.close()
    assert progress == [(" 50%", True), ("100%", False), ("100%", False)]
    assert "".join(written) == f"[0] {data}\n"
    assert p.chars_scanned <= 3 * (2 * len(data)), p.chars_scanned / len(data)


def test_background_output_scans_a_long_line_a_bounded_number_of_times() -> None:
    written: list[str] = []
    out = BackgroundOutput(lambda name, text: written.append(text))
    out.PARTIAL_S = 600.0  # (the unfinished line is not written early)
    data = "z" * (8 << 20)
    _feed(out, data + "\nend\r\n")
    assert "".join(written) == f"[0] {data}\n[0] end\r\n"
    assert out.chars_scanned <= 3 * len(data), out.chars_scanned / len(data)


def test_background_output_keeps_lines_after_other_line_separators() -> None:
    written: list[str] = []
    out = BackgroundOutput(lambda name, text: written.append(text))
    out.PARTIAL_S = 600.0
    out(0, "stdout", "page\x0cbreak\nnext\n")  # (a form feed ends no line here)
    assert "".join(written) == "[0] page\x0cbreak\n[0] next\n"
