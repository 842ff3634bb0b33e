"""Edge cases of the data plane found by review: pooled files that do not fit,
mappings of removed files, restarts, oversized peer replies, handles of another
mesh, in-band limits. Real worker processes, real shared memory."""

from __future__ import annotations

import os
import sys

import cloudpickle
import numpy as np
import pytest

from monarch_kernel import Actor
from monarch_kernel import RDMABuffer
from monarch_kernel import endpoint
from monarch_kernel.wire import shm as shm
from monarch_kernel import spawn_procs

cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.skipif(not shm.available(), reason="no /dev/shm")

MiB = 1 << 20


def _our_files() -> set[str]:
    return {n for n in os.listdir(shm.DIRECTORY) if shm.NAME_RE.match(n)}


class Edge(Actor):
    def __init__(self) -> None:
        self.kept: dict[str, object] = {}

    @endpoint
    def array(self, nbytes: int) -> np.ndarray:
        return np.ones(nbytes // 4, np.float32)

    @endpoint
    def small_pool(self, nbytes: int) -> None:
        from monarch_kernel.worker import worker as worker

        worker.current.codec.pool.max_bytes = nbytes

    @endpoint
    def register(self, name: str, nbytes: int) -> RDMABuffer:
        a = np.arange(nbytes // 8, dtype=np.int64)
        self.kept[name] = a
        return RDMABuffer(a)

    @endpoint
    def read(self, buf: RDMABuffer, route: str | None = None, limit: int | None = None) -> str:
        from monarch_kernel.tensors import buffer_ops as buffer_ops
        from monarch_kernel.actor.peers import peer_host
        from monarch_kernel.worker.worker import current

        real = buffer_ops._route
        if route:
            buffer_ops._route = lambda host, b: route
        codec = peer_host(current).codec
        old = codec.max_buffers
        if limit:
            codec.max_buffers = limit
        try:
            dst = np.zeros(buf.size() // 8, np.int64)
            buf.read_into(dst).get(timeout=30)
            return "ok" if (dst == np.arange(dst.size)).all() else "wrong bytes"
        except Exception as e:  # noqa: BLE001 - the test reads the message
            return f"{type(e).__name__}: {e}"
        finally:
            buffer_ops._route = real
            codec.max_buffers = old

    @endpoint
    def huge(self) -> np.ndarray:
        return np.zeros((1 << 30) + 8, np.uint8)  # never touched: no memory used

    @endpoint
    def ask_huge(self, other: object) -> str:
        try:
            other.huge.call_one().get(timeout=60)
        except Exception as e:  # noqa: BLE001 - the test reads the message
            return f"{type(e).__name__}: {e}"
        return "no error"

    @endpoint
    def ping(self) -> str:
        return "pong"


@pytest.fixture
def edges():
    procs = spawn_procs(2)
    try:
        yield procs, procs.spawn("edge", Edge)
    finally:
        procs.stop()


def test_replies_too_big_for_the_pool_leave_no_files(edges) -> None:
    _, e = edges
    r0 = e.slice(procs=0)
    r0.small_pool.call_one(10 * MiB).get(timeout=30)
    before = _our_files()
    r0.array.call_one(6 * MiB).get(timeout=30)  # pooled
    for _ in range(4):  # do not fit next to it: the pool makes room, or a one-off file
        assert r0.array.call_one(8 * MiB).get(timeout=30).sum() == 2 * MiB
    assert len(_our_files() - before) <= 1


def test_mappings_of_a_stopped_meshs_files_are_dropped() -> None:
    procs = spawn_procs(1)
    try:
        e = procs.spawn("edge", Edge)
        e.array.call_one(4 * MiB).get(timeout=30)
        names = procs.controller.ranks[0].shm_files
        assert names
    finally:
        procs.stop()
    with open("/proc/self/maps") as f:
        mapped = f.read()
    assert not [n for n in names if n in mapped]


def test_a_restarted_reader_leaves_no_lent_files(edges) -> None:
    procs, e = edges
    buf = e.slice(procs=0).register.call_one("a", 4 * MiB).get(timeout=30)
    before = _our_files()
    assert e.slice(procs=1).read.call_one(buf).get(timeout=30) == "ok"
    lent = _our_files() - before
    assert lent  # the reader's pooled file, kept for its next read
    procs.restart([1], timeout=60)
    assert not (lent & _our_files())


def test_a_peer_reply_over_the_limit_is_an_error_and_the_actor_lives(edges) -> None:
    _, e = edges
    msg = e.slice(procs=0).ask_huge.call_one(e.slice(procs=1)).get(timeout=90)
    assert "cannot be sent back" in msg and "limit" in msg, msg
    assert e.slice(procs=1).ping.call_one().get(timeout=30) == "pong"


def test_in_band_limit_is_a_clear_error(edges) -> None:
    _, e = edges
    buf = e.slice(procs=0).register.call_one("b", 4 * MiB).get(timeout=30)
    msg = e.slice(procs=1).read.call_one(buf, "band", MiB).get(timeout=30)
    assert msg.startswith("ValueError") and "in parts" in msg, msg
    assert e.slice(procs=1).read.call_one(buf, "band").get(timeout=30) == "ok"


def test_another_mesh_of_the_program_reads_a_buffer_another_program_cannot(edges) -> None:
    """The ranks of another mesh of this program read a buffer (shared memory and
    in-band, signed with the owner mesh's key: monarch_kernel.actor.mesh_keys); a
    buffer of a stopped mesh, or of another program's, is refused at once."""
    import subprocess
    import textwrap

    _, e = edges
    buf = e.slice(procs=0).register.call_one("c", MiB).get(timeout=30)
    other = spawn_procs(2)
    try:
        o = other.spawn("edge", Edge)
        for r in (0, 1):
            for route in (None, "band"):
                assert o.slice(procs=r).read.call_one(buf, route).get(timeout=30) == "ok"
        theirs_stopped = o.slice(procs=0).register.call_one("d", MiB).get(timeout=30)
    finally:
        other.stop()
    msg = e.slice(procs=1).read.call_one(theirs_stopped).get(timeout=30)
    assert msg.startswith("MeshFailure") and "stopped" in msg, msg  # (as a dead owner's)
    tests = os.path.dirname(os.path.abspath(__file__))
    prog = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent("""
            import sys, cloudpickle
            sys.path.insert(0, sys.argv[1])
            import test_buffer_edges as t
            from monarch_kernel import spawn_procs
            with spawn_procs(1) as pm:
                buf = pm.spawn("edge", t.Edge).register.call_one("x", 1 << 20).get(timeout=30)
                print(cloudpickle.dumps(buf).hex(), flush=True)
                sys.stdin.readline()  # until the test is done
        """), tests], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        cwd=os.path.dirname(tests))
    try:
        line = prog.stdout.readline()
        assert line.strip(), "the other program printed no buffer handle"
        theirs = cloudpickle.loads(bytes.fromhex(line.strip()))
        msg = e.slice(procs=1).read.call_one(theirs).get(timeout=30)
        assert msg.startswith("MeshError") and "another program" in msg, msg
    finally:
        prog.stdin.write("\n")
        prog.stdin.flush()
        prog.wait(timeout=60)



def test_deadlines_fire_once_and_cancelled_ones_never() -> None:
    """The one timeout thread of RDMABuffer operations (no thread per operation)."""
    import threading
    import time

    from monarch_kernel.tensors.buffer_ops import _Deadlines

    d = _Deadlines()
    d.IDLE_S = 0.2  # (its thread ends once idle: none is left behind)
    fired: list[int] = []
    done = threading.Event()
    # the first is left to fire; the others (due long after) are cancelled first, as
    # finished operations do: the heap is compacted, not left to grow
    entries = [d.add(0.05 if i == 0 else 60.0, lambda i=i: fired.append(i))
               for i in range(3000)]
    for e in entries[1:]:
        d.cancel(e)
    assert len(d._heap) < 2000
    d.add(0.1, done.set)
    assert done.wait(10)
    time.sleep(0.05)
    assert fired == [0]
    deadline = time.monotonic() + 10
    while d._thread is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert d._thread is None


class Owner(Actor):
    @endpoint
    def make(self) -> RDMABuffer:
        self.a = np.arange(64, dtype=np.uint8)
        return RDMABuffer(self.a)


class Reader(Actor):
    @endpoint
    def flood(self, buf: RDMABuffer, n: int) -> int:
        dsts = [np.zeros(64, np.uint8) for _ in range(n)]
        futures = [buf.read_into(d) for d in dsts]  # all at once, then wait
        for f in futures:
            f.get(timeout=60)
        return sum(int(d.sum()) for d in dsts)


def test_thousands_of_reads_at_once_over_zeromq_are_all_served(monkeypatch) -> None:
    # Over ZeroMQ (other hosts; here MONARCH_LANES=0) the owner's peer I/O thread
    # served each read and queued its reply in its own outbox: past some 2,000
    # reads at once it blocked on itself for good (3 runs of 3 on the code before).
    monkeypatch.setenv("MONARCH_LANES", "0")
    n = 12000
    procs = spawn_procs(2, telemetry_interval=0)
    try:
        owner = procs.slice(procs=0).spawn("owner", Owner)
        reader = procs.slice(procs=1).spawn("reader", Reader)
        buf = owner.make.call_one().get(timeout=30)
        assert reader.flood.call_one(buf, n).get(timeout=180) == n * sum(range(64))
    finally:
        procs.stop()


def test_a_bad_timeout_is_refused_at_once_as_by_future_get() -> None:
    procs = spawn_procs(1, telemetry_interval=0)
    try:
        buf = procs.spawn("owner", Owner).make.call_one().get(timeout=30)
        dst = np.zeros(64, np.uint8)
        for bad, err in ((-1, ValueError), (float("nan"), ValueError), ("5", TypeError)):
            with pytest.raises(err, match="timeout is .*seconds"):
                buf.read_into(dst, timeout=bad)
            with pytest.raises(err, match="timeout is .*seconds"):
                buf.write_from(dst, timeout=bad)
    finally:
        procs.stop()
