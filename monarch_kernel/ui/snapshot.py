"""The dashboard's state as plain data, and that data drawn as HTML or text.

No widgets and no I/O here: :func:`collect` turns what the controller knows
(ranks, telemetry, recent requests) into a JSON-ready dict, and
:func:`render_html` / :func:`render_text` draw such a dict. The live widget
(:mod:`monarch_kernel.ui.dashboard`) shows ``render_html`` of a fresh dict every
interval; the same HTML is what a saved, converted or re-opened notebook keeps
once the widget's model is gone, and any other view (a sidebar) may draw the
dict its own way.

The snapshot dict (``version`` 1)
---------------------------------
``shape``      the mesh's shape for people: ``"1 host x 4 procs"``
``dims``       the shape as a dict (``{"hosts": 1, "procs": 4}``)
``status``     ``"live"``, ``"stopped"`` (the mesh stopped), ``"closed"``, or
               ``"snapshot"`` (a copy taken while live, kept in the output)
``taken_at``   seconds since the epoch when it was taken
``has_gpu``    True when some rank reports a GPU (GPU columns are shown first)
``mode``       ``"rows"`` (a row per rank) or ``"heatmap"`` (many ranks)
``ranks``      one dict per rank, in rank order: ``rank``, ``host``, ``pid``,
               ``state`` (text), ``dead``, ``alive``, ``last`` (the figures are the
               last seen before the mesh stopped), ``cpu`` (% of one core),
               ``rss`` (bytes), ``mem_limit`` (bytes) and ``mem_limit_kind``
               (``"cgroup"``: the rank's cgroup limit; ``"largest"``: the
               largest rank's memory), ``gpu_util`` (%), ``gpu_mem`` and
               ``gpu_mem_total`` (bytes of the rank's device), ``threads``,
               ``history`` (``[age s, cpu %, rss bytes]``, oldest first);
               figures are None where unknown
``totals``     ``ranks``, ``reporting``, ``dead`` (rank list), ``cpu`` (sum),
               ``rss`` (sum), ``mem_limit`` (sum of cgroup limits or None),
               ``gpu_util`` (mean), ``gpu_mem``, ``gpu_mem_total`` (sums)
``timeline``   the recent cells and endpoint calls, oldest first: ``label``,
               ``ago`` (seconds since it was sent), ``ranks``
               (``{rank: seconds to its reply, or None: no reply yet}``),
               ``running`` (some rank has not replied), ``slowest`` (rank or
               None) and ``straggler`` (True when the slowest rank took at
               least 1.5 times the median and 0.1 s longer)

Colours come from JupyterLab's theme variables (``--jp-ui-font-color1``,
``--jp-layout-color0``, ``--jp-error-color1``, ``--jp-border-color2``, ...),
each with a light fallback for pages without them, so the light and the dark
theme both read well.
"""

from __future__ import annotations

import html
import statistics
import time
from collections.abc import Iterable, Mapping
from typing import Any

from monarch_kernel.errors import compact_ranks
from monarch_kernel.ui.status import fmt_bytes, fmt_pct, human_shape, plural, state_text

__all__ = [
    "SNAPSHOT_VERSION",
    "collect",
    "human_shape",
    "render_html",
    "render_text",
    "timeline",
]

SNAPSHOT_VERSION = 1
#: cells and endpoint calls the timeline shows
TIMELINE_LEN = 8
#: history points kept per rank in a snapshot
HISTORY_POINTS = 60

# theme variables, with the light theme's values for pages without JupyterLab's CSS
FG = "var(--jp-ui-font-color1, rgba(0,0,0,.87))"
FG2 = "var(--jp-ui-font-color2, rgba(0,0,0,.54))"
BG = "var(--jp-layout-color0, #fff)"
BG2 = "var(--jp-layout-color2, #eee)"
BORDER = "var(--jp-border-color2, #e0e0e0)"
ERROR = "var(--jp-error-color1, #d32f2f)"
BAR_CPU = "var(--jp-brand-color1, #1976d2)"
BAR_MEM = "var(--jp-warn-color1, #f57c00)"
BAR_GPU = "var(--jp-success-color1, #388e3c)"
BAR_SLOW = "var(--jp-error-color1, #d32f2f)"
STATE_COLORS = {"idle": "var(--jp-success-color1, #388e3c)",
                "running": "var(--jp-brand-color1, #1976d2)",
                "paused": "var(--jp-warn-color1, #f57c00)",
                "dead": ERROR}


# -------------------------------------------------------------- collecting
def timeline(requests: Iterable[Any], now: float, length: int = TIMELINE_LEN
             ) -> list[dict[str, Any]]:
    """The timeline entries (see the module docstring) of ``requests``.

    Parameters
    ----------
    requests : iterable of Request
        Oldest first; each with ``label``, ``ranks``, ``sent_at``,
        ``reply_at`` (rank -> monotonic time) and ``done()``.
    now : float
        ``time.monotonic()`` now.
    length : int
        Entries kept (the newest).
    """
    out = []
    for req in list(requests)[-length:]:
        times: dict[str, float | None] = {}
        for r in req.ranks:
            t = req.reply_at.get(r)
            times[str(r)] = None if t is None else round(max(0.0, t - req.sent_at), 4)
        got = [(v, int(r)) for r, v in times.items() if v is not None]
        running = any(v is None for v in times.values()) and not req.done()
        slowest: int | None = None
        straggler = False
        if running:  # the slowest is one still running
            slowest = next(int(r) for r, v in times.items() if v is None)
            if got:
                straggler = now - req.sent_at >= max(
                    1.5 * statistics.median(v for v, _ in got), 0.1 + max(v for v, _ in got))
        elif got:
            top, slowest = max(got)
            if len(got) > 1:
                med = statistics.median(v for v, _ in got)
                straggler = top >= 1.5 * med and top - med >= 0.1
        out.append({"label": req.label, "ago": round(now - req.sent_at, 3), "ranks": times,
                    "running": running, "slowest": slowest, "straggler": straggler})
    return out


def _history(points: Iterable[tuple[float, float, float]], now: float, span: float
             ) -> list[list[float]]:
    pts = [(now - t, c, m) for t, c, m in points if now - t <= span]
    if len(pts) > HISTORY_POINTS:
        step = len(pts) / HISTORY_POINTS
        pts = [pts[int(i * step)] for i in range(HISTORY_POINTS - 1)] + [pts[-1]]
    return [[round(a, 2), round(c, 2), float(m)] for a, c, m in pts]


def collect(dims: Mapping[str, int], ranks: Iterable[int], infos: Mapping[int, Any],
            recent: Iterable[Any] = (), status: str = "live", *, mode: str = "rows",
            history: Mapping[int, Iterable[tuple[float, float, float]]] | None = None,
            span: float = 60.0, now: float | None = None, wall: float | None = None,
            interval: float = 1.0) -> dict[str, Any]:
    """The dashboard's state as a plain, JSON-ready dict (see the module docstring).

    Parameters
    ----------
    dims : mapping of str to int
        The mesh's shape.
    ranks : iterable of int
        The ranks shown, in order.
    infos : mapping of int to RankInfo
        What the controller knows of each rank (``host``, ``pid``, ``state``,
        ``exitcode``, ``telemetry``); ranks missing here are left out.
    recent : iterable of Request
        The recent labelled requests (``Controller.recent``), oldest first.
    status : {"live", "stopped", "closed"}
        ``"stopped"`` shows every rank that exited cleanly as stopped.
    mode : {"rows", "heatmap"}
    history : mapping of int to iterable of (monotonic time, cpu, rss), optional
        Recent samples per rank, oldest first (the sparklines).
    span : float
        Seconds of history kept.
    now, wall : float, optional
        ``time.monotonic()`` and ``time.time()`` (default: now).
    interval : float
        Seconds between live refreshes (shown while live).
    """
    now = time.monotonic() if now is None else now
    wall = time.time() if wall is None else wall
    rows = []
    for r in ranks:
        info = infos.get(r)
        if info is None:
            continue
        tel = info.telemetry or {}
        state = info.state
        if status == "stopped" and (state != "dead" or info.exitcode == 0):
            state = "stopped"
        alive = "cpu" in tel and state not in ("dead", "stopped", "starting")
        # a mesh stopped (or a dashboard closed) keeps each rank's last figures, not dashes
        shown = alive or ("cpu" in tel and state == "stopped" and status != "live")
        gpu = tel.get("gpu") if shown else None
        rows.append({
            "rank": r, "host": info.host or "", "pid": info.pid,
            "state": state_text(state, tel.get("activity"), info.exitcode),
            "dead": state == "dead", "alive": alive,
            "cpu": tel.get("cpu") if shown else None,
            "rss": tel.get("rss") if shown else None,
            "mem_limit": tel.get("mem_limit"),
            "mem_limit_kind": "cgroup" if tel.get("mem_limit") else "largest",
            "threads": tel.get("threads") if shown else None,
            "last": shown and not alive,
            "gpu_util": (gpu or {}).get("util"),
            "gpu_mem": (gpu or {}).get("mem_used"),
            "gpu_mem_total": (gpu or {}).get("mem_total"),
            "gpu_index": (gpu or {}).get("index"),
            "history": (_history((history or {}).get(r, ()), now, span)
                        if mode == "rows" else []),  # (a heat map draws none)
        })
    live = [f for f in rows if f["alive"] or f["last"]]
    largest = max((f["rss"] or 0 for f in live), default=0)
    for f in rows:
        if not f["mem_limit"]:
            f["mem_limit"] = largest or None
    has_gpu = any(f["gpu_util"] is not None or f["gpu_mem"] is not None for f in rows)
    cgroup = [f["mem_limit"] for f in live if f["mem_limit_kind"] == "cgroup"]
    gpus = [f for f in live if f["gpu_util"] is not None]
    totals = {
        "ranks": len(rows), "reporting": sum(1 for f in rows if f["alive"]),
        "dead": [f["rank"] for f in rows if f["dead"]],
        "cpu": round(sum(f["cpu"] or 0 for f in live), 2) if live else None,
        "rss": sum(f["rss"] or 0 for f in live) if live else None,
        "mem_limit": sum(cgroup) if cgroup and len(cgroup) == len(live) else None,
        "gpu_util": (round(sum(f["gpu_util"] for f in gpus) / len(gpus), 1)
                     if gpus else None),
        "gpu_mem": sum(f["gpu_mem"] or 0 for f in gpus) if gpus else None,
        "gpu_mem_total": sum(f["gpu_mem_total"] or 0 for f in gpus) if gpus else None,
    }
    return {
        "version": SNAPSHOT_VERSION, "shape": human_shape(dims), "dims": dict(dims),
        "status": status, "taken_at": round(wall, 3), "interval": interval, "span": span,
        "has_gpu": has_gpu, "mode": mode, "ranks": rows, "totals": totals,
        "timeline": timeline(recent, now),
    }


# ----------------------------------------------------------------- drawing
def _esc(x: Any) -> str:
    return html.escape(str(x))


def _bar(frac: float | None, color: str, text: str, cls: str, title: str = "") -> str:
    """A bar (``frac`` of its width filled) and its figure, as a table cell."""
    w = 0.0 if frac is None else max(0.0, min(1.0, frac)) * 100
    tip = f' title="{_esc(title)}"' if title else ""
    return (f'<td class="{cls}"{tip} style="padding:1px 6px;text-align:left;white-space:nowrap">'
            f'<span style="display:inline-block;vertical-align:middle;width:70px;height:8px;'
            f'background:{BG2};border-radius:2px;overflow:hidden;margin-right:6px">'
            f'<span style="display:block;height:100%;width:{w:.1f}%;background:{color}">'
            f'</span></span><span class="mk-fig">{_esc(text)}</span></td>')


def sparkline(points: list[list[float]], span: float, width: int = 110, height: int = 22
              ) -> str:
    """An inline SVG of CPU (brand colour) and memory (warn colour) over ``span`` s."""
    lines = []
    for idx, color, floor in ((1, BAR_CPU, 100.0), (2, BAR_MEM, 0.0)):
        if len(points) < 2:
            continue
        top = max(floor, max(p[idx] for p in points) * (1.1 if idx == 2 else 1.0)) or 1.0
        pts = " ".join(
            f"{width - min(p[0], span) / span * width:.1f},"
            f"{height - 1 - min(max(p[idx] / top, 0.0), 1.0) * (height - 2):.1f}"
            for p in points)
        lines.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.3" '
                     f'points="{pts}"/>')
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'style="background:{BG2};border-radius:2px;vertical-align:middle">'
            f'{"".join(lines)}</svg>')


def _state_cell(f: dict[str, Any]) -> str:
    key = f["state"].split(" ")[0]
    color = STATE_COLORS.get(key, STATE_COLORS["running"] if key.startswith("running")
                             else FG2)
    text_color = ERROR if f["dead"] else FG
    return (f'<td class="mk-state" title="{_esc(f["state"])}" '
            f'style="padding:1px 6px;text-align:left;white-space:nowrap;color:{text_color};'
            f'border-left:4px solid {color}">'
            f'{_esc(f["state"][:32])}</td>')


def _mem_text(used: float | None, limit: float | None) -> str:
    if used is None:
        return "-"
    return f"{fmt_bytes(used)} / {fmt_bytes(limit)}" if limit else fmt_bytes(used)


def _rows_html(snap: dict[str, Any]) -> str:
    gpu = snap["has_gpu"]
    th = f'style="text-align:left;padding:1px 6px;text-align:left;color:{FG2};font-weight:normal"'
    heads = ["rank", "state"] + (["gpu util", "gpu memory"] if gpu else []) + [
        "cpu", "memory", "history"]
    out = ['<table class="mk-table" style="border-collapse:collapse;font-size:12px">',
           "<thead><tr>" + "".join(f"<th {th}>{h}</th>" for h in heads) + "</tr></thead>",
           "<tbody>"]
    host = None
    ncols = len(heads)
    for f in snap["ranks"]:
        if f["host"] != host:
            host = f["host"]
            n = sum(1 for g in snap["ranks"] if g["host"] == host)
            out.append(f'<tr class="mk-host"><td colspan="{ncols}" '
                       f'style="padding:4px 6px 1px;text-align:left;color:{FG}">'
                       f'<b>{_esc(host or "(starting)")}</b> &middot; '
                       f'{plural(n, "ranks")}</td></tr>')
        cls = f"mk-row mk-r{f['rank']}" + (" mk-dead" if f["dead"] else "")
        cells = [f'<td style="padding:1px 6px;text-align:left"><b>r{f["rank"]}</b></td>',
                 _state_cell(f)]
        if gpu:
            util = f["gpu_util"]
            idx = f"#{f['gpu_index']} " if f.get("gpu_index") is not None else ""
            cells.append(_bar(None if util is None else util / 100, BAR_GPU,
                              (idx + fmt_pct(util)) if util is not None else "-", "mk-gpu"))
            tot = f["gpu_mem_total"]
            cells.append(_bar(f["gpu_mem"] / tot if f["gpu_mem"] is not None and tot else None,
                              BAR_GPU, _mem_text(f["gpu_mem"], tot), "mk-gpumem",
                              "against the device's memory"))
        cpu = f["cpu"]
        cells.append(_bar(None if cpu is None else min(cpu, 100.0) / 100, BAR_CPU,
                          fmt_pct(cpu) if cpu is not None else "-", "mk-cpu",
                          "% of one core"))
        lim = f["mem_limit"]
        cells.append(_bar(f["rss"] / lim if f["rss"] is not None and lim else None, BAR_MEM,
                          _mem_text(f["rss"], lim), "mk-mem",
                          "RSS against the rank's cgroup limit" if f["mem_limit_kind"] ==
                          "cgroup" else "RSS against the largest rank's"))
        cells.append(f'<td class="mk-spark" style="padding:1px 6px;text-align:left">'
                     f'{sparkline(f["history"], snap["span"])}</td>')
        out.append(f'<tr class="{cls}" style="border-top:1px solid {BORDER}">'
                   + "".join(cells) + "</tr>")
    t = snap["totals"]
    last = snap["status"] != "live" and not t["reporting"] and t["cpu"] is not None
    cells = ['<td style="padding:2px 6px;text-align:left"><b>total</b></td>',
             f'<td style="padding:2px 6px;text-align:left;color:{FG}">'
             + ("last figures" if last else f'{t["reporting"]} of {t["ranks"]} reporting')
             + "</td>"]
    if gpu:
        cells.append(f'<td class="mk-gpu" style="padding:2px 6px;text-align:left">mean '
                     f'{fmt_pct(t["gpu_util"]) or "-"}</td>')
        cells.append(f'<td class="mk-gpumem" style="padding:2px 6px;text-align:left">'
                     f'{_mem_text(t["gpu_mem"], t["gpu_mem_total"])}</td>')
    cells.append(f'<td class="mk-cpu" style="padding:2px 6px;text-align:left">'
                 f'{fmt_pct(t["cpu"]) or "-"}</td>')
    cells.append(f'<td class="mk-mem" style="padding:2px 6px;text-align:left">'
                 f'{_mem_text(t["rss"], t["mem_limit"])}</td><td></td>')
    out.append(f'<tr class="mk-total" style="border-top:2px solid {BORDER};color:{FG}">'
               + "".join(cells) + "</tr></tbody></table>")
    return "".join(out)


def _heat_html(snap: dict[str, Any]) -> str:
    rows = snap["ranks"]
    states: dict[str, int] = {}
    for f in rows:
        k = f["state"].split(" (")[0]
        states[k] = states.get(k, 0) + 1
    live = [f for f in rows if f["alive"]]
    hot = sorted(live, key=lambda f: -(f["cpu"] or 0))[:5]
    cells = []
    for f in rows:
        v = None if not f["alive"] else min((f["cpu"] or 0) / 100, 1.0)
        color = ERROR if f["dead"] else (BG2 if v is None else BAR_CPU)
        op = 1.0 if v is None else 0.15 + 0.85 * v
        cells.append(f'<span class="mk-cell mk-r{f["rank"]}" title="r{f["rank"]}: '
                     f'{_esc(f["state"])} {fmt_pct(f["cpu"])}" style="display:inline-block;'
                     f'width:10px;height:10px;margin:1px;background:{color};opacity:{op:.2f}">'
                     f"</span>")
    return (f'<div style="color:{FG}">' + ", ".join(
        f"{n} {_esc(s)}" for s, n in sorted(states.items()))
        + (" &middot; busiest: " + ", ".join(f"r{f['rank']} {fmt_pct(f['cpu'])}" for f in hot)
           if hot else "") + "</div>"
        + f'<div style="max-width:640px;line-height:0">{"".join(cells)}</div>')


def _timeline_html(snap: dict[str, Any]) -> str:
    tl = snap["timeline"]
    if not tl:
        return (f'<div class="mk-timeline" style="color:{FG2};margin-top:6px">timeline: no '
                f"cell or endpoint call yet</div>")
    ranks = [f["rank"] for f in snap["ranks"]]
    th = f'style="padding:1px 6px;text-align:left;color:{FG2};font-weight:normal;text-align:left"'
    out = [f'<div class="mk-timeline" style="margin-top:6px"><div style="color:{FG2}">'
           f"recent cells and endpoint calls: time each rank took (full bar: the slowest; "
           f"<b style=\"color:{FG}\">slow</b>: a straggler)</div>"
           f'<table style="border-collapse:collapse;font-size:11px"><thead><tr><th {th}>rank'
           f"</th>"]
    for e in tl:
        out.append(f'<th {th} title="{e["ago"]:.0f} s ago">{_esc(e["label"])}</th>')
    out.append("</tr></thead><tbody>")
    for r in ranks:
        row = [f'<td style="padding:1px 6px;text-align:left;color:{FG}">r{r}</td>']
        for e in tl:
            if str(r) not in e["ranks"]:
                row.append("<td></td>")
                continue
            v = e["ranks"][str(r)]
            vals = [x for x in e["ranks"].values() if x is not None]
            top = max(vals + ([e["ago"]] if e["running"] else []), default=0) or 1.0
            slow = e["straggler"] and e["slowest"] == r
            if v is None:
                text, frac = ("running" if e["running"] else "no reply"), (
                    e["ago"] / top if e["running"] else 0)
            else:
                text, frac = f"{v:.2f} s" if v < 10 else f"{v:.0f} s", v / top
            color = BAR_SLOW if slow else BAR_CPU
            cls = "mk-tl" + (" mk-slow" if slow else "")
            row.append(
                f'<td class="{cls}" data-rank="{r}" style="padding:1px 6px;text-align:left;'
                f'white-space:nowrap;color:{FG}">'
                f'<span style="display:inline-block;vertical-align:middle;'
                f'width:40px;height:6px;background:{BG2};margin-right:4px">'
                f'<span style="display:block;height:100%;width:{min(frac, 1) * 100:.0f}%;'
                f'background:{color}"></span></span>{_esc(text)}'
                + (" <b>slow</b>" if slow else "") + "</td>")
        out.append("<tr>" + "".join(row) + "</tr>")
    out.append("</tbody></table></div>")
    return "".join(out)


def _status_words(snap: dict[str, Any]) -> str:
    at = time.strftime("%H:%M:%S", time.localtime(snap["taken_at"]))
    if snap["status"] == "live":
        return f"live, every {snap['interval']:g} s, {at}"
    if snap["status"] == "stopped":
        return f"mesh stopped; last state at {at}"
    if snap["status"] == "snapshot":
        return f"last state seen at {at} (the dashboard was live then)"
    return f"closed; last state at {at}"


def render_html(snap: dict[str, Any]) -> str:
    """The whole dashboard of snapshot ``snap`` as one self-contained HTML fragment.

    Inline styles only (no script, no external CSS), with JupyterLab's theme
    variables: it reads the same in the live widget, a re-opened notebook,
    nbconvert's HTML and other renderers of ``text/html``.
    """
    t = snap["totals"]
    dead = t["dead"]
    head = (f'<div class="mk-header" style="margin-bottom:4px"><b>mesh</b> '
            f'<span class="mk-shape">{_esc(snap["shape"])}</span> &middot; '
            f'{plural(t["ranks"], "ranks")}, {t["reporting"]} reporting'
            + (f' &middot; <span class="mk-dead-ranks" style="color:{ERROR};font-weight:bold">'
               f"dead: {compact_ranks(dead)}</span>" if dead else "")
            + f' &middot; <span class="mk-status">{_esc(_status_words(snap))}</span>'
            + (f' &middot; <span style="color:{FG2}">history: cpu and memory over the last '
               f'{snap["span"]:.0f} s</span>' if snap["mode"] == "rows" else "") + "</div>")
    body = _rows_html(snap) if snap["mode"] == "rows" else _heat_html(snap)
    return (f'<div class="monarch-dashboard-view" data-status="{_esc(snap["status"])}" '
            f'style="font-family:var(--jp-ui-font-family, sans-serif);font-size:12px;'
            f'color:{FG};background:{BG};padding:6px;border:1px solid {BORDER};'
            f'border-radius:3px;display:inline-block">'
            f"{head}{body}{_timeline_html(snap)}</div>")


def render_text(snap: dict[str, Any]) -> str:
    """A few lines of plain text for frontends without HTML (no widget words)."""
    t = snap["totals"]
    at = time.strftime("%H:%M:%S", time.localtime(snap["taken_at"]))
    head = {"live": f"as of {at}", "stopped": f"mesh stopped; last state at {at}",
            "closed": f"closed; last state at {at}"}.get(snap["status"], at)
    lines = [f"Dashboard of mesh {snap['shape']} ({head}): {plural(t['ranks'], 'ranks')}, "
             f"{t['reporting']} reporting"
             + (f", dead: {compact_ranks(t['dead'])}" if t["dead"] else "")]
    if t["cpu"] is not None:
        lines.append(f"  total cpu {fmt_pct(t['cpu'])}, memory "
                     f"{_mem_text(t['rss'], t['mem_limit'])}"
                     + (f", gpu memory {_mem_text(t['gpu_mem'], t['gpu_mem_total'])}"
                        if t["gpu_mem"] is not None else ""))
    slow = [e for e in snap["timeline"] if e["straggler"]]
    if slow:
        e = slow[-1]
        lines.append(f"  straggler: r{e['slowest']} in {e['label']}")
    return "\n".join(lines)
