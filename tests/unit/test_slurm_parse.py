"""Reading Slurm's output across versions, and what the launcher submits.

No Slurm needed: the parsers get recorded output shapes of Slurm 22.05
(JSON and columns) and the JSON shape of 23.x/24.x; the submission is
checked by replacing the launcher's command runner.
"""

from __future__ import annotations

import argparse
import getpass
import json
import subprocess
import types

import pytest
from IPython.core.error import UsageError

from monarch_kernel.kernel.magics import slurm_options
from monarch_kernel.launchers import get_launcher
from monarch_kernel.launchers.base import LaunchSpec
from monarch_kernel.launchers.slurm import (
    SlurmLauncher,
    decode_exit,
    parse_scontrol_job,
    parse_squeue_columns,
    parse_squeue_json,
)
from monarch_kernel.launchers.slurm_cli import JobQuery


def test_decode_exit_spellings():
    assert decode_exit(0) == 0
    assert decode_exit(768) == 3  # wait status (22.05 JSON)
    assert decode_exit(15) == -15  # killed by SIGTERM
    assert decode_exit("3:0") == 3
    assert decode_exit("0:9") == -9
    assert decode_exit({"status": ["EXITED"], "return_code": {"set": True, "number": 3},
                        "signal": {"id": {"set": False, "number": 0}, "name": ""}}) == 3
    assert decode_exit({"status": "SIGNALED", "return_code": 0,
                        "signal": {"signal_id": 9, "name": "KILL"}}) == -9
    assert decode_exit({"set": True, "number": 2}) == 2
    assert decode_exit(None) is None and decode_exit("garbage") is None


def test_squeue_json_22_05_and_24_shapes():
    old = {"meta": {}, "errors": [], "jobs": [
        {"job_id": 1, "job_state": "COMPLETED", "state_reason": "None", "nodes": "vm",
         "exit_code": 0},
        {"job_id": 2, "job_state": "PENDING", "state_reason": "Resources", "nodes": "",
         "exit_code": 0}]}
    info = parse_squeue_json(json.dumps(old), "2")  # squeue --json ignored --jobs here
    assert (info.state, info.reason, info.active) == ("PENDING", "Resources", True)
    new = {"jobs": [{"job_id": 7, "job_state": ["RUNNING"], "state_reason": "None",
                     "nodes": "n[01-02]", "exit_code": {"status": ["SUCCESS"],
                                                        "return_code": {"set": True,
                                                                        "number": 0}}}]}
    info = parse_squeue_json(json.dumps(new), "7")
    assert (info.state, info.nodes, info.exit_code) == ("RUNNING", "n[01-02]", 0)
    assert parse_squeue_json(json.dumps(new), "8") is None
    with pytest.raises(ValueError):
        parse_squeue_json("squeue: error: unrecognized option '--json'", "7")


def test_squeue_columns_and_scontrol():
    info = parse_squeue_columns("  12|PENDING|BeginTime|\n", "12")
    assert (info.state, info.reason, info.nodes) == ("PENDING", "BeginTime", "")
    assert parse_squeue_columns("", "12") is None
    text = ("JobId=4 JobName=wrap UserId=root(0) JobState=FAILED Reason=NonZeroExitCode "
            "Dependency=(null) ExitCode=3:0 NodeList=vm BatchHost=vm")
    info = parse_scontrol_job(text, "4")
    assert (info.state, info.exit_code, info.nodes, info.active) == ("FAILED", 3, "vm", False)
    assert parse_scontrol_job("JobId=5 JobState=CANCELLED ExitCode=0:15", "5").exit_code == -15


class _Recorder(SlurmLauncher):
    """A SlurmLauncher whose commands are recorded instead of run."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.calls = []

    def _run(self, cmd, timeout=30.0, input=None, env=None):
        self.calls.append((cmd, input, env))
        return subprocess.CompletedProcess(cmd, 0, stdout="4242\n", stderr="")


class _AliveThread:
    """Stands in for the watcher thread (nothing to watch here)."""

    def is_alive(self):
        return True


def _spec(shape):
    return LaunchSpec("tcp://10.0.0.1:5555", b"\x01" * 32, shape,
                      list(range(shape["hosts"] * shape["procs"])))


def test_sbatch_submission_keeps_the_key_out_of_argv_and_script(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    la = _Recorder(partition="gpu", time="30", account="proj", gpus_per_node=4,
                   extra_args="--qos=high")
    la._watcher = _AliveThread()
    la.launch(_spec({"hosts": 2, "procs": 4}))
    cmd, script, env = la.calls[0]
    key = (b"\x01" * 32).hex()
    assert cmd[0] == "sbatch" and key not in " ".join(cmd) and key not in script
    assert env["MONARCH_MESH_KEY"] == key  # through the job's environment
    for arg in ("--nodes=2", "--ntasks=8", "--ntasks-per-node=4", "--partition=gpu",
                "--time=30", "--account=proj", "--gpus-per-node=4", "--qos=high",
                "--export=ALL"):
        assert arg in cmd
    assert "srun" in script and "SLURM_PROCID" in script and "--distribution=block" in script
    assert la.placements()[7].job == "4242"


def test_key_file_and_packing_onto_fewer_nodes(monkeypatch, tmp_path):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    la = _Recorder(nodes=1, key_dir=str(tmp_path))
    la._watcher = _AliveThread()
    la.launch(_spec({"hosts": 2, "procs": 2}))
    cmd, script, env = la.calls[0]
    assert "--nodes=1" in cmd and "--ntasks=4" in cmd
    assert not any(a.startswith("--ntasks-per-node") for a in cmd)
    assert "MONARCH_MESH_KEY" not in env
    (keyfile,) = tmp_path.iterdir()
    assert oct(keyfile.stat().st_mode & 0o777) == "0o600"
    assert str(keyfile) in script and keyfile.read_text() not in script


def test_magic_options_and_launcher_names():
    ns = argparse.Namespace(launcher="slurm", partition="p", time="1:00:00", account=None,
                            gpus_per_node=2, nodes=None, sbatch="--qos=high --exclusive")
    assert slurm_options(ns) == {"partition": "p", "time": "1:00:00", "gpus_per_node": 2,
                                 "extra_args": ["--qos=high", "--exclusive"]}
    ns.launcher = "local"
    with pytest.raises(UsageError, match="need --launcher slurm"):
        slurm_options(ns)
    assert isinstance(get_launcher("monarch_kernel.launchers.slurm:SlurmLauncher"),
                      SlurmLauncher)
    with pytest.raises(ValueError, match="not a Launcher"):
        get_launcher("json:dumps")
    with pytest.raises(ValueError, match="unknown launcher"):
        get_launcher("kubernetes")


def _fake_run(answers):
    """A command runner answering by the command's first two words."""
    calls = []

    def run(cmd, timeout=30.0, input=None, env=None):
        calls.append(cmd)
        for prefix, (rc, out, err) in answers.items():
            if " ".join(cmd).startswith(prefix):
                return subprocess.CompletedProcess(cmd, rc, out, err)
        raise AssertionError(f"unexpected command {cmd}")

    return run, calls


def test_job_query_falls_back_to_columns_without_json():
    run, calls = _fake_run({
        "squeue --json": (1, "", "squeue: unrecognized option '--json'"),
        "squeue -h": (0, "12|RUNNING|None|n01\n", ""),
    })
    q = JobQuery(run)
    assert q("12").state == "RUNNING" and q.json is False
    assert q("12").nodes == "n01"
    assert sum(c[1] == "--json" for c in calls) == 1  # asked once, then columns only


def test_job_query_unknown_is_not_gone_and_forgotten_is():
    run, _ = _fake_run({
        "squeue --json": (1, "", "slurm_load_jobs error: Unable to contact slurm controller"),
    })
    q = JobQuery(run)
    q.json = True
    assert q("12") is None  # slurmctld unreachable: conclude nothing
    run, _ = _fake_run({
        "squeue --json": (1, "", "slurm_load_jobs error: Invalid job id specified"),
        "scontrol show job": (1, "", "slurm_load_jobs error: Invalid job id specified"),
        "sacct": (1, "", "Slurm accounting storage is disabled"),
    })
    assert JobQuery(run)("12").state == "GONE"
    run, _ = _fake_run({
        "squeue --json": (0, '{"jobs": []}', ""),
        "scontrol show job": (0, "JobId=12 JobState=TIMEOUT Reason=TimeLimit ExitCode=0:15", ""),
    })
    info = JobQuery(run)("12")
    assert (info.state, info.exit_code, info.active) == ("TIMEOUT", -15, False)


def test_job_table_one_squeue_for_every_job_of_the_user():
    from monarch_kernel.launchers.slurm_cli import JobTable, parse_squeue_table

    text = "12|RUNNING|None|n01\n13|PENDING|Resources|\nsqueue: warning: x\n14|COMPLETING|None|n2\n"
    table = parse_squeue_table(text)
    assert sorted(table) == ["12", "13", "14"]
    assert (table["13"].state, table["13"].reason) == ("PENDING", "Resources")
    run, calls = _fake_run({"squeue -h -u 1234 -o": (0, text, ""),
                            "squeue -h -s -u 1234": (0, "12.0\n12.batch\n", "")})
    jobs = JobTable(run, user=1234, ttl=60)
    assert jobs.get("12").nodes == "n01" and jobs.alive("12") is True
    assert jobs.alive("13") is True  # queued: alive, not attachable yet
    assert jobs.alive("14") is False  # ending
    assert jobs.get("99").state == "GONE" and jobs.alive("99") is False
    assert jobs.alive("") is False and jobs.alive(None) is False
    assert jobs.alive("12.0") is True and jobs.alive("12.1") is False  # a step of an allocation
    assert len(calls) == 2  # one squeue for the jobs, one for the steps, then the cache
    jobs.clear()
    jobs.alive("12")
    assert len(calls) == 3


def test_job_table_concludes_nothing_when_slurm_cannot_be_asked():
    from monarch_kernel.launchers.slurm_cli import JobTable

    run, _ = _fake_run({"squeue": (1, "", "slurm_load_jobs error: Unable to contact slurm "
                                          "controller (connect failure)")})
    assert JobTable(run, user=0).alive("12") is None

    def missing(cmd, timeout=10.0):
        raise FileNotFoundError(cmd[0])

    assert JobTable(missing).get("12") is None

    def slow(cmd, timeout=10.0):
        raise subprocess.TimeoutExpired(cmd, timeout)

    assert JobTable(slow).alive("12") is None


def test_a_detached_job_is_never_cancelled_with_its_controller(monkeypatch, tmp_path):
    """No guardian entry cancels a detached job; its script removes its own files."""
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    la = _Recorder(key_dir=str(tmp_path), output="/tmp/out-%u-%j.txt")
    la._watcher = _AliveThread()
    la.make_detachable(types.SimpleNamespace(keep_alive=60, output_bytes=1000,
                                             mesh_dir=None, record="/r/x.json", mesh_id="m1"))
    told = []
    la.guard.ensure = lambda: False  # (no guardian process in a unit test)
    la.guard._write = told.append
    la.launch(_spec({"hosts": 1, "procs": 2}))
    cmd, script, _ = la.calls[0]
    # the mesh's own guardian: it cancels nothing, it cleans up once the job is gone
    assert la.guard.detached and told == ["job 4242"]
    assert not any("scancel" in line for line in la.guard._onexit.values())
    assert la.units[0].detached
    (keyfile,) = tmp_path.iterdir()
    assert "trap cleanup EXIT" in script and "exec srun" not in script
    assert f'/tmp/out-{getpass.getuser()}-"$SLURM_JOB_ID".txt' in script
    assert str(keyfile) in script
    assert "MONARCH_ATTACH_ENDPOINT=" in script and "tcp://*:0" in script
    assert "MONARCH_DETACH_KEEP_ALIVE=60.0" in script
    assert la.mesh_job() == "4242"
    # the script, run by bash with srun standing for a step that ends: files gone
    out = tmp_path / "out-7.txt"
    out.write_text("x")
    fake = script.replace("srun --job-name", "true --job-name").replace(
        f"/tmp/out-{getpass.getuser()}-", f"{tmp_path}/out-")
    subprocess.run(["bash", "-c", fake], env={"SLURM_JOB_ID": "7", "PATH": "/usr/bin:/bin"},
                   check=True, timeout=30)
    assert not out.exists() and not keyfile.exists()
    la.release()
    assert la._closing.is_set() and la.guard.proc is None


def test_an_attached_job_is_guarded_as_before(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    la = _Recorder()
    la._watcher = _AliveThread()
    la.guard.ensure = lambda: False  # (no guardian process in a unit test)
    la.guard._write = lambda line: None
    la.launch(_spec({"hosts": 1, "procs": 2}))
    _, script, _ = la.calls[0]
    assert "exec srun" in script and "trap" not in script
    assert list(la.guard._onexit) == [la.units[0].step_name]
    la.release()  # a mesh detached later: its job is no longer cancelled at exit
    assert not la.guard._onexit


class _Running(_Recorder):
    """Slurm lists job 77 as running until it is cancelled."""

    def _run(self, cmd, timeout=30.0, input=None, env=None):
        self.calls.append((cmd, input, env))
        cancelled = any(c[0][0] == "scancel" for c in self.calls)
        if cmd[:2] == ["squeue", "-h"] and not cancelled:
            return subprocess.CompletedProcess(cmd, 0, stdout="77|RUNNING|None|n1\n", stderr="")
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr="Invalid job id specified")


def test_adopt_takes_over_a_running_job_or_one_step_of_an_allocation():
    la = _Running()
    la._query.json = False
    la._watcher = _AliveThread()
    la.adopt("77", [0, 1])
    assert {p.job for p in la.placements().values()} == {"77.0"}
    assert la.mesh_job() == "77"
    la.stop()
    assert ["scancel", "77"] in [c[0] for c in la.calls]
    assert la.guard.proc is None
    la = _Recorder()
    la._watcher = _AliveThread()
    la.adopt("80.3", [0])
    assert la.mesh_job() == "80.3"
    la.signal([0])
    assert ["scancel", "--signal=INT", "80.3"] in [c[0] for c in la.calls]  # never the job
    with pytest.raises(ValueError, match="not a Slurm job id"):
        la.adopt("x; rm -rf /", [0])


def test_a_task_whose_keep_alive_passed_cancels_what_is_left(tmp_path):
    """A detached task runs its worker (no exec) and, on the keep-alive exit
    code only, the cancel command; it exits with the worker's code."""
    from monarch_kernel.launchers.slurm_job import task_script
    from monarch_kernel.wire.messages import EXIT_KEEP_ALIVE

    spec = _spec({"hosts": 1, "procs": 2})
    marker = tmp_path / "cancelled"
    for code, cancelled in ((EXIT_KEEP_ALIVE, True), (0, False), (3, False)):
        fake = tmp_path / "python"
        fake.write_text(f"#!/bin/sh\nexit {code}\n")
        fake.chmod(0o755)
        script = task_script(spec, [0, 1], None, str(fake), {"A": "b"},
                             on_keep_alive=f"touch {marker}")
        assert "exec " not in script
        cp = subprocess.run(["bash", "-c", script], env={"SLURM_PROCID": "1", "PATH":
                            "/usr/bin:/bin"}, check=False, timeout=30)
        assert cp.returncode == code and marker.exists() == cancelled
        marker.unlink(missing_ok=True)
    assert "exec " in task_script(spec, [0, 1], None, None)  # an ordinary mesh: as before


def test_the_registry_asks_squeue_about_slurm_meshes(monkeypatch, tmp_path):
    """list_meshes: a Slurm record shows squeue's state; one whose job squeue no
    longer lists is removed; one squeue cannot answer for is kept."""
    import time

    from monarch_kernel.launchers import slurm
    from monarch_kernel.launchers.slurm_cli import JobTable
    from monarch_kernel.mesh import registry

    monkeypatch.setenv(registry.ENV, str(tmp_path / "reg"))
    for name, job in (("run", "12"), ("wait", "13"), ("gone", "14")):
        registry.save(registry.MeshRecord(
            name=name, user=0, host="login1", launcher="slurm", shape={"procs": 2},
            world_size=2, pids={}, endpoints={0: "tcp://10.0.0.5:1"}, key_hex="ab" * 32,
            created=time.time(), keep_alive=60.0, slurm_job=job))
    run, _ = _fake_run({"squeue -h -u": (0, "12|RUNNING|None|n1\n13|PENDING|Priority|\n", "")})
    monkeypatch.setattr(slurm, "_JOBS", JobTable(run, ttl=0))
    rows = {r.name: (r.state, r.slurm_job, r.job_state) for r in registry.list_meshes()}
    assert rows == {"run": ("detached", "12", "RUNNING"), "wait": ("detached", "13", "PENDING"),
                    "gone": ("gone", "14", "GONE")}
    assert [r.name for r in registry.records()] == ["run", "wait"]
    down, _ = _fake_run({"squeue": (1, "", "Unable to contact slurm controller")})
    monkeypatch.setattr(slurm, "_JOBS", JobTable(down, ttl=0))
    rows = {r.name: (r.state, r.job_state) for r in registry.list_meshes()}
    assert rows == {"run": ("detached", None), "wait": ("detached", None)}
