"""The ``jupyter_kernel_test`` conformance suite against the monarch kernel.

:class:`MonarchKernelTests` runs every test of ``jupyter_kernel_test.KernelTests``
(kernel_info, execute with stdout and stderr, errors, execute_result,
display_data, completion, is_complete, inspection, the pager, history,
clear_output), every message validated against the v5 message spec. Extra
tests here do the same for what only this kernel has: a ``%%mesh`` cell's
messages (rank-tagged output, results, errors, rank display data) must be
valid too, and ``input()`` works.
"""

from __future__ import annotations

import queue
import time
import unittest
from importlib.metadata import version

import jupyter_kernel_test
import pytest
from jupyter_kernel_test.msgspec_v5 import validate_message

pytestmark = pytest.mark.timeout(300)


class MonarchKernelTests(jupyter_kernel_test.KernelTests):
    kernel_name = "monarch"
    language_name = "python"
    file_extension = ".py"

    code_hello_world = "print('hello, world')"
    code_stderr = "import sys; print('test', file=sys.stderr)"
    completion_samples = [
        {"text": "zi", "matches": {"zip"}},
        {"text": "import getpas", "matches": {"getpass"}},
        {"text": "%mes", "matches": {"%mesh", "%%mesh"}},  # the kernel's own magics
    ]
    complete_code_samples = ["1", "print('hello, world')", "def f(x):\n  return x*2\n\n\n",
                             "%mesh status", "%%mesh\nrank\n\n"]
    incomplete_code_samples = ["print('''hello", "def f(x):\n  x*2", "for i in range(3):"]
    invalid_code_samples = ["import = 7q", "1 +* 2"]
    code_page_something = "zip?"
    code_generate_error = "raise ValueError('this is a test')"
    code_execute_result = [
        {"code": "1+2+3", "result": "6"},
        {"code": "[n*n for n in range(1, 4)]", "result": "[1, 4, 9]"},
    ]
    code_display_data = [
        {"code": "from IPython.display import HTML, display; display(HTML('<b>test</b>'))",
         "mime": "text/html"},
        {"code": "from IPython.display import Math, display; display(Math('\\\\frac{1}{2}'))",
         "mime": "text/latex"},
    ]
    code_history_pattern = "1?2*"
    # not "range": IPython answers a range of the current session with session number 0
    # (not the number "tail" gave), so the stock python3 kernel fails that sub-test too
    supported_history_operations = ("tail", "search")
    code_inspect_sample = "zip"
    code_clear_output = "from IPython.display import clear_output; clear_output()"

    def get_non_kernel_info_reply(self, timeout: float | None = None) -> dict | None:
        # the suite waits forever by default (completion, is_complete): bound it
        return super().get_non_kernel_info_reply(timeout=60 if timeout is None else timeout)

    # ---------------------------------------------------------- monarch's own
    def _run(self, code: str, timeout: float = 120, stdin=None) -> tuple[dict, list[dict]]:
        """Execute ``code``; validate and return the reply and its iopub messages."""
        self.flush_channels()
        msg_id = self.kc.execute(code, allow_stdin=stdin is not None)
        deadline = time.monotonic() + timeout
        reply = None
        outputs: list[dict] = []
        idle = False
        while not (idle and reply is not None):
            self.assertLess(time.monotonic(), deadline, f"no answer to {code!r}")
            if stdin is not None:
                try:
                    req = self.kc.get_stdin_msg(timeout=0.01)
                except queue.Empty:
                    pass
                else:
                    # (not validate_message: jupyter_kernel_test 0.7's schema wants a number
                    # for "password", which the spec and ipykernel make a boolean)
                    self.assertEqual(req["msg_type"], "input_request")
                    self.assertEqual(req["parent_header"]["msg_id"], msg_id)
                    self.assertIs(req["content"]["password"], False)
                    self.kc.input(stdin(req["content"]["prompt"]))
            if reply is None:
                try:
                    reply = self.kc.get_shell_msg(timeout=0.01)
                except queue.Empty:
                    pass
                else:
                    validate_message(reply, "execute_reply", msg_id)
            try:
                msg = self.kc.get_iopub_msg(timeout=0.05)
            except queue.Empty:
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            validate_message(msg, msg["msg_type"], msg_id)
            if msg["msg_type"] == "status":
                idle = msg["content"]["execution_state"] == "idle"
            elif msg["msg_type"] != "execute_input":
                outputs.append(msg)
        return reply, outputs

    def test_zz_mesh_cells_send_valid_messages(self) -> None:
        """Spawn a mesh and check that every message of its cells follows the spec
        (runs last in this class: it leaves a mesh in the kernel)."""
        reply, _ = self._run("%mesh spawn 2")
        self.assertEqual(reply["content"]["status"], "ok")
        reply, out = self._run("%%mesh\nimport sys\nprint('out', rank)\n"
                               "print('err', rank, file=sys.stderr)\nrank * 10")
        self.assertEqual(reply["content"]["status"], "ok")
        kinds = {m["msg_type"] for m in out}
        self.assertTrue({"stream", "execute_result"} <= kinds, kinds)
        text = "".join(m["content"]["text"] for m in out if m["msg_type"] == "stream")
        for line in ("[0] out 0", "[1] out 1", "[0] err 0", "[1] err 1"):
            self.assertIn(line, text)
        reply, out = self._run("%%mesh\nfrom IPython.display import HTML, display\n"
                               "display(HTML(f'<i>{rank}</i>'))")
        self.assertEqual(reply["content"]["status"], "ok")
        shown = [m for m in out if m["msg_type"] == "display_data"]
        self.assertEqual(sorted(m["content"]["metadata"].get("monarch_rank") for m in shown),
                         [0, 1])
        reply, out = self._run("%%mesh --ranks 1\nraise KeyError('k')")
        self.assertEqual(reply["content"]["status"], "error")
        self.assertEqual(reply["content"]["ename"], "KeyError")
        self.assertTrue(any(m["msg_type"] == "error" for m in out))
        reply, _ = self._run("%mesh stop")
        self.assertEqual(reply["content"]["status"], "ok")

    def test_input(self) -> None:
        prompts = []

        def answer(prompt: str) -> str:
            prompts.append(prompt)
            return "forty-two"

        reply, out = self._run("x = input('say: ')\nprint('got', x)", stdin=answer)
        self.assertEqual(reply["content"]["status"], "ok")
        self.assertEqual(prompts, ["say: "])
        text = "".join(m["content"]["text"] for m in out if m["msg_type"] == "stream")
        self.assertIn("got forty-two", text)

    def test_each_cell_is_transformed_once(self) -> None:
        """MonarchShell: ipykernel's and IPython's transformations of one cell are
        one (a counting input transformer sees each cell once), and what depends
        on the namespace (autocall of a one-line cell) still sees the cell's state."""
        setup = ("_seen = []\n"
                 "def _count(lines):\n"
                 "    _seen.append(''.join(lines))\n"
                 "    return lines\n"
                 "get_ipython().input_transformers_post.append(_count)\n"
                 "%autocall 2")
        reply, _ = self._run(setup)
        self.assertEqual(reply["content"]["status"], "ok")
        for code in ("x = 41", "%%capture\nx += 1", "print x"):
            reply, _ = self._run(code)
            self.assertEqual(reply["content"]["status"], "ok", reply["content"])
        reply, outputs = self._run("get_ipython().input_transformers_post.remove(_count)\n"
                                   "%autocall 0\n"
                                   "len(_seen), x")
        self.assertEqual(reply["content"]["status"], "ok", reply["content"])
        # once each: the 3 cells, the body that %%capture runs as a cell of its own,
        # and this last cell (not the setup cell: _count came while it ran); twice
        # each, as ipykernel and IPython alone do, would be 10
        results = [m["content"]["data"]["text/plain"] for m in outputs
                   if m["msg_type"] == "execute_result"]
        self.assertEqual(results, ["(5, 42)"])

    def test_monarch_kernel_info(self) -> None:
        self.flush_channels()
        msg_id = self.kc.kernel_info()
        reply = self.kc.get_shell_msg(timeout=jupyter_kernel_test.TIMEOUT)
        validate_message(reply, "kernel_info_reply", msg_id)
        c = reply["content"]
        self.assertEqual(c["implementation"], "monarch_kernel")
        self.assertEqual(c["language_info"]["name"], "python")
        self.assertIn("%mesh spawn", c["banner"])


class MonarchIopubWelcomeTests(jupyter_kernel_test.IopubWelcomeTests):
    kernel_name = "monarch"
    # (JEP 65: ipykernel sends the welcome from 7.0 on; the kernel inherits it)
    support_iopub_welcome = int(version("ipykernel").split(".")[0]) >= 7


if __name__ == "__main__":
    unittest.main()
