"""Another Unix user on this host, made for one test and removed after it.

Shared GPU nodes and Slurm login nodes have other users; the hardening tests
play one of them. :func:`other_user` creates a system user with its own group
(no home, no login shell), runs processes as that user, and on exit kills
every process of the user and deletes it with its group, whatever the test
did. It needs root and ``useradd``/``userdel``; without them it skips the
test, saying why.

:meth:`OtherUser.python` runs this interpreter (``sys.executable``, often
under a home directory other users cannot enter): it starts as root, runs
the given imports, then drops to the other user for good (``setgroups([])``,
``setgid``, ``setuid``) before the attack's own code runs, so everything the
code does (connect, send, read files) is done as that user. An import after
the drop needs files that user can read.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import pytest

__all__ = ["OtherUser", "other_user"]


@dataclass(frozen=True)
class OtherUser:
    """A Unix user made by :func:`other_user`.

    Attributes
    ----------
    name : str
        The user's (and its group's) name, ``mkt-`` and 8 hex digits.
    uid, gid : int
        Its user and group ids.
    """

    name: str
    uid: int
    gid: int

    def _env(self, env: dict[str, str] | None) -> dict[str, str]:
        base = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/tmp",
                "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}
        # the repository (for helpers such as wire_attack_helpers), when it is readable
        if "PYTHONPATH" in os.environ:
            base["PYTHONPATH"] = os.environ["PYTHONPATH"]
        base.update(env or {})
        return base

    def popen(self, argv: Sequence[str], env: dict[str, str] | None = None,
              **kwargs: object) -> subprocess.Popen:
        """Start ``argv`` as this user (no supplementary groups), cwd ``/tmp``; the
        program and every directory above it must be readable by that user."""
        return subprocess.Popen(list(argv), user=self.uid, group=self.gid, extra_groups=[],
                                cwd="/tmp", env=self._env(env), **kwargs)  # type: ignore[call-overload]

    def python_popen(self, code: str, imports: str = "", env: dict[str, str] | None = None,
                     **kwargs: object) -> subprocess.Popen:
        """Start ``python -c`` that runs ``imports`` as root, then ``code`` as this user.

        The drop is checked: the child exits with status 3 when it still has
        root's uid or groups after it.
        """
        prelude = (
            f"{imports}\n"
            "import os as _os\n"
            f"_os.setgroups([]); _os.setgid({self.gid}); _os.setuid({self.uid})\n"
            f"if _os.getuid() != {self.uid} or _os.geteuid() != {self.uid} "
            "or 0 in _os.getgroups() or _os.getegid() == 0:\n"
            "    raise SystemExit(3)\n"
        )
        return subprocess.Popen([sys.executable, "-c", prelude + code], cwd="/tmp",
                                env=self._env(env), **kwargs)  # type: ignore[call-overload]

    def python(self, code: str, imports: str = "", timeout: float = 60.0,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """Run ``code`` as this user (after ``imports`` as root, see
        :meth:`python_popen`) and wait for it, at most ``timeout`` s.

        Returns the completed process with ``stdout`` and ``stderr`` as text;
        raises :class:`subprocess.TimeoutExpired` (after killing it) past ``timeout``.
        """
        p = self.python_popen(code, imports, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate(timeout=10)
            raise
        return subprocess.CompletedProcess(p.args, p.returncode, out, err)

    def pids(self) -> list[int]:
        """The pids of this user's processes now."""
        out = subprocess.run(["pgrep", "-u", str(self.uid)], capture_output=True, text=True,
                             timeout=10)
        return [int(x) for x in out.stdout.split()]


@contextlib.contextmanager
def other_user() -> Iterator[OtherUser]:
    """Create a throw-away Unix user; remove it, and end all its processes, on exit.

    Skips the calling test when not root or when ``useradd`` is missing.
    """
    if os.geteuid() != 0:
        pytest.skip("needs root to create another Unix user")
    if not (shutil.which("useradd") and shutil.which("userdel")):
        pytest.skip("needs useradd and userdel (Debian's passwd package)")
    name = "mkt-" + secrets.token_hex(4)
    subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
                    "--user-group", name], check=True, capture_output=True, timeout=30)
    try:
        pw = pwd.getpwnam(name)
        user = OtherUser(name, pw.pw_uid, pw.pw_gid)
        yield user
    finally:
        with contextlib.suppress(KeyError):
            uid = pwd.getpwnam(name).pw_uid
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                subprocess.run(["pkill", "-KILL", "-u", str(uid)], capture_output=True,
                               timeout=10)
                if subprocess.run(["pgrep", "-u", str(uid)], capture_output=True,
                                  timeout=10).returncode != 0:
                    break
                time.sleep(0.1)
        subprocess.run(["userdel", name], capture_output=True, timeout=30)
        # userdel removes the user's own group with it (USERGROUPS_ENAB); be sure
        subprocess.run(["groupdel", name], capture_output=True, timeout=30)
