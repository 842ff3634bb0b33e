"""The message a cell ends with when collectives that waited for ranks that quit
their debugger were aborted (mesh.dist_setup.aborted_message)."""

from __future__ import annotations

from monarch_kernel.mesh.dist_setup import aborted_message


def test_one_rank_quit_several_waited():
    text = aborted_message([1], {0: "barrier", 2: "barrier", 3: "barrier"}, None)
    assert text.startswith("rank 1 quit the debugger while ranks 0, 2, 3 waited for it in a "
                           "collective (dist.barrier); their calls were aborted. ")
    assert "set up again on every rank" in text and "dist.new_group" in text


def test_one_waited_and_the_set_up_failed():
    text = aborted_message([2, 3], {0: "all_reduce"}, "timed out after 120 s")
    assert text.startswith("ranks 2, 3 quit the debugger while rank 0 waited for them in a "
                           "collective (dist.all_reduce); its call was aborted. ")
    assert "could not be set up again (timed out after 120 s)" in text
    assert "mesh.setup_dist()" in text and "%mesh restart all" in text
