"""Property-based fuzzing of the message decoder (hypothesis).

Whatever frames arrive, :meth:`Codec.decode` returns a :class:`Message` or
raises :class:`ProtocolError`: never another exception, never a hang (each
example has a hypothesis deadline, the test a pytest timeout). Mutating a
valid message in any way (a flipped byte, a cut frame, a dropped or inserted
frame) is always a ProtocolError.
"""

from __future__ import annotations

import struct
from datetime import timedelta

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from monarch_kernel.errors import ProtocolError
from monarch_kernel.wire import protocol as protocol

pytestmark = pytest.mark.timeout(300)

KEY = b"fuzz-key-" + bytes(range(23))

FUZZ = settings(max_examples=300, deadline=timedelta(seconds=2),
                suppress_health_check=[HealthCheck.too_slow])

frame = st.binary(max_size=200)
frames = st.lists(frame, max_size=8)


def _codec() -> protocol.Codec:
    return protocol.Codec(KEY, "r0", max_header=1 << 16, max_buffers=1 << 16)


def _decode(c: protocol.Codec, fr: list, router: bool) -> protocol.Message | None:
    try:
        msg = c.decode(fr, router=router)
    except ProtocolError:
        return None
    assert isinstance(msg, protocol.Message)
    assert msg.type in protocol.TYPES and isinstance(msg.id, str)
    return msg


# -------------------------------------------------------------- raw bytes
@FUZZ
@given(frames, st.booleans())
def test_any_frames_give_a_message_or_a_protocol_error(fr, router):
    assert _decode(_codec(), fr, router) is None  # unsigned: never a message


# an envelope's bytes after the magic: anything, or a plausible (unsigned) layout
envelope_tails = st.one_of(
    st.binary(max_size=300),
    st.builds(lambda sig, n, h, p: sig + n.to_bytes(4, "little") + h + p,
              st.binary(min_size=32, max_size=32),
              st.integers(0, 400) | st.integers(0, (1 << 32) - 1),
              st.sampled_from([b"", b"{}", b'{"t":"execute","id":"x","p":null,"s":"ctl","nb":0}',
                               protocol.pack_header("execute", "x", None, "ctl"),
                               protocol.pack_header("push", "y", "p", "ctl", [3], [0])])
              | st.binary(max_size=60),
              st.binary(max_size=60)),
)


@FUZZ
@given(st.lists(frame, max_size=3), envelope_tails, st.lists(frame, max_size=6), st.booleans())
def test_frames_with_the_magic_give_a_protocol_error(identity, tail, rest, router):
    env = protocol.MAGIC + tail
    fr = [*identity, env, *rest] if router else [env, *rest]
    assert _decode(_codec(), fr, router) is None


# ----------------------------------------- signed but arbitrary contents
def _reference_parse(h: bytes) -> dict | None:
    """The fields of header bytes, read independently of protocol.py from the
    documented layout; None for anything that is not a well-formed header."""
    if len(h) < 10:
        return None
    code, ls, li, lp, nb, nsh, nto = struct.unpack_from("<BBBBHHH", h)
    plen = 0 if lp == 255 else lp
    o = 10 + ls + li + plen
    if code >= len(protocol.TYPE_CODES) or o + 8 * nb + 2 * nsh + 8 * nto != len(h):
        return None
    try:
        sender = h[10:10 + ls].decode("ascii")
        mid = h[10 + ls:10 + ls + li].decode("ascii")
        parent = None if lp == 255 else h[10 + ls + li:o].decode("ascii")
    except UnicodeDecodeError:
        return None
    to = [struct.unpack_from("<II", h, o + 8 * nb + 2 * nsh + 8 * k) for k in range(nto)]
    if any(a >= b for a, b in to):  # an empty range of addressees
        return None
    return {"t": protocol.TYPE_CODES[code], "id": mid, "p": parent, "s": sender,
            "bl": list(struct.unpack_from(f"<{nb}Q", h, o)),
            "sh": list(struct.unpack_from(f"<{nsh}H", h, o + 8 * nb)), "to": to}


names = st.text(st.characters(max_codepoint=127), max_size=12).map(str.encode)


@st.composite
def headers(draw, lengths=None):
    """(header bytes, intended fields or None): a binary header assembled from
    fields (codes up to 255, non-ASCII names, any buffer lengths and shared-memory
    indices), whose declared counts may then disagree with what follows, and
    which may be cut or extended; or arbitrary bytes."""
    if draw(st.integers(0, 9)) == 9:
        return draw(st.binary(max_size=120)), None
    code = draw(st.integers(0, len(protocol.TYPE_CODES) - 1) | st.integers(0, 255))
    sender, mid = draw(names), draw(names)
    parent = draw(st.none() | names)
    bad = draw(st.integers(0, 7))
    if bad >= 5:  # a name (sender, id or parent) that is not ASCII
        odd = draw(st.binary(max_size=6)) + bytes([draw(st.integers(128, 255))])
        sender, mid, parent = [odd if i == bad - 5 else n
                               for i, n in enumerate((sender, mid, parent))]
    bl = lengths if lengths is not None else draw(
        st.lists(st.integers(0, 60) | st.integers(0, (1 << 64) - 1), max_size=4))
    sh = draw(st.just([]) | st.lists(st.integers(0, 4) | st.integers(0, (1 << 16) - 1),
                                     max_size=3))
    # addressee ranges (the receiver here is the controller's codec: it takes any)
    to = draw(st.just([]) | st.lists(st.tuples(st.integers(0, 9), st.integers(0, 9))
                                     | st.tuples(st.integers(0, (1 << 32) - 1),
                                                 st.integers(0, (1 << 32) - 1)), max_size=3))
    declared = [code, len(sender), len(mid), 255 if parent is None else len(parent),
                len(bl), len(sh), len(to)]
    lied = draw(st.integers(0, 2)) == 2
    if lied:  # one declared length or count that does not match
        i = draw(st.integers(1, 6), label="lie")
        declared[i] = draw(st.integers(0, 255 if i < 4 else (1 << 16) - 1), label="value")
    h = b"".join((struct.pack("<BBBBHHH", *declared), sender, mid, parent or b"",
                  struct.pack(f"<{len(bl)}Q", *bl), struct.pack(f"<{len(sh)}H", *sh),
                  *(struct.pack("<II", a, b) for a, b in to)))
    cut = draw(st.sampled_from(["none", "none", "none", "cut", "extend"]))
    if cut == "cut" and h:
        h = h[:draw(st.integers(0, len(h) - 1), label="keep")]
    elif cut == "extend":
        h += draw(st.binary(min_size=1, max_size=8), label="extra")
    intended = None
    if cut == "none" and not lied and code < len(protocol.TYPE_CODES):
        try:
            intended = {"t": protocol.TYPE_CODES[code], "id": mid.decode("ascii"),
                        "p": None if parent is None else parent.decode("ascii"),
                        "s": sender.decode("ascii"), "bl": bl, "sh": sh,
                        "to": [tuple(r) for r in to]}
        except UnicodeDecodeError:
            pass
        if any(a >= b for a, b in to):  # an empty range: not well-formed
            intended = None
    return h, intended


NONE_PICKLE = b"\x80\x05N."  # pickle of None


def _check_against_reference(msg: protocol.Message | None, h: bytes, intended: dict | None,
                             bufs: list) -> None:
    ref = _reference_parse(h)
    if intended is not None:  # the reference reads back what was packed
        assert ref == intended
    if msg is not None:  # only a well-formed header naming the true lengths gets through
        assert ref is not None, h
        assert (msg.type, msg.id, msg.parent, msg.sender) == (ref["t"], ref["id"], ref["p"],
                                                              ref["s"])
        assert ref["bl"] == [len(b) for b in bufs]
        assert list(msg.to) == ref["to"]
        assert msg.type in protocol.TYPES


@FUZZ
@given(st.data(), st.sampled_from([NONE_PICKLE]) | st.binary(max_size=300),
       st.lists(st.binary(max_size=50), max_size=3), st.booleans())
def test_signed_arbitrary_headers_and_payloads_never_raise_anything_else(data, payload, bufs,
                                                                        true_lengths):
    """With the right key (a buggy peer), any header and any payload bytes still
    give a Message or a ProtocolError (the payload may be garbage pickle)."""
    c = _codec()
    # true_lengths: name the real buffer lengths, to get past the buffer-length check
    h, intended = data.draw(headers([len(b) for b in bufs] if true_lengths else None),
                            label="header")
    fr = c.seal(h, payload, bufs)
    msg = _decode(c, fr, router=False)
    _check_against_reference(msg, h, intended, bufs)
    if (intended is not None and intended["bl"] == [len(b) for b in bufs] and not intended["sh"]
            and payload == NONE_PICKLE
            and (not intended["to"] or protocol.addressed_to(tuple(intended["to"]), c.rank))):
        # the control: a well-formed header addressed to this rank (or to nobody in
        # particular) is accepted, whatever its names
        assert msg is not None and msg.content is None


@FUZZ
@given(st.binary(max_size=400)
       | st.builds(lambda h, i, x: h[:i] + bytes([h[i] ^ x]) + h[i + 1:] if i < len(h) else h,
                   st.sampled_from([protocol.pack_header("execute", "x", None, "ctl"),
                                    protocol.pack_header("reply", "y", "x", "r0"),
                                    protocol.pack_header("push", "z", None, "ctl", [5], [0])]),
                   st.integers(0, 30), st.integers(1, 255)))
def test_signed_arbitrary_header_bytes_give_a_message_or_a_protocol_error(h):
    c = _codec()
    fr = c.seal(h, NONE_PICKLE)
    msg = _decode(c, fr, router=False)
    _check_against_reference(msg, h, None, [])
    ref = _reference_parse(h)
    if ref is not None and ref["bl"] == [] and ref["sh"] == []:
        assert msg is not None and msg.content is None  # a well-formed one gets through


descriptors = st.one_of(
    st.binary(max_size=140),
    st.builds(lambda n, size, flag: f"{n}:{size}:{flag}".encode(),
              st.sampled_from(["monarch-" + "0" * 24, "../../etc/passwd", "monarch-x",
                               "", "monarch-" + "a" * 200]),
              st.integers(-5, 1 << 40), st.sampled_from(["0", "1", "p", "2", ""])),
)


@FUZZ
@given(st.lists(descriptors, min_size=1, max_size=3), st.data(), st.booleans())
def test_signed_shared_memory_descriptors_never_raise_anything_else(descs, data, lazy):
    """Buffers that the header marks as shared-memory descriptors ("sh"): a bad or
    dangling descriptor is a ProtocolError (now or when the content is read)."""
    c = _codec()
    sh = data.draw(st.lists(st.integers(0, len(descs) - 1), min_size=1, max_size=3,
                            unique=True), label="sh")
    h = protocol.pack_header("push", "x", None, "ctl", [len(d) for d in descs], sh)
    payload = NONE_PICKLE
    fr = c.seal(h, payload, descs)
    try:
        msg = c.decode(fr, lazy=lazy)
        msg.content  # noqa: B018 - maps the named files: none of them exists
    except ProtocolError:
        return


def _declared(code=0, ls=3, li=1, lp=255, nb=0, nsh=0, rest=b"ctlx", nto=0) -> bytes:
    return struct.pack("<BBBBHHH", code, ls, li, lp, nb, nsh, nto) + rest


@pytest.mark.parametrize("h", [
    _declared(nb=65535),  # 65535 buffer lengths (512 KiB) in a 14-byte header
    _declared(nsh=65535),
    _declared(nto=65535),  # 65535 addressee ranges that are not there
    _declared(nto=1, rest=b"ctlx" + bytes(8)),  # an empty range [0, 0)
    _declared(nb=65535, nsh=65535, rest=b"ctlx" + bytes(8 * 1000)),
    _declared(ls=254, li=254, lp=254),
    _declared(ls=200),
    _declared(li=2),
    _declared(lp=0, rest=b"ctl"),  # a parent of 0 bytes, after an id that is not there
    _declared(nb=1, rest=b"ctlx" + bytes(7)),  # a buffer length cut short
    _declared(nsh=1, rest=b"ctlx" + bytes(1)),
    _declared()[:7],  # not even the fixed part
    b"",
], ids=lambda h: f"{len(h)}B")
def test_header_whose_declared_lengths_exceed_its_size_is_a_protocol_error(h):
    """Declared sizes are checked against the header's actual size before any
    field is read, so a short header cannot make the decoder read beyond it
    (or allocate what it declares)."""
    c = _codec()
    assert _reference_parse(h) is None
    with pytest.raises(ProtocolError, match="malformed"):
        c.decode(c.seal(h, NONE_PICKLE))
    with pytest.raises(ProtocolError, match="malformed"):  # nor with a buffer
        c.decode(c.seal(h, NONE_PICKLE, [b"abc"]))
    # the control: the same codec accepts a well-formed header
    ok = protocol.pack_header(protocol.TYPE_CODES[0], "x", None, "ctl")
    assert ok == _declared() and c.decode(c.seal(ok, NONE_PICKLE)).content is None


# ----------------------------------------------------- mutations of valid
contents = st.one_of(
    st.none(),
    st.integers(),
    st.text(max_size=50),
    st.binary(max_size=100),
    st.dictionaries(st.text(max_size=8), st.integers() | st.text(max_size=20), max_size=5),
    st.integers(513, 2000).map(lambda n: {"arr": np.arange(n, dtype=np.float64)}),  # a buffer
)
types = st.sampled_from(sorted(protocol.TYPES))


def _valid(mtype: str, content: object, router: bool) -> tuple[protocol.Codec, list[bytes], int]:
    sender = protocol.Codec(KEY, "ctl", max_header=1 << 16, max_buffers=1 << 16)
    fr = [bytes(f) for f in sender.encode(mtype, content)]
    lead = 0
    if router:
        fr = [b"r0.identity", *fr]
        lead = 1
    return _codec(), fr, lead


@FUZZ
@given(types, contents, st.booleans())
def test_valid_messages_round_trip(mtype, content, router):
    c, fr, _ = _valid(mtype, content, router)
    msg = c.decode(fr, router=router)
    assert msg.type == mtype and msg.sender == "ctl"
    if isinstance(content, dict) and "arr" in content:
        np.testing.assert_array_equal(msg.content["arr"], content["arr"])
    else:
        assert msg.content == content
    with pytest.raises(ProtocolError, match="replayed"):
        c.decode(fr, router=router)


@FUZZ
@given(types, contents, st.booleans(), st.data())
def test_a_flipped_byte_is_a_protocol_error(mtype, content, router, data):
    c, fr, lead = _valid(mtype, content, router)
    i = data.draw(st.integers(lead, len(fr) - 1), label="frame")
    if not fr[i]:
        return
    j = data.draw(st.integers(0, len(fr[i]) - 1), label="byte")
    x = data.draw(st.integers(1, 255), label="xor")
    b = bytearray(fr[i])
    b[j] ^= x
    fr[i] = bytes(b)
    with pytest.raises(ProtocolError):
        c.decode(fr, router=router)


@FUZZ
@given(types, contents, st.booleans(), st.data())
def test_a_cut_frame_is_a_protocol_error(mtype, content, router, data):
    c, fr, lead = _valid(mtype, content, router)
    i = data.draw(st.integers(lead, len(fr) - 1), label="frame")
    if not fr[i]:
        return
    n = data.draw(st.integers(0, len(fr[i]) - 1), label="keep")
    fr[i] = fr[i][:n]
    with pytest.raises(ProtocolError):
        c.decode(fr, router=router)


@FUZZ
@given(types, contents, st.booleans(), st.data())
def test_a_dropped_frame_is_a_protocol_error(mtype, content, router, data):
    c, fr, lead = _valid(mtype, content, router)
    i = data.draw(st.integers(lead, len(fr) - 1), label="frame")
    del fr[i]
    with pytest.raises(ProtocolError):
        c.decode(fr, router=router)


@FUZZ
@given(types, contents, st.booleans(), frame, st.data())
def test_an_inserted_frame_is_a_protocol_error(mtype, content, router, extra, data):
    c, fr, lead = _valid(mtype, content, router)
    # after the envelope: before it, a ROUTER would just see one more identity frame
    i = data.draw(st.integers(lead + 1 if router else 0, len(fr)), label="position")
    fr.insert(i, extra)
    with pytest.raises(ProtocolError):
        c.decode(fr, router=router)


@FUZZ
@given(types, contents, st.booleans(), st.data())
def test_swapped_frames_are_a_protocol_error(mtype, content, router, data):
    c, fr, lead = _valid(mtype, content, router)
    i = data.draw(st.integers(lead, len(fr) - 1), label="a")
    j = data.draw(st.integers(lead, len(fr) - 1), label="b")
    if fr[i] == fr[j]:
        return
    fr[i], fr[j] = fr[j], fr[i]
    with pytest.raises(ProtocolError):
        c.decode(fr, router=router)
