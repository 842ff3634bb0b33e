"""notebooks/05_fault_tolerance.ipynb: a rank is killed mid-training, the mesh
restarts it, training resumes from the controller's checkpoint."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from notebook_helpers import kernel_pid_hook

from monarch_kernel.testing.kernel import wait_for, worker_pids

ROOT = Path(__file__).resolve().parents[2]


def test_fault_tolerance_notebook_recovers_and_reaches_90_percent():
    nb = nbformat.read(ROOT / "notebooks" / "05_fault_tolerance.ipynb", as_version=4)
    ref: list = []
    kernel: list[int] = []
    client = NotebookClient(nb, kernel_name="monarch", timeout=600,
                            on_cell_start=kernel_pid_hook(ref, kernel))
    ref.append(client)
    client.execute()
    assert kernel and kernel[0], "the kernel's pid was not seen"
    text = "".join(out.get("text", "") for c in nb.cells for out in c.get("outputs", []))
    assert "MeshFailure: rank 2" in text and "killed by SIGKILL" in text
    assert "restarted" in text and "resumed from the checkpoint" in text
    accs = [float(x) for x in re.search(r"per rank: \[([^\]]*)\]", text).group(1).split(",")]
    assert len(accs) == 4 and min(accs) >= 0.90
    # workers of a kernel killed mid-shutdown notice and exit within seconds
    wait_for(lambda: not worker_pids(kernel[0]), timeout=10, what="workers exit")
