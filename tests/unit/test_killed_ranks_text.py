"""How a failure names the ranks the mesh killed, and the restart spec it suggests."""

from __future__ import annotations

import signal

from monarch_kernel.controller.request import RankInfo
from monarch_kernel.errors import MeshFailure, restart_hint
from monarch_kernel.mesh.shape import parse_ranks
from monarch_kernel.mesh.supervision import KILLED_BY


def test_restart_hint_uses_a_spec_that_restart_accepts():
    assert restart_hint([], 3) == ""
    assert restart_hint([1], 3) == "%mesh restart 1  (or mesh.restart(1))"
    assert restart_hint([2, 0], 3) == "%mesh restart 0,2  (or mesh.restart('0,2'))"
    assert restart_hint([0, 1, 2], 3) == "%mesh restart all  (or mesh.restart())"
    assert parse_ranks("0,2", 3) == [0, 2]  # (one shell word, as %mesh restart splits)


def test_survivors_killed_after_a_death_are_named_in_one_line():
    err = MeshFailure("rank 1 exited with code 3", rank=1)
    err.stopped, err.killed = [0, 2, 3], [0, 2]
    err.restart = restart_hint([0, 1, 2], 4)
    lines = err._render_traceback_()
    assert lines[1:] == [
        "rank 3 was stopped because rank 1 died",
        "ranks 0, 2 did not stop after rank 1 died and were killed (they were running C code "
        "or ignored the interrupt); restart with  %mesh restart 0,1,2  "
        "(or mesh.restart('0,1,2'))"]


def test_ranks_killed_by_an_interrupt_are_all_named():
    err = MeshFailure("rank 0 was killed", rank=0)
    err.stopped, err.killed = [1], [0, 1]
    err.restart = restart_hint([0, 1], 2)
    assert err._render_traceback_()[1:] == [
        "ranks 0, 1 ignored the interrupt and were killed; restart with  %mesh restart all  "
        "(or mesh.restart())"]


def test_a_rank_the_mesh_killed_says_so():
    info = RankInfo(0, exitcode=-signal.SIGKILL)
    assert info.describe_exit() == "was killed by SIGKILL"
    info.killed_by = KILLED_BY
    assert info.describe_exit() == ("was killed by the mesh after it ignored the interrupt "
                                    "(SIGKILL)")
