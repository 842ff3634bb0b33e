"""Helpers of the notebook tests (nbclient runs of notebooks/)."""

from __future__ import annotations

from typing import Any

from nbclient import NotebookClient


def kernel_pid_hook(client_ref: list[Any], pids: list[int]) -> Any:
    """An nbclient ``on_cell_start`` hook that notes the kernel's pid in
    ``pids`` (at the first cell; ``client_ref[0]`` is the NotebookClient).
    The kernel's workers name it with ``--controller-pid``, so a test can
    look for its own leftover workers only, not other meshes on the machine
    (``monarch_kernel.testing.kernel.worker_pids(pid)``)."""
    def hook(**_kw: Any) -> None:
        if not pids:
            pids.append(client_ref[0].km.provisioner.pid)
    return hook


#: the cell tag that makes :class:`RestartingClient` restart the kernel before the cell
RESTART_TAG = "restart-kernel-before"


class RestartingClient(NotebookClient):
    """An nbclient ``NotebookClient`` that restarts the kernel (as JupyterLab's
    Kernel > Restart does: a ``shutdown_request`` with ``restart: true``, then the
    same connection) before every cell tagged :data:`RESTART_TAG`. ``restarts``
    counts them; ``pids`` lists the kernel's pid after each."""

    def __init__(self, nb: Any, **kwargs: Any) -> None:
        super().__init__(nb, **kwargs)
        self.restarts = 0
        self.pids: list[int] = []

    async def async_execute_cell(self, cell: Any, cell_index: int, *args: Any,
                                 **kwargs: Any) -> Any:
        if RESTART_TAG in (cell.get("metadata", {}).get("tags") or []):
            assert self.km is not None and self.kc is not None
            await self.km.restart_kernel(now=False)
            await self.kc.wait_for_ready(timeout=self.startup_timeout)
            self.restarts += 1
            self.pids.append(self.km.provisioner.pid)
        return await super().async_execute_cell(cell, cell_index, *args, **kwargs)
