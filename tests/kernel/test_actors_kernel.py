"""Through the real kernel: actors defined in notebook cells, ``await`` in a cell,
the actor demo script, and notebooks/02_actors.ipynb under nbclient."""

from __future__ import annotations

import queue
import re
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

import pytest

from monarch_kernel.testing.kernel import worker_pids

ROOT = Path(__file__).resolve().parents[2]

CELL_ACTOR = '''
from monarch_kernel import Actor, endpoint, current_rank
import os

def helper(x):
    return 10 * x

class Cell(Actor):
    def __init__(self, k):
        self.k = k

    @endpoint
    def f(self, x):
        print("hello from", current_rank().rank)
        return helper(x) + self.k

    @endpoint
    async def af(self, x):
        return helper(x) - self.k

    @endpoint
    def pid(self):
        return os.getpid()

    @endpoint
    def bad(self):
        table = {}
        return table["missing"]

cells = mesh.spawn("cells", Cell, 1)
cells.f.call(2).get(timeout=30)
'''


@pytest.fixture(scope="module")
def kc(shared_kernel):
    r = shared_kernel.execute("%mesh spawn 2")
    assert r.status == "ok", r.error_text()
    r = shared_kernel.execute(CELL_ACTOR, timeout=60)
    assert r.status == "ok", r.error_text()
    assert "21" in r.result_text() and "ValueMesh" in r.result_text()
    out = r.stream()
    assert "[0] hello from 0" in out and "[1] hello from 1" in out  # rank-tagged output
    return shared_kernel


def test_get_in_a_cell_neither_deadlocks_nor_warns(kc):
    r = kc.execute("import warnings\nwarnings.simplefilter('error')\n"
                   "v = cells.slice(procs=1).f.call_one(5).get(timeout=30)\nv", timeout=60)
    assert r.status == "ok", r.error_text()
    assert r.result_text() == "51"
    assert "Warning" not in r.stream("stderr")
    kc.execute("warnings.resetwarnings()")


def test_await_in_a_cell(kc):
    r = kc.execute("await cells.af.choose(3)", timeout=60)
    assert r.status == "ok", r.error_text()
    assert r.result_text() == "29"
    r = kc.execute("vm = await cells.af.call(1)\nvm.values()", timeout=60)
    assert r.status == "ok", r.error_text()
    assert r.result_text() == "[9, 9]"


def test_stream_and_broadcast_in_a_cell(kc):
    r = kc.execute("sorted(f.get(timeout=30) for f in cells.f.stream(1))", timeout=60)
    assert r.status == "ok", r.error_text()
    assert r.result_text() == "[11, 11]"
    r = kc.execute("cells.bad.broadcast()\n"
                   "from monarch_kernel.testing.kernel import wait_for\n"
                   "wait_for(lambda: len(cells.broadcast_failures) == 2, 30)\n"
                   "import time; time.sleep(0.2)\n"
                   "print(sorted(type(e).__name__ for e in cells.broadcast_failures))",
                   timeout=60)
    assert r.status == "ok", r.error_text()
    assert "['KeyError', 'KeyError']" in r.stream("stdout")


def test_remote_traceback_shows_the_cell_source(kc):
    r = kc.execute("cells.bad.call().get(timeout=30)", timeout=60)
    assert r.status == "error"
    text = r.error_text()
    assert "KeyError" in text and "actor cells" in text
    assert 'return table["missing"]' in text  # the line of the cell that defined the class
    r = kc.execute("try:\n    cells.bad.call().get(timeout=30)\nexcept KeyError as e:\n"
                   "    print('caught', e.ranks)", timeout=60)
    assert r.status == "ok", r.error_text()
    assert "caught [0, 1]" in r.stream()


def test_actors_share_processes_with_mesh_cells(kc):
    r = kc.execute("actor_pids = cells.pid.call().get(timeout=30).values()", timeout=60)
    assert r.status == "ok", r.error_text()
    r = kc.execute("%%mesh\nimport os\nmy_pid = os.getpid()")
    assert r.status == "ok", r.error_text()
    r = kc.execute("cell_pids = %mesh pull my_pid\nprint(sorted(cell_pids.values()) == "
                   "sorted(actor_pids))")
    assert r.stream().strip() == "True", r.error_text()


def test_a_mesh_cell_calls_an_actor_worker_to_worker(kc):
    r = kc.execute("h = cells.slice(procs=0)\n%mesh push h", timeout=60)
    assert r.status == "ok", r.error_text()
    r = kc.execute("%%mesh\nh.f.call_one(rank).get(timeout=30)", timeout=60)
    assert r.status == "ok", r.error_text()
    assert re.search(r"0\s+0\s+0\s+1\b", r.result_text()), r.result_text()
    assert re.search(r"1\s+0\s+1\s+11\b", r.result_text()), r.result_text()


def test_actor_demo_script_runs():
    proc = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "actor_demo.py")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, out + err
    for marker in ("call ->", "call_one(procs=1) -> 11", "choose while rank 0 is busy",
                   "broadcast ->", "stream (completion order) -> [3, 2, 1, 0]",
                   "await -> ok", "except KeyError", "timeout -> still running",
                   "relay.total ->", "after stop ->", "OK ("):
        assert marker in out, out
    assert not worker_pids(proc.pid)  # the script's workers ended with it


def test_actors_notebook_trains_to_90_percent():
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(ROOT / "notebooks" / "02_actors.ipynb", as_version=4)
    pids: list[int] = []
    client = NotebookClient(nb, kernel_name="monarch", timeout=300, allow_errors=False)
    client.on_cell_execute = lambda **_: pids.append(client.km.provisioner.process.pid)
    client.execute()
    text = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", [])
                   if o.get("output_type") == "stream")
    m = re.search(r"held-out accuracy: ([0-9.]+)", text)
    assert m and float(m.group(1)) >= 0.90, text[-2000:]
    assert re.search(r"step 100 +version 100", text)
    assert "(chosen) scores the final weights" in text
    assert "RuntimeError from server" in text
    assert pids and not worker_pids(pids[0])  # the notebook's workers are gone


def test_broadcast_output_reaches_the_notebook(kc):
    # nothing waits for a broadcast: what its endpoint prints is written, tagged by
    # rank, where ipykernel puts background output: from ipykernel 7 on, this cell
    # (which is running); ipykernel 6 gives a thread's output to the cell that started
    # the thread (%mesh spawn's, for the mesh's threads)
    msg_id = kc.kc.execute("import time\ncells.f.broadcast(5)\ntime.sleep(3)")
    here: list[str] = []
    elsewhere: list[str] = []
    deadline = time.monotonic() + 60
    while True:
        assert time.monotonic() < deadline, "the cell did not end within 60 s"
        try:
            msg = kc.kc.get_iopub_msg(timeout=1)
        except queue.Empty:
            continue
        mine = msg["parent_header"].get("msg_id") == msg_id
        if mine and msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            break
        if msg["msg_type"] == "stream":
            (here if mine else elsewhere).append(msg["content"]["text"])
    while (rep := kc.kc.get_shell_msg(timeout=10))["parent_header"].get("msg_id") != msg_id:
        pass
    assert rep["content"]["status"] == "ok", rep["content"]
    out = "".join(here if int(version("ipykernel").split(".")[0]) >= 7 else elsewhere)
    assert "[0] hello from 0" in out and "[1] hello from 1" in out, (here, elsewhere)
