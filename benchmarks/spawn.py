"""Spawn: N local workers started and every one answered, against raw processes.

``python -m benchmarks.spawn [--sizes 1,4,16,32] [--runs 5] [--torchmonarch PYTHON]
[--json out.json]``

Variants, each timed from the call that starts the workers until every
worker has answered one message (interleaved: each run measures every
variant once, in an order that rotates from run to run; the figures are the
medians over the runs, with the lowest and highest):

``raw``
    N bare ``python -c`` processes that import pyzmq, connect a DEALER to our
    ROUTER (ipc) and say hello; then each answers one no-op message. The
    least a Python worker on ZeroMQ costs. Ordinary processes, like ours
    (the workers' ``SCHED_BATCH`` policy is recorded, not changed).
``zygote_cold``
    ``spawn_procs(N)`` with the template process (:mod:`monarch_kernel.launchers.zygote`)
    ended before the run: its start-up and imports are in the figure (the
    first mesh of a kernel).
``zygote_warm``
    The same with the template process already running (every later mesh).
``no_zygote``
    ``MONARCH_ZYGOTE=0``: each worker starts its own Python.
``torchmonarch``
    With ``--torchmonarch PYTHON`` (an interpreter that has torchmonarch):
    ``this_host().spawn_procs(per_host={"procs": N})`` in a child process,
    timed inside it, imports excluded.

For ours and torchmonarch, "answered" is an actor spawned on every rank and
a no-op endpoint called on all of them (as :mod:`.ours` and
:mod:`.actor_peers` time their ``spawn_s``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import cloudpickle
import zmq

from monarch_kernel import Actor, endpoint
from monarch_kernel.launchers import zygote
from monarch_kernel.mesh.procmesh import spawn_procs

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers need not import it

RAW_WORKER = ("import sys, zmq\n"
              "s = zmq.Context().socket(zmq.DEALER); s.linger = 0\n"
              "s.connect(sys.argv[1]); s.send(b'hello')\n"
              "while s.recv() != b'stop': s.send(b'ok')\n")

TM_CHILD = r"""
import sys, time
from monarch.actor import Actor, endpoint, this_host
class Noop(Actor):
    @endpoint
    def noop(self) -> None:
        return None
n = int(sys.argv[1])
t0 = time.perf_counter()
procs = this_host().spawn_procs(per_host={"procs": n})
procs.spawn("noop", Noop).noop.call().get()
print("SPAWN_S", time.perf_counter() - t0, flush=True)
procs.stop().get()
"""


class Noop(Actor):
    """An actor with a no-op endpoint."""

    @endpoint
    def noop(self) -> None:
        return None


def raw(n: int) -> float:
    """Seconds until ``n`` bare pyzmq processes have connected and answered."""
    ctx = zmq.Context()
    d = tempfile.mkdtemp(prefix="spawnbench-")
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    addr = f"ipc://{d}/r"
    router.bind(addr)
    procs: list[subprocess.Popen] = []
    try:
        t0 = time.perf_counter()
        procs = [subprocess.Popen([sys.executable, "-c", RAW_WORKER, addr],
                                  stdin=subprocess.DEVNULL, start_new_session=True)
                 for _ in range(n)]
        ids: list[bytes] = []
        while len(ids) < n:
            if not router.poll(60000):
                raise TimeoutError("raw workers did not connect")
            ids.append(router.recv_multipart()[0])
        for i in ids:
            router.send_multipart([i, b"noop"])
        for _ in ids:
            router.recv_multipart()
        secs = time.perf_counter() - t0
        for i in ids:
            router.send_multipart([i, b"stop"])
        for p in procs:
            p.wait(30)
        return secs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(5)
        router.close(0)
        ctx.term()
        shutil.rmtree(d, ignore_errors=True)


def ours(n: int, variant: str) -> float:
    """Seconds until ``spawn_procs(n)`` returned and a no-op reached every rank."""
    if variant == "zygote_cold":
        zygote.shutdown()
    os.environ["MONARCH_ZYGOTE"] = "0" if variant == "no_zygote" else "1"
    try:
        t0 = time.perf_counter()
        procs = spawn_procs(n, force=True, timeout=300)
        try:
            procs.spawn("noop", Noop).noop.call().get(timeout=300)
            return time.perf_counter() - t0
        finally:
            procs.stop()
    finally:
        os.environ.pop("MONARCH_ZYGOTE", None)


def torchmonarch(n: int, python: str) -> float:
    """torchmonarch's seconds for the same (in a child process and session of its own)."""
    p = subprocess.Popen([python, "-c", TM_CHILD, str(n)], stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, text=True,
                         start_new_session=True)
    try:
        for line in p.stdout or ():
            if line.startswith("SPAWN_S"):
                return float(line.split()[1])
        raise RuntimeError("torchmonarch printed no figure")
    finally:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait(5)


def _summary(xs: list[float]) -> dict[str, float]:
    return {"median_s": statistics.median(xs), "min_s": min(xs), "max_s": max(xs), "runs": len(xs)}


def run(sizes: tuple[int, ...] = (1, 4, 16, 32), runs: int = 5,
        tm_python: str | None = None) -> dict[str, Any]:
    """Every variant for every size, ``runs`` interleaved rounds each."""
    variants = ["raw", "zygote_cold", "zygote_warm", "no_zygote"]
    if tm_python:
        variants.append("torchmonarch")
    out: dict[str, Any] = {"cores": len(os.sched_getaffinity(0)),
                           "load_before": os.getloadavg(), "n": {}}
    for n in sizes:
        times: dict[str, list[float]] = {v: [] for v in variants}
        for r in range(runs):
            order = variants[r % len(variants):] + variants[:r % len(variants)]
            if "zygote_warm" in order:  # (warm means: a zygote already runs)
                zygote.shutdown()
                order.remove("zygote_warm")
                order.insert(order.index("zygote_cold") + 1, "zygote_warm")
            for v in order:
                print(f"[spawn] N={n} run {r + 1}/{runs}: {v}", file=sys.stderr, flush=True)
                if v == "raw":
                    times[v].append(raw(n))
                elif v == "torchmonarch":
                    assert tm_python is not None
                    times[v].append(torchmonarch(n, tm_python))
                else:
                    times[v].append(ours(n, v))
        row = {v: _summary(xs) for v, xs in times.items()}
        base = row["raw"]["median_s"]
        row["ratio_to_raw"] = {v: row[v]["median_s"] / base for v in variants if v != "raw"}
        out["n"][n] = row
    out["load_after"] = os.getloadavg()
    zygote.shutdown()
    return out


def table(result: dict[str, Any]) -> str:
    """A markdown table of ``run``'s result."""
    variants = [v for v in ("raw", "zygote_cold", "zygote_warm", "no_zygote", "torchmonarch")
                if any(v in row for row in result["n"].values())]
    lines = ["| N | " + " | ".join(variants) + " | cold / raw | warm / raw |",
             "|---|" + "---|" * (len(variants) + 2)]
    for n, row in result["n"].items():
        cells = [f"{row[v]['median_s']:.2f} s ({row[v]['min_s']:.2f}-{row[v]['max_s']:.2f})"
                 for v in variants]
        lines.append(f"| {n} | " + " | ".join(cells)
                     + f" | {row['ratio_to_raw']['zygote_cold']:.2f}x"
                     + f" | {row['ratio_to_raw']['zygote_warm']:.2f}x |")
    la, lb = result["load_before"], result["load_after"]
    lines.append(f"\n{result['cores']} cores; load average before {la[0]:.2f}, "
                 f"after {lb[0]:.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.spawn", description=__doc__)
    p.add_argument("--sizes", default="1,4,16,32")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--torchmonarch", default=None, metavar="PYTHON",
                   help="an interpreter with torchmonarch installed")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    result = run(tuple(int(x) for x in a.sizes.split(",")), a.runs, a.torchmonarch)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
