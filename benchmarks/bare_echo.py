"""A second fan-out baseline: a bare Python echo over Unix socket pairs.

Each worker (``python -c``) reads a message from its end of a socket pair
and writes it back; the driver writes one 100-byte message to each of N
workers and waits, in ``epoll``, for every answer. No framing, no
signature, no dispatch, no ZeroMQ I/O threads: the least any system whose
workers run Python must do per rank, so its growth from N = 1 to 64 is the
floor this machine sets for a broadcast (64 processes taking turns on its
cores, each woken to cold caches).
"""

from __future__ import annotations

import os
import select
import socket
import subprocess
import sys

from benchmarks.stats import fanout_p50_us

_WORKER = """
import os, sys
fd = int(sys.argv[1])
while True:
    data = os.read(fd, 65536)
    if not data:
        break
    os.write(fd, data)
"""

_MESSAGE = b"x" * 100


class BareMesh:
    """N bare echo workers, each on its own socket pair."""

    def __init__(self, n: int) -> None:
        self.socks: list[socket.socket] = []
        self.procs: list[subprocess.Popen] = []
        self.poll = select.epoll()
        try:
            for _ in range(n):
                mine, theirs = socket.socketpair()
                self.socks.append(mine)
                try:
                    self.procs.append(subprocess.Popen(
                        [sys.executable, "-c", _WORKER, str(theirs.fileno())],
                        pass_fds=(theirs.fileno(),)))
                finally:
                    theirs.close()
                self.poll.register(mine.fileno(), select.EPOLLIN)
        except BaseException:
            self.close()
            raise

    def bcast(self) -> None:
        for s in self.socks:
            s.sendall(_MESSAGE)
        left = {s.fileno(): len(_MESSAGE) for s in self.socks}
        while left:
            events = self.poll.poll(30.0)
            if not events:
                raise TimeoutError(f"{len(left)} bare echo workers did not answer in 30 s")
            for fd, _ in events:
                got = len(os.read(fd, 65536))
                if not got:
                    raise ConnectionError("a bare echo worker is gone")
                left[fd] -= got
                if left[fd] <= 0:
                    del left[fd]

    def close(self) -> None:
        for s in self.socks:
            s.close()  # the worker reads end-of-file and leaves
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.poll.close()


def fanout(sizes: tuple[int, ...] = (1, 4, 16, 64), calls: int = 200) -> dict[str, float]:
    """``bcast_p50_us`` of the bare echo for each N in ``sizes``."""
    return fanout_p50_us(BareMesh, sizes, calls)
