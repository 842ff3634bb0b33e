"""pytest plugin: fixtures for testing code that drives monarch meshes.

Installed with the package (the ``pytest11`` entry point
``monarch_kernel.testing.plugin``), so after ``pip install monarch-kernel``
every pytest run of that environment has these fixtures; a project's own
fixture of the same name takes precedence over the plugin's. Without the
entry point (a source checkout not installed), load it with
``pytest_plugins = ["monarch_kernel.testing.plugin"]`` in a ``conftest.py`` or
``pytest -p monarch_kernel.testing.plugin``.

Fixtures
--------
local_mesh
    A local :class:`~monarch_kernel.mesh.procmesh.ProcMesh` of 4 ranks whose
    controller is the test process; stopped afterwards. Another size or shape
    through indirect parametrisation:
    ``@pytest.mark.parametrize("local_mesh", [2], indirect=True)`` (any value
    :func:`~monarch_kernel.mesh.procmesh.spawn_procs` takes as its shape).
kernel
    A fresh :class:`~monarch_kernel.testing.kernel.KernelSession` (a real
    monarch kernel through ``jupyter_client``), shut down afterwards.
shared_kernel
    One :class:`~monarch_kernel.testing.kernel.KernelSession` for a whole test
    module (tests must leave it usable).
monarch_kernel_name
    The kernelspec the kernel fixtures start: ``"monarch"``. Override it to
    test another installed spec.

Every fixture checks at teardown that the worker processes it started are
gone within :data:`LEAK_TIMEOUT_S` seconds; leftovers are killed (so they do
not leak into later tests) and the teardown fails with ``AssertionError``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
import pytest

from monarch_kernel.mesh.procmesh import ProcMesh, spawn_procs
from monarch_kernel.testing.kernel import KernelSession, assert_no_workers

__all__ = ["LEAK_TIMEOUT_S", "LOCAL_MESH_PROCS", "kernel", "local_mesh",
           "monarch_kernel_name", "shared_kernel"]

#: Ranks of ``local_mesh`` when the test does not parametrise it.
LOCAL_MESH_PROCS = 4
#: Seconds a fixture's teardown waits for its worker processes to exit.
LEAK_TIMEOUT_S = 10.0


@pytest.fixture(scope="session")
def monarch_kernel_name() -> str:
    """Name of the kernelspec the ``kernel`` and ``shared_kernel`` fixtures start."""
    return "monarch"


def _session(kernel_name: str) -> Iterator[KernelSession]:
    ks = KernelSession(kernel_name=kernel_name)
    try:
        yield ks
    finally:
        pid = ks.pid
        ks.shutdown()
        assert_no_workers(pid, timeout=LEAK_TIMEOUT_S)


@pytest.fixture
def kernel(monarch_kernel_name: str) -> Iterator[KernelSession]:
    """A fresh monarch kernel (shut down afterwards; its workers must be gone)."""
    yield from _session(monarch_kernel_name)


@pytest.fixture(scope="module")
def shared_kernel(monarch_kernel_name: str) -> Iterator[KernelSession]:
    """One monarch kernel for a whole test module (tests must not break it)."""
    yield from _session(monarch_kernel_name)


@pytest.fixture
def local_mesh(request: pytest.FixtureRequest) -> Iterator[ProcMesh]:
    """A local mesh driven from this test process (the test is the controller):
    ``LOCAL_MESH_PROCS`` ranks, or the shape given by indirect parametrisation."""
    shape: dict[str, int] | int = getattr(request, "param", LOCAL_MESH_PROCS)
    mesh = spawn_procs(shape)
    try:
        yield mesh
    finally:
        mesh.stop()
        assert_no_workers(os.getpid(), timeout=LEAK_TIMEOUT_S)
