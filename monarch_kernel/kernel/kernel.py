"""MonarchKernel: an IPython kernel that is the controller of worker meshes.

Everything an IPython kernel does stays as it is (ordinary cells run in the
controller); the ``%mesh`` / ``%%mesh`` magics (:mod:`.magics`) drive
meshes. On shutdown or restart every mesh is stopped, so no worker outlives
its kernel, except a durable one (``%mesh spawn ... --detach``): it is detached,
its ranks keep running, and ``%mesh attach NAME`` finds them again.
"""

from __future__ import annotations

import builtins
import sys
from typing import Any

from ipykernel.ipkernel import IPythonKernel
from ipykernel.zmqshell import ZMQInteractiveShell
from traitlets import Float, Type

from monarch_kernel import __version__
from monarch_kernel.kernel.magics import MeshMagics
from monarch_kernel.kernel.sidebar import MeshSidebar
from monarch_kernel.launchers import zygote
from monarch_kernel.launchers.local import WORKER_PRELOAD

__all__ = ["MonarchKernel", "MonarchShell"]


class MonarchShell(ZMQInteractiveShell):
    """ipykernel's shell, transforming each cell once rather than twice.

    ipykernel's ``do_execute`` transforms a cell (to learn whether it must run
    as a coroutine), then calls ``run_cell``, which transforms it again: for a
    ``%%mesh`` cell that is a second tokenization of the cell, on every
    cell's path. The second call with the very same string returns the first's
    result (one entry, used once: nothing runs between the two calls, so the
    interpreter state that a one-line cell's transformation reads is the same).
    """

    _transformed: tuple[str, str] | None = None

    def showtraceback(self, exc_tuple: Any = None, filename: str | None = None,
                      tb_offset: int | None = None, exception_only: bool = False,
                      running_compiled_code: bool = False) -> None:
        """IPython's, except that an error from the ranks that is (or was raised
        while handling) an exception group is shown as the ranks formatted it
        (its ``_render_traceback_``), as other errors from the ranks are: IPython
        prints exception groups with Python's own formatting, which would show
        this package's frames and each member's rank again."""
        try:
            _, value, _ = self._get_exc_info(exc_tuple)
        except ValueError:
            value = None
        render = getattr(value, "_render_traceback_", None)
        if render is not None and not exception_only and _holds_group(value):
            try:
                stb = render()
            except Exception:  # noqa: BLE001 - IPython's own formatting, then
                stb = None
            if stb is not None:
                self._showtraceback(type(value), value, stb)
                return
        super().showtraceback(exc_tuple, filename, tb_offset, exception_only,
                              running_compiled_code)

    def transform_cell(self, raw_cell: str) -> str:
        memo, self._transformed = self._transformed, None
        if memo is not None and memo[0] is raw_cell:
            return memo[1]
        cell = super().transform_cell(raw_cell)
        self._transformed = (raw_cell, cell)
        return cell


def _holds_group(value: Any) -> bool:
    """``value`` or an exception of its ``__context__`` chain is an exception group."""
    group = getattr(builtins, "BaseExceptionGroup", None)
    seen: set[int] = set()
    while value is not None and group is not None and id(value) not in seen:
        if isinstance(value, group):
            return True
        seen.add(id(value))
        value = value.__context__
    return False


class MonarchKernel(IPythonKernel):
    """The ``monarch`` kernel (display name "Monarch (mesh)")."""

    shell_class = Type(MonarchShell)
    implementation = "monarch_kernel"
    implementation_version = __version__
    banner = (
        "Monarch (mesh): an IPython kernel that drives a mesh of worker processes.\n"
        "Start one with  %mesh spawn 4  and run cells on it with  %%mesh"
    )
    # ipykernel sleeps 0.5 ms after every cell before its reply ("FIXME: ... the
    # flush doesn't seem to make it to the clients"); its OutStream.flush already
    # waits for the IOPub thread, and frontends wait for the idle status after
    # the outputs, so this kernel does not: a cell's round trip is 0.5 ms shorter
    _execute_sleep = Float(0.0).tag(config=True)

    #: cells whose inputs IPython's history keeps in memory before writing them to
    #: its SQLite file together (IPython's default, 0, commits every cell on a
    #: thread that holds the lock the next cell's store_inputs waits for: about
    #: 0.3-0.4 ms a cell here). The cache is written at shutdown; a crash loses at
    #: most this many entries of %history. Configurable as usual
    #: (``--HistoryManager.db_cache_size=0`` restores IPython's behaviour).
    HISTORY_CACHE_CELLS = 20

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        hm = getattr(self.shell, "history_manager", None)
        if hm is not None and "db_cache_size" not in self.config.get("HistoryManager", {}):
            hm.db_cache_size = self.HISTORY_CACHE_CELLS
        assert self.shell is not None  # (IPythonKernel.__init__ made it)
        self.mesh_magics = MeshMagics(self.shell, kernel=self)
        self.shell.register_magics(self.mesh_magics)
        # JupyterLab's mesh sidebar opens comms to "monarch.mesh" (kernel/sidebar.py)
        self.mesh_sidebar = MeshSidebar(self.mesh_magics)
        self.mesh_sidebar.register(self.comm_manager)
        # local workers fork from a template process: its imports start now, not at the
        # first %mesh spawn (launchers/zygote.py; MONARCH_ZYGOTE=0: none)
        zygote.prestart("monarch_kernel", WORKER_PRELOAD)

    async def do_shutdown(self, restart: bool) -> dict[str, Any]:
        self.mesh_magics.shutting_down.set()  # (a durable mesh's running cell: left running)
        self.mesh_sidebar.close()
        self.mesh_magics.release_all()  # (durable meshes are detached, not stopped)
        # dashboards of meshes stopped above froze already; any other keeps its last
        # state in the notebook's output too (only if one was ever made: no import here)
        dashboards = sys.modules.get("monarch_kernel.ui.dashboard")
        if dashboards is not None:
            dashboards.freeze_all()
        return super().do_shutdown(restart)
