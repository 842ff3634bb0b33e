"""Input a careless user gives, refused at once, in plain words.

Numbers (NaN, infinities, negatives) for every magic argument and the
public API, rank ranges checked without being built, meshes far bigger
than the host, addresses this host cannot listen on; ranks written as
people write them; Ctrl-C while a mesh starts; the ranks stopped because
another died named in one line.
"""

from __future__ import annotations

import os
import re
import signal
import tracemalloc

import pytest
from IPython.core.error import UsageError

from monarch_kernel import errors
from monarch_kernel.controller.controller import Controller
from monarch_kernel.controller.request import RankInfo
from monarch_kernel.debug import console, ranks
from monarch_kernel.errors import (
    MeshError,
    MeshFailure,
    RankSpecError,
    SpawnInterrupted,
    compact_ranks,
    ranks_label,
)
from monarch_kernel.kernel.commands import CELL, COMMANDS, command
from monarch_kernel.kernel.magics import MeshMagics
from monarch_kernel.mesh import procmesh
from monarch_kernel.mesh.procmesh import MAX_RANKS_PER_CPU, host_capacity, spawn_procs
from monarch_kernel.mesh.shape import Shape, parse_ranks
from monarch_kernel.testing.kernel import assert_no_workers, worker_pids
from monarch_kernel.ui import dashboard, snapshot
from monarch_kernel.util.numbers import check_number

BAD_NUMBERS = ["nan", "inf", "-inf", "-1", "NaN", "1e400"]


# ----------------------------------------------------------------- rank lists
@pytest.mark.parametrize("given,text", [
    ([0, 1, 2, 3], "0-3"),
    ([0, 2, 3], "0, 2, 3"),
    ([3, 0, 2, 2, 3], "0, 2, 3"),  # each once, in order
    ([0, 1, 2, 5, 7, 8, 9], "0-2, 5, 7-9"),
    ([4], "4"),
    ([], ""),
])
def test_ranks_are_written_as_people_write_them(given, text):
    assert compact_ranks(given) == text
    assert ":" not in compact_ranks(given)


def test_ranks_label():
    assert ranks_label([1]) == "rank 1"
    assert ranks_label([1, 1]) == "rank 1"
    assert ranks_label([0, 1, 2, 3]) == "ranks 0-3"
    assert ranks_label([3, 0, 2]) == "ranks 0, 2, 3"
    assert ranks_label([]) == "remote"


def test_one_function_writes_ranks_everywhere():
    assert console.compact_ranks is errors.compact_ranks
    assert console.ranks_label is errors.ranks_label
    assert snapshot.compact_ranks is errors.compact_ranks  # (what the dashboard draws)
    assert not hasattr(ranks, "plural") and not hasattr(dashboard, "_ranges")
    lines: list[str] = []
    req = type("R", (), {"replies": {2: ("error", {"type": "bdb.BdbQuit"}),
                                     0: ("error", {"type": "bdb.BdbQuit"})}})()
    ranks.report_quits(req, lines.append)
    assert lines[0].startswith("ranks 0, 2: debugging ended with quit")


def test_escalation_names_each_rank_once():
    """A second interrupt (or ranks ignoring the first for 5 s) escalates again: the
    ranks killed are listed once each."""
    sent = []
    ctl = type("C", (), {"ranks": {r: RankInfo(r, state="busy") for r in range(4)}})()

    class Launcher:
        local = True

        def signal(self, rs, sig):
            sent.append((list(rs), sig))
            for r in rs:  # (SIGTERM: these ranks ignore it too)
                if sig == signal.SIGKILL:
                    ctl.ranks[r].state = "dead"

    mesh = type("M", (), {"launcher": Launcher(), "controller": ctl, "_stopped": False})()
    mesh.root = mesh
    req = type("R", (), {"ranks": [0, 1, 2, 3], "replies": {1: ("ok", None)}})()
    killed: list[int] = []
    for _ in range(3):
        MeshMagics._interrupt(None, mesh, req, 1.0, [], killed)  # type: ignore
    assert sent == [([0, 2, 3], signal.SIGTERM), ([0, 2, 3], signal.SIGKILL)]
    assert all(ctl.ranks[r].killed_by for r in (0, 2, 3))
    assert killed == [0, 2, 3]
    assert ranks_label(killed) == "ranks 0, 2, 3"


# --------------------------------------------------------------------- numbers
def test_check_number():
    assert check_number(2, "x", integer=True) == 2
    assert check_number(0.5, "t", above=True, seconds=True) == 0.5
    assert check_number(0, "t", seconds=True, zero="off") == 0.0
    for bad in (float("nan"), float("inf"), -float("inf"), -1, True, "3"):
        with pytest.raises(ValueError, match=r"^t must be"):
            check_number(bad, "t", seconds=True)
    with pytest.raises(ValueError, match="a positive number of seconds, not 0"):
        check_number(0, "t", above=True, seconds=True)
    with pytest.raises(ValueError, match="a whole number 0 or more"):
        check_number(1.5, "k", integer=True)
    with pytest.raises(ValueError, match="at most"):
        check_number(1e12, "t", seconds=True)


def _numeric_args():
    for c in COMMANDS:
        for a in c.args:
            if a.options.get("type") is not None:
                yield c, a


@pytest.mark.parametrize("cmd,arg", list(_numeric_args()),
                         ids=[f"{c.name} {a.flags[0]}" for c, a in _numeric_args()])
@pytest.mark.parametrize("bad", BAD_NUMBERS)
def test_every_numeric_argument_of_every_magic_refuses_nan_infinities_negatives(cmd, arg, bad):
    argv = {"spawn": ["2"], "show": ["x"], "restart": ["0"]}.get(cmd.name, [])
    if cmd.name == "spawn" and arg.flags[0] in ("--nodes", "--gpus-per-node"):
        argv = [*argv, "--launcher", "slurm"]
    with pytest.raises(UsageError) as ei:
        cmd.parse([*argv, f"{arg.flags[0]}={bad}"])
    msg = str(ei.value)
    assert "\n" not in msg and re.search(rf"argument {arg.flags[0]}: (must be|invalid)", msg), msg


def test_zero_is_refused_where_it_means_nothing_and_kept_where_it_does():
    for cmd, argv in [("spawn", ["2", "--heartbeat", "0"]), ("spawn", ["2", "--timeout", "0"]),
                      ("dashboard", ["--interval", "0"]), ("dashboard", ["--history", "0"]),
                      ("restart", ["0", "--timeout", "0"]), ("%%mesh", ["--timeout", "0"])]:
        with pytest.raises(UsageError, match="must be a positive number of seconds"):
            command(cmd).parse(argv)
    assert command("spawn").parse(["2", "--telemetry-interval", "0"]).telemetry_interval == 0
    assert command("debug").parse(["--wait", "0"]).wait == 0
    assert command("show").parse(["x", "--values", "0"]).values == 0
    assert CELL.parse(["--timeout", "2.5"]).timeout == 2.5


@pytest.mark.parametrize("kwargs", [
    {"telemetry_interval": float("nan")}, {"telemetry_interval": -1.0},
    {"timeout": float("nan")}, {"timeout": float("inf")}, {"timeout": 0},
    {"heartbeat": float("nan")}, {"heartbeat": 0}, {"max_restarts": -1},
    {"max_restarts": 1.5}, {"bind": "300.1.1.1"}, {"bind": "192.0.2.77"},
    {"shape": 8 * 4096}, {"shape": True},
], ids=repr)
def test_spawn_procs_refuses_bad_arguments_before_starting_anything(kwargs):
    before = set(worker_pids(os.getpid()))
    kwargs = dict(kwargs)
    shape = kwargs.pop("shape", 1)
    with pytest.raises(MeshError) as ei:
        spawn_procs(shape, **kwargs)
    assert "\n" not in str(ei.value)
    assert set(worker_pids(os.getpid())) == before


def test_bind_to_an_address_of_another_host_is_refused_in_plain_words():
    with pytest.raises(MeshError, match=r"cannot listen on '192\.0\.2\.77'.*address of this host"):
        spawn_procs(1, bind="192.0.2.77")


def test_far_more_ranks_than_the_host_allows_need_force(monkeypatch):
    cpus = len(os.sched_getaffinity(0))
    assert host_capacity(1) == ""
    n = MAX_RANKS_PER_CPU * cpus + 1
    assert f"more than {MAX_RANKS_PER_CPU} per CPU" in host_capacity(n)
    if n <= 4096:
        with pytest.raises(MeshError, match=r"spawn fewer ranks, or start them anyway with "
                                            r"force=True"):
            spawn_procs(n)
        sh, la, addr = procmesh.check_spawn(n, force=True)  # (checked only: nothing starts)
        assert len(sh) == n and la.local and addr is None  # (a local mesh: Unix sockets)
    assert command("spawn").parse([str(n), "--force"]).force
    # memory: N x an idle worker's memory above what is available
    monkeypatch.setattr(procmesh, "WORKER_MEMORY", 1 << 50)
    assert "GiB available" in host_capacity(2)


@pytest.mark.parametrize("local_mesh", [2], indirect=True)
def test_dashboard_and_mesh_methods_refuse_nan_and_infinities(local_mesh):
    for kw in ({"interval": float("nan")}, {"interval": float("inf")},
               {"history": float("nan")}, {"interval": -1.0}):
        with pytest.raises(ValueError, match="must be a positive number of seconds"):
            dashboard.Dashboard(local_mesh, **kw)
    for call in (lambda: local_mesh.exec("1", timeout=float("nan")),
                 lambda: local_mesh.exec("1", timeout=float("inf")),
                 lambda: local_mesh.restart(0, timeout=float("nan")),
                 lambda: local_mesh.setup_dist(timeout=-1)):
        with pytest.raises(MeshError, match="timeout must be a positive number of seconds"):
            call()
    assert local_mesh.exec("rank + 1", timeout=60).values() == [1, 2]


# ----------------------------------------------------------------- rank ranges
@pytest.mark.parametrize("spec", ["0:30000000", "0:1000000000", "0:10**12", "5:",
                                  "0:99999999999999999999", "-5:3", "0:4,0:1000000000"])
def test_huge_rank_ranges_are_refused_without_being_built(spec):
    tracemalloc.start()
    try:
        with pytest.raises(RankSpecError) as ei:
            parse_ranks(spec, 4)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak  # (0:30000000 took 1.1 GB)
    assert re.search(r"ranks 0 to 3|bad rank spec", str(ei.value)), ei.value


def test_rank_specs_still_parse():
    assert parse_ranks("0:2,5", 8) == [0, 1, 5]
    assert parse_ranks("3,1,3", 4) == [3, 1]
    assert parse_ranks("2:", 4) == [2, 3]
    assert parse_ranks("all", 3) == [0, 1, 2]
    assert ranks.parse_debug_ranks("procs=1:1000000000", Shape({"procs": 4}), 4) == [1, 2, 3]
    with pytest.raises(RankSpecError):
        ranks.parse_debug_ranks("0:1000000000", Shape({"procs": 4}), 4)


# ------------------------------------------------------------ Ctrl-C, rank death
def test_ctrl_c_while_a_mesh_starts_stops_its_workers_and_says_so(monkeypatch):
    original = Controller.wait_ready

    def interrupted(self, rs, timeout):  # Ctrl-C once rank 0 has started
        original(self, rs[:1], timeout)
        raise KeyboardInterrupt

    monkeypatch.setattr(Controller, "wait_ready", interrupted)
    with pytest.raises(KeyboardInterrupt) as ei:
        spawn_procs(3)
    assert isinstance(ei.value, SpawnInterrupted)
    assert re.fullmatch(r"spawn interrupted: [1-3] of 3 ranks had started; nothing is left "
                        r"running", str(ei.value)), str(ei.value)
    assert ei.value.__context__ is None or ei.value.__suppress_context__
    assert len(ei.value._render_traceback_()) == 1
    # the line names the class raised (and the one the docs name)
    assert re.sub(r"\x1b\[[0-9;]*m", "", ei.value._render_traceback_()[0]).startswith(
        "SpawnInterrupted: spawn interrupted: ")
    assert_no_workers(os.getpid(), timeout=10)


def test_ranks_stopped_because_one_died_are_named_in_one_line():
    with spawn_procs(4) as m:
        with pytest.raises(MeshFailure) as ei:
            m.exec("import os, time\nif rank == 1:\n    time.sleep(0.3)\n    os._exit(3)\n"
                   "time.sleep(60)", timeout=60)
        err = ei.value
        assert err.rank == 1 and err.stopped == [0, 2, 3]
        shown = "\n".join(err._render_traceback_())
        assert "ranks 0, 2, 3 were stopped because rank 1 died" in shown
        assert "KeyboardInterrupt" not in shown and "0,2:4" not in shown
        assert err.others == []
    assert_no_workers(os.getpid(), timeout=10)


def test_actor_call_timeouts_refuse_nan_and_infinities():
    from monarch_kernel.actor.future import check_timeout

    assert check_timeout(None) is None and check_timeout(0) == 0.0
    for bad in (float("nan"), float("inf"), -1.0):
        with pytest.raises(ValueError, match="finite number of seconds >= 0"):
            check_timeout(bad)
