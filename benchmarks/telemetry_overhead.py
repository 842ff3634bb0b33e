#!/usr/bin/env python3
"""What worker telemetry costs, in % of one CPU core per worker.

Two figures, measured in the same run:

1. **sampler** -- each worker's sampler thread reports the CPU time it has
   used (``sampler_cpu``, from ``time.thread_time()``) with every record; the
   growth of that figure over ``seconds``, divided by the wall time, is the
   sampler's own cost (psutil reads, USS every 10th sample, NVML, pickling
   and signing the message). This is the precise figure.
2. **whole worker, on vs off** -- two meshes of idle workers, one with
   telemetry at ``interval`` and one with telemetry off, side by side; the
   difference of their processes' CPU time (``psutil`` ``cpu_times``) over
   the same ``seconds``. It also counts the I/O thread forwarding the
   messages, but it is noisy on a loaded machine (it is a difference of two
   small numbers).

Every worker imports torch first (as real workers do): a process with torch
loaded has many more memory mappings, which makes USS (``smaps_rollup``) the
costliest figure.

Usage::

    python benchmarks/telemetry_overhead.py [--seconds 20] [--ranks 2] [--interval 1.0]

or from Python: ``measure(seconds) -> dict``.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import psutil

from monarch_kernel.mesh.procmesh import ProcMesh, spawn_procs

__all__ = ["measure"]


def _cpu_seconds(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        t = psutil.Process(pid).cpu_times()
        total += t.user + t.system
    return total


def _sampler_state(mesh: ProcMesh) -> dict[int, tuple[int, float]]:
    out = {}
    for r in mesh.ranks:
        tel = mesh.controller.ranks[r].telemetry
        if "sampler_cpu" in tel:
            out[r] = (int(tel["seq"]), float(tel["sampler_cpu"]))
    return out


def measure(seconds: float = 20.0, ranks: int = 2, interval: float = 1.0,
            import_torch: bool = True) -> dict[str, Any]:
    """Measure telemetry overhead on idle local workers.

    Parameters
    ----------
    seconds : float
        Length of the measurement window (after a short warm-up).
    ranks : int
        Workers per mesh (two meshes are started: telemetry on and off).
    interval : float
        Telemetry interval of the "on" mesh, seconds.
    import_torch : bool
        Import torch in every worker first (realistic memory maps).

    Returns
    -------
    dict
        ``sampler_ms_per_sample`` (CPU ms per sample), ``sampler_pct_of_core``
        (the sampler's cost at ``interval``, % of one core per worker),
        ``worker_pct_on`` / ``worker_pct_off`` (whole idle worker's CPU, % of
        a core, mean per worker), ``diff_pct_of_core`` (on - off), and the
        parameters.

    Raises
    ------
    ValueError
        For non-positive ``seconds``, ``ranks`` or ``interval``.
    """
    if seconds <= 0 or ranks < 1 or interval <= 0:
        raise ValueError("seconds, ranks and interval must be positive")
    on = spawn_procs(ranks, telemetry_interval=interval)
    off = None
    try:
        off = spawn_procs(ranks, telemetry_interval=0)
        if import_torch:
            for m in (on, off):
                m.exec("import torch")
        pids_on = [on.controller.ranks[r].pid for r in on.ranks]
        pids_off = [off.controller.ranks[r].pid for r in off.ranks]
        time.sleep(max(2.0, 2.5 * interval))  # warm-up: first samples, imports settle
        s0 = _sampler_state(on)
        c_on0, c_off0, t0 = _cpu_seconds(pids_on), _cpu_seconds(pids_off), time.monotonic()
        time.sleep(seconds)
        c_on1, c_off1, t1 = _cpu_seconds(pids_on), _cpu_seconds(pids_off), time.monotonic()
        s1 = _sampler_state(on)
    finally:
        on.stop()
        if off is not None:
            off.stop()
    wall = t1 - t0
    per_sample = []
    sampler_pct = []
    for r, (seq1, cpu1) in s1.items():
        if r in s0 and seq1 > s0[r][0]:
            seq0, cpu0 = s0[r]
            per_sample.append((cpu1 - cpu0) / (seq1 - seq0))
            # the records bracket a slightly different window than [t0, t1]
            sampler_pct.append((cpu1 - cpu0) / ((seq1 - seq0) * interval) * 100)
    on_pct = (c_on1 - c_on0) / wall / ranks * 100
    off_pct = (c_off1 - c_off0) / wall / ranks * 100
    return {
        "seconds": round(wall, 2),
        "ranks": ranks,
        "interval": interval,
        "import_torch": import_torch,
        "sampler_ms_per_sample": round(1000 * sum(per_sample) / len(per_sample), 4)
        if per_sample else None,
        "sampler_pct_of_core": round(sum(sampler_pct) / len(sampler_pct), 4)
        if sampler_pct else None,
        "worker_pct_on": round(on_pct, 3),
        "worker_pct_off": round(off_pct, 3),
        "diff_pct_of_core": round(on_pct - off_pct, 3),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--interval", type=float, default=1.0)
    p.add_argument("--no-torch", action="store_true", help="do not import torch in workers")
    a = p.parse_args()
    res = measure(a.seconds, a.ranks, a.interval, import_torch=not a.no_torch)
    print(json.dumps(res, indent=2))
    print(f"telemetry at {a.interval:g} s costs {res['sampler_pct_of_core']}% of one core per "
          f"worker (sampler thread: {res['sampler_ms_per_sample']} ms CPU per sample); "
          f"whole idle worker on vs off: {res['worker_pct_on']}% vs {res['worker_pct_off']}% "
          f"(difference {res['diff_pct_of_core']}%)")


if __name__ == "__main__":
    main()
