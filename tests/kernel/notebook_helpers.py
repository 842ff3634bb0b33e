"""Helpers of the notebook tests (nbclient runs of notebooks/)."""

from __future__ import annotations

from typing import Any


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
