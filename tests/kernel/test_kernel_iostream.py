"""The kernel's OutStream (monarch_kernel/kernel/iostream.py): a flush with
nothing written costs nothing, and output still comes before the reply."""

from __future__ import annotations

import threading

import pytest
import zmq
from ipykernel.iostream import IOPubThread
from jupyter_client.session import Session

from monarch_kernel.kernel.iostream import OutStream
from monarch_kernel.testing.kernel import KernelSession


@pytest.fixture
def stream():
    """A real IOPub thread on a PUB socket, our OutStream on it, and a SUB reader."""
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.linger = 0
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    sub = ctx.socket(zmq.SUB)
    sub.linger = 0
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    thread = IOPubThread(pub)
    thread.start()
    session = Session(key=b"k")
    out = OutStream(session, thread, "stdout", watchfd=False)
    # a PUB drops what it sends before the SUB is connected: wait until it hears
    for _ in range(200):
        out.write("?")
        out.flush()
        if sub.poll(50):
            break
    while sub.poll(100):
        sub.recv_multipart()
    try:
        yield out, thread, session, sub
    finally:
        out.close()
        # end the thread loop's event-pipe GC task before the loop stops (else asyncio
        # reports "Task was destroyed but it is pending" at exit)
        task = getattr(thread, "_event_pipe_gc_task", None)
        if task is not None:
            ended = threading.Event()

            def cancel() -> None:
                task.cancel()
                task.add_done_callback(lambda _: ended.set())

            thread.io_loop.add_callback(cancel)
            ended.wait(5)
        thread.stop()
        thread.close()
        sub.close()
        ctx.term()


def _texts(session: Session, sub: zmq.Socket, wait_ms: int) -> list[str]:
    out = []
    while sub.poll(wait_ms):
        _, msg = session.feed_identities(sub.recv_multipart())
        out.append(session.deserialize(msg)["content"]["text"])
        wait_ms = 50
    return out


def test_flush_publishes_what_was_written_before_it_returns(stream):
    out, thread, session, sub = stream
    out.write("hello ")
    out.write("world")
    out.flush()
    # flush waited for the IOPub thread: the message is on the wire already
    assert _texts(session, sub, 2000) == ["hello world"]


def test_a_flush_with_nothing_written_skips_the_round_trip(stream):
    out, thread, session, sub = stream
    out.write("a")
    out.flush()
    skipped = out.flushes_skipped
    scheduled = []
    real = thread.schedule

    def counting(f):
        scheduled.append(f)
        real(f)

    thread.schedule = counting
    try:
        for _ in range(5):
            out.flush()
        assert out.flushes_skipped == skipped + 5
        assert scheduled == []  # nothing handed to the IOPub thread
        out.write("b")
        out.flush()  # a write since: the real flush runs
        assert scheduled, "a flush after a write must go through the IOPub thread"
    finally:
        thread.schedule = real
    assert _texts(session, sub, 2000) == ["a", "b"]


def test_writes_from_other_threads_are_flushed(stream):
    out, thread, session, sub = stream

    def writer(i: int) -> None:
        for _ in range(100):
            out.write(str(i))

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    out.flush()
    text = "".join(_texts(session, sub, 2000))
    assert sorted(text) == sorted("0123" * 100)


def test_the_kernel_uses_it_and_keeps_output_before_idle():
    ks = KernelSession("monarch")
    try:
        r = ks.execute("import sys\nprint(type(sys.stdout).__module__, "
                       "type(sys.stderr).__module__)")
        assert r.status == "ok"
        assert r.stream().split() == ["monarch_kernel.kernel.iostream"] * 2
        for _ in range(3):  # the same cell many times: output never lags the idle status
            r = ks.execute("import sys\nprint('a', end='')\nsys.stdout.flush()\nprint('b')\n"
                           "print('c', file=sys.stderr)")
            assert r.status == "ok"
            streams = [(m["content"]["name"], m["content"]["text"]) for _, m in r.messages
                       if m["msg_type"] == "stream"]
            assert "".join(t for n, t in streams if n == "stdout") == "ab\n"
            assert "".join(t for n, t in streams if n == "stderr") == "c\n"
    finally:
        ks.shutdown()


def test_history_is_cached_in_memory_and_written_at_shutdown():
    """The kernel batches IPython's history writes (HISTORY_CACHE_CELLS); what
    a session ran is in the SQLite file once the kernel has shut down."""
    import sqlite3
    import uuid

    ks = KernelSession("monarch")
    marker = f"history_marker_{uuid.uuid4().hex[:12]}"
    try:
        r = ks.execute("hm = get_ipython().history_manager\n"
                       "hm.db_cache_size, str(hm.hist_file), hm.session_number")
        assert r.status == "ok", r.error_text()
        size, path, session = eval(r.result_text())  # noqa: S307 - our own repr of a tuple
        assert size == 20
        for i in range(3):
            assert ks.execute(f"{marker} = {i}").status == "ok"
    finally:
        ks.shutdown()
    if path == ":memory:":
        pytest.skip("IPython history is not kept in a file here")
    with sqlite3.connect(path) as db:
        rows = db.execute("SELECT source FROM history WHERE session = ? AND source LIKE ?",
                          (session, f"{marker}%")).fetchall()
    assert [r[0] for r in rows] == [f"{marker} = {i}" for i in range(3)]
