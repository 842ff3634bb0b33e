"""End to end: remote breakpoints driven from the notebook's own prompt.

A real monarch kernel with a 4-rank local mesh; a client that answers the
kernel's ``input_request`` messages (``(Pdb rank R)``, ``(mesh-debug)``)
from a script, as a user at the notebook would.
"""

from __future__ import annotations

import ast
import os
import re
import signal
import time

import pytest

from monarch_kernel.testing.kernel import KernelSession

pytestmark = pytest.mark.timeout(300)


class Script:
    """Answers prompts in order; records what was asked. Never leaves a prompt unanswered:
    past the end of the script it answers ``c`` (and the test fails on ``extra``)."""

    def __init__(self, answers: list[str]) -> None:
        self.answers = list(answers)
        self.prompts: list[str] = []
        self.extra: list[str] = []

    def __call__(self, prompt: str) -> str:
        self.prompts.append(prompt)
        if self.answers:
            return self.answers.pop(0)
        self.extra.append(prompt)
        return "c"

    def check(self) -> None:
        assert not self.answers, f"prompts never came for {self.answers}; asked {self.prompts}"
        assert not self.extra, f"unexpected prompts {self.extra}"


@pytest.fixture(scope="module")
def k4(shared_kernel: KernelSession) -> KernelSession:
    r = shared_kernel.execute("%mesh spawn 4")
    assert r.status == "ok", r.error_text()
    return shared_kernel


def _states(k: KernelSession) -> str:
    r = k.execute("print([row['state'] for row in mesh.status()])")
    return r.stream()


def test_breakpoint_on_one_rank_step_print_continue(k4):
    s = Script(["l", "n", "p x", "c"])
    r = k4.execute("%%mesh\nx = rank * 10\nif rank == 1:\n    breakpoint()\nx = x + 1\n"
                   "print('done', x)\nx", on_input=s, timeout=120)
    assert r.status == "ok", r.error_text()
    s.check()
    assert s.prompts == ["(Pdb rank 1) "] * 4
    out = r.stream()
    # the cell as the notebook names it, lines counted as in the editor (%%mesh is line 1)
    assert re.search(r"rank 1 paused at Cell In\[\d+\], line 5, in <module>", out), out
    assert "-> x = x + 1" in out  # pdb's location line
    # `l` shows the cell's own source lines as the editor does (linecache entry of the cell)
    assert "  1  \t%%mesh" in out and "  2  \tx = rank * 10" in out
    assert "  5  ->\tx = x + 1" in out
    assert re.search(r"^11$", out, re.MULTILINE)  # `p x` after `n`
    for rank in range(4):
        assert f"[{rank}] done {rank * 10 + 1}" in out
    assert "31" in r.result_text() and "11" in r.result_text()


def test_several_ranks_console_list_cast_continue(k4):
    asked: list[str] = []
    plan = ["list", "cast 0:2 p rank", "cast procs=2:4 p rank * 100", "cast 7 p 1",
            "attach 3", "p y", "n", "p y", "detach", "continue"]

    def answer(prompt: str) -> str:
        asked.append(prompt)
        if prompt.startswith("(Pdb") and not plan[0].startswith(("p ", "n", "detach")):
            return "detach"  # only one rank had paused yet: go to the console
        return plan.pop(0) if plan else "continue"

    r = k4.execute("%%mesh\ny = 0\nbreakpoint()\ny = rank + 1\nprint('finished', y)",
                   on_input=answer, timeout=120)
    assert r.status == "ok", r.error_text()
    assert not plan, asked
    out = r.stream()
    rows = re.findall(r"^([0-3])\s+\S+\s+<module>\s+Cell In\[\d+\], line 4$", out,
                      re.MULTILINE)
    assert sorted(rows) == ["0", "1", "2", "3"], out
    assert "[0] 0\n[1] 1\n" in out
    assert "[2] 200\n[3] 300\n" in out
    assert "rank 7 does not exist" in out
    assert "(Pdb rank 3) " in asked
    assert re.search(r"^4$", out, re.MULTILINE)  # rank 3's y after `n`
    assert "[0-3] finished" in out or all(f"[{r}] finished {r + 1}" in out for r in range(4))
    assert "paused" not in _states(k4)


def test_quit_ends_the_rank_cleanly(k4):
    s = Script(["p i", "q"])
    r = k4.execute("%%mesh\nfor i in range(100):\n    if rank == 2 and i == 5:\n"
                   "        breakpoint()\nrank", on_input=s, timeout=120)
    s.check()
    assert r.status == "ok", r.error_text()
    err = r.stream("stderr")
    assert "rank 2: debugging ended with quit" in err and "BdbQuit" in err
    assert re.search(r"^5$", r.stream("stdout"), re.MULTILINE)
    text = r.result_text()
    assert "None" in text and "3" in text  # rank 2 stopped; the others returned
    # nothing is left paused, and every rank runs the next cell
    r = k4.execute("%%mesh\nrank * 2")
    assert r.status == "ok" and "6" in r.result_text()
    assert "paused" not in _states(k4)


def test_post_mortem_shows_the_failing_frame(k4):
    r = k4.execute("%%mesh\ndef lookup(table, key):\n    hits = len(table) * 7\n"
                   "    return table[key]\nlookup({'a': 1}, 'missing' if rank == 3 else 'a')")
    assert r.status == "error" and r.reply["content"]["ename"] == "KeyError"
    s = Script(["args", "p hits", "w", "c"])
    r = k4.execute("%mesh debug --post-mortem 3", on_input=s, timeout=120)
    assert r.status == "ok", r.error_text()
    s.check()
    assert s.prompts[0] == "(Pdb rank 3) "
    out = r.stream()
    assert "rank 3 paused at Cell In[" in out and "in lookup" in out
    assert "post-mortem of KeyError" in out
    assert "table = {'a': 1}" in out and "key = 'missing'" in out
    assert re.search(r"^7$", out, re.MULTILINE)
    assert "-> return table[key]" in out
    assert "worker.py" not in out  # `w` shows the user's frames only


def test_post_mortem_without_an_exception_is_a_clear_error(k4):
    r = k4.execute("%mesh debug --post-mortem 0", on_input=Script([]), timeout=60)
    assert r.status == "error"
    assert "rank 0 has no uncaught exception" in r.error_text()
    r = k4.execute("%mesh debug --post-mortem 9", on_input=Script([]), timeout=60)
    assert r.status == "error" and "rank 9 does not exist" in r.error_text()


def test_no_stdin_skips_the_breakpoint_with_a_warning(k4):
    r = k4.execute("%%mesh\nfor i in range(3):\n    if rank == 1:\n        breakpoint()\n"
                   "rank + i", timeout=120)  # allow_stdin false, as nbclient
    assert r.status == "ok", r.error_text()
    err = r.stream("stderr")
    assert "rank 1: breakpoint at Cell In[" in err and "skipped" in err
    assert err.count("rank 1: breakpoint at") == 1  # one warning per rank, not per breakpoint
    assert "5" in r.result_text()  # rank 3 + 2
    r = k4.execute("%mesh debug --post-mortem 1", timeout=60)
    assert r.status == "ok" and "%mesh debug skipped" in r.stream("stderr")


def test_interrupt_while_paused_releases_the_ranks(k4):
    def answer(prompt: str) -> None:
        k4.interrupt()
        # leave the prompt unanswered, as a user pressing stop

    t0 = time.monotonic()
    r = k4.execute("%%mesh\nimport time\nif rank == 0:\n    breakpoint()\ntime.sleep(0.2)\n'end'",
                   on_input=answer, timeout=120)
    assert time.monotonic() - t0 < 60
    assert r.status == "error"
    assert "released" in r.stream("stderr")
    text = r.error_text()
    assert "KeyboardInterrupt" in text
    assert "bdb.py" not in text  # the paused line, not pdb's own frames
    r = k4.execute("%%mesh\nrank")
    assert r.status == "ok" and "3" in r.result_text()
    assert "paused" not in _states(k4)


def test_background_pause_and_mesh_debug(k4):
    r = k4.execute("%%mesh --ranks 2\nimport threading\ndef bg():\n    secret = 42\n"
                   "    breakpoint()\n    secret += 1\nthreading.Thread(target=bg, name='bgwork')"
                   ".start()")
    assert r.status == "ok", r.error_text()
    s = Script(["list", "cast 2 p secret", "detach"])
    r = k4.execute("%mesh debug --wait 20", on_input=s, timeout=120)
    assert r.status == "ok", r.error_text()
    s.check()
    out = r.stream()
    assert re.search(r"^2\s+\S+\s+bg \[bgwork\]\s+Cell In\[\d+\], line 6$", out,
                     re.MULTILINE), out
    assert "[2] 42" in out
    assert "still paused" in out
    assert "paused" in _states(k4)  # it stayed paused after detach
    s = Script(["attach 2", "p secret", "n", "p secret", "c"])
    r = k4.execute("%mesh debug", on_input=s, timeout=120)
    assert r.status == "ok", r.error_text()
    s.check()
    assert re.search(r"^43$", r.stream(), re.MULTILINE)
    assert "no rank is paused any more" in r.stream()


def test_pdb_set_trace_and_breakpoints_in_functions(k4):
    r = k4.execute("%%mesh\ndef twice(a):\n    b = a * 2\n    return b\n")
    assert r.status == "ok"
    # step into a function defined in an earlier cell, up/down, a breakpoint by line
    s = Script(["s", "n", "p a", "u", "p v", "d", "c"])
    r = k4.execute("%%mesh --ranks 0\nimport pdb\nv = 5\npdb.set_trace()\nv = twice(v)\nv",
                   on_input=s, timeout=120)
    assert r.status == "ok", r.error_text()
    s.check()
    out = r.stream()
    assert "--Call--" in out and "twice()" in out
    assert "-> b = a * 2" in out
    assert re.search(r"^5$", out, re.MULTILINE)
    assert "10" in r.result_text()


def test_controller_breakpoint_keeps_ipykernel_behaviour(k4):
    r = k4.execute("import sys\nprint(sys.breakpointhook.__module__)")
    assert r.status == "ok"
    assert "monarch_kernel" not in r.stream()
    r = k4.execute("z = 1\nbreakpoint()\nz + 1", timeout=60)
    assert r.status == "ok" and "2" in r.result_text()


def test_breakpoint_in_an_actor_endpoint(k4):
    code = (
        "from monarch_kernel import Actor, endpoint, current_rank\n"
        "class Acc(Actor):\n"
        "    def __init__(self):\n"
        "        self.n = 100\n"
        "    @endpoint\n"
        "    def add(self, k):\n"
        "        if current_rank().rank == 1:\n"
        "            breakpoint()\n"
        "        self.n += k\n"
        "        return self.n\n"
        "accs = mesh.spawn('acc', Acc)\n"
        "accs.add.call(5).get()\n"
    )
    s = Script(["p k", "l", "n", "p self.n", "c"])
    r = k4.execute(code, on_input=s, timeout=120)
    assert r.status == "ok", r.error_text()
    s.check()
    assert s.prompts == ["(Pdb rank 1) "] * 5
    out = r.stream()
    assert "rank 1 paused at" in out and "in add (thread monarch-actor-acc)" in out
    assert re.search(r"^5$", out, re.MULTILINE)
    assert "->\t        self.n += k" in out  # `l` shows the notebook's source of the endpoint
    assert re.search(r"^105$", out, re.MULTILINE)
    assert "105" in r.result_text()


def test_rank_killed_while_paused_never_hangs(k4):
    r = k4.execute("print([row['pid'] for row in mesh.status()])")
    pids = ast.literal_eval(r.stream())

    def answer(prompt: str) -> str:
        os.kill(pids[2], signal.SIGKILL)
        time.sleep(0.5)
        return "n"

    r = k4.execute("%%mesh\nimport time\nif rank == 2:\n    breakpoint()\ntime.sleep(0.1)",
                   on_input=answer, timeout=120)
    assert r.status == "error"
    assert "rank 2" in r.error_text() and "SIGKILL" in r.error_text()
    r = k4.execute("%mesh spawn 4")  # a fresh mesh for whatever runs next
    assert r.status == "ok", r.error_text()
