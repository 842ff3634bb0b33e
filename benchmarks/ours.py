"""Our figures: actor calls, tensors, spawn, memory, fan-out, through the API
users call (``spawn_procs``, actor endpoints and their adverbs)."""

from __future__ import annotations

import sys
import time
from typing import Any

import cloudpickle
import psutil

from monarch_kernel import Actor, endpoint
from monarch_kernel.mesh.procmesh import spawn_procs

from benchmarks.stats import best_gbps, latencies_us, p50, p99

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers need not import it

MiB = 1 << 20


class Bench(Actor):
    """A no-op endpoint, a sum, and a worker-to-worker transfer."""

    @endpoint
    def noop(self) -> None:
        return None

    @endpoint
    def sum(self, t: Any) -> float:
        return float(t.sum())

    @endpoint
    def register(self, nbytes: int) -> Any:
        import torch

        from monarch_kernel import RDMABuffer

        self.kept = torch.ones(nbytes // 4)
        return RDMABuffer(self.kept)

    @endpoint
    def read_buffer(self, buf: Any) -> float:
        """Best of 3 ``read_into`` of ``buf`` (seconds), after a warm-up."""
        import torch

        dst = torch.empty(buf.size() // 4)
        buf.read_into(dst).get(timeout=60)
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            buf.read_into(dst).get(timeout=60)
            best = min(best, time.perf_counter() - t0)
        assert float(dst.sum()) == dst.numel()
        return best

    @endpoint
    def ping(self, other: Any, calls: int) -> float:
        """p50 (us) of ``calls`` no-op calls to ``other``, worker to worker, after 100
        (timed here, not with .stats: this class travels by value, and a worker
        need not be able to import ``benchmarks``)."""
        import statistics

        lat = []
        for i in range(100 + calls):
            t0 = time.perf_counter()
            other.noop.call_one().get()
            if i >= 100:
                lat.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(lat)

    @endpoint
    def send_to(self, other: Any, nbytes: int) -> float:
        import torch

        t = torch.ones(nbytes // 4)
        other.sum.call_one(t).get()  # warm-up
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            other.sum.call_one(t).get()
            best = min(best, time.perf_counter() - t0)
        return best


def measure(n: int, calls: int = 2000, big: bool = True, telemetry: float = 1.0
            ) -> dict[str, float]:
    """Our figures for ``n`` local workers."""
    t0 = time.perf_counter()
    procs = spawn_procs(n, telemetry_interval=telemetry)
    actors = procs.spawn("bench", Bench)
    actors.noop.call().get()
    spawn_s = time.perf_counter() - t0
    try:
        one = actors.slice(procs=0)
        lat = latencies_us(lambda: one.noop.call_one().get(), calls)
        out: dict[str, float] = {
            "call_p50_us": p50(lat), "call_p99_us": p99(lat),
            "bcast_p50_us": p50(latencies_us(lambda: actors.noop.call().get(),
                                             max(200, calls // 4))),
            "spawn_s": spawn_s,
        }
        best = 0.0
        for _ in range(3):
            t1 = time.perf_counter()
            futures = [one.noop.call_one() for _ in range(1000)]
            for f in futures:
                f.get()
            best = max(best, 1000 / (time.perf_counter() - t1))
        out["calls_per_s"] = best
        if n >= 2:  # an actor's call to another worker's actor (never through us)
            out["peer_call_p50_us"] = one.ping.call_one(actors.slice(procs=1),
                                                        calls).get(timeout=300)
        rss = [psutil.Process(procs.controller.ranks[r].pid).memory_info().rss
               for r in procs.ranks]
        out["worker_rss_mb"] = sum(rss) / len(rss) / MiB
        if big:
            import torch

            t = torch.ones(64 * MiB // 4)
            out["tensor_gbps"] = best_gbps(lambda: one.sum.call_one(t).get(), 64 * MiB)
            if n >= 2:
                secs = one.send_to.call_one(actors.slice(procs=1), 64 * MiB).get()
                out["p2p_gbps"] = 64 * MiB / secs / 1e9
                buf = one.register.call_one(64 * MiB).get()
                secs = actors.slice(procs=1).read_buffer.call_one(buf).get()
                out["rdma_gbps"] = 64 * MiB / secs / 1e9
        return out
    finally:
        procs.stop()


def fanout(sizes: tuple[int, ...] = (1, 4, 16, 64), calls: int = 200) -> dict[str, float]:
    """``bcast_p50_us`` for meshes of lightweight workers (telemetry off)."""
    out = {}
    for n in sizes:
        procs = spawn_procs(n, telemetry_interval=0, timeout=300)
        try:
            noop = procs.spawn("bench", Bench).noop
            out[f"bcast_p50_us_n{n}"] = p50(
                latencies_us(lambda noop=noop: noop.call().get(), calls, warmup=100))
        finally:
            procs.stop()
    return out
