"""notebooks/04_debugging.ipynb under nbclient, its prompts answered from a scripted stdin
(scripts/run_notebook.py --stdin-file notebooks/04_debugging.stdin)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from monarch_kernel.testing import worker_pids

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(600)
def test_debugging_notebook_runs_with_scripted_stdin(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "run_notebook.py"),
         str(ROOT / "notebooks" / "04_debugging.ipynb"),
         "--stdin-file", str(ROOT / "notebooks" / "04_debugging.stdin"),
         "--out", str(tmp_path), "--timeout", "300"],
        capture_output=True, text=True, timeout=580,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "OK: every cell ran" in proc.stdout
    nb = nbformat.read(tmp_path / "04_debugging.ipynb", as_version=4)
    text = "".join(out.get("text", "") for cell in nb.cells for out in cell.get("outputs", [])
                   if out.get("output_type") == "stream")
    assert "rank 2 paused at <mesh-cell-" in text
    assert "(Pdb rank 2) p data\n" in text and "[2, 3, 4]" in text
    assert "(mesh-debug) cast 0:2 p x\n" in text and "[0] 0\n[1] 1\n" in text
    assert "[2] 4\n[3] 9\n" in text
    assert "rank 1: debugging ended with quit" in text
    assert "key = 'z'" in text
    assert "[0] 7" in text
    assert not worker_pids(), "workers left after the notebook"
