"""Worker telemetry: activity, the sampler, guarded GPU paths, and the worker hook."""

from __future__ import annotations

import os
import sys
import threading
import time
import types

import pytest

from monarch_kernel.worker import telemetry as telemetry
from monarch_kernel.launchers.base import LaunchSpec, worker_command
from monarch_kernel.testing.kernel import wait_for


# ----------------------------------------------------------------- activity
def test_activity_per_thread_and_paused_wins():
    assert telemetry.current_activity() == "idle"
    telemetry.set_activity("running cell")
    try:
        assert telemetry.current_activity() == "running cell"
        started, release = threading.Event(), threading.Event()

        def actor_thread(text):
            with telemetry.activity(text):
                started.set()
                release.wait(5)

        t = threading.Thread(target=actor_thread, args=("running endpoint step",))
        t.start()
        assert started.wait(5)
        # the main thread's activity first, then the others'
        assert telemetry.current_activity() == "running cell; running endpoint step"
        with telemetry.activity("paused"):
            assert telemetry.current_activity() == "paused"
        assert telemetry.current_activity() == "running cell; running endpoint step"
        release.set()
        t.join(5)
        assert telemetry.current_activity() == "running cell"
    finally:
        telemetry.set_activity(None)
    assert telemetry.current_activity() == "idle"
    assert telemetry.request_activity("execute") == "running cell"
    assert telemetry.request_activity("frobnicate") == "handling frobnicate"


# ------------------------------------------------------------------ sampler
def test_sampler_record_and_cpu():
    s = telemetry.Sampler(gpu=False)
    wall0 = time.monotonic()
    first = s.sample()
    for key in ("activity", "cpu", "rss", "uss", "threads", "mem_total", "gpu", "seq"):
        assert key in first, key
    assert first["cpu"] == 0.0 and first["seq"] == 0
    assert first["rss"] > 1 << 20 and first["threads"] >= 1
    assert first["mem_total"] >= first["rss"]
    assert first["gpu"] is None
    if sys.platform.startswith("linux"):
        assert 0 < first["uss"] <= first["rss"]
    t0 = time.thread_time()
    while time.thread_time() - t0 < 0.4:  # 0.4 s of CPU
        pass
    second = s.sample({"cells": 3})
    wall = time.monotonic() - wall0
    assert second["seq"] == 1 and second["cells"] == 3
    # at least the 0.4 s of CPU this thread burnt, over at most the wall time between the
    # samples (whatever the load: a loaded machine stretches the wall time, not the CPU)
    assert second["cpu"] >= 0.4 / wall * 100 - 0.01, (second, wall)
    assert second["uss"] == first["uss"]  # USS is refreshed every 10 s only


# --------------------------------------------------------------------- GPU
class _NvmlError(Exception):
    pass


def _fake_nvml(count=2, fail_after=None, pid=None):
    """A stand-in for pynvml with ``count`` devices; device i has util 10*i+5 %."""
    calls = {"n": 0}

    def handle(i):
        calls["n"] += 1
        if fail_after is not None and calls["n"] > fail_after:
            raise _NvmlError("GPU is lost")
        if not 0 <= i < count:
            raise _NvmlError("bad index")
        return i

    return types.SimpleNamespace(
        nvmlInit=lambda: None, nvmlShutdown=lambda: None,
        nvmlDeviceGetCount=lambda: count,
        nvmlDeviceGetHandleByIndex=handle,
        nvmlDeviceGetHandleByUUID=lambda u: int(u.rsplit("-", 1)[1]),
        nvmlDeviceGetIndex=lambda h: h,
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=10 * h + 5, memory=1),
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(
            used=(h + 1) << 30, total=80 << 30, free=0),
        nvmlDeviceGetName=lambda h: b"Fake GPU",
        nvmlDeviceGetComputeRunningProcesses=lambda h: (
            [types.SimpleNamespace(pid=pid, usedGpuMemory=123 << 20)] if pid and h == 1 else []),
    ), calls


def test_gpu_probe_without_nvml_reports_none():
    def broken_init():
        raise _NvmlError("NVML Shared Library Not Found")

    probe = telemetry.GpuProbe(nvml=types.SimpleNamespace(nvmlInit=broken_init))
    assert not probe.ok and probe.sample() is None
    # the real binding on this machine: None without a GPU, a dict with one, never an error
    real = telemetry.GpuProbe().sample()
    assert real is None or {"util", "mem_used", "mem_total"} <= set(real)


def test_gpu_probe_picks_device(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("LOCAL_RANK", "1")
    nv, _ = _fake_nvml()
    g = telemetry.GpuProbe(pid=4242, nvml=nv).sample()
    assert g["index"] == 1 and g["util"] == 15.0 and g["name"] == "Fake GPU"
    assert g["mem_used"] == 2 << 30 and g["mem_total"] == 80 << 30
    assert g["proc_mem"] is None and g["torch_allocated"] is None
    # CUDA_VISIBLE_DEVICES maps LOCAL_RANK 1 to physical device 0
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    assert telemetry.GpuProbe(nvml=nv).sample()["index"] == 0
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-x-1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert telemetry.GpuProbe(nvml=nv).sample()["index"] == 1
    # NVML lists this process on device 1: that one wins over LOCAL_RANK
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    nv, _ = _fake_nvml(pid=os.getpid())
    g = telemetry.GpuProbe(nvml=nv).sample()
    assert g["index"] == 1 and g["proc_mem"] == 123 << 20


def test_gpu_probe_uses_torch_only_when_initialized(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("LOCAL_RANK", "0")
    state = {"init": False}
    cuda = types.SimpleNamespace(
        is_initialized=lambda: state["init"], current_device=lambda: 1,
        memory_allocated=lambda d: 7 << 20, memory_reserved=lambda d: 9 << 20)
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    nv, _ = _fake_nvml()
    probe = telemetry.GpuProbe(nvml=nv)
    g = probe.sample()
    assert g["index"] == 0 and g["torch_allocated"] is None
    state["init"] = True
    g = probe.sample()
    assert g["index"] == 1 and g["torch_allocated"] == 7 << 20 and g["torch_reserved"] == 9 << 20


def test_gpu_probe_turns_off_after_an_nvml_error():
    nv, _ = _fake_nvml(fail_after=3)  # the first sample makes 3 handle calls
    probe = telemetry.GpuProbe(nvml=nv)
    assert probe.sample() is not None
    assert probe.sample() is None and not probe.ok
    assert probe.sample() is None


def test_sampler_with_gpu_probe():
    nv, _ = _fake_nvml(count=1)
    rec = telemetry.Sampler(gpu=telemetry.GpuProbe(nvml=nv)).sample()
    assert rec["gpu"]["util"] == 5.0


# ------------------------------------------------------------------- thread
def test_telemetry_thread_sends_and_stops():
    got: list[dict] = []
    t = telemetry.TelemetryThread(got.append, interval=0.05, extra=lambda: {"cells": 1},
                                  sampler=telemetry.Sampler(gpu=False))
    t.start()
    wait_for(lambda: len(got) >= 3, 10, what="three records")
    t.stop()
    assert not t.is_alive()
    assert [r["seq"] for r in got[:3]] == [0, 1, 2]
    assert all(r["interval"] == 0.05 and r["cells"] == 1 and r["sampler_cpu"] > 0 for r in got)


def test_telemetry_thread_ends_when_send_fails_or_worker_stops():
    def closed(rec):
        raise RuntimeError("socket closed")

    t = telemetry.TelemetryThread(closed, interval=0.05, sampler=telemetry.Sampler(gpu=False))
    t.start()
    t.join(10)
    assert not t.is_alive()
    stopping = threading.Event()
    t = telemetry.TelemetryThread(lambda r: None, 0.05, stopping=stopping,
                                  sampler=telemetry.Sampler(gpu=False))
    t.start()
    stopping.set()
    t.join(10)
    assert not t.is_alive()
    with pytest.raises(ValueError, match="interval"):
        telemetry.TelemetryThread(lambda r: None, 0)
    assert telemetry.start(object(), 0) is None


def test_worker_command_passes_the_interval():
    spec = LaunchSpec("tcp://127.0.0.1:1", b"k", {"procs": 2}, [0, 1], telemetry_interval=0.5)
    cmd = worker_command(spec, 0)
    assert cmd[cmd.index("--telemetry-interval") + 1] == "0.5"


# ------------------------------------------------------------ real workers
def test_workers_report_state_messages():
    from monarch_kernel.mesh.procmesh import spawn_procs

    seen: list[tuple[str, int]] = []
    with spawn_procs(2, telemetry_interval=0.2) as m:
        m.controller.listeners.append(lambda kind, rank, payload: seen.append((kind, rank)))
        ctl = m.controller
        wait_for(lambda: all("cpu" in ctl.ranks[r].telemetry for r in m.ranks), 20,
                 what="telemetry from every rank")
        tel = ctl.ranks[0].telemetry
        assert tel["activity"] == "idle" and tel["interval"] == 0.2
        assert tel["gpu"] is None or isinstance(tel["gpu"], dict)
        assert tel["rss"] > 0 and tel["threads"] >= 3
        req = m.run("import time\ntime.sleep(2)", [1])
        wait_for(lambda: ctl.ranks[1].telemetry.get("activity") == "running cell", 10,
                 what="rank 1 reporting 'running cell'")
        assert ctl.ranks[0].telemetry["activity"] == "idle"
        assert req.wait(20)
        wait_for(lambda: ctl.ranks[1].telemetry.get("activity") == "idle", 10,
                 what="rank 1 idle again")
        assert ctl.ranks[1].telemetry["cells"] == 1
        assert ("state", 0) in seen and ("state", 1) in seen


def test_telemetry_off():
    from monarch_kernel.mesh.procmesh import spawn_procs

    with spawn_procs(1, telemetry_interval=0) as m:
        m.exec("1")  # the worker is up and answering
        time.sleep(1.0)
        assert m.controller.ranks[0].telemetry == {}
        threads = m.exec("import threading; sorted(t.name for t in threading.enumerate())")
        assert "monarch-telemetry" not in threads.values()[0]
    from monarch_kernel.errors import MeshFailure

    with pytest.raises(MeshFailure, match="stopped"):
        m.dashboard()
