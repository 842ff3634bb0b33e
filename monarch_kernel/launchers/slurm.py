"""The ``slurm`` launcher: workers are the tasks of a Slurm job.

Outside an allocation, :meth:`SlurmLauncher.launch` submits a batch job with
``sbatch`` whose script runs one ``srun`` step with one task per rank; inside
an existing allocation (``SLURM_JOB_ID`` set, e.g. under ``salloc``) it starts
that step with ``srun`` directly. Each task computes its rank from
``SLURM_PROCID`` (block distribution: ranks are host-major), then execs
``python -m monarch_kernel worker``, which connects back to the controller.
The mesh key reaches workers through the job's environment (``--export=ALL``)
or, with ``key_dir``, through a 0600 file on a shared file system; never
through argv or the batch script.

While a job is queued, :meth:`SlurmLauncher.wait_started` prints its state
(``job 12 PENDING (Resources)``); an interrupt (KeyboardInterrupt) then
cancels it. A watcher thread reads the job's state every ``poll_interval``
seconds (``squeue --json`` where it works, else ``squeue -o`` columns, then
``scontrol show job`` and ``sacct`` for finished jobs), so that
:meth:`SlurmLauncher.poll` stays cheap. :meth:`SlurmLauncher.stop` cancels the
job (``scancel``) and waits until ``squeue`` no longer lists it.

The Slurm command-line interface is the only contract used (as in
submitit and dask-jobqueue); parsing accepts the JSON of Slurm 21.08 to 24.x
(``job_state`` as a string or a list, ``exit_code`` as a wait status or an
object) and the column output of older versions.

This module is the launcher: it submits, waits, watches, signals and
cancels. What it submits (the per-task script, the ``sbatch`` and ``srun``
command lines, the key file) is composed in :mod:`.slurm_job`, which also
holds the record of one launch (:class:`~.slurm_job.SlurmUnit`); reading
Slurm's answers, whatever its version, is :mod:`.slurm_cli`.
"""

from __future__ import annotations

import getpass
import logging
import os
import re
import shlex
import shutil
import signal as _signal
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from monarch_kernel.errors import MeshError, MeshFailure
from monarch_kernel.launchers.base import Launcher, LaunchSpec, Placement
from monarch_kernel.launchers.guard import Guardian
from monarch_kernel.launchers.slurm_cli import (
    ACTIVE_STATES,
    WAITING_STATES,
    JobInfo,
    JobQuery,
    JobTable,
    decode_exit,
    parse_scontrol_job,
    parse_squeue_columns,
    parse_squeue_json,
    read_tail,
    slurm_version,
    slurmctld_host,
    unlink_quiet,
)
from monarch_kernel.launchers.slurm_job import (
    SlurmUnit,
    batch_script,
    geometry,
    job_env,
    sbatch_command,
    srun_command,
    task_lines,
    task_script,
    write_key_file,
)
from monarch_kernel.mesh import registry
from monarch_kernel.mesh.registry import MeshRecord
from monarch_kernel.transport.netaddr import address_towards, primary_address

__all__ = [
    "ACTIVE_STATES",
    "JobInfo",
    "SlurmLauncher",
    "decode_exit",
    "mesh_alive",
    "mesh_job_state",
    "parse_scontrol_job",
    "parse_squeue_columns",
    "parse_squeue_json",
]

log = logging.getLogger("monarch_kernel.launchers.slurm")

class SlurmLauncher(Launcher):
    """Start each rank as one task of a Slurm job.

    Parameters
    ----------
    partition, time, account : str, optional
        ``--partition``, ``--time`` (e.g. ``"30"`` or ``"2:00:00"``), ``--account``.
    gpus_per_node : int, optional
        ``--gpus-per-node``; with ``--dist nccl`` LOCAL_RANK picks the GPU.
    nodes : int, optional
        Nodes to ask for (default: the shape's ``hosts``). ``nodes=1`` packs
        every "host" of the shape onto one node (``-N1 -n H*P``), e.g. on a
        one-node test cluster; ranks stay host-major.
    extra_args : sequence of str or str
        More ``sbatch`` arguments (``srun`` arguments inside an allocation).
    allocation : bool, optional
        Start steps in the current allocation (``srun``) instead of
        submitting a job; default: when ``SLURM_JOB_ID`` is set.
    python : str, optional
        The Python the workers run (default: this one; it must exist at the
        same path on the nodes).
    key_dir : str, optional
        A directory on a file system the nodes share: the mesh key goes to a
        0600 file there instead of the job's environment (for sites that run
        jobs with ``--export=NONE``). Removed at :meth:`stop`.
    output : str
        The batch job's output file (``%u`` user, ``%j`` job id). Workers'
        output reaches the notebook; this file only holds what they wrote
        before connecting or after dying (shown in failure messages when it
        is readable here). Removed at :meth:`stop`.
    job_name : str
        The job's name (steps are named ``job_name-<random>``).
    poll_interval : float
        Seconds between the watcher's job-state queries (5 times that once
        every rank connected: heartbeats watch them then).
    pending_timeout : float, optional
        Give up (TimeoutError) if the job is still queued after this many
        seconds; default: wait until interrupted.
    report : callable(str), optional
        Where progress lines go (default: print to stdout).
    """

    name = "slurm"
    local = False

    def __init__(
        self,
        partition: str | None = None,
        time: str | None = None,
        account: str | None = None,
        gpus_per_node: int | None = None,
        nodes: int | None = None,
        extra_args: Sequence[str] | str = (),
        allocation: bool | None = None,
        python: str | None = None,
        key_dir: str | None = None,
        output: str = "/tmp/monarch-%u-%j.out",
        job_name: str = "monarch",
        poll_interval: float = 2.0,
        pending_timeout: float | None = None,
        report: Callable[[str], None] | None = None,
    ) -> None:
        self.partition, self.time, self.account = partition, time, account
        if gpus_per_node is not None and int(gpus_per_node) < 0:
            raise ValueError("--gpus-per-node must be 0 or more")
        if nodes is not None and int(nodes) < 1:
            raise ValueError("--nodes must be 1 or more")
        self.gpus_per_node = None if gpus_per_node is None else int(gpus_per_node)
        self.nodes = None if nodes is None else int(nodes)
        self.extra_args = shlex.split(extra_args) if isinstance(extra_args, str) else list(
            extra_args)
        self.allocation = (bool(os.environ.get("SLURM_JOB_ID")) if allocation is None
                           else allocation)
        self.python = python
        self.key_dir = key_dir
        self.output = output
        self.job_name = job_name
        self.poll_interval = poll_interval
        self.pending_timeout = pending_timeout
        self.report = report or (lambda text: print(text, flush=True))
        #: set by :meth:`make_detachable`: the workers outlive this controller
        self.detach_plan: Any = None
        self.controller: Any = None
        self.units: list[SlurmUnit] = []
        self._unit_of: dict[int, SlurmUnit] = {}
        self._exits: dict[int, int] = {}
        self._query = JobQuery(lambda *a, **kw: self._run(*a, **kw))
        self._lock = threading.RLock()
        self._closing = threading.Event()
        self._watcher: threading.Thread | None = None
        self._tmpdir: str | None = None
        #: cancels the jobs if this process ends first (see :mod:`.guard`)
        self.guard = Guardian()

    # --------------------------------------------------------- running tools
    @staticmethod
    def _run(cmd: list[str], timeout: float = 30.0, input: str | None = None,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        try:
            return subprocess.run(cmd, check=False, input=input, capture_output=True, text=True,
                                  timeout=timeout, env=env,
                                  stdin=None if input is not None else subprocess.DEVNULL)
        except FileNotFoundError:
            raise MeshError(
                f"{cmd[0]} not found: --launcher slurm needs the Slurm client commands "
                "(sbatch, srun, squeue, scancel) on PATH"
            ) from None

    def query(self, job_id: str) -> JobInfo | None:
        """The state of ``job_id`` (None when Slurm could not be asked; state
        ``GONE`` once Slurm forgot the job). See :class:`.slurm_cli.JobQuery`."""
        return self._query(job_id)

    def _find_step(self, unit: SlurmUnit) -> None:
        unit.step_tried = time.monotonic()
        try:
            cp = self._run(["squeue", "-h", "--steps", "--jobs", unit.job_id,
                            "-o", "%i|%j|%N"], timeout=10)
        except (subprocess.TimeoutExpired, MeshError):
            return
        for line in cp.stdout.splitlines():
            parts = line.strip().split("|")
            if len(parts) >= 2 and parts[1] == unit.step_name:
                unit.step = parts[0].split(".", 1)[-1]
                if len(parts) > 2 and parts[2]:
                    unit.nodes = parts[2]
                if not unit.ended and not unit.detached:
                    self._guard_unit(unit)
                return

    # ----------------------------------------------------------------- launch
    def _write_key(self, key: bytes) -> str | None:
        return None if self.key_dir is None else write_key_file(self.key_dir, key)

    def launch(self, spec: LaunchSpec) -> None:
        """Submit the job (or start the step) for ``spec.ranks``; returns at once.

        Raises
        ------
        MeshError
            If ``sbatch`` / ``srun`` refuses (bad partition, account, ...).
        """
        ranks = list(spec.ranks)
        step_name = f"{self.job_name}-{uuid.uuid4().hex[:8]}"
        key_file = self._write_key(spec.key)
        try:
            unit = (self._launch_step if self.allocation else self._launch_job)(
                spec, ranks, step_name, key_file)
        except BaseException:
            if key_file:
                unlink_quiet(key_file)
            raise
        unit.detached = self.detach_plan is not None
        if not unit.detached:
            self._guard_unit(unit)
        else:
            self._guard_detached(unit)
        with self._lock:
            for r in ranks:
                old = self._unit_of.get(r)
                if old is not None:
                    old.live.discard(r)
                self._unit_of[r] = unit
                self._exits.pop(r, None)
            self.units.append(unit)
        if self._watcher is None or not self._watcher.is_alive():
            self._closing.clear()
            self._watcher = threading.Thread(target=self._watch, name="monarch-slurm-watch",
                                             daemon=True)
            self._watcher.start()

    def _guard_detached(self, unit: SlurmUnit) -> None:
        """Have the mesh's detached guardian clean up after ``unit`` ends (the
        batch job gone from squeue, or the srun of an allocation step exited)."""
        try:
            self.guard.ensure()
        except OSError as e:
            log.warning("could not start the process that cleans up after the mesh: %s", e)
            return
        if unit.proc is None:
            self.guard.watch_job(unit.job_id)
        else:
            self.guard.watch([unit.proc.pid])

    def _guard_unit(self, unit: SlurmUnit) -> None:
        """Have the guardian end ``unit`` if this process ends before it does:
        SIGTERM to its tasks at once, SIGKILL to its step ``guard.grace`` seconds
        later (a task stuck in C code can run neither its Python watchdog nor a
        SIGTERM handler; a signalled step ends at once, a cancelled job only
        after Slurm's KillWait), then cancel the batch job and remove its output
        and key files."""
        if unit.proc is None:  # a batch job: its one srun is step 0 (until we know better)
            job = unit.job_id
            step = f"{job}.{unit.step or 0}"
            term = [["scancel", "--signal=TERM", job]]
            kill = [["scancel", "--signal=KILL", step], ["scancel", job]]
        elif unit.step is not None:  # a step of the user's allocation (which stays)
            step = f"{unit.job_id}.{unit.step}"
            term = [["scancel", "--signal=TERM", step]]
            kill = [["scancel", "--signal=KILL", step]]
        else:  # a step whose id is not known yet: srun passes SIGTERM on to its tasks
            term = [["kill", "-TERM", str(unit.proc.pid)]]
            kill = [["kill", "-KILL", str(unit.proc.pid)]]
        # (the output and key files this process would have removed at stop)
        kill += [["rm", "-f", "--", path] for path in (unit.output, unit.key_file) if path]
        try:
            self.guard.ensure()
        except OSError as e:
            log.warning("could not start the process that cancels jobs with the kernel: %s", e)
            return
        self.guard.on_exit(unit.step_name, term, kill)

    def _launch_job(self, spec: LaunchSpec, ranks: list[int], step_name: str,
                    key_file: str | None) -> SlurmUnit:
        geom = geometry(spec, ranks, self.nodes)
        # a detached job removes its own files: no controller may be left to do it
        cleanup = ([self.output.replace("%u", getpass.getuser()), *filter(None, [key_file])]
                   if self.detach_plan is not None else [])
        # (a rank at the end of its keep-alive cancels the job: ranks stuck in C code too)
        script = batch_script(spec, ranks, step_name, geom,
                              task_script(spec, ranks, key_file, self.python,
                                          self._detach_env(), self._on_keep_alive(False)),
                              cleanup)
        cmd = sbatch_command(self.job_name, self.output, geom, self.extra_args, {
            "--partition": self.partition, "--time": self.time, "--account": self.account,
            "--gpus-per-node": self.gpus_per_node})
        try:
            cp = self._run(cmd, input=script, env=job_env(spec, key_file), timeout=60)
        except subprocess.TimeoutExpired:
            raise MeshError("sbatch did not answer within 60 s; is slurmctld up?") from None
        m = re.match(r"^\s*(\d+)", cp.stdout)
        if cp.returncode != 0 or not m:
            why = (cp.stderr.strip() or cp.stdout.strip() or f"exit {cp.returncode}").splitlines()
            raise MeshError(f"sbatch refused the job: {why[-1]}")
        job_id = m.group(1)
        output = self.output.replace("%u", getpass.getuser()).replace("%j", job_id)
        return SlurmUnit(job_id, ranks, step_name, output, key_file, live=set(ranks))

    def _launch_step(self, spec: LaunchSpec, ranks: list[int], step_name: str,
                     key_file: str | None) -> SlurmUnit:
        job_id = os.environ.get("SLURM_JOB_ID", "")
        if not job_id:
            raise MeshError("allocation=True needs SLURM_JOB_ID (run inside salloc or sbatch)")
        where = getattr(self.detach_plan, "mesh_dir", None)  # (its guardian removes it)
        if where is None and self._tmpdir is None:
            self._tmpdir = tempfile.mkdtemp(prefix="monarch-slurm-")
        fd, output = tempfile.mkstemp(prefix="srun-", suffix=".out",
                                      dir=where or self._tmpdir)
        cmd = srun_command(job_id, step_name, geometry(spec, ranks, self.nodes),
                           self.gpus_per_node, self.extra_args,
                           task_script(spec, ranks, key_file, self.python,
                                       self._detach_env(), self._on_keep_alive(True)),
                           overlap=slurm_version() >= (20, 11))
        try:
            proc = subprocess.Popen(cmd, env=job_env(spec, key_file), stdin=subprocess.DEVNULL,
                                    stdout=fd, stderr=subprocess.STDOUT, start_new_session=True)
        except FileNotFoundError:
            raise MeshError("srun not found: --launcher slurm needs the Slurm client "
                            "commands on PATH") from None
        finally:
            os.close(fd)
        return SlurmUnit(job_id, ranks, step_name, output, key_file, proc=proc, state="RUNNING",
                         live=set(ranks))

    # ------------------------------------------------------------- waiting
    def attach(self, controller: Any) -> None:
        """Remember the controller (for each rank's host and pid); its private
        directory for Unix sockets, if any, is removed by the guardian should this
        process be killed."""
        self.controller = controller
        ipc_dir = getattr(controller, "ipc_dir", None)
        if isinstance(ipc_dir, str):
            self.guard.remove_on_exit(ipc_dir)

    def wait_started(self, timeout: float) -> None:
        """Wait while the job is queued, printing its state when it changes.

        ``timeout`` is not used here (the connect timeout starts when the job
        runs); ``pending_timeout`` bounds the wait in the queue.

        Raises
        ------
        MeshFailure
            If the job ended before it ran.
        TimeoutError
            If ``pending_timeout`` passed.
        KeyboardInterrupt
            Passed on (the caller cancels the job).
        """
        for unit in list(self.units):
            if unit.proc is None and not unit.started:
                self._wait_job(unit)
                unit.started = True

    def _wait_job(self, unit: SlurmUnit) -> None:
        t0 = last_print = time.monotonic()
        last: tuple[str, str] | None = None
        delay, unknown_since = 0.2, None
        while True:
            info = self.query(unit.job_id)
            now = time.monotonic()
            if info is None:
                unknown_since = unknown_since or now
                if now - unknown_since > 60:
                    raise MeshError(f"cannot read the state of Slurm job {unit.job_id} "
                                    "(squeue fails); is slurmctld up?")
            else:
                unknown_since = None
                self._update(unit, info)
                if not info.active or info.state == "COMPLETING":
                    raise MeshFailure(f"Slurm job {unit.job_id} ended ({self._describe(unit)}) "
                                      f"before its workers started{self._tail(unit)}")
                if info.state not in WAITING_STATES:  # RUNNING (or SUSPENDED, ...)
                    self.report(f"job {unit.job_id} {info.state} on {info.nodes or '?'}")
                    return
                key = (info.state, info.reason)
                if key != last or now - last_print >= 30:
                    since = f", waiting {now - t0:.0f} s" if key == last else ""
                    why = f" ({info.reason})" if info.reason not in ("", "None") else ""
                    self.report(f"job {unit.job_id} {info.state}{why}{since}")
                    last, last_print = key, now
            if self.pending_timeout is not None and now - t0 > self.pending_timeout:
                raise TimeoutError(f"Slurm job {unit.job_id} was still queued after "
                                   f"{self.pending_timeout:g} s")
            time.sleep(delay)
            delay = min(2.0, delay * 1.5)

    def _update(self, unit: SlurmUnit, info: JobInfo) -> None:
        unit.state, unit.reason = info.state, info.reason
        if info.nodes:
            unit.nodes = info.nodes
        if not info.active or info.state == "COMPLETING":
            self._ended(unit, info.exit_code)

    def _ended(self, unit: SlurmUnit, code: int | None) -> None:
        with self._lock:
            if unit.ended:
                return
            unit.ended = True
            unit.exit_code = code
            self.guard.drop(unit.step_name)
            rc = code if code is not None else (0 if unit.state == "COMPLETED" else 1)
            for r in unit.live:
                self._exits[r] = rc
            unit.live = set()

    def _describe(self, unit: SlurmUnit) -> str:
        code = "" if unit.exit_code is None else f", exit code {unit.exit_code}"
        return f"{unit.state}{code}"

    def _tail(self, unit: SlurmUnit, lines: int = 10) -> str:
        text = read_tail(unit.output)
        if not text:
            return ""
        return "; its output:\n" + "\n".join(f"  {ln}" for ln in text.splitlines()[-lines:])

    # ------------------------------------------------------------- watching
    def _watch(self) -> None:
        while not self._closing.wait(self.poll_interval):
            for unit in list(self.units):
                if unit.ended:
                    continue
                try:
                    if unit.proc is not None:
                        code = unit.proc.poll()
                        if unit.step is None:
                            self._find_step(unit)
                        if code is not None:
                            unit.state = "COMPLETED" if code == 0 else "FAILED"
                            self._ended(unit, code)
                        continue
                    # once every rank said hello, heartbeats watch them: ask Slurm less
                    now = time.monotonic()
                    if now < unit.next_check:
                        continue
                    unit.next_check = now + (4 * self.poll_interval if self._connected(unit)
                                             else 0.0)
                    info = self.query(unit.job_id)
                    if info is not None:
                        self._update(unit, info)
                        if unit.step is None and info.state == "RUNNING":
                            self._find_step(unit)
                except Exception:  # the watcher must survive a bad answer
                    log.exception("watching Slurm job %s failed", unit.job_id)

    def _connected(self, unit: SlurmUnit) -> bool:
        ranks = self.controller.ranks if self.controller is not None else {}
        return all(r in ranks and ranks[r].state != "starting" for r in unit.live)

    def poll(self) -> dict[int, int]:
        """Ranks whose job (or step) ended since the last call (cheap: no Slurm call)."""
        with self._lock:
            out, self._exits = self._exits, {}
        return out

    def forget(self, ranks: list[int]) -> None:
        """Never report the current processes of ``ranks`` as exited."""
        with self._lock:
            for r in ranks:
                unit = self._unit_of.get(r)
                if unit is not None:
                    unit.live.discard(r)
                self._exits.pop(r, None)

    def leftover_output(self, rank: int) -> list[tuple[str, bytes]]:
        """What ``rank`` wrote to the job's output file (``srun --label`` lines),
        plus unlabelled lines (srun's own errors), if the file is readable here."""
        unit = self._unit_of.get(rank)
        if unit is None or rank in unit.leftover_done or rank not in unit.ranks:
            return []
        unit.leftover_done.add(rank)
        text = read_tail(unit.output, 65536)
        if not text:
            return []
        mine = task_lines(text, str(unit.ranks.index(rank)))
        return [("stderr", ("\n".join(mine[-40:]) + "\n").encode())] if mine else []

    def placements(self) -> dict[int, Placement]:
        """Each rank's node (from its hello, else the job's node list) and job[.step]."""
        out = {}
        ranks = self.controller.ranks if self.controller is not None else {}
        for unit in {id(u): u for u in self._unit_of.values()}.values():
            if unit.step is None and not unit.ended and time.monotonic() - unit.step_tried > 1:
                self._find_step(unit)
        for r, unit in list(self._unit_of.items()):
            info = ranks.get(r)
            host = (info.host if info is not None else "") or unit.nodes
            pid = info.pid if info is not None else None
            job = unit.job_id if unit.step is None else f"{unit.job_id}.{unit.step}"
            out[r] = Placement(r, host, pid, job)
        return out

    # ------------------------------------------------------ detach, attach
    def mesh_job(self, timeout: float = 10.0) -> str | None:
        """The Slurm job of the ranks, as the mesh registry records it: the job
        id of a batch job, ``JOB.STEP`` for a step in the user's allocation
        (waiting up to ``timeout`` seconds for squeue to list the step); None
        before :meth:`launch`, or for a step squeue never listed."""
        units = [u for u in self.units if not u.ended] or self.units
        if not units:
            return None
        unit = units[0]
        if unit.proc is None and not unit.step_only:
            return unit.job_id
        deadline = time.monotonic() + timeout
        while unit.step is None and time.monotonic() < deadline:
            self._find_step(unit)
            if unit.step is None:
                time.sleep(0.2)
        return None if unit.step is None else f"{unit.job_id}.{unit.step}"

    def make_detachable(self, plan: Any) -> None:
        """Start the workers of the next :meth:`launch` detachable: they outlive
        this controller (nothing cancels their job when it ends) and each binds
        a TCP attach endpoint (CurveZMQ, the mesh's key) on the address of its
        node that reaches this host. ``plan``: ``keep_alive`` (seconds a rank
        waits for a controller) and ``output_bytes`` (bytes of output each rank
        keeps), as :class:`~.local.DetachPlan` has them; its ``mesh_dir`` and
        ``record`` (the registry file, if it still names ``mesh_id``) are removed
        by a guardian of the mesh's own on this host once the job ended."""
        self.detach_plan = plan
        self.guard = Guardian(detached=True)
        if getattr(plan, "mesh_dir", None):
            self.guard.remove_on_exit(plan.mesh_dir)
        if getattr(plan, "record", None):
            self.guard.remove_file_at_end(plan.record, plan.mesh_id)

    def _detach_env(self) -> dict[str, str]:
        plan = self.detach_plan
        if plan is None:
            return {}
        return {"MONARCH_ATTACH_ENDPOINT": "tcp://*:0",
                "MONARCH_DETACH_KEEP_ALIVE": repr(float(plan.keep_alive)),
                "MONARCH_DETACH_OUTPUT_BYTES": str(int(plan.output_bytes)),
                "MONARCH_DETACH_HOLDER": f"{os.getpid()}@{socket.gethostname()}"}

    def _on_keep_alive(self, step: bool) -> str | None:
        """What a task runs when its rank's keep-alive passed (detached meshes):
        cancel the batch job, or the step of the user's allocation."""
        if self.detach_plan is None:
            return None
        return ('scancel "$SLURM_JOB_ID.$SLURM_STEP_ID"' if step
                else 'scancel "$SLURM_JOB_ID"')

    def release(self) -> None:
        """Leave the job running without this controller: stop watching it, and
        tell the guardian to cancel nothing when this process ends (the ranks
        end themselves after their keep-alive, and the job with them)."""
        with self._lock:
            for unit in self.units:
                unit.detached = True
                self.guard.drop(unit.step_name)
        self._closing.set()
        if self.guard.detached:
            self.guard.release()  # (it goes on: it cleans up once the job ended)
        else:
            self.guard.close()

    def record_fields(self) -> dict[str, Any]:
        """What the mesh registry records of this launcher's (detachable) mesh: its
        job (:meth:`mesh_job`) and the settings :meth:`adopt_record` needs."""
        return {"slurm_job": self.mesh_job(),
                "extra": {"slurm": {"output": self.output, "job_name": self.job_name,
                                    "poll_interval": self.poll_interval}}}

    def adopt_record(self, rec: Any) -> None:
        """Take over the ranks of registry record ``rec`` (a detachable mesh of
        this launcher's): its ``slurm_job``, ``world_size`` and the settings
        :meth:`record_fields` kept.

        Raises
        ------
        MeshError
            If the record names no Slurm job.
        """
        if not rec.slurm_job:
            raise MeshError(f"mesh {rec.name!r}: its record names no Slurm job; "
                            "stop it with scancel and spawn it again")
        kept = (rec.extra or {}).get("slurm") or {}
        self.output = str(kept.get("output", self.output))
        self.job_name = str(kept.get("job_name", self.job_name))
        self.poll_interval = float(kept.get("poll_interval", self.poll_interval))
        self.adopt(str(rec.slurm_job), list(range(int(rec.world_size))))

    def adopt(self, job: str, ranks: list[int]) -> None:
        """Take over the ranks of running Slurm job ``job`` (attach to a detached
        mesh): watch, signal and stop them as if :meth:`launch` had started
        them. ``job``: a batch job id, or ``JOB.STEP`` for a step in the user's
        allocation (then only that step is ever signalled or cancelled). The
        job stays detached (nothing cancels it when this process ends) until
        :meth:`stop`.

        Raises
        ------
        ValueError
            If ``job`` is not a job id (``123`` or ``123.4``).
        """
        m = re.match(r"^\s*(\d+)(?:\.(\d+))?\s*$", str(job))
        if m is None:
            raise ValueError(f"not a Slurm job id: {job!r}")
        job_id, step = m.group(1), m.group(2)
        output = (None if step else
                  self.output.replace("%u", getpass.getuser()).replace("%j", job_id))
        unit = SlurmUnit(job_id, list(ranks), step_name=f"adopted-{job}", output=output,
                         step=step or "0", state="RUNNING", started=True, live=set(ranks),
                         detached=True, step_only=step is not None)
        with self._lock:
            for r in ranks:
                self._unit_of[r] = unit
                self._exits.pop(r, None)
            self.units.append(unit)
        if self._watcher is None or not self._watcher.is_alive():
            self._closing.clear()
            self._watcher = threading.Thread(target=self._watch, name="monarch-slurm-watch",
                                             daemon=True)
            self._watcher.start()

    # ------------------------------------------------------ signals, stopping
    def signal(self, ranks: list[int], sig: int = _signal.SIGINT) -> None:
        """Send ``sig`` to the tasks of ``ranks``.

        Slurm signals whole steps: when ``ranks`` covers a step, ``scancel
        --signal`` is used; for some ranks of a step, ``kill`` runs on their
        nodes in an overlapping step (needs their pids, Slurm >= 20.11).
        """
        name = _signal.Signals(sig).name.removeprefix("SIG")
        wanted = set(ranks)
        for unit in self._units_of(ranks):
            if unit.ended:
                continue
            mine = [r for r in unit.ranks if r in wanted]
            if set(unit.ranks) <= wanted:
                self._scancel(unit, f"--signal={name}")
            else:
                self._kill_tasks(unit, mine, name)

    def _units_of(self, ranks: list[int] | None) -> list[SlurmUnit]:
        with self._lock:
            if ranks is None:
                return list(self.units)
            return list({id(u): u for r in ranks if (u := self._unit_of.get(r))}.values())

    def _target(self, unit: SlurmUnit) -> str | None:
        if unit.step_only:
            return f"{unit.job_id}.{unit.step}"
        if unit.proc is None:
            return unit.job_id
        if unit.step is None:
            self._find_step(unit)
        return None if unit.step is None else f"{unit.job_id}.{unit.step}"

    def _scancel(self, unit: SlurmUnit, *args: str) -> None:
        target = self._target(unit)
        if target is None:  # a step whose id we never saw: signal srun itself
            if unit.proc is not None and unit.proc.poll() is None:
                sig = args[0].split("=", 1)[1] if args else "TERM"
                unit.proc.send_signal(getattr(_signal, f"SIG{sig}", _signal.SIGTERM))
            return
        try:
            cp = self._run(["scancel", *args, target], timeout=30)
        except subprocess.TimeoutExpired:
            log.warning("scancel %s did not answer within 30 s", target)
            return
        if cp.returncode != 0 and "already completing" not in cp.stderr.lower() + cp.stdout:
            log.info("scancel %s: %s", target, cp.stderr.strip())

    def _kill_tasks(self, unit: SlurmUnit, ranks: list[int], sig: str) -> None:
        by_host: dict[str, list[str]] = {}
        for r in ranks:
            info = self.controller.ranks.get(r) if self.controller is not None else None
            if info is not None and info.pid and info.host:
                by_host.setdefault(info.host, []).append(str(info.pid))
        for host, pids in by_host.items():
            cmd = ["srun", f"--jobid={unit.job_id}", "--overlap", "-N1", "-n1", f"-w{host}",
                   "kill", f"-{sig}", *pids]
            try:
                self._run(cmd, timeout=30)
            except (subprocess.TimeoutExpired, MeshError) as e:
                log.warning("could not signal ranks %s on %s: %s", ranks, host, e)

    def stop(self, ranks: list[int] | None = None, timeout: float = 5.0) -> None:
        """Cancel the jobs (steps) of ``ranks`` (all if None) and wait until
        Slurm lists them no more; remove key and output files."""
        units = self._units_of(ranks)
        wanted = None if ranks is None else set(ranks)
        whole = [u for u in units if wanted is None or set(u.ranks) <= wanted]
        for u in units:
            if wanted is not None and u not in whole:  # (wanted None: every unit is whole)
                self._kill_tasks(u, [r for r in u.ranks if r in wanted], "TERM")
        # workers that got "stop" exit by themselves: give the job a moment to end
        deadline = time.monotonic() + min(timeout, 2.0)
        for u in whole:
            while not self._gone(u) and time.monotonic() < deadline:
                time.sleep(0.1)
        for u in whole:
            if not self._gone(u):
                waiting = u.state in WAITING_STATES
                self._scancel(u)
                if waiting:
                    self.report(f"job {u.job_id} cancelled while {u.state}")
        deadline = time.monotonic() + max(timeout, 60.0)  # KillWait and epilogs
        for u in whole:
            while not self._gone(u):
                if time.monotonic() > deadline:
                    log.warning("Slurm job %s still listed after scancel", u.job_id)
                    break
                time.sleep(0.2)
            self._ended(u, u.exit_code)
            for path in (u.key_file, u.output):
                if path:
                    unlink_quiet(path)
        with self._lock:
            if all(u.ended for u in self.units):
                self._closing.set()
        if self._closing.is_set():
            if self.guard.detached:  # (it sees the job gone, cleans up and exits)
                self.guard.release()
            else:
                self.guard.close()
        if self._closing.is_set() and self._tmpdir:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    def _gone(self, unit: SlurmUnit) -> bool:
        """True once the job (or step) is no longer listed by Slurm."""
        if unit.proc is not None:
            return unit.proc.poll() is not None
        if unit.step_only:
            alive = JobTable(lambda cmd, timeout=10.0: self._run(cmd, timeout=timeout)).alive(
                f"{unit.job_id}.{unit.step}")
            return alive is False
        info = self.query(unit.job_id)
        if info is None:
            return False
        unit.state = info.state
        if info.exit_code is not None:
            unit.exit_code = info.exit_code
        return not info.active

    # ------------------------------------------------------------- binding
    def default_bind(self) -> str:
        """The address of the interface that reaches the Slurm nodes: towards
        the allocation's first node inside one, else towards slurmctld."""
        target = None
        if self.allocation and os.environ.get("SLURM_JOB_NODELIST"):
            try:
                cp = self._run(["scontrol", "show", "hostnames",
                                os.environ["SLURM_JOB_NODELIST"]], timeout=10)
                target = (cp.stdout.split() or [None])[0]
            except (subprocess.TimeoutExpired, MeshError):
                pass
        if target is None:
            target = slurmctld_host()
        return (address_towards(target) if target else None) or primary_address()


# ------------------------------------------------------------- registry liveness
#: this user's jobs, one squeue call for every Slurm mesh the registry asks about
_JOBS = JobTable(ttl=1.0)


def mesh_alive(rec: MeshRecord) -> bool:
    """Whether the Slurm job of registry record ``rec`` is pending or running
    (``squeue``); True when Slurm cannot be asked (a record is never dropped
    because slurmctld did not answer)."""
    alive = _JOBS.alive(rec.slurm_job)
    return True if alive is None else alive


def mesh_job_state(rec: MeshRecord) -> str | None:
    """``squeue``'s state of the job of ``rec`` (``RUNNING``, ``PENDING``, ...,
    ``GONE`` once it is listed no more); None when Slurm cannot be asked."""
    if not rec.slurm_job:
        return "GONE"
    info = _JOBS.get(rec.slurm_job)
    return None if info is None else info.state


registry.register_liveness("slurm", mesh_alive, mesh_job_state)
