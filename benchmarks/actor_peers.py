"""Ray and PyTorch Monarch (``torchmonarch``), measured as ours are, when installed.

Each peer runs in a child process of its own, in a session of its own
(``python -m benchmarks.actor_peers ray|torchmonarch N CALLS [--no-big]``,
which prints a result line), so its runtime (Ray's raylet and object store,
Monarch's Rust actor runtime and host agent) neither shares the benchmark's
process with ours nor outlives the measurement: every process of the session
is killed once the child exits, or at its timeout. The sample counts are ours
(:func:`.ours.measure`): CALLS calls after 100 of warm-up, a quarter of that
(at least 200) broadcasts.

Figures, as for ours (:mod:`.ours`): ``spawn_s`` (N workers up and an actor
on each answering), ``call_p50_us`` / ``call_p99_us`` (no-op endpoint of one
actor), ``bcast_p50_us`` (no-op on all N, gathered), ``calls_per_s`` (1,000
no-op calls in flight to one actor), ``tensor_gbps`` (a 64 MiB float32 tensor
to an actor and its sum back) and ``p2p_gbps`` (64 MiB from one actor to
another, never through the driver). Ray actors are ``@ray.remote`` classes
in a local Ray instance of their own (``ray.init(address="local",
num_cpus=N)``; its dashboard off);
Monarch's are ``monarch.actor.Actor`` subclasses on
``this_host().spawn_procs(per_host={"procs": N})``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

import psutil

from benchmarks.stats import best_gbps, best_of, latencies_us, p50, p99

MiB = 1 << 20
#: seconds a peer's child process may take before it is killed (a run takes 10-30 s)
TIMEOUT_S = 180
#: the prefix of the line that carries a child's result
_MARK = "RESULT "
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def measure(peer: str, n: int, calls: int = 2000, big: bool = True) -> dict[str, Any]:
    """Run one peer in a child process; its figures, or ``{"error": ...}``.

    The child leads a session of its own. Whatever the peer started (Ray's
    raylet, GCS, agents and workers; Monarch's host agent and procs, which
    put themselves in process groups of their own) stays in that session and
    is killed with it, after the child exits or at the timeout. The child
    prints its result before the peer's own shutdown, so a shutdown that
    hangs loses no measurement.
    """
    cmd = [sys.executable, "-m", "benchmarks.actor_peers", peer, str(n), str(calls)]
    if not big:
        cmd.append("--no-big")
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    env.pop("RAY_ADDRESS", None)  # a local instance of its own, never a running cluster
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                            cwd=_ROOT, start_new_session=True)
    timed_out = False
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill_session(proc.pid)
        try:  # (what it printed so far is kept: see subprocess.Popen.communicate)
            out, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:  # a process that left the session holds the pipes
            proc.kill()
            for f in (proc.stdout, proc.stderr):
                if f is not None:
                    f.close()
            proc.wait()
            out, err = b"", b""
    finally:
        _kill_session(proc.pid)
    for line in out.decode(errors="replace").splitlines():  # the first result line
        if line.startswith(_MARK):
            try:
                return json.loads(line[len(_MARK):])
            except ValueError as e:
                return {"error": f"{peer} printed an unreadable result: {e}"}
    if timed_out:
        return {"error": f"{peer} did not finish within {TIMEOUT_S} s (killed)"}
    rc = proc.returncode
    why = f"exited with {rc}"
    if rc < 0:
        try:
            why = f"was killed by {signal.Signals(-rc).name}"
        except ValueError:
            why = f"was killed by signal {-rc}"
    tail = err.decode(errors="replace").strip().splitlines()[-3:]
    return {"error": f"{peer} {why} without a result: {' | '.join(tail)}"}


def _kill_session(sid: int, timeout: float = 5.0) -> None:
    """SIGKILL every process of session ``sid`` until none is left (or ``timeout``
    seconds passed); whatever process group each is in."""
    deadline = time.monotonic() + timeout
    me = os.getpid()
    while True:
        left = []
        for pid in psutil.pids():
            try:
                if pid != me and os.getsid(pid) == sid:
                    left.append(pid)
            except OSError:  # gone meanwhile
                continue
        if not left or time.monotonic() > deadline:
            return
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.05)


# --------------------------------------------------------------------- Ray
def _ray(n: int, calls: int, big: bool) -> dict[str, Any]:
    import ray

    @ray.remote
    class Bench:
        def noop(self) -> None:
            return None

        def sum(self, t: Any) -> float:
            return float(t.sum())

        def send_to(self, other: Any, nbytes: int) -> float:
            import torch

            t = torch.ones(nbytes // 4)
            return best_gbps(lambda: ray.get(other.sum.remote(t)), nbytes)

    t0 = time.perf_counter()
    try:
        ray.init(address="local", num_cpus=n, include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
        actors = [Bench.remote() for _ in range(n)]
        ray.get([a.noop.remote() for a in actors])
        out: dict[str, Any] = {"spawn_s": time.perf_counter() - t0}
        one = actors[0]
        lat = latencies_us(lambda: ray.get(one.noop.remote()), calls)
        out.update(call_p50_us=p50(lat), call_p99_us=p99(lat))
        out["bcast_p50_us"] = p50(latencies_us(
            lambda: ray.get([a.noop.remote() for a in actors]), max(200, calls // 4)))
        out["calls_per_s"] = best_of(lambda: _ray_pipelined(ray, one), 3)
        if big:
            import torch

            t = torch.ones(64 * MiB // 4)
            out["tensor_gbps"] = best_gbps(lambda: ray.get(one.sum.remote(t)), 64 * MiB)
            if n > 1:
                out["p2p_gbps"] = ray.get(actors[0].send_to.remote(actors[1], 64 * MiB))
        out["version"] = ray.__version__
        _emit(out)  # before the shutdown: one that hangs loses nothing
        return out
    finally:
        ray.shutdown()


def _ray_pipelined(ray: Any, one: Any) -> float:
    t0 = time.perf_counter()
    ray.get([one.noop.remote() for _ in range(1000)])
    return 1000 / (time.perf_counter() - t0)


# ------------------------------------------------------------ torchmonarch
def _torchmonarch(n: int, calls: int, big: bool) -> dict[str, Any]:
    import monarch
    from monarch.actor import Actor, endpoint, this_host

    class Bench(Actor):
        @endpoint
        def noop(self) -> None:
            return None

        @endpoint
        def sum(self, t: Any) -> float:
            return float(t.sum())

    class Sender(Actor):  # (Monarch refuses sync and async endpoints in one class)
        @endpoint
        async def send_to(self, other: Any, nbytes: int) -> float:
            import torch

            t = torch.ones(nbytes // 4)
            await other.sum.call_one(t)  # warm-up
            best = float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                await other.sum.call_one(t)
                best = min(best, time.perf_counter() - t0)
            return nbytes / best / 1e9

    t0 = time.perf_counter()
    procs = this_host().spawn_procs(per_host={"procs": n})
    try:
        actors = procs.spawn("bench", Bench)
        actors.noop.call().get()
        out: dict[str, Any] = {"spawn_s": time.perf_counter() - t0}
        one = actors.slice(procs=0)
        lat = latencies_us(lambda: one.noop.call_one().get(), calls)
        out.update(call_p50_us=p50(lat), call_p99_us=p99(lat))
        out["bcast_p50_us"] = p50(latencies_us(lambda: actors.noop.call().get(),
                                               max(200, calls // 4)))
        best = 0.0
        for _ in range(3):
            t1 = time.perf_counter()
            futures = [one.noop.call_one() for _ in range(1000)]
            for f in futures:
                f.get()
            best = max(best, 1000 / (time.perf_counter() - t1))
        out["calls_per_s"] = best
        if big:
            import torch

            t = torch.ones(64 * MiB // 4)
            out["tensor_gbps"] = best_gbps(lambda: one.sum.call_one(t).get(), 64 * MiB)
            if n > 1:
                sender = procs.spawn("sender", Sender).slice(procs=0)
                out["p2p_gbps"] = sender.send_to.call_one(actors.slice(procs=1),
                                                          64 * MiB).get()
        out["version"] = getattr(monarch, "__version__", None) or _dist_version("torchmonarch")
        _emit(out)  # before the shutdown: one that hangs loses nothing
        return out
    finally:
        procs.stop().get()


def _dist_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def main(argv: list[str]) -> int:
    peer, n, calls = argv[0], int(argv[1]), int(argv[2])
    big = "--no-big" not in argv
    fn = {"ray": _ray, "torchmonarch": _torchmonarch}[peer]
    try:
        fn(n, calls, big)  # (prints its result line itself, before its shutdown)
    except Exception as e:  # noqa: BLE001 - reported in the JSON, the suite goes on
        _emit({"error": f"{type(e).__name__}: {e}"})  # (the first result line counts)
    return 0


def _emit(out: dict[str, Any]) -> None:
    print(_MARK + json.dumps(out), flush=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
