"""Helpers for tests: a real monarch kernel through ``jupyter_client``.

:class:`KernelSession` starts the installed ``monarch`` kernelspec with a
``KernelManager``, runs code through a blocking client, and collects every
iopub message of that execution with its arrival time. Every wait has a
timeout. :func:`worker_pids` lists live worker processes for leak checks,
:func:`assert_no_workers` waits for a controller's workers to be gone.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psutil

__all__ = ["ExecResult", "KernelSession", "assert_no_workers", "wait_for", "worker_pids"]


def wait_for(predicate: Callable[[], Any], timeout: float, interval: float = 0.05,
             what: str = "condition") -> Any:
    """Poll ``predicate`` until it returns something true, or raise TimeoutError."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached within {timeout} s")
        time.sleep(interval)


def is_worker_cmdline(cmd: list[str]) -> bool:
    """Whether argv ``cmd`` runs a mesh worker (``python -m monarch_kernel worker ...``)."""
    return any(cmd[i:i + 3] == ["-m", "monarch_kernel", "worker"] for i in range(len(cmd)))


def worker_pids(parent: int | None = None) -> list[int]:
    """Pids of live mesh worker processes (``python -m monarch_kernel worker``;
    optionally only those started with ``--controller-pid parent``)."""
    out = []
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        cmd = p.info.get("cmdline") or []
        if (is_worker_cmdline(cmd) and p.info.get("status") != psutil.STATUS_ZOMBIE
                and (parent is None or str(parent) in cmd)):
            out.append(p.info["pid"])
    return out


def assert_no_workers(controller_pid: int, timeout: float = 10.0) -> None:
    """Wait until no worker of ``controller_pid`` is alive.

    Raises
    ------
    AssertionError
        If some are still alive after ``timeout`` seconds; those are killed
        (SIGKILL) first, so that they do not leak into later tests.
    """
    deadline = time.monotonic() + timeout
    while worker_pids(controller_pid):
        if time.monotonic() > deadline:
            left = worker_pids(controller_pid)
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            raise AssertionError(f"worker processes left behind: {left}")
        time.sleep(0.05)


@dataclass
class ExecResult:
    """Everything one ``execute_request`` produced."""

    reply: dict[str, Any]
    messages: list[tuple[float, dict[str, Any]]] = field(default_factory=list)
    reply_time: float = 0.0

    @property
    def status(self) -> str:
        return self.reply["content"]["status"]

    def stream(self, name: str | None = None) -> str:
        """Concatenated stream text (``name``: stdout / stderr / both)."""
        return "".join(
            m["content"]["text"] for _, m in self.messages
            if m["msg_type"] == "stream" and (name is None or m["content"]["name"] == name)
        )

    def result_text(self) -> str:
        """``text/plain`` of the execute_result, or ""."""
        for _, m in self.messages:
            if m["msg_type"] == "execute_result":
                return m["content"]["data"].get("text/plain", "")
        return ""

    def error(self) -> dict[str, Any] | None:
        for _, m in self.messages:
            if m["msg_type"] == "error":
                return m["content"]
        return None

    def error_text(self) -> str:
        """The error's name, value and traceback without colours (from the
        iopub ``error`` message, or the reply for errors shown as text)."""
        err = self.error()
        if err is None:
            content = self.reply.get("content", {})
            if content.get("status") != "error":
                return ""
            err = {"ename": content.get("ename", ""), "evalue": content.get("evalue", ""),
                   "traceback": content.get("traceback", [])}
        import re

        text = "\n".join([err["ename"], err["evalue"], *err["traceback"]])
        return re.sub(r"\x1b\[[0-9;]*m", "", text)


class KernelSession:
    """A running monarch kernel and a blocking client.

    Parameters
    ----------
    kernel_name : str
        Kernelspec to start (``"monarch"``).
    """

    def __init__(self, kernel_name: str = "monarch", startup_timeout: float = 60) -> None:
        from jupyter_client.manager import KernelManager

        self.km = KernelManager(kernel_name=kernel_name)
        self.km.start_kernel()
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=startup_timeout)

    @property
    def pid(self) -> int:
        return self.km.provisioner.process.pid  # type: ignore[union-attr]

    def execute(self, code: str, timeout: float = 120, allow_stdin: bool = False,
                on_input: Callable[[str], str | None] | None = None,
                on_message: Callable[[dict[str, Any]], None] | None = None) -> ExecResult:
        """Run ``code``; collect its iopub messages until the kernel is idle.

        ``on_input(prompt)`` answers the kernel's input requests (``input()``,
        the debugger's prompts); returning None leaves the prompt unanswered
        (e.g. to interrupt the kernel instead).

        Raises
        ------
        TimeoutError
            If the execution does not finish within ``timeout`` seconds.
        """
        msg_id = self.kc.execute(code, allow_stdin=allow_stdin or on_input is not None)
        deadline = time.monotonic() + timeout
        res = ExecResult(reply={})
        idle = False
        while not (idle and res.reply):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"execution did not finish within {timeout} s: {code[:80]!r}")
            if on_input is not None:
                try:
                    req = self.kc.get_stdin_msg(timeout=0.01)
                except queue.Empty:
                    pass
                else:
                    answer = on_input(req["content"]["prompt"])
                    if answer is not None:  # None: leave the prompt unanswered
                        self.kc.input(answer)
            if not res.reply:
                try:
                    rep = self.kc.get_shell_msg(timeout=0.01)
                except queue.Empty:
                    pass
                else:
                    if rep["parent_header"].get("msg_id") == msg_id:
                        res.reply = rep
                        res.reply_time = time.monotonic()
            try:
                msg = self.kc.get_iopub_msg(timeout=0.05)
            except queue.Empty:
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            if on_message is not None:
                on_message(msg)
            if msg["msg_type"] == "status":
                idle = msg["content"]["execution_state"] == "idle"
                continue
            res.messages.append((time.monotonic(), msg))
        if res.reply.get("content", {}).get("status") == "error":
            self.sync_shell(max(deadline - time.monotonic(), 10.0))
        return res

    def sync_shell(self, timeout: float = 10) -> None:
        """Make a round trip through the shell channel (a ``kernel_info`` request).

        After an error reply, ipykernel aborts the execute requests that reach it
        before it has reset its abort flag (``stop_on_error``). ipykernel 6 queues
        that reset only after the idle status is out, so an execute request sent
        at the idle status can reach the kernel first and come back ``aborted``;
        once a later request has had its reply, the reset is queued ahead of
        anything sent after. :meth:`execute` calls this after an error reply.

        Raises
        ------
        TimeoutError
            If the reply does not come within ``timeout`` seconds.
        """
        msg_id = self.kc.kernel_info()
        _read_until(self.kc.get_shell_msg,
                    lambda rep: rep["parent_header"].get("msg_id") == msg_id,
                    timeout, "kernel_info reply")

    def interrupt(self) -> None:
        self.km.interrupt_kernel()

    def wait_idle(self, msg_id: str, timeout: float = 10) -> None:
        """Read iopub until the kernel's idle status for request ``msg_id``.

        After an error reply, ipykernel aborts the execute requests that reach
        it before it has reset its abort flag (``stop_on_error``); one sent as
        soon as the reply came can lose that race, one sent after this cannot
        (this ends with :meth:`sync_shell`, after which the reset is queued).

        Raises
        ------
        TimeoutError
            If no idle status for ``msg_id`` came within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        _read_until(self.kc.get_iopub_msg,
                    lambda msg: (msg["parent_header"].get("msg_id") == msg_id
                                 and msg["msg_type"] == "status"
                                 and msg["content"]["execution_state"] == "idle"),
                    timeout, f"idle status for {msg_id}")
        self.sync_shell(max(deadline - time.monotonic(), 10.0))

    def shutdown(self) -> None:
        """Shut the kernel down (it stops its meshes) and close the channels."""
        try:
            self.kc.stop_channels()
        finally:
            if self.km.has_kernel:
                self.km.shutdown_kernel(now=False)


def _read_until(get: Any, match: Any, timeout: float, what: str) -> dict:
    """Read messages with ``get`` (a jupyter_client channel getter) until one
    ``match``es it; that message.

    Raises
    ------
    TimeoutError
        Naming ``what`` when none matched within ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no {what} within {timeout} s")
        try:
            msg = get(timeout=min(left, 0.2))
        except queue.Empty:
            continue
        if match(msg):
            return msg
