"""The controller side's debugger console: pdb prompts for paused ranks.

While a ``%%mesh`` cell runs, the kernel hands every ``debug`` event of the
cell's request to :meth:`DebugConsole.on_event`. The console waits a moment
for the other ranks of the cell to pause or finish, then:

- one rank paused: it prints ``rank 2 paused at <where>`` and pdb's location,
  and prompts ``(Pdb rank 2)``; each line goes to that rank's pdb and its
  output comes back (``n``, ``s``, ``c``, ``p x``, ``l``, ``w``, ``u``,
  ``d``, ``b``, ``q``, ...). ``detach`` leaves pdb for the console.
- several ranks paused: the ``(mesh-debug)`` console::

      list                 rank, host, function, file:line of every paused rank
      attach R             pdb on rank R (until ``detach``)
      cast RANKS CMD       one pdb command on several ranks: 3, 1,2, 0:4,
                           procs=1:3, hosts=0,procs=1, all
      continue             continue every paused rank
      quit                 quit every paused rank (their code raises BdbQuit)
      detach               leave the console (``%mesh debug`` only)

``%mesh debug`` runs the same console (:meth:`DebugConsole.run`) for ranks
paused outside a running cell.

The console never waits for ever: a session that was sent a line and says
nothing (no message) for ``answer_timeout`` seconds while its rank is alive
(a command that runs long, or a pdb that is gone) gets a warning naming the
rank and the session and what to do; the console stops waiting for it and
leaves it out until it says something again. In ``%mesh debug``, a session
that runs on (``n``, ``c`` with breakpoints) and stays silent as long is left
running the same way. With a frontend that cannot answer input
requests (``allow_stdin`` false) every breakpoint is skipped with a warning
naming the rank. A ``KeyboardInterrupt`` (the kernel's interrupt) releases
the paused ranks and goes on to the caller.

The console knows nothing of Jupyter: it is given an ``input_fn(prompt)``
(the kernel's ``raw_input``, i.e. Jupyter's ``input_request``) and a
``write(text)``. Ideas from pdb's own ``cmd.Cmd`` loop and from
torch.distributed's ``_DistributedPdb`` / Monarch's ``debug_controller``
(list / attach / cast / continue over ranks).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from monarch_kernel.debug.ranks import parse_debug_ranks, ranks_text, report_quits
from monarch_kernel.debug.registry import DebugRegistry, DebugSession
from monarch_kernel.errors import RankSpecError, compact_ranks, ranks_label
from monarch_kernel.util.cells import location

__all__ = ["HELP", "DebugConsole", "parse_debug_ranks", "report_quits"]

HELP = """\
(mesh-debug) commands:
  list                 paused ranks: rank, host, function, file:line
  attach R             pdb on rank R; pdb commands until  detach
  cast RANKS CMD       run one pdb command on RANKS: 3 | 1,2 | 0:4 | procs=1:3 | all
  continue             continue every paused rank (also: c)
  quit                 quit debugging every paused rank; their code raises BdbQuit (also: q)
  detach               leave this console (%mesh debug only; ranks stay paused)
  help                 this text"""

#: seconds to wait for more ranks of a cell to pause before prompting
GATHER_QUIET = 1.0
GATHER_MAX = 5.0
#: seconds a session may stay silent after it was sent a line (see the module docstring)
ANSWER_TIMEOUT = 15.0


class _Leave(Exception):
    """The user left the console (``detach`` in ``%mesh debug``)."""


class DebugConsole:
    """Drives the paused ranks of one request (or of a whole mesh) from prompts.

    Parameters
    ----------
    registry : DebugRegistry
        The controller's session registry.
    mesh : ProcMesh
        The mesh (its root shape names dimensions for rank specs).
    input_fn : callable(prompt: str) -> str
        Asks the user for one line; may raise ``EOFError`` or
        ``KeyboardInterrupt``.
    write : callable(text: str) -> None
        Shows text to the user.
    allow_stdin : bool
        False when the frontend cannot answer prompts: breakpoints are
        skipped with a warning.
    req : Request or None
        The running cell's request (None for ``%mesh debug``).
    on_event : callable(event) or None
        Shows the request's other events (stream, display) while debugging.
    flush : callable() or None
        Flushes held rank output before the console writes.
    warn : callable(text: str) or None
        Where warnings go (default: ``write``).
    patience : float
        Seconds a command's rank may run on while other ranks are paused
        before the console prompts again (a rank stepping over a collective
        waits for the paused ones).
    answer_timeout : float
        Seconds a session may stay silent after it was sent a line before
        the console stops waiting for it (see the module docstring).
    on_quit : callable(ranks: list of int) -> bool, or None
        Called once (cell mode), with the ranks that quit their debugger,
        when the console returns to the cell while other ranks of the cell
        still run (they may wait for the ranks that quit in a collective);
        returns True when it takes care of such collectives.
    """

    def __init__(self, registry: DebugRegistry, mesh: Any, input_fn: Callable[[str], str],
                 write: Callable[[str], None], *, allow_stdin: bool = True, req: Any = None,
                 on_event: Callable[[tuple], None] | None = None,
                 flush: Callable[[], None] | None = None,
                 warn: Callable[[str], None] | None = None, patience: float = 2.0,
                 answer_timeout: float = ANSWER_TIMEOUT,
                 on_quit: Callable[[list[int]], bool] | None = None) -> None:
        self.registry = registry
        self.mesh = mesh
        self.input_fn = input_fn
        self._write_fn = write
        self._warn_fn = warn or write
        self.allow_stdin = allow_stdin
        self.req = req
        self.on_event_fn = on_event
        self.flush_fn = flush
        self.patience = patience
        self.answer_timeout = answer_timeout
        self.on_quit_fn = on_quit
        self.interrupted = False
        self.console_mode = False
        #: seconds spent serving paused ranks (a cell's --timeout does not count them)
        self.paused_s = 0.0
        self._announced: dict[str, int] = {}
        self._skipped: set[int] = set()
        self._quit_ranks: set[int] = set()
        self._hint_started = False
        #: sessions that did not answer a line: sid -> their seq then (left out while
        #: it stays the same)
        self._silent: dict[str, int] = {}

    # ------------------------------------------------------------ output
    def _write(self, text: str) -> None:
        if not text:
            return
        if self.flush_fn is not None:
            self.flush_fn()
        self._write_fn(text if text.endswith("\n") else text + "\n")

    def _warn(self, text: str) -> None:
        if self.flush_fn is not None:
            self.flush_fn()
        self._warn_fn(text if text.endswith("\n") else text + "\n")

    def _host(self, rank: int) -> str:
        info = self.mesh.controller.ranks.get(rank)
        return info.host if info is not None else ""

    # ------------------------------------------------------------ waiting
    def _paused(self, silent: bool = False) -> list[DebugSession]:
        """The paused sessions served here; ``silent``: also those that did not answer."""
        if self.req is None:
            paused = self.registry.sessions("paused", ranks=self.mesh.root.ranks)
        else:
            paused = self.registry.sessions("paused", parent=self.req.id)
        if silent:
            return paused
        return [s for s in paused if self._silent.get(s.sid) != s.seq]

    def _still_silent(self) -> list[DebugSession]:
        return [s for s in self._paused(silent=True) if self._silent.get(s.sid) == s.seq]

    def _pump(self, timeout: float) -> None:
        """Show the request's other events for up to ``timeout`` seconds."""
        if self.req is None:
            self.registry.wait(self.registry.version, timeout)
            return
        try:
            ev = self.req.events.get(timeout=timeout)
        except queue.Empty:
            if self.flush_fn is not None:
                self.flush_fn()
            return
        if ev[0] == "debug":
            content = ev[2] if len(ev) > 2 else {}
            if isinstance(content, dict) and content.get("kind") == "note":
                self._warn(content.get("text", ""))
            return
        if self.on_event_fn is not None:
            self.on_event_fn(ev)

    def _drain(self) -> None:
        """Show every event of the request that already arrived (before a prompt)."""
        if self.req is None:
            return
        while not self.req.events.empty():
            self._pump(0)
        if self.flush_fn is not None:
            self.flush_fn()

    def _gather(self) -> None:
        """Wait briefly until the cell's other ranks paused or finished too."""
        if self.req is None:
            return
        start = last = time.monotonic()
        version = self.registry.version
        while True:
            paused = {s.rank for s in self._paused()}
            outstanding = [r for r in self.req.ranks
                           if r not in self.req.replies and r not in paused]
            now = time.monotonic()
            if (not outstanding or self.req.done() or now - last > GATHER_QUIET
                    or now - start > GATHER_MAX):
                self._drain()
                return
            self._pump(0.05)
            if self.registry.version != version:
                version, last = self.registry.version, time.monotonic()

    def _run(self, targets: list[DebugSession], line: str) -> list[DebugSession]:
        """Send ``line`` to every target; wait for each to prompt again, end or run on.

        Returns the targets' sessions as they are then. A target still
        running after ``patience`` seconds while other ranks are paused is
        left running (it may be waiting for them). A target silent for
        ``answer_timeout`` seconds is given up (:meth:`_give_up`).
        """
        seq0 = {s.sid: s.seq for s in targets}
        for s in targets:
            self.registry.send(s, line)
        sent = time.monotonic()
        news = {s.sid: (s.seq, sent) for s in targets}  # latest seq, when it came
        given_up: set[str] = set()
        while True:
            now = time.monotonic()
            current = [self.registry.get(t.sid) or t for t in targets]
            for s in current:
                if news[s.sid][0] != s.seq:
                    news[s.sid] = (s.seq, now)
            waiting = [s for s in current
                       if s.state != "ended" and not (s.state == "paused" and s.seq > seq0[s.sid])
                       and s.sid not in given_up]
            if not waiting:
                return current
            if self.req is not None and self.req.done():
                return current
            # silent since the line was sent (in a cell: the cell's request bounds
            # a rank that runs on; in %mesh debug, nothing else does)
            stalled = [s for s in waiting if now - news[s.sid][1] > self.answer_timeout
                       and (s.seq == seq0[s.sid] or self.req is None)]
            if stalled:
                self._give_up(stalled, line, seq0)
                given_up.update(s.sid for s in stalled)
                continue
            running = [s for s in waiting if s.state == "running" and s.seq > seq0[s.sid]]
            if running and len(running) == len(waiting):
                others = [p for p in self._paused() if p.sid not in seq0]
                if others and all(now - s.since > self.patience for s in running):
                    ranks = sorted({s.rank for s in running})
                    self._warn(f"{ranks_label(ranks)} still running (it may wait for the paused "
                               f"{ranks_label(sorted({p.rank for p in others}))}, e.g. in a "
                               "collective); back to the prompt")
                    return current
            self._pump(0.05)

    def _give_up(self, stalled: list[DebugSession], line: str, seq0: dict[str, int]) -> None:
        """Stop waiting for sessions that stayed silent after ``line``; say so."""
        secs = f"{self.answer_timeout:g} s"
        for s in sorted(stalled, key=lambda s: s.rank):
            who = f"rank {s.rank} (session {s.sid})"
            if s.seq > seq0[s.sid]:  # %mesh debug: it runs on (n, c with breakpoints)
                self._write(f"{who} still runs after {line.strip()!r}: no prompt for {secs}; "
                            "back to the prompt (%mesh debug again once it pauses, or "
                            "interrupt the kernel)")
                continue
            self._silent[s.sid] = s.seq
            if self.req is None:
                todo = ("Interrupt the kernel to stop this console, or run  %mesh debug  "
                        "again later to retry that rank.")
            else:
                todo = ("The cell waits for that rank as for running code and prompts again "
                        "if it pauses; interrupt the kernel to stop it.")
            self._warn(f"{who} did not answer {line.strip()!r} within {secs} although the "
                       "rank is alive: the command may still run there, or its debugger is "
                       f"gone. Not waiting for it any more. {todo}")

    # ------------------------------------------------------------ entry points
    def on_event(self, ev: tuple) -> None:
        """Handle one ``("debug", rank, content)`` event of the running cell."""
        content = ev[2] if len(ev) > 2 else {}
        if isinstance(content, dict) and content.get("kind") == "note":
            self._warn(content.get("text", ""))
            return
        self.serve()

    def serve(self) -> None:
        """Serve the cell's paused ranks until none is paused (cell mode)."""
        if not self._paused():
            return
        t0 = time.monotonic()
        try:
            self._gather()
            while True:
                paused = self._paused()
                if not paused or (self.req is not None and self.req.done()):
                    return  # (once every rank answered the cell, none of its code is paused)
                if self.interrupted:
                    paused = self._paused(silent=True)
                    self.registry.release(paused)
                    self._await_leave(paused)
                    continue
                if not self.allow_stdin:
                    self._skip(paused)
                    continue
                if len(paused) == 1 and not self.console_mode:
                    self._announce(paused)
                    self._attached(paused[0])
                else:
                    if not self.console_mode:
                        self._write(f"{ranks_text(paused)} paused; (mesh-debug) console: "
                                    "list, attach R, cast RANKS CMD, continue, quit, help")
                    self.console_mode = True
                    self._announce(paused, discard=True)
                    self._prompt_console()
        except KeyboardInterrupt:
            self._interrupt()
            raise
        finally:
            self.paused_s += time.monotonic() - t0
            self.console_mode = False
            self._maybe_hint()

    def run(self, wait: float = 0.0) -> None:
        """Serve every paused rank of the mesh until none is paused or the user detaches
        (``%mesh debug``).

        Parameters
        ----------
        wait : float
            Seconds to wait for a rank to pause when none is paused yet.
        """
        deadline = time.monotonic() + wait
        while not self._paused() and time.monotonic() < deadline:
            self._pump(0.05)
        paused = self._paused()
        if not paused:
            self._write("no rank is paused in a debugger")
            return
        self.console_mode = True
        self._write(f"{ranks_text(paused)} paused; type  help  for the commands")
        try:
            while True:
                paused = self._paused()
                if not paused:
                    if not self._still_silent():  # (else the warning said it)
                        self._write("no rank is paused any more")
                    return
                self._announce(paused, discard=True)
                self._prompt_console()
        except _Leave:
            left = self._paused()
            if left:
                self._write(f"left the console; {ranks_text(left)} still paused "
                            "(%mesh debug to come back)")
        except KeyboardInterrupt:
            self._interrupt()
            raise

    # ------------------------------------------------------------ modes
    def _announce(self, paused: list[DebugSession], discard: bool = False) -> None:
        """Say which ranks newly paused (``discard``: drop their pending pdb text, whose
        location the line already names)."""
        for s in paused:
            if self._announced.get(s.sid) == s.seq:
                continue
            self._announced[s.sid] = s.seq
            if discard:
                self.registry.take_text(s)
            thread = f" (thread {s.thread})" if s.thread and s.thread != "MainThread" else ""
            self._write(f"rank {s.rank} paused at {s.where}{thread}")

    def _skip(self, paused: list[DebugSession]) -> None:
        for s in paused:
            if s.rank not in self._skipped:
                self._skipped.add(s.rank)
                self._warn(f"rank {s.rank}: breakpoint at {s.where} skipped: this frontend "
                           "cannot answer input requests (allow_stdin is false); the rank runs "
                           "on (later breakpoints of this rank in this cell are skipped too)")
        self.registry.release(paused)
        self._await_leave(paused)

    def _await_leave(self, sessions: list[DebugSession], timeout: float = 10.0) -> None:
        seq0 = {s.sid: s.seq for s in sessions}
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.req is not None and self.req.done():
                return
            if all((self.registry.get(t.sid) or t).seq > seq0[t.sid] for t in sessions):
                return
            self._pump(0.05)

    def _interrupt(self) -> None:
        self.interrupted = True
        paused = self._paused(silent=True)
        if paused:
            self.registry.release(paused)
            self._warn(f"interrupted: {ranks_text(paused)} released from the debugger")

    def _ask(self, prompt: str) -> str | None:
        self._drain()
        try:
            return self.input_fn(prompt)
        except EOFError:
            return None

    def _attached(self, s: DebugSession) -> None:
        """pdb on one session until it runs on, ends, or the user detaches."""
        self._write(self.registry.take_text(s) or s.entry)
        while True:
            cur = self.registry.get(s.sid)
            if cur is None or cur.state != "paused" or (self.req is not None and self.req.done()):
                return
            others = [p for p in self._paused()
                      if p.sid != cur.sid and self._announced.get(p.sid) != p.seq]
            if others:
                self._announce(others)
                self._write(f"(detach to see every paused rank; rank {cur.rank} is attached)")
            line = self._ask(cur.prompt or f"(Pdb rank {cur.rank}) ")
            if line is None or line.strip() == "detach":
                self.console_mode = True
                self._write("detached; (mesh-debug) console (help for commands)")
                return
            after = self._run([cur], line)[0]
            self._show(after, prefix=False)
            self._announced[after.sid] = after.seq
            if after.state != "paused" or self._silent.get(after.sid) == after.seq:
                return

    def _show(self, s: DebugSession, prefix: bool) -> None:
        text = self.registry.take_text(s)
        if prefix and text:
            text = "".join(f"[{s.rank}] {ln}\n" for ln in text.rstrip("\n").split("\n"))
        self._write(text)
        if s.state == "ended":
            self._announced.pop(s.sid, None)
            if s.reason == "quit":
                self._quit_ranks.add(s.rank)
                if self.req is None:  # in a cell, report_quits says it when the cell ends
                    self._write(f"rank {s.rank}: quit; its code stops with BdbQuit")
            elif s.reason == "returned":
                self._write(f"rank {s.rank}: its code returned; debugging ended")
            elif s.reason == "the rank died":
                self._warn(f"rank {s.rank} died while being debugged")

    def _prompt_console(self) -> None:
        line = self._ask("(mesh-debug) ")
        if line is None:
            if self.req is None:
                raise _Leave
            line = "continue"
        cmd, _, rest = line.strip().partition(" ")
        rest = rest.strip()
        paused = self._paused()
        if not cmd:
            return
        if cmd in ("list", "ls"):
            self._list(paused)
        elif cmd == "attach":
            target = self._one(rest, paused)
            if target is not None:
                self._attached(target)
        elif cmd == "detach":
            if self.req is None:
                raise _Leave
            self._write("the cell waits for its paused ranks: continue or quit them "
                        "(or attach R and use pdb)")
        elif cmd == "cast":
            spec, _, command = rest.partition(" ")
            if not spec or not command.strip():
                self._write("usage: cast RANKS CMD   e.g.  cast 0:2 p rank")
                return
            self._cast(spec, command.strip(), paused)
        elif cmd in ("continue", "c", "cont"):
            self._all(paused, "c")
        elif cmd in ("quit", "q", "exit"):
            self._all(paused, "q")
        elif cmd in ("help", "h", "?"):
            self._write(HELP)
        else:
            self._write(f"unknown command {cmd!r}; type  help  for the commands "
                        "(attach R for pdb commands)")

    def _list(self, paused: list[DebugSession]) -> None:
        rows = [("rank", "host", "function", "where")]
        for s in paused:
            thread = f" [{s.thread}]" if s.thread and s.thread != "MainThread" else ""
            rows.append((str(s.rank), self._host(s.rank), s.function + thread,
                         location(s.filename, s.lineno)))
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        self._write("\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                              for r in rows))

    def _select(self, spec: str, paused: list[DebugSession]) -> list[DebugSession] | None:
        if spec.strip() == "all":
            return list(paused)
        try:
            ranks = parse_debug_ranks(spec, self.mesh.root.shape, self.mesh.world_size)
        except RankSpecError as e:
            self._write(str(e))
            return None
        chosen = [s for s in paused if s.rank in ranks]
        missing = sorted(set(ranks) - {s.rank for s in chosen})
        if missing:
            self._write(f"not paused: {compact_ranks(missing)}")
        return chosen

    def _one(self, spec: str, paused: list[DebugSession]) -> DebugSession | None:
        if not spec:
            self._write("usage: attach R   e.g.  attach 2")
            return None
        chosen = self._select(spec, paused)
        if not chosen:
            return None
        if len({s.rank for s in chosen}) > 1:
            self._write("attach takes one rank; use  cast RANKS CMD  for several")
            return None
        return chosen[0]

    def _cast(self, spec: str, command: str, paused: list[DebugSession]) -> None:
        chosen = self._select(spec, paused)
        if chosen:
            self._broadcast(chosen, command)

    def _all(self, paused: list[DebugSession], command: str) -> None:
        if paused:
            verb = "continue" if command == "c" else "quit"
            self._write(f"{ranks_text(paused)}: {verb}")
            self._broadcast(paused, command)

    def _broadcast(self, sessions: list[DebugSession], command: str) -> None:
        after = self._run(sessions, command)
        for s in sorted(after, key=lambda s: s.rank):
            self._show(s, prefix=True)
            self._announced[s.sid] = s.seq

    # ------------------------------------------------------------ hints
    def _maybe_hint(self, delay: float = 3.0) -> None:
        """After a quit, say so if the cell's other ranks keep running (a collective
        may wait for the ranks that quit); never blocks."""
        req = self.req
        if req is None or not self._quit_ranks or self._hint_started or req.done():
            return
        self._hint_started = True
        quit_ranks = sorted(self._quit_ranks)
        watched = self.on_quit_fn is not None and self.on_quit_fn(quit_ranks)
        advice = ("a collective that waits for it is aborted; interrupt the kernel to stop "
                  "them" if watched else "if they wait for it (a collective), interrupt the "
                  "kernel to stop them")

        def check() -> None:
            if req.wait(delay):
                return
            waiting = [r for r in req.ranks if r not in req.replies and r not in quit_ranks]
            if waiting and not self.registry.sessions("paused", parent=req.id):
                req.put_event(("debug", -1, {
                    "kind": "note",
                    "text": f"{ranks_label(waiting)} still running after "
                            f"{ranks_label(quit_ranks)} quit; {advice}",
                }))

        threading.Thread(target=check, name="monarch-debug-hint", daemon=True).start()
