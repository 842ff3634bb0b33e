"""The kernel's stdin bridge for the distributed debugger.

Connects :class:`monarch_kernel.debug.console.DebugConsole` to Jupyter:
prompts go out as ``input_request`` messages on the stdin channel through
ipykernel's own ``Kernel.raw_input`` (the path ``input()`` takes in a
cell, see ``ipykernel.kernelbase.Kernel._input_request``), and whether the
frontend can answer them comes from the execute request's ``allow_stdin``
(``Kernel._allow_stdin``). Also implements ``%mesh debug [--post-mortem
RANK]``.
"""

from __future__ import annotations

import builtins
import sys
from collections.abc import Callable
from typing import Any

from IPython.core.error import UsageError

from ..controller import Request
from ..debug.console import DebugConsole, report_quits
from ..debug.registry import registry_for
from ..output import RankPrinter
from ..procmesh import ProcMesh, raise_failures

__all__ = ["cell_console", "debug_command", "stdin_bridge", "POST_MORTEM_CODE"]

#: what a rank runs for ``%mesh debug --post-mortem``
POST_MORTEM_CODE = "__import__('monarch_kernel.debug.server', fromlist=['x']).post_mortem()"


def stdin_bridge(kernel: Any) -> tuple[Callable[[str], str], bool]:
    """``(input_fn, allow_stdin)`` for the current execution of ``kernel``.

    Without a kernel (plain IPython), ``builtins.input`` and True.
    """
    if kernel is None:
        return builtins.input, True
    return kernel.raw_input, bool(getattr(kernel, "_allow_stdin", False))


def _out(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _err(text: str) -> None:
    sys.stderr.write(text)
    sys.stderr.flush()


def cell_console(magics: Any, m: ProcMesh, req: Request, printer: RankPrinter) -> DebugConsole:
    """The console that serves the ranks of ``req`` that pause while a cell waits for it."""
    input_fn, allow = stdin_bridge(magics.kernel)
    return DebugConsole(
        registry_for(m.controller), m, input_fn, _out, allow_stdin=allow, req=req,
        on_event=lambda ev: magics._event(ev, printer), flush=printer.flush_lines, warn=_err,
    )


def debug_command(magics: Any, argv: list[str]) -> None:
    """``%mesh debug [--post-mortem RANK]``.

    Raises
    ------
    UsageError
        For bad arguments, a frontend that cannot answer prompts, or a rank
        with no exception to debug.
    """
    from .magics import _parser

    p = _parser("debug")
    p.add_argument("--post-mortem", dest="post_mortem", metavar="RANK", default=None)
    p.add_argument("--wait", type=float, default=0.0, metavar="SECONDS")
    a = p.parse_args(argv)
    if a.wait < 0:
        raise UsageError("%mesh debug --wait: give 0 or more seconds")
    m = magics.current_mesh()
    reg = registry_for(m.controller)
    input_fn, allow = stdin_bridge(magics.kernel)
    if not allow:
        raise UsageError("%mesh debug: this frontend cannot answer input requests "
                         "(allow_stdin is false); run it from Jupyter, JupyterLab or "
                         "jupyter console")
    if a.post_mortem is None:
        DebugConsole(reg, m, input_fn, _out, warn=_err).run(wait=a.wait)
        return
    try:
        rank = int(a.post_mortem)
    except ValueError:
        raise UsageError(f"%mesh debug --post-mortem: {a.post_mortem!r} is not a rank; "
                         "give one rank, e.g.  %mesh debug --post-mortem 3") from None
    if not 0 <= rank < m.world_size:
        raise UsageError(f"%mesh debug --post-mortem: rank {rank} does not exist: this mesh "
                         f"has ranks 0 to {m.world_size - 1}")
    req = m.root.request("execute", {"code": POST_MORTEM_CODE, "filename": "<mesh-debug>"},
                         [rank])
    magics._wait(m, req, None)
    report_quits(req, _err)
    status, value = req.replies.get(rank, ("ok", None))
    if status == "error" and "no uncaught exception" in str(value.get("message", "")):
        raise UsageError(f"%mesh debug --post-mortem: {value['message']}")
    raise_failures(req)
