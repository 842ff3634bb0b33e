"""Small timing helpers shared by the benchmarks."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any


def latencies_us(fn: Callable[[], object], n: int, warmup: int = 100) -> list[float]:
    """Call ``fn`` ``warmup + n`` times; the last ``n`` durations in microseconds."""
    for _ in range(warmup):
        fn()
    out = []
    clock = time.perf_counter
    for _ in range(n):
        t0 = clock()
        fn()
        out.append((clock() - t0) * 1e6)
    return out


def p50(xs: list[float]) -> float:
    return statistics.median(xs)


def p99(xs: list[float]) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(0.99 * (len(s) - 1))))]


def best_of(fn: Callable[[], float], times: int) -> float:
    """The best (largest) of ``times`` throughput measurements."""
    return max(fn() for _ in range(times))


def best_gbps(fn: Callable[[], object], nbytes: int, times: int = 3) -> float:
    """GB/s of the fastest of ``times`` calls of ``fn`` moving ``nbytes``, after
    one call to warm up."""
    fn()
    clock = time.perf_counter
    best = float("inf")
    for _ in range(times):
        t0 = clock()
        fn()
        best = min(best, clock() - t0)
    return nbytes / best / 1e9


def fanout_p50_us(make: Callable[[int], Any], sizes: tuple[int, ...], calls: int
                  ) -> dict[str, float]:
    """``bcast_p50_us_nN``: the p50 of ``make(N).bcast()`` (after 100 warm-up
    broadcasts) for each N in ``sizes``; each mesh is closed before the next."""
    out = {}
    for n in sizes:
        m = make(n)
        try:
            out[f"bcast_p50_us_n{n}"] = p50(latencies_us(m.bcast, calls, warmup=100))
        finally:
            m.close()
    return out
