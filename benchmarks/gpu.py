"""CUDA tensors through actor calls, against torch's own copies in the same run.

``python -m benchmarks.gpu --json out.json [--sizes 64MiB,1GiB]``

For each size, a float32 CUDA tensor goes

- controller -> worker: an actor endpoint called with the tensor returns its sum;
- worker -> controller: an endpoint returns a CUDA tensor it keeps;
- worker -> worker: an actor on rank 0 calls rank 1's endpoint with its tensor;

and, as baselines measured in this process in the same run: torch's D2H then
H2D copy of the same tensor (pageable memory, as our path stages it: the
staging floor; and into a pinned buffer allocated once), and a device-to-device
copy. Each figure is bytes / seconds of one whole operation (a call: from the
send to the reply, the tensor rebuilt on the receiver's GPU); the clock starts
and stops after ``torch.cuda.synchronize()``. Best and median of ``--reps``
timed runs after warm-up; ``ratio_to_staging`` is ours / the pageable floor.

Also ``RDMABuffer.read_into`` worker to worker (the reader's route: CUDA IPC
on one host; the staged route through shared memory; into a CPU tensor).

``--cpu-dry-run`` runs the same code on CPU tensors with small sizes (to
check the script without a GPU; the figures mean nothing).
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import statistics
import sys
import time
from typing import Any

import cloudpickle

from monarch_kernel import Actor, endpoint
from monarch_kernel.mesh.procmesh import spawn_procs

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers need not import it

MiB = 1 << 20
GiB = 1 << 30
CALL_TIMEOUT = 120.0  # seconds: every wait for a call


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


class GpuBench(Actor):
    """The worker side: a sum, a kept tensor to return, a worker-to-worker sender."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.kept: Any = None

    @endpoint
    def noop(self) -> None:
        return None

    @endpoint
    def sum(self, t: Any) -> tuple[float, str]:
        return float(t.sum()), str(t.device)  # float(): waits for the GPU

    @endpoint
    def keep(self, n: int) -> str:
        import torch

        self.kept = torch.ones(n, device=self.device)
        _sync(self.device)
        return str(self.kept.device)

    @endpoint
    def give(self) -> Any:
        return self.kept

    @endpoint
    def drop(self) -> None:
        self.kept = None
        if self.device.startswith("cuda"):
            import torch

            torch.cuda.empty_cache()

    @endpoint
    def register(self, n: int) -> Any:
        """An RDMABuffer of a kept tensor of ``n`` ones on this rank's device."""
        import torch

        from monarch_kernel import RDMABuffer

        self.kept = torch.ones(n, device=self.device)
        _sync(self.device)
        return RDMABuffer(self.kept)

    @endpoint
    def read_buffer(self, buf: Any, dst_device: str, warmup: int, reps: int,
                    route: str | None = None) -> dict[str, Any]:
        """Time ``buf.read_into`` a tensor on ``dst_device`` (the future is done
        once the bytes are in place: CUDA copies complete)."""
        import torch

        from monarch_kernel.tensors import buffer_ops as buffer_ops

        if route is not None:  # force a route (the staged ones, for comparison)
            real = buffer_ops._route
            buffer_ops._route = lambda host, b: route
        try:
            before = dict(buffer_ops.routes)
            dst = torch.empty(buf.size() // 4, device=dst_device)
            for _ in range(max(1, warmup)):
                buf.read_into(dst).get(timeout=CALL_TIMEOUT)
            secs = []
            for _ in range(reps):
                _sync(dst_device)
                t0 = time.perf_counter()
                buf.read_into(dst).get(timeout=CALL_TIMEOUT)
                secs.append(time.perf_counter() - t0)
            total = float(dst.sum())
        finally:
            if route is not None:
                buffer_ops._route = real
        used = [k for k, v in buffer_ops.routes.items() if v != before.get(k, 0)]
        del dst
        if dst_device.startswith("cuda"):
            torch.cuda.empty_cache()
        return {"secs": secs, "sum": total, "routes": used}

    @endpoint
    def send_to(self, other: Any, n: int, warmup: int, reps: int) -> dict[str, Any]:
        """Call ``other.sum`` with a tensor of ``n`` floats on this rank's device."""
        import torch

        t = torch.ones(n, device=self.device)
        total, arrived = other.sum.call_one(t).get(timeout=CALL_TIMEOUT)
        for _ in range(warmup - 1):
            other.sum.call_one(t).get(timeout=CALL_TIMEOUT)
        secs = []
        for _ in range(reps):
            _sync(self.device)
            t0 = time.perf_counter()
            other.sum.call_one(t).get(timeout=CALL_TIMEOUT)
            _sync(self.device)
            secs.append(time.perf_counter() - t0)
        return {"secs": secs, "arrived_on": arrived, "sum": total}


# ------------------------------------------------------------------- helpers
def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+)\s*(B|KiB|MiB|GiB)?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"bad size {text!r} (e.g. 64MiB, 1GiB, 4096)")
    unit = {"B": 1, None: 1, "KiB": 1 << 10, "MiB": MiB, "GiB": GiB}[m.group(2)]
    return int(m.group(1)) * unit


def label(nbytes: int) -> str:
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 1 << 10)):
        if nbytes % size == 0:
            return f"{nbytes // size}{unit}"
    return f"{nbytes}B"


def timed(fn: Any, device: str, warmup: int, reps: int) -> list[float]:
    """Seconds of ``reps`` runs of ``fn`` after ``warmup`` runs, each between
    two ``torch.cuda.synchronize()``."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        out.append(time.perf_counter() - t0)
    return out


def rates(nbytes: int, secs: list[float]) -> dict[str, float]:
    """Best and median GB/s (1e9 bytes a second) and the median in ms."""
    return {"gbps_best": nbytes / min(secs) / 1e9,
            "gbps_median": nbytes / statistics.median(secs) / 1e9,
            "ms_median": statistics.median(secs) * 1e3}


def attempt(result: dict[str, Any], key: str, errors: list[str], fn: Any) -> None:
    """``result[key] = fn()``; a failure is recorded instead (the run goes on)."""
    print(f"[gpu-bench] {key} ...", file=sys.stderr, flush=True)
    try:
        result[key] = fn()
    except Exception as e:  # noqa: BLE001 - one figure failing must not lose the others
        result[key] = {"error": f"{type(e).__name__}: {e}"[:1000]}
        errors.append(f"{key}: {type(e).__name__}: {e}"[:300])
        print(f"[gpu-bench] {key} FAILED: {type(e).__name__}: {e}", file=sys.stderr, flush=True)


# -------------------------------------------------------------- measurements
def baselines(nbytes: int, device: str, warmup: int, reps: int) -> dict[str, Any]:
    """torch's own copies of the same tensor in this process."""
    import torch

    n = nbytes // 4
    t = torch.ones(n, device=device)
    out: dict[str, Any] = {}
    host: dict[str, Any] = {}

    def d2h() -> None:
        host["c"] = t.cpu()  # fresh pageable memory, as serialize does

    def h2d() -> None:
        host["g"] = host["c"].to(device)

    out["d2h_pageable"] = rates(nbytes, timed(d2h, device, warmup, reps))
    out["h2d_pageable"] = rates(nbytes, timed(h2d, device, warmup, reps))
    out["staging_pageable"] = rates(nbytes, timed(lambda: (d2h(), h2d()), device, warmup,
                                                  reps))
    host.clear()
    if device.startswith("cuda"):
        pinned = torch.empty(n, pin_memory=True)
        back = torch.empty_like(t)

        def pinned_round_trip() -> None:
            pinned.copy_(t, non_blocking=True)
            torch.cuda.current_stream().synchronize()
            back.copy_(pinned, non_blocking=True)

        out["staging_pinned"] = rates(nbytes, timed(pinned_round_trip, device, warmup, reps))
    dst = torch.empty_like(t)
    out["d2d_copy"] = rates(nbytes, timed(lambda: dst.copy_(t), device, warmup, reps))
    return out  # the tensors go with this frame (run() empties the CUDA cache)


def ours(mesh: Any, actors: Any, nbytes: int, device: str, warmup: int, reps: int,
         errors: list[str]) -> dict[str, Any]:
    import torch

    n = nbytes // 4
    r0, r1 = actors.slice(procs=0), actors.slice(procs=1)
    out: dict[str, Any] = {}

    def ctl_to_worker() -> dict[str, Any]:
        t = torch.ones(n, device=device)
        total, arrived = r0.sum.call_one(t).get(timeout=CALL_TIMEOUT)
        if abs(total - n) > 1e-3 * n or not arrived.startswith(device.split(":")[0]):
            raise RuntimeError(f"wrong arrival: sum {total} (expected {n}) on {arrived}")
        secs = timed(lambda: r0.sum.call_one(t).get(timeout=CALL_TIMEOUT), device,
                     max(0, warmup - 1), reps)
        return {**rates(nbytes, secs), "arrived_on": arrived}

    def worker_to_ctl() -> dict[str, Any]:
        kept_on = r0.keep.call_one(n).get(timeout=CALL_TIMEOUT)
        try:
            got = r0.give.call_one().get(timeout=CALL_TIMEOUT)
            if tuple(got.shape) != (n,) or got.device.type != device.split(":")[0]:
                raise RuntimeError(f"wrong arrival: {tuple(got.shape)} on {got.device}")
            arrived = str(got.device)
            del got
            secs = timed(lambda: r0.give.call_one().get(timeout=CALL_TIMEOUT), device,
                         max(0, warmup - 1), reps)
        finally:
            r0.drop.call_one().get(timeout=CALL_TIMEOUT)
        return {**rates(nbytes, secs), "arrived_on": arrived, "kept_on": kept_on}

    def worker_to_worker() -> dict[str, Any]:
        got = r0.send_to.call_one(r1, n, max(1, warmup), reps).get(
            timeout=CALL_TIMEOUT * (warmup + reps + 1))
        if abs(got["sum"] - n) > 1e-3 * n:
            raise RuntimeError(f"wrong arrival: sum {got['sum']} (expected {n})")
        return {**rates(nbytes, got["secs"]), "arrived_on": got["arrived_on"]}

    attempt(out, "ctl_to_worker", errors, ctl_to_worker)
    attempt(out, "worker_to_ctl", errors, worker_to_ctl)
    attempt(out, "worker_to_worker", errors, worker_to_worker)
    def rdma(dst_device: str, route: str | None) -> Any:
        def measure() -> dict[str, Any]:
            buf = r0.register.call_one(n).get(timeout=CALL_TIMEOUT)
            try:
                got = r1.read_buffer.call_one(buf, dst_device, max(1, warmup), reps, route).get(
                    timeout=CALL_TIMEOUT * (warmup + reps + 1))
            finally:
                r0.drop.call_one().get(timeout=CALL_TIMEOUT)
            if abs(got["sum"] - n) > 1e-3 * n:
                raise RuntimeError(f"wrong bytes: sum {got['sum']} (expected {n})")
            return {**rates(nbytes, got["secs"]), "routes": got["routes"]}
        return measure

    # RDMABuffer.read_into, worker to worker: the route the reader picks (CUDA IPC on
    # one host), the staged one through shared memory, and into a CPU tensor
    attempt(out, "rdma_read_into", errors, rdma(device, None))
    attempt(out, "rdma_read_into_staged", errors, rdma(device, "shm"))
    attempt(out, "rdma_read_into_cpu", errors, rdma("cpu", None))
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return out


#: (section, key, table heading) of the printed table
ROWS = [("baseline", "d2d_copy", "D2D copy"),
        ("baseline", "staging_pinned", "D2H+H2D pinned"),
        ("baseline", "staging_pageable", "D2H+H2D pageable (floor)"),
        ("baseline", "d2h_pageable", "D2H pageable"),
        ("baseline", "h2d_pageable", "H2D pageable"),
        ("ours", "ctl_to_worker", "ours ctl->worker call"),
        ("ours", "worker_to_ctl", "ours worker->ctl reply"),
        ("ours", "worker_to_worker", "ours worker->worker call"),
        ("ours", "rdma_read_into", "RDMABuffer read_into"),
        ("ours", "rdma_read_into_staged", "RDMABuffer staged (shm)"),
        ("ours", "rdma_read_into_cpu", "RDMABuffer into CPU")]


def table(result: dict[str, Any]) -> str:
    sizes = list(result["sizes"])
    lines = [f"{'GB/s best (median)':<28}" + "".join(f"{s:>22}" for s in sizes)]
    for section, key, heading in ROWS:
        cells = []
        for s in sizes:
            v = result["sizes"][s].get(section, {}).get(key)
            if v is None:
                cells.append(f"{'-':>22}")
            elif "error" in v:
                cells.append(f"{'error':>22}")
            else:
                cells.append(f"{v['gbps_best']:>11.2f} ({v['gbps_median']:>7.2f})")
        lines.append(f"{heading:<28}" + "".join(cells))
    lines.append(f"{'ratio ours/floor (median)':<28}" + "".join(
        f"{'':>22}" for _ in sizes))
    for key in ("ctl_to_worker", "worker_to_ctl", "worker_to_worker"):
        cells = [f"{result['sizes'][s].get('ratio_to_staging', {}).get(key, float('nan')):>22.3f}"
                 for s in sizes]
        lines.append(f"{'  ' + key:<28}" + "".join(cells))
    return "\n".join(lines)


def machine(device: str) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"python": sys.version.split()[0], "platform": platform.platform(),
                            "torch": torch.__version__, "cuda": torch.version.cuda,
                            "device": device}
    if device.startswith("cuda"):
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, gpu_mem_bytes=int(p.total_memory),
                    gpu_count=torch.cuda.device_count())
    try:
        import pynvml

        pynvml.nvmlInit()
        info["driver"] = pynvml.nvmlSystemGetDriverVersion()
        pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001, S110 - no NVML: no driver figure
        pass
    return info


def run(sizes: list[int], device: str, warmup: int, reps: int) -> tuple[dict[str, Any], list]:
    import torch

    errors: list[str] = []
    result: dict[str, Any] = {"machine": machine(device), "warmup": warmup, "reps": reps,
                              "sizes": {}}
    t0 = time.perf_counter()
    mesh = spawn_procs(2, timeout=120, telemetry_interval=1.0)
    try:
        actors = mesh.spawn("gpubench", GpuBench, device)
        actors.noop.call().get(timeout=CALL_TIMEOUT)
        result["spawn_s"] = time.perf_counter() - t0
        lat = timed(lambda: actors.slice(procs=0).noop.call_one().get(timeout=CALL_TIMEOUT),
                    "cpu", 50, 200)
        result["noop_call_p50_us"] = statistics.median(lat) * 1e6
        torch.ones(1, device=device)  # this process's CUDA context, outside any timing
        for nbytes in sizes:
            # fewer runs for large sizes: about 1 s a call there
            w, r = (warmup, reps) if nbytes <= 256 * MiB else (1, max(3, reps // 3))
            row: dict[str, Any] = {"bytes": nbytes, "warmup": w, "reps": r}
            attempt(row, "baseline", errors,
                    lambda nbytes=nbytes, w=w, r=r: baselines(nbytes, device, w, r))
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
            row["ours"] = ours(mesh, actors, nbytes, device, w, r, errors)
            floor = row["baseline"].get("staging_pageable", {}).get("gbps_median")
            row["ratio_to_staging"] = {
                k: v["gbps_median"] / floor for k, v in row["ours"].items()
                if floor and isinstance(v, dict) and "gbps_median" in v}
            result["sizes"][label(nbytes)] = row
    finally:
        mesh.stop()
    result["errors"] = errors
    return result, errors


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__.split(
        "\n\n")[0])
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--sizes", default=None,
                   help="comma-separated tensor sizes (default 64MiB,1GiB; "
                        "with --cpu-dry-run 1MiB,8MiB)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--cpu-dry-run", action="store_true",
                   help="CPU tensors and small sizes: checks the script without a GPU")
    args = p.parse_args(argv)
    import torch

    if args.cpu_dry_run:
        device = "cpu"
    elif torch.cuda.is_available():
        device = "cuda:0"
    else:
        print("benchmarks/gpu.py: no CUDA here (torch.cuda.is_available() is False, "
              f"torch {torch.__version__}); it measures CUDA tensors and needs a GPU "
              "(--cpu-dry-run checks the script on CPU)", file=sys.stderr)
        return 2
    default = "1MiB,8MiB" if args.cpu_dry_run else "64MiB,1GiB"
    sizes = [parse_size(s) for s in (args.sizes or default).split(",") if s.strip()]
    result, errors = run(sizes, device, args.warmup, args.reps)
    text = table(result)
    print(text)
    print(f"noop call p50: {result.get('noop_call_p50_us', float('nan')):.0f} us; "
          f"machine: {result['machine']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json}")
    for e in errors:
        print(f"ERROR {e}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
