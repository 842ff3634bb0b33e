"""Latency of ours and of the raw baseline, measured in alternating blocks.

On a shared VM the speed of the machine drifts over seconds (the raw pyzmq
no-op call can move by 2x within minutes). With both meshes
up, blocks of calls alternate between the raw DEALER/ROUTER echo and our
actor endpoints, so both see the same machine and their ratio compares like
with like. Figures: ``call_p50_us``, ``call_p99_us`` (one worker) and
``bcast_p50_us`` (all N, gathered), each side, and ours / raw; and ours
with the controller's spin off (``call_p50_us_spin_off``; see
:mod:`monarch_kernel.controller.io`), so the ratio shows what the spin is
worth: the raw echo blocks in ``recv`` and never spins. Each block starts
with the spin as set, and ``spin_contended`` counts the times the spin
turned itself off in a block (a yield that lost the core for 1 ms).

``call_p50_us_zeromq``, ``bcast_p50_us_zeromq``: ours again on a second mesh
whose workers talk to the controller through ZeroMQ instead of lanes
(``MONARCH_LANES=0``, :mod:`monarch_kernel.transport.lane`), in the same blocks: what
the lanes are worth (only when lanes are on: with ``MONARCH_LANES=0`` both
meshes would use ZeroMQ).

``call_idle_p50_us``: a no-op call after ``IDLE_S`` (1.5 ms) of idleness,
each side, in the same alternating blocks. Back-to-back calls keep every
thread and cache warm; a notebook's calls come after a pause, and this is
where a spin that held on to its core cost most (see
:mod:`monarch_kernel.controller.io`).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from typing import Any

from monarch_kernel.mesh.procmesh import spawn_procs

from benchmarks.ours import Bench
from benchmarks.raw_zmq import RawMesh
from benchmarks.stats import latencies_us, p50, p99

#: seconds of idleness before each call of ``call_idle_p50_us``
IDLE_S = 0.0015


def _after_idle(fn: Any) -> Any:
    """``fn`` timed after ``IDLE_S`` of sleep (the sleep is not timed)."""
    clock = time.perf_counter

    def timed() -> float:
        time.sleep(IDLE_S)
        t0 = clock()
        fn()
        return (clock() - t0) * 1e6
    return timed


@contextlib.contextmanager
def _lanes_off() -> Iterator[None]:
    """Meshes spawned within use ZeroMQ for their local workers."""
    old = os.environ.get("MONARCH_LANES")
    os.environ["MONARCH_LANES"] = "0"
    try:
        yield
    finally:
        if old is None:
            del os.environ["MONARCH_LANES"]
        else:
            os.environ["MONARCH_LANES"] = old


def measure(n: int, calls: int = 2000, block: int = 100) -> dict[str, Any]:
    """Alternate ``block`` calls of each kind until each has ``calls`` (the calls
    after idleness: a quarter of that, in blocks of a quarter)."""
    raw = RawMesh(n)
    procs = spawn_procs(n, telemetry_interval=1.0)
    zmq_procs = None
    try:
        actors = procs.spawn("bench", Bench)
        one = actors.slice(procs=0)
        fns = {
            ("raw_pyzmq", "call"): lambda: raw.call(raw.ids[0]),
            ("monarch_kernel", "call"): lambda: one.noop.call_one().get(),
            ("raw_pyzmq", "bcast"): raw.bcast,
            ("monarch_kernel", "bcast"): lambda: actors.noop.call().get(),
        }
        if procs.transport == "lanes":  # ours over ZeroMQ too, in the same blocks
            with _lanes_off():
                zmq_procs = spawn_procs(n, telemetry_interval=1.0)
            zactors = zmq_procs.spawn("bench", Bench)
            zone = zactors.slice(procs=0)
            fns["monarch_kernel", "call_zeromq"] = lambda: zone.noop.call_one().get()
            fns["monarch_kernel", "bcast_zeromq"] = lambda: zactors.noop.call().get()
        # ours again with the controller's spin off (MONARCH_SPIN_US=0): what the
        # spin (controller_io) is worth, in the same blocks
        fns["monarch_kernel", "call_nospin"] = fns["monarch_kernel", "call"]
        ctl = procs.controller
        spin = ctl.spin_s
        idle = {("raw_pyzmq", "call_idle"): _after_idle(fns["raw_pyzmq", "call"]),
                ("monarch_kernel", "call_idle"): _after_idle(fns["monarch_kernel", "call"])}
        lat: dict[tuple[str, str], list[float]] = {k: [] for k in [*fns, *idle]}
        for k, fn in fns.items():
            latencies_us(fn, 1, warmup=100)
        contended = ctl.spin_contended
        for _ in range(max(1, calls // block)):
            for k, fn in fns.items():
                ctl.spin_s = 0.0 if k[1] == "call_nospin" else spin
                ctl.engine.spin_off_until = 0.0  # (each block starts with the spin as set)
                lat[k] += latencies_us(fn, block, warmup=3)
            ctl.spin_s = spin
            ctl.engine.spin_off_until = 0.0
            for k, timed in idle.items():
                lat[k] += [timed() for _ in range(max(1, block // 4))]
        ctl.spin_s = spin
        out: dict[str, Any] = {}
        for side in ("raw_pyzmq", "monarch_kernel"):
            out[side] = {"call_p50_us": p50(lat[side, "call"]),
                         "call_p99_us": p99(lat[side, "call"]),
                         "bcast_p50_us": p50(lat[side, "bcast"]),
                         "call_idle_p50_us": p50(lat[side, "call_idle"])}
        out["ratio_to_raw"] = {m: out["monarch_kernel"][m] / out["raw_pyzmq"][m]
                               for m in out["raw_pyzmq"]}
        nospin = p50(lat["monarch_kernel", "call_nospin"])
        out["monarch_kernel"]["call_p50_us_spin_off"] = nospin
        out["ratio_to_raw"]["call_p50_us_spin_off"] = nospin / out["raw_pyzmq"]["call_p50_us"]
        for m in ("call", "bcast") if zmq_procs is not None else ():  # ZeroMQ, not lanes
            v = p50(lat["monarch_kernel", f"{m}_zeromq"])
            out["monarch_kernel"][f"{m}_p50_us_zeromq"] = v
            out["ratio_to_raw"][f"{m}_p50_us_zeromq"] = v / out["raw_pyzmq"][f"{m}_p50_us"]
        out["spin_us"] = spin * 1e6
        # times a yield lost the core for 1 ms and turned the spin off for 1 s (a
        # block then ran partly without it; see monarch_kernel.controller.io)
        out["spin_contended"] = ctl.spin_contended - contended
        return out
    finally:
        procs.stop()
        if zmq_procs is not None:
            zmq_procs.stop()
        raw.close()
