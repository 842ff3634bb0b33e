"""A guardian: a small process that ends a mesh's workers when their controller ends.

A worker's own watchdog is a Python thread: it cannot run while the rank's
main thread holds the GIL in C code (``sum(range(10**13))``, a catastrophic
regular expression), and it knows nothing of the processes that user code
on the rank started. The guardian is a separate interpreter, started once
per launcher by the controller (its parent) in a session of its own (a
Ctrl-C or a ``killpg`` meant for the kernel does not reach it). It is told,
one line per event on its stdin:

``watch PID``
    a local worker (started with ``start_new_session=True``: its pid is its
    process group and session). When the worker exits, for whatever reason,
    what is left of its process group and session (processes that user code
    on the rank started, their children...) gets SIGTERM, then SIGKILL
    ``grace`` seconds later.
``onexit KEY JSON``
    commands to run if the controller ends first, e.g. cancelling a Slurm
    job: ``{"term": [argv, ...], "kill": [argv, ...]}``; the ``term``
    commands run at once, the ``kill`` ones ``grace`` seconds later.
``drop KEY``
    forget the ``onexit`` entry ``KEY`` (the job ended normally).
``rmdir PATH``
    a directory of the controller's (its private directory for Unix sockets,
    named ``mk-PID-...``) to remove if the controller ends first: a
    controller killed with SIGKILL (a kernel shut down "now") cannot remove it.
``keep PATH``
    forget ``rmdir PATH`` (the controller removes it itself).
``job JOBID``
    (detached guardian) a Slurm job whose end is the end of the mesh: it
    counts as a watched worker until ``squeue`` lists it no more (asked
    every :data:`JOB_POLL` seconds; an unanswered ``squeue`` concludes
    nothing).
``rmfile PATH TOKEN``
    a file to remove when everything ends (a detached mesh's registry
    record), only if it still contains ``TOKEN`` (the mesh's id: a later
    mesh of the same name has another). While the mesh runs, the guardian
    also keeps that record right about its controller (see below).

A guardian started ``detached`` (the third argument; one per detachable
mesh) is not tied to its controller: when the controller ends it goes on
watching the workers (which outlive it, see
:mod:`monarch_kernel.worker.detach`), ending what is left of each one's
session as it exits; once every watched worker has ended it removes the
``rmdir`` directories and the ``rmfile`` files and exits. Its ``onexit``
commands never run. Every :data:`RECORD_POLL` seconds it reads each
``rmfile`` record (a JSON object whose ``mesh_id`` is ``TOKEN``): when the
controller it names (``{"pid", "host"}``, on this host, whichever controller
attached last) no longer runs (gone, or a zombie that nobody reaped), it
rewrites the record with ``controller`` null and ``last_seen`` set to the
last moment that controller was known to run (the later of the record's own
``last_seen`` and the guardian's last look that found it running). The
ranks start their keep-alive when they notice the death, never before it,
so a keep-alive counted from ``last_seen`` is never longer than what they
wait.

When the controller ends (its pidfd becomes readable, or stdin reaches end
of file: the controller closed it, or died), every watched worker's process
group and session get SIGTERM, the ``term`` commands run, and ``grace``
seconds later (or as soon as every group is empty) the survivors get SIGKILL
and the ``kill`` commands run; then the guardian exits. A worker busy in C
code therefore ends at most ``grace`` seconds (plus the time Slurm takes to
deliver a signal, for jobs) after its controller.

Processes that leave their rank's session (``setsid``,
``start_new_session=True``) are not followed: that is how a rank starts a
process meant to outlive it.

This file runs as a script (``python -I -S guard.py CONTROLLER_PID``) and
imports nothing but the standard library; :class:`Guardian` is the
controller's handle on it.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

__all__ = ["DEFAULT_GRACE", "JOB_POLL", "Guardian"]

#: seconds between SIGTERM and SIGKILL
DEFAULT_GRACE = 2.0
#: seconds between a detached guardian's questions to squeue about its jobs
JOB_POLL = 2.0
#: seconds between a detached guardian's looks at the controller its records name
RECORD_POLL = 0.5


# ------------------------------------------------------------------ killing
def _members(ids: set[int]) -> list[tuple[int, int, int]] | None:
    """``(pid, process group, session)`` of the live (not zombie) processes
    whose process group or session is in ``ids``; None where /proc cannot tell."""
    out: list[tuple[int, int, int]] = []
    try:
        names = os.listdir("/proc")
    except OSError:
        return None
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
            fields = stat[stat.rfind(b")") + 2:].split()  # state ppid pgrp session ...
            state, pgrp, sid = fields[0], int(fields[2]), int(fields[3])
        except (OSError, IndexError, ValueError):
            continue
        if (pgrp in ids or sid in ids) and state not in (b"Z", b"X"):
            out.append((int(name), pgrp, sid))
    return out


def _running(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, ended but not reaped, does not): the
    test of :func:`monarch_kernel.util.procs.running`, repeated here because this
    file runs as a script (``python -I -S``) that cannot import the package."""
    if pid < 1:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def _signal_trees(ids: set[int], sig: int) -> set[int]:
    """Send ``sig`` to process groups ``ids`` and to the other processes of
    sessions ``ids``; return the ids that still have a live process (sig 0:
    only look)."""
    if not ids:
        return set()
    members = _members(ids)
    if members is None:  # no /proc: the groups only
        left = set()
        for pgid in ids:
            try:
                os.killpg(pgid, sig)
                left.add(pgid)
            except (ProcessLookupError, PermissionError):
                pass
        return left
    left = {pgrp for _, pgrp, _ in members if pgrp in ids}
    left |= {sid for _, _, sid in members if sid in ids}
    if sig:
        for pgid in left & ids:
            try:
                os.killpg(pgid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        for pid, pgrp, sid in members:
            if sid in ids and pgrp not in ids:
                try:
                    os.kill(pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
    return left


# ------------------------------------------------------------- the process
class _Watch:
    """The guardian's state and loop (runs in the guardian process)."""

    def __init__(self, controller: int, grace: float, detached: bool = False) -> None:
        self.controller = controller
        self.grace = grace
        self.detached = detached
        self.files: dict[str, str] = {}  # path -> token (rmfile)
        self.jobs: dict[str, float] = {}  # Slurm job -> when squeue is asked next
        self.watched = False  # a worker was watched (detached: the end is when none is left)
        self.poll = select.poll()
        self.fds: dict[int, int] = {}  # pidfd -> worker pid
        self.workers: set[int] = set()
        self.polled: set[int] = set()  # workers without a pidfd: looked at every 0.1 s
        self.onexit: dict[str, dict[str, list[list[str]]]] = {}
        self.dirs: set[str] = set()  # removed when the controller ends
        self.pending: dict[int, float] = {}  # pgid -> when SIGKILL is due
        self.ended: set[int] = set()  # workers that ended in this round
        #: record path -> (controller pid, epoch s) of the last look that found it running
        self.seen: dict[str, tuple[int, float]] = {}
        self.records_due = 0.0  # (monotonic) when the records are read next
        self.buf = b""
        self.ctl_fd = self._pidfd(controller)
        if self.ctl_fd is not None:
            self.poll.register(self.ctl_fd, select.POLLIN)
        self.poll.register(0, select.POLLIN)

    @staticmethod
    def _pidfd(pid: int) -> int | None:
        try:
            return os.pidfd_open(pid)
        except (AttributeError, OSError):
            return None

    def controller_gone(self) -> bool:
        return os.getppid() != self.controller

    def add(self, pid: int) -> None:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:  # already gone: end what is left of it
            self.ended.add(pid)
            return
        except (AttributeError, OSError):  # no pidfds here, or no fd left
            self.workers.add(pid)
            self.watched = True
            self.polled.add(pid)
            return
        self.fds[fd] = pid
        self.watched = True
        self.workers.add(pid)
        self.poll.register(fd, select.POLLIN)

    def command(self, line: str) -> None:
        verb, _, rest = line.partition(" ")
        if verb == "watch":
            self.add(int(rest))
        elif verb == "onexit":
            key, _, spec = rest.partition(" ")
            self.onexit[key] = json.loads(spec)
        elif verb == "drop":
            self.onexit.pop(rest.strip(), None)
        elif verb == "rmdir" and os.path.basename(rest).startswith(("mk-", "mkm-")):
            self.dirs.add(rest)
        elif verb == "job" and rest.strip().replace(".", "").isdigit():
            self.jobs[rest.strip()] = 0.0
            self.watched = True
        elif verb == "rmfile":
            path, _, token = rest.rpartition(" ")
            if path and token:
                self.files[path] = token
        elif verb == "keep":
            self.dirs.discard(rest)

    def end_groups(self) -> None:
        """SIGTERM what is left of the groups of the workers that ended."""
        ended, self.ended = self.ended, set()
        self.workers -= ended
        due = time.monotonic() + self.grace
        for pgid in _signal_trees(ended, signal.SIGTERM):
            self.pending[pgid] = due

    def due(self) -> None:
        """Forget the groups that are empty; SIGKILL the ones whose grace passed."""
        now = time.monotonic()
        left = _signal_trees(set(self.pending), 0)
        late = {g for g in left if now >= self.pending[g]}
        _signal_trees(late, signal.SIGKILL)
        self.pending = {g: t for g, t in self.pending.items() if g in left and g not in late}

    def read_commands(self) -> bool:
        """Carry out the commands waiting on stdin; False at its end."""
        try:
            data = os.read(0, 65536)
        except BlockingIOError:
            return True
        if not data:
            return False
        self.buf += data
        *lines, self.buf = self.buf.split(b"\n")
        for line in lines:
            try:
                self.command(line.decode())
            except (ValueError, TypeError, UnicodeDecodeError):
                pass
        return True

    def _let_go(self, fd: int) -> None:
        """Detached: the controller ended (``fd``: its pidfd or stdin); go on."""
        try:
            self.poll.unregister(fd)
        except (KeyError, ValueError):
            pass
        if fd == self.ctl_fd:
            os.close(fd)
            self.ctl_fd = None
        self.controller_left = True

    def cleanup(self) -> None:
        """Remove the directories and files it was given (after the workers)."""
        for path in self.dirs:
            shutil.rmtree(path, ignore_errors=True)
        for path, token in self.files.items():
            try:
                with open(path) as f:
                    if token not in f.read():
                        continue
                os.unlink(path)
            except OSError:
                pass

    def run(self) -> None:
        self.controller_left = False
        if self.detached:
            return self.run_detached()
        if self.controller_gone():  # it died while we started: what did it start?
            os.set_blocking(0, False)
            while self.read_commands() and select.select([0], [], [], 0.2)[0]:
                pass
            return self.controller_ended()
        while True:
            polling = self.ctl_fd is None
            timeout = 100 if (self.pending or self.polled or polling) else None
            for fd, _ in self.poll.poll(timeout):
                if fd == 0:
                    if not self.read_commands():
                        return self.controller_ended()
                elif fd == self.ctl_fd:
                    return self.controller_ended()
                else:
                    self.poll.unregister(fd)
                    os.close(fd)
                    self.ended.add(self.fds.pop(fd))
            if polling and self.controller_gone():  # no pidfd: look every 0.1 s
                return self.controller_ended()
            self.workers_step()

    def workers_step(self) -> None:
        """Note workers (watched without a pidfd) that ended, end what is left of
        the groups of every ended worker, and run the kill commands that are due."""
        for pid in list(self.polled):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                self.polled.discard(pid)
                self.ended.add(pid)
        if self.ended:
            self.end_groups()
        if self.pending:
            self.due()

    def run_detached(self) -> None:
        """Watch the workers until none is left, the controller's end or not."""
        stdin_open = True
        while True:
            timeout = 100 if (self.pending or self.polled) else 1000
            for fd, _ in self.poll.poll(timeout):
                if fd == 0:
                    if not self.read_commands():
                        self._let_go(0)
                        stdin_open = False
                elif fd == self.ctl_fd:
                    self._let_go(fd)
                else:
                    self.poll.unregister(fd)
                    os.close(fd)
                    self.ended.add(self.fds.pop(fd))
            self.workers_step()
            if self.jobs:
                self.check_jobs()
            if self.files and time.monotonic() >= self.records_due:
                self.records_due = time.monotonic() + RECORD_POLL
                for path, token in list(self.files.items()):
                    self.check_record(path, token)
            if self.watched and not self.workers and not self.pending and not self.jobs:
                if stdin_open:  # (the commands sent with the last worker's end)
                    os.set_blocking(0, False)
                    self.read_commands()
                self.cleanup()
                return
            if not stdin_open and not self.watched:
                self.cleanup()  # (nothing was ever started)
                return

    def check_record(self, path: str, token: str) -> None:
        """Mark the record at ``path`` (mesh ``token``) detached if the controller on
        this host that it names no longer runs (see the module docstring)."""
        now = time.time()
        try:
            with open(path) as f:
                text = f.read()
            rec = json.loads(text)
            ctl = rec.get("controller") if rec.get("mesh_id") == token else None
            if not isinstance(ctl, dict) or ctl.get("host") != os.uname().nodename:
                return
            pid = int(ctl.get("pid", 0))
        except (OSError, ValueError, TypeError, AttributeError):
            return
        if _running(pid):
            self.seen[path] = (pid, now)
            return
        seen_pid, seen_t = self.seen.pop(path, (0, 0.0))
        last = float(rec.get("last_seen") or 0.0)
        rec["controller"] = None
        rec["last_seen"] = max(last, seen_t if seen_pid == pid else 0.0)
        tmp = f"{path}.{os.getpid()}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(rec, sort_keys=True))
            with open(path) as f:  # (not if a controller attached meanwhile)
                if f.read() != text:
                    os.unlink(tmp)
                    return
            os.replace(tmp, path)
        except OSError:
            try:
                os.unlink(tmp)
            except OSError:
                pass

    def check_jobs(self) -> None:
        """Forget the Slurm jobs that squeue lists no more (asked every JOB_POLL s)."""
        now = time.monotonic()
        for job, due in list(self.jobs.items()):
            if now < due:
                continue
            self.jobs[job] = now + JOB_POLL
            try:
                cp = subprocess.run(["squeue", "-h", "-j", job.split(".")[0], "-o", "%T"],
                                    stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                    timeout=30, check=False)
            except (OSError, subprocess.SubprocessError):
                continue  # (no answer: nothing concluded)
            said = (cp.stdout + cp.stderr).lower()
            if (cp.returncode == 0 and not cp.stdout.strip()) or "invalid job id" in said:
                del self.jobs[job]

    def _run_all(self, phase: str) -> None:
        for spec in self.onexit.values():
            for argv in spec.get(phase, ()):
                try:
                    subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL, timeout=30, check=False)
                except (OSError, subprocess.SubprocessError):
                    pass

    def controller_ended(self) -> None:
        """End every watched group and run the ``onexit`` commands."""
        groups = _signal_trees(self.workers | self.ended, signal.SIGTERM) | set(self.pending)
        self._run_all("term")
        deadline = time.monotonic() + self.grace
        jobs = any(spec.get("kill") for spec in self.onexit.values())  # (cannot be watched)
        while (groups or jobs) and time.monotonic() < deadline:
            time.sleep(0.05)
            groups = _signal_trees(groups, 0)
        _signal_trees(groups, signal.SIGKILL)
        self._run_all("kill")
        for path in self.dirs:  # (after the workers, which may still use its sockets)
            shutil.rmtree(path, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    """Run the guardian (``guard.py CONTROLLER_PID [GRACE]``) until the controller ends."""
    args = sys.argv[1:] if argv is None else argv
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    controller = int(args[0])
    grace = float(args[1]) if len(args) > 1 else DEFAULT_GRACE
    detached = len(args) > 2 and args[2] == "detached"
    if detached:  # (the kernel's end, a Ctrl-C or SIGHUP of its terminal must not end it)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:  # one pidfd per worker
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ImportError, ValueError, OSError):
        pass
    _Watch(controller, grace, detached).run()
    return 0


# ------------------------------------------------------------- the handle
class Guardian:
    """The controller's handle on its guardian process (started on first use).

    Thread-safe. If the guardian process dies, the next call starts a new one
    (:meth:`ensure` says so, so that the caller can tell it again what to
    watch).

    Parameters
    ----------
    grace : float
        Seconds between SIGTERM and SIGKILL.
    """

    def __init__(self, grace: float = DEFAULT_GRACE, detached: bool = False) -> None:
        self.grace = grace
        #: a detached mesh's guardian: not tied to this process (see the module docstring)
        self.detached = detached
        self.proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self._onexit: dict[str, str] = {}
        self._dirs: list[str] = []

    @property
    def pid(self) -> int | None:
        """The guardian's pid (None before it started)."""
        return None if self.proc is None else self.proc.pid

    def ensure(self) -> bool:
        """Start the guardian if it is not running; True if it was (re)started
        now. Raises OSError if it cannot be started."""
        with self._lock:
            if self.proc is not None and self.proc.poll() is None:
                return False
            self.proc = subprocess.Popen(
                [sys.executable, "-I", "-S", os.path.abspath(__file__), str(os.getpid()),
                 repr(self.grace), *(["detached"] if self.detached else [])],
                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, start_new_session=True,
                # (a detached one outlives this process: it must not hold its stderr,
                # which whoever reads this process's output waits on)
                stderr=subprocess.DEVNULL if self.detached else None,
            )
            for line in self._onexit.values():
                self._write(line)
            for path in self._dirs:
                self._write(f"rmdir {path}")
            return True

    def _write(self, line: str) -> None:
        proc = self.proc
        if proc is None or proc.stdin is None:
            return
        try:
            proc.stdin.write(line.encode() + b"\n")
            proc.stdin.flush()
        except (BrokenPipeError, ValueError, OSError):
            pass  # (it died: the next ensure() starts another)

    def watch(self, pids: list[int]) -> None:
        """End the process group and session of each of ``pids`` (local
        workers, each the leader of its own session) when it exits, or when
        this process ends."""
        with self._lock:
            for pid in pids:
                self._write(f"watch {int(pid)}")

    def on_exit(self, key: str, term: Sequence[list[str]],
                kill: Sequence[list[str]] = ()) -> None:
        """Run commands ``term`` (then ``kill``, ``grace`` seconds later) if this
        process ends before :meth:`drop` ``(key)``; replaces an entry of the same key."""
        line = f"onexit {key} " + json.dumps({"term": list(term), "kill": list(kill)})
        with self._lock:
            self._onexit[key] = line
            self._write(line)

    def remove_on_exit(self, path: str) -> None:
        """Remove directory ``path`` (a private directory of this process, named
        ``mk-PID-...`` by :func:`~monarch_kernel.transport.sockets.private_dir`;
        other names are ignored) if this process ends before :meth:`close`:
        killed, it cannot remove it itself. Told to the guardian when it runs
        (now, or when it is started)."""
        if "\n" in path or not os.path.basename(path).startswith(("mk-", "mkm-")):
            return
        with self._lock:
            if path not in self._dirs:
                self._dirs.append(path)
                self._write(f"rmdir {path}")

    def remove_file_at_end(self, path: str, token: str) -> None:
        """(Detached guardian) remove file ``path`` once every worker ended, if it
        still contains ``token``."""
        if "\n" in path or " " in token or "\n" in token or not token:
            return
        with self._lock:
            line = f"rmfile {path} {token}"
            self._onexit[f"rmfile:{path}"] = line  # (told again to a restarted guardian)
            self._write(line)

    def watch_job(self, job: str) -> None:
        """(Detached guardian) count Slurm job ``job`` as a watched worker until
        squeue lists it no more."""
        if not job.replace(".", "").isdigit():
            return
        with self._lock:
            line = f"job {job}"
            self._onexit[f"job:{job}"] = line  # (told again to a restarted guardian)
            self._write(line)

    def release(self) -> None:
        """Let go of a detached guardian without stopping it: it goes on watching
        the workers (this process detaches from the mesh)."""
        with self._lock:
            proc, self.proc = self.proc, None
            self._onexit.clear()
            self._dirs.clear()
        if proc is not None and proc.stdin is not None:
            try:
                proc.stdin.close()
            except OSError:
                pass

    def drop(self, key: str) -> None:
        """Forget the :meth:`on_exit` entry ``key``."""
        with self._lock:
            if self._onexit.pop(key, None) is not None:
                self._write(f"drop {key}")

    def close(self, timeout: float = DEFAULT_GRACE + 1.0) -> None:
        """Stop the guardian: the :meth:`on_exit` commands are dropped (the
        caller ended those jobs itself); the process groups it still watches end
        as if this process had (SIGTERM, SIGKILL after ``grace``). Waits up to
        ``timeout`` seconds for it."""
        with self._lock:
            for key in self._onexit:  # (what the caller stopped itself)
                self._write(f"drop {key}")
            self._onexit.clear()
            for path in self._dirs:  # (the caller removes those itself when it closes)
                self._write(f"keep {path}")
            self._dirs.clear()
            proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            if proc.stdin is not None:
                proc.stdin.close()
        except OSError:
            pass
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


if __name__ == "__main__":
    sys.exit(main())
