"""The message schemas (monarch_kernel.wire.messages) against the wire's list of types."""

from __future__ import annotations

import re

import pytest

from monarch_kernel.wire import messages, protocol, serialize
from monarch_kernel.wire.messages import (
    ACTOR,
    IPC,
    KEEP,
    METHOD,
    ONEWAY,
    PAYLOAD,
    REFS,
    SOURCES,
    UID,
    WAIT_ACTOR,
    WAIT_CALL,
    WAIT_ENTRIES,
    WAIT_SEQ,
    WAITED,
    Call,
    RankDead,
    WaitNotice,
)

pytestmark = pytest.mark.timeout(30)

#: the codes every type had before rank_dead was added: they must not move
CODES_V2 = ("buffer", "call", "calls", "debug", "debug_input", "display", "event", "execute",
            "free", "heartbeat", "hello", "interrupt", "keys", "pull", "push", "ref", "replies",
            "reply", "setup", "shm_done", "spawn_actor", "state", "stop", "stop_actor", "stream")


def test_every_type_has_a_row_in_the_schema_table():
    doc = messages.__doc__ or ""
    rows = set(re.findall(r"^``(\w+)``\s", doc, re.MULTILINE))
    assert rows == set(protocol.TYPES)


def test_type_codes_of_existing_types_stay():
    assert protocol.TYPE_CODES[:len(CODES_V2)] == CODES_V2
    assert protocol.TYPE_CODES[len(CODES_V2):] == ("rank_dead", "attach", "detach")
    assert len(set(protocol.TYPE_CODES)) == len(protocol.TYPE_CODES) < 255


def test_call_keys_are_the_schema_keys():
    consts = {ACTOR, METHOD, UID, PAYLOAD, IPC, ONEWAY, REFS, KEEP, SOURCES, WAITED}
    assert len(consts) == 10
    assert consts == Call.__required_keys__ | Call.__optional_keys__
    assert Call.__required_keys__ == {ACTOR, METHOD, UID, PAYLOAD}


def test_wait_notice_keys_are_the_schema_keys():
    consts = {WAIT_ACTOR, WAIT_CALL, WAIT_SEQ, WAIT_ENTRIES}
    assert len(consts) == 4
    assert consts | {"kind"} == WaitNotice.__required_keys__


def test_named_keys_pickle_as_the_letters() -> None:
    """Senders build with the constants: the bytes are those of the letters."""
    packed = serialize.Packed.pack((1, 2))
    named: Call = {ACTOR: "c", METHOD: "incr", UID: "u1", PAYLOAD: packed, ONEWAY: True}
    letters = {"a": "c", "m": "incr", "u": "u1", "p": packed, "o": True}
    assert serialize.dumps(named) == serialize.dumps(letters)


def test_rank_dead_is_its_own_message():
    codec = protocol.Codec(protocol.new_key(), "ctl")
    notice = RankDead(rank=3, addr="tcp://127.0.0.1:5555", reason="exit code 1")
    msg = protocol.Codec(codec.key, "r0").decode(codec.encode("rank_dead", notice))
    assert msg.type == "rank_dead"
    assert msg.content == {"rank": 3, "addr": "tcp://127.0.0.1:5555", "reason": "exit code 1"}
    assert "sys" not in msg.content
