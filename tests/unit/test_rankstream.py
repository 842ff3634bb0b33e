"""Rank output as the MIME bundle application/vnd.monarch.rankstream+json (kernel/rankstream.py)
and RankPrinter's structured lines (controller/output.py): the text/plain fallback is exactly
the stream text of today, displays are bounded parts, progress bars are ordered by rank."""

from __future__ import annotations

from typing import Any

from monarch_kernel.controller.output import RankPrinter
from monarch_kernel.kernel.rankstream import MIME, RankStreamChannel, RankStreamDisplay


class Recorder:
    def __init__(self) -> None:
        self.msgs: list[dict[str, Any]] = []

    def __call__(self, data, metadata=None, transient=None, update=False) -> None:
        self.msgs.append({"data": data, "id": transient["display_id"], "update": update})

    def final(self) -> dict[str, dict[str, Any]]:
        """display id -> its last data, in order of first appearance."""
        out: dict[str, dict[str, Any]] = {}
        for m in self.msgs:
            out[m["id"]] = m["data"]
        return out


def feed_both(chunks):
    """The same chunks through a plain RankPrinter and through one feeding a display."""
    streams: list[tuple[str, str]] = []
    plain = RankPrinter(lambda name, text: streams.append((name, text)))
    rec = Recorder()
    shown = RankStreamDisplay(rec, [0, 1, 2, 3])
    mime = RankPrinter(lambda n, t: None, on_lines=shown.lines, on_progress=shown.progress)
    for rank, name, text in chunks:
        plain.feed(rank, name, text)
        mime.feed(rank, name, text)
    plain.close()
    mime.close()
    shown.close()
    return streams, rec


def test_plain_fallback_is_the_stream_text_and_mime_keeps_ranks_and_streams():
    chunks = [(r, "stdout", "epoch 1\n") for r in range(4)]
    chunks += [(2, "stderr", "warn: slow\n"), (1, "stdout", "loss 0.5\n")]
    streams, rec = feed_both(chunks)
    (data,) = rec.final().values()
    # today's text: "[0-3] epoch 1\n[1] loss 0.5\n" on stdout, "[2] warn: slow\n" on stderr
    stdout = "".join(t for n, t in streams if n == "stdout")
    stderr = "".join(t for n, t in streams if n == "stderr")
    assert stdout == "[0-3] epoch 1\n[1] loss 0.5\n" and stderr == "[2] warn: slow\n"
    assert data["text/plain"] == "[0-3] epoch 1\n[2] warn: slow\n[1] loss 0.5\n"
    payload = data[MIME]
    assert payload["version"] == 1 and payload["ranks"] == [0, 1, 2, 3]
    assert payload["lines"] == [
        {"ranks": [0, 1, 2, 3], "stream": "stdout", "text": "epoch 1"},
        {"ranks": [2], "stream": "stderr", "text": "warn: slow"},
        {"ranks": [1], "stream": "stdout", "text": "loss 0.5"},
    ]


def test_long_output_goes_to_bounded_parts_linear_in_size():
    rec = Recorder()
    shown = RankStreamDisplay(rec, [0, 1])
    n = 5000
    for i in range(n):  # one line per call: the worst case for updates
        shown.lines([("stdout", [i % 2], f"line {i}")])
    shown.close()
    parts = rec.final()
    assert len(parts) == -(-n // RankStreamDisplay.MAX_LINES)
    texts = [e["text"] for d in parts.values() for e in d[MIME]["lines"]]
    assert texts == [f"line {i}" for i in range(n)]
    assert [d[MIME]["part"] for d in parts.values()] == list(range(len(parts)))
    assert len({d[MIME]["cell"] for d in parts.values()}) == 1
    sent = sum(len(m["data"][MIME]["lines"]) for m in rec.msgs)
    assert sent <= n * RankStreamDisplay.MAX_LINES // 2 + n  # each line re-sent < MAX_LINES times
    assert all(not m["update"] for m in rec.msgs if m["id"] not in
               {x["id"] for x in rec.msgs[: rec.msgs.index(m)]})


def test_one_huge_line_is_sent_once_in_a_part_of_its_own():
    rec = Recorder()
    shown = RankStreamDisplay(rec, [0])
    shown.lines([("stdout", [0], "a")])
    shown.lines([("stdout", [0], "x" * 100_000)])
    shown.lines([("stdout", [0], "b")])
    parts = list(rec.final().values())
    assert [[e["text"][:3] for e in p[MIME]["lines"]] for p in parts] == [["a"], ["xxx"], ["b"]]


def test_progress_bars_grouped_by_rank_in_rank_order_and_throttled():
    now = [0.0]
    rec = Recorder()
    shown = RankStreamDisplay(rec, [0, 1, 2, 3], clock=lambda: now[0])
    printer = RankPrinter(lambda n, t: None, on_lines=shown.lines, on_progress=shown.progress)
    printer.feed(3, "stdout", "start\n")
    printer.flush_lines()
    for step in range(1, 4):
        for rank in (3, 1, 0, 2):  # arrival order is not rank order
            printer.feed(rank, "stderr", f"\r{step * 10}%|")
        now[0] += 0.05
        shown.tick()
    printer.feed(0, "stdout", "after\n")
    printer.close()
    shown.close()
    parts = list(rec.final().values())
    assert [p[MIME].get("lines", [{}])[0].get("text") for p in parts] == ["start", None, "after"]
    bars = parts[1][MIME]["progress"]
    assert [b["rank"] for b in bars] == [0, 1, 2, 3]
    assert all(b["text"] == "30%|" and b["done"] for b in bars)
    assert parts[1]["text/plain"] == "".join(f"[{r}] 30%|\n" for r in range(4))
    bar_msgs = [m for m in rec.msgs if "progress" in m["data"][MIME]]
    assert len(bar_msgs) < 12  # 12 redraws, throttled to ~1 update per 0.1 s (+ first, last)


class FakeComm:
    def __init__(self, comm_id: str) -> None:
        self.comm_id = comm_id
        self.sent: list[Any] = []
        self.closed: Any = None
        self.close_cb = None

    def send(self, data):
        self.sent.append(data)

    def close(self, data=None):
        self.closed = data

    def on_close(self, cb):
        self.close_cb = cb


class FakeManager:
    def __init__(self):
        self.targets = {}

    def register_target(self, name, cb):
        self.targets[name] = cb


def test_channel_enabled_only_while_a_frontend_comm_is_open():
    mgr = FakeManager()
    ch = RankStreamChannel(mgr)
    assert not ch.enabled and ch.display(Recorder(), [0]) is None
    c = FakeComm("a")
    mgr.targets["monarch.rankstream"](c, {"content": {"data": {"mimetypes": [MIME]}}})
    assert ch.enabled and c.sent == [{"mime": MIME, "version": 1}]
    assert isinstance(ch.display(Recorder(), [0]), RankStreamDisplay)
    other = FakeComm("b")
    mgr.targets["monarch.rankstream"](other, {"content": {"data": {"mimetypes": ["x/y"]}}})
    assert other.closed is not None
    c.close_cb({})
    assert not ch.enabled
    assert not RankStreamChannel(None).enabled
