"""Failures are fast, clear and recoverable; nothing hangs or leaks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from monarch_kernel.testing.kernel import KernelSession, wait_for, worker_pids


@pytest.fixture(scope="module")
def ks(shared_kernel):
    return shared_kernel


def spawn(ks, args="3"):
    r = ks.execute(f"%mesh spawn {args}")
    assert r.status == "ok", r.error_text()


def timed(ks, code, timeout=60):
    t0 = time.monotonic()
    r = ks.execute(code, timeout=timeout)
    return r, time.monotonic() - t0


@pytest.mark.parametrize("how,expect", [
    ("os._exit(3)", "exited with code 3"),
    ("os.kill(os.getpid(), signal.SIGKILL)", "killed by SIGKILL"),
    ("import ctypes; ctypes.string_at(0)", "killed by SIGSEGV"),
])
def test_rank_death_fails_the_cell_fast_with_details(ks, how, expect):
    spawn(ks)
    code = textwrap.dedent(f"""\
        %%mesh
        import os, signal, time
        for i in range(3):
            print(f'line {{i}} of rank {{rank}}')
        if rank == 1:
            time.sleep(0.5)  # the others have printed (else their interrupt may come first)
            {how}
        time.sleep(20)
        """)
    r, took = timed(ks, code)
    assert r.status == "error"
    assert took < 10, took  # well before the survivors' 20 s sleep ends: they were stopped
    content = r.reply["content"]
    assert content["ename"] == "MeshFailure"
    text = r.error_text()
    assert "rank 1" in text and expect in text and "pid" in text
    assert "line 2 of rank 1" in text  # its last output is in the error
    out = r.stream()
    for rank in (0, 2):
        assert f"line 0 of rank {rank}" in out  # the others' output is kept
    r = ks.execute("%%mesh --ranks 0,2\nrank * 7")  # survivors were interrupted; they work
    assert r.status == "ok", r.error_text()
    assert "14" in r.result_text()


LATE = textwrap.dedent("""\
    import os, signal, time
    if rank == 1:
        time.sleep(0.3)
        os._exit(3)
    # this rank writes its line after rank 1 died, and cannot be interrupted before
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    time.sleep(1.0)
    print(f"late line of rank {rank}", flush=True)
    signal.signal(signal.SIGINT, previous)
    time.sleep(0.3)
    """)


def test_survivors_output_after_a_death_is_shown(ks):
    """What the other ranks print after a rank died, until they are interrupted,
    still reaches the failed cell."""
    spawn(ks)
    r, took = timed(ks, "%%mesh\n" + LATE)
    assert r.status == "error" and "exited with code 3" in r.error_text()
    out = r.stream()
    assert "late line of rank 0" in out and "late line of rank 2" in out, out
    assert took < 10


def test_survivors_output_after_a_death_is_shown_in_scripts(capfd):
    from monarch_kernel import MeshFailure, spawn_procs

    procs = spawn_procs(3)
    try:
        with pytest.raises(MeshFailure, match="exited with code 3"):
            procs.exec(LATE, timeout=60)
    finally:
        procs.stop()
    out = capfd.readouterr().out
    assert "late line of rank 0" in out and "late line of rank 2" in out, out


def test_output_written_just_before_death_is_not_lost(ks):
    spawn(ks, "2")
    r = ks.execute("%%mesh --ranks 1\nimport os, sys\nfor i in range(200):\n"
                   "    print('seq', i)\nos.write(1, b'raw last words\\n')\nos._exit(7)")
    assert r.status == "error"
    out = r.stream()
    assert all(f"[1] seq {i}\n" in out for i in range(200))
    assert "[1] raw last words" in out


def test_collective_on_survivors_does_not_hang(ks):
    spawn(ks, "3 --dist gloo")
    r, took = timed(ks, "%%mesh\nimport os\nif rank == 2:\n    os._exit(1)\n"
                        "t = torch.ones(1)\ndist.all_reduce(t)\nt")
    assert r.status == "error" and took < 10
    assert "rank 2" in r.error_text() and "exited with code 1" in r.error_text()


def test_restart_replaces_a_dead_rank_and_reruns_dist_setup(ks):
    spawn(ks, "3 --dist gloo")
    r = ks.execute("%%mesh\nimport os\nif rank == 1:\n    os._exit(3)")
    assert r.status == "error"
    r = ks.execute("%%mesh\nrank")
    assert r.status == "error" and "%mesh restart 1" in r.error_text()
    r = ks.execute("%mesh restart 1")
    assert r.status == "ok", r.error_text()
    r = ks.execute("%%mesh\nt = torch.ones(1) * (rank + 1)\ndist.all_reduce(t)\nt.item()")
    assert r.status == "ok", r.error_text()
    assert r.result_text().count("6.0") == 3


def test_restart_a_live_rank_gives_a_fresh_process(ks):
    spawn(ks, "2")
    ks.execute("%%mesh\nimport os\nmine = os.getpid()")
    before = ks.execute("vm = %mesh pull mine\nprint(vm.values())").stream()
    assert ks.execute("%mesh restart 0").status == "ok"
    r = ks.execute("%%mesh\n'mine' in dir()")
    assert "False" in r.result_text() and "True" in r.result_text()  # rank 0 is new
    after = ks.execute("%%mesh --ranks 0\nimport os\nos.getpid()").result_text()
    assert str(eval(before)[0]) not in after


def test_automatic_restart_on_failure_with_a_budget(ks):
    spawn(ks, "2 --restart on-failure --max-restarts 1")
    r = ks.execute("%%mesh --ranks 1\nimport os\nos._exit(4)")
    assert r.status == "error" and "exited with code 4" in r.error_text()
    r = ks.execute("%%mesh\nrank + 10", timeout=60)  # waits for the restarted rank
    assert r.status == "ok", r.error_text()
    assert "11" in r.result_text()
    ks.execute("%%mesh --ranks 1\nimport os\nos._exit(4)")
    time.sleep(0.5)
    r = ks.execute("%%mesh\nrank")
    assert r.status == "error" and "%mesh restart 1" in r.error_text()  # budget spent


def test_timeout_interrupts_a_stuck_cell(ks):
    spawn(ks, "2")
    r, took = timed(ks, "%%mesh --timeout 1\nimport time\ntime.sleep(60)")
    assert r.status == "error"
    assert took < 30, took  # well before the cell's 60 s sleep ends
    assert "timed out after 1 s" in r.stream("stderr")
    assert ks.execute("%%mesh\nrank").status == "ok"


def test_rank_ignoring_sigint_is_killed_after_5_s(ks):
    spawn(ks, "2")
    msg_id = ks.kc.execute("%%mesh\nimport signal, time\nif rank == 1:\n"
                           "    signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
                           "while True:\n    time.sleep(0.01)")
    time.sleep(1.0)
    t0 = time.monotonic()
    ks.interrupt()
    reply, stderr, idle = None, "", False
    took = None
    deadline = time.monotonic() + 20
    # the reply may come before the cell's last output: read iopub up to its idle status
    while (reply is None or not idle) and time.monotonic() < deadline:
        try:
            m = ks.kc.get_iopub_msg(timeout=0.2)
            if m["parent_header"].get("msg_id") == msg_id:
                if m["msg_type"] == "stream":
                    stderr += m["content"]["text"]
                elif m["msg_type"] == "status" and m["content"]["execution_state"] == "idle":
                    idle = True
        except Exception:  # noqa: BLE001 - queue.Empty
            pass
        try:
            rep = ks.kc.get_shell_msg(timeout=0.01)
            if rep["parent_header"].get("msg_id") == msg_id:
                reply = rep
                took = time.monotonic() - t0
        except Exception:  # noqa: BLE001
            pass
    assert reply is not None and reply["content"]["status"] == "error"
    assert took is not None and took > 4.5, took  # not before its 5 s of grace (the
    # loop's 20 s deadline bounds it from above)
    shown = stderr + "\n".join(reply["content"].get("traceback", []))
    assert "rank 1 ignored the interrupt and was killed" in shown, shown
    time.sleep(0.5)
    while True:  # drain what is left of that cell's output
        try:
            ks.kc.get_iopub_msg(timeout=0.2)
        except Exception:  # noqa: BLE001
            break


def rank_pids(ks, n):
    r = ks.execute("%%mesh\nimport os\nprint('PID', rank, os.getpid())")
    assert r.status == "ok", r.error_text()
    pids = {}
    for line in r.stream("stdout").splitlines():
        if "PID" in line:
            _, rank, pid = line.split("PID", 1)[1].split(" ")
            pids[int(rank)] = int(pid)
    assert sorted(pids) == list(range(n)), r.stream()
    return pids


def gone(pid):
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


SURVIVORS = {
    # busy in C code holding the GIL: SIGINT cannot reach them
    "c-code": "sum(range(10**13))",
    # pure Python that ignores SIGINT
    "sig-ign": "signal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True:\n    pass",
}


@pytest.mark.parametrize("kind", list(SURVIVORS))
def test_survivors_that_do_not_stop_after_a_death_are_killed(ks, kind):
    """A rank dies while the others run code that SIGINT cannot stop: they are
    killed (the cell does not end while they still run it), the error names them
    and how to restart, and the next cell does not wait for them."""
    spawn(ks, "3")
    pids = rank_pids(ks, 3)
    code = ("%%mesh\nimport os, signal, time\nif rank == 1:\n    time.sleep(1.5)\n"
            "    os.kill(os.getpid(), signal.SIGKILL)\n" + SURVIVORS[kind])
    r, took = timed(ks, code, timeout=60)
    assert r.status == "error" and took < 30, took
    text = r.error_text()
    assert "rank 1" in text and "killed by SIGKILL" in text, text
    assert ("ranks 0, 2 did not stop after rank 1 died and were killed (they were running "
            "C code or ignored the interrupt); restart with  %mesh restart all") in text, text
    wait_for(lambda: all(gone(p) for p in pids.values()), 10,
             what="no rank still runs the failed cell")
    # the next cell fails at once, naming every dead rank
    r, took = timed(ks, "%%mesh\nprint('next cell')", timeout=30)
    assert r.status == "error" and took < 10, took
    assert "was killed by the mesh after it ignored the interrupt" in r.error_text()
    assert "Restart ranks 0-2 with  %mesh restart all" in r.error_text(), r.error_text()
    r = ks.execute("%mesh restart all", timeout=60)
    assert r.status == "ok", r.error_text()
    assert "restarted ranks 0-2 in " in r.stream(), r.stream()
    r, took = timed(ks, "%%mesh\nprint('next cell')", timeout=30)
    assert r.status == "ok", r.error_text()
    printed = set()  # (identical lines are grouped: "[0-2] next cell", "[0, 2] next cell")
    for line in r.stream().splitlines():
        tag, _, text = line.partition("] ")
        for part in tag.lstrip("[").split(",") if text == "next cell" else []:
            first, _, last = part.strip().partition("-")
            printed.update(range(int(first), int(last or first) + 1))
    assert printed == {0, 1, 2}, r.stream()


def test_a_killed_survivor_and_the_dead_rank_are_restarted_together(ks):
    """Only the survivor that ignored the interrupt is killed; the restart hint
    names it and the dead rank in a spec that %mesh restart accepts."""
    spawn(ks, "3")
    code = ("%%mesh\nimport os, signal, time\nif rank == 1:\n    time.sleep(1.0)\n"
            "    os._exit(3)\nif rank == 0:\n    signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
            "while True:\n    time.sleep(0.01)")
    r, took = timed(ks, code, timeout=60)
    assert r.status == "error" and took < 30, took
    text = r.error_text()
    assert "rank 2 was stopped because rank 1 died" in text, text
    assert ("rank 0 did not stop after rank 1 died and was killed (it was running C code or "
            "ignored the interrupt); restart with  %mesh restart 0,1") in text, text
    r = ks.execute("%%mesh\nrank")
    assert "Restart ranks 0, 1 with  %mesh restart 0,1  (or mesh.restart('0,1'))" in \
        r.error_text(), r.error_text()
    r = ks.execute("%mesh restart 0,1", timeout=60)
    assert r.status == "ok" and "restarted ranks 0, 1 in " in r.stream(), r.stream()
    r = ks.execute("%%mesh\nrank * 10", timeout=30)
    assert r.status == "ok" and "20" in r.result_text(), r.error_text()


def test_interrupt_that_kills_every_rank_names_them_all(ks):
    spawn(ks, "2")
    msg_id = ks.kc.execute("%%mesh\nsum(range(10**13))")
    time.sleep(1.0)
    ks.interrupt()
    deadline = time.monotonic() + 40
    reply = None
    while reply is None and time.monotonic() < deadline:
        rep = ks.kc.get_shell_msg(timeout=40)
        if rep["parent_header"].get("msg_id") == msg_id:
            reply = rep
    assert reply is not None and reply["content"]["status"] == "error"
    shown = "\n".join(reply["content"]["traceback"])
    assert "was killed by the mesh after it ignored the interrupt" in shown, shown
    assert ("ranks 0, 1 ignored the interrupt and were killed; restart with  "
            "%mesh restart all  (or mesh.restart())") in shown, shown
    ks.wait_idle(msg_id)
    r = ks.execute("%%mesh\nrank")
    assert "Restart ranks 0, 1 with  %mesh restart all" in r.error_text(), r.error_text()


def test_timeout_names_only_the_ranks_it_interrupted(ks):
    spawn(ks, "3")
    r = ks.execute("%%mesh --timeout 2\nimport time\nif rank != 0:\n    time.sleep(60)",
                   timeout=60)
    assert r.status == "error"
    assert "timed out after 2 s; ranks 1, 2 were interrupted" in r.stream("stderr"), r.stream()


def test_missed_heartbeats_detect_a_silent_remote_rank():
    from monarch_kernel.launchers.local import LocalLauncher
    from monarch_kernel.mesh.procmesh import spawn_procs

    class RemoteLike(LocalLauncher):  # local processes, supervised as if remote
        local = False

    m = spawn_procs(2, launcher=RemoteLike(), heartbeat=0.3)
    try:
        pid = m.controller.ranks[1].pid
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        req = m.run("import time; time.sleep(30)")
        from monarch_kernel.errors import MeshFailure

        with pytest.raises(MeshFailure, match="rank 1 .*stopped answering"):
            m.collect(req, timeout=10)
        # found by missed heartbeats (3 x 0.3 s), well inside collect's 10 s
        assert time.monotonic() - t0 < 10 / 2
    finally:
        os.kill(pid, signal.SIGKILL)
        m.stop()


def test_kernel_restart_leaves_no_worker():
    ks = KernelSession()
    try:
        assert ks.execute("%mesh spawn 2").status == "ok"
        old = worker_pids(ks.pid)
        assert len(old) == 2
        ks.km.restart_kernel(now=False)
        ks.kc.wait_for_ready(timeout=60)
        wait_for(lambda: not any(psutil.pid_exists(p) for p in old), 10,
                 what="workers gone after kernel restart")
    finally:
        ks.shutdown()


def test_controller_script_exit_stops_workers(tmp_path):
    script = tmp_path / "driver.py"
    script.write_text("import os\nfrom monarch_kernel import this_host\n"
                      "m = this_host().spawn_procs(per_host={'procs': 2})\n"
                      "print(os.getpid(), m.exec('rank').values(), flush=True)\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    pid, values = out.stdout.split(" ", 1)
    assert values.strip() == "[0, 1]"
    wait_for(lambda: not worker_pids(int(pid)), 10, what="workers gone after the script")
