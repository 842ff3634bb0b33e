"""Helpers for tests of code that drives meshes: a real kernel through
``jupyter_client``, waits with timeouts, and the worker processes of a test.

The same helpers are offered as pytest fixtures by :mod:`monarch_kernel.testing.plugin`.
"""

from monarch_kernel.testing.kernel import (
    ExecResult,
    KernelSession,
    assert_no_workers,
    wait_for,
    worker_pids,
)

__all__ = ["ExecResult", "KernelSession", "assert_no_workers", "wait_for", "worker_pids"]
