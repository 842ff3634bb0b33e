"""The owner side of RDMABuffers: flat byte views of tensors, copies between
them, and the registry of the buffers this process registered.

Used by the handle (:mod:`monarch_kernel.tensors.buffer`) and by how its
operations travel (:mod:`monarch_kernel.tensors.buffer_ops`).
"""

from __future__ import annotations

import sys
import threading
from typing import Any

from monarch_kernel.errors import MeshError

__all__ = ["byte_view", "copy_bytes", "is_cuda", "lookup", "nbytes", "register", "registered",
           "unregister"]

_registry: dict[str, Any] = {}  # buffer id -> (registered object, its flat view) (owner side)
_lock = threading.Lock()


def byte_view(x: Any, what: str, writable: bool) -> Any:
    """A flat uint8 view of ``x`` sharing its memory: a torch tensor for a
    tensor (on its device), a numpy array for anything else."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        if x.layout != torch.strided or not x.is_contiguous():
            raise ValueError(f"{what} must be a contiguous tensor; got shape "
                             f"{tuple(x.shape)} with strides {x.stride()} (call .contiguous())")
        if x.device.type not in ("cpu", "cuda"):
            raise ValueError(f"{what} is on {x.device}; only CPU and CUDA tensors can be used")
        return x.detach().reshape(-1).view(torch.uint8)
    import numpy as np

    try:
        a = np.asarray(memoryview(x) if not isinstance(x, np.ndarray) else x)
    except TypeError:
        raise TypeError(f"{what} must be a torch.Tensor, a numpy array or a buffer; got "
                        f"{type(x).__name__}") from None
    if not a.flags.c_contiguous:
        raise ValueError(f"{what} must be C-contiguous")
    if writable and not a.flags.writeable:
        raise ValueError(f"{what} is read-only")
    return a.reshape(-1).view(np.uint8)


def is_cuda(view: Any) -> bool:
    """Whether a view (:func:`byte_view`) is in CUDA memory."""
    return getattr(getattr(view, "device", None), "type", "cpu") == "cuda"


def copy_bytes(dst: Any, src: Any) -> None:
    """Copy between flat uint8 views (torch or numpy, any device), synchronously:
    CUDA copies are complete when this returns."""
    import numpy as np

    torch = sys.modules.get("torch")
    dt = torch is not None and isinstance(dst, torch.Tensor)
    st = torch is not None and isinstance(src, torch.Tensor)
    if dt and dst.device.type == "cpu":
        dst, dt = dst.numpy(), False
    if st and src.device.type == "cpu":
        src, st = src.numpy(), False
    if not dt and not st:
        np.copyto(dst, src)  # (numpy lets other threads run during a large copy)
        return
    d = dst if dt else torch.from_numpy(dst)
    s = src if st else torch.from_numpy(src if src.flags.writeable else src.copy())
    d.copy_(s)
    for t in (d, s):  # the copy's streams only: never wait for, say, NCCL's work here
        if t.device.type == "cuda":
            torch.cuda.current_stream(t.device).synchronize()


def nbytes(view: Any) -> int:
    """The size in bytes of a flat uint8 view (:func:`byte_view`)."""
    return int(view.numel()) if hasattr(view, "numel") else int(view.nbytes)


def lookup(bid: str, rank: int) -> tuple[Any, Any]:
    """``(data, view)`` of buffer ``bid`` registered here (``rank``: this rank, named by
    the error).

    Raises
    ------
    MeshError
        If it was dropped, or never registered in this process.
    """
    with _lock:
        entry = _registry.get(bid)
    if entry is None:
        raise MeshError(f"RDMABuffer {bid} on rank {rank} was dropped (or its rank was "
                        "restarted since): register the tensor again")
    return entry


def register(bid: str, data: Any, view: Any) -> None:
    """Keep ``data`` (and its flat view) alive here as buffer ``bid`` (its owner)."""
    with _lock:
        _registry[bid] = (data, view)


def unregister(bid: str) -> None:
    """Forget buffer ``bid`` here (its owner's ``drop``); no error if unknown."""
    with _lock:
        _registry.pop(bid, None)


def registered(bid: str) -> bool:
    """True while buffer ``bid`` is registered in this process (tests)."""
    with _lock:
        return bid in _registry
