"""The guardian (monarch_kernel.launchers.guard) with a stand-in controller and
stand-in workers: plain processes, no mesh."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import psutil

from monarch_kernel.launchers.guard import Guardian
from monarch_kernel.testing.kernel import wait_for

#: a stand-in worker: ignores SIGTERM in C (no Python handler would run while
#: the GIL is held), starts a child, a grandchild and a child in a group of its
#: own, prints their pids, then holds the GIL
WORKER = r"""
import os, signal, subprocess, sys
signal.signal(signal.SIGTERM, signal.SIG_IGN)
kids = [subprocess.Popen(["sleep", "600"]),
        subprocess.Popen(["sh", "-c", "sleep 601 & sleep 602; :"]),
        subprocess.Popen(["sleep", "603"], preexec_fn=os.setpgrp)]
print(json.dumps([k.pid for k in kids]), flush=True)
sum(range(10**13))
""".replace("import os", "import json, os")

#: a stand-in controller: starts WORKER in a session of its own, has the guardian
#: watch it and touch files at its own end, prints the pids, then waits
CONTROLLER = r"""
import json, subprocess, sys, time
from monarch_kernel.launchers.guard import Guardian
g = Guardian(grace=float(sys.argv[2]))
w = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE,
                     start_new_session=True)
g.ensure()
g.watch([w.pid])
d = sys.argv[3]
g.on_exit("job", [["touch", d + "/term"]], [["touch", d + "/kill"]])
g.on_exit("gone", [["touch", d + "/dropped"]])
g.drop("gone")
kids = json.loads(w.stdout.readline())
print(json.dumps({"guard": g.pid, "worker": w.pid, "kids": kids}), flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _kill(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            psutil.Process(pid).kill()


def _descendants_of(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            out += [c.pid for c in psutil.Process(pid).children(recursive=True)]
    return out


def test_controller_killed_ends_a_gil_bound_worker_and_its_children(tmp_path):
    ctl = subprocess.Popen([sys.executable, "-c", CONTROLLER, WORKER, "1.0", str(tmp_path)],
                           stdout=subprocess.PIPE, text=True)
    pids: list[int] = [ctl.pid]
    try:
        info = json.loads(ctl.stdout.readline())  # type: ignore[union-attr]
        worker, kids, guard = info["worker"], info["kids"], info["guard"]
        kids = wait_for(lambda: len(d := _descendants_of([worker])) >= 5 and d, 10,
                        what="the worker's children")
        pids += [worker, guard, *kids]
        ctl.kill()
        ctl.wait(10)
        t0 = time.monotonic()
        wait_for(lambda: not any(_alive(p) for p in [worker, *kids]), 10,
                 what="worker and children gone")
        assert time.monotonic() - t0 < 10
        wait_for(lambda: not _alive(guard), 10, what="the guardian gone")
        assert (tmp_path / "term").exists() and (tmp_path / "kill").exists()
        assert not (tmp_path / "dropped").exists()
    finally:
        _kill(pids)
        ctl.wait(10)


def test_a_worker_that_ends_takes_its_children_along_and_close_runs_no_commands(tmp_path):
    g = Guardian(grace=1.0)
    w = subprocess.Popen([sys.executable, "-c", WORKER], stdout=subprocess.PIPE,
                         start_new_session=True)
    pids = [w.pid]
    try:
        json.loads(w.stdout.readline())  # type: ignore[union-attr]
        kids = wait_for(lambda: len(d := _descendants_of([w.pid])) >= 5 and d, 10,
                        what="the worker's children")
        pids += kids
        assert g.ensure() and not g.ensure()
        pids.append(g.pid)  # type: ignore[arg-type]
        g.watch([w.pid])
        g.on_exit("job", [["touch", str(tmp_path / "term")]])
        os.kill(w.pid, signal.SIGKILL)
        w.wait(10)
        wait_for(lambda: not any(_alive(p) for p in kids), 5, what="the children gone")
        assert _alive(g.pid)  # type: ignore[arg-type]
        g.close()
        assert g.pid is None and not (tmp_path / "term").exists()
    finally:
        _kill(pids)
        w.wait(10)
        g.close()


def test_a_guardian_that_died_is_started_again():
    g = Guardian()
    try:
        assert g.ensure()
        first = g.pid
        os.kill(first, signal.SIGKILL)  # type: ignore[arg-type]
        wait_for(lambda: g.proc.poll() is not None, 10, what="the guardian dead")  # type: ignore[union-attr]
        assert g.ensure() and g.pid != first
    finally:
        g.close()


#: a stand-in controller that has the guardian remove its private directory, then waits
DIR_OWNER = r"""
import sys, time
from monarch_kernel.launchers.guard import Guardian
g = Guardian(grace=0.5)
g.remove_on_exit(sys.argv[1] + "/not-ours")  # (a name private_dir never makes: ignored)
g.remove_on_exit(sys.argv[2])  # (told before the guardian starts: sent when it does)
g.ensure()
print(g.pid, flush=True)
if sys.argv[3] == "close":
    g.close()
    print("closed", flush=True)
time.sleep(600)
"""


def test_a_killed_controllers_private_directory_is_removed_by_its_guardian(tmp_path):
    own = tmp_path / f"mk-{os.getpid()}-test"
    other = tmp_path / "not-ours"
    for d in (own, other):
        d.mkdir()
        (d / "up").write_text("")
    ctl = subprocess.Popen([sys.executable, "-c", DIR_OWNER, str(tmp_path), str(own), "kill"],
                           stdout=subprocess.PIPE)
    guard = int(ctl.stdout.readline())  # type: ignore[union-attr]
    try:
        ctl.kill()  # SIGKILL: it cannot remove the directory itself
        ctl.wait(10)
        wait_for(lambda: not own.exists(), 10, what="the directory removed")
        wait_for(lambda: not _alive(guard), 10, what="the guardian gone")
        assert other.exists()
    finally:
        _kill([ctl.pid, guard])
        ctl.wait(10)


def test_a_closed_guardian_leaves_the_directory_to_its_controller(tmp_path):
    own = tmp_path / f"mk-{os.getpid()}-test"
    own.mkdir()
    ctl = subprocess.Popen([sys.executable, "-c", DIR_OWNER, str(tmp_path), str(own), "close"],
                           stdout=subprocess.PIPE)
    guard = int(ctl.stdout.readline())  # type: ignore[union-attr]
    try:
        assert ctl.stdout.readline() == b"closed\n"  # type: ignore[union-attr]
        wait_for(lambda: not _alive(guard), 10, what="the guardian gone")
        assert own.exists()  # (a controller still running removes it when it closes)
    finally:
        _kill([ctl.pid, guard])
        ctl.wait(10)


def test_a_detached_guardian_outlives_its_controller_until_squeue_forgets_the_job(
        tmp_path, monkeypatch):
    """The guardian of a detached Slurm mesh: the controller's end changes
    nothing; once squeue lists the job no more it removes the mesh's record
    and exits (a squeue that fails concludes nothing)."""
    done, record = tmp_path / "job-ended", tmp_path / "mesh.json"
    record.write_text('{"mesh_id": "m1"}')
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    squeue = bin_dir / "squeue"  # RUNNING until `done` exists; a failure first
    squeue.write_text(f"#!/bin/sh\n[ -e {tmp_path}/failed ] || "
                      f"{{ touch {tmp_path}/failed; echo down >&2; exit 1; }}\n"
                      f"[ -e {done} ] || echo RUNNING\n")
    squeue.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    g = Guardian(detached=True)
    g.ensure()
    g.watch_job("4242")
    g.remove_file_at_end(str(record), "m1")
    pid = g.pid
    g.release()  # the controller leaves
    time.sleep(5)  # two squeue rounds: a failure, then RUNNING
    assert psutil.pid_exists(pid) and record.exists()
    done.touch()
    wait_for(lambda: not record.exists(), 15, what="the record removed")
    wait_for(lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status()
             == psutil.STATUS_ZOMBIE, 10, what="the guardian gone")
