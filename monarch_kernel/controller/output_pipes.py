"""The output of a controller's local workers: their stdout/stderr pipes.

A local worker's stdout and stderr are pipes whose read ends the controller
holds (:meth:`RankOutput.adopt_pipes`); whichever thread leads the
controller's I/O reads them live, before handling that rank's replies (so a
reply never overtakes its output), and to the end when the rank dies (so
nothing it wrote is lost). Text goes to the request the rank is working on,
else to ``on_output``. :class:`RankOutput` is a mixin of
:class:`~monarch_kernel.controller.controller.Controller` and uses its state.
"""

from __future__ import annotations

import logging
import os
import select

import zmq

from monarch_kernel.controller.request import RankInfo, Request, _Pipe
from monarch_kernel.transport.sockets import FdPoller

log = logging.getLogger("monarch_kernel.controller.controller")

__all__ = ["RankOutput"]


class RankOutput:
    """Reading local workers' output pipes (see the module docstring)."""

    def adopt_pipes(self, rank: int, stdout_fd: int, stderr_fd: int) -> None:
        """Take the read ends of a local worker's stdout/stderr pipes (any thread).

        From then on the I/O thread alone reads them: live, before handling the
        rank's replies (so a reply never overtakes its output), and to the end
        when the rank dies (so nothing it wrote is lost); it closes them at EOF.
        """
        with self._lock:
            self._new_pipes.append((rank, stdout_fd, stderr_fd))
        self._wake_io()  # it registers them now

    def _register_pipes(self, poller: FdPoller) -> None:
        with self._lock:
            new, self._new_pipes = self._new_pipes, []
        for rank, out_fd, err_fd in new:
            for fd, name in ((out_fd, "stdout"), (err_fd, "stderr")):
                self._pipes[fd] = _Pipe(rank, name, fd)
                poller.register(fd, zmq.POLLIN)
                if rank not in self._rank_polls:
                    self._rank_polls[rank] = select.poll()
                self._rank_polls[rank].register(fd, select.POLLIN)

    def _read_pipe(self, pipe: _Pipe, poller: FdPoller | None) -> None:
        """Forward what is in ``pipe`` now; close it at EOF."""
        while True:
            try:
                data = os.read(pipe.fd, 65536)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:  # every writer is gone
                if poller is not None:
                    poller.unregister(pipe.fd)
                rank_poll = self._rank_polls.get(pipe.rank)
                if rank_poll is not None:
                    rank_poll.unregister(pipe.fd)
                self._pipes.pop(pipe.fd, None)
                os.close(pipe.fd)
                return
            text = pipe.decoder.decode(data)
            if text:
                self._deliver_stream(pipe.rank, pipe.name, text, self._running_request(pipe.rank))
            if len(data) < 65536:
                return

    def _drain_pipes(self, rank: int) -> None:
        """Forward everything ``rank`` wrote so far (the thread that leads);
        one poll(2) of the rank's pipes when there is nothing to read."""
        rank_poll = self._rank_polls.get(rank)
        if rank_poll is None:
            return
        for fd, _ in rank_poll.poll(0):
            pipe = self._pipes.get(fd)
            if pipe is not None:
                self._read_pipe(pipe, self._poller)

    def _running_request(self, rank: int) -> Request | None:
        """The request ``rank`` is working on: its oldest unanswered one."""
        with self._lock:
            for q in self.pending.values():
                if rank in q.ranks and rank not in q.replies and q.failure is None:
                    return q
            for q in self.pending.values():  # failed, but still routable for a while
                if rank in q.ranks and rank not in q.replies:
                    return q
        return None

    def _deliver_stream(self, rank: int, name: str, text: str, req: Request | None) -> None:
        self._remember_output(self.ranks[rank], text)
        if req is not None:
            req.put_event(("stream", rank, name, text))
        elif self.on_output is not None:
            self.on_output(rank, name, text)
        else:
            log.info("[%d] %s", rank, text.rstrip("\n"))

    def _deliver_leftover(self, rank: int) -> None:
        """Forward what a dead rank wrote but never sent (read from the launcher's pipes)."""
        try:
            chunks = self.leftover_output(rank) if self.leftover_output else []
        except Exception:
            log.exception("reading the output of dead rank %d failed", rank)
            return
        with self._lock:
            waiting = [q for q in self.pending.values()
                       if rank in q.ranks and rank not in q.replies]
        for name, data in chunks:
            text = data.decode("utf-8", errors="replace")
            if waiting:
                for q in waiting:
                    self._deliver_stream(rank, name, text, q)
            else:
                self._deliver_stream(rank, name, text, None)

    @staticmethod
    def _remember_output(info: RankInfo, text: str) -> None:
        text = info.partial + text
        *lines, info.partial = text.split("\n")
        info.last_lines.extend(lines)
        if len(info.partial) > 4096:
            info.partial = info.partial[-4096:]
