"""The wire format: signing, replay, limits, out-of-band buffers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from monarch_kernel import protocol, serialize
from monarch_kernel.errors import ProtocolError, SerializationError


def pair(**kw):
    key = protocol.new_key()
    return protocol.Codec(key, "ctl", **kw), protocol.Codec(key, "r0", **kw)


def test_round_trip_keeps_types_and_ids():
    a, b = pair()
    frames = a.encode("execute", {"code": "1+1", "n": 3}, parent="p1")
    m = b.decode(frames)
    assert (m.type, m.parent, m.sender) == ("execute", "p1", "ctl")
    assert m.content == {"code": "1+1", "n": 3}
    assert frames[0] == protocol.MAGIC and len(frames[1]) == 64


def test_large_arrays_travel_out_of_band_without_copy_into_pickle():
    a, b = pair()
    t = torch.arange(1 << 20, dtype=torch.float32)
    arr = np.ones(1 << 18)
    frames = a.encode("push", {"t": t, "a": arr})
    payload = frames[3]
    assert len(frames) == 6  # magic, sig, header, payload, 2 buffers
    assert len(payload) < 4096  # the data is not in the pickle stream
    m = b.decode(frames)
    assert torch.equal(m.content["t"], t) and m.content["t"].dtype == torch.float32
    np.testing.assert_array_equal(m.content["a"], arr)


def test_tensor_dtypes_without_numpy_equivalent():
    a, b = pair()
    t = torch.randn(5000).to(torch.bfloat16).reshape(50, 100)
    got = b.decode(a.encode("push", t)).content
    assert got.dtype == torch.bfloat16 and got.shape == (50, 100) and torch.equal(got, t)
    g = torch.ones(3, requires_grad=True)
    assert b.decode(a.encode("push", g)).content.requires_grad


def test_wrong_key_is_rejected_before_unpickling(tmp_path):
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    other = protocol.Codec(protocol.new_key(), "ctl")
    _, b = pair()
    with pytest.raises(ProtocolError, match="signature"):
        b.decode(other.encode("execute", Evil()))
    assert not marker.exists()


def test_tampered_replayed_and_truncated_frames_are_rejected():
    a, b = pair()
    frames = [bytes(f) for f in a.encode("execute", {"code": "x"})]
    tampered = list(frames)
    tampered[3] = tampered[3][:-1] + b"\x00"
    with pytest.raises(ProtocolError, match="signature"):
        b.decode(tampered)
    b.decode(frames)
    with pytest.raises(ProtocolError, match="replayed"):
        b.decode(frames)
    with pytest.raises(ProtocolError, match="malformed"):
        b.decode(frames[:3])
    with pytest.raises(ProtocolError):
        b.decode([b"garbage"])


def test_size_limits():
    a, b = pair(max_buffers=1 << 20)
    with pytest.raises(ProtocolError, match="exceed"):
        b.decode(a.encode("push", np.zeros(1 << 18)))  # 2 MiB buffer > 1 MiB limit


def test_unpicklable_value_names_its_type():
    import threading

    with pytest.raises(SerializationError, match="lock"):
        serialize.dumps(threading.Lock())
