"""torch's CUDA IPC reduction of a tensor, read through one guarded accessor.

``torch.multiprocessing.reductions.reduce_tensor`` turns a CUDA tensor into
``(rebuild_cuda_tensor, args)``, where ``args`` is a positional tuple whose
layout is torch's own (torch 2.x: the 15 parameters of
``rebuild_cuda_tensor``, :data:`REBUILD_ARGS`). This module is the one place
that knows that layout: :func:`reduce` makes the tuple, :func:`rebuild` maps
it in the receiver, :func:`release` gives back the sender's memory without
mapping it, and :class:`CudaIpcArgs` names its fields. Each checks the tuple
(and, once per process, torch's ``rebuild_cuda_tensor`` signature) against
the layout it knows, and raises :class:`CudaIpcLayoutError`, which names
the torch version, for any other; the senders then stage the tensor through
host memory instead (:mod:`monarch_kernel.wire.serialize`,
:mod:`monarch_kernel.tensors.buffer_ops`).

The tuple travels as it is (pickled inside a message): the bytes on the wire
are torch's.
"""

from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass
from typing import Any

from monarch_kernel.errors import SerializationError

__all__ = ["REBUILD_ARGS", "CudaIpcArgs", "CudaIpcLayoutError", "check_torch", "rebuild",
           "reduce", "release"]

#: the positional arguments of ``torch.multiprocessing.reductions.rebuild_cuda_tensor``
#: (torch 2.x), in order: the layout of the tuple ``reduce_tensor`` makes
REBUILD_ARGS: tuple[str, ...] = (
    "tensor_cls", "tensor_size", "tensor_stride", "tensor_offset", "storage_cls", "dtype",
    "storage_device", "storage_handle", "storage_size_bytes", "storage_offset_bytes",
    "requires_grad", "ref_counter_handle", "ref_counter_offset", "event_handle",
    "event_sync_required",
)
_INDEX = {name: i for i, name in enumerate(REBUILD_ARGS)}
_checked: list[bool] = []  # [True] once torch's signature was found to match
_ADVICE = ("Send the tensor with tensor.cpu(), or set MONARCH_CUDA_IPC=0 to stage CUDA "
           "tensors through host memory")


class CudaIpcLayoutError(SerializationError):
    """torch's CUDA IPC reduction has a layout this module does not know (another
    torch version): the tensor cannot travel by IPC handle."""


def _torch_version() -> str:
    torch = sys.modules.get("torch")
    return str(getattr(torch, "__version__", "not loaded"))


@dataclass(frozen=True)
class CudaIpcArgs:
    """The arguments of ``rebuild_cuda_tensor`` (one CUDA IPC reduction), by name.

    Attributes
    ----------
    args : tuple
        The positional tuple, as torch made it (of :data:`REBUILD_ARGS`' length).
    """

    args: tuple

    @classmethod
    def of(cls, args: Any) -> CudaIpcArgs:
        """Wrap ``args`` after checking its shape.

        Raises
        ------
        CudaIpcLayoutError
            If ``args`` is not a tuple of ``len(REBUILD_ARGS)`` items.
        """
        if type(args) is not tuple or len(args) != len(REBUILD_ARGS):
            shape = (f"a tuple of {len(args)} items" if isinstance(args, tuple)
                     else f"a {type(args).__name__}")
            raise CudaIpcLayoutError(
                f"torch {_torch_version()}'s CUDA IPC reduction gave {shape}; "
                f"monarch_kernel knows the layout of torch 2.x (a tuple of "
                f"{len(REBUILD_ARGS)}: {', '.join(REBUILD_ARGS)}). {_ADVICE}")
        return cls(args)

    def field(self, name: str) -> Any:
        """The argument called ``name`` (one of :data:`REBUILD_ARGS`; KeyError otherwise)."""
        return self.args[_INDEX[name]]

    @property
    def storage_cls(self) -> Any:
        """The storage class (its ``_release_ipc_counter`` gives back the reference)."""
        return self.args[_INDEX["storage_cls"]]

    @property
    def storage_device(self) -> int:
        """The sender's device index."""
        return self.args[_INDEX["storage_device"]]

    @property
    def ref_counter_handle(self) -> Any:
        """The shared file of the sender's IPC reference counts."""
        return self.args[_INDEX["ref_counter_handle"]]

    @property
    def ref_counter_offset(self) -> int:
        """This reduction's slot in that file."""
        return self.args[_INDEX["ref_counter_offset"]]


def check_torch() -> None:
    """Check (once per process) that torch's ``rebuild_cuda_tensor`` takes the
    arguments of :data:`REBUILD_ARGS`, in that order.

    Raises
    ------
    CudaIpcLayoutError
        If its parameters differ (naming torch's version and both lists).
    ImportError
        If torch is not installed.
    """
    if _checked:
        return
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    names = tuple(inspect.signature(rebuild_cuda_tensor).parameters)
    if names != REBUILD_ARGS:
        raise CudaIpcLayoutError(
            f"torch {_torch_version()}'s rebuild_cuda_tensor takes ({', '.join(names)}); "
            f"monarch_kernel knows torch 2.x's ({', '.join(REBUILD_ARGS)}). {_ADVICE}")
    _checked.append(True)


def reduce(tensor: Any) -> tuple:
    """The IPC reduction of CUDA tensor ``tensor``: the argument tuple of
    ``rebuild_cuda_tensor`` (holding an IPC handle of ``tensor``'s memory).

    Raises
    ------
    CudaIpcLayoutError
        If torch reduced it to something else than ``rebuild_cuda_tensor`` and a
        tuple of the known layout.
    Exception
        What torch raises (no CUDA IPC in this build or container, a non-leaf
        tensor that requires grad, ...).
    """
    check_torch()
    from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

    fn, args = reduce_tensor(tensor)
    if fn is not rebuild_cuda_tensor:
        raise CudaIpcLayoutError(
            f"torch {_torch_version()} reduced a CUDA tensor with "
            f"{getattr(fn, '__qualname__', fn)!r}, not rebuild_cuda_tensor (a tensor that "
            f"is not a plain strided CUDA tensor, or another torch version). {_ADVICE}")
    return CudaIpcArgs.of(args).args


def rebuild(args: Any) -> Any:
    """The tensor that IPC reduction ``args`` describes, mapped into this process
    (the sender's memory; waits for the sender's event).

    Raises
    ------
    CudaIpcLayoutError
        If ``args`` or torch's ``rebuild_cuda_tensor`` has another layout.
    """
    check_torch()
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    return rebuild_cuda_tensor(*CudaIpcArgs.of(args).args)


def release(args: Any) -> None:
    """Give back the reference that IPC reduction ``args`` holds on the sender's
    memory without mapping it (as ``rebuild_cuda_tensor`` does for a cached
    handle): only the shared reference-count file is touched.

    Raises
    ------
    CudaIpcLayoutError
        If ``args`` has another layout.
    Exception
        What torch raises (the reference-count file is gone, ...).
    """
    a = CudaIpcArgs.of(args)
    a.storage_cls._release_ipc_counter(a.ref_counter_handle, a.ref_counter_offset,
                                       device=a.storage_device)
