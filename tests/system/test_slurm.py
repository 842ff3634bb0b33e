"""Meshes through a real Slurm (a one-node cluster on this host).

The cluster is the one ``.ci/run`` started (``SLURM_CONF`` set), or one these
tests start with ``scripts/slurm_ci.sh start`` and stop afterwards. They skip,
saying why, only when that is impossible: not root, or no apt-get to install
Slurm. On the one node, a ``2x2`` mesh asks for ``--nodes 1``: Slurm puts the
two "hosts" (4 tasks, ``-N1 -n4``) on the same node, ranks still host-major.
"""

from __future__ import annotations

import contextlib
import getpass
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from monarch_kernel.testing.kernel import KernelSession, is_worker_cmdline, wait_for

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "slurm_ci.sh"


def _sh(*cmd: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def _slurm_up() -> bool:
    try:
        cp = _sh("sinfo", "-h", "-o", "%t", timeout=15)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return cp.returncode == 0 and any(s.strip("*~#") in ("idle", "mix", "alloc")
                                      for s in cp.stdout.split())


@pytest.fixture(scope="module")
def slurm():
    """A running Slurm: the one in SLURM_CONF, else a one-node cluster started here."""
    saved = {k: os.environ.get(k) for k in ("SLURM_CONF", "MONARCH_SLURM_DIR", "PATH")}
    started = None
    os.environ["PATH"] = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"
    if not (os.environ.get("SLURM_CONF") and _slurm_up()):
        if os.geteuid() != 0:
            pytest.skip("Slurm tests need root to start a one-node cluster "
                        "(scripts/slurm_ci.sh), or SLURM_CONF of a running one")
        if shutil.which("sbatch") is None and shutil.which("apt-get") is None:
            pytest.skip("Slurm is not installed and apt-get is not available to install it")
        cp = subprocess.run(["bash", str(SCRIPT), "start"], check=False, capture_output=True,
                            text=True,
                            timeout=900, stdin=subprocess.DEVNULL)
        if cp.returncode in (2, 3):  # not root / apt-get cannot install
            pytest.skip("cannot set up Slurm: " + (cp.stderr.strip().splitlines() or ["?"])[-1])
        assert cp.returncode == 0, f"scripts/slurm_ci.sh start failed:\n{cp.stderr[-3000:]}"
        for key, value in re.findall(r"^export (\w+)=(\S+)$", cp.stdout, re.MULTILINE):
            os.environ[key] = value
        started = os.environ["MONARCH_SLURM_DIR"]
    os.environ.pop("SLURM_JOB_ID", None)  # submit jobs, even if pytest runs inside one
    try:
        yield
    finally:
        if started:
            subprocess.run(["bash", str(SCRIPT), "stop", started], check=False, timeout=180,
                           stdin=subprocess.DEVNULL)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _jobs(name: str | None = None) -> list[str]:
    """Ids of jobs Slurm still lists (pending, running, completing)."""
    return _sh("squeue", "-h", "-o", "%i", *(["-n", name] if name else [])).stdout.split()


def _job_gone(job: str) -> bool:
    return job not in _jobs()


@pytest.fixture(scope="module")
def sk(slurm):
    """One kernel for the tests that leave it usable."""
    ks = KernelSession()
    try:
        yield ks
    finally:
        ks.shutdown()


@pytest.fixture(autouse=True)
def _nothing_left(slurm):
    """Every monarch job a test submitted is gone when it ends."""
    before = set(_jobs("monarch"))
    yield
    wait_for(lambda: not set(_jobs("monarch")) - before, 60,
             what="the test's Slurm jobs gone")


def _ok(ks: KernelSession, code: str, timeout: float = 120):
    r = ks.execute(code, timeout=timeout)
    assert r.status == "ok", f"{code!r}:\n{r.error_text()}\n{r.stream()}"
    return r


def _workers_of(address: str) -> list[int]:
    out = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = p.info.get("cmdline") or []
        if is_worker_cmdline(cmd) and address in cmd:
            out.append(p.info["pid"])
    return out


def test_1x2_cell_status_and_stop(sk):
    r = _ok(sk, "%mesh spawn 1x2 --launcher slurm")
    job = re.search(r"job (\d+) RUNNING on (\S+)", r.stream())
    assert job, r.stream()
    job, node = job.groups()
    r = _ok(sk, "%%mesh\nimport os, socket\n"
                "(rank, os.environ['SLURM_JOB_ID'], os.environ['SLURM_PROCID'], "
                "socket.gethostname())")
    for rank in (0, 1):
        assert f"({rank}, '{job}', '{rank}', '{node}')" in r.result_text()
    status = _ok(sk, "%mesh status").result_text()
    assert "job" in status
    assert len(re.findall(rf"\b{job}\.0\b", status)) == 2, status  # job.step per rank
    assert len(re.findall(rf"\b{re.escape(node)}\b", status)) == 2, status
    address = _ok(sk, "mesh.controller.address").result_text().strip("'")
    key = _ok(sk, "mesh.controller.key.hex()").result_text().strip("'")
    pids = _workers_of(address)
    assert len(pids) == 2
    # the key is in no process's argv and not in the batch script Slurm keeps
    for p in psutil.process_iter(["cmdline"]):
        assert key not in " ".join(p.info.get("cmdline") or [])
    script = _sh("scontrol", "write", "batch_script", job, "-").stdout
    assert "srun" in script and key not in script
    r = _ok(sk, "%mesh stop")
    assert "stopped" in r.stream()
    assert _job_gone(job)  # stop returns once squeue lists the job no more
    assert not _workers_of(address)


def test_pending_job_shows_its_state_and_interrupt_cancels_it(sk):
    seen = []

    def on_message(msg):
        if msg["msg_type"] == "stream" and "PENDING (BeginTime)" in msg["content"]["text"]:
            if not seen:
                sk.interrupt()
            seen.append(msg["content"]["text"])

    r = sk.execute("%mesh spawn 1x1 --launcher slurm --sbatch=--begin=now+1hour",
                   timeout=120, on_message=on_message)
    assert seen, r.stream()
    assert r.status == "error" and "SpawnInterrupted: spawn interrupted" in r.error_text()
    job = re.search(r"job (\d+) PENDING \(BeginTime\)", r.stream()).group(1)
    assert f"job {job} cancelled while PENDING" in r.stream()
    assert _job_gone(job)
    # the kernel is still usable, and bad Slurm input is a one-line error
    r = sk.execute("%mesh spawn 2 --launcher slurm --partition no_such_partition")
    assert r.status == "error"
    assert "sbatch refused the job" in r.error_text()
    assert "Invalid partition" in r.error_text()


def test_2x2_on_one_node_then_restart_and_shutdown_cancel_the_jobs(slurm):
    ks = KernelSession()
    try:
        r = _ok(ks, "%mesh spawn 2x2 --launcher slurm --nodes 1")
        job = re.search(r"job (\d+) RUNNING", r.stream()).group(1)
        r = _ok(ks, "%%mesh\nimport os\n(rank, int(os.environ['SLURM_PROCID']), "
                    "os.environ['SLURM_NTASKS'], os.environ['SLURM_JOB_NUM_NODES'])")
        text = r.result_text()
        assert "{'hosts': 2, 'procs': 2}" in text
        for rank in range(4):  # host-major: rank == SLURM_PROCID with block distribution
            assert f"({rank}, {rank}, '4', '1')" in text, text
        status = _ok(ks, "%mesh status").result_text()
        assert len(re.findall(rf"\b{job}\.0\b", status)) == 4, status
        ks.km.restart_kernel(now=False)
        ks.kc.wait_for_ready(timeout=60)
        wait_for(lambda: _job_gone(job), 30, what=f"job {job} cancelled by the restart")
        r = _ok(ks, "%mesh spawn 1x1 --launcher slurm")
        job = re.search(r"job (\d+) RUNNING", r.stream()).group(1)
        _ok(ks, "%%mesh\nrank")
    finally:
        ks.shutdown()
    wait_for(lambda: _job_gone(job), 30, what=f"job {job} cancelled by the shutdown")


ALLOC_DRIVER = r'''
import os, subprocess
from monarch_kernel.mesh.procmesh import spawn_procs
job = os.environ["SLURM_JOB_ID"]
m = spawn_procs(2, launcher="slurm", timeout=60)
code = "import os\n(os.environ['SLURM_JOB_ID'], os.environ['SLURM_STEP_ID'])"
print("VALUES", m.exec(code).values())
print("PLACEMENTS", sorted({p.job for p in m.launcher.placements().values()}))
m.stop()
print("STEPS", subprocess.run(["squeue", "-h", "-s", "-j", job, "-o", "%i"],
                              check=False, capture_output=True, text=True).stdout.split())
print("JOB", subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"],
                            check=False, capture_output=True, text=True).stdout.strip())
'''


def test_inside_an_allocation_steps_are_started_with_srun(slurm, tmp_path):
    driver = tmp_path / "driver.py"
    driver.write_text(textwrap.dedent(ALLOC_DRIVER))
    cp = subprocess.run(["salloc", "-n2", sys.executable, str(driver)], check=False,
                        capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL,
                        cwd=str(tmp_path))
    assert cp.returncode == 0, cp.stdout + cp.stderr
    out = dict(line.split(" ", 1) for line in cp.stdout.splitlines() if " " in line)
    job = re.search(r"Granted job allocation (\d+)", cp.stderr).group(1)
    values = eval(out["VALUES"])
    assert len(values) == 2 and {v[0] for v in values} == {job}
    step = values[0][1]
    assert eval(out["PLACEMENTS"]) == [f"{job}.{step}"]
    assert eval(out["STEPS"]) == []  # our step is gone ...
    assert out["JOB"] == "RUNNING"  # ... and the user's allocation was left alone


def test_a_job_that_fails_to_start_says_why(slurm, capsys):
    from monarch_kernel.errors import MeshFailure
    from monarch_kernel.mesh.procmesh import spawn_procs

    with pytest.raises(MeshFailure) as e:
        spawn_procs(2, launcher="slurm", timeout=60,
                    launcher_options={"python": "/nonexistent/python3"})
    assert "/nonexistent/python3: No such file or directory" in str(e.value)
    # seen while the job was still starting, or as the exit of its ranks
    assert "before its workers started" in str(e.value) or "while starting" in str(e.value)
    job = re.search(r"job (\d+) ", capsys.readouterr().out).group(1)
    assert not Path(f"/tmp/monarch-{getpass.getuser()}-{job}.out").exists()  # removed


def test_a_rank_stuck_in_c_code_ends_when_the_kernel_is_killed(slurm):
    """The kernel's guardian cancels the job: SIGTERM, then SIGKILL (a rank whose
    main thread holds the GIL cannot run its watchdog, nor a SIGTERM handler)."""
    ks = KernelSession()
    pids: list[int] = []
    try:
        r = _ok(ks, "%mesh spawn 1x2 --launcher slurm")
        job = re.search(r"job (\d+) RUNNING", r.stream()).group(1)
        address = _ok(ks, "mesh.controller.address").result_text().strip("'")
        pids = _workers_of(address)
        assert len(pids) == 2
        ks.kc.execute("%%mesh\nsum(range(10**13))")
        wait_for(lambda: psutil.Process(pids[0]).cpu_percent(0.3) > 20, 10,
                 what="rank 0 computing")
        os.kill(ks.pid, signal.SIGKILL)
        t0 = time.monotonic()
        wait_for(lambda: not _workers_of(address), 20, what="the ranks gone")
        took = time.monotonic() - t0
        print(f"over Slurm, GIL-bound ranks ended {took:.2f} s after the kernel's SIGKILL")
        assert took < 10.0
        wait_for(lambda: _job_gone(job), 30, what=f"job {job} cancelled")
        wait_for(lambda: not Path(f"/tmp/monarch-{getpass.getuser()}-{job}.out").exists(), 10,
                 what="the job's output file removed by the kernel's guardian")
    finally:
        for pid in pids:
            with contextlib.suppress(psutil.NoSuchProcess):
                psutil.Process(pid).kill()
        ks.kc.stop_channels()
        ks.km.cleanup_resources()


ALLOC_KILLED_DRIVER = r'''
import os, signal, threading, time
from monarch_kernel.mesh.procmesh import spawn_procs
m = spawn_procs(2, launcher="slurm", timeout=60)
pids = m.exec("import os\nos.getpid()").values()
deadline = time.monotonic() + 20
while m.launcher.units[0].step is None and time.monotonic() < deadline:
    time.sleep(0.1)
threading.Thread(target=lambda: m.exec("sum(range(10**13))"), daemon=True).start()
time.sleep(2)
print("PIDS", list(pids), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
'''


def test_inside_an_allocation_a_stuck_step_ends_when_its_controller_is_killed(slurm, tmp_path):
    driver = tmp_path / "driver.py"
    driver.write_text(ALLOC_KILLED_DRIVER)
    name = f"monarch-killed-{os.getpid()}"
    salloc = subprocess.Popen(["salloc", "-n2", "-J", name, "bash", "-c",
                               f"{sys.executable} {driver}; sleep 120"],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                              stdin=subprocess.DEVNULL, cwd=str(tmp_path))
    pids: list[int] = []
    try:
        line = salloc.stdout.readline()  # type: ignore[union-attr]
        assert line.startswith("PIDS"), line
        t0 = time.monotonic()
        pids = eval(line.split(" ", 1)[1])
        wait_for(lambda: not any(psutil.pid_exists(p) and psutil.Process(p).status()
                                 != psutil.STATUS_ZOMBIE for p in pids), 20,
                 what="the step's ranks gone")
        took = time.monotonic() - t0
        print(f"in an allocation, GIL-bound ranks ended {took:.2f} s after their "
              "controller's SIGKILL")
        assert took < 10.0
        assert _jobs(name)  # the user's allocation stays
    finally:
        for job in _jobs(name):
            _sh("scancel", job)
        for pid in pids:
            with contextlib.suppress(psutil.NoSuchProcess):
                psutil.Process(pid).kill()
        salloc.kill()
        salloc.wait(30)


# ------------------------------------------------------------------ detached meshes
DETACH_DRIVER = r'''
import json, os, signal, sys
from monarch_kernel import Actor, endpoint, spawn_procs
from monarch_kernel.mesh import registry

class Acc(Actor):
    def __init__(self):
        self.total = 0

    @endpoint
    def add(self, x):
        self.total += x
        return self.total

name, keep_alive, how = sys.argv[1], float(sys.argv[2]), sys.argv[3]
m = spawn_procs({"hosts": 1, "procs": 2}, launcher="slurm", name=name, detach=True,
                keep_alive=keep_alive, timeout=90)
m.exec("import os\ncounter = 10 * rank + 1")
acc = m.spawn("acc", Acc)
acc.add.call(5).get(timeout=60)
rec = registry.load(name)
print("INFO", json.dumps({"pids": m.exec("os.getpid()").values(), "job": rec.slurm_job,
                          "endpoints": rec.endpoints}), flush=True)
if how == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
if how == "stuck":  # rank 1 holds the GIL in C code: it cannot run its keep-alive check
    m.run("if rank == 1:\n    sum(range(10**13))")
m.detach()
'''


def _spawn_detached(tmp_path, name: str, keep_alive: float, how: str) -> dict:
    driver = tmp_path / "spawn_detached.py"
    driver.write_text(DETACH_DRIVER)
    cp = subprocess.run([sys.executable, str(driver), name, str(keep_alive), how],
                        check=False, capture_output=True, text=True, timeout=240,
                        stdin=subprocess.DEVNULL, cwd=str(tmp_path))
    line = [ln for ln in cp.stdout.splitlines() if ln.startswith("INFO ")]
    assert line, f"rc {cp.returncode}\n{cp.stdout}\n{cp.stderr[-3000:]}"
    import json

    info = json.loads(line[0].split(" ", 1)[1])
    if how == "kill":
        assert cp.returncode == -signal.SIGKILL, cp.stderr[-3000:]
    else:
        assert cp.returncode == 0, cp.stderr[-3000:]
    return info


def test_a_rank_stuck_in_c_code_is_cancelled_when_the_keep_alive_passes(
        slurm, tmp_path, registry_dir):
    """Rank 0 reaches the end of its keep-alive and cancels the job: rank 1,
    which holds the GIL in C code and cannot check its own, ends with it."""
    info = _spawn_detached(tmp_path, "sd-stuck", 5, "stuck")
    job, pids = info["job"], info["pids"]
    try:
        wait_for(lambda: psutil.Process(pids[1]).cpu_percent(0.3) > 20, 10,
                 what="rank 1 computing")
        wait_for(lambda: _job_gone(job), 90, what=f"job {job} cancelled after its keep-alive")
        wait_for(lambda: not any(psutil.pid_exists(p) for p in pids), 30, what="ranks gone")
        wait_for(lambda: not (registry_dir / "sd-stuck.json").exists(), 15,
                 what="the record removed by the mesh's guardian")
        assert not Path(f"/tmp/monarch-{getpass.getuser()}-{job}.out").exists()
    finally:
        if job in _jobs():
            _sh("scancel", job)


@pytest.fixture
def registry_dir(tmp_path, monkeypatch):
    """A registry of this test's own (the environment variable the registry reads)."""
    from monarch_kernel.mesh import registry

    path = tmp_path / "registry"
    monkeypatch.setenv(registry.ENV, str(path))
    return path


def _handshake(endpoint: str, server_key: bytes, client: tuple[bytes, bytes]) -> str:
    """The outcome of a CurveZMQ handshake with ``endpoint`` as client ``client``
    (public, secret): ``"succeeded"``, ``"refused"`` (the server's ZAP handler
    said no) or ``"none"`` (nothing within 5 s)."""
    import zmq
    from zmq.utils.monitor import recv_monitor_message

    ctx = zmq.Context()
    d = ctx.socket(zmq.DEALER)
    mon = d.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
    try:
        d.linger = 0
        d.curve_serverkey = server_key
        d.curve_publickey, d.curve_secretkey = client
        d.connect(endpoint)
        if not mon.poll(5000):
            return "none"
        event = recv_monitor_message(mon)["event"]
        return "succeeded" if event == zmq.EVENT_HANDSHAKE_SUCCEEDED else "refused"
    finally:
        d.disable_monitor()
        mon.close(0)
        d.close(0)
        ctx.term()


def _check_attach_endpoint_curve(rec) -> None:
    """Rank 0's attach endpoint completes a CurveZMQ handshake with the mesh's
    client key only: a stranger's key pair is refused by its ZAP handler."""
    import zmq

    from monarch_kernel.transport.sockets import curve_attach_keypair, curve_client_keypair

    key = bytes.fromhex(rec.key_hex)
    server = curve_attach_keypair(key)[0]
    assert _handshake(rec.endpoints[0], server, zmq.curve_keypair()) == "refused"
    assert _handshake(rec.endpoints[0], server, curve_client_keypair(key)) == "succeeded"


def test_a_detached_mesh_outlives_its_killed_controller_and_attach_finds_it(
        slurm, tmp_path, registry_dir):
    """Detach over Slurm: the controller is SIGKILLed, the job runs on; attach
    through the registry and squeue gives the same ranks, state and actor."""
    import monarch_kernel
    import monarch_kernel.launchers  # noqa: F401 - registers squeue liveness for Slurm records
    from monarch_kernel.mesh import registry

    info = _spawn_detached(tmp_path, "sd-kill", 300, "kill")
    job, pids = info["job"], info["pids"]
    try:
        assert all(e.startswith("tcp://") for e in info["endpoints"].values()), info
        time.sleep(2)  # longer than a heartbeat timeout would allow a guarded mesh
        assert job in _jobs() and all(psutil.pid_exists(p) for p in pids)
        (row,) = [r for r in registry.list_meshes() if r.name == "sd-kill"]
        assert (row.state, row.launcher, row.slurm_job, row.job_state) == (
            "detached", "slurm", job, "RUNNING"), row
        rec = registry.load("sd-kill")
        assert rec is not None and rec.guardian_pid and psutil.pid_exists(rec.guardian_pid)
        _check_attach_endpoint_curve(rec)
        t0 = time.monotonic()
        m = monarch_kernel.attach("sd-kill", timeout=30)
        took = time.monotonic() - t0
        print(f"attach to a detached 2-rank Slurm mesh took {took:.2f} s")
        assert took < 30.0
        try:
            assert m.exec("os.getpid()").values() == pids
            assert m.exec("counter").values() == [1, 11]
            assert m.actors("acc").add.call(1).get(timeout=30).values() == [6, 6]
            assert {p.job for p in m.launcher.placements().values()} == {f"{job}.0"}
        finally:
            m.stop()
        assert _job_gone(job)
        assert registry.load("sd-kill") is None
        assert not any(psutil.pid_exists(p) for p in pids)
        wait_for(lambda: not psutil.pid_exists(rec.guardian_pid), 15, what="its guardian gone")
        assert not Path(f"/tmp/monarch-{getpass.getuser()}-{job}.out").exists()
    finally:
        if job in _jobs():
            _sh("scancel", job)


def test_keep_alive_expiry_ends_the_job_and_list_forgets_it(slurm, tmp_path, registry_dir):
    import monarch_kernel.launchers  # noqa: F401 - registers squeue liveness for Slurm records
    from monarch_kernel.mesh import registry

    info = _spawn_detached(tmp_path, "sd-expire", 6, "detach")
    job, pids = info["job"], info["pids"]
    try:
        assert job in _jobs()
        t0 = time.monotonic()
        wait_for(lambda: _job_gone(job), 90, what=f"job {job} ended by its keep-alive")
        print(f"job gone {time.monotonic() - t0:.1f} s after a 6 s keep-alive began")
        wait_for(lambda: not any(psutil.pid_exists(p) for p in pids), 10, what="ranks gone")
        # the mesh's guardian (on this host) saw the job gone and removed the record
        wait_for(lambda: not (registry_dir / "sd-expire.json").exists(), 15,
                 what="the record removed by the mesh's guardian")
        rows = [r for r in registry.list_meshes() if r.name == "sd-expire"]
        assert [r.state for r in rows] in ([], ["gone"])
        assert registry.load("sd-expire") is None  # removed as the listing found it gone
        assert not list(registry_dir.glob("*.json"))
        wait_for(lambda: not Path(f"/tmp/monarch-{getpass.getuser()}-{job}.out").exists(), 10,
                 what="the job's output file removed by its own script")
    finally:
        if job in _jobs():
            _sh("scancel", job)


def test_inside_an_allocation_a_detached_step_outlives_its_controller(slurm, tmp_path,
                                                                      registry_dir):
    """A detached mesh started as a step of the user's allocation: the step
    survives its killed controller; attach from outside adopts the step, and
    stopping the mesh cancels that step only (the allocation stays)."""
    import monarch_kernel
    import monarch_kernel.launchers  # noqa: F401 - registers squeue liveness for Slurm records
    from monarch_kernel.mesh import registry

    driver = tmp_path / "spawn_detached.py"
    driver.write_text(DETACH_DRIVER)
    name = f"monarch-alloc-{os.getpid()}"
    salloc = subprocess.Popen(["salloc", "-n2", "-J", name, "bash", "-c",
                               f"{sys.executable} {driver} sd-alloc 120 kill; sleep 120"],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                              stdin=subprocess.DEVNULL, cwd=str(tmp_path))
    try:
        line = ""
        while not line.startswith("INFO "):
            line = salloc.stdout.readline()  # type: ignore[union-attr]
            assert line, "the driver ended without spawning"
        import json

        info = json.loads(line.split(" ", 1)[1])
        job, pids = info["job"], info["pids"]
        alloc = job.split(".")[0]
        assert "." in job and alloc in _jobs(name), info  # JOB.STEP of the allocation
        time.sleep(2)
        assert all(psutil.pid_exists(p) for p in pids)
        (row,) = [r for r in registry.list_meshes() if r.name == "sd-alloc"]
        assert (row.state, row.slurm_job) == ("detached", job)
        m = monarch_kernel.attach("sd-alloc", timeout=30)
        try:
            assert m.exec("os.getpid()").values() == pids
            assert m.exec("counter").values() == [1, 11]
        finally:
            m.stop()
        assert registry.load("sd-alloc") is None
        wait_for(lambda: not any(psutil.pid_exists(p) for p in pids), 20, what="ranks gone")
        assert alloc in _jobs(name)  # the allocation itself stays
    finally:
        for j in _jobs(name):
            _sh("scancel", j)
        salloc.kill()
        salloc.wait(30)


def test_a_killed_kernels_slurm_mesh_is_attached_from_a_new_kernel(slurm, registry_dir):
    """The kernel that spawned a detached Slurm mesh is SIGKILLed; a new kernel
    attaches through the registry and squeue: same ranks, same state."""
    ks = KernelSession()  # (the kernel inherits this test's registry directory)
    job, pids = "", []
    try:
        _ok(ks, "import os, monarch_kernel\n"
                "m = monarch_kernel.spawn_procs({'hosts': 1, 'procs': 2}, launcher='slurm', "
                "name='sd-kernel', detach=True, keep_alive=300, timeout=90)\n"
                "m.exec('counter = rank + 100')")
        pids = eval(_ok(ks, "m.exec('import os\\nos.getpid()').values()").result_text())
        job = _ok(ks, "m.record.slurm_job").result_text().strip("'")
        os.kill(ks.pid, signal.SIGKILL)
        ks.km.provisioner.process.wait(30)  # type: ignore[union-attr]
    finally:
        ks.kc.stop_channels()
        ks.km.cleanup_resources()
    try:
        time.sleep(2)
        assert job in _jobs() and all(psutil.pid_exists(p) for p in pids)
        ks2 = KernelSession()
        try:
            r = _ok(ks2, "import time, monarch_kernel\nt0 = time.monotonic()\n"
                         "m = monarch_kernel.attach('sd-kernel')\n"
                         "took = time.monotonic() - t0\n"
                         "m.exec('import os\\n(os.getpid(), counter)').values()")
            assert eval(r.result_text()) == [(pids[0], 100), (pids[1], 101)]
            print("attach from a new kernel took "
                  + _ok(ks2, "f'{took:.2f} s'").result_text())
            _ok(ks2, "m.stop()")
        finally:
            ks2.shutdown()
        assert _job_gone(job)
        assert not list(registry_dir.glob("*.json"))
    finally:
        if job and job in _jobs():
            _sh("scancel", job)
