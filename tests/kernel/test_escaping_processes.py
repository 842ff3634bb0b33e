"""Nothing a mesh started outlives it: ranks stuck in C code when the kernel is
killed, and the processes user code on a rank started (their children too),
whether the rank ends by ``%mesh stop``, ``%mesh restart``, kernel shutdown,
a SIGKILL of the kernel, or its own death."""

from __future__ import annotations

import contextlib
import os
import signal
import time

import psutil
import pytest

from monarch_kernel.testing.kernel import KernelSession, wait_for, worker_pids

#: what the issue promises: a rank ends within 10 s of its kernel, and what a
#: rank started within 5 s of the rank
RANK_BOUND_S = 10.0
CHILDREN_BOUND_S = 5.0

#: children, grandchildren (through sh) and a child in a process group of its own
#: (same session) on every rank that runs it: PER_RANK processes
START_CHILDREN = """%%mesh
import os, subprocess
kids = [subprocess.Popen(["sleep", "600"]),
        subprocess.Popen(["sh", "-c", "sleep 601 & sleep 602; :"]),
        subprocess.Popen(["sleep", "603"], preexec_fn=os.setpgrp)]
[k.pid for k in kids]
"""

PER_RANK = 5  # sleep 600, sh, sleep 601, sleep 602, sleep 603

GIL_BOUND = {
    "sum": "sum(range(10**13))",
    "regex": "import re\nre.match(r'(a+)+$', 'a' * 64 + 'b')",
}


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _descendants(pids: list[int], n: int) -> list[int]:
    """The descendants of ``pids`` (waits until there are ``n`` of them)."""
    def look() -> list[int]:
        out = []
        for pid in pids:
            with contextlib.suppress(psutil.NoSuchProcess):
                out += [c.pid for c in psutil.Process(pid).children(recursive=True)]
        return out if len(out) >= n else []
    return wait_for(look, 10, what=f"{n} processes started by the ranks")


def _time_until_gone(pids: list[int], bound: float, what: str) -> float:
    """Seconds until none of ``pids`` is alive."""
    t0 = time.monotonic()
    wait_for(lambda: not any(_alive(p) for p in pids), bound + 5, what=what)
    return time.monotonic() - t0


def _kill_all(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess, ProcessLookupError):
            psutil.Process(pid).kill()


def _children_of_ranks(ks: KernelSession, n: int) -> tuple[list[int], list[int]]:
    """Start :data:`START_CHILDREN` on every rank of ``ks``'s mesh; (workers, descendants)."""
    r = ks.execute(START_CHILDREN)
    assert r.status == "ok", r.error_text()
    workers = worker_pids(ks.pid)
    assert len(workers) == n
    return workers, _descendants(workers, PER_RANK * n)


def _busy(pid: int, seconds: float = 10.0) -> None:
    """Wait until worker ``pid`` spends its time computing (the cell started)."""
    proc = psutil.Process(pid)

    def spinning() -> bool:
        return proc.cpu_percent(0.3) > 20
    wait_for(spinning, seconds, what="the rank computing")


@pytest.mark.parametrize("code", list(GIL_BOUND.values()), ids=list(GIL_BOUND))
def test_rank_holding_the_gil_ends_with_its_killed_kernel(code):
    ks = KernelSession()
    workers: list[int] = []
    kids: list[int] = []
    try:
        assert ks.execute("%mesh spawn 2").status == "ok"
        workers, kids = _children_of_ranks(ks, 2)
        ks.kc.execute("%%mesh\n" + code)
        _busy(workers[0])
        assert all(_alive(p) for p in workers)
        os.kill(ks.pid, signal.SIGKILL)
        t0 = time.monotonic()
        ended: dict[str, float] = {}
        groups = {"ranks": workers, "children": kids}

        def all_ended() -> bool:
            for name, pids in groups.items():
                if name not in ended and not any(_alive(p) for p in pids):
                    ended[name] = time.monotonic() - t0
            return len(ended) == len(groups)
        wait_for(all_ended, RANK_BOUND_S + 5, what="GIL-bound ranks and their children gone")
        took, took_kids = ended["ranks"], ended["children"]
        print(f"GIL-bound ranks ended {took:.2f} s after the kernel's SIGKILL, "
              f"their children {took_kids:.2f} s after it")
        assert took < RANK_BOUND_S
        assert took_kids < CHILDREN_BOUND_S
    finally:
        _kill_all(workers + kids)
        ks.kc.stop_channels()
        ks.km.cleanup_resources()


def _spawn(ks: KernelSession, n: int = 2) -> None:
    r = ks.execute(f"%mesh spawn {n}")
    assert r.status == "ok", r.error_text()


def test_children_end_with_mesh_stop(shared_kernel):
    _spawn(shared_kernel)
    workers, kids = _children_of_ranks(shared_kernel, 2)
    try:
        t0 = time.monotonic()
        assert shared_kernel.execute("%mesh stop").status == "ok"
        took = _time_until_gone(kids, CHILDREN_BOUND_S, "children gone after %mesh stop")
        print(f"children ended {took:.2f} s after %mesh stop returned "
              f"({time.monotonic() - t0:.2f} s after it started)")
        assert took < CHILDREN_BOUND_S
    finally:
        _kill_all(kids)


def test_children_end_with_mesh_restart(shared_kernel):
    _spawn(shared_kernel)
    workers, kids = _children_of_ranks(shared_kernel, 2)
    try:
        mine = set(_descendants([workers[1]], PER_RANK))
        r = shared_kernel.execute("%mesh restart 1")
        assert r.status == "ok", r.error_text()
        took = _time_until_gone(sorted(mine), CHILDREN_BOUND_S,
                                "rank 1's children gone after %mesh restart 1")
        print(f"rank 1's children ended {took:.2f} s after %mesh restart returned")
        assert took < CHILDREN_BOUND_S
        assert all(_alive(p) for p in kids if p not in mine)  # rank 0's are its own
        assert shared_kernel.execute("%%mesh\nrank").status == "ok"
    finally:
        shared_kernel.execute("%mesh stop")
        _kill_all(kids)


def test_children_end_when_their_rank_is_killed(shared_kernel):
    _spawn(shared_kernel)
    workers, kids = _children_of_ranks(shared_kernel, 2)
    try:
        mine = _descendants([workers[1]], PER_RANK)
        os.kill(workers[1], signal.SIGKILL)
        took = _time_until_gone(mine, CHILDREN_BOUND_S, "children of the killed rank gone")
        print(f"a killed rank's children ended {took:.2f} s after it")
        assert took < CHILDREN_BOUND_S
        assert all(_alive(p) for p in kids if p not in mine)
    finally:
        shared_kernel.execute("%mesh stop")
        _kill_all(kids)


def test_children_end_with_kernel_shutdown():
    ks = KernelSession()
    kids: list[int] = []
    try:
        _spawn(ks)
        _, kids = _children_of_ranks(ks, 2)
        t0 = time.monotonic()
        ks.shutdown()
        took = _time_until_gone(kids, CHILDREN_BOUND_S, "children gone after kernel shutdown")
        print(f"children ended {took:.2f} s after the kernel's shutdown returned "
              f"({time.monotonic() - t0:.2f} s after it started)")
        assert took < CHILDREN_BOUND_S
    finally:
        _kill_all(kids)
        if ks.km.has_kernel:
            ks.km.shutdown_kernel(now=True)


def test_a_rank_may_start_a_process_that_outlives_it(shared_kernel):
    """A process in a session of its own is not the rank's: it is left alone."""
    _spawn(shared_kernel, 1)
    r = shared_kernel.execute("%%mesh\nimport subprocess\n"
                              "own = subprocess.Popen(['sleep', '604'], "
                              "start_new_session=True).pid")
    assert r.status == "ok", r.error_text()
    r = shared_kernel.execute("vm = %mesh pull own\nprint(vm.values()[0])")
    pid = int(r.stream())
    try:
        assert shared_kernel.execute("%mesh stop").status == "ok"
        time.sleep(CHILDREN_BOUND_S)
        assert _alive(pid)
    finally:
        _kill_all([pid])
