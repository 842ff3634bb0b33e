"""The same measurements on the peers that are installed (ipyparallel; Ray and
torchmonarch are measured when importable, otherwise reported as absent)."""

from __future__ import annotations

import importlib.util
import time
from typing import Any

from .stats import latencies_us, p50, p99

MiB = 1 << 20


def _noop() -> None:
    return None


def _sum(t: Any) -> float:
    return float(t.sum())


def ipyparallel(n: int, calls: int = 500, big: bool = True) -> dict[str, float]:
    """ipyparallel with ``n`` engines (a local cluster it starts itself)."""
    import ipyparallel as ipp

    t0 = time.perf_counter()
    cluster = ipp.Cluster(n=n, log_level=40)
    rc = cluster.start_and_connect_sync()
    rc.wait_for_engines(n, timeout=120)
    rc[:].apply_sync(_noop)
    spawn_s = time.perf_counter() - t0
    try:
        one, every = rc[0], rc[:]
        lat = latencies_us(lambda: one.apply_sync(_noop), calls, warmup=20)
        out = {"call_p50_us": p50(lat), "call_p99_us": p99(lat),
               "bcast_p50_us": p50(latencies_us(lambda: every.apply_sync(_noop), calls // 2,
                                                warmup=10)),
               "spawn_s": spawn_s}
        t1 = time.perf_counter()
        ars = [one.apply_async(_noop) for _ in range(1000)]
        for ar in ars:
            ar.get(timeout=120)
        out["calls_per_s"] = 1000 / (time.perf_counter() - t1)
        if big:
            import torch

            t = torch.ones(64 * MiB // 4)
            one.apply_sync(_sum, t)
            best = 0.0
            for _ in range(3):
                t1 = time.perf_counter()
                one.apply_sync(_sum, t)
                best = max(best, 64 * MiB / (time.perf_counter() - t1) / 1e9)
            out["tensor_gbps"] = best
        return out
    finally:
        cluster.stop_cluster_sync()


def px_pass(n: int = 2, cells: int = 40) -> tuple[float, float]:
    """p50 of ``%px pass`` through a real python3 kernel (jupyter_client), and of a
    plain ``pass`` cell in the same kernel (what the kernel alone costs), in us."""
    from monarch_kernel.testing import KernelSession

    ks = KernelSession("python3")
    try:
        r = ks.execute("import ipyparallel as ipp\ncluster = ipp.Cluster(n=%d, log_level=40)\n"
                       "rc = cluster.start_and_connect_sync()\nrc.wait_for_engines(%d)\n"
                       "rc.activate()" % (n, n), timeout=180)
        if r.status != "ok":
            raise RuntimeError(r.error_text())
        plain = _cell_p50(ks, "pass", cells)
        return _cell_p50(ks, "%px pass", cells, after="cluster.stop_cluster_sync()"), plain
    finally:
        ks.shutdown()


def _cell_p50(ks: Any, code: str, cells: int, after: str | None = None) -> float:
    for _ in range(5):
        ks.execute(code)
    lat = []
    for _ in range(cells):
        t0 = time.perf_counter()
        r = ks.execute(code)
        lat.append((time.perf_counter() - t0) * 1e6)
        if r.status != "ok":
            raise RuntimeError(r.error_text())
    if after:
        ks.execute(after, timeout=60)
    return p50(lat)


def mesh_pass(n: int = 2, cells: int = 40) -> tuple[float, float]:
    """p50 of ``%%mesh pass`` through the real monarch kernel, and of a plain
    ``pass`` cell in the same kernel (what the kernel alone costs), in us."""
    from monarch_kernel.testing import KernelSession

    ks = KernelSession("monarch")
    try:
        r = ks.execute(f"%mesh spawn {n}")
        if r.status != "ok":
            raise RuntimeError(r.error_text())
        plain = _cell_p50(ks, "pass", cells)
        return _cell_p50(ks, "%%mesh\npass", cells, after="%mesh stop"), plain
    finally:
        ks.shutdown()


def installed() -> dict[str, bool]:
    return {name: importlib.util.find_spec(mod) is not None
            for name, mod in (("ipyparallel", "ipyparallel"), ("ray", "ray"),
                              ("torchmonarch", "monarch"))}
