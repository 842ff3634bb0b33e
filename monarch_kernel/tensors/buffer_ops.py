"""How an :class:`~monarch_kernel.tensors.buffer.RDMABuffer` operation travels.

The reader (or writer) sends a ``buffer`` message to the owner's peer socket
(:mod:`monarch_kernel.actor.peers`); the owner's peer I/O thread answers it
with :func:`serve` (or, while one waits in the owner's poll, the thread
that leads its I/O: an idle actor's, a caller's waiting for a reply; see
:mod:`monarch_kernel.worker.io`), so no busy actor or cell of the owner
takes part. Content::

    {"op": "read" | "write" | "drop", "id": buffer id, "n": bytes,
     "m": "ipc" | "shm" | "band", "shm": file name, "data": array}

(:class:`monarch_kernel.wire.messages.Buffer`). ``m`` is the route: ``ipc``
asks for a fresh CUDA IPC handle of the owner's tensor (the reader then
copies device to device itself); ``shm``
names a pooled shared-memory file of the reader's, which the owner fills
(read) or empties (write); ``band`` carries the bytes in the messages
themselves. The reply is ``{"status": "ok" | "error", "value": ...}``.
The reader finishes the operation (its copy) in the thread that reads the
reply (its peer I/O thread, or its leading thread), and completes the
operation's future.
"""

from __future__ import annotations

import heapq
import logging
import sys
import threading
import time
from typing import Any

from monarch_kernel.wire import shm as _shm
from monarch_kernel.actor import peers as actor_peers
from monarch_kernel.actor.peers import address_host, peer_host
from monarch_kernel.tensors.memory import byte_view, copy_bytes, is_cuda, lookup, nbytes, unregister
from monarch_kernel.errors import MeshError
from monarch_kernel.actor.future import Future
from monarch_kernel.wire.serialize import release_ipc_reference
from monarch_kernel.wire.messages import BUF_NBYTES, BUF_ROUTE, Buffer, Reply
from monarch_kernel.wire import torch_ipc

log = logging.getLogger("monarch_kernel.tensors.buffer")

#: pooled shared-memory files this process lends to owners (same host, CPU routes)
_pool = _shm.Pool(max_bytes=4 << 30)
#: operations this process started, by route (``ipc``, ``shm``, ``band``)
routes: dict[str, int] = {"ipc": 0, "shm": 0, "band": 0}
#: set once an owner refused CUDA IPC (another container, a driver that forbids
#: it): later CUDA operations of this process take the staged route at once
_ipc_refused = False


def _route(host: Any, buf: Any) -> str:
    same = address_host(host.address) == address_host(buf._address)
    if same and buf._device.startswith("cuda") and not _ipc_refused:
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available():
            return "ipc"
    if same and _shm.available():
        return "shm"
    return "band"


class _Op:
    """One operation in flight (reader side)."""

    __slots__ = ("buf", "deadline", "future", "lease", "lock", "n", "op", "route", "state",
                 "view")

    def __init__(self, buf: Any, op: str, view: Any, route: str) -> None:
        self.buf, self.op, self.view, self.route = buf, op, view, route
        self.n = nbytes(view) if view is not None else 0
        self.future: Future[Any] = Future()
        self.lease: tuple[str, Any] | None = None
        self.deadline: list[Any] | None = None  # its entry in _deadlines
        # "pending" until the reply is acted on ("copying"), or the timer fires first
        # ("expired"): a copy into dst never starts after a TimeoutError was reported
        self.state = "pending"
        self.lock = threading.Lock()


def start(worker: Any, buf: Any, op: str, view: Any, timeout: float | None) -> Future[Any]:
    """Send operation ``op`` of ``buf`` to its owner (see the module docstring);
    the returned future completes when the reply has been acted on."""
    host = peer_host(worker)
    o = _Op(buf, op, view, _route(host, buf) if op != "drop" else "band")
    if timeout is not None:
        o.deadline = _deadlines.add(timeout, lambda: _expire(o, timeout))
    _send(host, o)
    return o.future


def _send(host: Any, o: _Op) -> None:
    buf = o.buf
    routes[o.route] += 1
    content: Buffer = {"op": o.op, "id": buf._id, BUF_NBYTES: o.n, BUF_ROUTE: o.route}
    try:
        if o.route == "shm" and o.op != "drop":
            try:
                o.lease = _pool.lease(o.n)
            except OSError as e:  # /dev/shm full (a container's is often 64 MiB)
                log.info("no shared memory for %d bytes (%s): sending them in-band", o.n, e)
            if o.lease is None:  # the pool is full: send the bytes in the messages
                o.route = content[BUF_ROUTE] = "band"
            else:
                content["shm"] = o.lease[0]
                if o.op == "write":
                    import numpy as np

                    dst = np.frombuffer(o.lease[1], np.uint8, count=o.n)
                    copy_bytes(dst, o.view)
                    del dst
        if o.route == "band" and o.op != "drop" and o.n > host.codec.max_buffers:
            raise ValueError(
                f"RDMABuffer {o.op} of {o.n} bytes: without shared memory between the two "
                f"ranks (another host, or /dev/shm full) the bytes go in one message, and "
                f"the mesh's limit is {host.codec.max_buffers} bytes; {o.op} it in parts "
                "(views of at most that size, one RDMABuffer each)")
        if o.route == "band" and o.op == "write":
            content["data"] = _to_numpy(o.view)
        req = host.request([buf._rank], {buf._rank: buf._address}, content, oneway=False,
                           type="buffer", mesh=buf._mesh)
    except BaseException as e:  # noqa: BLE001 - the owner is dead, /dev/shm is full, ...
        _done(o, e)
        return
    assert req is not None
    req.add_done_callback(lambda r: _finish(host, o, r))


def _to_numpy(view: Any) -> Any:
    if hasattr(view, "numel"):  # a torch uint8 view
        return view.cpu().numpy() if is_cuda(view) else view.numpy()
    return view


def _finish(host: Any, o: _Op, req: Any) -> None:
    """The owner answered (in the thread of this process that read the reply)."""
    global _ipc_refused
    with o.lock:
        expired = o.state == "expired"
        if not expired:
            o.state = "copying"
    if expired:
        if o.route == "ipc" and req.failure is None and o.op != "drop":
            status, value = req.replies.get(o.buf._rank, ("error", None))
            if status == "ok" and value is not None:  # a handle never opened: let it go
                release_ipc_reference(value)
        _release(o)
        return
    rank = o.buf._rank
    try:
        if req.failure is not None:
            raise req.failure
        status, value = req.replies[rank]
        if status != "ok":
            if value.get("code") == "noipc" and o.route == "ipc":
                log.warning("rank %d refused CUDA IPC (%s); staging through host memory",
                            rank, value.get("message"))
                _ipc_refused = True
                o.route = "shm" if _shm.available() else "band"
                with o.lock:
                    o.state = "pending"
                _send(host, o)
                return
            raise _ERRORS.get(value.get("type"), RuntimeError)(
                value.get("message", "the owner refused the operation"))
        if o.op == "read":
            if o.route == "ipc":
                _ipc_copy(o, value)
            elif o.route == "shm":
                import numpy as np

                assert o.lease is not None
                src = np.frombuffer(o.lease[1], np.uint8, count=o.n)
                copy_bytes(o.view, src)
                del src
            else:
                copy_bytes(o.view, value)
        elif o.op == "write" and o.route == "ipc":
            _ipc_copy(o, value)
    except BaseException as e:  # noqa: BLE001 - reported through the future
        _done(o, e)
        return
    _done(o, None, o.n if o.op == "read" else None)


def _ipc_copy(o: _Op, args: tuple) -> None:
    alias = torch_ipc.rebuild(args)  # the owner's bytes, mapped into this process
    try:
        if o.op == "read":
            copy_bytes(o.view, alias[: o.n])
        else:
            copy_bytes(alias[: o.n], o.view)
    finally:
        del alias


def _done(o: _Op, error: BaseException | None, value: Any = None) -> None:
    if o.deadline is not None:
        _deadlines.cancel(o.deadline)
    _release(o)
    o.view = None
    if error is not None:
        o.future.set_exception(error)
    else:
        o.future.set_result(value)


def _release(o: _Op) -> None:
    lease, o.lease = o.lease, None
    if lease is not None:  # a timed-out owner may still write into it: never reuse it
        _pool.release(lease[0], discard=o.state == "expired")


class _Deadlines:
    """One thread that runs callbacks when their deadlines pass (a
    ``threading.Timer`` per operation would start a thread each time, as
    costly as a small read). Operations that finish first cancel
    theirs; cancelled entries are dropped when they come up, or all at once
    when they are most of the heap."""

    def __init__(self) -> None:
        self._heap: list[list[Any]] = []  # [deadline, seq, callback or None]
        self._cancelled = 0
        self._cond = threading.Condition()
        self._seq = 0
        self._thread: threading.Thread | None = None

    def add(self, delay: float, fn: Any) -> list[Any]:
        """Run ``fn()`` in ``delay`` seconds; returns the entry for :meth:`cancel`."""
        with self._cond:
            self._seq += 1
            entry = [time.monotonic() + delay, self._seq, fn]
            heapq.heappush(self._heap, entry)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="monarch-rdma-timeouts",
                                                daemon=True)
                self._thread.start()
            elif self._heap[0] is entry:  # the new earliest: wake the thread
                self._cond.notify()
        return entry

    def cancel(self, entry: list[Any]) -> None:
        with self._cond:
            if entry[2] is None:
                return
            entry[2] = None
            self._cancelled += 1
            if self._heap and self._heap[0] is entry:  # the thread waits for it: wake it
                self._cond.notify()
            if self._cancelled > 1024 and self._cancelled * 2 > len(self._heap):
                self._heap = [e for e in self._heap if e[2] is not None]
                heapq.heapify(self._heap)
                self._cancelled = 0

    #: seconds the thread waits with nothing to do before it ends (add starts a new one)
    IDLE_S = 30.0

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    while self._heap and self._heap[0][2] is None:  # cancelled: drop it
                        heapq.heappop(self._heap)
                        self._cancelled = max(0, self._cancelled - 1)
                    if self._heap and self._heap[0][0] <= time.monotonic():
                        break
                    if not self._heap:
                        if not self._cond.wait(self.IDLE_S) and not self._heap:
                            self._thread = None  # idle: end (under the lock add takes)
                            return
                        continue
                    self._cond.wait(self._heap[0][0] - time.monotonic())
                entry = heapq.heappop(self._heap)
                fn, entry[2] = entry[2], None
                if fn is None:
                    self._cancelled = max(0, self._cancelled - 1)
                    continue
            try:
                fn()
            except Exception:
                log.exception("an RDMABuffer timeout callback failed")


_deadlines = _Deadlines()


def _expire(o: _Op, timeout: float) -> None:
    with o.lock:
        if o.state != "pending":  # the reply is being acted on: it will complete
            return
        o.state = "expired"
    o.future.set_exception(TimeoutError(
        f"RDMABuffer {o.op} of {o.n} bytes: rank {o.buf._rank} did not answer within "
        f"{timeout:g} s (pass a larger timeout=, or check the rank with %mesh status)"))


# --------------------------------------------------------------- owner side
def serve(host: Any, msg: Any) -> None:
    """Answer a ``buffer`` message (the thread that read it: the owner's peer I/O
    thread, or the thread leading its I/O, :mod:`monarch_kernel.worker.io`)."""
    c: Buffer = msg.content
    try:
        value = _serve(c, host.rank)
        reply: Reply = {"status": "ok", "value": value}
    except _NoIpc as e:
        reply = {"status": "error", "value": {"type": "RuntimeError", "message": str(e),
                                             "code": "noipc"}}
    except Exception as e:  # noqa: BLE001 - any failure goes back to the reader
        text = str(e) if f"rank {host.rank}" in str(e) else f"rank {host.rank}: {e}"
        reply = {"status": "error", "value": {"type": type(e).__name__, "message": text}}
    try:
        frames = host.codec.encode("reply", reply, parent=msg.id)
    except Exception as e:  # noqa: BLE001 - cannot happen for arrays; never leave a reader waiting
        frames = host.codec.encode("reply", {"status": "error", "value": {
            "type": "RuntimeError", "message": f"rank {host.rank}: {e}"}}, parent=msg.id)
    host.reply_to(msg.identity, frames)


class _NoIpc(RuntimeError):
    pass


#: the owner's exception types, by name, raised again on the reader's side
_ERRORS: dict[str, type[Exception]] = {
    "MeshError": MeshError, "ValueError": ValueError, "TypeError": TypeError,
    "OSError": OSError, "FileNotFoundError": OSError, "RuntimeError": RuntimeError,
    "SerializationError": RuntimeError}


def _serve(c: Buffer, rank: int) -> Any:
    op, route = c["op"], c.get(BUF_ROUTE)
    if op == "drop":
        unregister(c["id"])
        return None
    if op not in ("read", "write"):
        raise ValueError(f"unknown buffer operation {op!r}")
    reg = lookup(c["id"], rank)[1]
    n = int(c[BUF_NBYTES])
    if not 0 <= n <= nbytes(reg):
        raise ValueError(f"{n} bytes asked of a buffer of {nbytes(reg)}")
    if route == "ipc":
        if not is_cuda(reg):
            raise ValueError("CUDA IPC asked for a buffer that is not on a GPU")
        try:
            return torch_ipc.reduce(reg)
        except Exception as e:
            raise _NoIpc(f"CUDA IPC unavailable on rank {rank}: {e}") from e
    if route == "shm":
        import numpy as np

        mm = _shm.map_writable(c["shm"], n)
        view = np.frombuffer(mm, np.uint8, count=n)
        try:
            copy_bytes(view, reg[:n]) if op == "read" else copy_bytes(reg[:n], view)
        finally:
            del view
        return None
    if op == "read":
        return _to_numpy(reg[:n])
    data = byte_view(c["data"], "data", writable=False)
    if nbytes(data) != n:
        raise ValueError(f"write of {n} bytes carried {nbytes(data)}")
    copy_bytes(reg[:n], data)
    return None


__all__ = ["serve", "start"]


actor_peers.register_handler("buffer", serve)  # an RDMABuffer operation: answered right here
