"""A template process (a "zygote") that starts local workers by ``fork``.

Starting ``python -m monarch_kernel worker`` costs a Python start-up and the
import of the worker's modules, pyzmq and cloudpickle, once per rank. The
zygote pays that once: it is a single-threaded process of ours that has
imported those modules (never torch, unless ``MONARCH_ZYGOTE_PRELOAD`` names
it) and forks one child per worker on request, so N workers cost about N
forks. :func:`start_worker` is the launcher's seam: it takes what
``subprocess.Popen`` would (argv, environment, stdout/stderr, fds to pass)
and returns a :class:`WorkerProcess` with Popen's ``pid``, ``returncode``,
``poll``, ``wait``, ``send_signal``, ``terminate`` and ``kill``; it starts a
plain ``subprocess.Popen`` where the zygote cannot be used.

How a child is made (each as ``subprocess.Popen(..., start_new_session=True,
pass_fds=...)`` would):

- The launcher sends the request (argv, environment, working directory,
  which fd numbers the child gets) over a ``SOCK_SEQPACKET`` socket pair
  (no name in the file system: no other process, of this user or another,
  can connect) and the fds themselves with ``SCM_RIGHTS``.
- The child calls ``setsid()`` (its pid is its process group and session:
  the guardian, :mod:`.guard`, watches it as any local worker), resets the
  signal dispositions Python starts with, gets exactly the fds asked for
  under the numbers asked for (0 is ``/dev/null``; every other fd is
  closed), the rank's environment, the launcher's working directory, fresh
  random state (``random`` and, if imported, ``numpy.random``), and its
  ``/proc/PID/cmdline`` and ``environ`` rewritten to the worker's argv and
  environment (``ps``, ``psutil`` and the tests find it as a worker). Then
  it runs the module as ``python -m`` would, and exits with its status.
- The zygote reaps its children and reports each exit status; the launcher's
  handle reports it as Popen would (negative: killed by that signal). Signals
  are sent with a pidfd, so a pid reused after an exit is never signalled.

Lifetime: the zygote ends when the process that started it ends (its end of
the socket pair closes, or its pidfd becomes readable), however it ends. It
never signals its children and they do not get a parent-death signal (Linux
clears it at ``fork``; we never set one on them): they are session leaders of
their own, so when the zygote ends they are re-parented and run on. Workers
of a detached mesh therefore outlive the kernel exactly as Popen-started ones
do; the guardian is what ends the workers of an ordinary mesh with the kernel.

If the zygote dies while the kernel lives, the next start warns and starts a
new one (at most :data:`MAX_RESTARTS` times, then every worker starts as its
own Python, with a warning). Workers it had started still run; their exit is
still seen (pidfd), but their exit status is lost and reported as
:data:`UNKNOWN_STATUS`.

What a fork shares with its zygote, unlike a new Python: the ``hash()`` seed
(``PYTHONHASHSEED``: the same on every rank), the umask and resource limits
of the kernel when the zygote started, and what Python reads only when it
starts. So a request whose ``PYTHON*``, ``LD_*`` or ``MALLOC_*`` variables
differ from the zygote's gets a new zygote started with them (the old one
still serves the workers it started), and one for another interpreter, or
whose argv or environment do not fit in the room kept for them in ``/proc``
(8 KiB, 64 KiB), starts the plain way. ``MONARCH_ZYGOTE=0`` turns the zygote
off (:func:`~monarch_kernel.util.switches.zygote_enabled`).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Mapping, Sequence

from monarch_kernel.util.switches import zygote_enabled

__all__ = ["MAX_RESTARTS", "PRELOAD_ENV", "UNKNOWN_STATUS", "WorkerProcess", "Zygote",
           "current", "prestart", "shutdown", "start_worker"]

#: modules the zygote imports besides the worker's own (comma-separated, e.g. "torch")
PRELOAD_ENV = "MONARCH_ZYGOTE_PRELOAD"
#: how many times a dead zygote is replaced before workers start the plain way
MAX_RESTARTS = 3
#: exit status reported for a worker whose zygote died before it (status unknown)
UNKNOWN_STATUS = 255
#: bytes of room for the worker's argv and environment in /proc (see _rewrite_area)
_ARGV_ROOM = 8192
_ENV_ROOM = 65536
_PAD_VAR = "MONARCH_ZYGOTE_ROOM"
_MAX_MSG = 4 << 20
_STARTUP_PREFIXES = ("PYTHON", "LD_", "MALLOC_")
#: how the zygote runs (not ``-m``: this module is imported by its package first)
_ENTRY = "import sys; from monarch_kernel.launchers.zygote import main; sys.exit(main())"


# ----------------------------------------------------------- in the zygote
def _proc_areas() -> tuple[int, int, int, int] | None:
    """``(arg_start, arg_end, env_start, env_end)`` of this process (/proc)."""
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read()
        fields = stat[stat.rfind(b")") + 2:].split()  # fields[0] is field 3 (state)
        return int(fields[45]), int(fields[46]), int(fields[47]), int(fields[48])
    except (OSError, IndexError, ValueError):
        return None


def _rewrite_area(start: int, end: int, items: Sequence[str]) -> bool:
    """Write ``items`` NUL-separated over memory ``[start, end)`` (the rest
    NULs, the last byte NUL): what ``/proc/PID/cmdline`` or ``environ`` shows."""
    import ctypes

    data = b"".join(s.encode("utf-8", "surrogateescape") + b"\0" for s in items)
    if start <= 0 or len(data) >= end - start:
        return False
    ctypes.memmove(start, data + b"\0" * (end - start - len(data)), end - start)
    return True


def _arrange_fds(fds: list[int], targets: list[int]) -> None:
    """Make ``fds[i]`` this process's fd ``targets[i]`` (inheritable), fd 0
    ``/dev/null`` unless asked for, and close every other fd."""
    floor = max([*fds, *targets, 2]) + 1
    moved = [_dup_above(f, floor) for f in fds]
    keep = set(moved)
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd not in keep:
            with contextlib.suppress(OSError):
                os.close(fd)
    for src, dst in zip(moved, targets, strict=True):
        os.dup2(src, dst, inheritable=True)
    if 0 not in targets:
        null = os.open(os.devnull, os.O_RDONLY)
        if null != 0:
            os.dup2(null, 0, inheritable=True)
            os.close(null)
    for src in moved:
        if src not in targets:
            os.close(src)


def _dup_above(fd: int, floor: int) -> int:
    import fcntl

    return fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, floor)


def _child(req: dict, fds: list[int], areas: tuple[int, int, int, int] | None,
           start_dir: str) -> int:
    """Become the worker ``req`` asks for and run it; returns its exit status."""
    import random
    import runpy

    os.setsid()
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # (as Python sets it when it starts)
    _arrange_fds(fds, list(req["fds"]))
    env = dict(req["env"])
    os.environ.clear()
    os.environ.update(env)
    cwd = req.get("cwd") or start_dir
    with contextlib.suppress(OSError):
        os.chdir(cwd)
    if sys.path and sys.path[0] == start_dir:  # (python -m puts the working directory first)
        sys.path[0] = cwd
    if areas is not None:
        _rewrite_area(areas[0], areas[1], req["argv"])
        _rewrite_area(areas[2], areas[3], [f"{k}={v}" for k, v in env.items()])
    random.seed()
    np = sys.modules.get("numpy")
    if np is not None:
        with contextlib.suppress(Exception):
            np.random.seed()
    module = req["argv"][2]
    sys.argv = [module, *req["argv"][3:]]
    # (as under python -m, the code run as __main__ is not also in sys.modules under
    # its own name: runpy warns otherwise, and a second copy would be unexpected)
    sys.modules.pop(_main_of(module) if _is_package(module) else module, None)
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return 0
    except SystemExit as e:
        if e.code is None:
            return 0
        if isinstance(e.code, int):
            return e.code
        print(e.code, file=sys.stderr)
        return 1


def _fork(req: dict, fds: list[int], areas: tuple[int, int, int, int] | None,
          start_dir: str) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        code = _child(req, fds, areas, start_dir)
    except BaseException:  # noqa: BLE001 - a child never returns into the zygote's loop
        with contextlib.suppress(BaseException):
            import traceback

            traceback.print_exc()
    finally:
        with contextlib.suppress(BaseException):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code & 0xFF if isinstance(code, int) else 1)
    return 0  # (never reached)


def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def _send(conn: socket.socket, obj: dict) -> bool:
    try:
        conn.send(json.dumps(obj).encode())
        return True
    except OSError:
        return False


def main(argv: list[str] | None = None) -> int:
    """Run the zygote: ``python -m monarch_kernel.launchers.zygote FD PARENT PRELOAD ROOM``."""
    args = sys.argv[1:] if argv is None else argv
    if sys.path and sys.path[0] == "":  # (python -c: the working directory, as -m puts it)
        sys.path[0] = os.getcwd()
    conn = socket.socket(fileno=int(args[0]))
    parent = int(args[1])
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.pop(_PAD_VAR, None)
    for name in ("ctypes", "fcntl", "random", "runpy", "traceback"):  # (what each child uses)
        importlib.import_module(name)
    error = ""
    for i, name in enumerate(filter(None, args[2].split(","))):
        try:
            importlib.import_module(name)
        except BaseException as e:  # noqa: BLE001 - reported to the launcher, which falls back
            if i == 0:  # (the others are only a head start: the worker imports what it needs)
                error = f"could not import {name}: {type(e).__name__}: {e}"
                break
    areas = _proc_areas()
    if not error and _threads() != 1:
        error = f"{_threads()} threads after the imports (a fork copies only one)"
    if not _send(conn, {"ready": os.getpid(), "error": error}) or error:
        return 1
    start_dir = os.getcwd()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    poller = select.poll()
    poller.register(conn, select.POLLIN)
    poller.register(wake_r, select.POLLIN)
    try:
        pfd = os.pidfd_open(parent)
        poller.register(pfd, select.POLLIN)
    except (AttributeError, OSError):
        pfd = -1
    while True:
        try:
            events = poller.poll(None if pfd >= 0 else 1000)
        except InterruptedError:
            continue
        if pfd < 0 and os.getppid() != parent:
            return 0
        for fd, _ in events:
            if fd == pfd:
                return 0  # the kernel ended: so do we (never our children)
            if fd == wake_r:
                with contextlib.suppress(OSError):
                    while os.read(wake_r, 4096):
                        pass
                while True:
                    try:
                        pid, status = os.waitpid(-1, os.WNOHANG)
                    except ChildProcessError:
                        break
                    if not pid:
                        break
                    _send(conn, {"exit": pid, "status": status})
            elif fd == conn.fileno():
                try:
                    msg, fds, _, _ = socket.recv_fds(conn, _MAX_MSG, 16)
                except OSError:
                    return 0
                if not msg:
                    return 0  # the kernel closed its end, or ended
                try:
                    req = json.loads(msg)
                    if _threads() != 1:
                        raise RuntimeError(f"{_threads()} threads in the zygote")
                    pid = _fork(req, fds, areas, start_dir)
                    reply = {"id": req["id"], "pid": pid}
                except Exception as e:  # noqa: BLE001 - told to the launcher, which falls back
                    reply = {"id": req.get("id") if isinstance(req, dict) else None,
                             "error": f"{type(e).__name__}: {e}"}
                for f in fds:
                    os.close(f)
                _send(conn, reply)


# ------------------------------------------------------------ in the kernel
class _Dead(Exception):
    """The zygote ended."""


class Zygote:
    """The launcher's handle on one zygote process (thread-safe).

    Parameters
    ----------
    module : str
        The module workers run (``python -m MODULE``); the zygote imports it
        (its ``__main__`` for a package) with pyzmq and cloudpickle.
    preload : sequence of str
        More modules to import in the zygote (those that fail to import are
        left to the workers).
    timeout : float
        Seconds to wait for the zygote to be ready, and for each reply.
    env : mapping or None
        The zygote's environment (``os.environ`` if None); workers whose
        ``PYTHON*``, ``LD_*``, ``MALLOC_*`` variables differ are not forked from it.

    Raises
    ------
    OSError
        If the zygote cannot be started or is not ready in time.
    """

    def __init__(self, module: str, preload: Sequence[str] = (), timeout: float = 60.0,
                 env: Mapping[str, str] | None = None) -> None:
        self.module = module
        self.timeout = timeout
        self.owner = os.getpid()
        base = dict(os.environ if env is None else env)
        self.startup_env = _startup_env(base)
        self._lock = threading.Lock()
        self._next = 0
        self.exits: dict[int, int] = {}
        self.dead = False
        #: it started but cannot fork workers (threads, a failed import): never retried
        self.refused = False
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock = ours
        names = [_main_of(module), "zmq", "cloudpickle", *preload]
        base[_PAD_VAR] = "x" * _ENV_ROOM
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _ENTRY, str(theirs.fileno()), str(os.getpid()),
                 ",".join(names), " " * _ARGV_ROOM],
                env=base, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),), start_new_session=True,
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._ready = False

    def _wait_ready(self) -> None:
        """Wait for the zygote's first message (its imports done); under ``_lock``.

        Raises
        ------
        OSError
            If it did not start, or cannot fork.
        """
        if self._ready:
            return
        try:
            ready = self._recv(self.timeout)
        except (_Dead, TimeoutError, ValueError) as e:
            self._died()
            raise OSError(f"the template process that starts workers did not start: {e}") from None
        if ready.get("error"):
            self.refused = True
            self._died()
            raise OSError(f"the template process that starts workers cannot fork: "
                          f"{ready['error']}")
        self._ready = True

    @property
    def pid(self) -> int:
        return self.proc.pid

    def usable_for(self, argv: Sequence[str], env: Mapping[str, str]) -> bool:
        """Whether a worker of ``argv`` and ``env`` can be forked from this zygote."""
        return (not self.dead and os.getpid() == self.owner and len(argv) >= 3
                and argv[0] == sys.executable and argv[1] == "-m" and argv[2] == self.module
                and _startup_env(env) == self.startup_env
                and sum(len(a) + 1 for a in argv) < _ARGV_ROOM
                and sum(len(k) + len(v) + 2 for k, v in env.items()) < _ENV_ROOM)

    def _read_one(self) -> dict | None:
        """Read one message (the socket is readable); an exit report is stored
        and None returned."""
        try:
            data = self.sock.recv(_MAX_MSG)
        except OSError as e:
            raise _Dead(str(e)) from None
        if not data:
            raise _Dead("it ended")
        msg = json.loads(data)
        if "exit" in msg:
            self.exits[msg["exit"]] = os.waitstatus_to_exitcode(msg["status"])
            return None
        return msg

    def _recv(self, timeout: float) -> dict:
        """The next message from the zygote that is not an exit report."""
        deadline = time.monotonic() + timeout
        while True:
            left = max(0.0, deadline - time.monotonic())
            if not select.select([self.sock], [], [], left)[0]:
                raise TimeoutError("no answer from the template process")
            msg = self._read_one()
            if msg is not None:
                return msg

    def drain(self) -> None:
        """Store the exit reports waiting on the socket (never blocks)."""
        if self.dead or not self._ready or not self._lock.acquire(blocking=False):
            return
        try:
            while select.select([self.sock], [], [], 0)[0]:
                self._read_one()
        except (_Dead, ValueError):
            self._died()
        finally:
            self._lock.release()

    def wait_any(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for a report from the zygote."""
        if self.dead:
            time.sleep(min(timeout, 0.05))
            return
        if select.select([self.sock], [], [], timeout)[0]:
            self.drain()

    def spawn(self, argv: Sequence[str], env: Mapping[str, str], fds: Mapping[int, int],
              cwd: str) -> int:
        """Fork a worker; ``fds`` maps each fd number of the child to one of ours.

        Raises
        ------
        OSError
            If the zygote is gone or refused (the caller starts the worker another way).
        """
        with self._lock:
            if self.dead:
                raise OSError("the template process has ended")
            self._wait_ready()
            self._next += 1
            rid = self._next
            req = json.dumps({"id": rid, "argv": list(argv), "env": dict(env), "cwd": cwd,
                              "fds": list(fds)}).encode()
            try:
                socket.send_fds(self.sock, [req], list(fds.values()))
                while True:
                    msg = self._recv(self.timeout)
                    if msg.get("id") == rid:
                        break
            except (_Dead, TimeoutError, OSError) as e:
                self._died()
                raise OSError(f"the template process that starts workers ended ({e})") from None
        if "pid" not in msg:
            raise OSError(f"the template process could not start the worker: {msg.get('error')}")
        return int(msg["pid"])

    def _died(self) -> None:
        if not self.dead:
            self.dead = True
            with contextlib.suppress(OSError):
                self.sock.close()

    def alive(self) -> bool:
        return not self.dead and self.proc.poll() is None

    def close(self, timeout: float = 5.0) -> None:
        """End the zygote (its children run on) and wait up to ``timeout`` s for it."""
        with self._lock:
            self._died()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


def _is_package(module: str) -> bool:
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return False
    return spec is not None and spec.submodule_search_locations is not None


def _main_of(module: str) -> str:
    """What the zygote imports of ``python -m MODULE``: ``MODULE.__main__`` for
    a package (whose ``if __name__ == "__main__"`` keeps it from running), else
    only the package that holds the module (importing the module would run it)."""
    if _is_package(module):
        return f"{module}.__main__"
    return module.rpartition(".")[0] or "sys"


def _startup_env(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(_STARTUP_PREFIXES) and k != _PAD_VAR}


class WorkerProcess:
    """A worker forked by a :class:`Zygote`, with the parts of
    ``subprocess.Popen`` the launchers use (``returncode`` negative: killed
    by that signal)."""

    def __init__(self, zygote: Zygote, pid: int, args: Sequence[str]) -> None:
        self.zygote = zygote
        self.pid = pid
        self.args = list(args)
        self.returncode: int | None = None
        try:
            self._pidfd: int | None = os.pidfd_open(pid)
        except (AttributeError, OSError):
            self._pidfd = None

    def poll(self) -> int | None:
        """The exit code, or None while the worker runs."""
        if self.returncode is not None:
            return self.returncode
        z = self.zygote
        z.drain()
        code = z.exits.pop(self.pid, None)
        if code is None and z.dead and not self._running():
            code = UNKNOWN_STATUS
        if code is not None:
            self.returncode = code
            if self._pidfd is not None:
                os.close(self._pidfd)
                self._pidfd = None
        return self.returncode

    def _running(self) -> bool:
        if self._pidfd is not None:
            return not select.select([self._pidfd], [], [], 0)[0]
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the exit code; raises ``subprocess.TimeoutExpired`` after ``timeout`` s."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = 0.05 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            self.zygote.wait_any(min(left, 0.05))
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        """Send ``sig`` if the worker still runs (never to a reused pid)."""
        if self.poll() is not None:
            return
        if self._pidfd is not None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, sig)
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __del__(self) -> None:
        fd, self._pidfd = getattr(self, "_pidfd", None), None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


_zygote: Zygote | None = None
_restarts = 0
_given_up = False
_zlock = threading.Lock()


def _get(module: str, preload: Sequence[str], env: Mapping[str, str]) -> Zygote | None:
    """The zygote for ``module`` and what Python reads from ``env`` when it
    starts (started, replaced or restarted as needed); None when workers must
    start the plain way."""
    global _zygote, _restarts, _given_up
    with _zlock:
        z = _zygote
        if z is not None and z.owner == os.getpid():
            same = z.module == module and z.startup_env == _startup_env(env)
            if same and z.alive():
                return z
            if not same:  # (e.g. PYTHONPATH changed): it still serves the workers it started
                _zygote = None
            elif z.refused:
                _given_up = True
                _zygote = None
                z.close(0.5)
            else:
                z.close(0.5)
                _restarts += 1
                if _restarts > MAX_RESTARTS:
                    _given_up = True
                    warnings.warn(f"the template process that starts workers ended "
                                  f"{_restarts} times: workers now start as new Python "
                                  f"processes (slower)", RuntimeWarning, stacklevel=4)
                else:
                    warnings.warn(f"the template process that starts workers ended (exit "
                                  f"status {z.proc.poll()}); starting a new one",
                                  RuntimeWarning, stacklevel=4)
        if _given_up:
            return None
        extra = [m.strip() for m in os.environ.get(PRELOAD_ENV, "").split(",") if m.strip()]
        try:
            _zygote = Zygote(module, [*preload, *extra], env=env)
        except OSError as e:
            _given_up = True
            _zygote = None
            warnings.warn(f"could not start the template process that starts workers ({e}): "
                          f"workers start as new Python processes (slower)",
                          RuntimeWarning, stacklevel=4)
            return None
        return _zygote


def prestart(module: str, preload: Sequence[str] = ()) -> None:
    """Start the zygote for workers of ``python -m module`` now, without
    waiting for it (the first mesh then does not wait for its imports).
    Does nothing if ``MONARCH_ZYGOTE`` is 0 or invalid, or one runs."""
    try:
        if not zygote_enabled(os.environ):
            return
    except ValueError:
        return
    _get(module, preload, os.environ)


def shutdown() -> None:
    """End this process's zygote, if any (workers it started run on)."""
    global _zygote
    with _zlock:
        z, _zygote = _zygote, None
    if z is not None and z.owner == os.getpid():
        z.close()


def current() -> Zygote | None:
    """This process's zygote, if it runs."""
    z = _zygote
    return z if z is not None and z.owner == os.getpid() and z.alive() else None


def start_worker(argv: Sequence[str], env: Mapping[str, str], stdout: int, stderr: int,
                 pass_fds: Sequence[int] = (), preload: Sequence[str] = ()
                 ) -> WorkerProcess | subprocess.Popen:
    """Start one worker in a session of its own, as ``subprocess.Popen(argv,
    env=env, stdin=DEVNULL, stdout=stdout, stderr=stderr, pass_fds=pass_fds,
    start_new_session=True)`` would: forked from the zygote when it can be
    (``MONARCH_ZYGOTE`` not 0, ``argv`` is ``[sys.executable, "-m", MODULE,
    ...]``), else with ``subprocess.Popen``. ``preload``: modules the zygote
    imports besides ``MODULE`` (when it starts).

    Raises
    ------
    OSError
        If the worker could not be started either way.
    ValueError
        If ``MONARCH_ZYGOTE`` holds something other than 0 or 1.
    """
    if zygote_enabled(env) and len(argv) >= 3 and argv[1] == "-m":
        z = _get(argv[2], preload, env)
        if z is not None and z.usable_for(argv, env):
            fds = {1: stdout, 2: stderr, **{f: f for f in pass_fds}}
            try:
                pid = z.spawn(argv, env, fds, os.getcwd())
            except OSError as e:
                warnings.warn(f"{e}: this worker starts as a new Python process",
                              RuntimeWarning, stacklevel=2)
            else:
                return WorkerProcess(z, pid, argv)
    return subprocess.Popen(list(argv), env=dict(env), stdin=subprocess.DEVNULL, stdout=stdout,
                            stderr=stderr, pass_fds=tuple(pass_fds), start_new_session=True)


if __name__ == "__main__":
    sys.exit(main())
