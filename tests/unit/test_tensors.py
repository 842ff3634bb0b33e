"""Distributed tensors: the DeviceMesh on every rank, and handles on the controller.

The test process is the controller of real local meshes (gloo, CPU).
"""

from __future__ import annotations

import gc
import operator
import os
import signal
import sys

import cloudpickle
import pytest
import torch

from monarch_kernel import Actor, MeshError, MeshFailure, endpoint
from monarch_kernel.mesh.procmesh import spawn_procs
from monarch_kernel.tensors.handles import Ref
from monarch_kernel.testing.kernel import wait_for, worker_pids
from monarch_kernel.wire import serialize as serialize

MB = 1 << 20

# the workers cannot import this test module: ship its classes by value, like a notebook's
cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def mesh():
    """A 1x4 gloo mesh shared by the tests of this module (they leave it usable)."""
    m = spawn_procs(4, dist="gloo")
    try:
        m.exec("torch.set_num_threads(1)\nimport monarch_kernel.tensors.store as T")
        yield m
    finally:
        m.stop()
        wait_for(lambda: not worker_pids(os.getpid()), 10, what="workers gone")


class BytesCounter:
    """Counts the bytes this process pickles and unpickles (every message it
    sends or receives, shared memory included), while active."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.total = 0
        dumps, loads = serialize.dumps, serialize.loads

        def counting_dumps(obj):
            payload, buffers = dumps(obj)
            self.total += len(payload) + sum(memoryview(b).nbytes for b in buffers)
            return payload, buffers

        def counting_loads(payload, buffers=()):
            self.total += memoryview(payload).nbytes + sum(memoryview(b).nbytes
                                                           for b in buffers)
            return loads(payload, buffers)

        monkeypatch.setattr(serialize, "dumps", counting_dumps)
        monkeypatch.setattr(serialize, "loads", counting_loads)

    def reset(self) -> None:
        self.total = 0


class Doubler(Actor):
    @endpoint
    def double(self, t: torch.Tensor) -> float:
        self.last = t  # the rank's own tensor object, not a copy
        return float(t.sum()) * 2

    @endpoint
    def same_object(self) -> bool:
        import monarch_kernel.tensors.store as T

        return any(v is self.last for v in T._store.values())

    @endpoint
    def make(self, n: int) -> torch.Tensor:
        import monarch_kernel

        return torch.full((n,), float(monarch_kernel.current_rank().rank))

    @endpoint
    def names(self) -> tuple:
        import monarch_kernel

        dm = monarch_kernel.device_mesh()
        return dm.mesh_dim_names, tuple(dm.shape)


# ------------------------------------------------------------- DeviceMesh
def test_device_mesh_1x4_names_and_sizes(mesh):
    vm = mesh.exec("(device_mesh.mesh_dim_names, tuple(device_mesh.shape), "
                   "dist.get_process_group_ranks(device_mesh.get_group('procs')), "
                   "device_mesh['procs'].size(), device_mesh.device_type)")
    for v in vm.values():
        assert v == (("hosts", "procs"), (1, 4), [0, 1, 2, 3], 4, "cpu")
    a = mesh.spawn("dm_names", Doubler)
    try:  # monarch_kernel.device_mesh() in actors
        assert a.names.call().get().values() == [(("hosts", "procs"), (1, 4))] * 4
    finally:
        a.stop()


def test_device_mesh_2x2_matches_the_mesh_and_its_slices():
    m = spawn_procs({"hosts": 2, "procs": 2}, dist="gloo")
    try:
        vm = m.exec("torch.set_num_threads(1)\n"
                    "(device_mesh.mesh_dim_names, tuple(device_mesh.shape), "
                    "device_mesh['procs'].mesh.tolist(), device_mesh['hosts'].mesh.tolist())")
        for p, (names, sizes, procs_sub, hosts_sub) in vm.items():
            assert names == ("hosts", "procs") and sizes == (2, 2)
            # slicing the mesh on the controller = the sub-mesh on the ranks
            assert procs_sub == m.slice(hosts=p["hosts"]).ranks
            assert hosts_sub == m.slice(procs=p["procs"]).ranks
        m.exec("x = torch.tensor([float(rank)])")
        r = m.ref("x")
        by_hosts = r.reduce("hosts", "sum").gather()
        for p, v in by_hosts.items():  # ranks p and p +- 2
            assert v.item() == sum(q for q in (0, 1, 2, 3) if q % 2 == p["procs"])
        both = r.reduce(("hosts", "procs"), "max").gather()
        assert [v.item() for v in both] == [3.0] * 4
        with pytest.raises(MeshError, match="needs rank 2, which this handle does not"):
            r.slice(hosts=0).reduce("hosts")
    finally:
        m.stop()


# ------------------------------------------------------------------ DTensor
def test_dtensor_matmul_over_4_ranks_equals_the_controller(mesh):
    torch.manual_seed(0)
    A, B = torch.randn(8, 6), torch.randn(6, 4)
    mesh.push(A=A, B=B)
    mesh.exec("from torch.distributed.tensor import distribute_tensor, Shard, Replicate\n"
              "tp = device_mesh['procs']\n"
              "C = distribute_tensor(A, tp, [Shard(0)]) @ distribute_tensor(B, tp, [Replicate()])")
    c = mesh.ref("C")
    meta = c.meta().values()
    assert all(m["placements"] == ["Shard(dim=0)"] and m["shape"] == (2, 4)
               and m["global_shape"] == (8, 4) for m in meta)
    torch.testing.assert_close(c.full_tensor(), A @ B)
    torch.testing.assert_close(torch.cat(c.gather().values()), A @ B)  # the local shards
    # the same with handles: B sharded by columns, A replicated, matmul on the ranks
    a = mesh.ref("A").to_dtensor(["R"], local=False)
    from torch.distributed.tensor import Shard  # (not imported by `import torch` everywhere)

    b = mesh.ref("B").to_dtensor([Shard(1)], local=False)
    assert b.shape.values() == [(6, 1)] * 4
    p = a.map(operator.matmul, b)
    assert p.meta().values()[0]["placements"] == ["Shard(dim=1)"]
    torch.testing.assert_close(p.full_tensor(), A @ B)


def test_to_dtensor_errors(mesh):
    mesh.exec("v = torch.ones(4)")
    r = mesh.ref("v")
    with pytest.raises(ValueError, match="not a placement"):
        r.to_dtensor(["diagonal"])
    with pytest.raises(MeshError, match="one placement per dimension"):
        r.to_dtensor(["S(0)", "R", "R"])


# ------------------------------------------------------------------ handles
def test_shape_fetch_gather_and_show(mesh):
    mesh.exec("x = torch.arange(6.).reshape(2, 3) + rank")
    r = mesh.ref("x")
    assert r.shape.values() == [(2, 3)] * 4 and r.dtype.values() == ["float32"] * 4
    assert torch.equal(r.fetch(procs=2), torch.arange(6.).reshape(2, 3) + 2)
    assert [v[0, 0].item() for v in r.gather()] == [0.0, 1.0, 2.0, 3.0]
    with pytest.raises(MeshError, match="one point"):
        r.fetch()
    text = repr(r.table())
    assert "2x3" in text and "float32" in text and "[3, 4, 5, 6, 7, 8]" in text
    assert "<table>" in r.table()._repr_html_()


def test_reduce_sum_equals_sum_of_gathered(mesh):
    mesh.exec("torch.manual_seed(rank)\ng = torch.randn(3, 5)\nn = rank + 1")
    r = mesh.ref("g")
    s = r.reduce("procs", "sum")
    assert isinstance(s, Ref) and s.id != r.id
    expected = sum(r.gather().values())
    for v in s.gather():
        torch.testing.assert_close(v, expected)
    torch.testing.assert_close(r.reduce("procs", "avg").fetch(procs=0), expected / 4)
    assert mesh.ref("n").reduce("procs", "prod").gather().values() == [24] * 4
    with pytest.raises(ValueError, match="unknown reduce op"):
        r.reduce("procs", "median")
    with pytest.raises(MeshError, match="no dimension"):
        r.reduce("gpus")


def test_handle_in_a_cell_and_an_endpoint_moves_no_bytes(mesh, monkeypatch):
    mesh.exec(f"big = torch.ones({MB // 4}) * rank")  # 1 MiB per rank
    r = mesh.ref("big")
    a = mesh.spawn("doubler", Doubler)
    try:
        counter = BytesCounter(monkeypatch)
        mesh.push(local_big=r)  # as %%mesh does with a handle named in a cell
        sums = mesh.exec(f"(local_big is T._store[{r.id!r}], float(local_big.sum()))")
        got = a.double.call(r).get()
        moved = counter.total
        assert sums.values() == [(True, float(k * MB // 4)) for k in range(4)]
        assert got.values() == [float(k * MB // 4) * 2 for k in range(4)]
        assert a.same_object.call().get().values() == [True] * 4
        assert moved < 16_000, moved  # ids and small results only
        counter.reset()
        r.gather()  # the counter does see data when it moves
        assert counter.total > 4 * MB
    finally:
        a.stop()


def test_rref_keeps_endpoint_results_on_the_ranks(mesh, monkeypatch):
    a = mesh.spawn("maker", Doubler)
    try:
        counter = BytesCounter(monkeypatch)
        h = a.make.rref(MB // 4)
        assert counter.total < 16_000, counter.total
        assert isinstance(h, Ref) and h.shape.values() == [(MB // 4,)] * 4
        assert h.fetch(procs=3)[0].item() == 3.0
        assert a.double.call(h).get().values() == [k * MB / 2 for k in range(4)]
    finally:
        a.stop()


class Slow(Actor):
    """Blocks its thread, then takes a value broadcast to it."""

    def __init__(self):
        self.got = None

    @endpoint
    def block(self, seconds):
        import time

        time.sleep(seconds)

    @endpoint
    def use(self, t):
        self.got = float(t.sum())

    @endpoint
    def value(self):
        return self.got


def test_a_handle_broadcast_then_dropped_still_reaches_the_queued_call(mesh):
    # the call waits behind a slow one while the controller frees the handle's values:
    # the rank took the value when the call arrived, so the call still gets it
    mesh.exec("import monarch_kernel\n"
              "b = torch.full((4,), float(monarch_kernel.current_rank().rank))")
    a = mesh.spawn("slow", Slow)
    try:
        r = mesh.ref("b")
        rid = r.id
        a.block.broadcast(3.0)
        a.use.broadcast(r)
        del r
        gc.collect()
        held = f"{rid!r} in T.local_ids()"
        wait_for(lambda: mesh.exec(held).values() == [False] * 4, 10,
                 what="the values freed on the ranks")
        assert a.value.call().get(timeout=30).values() == [4.0 * k for k in range(4)]
        assert not a.broadcast_failures
    finally:
        a.stop()


def test_freed_handle_frees_the_rank_side_value(mesh):
    mesh.exec("w = torch.zeros(10)")
    r = mesh.ref("w")
    s = r.reduce("procs")
    ids = (r.id, s.id)
    held = f"sorted(set({ids!r}) & set(T.local_ids()))"
    assert mesh.exec(held).values() == [sorted(ids)] * 4
    del r
    gc.collect()
    wait_for(lambda: mesh.exec(held).values() == [[ids[1]]] * 4, 10, what="free of r")
    s.free()
    wait_for(lambda: mesh.exec(held).values() == [[]] * 4, 10, what="free of s")
    with pytest.raises(MeshError, match="was freed"):
        s.gather()


def test_reduce_and_dtensor_need_dist_and_handles_stay_in_their_mesh(mesh):
    m = spawn_procs(2)
    try:
        m.exec("x = 1.5")
        r = m.ref("x")
        with pytest.raises(MeshError, match="--dist gloo"):
            r.reduce("procs")
        assert r.gather().values() == [1.5, 1.5]
        with pytest.raises(Exception, match="belongs to another mesh"):
            mesh.slice(procs=0).push(y=r)
        assert m.exec("import monarch_kernel\ntry:\n monarch_kernel.device_mesh()\n"
                      "except RuntimeError as e:\n err = str(e)\nerr").values()[0].startswith(
            "this mesh has no torch.distributed")
    finally:
        m.stop()


def test_handle_on_a_dead_rank_raises_mesh_failure():
    m = spawn_procs(2)
    try:
        m.exec("x = [rank] * 3")
        r = m.ref("x")
        os.kill(m.controller.ranks[1].pid, signal.SIGKILL)
        wait_for(lambda: m.controller.ranks[1].state == "dead", 10, what="rank 1 dead")
        with pytest.raises(MeshFailure, match="rank 1"):
            r.gather()
        with pytest.raises(MeshFailure):
            r.fetch(procs=1)
        with pytest.raises(MeshFailure):
            m.slice(procs=1).push(y=r)
        assert r.fetch(procs=0) == [0, 0, 0]  # the live rank still serves its value
        m.restart(1)
        with pytest.raises(MeshFailure, match="restarted"):
            r.fetch(procs=1)
        assert r.slice(procs=0).gather().values() == [[0, 0, 0]]
    finally:
        m.stop()
