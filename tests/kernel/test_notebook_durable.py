"""notebooks/07_durable_mesh.ipynb under nbclient: a durable mesh outlives a kernel
restart (done by the runner before the cell tagged ``restart-kernel-before``), and
``%mesh attach`` finds the same processes, their state and actor, shows what the
ranks printed meanwhile and follows the running call to its end."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import nbformat
import psutil
import pytest
from notebook_helpers import RestartingClient, kernel_pid_hook

from monarch_kernel.testing.kernel import wait_for, worker_pids

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(600)


def _workers(registry: str) -> list[int]:
    """This run's workers (they inherit its MONARCH_MESH_REGISTRY; a durable mesh's
    workers name no controller pid)."""
    out = []
    for pid in worker_pids():
        try:
            if psutil.Process(pid).environ().get("MONARCH_MESH_REGISTRY") == registry:
                out.append(pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return out


def _texts(cell) -> str:
    out = []
    for o in cell.get("outputs", []):
        if o.get("output_type") == "stream":
            out.append(o["text"])
        elif "data" in o:
            out.append(o["data"].get("text/plain", ""))
    return "".join(out)


def test_durable_mesh_notebook_survives_a_kernel_restart(tmp_path, monkeypatch):
    registry = str(tmp_path / "meshes")
    monkeypatch.setenv("MONARCH_MESH_REGISTRY", registry)  # (the kernel's too)
    nb = nbformat.read(ROOT / "notebooks" / "07_durable_mesh.ipynb", as_version=4)
    ref: list = []
    kernel: list[int] = []
    client = RestartingClient(nb, kernel_name="monarch", timeout=300,
                              on_cell_start=kernel_pid_hook(ref, kernel))
    ref.append(client)
    try:
        client.execute()
    finally:
        if _workers(registry):  # (a failed run: its mesh must not live on)
            subprocess.run([sys.executable, "-m", "monarch_kernel", "meshes", "stop", "train"],
                           capture_output=True, timeout=60, check=False)
    assert client.restarts == 1 and client.pids and client.pids[0] != kernel[0]
    code = [c for c in nb.cells if c.cell_type == "code"]
    by_source = {c.source.splitlines()[0]: _texts(c) for c in code}
    listed = _texts(next(c for c in code if "restart-kernel-before" in c.metadata.get("tags", [])))
    assert re.search(r"train\s.*detached", listed), listed
    attach = by_source["%mesh attach train"]
    assert "attached to mesh 'train'" in attach, attach
    steps = [int(s) for s in re.findall(r"step (\d+)", attach)]
    assert steps and steps == sorted(set(steps)) and steps[-1] == 79, attach
    assert "epoch done on rank 0" in attach, attach
    same = next(_texts(c) for c in code if "os.getpid() == pid" in c.source)
    assert same.count("True") == 4 and "[30, 31, 32]" in same, same
    actor = next(_texts(c) for c in code if 'train.actors("trainer")' in c.source)
    assert "101" in actor, actor
    assert "stopped" in by_source["%mesh stop train"]
    wait_for(lambda: not _workers(registry), timeout=20, what="workers exit")
