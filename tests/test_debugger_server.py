"""The debugger's parts without a kernel: the worker-side RemotePdb over a fake
channel, rank specs of the console, and traceback trimming."""

from __future__ import annotations

import bdb
import queue
import sys
import threading
from typing import Any

import pytest

from monarch_kernel.debug import server
from monarch_kernel.debug.console import parse_debug_ranks
from monarch_kernel.errors import RankSpecError
from monarch_kernel.mesh import Shape

pytestmark = pytest.mark.timeout(60)


class FakeWorker:
    """What RemotePdb needs of a Worker: rank, main thread, current request, send()."""

    def __init__(self) -> None:
        self.rank = 5
        self.main_thread_id = threading.get_ident()
        self.current_parent = "req-main"
        self.capture = None
        self.sent: queue.Queue[tuple[str, Any, str | None]] = queue.Queue()

    def send(self, type: str, content: Any = None, parent: str | None = None) -> None:
        self.sent.put((type, content, parent))

    def next(self) -> tuple[str, dict[str, Any], str | None]:
        return self.sent.get(timeout=10)


@pytest.fixture
def fake():
    w = FakeWorker()
    server.install(w)
    try:
        yield w
    finally:
        server.uninstall()


def _in_thread(fn: Any) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001
            out["error"] = e

    t = threading.Thread(target=run, name="user-code", daemon=True)
    t.start()
    return t, out


def _code_with_breakpoint() -> int:
    x = 1
    breakpoint()  # noqa: T100
    y = x + 1
    return y


def test_breakpoint_pauses_the_calling_thread_and_takes_commands(fake):
    t, out = _in_thread(_code_with_breakpoint)
    kind, msg, parent = fake.next()
    assert kind == "debug" and msg["kind"] == "paused"
    assert parent is None  # not the main thread, and no request parent set
    assert msg["prompt"] == "(Pdb rank 5) " and msg["function"] == "_code_with_breakpoint"
    assert msg["thread"] == "user-code"
    assert "-> y = x + 1" in msg["text"] and msg["entry"].startswith("> ")
    sid = msg["session"]
    server.deliver({"session": sid, "line": "p x"})
    _, msg, _ = fake.next()
    assert msg["kind"] == "paused" and msg["text"] == "1\n"
    server.deliver({"session": sid, "line": "c"})
    _, msg, _ = fake.next()
    assert msg["kind"] == "ended" and msg["reason"] == "continue"
    t.join(10)
    assert out == {"value": 2}
    assert sys.gettrace() is None


def test_quit_raises_bdbquit_in_the_paused_code(fake):
    t, out = _in_thread(_code_with_breakpoint)
    _, msg, _ = fake.next()
    server.deliver({"session": msg["session"], "line": "q"})
    _, msg, _ = fake.next()
    assert msg["kind"] == "ended" and msg["reason"] == "quit"
    t.join(10)
    assert isinstance(out.get("error"), bdb.BdbQuit)


def test_release_lets_the_code_run_on_past_breakpoints(fake):
    def code() -> int:
        total = 0
        for i in range(3):
            breakpoint()  # noqa: T100
            total += i
        return total

    server.set_request_parent("req-actor")
    try:
        t, out = _in_thread(code)  # the parent is per thread: this one has none
    finally:
        server.set_request_parent(None)
    seen = 0
    while "value" not in out or not fake.sent.empty():
        try:
            _, msg, _ = fake.next()
        except queue.Empty:
            break
        if msg["kind"] == "paused":
            seen += 1
            server.deliver({"session": msg["session"], "line": None})
        else:
            assert msg["kind"] == "ended" and msg["reason"] == "released"
    t.join(10)
    assert out == {"value": 3} and seen == 3


def test_lines_for_unknown_sessions_are_dropped(fake):
    server.deliver({"session": "5.999999", "line": "c"})
    server.deliver({"session": None, "line": "c"})
    assert fake.sent.empty()


def test_post_mortem_uses_the_last_exception(fake):
    def failing() -> None:
        table = {"a": 1}
        table["zz"]

    try:
        failing()
    except KeyError as e:
        server.remember_exception(e)
    t, out = _in_thread(server.post_mortem)
    _, msg, _ = fake.next()
    assert msg["kind"] == "paused" and msg["function"] == "failing"
    assert "post-mortem of KeyError" in msg["text"]
    server.deliver({"session": msg["session"], "line": "p table"})
    _, msg, _ = fake.next()
    assert msg["text"] == "{'a': 1}\n"
    server.deliver({"session": msg["session"], "line": "c"})
    _, msg, _ = fake.next()
    assert msg["kind"] == "ended"
    t.join(10)
    assert out == {"value": None}


def test_post_mortem_without_exception_says_so(fake):
    fake.last_traceback = None
    with pytest.raises(RuntimeError, match="rank 5 has no uncaught exception"):
        server.post_mortem()


def test_cut_debugger_frames_keeps_the_user_frames():
    import bdb as bdb_module

    def user() -> None:
        inner()

    def inner() -> None:
        # an exception that passes through a frame of the bdb module
        code = compile("raise KeyboardInterrupt", "<x>", "exec")
        exec(code, {"__name__": "bdb"})  # noqa: S102

    with pytest.raises(KeyboardInterrupt) as info:
        user()
    tb = info.value.__traceback__
    cut = server.cut_debugger_frames(tb)
    names = []
    while cut is not None:
        names.append(cut.tb_frame.f_code.co_name)
        cut = cut.tb_next
    assert names[-2:] == ["user", "inner"]
    assert bdb_module  # the real module is untouched


@pytest.mark.parametrize("spec, ranks", [
    ("3", [3]), ("1,2", [1, 2]), ("0:4", [0, 1, 2, 3]), ("procs=1:3", [1, 2, 5, 6]),
    ("hosts=1,procs=1", [5]), ("hosts=0", [0, 1, 2, 3]), ("all", list(range(8))),
])
def test_rank_specs(spec, ranks):
    shape = Shape({"hosts": 2, "procs": 4})
    assert sorted(parse_debug_ranks(spec, shape, 8)) == ranks


@pytest.mark.parametrize("spec, message", [
    ("9", "does not exist"), ("procs=7", "procs"), ("gpus=1", "dimensions"),
    ("1,procs=2", "mix"), ("procs=x", "NAME=INDEX"), ("2:1", "empty"),
])
def test_bad_rank_specs(spec, message):
    with pytest.raises(RankSpecError, match=message):
        parse_debug_ranks(spec, Shape({"hosts": 2, "procs": 4}), 8)
