"""``%mesh status``: one row per rank, as HTML in a notebook and as a ``rich``
table in a terminal frontend (``jupyter console`` shows ``text/plain``)."""

from __future__ import annotations

import html
import io
from typing import Any

__all__ = ["StatusTable", "COLUMNS"]

COLUMNS = [("rank", "rank"), ("host", "host"), ("pid", "pid"), ("state", "state")]


def _fmt(value: Any) -> str:
    return "" if value is None else str(value)


class StatusTable:
    """A snapshot of a mesh's status, rendered as HTML or text.

    Parameters
    ----------
    mesh : ProcMesh
    """

    def __init__(self, mesh: Any) -> None:
        self.dims = mesh.shape.dims
        self.rows = mesh.status()
        self.columns = list(COLUMNS)
        if any(r.get("job") for r in self.rows):
            self.columns.insert(2, ("job", "job"))

    def _cells(self, row: dict[str, Any]) -> list[str]:
        return [_fmt(row.get(key)) for key, _ in self.columns]

    def __repr__(self) -> str:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"mesh {self.dims}")
        for _, title in self.columns:
            table.add_column(title)
        for row in self.rows:
            table.add_row(*self._cells(row))
        buf = io.StringIO()
        Console(file=buf, width=120, force_terminal=False, force_jupyter=False,
                color_system=None).print(table)
        return buf.getvalue().rstrip("\n")

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{html.escape(t)}</th>" for _, t in self.columns)
        body = "".join(
            "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in self._cells(r)) + "</tr>"
            for r in self.rows
        )
        return (f"<div><b>mesh</b> {html.escape(str(self.dims))}<table><thead><tr>{head}"
                f"</tr></thead><tbody>{body}</tbody></table></div>")
