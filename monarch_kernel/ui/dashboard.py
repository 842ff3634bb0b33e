"""``%mesh dashboard``: a live ipywidgets view of every rank's resources.

What it shows (drawn by :func:`monarch_kernel.ui.snapshot.render_html`)
-------------------------------------------------------------------------
A header with the mesh's shape as people write it (``1 host x 4 procs``),
the ranks reporting, dead ranks and whether it is live; then

rows (up to ``max_rows`` = 32 ranks)
    A row per rank, grouped by host: state, GPU utilization and GPU memory
    (against the device's memory; first, and only where some rank has a
    GPU), CPU %, memory (RSS against the rank's cgroup memory limit, else the
    largest rank's RSS) and a sparkline of CPU and memory over the last
    ``history`` seconds; a totals row under them.
heatmap (more ranks)
    A summary (ranks per state, the busiest ranks) and a cell per rank.

and a timeline of the recent cells and endpoint calls: how long each rank
took to reply to each (``Controller.recent``), the straggler marked.

How it stays live
-----------------
Workers send telemetry about once a second (:mod:`monarch_kernel.worker.telemetry`).
The dashboard registers a listener on the mesh's controller: the listener
(run in the controller's I/O thread) only records each sample in a short
history and wakes the dashboard's own thread when a rank dies. That thread
(``monarch-dashboard-N``) redraws every ``interval`` seconds by setting the
``HTML`` widget's value; ipywidgets sends that as a comm message on the
kernel's IOPub channel, which works while the kernel's main thread runs
other cells (ipykernel >= 6). No extra port, no timer on the kernel's loop.

Outputs that survive
--------------------
A widget's output holds only a model id; once the kernel is gone, JupyterLab
shows "Error displaying widget: model not found" and nbconvert skips it. So
the dashboard is displayed with a display id and a bundle of the widget view
(also under ``application/vnd.monarch.dashboard+json``, which the monarch
JupyterLab extension renders as the live widget while its model exists and
as the ``text/html`` otherwise) plus ``text/html`` (its last drawing) and
``text/plain`` (a summary). Every
``snapshot_every`` seconds while live the bundle is sent again
(``update_display_data``) so a notebook saved meanwhile keeps recent figures
(nbconvert, GitHub and other renderers without the model use ``text/html``).
When the mesh stops, the kernel shuts down or the dashboard is closed,
:meth:`Dashboard.freeze` replaces the output with the static HTML alone: a
re-opened or converted notebook shows the last state and says how it ended.

The thread ends, and the listener is removed, when the widget is closed
(:meth:`Dashboard.close`, or the frontend closing its comm), when the mesh
is stopped, and with the kernel process. Any number of dashboards can run
at once.

Reading it from the frontend side
---------------------------------
The :class:`Dashboard` model carries a synced ``figures`` dict: the plain-data
snapshot (:func:`monarch_kernel.ui.snapshot.collect`), so tests and other
views can read the numbers from the comm messages alone. In the HTML every
rank row has the classes ``mk-row mk-rN`` and its cells ``mk-state``,
``mk-gpu``, ``mk-gpumem``, ``mk-cpu``, ``mk-mem``.
"""

from __future__ import annotations

import collections
import html
import itertools
import math
import threading
import time
import uuid
import weakref
from typing import Any

import ipywidgets as widgets
from traitlets import Dict

from monarch_kernel.ui.snapshot import collect, human_shape, render_html, render_text
from monarch_kernel.util.numbers import check_number

__all__ = ["Dashboard", "freeze_all", "grid_shape", "heatmap_svg", "sparkline_svg"]

MAX_ROWS = 32
#: seconds between refreshes of the static copy in the output while live
SNAPSHOT_EVERY = 30.0
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
#: the same view under the monarch extension's MIME type: JupyterLab with the extension
#: renders it (the live widget while its model exists, else the bundle's text/html)
DASHBOARD_MIME = "application/vnd.monarch.dashboard+json"
_counter = itertools.count(1)



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
            f'style="background:var(--jp-layout-color2, #eee);border-radius:2px">'
            f'{tip}{"".join(lines)}</svg>')


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
    snapshot_every : float
        Seconds between refreshes of the static copy kept in the notebook's
        output (``text/html`` next to the widget view) while live.

    Raises
    ------
    ValueError
        For an ``interval``, ``history`` or ``snapshot_every`` that is not a
        positive, finite number of seconds, or an unknown ``layout``.
    """

    #: the plain-data snapshot shown (:func:`monarch_kernel.ui.snapshot.collect`), less
    #: each rank's ``history`` (drawn in the HTML)
    figures = Dict().tag(sync=True)

    def __init__(self, mesh: Any, interval: float = 1.0, history: float = 60.0,
                 layout: str = "auto", max_rows: int = MAX_ROWS,
                 snapshot_every: float = SNAPSHOT_EVERY) -> None:
        check_number(interval, "dashboard interval", above=True, seconds=True)
        check_number(history, "dashboard history", above=True, seconds=True)
        check_number(snapshot_every, "dashboard snapshot interval", above=True, seconds=True)
        if layout not in ("auto", "rows", "heatmap"):
            raise ValueError(f"dashboard layout {layout!r} is unknown; use auto, rows or heatmap")
        super().__init__(layout=widgets.Layout(padding="4px"))
        self.mesh = mesh
        self.controller = mesh.controller
        self.ranks: list[int] = list(mesh.ranks)
        self.dims: dict[str, int] = dict(mesh.shape.dims)
        self.interval = float(interval)
        self.history = float(history)
        self.snapshot_every = float(snapshot_every)
        self.mode = layout if layout != "auto" else (
            "rows" if len(self.ranks) <= max_rows else "heatmap")
        self._history: dict[int, collections.deque[tuple[float, float, float]]] = {
            r: collections.deque(maxlen=2000) for r in self.ranks}
        self._seen = set(self.ranks)
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._closed = False
        self._frozen = False
        self.display_id = f"monarch-dashboard-{uuid.uuid4().hex}"
        self._shown = False  # displayed with our display id at least once
        self._snap_at = 0.0  # monotonic time the output's static copy was last refreshed
        self.snap: dict[str, Any] = {}
        self.html = ""
        self.add_class("monarch-dashboard")
        self.view = widgets.HTML()
        self.children = (self.view,)
        self._seed_history()
        self.refresh()
        self.controller.listeners.append(self._listen)
        _live.add(self)
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
        # runs in the controller's I/O thread (or the one stopping the mesh)
        if rank not in self._seen:
            return
        if kind == "state" and isinstance(payload, dict) and "cpu" in payload:
            rss = payload.get("rss") or 0
            self._history[rank].append((time.monotonic(), float(payload["cpu"]), float(rss)))
        elif kind in ("dead", "hello"):
            self._wake.set()
            if kind == "dead" and self._mesh_stopped() and self._all_down():
                # the mesh is being stopped (also at kernel shutdown): keep the last
                # state in the output now, in this thread, before the kernel may exit
                self.freeze()

    def _all_down(self) -> bool:
        infos = self.controller.ranks
        return all(getattr(infos.get(r), "state", "dead") in ("dead", "stopped")
                   for r in self.ranks)

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
                if self._mesh_stopped():
                    self.freeze()
                    break
                self.refresh()
                if self._shown and time.monotonic() - self._snap_at >= self.snapshot_every:
                    self._publish()
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

    def freeze(self) -> None:
        """Take the last state and put it in the output for good: every display of
        this dashboard is replaced by its static HTML (no widget), so a saved,
        re-opened or converted notebook shows the figures. Idempotent."""
        with self._lock:
            if self._frozen:
                return
            self._frozen = True
            self._stop.set()
            self._wake.set()
            self._detach()
            self.refresh(force=True)
            if self._shown:
                self._publish(static=True)
        _live.discard(self)

    def close(self) -> None:
        """Stop the refresh thread and close this widget (its output keeps the last
        state as static HTML)."""
        if not hasattr(self, "thread"):  # __init__ failed part way (bad arguments)
            super().close()
            return
        self.stop()
        if not self._frozen and self._shown and not self._closed:
            self._status = "closed"
            self.freeze()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            _live.discard(self)
            self.view.close()
            super().close()

    def _comm_closed(self, msg: Any) -> None:
        self.close()  # the frontend closed the model

    def open(self) -> None:
        super().open()
        if self.comm is not None:
            self.comm.on_close(self._comm_closed)

    # ------------------------------------------------------------ display
    def _bundle(self, static: bool = False) -> dict[str, Any]:
        # (while live, the copy kept in the output says when it was taken, not "live")
        html_text = self.html if static or not self.snap else render_html(
            dict(self.snap, status="snapshot"))
        data: dict[str, Any] = {"text/html": html_text, "text/plain": render_text(self.snap)}
        if not static and self.model_id:
            view = {"version_major": 2, "version_minor": 0, "model_id": self.model_id}
            data[WIDGET_VIEW] = view
            data[DASHBOARD_MIME] = dict(view)
        return data

    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any]:
        return self._bundle(static=self._frozen)

    def _ipython_display_(self) -> None:
        from IPython.display import display

        self._shown = True
        self._snap_at = time.monotonic()
        display(self._bundle(static=self._frozen), raw=True,
                metadata={WIDGET_VIEW: {}, "monarch": {"dashboard": True}} if not self._frozen
                else {"monarch": {"dashboard": True}},
                display_id=self.display_id)

    def _publish(self, static: bool = False) -> None:
        """Replace every display of this dashboard (``update_display_data``)."""
        from IPython.display import update_display

        self._snap_at = time.monotonic()
        try:
            update_display(self._bundle(static=static), raw=True, display_id=self.display_id,
                           metadata={"monarch": {"dashboard": True}})
        except Exception:  # noqa: BLE001 - no kernel (plain Python): nothing to update
            import logging

            logging.getLogger("monarch_kernel.ui").debug("no display to update", exc_info=True)

    # -------------------------------------------------------------- figures
    def snapshot(self) -> dict[str, Any]:
        """The dashboard's state now, as plain data (see :mod:`monarch_kernel.ui.snapshot`)."""
        status = "stopped" if self._mesh_stopped() else getattr(self, "_status", "live")
        now = time.monotonic()
        recent = [q for q in list(getattr(self.controller, "recent", ()))
                  if set(q.ranks) & self._seen]
        return collect(self.dims, self.ranks, dict(self.controller.ranks), recent, status,
                       mode=self.mode, history=self._history, span=self.history, now=now,
                       interval=self.interval)

    def refresh(self, force: bool = False) -> None:
        """Redraw from the controller's latest figures (the thread calls this)."""
        with self._lock:
            if self._closed or (self._frozen and not force):
                return
            self.snap = self.snapshot()
            self.html = render_html(self.snap)
            self.view.value = self.html
            # (the sparklines' points stay out of the synced figures: the HTML has them)
            self.figures = dict(self.snap, ranks=[
                {k: v for k, v in f.items() if k != "history"} for f in self.snap["ranks"]])

    def __repr__(self) -> str:
        t = self.snap.get("totals", {})
        state = "live" if self.running and not self._frozen else "last state"
        return (f"<Dashboard of mesh {human_shape(self.dims)}: {t.get('ranks', 0)} ranks, "
                f"{self.mode}, {state}>")


#: dashboards not yet frozen (freeze_all keeps their last state at kernel shutdown)
_live: weakref.WeakSet[Dashboard] = weakref.WeakSet()


def freeze_all() -> int:
    """Freeze every live dashboard (see :meth:`Dashboard.freeze`); returns how many."""
    n = 0
    for d in list(_live):
        d.freeze()
        n += 1
    return n
