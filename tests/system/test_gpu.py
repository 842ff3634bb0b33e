"""GPU code paths on a machine with CUDA: tensors on the wire, NVML telemetry,
``--dist nccl``, handles to CUDA tensors.

The test process is the controller of real local meshes. Every test here is
skipped where ``torch.cuda.is_available()`` is False (CI without a GPU); on a
GPU machine the module takes well under a minute (meshes of 1 or 2 ranks,
shared where the tests leave them usable).

Run with the project on ``PYTHONPATH`` (no install needed): workers start as
``sys.executable -m monarch_kernel.worker.worker`` and inherit the environment.
"""

from __future__ import annotations

import os
import sys
import time

import cloudpickle
import numpy as np
import pytest
import torch

from monarch_kernel import Actor
from monarch_kernel import endpoint
from monarch_kernel.wire import serialize as serialize
from monarch_kernel.mesh.procmesh import spawn_procs
from monarch_kernel.tensors.handles import show
from monarch_kernel.testing.kernel import wait_for, worker_pids

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (torch.cuda.is_available() is False)")

# the workers cannot import this test module: ship its classes by value, like a notebook's
cloudpickle.register_pickle_by_value(sys.modules[__name__])

GiB = 1 << 30
MiB = 1 << 20
T = 60  # seconds: every wait of this module


def _workers() -> set[int]:
    return set(worker_pids(os.getpid()))


def _no_new_workers(before: set[int]) -> None:
    """Wait until no worker started after ``before`` was taken is left (other
    meshes of this module may still be up)."""
    wait_for(lambda: _workers() <= before, 15, what="no worker processes left")


class Gpu(Actor):
    """Endpoints that report what arrived, and make CUDA tensors."""

    @endpoint
    def inspect(self, t: torch.Tensor) -> dict:
        return {"device": str(t.device), "dtype": str(t.dtype), "shape": tuple(t.shape),
                "requires_grad": t.requires_grad, "is_leaf": t.is_leaf,
                "cpu": t.detach().cpu()}

    @endpoint
    def echo(self, *values: object) -> tuple:
        return values

    @endpoint
    def make(self, n: int, dtype: str, requires_grad: bool = False) -> torch.Tensor:
        t = torch.arange(n, device="cuda").to(getattr(torch, dtype))
        return t.requires_grad_(requires_grad)

    @endpoint
    def relay(self, other: object, n: int) -> dict:
        """Send a CUDA tensor of this rank to ``other`` (an actor on another rank)."""
        t = torch.arange(n, dtype=torch.float32, device="cuda")
        got = other.inspect.call_one(t).get(timeout=60)
        got["expected"] = t.cpu()
        return got

    @endpoint
    def local_device(self, t: torch.Tensor) -> str:
        return str(t.device)


def _first_rank(vm: object) -> object:
    return vm.values()[0]


@pytest.fixture(scope="module")
def mesh():
    """Two plain ranks (no torch.distributed), both on the first GPU; telemetry every 0.2 s."""
    before = _workers()
    m = spawn_procs(2, timeout=T, telemetry_interval=0.2)
    try:
        m.exec("import torch", timeout=T)
        yield m
    finally:
        m.stop()
        _no_new_workers(before)


@pytest.fixture(scope="module")
def gpu(mesh):
    a = mesh.spawn("gpu", Gpu)
    try:
        yield a
    finally:
        a.stop()


# ------------------------------------------------------------ tensors on the wire
@pytest.mark.parametrize("nbytes", [4 * 1024, 8 * MiB], ids=["small", "8MiB-shm"])
@pytest.mark.parametrize("requires_grad", [False, True], ids=["plain", "grad"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_cuda_argument_arrives_on_cuda(gpu, dtype, requires_grad, nbytes):
    n = nbytes // torch.tensor([], dtype=dtype).element_size()
    t = (torch.randn(n, device="cuda") * 100).to(dtype).requires_grad_(requires_grad)
    got = gpu.slice(procs=1).inspect.call_one(t).get(timeout=T)
    assert got["device"] == "cuda:0"
    assert got["dtype"] == str(dtype) and got["shape"] == (n,)
    assert got["requires_grad"] is requires_grad and got["is_leaf"]
    assert torch.equal(got["cpu"], t.detach().cpu())  # bit for bit (bf16 travels as raw bytes)


@pytest.mark.parametrize("nbytes", [4 * 1024, 8 * MiB], ids=["small", "8MiB-shm"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_result_arrives_on_cuda(gpu, dtype, nbytes):
    n = nbytes // torch.tensor([], dtype=getattr(torch, dtype)).element_size()
    for requires_grad in ((False, True) if dtype == "float32" else (False,)):
        r = gpu.slice(procs=0).make.call_one(n, dtype, requires_grad).get(timeout=T)
        assert r.device.type == "cuda" and r.device.index == torch.cuda.current_device()
        assert r.dtype == getattr(torch, dtype) and r.requires_grad is requires_grad
        assert torch.equal(r.detach(), torch.arange(n, device="cuda").to(r.dtype))
    every = gpu.make.call(4, dtype).get(timeout=T)  # one reply per rank
    assert [v.device.type for v in every.values()] == ["cuda", "cuda"]


def test_awkward_cuda_tensors_round_trip(gpu):
    base = torch.randn(3, 5, device="cuda")
    values = (torch.tensor(2.5, device="cuda", dtype=torch.bfloat16),  # 0-d, raw bytes
              torch.empty(0, device="cuda"),                           # no elements
              base.t(),                                                # not contiguous
              base[:, 1::2],                                           # strided view
              torch.tensor([1 + 2j], device="cuda").conj())            # conjugate bit set
    back = gpu.slice(procs=1).echo.call_one(*values).get(timeout=T)
    assert len(back) == len(values)
    for sent, got in zip(values, back):
        assert got.device.type == "cuda", got
        assert got.shape == sent.shape and got.dtype == sent.dtype
        assert torch.equal(got.cpu().resolve_conj(), sent.cpu().resolve_conj())


def test_worker_to_worker_cuda_tensor(gpu):
    got = gpu.slice(procs=0).relay.call_one(gpu.slice(procs=1), 3 * MiB).get(timeout=T)
    assert got["device"] == "cuda:0" and got["dtype"] == "torch.float32"
    assert torch.equal(got["cpu"], got["expected"])


class _FromMissingGpu:
    """Unpickles (serialize's own reducer output) as a tensor that lived on a GPU
    index the receiver does not have."""

    def __init__(self, values: np.ndarray, index: int) -> None:
        self.values, self.index = values, index

    def __reduce__(self) -> tuple:
        return (serialize._rebuild_tensor, (self.values, torch.float32, self.values.shape,
                                            f"cuda:{self.index}", True, False))


def test_missing_device_index_lands_on_the_current_device(gpu):
    missing = torch.cuda.device_count()  # one past the last index of this machine
    values = np.arange(6, dtype=np.float32)
    here = serialize.loads(*serialize.dumps(_FromMissingGpu(values, missing)))
    assert here.device == torch.device("cuda", torch.cuda.current_device())
    assert here.requires_grad and torch.equal(here.detach().cpu(), torch.from_numpy(values))
    # the same on a worker (its current device: 0 in a plain mesh)
    got = gpu.slice(procs=1).inspect.call_one(_FromMissingGpu(values, missing)).get(timeout=T)
    assert got["device"] == "cuda:0" and got["requires_grad"]
    assert torch.equal(got["cpu"], torch.from_numpy(values))


def test_worker_without_a_gpu_refuses_cuda_tensors_clearly(monkeypatch):
    torch.zeros(1, device="cuda")  # CUDA is initialized here before the variable changes
    before = _workers()
    with monkeypatch.context() as mp:
        mp.setenv("CUDA_VISIBLE_DEVICES", "")  # inherited by the worker only
        m = spawn_procs(1, timeout=T, telemetry_interval=0.2)
    try:
        a = m.spawn("nogpu", Gpu)
        assert m.exec("import torch; torch.cuda.is_available()", timeout=T).values() == [False]
        with pytest.raises(Exception, match="no such device") as ei:
            a.inspect.call_one(torch.ones(3, device="cuda")).get(timeout=T)
        assert "cuda:0" in str(ei.value) and ".cpu()" in str(ei.value)
        ok = a.inspect.call_one(torch.ones(3)).get(timeout=T)  # CPU tensors still fine
        assert ok["device"] == "cpu"
        # telemetry honours CUDA_VISIBLE_DEVICES="": no GPU figures for this rank
        ctl = m.controller
        wait_for(lambda: ctl.ranks[0].telemetry.get("seq", 0) >= 2, T, what="telemetry")
        assert ctl.ranks[0].telemetry["gpu"] is None
    finally:
        m.stop()
        _no_new_workers(before)


# ------------------------------------------------------------------- telemetry
def test_telemetry_reports_real_nvml_figures(mesh, record_property):
    ctl = mesh.controller
    facts = mesh.collect(mesh.run(
        "_big = torch.empty(1 << 28, dtype=torch.float32, device='cuda')  # 1 GiB\n"
        "torch.cuda.synchronize()\n"
        "(torch.cuda.memory_allocated(), torch.cuda.current_device(),\n"
        " torch.cuda.get_device_name(), torch.cuda.mem_get_info()[1])", [0]),
        [0], timeout=T)
    allocated, device, name, cuda_total = _first_rank(facts)
    assert allocated >= GiB

    def big_sample() -> bool:
        g = ctl.ranks[0].telemetry.get("gpu") or {}
        return (g.get("torch_allocated") or 0) >= GiB

    try:
        wait_for(big_sample, 20, what="a telemetry sample with the 1 GiB allocation")
        g = ctl.ranks[0].telemetry["gpu"]
        vis = os.environ.get("CUDA_VISIBLE_DEVICES")
        if vis is None:  # NVML's index is torch's
            assert g["index"] == device
        elif vis.split(",")[device].strip().isdigit():
            assert g["index"] == int(vis.split(",")[device])
        assert g["name"] and (g["name"] in name or name in g["name"]), (g["name"], name)
        assert 0.0 <= g["util"] <= 100.0
        assert 0 < g["mem_total"] and abs(g["mem_total"] - cuda_total) <= 0.1 * cuda_total
        assert GiB <= g["mem_used"] <= g["mem_total"]
        assert g["torch_reserved"] >= g["torch_allocated"] >= GiB
        # per-process memory: NVML may not list processes of a container (other pid
        # namespace); when it does, this rank holds at least its 1 GiB
        assert g["proc_mem"] is None or g["proc_mem"] >= GiB, g
        record_property("gpu_telemetry", repr(g))  # in the JUnit XML
    finally:
        mesh.collect(mesh.run("del _big; torch.cuda.empty_cache()", [0]), [0], timeout=T)
    wait_for(lambda: (ctl.ranks[0].telemetry["gpu"]["torch_allocated"] or 0) < GiB, 20,
             what="telemetry after freeing the 1 GiB")


# ------------------------------------------------------------------ --dist nccl
@pytest.fixture(scope="module")
def nccl_mesh():
    before = _workers()
    m = spawn_procs(1, dist="nccl", timeout=T)
    try:
        yield m
    finally:
        m.stop()
        _no_new_workers(before)


def test_nccl_one_rank_all_reduce_and_device_mesh(nccl_mesh):
    vm = nccl_mesh.exec(
        "t = torch.full((4,), float(rank + 3), device='cuda')\n"
        "dist.all_reduce(t)\n"
        "torch.cuda.synchronize()\n"
        "(dist.get_backend(), device_mesh.device_type, device_mesh.mesh_dim_names,\n"
        " tuple(device_mesh.shape), torch.cuda.current_device(), t)", timeout=T)
    backend, dtype, names, sizes, device, t = _first_rank(vm)
    assert backend == "nccl" and dtype == "cuda"
    assert names == ("hosts", "procs") and sizes == (1, 1) and device == 0
    assert t.device.type == "cuda" and torch.equal(t.cpu(), torch.full((4,), 3.0))
    # a collective over a named dimension of the device mesh
    vm = nccl_mesh.exec("u = torch.ones(2, device='cuda')\n"
                        "dist.all_reduce(u, group=device_mesh.get_group('procs'))\n"
                        "u.sum().item()", timeout=T)
    assert vm.values() == [2.0]


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() >= 2,
                    reason="needs a host with fewer GPUs than ranks (here: 1 GPU, 2 ranks)")
def test_nccl_more_ranks_than_gpus_is_a_clear_error(record_property):
    before = _workers()
    t0 = time.monotonic()
    m = None
    try:
        with pytest.raises(RuntimeError, match="needs one GPU per rank") as ei:
            m = spawn_procs(2, dist="nccl", timeout=T)
    except BaseException:
        if m is not None:  # set-up passed: say what NCCL does at the first collective
            try:
                m.exec("t = torch.ones(1, device='cuda'); dist.all_reduce(t); "
                       "torch.cuda.synchronize()", timeout=30)
                what = "the first all_reduce worked"
            except BaseException as e:  # noqa: BLE001 - reported in the failure
                what = f"the first all_reduce raised {type(e).__name__}: {e}"[:2000]
            m.stop()
            pytest.fail(f"spawn_procs(2, dist='nccl') on one GPU did not fail; {what}")
        raise
    msg = str(ei.value)
    record_property("error", msg)
    assert "--dist gloo" in msg and "GPU" in msg, msg
    assert time.monotonic() - t0 < T, "a clear error, but only after the set-up timeout"
    _no_new_workers(before)


# ------------------------------------------------------- handles to CUDA tensors
def test_ref_to_cuda_tensors_stays_on_the_ranks(mesh, gpu):
    mesh.exec("g = (torch.arange(6., device='cuda') + rank).reshape(2, 3)", timeout=T)
    r = mesh.ref("g")
    meta = r.meta(preview=3).values()
    assert [m["device"] for m in meta] == ["cuda:0", "cuda:0"]
    assert [m["values"] for m in meta] == [[0.0, 1.0, 2.0], [1.0, 2.0, 3.0]]
    assert meta[0]["shape"] == (2, 3) and meta[0]["nbytes"] == 24
    assert "cuda:0" in repr(show(mesh, r))  # what %mesh show prints
    one = r.fetch(procs=1)
    assert one.device.type == "cuda"
    assert torch.equal(one.cpu(), (torch.arange(6.) + 1).reshape(2, 3))
    assert all(v.device.type == "cuda" for v in r.gather().values())
    doubled = r.map(lambda t: t * 2)  # runs on the ranks, stays there
    assert doubled.meta().values()[1]["device"] == "cuda:0"
    assert torch.equal(doubled.fetch(procs=1).cpu(), (torch.arange(6.) + 1).reshape(2, 3) * 2)
    # a handle passed to an endpoint is the rank's own CUDA tensor: no bytes move
    assert gpu.local_device.call(r).get(timeout=T).values() == ["cuda:0", "cuda:0"]
    # an endpoint's CUDA result kept on the ranks
    kept = gpu.make.rref(5, "float32")
    assert [m["device"] for m in kept.meta().values()] == ["cuda:0", "cuda:0"]
    assert torch.equal(kept.fetch(procs=0).cpu(), torch.arange(5.))


def test_ref_reduce_over_nccl(nccl_mesh):
    nccl_mesh.exec("h = torch.full((3,), 2.0, device='cuda')", timeout=T)
    r = nccl_mesh.ref("h")
    s = r.reduce("procs", "sum")
    assert s.meta().values()[0]["device"] == "cuda:0"
    out = s.fetch()
    assert out.device.type == "cuda" and torch.equal(out.cpu(), torch.full((3,), 2.0))
    # a CPU tensor reduced over NCCL goes through the GPU and comes back to the CPU
    nccl_mesh.exec("c = torch.full((2,), 5.0)", timeout=T)
    back = nccl_mesh.ref("c").reduce("procs", "max").fetch()
    assert back.device.type == "cpu" and torch.equal(back, torch.full((2,), 5.0))


# ------------------------------------------------- CUDA IPC (one receiver, this host)
class Ipc(Actor):
    @endpoint
    def bump(self, t: torch.Tensor) -> tuple:
        """Change the received tensor in place: the sender's must not change."""
        t += 1
        torch.cuda.synchronize()
        return str(t.device), float(t.double().sum())

    @endpoint
    def make(self, n: int) -> torch.Tensor:
        return torch.full((n,), 3.0, device="cuda")  # dropped here at once after sending

    @endpoint
    def fetch_from(self, other: object, n: int) -> tuple:
        t = other.make.call_one(n).get(timeout=60)
        return str(t.device), float(t.double().sum())

    @endpoint
    def pass_on(self, other: object, n: int) -> tuple:
        t = torch.full((n,), 2.0, device="cuda")
        out = other.bump.call_one(t).get(timeout=60)
        torch.cuda.synchronize()
        return out, float(t.double().sum())


@pytest.mark.parametrize("ipc", ["1", "0"], ids=["ipc", "staged"])
def test_big_cuda_tensors_are_copies_by_either_route(monkeypatch, ipc):
    """Big CUDA tensors to one process on this host go by IPC handle (or staged
    with MONARCH_CUDA_IPC=0): the receiver gets its own copy on its GPU, the
    sender may drop its tensor at once, results come back the same way."""
    before = _workers()
    monkeypatch.setenv("MONARCH_CUDA_IPC", ipc)
    n = 4 * MiB  # 16 MiB
    with serialize.cuda_ipc():
        packed = serialize.Packed.pack(torch.ones(n, device="cuda"))
    assert packed.ipc is (ipc == "1")
    m = spawn_procs(2, timeout=T, telemetry_interval=0)
    try:
        a = m.spawn("ipc", Ipc)
        t = torch.zeros(n, device="cuda")
        device, total = a.slice(procs=0).bump.call_one(t).get(timeout=T)
        assert device == "cuda:0" and total == float(n)
        assert float(t.sum()) == 0.0  # the sender's tensor is untouched
        for _ in range(3):  # sent, then dropped by the sender before the receiver copies
            f = a.slice(procs=1).bump.call_one(torch.full((n,), 5.0, device="cuda"))
            torch.cuda.empty_cache()
            torch.empty(n, device="cuda").fill_(-1.0)  # would take over freed memory
            assert f.get(timeout=T) == ("cuda:0", 6.0 * n)
        for _ in range(3):  # a message is a snapshot: changes made after sending never show
            t = torch.zeros(n, device="cuda")
            f = a.slice(procs=1).bump.call_one(t)
            t.add_(100.0)
            assert f.get(timeout=T) == ("cuda:0", float(n))
        back = a.slice(procs=0).make.call_one(n).get(timeout=T)
        assert back.device.type == "cuda" and float(back.double().sum()) == 3.0 * n
        out, mine = a.slice(procs=0).pass_on.call_one(a.slice(procs=1), n).get(timeout=T)
        assert out == ("cuda:0", 3.0 * n) and mine == 2.0 * n  # worker to worker
        got = a.slice(procs=0).fetch_from.call_one(a.slice(procs=1), n).get(timeout=T)
        assert got == ("cuda:0", 3.0 * n)  # a worker-to-worker result
        # a broadcast call (several receivers) is staged: still right everywhere
        every = a.bump.call(torch.ones(n, device="cuda")).get(timeout=T).values()
        assert every == [("cuda:0", 2.0 * n)] * 2
    finally:
        m.stop()
        _no_new_workers(before)


def test_big_cuda_tensor_to_a_worker_without_a_gpu_is_refused_clearly(monkeypatch):
    torch.zeros(1, device="cuda")
    before = _workers()
    with monkeypatch.context() as mp:
        mp.setenv("CUDA_VISIBLE_DEVICES", "")
        m = spawn_procs(1, timeout=T, telemetry_interval=0)
    try:
        a = m.spawn("nogpu", Ipc)
        with pytest.raises(Exception, match="no such device") as ei:
            a.bump.call_one(torch.ones(4 * MiB, device="cuda")).get(timeout=T)
        assert ".cpu()" in str(ei.value)
    finally:
        m.stop()
        _no_new_workers(before)


def test_many_ipc_shares_of_one_tensor(record_property):
    """An RDMABuffer of a long-lived CUDA tensor shares it once per read: 1,100
    reads in a row all see the right bytes (torch keeps an event per share)."""
    from monarch_kernel import RDMABuffer

    class Owner(Actor):
        @endpoint
        def register(self, n: int) -> RDMABuffer:
            self.t = torch.arange(n, dtype=torch.float32, device="cuda")
            return RDMABuffer(self.t)

    class Reader(Actor):
        @endpoint
        def read_many(self, buf: RDMABuffer, times: int) -> dict:
            dst = torch.empty(buf.size() // 4, device="cuda")
            bad = 0
            t0 = time.perf_counter()
            for _ in range(times):
                dst.fill_(-1)
                buf.read_into(dst).get(timeout=60)
                bad += int(dst[-1].item() != dst.numel() - 1)
            return {"bad": bad, "us_per_read": (time.perf_counter() - t0) / times * 1e6}

    before = _workers()
    m = spawn_procs(2, timeout=T, telemetry_interval=0)
    try:
        buf = m.slice(procs=0).spawn("owner", Owner).register.call_one(1 << 18).get(timeout=T)
        got = m.slice(procs=1).spawn("reader", Reader).read_many.call_one(buf, 1100).get(
            timeout=300)
        record_property("ipc_reads", repr(got))
        assert got["bad"] == 0, got
    finally:
        m.stop()
        _no_new_workers(before)
