"""Talking to Slurm's command-line tools, whatever their version.

Job state comes from ``squeue --json`` where it works (Slurm >= 21.08 with
its JSON plugin; 21.08/22.05 ignore ``--jobs`` there and list every job, so
the job is picked from the list), else from ``squeue -o`` columns; a job
squeue no longer lists is read from ``scontrol show job`` and then
``sacct``. The parsers accept the JSON of Slurm 21.08 to 24.x (``job_state``
as a string or a list, ``exit_code`` as a wait status or an object) and the
``rc:signal`` exit codes of scontrol and sacct.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ACTIVE_STATES",
    "WAITING_STATES",
    "JobInfo",
    "JobQuery",
    "JobTable",
    "decode_exit",
    "parse_scontrol_job",
    "parse_squeue_columns",
    "parse_squeue_json",
    "parse_squeue_table",
    "read_tail",
    "slurm_version",
    "slurmctld_host",
    "state_name",
    "unlink_quiet",
]

#: job states in which the job still holds (or waits for) resources
ACTIVE_STATES = frozenset({
    "PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED",
    "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED",
    "RESV_DEL_HOLD", "POWER_UP_NODE", "UPDATE_DB",
})
#: states in which the workers have not started yet
WAITING_STATES = frozenset({"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD",
                            "REQUEUE_FED", "RESV_DEL_HOLD", "POWER_UP_NODE"})



@dataclass
class JobInfo:
    """What Slurm says about one job (state names as ``squeue -o %T`` prints them)."""

    job_id: str
    state: str
    reason: str = ""
    nodes: str = ""
    exit_code: int | None = None

    @property
    def active(self) -> bool:
        return self.state in ACTIVE_STATES


def decode_exit(value: Any) -> int | None:
    """An exit code from any of Slurm's spellings (negative: killed by that signal).

    ``768`` (a wait status, JSON of 21.08/22.05), ``"3:0"`` (``rc:signal``,
    scontrol and sacct), ``{"return_code": {"number": 3}, "signal": ...}``
    (JSON of 23.x/24.x).
    """
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, int):
        sig = value & 0x7F
        return -sig if sig and sig != 0x7F else (value >> 8) & 0xFF
    if isinstance(value, str):
        m = re.match(r"^\s*(\d+)(?::(\d+))?\s*$", value)
        if not m:
            return None
        rc, sig = int(m.group(1)), int(m.group(2) or 0)
        return -sig if sig else rc
    if isinstance(value, dict):
        if "number" in value:  # {"set": true, "number": 3}
            return int(value["number"]) if value.get("set", True) else None
        signo = value.get("signal")
        if isinstance(signo, dict):
            signo = signo.get("id", signo.get("signal_id"))
            if isinstance(signo, dict):
                signo = signo.get("number") if signo.get("set", True) else None
        if isinstance(signo, int) and signo > 0:
            return -signo
        code = value.get("return_code")
        if isinstance(code, dict):
            code = code.get("number") if code.get("set", True) else None
        return int(code) if isinstance(code, int) else None
    return None


def state_name(value: Any) -> str:
    if isinstance(value, list):
        value = value[0] if value else ""
    if isinstance(value, dict):  # {"current": [...]} in some versions
        return state_name(value.get("current") or value.get("name") or "")
    return str(value or "").upper().rstrip("+")


def parse_squeue_json(text: str, job_id: str) -> JobInfo | None:
    """Job ``job_id`` from ``squeue --json`` output (None if it is not listed).

    Raises
    ------
    ValueError
        If ``text`` is not squeue's JSON.
    """
    data = json.loads(text)
    if not isinstance(data, dict) or not isinstance(data.get("jobs"), list):
        raise ValueError("no 'jobs' list in squeue's JSON")  # noqa: TRY004 - bad input text
    for j in data["jobs"]:
        if str(j.get("job_id")) != str(job_id):
            continue
        nodes = j.get("nodes") or j.get("node_list") or ""
        return JobInfo(str(job_id), state_name(j.get("job_state")),
                       str(j.get("state_reason") or ""),
                       nodes if isinstance(nodes, str) else "",
                       decode_exit(j.get("exit_code")))
    return None


def parse_squeue_columns(text: str, job_id: str) -> JobInfo | None:
    """Job ``job_id`` from ``squeue -h -o '%i|%T|%r|%N'`` output."""
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) >= 2 and parts[0].strip() == str(job_id):
            parts += [""] * (4 - len(parts))
            return JobInfo(str(job_id), state_name(parts[1].strip()), parts[2].strip(),
                           parts[3].strip())
    return None


def parse_squeue_table(text: str) -> dict[str, JobInfo]:
    """Every job (or step) of ``squeue -h -o '%i|%T|%r|%N'`` output, by id.

    Lines that are not ``id|...`` (a header, a warning) are skipped; a step
    listing (``squeue -s -o %i``) gives entries of state ``RUNNING``.
    """
    out: dict[str, JobInfo] = {}
    for line in text.splitlines():
        parts = [p.strip() for p in line.strip().split("|")]
        if not parts or not re.match(r"^\d+(?:_\d+)?(?:\.\w+)?$", parts[0]):
            continue
        parts += [""] * (4 - len(parts))
        out[parts[0]] = JobInfo(parts[0], state_name(parts[1] or "RUNNING"), parts[2],
                                parts[3])
    return out


def parse_scontrol_job(text: str, job_id: str) -> JobInfo | None:
    """Job ``job_id`` from ``scontrol show job -o ID`` (``Key=Value`` tokens)."""
    fields = dict(re.findall(r"(\w+)=(\S*)", text))
    if fields.get("JobId") != str(job_id) or "JobState" not in fields:
        return None
    nodes = fields.get("NodeList", "")
    return JobInfo(str(job_id), state_name(fields["JobState"]),
                   fields.get("Reason", "").replace("None", ""),
                   "" if nodes == "(null)" else nodes, decode_exit(fields.get("ExitCode")))


class JobQuery:
    """Reads one job's state with what this Slurm supports (JSON, else columns).

    Parameters
    ----------
    run : callable(cmd, timeout=...) -> subprocess.CompletedProcess
        Runs a Slurm command (raises ``subprocess.TimeoutExpired``).
    """

    def __init__(self, run: Callable[..., subprocess.CompletedProcess]) -> None:
        self.run = run
        self.json: bool | None = None  # does `squeue --json` work here?

    def __call__(self, job_id: str) -> JobInfo | None:
        """The state of ``job_id``: None when Slurm could not be asked (then
        nothing is concluded), state ``GONE`` once Slurm has forgotten the job."""
        if self.json is not False:
            try:
                cp = self.run(["squeue", "--json", "--jobs", job_id])
            except subprocess.TimeoutExpired:
                return None
            if cp.returncode == 0:
                try:
                    info = parse_squeue_json(cp.stdout, job_id)
                except ValueError:  # not the JSON we know: use columns from now on
                    self.json = False
                    return self(job_id)
                # Slurm 21.08/22.05 list every job of the cluster here: on a busy
                # cluster the columns (which honour --jobs) are much cheaper
                self.json = len(cp.stdout) < 1_000_000
                return info if info is not None else self.finished(job_id)
            if _invalid_job(cp):
                return self.finished(job_id)
            if self.json is None:  # no --json here (Slurm < 21.08, or no JSON plugin)
                self.json = False
                return self(job_id)
            return None
        try:
            cp = self.run(["squeue", "-h", "--jobs", job_id, "-o", "%i|%T|%r|%N"])
        except subprocess.TimeoutExpired:
            return None
        if cp.returncode == 0:
            info = parse_squeue_columns(cp.stdout, job_id)
            return info if info is not None else self.finished(job_id)
        return self.finished(job_id) if _invalid_job(cp) else None

    def finished(self, job_id: str) -> JobInfo | None:
        """A job squeue no longer lists: from scontrol, else sacct, else ``GONE``
        (None when slurmctld does not answer)."""
        try:
            cp = self.run(["scontrol", "show", "job", "-o", job_id])
            if cp.returncode == 0:
                info = parse_scontrol_job(cp.stdout, job_id)
                if info is not None:
                    return info
            elif not _invalid_job(cp):
                return None
            cp = self.run(["sacct", "-n", "-P", "-X", "-j", job_id, "-o",
                           "JobID,State,ExitCode,NodeList"])
        except subprocess.TimeoutExpired:
            return None
        if cp.returncode == 0:  # (fails without accounting storage: nothing more to learn)
            for line in cp.stdout.splitlines():
                parts = line.split("|")
                if len(parts) >= 3 and parts[0] == job_id:
                    return JobInfo(job_id, state_name(parts[1].split()[0] if parts[1] else ""),
                                   "", parts[3] if len(parts) > 3 else "",
                                   decode_exit(parts[2]))
        return JobInfo(job_id, "GONE")


class JobTable:
    """The jobs of one user as ``squeue`` lists them, read at most once per ``ttl``.

    One ``squeue -u USER`` call answers for every job of the user (the mesh
    registry asks about each Slurm mesh it lists); job steps (``"12.0"``) are
    read with ``squeue -s`` the same way.

    Parameters
    ----------
    run : callable(cmd, timeout=...) -> subprocess.CompletedProcess, optional
        Runs a Slurm command (raises ``subprocess.TimeoutExpired`` or ``OSError``);
        default: :func:`subprocess.run` with a 10 s timeout.
    user : str or int, optional
        Whose jobs (name or uid; default: this process's uid).
    ttl : float
        Seconds an answer is reused.
    """

    def __init__(self, run: Callable[..., subprocess.CompletedProcess] | None = None,
                 user: str | int | None = None, ttl: float = 2.0) -> None:
        self.run = run or _run_quiet
        self.user = str(os.getuid() if user is None else user)
        self.ttl = ttl
        self._cache: dict[bool, tuple[float, dict[str, JobInfo] | None]] = {}

    def _table(self, steps: bool) -> dict[str, JobInfo] | None:
        now = time.monotonic()
        hit = self._cache.get(steps)
        if hit is not None and now - hit[0] < self.ttl:
            return hit[1]
        cmd = (["squeue", "-h", "-s", "-u", self.user, "-o", "%i"] if steps
               else ["squeue", "-h", "-u", self.user, "-o", "%i|%T|%r|%N"])
        try:
            cp = self.run(cmd, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            table = None
        else:
            table = parse_squeue_table(cp.stdout) if cp.returncode == 0 else None
        self._cache[steps] = (now, table)
        return table

    def get(self, job: str) -> JobInfo | None:
        """What squeue says of ``job`` (a job id, or ``JOB.STEP``): its
        :class:`JobInfo`, state ``GONE`` when squeue lists it no more (not
        this user's, ended, or never was), None when squeue could not be asked
        (no Slurm client here, slurmctld down: nothing can be concluded)."""
        job = str(job).strip()
        table = self._table("." in job)
        if table is None:
            return None
        return table.get(job) or JobInfo(job, "GONE")

    def alive(self, job: str | None) -> bool | None:
        """True while ``job`` is pending or running (not completing), False once
        it ends or is gone (or ``job`` is empty), None when Slurm cannot be asked."""
        if not job:
            return False
        info = self.get(job)
        if info is None:
            return None
        return info.active and info.state != "COMPLETING"

    def clear(self) -> None:
        """Forget the answers (the next question asks squeue)."""
        self._cache.clear()


def _run_quiet(cmd: list[str], timeout: float = 10.0) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def _invalid_job(cp: subprocess.CompletedProcess) -> bool:
    """True when Slurm answered that it knows no such job."""
    return "invalid job id" in (cp.stderr + cp.stdout).lower()


def slurmctld_host() -> str | None:
    """The (first) slurmctld host's address or name, from ``scontrol show config``."""
    try:
        cp = subprocess.run(["scontrol", "show", "config"], check=False, capture_output=True,
                            text=True, timeout=10, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in cp.stdout.splitlines():
        m = re.match(r"^\s*(?:SlurmctldHost\[0\]|ControlMachine|ControlAddr)\s*=\s*(\S+)", line)
        if m:
            value = m.group(1)
            inner = re.match(r"^([^()]+)\(([^()]+)\)$", value)  # name(addr)
            return inner.group(2) if inner else value
    return None


_version: tuple[int, int] | None = None


def slurm_version() -> tuple[int, int]:
    """(major, minor) of the Slurm client (``srun --version``); (0, 0) if unknown."""
    global _version
    if _version is None:
        try:
            out = subprocess.run(["srun", "--version"], check=False, capture_output=True,
                                 text=True, timeout=10, stdin=subprocess.DEVNULL).stdout
            m = re.search(r"(\d+)\.(\d+)", out)
            _version = (int(m.group(1)), int(m.group(2))) if m else (0, 0)
        except (OSError, subprocess.TimeoutExpired):
            _version = (0, 0)
    return _version


def read_tail(path: str | None, size: int = 8192) -> str:
    """The last ``size`` bytes of ``path`` as text ("" if it cannot be read here)."""
    if not path:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - size))
            return f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


def unlink_quiet(path: str) -> None:
    """Remove ``path`` if it exists."""
    try:
        os.unlink(path)
    except OSError:
        pass
