"""The debugger's parts without a kernel: the worker-side RemotePdb over a fake
channel, rank specs of the console, traceback trimming, and the console's bounded
waits driven from this process over real workers (``local_mesh``)."""

from __future__ import annotations

import bdb
import queue
import re
import signal
import sys
import threading
import time
from typing import Any

import pytest

from monarch_kernel.debug import server
from monarch_kernel.debug.console import DebugConsole, parse_debug_ranks
from monarch_kernel.debug.registry import registry_for
from monarch_kernel.errors import RankSpecError
from monarch_kernel.mesh.shape import Shape

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


class _InterruptOnSecondDrain:
    """A worker's output capture (drained before each debug message) at whose second
    drain, the one before the message after the paused one, SIGINT arrives: the
    worker's interrupt landing just after the controller released the paused code."""

    def __init__(self) -> None:
        self.calls = 0

    def drain(self) -> None:
        self.calls += 1
        if self.calls == 2:
            signal.raise_signal(signal.SIGINT)


@pytest.mark.parametrize("line, reason", [(None, "released"), ("c", "continue")])
def test_an_interrupt_just_after_the_release_still_ends_the_session(fake, line, reason):
    # the kernel's interrupt of a paused rank sends a release, then the interrupt: the
    # interrupt may land after pdb's loop ended but before the message saying so (it
    # left the controller believing the rank paused for ever)
    fake.capture = _InterruptOnSecondDrain()

    def controller() -> None:
        _, msg, _ = fake.next()
        server.deliver({"session": msg["session"], "line": line})

    t = threading.Thread(target=controller, daemon=True)
    t.start()
    prev = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a worker
    try:
        with pytest.raises(KeyboardInterrupt):
            _code_with_breakpoint()  # paused in this, the main thread (signals reach it)
    finally:
        signal.signal(signal.SIGINT, prev)
    t.join(10)
    msgs = []
    while not fake.sent.empty():
        msgs.append(fake.sent.get()[1])
    assert [m["kind"] for m in msgs] == ["ended"], msgs  # (the paused one was taken)
    assert msgs[0]["reason"] == reason
    assert sys.gettrace() is None
    assert not server._sessions


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


# ---------------------------------------------------------------- the console's bounded waits
_BG = ("import threading\n"
       "def bg():\n"
       "    secret = 7\n"
       "    breakpoint()\n"
       "    secret += 1\n"
       "threading.Thread(target=bg, name='bgwork', daemon=True).start()\n")


class _Console:
    """A console of ``mesh`` whose prompts are answered from a script; records output."""

    def __init__(self, mesh: Any, answers: list[str], req: Any = None) -> None:
        self.answers = list(answers)
        self.prompts: list[str] = []
        self.out: list[str] = []
        self.err: list[str] = []
        self.console = DebugConsole(
            registry_for(mesh.controller), mesh, self._ask, self.out.append, req=req,
            warn=self.err.append, answer_timeout=1.0)

    def _ask(self, prompt: str) -> str:
        self.prompts.append(prompt)
        if not self.answers:
            raise AssertionError(f"unexpected prompt {prompt!r}; output {self.out}")
        return self.answers.pop(0)


def _bg_session(mesh: Any, rank: int) -> Any:
    reg = registry_for(mesh.controller)
    mesh.collect(mesh.run(_BG, [rank]), timeout=60)
    deadline = time.monotonic() + 30
    while not reg.sessions("paused", ranks=[rank]):
        assert time.monotonic() < deadline, "the background thread never paused"
        time.sleep(0.05)
    (s,) = reg.sessions("paused", ranks=[rank])
    return s


def test_console_stops_waiting_for_a_session_that_does_not_answer(local_mesh):
    m = local_mesh
    s = _bg_session(m, 1)
    # a command that runs longer than the console waits for an answer
    c = _Console(m, ["attach 1", "p __import__('time').sleep(4) or 'woke'"])
    c.console.run()
    # it did not wait for the command to end
    assert "woke" not in "".join(registry_for(m.controller).get(s.sid).text)
    assert not c.answers, c.prompts
    err = "".join(c.err)
    assert f"rank 1 (session {s.sid}) did not answer" in err, err
    assert "within 1 s although the rank is alive" in err
    assert "Interrupt the kernel" in err and "%mesh debug" in err
    assert "no rank is paused any more" not in "".join(c.out)
    # once it answers, it is served again, as if nothing happened
    reg = registry_for(m.controller)
    deadline = time.monotonic() + 30
    while "woke" not in "".join(reg.get(s.sid).text):
        assert time.monotonic() < deadline, "the session never answered"
        time.sleep(0.05)
    c = _Console(m, ["attach 1", "p secret", "c"])
    c.console.run()
    assert not c.answers and not c.err, (c.prompts, c.err)
    out = "".join(c.out)
    assert re.search(r"^7$", out, re.MULTILINE) and "no rank is paused any more" in out, out
    assert reg.get(s.sid).state == "ended"


def test_console_stops_waiting_for_a_session_whose_debugger_is_gone(local_mesh):
    # what a lost "ended" message left behind: the controller holds the session as paused,
    # the worker drops every line for it (it forgot the session), nobody ever answers
    m = local_mesh
    s = _bg_session(m, 2)
    c = _Console(m, ["attach 2",
                     "!import monarch_kernel.debug.server as S; S._sessions.clear()",
                     "n"])
    t0 = time.monotonic()
    c.console.run()
    assert time.monotonic() - t0 < 10
    assert not c.answers, c.prompts
    assert f"rank 2 (session {s.sid}) did not answer 'n' within 1 s" in "".join(c.err)
    assert registry_for(m.controller).get(s.sid).state == "paused"  # as the worker last said
    # another console lists it again (the user may retry), and gives up again: no hang
    c = _Console(m, ["list", "continue"])
    c.console.run()
    assert not c.answers
    assert re.search(r"^2\s+\S+\s+bg \[bgwork\]\s+<mesh-cell-\d+>:5$", "".join(c.out),
                     re.MULTILINE), c.out
    assert f"rank 2 (session {s.sid}) did not answer 'c' within 1 s" in "".join(c.err)


def test_cell_console_stops_waiting_and_serves_the_rank_when_it_answers(local_mesh):
    m = local_mesh
    req = m.run("x = 5\nbreakpoint()\nx += 1\nx", [0])
    c = _Console(m, ["p __import__('time').sleep(3) or 'woke'", "p x", "c"], req=req)
    while not req.done():  # what the kernel's cell does: debug events go to the console
        try:
            ev = req.events.get(timeout=0.1)
        except queue.Empty:
            continue
        if ev[0] == "debug":
            c.console.on_event(ev)
    assert req.replies[0] == ("ok", 6), req.replies
    assert not c.answers, c.prompts
    err = "".join(c.err)
    assert re.search(r"rank 0 \(session 0\.\d+\) did not answer", err), err
    assert "The cell waits for that rank" in err
    out = "".join(c.out)
    assert "'woke'" in out and re.search(r"^5$", out, re.MULTILINE), out
