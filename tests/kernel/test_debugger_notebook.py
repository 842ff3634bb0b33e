"""notebooks/04_debugging.ipynb under nbclient, its prompts answered from a scripted stdin
(scripts/run_notebook.py --stdin-file notebooks/04_debugging.stdin)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import nbformat
import psutil
import pytest

from monarch_kernel.testing.kernel import wait_for, worker_pids

ROOT = Path(__file__).resolve().parents[2]


def _tagged_workers(tag: str) -> list[int]:
    """Worker processes whose environment carries ``tag`` (inherited from this run)."""
    out = []
    for pid in worker_pids():
        try:
            if psutil.Process(pid).environ().get("MONARCH_TEST_TAG") == tag:
                out.append(pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return out


@pytest.mark.timeout(600)
def test_debugging_notebook_runs_with_scripted_stdin(tmp_path):
    tag = uuid.uuid4().hex
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "run_notebook.py"),
         str(ROOT / "notebooks" / "04_debugging.ipynb"),
         "--stdin-file", str(ROOT / "notebooks" / "04_debugging.stdin"),
         "--out", str(tmp_path), "--timeout", "300"],
        capture_output=True, text=True, timeout=580, check=False,
        env={**os.environ, "MONARCH_TEST_TAG": tag},
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "OK: every cell ran" in proc.stdout
    nb = nbformat.read(tmp_path / "04_debugging.ipynb", as_version=4)
    text = "".join(out.get("text", "") for cell in nb.cells for out in cell.get("outputs", [])
                   if out.get("output_type") == "stream")
    assert "rank 2 paused at Cell In[" in text
    assert "(Pdb rank 2) p data\n" in text and "[2, 3, 4]" in text
    assert "(mesh-debug) cast 0:2 p x\n" in text and "[0] 0\n[1] 1\n" in text
    assert "[2] 4\n[3] 9\n" in text
    assert "rank 1: debugging ended with quit" in text
    assert "key = 'z'" in text
    assert "[0] 7" in text
    # other tests may run meshes meanwhile: look only for this run's workers
    wait_for(lambda: not _tagged_workers(tag), 10, what="the notebook's workers gone")
