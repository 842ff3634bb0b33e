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
import weakref
from collections.abc import Callable
from typing import Any

from IPython.core.error import UsageError

from monarch_kernel.actor.replies import set_debug_handler, show_display
from monarch_kernel.controller.controller import Request
from monarch_kernel.controller.output import RankPrinter
from monarch_kernel.debug.console import DebugConsole, report_quits
from monarch_kernel.debug.registry import registry_for
from monarch_kernel.errors import CollectiveAborted, raise_request_failures
from monarch_kernel.kernel.commands import command
from monarch_kernel.mesh.dist_setup import (
    QuitWatch,
    aborted_message,
    restore_after_abort,
    watch_quit,
)
from monarch_kernel.mesh.procmesh import ProcMesh, live_meshes

__all__ = ["POST_MORTEM_CODE", "call_debug_event", "cell_console", "debug_command",
           "finish_cell", "stdin_bridge"]

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


_quit_watches: weakref.WeakKeyDictionary[Request, QuitWatch] = weakref.WeakKeyDictionary()


def cell_console(magics: Any, m: ProcMesh, req: Request, printer: RankPrinter) -> DebugConsole:
    """The console that serves the ranks of ``req`` that pause while a cell waits for it.

    On a mesh with ``torch.distributed`` set up, a rank that quits its
    debugger while others of the cell still run starts :func:`watch_quit`:
    the collectives that wait for it are aborted (see :func:`finish_cell`).
    """
    input_fn, allow = stdin_bridge(magics.kernel)

    def on_quit(ranks: list[int]) -> bool:
        if not m.root.dist:
            return False
        _quit_watches[req] = watch_quit(m.root, req, ranks)
        return True

    return DebugConsole(
        registry_for(m.controller), m, input_fn, _out, allow_stdin=allow, req=req,
        on_event=lambda ev: magics.show_event(ev, printer), flush=printer.flush_lines, warn=_err,
        on_quit=on_quit,
    )


def finish_cell(m: ProcMesh, req: Request, write: Callable[[str], None]) -> list[int]:
    """After a cell's request is done: say which ranks quit their debugger
    (:func:`report_quits`); the ranks that quit.

    If collectives that waited for those ranks were aborted, the aborted
    ranks' errors become one ``CollectiveAborted`` error saying so, and
    ``torch.distributed`` is set up again on every rank of the mesh (the
    aborted process group is unusable), so ``dist`` works in the next cell.
    """
    quit_ranks = report_quits(req, write)
    watch = _quit_watches.pop(req, None)
    if watch is None or not watch.aborted:
        return quit_ranks
    aborted = sorted(r for r in watch.aborted if req.replies.get(r, ("ok",))[0] == "error")
    restored = restore_after_abort(m.root)
    text = aborted_message(quit_ranks or watch.quit_ranks, watch.aborted, restored)
    for r in aborted:
        value = req.replies[r][1]
        # (no description of the torch error it replaces: it is rebuilt from exc)
        req.replies[r] = ("error", {
            **value, "exc": CollectiveAborted(text), "tree": None,
            "type": "monarch_kernel.CollectiveAborted", "message": text,
            "traceback": _user_frames(str(value.get("traceback", ""))) +
            f"monarch_kernel.CollectiveAborted: {text}\n"})
    if not aborted:  # (all of them ended by themselves meanwhile)
        write(text + "\n")
    return quit_ranks


def _user_frames(tb: str) -> str:
    """The frames of a rank's formatted traceback down to the first frame of
    torch.distributed (the user's call of the collective)."""
    out: list[str] = []
    for line in tb.splitlines(keepends=True):
        if "torch/distributed/" in line.replace("\\", "/") and line.lstrip().startswith("File"):
            break
        if not line.startswith((" ", "\t", "Traceback")):
            break  # the exception's own line
        out.append(line)
    return "".join(out)


_call_consoles: weakref.WeakKeyDictionary[Request, DebugConsole] = weakref.WeakKeyDictionary()


def _mesh_of(req: Request) -> ProcMesh | None:
    for m in live_meshes():
        if req.id in m.controller.pending:
            return m
    return None


def call_debug_event(req: Request, ev: tuple, printer: RankPrinter | None) -> None:
    """A rank paused in pdb while the kernel waits for an actor call (``Future.get``).

    Called by the future's output pump in the kernel's main thread; serves
    the paused ranks of that call with the same prompts as in a ``%%mesh``
    cell.
    """
    console = _call_consoles.get(req)
    if console is None:
        m = _mesh_of(req)
        if m is None:
            return
        def on_event(e: tuple) -> None:
            if e[0] == "stream" and printer is not None:
                printer.feed(e[1], e[2], e[3])
            elif e[0] == "display":
                show_display(e[1], e[2])

        input_fn, allow = stdin_bridge(_kernel())
        console = _call_consoles[req] = DebugConsole(
            registry_for(m.controller), m, input_fn, _out, allow_stdin=allow, req=req,
            on_event=on_event, flush=printer.flush_lines if printer is not None else None,
            warn=_err)
    console.on_event(ev)


set_debug_handler(call_debug_event)  # actor calls the kernel waits for: their paused ranks


def _kernel() -> Any:
    try:
        from ipykernel.kernelbase import Kernel

        return Kernel.instance() if Kernel.initialized() else None
    except Exception:  # noqa: BLE001 - not in a kernel
        return None


def debug_command(magics: Any, argv: list[str]) -> None:
    """``%mesh debug [--post-mortem RANK]``.

    With a frontend that cannot answer prompts it only warns.

    Raises
    ------
    UsageError
        For bad arguments, or a rank with no exception to debug.
    """
    a = command("debug").parse(argv)
    if a.wait < 0:
        raise UsageError("%mesh debug --wait: give 0 or more seconds")
    m = magics.current_mesh()
    reg = registry_for(m.controller)
    input_fn, allow = stdin_bridge(magics.kernel)
    if not allow:  # as for breakpoints: a warning, never a prompt nobody can answer
        paused = reg.sessions("paused", ranks=m.root.ranks)
        where = "; ".join(f"rank {s.rank} at {s.where}" for s in paused) or "none"
        _err("%mesh debug skipped: this frontend cannot answer input requests (allow_stdin "
             f"is false); run it from Jupyter, JupyterLab or jupyter console. Paused: {where}\n")
        return
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
    magics.wait_cell(m, req, None)
    report_quits(req, _err)
    status, value = req.replies.get(rank, ("ok", None))
    if status == "error" and "no uncaught exception" in str(value.get("message", "")):
        raise UsageError(f"%mesh debug --post-mortem: {value['message']}")
    raise_request_failures(req)
