"""``%mesh list`` and ``python -m monarch_kernel meshes list``: the user's durable meshes.

One row per mesh of the registry (:func:`monarch_kernel.mesh.registry.list_meshes`):
name, shape, state (attached, detached, gone), age, attached to (``pid@host``
of the controller that holds it, or ``this kernel``), keep-alive left (how long a
detached mesh waits for a controller before its ranks end themselves) and
launcher (with the Slurm job and its state: ``slurm (job 42, RUNNING)``, or
``PENDING`` while the job waits for its nodes). Shown as HTML in a notebook and as a ``rich``
table in a terminal (``text/plain``), as ``%mesh status`` is.

This module imports no IPython: the command line uses it too.
"""

from __future__ import annotations

import html
import io
from collections.abc import Iterable
from typing import Any

from monarch_kernel.ui.status import human_shape

__all__ = ["COLUMNS", "MeshTable", "fmt_duration"]

#: (key, title) of each column
COLUMNS = [("name", "name"), ("shape", "shape"), ("state", "state"), ("age", "age"),
           ("attached", "attached to"), ("keep_alive", "keep-alive left"),
           ("launcher", "launcher")]


def fmt_duration(seconds: float | None) -> str:
    """``42`` -> ``"42s"``, ``600`` -> ``"10m"``, ``3900`` -> ``"1h 05m"``,
    ``90000`` -> ``"1d 01h"``; None -> ``""``; negatives count as 0."""
    if seconds is None:
        return ""
    s = max(0, int(round(float(seconds))))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m" + (f" {s % 60:02d}s" if s < 600 and s % 60 else "")
    if s < 86400:
        return f"{s // 3600}h {s % 3600 // 60:02d}m"
    return f"{s // 86400}d {s % 86400 // 3600:02d}h"


class MeshTable:
    """The meshes of the registry as a table (``text/plain``: rich; ``text/html``).

    Parameters
    ----------
    infos : iterable of MeshInfo
        What :func:`~monarch_kernel.mesh.registry.list_meshes` returned (anything
        with its attributes: name, shape, state, age_s, attached_to,
        keep_alive_left_s, launcher, slurm_job, and optionally job_state).
    here : set of str
        Names of the meshes attached to the kernel that shows the table: their
        "attached to" column says ``this kernel``.
    """

    def __init__(self, infos: Iterable[Any], here: Iterable[str] = ()) -> None:
        mine = set(here)
        self.rows = [self.row(i, i.name in mine) for i in infos]

    @staticmethod
    def row(info: Any, here: bool = False) -> dict[str, str]:
        """One mesh's cells, as text (``here``: attached to the kernel showing it)."""
        attached = getattr(info, "attached_to", None) or ""
        state = str(getattr(info, "state", ""))
        if attached and here and state == "attached":
            attached = f"this kernel ({attached})"
        elif not attached:
            attached = "-" if state != "gone" else ""
        left = getattr(info, "keep_alive_left_s", None)
        launcher = str(getattr(info, "launcher", "") or "")
        job = getattr(info, "slurm_job", None)
        job_state = getattr(info, "job_state", None)
        if job:
            launcher += f" (job {job}, {job_state})" if job_state else f" (job {job})"
        elif job_state:
            launcher += f" ({job_state})"
        return {
            "name": str(info.name),
            "shape": human_shape(getattr(info, "shape", None) or {}),
            "state": state,
            "age": fmt_duration(getattr(info, "age_s", None)),
            "attached": attached,
            "keep_alive": fmt_duration(left) if state == "detached" else "",
            "launcher": launcher,
        }

    def __len__(self) -> int:
        return len(self.rows)

    def __repr__(self) -> str:
        if not self.rows:
            return "no durable meshes (start one with  %mesh spawn 4 --name NAME --detach)"
        from rich.console import Console
        from rich.table import Table

        table = Table(title="durable meshes")
        for _, title in COLUMNS:
            table.add_column(title)
        for r in self.rows:
            table.add_row(*(r[k] for k, _ in COLUMNS))
        buf = io.StringIO()
        Console(file=buf, width=160, force_terminal=False, force_jupyter=False,
                color_system=None).print(table)
        return buf.getvalue().rstrip("\n")

    def _repr_html_(self) -> str:
        if not self.rows:
            return f"<div>{html.escape(repr(self))}</div>"
        head = "".join(f"<th>{html.escape(t)}</th>" for _, t in COLUMNS)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(r[k])}</td>" for k, _ in COLUMNS)
                       + "</tr>" for r in self.rows)
        return (f"<div><b>durable meshes</b><table><thead><tr>{head}</tr></thead>"
                f"<tbody>{body}</tbody></table></div>")

    def plain(self) -> str:
        """Tab-free plain text without rich's boxes (the command line's ``--plain``)."""
        if not self.rows:
            return repr(self)
        widths = {k: max(len(t), *(len(r[k]) for r in self.rows)) for k, t in COLUMNS}
        lines = ["  ".join(t.ljust(widths[k]) for k, t in COLUMNS).rstrip()]
        lines += ["  ".join(r[k].ljust(widths[k]) for k, _ in COLUMNS).rstrip()
                  for r in self.rows]
        return "\n".join(lines)


def describe(info: Any) -> str:
    """One mesh in words: ``"'train' (1 host x 4 procs, detached)"``."""
    return f"{info.name!r} ({human_shape(getattr(info, 'shape', None) or {})}, {info.state})"
