"""End to end: quitting the debugger on one rank while the others wait for it in a
collective (``dist.barrier()``) on a 2-rank gloo mesh.

Before, the cell ran for ever (a blocked collective ignores interrupts) and the
waiting ranks had to be killed. Now the cell ends by itself with the waiting
ranks' calls aborted, and the mesh (ranks, namespaces, torch.distributed) stays
usable.
"""

from __future__ import annotations

import ast
import time

import pytest

from monarch_kernel.testing.kernel import KernelSession

pytestmark = pytest.mark.timeout(300)

#: the issue's bound on the whole cell after `q` is 10 s; the test allows much more
#: (a loaded CI machine) and prints what it measured
BOUND_S = 60.0


def _gloo() -> bool:
    try:
        import torch.distributed as dist
    except ImportError:
        return False
    return dist.is_available() and dist.is_gloo_available()


@pytest.fixture(scope="module")
def k2(shared_kernel: KernelSession) -> KernelSession:
    if not _gloo():
        pytest.skip("torch.distributed with gloo is not available")
    r = shared_kernel.execute("%mesh spawn 2 --dist gloo", timeout=180)
    assert r.status == "ok", r.error_text()
    return shared_kernel


def _pids(k: KernelSession) -> list[int]:
    return ast.literal_eval(k.execute("print([row['pid'] for row in mesh.status()])").stream())


class QuitAt:
    """Answers the first prompt with ``q``; notes when."""

    def __init__(self) -> None:
        self.prompts: list[str] = []
        self.at: float | None = None

    def __call__(self, prompt: str) -> str:
        self.prompts.append(prompt)
        if self.at is None:
            self.at = time.monotonic()
            return "q"
        return "c"


def _quit_while_peer_waits(k: KernelSession, cell: str) -> tuple[object, float]:
    quit_ = QuitAt()
    r = k.execute(cell, on_input=quit_, timeout=BOUND_S + 30)
    assert quit_.prompts == ["(Pdb rank 1) "], quit_.prompts
    assert quit_.at is not None
    return r, time.monotonic() - quit_.at


def test_quit_while_peer_waits_in_barrier_ends_the_cell(k2):
    r = k2.execute("%%mesh\nkeep = rank * 7 + 1")
    assert r.status == "ok", r.error_text()
    pids = _pids(k2)

    r, took = _quit_while_peer_waits(
        k2, "%%mesh\nif rank == 1:\n    breakpoint()\n    x = 1\ndist.barrier()\n'after'")
    print(f"cell ended {took:.2f} s after q")
    assert took < BOUND_S
    assert r.status == "error"
    err = r.error_text()
    assert "rank 1 quit the debugger while rank 0 waited for it in a collective " \
           "(dist.barrier); its call was aborted" in err, err
    assert "set up again" in err and "CollectiveAborted" in err
    # what a notebook's error line reads: "CollectiveAborted: rank 1 quit ..." (the
    # class the guide names, the ranks named once)
    e = r.error() or r.reply["content"]
    assert e["ename"] == "CollectiveAborted", e["ename"]
    assert e["evalue"].startswith("rank 1 quit the debugger while rank 0 waited"), e["evalue"]
    assert "pair.cc" not in err and "c10d_logger" not in err  # no torch internals
    assert "dist.barrier()" in err  # the user's line
    assert "rank 1: debugging ended with quit" in r.stream("stderr")

    # the same processes, with their namespaces; cells run; dist works again
    assert _pids(k2) == pids
    r = k2.execute("%%mesh\nkeep", timeout=60)
    assert r.status == "ok", r.error_text()
    assert "1" in r.result_text() and "8" in r.result_text()
    r = k2.execute("%%mesh\nt = torch.ones(1) * (rank + 1)\ndist.barrier()\n"
                   "dist.all_reduce(t)\nint(t.item())", timeout=60)
    assert r.status == "ok", r.error_text()
    assert r.result_text().count("3") == 2, r.result_text()


def test_peer_that_reaches_the_barrier_after_the_quit_is_aborted_too(k2):
    r, took = _quit_while_peer_waits(
        k2, "%%mesh\nimport time\nif rank == 1:\n    breakpoint()\n    x = 1\n"
            "else:\n    time.sleep(3)\ndist.barrier()\n'after'")
    print(f"cell ended {took:.2f} s after q")
    assert took < BOUND_S
    assert r.status == "error"
    assert "rank 0 waited for it in a collective (dist.barrier)" in r.error_text()
    r = k2.execute("%%mesh\ndist.barrier()\n'again'", timeout=60)
    assert r.status == "ok", r.error_text()


def test_quit_without_a_collective_leaves_dist_alone(k2):
    r = k2.execute("%%mesh\nimport os\nos.environ['MASTER_PORT']")
    port = r.result_text()
    r, took = _quit_while_peer_waits(
        k2, "%%mesh\nimport time\nif rank == 1:\n    breakpoint()\n    x = 1\n"
            "else:\n    time.sleep(2)\nrank")
    assert r.status == "ok", r.error_text()
    assert "collective" not in r.error_text() + r.stream()
    r = k2.execute("%%mesh\nos.environ['MASTER_PORT']")
    assert r.result_text() == port  # the process group was not set up again
    r = k2.execute("%%mesh\ndist.barrier()\n'still'", timeout=60)
    assert r.status == "ok", r.error_text()
