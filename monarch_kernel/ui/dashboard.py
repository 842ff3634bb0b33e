"""``%mesh dashboard``: a live ipywidgets view of every rank's resources.

Layout
------
rows (up to ``max_rows`` = 32 ranks)
    A row per rank, grouped by host: state, CPU %, memory (RSS against the
    host's memory), GPU utilization and GPU memory as bars, and a sparkline
    of CPU (blue) and memory (orange) over the last ``history`` seconds.
heatmap (more ranks)
    A summary (ranks per state, dead ranks, the busiest ranks) and heat maps
    of CPU, memory and (where present) GPU utilization over the mesh's
    dimensions: rows are the outer dimensions, columns the innermost one.

How it stays live
-----------------
Workers send telemetry about once a second (:mod:`monarch_kernel.worker.telemetry`).
The dashboard registers a listener on the mesh's controller: the listener
(run in the controller's I/O thread) only records each sample in a short
history and wakes the dashboard's own thread when a rank dies. That thread
(``monarch-dashboard-N``) refreshes the widgets every ``interval`` seconds
by setting traitlets; ipywidgets sends those as comm messages on the
kernel's IOPub channel, which works while the kernel's main thread runs
other cells (ipykernel >= 6). No extra port, no timer on the kernel's loop.

The thread ends, and the listener is removed, when the widget is closed
(:meth:`Dashboard.close`, or the frontend closing its comm), when the mesh
is stopped (one last refresh shows "stopped"), and with the kernel process
(daemon thread; kernel shutdown also stops meshes). Any number of
dashboards can run at once.

Reading it from the frontend side
---------------------------------
The :class:`Dashboard` model carries a synced ``figures`` dict (rows
layout: ``{"mode": "rows", "ranks": {"1": {"state", "cpu", "rss",
"gpu_util", "gpu_mem", ...}}}``; heat map layout: a summary) and every bar is
a ``FloatProgress`` whose ``_dom_classes`` name its rank and figure
(``mk-r1``, ``mk-cpu``), so tests and scripts can read the numbers from the
comm messages alone.

Sparklines and heat maps are inline SVG in ``HTML`` widgets (no plotting
library), as in Tufte's sparklines.
"""

from __future__ import annotations

import collections
import html
import itertools
import math
import threading
import time
from typing import Any

import ipywidgets as widgets
from traitlets import Dict

from monarch_kernel.errors import compact_ranks
from monarch_kernel.ui.status import fmt_bytes, fmt_pct, gpu_texts, state_text
from monarch_kernel.util.numbers import check_number

__all__ = ["Dashboard", "grid_shape", "heatmap_svg", "sparkline_svg"]

MAX_ROWS = 32
_counter = itertools.count(1)

STATE_COLORS = {"idle": "#2e7d32", "running": "#1565c0", "paused": "#ef6c00",
                "dead": "#b71c1c", "stopped": "#616161", "starting": "#616161"}
CPU_COLOR, MEM_COLOR = "#1e88e5", "#fb8c00"


# ------------------------------------------------------------------ drawing
def sparkline_svg(series: list[tuple[list[tuple[float, float]], str, float]], span: float,
                  width: int = 120, height: int = 26, title: str = "") -> str:
    """An inline SVG with one polyline per series.

    Parameters
    ----------
    series : list of (points, color, top)
        ``points``: ``(age_seconds, value)`` pairs; ``color``: an SVG color;
        ``top``: the value drawn at the top edge (0 at the bottom).
    span : float
        Seconds shown (age 0 at the right edge, ``span`` at the left).
    width, height : int
        Pixels.
    title : str
        Tooltip text.

    Returns
    -------
    str
        ``<svg>...</svg>``.
    """
    lines = []
    for points, color, top in series:
        if len(points) < 2:
            continue
        top = top or 1.0
        pts = " ".join(
            f"{width - min(age, span) / span * width:.1f},"
            f"{height - 1 - min(max(v / top, 0.0), 1.0) * (height - 2):.1f}"
            for age, v in points)
        lines.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.3" '
                     f'points="{pts}"/>')
    tip = f"<title>{html.escape(title)}</title>" if title else ""
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'style="background:#f5f5f5;border-radius:2px">{tip}{"".join(lines)}</svg>')


def grid_shape(dims: dict[str, int]) -> tuple[int, int, str, str]:
    """(rows, columns, row label, column label) of a heat map over ``dims``.

    The innermost dimension runs along a row; the others, flattened, down the
    columns. One dimension is wrapped into a near-square grid.
    """
    names, sizes = list(dims), list(dims.values())
    n = math.prod(sizes) if sizes else 0
    if len(sizes) >= 2 and sizes[-1] > 1:
        return n // sizes[-1], sizes[-1], " x ".join(names[:-1]), names[-1]
    cols = max(1, math.ceil(math.sqrt(n)))
    return math.ceil(n / cols), cols, f"rank // {cols}", f"rank % {cols}"


def _level_color(x: float | None, hue: str) -> str:
    if x is None:
        return "#e0e0e0"
    level = min(9, max(0, int(x * 10)))
    # light -> saturated, 10 levels (quantized: equal pictures send no update)
    base = {"cpu": (30, 136, 229), "mem": (251, 140, 0), "gpu": (67, 160, 71)}[hue]
    f = 0.12 + 0.88 * (level / 9)
    r, g, b = (round(255 - (255 - c) * f) for c in base)
    return f"#{r:02x}{g:02x}{b:02x}"


def heatmap_svg(values: list[float | None], dead: list[bool], rows: int, cols: int,
                hue: str, title: str, cell: int = 0) -> str:
    """An SVG heat map: one cell per rank (row-major), ``values`` in [0, 1].

    Cells of the same color are drawn as one path, so the picture stays
    small (a few bytes per rank) and identical while nothing changes. Dead
    ranks are black, ranks without figures grey.
    """
    cell = cell or max(4, min(18, 480 // max(cols, 1)))
    paths: dict[str, list[str]] = collections.defaultdict(list)
    for i, v in enumerate(values):
        r, c = divmod(i, cols)
        color = "#212121" if dead[i] else _level_color(v, hue)
        paths[color].append(f"M{c * cell} {r * cell}h{cell - 1}v{cell - 1}h{1 - cell}z")
    w, h = cols * cell, rows * cell
    body = "".join(f'<path fill="{color}" d="{"".join(d)}"/>' for color, d in
                   sorted(paths.items()))
    return (f'<div style="display:inline-block;margin-right:12px"><div style="font-size:11px">'
            f'{html.escape(title)}</div><svg xmlns="http://www.w3.org/2000/svg" width="{w}" '
            f'height="{h}">{body}</svg></div>')


def _badge(text: str) -> str:
    key = text.split(" ")[0]
    color = STATE_COLORS.get(key, STATE_COLORS["running"])
    return (f'<span class="mk-state" title="{html.escape(text)}" style="color:white;'
            f'background:{color};border-radius:3px;padding:1px 5px;font-size:11px;'
            f'white-space:nowrap">{html.escape(text[:28])}</span>')


# ---------------------------------------------------------------- one rank row
class _RankRow:
    """The widgets of one rank's row."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        lay = widgets.Layout
        style = {"description_width": "58px"}
        tag = f"mk-r{rank}"

        def bar(kind: str, top: float = 100.0) -> widgets.FloatProgress:
            return widgets.FloatProgress(
                value=0.0, min=0.0, max=top, description="", style=style,
                layout=lay(width="150px"), _dom_classes=(f"mk-{kind}", tag))

        self.name = widgets.HTML(f"<b>r{rank}</b>", layout=lay(width="44px"))
        self.state = widgets.HTML(_badge("starting"), layout=lay(width="160px"))
        self.cpu = bar("cpu")
        self.mem = bar("mem", 1.0)
        self.gpu = bar("gpu")
        self.gpu_mem = bar("gpumem", 1.0)
        self.no_gpu = widgets.HTML('<span style="color:#757575">no GPU</span>',
                                   layout=lay(width="300px", display="none"))
        self.spark = widgets.HTML(sparkline_svg([], 60), layout=lay(width="130px"))
        self.box = widgets.HBox(
            [self.name, self.state, self.cpu, self.mem, self.gpu, self.gpu_mem, self.no_gpu,
             self.spark], layout=lay(align_items="center"), _dom_classes=("mk-row", tag))

    @property
    def widgets(self) -> list[widgets.Widget]:
        return [self.name, self.state, self.cpu, self.mem, self.gpu, self.gpu_mem,
                self.no_gpu, self.spark, self.box]

    def update(self, fig: dict[str, Any], spark: str) -> None:
        alive = fig["alive"]
        with self.state.hold_sync():
            self.state.value = _badge(fig["state"])
        with self.cpu.hold_sync():
            self.cpu.value = min(fig["cpu"] or 0.0, 100.0) if alive else 0.0
            self.cpu.description = fmt_pct(fig["cpu"]) if alive else "-"
            self.cpu.bar_style = "danger" if fig["dead"] else (
                "warning" if alive and (fig["cpu"] or 0) > 90 else "")
        with self.mem.hold_sync():
            total = float(fig["mem_total"] or 1)
            self.mem.max = total
            self.mem.value = min(float(fig["rss"] or 0), total) if alive else 0.0
            self.mem.description = fmt_bytes(fig["rss"]) if alive else "-"
            self.mem.bar_style = "danger" if fig["dead"] else ""
        gpu = fig["gpu"]
        has_gpu = gpu is not None
        if alive and has_gpu != (self.no_gpu.layout.display == "none"):
            self.no_gpu.layout.display = "none" if has_gpu else None
            self.gpu.layout.display = None if has_gpu else "none"
            self.gpu_mem.layout.display = None if has_gpu else "none"
        if gpu is not None:
            with self.gpu.hold_sync():
                self.gpu.value = float(gpu.get("util") or 0.0) if alive else 0.0
                self.gpu.description = fmt_pct(gpu.get("util")) if alive else "-"
            with self.gpu_mem.hold_sync():
                self.gpu_mem.max = float(gpu.get("mem_total") or 1)
                self.gpu_mem.value = float(gpu.get("mem_used") or 0) if alive else 0.0
                self.gpu_mem.description = fmt_bytes(gpu.get("mem_used")) if alive else "-"
        self.spark.value = spark
        dom = ("mk-row", f"mk-r{self.rank}") + (("mk-dead",) if fig["dead"] else ())
        if self.box._dom_classes != dom:
            self.box._dom_classes = dom


# ----------------------------------------------------------------- dashboard
class Dashboard(widgets.VBox):
    """A live dashboard of a mesh's ranks (see the module docstring).

    Parameters
    ----------
    mesh : ProcMesh
        The mesh (or a slice of one) to watch.
    interval : float
        Seconds between refreshes (the workers' own sampling interval is set
        at spawn: ``%mesh spawn N --telemetry-interval S``).
    history : float
        Seconds of CPU and memory history in the sparklines.
    layout : {"auto", "rows", "heatmap"}
        ``auto``: rows up to 32 ranks, a heat map above.

    Raises
    ------
    ValueError
        For an ``interval`` or ``history`` that is not a positive, finite number of
        seconds, or an unknown ``layout``.
    """

    #: the figures shown, readable by any frontend (see the module docstring)
    figures = Dict().tag(sync=True)

    def __init__(self, mesh: Any, interval: float = 1.0, history: float = 60.0,
                 layout: str = "auto", max_rows: int = MAX_ROWS) -> None:
        check_number(interval, "dashboard interval", above=True, seconds=True)
        check_number(history, "dashboard history", above=True, seconds=True)
        if layout not in ("auto", "rows", "heatmap"):
            raise ValueError(f"dashboard layout {layout!r} is unknown; use auto, rows or heatmap")
        super().__init__(layout=widgets.Layout(padding="4px"))
        self.mesh = mesh
        self.controller = mesh.controller
        self.ranks: list[int] = list(mesh.ranks)
        self.dims: dict[str, int] = dict(mesh.shape.dims)
        self.interval = float(interval)
        self.history = float(history)
        self.mode = layout if layout != "auto" else (
            "rows" if len(self.ranks) <= max_rows else "heatmap")
        self._history: dict[int, collections.deque[tuple[float, float, float]]] = {
            r: collections.deque(maxlen=2000) for r in self.ranks}
        self._seen = set(self.ranks)
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._closed = False
        self.add_class("monarch-dashboard")
        self.header = widgets.HTML()
        self._rows: dict[int, _RankRow] = {}
        self._host_key: tuple[str, ...] = ()
        if self.mode == "rows":
            self._rows = {r: _RankRow(r) for r in self.ranks}
            self.body = widgets.VBox()
        else:
            self.summary = widgets.HTML()
            self.heat = widgets.HTML()
            self.body = widgets.VBox([self.summary, self.heat])
        self.children = (self.header, self.body)
        self._seed_history()
        self.refresh()
        self.controller.listeners.append(self._listen)
        self.thread = threading.Thread(target=self._run, daemon=True,
                                       name=f"monarch-dashboard-{next(_counter)}")
        self.thread.start()

    # --------------------------------------------------------- life cycle
    @property
    def running(self) -> bool:
        """True while the refresh thread runs."""
        return self.thread.is_alive()

    def _mesh_stopped(self) -> bool:
        root = getattr(self.mesh, "root", self.mesh)
        closed = getattr(self.controller, "_closed", None)
        return bool(getattr(root, "_stopped", False)) or bool(closed and closed.is_set())

    def _listen(self, kind: str, rank: int, payload: Any) -> None:
        # runs in the controller's I/O thread: record, wake, nothing more
        if rank not in self._seen:
            return
        if kind == "state" and isinstance(payload, dict) and "cpu" in payload:
            rss = payload.get("rss") or 0
            self._history[rank].append((time.monotonic(), float(payload["cpu"]), float(rss)))
        elif kind in ("dead", "hello"):
            self._wake.set()

    def _seed_history(self) -> None:
        now = time.monotonic()
        for r in self.ranks:
            t = self.controller.ranks.get(r)
            tel = getattr(t, "telemetry", None) or {}
            if "cpu" in tel:
                self._history[r].append((now, float(tel["cpu"]), float(tel.get("rss") or 0)))

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._wake.wait(self.interval)
                self._wake.clear()
                if self._stop.is_set():
                    break
                stopped = self._mesh_stopped()
                self.refresh()
                if stopped:
                    break
        except Exception:
            import logging

            logging.getLogger("monarch_kernel.ui").exception("the dashboard stopped")
        finally:
            self._detach()

    def _detach(self) -> None:
        try:
            self.controller.listeners.remove(self._listen)
        except ValueError:
            pass

    def stop(self, timeout: float = 2.0) -> None:
        """Stop refreshing (the widget stays, frozen); waits up to ``timeout`` s."""
        self._stop.set()
        self._wake.set()
        self._detach()
        if self.thread.is_alive() and threading.current_thread() is not self.thread:
            self.thread.join(timeout)

    def close(self) -> None:
        """Stop the refresh thread and close this widget and its parts."""
        if not hasattr(self, "thread"):  # __init__ failed part way (bad arguments)
            super().close()
            return
        self.stop()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            parts: list[widgets.Widget] = [self.header, self.body]
            for row in self._rows.values():
                parts.extend(row.widgets)
            if self.mode == "heatmap":
                parts += [self.summary, self.heat]
            for w in parts:
                w.close()
            super().close()

    def _comm_closed(self, msg: Any) -> None:
        self.close()  # the frontend closed the model

    def open(self) -> None:
        super().open()
        if self.comm is not None:
            self.comm.on_close(self._comm_closed)

    # -------------------------------------------------------------- figures
    def snapshot(self) -> dict[int, dict[str, Any]]:
        """Per rank: host, pid, state text, alive/dead, cpu %, rss, uss,
        mem_total, threads, gpu dict (or None), message counts."""
        out = {}
        stopped = self._mesh_stopped()
        for r in self.ranks:
            info = self.controller.ranks.get(r)
            if info is None:
                continue
            tel = info.telemetry or {}
            state = info.state
            if stopped and (state != "dead" or info.exitcode == 0):
                state = "stopped"  # a clean exit seen while the mesh was being stopped
            has = "cpu" in tel
            alive = has and state not in ("dead", "stopped", "starting")
            out[r] = {
                "host": info.host or "", "pid": info.pid,
                "state": state_text(state, tel.get("activity"), info.exitcode),
                "dead": state == "dead", "alive": alive, "has_figures": has,
                "cpu": tel.get("cpu") if alive else None,
                "rss": tel.get("rss") if alive else None,
                "uss": tel.get("uss") if alive else None,
                "mem_total": tel.get("mem_total"),
                "threads": tel.get("threads") if alive else None,
                "gpu": tel.get("gpu") if alive else None,
                "msgs": [info.messages_in, info.messages_out],
            }
        return out

    def _spark(self, r: int, now: float) -> str:
        hist = self._history.get(r)
        if not hist:
            return sparkline_svg([], self.history)
        while hist and now - hist[0][0] > self.history + 2:
            hist.popleft()
        pts = list(hist)
        cpu = [(now - t, c) for t, c, _ in pts]
        mem = [(now - t, m) for t, _, m in pts]
        top_cpu = max(100.0, max(c for _, c in cpu))
        top_mem = max(m for _, m in mem) * 1.1 or 1.0
        title = (f"last {self.history:.0f} s: cpu max {fmt_pct(max(c for _, c in cpu))}, "
                 f"rss {fmt_bytes(min(m for _, m in mem))} - {fmt_bytes(max(m for _, m in mem))}")
        return sparkline_svg([(cpu, CPU_COLOR, top_cpu), (mem, MEM_COLOR, top_mem)],
                             self.history, title=title)

    def refresh(self) -> None:
        """Redraw from the controller's latest figures (the thread calls this)."""
        with self._lock:
            if self._closed:
                return
            snap = self.snapshot()
            now = time.monotonic()
            if self.mode == "rows":
                self._refresh_rows(snap, now)
            else:
                self._refresh_heat(snap)
            live = sum(1 for f in snap.values() if f["alive"])
            dead = [r for r, f in snap.items() if f["dead"]]
            status = "stopped" if self._mesh_stopped() else (
                "closed" if self._stop.is_set() else f"live, every {self.interval:g} s")
            self.header.value = (
                f'<div style="font-size:12px"><b>mesh</b> {html.escape(str(self.dims))} &middot; '
                f"{len(self.ranks)} ranks, {live} reporting"
                + (f', <span style="color:#b71c1c">dead: {compact_ranks(dead)}</span>'
                   if dead else "")
                + f" &middot; {time.strftime('%H:%M:%S')} ({status})"
                + (f' &middot; <span style="color:{CPU_COLOR}">cpu</span> / '
                   f'<span style="color:{MEM_COLOR}">memory</span> over the last '
                   f"{self.history:.0f} s" if self.mode == "rows" else "") + "</div>")

    def _refresh_rows(self, snap: dict[int, dict[str, Any]], now: float) -> None:
        hosts = tuple(snap[r]["host"] if r in snap else "" for r in self.ranks)
        if hosts != self._host_key:
            self._host_key = hosts
            groups: dict[str, list[int]] = {}
            for r, h in zip(self.ranks, hosts, strict=True):
                groups.setdefault(h or "(starting)", []).append(r)
            head = widgets.HTML(
                '<div style="font-size:11px;color:#616161;display:flex">'
                '<span style="width:44px">rank</span><span style="width:160px">state</span>'
                '<span style="width:150px">cpu</span><span style="width:150px">memory (rss)'
                '</span><span style="width:150px">gpu util</span><span style="width:150px">'
                'gpu memory</span><span>history</span></div>')
            kids: list[widgets.Widget] = [head]
            for host, rs in groups.items():
                kids.append(widgets.HTML(f"<b>{html.escape(host)}</b> &middot; {len(rs)} "
                                         f"rank{'s' if len(rs) != 1 else ''}"))
                kids.extend(self._rows[r].box for r in rs)
            old = self.body.children
            self.body.children = tuple(kids)
            for w in old:
                if not isinstance(w, widgets.HBox):
                    w.close()
        figs = {}
        for r in self.ranks:
            f = snap.get(r)
            if f is None:
                continue
            self._rows[r].update(f, self._spark(r, now))
            gpu_util, gpu_mem = gpu_texts(f["gpu"]) if f["alive"] else ("", "")
            figs[str(r)] = {
                "state": f["state"], "dead": f["dead"], "host": f["host"], "pid": f["pid"],
                "cpu": f["cpu"], "rss": f["rss"], "uss": f["uss"], "threads": f["threads"],
                "gpu_util": (f["gpu"] or {}).get("util") if f["alive"] else None,
                "gpu_mem": (f["gpu"] or {}).get("mem_used") if f["alive"] else None,
                "gpu_text": [gpu_util, gpu_mem], "msgs": f["msgs"],
            }
        self.figures = {"mode": "rows", "ranks": figs}

    def _refresh_heat(self, snap: dict[int, dict[str, Any]]) -> None:
        rows, cols, rlabel, clabel = grid_shape(self.dims)
        order = [snap.get(r) for r in self.ranks]
        dead = [bool(f and f["dead"]) for f in order]
        cpu = [min(f["cpu"] / 100, 1.0) if f and f["alive"] else None for f in order]
        top = max((f["rss"] or 0 for f in order if f and f["alive"]), default=0) or 1
        mem = [(f["rss"] or 0) / top if f and f["alive"] else None for f in order]
        maps = [heatmap_svg(cpu, dead, rows, cols, "cpu", "CPU (% of a core, 100 = full)"),
                heatmap_svg(mem, dead, rows, cols, "mem",
                            f"memory (RSS; full = the largest, {fmt_bytes(top)})")]
        if any(f and f["gpu"] for f in order):
            gpu = [float(f["gpu"]["util"]) / 100 if f and f["alive"] and f["gpu"] else None
                   for f in order]
            maps.append(heatmap_svg(gpu, dead, rows, cols, "gpu", "GPU utilization"))
        self.heat.value = (f'<div style="font-size:11px;color:#616161">rows: {html.escape(rlabel)}'
                           f", columns: {html.escape(clabel)}; black: dead, grey: no figures"
                           f"</div>{''.join(maps)}")
        states = collections.Counter(f["state"].split(" (")[0] for f in snap.values())
        live = {r: f for r, f in snap.items() if f["alive"]}
        hot = sorted(live, key=lambda r: -(live[r]["cpu"] or 0))[:5]
        dead_ranks = [r for r, f in snap.items() if f["dead"]]
        mean = sum(f["cpu"] or 0 for f in live.values()) / len(live) if live else None
        self.summary.value = (
            '<div style="font-size:12px">' + ", ".join(
                f"{n} {html.escape(s)}" for s, n in sorted(states.items()))
            + (f' &middot; <span style="color:#b71c1c">dead: {compact_ranks(dead_ranks)}</span>'
               if dead_ranks else "")
            + (f" &middot; cpu mean {fmt_pct(mean)}, busiest: " + ", ".join(
                f"r{r} {fmt_pct(live[r]['cpu'])}" for r in hot) if live else "") + "</div>")
        self.figures = {
            "mode": "heatmap", "n": len(self.ranks), "states": dict(states),
            "dead": dead_ranks, "cpu_mean": mean,
            "cpu_max": max((f["cpu"] or 0 for f in live.values()), default=None),
            "hot": [[r, live[r]["cpu"]] for r in hot],
        }

    def __repr__(self) -> str:
        return (f"<Dashboard of mesh {self.dims}: {len(self.ranks)} ranks, {self.mode}, "
                f"{'live' if self.running else 'stopped'}>")
