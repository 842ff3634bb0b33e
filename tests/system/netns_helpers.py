"""Test hosts made of Linux network namespaces, and a launcher that uses them.

:class:`NetnsPair` creates two network namespaces joined by a veth pair with
addresses in a private /24 (``10.231.7.1`` and ``10.231.7.2`` by default;
they exist only inside the namespaces made here), brings the links and
loopback up, and deletes everything again (killing what still runs in the
namespaces) even when a test fails. :class:`NetnsLauncher` starts workers in
one namespace with ``ip netns exec``; it is not local, so the controller
supervises its workers by heartbeats, as for real remote hosts.

Needs root and ``ip`` (iproute2).
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import sys
import threading
import uuid

from monarch_kernel.launchers.base import Launcher, LaunchSpec, Placement, worker_command

__all__ = ["NetnsLauncher", "NetnsPair", "netns_unavailable"]

_live: set[str] = set()


def _ip(*args: str, check: bool = True, timeout: float = 20) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=timeout,
                          check=check, stdin=subprocess.DEVNULL)


def netns_unavailable() -> str | None:
    """Why namespace tests cannot run here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespace tests need root (ip netns add)"
    if shutil.which("ip") is None:
        return "network namespace tests need iproute2 (apt-get install -y iproute2)"
    name = f"mkprobe{os.getpid()}"
    try:
        cp = _ip("netns", "add", name, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"ip netns add failed: {e}"
    if cp.returncode != 0:
        return f"ip netns add is not permitted here: {cp.stderr.strip()}"
    _ip("netns", "del", name, check=False)
    return None


def kill_namespace_processes(name: str) -> list[int]:
    """SIGKILL every process in namespace ``name``; return their pids."""
    cp = _ip("netns", "pids", name, check=False)
    pids = [int(p) for p in cp.stdout.split() if p.isdigit()]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids


def delete_namespace(name: str) -> None:
    """Kill what runs in ``name`` and delete it (its veth end goes with it)."""
    kill_namespace_processes(name)
    _ip("netns", "del", name, check=False)
    _live.discard(name)


@atexit.register
def _cleanup() -> None:
    for name in list(_live):
        delete_namespace(name)


class NetnsPair:
    """Two namespaces (``ns1``: controller side, ``ns2``: worker side) on one veth link.

    Parameters
    ----------
    subnet : str
        The first three octets of the /24 used inside the namespaces.

    Attributes
    ----------
    ns1, ns2 : str
        Namespace names (unique per instance).
    addr1, addr2 : str
        Their addresses on the link.
    """

    def __init__(self, subnet: str = "10.231.7") -> None:
        tag = uuid.uuid4().hex[:6]
        self.ns1, self.ns2 = f"mk{tag}c", f"mk{tag}w"
        self.addr1, self.addr2 = f"{subnet}.1", f"{subnet}.2"
        self._veth = (f"mk{tag}a", f"mk{tag}b")

    def __enter__(self) -> NetnsPair:
        try:
            for ns in (self.ns1, self.ns2):
                _ip("netns", "add", ns)
                _live.add(ns)
            a, b = self._veth
            _ip("link", "add", a, "netns", self.ns1, "type", "veth", "peer", "name", b,
                "netns", self.ns2)
            for ns, dev, addr in ((self.ns1, a, self.addr1), (self.ns2, b, self.addr2)):
                _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
                _ip("-n", ns, "link", "set", dev, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def pids(self, ns: str) -> list[int]:
        """Pids of the processes running in namespace ``ns``."""
        cp = _ip("netns", "pids", ns, check=False)
        return [int(p) for p in cp.stdout.split() if p.isdigit()]

    def exec_argv(self, ns: str, argv: list[str]) -> list[str]:
        """``argv`` run inside namespace ``ns``."""
        return ["ip", "netns", "exec", ns, *argv]

    def close(self) -> None:
        for ns in (self.ns2, self.ns1):
            delete_namespace(ns)


class NetnsLauncher(Launcher):
    """Start each rank as ``ip netns exec NS python -m monarch_kernel.worker.worker``.

    Parameters
    ----------
    netns : str, optional
        The workers' namespace (default: ``$MONARCH_TEST_WORKER_NETNS``, so a
        kernel can use ``--launcher netns_helpers:NetnsLauncher``).
    """

    name = "netns"
    local = False  # another "host": supervised by heartbeats, interrupts are messages

    def __init__(self, netns: str | None = None) -> None:
        self.netns = netns or os.environ.get("MONARCH_TEST_WORKER_NETNS", "")
        if not self.netns:
            raise ValueError("NetnsLauncher needs a namespace (MONARCH_TEST_WORKER_NETNS)")
        self.procs: dict[int, subprocess.Popen] = {}
        self._reported: set[int] = set()
        self._lock = threading.Lock()

    def launch(self, spec: LaunchSpec) -> None:
        env = dict(os.environ)
        env["MONARCH_MESH_KEY"] = spec.key.hex()
        env.setdefault("OMP_NUM_THREADS", "1")
        for rank in spec.ranks:
            cmd = ["ip", "netns", "exec", self.netns, *worker_command(spec, rank, sys.executable)]
            proc = subprocess.Popen(cmd, env={**env, **spec.env.get(rank, {})},
                                    stdin=subprocess.DEVNULL, start_new_session=True)
            with self._lock:
                self.procs[rank] = proc
                self._reported.discard(rank)

    def placements(self) -> dict[int, Placement]:
        return {r: Placement(r, f"netns:{self.netns}", p.pid) for r, p in self.procs.items()}

    def poll(self) -> dict[int, int]:
        out = {}
        with self._lock:
            for rank, p in self.procs.items():
                if rank not in self._reported and p.poll() is not None:
                    self._reported.add(rank)
                    out[rank] = p.returncode
        return out

    def forget(self, ranks: list[int]) -> None:
        with self._lock:
            self._reported.update(ranks)

    def signal(self, ranks: list[int], sig: int = signal.SIGINT) -> None:
        for r in ranks:
            p = self.procs.get(r)
            if p is not None and p.poll() is None:
                p.send_signal(sig)

    def stop(self, ranks: list[int] | None = None, timeout: float = 5.0) -> None:
        from monarch_kernel.launchers.base import stop_processes

        stop_processes([p for r, p in self.procs.items() if ranks is None or r in ranks],
                       timeout)

    def default_bind(self) -> str:
        return os.environ.get("MONARCH_TEST_BIND", "127.0.0.1")
