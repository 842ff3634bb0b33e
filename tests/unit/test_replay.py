"""Replay protection over a mesh's whole life (wire version 4), and addressees.

A signed message is accepted once by a receiver, ever: not again after any
number of others (version 2 forgot an id after 65,536 others), not by a
fresh receiver that was told where the sender's stream stood when it
started (a restarted rank), and not from an earlier run of a rank (its
epoch). Messages that overtake one another (several threads of one sender)
are all accepted once.
"""

from __future__ import annotations

import random
import threading

import pytest

from monarch_kernel.errors import ProtocolError
from monarch_kernel.util.droplog import DropLog
from monarch_kernel.wire import protocol as protocol


def _codecs():
    key = protocol.new_key()
    return protocol.Codec(key, "ctl"), protocol.Codec(key, "r0")


def test_a_message_is_refused_again_after_more_than_65536_others():
    ctl, rank = _codecs()
    old = [bytes(f) for f in ctl.encode("execute", {"code": "print('once')"})]
    rank.decode(old)
    heartbeat = ctl.encode("heartbeat")  # (one signed message; the others must be new)
    for _ in range((1 << 16) + 10):
        rank.decode(ctl.seal(*_parts(heartbeat)), lazy=True)
    with pytest.raises(ProtocolError, match="replayed") as e:
        rank.decode(old)
    assert e.value.reason == "replayed"  # type: ignore[attr-defined]


def _parts(frames):
    """(header, payload) of a one-frame message, to sign again with a new number."""
    env = bytes(frames[0])
    n = int.from_bytes(env[52:56], "little")
    return env[56:56 + n], env[56 + n:]


def test_a_fresh_receiver_told_the_senders_position_refuses_what_was_sent_before():
    ctl, rank = _codecs()
    sent = [[bytes(f) for f in ctl.encode("execute", {"code": str(i)})] for i in range(5)]
    floor = ctl.mark()  # the controller starts a rank (restarts it) now
    later = ctl.encode("execute", {"code": "later"})
    fresh = protocol.Codec(ctl.key, "r0")  # the same mesh key, a new process
    fresh.expect("ctl", ctl.epoch, floor)
    for frames in sent:  # (none of them reached it before: it never saw them)
        with pytest.raises(ProtocolError, match="replayed"):
            fresh.decode(frames)
    assert fresh.decode(later).content == {"code": "later"}


def test_a_receiver_refuses_an_earlier_run_of_a_rank():
    key = protocol.new_key()
    ctl = protocol.Codec(key, "ctl")
    run1 = protocol.Codec(key, "r2", epoch=protocol.new_epoch())
    ctl.expect("r2", run1.epoch)
    captured = [[bytes(f) for f in run1.encode("reply", {"status": "ok", "value": i})]
                for i in range(3)]
    ctl.decode(captured[0])
    run2 = protocol.Codec(key, "r2", epoch=protocol.new_epoch())  # the rank restarted
    ctl.expect("r2", run2.epoch)
    for frames in captured:  # seen or not: an earlier run's messages are refused
        with pytest.raises(ProtocolError, match="another run") as e:
            ctl.decode(frames)
        assert e.value.reason == "stale epoch"  # type: ignore[attr-defined]
    assert ctl.decode(run2.encode("reply", {"status": "ok", "value": 9})).content["value"] == 9
    # a fresh controller-side codec with the same key, told to expect run 2: the same
    fresh = protocol.Codec(key, "ctl")
    fresh.expect("r2", run2.epoch)
    with pytest.raises(ProtocolError, match="another run"):
        fresh.decode(captured[1])


def test_a_restarted_rank_with_the_same_key_refuses_replays_from_any_earlier_time():
    """The controller side of it, end to end through its public methods: each
    run of a rank gets what its launcher passes (launch_env), and the
    controller's messages of any earlier time are refused by the new run."""
    ctl, _ = _codecs()
    history = []
    for run in range(3):
        floor = ctl.mark()
        epoch, ctl_epoch, got_floor = protocol.parse_streams(
            protocol.format_streams(protocol.new_epoch(), ctl.epoch, floor))
        rank = protocol.Codec(ctl.key, "r1", epoch=epoch)
        rank.expect("ctl", ctl_epoch, got_floor)
        for old in history:
            with pytest.raises(ProtocolError, match="replayed"):
                rank.decode(old)
        mine = [[bytes(f) for f in ctl.encode("execute", {"code": f"{run}.{i}"})]
                for i in range(4)]
        for frames in mine:
            rank.decode(frames)
            with pytest.raises(ProtocolError, match="replayed"):
                rank.decode(frames)
        history += mine


def test_a_codec_with_another_epoch_under_an_expected_name_is_refused():
    ctl, rank = _codecs()
    rank.expect("ctl", ctl.epoch, 0)
    impostor = protocol.Codec(ctl.key, "ctl")  # the key, but not the controller's stream
    with pytest.raises(ProtocolError, match="another run"):
        rank.decode(impostor.encode("execute", {"code": "1"}))
    assert rank.decode(ctl.encode("execute", {"code": "2"})).content == {"code": "2"}


def test_out_of_order_messages_are_accepted_once():
    ctl, rank = _codecs()
    msgs = [[bytes(f) for f in ctl.encode("heartbeat")] for _ in range(3000)]
    order = list(range(3000))
    # overtaken by up to 50 later ones (threads of one sender, two paths)
    order.sort(key=lambda i: i + random.Random(i).randint(0, 50))
    for i in order:
        rank.decode(msgs[i])
    for i in random.Random(1).sample(range(3000), 200):
        with pytest.raises(ProtocolError, match="replayed"):
            rank.decode(msgs[i])


def test_a_receiver_that_sees_part_of_a_stream_accepts_it_and_refuses_the_rest_replayed():
    """The controller's stream goes to many ranks: each sees numbers with gaps.
    What went to another rank, replayed here, is refused only if older than
    the window; what this rank got is refused always."""
    ctl, r0 = _codecs()
    mine = []
    for i in range(5000):
        frames = [bytes(f) for f in ctl.encode("heartbeat")]
        if i % 7 == 0:
            r0.decode(frames)
            mine.append(frames)
    for frames in mine:
        with pytest.raises(ProtocolError, match="replayed"):
            r0.decode(frames)
    w = protocol.Window()
    for s in range(1, 100_000, 7):
        assert w.admit(s)
    assert len(w.seen) <= protocol.REORDER_LIMIT + 1  # bounded memory


def test_window_accepts_each_number_once_whatever_the_order():
    rng = random.Random(5)
    for _ in range(200):
        w = protocol.Window(limit=16)
        accepted: set[int] = set()
        seqs = sorted(range(1, 400), key=lambda s: s + rng.randint(0, 30))
        seqs += rng.sample(seqs, 80)
        for s in seqs:
            if w.admit(s):
                assert s not in accepted
                accepted.add(s)
            assert len(w.seen) <= 17
        assert len(accepted) > 300  # (late ones within the window got in)


def test_window_accepts_a_number_overtaken_by_at_most_half_its_limit():
    rng = random.Random(7)
    for sparse in (1, 5):
        for _ in range(100):
            w = protocol.Window(limit=16)
            seqs = [sparse * i for i in range(1, 300)]
            seqs.sort(key=lambda s: s + rng.randint(0, 12 * sparse))
            for i, s in enumerate(seqs):
                overtaken = sum(1 for t in seqs[:i] if t > s)
                ok = w.admit(s)
                if overtaken <= 8:
                    assert ok, (s, overtaken)


def test_sequence_numbers_are_unique_across_threads():
    ctl, rank = _codecs()
    out: list[list[bytes]] = []
    lock = threading.Lock()

    def send() -> None:
        mine = [[bytes(f) for f in ctl.encode("heartbeat")] for _ in range(500)]
        with lock:
            out.extend(mine)

    threads = [threading.Thread(target=send) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for frames in out:
        rank.decode(frames)  # none refused: every number was given once


def test_wire_version_4_refuses_version_3():
    ctl, rank = _codecs()
    frames = [bytes(f) for f in ctl.encode("execute", {"code": "1"})]
    with pytest.raises(ProtocolError, match="magic"):
        rank.decode([b"MK/3" + frames[0][4:]])
    assert protocol.MAGIC == b"MK/4" and protocol.VERSION == 4


def test_streams_environment_is_checked():
    assert protocol.parse_streams("a:b:7") == (10, 11, 7)
    for bad in ("", "a:b", "0:b:1", "a:b:-1", "x:b:1", "a:b:1:2", f"{1 << 64:x}:1:1"):
        with pytest.raises(ValueError, match="MONARCH_STREAMS"):
            protocol.parse_streams(bad)


def test_drop_log_reports_a_flood_in_few_lines(caplog):
    now = [0.0]
    import logging

    log = logging.getLogger("test.drops")
    caplog.set_level(logging.WARNING, logger="test.drops")
    drops = DropLog(log, "the controller", clock=lambda: now[0])
    for i in range(20_000):
        now[0] = i / 20_000  # 20,000 in one second
        drops.drop("bad signature", "bad message signature", b"peer-1")
    drops.drop("replayed", "replayed message", b"peer-2")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3  # the first ones, as they came
    now[0] = 6.0
    drops.tick()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 4, lines
    assert lines[-1] == ("the controller dropped 19,998 more messages from 2 peers in the "
                         "last 6 s: 19,997 bad signature, 1 replayed")
    assert drops.total == 20_001 and drops.by_reason["bad signature"] == 20_000
    drops.tick()  # nothing more
    assert len(caplog.records) == 4
    for i in range(1000):  # the flood goes on: one line per interval
        now[0] = 6.0 + i / 100
        drops.drop("bad signature", "bad message signature", b"peer-1")
    now[0] = 20.0
    drops.tick()
    lines = [r.getMessage() for r in caplog.records][4:]
    assert [ln.split(" in the last")[0] for ln in lines] == [
        "the controller dropped 500 more messages from 1 peer",
        "the controller dropped 500 more messages from 1 peer"], lines
    now[0] = 100.0  # quiet for long: the next drop is told at once again
    drops.drop("replayed", "replayed message x", b"peer-3")
    assert caplog.records[-1].getMessage() == "the controller dropped a message: replayed message x"


# ------------------------------------------------ one message for many ranks
def _ranks(key: bytes, n: int) -> list[protocol.Codec]:
    return [protocol.Codec(key, f"r{r}") for r in range(n)]


def test_a_broadcast_is_one_message_every_addressed_rank_accepts_once():
    key = protocol.new_key()
    ctl, ranks = protocol.Codec(key, "ctl"), _ranks(key, 4)
    frames = [bytes(f) for f in ctl.encode("call", {"m": "step"}, to=[0, 1, 2, 3])]
    for r in ranks:  # the same bytes, signed once, for every rank
        msg = r.decode(frames)
        assert msg.content == {"m": "step"} and msg.to == ((0, 4),)
    for r in ranks:  # and each accepts it once
        with pytest.raises(ProtocolError, match="replayed"):
            r.decode(frames)


def test_a_message_for_some_ranks_is_refused_by_the_others():
    key = protocol.new_key()
    ctl, ranks = protocol.Codec(key, "ctl"), _ranks(key, 6)
    subset = [bytes(f) for f in ctl.encode("call", {"m": "x"}, to=[1, 2, 4])]
    later = [bytes(f) for f in ctl.encode("call", {"m": "y"}, to=range(6))]
    for r in range(6):  # every rank took the later broadcast first: the subset's
        ranks[r].decode(later)  # number lies below what it accepted, yet never seen
    for r in range(6):
        if r in (1, 2, 4):
            assert ranks[r].decode(subset).content == {"m": "x"}
        else:
            with pytest.raises(ProtocolError, match="addressed to other ranks") as e:
                ranks[r].decode(subset)
            assert e.value.reason == "not addressed"  # type: ignore[attr-defined]
    # refused before its number was taken: the rank still accepts numbers after it
    assert ranks[0].decode(ctl.encode("call", {"m": "z"}, to=[0])).content == {"m": "z"}


def test_the_addressees_are_signed():
    key = protocol.new_key()
    ctl, r3 = protocol.Codec(key, "ctl"), protocol.Codec(key, "r3")
    env = bytearray(ctl.encode("call", {"m": "x"}, to=[0, 1])[0])
    hlen = int.from_bytes(env[52:56], "little")
    header = bytes(env[56:56 + hlen])
    assert header.endswith((0).to_bytes(4, "little") + (2).to_bytes(4, "little"))
    env[56 + hlen - 4:56 + hlen] = (4).to_bytes(4, "little")  # [0, 2) -> [0, 4): rank 3 too
    with pytest.raises(ProtocolError, match="signature"):
        r3.decode([bytes(env)])


def test_unaddressed_messages_and_the_controller_are_unaffected():
    key = protocol.new_key()
    ctl, r5 = protocol.Codec(key, "ctl"), protocol.Codec(key, "r5")
    assert r5.decode(ctl.encode("heartbeat")).type == "heartbeat"  # names no addressees
    assert ctl.decode(r5.encode("reply", {"status": "ok", "value": 1}, parent="p")).to == ()
    assert protocol.rank_ranges([5, 0, 1, 2, 9, 10, 2]) == ((0, 3), (5, 6), (9, 11))
    assert protocol.rank_ranges([]) == ()
    with pytest.raises(ValueError):
        protocol.rank_ranges([-1])
