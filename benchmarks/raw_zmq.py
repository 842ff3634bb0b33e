"""The baseline: raw pyzmq DEALER/ROUTER echo between processes.

The "controller" binds a ROUTER; each "worker" (``python -m
benchmarks.raw_zmq worker ADDR ID``) connects a DEALER and answers every
message: an empty frame is echoed (a no-op call); a large frame is summed
with numpy (as float32) and the 8-byte sum sent back. A worker can also be
told to send a large frame to a peer (worker to worker transfer).
This is the least any framework on ZeroMQ must do, with no serialization,
signing or routing logic. Like the bare echo (:mod:`benchmarks.bare_echo`),
its workers are ordinary processes whatever ``MONARCH_SCHED_BATCH`` says (a
plain program, as it uses ZeroMQ over TCP where ours uses lanes); the
results record the policy of ours (``sched_batch``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np
import zmq

from benchmarks.stats import fanout_p50_us, latencies_us, p50, p99

MiB = 1 << 20
#: set to "batch" in a raw worker's environment: it runs under SCHED_BATCH, as ours do
POLICY_ENV = "RAW_ZMQ_POLICY"


def worker(addr: str, ident: str) -> None:
    if os.environ.get(POLICY_ENV) == "batch":  # our workers' policy (worker/sched.py)
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.linger = 0
    s.sndhwm = s.rcvhwm = 0  # pipelined bursts must not be dropped at the HWM
    s.identity = ident.encode()
    s.connect(addr)
    peer = ctx.socket(zmq.ROUTER)
    peer.linger = 0
    port = peer.bind_to_random_port("tcp://127.0.0.1")
    s.send_multipart([b"hello", str(port).encode()])
    poller = zmq.Poller()
    poller.register(s, zmq.POLLIN)
    poller.register(peer, zmq.POLLIN)
    out: dict[str, zmq.Socket] = {}
    parent = os.getppid()
    while True:
        ev = dict(poller.poll(1000))
        if not ev and os.getppid() != parent:  # the driver died before its stop: leave
            break
        if peer in ev:
            who, data = peer.recv_multipart(copy=False)
            total = float(np.frombuffer(data.buffer, dtype=np.float32).sum())
            peer.send_multipart([who.bytes, np.float64(total).tobytes()])
        if s in ev:
            frames = s.recv_multipart(copy=False)
            kind = frames[0].bytes
            if kind == b"stop":
                break
            if kind == b"noop":
                s.send_multipart([b"ok", frames[1]])
            elif kind == b"sum":
                total = float(np.frombuffer(frames[1].buffer, dtype=np.float32).sum())
                s.send_multipart([b"ok", np.float64(total).tobytes()])
            elif kind == b"p2p":  # send N bytes to the peer at port, time it
                port, nbytes = frames[1].bytes.decode().split(":")
                d = out.get(port)
                if d is None:
                    d = out[port] = ctx.socket(zmq.DEALER)
                    d.linger = 0
                    d.connect(f"tcp://127.0.0.1:{port}")
                payload = np.ones(int(nbytes) // 4, dtype=np.float32)
                t0 = time.perf_counter()
                d.send(payload, copy=False)
                d.recv()
                s.send_multipart([b"ok", str(time.perf_counter() - t0).encode()])
    s.close(0)
    peer.close(0)
    for d in out.values():
        d.close(0)
    ctx.term()


class RawMesh:
    """N raw echo workers and a ROUTER controller.

    Parameters
    ----------
    n : int
        Workers.
    transport : {"tcp", "ipc"}
        The ROUTER's endpoint: loopback TCP, or a Unix socket in a fresh
        private directory (removed by :meth:`close`).
    policy : {"ordinary", "batch"}
        The workers' scheduling policy: ``"batch"`` is ``SCHED_BATCH``, what
        our workers run under by default (:mod:`monarch_kernel.worker.sched`).
    """

    def __init__(self, n: int, transport: str = "tcp", policy: str = "ordinary") -> None:
        t0 = time.perf_counter()
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.linger = 0
        self.router.sndhwm = self.router.rcvhwm = 0  # ROUTER drops at the HWM otherwise
        self.tmp: str | None = None
        if transport == "ipc":
            self.tmp = tempfile.mkdtemp(prefix="raw-zmq-")
            addr = f"ipc://{self.tmp}/router"
            self.router.bind(addr)
        else:
            port = self.router.bind_to_random_port("tcp://127.0.0.1")
            addr = f"tcp://127.0.0.1:{port}"
        env = {**os.environ, POLICY_ENV: policy}
        self.procs = [subprocess.Popen([sys.executable, "-m", "benchmarks.raw_zmq", "worker",
                                        addr, f"w{i}"], env=env) for i in range(n)]
        self.ids: list[bytes] = []
        self.peer_ports: dict[bytes, str] = {}
        while len(self.ids) < n:
            if not self.router.poll(120000):  # (64 workers on 2 busy cores take a while)
                raise TimeoutError("raw workers did not connect")
            ident, _, port_b = self.router.recv_multipart()
            self.ids.append(ident)
            self.peer_ports[ident] = port_b.decode()
        self.ids.sort()
        self.spawn_s = time.perf_counter() - t0

    def call(self, ident: bytes, kind: bytes = b"noop", data: Any = b"") -> Any:
        self.router.send_multipart([ident, kind, data], copy=False)
        return self.router.recv_multipart()[2]

    def bcast(self) -> None:
        for i in self.ids:
            self.router.send_multipart([i, b"noop", b""])
        for _ in self.ids:
            self.router.recv_multipart()

    def pipelined(self, n: int = 1000) -> float:
        ident = self.ids[0]
        t0 = time.perf_counter()
        for _ in range(n):
            self.router.send_multipart([ident, b"noop", b""])
        for _ in range(n):
            self.router.recv_multipart()
        return n / (time.perf_counter() - t0)

    def tensor_gbps(self, nbytes: int = 64 * MiB) -> float:
        data = np.ones(nbytes // 4, dtype=np.float32)
        self.call(self.ids[0], b"sum", data)  # warm-up
        best = 0.0
        for _ in range(3):
            t0 = time.perf_counter()
            self.call(self.ids[0], b"sum", data)
            best = max(best, nbytes / (time.perf_counter() - t0) / 1e9)
        return best

    def p2p_gbps(self, nbytes: int = 64 * MiB) -> float:
        a, b = self.ids[0], self.ids[1]
        arg = f"{self.peer_ports[b]}:{nbytes}".encode()
        self.call(a, b"p2p", arg)
        best = 0.0
        for _ in range(3):
            secs = float(self.call(a, b"p2p", arg))
            best = max(best, nbytes / secs / 1e9)
        return best

    def close(self) -> None:
        for i in self.ids:
            self.router.send_multipart([i, b"stop", b""])
        for p in self.procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.router.close(0)
        self.ctx.term()
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)


def measure(n: int, calls: int = 2000, big: bool = True) -> dict[str, float]:
    """The raw figures for ``n`` workers."""
    m = RawMesh(n)
    try:
        lat = latencies_us(lambda: m.call(m.ids[0]), calls)
        out = {"call_p50_us": p50(lat), "call_p99_us": p99(lat),
               "bcast_p50_us": p50(latencies_us(m.bcast, max(200, calls // 4))),
               "calls_per_s": max(m.pipelined() for _ in range(3)),
               "spawn_s": m.spawn_s}
        if big:
            out["tensor_gbps"] = m.tensor_gbps()
            if n >= 2:
                out["p2p_gbps"] = m.p2p_gbps()
        return out
    finally:
        m.close()


def fanout(sizes: tuple[int, ...] = (1, 4, 16, 64), calls: int = 200) -> dict[str, float]:
    """The raw ``bcast_p50_us`` for N echo workers: how far this machine itself
    lets a broadcast grow with N (where processes outnumber cores, they take turns)."""
    return fanout_p50_us(RawMesh, sizes, calls)


if __name__ == "__main__":
    if sys.argv[1] == "worker":
        worker(sys.argv[2], sys.argv[3])
