"""Serialization: cloudpickle with out-of-band buffers (pickle protocol 5).

Functions and classes defined in a notebook cell or in ``__main__`` travel by
value (cloudpickle). Large contiguous buffers -- numpy arrays, and torch
tensors, which are reduced to numpy arrays here because torch's own reducer
copies storages in-band -- are not copied into the pickle stream: they are
returned as separate buffers that :mod:`monarch_kernel.wire.protocol` sends as
their own frames (PEP 574).

Tensors keep their dtype, shape, ``requires_grad`` and device: a CUDA tensor
is rebuilt on a GPU of the receiver, never silently left on the CPU: on the
rank's own GPU when it has one (``--dist nccl`` assigns it,
:mod:`monarch_kernel.util.gpu`), else on the device of the same index when it
exists, else on the receiver's current device. A receiver without CUDA
refuses it with an error that says to send ``tensor.cpu()``.

How a CUDA tensor travels: to one process on the same host (the sender
says so with :func:`cuda_ipc`), a tensor of at least :data:`IPC_MIN_BYTES`
goes as a CUDA IPC handle of a device copy made at send time (a snapshot,
like staged bytes: ``torch.multiprocessing``'s reduction; the receiver maps
that copy, copies it device to device into memory of its own and lets go;
torch's IPC reference count keeps the sender's copy until then, and its
event orders the receiver's copy after the sender's). Otherwise it is
staged through host memory. ``MONARCH_CUDA_IPC=0`` turns the IPC route off.
torch's reduction is read through :mod:`monarch_kernel.wire.torch_ipc`, which
knows its layout (another torch's: the tensor is staged, with a warning).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import pickle
import pickletools
import re
import sys
import threading
import types
from collections.abc import Iterable, Iterator
from typing import Any

import cloudpickle

from monarch_kernel.errors import SerializationError
from monarch_kernel.util import gpu
from monarch_kernel.wire import torch_ipc

__all__ = ["PROTOCOL", "Packed", "dumps", "find_unpicklable", "load_failure", "loads"]

log = logging.getLogger("monarch_kernel.wire.serialize")

PROTOCOL = 5
#: buffers smaller than this are left in-band (a frame costs more than a copy)
OOB_THRESHOLD = 4096


#: CUDA tensors at least this large go by IPC handle to a receiver on this host
IPC_MIN_BYTES = 1 << 20
_ipc = threading.local()


def cuda_ipc(on: bool = True) -> contextlib.AbstractContextManager[None]:
    """A context: while active (in this thread), values pickled go to one process
    on this host, so large CUDA tensors may travel as CUDA IPC handles (see the
    module docstring). Nothing to do (a shared no-op context, on the hot path of
    every call) when ``on`` is False or torch is not loaded."""
    if not on or "torch" not in sys.modules or os.environ.get("MONARCH_CUDA_IPC") == "0":
        return _NO_IPC
    return _ipc_on()


_NO_IPC = contextlib.nullcontext()


@contextlib.contextmanager
def _ipc_on() -> Iterator[None]:
    prev = getattr(_ipc, "on", False)
    _ipc.on = True
    try:
        yield
    finally:
        _ipc.on = prev


def _target_device(torch: Any, device: str) -> str:
    """Where a tensor that lived on ``device`` (not the CPU) lands here."""
    if not device.startswith("cuda") or not torch.cuda.is_available():
        raise SerializationError(
            f"received a tensor that lived on {device!r}, but this process has no such "
            "device; move it to the CPU first (tensor.cpu()) if that is what you want"
        )
    index = gpu.assigned()  # a rank with its own GPU (--dist nccl): there
    if index is None:
        index = int(device.split(":")[1]) if ":" in device else 0
        if index >= torch.cuda.device_count():
            index = torch.cuda.current_device()
    return f"cuda:{index}"


def _rebuild_tensor(
    array: Any, dtype: Any, shape: tuple, device: str, requires_grad: bool, raw: bool
):
    import torch

    t = torch.from_numpy(_writable(array))
    if raw:
        t = t.view(dtype).reshape(shape)
    if device != "cpu":
        t = t.to(_target_device(torch, device), non_blocking=False)
    if requires_grad:
        t.requires_grad_(True)
    return t


def _rebuild_cuda_ipc(args: tuple, device: str, requires_grad: bool):
    """A copy, in this process's memory, of a CUDA tensor sent as an IPC handle."""
    import torch

    try:
        target = _target_device(torch, device)
    except SerializationError:  # no GPU here: still let the sender free its block
        release_ipc_reference(args)
        raise
    alias = torch_ipc.rebuild(args)  # the sender's memory (waits for its event)
    try:
        t = alias.to(target, copy=True)
        # copied before the sender may reuse its block (the copy's streams only: this
        # may run in an I/O thread, which must never wait for, say, NCCL's work)
        torch.cuda.current_stream(t.device).synchronize()
        if alias.device != t.device:
            torch.cuda.current_stream(alias.device).synchronize()
    finally:
        del alias  # releases torch's IPC reference: the sender may free the block
    if requires_grad:
        t.requires_grad_(True)
    return t


def _writable(array: Any) -> Any:
    if not array.flags.writeable:
        array = array.copy()
    return array


_NUMPY_DTYPES: set[str] = {
    "float64", "float32", "float16", "int64", "int32", "int16", "int8", "uint8", "bool",
    "complex64", "complex128",
}


def release_ipc_reference(args: tuple) -> None:
    """Give back the reference a CUDA IPC handle holds on the sender's memory
    without opening it (as ``rebuild_cuda_tensor`` does for a cached handle);
    best effort: only the shared reference-count file is touched."""
    try:
        torch_ipc.release(args)
    except Exception:  # noqa: BLE001, S110 - the sender then keeps the block until it exits
        pass


_ipc_layout_warned: list[bool] = []


def _reduce_cuda_ipc(t: Any) -> tuple | None:
    """The IPC-handle reduction of a CUDA tensor, or None (then it is staged)."""
    try:
        # a copy of its own: the receiver copies when the message arrives, and what the
        # sender does to its tensor meanwhile must not show (the message is a snapshot,
        # as when staged); the copy is freed once the receiver let go of the handle
        args = torch_ipc.reduce(t.detach().clone())
    except torch_ipc.CudaIpcLayoutError as e:  # another torch: stage it, and say why once
        if not _ipc_layout_warned:
            _ipc_layout_warned.append(True)
            log.warning("CUDA tensors are staged through host memory: %s", e)
        return None
    except Exception:  # noqa: BLE001 - no IPC for this tensor (or this build): stage it
        return None
    return (_rebuild_cuda_ipc, (args, str(t.device), bool(t.requires_grad)))


def _reduce_tensor(t: Any) -> tuple:
    import torch

    if (t.device.type == "cuda" and getattr(_ipc, "on", False)
            and t.numel() * t.element_size() >= IPC_MIN_BYTES):
        reduced = _reduce_cuda_ipc(t)
        if reduced is not None:
            _ipc.count = getattr(_ipc, "count", 0) + 1
            return reduced
    device = str(t.device)
    requires_grad = bool(t.requires_grad)
    cpu = t.detach()
    if cpu.device.type != "cpu":
        cpu = cpu.cpu()
    cpu = cpu.contiguous()
    raw = str(cpu.dtype).replace("torch.", "") not in _NUMPY_DTYPES or cpu.is_conj()
    # raw (bfloat16, float8, ..., or a conjugate view): ship the raw bytes
    array = cpu.resolve_conj().reshape(-1).view(torch.uint8).numpy() if raw else cpu.numpy()
    return (_rebuild_tensor, (array, cpu.dtype, tuple(cpu.shape), device, requires_grad, raw))


def _rebuild_code(args: tuple, filename: str) -> types.CodeType:
    return types.CodeType(*args).replace(co_filename=filename)


class _Pickler(cloudpickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        torch = sys.modules.get("torch")
        if torch is not None and type(obj) is torch.Tensor and obj.layout == torch.strided:
            return _reduce_tensor(obj)
        if type(obj) is types.CodeType:
            # cloudpickle writes "<dynamic-code>" as the file name of code shipped by
            # value; keep the real one, so remote tracebacks can show the source lines
            # (of notebook cells, of __main__ scripts: the actor module ships them)
            _, args = self.dispatch_table[types.CodeType](obj)
            return (_rebuild_code, (args, obj.co_filename))
        if isinstance(obj, _FILES) and obj not in (sys.stdout, sys.stderr, sys.stdin):
            # cloudpickle would read a text file to its end (forever for /dev/zero or a
            # pipe) and send a StringIO copy: refuse, and say what to send instead
            raise TypeError(f"cannot send an open file ({getattr(obj, 'name', '?')!r}); "
                            "send its contents or its path")
        return super().reducer_override(obj)


_FILES = (io.TextIOWrapper, io.BufferedReader, io.BufferedWriter, io.BufferedRandom, io.FileIO)


def dumps(obj: Any) -> tuple[bytes, list[memoryview]]:
    """Pickle ``obj``; large buffers are returned separately.

    Parameters
    ----------
    obj : Any

    Returns
    -------
    payload : bytes
        The pickle stream (protocol 5).
    buffers : list of memoryview
        Out-of-band buffers, in the order :func:`loads` needs them.

    Raises
    ------
    SerializationError
        If ``obj`` (or something inside it) cannot be pickled; the message
        names the value's type.
    """
    if obj is OK_NONE:  # the reply of most calls: pickled once
        return OK_NONE_PAYLOAD, []
    if _plain(obj, 3):  # nothing cloudpickle must see: the C pickler alone is much faster
        return pickle.dumps(obj, protocol=PROTOCOL), []
    buffers: list[memoryview] = []

    def callback(buf: pickle.PickleBuffer) -> bool:
        view = buf.raw()
        if view.nbytes < OOB_THRESHOLD:
            return True  # keep small buffers in-band
        buffers.append(view)
        return False

    f = io.BytesIO()
    try:
        _Pickler(f, protocol=PROTOCOL, buffer_callback=callback).dump(obj)
    except Exception as e:  # pickling raises many types (TypeError, PicklingError, ...)
        raise SerializationError(
            f"cannot send a value of type {type(obj).__module__}.{type(obj).__qualname__}: "
            f"{type(e).__name__}: {e}"
        ) from e
    return f.getvalue(), buffers


class Packed:
    """A value pickled by :func:`dumps`, carried inside a message.

    Large buffers (arrays, tensors) and a large pickle stream stay out of
    band: they travel as their own frames, not copied into the pickle. A value
    that holds CUDA IPC handles (``ipc``) is unpickled as soon as it arrives,
    not when first asked for: the sender's GPU memory is held until then.
    """

    __slots__ = ("_value", "buffers", "ipc", "payload")

    def __init__(self, payload: Any, buffers: list[Any] | tuple = (), ipc: bool = False) -> None:
        self.payload = payload
        self.buffers = buffers
        self.ipc = ipc
        if ipc:  # (only on the receiving side: see pack)
            try:
                self._value = (True, loads(payload, buffers))
            except BaseException as e:  # noqa: BLE001 - raised by unpack, where it is asked for
                self._value = (False, e)

    @classmethod
    def pack(cls, obj: Any) -> Packed:
        """Pickle ``obj`` now (raises SerializationError)."""
        if obj is None and cls is Packed:
            return _PACKED_NONE  # the value of most endpoints: made once
        before = getattr(_ipc, "count", 0)
        p = cls(*dumps(obj))
        p.ipc = getattr(_ipc, "count", 0) != before
        return p

    def unpack(self) -> Any:
        """Unpickle (raises SerializationError)."""
        if self.ipc and hasattr(self, "_value"):
            ok, value = self._value
            if not ok:
                raise value
            return value
        if self.payload == _NO_ARGS:  # an endpoint called without arguments
            return (), {}
        if self.payload == _NONE:  # the value of most endpoints
            return None
        return loads(self.payload, self.buffers)

    def __reduce__(self) -> tuple:
        args: tuple = (pickle.PickleBuffer(self.payload),
                       [pickle.PickleBuffer(b) for b in self.buffers])
        return (Packed, (*args, True) if self.ipc else args)


_ATOMS = frozenset({type(None), bool, int, float, str, bytes})
_PACKED_NONE = Packed(pickle.dumps(None, protocol=PROTOCOL))
_NO_ARGS = pickle.dumps(((), {}), protocol=PROTOCOL)
_NONE = _PACKED_NONE.payload
#: the content of a reply whose value is None (most endpoints'), and its pickle:
#: sent and read without pickling (a shared dict: nobody may change it)
OK_NONE: dict[str, Any] = {"status": "ok", "value": _PACKED_NONE}
OK_NONE_PAYLOAD = pickle.dumps(OK_NONE, protocol=PROTOCOL)


def reply_content(status: str, value: Any) -> dict[str, Any]:
    """The content of a reply message: :data:`OK_NONE` for an ok ``None``
    (``Packed.pack(None)``), which :func:`dumps` sends without pickling."""
    if status == "ok" and value is _PACKED_NONE:
        return OK_NONE
    return {"status": status, "value": value}


def _plain(obj: Any, depth: int) -> bool:
    """True when ``obj`` is built only of atoms, small containers and
    :class:`Packed` values without out-of-band buffers (the control
    messages of the hot path: call and reply envelopes, ids, names)."""
    t = type(obj)
    if t in _ATOMS:
        return t is not bytes or len(obj) < OOB_THRESHOLD
    if t is Packed:  # a large payload goes out of band, through the full pickler
        return not obj.buffers and len(obj.payload) < OOB_THRESHOLD
    if depth <= 0:
        return False
    if t is dict:
        return len(obj) <= 16 and all(type(k) is str and _plain(v, depth - 1)
                                      for k, v in obj.items())
    if t is tuple or t is list:
        return len(obj) <= 64 and all(_plain(v, depth - 1) for v in obj)
    return False


def loads(payload: bytes | memoryview, buffers: Iterable[Any] = ()) -> Any:
    """Unpickle what :func:`dumps` produced.

    Raises
    ------
    SerializationError
        If the stream cannot be unpickled here (a module missing on this side,
        a corrupt stream, ...).
    """
    try:
        return pickle.loads(payload, buffers=buffers)
    except Exception as e:
        raise SerializationError(
            f"cannot unpickle a received value: {type(e).__name__}: {e}"
        ) from e


# ------------------------------------------------------ what cannot be sent, in words
#: how deep :func:`find_unpicklable` walks into a value, and how many parts it tries
FIND_DEPTH = 12
FIND_TRIES = 400


def _qual(t: type) -> str:
    mod = getattr(t, "__module__", "") or ""
    return t.__qualname__ if mod in ("builtins", "__main__") else f"{mod}.{t.__qualname__}"


def _code_names(co: types.CodeType) -> set[str]:
    """The global names ``co`` (and the code nested in it) may read."""
    names = set(co.co_names)
    for c in co.co_consts:
        if isinstance(c, types.CodeType):
            names |= _code_names(c)
    return names


def _parts(obj: Any) -> Iterator[tuple[str, Any]]:
    """``(path suffix, part)`` of what pickling ``obj`` pickles too."""
    if isinstance(obj, dict):
        for k, v in list(obj.items()):
            yield f"[{k!r}]", v
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield f"[{i}]", v
    elif isinstance(obj, (set, frozenset)):
        for v in list(obj):
            yield f" item {v!r}" if type(v) in _ATOMS else " item", v
    elif isinstance(obj, types.FunctionType):
        for i, cell in enumerate(obj.__closure__ or ()):
            try:
                yield f".__closure__[{i}].cell_contents", cell.cell_contents
            except ValueError:  # an empty cell
                continue
        g = obj.__globals__
        for n in sorted(_code_names(obj.__code__)):
            if n in g:
                yield f".__globals__[{n!r}]", g[n]
        for i, v in enumerate(obj.__defaults__ or ()):
            yield f".__defaults__[{i}]", v
        for k, v in (obj.__kwdefaults__ or {}).items():
            yield f".__kwdefaults__[{k!r}]", v
        for k, v in vars(obj).items():
            yield f".{k}", v
    elif isinstance(obj, types.MethodType):
        yield ".__self__", obj.__self__
        yield ".__func__", obj.__func__
    elif isinstance(obj, type):
        for k, v in list(vars(obj).items()):
            if not (k.startswith("__") and k.endswith("__")):
                yield f".{k}", v
    else:
        d = getattr(obj, "__dict__", None)
        if isinstance(d, dict):
            for k, v in list(d.items()):
                yield f".{k}", v
        for k in getattr(type(obj), "__slots__", ()) or ():
            if isinstance(k, str) and hasattr(obj, k):
                yield f".{k}", getattr(obj, k)


def _pickle_error(obj: Any) -> BaseException | None:
    try:
        dumps(obj)
    except SerializationError as e:
        return e.__cause__ or e
    except Exception as e:  # noqa: BLE001 - whatever the pickler raised
        return e
    return None


def find_unpicklable(obj: Any, name: str) -> tuple[str, str, str] | None:
    """Which part of ``obj`` cannot be pickled, and why.

    Walks what pickling ``obj`` pickles (dict items, list and tuple items,
    attributes, a function's closure cells, the globals it reads and its
    defaults, a method's object), at most :data:`FIND_DEPTH` deep and
    :data:`FIND_TRIES` parts in all, down to the innermost part that fails.

    Returns
    -------
    (path, type, reason) or None
        ``("f.__closure__[0].cell_contents", "_thread.lock", "cannot pickle
        '_thread.lock' object")``, the path starting at ``name``; None when
        ``obj`` pickles.
    """
    err = _pickle_error(obj)
    if err is None:
        return None
    path, seen, tries = name, {id(obj)}, [FIND_TRIES]
    for _ in range(FIND_DEPTH):
        for suffix, part in _parts(obj):
            if tries[0] <= 0 or id(part) in seen:
                continue
            tries[0] -= 1
            sub = _pickle_error(part)
            if sub is not None:
                seen.add(id(part))
                obj, err, path = part, sub, path + suffix
                break
        else:
            break
    reason = str(err) or type(err).__name__
    return path, _qual(type(obj)), reason


_STRINGS = frozenset({"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE"})
_GETS = frozenset({"BINGET", "LONG_BINGET", "GET"})


def _globals_in(payload: Any) -> list[tuple[str, str]]:
    """The ``(module, name)`` globals a pickle stream refers to (best effort)."""
    out: list[tuple[str, str]] = []
    memo: dict[Any, Any] = {}
    recent: list[Any] = []
    try:
        for op, arg, _ in pickletools.genops(bytes(payload)):
            n = op.name
            if n in _STRINGS:
                recent.append(arg)
            elif n in _GETS:
                recent.append(memo.get(arg))
            elif n == "MEMOIZE":
                memo[len(memo)] = recent[-1] if recent else None
            elif n in ("PUT", "BINPUT", "LONG_BINPUT"):
                memo[arg] = recent[-1] if recent else None
            elif n == "STACK_GLOBAL":
                if len(recent) >= 2 and all(isinstance(x, str) for x in recent[-2:]):
                    out.append((recent[-2], recent[-1]))
                recent = []
            elif n == "GLOBAL" and isinstance(arg, str) and " " in arg:
                mod, _, qual = arg.partition(" ")
                out.append((mod, qual))
                recent = []
            else:
                recent = []
    except Exception:  # noqa: BLE001, S110 - a partial list is still useful
        pass
    return out


_NO_ATTRIBUTE = re.compile(r"Can't get attribute '([^']+)' on <module '([^']+)'")


def load_failure(e: BaseException, payload: Any = b"", where: str = "here") -> str:
    """Why a value does not unpickle ``where`` (``"on the ranks"``), in words: the
    class it needs that is missing (``payload``, its pickle stream, tells which class
    of a missing module), else the error's own text."""
    cause = e.__cause__ if isinstance(e, SerializationError) and e.__cause__ else e
    if isinstance(cause, ModuleNotFoundError) and cause.name:
        mod = cause.name
        used = [f"{m}.{q}" for m, q in _globals_in(payload)
                if m == mod or m.startswith(mod + ".")]
        what = f"class {used[0]}" if used else "it"
        return (f"{what} comes from module {mod!r}, which cannot be imported {where} (a "
                f"file next to the notebook? put its directory on sys.path {where}, or "
                "define the class in a %%mesh cell)")
    if isinstance(cause, AttributeError):
        m = _NO_ATTRIBUTE.search(str(cause))
        if m:
            cls, mod = m.group(1), m.group(2)
            inside = "" if mod == "__main__" else f" (module {mod!r})"
            return (f"class {cls} is not defined {where}{inside} (defined in a notebook "
                    "cell? run it with %%mesh first)")
    return f"{type(cause).__name__}: {cause}"
