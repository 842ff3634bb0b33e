"""RDMABuffer: a rank registers a tensor, others read and write it directly
(the data plane). Real worker processes, real peer sockets, real
shared memory; CUDA routes are in tests/system/test_gpu.py."""

from __future__ import annotations

import os
import signal
import sys
import time

import cloudpickle
import pytest

from monarch_kernel import Actor, MeshError, RDMABuffer, endpoint, spawn_procs

cloudpickle.register_pickle_by_value(sys.modules[__name__])

N = 1 << 20  # float32 elements: 4 MiB


class Holder(Actor):
    """Registers tensors and arrays; reads and writes others' buffers."""

    def __init__(self) -> None:
        self.kept: dict[str, object] = {}

    @endpoint
    def register(self, name: str, n: int = N, dtype: str = "float32") -> RDMABuffer:
        import torch

        t = torch.arange(n, dtype=getattr(torch, dtype))
        self.kept[name] = t
        return RDMABuffer(t)

    @endpoint
    def register_numpy(self, name: str, n: int) -> RDMABuffer:
        import numpy as np

        a = np.arange(n, dtype=np.int64)
        self.kept[name] = a
        return RDMABuffer(a)

    @endpoint
    def total(self, name: str) -> float:
        return float(self.kept[name].sum())

    @endpoint
    def read(self, buf: RDMABuffer, n: int = N, dtype: str = "float32",
             route: str | None = None, timeout: float = 30.0) -> object:
        import torch

        _force_route(route)
        dst = torch.full((n,), -1, dtype=getattr(torch, dtype))
        got = buf.read_into(dst, timeout=timeout).get(timeout=timeout + 5)
        return got, dst

    @endpoint
    async def read_async(self, buf: RDMABuffer) -> float:
        import torch

        dst = torch.empty(N)
        await buf.read_into(dst)
        return float(dst.double().sum())  # (float64: the same sum on any machine)

    @endpoint
    def write(self, buf: RDMABuffer, value: float, n: int = N, route: str | None = None) -> None:
        import torch

        _force_route(route)
        buf.write_from(torch.full((n,), value)).get(timeout=30)

    @endpoint
    def read_numpy(self, buf: RDMABuffer, n: int) -> object:
        import numpy as np

        dst = np.zeros(n, dtype=np.int64)
        buf.read_into(dst).get(timeout=30)
        return dst

    @endpoint
    def try_(self, what: str, buf: RDMABuffer) -> str:
        import torch

        try:
            if what == "small":
                buf.read_into(torch.empty(10))
            elif what == "strided":
                buf.read_into(torch.empty(2 * N)[::2])
            elif what == "large":
                buf.write_from(torch.empty(N + 1))
            elif what == "readonly":
                import numpy as np

                a = np.zeros(N, np.float32)
                a.flags.writeable = False
                buf.read_into(a)
            elif what == "dropped":
                buf.read_into(torch.empty(N)).get(timeout=30)
            elif what == "empty":
                RDMABuffer(torch.empty(0))
        except (ValueError, MeshError) as e:
            return f"{type(e).__name__}: {e}"
        return "no error"

    @endpoint
    def drop(self, buf: RDMABuffer) -> None:
        buf.drop().get(timeout=30)

    @endpoint
    def registered(self, buf: RDMABuffer) -> bool:
        from monarch_kernel.tensors import buffer as buffer

        return buffer.registered(buf._id)

    @endpoint
    def sleep(self, secs: float) -> None:
        time.sleep(secs)

    @endpoint
    def read_or_error(self, buf: RDMABuffer, timeout: float) -> str:
        import torch

        t0 = time.monotonic()
        try:
            buf.read_into(torch.empty(N), timeout=timeout).get(timeout=timeout + 30)
        except Exception as e:  # noqa: BLE001 - the test looks at what it was
            return f"{type(e).__name__} after {time.monotonic() - t0:.1f}s: {e}"
        return "read"

    @endpoint
    def pid(self) -> int:
        return os.getpid()


def _force_route(route: str | None) -> None:
    """Take the given route in this worker (the cross-host one cannot be had on
    one host otherwise); the transfer itself is the real one."""
    from monarch_kernel.tensors import buffer_ops as buffer_ops

    if route is None:
        if hasattr(buffer_ops, "_real_route"):
            buffer_ops._route = buffer_ops._real_route
        return
    if not hasattr(buffer_ops, "_real_route"):
        buffer_ops._real_route = buffer_ops._route
    buffer_ops._route = lambda host, buf: route


@pytest.fixture(scope="module")
def holders():
    procs = spawn_procs(3)
    try:
        yield procs.spawn("holders", Holder)
    finally:
        procs.stop()


def test_read_into_another_rank(holders) -> None:
    import torch

    buf = holders.slice(procs=0).register.call_one("a").get(timeout=30)
    assert buf.size() == 4 * N and buf.owner == 0 and buf.device == "cpu"
    got, dst = holders.slice(procs=1).read.call_one(buf).get(timeout=60)
    assert got == 4 * N
    assert torch.equal(dst, torch.arange(N, dtype=torch.float32))


def test_in_band_route_and_numpy(holders) -> None:
    import numpy as np
    import torch

    buf = holders.slice(procs=0).register.call_one("b").get(timeout=30)
    got, dst = holders.slice(procs=2).read.call_one(buf, route="band").get(timeout=60)
    assert got == 4 * N and torch.equal(dst, torch.arange(N, dtype=torch.float32))
    holders.slice(procs=2).write.call_one(buf, 2.0, route="band").get(timeout=60)
    assert holders.slice(procs=0).total.call_one("b").get(timeout=30) == 2.0 * N
    arr = holders.slice(procs=1).register_numpy.call_one("c", 1000).get(timeout=30)
    assert np.array_equal(holders.slice(procs=2).read_numpy.call_one(arr, 1000).get(timeout=30),
                          np.arange(1000))


def test_write_from_and_raw_dtype(holders) -> None:
    import torch

    buf = holders.slice(procs=1).register.call_one("d").get(timeout=30)
    holders.slice(procs=2).write.call_one(buf, 3.0).get(timeout=60)
    assert holders.slice(procs=1).total.call_one("d").get(timeout=30) == 3.0 * N
    # a part of the buffer: only the first bytes change
    holders.slice(procs=0).write.call_one(buf, 1.0, n=10).get(timeout=60)
    assert holders.slice(procs=1).total.call_one("d").get(timeout=30) == 3.0 * N - 20
    bf = holders.slice(procs=0).register.call_one("e", 4096, "bfloat16").get(timeout=30)
    _, dst = holders.slice(procs=1).read.call_one(bf, 4096, "bfloat16").get(timeout=30)
    assert dst.dtype == torch.bfloat16
    assert torch.equal(dst, torch.arange(4096, dtype=torch.bfloat16))


def test_owner_busy_and_async_and_own_rank(holders) -> None:
    """The owner's actor is busy for 5 s: reads go on (the owner's peer thread
    answers them); an async endpoint awaits a read; the owner reads itself."""
    buf = holders.slice(procs=0).register.call_one("f").get(timeout=30)
    busy = holders.slice(procs=0).sleep.call_one(5.0)
    total = holders.slice(procs=1).read_async.call_one(buf).get(timeout=60)
    assert not busy.done()  # read while the owner's actor was still busy
    assert total == float(sum(range(N)))
    busy.get(timeout=30)
    got, dst = holders.slice(procs=0).read.call_one(buf).get(timeout=30)
    assert got == 4 * N and float(dst.double().sum()) == total


def test_bad_input_is_refused_clearly(holders) -> None:
    buf = holders.slice(procs=0).register.call_one("g").get(timeout=30)
    r1 = holders.slice(procs=1)
    assert "at least 4194304 bytes" in r1.try_.call_one("small", buf).get(timeout=30)
    assert "contiguous" in r1.try_.call_one("strided", buf).get(timeout=30)
    assert "holds only 4194304" in r1.try_.call_one("large", buf).get(timeout=30)
    assert "read-only" in r1.try_.call_one("readonly", buf).get(timeout=30)
    assert "0 bytes" in r1.try_.call_one("empty", buf).get(timeout=30)
    with pytest.raises(MeshError, match="ranks of a mesh"):
        import torch

        RDMABuffer(torch.ones(4))


def test_drop(holders) -> None:
    buf = holders.slice(procs=0).register.call_one("h").get(timeout=30)
    assert holders.slice(procs=0).registered.call_one(buf).get(timeout=30)
    holders.slice(procs=2).drop.call_one(buf).get(timeout=30)  # from another rank
    assert not holders.slice(procs=0).registered.call_one(buf).get(timeout=30)
    msg = holders.slice(procs=1).try_.call_one("dropped", buf).get(timeout=30)
    assert msg.startswith("MeshError") and "dropped" in msg
    holders.slice(procs=2).drop.call_one(buf).get(timeout=30)  # twice: harmless


def test_stopped_owner_times_out_and_dead_owner_fails() -> None:
    procs = spawn_procs(2)
    try:
        hs = procs.spawn("h", Holder)
        buf = hs.slice(procs=0).register.call_one("x").get(timeout=30)
        pid = hs.slice(procs=0).pid.call_one().get(timeout=30)
        os.kill(pid, signal.SIGSTOP)
        try:
            msg = hs.slice(procs=1).read_or_error.call_one(buf, 1.0).get(timeout=60)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert msg.startswith("TimeoutError after 1.") and "rank 0 did not answer" in msg
        os.kill(pid, signal.SIGKILL)
        msg = hs.slice(procs=1).read_or_error.call_one(buf, 30.0).get(timeout=60)
        assert msg.startswith("MeshFailure after "), msg
        assert float(msg.split(" after ")[1].split("s")[0]) < 20
    finally:
        procs.stop()



# ------------------------------------------------------------------- CUDA
def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


cuda = pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU")


class GpuHolder(Actor):
    def __init__(self) -> None:
        self.kept: dict[str, object] = {}

    @endpoint
    def register(self, name: str, n: int) -> RDMABuffer:
        import torch

        t = torch.arange(n, dtype=torch.float32, device="cuda")
        self.kept[name] = t
        return RDMABuffer(t)

    @endpoint
    def fill_later(self, name: str, value: float) -> None:
        """Queue a fill behind about 0.2 s of GPU work and return at once."""
        import torch

        torch.cuda._sleep(400_000_000)
        self.kept[name].fill_(value)

    @endpoint
    def total(self, name: str) -> float:
        return float(self.kept[name].sum())

    @endpoint
    def read(self, buf: RDMABuffer, n: int, device: str, route: str | None = None) -> object:
        import torch

        from monarch_kernel.tensors import buffer_ops as buffer_ops

        _force_route(route)
        before = dict(buffer_ops.routes)
        dst = torch.full((n,), -1.0, device=device)
        buf.read_into(dst).get(timeout=60)
        used = [k for k, v in buffer_ops.routes.items() if v != before.get(k, 0)]
        return used, dst.device.type, dst.cpu()

    @endpoint
    def write(self, buf: RDMABuffer, value: float, n: int, device: str,
              route: str | None = None) -> None:
        import torch

        _force_route(route)
        buf.write_from(torch.full((n,), value, device=device)).get(timeout=60)


@pytest.fixture(scope="module")
def gpu_holders():
    procs = spawn_procs(2)
    try:
        yield procs.spawn("gpu_holders", GpuHolder)
    finally:
        procs.stop()


@cuda
def test_cuda_ipc_read_and_write(gpu_holders) -> None:
    import torch

    n = 16 << 20  # 64 MiB
    buf = gpu_holders.slice(procs=0).register.call_one("a", n).get(timeout=60)
    assert buf.device.startswith("cuda")
    r1 = gpu_holders.slice(procs=1)
    want = torch.arange(n, dtype=torch.float32)
    for device in ("cuda", "cpu"):
        used, kind, got = r1.read.call_one(buf, n, device).get(timeout=60)
        assert used == ["ipc"] and kind == device and torch.equal(got, want)
    r1.write.call_one(buf, 2.0, n, "cuda").get(timeout=60)
    assert gpu_holders.slice(procs=0).total.call_one("a").get(timeout=60) == 2.0 * n


@cuda
def test_cuda_staged_routes(gpu_holders) -> None:
    import torch

    n = 1 << 20
    buf = gpu_holders.slice(procs=0).register.call_one("b", n).get(timeout=60)
    r1 = gpu_holders.slice(procs=1)
    want = torch.arange(n, dtype=torch.float32)
    for value, route in ((5.0, "shm"), (7.0, "band")):
        used, kind, got = r1.read.call_one(buf, n, "cuda", route).get(timeout=60)
        assert used == [route] and kind == "cuda"
        assert torch.equal(got, want)
        r1.write.call_one(buf, value, n, "cuda", route).get(timeout=60)
        assert gpu_holders.slice(procs=0).total.call_one("b").get(timeout=60) == value * n
        want = torch.full((n,), value)
    r1.read.call_one(buf, n, "cuda", None).get(timeout=60)  # back to the real route


@cuda
def test_cuda_read_waits_for_the_owners_queued_work(gpu_holders) -> None:
    """The owner queues a fill behind ~0.2 s of GPU work and returns; a read
    made at once sees the filled values (the IPC handle carries an event)."""
    n = 1 << 20
    r0, r1 = gpu_holders.slice(procs=0), gpu_holders.slice(procs=1)
    buf = r0.register.call_one("c", n).get(timeout=60)
    r0.fill_later.call_one("c", 9.0).get(timeout=60)
    used, _, got = r1.read.call_one(buf, n, "cuda").get(timeout=60)
    assert used == ["ipc"] and float(got.min()) == 9.0 == float(got.max())
