"""RDMABuffer: one-sided reads and writes of a tensor registered on a rank.

A rank registers a tensor (``buf = RDMABuffer(t)``) and sends the handle
to others, inside any actor call or return value; a holder of the handle on
another rank then reads the tensor's bytes into a tensor of its own
(``buf.read_into(dst)``) or writes into it (``buf.write_from(src)``),
without the owner's code taking part and never through the controller.
The API is PyTorch Monarch's ``monarch.rdma.RDMABuffer`` (``size``,
``read_into``, ``write_from``, ``drop``, futures that are both ``.get()``-able
and awaitable); the transport is not RDMA hardware but what this host
offers:

* CUDA tensor, reader on the same host: a CUDA IPC handle
  (``cudaIpcGetMemHandle``, through ``torch.multiprocessing``'s reductions)
  made fresh for each operation by the owner's peer I/O (or leading) thread; the reader
  maps the owner's memory and copies device to device. The copy is ordered
  after the work the owner had queued on its default stream when the handle
  was made (the handle carries a CUDA event).
* CPU tensor, same host: the reader lends the owner a pooled shared-memory
  file (:meth:`monarch_kernel.wire.shm.Pool.lease`); the owner's peer I/O (or leading) thread
  copies the bytes into it (a read) or out of it (a write): one copy on
  each side, no socket.
* Otherwise (another host, or CUDA IPC refused): the bytes travel as
  zero-copy ZeroMQ frames of the peer connection (signed), staged through
  host memory for CUDA tensors.

The owner keeps the tensor alive until :meth:`RDMABuffer.drop`. Like real
RDMA, nothing orders a read against the owner's later writes: tell readers
when the data is ready (an endpoint call does).
"""

from __future__ import annotations

import secrets
import sys
from typing import Any

from monarch_kernel.actor.future import Future, check_timeout
from monarch_kernel.actor.mesh_keys import check_known
from monarch_kernel.actor.peers import peer_host
from monarch_kernel.errors import MeshError
from monarch_kernel.tensors import buffer_ops
from monarch_kernel.tensors.memory import (
    byte_view,
    copy_bytes,
    lookup,
    nbytes,
    register,
    registered,
    unregister,
)

__all__ = ["RDMABuffer", "registered", "unregister"]

#: seconds an operation waits for the owner by default
DEFAULT_TIMEOUT_S = 60.0


def _worker() -> Any:
    mod = sys.modules.get("monarch_kernel.worker.worker")
    w = getattr(mod, "current", None) if mod is not None else None
    if w is None:
        raise MeshError("RDMABuffer works on the ranks of a mesh: register, read, write and "
                        "drop buffers in actor endpoints or %%mesh cells (the controller can "
                        "only hold handles and pass them on)")
    return w


class RDMABuffer:
    """A handle to a tensor registered on a rank, readable and writable from
    other ranks (see the module docstring for how the bytes travel).

    Parameters
    ----------
    data : torch.Tensor, numpy.ndarray or writable buffer
        Contiguous, on the CPU or a CUDA device, at least one byte. Its
        memory is used in place (not copied) and kept alive until
        :meth:`drop`.

    Raises
    ------
    MeshError
        Outside the ranks of a mesh (in the controller): buffers live on
        ranks; the controller can hold and pass handles.
    ValueError
        If ``data`` is not contiguous, is empty or is on another device type.

    Notes
    -----
    The handle pickles to a few hundred bytes (id, owner rank and address,
    size): send it in any call or return value. From PyTorch Monarch's
    ``monarch.rdma.RDMABuffer``.
    """

    def __init__(self, data: Any) -> None:
        w = _worker()
        view = byte_view(data, "data", writable=True)
        size = nbytes(view)
        if size == 0:
            raise ValueError("cannot make an RDMABuffer of 0 bytes")
        host = peer_host(w)
        self._id = secrets.token_hex(8)
        self._rank = int(w.rank)
        self._address = host.address
        self._nbytes = size
        self._device = str(view.device) if hasattr(view, "numel") else "cpu"
        self._mesh = w.codec.fingerprint  # (which mesh: mesh_keys.check_known)
        register(self._id, data, view)

    # -------------------------------------------------------------- the handle
    def __reduce__(self) -> tuple:
        return (_rebuild, (self._id, self._rank, self._address, self._nbytes, self._device,
                           self._mesh))

    def __repr__(self) -> str:
        return (f"RDMABuffer({self._nbytes} bytes on rank {self._rank}, {self._device}, "
                f"id {self._id})")

    def size(self) -> int:
        """The buffer's size in bytes."""
        return self._nbytes

    @property
    def owner(self) -> int:
        """The rank that registered the buffer."""
        return self._rank

    @property
    def device(self) -> str:
        """Where the bytes live on the owner (``"cpu"``, ``"cuda:0"``, ...)."""
        return self._device

    # -------------------------------------------------------------- operations
    def read_into(self, dst: Any, *, timeout: float | None = DEFAULT_TIMEOUT_S) -> Future[int]:
        """Copy the buffer's bytes into ``dst``.

        Parameters
        ----------
        dst : torch.Tensor (CPU or CUDA), numpy.ndarray or writable buffer
            Contiguous, at least :meth:`size` bytes; its first ``size()``
            bytes are overwritten (raw bytes: give it the owner's dtype).
        timeout : float or None
            Seconds to wait for the owner; the future then fails with
            TimeoutError.

        Returns
        -------
        Future of int
            The number of bytes read, once they are in ``dst`` (CUDA copies
            are complete, not only queued). ``.get()`` or ``await`` it.

        Raises
        ------
        ValueError, TypeError
            At once, if ``dst`` is too small, not contiguous or not writable,
            or ``timeout`` is negative, NaN or not a number.
        MeshError
            Outside the ranks of a mesh. Through the future: MeshError if the
            buffer was dropped, MeshFailure if the owner died.
        """
        view = byte_view(dst, "dst", writable=True)
        n = nbytes(view)
        if n < self._nbytes:
            raise ValueError(f"dst has {n} bytes but the buffer holds {self._nbytes}: pass a "
                             f"tensor of at least {self._nbytes} bytes")
        return self._start("read", view[: self._nbytes], timeout)

    def write_from(self, src: Any, *, timeout: float | None = DEFAULT_TIMEOUT_S) -> Future[None]:
        """Copy ``src``'s bytes into the buffer (its first ``src`` bytes).

        Parameters
        ----------
        src : torch.Tensor (CPU or CUDA), numpy.ndarray or buffer
            Contiguous, at most :meth:`size` bytes.
        timeout : float or None
            Seconds to wait for the owner.

        Returns
        -------
        Future of None
            Done once the bytes are in the owner's tensor.

        Raises
        ------
        ValueError, TypeError
            At once, if ``src`` is too large or not contiguous, or ``timeout``
            is negative, NaN or not a number.
        MeshError
            Outside the ranks of a mesh; through the future as for
            :meth:`read_into`.
        """
        view = byte_view(src, "src", writable=False)
        n = nbytes(view)
        if n > self._nbytes:
            raise ValueError(f"src has {n} bytes but the buffer holds only {self._nbytes}: "
                             f"write a part of it (at most {self._nbytes} bytes), or register "
                             "a larger buffer")
        return self._start("write", view, timeout)

    def drop(self) -> Future[None]:
        """Release the owner's tensor: later reads and writes fail with
        MeshError. Dropping twice is harmless.

        Returns
        -------
        Future of None
        """
        w = self._worker_of_mesh()
        if self._is_owner(w):
            unregister(self._id)
            return Future.completed(None)
        return self._start("drop", None, None)

    # ---------------------------------------------------------------- plumbing
    def _worker_of_mesh(self) -> Any:
        """This worker, if it may reach the owner: a rank of the owner's mesh, or of
        another mesh of its program (:mod:`monarch_kernel.actor.mesh_keys`)."""
        w = _worker()
        check_known(w, self._mesh, repr(self))
        return w

    def _is_owner(self, w: Any) -> bool:
        return peer_host(w).address == self._address

    def _start(self, op: str, view: Any, timeout: float | None) -> Future[Any]:
        timeout = check_timeout(timeout)  # (as Future.get's: clear, and at once)
        w = self._worker_of_mesh()
        if self._is_owner(w):  # the owner itself: a plain copy
            try:
                reg = lookup(self._id, self._rank)[1]
                n = nbytes(view)
                copy_bytes(view, reg[:n]) if op == "read" else copy_bytes(reg[:n], view)
            except BaseException as e:  # noqa: BLE001 - reported through the future
                return Future.failed(e)
            return Future.completed(n if op == "read" else None)
        return buffer_ops.start(w, self, op, view, timeout)


def _rebuild(bid: str, rank: int, address: str, size: int, device: str,
             mesh: str) -> RDMABuffer:
    b = RDMABuffer.__new__(RDMABuffer)
    b._id, b._rank, b._address, b._nbytes, b._device = bid, rank, address, size, device
    b._mesh = mesh
    return b
