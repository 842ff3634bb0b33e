"""notebooks/06_distributed_tensors.ipynb under nbclient with the monarch kernel (CPU, gloo)."""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbclient import NotebookClient

from monarch_kernel.testing.kernel import wait_for, worker_pids

ROOT = Path(__file__).resolve().parents[2]


def test_distributed_tensors_notebook_matches_single_process():
    nb = nbformat.read(ROOT / "notebooks" / "06_distributed_tensors.ipynb", as_version=4)
    client = NotebookClient(nb, kernel_name="monarch", timeout=300, allow_errors=False)
    kernel_pids: list[int] = []  # this kernel's workers only (other tests may run meanwhile)
    client.on_cell_execute = lambda **kw: kernel_pids.append(client.km.provisioner.process.pid)
    client.execute()
    texts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream":
                texts.append(out["text"])
            elif "data" in out:
                texts.append(out["data"].get("text/plain", ""))
    joined = "".join(texts)
    assert "tensor-parallel output matches the single-process model" in joined, joined[-3000:]
    # every rank prints the same placements: folded into "[0-3] ..." when the lines
    # arrive together, else one line per rank (or per group of ranks)
    assert _ranks_printing(joined, "h (Shard(dim=1),)  partial (Partial(sum),)  y (Replicate(),)"
                           ) == {0, 1, 2, 3}, joined[-3000:]
    assert "DTensor[Shard(dim=0)] global 32x16" in joined  # %mesh show of the sharded weight
    assert "w is w1 -> True, local shard (8, 16)" in joined  # a handle in a cell: the rank's own
    assert "the doubled shards are gone from every rank" in joined
    wait_for(lambda: not worker_pids(kernel_pids[0]), 10, what="the notebook's workers gone")


def _ranks_printing(text: str, line: str) -> set[int]:
    """The ranks whose tagged output (``[0-3] LINE``, ``[0, 2] LINE``) is ``line``."""
    ranks: set[int] = set()
    for got in text.splitlines():
        if got.startswith("[") and "]" in got and got[got.index("]") + 2:] == line:
            for part in got[1:got.index("]")].split(","):
                first, _, last = part.strip().partition("-")
                ranks |= set(range(int(first), int(last or first) + 1))
    return ranks
