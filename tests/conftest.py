"""Shared fixtures: a real monarch kernel, real local meshes, leak checks."""

from __future__ import annotations

import os
import time

import pytest

from monarch_kernel.testing.kernel import KernelSession, worker_pids


def _kernel_session():
    ks = KernelSession()
    try:
        yield ks
    finally:
        pid = ks.pid
        ks.shutdown()
        _assert_no_workers(pid)


@pytest.fixture
def kernel():
    """A fresh monarch kernel (shut down afterwards; its workers must be gone)."""
    yield from _kernel_session()


@pytest.fixture(scope="module")
def shared_kernel():
    """One monarch kernel for a whole test module (faster; tests must not break it)."""
    yield from _kernel_session()


@pytest.fixture
def local_mesh():
    """A 4-rank local mesh driven from this test process (the test is the controller)."""
    from monarch_kernel.mesh.procmesh import spawn_procs

    m = spawn_procs(4)
    try:
        yield m
    finally:
        m.stop()
        _assert_no_workers(os.getpid())


def _assert_no_workers(controller_pid: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while worker_pids(controller_pid):
        if time.monotonic() > deadline:
            left = worker_pids(controller_pid)
            for pid in left:  # do not leak them into later tests
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass
            raise AssertionError(f"worker processes left behind: {left}")
        time.sleep(0.05)
