"""``python -m benchmarks [--json out.json] [--quick] [--compare KIND]``: the whole suite.

Measures, in one run on this machine: the raw pyzmq baseline, our figures
(latency also in blocks alternating with the baseline, :mod:`.paired`),
and the installed peers, for N = 2 and 4 workers, plus ``%%mesh pass``
against ``%px pass`` (both kernels up, cells in alternating blocks, with a
plain ``pass`` in each kernel for its own floor), telemetry overhead, idle
worker memory and fan-out growth. Prints a table; the JSON holds every figure and each of ours as a
ratio to the raw baseline of the same run.

One result per machine kind is kept in ``benchmarks/baselines/KIND.json``
(``vm-2cores``, ``h200-16cores``; ``h200-gpu`` for :mod:`.gpu`).
``--compare KIND`` (or a path) prints this run's ratios next to that
baseline's; ``--json baselines`` writes the result there, under ``--kind``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

from monarch_kernel.util.switches import lanes_enabled, sched_batch_enabled

from benchmarks import actor_peers
from benchmarks import bare_echo
from benchmarks import ours
from benchmarks import paired
from benchmarks import peers
from benchmarks import raw_zmq

METRICS = ["call_p50_us", "call_p99_us", "bcast_p50_us", "peer_call_p50_us", "calls_per_s",
           "tensor_gbps", "p2p_gbps", "rdma_gbps", "spawn_s"]
LOWER_IS_BETTER = {"call_p50_us", "call_p99_us", "bcast_p50_us", "peer_call_p50_us", "spawn_s",
                   "cell_p50_us", "worker_rss_mb", "telemetry_cpu_pct"}


def run(quick: bool = False, sizes: tuple[int, ...] = (2, 4), kernels: bool = True
        ) -> dict[str, Any]:
    calls = 500 if quick else 2000
    ours_policy, baseline_policy = _policies()
    result: dict[str, Any] = {"machine": {"python": sys.version.split()[0],
                                          "platform": platform.platform(),
                                          "cores": len(os.sched_getaffinity(0))
                                          if hasattr(os, "sched_getaffinity")
                                          else os.cpu_count()},
                              "installed": peers.installed(),
                              # local workers through lanes (monarch_kernel.transport.lane), or ZeroMQ
                              "lanes": lanes_enabled(),
                              # our workers under SCHED_BATCH (monarch_kernel.worker.sched);
                              # the baselines' are ordinary processes
                              "sched_batch": sched_batch_enabled(),
                              "worker_policy": ours_policy,
                              "baseline_policy": baseline_policy,
                              "versions": peers.versions(), "n": {}}
    for n in sizes:
        row: dict[str, Any] = {}
        print(f"[bench] N={n}: raw pyzmq", file=sys.stderr, flush=True)
        row["raw_pyzmq"] = raw_zmq.measure(n, calls)
        print(f"[bench] N={n}: monarch_kernel", file=sys.stderr, flush=True)
        row["monarch_kernel"] = ours.measure(n, calls)
        if result["installed"]["ipyparallel"]:
            print(f"[bench] N={n}: ipyparallel", file=sys.stderr, flush=True)
            try:
                row["ipyparallel"] = peers.ipyparallel(n, calls=200 if quick else 500)
            except Exception as e:  # noqa: BLE001 - a peer failing must not stop the suite
                row["ipyparallel"] = {"error": f"{type(e).__name__}: {e}"}
        for peer in ("ray", "torchmonarch"):
            if result["installed"][peer]:
                print(f"[bench] N={n}: {peer}", file=sys.stderr, flush=True)
                row[peer] = actor_peers.measure(peer, n, calls)
        ratios = {}
        base = row["raw_pyzmq"]
        for k, v in row["monarch_kernel"].items():
            if base.get(k):
                ratios[k] = v / base[k]
        if row["monarch_kernel"].get("rdma_gbps") and base.get("p2p_gbps"):
            # RDMABuffer.read_into, worker to worker, against raw pyzmq's worker-to-worker send
            ratios["rdma_gbps"] = row["monarch_kernel"]["rdma_gbps"] / base["p2p_gbps"]
        row["ratio_to_raw"] = ratios
        print(f"[bench] N={n}: raw and ours in alternating blocks", file=sys.stderr, flush=True)
        row["paired"] = paired.measure(n, calls)
        result["n"][str(n)] = row
    cell: dict[str, Any] = {}
    if kernels:
        print("[bench] cells through the kernels (alternating blocks)", file=sys.stderr,
              flush=True)
        cells = 20 if quick else 60
        px = result["installed"]["ipyparallel"]
        try:
            cell = peers.cells(2, cells, px=px)
        except Exception as e:  # ipyparallel failing must not lose ours
            if not px:
                raise
            cell = peers.cells(2, cells, px=False)
            cell["ipyparallel_px"] = f"error: {e}"
    if isinstance(cell.get("ipyparallel_px"), float):
        cell["ratio_to_ipyparallel"] = cell["monarch_kernel"] / cell["ipyparallel_px"]
        # the floor: a cell that sends nothing anywhere, in our kernel, against %px
        cell["plain_pass_ratio_to_ipyparallel"] = (cell["monarch_kernel_plain_pass"]
                                                   / cell["ipyparallel_px"])
    result["cell_p50_us"] = cell
    print("[bench] telemetry overhead", file=sys.stderr, flush=True)
    from benchmarks import telemetry_overhead

    tel = telemetry_overhead.measure(seconds=6 if quick else 20, ranks=2)
    result["telemetry_cpu_pct"] = tel.get("sampler_pct_of_core")
    result["telemetry"] = tel
    print("[bench] fan-out", file=sys.stderr, flush=True)
    sizes = (1, 4, 16) if quick else (1, 4, 16, 64)
    fan = ours.fanout(sizes, calls=50 if quick else 200)
    result["fanout"] = fan
    raw = raw_zmq.fanout(sizes, calls=50 if quick else 200)
    result["fanout_raw_pyzmq"] = raw
    bare = bare_echo.fanout(sizes, calls=50 if quick else 200)
    result["fanout_bare_python"] = bare
    if "bcast_p50_us_n64" in fan:
        for f in (fan, raw, bare):
            f["ratio_n64_to_n1"] = f["bcast_p50_us_n64"] / f["bcast_p50_us_n1"]
        fan["ratio_to_raw_n64"] = fan["bcast_p50_us_n64"] / raw["bcast_p50_us_n64"]
    return result


def _policies() -> tuple[str, str]:
    """The scheduling policies our workers and the baselines' run under: the
    baselines' inherit this process's, and so do ours unless it is an ordinary
    one and the switch is on (monarch_kernel.worker.sched)."""
    if not hasattr(os, "sched_getscheduler"):
        return "ordinary (not Linux)", "ordinary (not Linux)"
    mine = os.sched_getscheduler(0)
    names = {getattr(os, n): n for n in ("SCHED_OTHER", "SCHED_BATCH", "SCHED_IDLE",
                                          "SCHED_FIFO", "SCHED_RR") if hasattr(os, n)}
    name = str(names.get(mine, mine))
    if mine != os.SCHED_OTHER:
        return f"{name}, this process's (kept by workers)", name
    return ("SCHED_BATCH" if sched_batch_enabled() else
            "SCHED_OTHER (MONARCH_SCHED_BATCH=0)"), name


def table(result: dict[str, Any]) -> str:
    absent = [k for k, v in result.get("installed", {}).items() if not v]
    lines = [f"not installed, so not measured: {', '.join(absent)}"] if absent else []
    m = result.get("machine", {})
    lines.append(f"machine: {m.get('cores', '?')} cores, Python {m.get('python', '?')}; "
                 + ", ".join(f"{k} {v}" for k, v in result.get("versions", {}).items() if v))
    if "lanes" in result:
        lines.append("monarch_kernel's local workers: " + (
            "lanes (Unix socket pairs)" if result["lanes"] else "ZeroMQ (MONARCH_LANES=0)"))
    if "worker_policy" in result:
        lines.append(f"monarch_kernel's workers: {result['worker_policy']}; the baselines' "
                     f"workers: {result.get('baseline_policy', 'SCHED_OTHER')}")
    lines.append("rdma_gbps / raw: against the raw worker-to-worker send (p2p_gbps)")
    for n, row in result["n"].items():
        cols = [c for c in ("raw_pyzmq", "monarch_kernel", "ipyparallel", "ray", "torchmonarch")
                if c in row]
        lines.append(f"\nN = {n} workers")
        lines.append("| metric | " + " | ".join(cols) + " | ours / raw |")
        lines.append("|---|" + "---|" * (len(cols) + 1))
        for m in METRICS + ["worker_rss_mb"]:
            vals = []
            for c in cols:
                v = row[c].get(m) if isinstance(row[c], dict) else None
                vals.append("-" if v is None else f"{v:,.2f}" if v < 100 else f"{v:,.0f}")
            ratio = row["ratio_to_raw"].get(m)
            shown = "-" if ratio is None else f"{ratio:.2f}x"
            lines.append(f"| {m} | " + " | ".join(vals) + f" | {shown} |")
        for c in cols:
            if isinstance(row[c], dict) and "error" in row[c]:
                lines.append(f"{c}: not measured ({row[c]['error']})")
        pr = row.get("paired")
        if pr:
            lines.append("alternating blocks, ours / raw: " + ", ".join(
                f"{m} {pr['monarch_kernel'][m]:,.0f} / {pr['raw_pyzmq'][m]:,.0f} us = "
                f"{pr['ratio_to_raw'][m]:.2f}x" for m in ("call_p50_us", "bcast_p50_us")))
            if "call_p50_us_spin_off" in pr["monarch_kernel"]:
                lines.append(
                    f"  call_p50_us with the controller's spin off (MONARCH_SPIN_US=0): "
                    f"{pr['monarch_kernel']['call_p50_us_spin_off']:,.0f} us = "
                    f"{pr['ratio_to_raw']['call_p50_us_spin_off']:.2f}x raw"
                    + (f" (the spin turned itself off {pr['spin_contended']} times: a core "
                       "was contended)" if pr.get("spin_contended") else ""))
            if "call_p50_us_zeromq" in pr["monarch_kernel"]:
                lines.append("  ours with ZeroMQ instead of lanes (MONARCH_LANES=0): " + ", ".join(
                    f"{m} {pr['monarch_kernel'][m + '_zeromq']:,.0f} us = "
                    f"{pr['ratio_to_raw'][m + '_zeromq']:.2f}x raw"
                    for m in ("call_p50_us", "bcast_p50_us")))
            if "call_idle_p50_us" in pr["monarch_kernel"]:
                lines.append(
                    f"  call_p50_us after {paired.IDLE_S * 1e3:g} ms idle: "
                    f"{pr['monarch_kernel']['call_idle_p50_us']:,.0f} / "
                    f"{pr['raw_pyzmq']['call_idle_p50_us']:,.0f} us = "
                    f"{pr['ratio_to_raw']['call_idle_p50_us']:.2f}x raw")
    c = result["cell_p50_us"]
    if not c:
        lines.append("\ncell_p50_us: not measured (--no-kernels)")
    else:
        _cells(lines, c)
    _rest(lines, result)
    return "\n".join(lines)


def _cells(lines: list[str], c: dict[str, Any]) -> None:
    lines.append(f"\ncell_p50_us: %%mesh pass {c['monarch_kernel']:,.0f} us"
                 + (f", %px pass {c['ipyparallel_px']:,.0f} us, ratio "
                    f"{c['ratio_to_ipyparallel']:.2f}" if "ratio_to_ipyparallel" in c else ""))
    lines.append(f"plain `pass` cell: monarch kernel {c['monarch_kernel_plain_pass']:,.0f} us"
                 + (f", python3 kernel {c['python3_plain_pass']:,.0f} us; monarch plain pass / "
                    f"%px pass {c['plain_pass_ratio_to_ipyparallel']:.2f}"
                    if "plain_pass_ratio_to_ipyparallel" in c else ""))


def _rest(lines: list[str], result: dict[str, Any]) -> None:
    if result.get("telemetry_cpu_pct") is not None:
        lines.append(f"telemetry_cpu_pct: {result['telemetry_cpu_pct']:.3f} % of a core per worker")
    fan = result["fanout"]
    lines.append("fan-out bcast_p50_us: " + ", ".join(
        f"N={k.split('_n')[-1]}: {v:,.0f}" for k, v in fan.items() if k.startswith("bcast")))
    raw = result.get("fanout_raw_pyzmq", {})
    lines.append("fan-out raw pyzmq bcast_p50_us: " + ", ".join(
        f"N={k.split('_n')[-1]}: {v:,.0f}" for k, v in raw.items() if k.startswith("bcast")))
    bare = result.get("fanout_bare_python", {})
    if bare:
        lines.append("fan-out bare Python echo bcast_p50_us: " + ", ".join(
            f"N={k.split('_n')[-1]}: {v:,.0f}" for k, v in bare.items() if k.startswith("bcast")))
    if "ratio_n64_to_n1" in fan:
        lines.append(f"fan-out N=64 / N=1: ours {fan['ratio_n64_to_n1']:.1f}x, raw pyzmq "
                     f"{raw['ratio_n64_to_n1']:.1f}x"
                     + (f", bare Python echo {bare['ratio_n64_to_n1']:.1f}x"
                        if "ratio_n64_to_n1" in bare else "")
                     + f"; ours / raw at N=64: {fan['ratio_to_raw_n64']:.2f}x")


#: where one result per machine kind is kept (``KIND.json``)
BASELINES = Path(__file__).resolve().parent / "baselines"


def baseline_path(kind_or_path: str) -> Path:
    """The baseline file of a machine kind (``vm-2cores``), or the path as given
    when it names an existing file."""
    p = Path(kind_or_path)
    return p if p.suffix == ".json" or p.exists() else BASELINES / f"{kind_or_path}.json"


def compare(result: dict[str, Any], baseline: dict[str, Any]) -> str:
    """This run's ratios to raw pyzmq next to a baseline's, per worker count:
    both are ratios within their own run, so they compare across runs."""
    lines = ["\nratio to raw pyzmq: this run / baseline "
             "(times: lower is better; calls_per_s and GB/s: higher)"]
    for n, row in result["n"].items():
        base = baseline.get("n", {}).get(n)
        if not base:
            lines.append(f"N = {n}: not in the baseline")
            continue
        pairs = [(m, v, base.get("ratio_to_raw", {}).get(m))
                 for m, v in row["ratio_to_raw"].items()]
        pr, bpr = row.get("paired", {}), base.get("paired", {})
        pairs += [(f"{m} (alternating)", v, bpr.get("ratio_to_raw", {}).get(m))
                  for m, v in pr.get("ratio_to_raw", {}).items()]
        lines.append(f"N = {n}: " + ", ".join(
            f"{m} {v:.2f}x / " + ("-" if b is None else f"{b:.2f}x") for m, v, b in pairs))
    fan, bfan = result.get("fanout", {}), baseline.get("fanout", {})
    if "ratio_n64_to_n1" in fan and "ratio_n64_to_n1" in bfan:
        lines.append(f"fan-out N=64 / N=1: {fan['ratio_n64_to_n1']:.1f}x / "
                     f"{bfan['ratio_n64_to_n1']:.1f}x")
    return "\n".join(lines)


#: set in the environment of the benchmark run by its reaper (benchmarks/reaper.py)
_REAPED = "MONARCH_BENCH_REAPED"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if os.environ.get(_REAPED) != "1" and sys.platform.startswith("linux"):
        # run as the child of a subreaper, so that whatever the peers start (ipyparallel
        # engines, Ray's daemons, kernels) ends with the run, even a run killed outright
        from benchmarks.reaper import run_reaped

        return run_reaped([sys.executable, "-m", "benchmarks", *argv],
                          env={**os.environ, _REAPED: "1"})
    p = argparse.ArgumentParser(prog="python -m benchmarks")
    p.add_argument("--json", help="write every figure to this file ('baselines': to "
                   "benchmarks/baselines/KIND.json, KIND from --kind)")
    p.add_argument("--kind", help="machine kind of --json baselines (vm-2cores, h200-16cores)")
    p.add_argument("--compare", metavar="KIND|PATH",
                   help="print the ratios next to those of benchmarks/baselines/KIND.json")
    p.add_argument("--quick", action="store_true", help="fewer iterations (about a minute)")
    p.add_argument("--no-kernels", action="store_true",
                   help="skip the cells through Jupyter kernels (where Jupyter is not installed)")
    p.add_argument("--sizes", default="2,4", help="worker counts, comma-separated (2,4)")
    a = p.parse_args(argv)
    if a.json == "baselines" and not a.kind:
        p.error("--json baselines needs --kind (e.g. vm-2cores)")
    base = None
    if a.compare:
        with open(baseline_path(a.compare)) as f:
            base = json.load(f)
    t0 = time.time()
    sizes = tuple(int(x) for x in a.sizes.split(","))
    result = run(quick=a.quick, sizes=sizes, kernels=not a.no_kernels)
    result["seconds"] = time.time() - t0
    print(table(result))
    if base is not None:
        print(compare(result, base))
    if a.json:
        out = baseline_path(a.kind) if a.json == "baselines" else Path(a.json)
        with open(out, "w") as f:
            json.dump(result, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
