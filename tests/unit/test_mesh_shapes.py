"""Shapes, slicing, ValueMesh and rank specs (pure data structures)."""

from __future__ import annotations

import pytest

from monarch_kernel.errors import MeshError, RankSpecError
from monarch_kernel.mesh.shape import Shape, ValueMesh, parse_ranks


def test_slice_int_drops_dimension_and_slice_keeps_it():
    s = Shape({"hosts": 2, "procs": 4})
    assert s.slice(procs=1).dims == {"hosts": 2} and s.slice(procs=1).ranks == [1, 5]
    sub = s.slice(hosts=1, procs=slice(0, 2))
    assert sub.dims == {"procs": 2} and sub.ranks == [4, 5]
    with pytest.raises(MeshError, match="no dimension"):
        s.slice(gpus=0)
    with pytest.raises(MeshError, match="out of range"):
        s.slice(procs=4)


def test_value_mesh_items_and_repr():
    vm = ValueMesh(Shape({"hosts": 1, "procs": 3}), [10, 11, 12])
    assert [p.rank for p, _ in vm.items()] == [0, 1, 2]
    assert vm.item(hosts=0, procs=1) == 11
    assert "ValueMesh" in repr(vm) and "<table>" in vm._repr_html_()
    assert vm.slice(procs=slice(1, 3)).values() == [11, 12]


@pytest.mark.parametrize("spec,expected", [
    ("0", [0]), ("1,3", [1, 3]), ("0:2", [0, 1]), ("all", [0, 1, 2, 3]), ("2:", [2, 3]),
])
def test_parse_ranks(spec, expected):
    assert parse_ranks(spec, 4) == expected


@pytest.mark.parametrize("spec,match", [
    ("9", "does not exist"), ("3:1", "empty"), ("a", "bad rank spec"), ("-1", "does not exist"),
])
def test_parse_ranks_errors(spec, match):
    with pytest.raises(RankSpecError, match=match):
        parse_ranks(spec, 4)


def test_restart_takes_a_rank_spec_as_the_magic_does() -> None:
    """``mesh.restart`` takes the rank specs ``%mesh restart`` takes ("all",
    "0,1", "0:2"), and a bad one is a clear RankSpecError, not a hang."""
    from monarch_kernel.mesh.procmesh import spawn_procs

    m = spawn_procs(2)
    try:
        before = {r: m.controller.ranks[r].pid for r in (0, 1)}
        m.restart("all")
        after = {r: m.controller.ranks[r].pid for r in (0, 1)}
        assert all(before[r] != after[r] for r in (0, 1))
        with pytest.raises(RankSpecError, match="rank 5 does not exist"):
            m.restart("5")
        with pytest.raises(RankSpecError, match="bad rank spec"):
            m.restart("one")
        assert list(m.collect(m.run("rank"), timeout=30).values()) == [0, 1]
    finally:
        m.stop()


@pytest.mark.parametrize("size", ["4", 2.0, True, None])
def test_a_size_that_is_not_a_whole_number_is_refused(size):
    with pytest.raises(MeshError, match="whole numbers >= 1"):
        Shape({"hosts": 1, "procs": size})


def test_a_negative_timeout_is_refused_clearly():
    from monarch_kernel.actor.future import Future

    f = Future.failed(RuntimeError("x"))
    for bad in (-1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="timeout is a finite number of seconds"):
            f.get(timeout=bad)
