"""Actors that spawn meshes supervise them with ``__supervise__``."""

from __future__ import annotations

import sys
import time

import cloudpickle
import pytest

from monarch_kernel import Actor, endpoint, this_host
from monarch_kernel.testing.kernel import wait_for

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests


class Parent(Actor):
    """Spawns a child mesh of its own; optionally handles its failures."""

    def __init__(self, handle: bool) -> None:
        self.handle = handle
        self.seen: list[str] = []
        self.child = None

    def __supervise__(self, failure):
        self.seen.append(str(failure).split(";")[0])
        return self.handle

    @endpoint
    def start_child(self) -> int:
        from monarch_kernel import spawn_procs

        self.child = spawn_procs(2, telemetry_interval=0)
        return len(self.child)

    @endpoint
    def crash_child(self) -> str:
        try:
            self.child.exec("import os\nif rank == 1:\n    os._exit(9)\nrank")
        except Exception as e:  # noqa: BLE001 - the call fails fast with MeshFailure
            return type(e).__name__
        return "no failure"

    @endpoint
    def seen_failures(self) -> list[str]:
        return list(self.seen)

    @endpoint
    def stop_child(self) -> None:
        self.child.stop()


@pytest.fixture
def procs():
    m = this_host().spawn_procs(per_host={"procs": 1})
    try:
        yield m
    finally:
        m.stop()


@pytest.mark.parametrize("handle", [True, False])
def test_supervise_sees_child_failures(procs, handle):
    parent = procs.spawn("parent", Parent, handle).slice(procs=0)
    assert parent.start_child.call_one().get(timeout=60) == 2
    assert parent.crash_child.call_one().get(timeout=30) == "MeshFailure"
    seen = wait_for(lambda: parent.seen_failures.call_one().get(timeout=10), 10,
                    what="__supervise__ called")
    assert "rank 1" in seen[0] and "exited with code 9" in seen[0]
    ctl = procs.controller
    if handle:
        time.sleep(0.5)
        assert ctl.unhandled == []
    else:  # unhandled: it surfaces on the controller
        wait_for(lambda: ctl.unhandled, 10, what="the unhandled failure reported")
        assert "actor 'parent'" in ctl.unhandled[0] and "exited with code 9" in ctl.unhandled[0]
    parent.stop_child.call_one().get(timeout=30)
