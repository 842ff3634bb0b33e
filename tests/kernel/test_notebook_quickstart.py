"""The main job: notebooks/01_quickstart.ipynb under nbclient with the monarch kernel."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from notebook_helpers import kernel_pid_hook

from monarch_kernel.testing.kernel import wait_for, worker_pids

ROOT = Path(__file__).resolve().parents[2]


def test_quickstart_notebook_trains_to_90_percent():
    nb = nbformat.read(ROOT / "notebooks" / "01_quickstart.ipynb", as_version=4)
    ref: list = []
    kernel: list[int] = []
    client = NotebookClient(nb, kernel_name="monarch", timeout=600, allow_errors=False,
                            on_cell_start=kernel_pid_hook(ref, kernel))
    ref.append(client)
    client.execute()
    assert kernel and kernel[0], "the kernel's pid was not seen"
    texts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream":
                texts.append(out["text"])
    joined = "".join(texts)
    m = re.search(r"held-out accuracy per rank: \[([^\]]*)\]", joined)
    assert m, joined[-2000:]
    accs = [float(x) for x in m.group(1).split(",")]
    assert len(accs) == 4 and min(accs) >= 0.90 and max(accs) == min(accs)
    assert re.search(r"\[\d\] epoch \d+ +loss", joined)  # live, rank-tagged loss lines
    # the last cell stops the mesh; should the kernel's shutdown still leave a worker
    # (a kernel killed mid-shutdown), it must notice and exit within seconds
    try:
        wait_for(lambda: not worker_pids(kernel[0]), timeout=10, what="workers exit")
    except TimeoutError:
        raise AssertionError(f"workers left after the notebook: "
                             f"{worker_pids(kernel[0])}") from None
