"""End to end: the real monarch kernel driving a local mesh."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from monarch_kernel.testing.kernel import KernelSession, wait_for, worker_pids


@pytest.fixture(scope="module")
def k4(shared_kernel):
    r = shared_kernel.execute("%mesh spawn 4")
    assert r.status == "ok", r.error_text()
    assert "4 ranks" in r.stream()
    return shared_kernel


def test_four_distinct_worker_processes(k4):
    r = k4.execute("%%mesh\nimport os\nmy_pid = os.getpid()")
    assert r.status == "ok", r.error_text()
    r = k4.execute("vm = %mesh pull my_pid\nprint(vm.values())")
    pids = eval(r.stream())
    assert len(set(pids)) == 4
    assert set(pids) == set(worker_pids(k4.pid))


def test_output_is_live_and_tagged(k4):
    r = k4.execute("%%mesh\nimport time\nprint('first', rank, flush=True)\n"
                   "time.sleep(2)\nprint('second')")
    assert r.status == "ok", r.error_text()
    first = [t for t, m in r.messages
             if m["msg_type"] == "stream" and "first" in m["content"]["text"]]
    assert first, r.stream()
    assert r.reply_time - first[0] > 1.0  # the first line came well before the reply
    out = r.stream()
    for rank in range(4):
        assert f"[{rank}] first {rank}" in out
    # identical lines from every rank fold into one ("[0-3] second") when they arrive
    # together (within the fold window), else they come per rank or group of ranks
    seconds = [line[1:line.index("]")] for line in out.splitlines()
               if line.startswith("[") and line.endswith("] second")]
    covered = {r for tag in seconds for part in tag.split(",")
               for r in range(int(part.split("-")[0]), int(part.split("-")[-1]) + 1)}
    assert covered == {0, 1, 2, 3}, out


def test_fd_level_and_subprocess_output(k4):
    r = k4.execute("%%mesh --ranks 0\nimport os, subprocess\nos.write(1, b'from fd 1\\n')\n"
                   "subprocess.run(['echo', 'from a child'])\nos.write(2, b'to fd 2\\n')")
    assert r.status == "ok", r.error_text()
    assert "[0] from fd 1" in r.stream("stdout")
    assert "[0] from a child" in r.stream("stdout")
    assert "[0] to fd 2" in r.stream("stderr")


def test_last_expression_is_a_value_mesh(k4):
    r = k4.execute("%%mesh\nx = rank * 10\nx + 1")
    assert r.status == "ok"
    text = r.result_text()
    assert "ValueMesh" in text and "31" in text
    html = [m for _, m in r.messages if m["msg_type"] == "execute_result"][0]
    assert "<table>" in html["content"]["data"]["text/html"]


def test_exception_on_one_rank_names_it(k4):
    r = k4.execute("%%mesh\ny = 1\nif rank == 2:\n    1 / 0\n'ok'")
    assert r.status == "error"
    content = r.reply["content"]
    assert content["ename"] == "ZeroDivisionError"
    assert "rank 2" in content["evalue"]
    text = r.error_text()
    assert "1 / 0" in text  # the cell's own source line in the remote traceback
    assert "rank 0" not in text and "rank 3" not in text


def test_identical_failures_are_grouped(k4):
    r = k4.execute("%%mesh\nraise ValueError('bad input')")
    assert r.status == "error"
    text = r.error_text()
    assert "ranks 0-3" in text
    assert text.count("ValueError: bad input") == 1


def test_ranks_slices(k4):
    r = k4.execute("%%mesh --ranks 1,3\nrank")
    assert r.status == "ok"
    assert "[1, 3]" in str(k4.execute("print(_.values())").stream())
    r = k4.execute("%%mesh --ranks 0:2\nprint('here', rank)")
    out = r.stream()
    assert "[0] here 0" in out and "[1] here 1" in out and "here 2" not in out


def test_push_pull_round_trip(k4):
    r = k4.execute("import torch\nt = torch.arange(6.).reshape(2, 3)\n"
                   "d = {'lr': 0.1, 'k': [1, 2]}\n%mesh push t d")
    assert r.status == "ok", r.error_text()
    r = k4.execute("%%mesh\nt2 = t * (rank + 1)\nd['rank'] = rank")
    assert r.status == "ok", r.error_text()
    r = k4.execute("tt = %mesh pull t2\ndd = %mesh pull d\n"
                   "assert all(torch.equal(v, t * (i + 1)) for i, v in enumerate(tt.values()))\n"
                   "assert [x['rank'] for x in dd.values()] == [0, 1, 2, 3]\n"
                   "assert dd.values()[0]['k'] == [1, 2]\nprint('round trip ok')")
    assert r.status == "ok", r.error_text()
    assert "round trip ok" in r.stream()


def test_controller_cells_run_locally(k4):
    r = k4.execute("import os\nos.getpid()")
    assert r.result_text() == str(k4.pid)


def test_interrupt_stops_all_ranks_and_next_cell_works(k4):
    msg_id = k4.kc.execute("%%mesh\nwhile True:\n    pass")
    time.sleep(1.5)
    k4.interrupt()
    while True:  # the ranks loop for ever: a reply at all means they were interrupted
        rep = k4.kc.get_shell_msg(timeout=10)
        if rep["parent_header"]["msg_id"] == msg_id:
            break
    assert rep["content"]["status"] == "error"
    k4.wait_idle(msg_id)  # (a cell sent at once may be aborted: see wait_idle)
    r = k4.execute("%%mesh\nrank + 100")
    assert r.status == "ok" and "103" in r.result_text()


def test_bad_magic_input_is_one_line_and_kernel_survives(k4):
    for line in ("%mesh frobnicate", "%mesh spawn 0", "%mesh spawn abc", "%mesh pull",
                 "%%mesh --ranks 9\nrank", "%%mesh --ranks 3:1\nrank",
                 "%mesh push not_defined_here"):
        r = k4.execute(line)
        assert r.status == "error", line
        assert r.reply["content"]["ename"] == "UsageError", (line, r.error_text())
    r = k4.execute("%%mesh\nrank")
    assert r.status == "ok"


@pytest.mark.parametrize("var", ["MONARCH_SPIN_US", "MONARCH_LANES", "MONARCH_MAX_MESSAGE_BYTES"])
def test_bad_spin_or_lanes_setting_keeps_the_running_mesh(k4, var):
    """A bad MONARCH_SPIN_US or MONARCH_LANES is refused before the running mesh
    is stopped."""
    r = k4.execute(f"import os; os.environ[{var!r}] = 'fast'")
    assert r.status == "ok"
    try:
        r = k4.execute("%mesh spawn 2")
        assert r.status == "error"
        assert r.reply["content"]["ename"] == "UsageError"
        assert var in r.reply["content"]["evalue"]
    finally:
        assert k4.execute(f"del os.environ[{var!r}]").status == "ok"
    r = k4.execute("%%mesh\nrank")
    assert r.status == "ok" and "3" in r.result_text()
    assert len(worker_pids(k4.pid)) == 4


def test_stop_leaves_no_worker(kernel):
    r = kernel.execute("%mesh spawn 2")
    assert r.status == "ok"
    assert len(worker_pids(kernel.pid)) == 2
    r = kernel.execute("%mesh stop")
    assert r.status == "ok", r.error_text()
    wait_for(lambda: not worker_pids(kernel.pid), 10, what="workers gone after %mesh stop")
    r = kernel.execute("%%mesh\nrank")
    assert r.status == "error" and "spawn" in r.error_text()


def test_no_mesh_yet_gives_clear_error(kernel):
    r = kernel.execute("%%mesh\nrank")
    assert r.status == "error"
    assert r.reply["content"]["ename"] == "UsageError"
    assert "%mesh spawn" in r.reply["content"]["evalue"]


def test_workers_exit_when_kernel_is_killed():
    ks = KernelSession()
    try:
        assert ks.execute("%mesh spawn 2").status == "ok"
        pids = worker_pids(ks.pid)
        assert len(pids) == 2
        os.kill(ks.pid, signal.SIGKILL)
        t0 = time.monotonic()
        wait_for(lambda: not any(psutil.pid_exists(p) and
                                 psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                                 for p in pids), 10, what="workers exit after kernel SIGKILL")
        assert time.monotonic() - t0 < 10
    finally:
        ks.kc.stop_channels()
        ks.km.cleanup_resources()


def test_kernelspec_install_cli(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "monarch_kernel", "install", "--prefix", str(tmp_path),
         "--name", "monarch-test"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    spec = tmp_path / "share" / "jupyter" / "kernels" / "monarch-test"
    import json

    data = json.loads((spec / "kernel.json").read_text())
    assert data["display_name"] == "Monarch (mesh)"
    # as ipykernel's own kernelspec: no debugpy "frozen modules" warning in the notebook
    assert data["argv"][1:4] == ["-Xfrozen_modules=off", "-m", "monarch_kernel.kernel"]
    assert (spec / "logo-64x64.png").exists()


def test_named_meshes_use_and_status(kernel):
    """Two named meshes: the last spawned is current; %mesh use switches."""
    for name in ("a", "b"):
        r = kernel.execute(f"%mesh spawn 1 --name {name}")
        assert r.status == "ok", r.error_text()
    pids = {}
    for name in ("a", "b"):
        r = kernel.execute(f"print({name}.controller.ranks[0].pid)")
        pids[name] = int(r.stream())
    r = kernel.execute("%%mesh\nimport os\nos.getpid()")
    assert str(pids["b"]) in r.result_text()
    r = kernel.execute("%mesh use a")
    assert r.status == "ok" and "'a'" in r.stream()
    r = kernel.execute("%%mesh\nimport os\nos.getpid()")
    assert str(pids["a"]) in r.result_text()
    r = kernel.execute("st = %mesh status\nprint(repr(st))")
    assert "mesh 'a'" in r.stream(), r.error_text()
    r = kernel.execute("%mesh use nope")
    assert r.status == "error" and r.reply["content"]["ename"] == "UsageError"
    assert "'a', 'b'" in r.reply["content"]["evalue"]
    r = kernel.execute("%mesh stop --all")
    assert r.status == "ok", r.error_text()
    wait_for(lambda: not worker_pids(kernel.pid), 10, what="workers gone after --all")


def test_mesh_use_adopts_a_mesh_made_with_spawn_procs(kernel):
    """A mesh made in a cell with spawn_procs (the PyTorch Monarch way) becomes the
    current mesh of the %mesh magics with %mesh use VARIABLE."""
    r = kernel.execute("%mesh status")
    assert r.status == "error" and "%mesh use NAME" in r.reply["content"]["evalue"]
    r = kernel.execute("from monarch_kernel import this_host\n"
                       "pm = this_host().spawn_procs(per_host={'procs': 2})\nn = 3")
    assert r.status == "ok", r.error_text()
    for bad, why in (("n", "holds a value of type int"), ("nothing", "is not defined")):
        r = kernel.execute(f"%mesh use {bad}")
        assert r.status == "error" and r.reply["content"]["ename"] == "UsageError"
        assert why in r.reply["content"]["evalue"], r.reply["content"]["evalue"]
    r = kernel.execute("%mesh use pm")
    assert r.status == "ok" and "made with spawn_procs" in r.stream(), r.error_text()
    r = kernel.execute("%%mesh\nrank * 10")
    assert r.status == "ok" and "10" in r.result_text(), r.error_text()
    r = kernel.execute("st = %mesh status\nprint(repr(st))")
    assert "mesh 'pm'" in r.stream(), r.error_text()
    r = kernel.execute("%mesh stop")
    assert r.status == "ok", r.error_text()
    r = kernel.execute("print(pm.root._stopped)")
    assert r.stream().strip() == "True"
    r = kernel.execute("%mesh use pm")
    assert r.status == "error" and "holds a stopped mesh" in r.reply["content"]["evalue"]
    wait_for(lambda: not worker_pids(kernel.pid), 10, what="workers gone after %mesh stop")
