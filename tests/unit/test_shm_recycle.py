"""Receive buffers of pooled shared-memory transfers are recycled only when
nothing refers to them any more (monarch_kernel.wire.shm._recv_buffer)."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from monarch_kernel.wire import protocol as protocol
from monarch_kernel.wire import shm as shm

pytestmark = pytest.mark.skipif(not shm.available(), reason="no /dev/shm")

N = 1 << 18  # float32 elements: 1 MiB, the shared-memory threshold


@pytest.fixture
def send():
    a = protocol.Codec(protocol.new_key(), "a")
    a.pool = shm.Pool()
    b = protocol.Codec(a._key, "b")

    def send(value):
        names: list[str] = []
        msg = b.decode(a.encode("push", value, shm="sender", shm_out=names))
        assert names, "the buffer did not go through shared memory"
        out = msg.content
        a.release_shm(names)
        return out

    yield send
    a.pool.close()
    gc.collect()


def test_a_buffer_in_use_is_never_overwritten(send):
    first = send(np.full(N, 1, np.float32))
    view = first[100:200]  # a view refers to the array that owns the memory
    second = send(np.full(N, 2, np.float32))
    del first
    third = send(np.full(N, 3, np.float32))
    assert (view == 1).all() and (second == 2).all() and (third == 3).all()
    assert len({view.ctypes.data - 100 * 4, second.ctypes.data, third.ctypes.data}) == 3


def test_a_buffer_nothing_refers_to_is_reused(send):
    first = send(np.full(N, 1, np.float32))
    address = first.ctypes.data
    del first
    again = send(np.full(N, 7, np.float32))
    assert again.ctypes.data == address and (again == 7).all()


def test_tensors_hold_their_buffer(send):
    torch = pytest.importorskip("torch")
    t = send(torch.full((N,), 1.0))
    u = t[5:9]
    del t
    w = send(torch.full((N,), 2.0))
    assert float(u.sum()) == 4.0 and float(w.sum()) == 2.0 * N
    address = w.data_ptr()
    del w
    assert send(torch.full((N,), 3.0)).data_ptr() == address


def test_kept_buffers_are_bounded(send, monkeypatch):
    monkeypatch.setattr(shm, "RECV_MAX_BYTES", 3 << 20)
    kept = [send(np.full(N, i, np.float32)) for i in range(6)]  # all in use: none reusable
    assert sum(b.nbytes for b in shm._recv) <= 3 << 20
    assert [float(k[0]) for k in kept] == list(range(6))


def _our_files() -> set[str]:
    import os

    return {n for n in os.listdir(shm.DIRECTORY) if shm.NAME_RE.match(n)}


def test_replies_reuse_the_workers_pooled_files():
    """A worker's large replies go through pooled files, which it reuses once the
    controller has copied them out (``shm_done``); every result keeps its own
    bytes, and a reply nobody waits for any more is acknowledged too."""
    import sys

    import cloudpickle

    from monarch_kernel import Actor, endpoint, spawn_procs

    cloudpickle.register_pickle_by_value(sys.modules[__name__])

    class Maker(Actor):
        @endpoint
        def make(self, value: float) -> np.ndarray:
            return np.full(4 * N, value, np.float32)  # 4 MiB

        @endpoint
        def slow(self, secs: float) -> np.ndarray:
            import time

            time.sleep(secs)
            return np.full(4 * N, 9, np.float32)

        @endpoint
        def files(self) -> int:
            from monarch_kernel.worker import worker as worker

            pool = worker.current.codec.pool
            return len(pool._free) + len(pool._busy)

    procs = spawn_procs(1)
    try:
        m = procs.spawn("maker", Maker)
        before = _our_files()
        results = [m.make.call_one(float(i)).get(timeout=30) for i in range(12)]
        assert [float(r[0]) for r in results] == [float(i) for i in range(12)]
        assert all((r == i).all() for i, r in enumerate(results))
        made = _our_files() - before
        assert m.files.call_one().get(timeout=30) <= 2 and len(made) <= 3, made
        f = m.slow.call_one(0.5)
        with pytest.raises(TimeoutError):
            f.get(timeout=0.05)  # given up on: its reply still comes, and is acknowledged
        del f
        import time

        time.sleep(1.0)
        assert float(m.make.call_one(5.0).get(timeout=30)[0]) == 5.0
        assert m.files.call_one().get(timeout=30) <= 2
    finally:
        procs.stop()
    gc.collect()


def test_a_killed_workers_pooled_files_are_removed():
    import os
    import signal
    import sys

    import cloudpickle

    from monarch_kernel import Actor, endpoint, spawn_procs
    from monarch_kernel.testing.kernel import wait_for

    cloudpickle.register_pickle_by_value(sys.modules[__name__])

    class Maker(Actor):
        @endpoint
        def make(self) -> np.ndarray:
            return np.ones(4 * N, np.float32)

    procs = spawn_procs(1)
    try:
        m = procs.spawn("maker", Maker)
        before = _our_files()
        m.make.call_one().get(timeout=30)
        made = _our_files() - before
        assert made  # the worker's pooled file
        os.kill(procs.controller.ranks[0].pid, signal.SIGKILL)
        wait_for(lambda: not (made & _our_files()), 15, what="the dead worker's files removed")
    finally:
        procs.stop()


def test_a_killed_workers_unseen_pool_files_are_swept_soon(monkeypatch):
    """Files of a worker's own pools that the controller never saw (its peer and
    buffer pools) are swept after the worker is killed outright, not only when a
    later controller starts; a live worker's files stay."""
    import os
    import signal
    import sys
    import time

    import cloudpickle

    from monarch_kernel import Actor
    from monarch_kernel.controller import controller as controller
    from monarch_kernel import endpoint
    from monarch_kernel import spawn_procs
    from monarch_kernel.testing.kernel import wait_for

    cloudpickle.register_pickle_by_value(sys.modules[__name__])

    class Holder(Actor):
        @endpoint
        def hold(self) -> str:
            from monarch_kernel.wire import shm as worker_shm

            self.pool = worker_shm.Pool()  # (as a peer or buffer pool: locked, kept)
            name, self.mm = self.pool.lease(1 << 20)
            return name

    # sweep at once and 1 s after a death, taking files older than 0.5 s
    monkeypatch.setattr(controller, "SWEEP_AFTER_DEATH_S", (0.0, 1.0))
    monkeypatch.setattr(controller, "SWEEP_MIN_AGE_S", 0.5)
    procs = spawn_procs(2)
    try:
        h = procs.spawn("holder", Holder)
        names = h.hold.call().get(timeout=30)
        doomed, kept = names.values()
        path = os.path.join(shm.DIRECTORY, doomed)
        assert os.path.exists(path)
        os.kill(procs.controller.ranks[0].pid, signal.SIGKILL)
        wait_for(lambda: not os.path.exists(path), 15, what="the killed worker's pool file swept")
        time.sleep(1.5)  # (both sweeps are past)
        assert os.path.exists(os.path.join(shm.DIRECTORY, kept))  # alive: kept
    finally:
        procs.stop()


def test_pooled_files_of_a_killed_process_are_swept_and_live_ones_kept(tmp_path,
                                                                        monkeypatch):
    """A process killed outright leaves its pooled files (no atexit ran); the
    next sweep removes them, and never a file whose pool is alive, nor
    anything that is not a regular file (a FIFO must not block the sweep)."""
    import os
    import select
    import signal
    import subprocess
    import sys
    import textwrap

    shm_dir = tmp_path / "shm"  # (not the host's /dev/shm: nobody else's files)
    shm_dir.mkdir()
    monkeypatch.setattr(shm, "DIRECTORY", str(shm_dir))
    script = tmp_path / "owner.py"
    script.write_text(textwrap.dedent(f"""
        import time
        from monarch_kernel.wire import shm as shm
        shm.DIRECTORY = {str(shm_dir)!r}
        pool = shm.Pool()
        name, mm = pool.lease(1 << 20)
        print(name, flush=True)
        time.sleep(60)
    """))
    os.mkfifo(shm_dir / ("monarch-p" + "0" * 23))
    live = shm.Pool()
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        mine, _ = live.lease(1 << 20)
        assert select.select([proc.stdout], [], [], 60)[0], "the owner did not start"
        theirs = proc.stdout.readline().strip()
        assert shm.NAME_RE.match(theirs) and theirs.startswith(shm.POOL_PREFIX)
        assert shm.sweep_stale(min_age=0) == []  # alive: kept (and the FIFO skipped)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        assert (shm_dir / theirs).exists()  # left behind
        assert shm.sweep_stale(min_age=0) == [theirs]
        assert not (shm_dir / theirs).exists() and (shm_dir / mine).exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        proc.stdout.close()
        live.close()
    assert not (shm_dir / mine).exists()


def test_a_forked_child_never_removes_its_parents_files():
    """A fork (multiprocessing, a user's os.fork) that exits, is sent SIGTERM or
    runs atexit owns none of the parent's shared-memory files."""
    import os

    pool = shm.Pool()
    try:
        name, _ = pool.lease(1 << 20)
        pid = os.fork()
        if pid == 0:
            try:
                shm.cleanup()  # what a worker's exit or SIGTERM handler runs
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        assert os.path.exists(os.path.join(shm.DIRECTORY, name))
    finally:
        pool.close()
