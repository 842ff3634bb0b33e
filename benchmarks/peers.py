"""The same measurements on the peers that are installed (ipyparallel; Ray and
torchmonarch are measured when importable, otherwise reported as absent)."""

from __future__ import annotations

import importlib.util
import time
from typing import Any

from benchmarks.stats import best_gbps, latencies_us, p50, p99

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
            out["tensor_gbps"] = best_gbps(lambda: one.apply_sync(_sum, t), 64 * MiB)
        return out
    finally:
        cluster.stop_cluster_sync()


def _python3_px(n: int) -> Any:
    """A python3 kernel with an ipyparallel cluster of ``n`` engines, %px active."""
    from monarch_kernel.testing.kernel import KernelSession

    ks = KernelSession("python3")
    r = ks.execute(f"import ipyparallel as ipp\ncluster = ipp.Cluster(n={n}, log_level=40)\n"
                   f"rc = cluster.start_and_connect_sync()\nrc.wait_for_engines({n})\n"
                   "rc.activate()", timeout=180)
    if r.status != "ok":
        ks.shutdown()
        raise RuntimeError(r.error_text())
    return ks


def _monarch_mesh(n: int) -> Any:
    """A monarch kernel with a mesh of ``n`` local workers."""
    from monarch_kernel.testing.kernel import KernelSession

    ks = KernelSession("monarch")
    r = ks.execute(f"%mesh spawn {n}")
    if r.status != "ok":
        ks.shutdown()
        raise RuntimeError(r.error_text())
    return ks


def _cell_times(ks: Any, code: str, cells: int) -> list[float]:
    lat = []
    for _ in range(cells):
        t0 = time.perf_counter()
        r = ks.execute(code)
        lat.append((time.perf_counter() - t0) * 1e6)
        if r.status != "ok":
            raise RuntimeError(r.error_text())
    return lat


def cells(n: int = 2, cells: int = 40, px: bool = True, block: int = 10) -> dict[str, float]:
    """p50 round trips of cells through real kernels (jupyter_client), in us.

    ``%%mesh pass`` and a plain ``pass`` in the monarch kernel; with ``px``,
    ``%px pass`` and a plain ``pass`` in a python3 kernel with ipyparallel.
    Both kernels are up at once and the four kinds of cell run in turns, in
    blocks of ``block`` cells (as :mod:`.paired` does for calls), so a slow
    minute of this machine weighs on all of them alike.
    """
    kinds = {"monarch_kernel": "%%mesh\npass", "monarch_kernel_plain_pass": "pass"}
    sessions = {"monarch_kernel": _monarch_mesh(n)}
    try:
        if px:
            sessions["ipyparallel_px"] = _python3_px(n)
            kinds.update({"ipyparallel_px": "%px pass", "python3_plain_pass": "pass"})
        session_of = {k: sessions["ipyparallel_px" if k in ("ipyparallel_px",
                                                           "python3_plain_pass")
                                  else "monarch_kernel"] for k in kinds}
        for k, code in kinds.items():  # warm-up
            _cell_times(session_of[k], code, 5)
        lat: dict[str, list[float]] = {k: [] for k in kinds}
        for _ in range(max(1, cells // block)):
            for k, code in kinds.items():
                lat[k] += _cell_times(session_of[k], code, block)
        return {k: p50(v) for k, v in lat.items()}
    finally:
        for name, ks in sessions.items():
            try:
                ks.execute("%mesh stop" if name == "monarch_kernel"
                           else "cluster.stop_cluster_sync()", timeout=60)
            finally:
                ks.shutdown()


def versions() -> dict[str, str | None]:
    """Versions of what the figures depend on (None: not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {}
    for dist in ("monarch_kernel", "pyzmq", "torch", "ipyparallel", "ray", "torchmonarch"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = None
    return out


def installed() -> dict[str, bool]:
    return {name: importlib.util.find_spec(mod) is not None
            for name, mod in (("ipyparallel", "ipyparallel"), ("ray", "ray"),
                              ("torchmonarch", "monarch"))}
