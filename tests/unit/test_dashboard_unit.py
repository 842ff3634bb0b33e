"""The dashboard widget and the status table, driven by a stand-in controller (no processes)."""

from __future__ import annotations

import re
import threading
import types

import pytest

from monarch_kernel.controller.controller import RankInfo
from monarch_kernel.controller.request import request_label
from monarch_kernel.errors import compact_ranks
from monarch_kernel.mesh.shape import Shape
from monarch_kernel.testing.kernel import wait_for
from monarch_kernel.ui import snapshot
from monarch_kernel.ui.dashboard import (
    DASHBOARD_MIME,
    WIDGET_VIEW,
    Dashboard,
    freeze_all,
    grid_shape,
    heatmap_svg,
    sparkline_svg,
)
from monarch_kernel.ui.status import StatusTable, figures, fmt_bytes, fmt_pct, gpu_texts, state_text
from monarch_kernel.worker.telemetry import Sampler, cgroup_memory_limit

GiB = 1 << 30


def _tel(cpu=1.0, rss=100 << 20, gpu=None, activity="idle"):
    return {"activity": activity, "cpu": cpu, "rss": rss, "uss": rss // 2, "threads": 7,
            "mem_total": 16 * GiB, "gpu": gpu, "seq": 1, "interval": 1.0, "cells": 0}


class FakeMesh:
    """What the dashboard reads of a ProcMesh: controller.ranks/listeners, shape, root."""

    def __init__(self, dims, hosts=("a",)):
        self.shape = Shape(dims)
        self.ranks = list(self.shape.ranks)
        per_host = max(1, len(self.ranks) // len(hosts))
        self.controller = types.SimpleNamespace(
            ranks={r: RankInfo(r, host=hosts[min(r // per_host, len(hosts) - 1)], pid=1000 + r,
                               state="idle", telemetry=_tel()) for r in self.ranks},
            listeners=[], _closed=threading.Event(), recent=[])
        self._stopped = False
        self.root = self

    def state(self, rank, **tel):
        self.controller.ranks[rank].telemetry = _tel(**tel)
        for fn in list(self.controller.listeners):
            fn("state", rank, self.controller.ranks[rank].telemetry)

    def kill(self, rank, code=-9):
        info = self.controller.ranks[rank]
        info.state, info.exitcode = "dead", code
        for fn in list(self.controller.listeners):
            fn("dead", rank, None)


def _threads():
    return [t.name for t in threading.enumerate() if t.name.startswith("monarch-dashboard")]


@pytest.fixture
def dashboards():
    made: list[Dashboard] = []
    yield made
    for d in made:
        d.close()
    wait_for(lambda: not any(d.running for d in made), 5, what="dashboard threads ending")


def _row(d: Dashboard, rank: int) -> dict:
    return next(f for f in d.figures["ranks"] if f["rank"] == rank)


def _cell(html_text: str, rank: int, cls: str) -> str:
    """The text of cell ``cls`` in rank ``rank``'s row of the dashboard's HTML."""
    row = re.search(rf'<tr class="mk-row mk-r{rank}( mk-dead)?".*?</tr>', html_text)
    assert row, f"no row of rank {rank}"
    cell = re.search(rf'<td class="{cls}".*?</td>', row.group(0))
    assert cell, f"no {cls} cell in rank {rank}'s row"
    return re.sub(r"<[^>]+>", "", cell.group(0))


def test_rows_show_figures_by_host(dashboards):
    mesh = FakeMesh({"hosts": 2, "procs": 2}, hosts=("node-a", "node-b"))
    mesh.controller.ranks[1].state = "busy"
    mesh.state(1, cpu=97.0, rss=2 * GiB, activity="running cell")
    d = Dashboard(mesh, interval=0.05)
    dashboards.append(d)
    assert d.mode == "rows"
    assert _row(d, 1)["cpu"] == 97.0 and _row(d, 1)["state"] == "running cell"
    assert _row(d, 0)["cpu"] == 1.0 and _row(d, 0)["state"] == "idle"
    assert _cell(d.view.value, 1, "mk-cpu") == "97%"
    assert _cell(d.view.value, 1, "mk-state") == "running cell"
    # grouped by host: a header per host, ranks 0,1 under node-a and 2,3 under node-b
    v = d.view.value
    assert v.index("node-a") < v.index("mk-r0") < v.index("mk-r1") < v.index("node-b") \
        < v.index("mk-r2")
    assert "2 ranks" in v
    # live: a new sample shows up on the next refresh, and the sparkline gets a history
    mesh.state(2, cpu=55.0, rss=3 * GiB)
    mesh.state(2, cpu=65.0, rss=3 * GiB)
    wait_for(lambda: _row(d, 2)["cpu"] == 65.0, 5, what="refresh")
    assert "<polyline" in _cell_html(d.view.value, 2, "mk-spark")
    # the shape for people, not a Python dict
    assert "2 hosts x 2 procs" in v and "{" not in re.sub(r"<[^>]+>", "", v)
    assert "4 ranks" in v


def _cell_html(html_text: str, rank: int, cls: str) -> str:
    row = re.search(rf'<tr class="mk-row mk-r{rank}( mk-dead)?".*?</tr>', html_text)
    assert row
    cell = re.search(rf'<td class="{cls}".*?</td>', row.group(0))
    assert cell
    return cell.group(0)


def test_memory_against_the_cgroup_limit_else_the_largest_rank(dashboards):
    mesh = FakeMesh({"procs": 3})
    mesh.state(0, rss=1 * GiB)
    mesh.state(1, rss=4 * GiB)
    mesh.state(2, rss=2 * GiB)
    d = Dashboard(mesh, interval=30.0)
    dashboards.append(d)
    # no cgroup limit: the largest rank (4 GiB) is full scale, not the host's 16 GiB
    assert [_row(d, r)["mem_limit"] for r in range(3)] == [4 * GiB] * 3
    assert _row(d, 0)["mem_limit_kind"] == "largest"
    assert _cell(d.view.value, 0, "mk-mem") == "1.0 GiB / 4.0 GiB"
    assert "width:25.0%" in _cell_html(d.view.value, 0, "mk-mem")
    # a cgroup limit wins
    for r in range(3):
        mesh.controller.ranks[r].telemetry["mem_limit"] = 8 * GiB
    d.refresh()
    assert _row(d, 0)["mem_limit"] == 8 * GiB and _row(d, 0)["mem_limit_kind"] == "cgroup"
    assert _cell(d.view.value, 1, "mk-mem") == "4.0 GiB / 8.0 GiB"
    assert d.figures["totals"]["mem_limit"] == 24 * GiB


def test_gpu_columns_first_and_only_with_a_gpu(dashboards):
    mesh = FakeMesh({"procs": 2})
    d = Dashboard(mesh, interval=30.0)
    dashboards.append(d)
    # CPU host: no GPU column at all (neither header nor cells)
    assert not d.figures["has_gpu"]
    assert "gpu" not in d.view.value.lower().replace("monarch", "")
    gpu = {"index": 0, "name": "H200", "util": 80.0, "mem_used": 40 * GiB,
           "mem_total": 141 * GiB, "proc_mem": None, "torch_allocated": 30 * GiB,
           "torch_reserved": 32 * GiB}
    mesh.state(0, gpu=gpu)
    mesh.state(1, gpu=dict(gpu, index=1, util=20.0, mem_used=10 * GiB))
    d.refresh()
    assert d.figures["has_gpu"]
    v = d.view.value
    heads = re.findall(r"<th [^>]*>([^<]*)</th>", v.split("mk-timeline")[0])
    assert heads[:5] == ["rank", "state", "gpu util", "gpu memory", "cpu"]
    assert _cell(v, 0, "mk-gpu") == "#0 80%"
    assert _cell(v, 0, "mk-gpumem") == "40.0 GiB / 141 GiB"
    t = d.figures["totals"]
    assert t["gpu_util"] == 50.0 and t["gpu_mem"] == 50 * GiB and t["gpu_mem_total"] == 282 * GiB
    util, mem = gpu_texts(gpu)
    assert util == "#0 80%" and mem.startswith("40.0 GiB / 141 GiB (torch 30.0 GiB/32.0 GiB")


def test_totals_row(dashboards):
    mesh = FakeMesh({"procs": 3})
    mesh.state(0, cpu=10.0, rss=GiB)
    mesh.state(1, cpu=20.0, rss=GiB)
    mesh.state(2, cpu=30.5, rss=2 * GiB)
    d = Dashboard(mesh, interval=30.0)
    dashboards.append(d)
    t = d.figures["totals"]
    assert t["cpu"] == 60.5 and t["rss"] == 4 * GiB and t["reporting"] == 3 and t["ranks"] == 3
    total = re.search(r'<tr class="mk-total".*?</tr>', d.view.value).group(0)
    text = re.sub(r"<[^>]+>", " ", total)
    assert "total" in text and "3 of 3" in text and "60%" in text and "4.0 GiB" in text


def _req(label, ranks, sent, replies, done=True):
    return types.SimpleNamespace(label=label, ranks=ranks, sent_at=sent, reply_at=replies,
                                 done=lambda: done)


def test_timeline_marks_the_straggler():
    now = 100.0
    reqs = [_req("cell 1", [0, 1, 2, 3], 90.0, {0: 90.5, 1: 90.5, 2: 90.6, 3: 92.5}),
            _req("endpoint step", [0, 1, 2, 3], 95.0, {0: 95.2, 1: 95.21, 2: 95.2, 3: 95.22}),
            _req("cell 2", [0, 1, 2, 3], 98.0, {0: 98.1, 1: 98.1, 2: 98.1}, done=False)]
    tl = snapshot.timeline(reqs, now)
    assert [e["label"] for e in tl] == ["cell 1", "endpoint step", "cell 2"]
    assert tl[0]["ranks"] == {"0": 0.5, "1": 0.5, "2": 0.6, "3": 2.5}
    assert tl[0]["slowest"] == 3 and tl[0]["straggler"]
    assert tl[1]["slowest"] == 3 and not tl[1]["straggler"]  # 20 ms apart: no straggler
    assert tl[2]["running"] and tl[2]["slowest"] == 3 and tl[2]["straggler"]
    mesh = FakeMesh({"procs": 4})
    infos = mesh.controller.ranks
    snap = snapshot.collect({"procs": 4}, range(4), infos, reqs, now=now, wall=0.0)
    html_text = snapshot.render_html(snap)
    slow = re.findall(r'<td class="mk-tl mk-slow" data-rank="(\d+)"', html_text)
    assert slow == ["3", "3"]
    assert "cell 1" in html_text and "2.50 s" in html_text and "running" in html_text
    assert "straggler: r3 in cell 2" in snapshot.render_text(snap)


def test_human_shape():
    assert snapshot.human_shape({"hosts": 1, "procs": 4}) == "1 host x 4 procs"
    assert snapshot.human_shape({"hosts": 2, "gpus": 8}) == "2 hosts x 8 gpus"
    assert snapshot.human_shape({"procs": 1}) == "1 proc"
    assert snapshot.human_shape({}) == "no ranks"


def test_colours_are_theme_variables():
    mesh = FakeMesh({"hosts": 1, "procs": 2})
    mesh.kill(1, -9)
    gpu = {"index": 0, "util": 5.0, "mem_used": GiB, "mem_total": 80 * GiB}
    mesh.state(0, gpu=gpu)
    reqs = [_req("cell 1", [0, 1], 1.0, {0: 1.1}, done=True)]
    snap = snapshot.collect({"hosts": 1, "procs": 2}, range(2), mesh.controller.ranks, reqs,
                            now=5.0, wall=0.0)
    html_text = snapshot.render_html(snap)
    # every colour is a JupyterLab theme variable (a fixed one only as its fallback)
    bare = re.sub(r"var\(--jp-[a-z0-9-]+(, [^()]*(\([^()]*\))?)?\)", "VAR", html_text)
    assert not re.findall(r"#[0-9a-fA-F]{3,6}\b|rgba?\(", bare), bare
    for var in ("--jp-ui-font-color1", "--jp-layout-color0", "--jp-error-color1",
                "--jp-border-color2", "--jp-layout-color2"):
        assert var in html_text, var
    # the dead rank's state and the header's dead ranks are in the error colour
    assert 'color:var(--jp-error-color1, #d32f2f)' in _cell_html(html_text, 1, "mk-state")
    assert "dead: 1" in html_text
    assert "--jp-ui-font-color3" not in html_text  # too faint for 4.5:1


def test_cgroup_memory_limit(tmp_path):
    proc = tmp_path / "proc" / "7"
    proc.mkdir(parents=True)
    root = tmp_path / "cg"
    # v2: the smallest limit along the path wins; "max" is no limit
    (root / "a" / "b").mkdir(parents=True)
    (root / "cgroup.controllers").write_text("memory\n")
    (root / "a" / "memory.max").write_text(f"{8 * GiB}\n")
    (root / "a" / "b" / "memory.max").write_text("max\n")
    (proc / "cgroup").write_text("0::/a/b\n")
    kw = {"root": str(root), "proc": str(tmp_path / "proc")}
    assert cgroup_memory_limit(7, **kw) == 8 * GiB
    (root / "a" / "b" / "memory.max").write_text(f"{2 * GiB}\n")
    assert cgroup_memory_limit(7, **kw) == 2 * GiB
    # v1: memory.limit_in_bytes; the "unlimited" huge number is no limit
    v1 = tmp_path / "cg1"
    (v1 / "memory" / "job").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    (v1 / "memory" / "job" / "memory.limit_in_bytes").write_text(f"{3 * GiB}\n")
    (proc / "cgroup").write_text("4:memory:/job\n1:cpu:/\n")
    assert cgroup_memory_limit(7, root=str(v1), proc=str(tmp_path / "proc")) == 3 * GiB
    (proc / "cgroup").write_text("4:memory:/\n")
    assert cgroup_memory_limit(7, root=str(v1), proc=str(tmp_path / "proc")) is None
    assert cgroup_memory_limit(99, **kw) is None  # no such process: no limit, no error
    # every telemetry record carries the limit (None here: no cgroup limit below the host's)
    rec = Sampler(gpu=False).sample()
    assert "mem_limit" in rec
    assert rec["mem_limit"] is None or rec["mem_limit"] < rec["mem_total"]


def test_dead_rank_shows_at_once(dashboards):
    mesh = FakeMesh({"procs": 4})
    d = Dashboard(mesh, interval=30.0)  # the periodic refresh would be far too late
    dashboards.append(d)
    mesh.kill(3, -9)
    wait_for(lambda: _row(d, 3)["dead"], 2, what="rank 3 shown dead")
    f = _row(d, 3)
    assert f["state"] == "dead (killed by SIGKILL)" and f["cpu"] is None
    assert 'class="mk-row mk-r3 mk-dead"' in d.view.value
    assert "dead: 3" in d.view.value


class _Displays:
    """IPython.display's display and update_display, recorded."""

    def __init__(self, monkeypatch):
        import IPython.display

        self.shown: list[tuple[dict, dict]] = []
        self.updates: list[tuple[dict, dict]] = []
        monkeypatch.setattr(IPython.display, "display",
                            lambda data, **kw: self.shown.append((data, kw)))
        monkeypatch.setattr(IPython.display, "update_display",
                            lambda data, **kw: self.updates.append((data, kw)))


def test_output_keeps_a_static_copy_and_freezes_when_the_mesh_stops(dashboards, monkeypatch):
    shown = _Displays(monkeypatch)
    mesh = FakeMesh({"hosts": 1, "procs": 2})
    d = Dashboard(mesh, interval=0.05, snapshot_every=0.2)
    dashboards.append(d)
    d._ipython_display_()
    data, kw = shown.shown[0]
    assert kw["display_id"] == d.display_id and kw["raw"]
    assert data[WIDGET_VIEW]["model_id"] == d.model_id
    assert data[DASHBOARD_MIME] == data[WIDGET_VIEW]  # the extension's own MIME type
    assert 'class="monarch-dashboard-view"' in data["text/html"]
    assert 'data-status="snapshot"' in data["text/html"] and "live," not in data["text/html"]
    assert 'data-status="live"' in d.view.value and "live, every" in d.view.value
    assert "live" not in data["text/plain"] and "1 host x 2 procs" in data["text/plain"]
    # while live, the static copy is refreshed now and then (a notebook saved meanwhile)
    wait_for(lambda: shown.updates, 5, what="a refresh of the static copy")
    assert WIDGET_VIEW in shown.updates[0][0]
    mesh.state(0, cpu=42.0)
    mesh._stopped = True
    mesh.kill(0, 0)
    mesh.kill(1, 0)  # the last rank down while stopping: frozen at once, in this thread
    assert not d.running or wait_for(lambda: not d.running, 5, what="end")
    last, kw = shown.updates[-1]
    assert kw["display_id"] == d.display_id
    assert WIDGET_VIEW not in last and DASHBOARD_MIME not in last  # static: no model needed
    assert 'data-status="stopped"' in last["text/html"]
    assert "42%" in last["text/html"]  # the last figures seen, kept
    assert "last figures" in last["text/html"]
    assert "mesh stopped" in last["text/html"] and "live" not in last["text/plain"]
    assert "mesh stopped" in last["text/plain"]
    n = len(shown.updates)
    d.freeze()
    assert len(shown.updates) == n  # once
    assert mesh.controller.listeners == []
    assert "live" not in repr(d)


def test_closing_keeps_the_last_state(dashboards, monkeypatch):
    shown = _Displays(monkeypatch)
    mesh = FakeMesh({"procs": 2})
    mesh.state(1, cpu=33.0)
    d = Dashboard(mesh, interval=30.0)
    dashboards.append(d)
    d._ipython_display_()
    d.close()
    last, _ = shown.updates[-1]
    assert WIDGET_VIEW not in last and 'data-status="closed"' in last["text/html"]
    assert "33%" in last["text/html"]
    # a dashboard never displayed sends nothing
    d2 = Dashboard(mesh, interval=30.0)
    dashboards.append(d2)
    n = len(shown.updates)
    d2.close()
    assert len(shown.updates) == n


def test_freeze_all(dashboards, monkeypatch):
    shown = _Displays(monkeypatch)
    mesh = FakeMesh({"procs": 2})
    d = Dashboard(mesh, interval=30.0)
    dashboards.append(d)
    d._ipython_display_()
    assert freeze_all() >= 1
    wait_for(lambda: not d.running, 5, what="the frozen dashboard's thread ending")
    assert WIDGET_VIEW not in shown.updates[-1][0]
    assert freeze_all() == 0


def test_stops_with_the_mesh_and_on_close(dashboards):
    mesh = FakeMesh({"procs": 2})
    d1 = Dashboard(mesh, interval=0.05)
    d2 = Dashboard(mesh, interval=0.05)  # several at once
    dashboards.extend([d1, d2])
    assert d1.running and d2.running and len(_threads()) >= 2
    assert len(mesh.controller.listeners) == 2
    d1.close()
    assert not d1.running and d2.running and len(mesh.controller.listeners) == 1
    assert d1.comm is None
    mesh._stopped = True
    mesh.kill(0, 0)  # ProcMesh.stop marks every rank stopped, which wakes the dashboard
    wait_for(lambda: not d2.running, 5, what="the dashboard ending with its mesh")
    assert mesh.controller.listeners == []
    assert 'data-status="stopped"' in d2.view.value
    d2.close()


def test_frontend_closing_the_comm_stops_it(dashboards):
    mesh = FakeMesh({"procs": 2})
    d = Dashboard(mesh, interval=0.05)
    dashboards.append(d)
    d._comm_closed({"content": {"comm_id": "x"}})
    assert not d.running and mesh.controller.listeners == []


def test_heatmap_for_large_meshes(dashboards):
    mesh = FakeMesh({"hosts": 8, "procs": 8})
    for r in range(64):
        mesh.controller.ranks[r].telemetry = _tel(cpu=float(r), rss=(r + 1) << 24)
    mesh.kill(5)
    d = Dashboard(mesh, interval=30.0)
    dashboards.append(d)
    assert d.mode == "heatmap" and d.figures["mode"] == "heatmap"
    assert len(d.figures["ranks"]) == 64 and d.figures["totals"]["dead"] == [5]
    v = d.view.value
    assert v.count('class="mk-cell') == 64 and "8 hosts x 8 procs" in v
    assert "busiest: r63 63%" in v and "dead: 5" in v and "63 idle" in v


def test_layout_choice_and_bad_arguments(dashboards):
    mesh = FakeMesh({"procs": 3})
    d = Dashboard(mesh, layout="heatmap")
    dashboards.append(d)
    assert d.mode == "heatmap"
    with pytest.raises(ValueError, match="interval"):
        Dashboard(mesh, interval=0)
    with pytest.raises(ValueError, match="layout"):
        Dashboard(mesh, layout="pie")
    with pytest.raises(ValueError, match="history"):
        Dashboard(mesh, history=-1)
    assert mesh.controller.listeners == [d._listen]


def test_request_labels():
    assert request_label("execute", {"code": "", "filename": "<mesh-cell-3>"}) == "cell 3"
    assert request_label("execute", {"code": "", "label": "In [5]"}) == "In [5]"
    assert request_label("call", {"a": "t", "m": "step"}) == "endpoint step"
    assert request_label("push", {}) == "" and request_label("execute", None) == ""


def test_drawing_helpers():
    assert grid_shape({"hosts": 4, "procs": 8}) == (4, 8, "hosts", "procs")
    assert grid_shape({"a": 2, "b": 3, "c": 4})[:2] == (6, 4)
    assert grid_shape({"ranks": 40})[:2] == (6, 7)
    svg = sparkline_svg([([(60, 0.0), (30, 50.0), (0, 100.0)], "#00f", 100.0)], 60, title="t")
    assert svg.startswith("<svg") and "<polyline" in svg and "<title>t</title>" in svg
    assert "0.0,25.0" in svg and "120.0,1.0" in svg  # oldest at the left/bottom, newest top right
    hm = heatmap_svg([0.0, 0.5, None, 1.0], [False, False, False, True], 2, 2, "cpu", "CPU")
    assert hm.count("<path") == 4 and 'fill="#212121"' in hm and 'fill="#e0e0e0"' in hm
    assert compact_ranks([1, 2, 3, 7, 9, 10]) == "1-3, 7, 9, 10"


def test_status_table_columns():
    rows = [
        {"rank": 0, "host": "h", "pid": 11, "state": "idle", "messages_in": 5,
         "messages_out": 2, **_tel(cpu=3.25, rss=150 << 20)},
        {"rank": 1, "host": "h", "pid": 12, "state": "busy", "messages_in": 5,
         "messages_out": 3, **_tel(cpu=99.0, activity="running endpoint step",
                                   gpu={"index": 1, "util": 50.0, "mem_used": GiB,
                                        "mem_total": 80 * GiB})},
        {"rank": 2, "host": "h", "pid": 13, "state": "dead", "exitcode": -9,
         "messages_in": 1, "messages_out": 1, **_tel(cpu=50.0)},
    ]
    mesh = types.SimpleNamespace(shape=Shape({"procs": 3}), status=lambda: rows)
    t = StatusTable(mesh)
    text = repr(t)
    for title in ("cpu", "rss", "uss", "threads", "gpu", "gpu mem", "msgs in/out"):
        assert title in text
    assert "3.2%" in text and "150 MiB" in text and "no GPU" in text
    assert "running endpoint step" in text and "#1 50%" in text and "1.0 GiB / 80.0 GiB" in text
    assert "dead (killed by SIGKILL)" in text
    assert figures(rows[2])["cpu"] == ""  # a dead rank's last figures are not shown
    html = t._repr_html_()
    assert "<th>gpu mem</th>" in html and "no GPU" in html and "#b71c1c" in html
    # telemetry off: no empty figure columns
    bare = [{"rank": 0, "host": "h", "pid": 1, "state": "idle"}]
    t2 = StatusTable(types.SimpleNamespace(shape=Shape({"procs": 1}), status=lambda: bare))
    assert "cpu" not in repr(t2)
    assert "mesh 1 proc" in repr(t2) and "{" not in t2._repr_html_()  # the shape in words
    # the controller's state is current, the worker's report up to an interval old
    assert state_text("idle", "running cell") == "idle"
    assert state_text("idle", "running endpoint step") == "running endpoint step"
    assert state_text("busy", "idle") == "running" and state_text("busy", "paused") == "paused"
    assert state_text("dead", "running cell", 3) == "dead (exit code 3)"
    assert state_text("dead", None, None) == "dead (stopped answering)"
    assert fmt_bytes(1536) == "1.5 KiB" and fmt_bytes(None) == "" and fmt_pct(12.6) == "13%"
