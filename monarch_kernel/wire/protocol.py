"""The controller <-> worker wire format: the ONE module that knows frames.

Every message is a multipart message (ZeroMQ's, or a lane's framing of the
same frames, :mod:`monarch_kernel.transport.lane`; after any ROUTER identity frames) of
one envelope frame and zero or more buffer frames::

    frame 0   envelope:
                bytes 0-3     b"MK/3"     magic and protocol version
                bytes 4-35    signature   HMAC-SHA256 (raw 32 bytes), keyed with
                                          the mesh's random key, over bytes 36..
                                          of this frame, then every buffer frame
                                          in order
                bytes 36-43   epoch       u64: the sending codec's stream (random
                                          per codec, or given by the controller
                                          for a rank's run)
                bytes 44-51   sequence    u64: 1, 2, 3, ... per sending codec
                bytes 52-55   header length H, unsigned 32-bit little-endian
                bytes 56..    header      H bytes, fixed layout (struct, little-endian):
                                u8   type code (index in TYPE_CODES)
                                u8   sender length S (ASCII, "ctl" or "r<rank>")
                                u8   message id length I (ASCII, unique per sender)
                                u8   parent id length P (255: no parent)
                                u16  number of buffer frames N
                                u16  number of shared-memory descriptors D
                                S + I + P bytes: sender, id, parent
                                N x u64: the length of each buffer frame
                                D x u16: indices of buffers that are shared-
                                      memory descriptors
                then          payload     pickle protocol 5 (cloudpickle) bytes
    frame 1+  buffers                     out-of-band pickle buffers (raw bytes
                                          of arrays and tensors), zero-copy
                                          on ZeroMQ (a lane's reader copies once)

A small message (no buffers: every control message) is ONE frame, so the
hot path pays for one ZeroMQ frame per hop rather than four (version 1 sent
magic, signature, header and payload as separate frames; each frame costs
a few microseconds of Python in pyzmq), and its header is a fixed layout
read with one ``struct`` call (version 1 used JSON). The signed header names
the length of every buffer, so no byte can move from one frame to another
unnoticed.

The payload is the message's content, a plain dict (or list, or None) whose
schema for each message type is in :mod:`monarch_kernel.wire.messages`, the one
list of message types and of their content; this module knows their names
(:data:`TYPES`) and codes (:data:`TYPE_CODES`) only.

The signature is checked with :func:`hmac.compare_digest` *before* the header
is parsed or anything is unpickled, exactly as ``jupyter_client.session``
does for the Jupyter wire protocol. Size limits (header and buffers) and the
magic are checked before hashing, so a message that is not ours costs a few
comparisons, and a wrongly signed one one HMAC of at most the size limits.

Replays
-------
Every codec is one *stream*: an epoch (64 bits) and a sequence number that
counts its messages from 1. A receiver keeps, per (sender, epoch), the
sequence numbers it accepted (:class:`Window`) and refuses any it accepted
before, at any time in the mesh's life: a replay. It accepts a message that
arrives late (sent by another thread of the sender, overtaken on another
path) if at most ``REORDER_LIMIT // 2`` (1,024) later ones of that stream
reached it first; one overtaken by more may be refused as too old.

Which epochs a receiver accepts from a sender: the one it was told to expect
(:meth:`Codec.expect`) where it was told one, else any (first come, its own
window). The controller gives each run of a rank a fresh epoch and expects it
(a restarted rank's predecessor's messages are refused), and tells each rank
it starts the controller's epoch and its current sequence number (the rank
refuses every message the controller signed before it started). Keys are
fresh per controller, so no message of another mesh verifies.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import logging
import os
import secrets
import struct
import threading
from dataclasses import dataclass, field
from typing import Any

from monarch_kernel.errors import ProtocolError, SerializationError
from monarch_kernel.wire import serialize
from monarch_kernel.wire import shm as _shm

log = logging.getLogger("monarch_kernel.wire.protocol")

__all__ = ["MAGIC", "REORDER_LIMIT", "STREAMS_ENV", "TYPES", "VERSION", "Codec", "Message",
           "Window", "format_streams", "new_epoch", "new_key", "parse_streams", "refused"]

MAGIC = b"MK/3"
VERSION = 3
_SIG = slice(4, 36)  # where the signature sits in the envelope frame
_ENV = struct.Struct("<QQI")  # epoch, sequence number, header length (bytes 36-55)
_HEAD = 36 + _ENV.size  # where the header starts

#: wire codes of the message types (a type's code is its index). The content of
#: each type, and its direction: :mod:`monarch_kernel.wire.messages`, the one list
#: of message types. A new type is appended (the codes of the others stay).
TYPE_CODES: tuple[str, ...] = (
    "buffer", "call", "calls", "debug", "debug_input", "display", "event", "execute",
    "free", "heartbeat", "hello", "interrupt", "keys", "pull", "push", "ref", "replies",
    "reply", "setup", "shm_done", "spawn_actor", "state", "stop", "stop_actor", "stream",
    "rank_dead", "attach", "detach",
)
#: every message type (:mod:`monarch_kernel.wire.messages` gives the content of each)
TYPES = frozenset(TYPE_CODES)
_CODE = {t: i for i, t in enumerate(TYPE_CODES)}
_FIXED = struct.Struct("<BBBBHH")  # type, sender, id, parent lengths, buffers, shm
_NO_PARENT = 255

DEFAULT_MAX_HEADER = 64 * 1024 * 1024  # bytes
DEFAULT_MAX_BUFFERS = 1024 * 1024 * 1024  # bytes
#: accepted sequence numbers a receiver keeps per stream at most (see Window): a
#: message that at most half as many later ones of its stream overtook is accepted
REORDER_LIMIT = 2048
#: streams of senders with no expected epoch that a codec keeps at most (the
#: oldest is forgotten first)
MAX_STREAMS = 4096


def new_key() -> bytes:
    """A fresh random 32-byte mesh key."""
    return secrets.token_bytes(32)


def new_epoch() -> int:
    """A fresh random epoch (a 64-bit integer, never 0)."""
    return secrets.randbits(64) or 1


#: the environment variable that gives a rank its streams (:func:`format_streams`)
STREAMS_ENV = "MONARCH_STREAMS"


def format_streams(epoch: int, controller_epoch: int, floor: int) -> str:
    """What a rank's :data:`STREAMS_ENV` holds: its own epoch, the controller's,
    and the controller's sequence number at the rank's start
    (``"<hex>:<hex>:<decimal>"``)."""
    return f"{epoch:x}:{controller_epoch:x}:{floor}"


def parse_streams(text: str) -> tuple[int, int, int]:
    """(epoch, controller's epoch, floor) of :func:`format_streams`'s text.

    Raises
    ------
    ValueError
        If ``text`` is not three such fields, or an epoch is 0 or beyond 64 bits.
    """
    try:
        a, b, c = text.split(":")
        epoch, ctl, floor = int(a, 16), int(b, 16), int(c)
    except ValueError:
        raise ValueError(f"{STREAMS_ENV} must read EPOCH:EPOCH:SEQ (hex, hex, decimal), "
                         f"not {text!r}") from None
    if not (0 < epoch < 1 << 64 and 0 < ctl < 1 << 64 and 0 <= floor < 1 << 64):
        raise ValueError(f"{STREAMS_ENV} holds an epoch or sequence number out of range: "
                         f"{text!r}")
    return epoch, ctl, floor


def refused(reason: str, message: str) -> ProtocolError:
    """A :class:`ProtocolError` with ``reason``, a short name of why the message
    was refused ("bad signature", "replayed", ...), as its ``reason``
    attribute (what a summary of drops counts by)."""
    e = ProtocolError(message)
    e.reason = reason  # type: ignore[attr-defined]
    return e


class Window:
    """The sequence numbers a receiver accepted from one stream (one sender's
    epoch): :meth:`admit` accepts each number once, ever.

    It holds ``floor`` (every number up to it is refused: accepted already, or
    too old) and the numbers above it that were accepted (at most ``limit``;
    when there are more, all but the highest ``limit // 2`` go below the
    floor). A stream that arrives in order costs a few comparisons and no
    memory; a stream this receiver sees only part of (its sender also talks
    to others) keeps ``limit // 2`` to ``limit`` numbers. A number that at
    most ``limit // 2`` higher ones arrived before is accepted (once).

    Parameters
    ----------
    floor : int
        Numbers up to this one are refused from the start (the sender's
        messages from before this receiver existed).
    limit : int
        How many accepted numbers above the floor are kept.
    """

    __slots__ = ("floor", "limit", "seen")

    def __init__(self, floor: int = 0, limit: int = REORDER_LIMIT) -> None:
        self.floor = floor
        self.limit = limit
        self.seen: set[int] = set()

    def admit(self, seq: int) -> bool:
        """Accept ``seq`` (True) unless it was accepted before or is too old (False)."""
        floor = self.floor
        if seq <= floor:
            return False
        seen = self.seen
        if seq == floor + 1:  # in order (the common case)
            if seen:
                while seq + 1 in seen:  # a gap closed: the numbers above it join the floor
                    seq += 1
                    seen.discard(seq)
            self.floor = seq
            return True
        if seq in seen:
            return False
        seen.add(seq)
        if len(seen) > self.limit:  # the lower ones go below the floor; limit // 2 stay
            ordered = sorted(seen)
            cut = len(ordered) - self.limit // 2
            floor = ordered[cut - 1]
            self.seen = seen = set(ordered[cut:])
            while floor + 1 in seen:
                floor += 1
                seen.discard(floor)
            self.floor = floor
        return True


@dataclass
class Message:
    """One decoded message.

    Attributes
    ----------
    type : str
        One of :data:`TYPES`.
    id : str
        Unique message id.
    parent : str or None
        Id of the request this answers, if any.
    sender : str
        ``"ctl"`` or ``"r<rank>"``.
    content : Any
        The unpickled payload.
    identity : list of bytes
        ROUTER identity frames it arrived with (empty on a DEALER).
    pooled : list of str
        Names of the sender's pooled shared-memory files whose bytes this
        message carries: copied out when ``content`` is decoded, after which
        the sender may reuse them (it is told with ``shm_done``).
    """

    type: str
    id: str
    parent: str | None
    sender: str
    _payload: Any = field(repr=False)
    identity: list[bytes] = field(default_factory=list)
    _buffers: list[Any] | None = field(default_factory=list, repr=False)
    pooled: list[str] = field(default_factory=list)
    _decoded: bool = field(default=False, repr=False)
    _content: Any = field(default=None, repr=False)

    @property
    def content(self) -> Any:
        """The payload, unpickled on first use (in the thread that uses it, so an
        I/O thread that only routes a message never pays for, e.g., importing
        torch to rebuild a tensor).

        Raises
        ------
        ProtocolError
            If the (signed) payload does not unpickle here.
        """
        if not self._decoded:
            if (self.type == "reply" and not self._buffers
                    and self._payload == serialize.OK_NONE_PAYLOAD):  # (most replies)
                self._content = {"status": "ok", "value": serialize.OK_NONE["value"]}
                self._decoded = True
                self._payload = self._buffers = None
                return self._content
            try:
                buffers = [b.open() if isinstance(b, _ShmFrame) else b
                           for b in self._buffers or ()]
                self._content = serialize.loads(self._payload, buffers)
            except Exception as e:
                raise refused("undecodable",
                              f"undecodable payload in {self.type!r} message: {e}") from e
            self._decoded = True
            self._payload = self._buffers = None
        return self._content


class Codec:
    """Encodes and verifies messages for one endpoint of a mesh.

    Parameters
    ----------
    key : bytes
        The mesh's HMAC key (32 random bytes; :func:`new_key`).
    sender : str
        This endpoint's name, written into every header.
    max_header : int
        Largest accepted header + payload, in bytes (default 64 MiB).
    max_buffers : int
        Largest accepted total of buffer frames, in bytes (default 1 GiB).
    epoch : int or None
        This codec's epoch (a 64-bit integer; given by the controller for a
        rank's run); None: a fresh random one (:func:`new_epoch`).
    """

    def __init__(
        self,
        key: bytes,
        sender: str,
        max_header: int = DEFAULT_MAX_HEADER,
        max_buffers: int = DEFAULT_MAX_BUFFERS,
        epoch: int | None = None,
    ) -> None:
        if not key:
            raise ValueError("a mesh key must not be empty")
        self._key = key
        self._hmac = _hmac_new(key)
        #: names the mesh this codec's key belongs to (16 hex digits; the key itself
        #: cannot be learned from it): handles of actors and buffers carry it, so a
        #: process of another mesh, which cannot sign for this one, refuses them at once
        #: the mesh's HMAC key (handed to this program's other meshes: mesh_keys)
        self.key = key
        self.fingerprint = hashlib.sha256(b"monarch-mesh:" + key).hexdigest()[:16]
        self.sender = sender
        self.max_header = max_header
        self.max_buffers = max_buffers
        self._prefix = f"{sender}.{os.getpid()}.{secrets.token_hex(4)}."
        self._counter = 0
        self._lock = threading.Lock()
        if epoch is not None and not 0 < epoch < 1 << 64:
            raise ValueError(f"an epoch is an integer from 1 to 2**64-1, not {epoch!r}")
        #: this codec's stream: its epoch, and the sequence numbers of what it signs
        self.epoch = new_epoch() if epoch is None else epoch
        self._seq = itertools.count(1)  # (next() is atomic: any thread may sign)
        self._streams: dict[tuple[str, int], Window] = {}  # (sender, epoch) -> accepted
        self._expected: dict[str, tuple[int, int]] = {}  # sender -> (epoch, floor)
        #: reusable shared-memory files for requests to this host (set by owners)
        self.pool: _shm.Pool | None = None

    def release_shm(self, names: list[str], discard: bool = False) -> None:
        """Give back shared-memory files of a finished request.

        With ``discard`` (the request failed: a receiver may not have read its
        file yet) pooled files are removed rather than reused, so nobody can
        read another request's bytes from them.
        """
        for n in names:
            if self.pool is not None and self.pool.release(n, discard=discard):
                continue
            _shm.unlink(n)

    def fork(self, sender: str) -> Codec:
        """A codec with the same key and limits, a new sender name, its own
        message ids, its own stream (a fresh epoch) and its own replay windows
        (for a second socket of one process, e.g. a worker's peer-to-peer actor
        socket)."""
        c = Codec(self._key, sender, self.max_header, self.max_buffers)
        return c

    def rekeyed(self, key: bytes) -> Codec:
        """A codec that signs and checks with ``key`` (another mesh's: a worker's
        calls to it, :mod:`monarch_kernel.actor.mesh_keys`), with this one's sender
        name, limits and shared-memory pool, and a stream and replay windows of
        its own."""
        c = Codec(key, self.sender, self.max_header, self.max_buffers)
        c.pool = self.pool
        return c

    def restart(self, epoch: int) -> None:
        """Sign from now on as stream ``epoch``, counting from 1 again (a worker of
        a detachable mesh taken over by a new controller, which gave it
        ``epoch``); the caller makes sure no other thread signs meanwhile.

        Raises
        ------
        ValueError
            If ``epoch`` is not an integer from 1 to 2**64-1.
        """
        if not isinstance(epoch, int) or not 0 < epoch < 1 << 64:
            raise ValueError(f"an epoch is an integer from 1 to 2**64-1, not {epoch!r}")
        self.epoch = epoch
        self._seq = itertools.count(1)

    def mark(self) -> int:
        """A sequence number above that of every message this codec signed so
        far (a receiver started now is told to refuse those: :meth:`expect`)."""
        return next(self._seq)

    def expect(self, sender: str, epoch: int, floor: int = 0) -> None:
        """Accept messages of ``sender`` from stream ``epoch`` only, and of it
        only sequence numbers above ``floor`` (any thread). What was accepted
        from ``sender``'s other epochs is forgotten: their messages are
        refused from now on."""
        with self._lock:
            self._expected[sender] = (epoch, floor)
            for k in [k for k in self._streams if k[0] == sender and k[1] != epoch]:
                del self._streams[k]

    def _admit(self, sender: str, epoch: int, seq: int) -> None:
        """Accept sequence number ``seq`` of ``sender``'s stream ``epoch`` once
        (lock held); else raise ProtocolError."""
        key = (sender, epoch)
        w = self._streams.get(key)
        if w is None:
            exp = self._expected.get(sender)
            if exp is not None:
                if exp[0] != epoch:
                    raise refused("stale epoch", f"a message of {sender!r} from another run "
                                  f"of it (epoch {epoch:016x}, expected {exp[0]:016x})")
                w = Window(exp[1])
            else:
                if len(self._streams) >= MAX_STREAMS:
                    del self._streams[next(iter(self._streams))]
                w = Window()
            self._streams[key] = w
        if not w.admit(seq):
            raise refused("replayed", f"replayed message of {sender!r} (sequence number {seq} "
                          f"of epoch {epoch:016x} was accepted before, or is too old)")

    def new_id(self) -> str:
        """A message id unique to this codec."""
        with self._lock:
            self._counter += 1
            return self._prefix + str(self._counter)

    def _sign(self, signed: Any, buffers: Any = ()) -> bytes:
        """HMAC-SHA256 of ``signed`` (envelope bytes 36..) then each buffer.

        A copy of a keyed HMAC made once (:func:`_hmac_new`), not
        :func:`hmac.digest`: that one-shot looks the digest up by name in
        OpenSSL at every call and lets go of the GIL around it, even for a
        100-byte message, so another thread (the kernel's IOPub thread, say)
        takes the GIL in the middle of a send. The copy is also the cheaper.
        Updates of under 2 KiB keep the GIL (CPython's ``HASHLIB_GIL_MINSIZE``).
        """
        h = self._hmac.copy()
        h.update(signed)
        for b in buffers:
            h.update(b)
        return h.digest()

    def seal(self, header: bytes, payload: Any, buffers: list[Any] | tuple = (),
             seq: int | None = None) -> list[Any]:
        """Signed frames from raw header bytes, with this codec's epoch and the
        next sequence number (or ``seq``) (what :meth:`encode` sends; tests
        use it to sign malformed headers as a buggy peer would)."""
        body = b"".join((_ENV.pack(self.epoch, next(self._seq) if seq is None else seq,
                                   len(header)), header, payload))
        return [MAGIC + self._sign(body, buffers) + body, *buffers]

    def encode(
        self,
        type: str,
        content: Any = None,
        parent: str | None = None,
        id: str | None = None,
        shm: str | None = None,
        shm_out: list[str] | None = None,
    ) -> list[Any]:
        """Build the frames of one message.

        Parameters
        ----------
        type : str
            One of :data:`TYPES`.
        content : Any
            The payload (pickled with :func:`serialize.dumps`).
        parent, id : str, optional
        shm : {None, "sender", "receiver", "reply"}
            For a receiver on this host: buffers of at least
            :data:`shm.MIN_BYTES` go through shared memory (:mod:`.shm`), and
            the named side removes the files (``"sender"``: the caller, with
            the names appended to ``shm_out``, gives them back with
            :meth:`release_shm` once the receivers answered). ``"reply"``:
            pooled files that the receiver reports copied (``shm_done``),
            else fresh files that the receiver removes.

        Returns
        -------
        list
            ``[envelope, *buffers]``; buffers are memoryviews that ZeroMQ
            sends without copying.

        Raises
        ------
        SerializationError
            If ``content`` cannot be pickled.
        """
        buffers: list[Any]  # memoryviews, then shared-memory descriptors (bytes) too
        payload, buffers = serialize.dumps(content)
        if buffers:
            total = sum(b.nbytes for b in buffers)
            if total > self.max_buffers:  # the receiver would drop it: say so here
                raise SerializationError(
                    f"cannot send {total} bytes of arrays/tensors in one message: the mesh's "
                    f"limit is {self.max_buffers} bytes; send the data in parts, or register "
                    "it with monarch_kernel.RDMABuffer and let the other side read it")
        sh: list[int] = []
        if shm and buffers and _shm.available():
            big = [i for i, b in enumerate(buffers) if b.nbytes >= _shm.MIN_BYTES]
            if big:
                buffers = list(buffers)
                for i in big:
                    try:
                        pool = self.pool if shm in ("sender", "reply") else None
                        sb = pool.put(buffers[i]) if pool is not None else None
                        if sb is not None:
                            mode = "p"
                        else:  # a fresh file; a reply's is removed by its receiver
                            sb = _shm.create(buffers[i])
                            mode = "0" if shm == "sender" else "1"
                    except OSError as e:  # /dev/shm full or missing: send the bytes in-band
                        log.info("shared memory unavailable (%s); sending %d bytes in-band",
                                 e, buffers[i].nbytes)
                        continue
                    if shm_out is not None and mode != "1":
                        shm_out.append(sb.name)
                    buffers[i] = sb.descriptor(mode)
                sh = [i for i in big if not isinstance(buffers[i], memoryview)]
        lengths = [len(b) if isinstance(b, bytes) else b.nbytes for b in buffers]
        header = pack_header(type, id or self.new_id(), parent, self.sender, lengths, sh)
        return self.seal(header, payload, buffers)

    def decode(self, frames: list[Any], router: bool = False, lazy: bool = False,
               identity: list[bytes] | None = None) -> Message:
        """Verify and decode frames received from a socket.

        Parameters
        ----------
        frames : list of bytes, bytearray, memoryview or zmq.Frame
        router : bool
            True when the frames came from a ROUTER socket and start with
            identity frames.
        lazy : bool
            Leave the payload pickled until ``Message.content`` is first read.
        identity : list of bytes, optional
            The routing identity of frames that came without identity frames
            (a lane's: :mod:`monarch_kernel.transport.lane`); ``router`` must be False.

        Raises
        ------
        ProtocolError
            For a missing magic, a bad or missing signature, a replayed id,
            an oversized or malformed message, or a payload that does not
            unpickle. Nothing is unpickled before the signature is checked.
        """
        views = [memoryview(f) if type(f) in _PLAIN else _view(f) for f in frames]
        if router:
            try:
                if len(frames) > 1 and type(frames[1]) is bytes and frames[1][:4] == MAGIC:
                    i = 1  # (one identity frame, the envelope read as bytes: the common case)
                else:
                    i = next(i for i, v in enumerate(views) if v[:4] == MAGIC)
            except StopIteration:
                raise refused("not ours",
                              "no protocol magic frame (not a monarch_kernel message)") from None
            identity = [bytes(v) for v in views[:i]]
            views = views[i:]
        elif identity is None:
            identity = []
        if not views or views[0].nbytes < _HEAD or views[0][:4] != MAGIC:
            raise refused("not ours",
                          f"malformed message: {len(views)} frames, bad or missing magic")
        env = views[0]
        buffers: list[Any] = views[1:]
        if env.nbytes - _HEAD > self.max_header:
            raise refused("oversized",
                          f"message header+payload of {env.nbytes - _HEAD} bytes exceeds "
                          f"the limit of {self.max_header} bytes")
        total = sum(b.nbytes for b in buffers) if buffers else 0
        if total > self.max_buffers:
            raise refused("oversized", f"message buffers of {total} bytes exceed the limit of "
                          f"{self.max_buffers} bytes")
        expected = self._sign(env[36:], buffers)
        if not hmac.compare_digest(expected, env[_SIG]):
            raise refused("bad signature",
                          "bad message signature (wrong key or tampered message)")
        epoch, seq, hlen = _ENV.unpack_from(env, 36)
        if _HEAD + hlen > env.nbytes:
            raise refused("malformed",
                          f"malformed message header: length {hlen} beyond the frame")
        header_b, payload = env[_HEAD:_HEAD + hlen], env[_HEAD + hlen:]
        mtype, mid, parent, sender, lengths, sh = _parse_header(bytes(header_b))
        if (lengths or buffers) and (len(lengths) != len(buffers) or any(
                n != b.nbytes for n, b in zip(lengths, buffers, strict=True))):
            raise refused("malformed",
                          f"malformed message header: it names {len(lengths)} buffer(s) "
                          f"of {list(lengths)[:8]} bytes, the message has "
                          f"{[b.nbytes for b in buffers][:8]}")
        if sh:
            try:
                if any(i >= len(buffers) for i in sh) or len(set(sh)) != len(sh):
                    raise ValueError("bad or repeated index")
                described = [_shm.parse(buffers[i]) for i in sh]
            except (ValueError, UnicodeDecodeError) as e:
                raise refused("malformed", f"malformed shared-memory descriptor: {e}") from None
            # the files' sizes count, not the few bytes of their descriptors
            claimed = total - sum(buffers[i].nbytes for i in sh) + sum(d[1] for d in described)
            if claimed > self.max_buffers:
                raise refused("oversized", f"message buffers of {claimed} bytes exceed the "
                              f"limit of {self.max_buffers} bytes")
        with self._lock:
            self._admit(sender, epoch, seq)
        if sh:
            buffers = list(buffers)
            for i, (name, size, mode) in zip(sh, described, strict=True):
                buffers[i] = _ShmFrame(name, size, mode)
        msg = Message(mtype, mid, parent, sender, payload, identity, buffers,
                      [d[0] for d in described if d[2] == "p"] if sh else [])
        if not lazy:
            msg.content  # noqa: B018 - decode now, raising ProtocolError here
        return msg


class _ShmFrame:
    """A verified shared-memory descriptor, mapped when the payload is decoded."""

    __slots__ = ("mode", "name", "nbytes")

    def __init__(self, name: str, nbytes: int, mode: str) -> None:
        self.name, self.nbytes, self.mode = name, nbytes, mode

    def open(self) -> memoryview:
        return _shm.open_buffer(self.name, self.nbytes, self.mode)


def _hmac_new(key: bytes) -> Any:
    """A keyed HMAC-SHA256 to copy for each message: OpenSSL's own object
    (``_hashlib.HMAC``, what :func:`hmac.new` wraps in Python) where there
    is one, else :func:`hmac.new`'s."""
    try:
        from _hashlib import hmac_new
    except ImportError:  # (a Python built without OpenSSL's hashlib)
        return hmac.new(key, digestmod=hashlib.sha256)
    return hmac_new(key, digestmod="sha256")


def pack_header(type: str | int, id: str, parent: str | None, sender: str,
                lengths: list[int] | tuple = (), sh: list[int] | tuple = ()) -> bytes:
    """The header bytes of a message (see the module docstring).

    ``type`` is a name from :data:`TYPES` or a raw code (tests sign
    malformed headers with it).

    Raises
    ------
    ValueError
        If a name is not ASCII or longer than 254 bytes, or ``type`` is
        unknown.
    """
    if isinstance(type, str):
        if type not in _CODE:
            raise ValueError(f"unknown message type {type!r}; see protocol.TYPES")
        code = _CODE[type]
    else:
        code = type
    s, i = sender.encode("ascii"), id.encode("ascii")
    p = b"" if parent is None else parent.encode("ascii")
    ls, li, lp = len(s), len(i), len(p)
    if ls >= _NO_PARENT or li >= _NO_PARENT or lp >= _NO_PARENT:
        raise ValueError("a sender, id or parent of 255 bytes or more")
    fixed = _FIXED.pack(code, ls, li, _NO_PARENT if parent is None else lp,
                        len(lengths), len(sh))
    if not lengths and not sh:  # a control message (the common case)
        return b"".join((fixed, s, i, p))
    return b"".join((
        fixed, s, i, p,
        struct.pack(f"<{len(lengths)}Q", *lengths),
        struct.pack(f"<{len(sh)}H", *sh),
    ))


def _parse_header(h: bytes) -> tuple[str, str, str | None, str, tuple, tuple]:
    """(type, id, parent, sender, buffer lengths, shm indices) of header bytes."""
    if len(h) < _FIXED.size:
        raise refused("malformed", f"malformed message header: {len(h)} bytes")
    code, ls, li, lp, nb, nsh = _FIXED.unpack_from(h)
    plen = 0 if lp == _NO_PARENT else lp
    off = _FIXED.size + ls + li + plen
    if off + 8 * nb + 2 * nsh != len(h):
        raise refused("malformed", f"malformed message header: {len(h)} bytes, its fields "
                      f"need {off + 8 * nb + 2 * nsh}")
    if code >= len(TYPE_CODES):
        raise refused("malformed", f"malformed message header: unknown type code {code}")
    try:
        o = _FIXED.size
        sender = h[o:o + ls].decode("ascii")
        mid = h[o + ls:o + ls + li].decode("ascii")
        parent = None if lp == _NO_PARENT else h[o + ls + li:off].decode("ascii")
    except UnicodeDecodeError:
        raise refused("malformed", "malformed message header: a name that is not ASCII") from None
    if not nb and not nsh:  # a control message (the common case)
        return TYPE_CODES[code], mid, parent, sender, (), ()
    lengths = struct.unpack_from(f"<{nb}Q", h, off)
    sh = struct.unpack_from(f"<{nsh}H", h, off + 8 * nb)
    return TYPE_CODES[code], mid, parent, sender, lengths, sh


#: frame types memoryview() takes as they are (no zmq.Frame ``buffer`` to look up)
_PLAIN = frozenset({bytes, bytearray, memoryview})


def _view(frame: Any) -> memoryview:
    buf = getattr(frame, "buffer", None)  # zmq.Frame
    if buf is not None:
        return buf
    return memoryview(frame)
