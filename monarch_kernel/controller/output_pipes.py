"""The output of a controller's local workers: their stdout/stderr pipes.

A local worker's stdout and stderr are pipes whose read ends the controller
holds (:meth:`RankOutput.adopt_pipes`); whichever thread leads the
controller's I/O (:class:`~monarch_kernel.transport.engine.Engine`) reads them
live, before handling that rank's replies (so a reply never overtakes its
output), and to the end when the rank dies (so nothing it wrote is lost).
Text goes to the request the rank is working on, else to ``on_output``.
:class:`RankOutput` is a part of
:class:`~monarch_kernel.controller.controller.Controller`, which it reaches
through :class:`OutputHost`.
"""

from __future__ import annotations

import logging
import os
import select
import threading
from collections.abc import Callable
from typing import Protocol

from monarch_kernel.controller.request import Pipe, RankInfo, Request
from monarch_kernel.transport.engine import Engine

log = logging.getLogger("monarch_kernel.controller.controller")

__all__ = ["OutputHost", "RankOutput"]

#: the order of output pipes among the engine's sources: before lanes and sockets
PIPE_ORDER = 0


class OutputHost(Protocol):
    """What :class:`RankOutput` uses of its controller."""

    ranks: dict[int, RankInfo]
    pending: dict[str, Request]
    lock: threading.RLock
    on_output: Callable[[int, str, str], None] | None
    leftover_output: Callable[[int], list[tuple[str, bytes]]] | None


class RankOutput:
    """Reading local workers' output pipes (see the module docstring).

    Parameters
    ----------
    host : OutputHost
        The controller.
    engine : Engine
        The controller's I/O engine, which watches the pipes.
    """

    def __init__(self, host: OutputHost, engine: Engine) -> None:
        self.host = host
        self.engine = engine
        self.pipes: dict[int, Pipe] = {}  # fd -> pipe (the thread that leads only)
        self._rank_polls: dict[int, select.poll] = {}  # rank -> poll of its pipes
        self._lock = threading.Lock()

    def adopt_pipes(self, rank: int, stdout_fd: int, stderr_fd: int) -> None:
        """Take the read ends of a local worker's stdout/stderr pipes (any thread).

        From then on the thread that leads alone reads them: live, before
        handling the rank's replies (so a reply never overtakes its output),
        and to the end when the rank dies (so nothing it wrote is lost); it
        closes them at EOF.
        """
        for fd, name in ((stdout_fd, "stdout"), (stderr_fd, "stderr")):
            pipe = Pipe(rank, name, fd)
            with self._lock:
                self.pipes[fd] = pipe
                if rank not in self._rank_polls:
                    self._rank_polls[rank] = select.poll()
                self._rank_polls[rank].register(fd, select.POLLIN)
            self.engine.add(fd, self._on_input, order=PIPE_ORDER)

    def _on_input(self, fd: int) -> None:
        pipe = self.pipes.get(fd)
        if pipe is not None:
            self.read(pipe)

    def read(self, pipe: Pipe) -> None:
        """Forward what is in ``pipe`` now; close it at EOF (the thread that leads)."""
        while True:
            try:
                data = os.read(pipe.fd, 65536)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:  # every writer is gone
                self.engine.remove(pipe.fd)
                with self._lock:
                    rank_poll = self._rank_polls.get(pipe.rank)
                    if rank_poll is not None:
                        rank_poll.unregister(pipe.fd)
                    self.pipes.pop(pipe.fd, None)
                os.close(pipe.fd)
                return
            text = pipe.decoder.decode(data)
            if text:
                self.deliver(pipe.rank, pipe.name, text, self.running_request(pipe.rank))
            if len(data) < 65536:
                return

    def drain(self, rank: int) -> None:
        """Forward everything ``rank`` wrote so far (the thread that leads);
        one poll(2) of the rank's pipes when there is nothing to read."""
        rank_poll = self._rank_polls.get(rank)
        if rank_poll is None:
            return
        for fd, _ in rank_poll.poll(0):
            pipe = self.pipes.get(fd)
            if pipe is not None:
                self.read(pipe)

    def close(self) -> None:
        """Close every pipe (the I/O thread, as it ends)."""
        with self._lock:
            fds, self.pipes = list(self.pipes), {}
            self._rank_polls.clear()
        for fd in fds:
            os.close(fd)

    def running_request(self, rank: int) -> Request | None:
        """The request ``rank`` is working on: its oldest unanswered one."""
        host = self.host
        with host.lock:
            for q in host.pending.values():
                if rank in q.ranks and rank not in q.replies and q.failure is None:
                    return q
            for q in host.pending.values():  # failed, but still routable for a while
                if rank in q.ranks and rank not in q.replies:
                    return q
        return None

    def deliver(self, rank: int, name: str, text: str, req: Request | None) -> None:
        """Hand ``text`` that ``rank`` wrote on stream ``name`` to ``req``, else to
        ``on_output``, else to the log."""
        host = self.host
        self._remember(host.ranks[rank], text)
        if req is not None:
            req.put_event(("stream", rank, name, text))
        elif host.on_output is not None:
            host.on_output(rank, name, text)
        else:
            log.info("[%d] %s", rank, text.rstrip("\n"))

    def deliver_leftover(self, rank: int) -> None:
        """Forward what a dead rank wrote but never sent (read from the launcher's pipes)."""
        host = self.host
        try:
            chunks = host.leftover_output(rank) if host.leftover_output else []
        except Exception:
            log.exception("reading the output of dead rank %d failed", rank)
            return
        with host.lock:
            waiting = [q for q in host.pending.values()
                       if rank in q.ranks and rank not in q.replies]
        for name, data in chunks:
            text = data.decode("utf-8", errors="replace")
            if waiting:
                for q in waiting:
                    self.deliver(rank, name, text, q)
            else:
                self.deliver(rank, name, text, None)

    @staticmethod
    def _remember(info: RankInfo, text: str) -> None:
        text = info.partial + text
        *lines, info.partial = text.split("\n")
        info.last_lines.extend(lines)
        if len(info.partial) > 4096:
            info.partial = info.partial[-4096:]
