"""Broadcast fan-out and pipelined throughput, ours against raw pyzmq over ipc and tcp.

``python -m benchmarks.bcast [--sizes 1,4,16,32] [--calls 300] [--json out.json]``

For each N, three meshes are up at once: ours (``spawn_procs(N)``, a no-op
endpoint, lanes as configured), and the raw pyzmq ROUTER/DEALER echo of
:mod:`benchmarks.raw_zmq` over ``ipc://`` and over loopback ``tcp://``, its
workers under the same scheduling policy as ours (``SCHED_BATCH`` unless
``MONARCH_SCHED_BATCH=0``, :mod:`monarch_kernel.worker.sched`; the driver
itself is an ordinary process for all three). Broadcasts (a no-op on every
rank, results gathered) run in blocks that alternate between the three, so
all see the same machine; each figure is the median of all its broadcasts
with the 25th and 75th percentiles as spread (never a best-of). The slope is
(p50 at N = 32, else the largest N, - p50 at N = 4) / (that N - 4),
microseconds per rank.

``--throughput``: 1,000 pipelined calls to one actor at N = 2 and N = 4,
ours with request/reply batching on and off (``MONARCH_BATCHING``), and raw
over ipc, in alternating rounds; calls/s as the median of the rounds, with
the lowest and highest.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

from benchmarks.ours import Bench
from benchmarks.raw_zmq import RawMesh
from monarch_kernel.mesh.procmesh import spawn_procs
from monarch_kernel.util.switches import sched_batch_enabled


def policy() -> str:
    """The raw workers' policy that matches ours: "batch" or "ordinary"."""
    if not hasattr(os, "SCHED_BATCH") or os.sched_getscheduler(0) != os.SCHED_OTHER:
        return "ordinary"
    return "batch" if sched_batch_enabled() else "ordinary"


def _spread(xs: list[float]) -> dict[str, float]:
    s = sorted(xs)
    q = statistics.quantiles(s, n=4) if len(s) >= 4 else [s[0], statistics.median(s), s[-1]]
    return {"p50": statistics.median(s), "p25": q[0], "p75": q[2], "n": len(s)}


def _blocks(fns: dict[str, Callable[[], object]], calls: int, block: int, warmup: int = 50
            ) -> dict[str, dict[str, float]]:
    """Run each fn ``calls`` times in alternating blocks; per name its spread (us)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    lat: dict[str, list[float]] = {k: [] for k in fns}
    clock = time.perf_counter
    while len(next(iter(lat.values()))) < calls:
        for k, fn in fns.items():
            out = lat[k]
            for _ in range(block):
                t0 = clock()
                fn()
                out.append((clock() - t0) * 1e6)
    return {k: _spread(v) for k, v in lat.items()}


def fanout(sizes: tuple[int, ...], calls: int = 300, block: int = 50) -> dict[str, Any]:
    """Broadcast p50 and spread per N, ours and raw over ipc and tcp (see the module docstring)."""
    pol = policy()
    rows: dict[str, Any] = {}
    errors: dict[str, str] = {}
    for n in sizes:
        print(f"[bcast] N={n}", file=sys.stderr, flush=True)
        with contextlib.ExitStack() as stack:
            try:
                raw_ipc = RawMesh(n, "ipc", pol)
                stack.callback(raw_ipc.close)
                raw_tcp = RawMesh(n, "tcp", pol)
                stack.callback(raw_tcp.close)
                procs = spawn_procs(n, telemetry_interval=0, timeout=300, force=True)
                stack.callback(procs.stop)
                noop = procs.spawn("bench", Bench).noop

                def ours(noop: Any = noop) -> None:
                    noop.call().get()
                rows[str(n)] = _blocks({"ours": ours, "raw_ipc": raw_ipc.bcast,
                                        "raw_tcp": raw_tcp.bcast}, calls, block)
            except Exception as e:  # noqa: BLE001 - one size failing keeps the others
                errors[str(n)] = f"{type(e).__name__}: {e}"
                print(f"[bcast] N={n} not measured: {errors[str(n)]}", file=sys.stderr)
    out: dict[str, Any] = {"rows": rows, "raw_policy": pol, "errors": errors}
    ns = [int(n) for n in rows]
    top = 32 if 32 in ns else max(ns, default=0)  # (the target's slope: N = 4 to 32)
    if 4 in ns and top > 4:
        out["slope_us_per_rank"] = {
            k: (rows[str(top)][k]["p50"] - rows["4"][k]["p50"]) / (top - 4)
            for k in ("ours", "raw_ipc", "raw_tcp")}
        out["slope_from_to"] = [4, top]
    return out


@contextlib.contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


def _pipelined(call: Callable[[], Any], n: int = 1000) -> float:
    t0 = time.perf_counter()
    futures = [call() for _ in range(n)]
    for f in futures:
        f.get()
    return n / (time.perf_counter() - t0)


def throughput(sizes: tuple[int, ...] = (2, 4), rounds: int = 9) -> dict[str, Any]:
    """Calls/s of 1,000 pipelined no-op calls to one actor (see the module docstring)."""
    out: dict[str, Any] = {}
    pol = policy()
    for n in sizes:
        print(f"[bcast] throughput N={n}", file=sys.stderr, flush=True)
        raw = RawMesh(n, "ipc", pol)
        procs = spawn_procs(n, telemetry_interval=0, timeout=300, force=True)
        with _env("MONARCH_BATCHING", "0"):
            plain = spawn_procs(n, telemetry_interval=0, timeout=300, force=True)
        try:
            one = procs.spawn("bench", Bench).slice(procs=0)
            one_plain = plain.spawn("bench", Bench).slice(procs=0)
            fns: dict[str, Callable[[], float]] = {
                "ours_batching": functools.partial(_pipelined, one.noop.call_one),
                "ours_no_batching": functools.partial(_pipelined, one_plain.noop.call_one),
                "raw_ipc": raw.pipelined,
            }
            for fn in fns.values():
                fn()  # warm-up
            res: dict[str, list[float]] = {k: [] for k in fns}
            for _ in range(rounds):
                for k, fn in fns.items():
                    res[k].append(fn())
            out[str(n)] = {k: {"median": statistics.median(v), "min": min(v), "max": max(v)}
                           for k, v in res.items()}
        finally:
            procs.stop()
            plain.stop()
            raw.close()
    return out


def _load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


def table(result: dict[str, Any]) -> str:
    lines = [f"load average before / after: {result['load_before']} / {result['load_after']}; "
             f"{result['cores']} cores; raw workers' policy: {result['fanout']['raw_policy']}"]
    lines.append("| N | ours p50 (p25-p75) | raw ipc | raw tcp | ours / raw ipc |")
    lines.append("|---|---|---|---|---|")
    for n, row in result["fanout"]["rows"].items():
        def f(k: str, row: dict[str, Any] = row) -> str:
            r = row[k]
            return f"{r['p50']:,.0f} us ({r['p25']:,.0f}-{r['p75']:,.0f})"
        lines.append(f"| {n} | {f('ours')} | {f('raw_ipc')} | {f('raw_tcp')} | "
                     f"{row['ours']['p50'] / row['raw_ipc']['p50']:.2f}x |")
    sl = result["fanout"].get("slope_us_per_rank")
    if sl:
        a, b = result["fanout"]["slope_from_to"]
        lines.append(f"slope N={a}..{b}: ours {sl['ours']:.1f} us/rank, raw ipc "
                     f"{sl['raw_ipc']:.1f}, raw tcp {sl['raw_tcp']:.1f}; ours / raw ipc "
                     f"{sl['ours'] / sl['raw_ipc']:.2f}x")
    for n, row in result.get("throughput", {}).items():
        lines.append(f"pipelined calls/s N={n}: " + ", ".join(
            f"{k} {v['median']:,.0f} ({v['min']:,.0f}-{v['max']:,.0f})" for k, v in row.items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bcast")
    p.add_argument("--sizes", default="1,4,16,32")
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--throughput", action="store_true")
    p.add_argument("--no-fanout", action="store_true")
    p.add_argument("--json")
    a = p.parse_args(argv)
    result: dict[str, Any] = {"load_before": _load(), "cores": len(os.sched_getaffinity(0))}
    sizes = tuple(int(x) for x in a.sizes.split(","))
    result["fanout"] = ({"rows": {}, "raw_policy": policy()} if a.no_fanout
                        else fanout(sizes, a.calls))
    if a.throughput:
        result["throughput"] = throughput()
    result["load_after"] = _load()
    print(table(result))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
