"""The sidebar's view of a durable mesh: it says it is detachable and its keep-alive;
an ordinary mesh says it is not."""

from __future__ import annotations

import pytest

from monarch_kernel.kernel.sidebar import mesh_state
from monarch_kernel.mesh.procmesh import spawn_procs

pytestmark = pytest.mark.timeout(120)


def test_mesh_state_names_a_durable_mesh_and_its_keep_alive(tmp_path, monkeypatch):
    monkeypatch.setenv("MONARCH_MESH_REGISTRY", str(tmp_path / "meshes"))
    m = spawn_procs(2, name="side", detach=True, keep_alive=600)
    try:
        st = mesh_state("side", m)
        assert st["detached"] is True and st["keep_alive"] == 600
        assert st["status"] == "live" and st["size"] == 2
    finally:
        m.stop()
    plain = spawn_procs(1)
    try:
        st = mesh_state("plain", plain)
        assert st["detached"] is False and st["keep_alive"] is None
    finally:
        plain.stop()
