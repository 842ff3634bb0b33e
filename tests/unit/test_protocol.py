"""The wire format: signing, replay, limits, out-of-band buffers."""

from __future__ import annotations

import hashlib
import hmac
import json
import struct

import numpy as np
import pytest
import torch

from monarch_kernel.errors import ProtocolError, SerializationError
from monarch_kernel.wire import protocol as protocol
from monarch_kernel.wire import serialize as serialize
from monarch_kernel.wire import shm as shm


def pair(**kw):
    key = protocol.new_key()
    return protocol.Codec(key, "ctl", **kw), protocol.Codec(key, "r0", **kw)


def split(envelope) -> tuple[bytes, bytes, bytes]:
    """(signature, header bytes, payload) of an envelope frame."""
    env = bytes(envelope)
    assert env[:4] == protocol.MAGIC
    n = int.from_bytes(env[52:56], "little")
    assert 56 + n <= len(env)
    return env[4:36], env[56:56 + n], env[56 + n:]


def fields(header: bytes) -> dict:
    """The fields of binary header bytes, read by hand from the documented layout
    (struct "<BBBBHHH", sender, id, parent, N x u64, D x u16, R x (u32, u32)),
    and checked against protocol._parse_header."""
    code, ls, li, lp, nb, nsh, nto = struct.unpack_from("<BBBBHHH", header)
    o = 10
    sender = header[o:o + ls].decode("ascii")
    mid = header[o + ls:o + ls + li].decode("ascii")
    o += ls + li
    parent = None
    if lp != 255:
        parent = header[o:o + lp].decode("ascii")
        o += lp
    bl = list(struct.unpack_from(f"<{nb}Q", header, o))
    sh = list(struct.unpack_from(f"<{nsh}H", header, o + 8 * nb))
    at = o + 8 * nb + 2 * nsh
    to = [struct.unpack_from("<II", header, at + 8 * k) for k in range(nto)]
    assert at + 8 * nto == len(header)
    head = {"t": protocol.TYPE_CODES[code], "id": mid, "p": parent, "s": sender, "nb": nb,
            "bl": bl, "sh": sh, "to": to}
    t, i, p, s, lengths, shm, ranges = protocol._parse_header(header, True)
    assert (t, i, p, s, list(lengths), list(shm), list(ranges)) == (
        head["t"], head["id"], head["p"], head["s"], head["bl"], head["sh"], head["to"])
    return head


def test_round_trip_keeps_types_and_ids():
    a, b = pair()
    frames = a.encode("execute", {"code": "1+1", "n": 3}, parent="p1")
    m = b.decode(frames)
    assert (m.type, m.parent, m.sender) == ("execute", "p1", "ctl")
    assert m.content == {"code": "1+1", "n": 3}
    assert len(frames) == 1  # a control message is one envelope frame
    env = bytes(frames[0])
    sig, header, payload = split(env)
    assert len(sig) == 32
    assert sig == hmac.new(a._key, env[36:], hashlib.sha256).digest()
    head = fields(header)
    assert head["t"] == "execute" and head["p"] == "p1" and head["s"] == "ctl"
    assert head["nb"] == 0 and head["bl"] == [] and head["sh"] == [] and head["id"] == m.id
    assert header[0] == protocol.TYPE_CODES.index("execute")
    assert header == protocol.pack_header("execute", m.id, "p1", "ctl")
    assert fields(protocol.pack_header("stop", "i", None, "r7"))["p"] is None
    assert serialize.loads(payload, []) == {"code": "1+1", "n": 3}


def test_large_arrays_travel_out_of_band_without_copy_into_pickle():
    a, b = pair()
    t = torch.arange(1 << 20, dtype=torch.float32)
    arr = np.ones(1 << 18)
    frames = a.encode("push", {"t": t, "a": arr})
    assert len(frames) == 3  # envelope, 2 buffers
    env = bytes(frames[0])
    sig, header, payload = split(env)
    assert len(payload) < 4096  # the data is not in the pickle stream
    head = fields(header)
    assert head["nb"] == 2 and head["sh"] == []
    assert sorted(head["bl"]) == sorted([t.numel() * 4, arr.nbytes])
    assert head["bl"] == [memoryview(f).nbytes for f in frames[1:]]
    h = hmac.new(a._key, env[36:], hashlib.sha256)
    for f in frames[1:]:
        h.update(f)
    assert sig == h.digest()  # the signature covers the buffers too
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
    env = frames[0]
    assert env[-1] != 0
    for bad in (
        env[:-1] + b"\x00",  # the payload's last byte
        env[:4] + bytes([env[4] ^ 1]) + env[5:],  # the signature
        env[:45] + bytes([env[45] ^ 1]) + env[46:],  # the header
        env[:36] + (int.from_bytes(env[36:40], "little") + 1).to_bytes(4, "little") + env[40:],
    ):
        with pytest.raises(ProtocolError, match="signature"):
            b.decode([bad])
    with pytest.raises(ProtocolError):  # cut short: the signature no longer matches
        b.decode([env[:-1]])
    with pytest.raises(ProtocolError, match="malformed"):  # no room for a header length
        b.decode([env[:39]])
    with pytest.raises(ProtocolError, match="malformed"):
        b.decode([])
    b.decode(frames)
    with pytest.raises(ProtocolError, match="replayed"):
        b.decode(frames)
    with pytest.raises(ProtocolError):
        b.decode([b"garbage"])
    # with buffers: a missing, cut or extra buffer frame
    big = [bytes(f) for f in a.encode("push", {"a": np.arange(1000.0), "b": np.ones(600)})]
    assert len(big) == 3
    for bad in ([big[0]], big[:2], [big[0], big[2]], [big[0], big[1], big[2][:-1]],
                [*big, b"x"], [big[0], big[2], big[1]]):
        with pytest.raises(ProtocolError):
            b.decode(bad)
    assert b.decode(big).content["b"].sum() == 600  # the untouched message still decodes


def test_bytes_moved_between_frames_are_rejected():
    """The signature covers the concatenation of envelope bytes 36.. and every
    buffer frame, so moving bytes across a frame boundary keeps it valid: the
    signed buffer lengths ("bl") must catch that."""
    a, b = pair()
    frames = [bytes(f) for f in a.encode("push", {"a": np.arange(1000.0), "b": np.ones(600)})]
    env, b0, b1 = frames
    assert len(frames) == 3 and fields(split(env)[1])["bl"] == [len(b0), len(b1)]
    k = 8
    moved = [
        [env[:-k], env[-k:] + b0, b1],  # envelope tail -> buffer 0
        [env + b0[:k], b0[k:], b1],  # buffer 0 head -> envelope
        [env, b0 + b1[:k], b1[k:]],  # buffer 1 head -> buffer 0
        [env, b0[:-k], b0[-k:] + b1],  # buffer 0 tail -> buffer 1
        [env + b0, b1],  # buffer 0 merged into the envelope (and nb wrong)
        [env, b0 + b1],  # two buffers merged
    ]
    for fr in moved:
        # the same signed bytes, split differently: the signature alone would pass
        assert fr[0][:36] == env[:36]
        assert b"".join(fr)[36:] == b"".join(frames)[36:]
        assert a._sign(fr[0][36:], fr[1:]) == env[4:36]
        with pytest.raises(ProtocolError, match="malformed"):
            b.decode(fr)
    # a (signed) header that does not name its buffer lengths, or names other
    # lengths with the same total, is no better
    _, header, payload = split(env)
    head = fields(header)
    for bl in ([], [len(b0)], [len(b0) + len(b1)], [len(b0) - k, len(b1) + k],
               [len(b0) + k, len(b1) - k], [len(b1), len(b0)], [len(b0), len(b1), 0]):
        assert bl != head["bl"]
        h = protocol.pack_header(head["t"], head["id"], head["p"], head["s"], bl)
        with pytest.raises(ProtocolError, match="malformed"):
            b.decode(a.seal(h, payload, [b0, b1]))
    m = b.decode(frames)  # none of the above counted as seen: the original still decodes
    np.testing.assert_array_equal(m.content["a"], np.arange(1000.0))


def test_json_headers_of_version_1_are_malformed():
    """A correctly signed message with a version 1 (JSON) header is refused."""
    a, b = pair()
    payload = serialize.dumps({"code": "1"})[0]
    for head in ({"t": "execute", "id": "x", "p": None, "s": "ctl", "nb": 0},
                 {"t": "execute", "id": "y", "p": None, "s": "ctl", "nb": 1, "bl": [3]}):
        h = json.dumps(head, separators=(",", ":")).encode()
        bufs = [b"abc"] if head["nb"] else []
        with pytest.raises(ProtocolError, match="malformed"):
            b.decode(a.seal(h, payload, bufs))
    assert b.decode(a.seal(protocol.pack_header("execute", "x", None, "ctl"),
                           payload)).content == {"code": "1"}  # the control


def test_pack_header_refuses_what_the_layout_cannot_hold():
    for bad in ({"type": "no-such-type"}, {"id": "\xe9"}, {"sender": "r\u00e9"},
                {"parent": "p" * 255}, {"id": "i" * 255}):
        kw = {"type": "execute", "id": "x", "parent": None, "sender": "ctl", **bad}
        with pytest.raises((ValueError, KeyError)):
            protocol.pack_header(**kw)
    h = protocol.pack_header("execute", "i" * 254, "p" * 254, "s" * 254, [1, 2], [1])
    assert protocol._parse_header(h) == ("execute", "i" * 254, "p" * 254, "s" * 254, (1, 2), (1,))
    assert protocol._parse_header(protocol.pack_header("call", "x", "", "ctl"))[2] == ""


def test_size_limits():
    key = protocol.new_key()
    lax = protocol.Codec(key, "ctl")  # a sender with a larger limit than the receiver's
    strict = protocol.Codec(key, "r0", max_buffers=1 << 20)
    with pytest.raises(ProtocolError, match="exceed"):
        strict.decode(lax.encode("push", np.zeros(1 << 18)))  # 2 MiB buffer > 1 MiB limit
    # the sender checks its own limit, so that nothing is sent only to be dropped
    with pytest.raises(SerializationError, match="limit is 1048576 bytes.*RDMABuffer"):
        strict.encode("push", np.zeros(1 << 18))


@pytest.mark.skipif(not shm.available(), reason="no /dev/shm")
def test_a_buffer_at_the_limit_through_shared_memory():
    """A buffer of exactly the limit, sent through a shared-memory file: its
    descriptor's few bytes must not count on top of the file's size."""
    a, b = pair(max_buffers=1 << 21)
    names: list[str] = []
    frames = a.encode("push", np.ones(1 << 18), shm="sender", shm_out=names)  # 2 MiB
    try:
        msg = b.decode(frames)
        assert float(msg.content.sum()) == 1 << 18
    finally:
        a.release_shm(names, discard=True)


def test_unpicklable_value_names_its_type():
    import threading

    with pytest.raises(SerializationError, match="lock"):
        serialize.dumps(threading.Lock())


def test_a_none_reply_is_pickled_once_and_read_without_pickle():
    """The reply of most endpoints (ok, None) has a constant pickle: sent as is,
    byte for byte what the general path makes, and read back as a fresh dict."""
    general, _ = serialize.dumps({"status": "ok", "value": serialize.Packed.pack(None)})
    assert general == serialize.OK_NONE_PAYLOAD
    assert serialize.dumps(serialize.OK_NONE) == (serialize.OK_NONE_PAYLOAD, [])
    sender, receiver = protocol.Codec(b"k" * 32, "r0"), protocol.Codec(b"k" * 32, "ctl")
    for content in (serialize.OK_NONE, {"status": "ok", "value": serialize.Packed.pack(None)}):
        msg = receiver.decode(sender.encode("reply", content, "ctl.1"), lazy=True)
        c = msg.content
        assert c["status"] == "ok" and c["value"].unpack() is None
        c["status"] = "changed"  # a fresh dict each time: the constant is untouched
        assert serialize.OK_NONE["status"] == "ok"
    # other replies and other types take the general path
    msg = receiver.decode(sender.encode("reply", {"status": "ok", "value":
                                                  serialize.Packed.pack(7)}, "ctl.2"))
    assert msg.content["value"].unpack() == 7
    msg = receiver.decode(sender.encode("event", serialize.OK_NONE))
    assert msg.content["status"] == "ok"
