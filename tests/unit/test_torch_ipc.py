"""The guarded accessor of torch's CUDA IPC reduction (runs on CPU: synthetic tuples
of the layout torch 2.x's reduce_tensor makes for a CUDA tensor)."""

from __future__ import annotations

import pytest

from monarch_kernel.errors import SerializationError
from monarch_kernel.wire import torch_ipc
from monarch_kernel.wire.torch_ipc import REBUILD_ARGS, CudaIpcArgs, CudaIpcLayoutError

pytestmark = pytest.mark.timeout(60)


class _Storage:
    released: list[tuple] = []

    @classmethod
    def _release_ipc_counter(cls, handle, offset, device=None):
        cls.released.append((handle, offset, device))


def _synthetic(**over):
    """The tuple reduce_tensor returns with rebuild_cuda_tensor (torch 2.x), in
    torch's order, with recognizable values."""
    values = {
        "tensor_cls": "Tensor", "tensor_size": (4, 4), "tensor_stride": (4, 1),
        "tensor_offset": 0, "storage_cls": _Storage, "dtype": "float32",
        "storage_device": 1, "storage_handle": b"handle", "storage_size_bytes": 64,
        "storage_offset_bytes": 512, "requires_grad": False,
        "ref_counter_handle": b"/torch_123_counter", "ref_counter_offset": 7,
        "event_handle": b"event", "event_sync_required": True,
    }
    values.update(over)
    return tuple(values[name] for name in REBUILD_ARGS)


def test_fields_by_name():
    a = CudaIpcArgs.of(_synthetic())
    assert a.storage_cls is _Storage
    assert a.storage_device == 1
    assert a.ref_counter_handle == b"/torch_123_counter"
    assert a.ref_counter_offset == 7
    assert a.field("storage_offset_bytes") == 512
    with pytest.raises(KeyError):
        a.field("no_such_field")


def test_release_gives_back_the_reference():
    _Storage.released.clear()
    torch_ipc.release(_synthetic())
    assert _Storage.released == [(b"/torch_123_counter", 7, 1)]


@pytest.mark.parametrize("bad", [_synthetic()[:13], _synthetic() + (None,), [1] * 15, None])
def test_unknown_shape_is_a_clear_error(bad):
    with pytest.raises(CudaIpcLayoutError, match="knows the layout of torch 2.x") as e:
        CudaIpcArgs.of(bad)
    assert isinstance(e.value, SerializationError)
    assert "MONARCH_CUDA_IPC=0" in str(e.value)
    with pytest.raises(CudaIpcLayoutError):
        torch_ipc.release(bad)
    with pytest.raises(CudaIpcLayoutError):
        torch_ipc.rebuild(bad)


def test_installed_torch_has_the_known_layout():
    """torch's rebuild_cuda_tensor takes REBUILD_ARGS in order (fails on a torch
    upgrade that changes the layout: then update REBUILD_ARGS and the accessor)."""
    pytest.importorskip("torch")
    torch_ipc.check_torch()


def test_reduce_checks_what_torch_returns(monkeypatch):
    reductions = pytest.importorskip("torch.multiprocessing.reductions")
    monkeypatch.setattr(reductions, "reduce_tensor",
                        lambda t: (reductions.rebuild_cuda_tensor, _synthetic()))
    assert torch_ipc.reduce(object()) == _synthetic()
    monkeypatch.setattr(reductions, "reduce_tensor",
                        lambda t: (reductions.rebuild_cuda_tensor, _synthetic()[:12]))
    with pytest.raises(CudaIpcLayoutError, match="gave a tuple of 12"):
        torch_ipc.reduce(object())
    monkeypatch.setattr(reductions, "reduce_tensor", lambda t: (print, ()))
    with pytest.raises(CudaIpcLayoutError, match="not rebuild_cuda_tensor"):
        torch_ipc.reduce(object())


def test_changed_torch_signature_is_a_clear_error(monkeypatch):
    reductions = pytest.importorskip("torch.multiprocessing.reductions")

    def rebuild_cuda_tensor(tensor_cls, tensor_size):  # another torch's
        raise AssertionError("not called")

    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", rebuild_cuda_tensor)
    monkeypatch.setattr(torch_ipc, "_checked", [])
    with pytest.raises(CudaIpcLayoutError, match="rebuild_cuda_tensor takes"):
        torch_ipc.rebuild(_synthetic())
