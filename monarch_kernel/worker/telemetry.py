"""Worker-side telemetry: what each rank is doing and what it costs.

Every worker runs one daemon thread (``monarch-telemetry``) that samples its
own process about once a second and sends the figures to the controller as a
small ``"state"`` message on the control channel. The controller keeps the
latest record in ``RankInfo.telemetry`` and calls its listeners
(``("state", rank, record)``), which is what ``%mesh status`` and the
dashboard (:mod:`monarch_kernel.ui.dashboard`) show.

A record (the message content) is a plain dict:

==================  ===========================================================
``activity``        ``"idle"``, ``"running cell"``, ``"running endpoint NAME"``,
                    ``"paused"``, ... (see :func:`set_activity`)
``cpu``             CPU used since the previous sample, in % of one core
                    (over 100 for several busy threads)
``rss``             resident set size, bytes
``uss``             unique set size (memory freed if the process exited),
                    bytes; refreshed every ``uss_every`` seconds (it is the
                    costly figure), None where the platform has none
``threads``         OS threads of the process
``mem_total``       the host's physical memory, bytes
``mem_limit``       the memory limit of the process's cgroup (v2 ``memory.max``,
                    v1 ``memory.limit_in_bytes``; the smallest along the
                    cgroup's path), bytes; None when there is none (or it is
                    no smaller than the host's memory)
``gpu``             None without a usable GPU, else a dict: ``index`` (NVML
                    device index), ``name``, ``util`` (%), ``mem_used`` and
                    ``mem_total`` (bytes, whole device), ``proc_mem`` (bytes
                    this process holds on it, if NVML says),
                    ``torch_allocated`` / ``torch_reserved`` (bytes, from
                    ``torch.cuda`` when this process initialized CUDA)
``cells``           cells this rank has run
``interval``        seconds between samples
``seq``             sample number, from 0
``sampler_cpu``     CPU seconds the sampler thread itself used so far (what
                    telemetry costs; see ``benchmarks/telemetry_overhead.py``)
==================  ===========================================================

Cost. Everything comes through psutil. All but USS is read from
``/proc/<pid>/stat`` and ``status``. USS (``memory_full_info``) needs
``/proc/<pid>/smaps_rollup``, which walks the page tables (costly for a process
with many mappings, e.g. one that imported torch), so it is read only every
``uss_every`` (10) seconds, whatever the interval; where it may not be read
(``AccessDenied``) or does not exist, ``uss`` is None. NVML calls take tens of
microseconds. torch is never imported here: its CUDA figures are read only
when the worker's own code already imported torch and initialized CUDA.

GPU paths are guarded: no NVML library, no driver or no device simply gives
``gpu=None``; an NVML error after start-up turns GPU sampling off for good.

The figures follow what ``psutil`` and ``nvidia-smi`` report (USS as in
psutil's ``memory_full_info``; utilization as NVML's
``nvmlDeviceGetUtilizationRates``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from monarch_kernel.util import gpu

log = logging.getLogger("monarch_kernel.worker.telemetry")

__all__ = [
    "DEFAULT_INTERVAL",
    "GpuProbe",
    "Sampler",
    "TelemetryThread",
    "activity",
    "cgroup_memory_limit",
    "current_activity",
    "request_activity",
    "set_activity",
    "start",
]

#: seconds between samples unless the worker is told otherwise
DEFAULT_INTERVAL = 1.0
#: USS (the costly figure) is refreshed every this many seconds
USS_EVERY = 10.0

# ------------------------------------------------------------------ activity
_activities: dict[int, str] = {}
_activity_lock = threading.Lock()

#: what the worker's main thread is doing while it handles a request type
REQUEST_ACTIVITY = {
    "execute": "running cell",
    "push": "receiving values",
    "pull": "sending values",
    "setup": "setting up torch.distributed",
    "spawn_actor": "starting an actor",
    "stop_actor": "stopping an actor",
    "stop": "stopping",
    "ref": "working on a tensor handle",
}


def set_activity(text: str | None) -> None:
    """Say what the calling thread is doing (None or ``"idle"``: nothing).

    Each thread has its own entry, so the main thread (cells) and actor
    threads (endpoints) can report at once. Conventions: ``"running cell"``,
    ``"running endpoint NAME"``, ``"paused"`` (in the debugger; wins over
    everything else). Cheap (a dict write under a lock); safe from any thread.

    Parameters
    ----------
    text : str or None
        A short phrase shown in the dashboard's state column.
    """
    tid = threading.get_ident()
    with _activity_lock:
        if text is None or text == "idle":
            _activities.pop(tid, None)
        else:
            _activities[tid] = text


@contextlib.contextmanager
def activity(text: str) -> Iterator[None]:
    """Report ``text`` (see :func:`set_activity`) while the block runs, then
    restore what the thread reported before."""
    tid = threading.get_ident()
    with _activity_lock:
        before = _activities.get(tid)
    set_activity(text)
    try:
        yield
    finally:
        set_activity(before)


def current_activity() -> str:
    """What the process is doing: ``"paused"`` if any thread is paused, else
    the main thread's activity followed by other threads', else ``"idle"``."""
    with _activity_lock:
        items = list(_activities.items())
    if not items:
        return "idle"
    for _, text in items:
        if text.startswith("paused"):
            return text
    main = threading.main_thread().ident
    items.sort(key=lambda kv: kv[0] != main)
    texts = list(dict.fromkeys(text for _, text in items))
    return "; ".join(texts)


def request_activity(msg_type: str) -> str:
    """The activity shown while the main thread handles request ``msg_type``."""
    return REQUEST_ACTIVITY.get(msg_type, f"handling {msg_type}")


# -------------------------------------------------------------- memory limit
#: cgroup v1 writes "no limit" as a huge number (2**63 rounded down to a page)
_V1_UNLIMITED = 1 << 60


def _read_limit(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    if not text.isdigit():  # "max" (v2): no limit here
        return None
    value = int(text)
    return value if 0 < value < _V1_UNLIMITED else None


def cgroup_memory_limit(pid: int | None = None, root: str = "/sys/fs/cgroup",
                        proc: str = "/proc") -> int | None:
    """The memory limit of process ``pid``'s cgroup, in bytes, or None.

    Reads ``<proc>/<pid>/cgroup``; for cgroup v2 (the ``0::PATH`` line) the
    ``memory.max`` files of PATH and of every cgroup above it under ``root``;
    for v1 (the ``memory`` controller's line) ``memory.limit_in_bytes`` under
    ``<root>/memory``. The smallest limit found wins (a parent's limit binds
    its children). A path that is not visible from here (a cgroup namespace
    shows ``/``) falls back to the mount's own files. Never raises.

    Parameters
    ----------
    pid : int, optional
        The process (default: this one).
    root, proc : str
        Where cgroupfs and procfs are mounted (tests point them elsewhere).
    """
    try:
        with open(os.path.join(proc, str(pid or os.getpid()), "cgroup")) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    found: list[int] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            base, name = root, "memory.max"
            if not os.path.exists(os.path.join(root, "cgroup.controllers")):
                base = os.path.join(root, "unified")
        elif "memory" in controllers.split(","):
            base, name = os.path.join(root, "memory"), "memory.limit_in_bytes"
        else:
            continue
        rel = path.strip("/")
        dirs = []
        while True:
            dirs.append(os.path.join(base, rel) if rel else base)
            if not rel:
                break
            rel = os.path.dirname(rel)
        for d in dirs:
            value = _read_limit(os.path.join(d, name))
            if value is not None:
                found.append(value)
    return min(found) if found else None


# ----------------------------------------------------------------------- GPU
class GpuProbe:
    """This process's GPU figures through NVML (``nvidia-ml-py``), guarded.

    The device is, in order: the one ``torch.cuda`` uses in this process (when
    torch is already imported and CUDA initialized), the one where NVML lists
    this process, else the one ``LOCAL_RANK`` would pick (as ``--dist nccl``
    does). ``CUDA_VISIBLE_DEVICES`` (indices or UUIDs) is honoured.

    Parameters
    ----------
    pid : int, optional
        The process to look for in NVML's process lists (default: this one).
    nvml : module, optional
        An NVML binding with pynvml's API (for tests); ``pynvml`` by default.
    """

    def __init__(self, pid: int | None = None, nvml: Any = None) -> None:
        self.pid = pid or os.getpid()
        self.nv = nvml
        self.ok = False
        self.count = 0
        self._names: dict[int, str] = {}
        self._found: int | None = None
        self._n = 0
        try:
            if self.nv is None:
                import pynvml

                self.nv = pynvml
            self.nv.nvmlInit()
            self.count = int(self.nv.nvmlDeviceGetCount())
            self.ok = self.count > 0
        except Exception as e:  # noqa: BLE001 - no library, no driver, no device: no GPU
            log.debug("no GPU telemetry: %s", e)
            self.ok = False

    # device choice -------------------------------------------------------
    def _visible(self) -> list[str] | None:
        env = os.environ.get("CUDA_VISIBLE_DEVICES")
        if env is None:
            return None
        return [p.strip() for p in env.split(",") if p.strip()]

    def _physical(self, logical: int) -> int | None:
        vis = self._visible()
        if vis is None:
            return logical if logical < self.count else None
        if logical >= len(vis):
            return None
        entry = vis[logical]
        if entry.isdigit():
            return int(entry)
        try:
            handle = self.nv.nvmlDeviceGetHandleByUUID(entry)
            return int(self.nv.nvmlDeviceGetIndex(handle))
        except Exception:  # noqa: BLE001
            return None

    def _torch_device(self) -> int | None:
        if gpu.assigned() is not None:  # (this thread's current device may be another)
            return gpu.assigned()
        torch = sys.modules.get("torch")
        cuda = getattr(torch, "cuda", None)
        try:
            if cuda is not None and cuda.is_initialized():
                return int(cuda.current_device())
        except Exception:  # noqa: BLE001, S110 - guarded: no GPU figure, no error
            pass
        return None

    def _search(self) -> int | None:
        for i in range(self.count):
            try:
                h = self.nv.nvmlDeviceGetHandleByIndex(i)
                procs = self.nv.nvmlDeviceGetComputeRunningProcesses(h)
            except Exception:  # noqa: BLE001, S112 - guarded: no GPU figure, no error
                continue
            if any(getattr(p, "pid", None) == self.pid for p in procs):
                return i
        return None

    def device(self) -> tuple[int | None, int | None]:
        """(NVML index, torch logical index or None) of this rank's GPU."""
        logical = self._torch_device()
        if logical is not None:
            return self._physical(logical), logical
        if self._n % 10 == 0:  # NVML's process lists cost more: look now and then
            self._found = self._search()
        self._n += 1
        if self._found is not None:
            return self._found, None
        local = int(os.environ.get("LOCAL_RANK", "0") or 0)
        n = len(self._visible() or []) or self.count
        return self._physical(local % max(1, n)), None

    # sampling ------------------------------------------------------------
    def sample(self) -> dict[str, Any] | None:
        """The GPU figures, or None when there is no usable GPU."""
        if not self.ok:
            return None
        try:
            index, logical = self.device()
            if index is None:
                return None
            nv = self.nv
            h = nv.nvmlDeviceGetHandleByIndex(index)
            util = nv.nvmlDeviceGetUtilizationRates(h)
            mem = nv.nvmlDeviceGetMemoryInfo(h)
            name = self._names.get(index)
            if name is None:
                name = nv.nvmlDeviceGetName(h)
                name = name.decode() if isinstance(name, bytes) else str(name)
                self._names[index] = name
            proc_mem = None
            try:
                for p in nv.nvmlDeviceGetComputeRunningProcesses(h):
                    if getattr(p, "pid", None) == self.pid:
                        proc_mem = getattr(p, "usedGpuMemory", None)
            except Exception:  # noqa: BLE001, S110 - guarded: no GPU figure, no error
                pass
            out: dict[str, Any] = {
                "index": index, "name": name, "util": float(util.gpu),
                "mem_used": int(mem.used), "mem_total": int(mem.total), "proc_mem": proc_mem,
                "torch_allocated": None, "torch_reserved": None,
            }
        except Exception as e:  # noqa: BLE001 - NVML broke: stop asking
            log.warning("GPU telemetry turned off: %s", e)
            self.ok = False
            return None
        if logical is not None:
            cuda = sys.modules["torch"].cuda
            try:
                out["torch_allocated"] = int(cuda.memory_allocated(logical))
                out["torch_reserved"] = int(cuda.memory_reserved(logical))
            except Exception:  # noqa: BLE001, S110 - guarded: no GPU figure, no error
                pass
        return out

    def close(self) -> None:
        if self.ok:
            try:
                self.nv.nvmlShutdown()
            except Exception:  # noqa: BLE001, S110 - guarded: no GPU figure, no error
                pass
            self.ok = False


# ------------------------------------------------------------------- sampler
class Sampler:
    """Takes telemetry records of one process (see the module docstring).

    Parameters
    ----------
    pid : int, optional
        The process to sample (default: this one).
    uss_every : float
        Refresh USS every this many seconds (0: never).
    gpu : bool or GpuProbe
        Sample the GPU (True: a :class:`GpuProbe` made on first use).
    """

    def __init__(self, pid: int | None = None, uss_every: float = USS_EVERY,
                 gpu: bool | GpuProbe = True) -> None:
        import psutil

        self.pid = pid or os.getpid()
        self.proc = psutil.Process(self.pid)
        self.uss_every = uss_every
        self._gpu: GpuProbe | None = gpu if isinstance(gpu, GpuProbe) else None
        self._want_gpu = bool(gpu)
        self.mem_total = int(psutil.virtual_memory().total)
        self.mem_limit = self._mem_limit()
        self.seq = 0
        self._uss: int | None = None
        self._uss_at = -float("inf")
        self._last_cpu = self._cpu_seconds()
        self._last_t = time.monotonic()

    def _mem_limit(self) -> int | None:
        limit = cgroup_memory_limit(self.pid)
        return limit if limit is not None and limit < self.mem_total else None

    def _cpu_seconds(self) -> float:
        t = self.proc.cpu_times()
        return t.user + t.system

    def _read_uss(self) -> int | None:
        """Unique set size in bytes: psutil's ``memory_full_info().uss`` (on Linux
        Private_Clean + Private_Dirty + Private_Hugetlb of ``/proc/<pid>/smaps_rollup``).

        None where it cannot be had: the platform has no such figure, reading it is
        not permitted (another user's process: ``psutil.AccessDenied``), or the
        process is gone. Never raises.
        """
        try:
            return int(self.proc.memory_full_info().uss)
        except Exception:  # noqa: BLE001 - AccessDenied, NoSuchProcess, no USS here: no figure
            return None

    @property
    def gpu(self) -> GpuProbe | None:
        if self._gpu is None and self._want_gpu:
            self._gpu = GpuProbe(self.pid)
        return self._gpu

    def sample(self, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """One record: CPU % since the previous call, memory, threads, GPU.

        Raises
        ------
        psutil.NoSuchProcess
            If the sampled process is gone.
        """
        with self.proc.oneshot():
            cpu_s = self._cpu_seconds()
            rss = int(self.proc.memory_info().rss)
            threads = int(self.proc.num_threads())
        now = time.monotonic()
        dt = now - self._last_t
        cpu = 0.0 if dt <= 0 or self.seq == 0 else max(0.0, (cpu_s - self._last_cpu) / dt * 100)
        self._last_cpu, self._last_t = cpu_s, now
        if self.uss_every and now - self._uss_at >= self.uss_every:
            self._uss_at = now
            self._uss = self._read_uss()
            if self.seq:
                self.mem_limit = self._mem_limit()  # (rarely changes: read with USS)
        probe = self.gpu
        rec: dict[str, Any] = {
            "activity": current_activity() if self.pid == os.getpid() else "",
            "cpu": round(cpu, 2),
            "rss": rss,
            "uss": self._uss,
            "threads": threads,
            "mem_total": self.mem_total,
            "mem_limit": self.mem_limit,
            "gpu": probe.sample() if probe is not None else None,
            "seq": self.seq,
        }
        if extra:
            rec.update(extra)
        self.seq += 1
        return rec

    def close(self) -> None:
        if self._gpu is not None:
            self._gpu.close()


class TelemetryThread(threading.Thread):
    """Samples every ``interval`` seconds and hands each record to ``send``.

    Parameters
    ----------
    send : callable(dict)
        Called with each record, from this thread; an exception from it
        (the connection is closing) ends the thread.
    interval : float
        Seconds between samples (> 0).
    extra : callable() -> dict, optional
        More fields for each record (e.g. the worker's cell count).
    stopping : threading.Event, optional
        Another event that also ends the thread (the worker's).
    sampler : Sampler, optional
    """

    def __init__(self, send: Callable[[dict[str, Any]], None], interval: float = DEFAULT_INTERVAL,
                 extra: Callable[[], dict[str, Any]] | None = None,
                 stopping: threading.Event | None = None, sampler: Sampler | None = None
                 ) -> None:
        if not interval > 0:
            raise ValueError(f"telemetry interval must be > 0 seconds, not {interval!r}")
        super().__init__(name="monarch-telemetry", daemon=True)
        self.send = send
        self.interval = float(interval)
        self.extra = extra
        self.stopping = stopping
        self.sampler = sampler
        self._stop_event = threading.Event()

    def stop(self, timeout: float = 2.0) -> None:
        """Ask the thread to end and wait up to ``timeout`` seconds for it."""
        self._stop_event.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout)

    def _done(self) -> bool:
        return self._stop_event.is_set() or (self.stopping is not None
                                             and self.stopping.is_set())

    def run(self) -> None:
        try:
            if self.sampler is None:
                self.sampler = Sampler()
            wait = 0.0  # the first record at once: memory figures show up without delay
            while not self._stop_event.wait(wait) and not self._done():
                t0 = time.monotonic()
                extra = {"interval": self.interval}
                if self.extra is not None:
                    extra.update(self.extra())
                rec = self.sampler.sample(extra)
                rec["sampler_cpu"] = time.thread_time()
                try:
                    self.send(rec)
                except Exception:  # noqa: BLE001 - the connection is closing
                    return
                wait = max(0.0, self.interval - (time.monotonic() - t0))
        except Exception:
            log.exception("telemetry stopped")
        finally:
            if self.sampler is not None:
                self.sampler.close()


def start(worker: Any, interval: float = DEFAULT_INTERVAL) -> TelemetryThread | None:
    """Start the sampler thread of ``worker`` (a :class:`~monarch_kernel.worker.worker.Worker`).

    Records go out as ``"state"`` messages through ``worker.send``. The
    thread ends with the worker (``worker.stopping``) or when sending fails.

    Parameters
    ----------
    interval : float
        Seconds between samples; 0 (or less) disables telemetry.

    Returns
    -------
    TelemetryThread or None
        None when disabled.
    """
    if not interval or interval <= 0:
        return None

    def send(rec: dict[str, Any]) -> None:
        worker.send("state", rec)

    def extra() -> dict[str, Any]:
        return {"cells": getattr(worker, "cell_count", 0)}

    t = TelemetryThread(send, interval, extra, getattr(worker, "stopping", None))
    t.start()
    return t
