"""The GPU a rank uses.

``torch.cuda.set_device`` sets the current device of the calling thread
only, while a rank runs user code in several threads (cells in the main
thread, each actor in its own). With ``--dist nccl`` the worker assigns the
rank its GPU (``LOCAL_RANK``, as ``torchrun`` does) through :func:`assign`;
actor threads adopt it when they start (:func:`enter_thread`), telemetry
reports it, and tensors that arrive from other processes land on it
(:mod:`monarch_kernel.wire.serialize`).
"""

from __future__ import annotations

import sys

__all__ = ["assign", "assigned", "enter_thread"]

_assigned: int | None = None


def assign(index: int) -> None:
    """Make CUDA device ``index`` this rank's GPU (and the calling thread's)."""
    global _assigned
    import torch

    torch.cuda.set_device(index)
    _assigned = index


def assigned() -> int | None:
    """This rank's GPU (torch's logical index), or None when none was assigned."""
    return _assigned


def enter_thread() -> None:
    """Make the rank's GPU the calling thread's current CUDA device (no-op
    without an assigned GPU)."""
    if _assigned is not None:
        torch = sys.modules.get("torch")
        if torch is not None:
            torch.cuda.set_device(_assigned)
