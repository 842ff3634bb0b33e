"""Ranks in the debugger's words: the console's rank specs, and ranks named in messages.

:func:`parse_debug_ranks` reads what ``cast``/``attach`` accept (``3``,
``1,2``, ``0:4``, ``all``, ``procs=1:3``); :func:`ranks_text` names the
ranks of debugger sessions (ranks themselves are written by
:func:`monarch_kernel.errors.ranks_label` everywhere); :func:`report_quits`
turns the ``BdbQuit`` replies of a cell into one line (used by the cell
magic and the ``%mesh debug`` bridge as well as the console).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from monarch_kernel.debug.registry import DebugSession
from monarch_kernel.errors import RankSpecError, compact_ranks, ranks_label
from monarch_kernel.mesh.shape import parse_ranks

__all__ = ["parse_debug_ranks", "ranks_text", "report_quits"]


def parse_debug_ranks(spec: str, shape: Any, world_size: int) -> list[int]:
    """Ranks named by a console rank spec.

    Parameters
    ----------
    spec : str
        ``3``, ``1,2``, ``0:4`` (end excluded), ``all``, or dimension
        selectors ``procs=1:3`` / ``hosts=0,procs=1`` over ``shape``.
    shape : Shape
        The mesh's shape (for dimension selectors).
    world_size : int

    Raises
    ------
    RankSpecError
        For a spec that names no rank or a rank outside the mesh.
    """
    spec = spec.strip()
    if "=" not in spec:
        return parse_ranks(spec, world_size)
    selectors: dict[str, int | slice] = {}
    for part in spec.split(","):
        name, eq, value = part.partition("=")
        name, value = name.strip(), value.strip()
        if not eq or not name:
            raise RankSpecError(
                f"bad rank spec {spec!r}; mix no plain ranks with dimension selectors: "
                "write e.g. procs=1:3 or hosts=0,procs=1"
            )
        try:
            if ":" in value:
                a, _, b = value.partition(":")
                selectors[name] = slice(int(a) if a.strip() else None,
                                        int(b) if b.strip() else None)
            else:
                selectors[name] = int(value)
        except ValueError:
            raise RankSpecError(f"bad selector {part!r}; write NAME=INDEX or NAME=START:STOP") \
                from None
    try:
        return list(shape.slice(**selectors).ranks)
    except Exception as e:  # noqa: BLE001 - MeshError from Shape.slice, said in one line
        raise RankSpecError(f"bad rank spec {spec!r}: {e}; dimensions: {shape.dims}") from None


def report_quits(req: Any, write: Callable[[str], None]) -> list[int]:
    """Turn ``BdbQuit`` replies of ``req`` into a message; the ranks that quit.

    Ranks whose code stopped because the user quit their debugger are not a
    failure of the cell: their replies become ``("ok", None)`` and one line
    says what happened.
    """
    quit_ranks = []
    for rank, (status, value) in list(req.replies.items()):
        if status == "error" and isinstance(value, dict) and \
                str(value.get("type", "")).endswith("BdbQuit"):
            req.replies[rank] = ("ok", None)
            quit_ranks.append(rank)
    if quit_ranks:
        quit_ranks.sort()
        write(f"{ranks_label(quit_ranks)}: debugging ended with quit; the cell's code stopped "
              "there (BdbQuit)\n")
    return quit_ranks


def ranks_text(sessions: list[DebugSession]) -> str:
    """The ranks of ``sessions``: ``rank 3``, ``2 ranks (1, 2)``, ``4 ranks (0-3)``."""
    ranks = sorted({s.rank for s in sessions})
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return f"{len(ranks)} ranks ({compact_ranks(ranks)})"
