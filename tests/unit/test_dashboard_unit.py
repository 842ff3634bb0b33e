"""The dashboard widget and the status table, driven by a stand-in controller (no processes)."""

from __future__ import annotations

import threading
import types

import pytest

from monarch_kernel.controller.controller import RankInfo
from monarch_kernel.errors import compact_ranks
from monarch_kernel.mesh.shape import Shape
from monarch_kernel.testing.kernel import wait_for
from monarch_kernel.ui.dashboard import Dashboard, grid_shape, heatmap_svg, sparkline_svg
from monarch_kernel.ui.status import StatusTable, figures, fmt_bytes, fmt_pct, gpu_texts, state_text

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
            listeners=[], _closed=threading.Event())
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


def _bars(d: Dashboard, kind: str) -> dict[int, object]:
    return {r: getattr(row, kind) for r, row in d._rows.items()}


def test_rows_show_figures_by_host(dashboards):
    mesh = FakeMesh({"hosts": 2, "procs": 2}, hosts=("node-a", "node-b"))
    mesh.controller.ranks[1].state = "busy"
    mesh.state(1, cpu=97.0, rss=2 * GiB, activity="running cell")
    d = Dashboard(mesh, interval=0.05)
    dashboards.append(d)
    assert d.mode == "rows"
    f = d.figures["ranks"]
    assert f["1"]["cpu"] == 97.0 and f["1"]["state"] == "running cell"
    assert f["0"]["cpu"] == 1.0 and f["0"]["state"] == "idle"
    assert f["1"]["gpu_text"] == ["no GPU", "no GPU"]
    assert _bars(d, "cpu")[1].value == 97.0 and _bars(d, "cpu")[1].description == "97%"
    assert _bars(d, "mem")[1].value == 2 * GiB and _bars(d, "mem")[1].max == 16 * GiB
    assert "mk-r1" in _bars(d, "cpu")[1]._dom_classes
    # no GPU: the GPU bars are hidden and "no GPU" is shown
    row = d._rows[1]
    assert row.gpu.layout.display == "none" and row.no_gpu.layout.display is None
    # grouped by host: a header per host, ranks 0,1 under node-a and 2,3 under node-b
    texts = [getattr(w, "value", "") for w in d.body.children]
    assert any("node-a" in t and "2 ranks" in t for t in texts)
    i_a = next(i for i, t in enumerate(texts) if "node-a" in t)
    i_b = next(i for i, t in enumerate(texts) if "node-b" in t)
    assert d.body.children[i_a + 1] is d._rows[0].box and d.body.children[i_b + 1] is d._rows[2].box
    # live: a new sample shows up on the next refresh, and the sparkline gets a history
    mesh.state(2, cpu=55.0, rss=3 * GiB)
    mesh.state(2, cpu=65.0, rss=3 * GiB)
    wait_for(lambda: d.figures["ranks"]["2"]["cpu"] == 65.0, 5, what="refresh")
    assert "<polyline" in d._rows[2].spark.value
    assert "<b>mesh</b>" in d.header.value and "4 ranks" in d.header.value


def test_gpu_bars(dashboards):
    mesh = FakeMesh({"procs": 2})
    gpu = {"index": 0, "name": "H200", "util": 80.0, "mem_used": 40 * GiB,
           "mem_total": 141 * GiB, "proc_mem": None, "torch_allocated": 30 * GiB,
           "torch_reserved": 32 * GiB}
    mesh.state(0, gpu=gpu)
    d = Dashboard(mesh, interval=0.05)
    dashboards.append(d)
    row = d._rows[0]
    assert row.gpu.value == 80.0 and row.gpu_mem.value == 40 * GiB
    assert row.gpu_mem.max == 141 * GiB and row.no_gpu.layout.display == "none"
    assert d.figures["ranks"]["0"]["gpu_util"] == 80.0
    util, mem = gpu_texts(gpu)
    assert util == "#0 80%" and mem.startswith("40.0 GiB / 141 GiB (torch 30.0 GiB/32.0 GiB")


def test_dead_rank_shows_at_once(dashboards):
    mesh = FakeMesh({"procs": 4})
    d = Dashboard(mesh, interval=30.0)  # the periodic refresh would be far too late
    dashboards.append(d)
    mesh.kill(3, -9)
    wait_for(lambda: d.figures["ranks"]["3"]["dead"], 2, what="rank 3 shown dead")
    f = d.figures["ranks"]["3"]
    assert f["state"] == "dead (killed by SIGKILL)" and f["cpu"] is None
    assert d._rows[3].cpu.bar_style == "danger" and "mk-dead" in d._rows[3].box._dom_classes
    assert "dead: 3" in d.header.value


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
    assert "stopped" in d2.header.value
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
    assert d.mode == "heatmap" and d._rows == {}
    f = d.figures
    assert f["mode"] == "heatmap" and f["n"] == 64 and f["dead"] == [5]
    assert f["hot"][0] == [63, 63.0] and f["cpu_max"] == 63.0
    assert "rows: hosts, columns: procs" in d.heat.value
    assert d.heat.value.count("<svg") == 2  # cpu and memory; no GPU anywhere
    assert "dead: 5" in d.summary.value and "63 idle" in d.summary.value
    before = d.heat.value
    d.refresh()
    assert d.heat.value == before  # quantized: nothing changed, nothing to send


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
    # the controller's state is current, the worker's report up to an interval old
    assert state_text("idle", "running cell") == "idle"
    assert state_text("idle", "running endpoint step") == "running endpoint step"
    assert state_text("busy", "idle") == "running" and state_text("busy", "paused") == "paused"
    assert state_text("dead", "running cell", 3) == "dead (exit code 3)"
    assert state_text("dead", None, None) == "dead (stopped answering)"
    assert fmt_bytes(1536) == "1.5 KiB" and fmt_bytes(None) == "" and fmt_pct(12.6) == "13%"
