"""The usage of the ``%mesh`` magics, and the parser of their arguments."""

from __future__ import annotations

import argparse
import re
from typing import Any

from IPython.core.error import UsageError

__all__ = ["USAGE", "MagicParser", "magic_parser", "usage_of"]

USAGE = """\
%mesh spawn N|HxP [--dist gloo|nccl|none] [--launcher local|slurm] [--bind ADDR] [--name mesh]
    [--restart never|on-failure] [--max-restarts K] [--heartbeat S] [--telemetry-interval S]
    Slurm: [--partition P] [--time T] [--account A] [--gpus-per-node G] [--nodes N] [--sbatch ARGS]
%%mesh [--ranks SPEC] [--timeout SECONDS]     run the cell on every rank (or SPEC: 0, 1,3, 0:2)
%mesh push NAME [NAME ...]                   copy notebook variables to every rank
x = %mesh pull NAME                          a ValueMesh of NAME from every rank
r = %mesh ref NAME                           a handle to NAME; the values stay on the ranks
%mesh show REF|NAME [--values K]             per rank: type, shape, dtype, device, K values
%mesh status                                 rank, host, pid, state, cpu, memory, gpu
%mesh dashboard [--interval S] [--history S] [--layout auto|rows|heatmap]   live widget
%mesh restart RANKS                          replace ranks (3, 1,2, 0:4, all) with fresh processes
%mesh debug [--wait S] [--post-mortem RANK]  console for paused ranks (breakpoint() on ranks)
%mesh use NAME                               make mesh NAME (spawn --name, or a variable
                                             holding a spawn_procs mesh) the current one
%mesh stop [--all]                           stop the current mesh's workers (--all: every mesh)"""


def usage_of(name: str) -> str:
    """The usage line of one command (``"%mesh spawn"``, ``"%%mesh"``), without its help."""
    for line in USAGE.splitlines():
        head = re.split(r"\s{2,}", line.strip())[0]
        if head.startswith(f"{name} ") or head == name or f"= {name} " in head:
            return head
    return "see  %mesh help"


class MagicParser(argparse.ArgumentParser):
    """An argument parser of a ``%mesh`` command whose errors raise ``UsageError``
    naming the command and its usage line (IPython shows them without a traceback)."""

    def error(self, message: str) -> Any:
        cmd = self.prog.split()[-1]
        name = cmd if cmd.startswith("%") else f"%mesh {cmd}"
        raise UsageError(f"{name}: {message}. Usage: {usage_of(name)}")

    def exit(self, status: int = 0, message: str | None = None) -> Any:
        raise UsageError(message or USAGE)


def magic_parser(name: str) -> MagicParser:
    """The parser of ``%mesh name`` (``name``: ``"spawn"``, ..., or ``"%%mesh"``)."""
    # exit_on_error stays True: bad values (type=float, choices) then reach error() above
    return MagicParser(prog=f"%mesh {name}", add_help=False)
