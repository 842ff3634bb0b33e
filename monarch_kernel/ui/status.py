"""``%mesh status``: one row per rank, as HTML in a notebook and as a ``rich``
table in a terminal frontend (``jupyter console`` shows ``text/plain``).

Columns: rank, host, (job), pid, state (what the rank is doing: idle,
running cell, running endpoint NAME, paused, or dead with how it died), cpu
(% of one core over the last telemetry interval), rss and uss (memory),
threads, gpu (utilization %) and gpu mem (device memory used / total, and
what torch holds), msgs (messages in / out at the controller). GPU columns
say "no GPU" where the rank's host has none. The figures come from each
worker's telemetry (:mod:`monarch_kernel.worker.telemetry`); the helpers here
format them for the dashboard too.
"""

from __future__ import annotations

import html
import io
import signal
from typing import Any

from monarch_kernel.wire.messages import WORKER_EXITS
from monarch_kernel.worker.telemetry import REQUEST_ACTIVITY

__all__ = [
    "COLUMNS",
    "StatusTable",
    "figures",
    "fmt_bytes",
    "fmt_pct",
    "gpu_texts",
    "human_shape",
    "plural",
    "state_text",
]

COLUMNS = [("rank", "rank"), ("host", "host"), ("pid", "pid"), ("state", "state"),
           ("cpu", "cpu"), ("rss", "rss"), ("uss", "uss"), ("threads", "threads"),
           ("gpu", "gpu"), ("gpu_mem", "gpu mem"), ("msgs", "msgs in/out")]

NO_GPU = "no GPU"


def plural(n: int, name: str) -> str:
    """``(1, "hosts")`` -> ``"1 host"``; ``(4, "procs")`` -> ``"4 procs"``."""
    if n == 1 and name.endswith("s") and not name.endswith("ss"):
        name = name[:-1]
    return f"{n} {name}"


def human_shape(dims: Any) -> str:
    """A mesh's shape as people write it.

    ``{"hosts": 1, "procs": 4}`` -> ``"1 host x 4 procs"``; ``{"procs": 8}`` ->
    ``"8 procs"``; ``{}`` -> ``"no ranks"``.
    """
    if not dims:
        return "no ranks"
    return " x ".join(plural(int(n), str(name)) for name, n in dict(dims).items())


def fmt_bytes(n: float | None) -> str:
    """``1536`` -> ``"1.5 KiB"``; None -> ``""``."""
    if n is None:
        return ""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            if unit == "B":
                return f"{int(n)} B"
            return f"{n:.0f} {unit}" if abs(n) >= 100 else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def fmt_pct(p: float | None) -> str:
    """``12.345`` -> ``"12%"``, ``3.2`` -> ``"3.2%"``; None -> ``""``."""
    if p is None:
        return ""
    return f"{p:.0f}%" if p >= 10 else f"{p:.1f}%"


def _exit_text(exitcode: int | None) -> str:
    if exitcode is None:
        return "stopped answering"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    why = WORKER_EXITS.get(exitcode)
    if why is not None:  # it left by itself, having lost its controller
        return "no word from the controller" if "{" in why else why
    return f"exit code {exitcode}"


def state_text(state: str, activity: str | None = None, exitcode: int | None = None) -> str:
    """What a rank is doing, in a few words.

    Parameters
    ----------
    state : str
        The controller's state: starting, idle, busy, dead or stopped. It is
        current; the worker's report may be up to one interval old, so a
        request's activity on a rank the controller knows idle reads "idle".
    activity : str or None
        The worker's own report (telemetry): idle, running cell, ...
    exitcode : int or None
        For dead ranks: the exit code (negative: killed by that signal).
    """
    if state == "dead":
        return f"dead ({_exit_text(exitcode)})"
    if state in ("stopped", "starting"):
        return state
    if state == "idle" and activity in REQUEST_ACTIVITY.values():
        return "idle"  # a sample taken before the request ended
    if activity and not (state == "busy" and activity == "idle"):
        return activity
    return "running" if state == "busy" else state


def live(row: dict[str, Any]) -> bool:
    """True when the row's telemetry figures describe a running process."""
    return row.get("state") not in ("dead", "stopped", "starting") and "cpu" in row


def gpu_texts(gpu: dict[str, Any] | None) -> tuple[str, str]:
    """(utilization, memory) texts of a telemetry ``gpu`` entry (``"no GPU"`` for None)."""
    if gpu is None:
        return NO_GPU, NO_GPU
    util = fmt_pct(gpu.get("util")) if gpu.get("util") is not None else ""
    mem = ""
    if gpu.get("mem_total"):
        mem = f"{fmt_bytes(gpu.get('mem_used'))} / {fmt_bytes(gpu['mem_total'])}"
    torch_mem = gpu.get("torch_reserved")
    if torch_mem is not None:
        mem += f" (torch {fmt_bytes(gpu.get('torch_allocated'))}/{fmt_bytes(torch_mem)})"
    elif gpu.get("proc_mem") is not None:
        mem += f" (this rank {fmt_bytes(gpu['proc_mem'])})"
    idx = f"#{gpu['index']} " if gpu.get("index") is not None else ""
    return (idx + util).strip(), mem.strip()


def figures(row: dict[str, Any]) -> dict[str, str]:
    """The text of every column for one ``ProcMesh.status()`` row."""
    out = {
        "rank": str(row.get("rank", "")),
        "host": row.get("host") or "",
        "job": row.get("job") or "",
        "pid": "" if row.get("pid") is None else str(row["pid"]),
        "state": state_text(row.get("state", ""), row.get("activity"), row.get("exitcode")),
        "msgs": f"{row.get('messages_in', 0)}/{row.get('messages_out', 0)}",
    }
    if live(row):
        gpu, gpu_mem = gpu_texts(row.get("gpu"))
        out.update(cpu=fmt_pct(row.get("cpu")), rss=fmt_bytes(row.get("rss")),
                   uss=fmt_bytes(row.get("uss")), threads=str(row.get("threads", "")),
                   gpu=gpu, gpu_mem=gpu_mem)
    else:
        out.update(cpu="", rss="", uss="", threads="", gpu="", gpu_mem="")
    return out


class StatusTable:
    """A snapshot of a mesh's status, rendered as HTML or text.

    Parameters
    ----------
    mesh : ProcMesh
        Anything with ``shape.dims`` and ``status()`` (rows of dicts).
    name : str or None
        The mesh's name in the notebook (``%mesh spawn --name``), shown in
        the title.
    """

    def __init__(self, mesh: Any, name: str | None = None) -> None:
        self.name = name
        self.dims = mesh.shape.dims
        self.rows = mesh.status()
        self.columns = list(COLUMNS)
        if any(r.get("job") for r in self.rows):
            self.columns.insert(2, ("job", "job"))
        if not any("cpu" in r for r in self.rows):  # telemetry off: no empty columns
            self.columns = [c for c in self.columns
                            if c[0] in ("rank", "host", "job", "pid", "state", "msgs")]

    def _label(self) -> str:
        shape = human_shape(self.dims)
        return f"{self.name!r} ({shape})" if self.name else shape

    def _cells(self, row: dict[str, Any]) -> list[str]:
        f = figures(row)
        return [f.get(key, "") for key, _ in self.columns]

    def __repr__(self) -> str:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"mesh {self._label()}")
        for key, title in self.columns:
            table.add_column(title, justify="right" if key in (
                "rank", "pid", "cpu", "rss", "uss", "threads") else "left")
        for row in self.rows:
            table.add_row(*self._cells(row))
        buf = io.StringIO()
        Console(file=buf, width=160, force_terminal=False, force_jupyter=False,
                color_system=None).print(table)
        return buf.getvalue().rstrip("\n")

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{html.escape(t)}</th>" for _, t in self.columns)
        body = []
        for r in self.rows:
            style = ' style="color:#b71c1c"' if r.get("state") == "dead" else ""
            body.append(f"<tr{style}>" + "".join(
                f"<td>{html.escape(c)}</td>" for c in self._cells(r)) + "</tr>")
        return (f"<div><b>mesh</b> {html.escape(self._label())}<table><thead><tr>{head}"
                f"</tr></thead><tbody>{''.join(body)}</tbody></table></div>")
