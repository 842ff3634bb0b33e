#!/usr/bin/env python3
"""Execute a notebook headless through a real Jupyter kernel and print what it shows.

Usage::

    python scripts/run_notebook.py notebooks/01_quickstart.ipynb [--kernel monarch]
                                   [--timeout 600] [--out build/notebooks]
                                   [--stdin-file notebooks/04_debugging.stdin]

Each cell's source is printed (shortened) as it starts, and its outputs
(stream text, the text/plain of results and displays, errors with their
tracebacks) as they arrive, so a rank's live output shows up live here too.
The executed notebook is written to ``build/notebooks/<name>``. The exit
status is 0 when every cell ran, 1 when a cell failed (or the kernel died).

``--stdin-file FILE`` answers the kernel's input requests (``input()``, the
debugger's ``(Pdb rank R)`` and ``(mesh-debug)`` prompts) with the file's
lines, in order: one answer per line, lines starting with ``#`` skipped.
Each prompt and its answer are echoed and kept in the cell's outputs. A
prompt with no line left is answered with end-of-file and fails the run, as
do lines left over at the end. Without it, input requests are refused
(nbclient's default), so a ``breakpoint()`` on a rank is skipped with a warning.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import textwrap
from pathlib import Path
from typing import Any

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, DeadKernelError

ROOT = Path(__file__).resolve().parent.parent
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
COLOR = sys.stdout.isatty()


def _plain(text: str) -> str:
    return text if COLOR else ANSI.sub("", text)


def _write(text: str) -> None:
    sys.stdout.write(_plain(text))
    sys.stdout.flush()


class PrintingClient(NotebookClient):
    """A NotebookClient that echoes cell sources and outputs to stdout as they come,
    and restarts the kernel before a cell tagged ``restart-kernel-before`` (as
    Kernel > Restart does: notebooks/07_durable_mesh.ipynb)."""

    async def async_execute_cell(self, cell: Any, cell_index: int, *args: Any,
                                 **kwargs: Any) -> Any:
        if "restart-kernel-before" in (cell.get("metadata", {}).get("tags") or []):
            assert self.km is not None and self.kc is not None
            _write("\n----- restarting the kernel\n")
            await self.km.restart_kernel(now=False)
            await self.kc.wait_for_ready(timeout=self.startup_timeout)
        return await super().async_execute_cell(cell, cell_index, *args, **kwargs)

    def process_message(self, msg: dict[str, Any], cell: Any, cell_index: int) -> Any:
        kind = msg["msg_type"]
        content = msg["content"]
        if kind == "stream":
            _write(content.get("text", ""))
        elif kind in ("execute_result", "display_data"):
            data = content.get("data", {})
            text = data.get("text/plain")
            if text is None:
                text = "<" + ", ".join(sorted(data)) + ">"
            prefix = f"Out[{content['execution_count']}]: " if kind == "execute_result" else ""
            _write(prefix + text + "\n")
        elif kind == "error":
            tb = content.get("traceback") or []
            _write(
                "\n".join(tb) + "\n" if tb else f"{content.get('ename')}: {content.get('evalue')}\n"
            )
        return super().process_message(msg, cell, cell_index)


class ScriptedStdinClient(PrintingClient):
    """A PrintingClient whose kernel may ask for input; answers come from a list of lines."""

    def __init__(self, nb: Any, lines: list[str], **kwargs: Any) -> None:
        super().__init__(nb, **kwargs)
        self.lines = list(lines)
        self.stdin_errors: list[str] = []

    async def async_start_new_kernel_client(self) -> Any:
        kc = await super().async_start_new_kernel_client()
        kc.allow_stdin = True  # nbclient turns it off; the scripted lines answer
        return kc

    async def async_execute_cell(self, cell: Any, cell_index: int, *args: Any,
                                 **kwargs: Any) -> Any:
        answering = asyncio.ensure_future(self._answer_stdin(cell))
        try:
            return await super().async_execute_cell(cell, cell_index, *args, **kwargs)
        finally:
            answering.cancel()

    async def _answer_stdin(self, cell: Any) -> None:
        while True:
            msg = await self.kc.stdin_channel.get_msg(timeout=None)
            if msg["msg_type"] != "input_request":
                continue
            prompt = msg["content"].get("prompt", "")
            await asyncio.sleep(0.2)  # let the output before the prompt arrive first
            if self.lines:
                answer, shown = self.lines.pop(0), None
            else:
                answer, shown = "\x04", "<end of file>"
                self.stdin_errors.append(f"no scripted line left for the prompt {prompt!r}")
            text = f"{prompt}{shown or answer}\n"
            _write(text)
            cell.outputs.append(nbformat.v4.new_output("stream", name="stdout", text=text))
            self.kc.input(answer)


def _read_stdin_file(path: Path) -> list[str]:
    return [ln for ln in path.read_text().splitlines() if not ln.startswith("#")]


def _on_cell_start(cell: Any, cell_index: int, **_: Any) -> None:
    if cell.get("cell_type") != "code":
        return
    lines = cell.source.splitlines() or [""]
    shown = lines[:6] + ([f"... ({len(lines) - 6} more lines)"] if len(lines) > 6 else [])
    _write(
        f"\n----- cell {cell_index} "
        + "-" * 50
        + "\n"
        + textwrap.indent("\n".join(shown), "  >> ")
        + "\n"
    )


def main(argv: list[str] | None = None) -> int:
    """Run the notebook; see the module docstring. Returns the exit status."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("notebook", type=Path)
    p.add_argument("--kernel", default="monarch", help="kernelspec name (default: monarch)")
    p.add_argument("--timeout", type=int, default=600, help="seconds per cell (default: 600)")
    p.add_argument(
        "--out",
        type=Path,
        default=ROOT / "build" / "notebooks",
        help="folder for the executed notebook (default: build/notebooks)",
    )
    p.add_argument("--stdin-file", type=Path, default=None,
                   help="answer input requests with this file's lines (see above)")
    a = p.parse_args(argv)

    nb_path = a.notebook.resolve()
    nb = nbformat.read(nb_path, as_version=4)
    options: dict[str, Any] = {
        "kernel_name": a.kernel,
        "timeout": a.timeout,
        "on_cell_start": _on_cell_start,
        "resources": {"metadata": {"path": str(nb_path.parent)}},
    }
    if a.stdin_file is not None:
        client: PrintingClient = ScriptedStdinClient(nb, _read_stdin_file(a.stdin_file),
                                                     **options)
    else:
        client = PrintingClient(nb, **options)
    _write(f"Executing {nb_path} with kernel {a.kernel!r}\n")
    status = 0
    try:
        client.execute()
    except CellExecutionError as e:
        # The traceback was already printed as it arrived.
        _write(f"\nFAILED: a cell raised {e.ename}: {e.evalue}\n")
        status = 1
    except DeadKernelError as e:
        _write(f"\nFAILED: the kernel died: {e}\n")
        status = 1
    except TimeoutError as e:
        _write(f"\nFAILED: timed out: {e}\n")
        status = 1
    finally:
        a.out.mkdir(parents=True, exist_ok=True)
        out = a.out / nb_path.name
        nbformat.write(nb, out)
        _write(f"\nExecuted notebook written to {out}\n")
    if isinstance(client, ScriptedStdinClient) and (client.stdin_errors or client.lines):
        for err in client.stdin_errors:
            _write(f"FAILED: {err}\n")
        if client.lines:
            _write(f"FAILED: {len(client.lines)} scripted stdin lines were not used: "
                   f"{client.lines[:5]}\n")
        status = 1
    _write("OK: every cell ran\n" if status == 0 else "")
    return status


if __name__ == "__main__":
    sys.exit(main())
