"""The ``%mesh`` commands, each defined once: its arguments, usage and help.

Every command of the ``%mesh`` line magic (and the options of the ``%%mesh``
cell magic) is one :class:`Command` in :data:`COMMANDS`. From that one
definition come its argparse parser (:meth:`Command.parse`), its usage line
in error messages (:meth:`Command.usage`), its lines in ``%mesh help``
(:func:`usage_text`) and its own help (``%mesh help spawn``,
:meth:`Command.help_text`). The defaults of ``%mesh spawn``, ``restart``,
``dashboard`` and ``show`` are read from the signatures of the functions they
call (:func:`~monarch_kernel.mesh.procmesh.spawn_procs`,
:meth:`ProcMesh.restart <monarch_kernel.mesh.procmesh.ProcMesh.restart>`,
...), so the magic and the Python API cannot drift apart.

Bad input raises IPython's ``UsageError`` whose message is one line:
``"%mesh CMD: what is wrong. Usage: <the command's usage line>"``.
"""

from __future__ import annotations

import argparse
import inspect
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from IPython.core.error import UsageError

from monarch_kernel.mesh.procmesh import ProcMesh, attach, spawn_procs
from monarch_kernel.mesh.supervision import RESTART_POLICIES
from monarch_kernel.tensors.handles import show
from monarch_kernel.util.numbers import check_number, parse_duration

__all__ = ["CELL", "COMMANDS", "COUNT", "DURATION", "POSITIVE_SECONDS", "SECONDS",
           "SLURM_OPTIONS", "Arg", "Command", "MeshArgumentParser", "command", "duration",
           "number", "usage_text"]


def _default(fn: Callable[..., Any], name: str) -> Any:
    """The default of parameter ``name`` of ``fn`` (one place for each default)."""
    return inspect.signature(fn).parameters[name].default


@dataclass(frozen=True)
class Arg:
    """One argument of a command: ``ArgumentParser.add_argument(*flags, **options)``.

    ``metavar`` (in ``options``) names the value in usage; choices are shown as
    ``a|b|c``.
    """

    flags: tuple[str, ...]
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def positional(self) -> bool:
        return not self.flags[0].startswith("-")

    def usage(self) -> str:
        """This argument in a usage line: ``NAME``, ``NAME [NAME ...]``, ``[--opt VALUE]``."""
        o = self.options
        value = o.get("metavar") or ("|".join(o["choices"]) if "choices" in o else
                                     self.flags[0].lstrip("-").upper().replace("-", "_"))
        if self.positional:
            if o.get("nargs") == "?":
                return f"[{value}]"
            return f"{value} [{value} ...]" if o.get("nargs") == "+" else value
        if o.get("action") in ("store_true", "store_false"):
            return f"[{self.flags[0]}]"
        return f"[{self.flags[0]} {value}]"


def arg(*flags: str, **options: Any) -> Arg:
    """An :class:`Arg` (``add_argument``'s own call shape)."""
    return Arg(flags, options)


class MeshArgumentParser(argparse.ArgumentParser):
    """An argparse parser whose errors are one-line ``UsageError`` s naming the
    command and its usage line, never a ``SystemExit``."""

    def __init__(self, command: Command) -> None:
        # exit_on_error stays True: bad values (type=float, choices) then reach error()
        super().__init__(prog=command.prog, add_help=False, usage=command.usage(),
                         description=command.help)
        self.command = command

    def error(self, message: str) -> Any:
        raise UsageError(f"{self.command.prog}: {message}. Usage: {self.command.usage()}")

    def exit(self, status: int = 0, message: str | None = None) -> Any:
        raise UsageError(message or self.command.usage())


@dataclass(frozen=True)
class Command:
    """One ``%mesh`` command.

    Attributes
    ----------
    name : str
        ``"spawn"`` for ``%mesh spawn``; ``"%%mesh"`` for the cell magic.
    help : str
        What it does, one line (``%mesh help``).
    lines : tuple of (str, tuple of Arg)
        Its arguments, by usage line: a label (``""`` or e.g. ``"Slurm:"``) and
        the arguments shown on that line. The first line is the usage in errors.
    assigns : str
        What the command's value is assigned to in its usage (``"x"`` for
        ``x = %mesh pull NAME``), or ``""``.
    parsed : bool
        False for commands that read their words themselves (names to push or
        pull): their arguments are described here but not parsed by argparse.
    """

    name: str
    help: str
    lines: tuple[tuple[str, tuple[Arg, ...]], ...] = ()
    assigns: str = ""
    parsed: bool = True

    @property
    def prog(self) -> str:
        return self.name if self.name.startswith("%") else f"%mesh {self.name}"

    @property
    def args(self) -> tuple[Arg, ...]:
        return tuple(a for _, line in self.lines for a in line)

    def usage_lines(self) -> list[str]:
        """The whole usage: the first line, then one indented line per further group."""
        head = f"{self.assigns} = " if self.assigns else ""
        out = []
        for i, (label, line) in enumerate(self.lines or (("", ()),)):
            words = [a.usage() for a in line]
            if i == 0:
                out.append(" ".join([head + self.prog, *words]))
            else:
                out.append("    " + " ".join([label, *words] if label else words))
        return out

    def usage(self) -> str:
        """The first usage line (``"%mesh spawn N|HxP [--dist gloo|nccl|none] ..."``)."""
        return self.usage_lines()[0]

    def parser(self) -> MeshArgumentParser:
        """A parser of this command's arguments (its errors are ``UsageError``)."""
        p = MeshArgumentParser(self)
        for a in self.args:
            options = dict(a.options)
            if a.positional:  # errors name a missing positional by its dest ("size")
                options.pop("metavar", None)
            p.add_argument(*a.flags, **options)
        return p

    def parse(self, argv: list[str]) -> argparse.Namespace:
        """The arguments in ``argv``.

        Raises
        ------
        UsageError
            For a missing, unknown or malformed argument (one line, with the usage).
        """
        return self.parser().parse_args(argv)

    def help_text(self) -> str:
        """Usage, what it does, and each argument with its help and default."""
        lines = [*self.usage_lines(), "", self.help]
        for a in self.args:
            text = a.options.get("help", "")
            default = a.options.get("default")
            if default not in (None, False) and not a.positional:
                text += f" (default: {default})"
            lines.append(f"  {', '.join(a.flags) if not a.positional else a.usage():<24}{text}")
        return "\n".join(lines)


def number(*, integer: bool = False, **limits: Any) -> Callable[[str], Any]:
    """An argparse ``type`` for a number that :func:`~monarch_kernel.util.numbers.check_number`
    accepts with ``limits`` (``above=True, seconds=True``: positive seconds).

    Text that is no number gives argparse's ``invalid float value: 'abc'``; NaN,
    infinities and numbers out of range give ``argument --x: must be ..., not 'nan'``.
    """
    def parse(text: str) -> Any:
        value = int(text) if integer else float(text)  # (ValueError: "invalid float value")
        try:
            return check_number(value, integer=integer, **limits)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e).replace(f"not {value!r}", f"not {text!r}")
                                             ) from None
    parse.__name__ = "int" if integer else "float"  # (argparse names the type so)
    return parse


def duration(text: str) -> float:
    """An argparse ``type`` for a duration (``30s``, ``10m``, ``1h``, ``2d``, or seconds):
    its seconds, through :func:`~monarch_kernel.util.numbers.parse_duration`; bad text
    gives ``argument --x: must be a positive duration like 30s, ..., not '1w'``."""
    try:
        return parse_duration(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


#: seconds > 0 (timeouts, intervals); seconds >= 0; counts >= 0; a duration > 0 (1h)
POSITIVE_SECONDS = number(above=True, seconds=True)
SECONDS = number(seconds=True)
COUNT = number(integer=True)
DURATION = duration

_SPAWN = spawn_procs

CELL = Command("%%mesh", "run the cell on every rank (or SPEC: 0, 1,3, 0:2)", (
    ("", (arg("--ranks", metavar="SPEC", default=None, help="the ranks to run on"),
          arg("--timeout", metavar="SECONDS", type=POSITIVE_SECONDS, default=None,
              help="interrupt the ranks after this many seconds"))),
))

COMMANDS: tuple[Command, ...] = (
    Command("spawn", "start a mesh of N ranks (HxP: H hosts of P processes)", (
        ("", (arg("size", metavar="N|HxP", help="ranks: N, or HOSTSxPROCS"),
              arg("--dist", choices=["gloo", "nccl", "none"],
                  default=_default(_SPAWN, "dist") or "none",
                  help="torch.distributed backend set up on every rank"),
              arg("--name", metavar="mesh", default=None,
                  help="the notebook variable (and %mesh use name) of the mesh (default: "
                       "mesh); with --detach also its name in  %mesh list"),
              arg("--detach", action="store_true",
                  help="a durable mesh: it outlives this kernel (a restart, a crash) and "
                       "is found again with  %mesh attach NAME; needs --name"),
              arg("--keep-alive", metavar="TIME", type=DURATION, default=None,
                  help="with --detach: how long the ranks wait for a kernel to attach "
                       "before they end themselves (30s, 10m, 1h, 2d; default 1h)"))),
        ("", (arg("--launcher", metavar="local|slurm", default=_default(_SPAWN, "launcher"),
                  help="where the ranks run"),
              arg("--bind", metavar="ADDR", default=_default(_SPAWN, "bind"),
                  help="listen on TCP at this address (default for local meshes: Unix "
                       "sockets only your user can reach)"),
              arg("--restart", choices=list(RESTART_POLICIES), default=_default(_SPAWN, "restart"),
                  help="replace a rank that dies"),
              arg("--max-restarts", metavar="K", type=COUNT,
                  default=_default(_SPAWN, "max_restarts"), help="restart budget of the mesh"))),
        ("", (arg("--heartbeat", metavar="S", type=POSITIVE_SECONDS,
                  default=_default(_SPAWN, "heartbeat"),
                  help="seconds between heartbeats"),
              arg("--timeout", metavar="S", type=POSITIVE_SECONDS,
                  default=_default(_SPAWN, "timeout"),
                  help="seconds the ranks may take to start"),
              arg("--telemetry-interval", metavar="S", type=number(seconds=True, zero="off"),
                  default=_default(_SPAWN, "telemetry_interval"),
                  help="seconds between telemetry samples (0: off)"),
              arg("--force", action="store_true",
                  help="start the ranks even if they are far more than this host's CPUs "
                       "or memory allow"))),
        ("Slurm:", (arg("--partition", metavar="P", help="sbatch --partition"),
                    arg("--time", metavar="T", help="sbatch --time"),
                    arg("--account", metavar="A", help="sbatch --account"),
                    arg("--gpus-per-node", metavar="G", type=COUNT, help="GPUs of each node"),
                    arg("--nodes", metavar="N", type=number(integer=True, minimum=1),
                        help="sbatch --nodes"),
                    arg("--sbatch", metavar="ARGS", help="more sbatch arguments"))),
    )),
    CELL,
    Command("push", "copy notebook variables to every rank", (
        ("", (arg("names", metavar="NAME", nargs="+"),)),), parsed=False),
    Command("pull", "a ValueMesh of NAME from every rank", (
        ("", (arg("name", metavar="NAME"),)),), assigns="x", parsed=False),
    Command("ref", "a handle to NAME; the values stay on the ranks", (
        ("", (arg("name", metavar="NAME"),)),), assigns="r", parsed=False),
    Command("show", "per rank: type, shape, dtype, device, K values", (
        ("", (arg("target", metavar="REF|NAME", help="a handle, or a variable of the ranks"),
              arg("--values", metavar="K", type=COUNT, default=_default(show, "preview"),
                  help="values shown of each rank"))),)),
    Command("status", "rank, host, pid, state, cpu, memory, gpu", parsed=False),
    Command("dashboard", "live widget", (
        ("", (arg("--interval", metavar="S", type=POSITIVE_SECONDS,
                  default=_default(ProcMesh.dashboard, "interval"), help="seconds between updates"),
              arg("--history", metavar="S", type=POSITIVE_SECONDS,
                  default=_default(ProcMesh.dashboard, "history"), help="seconds of history"),
              arg("--layout", choices=["auto", "rows", "heatmap"],
                  default=_default(ProcMesh.dashboard, "layout"), help="rows or a heat map"))),)),
    Command("restart", "replace ranks (3, 1,2, 0:4, all) with fresh processes", (
        ("", (arg("ranks", metavar="RANKS", help="a rank spec: 3, 1,2, 0:4 or all"),
              arg("--timeout", metavar="S", type=POSITIVE_SECONDS,
                  default=_default(ProcMesh.restart, "timeout"),
                  help="seconds the new ranks may take to start"))),)),
    Command("debug", "console for paused ranks (breakpoint() on ranks)", (
        ("", (arg("--wait", metavar="S", type=SECONDS, default=0.0,
                  help="wait this long for a rank to pause"),
              arg("--post-mortem", dest="post_mortem", metavar="RANK", default=None,
                  help="debug the last uncaught exception of RANK"))),)),
    Command("use", "make mesh NAME (spawn --name, or a variable holding a spawn_procs mesh) "
                   "the current one", (
        ("", (arg("name", metavar="NAME"),)),)),
    Command("attach", "attach to durable mesh NAME, follow what it runs", (
        ("", (arg("name", metavar="NAME", help="the mesh's name (see  %mesh list)"),
              arg("--steal", action="store_true",
                  help="take it over from the kernel that holds it (that kernel is told)"),
              arg("--timeout", metavar="S", type=POSITIVE_SECONDS,
                  default=_default(attach, "timeout"),
                  help="seconds to wait for the ranks to answer"))),)),
    Command("detach", "let go of the current durable mesh; it keeps running", (
        ("", (arg("name", metavar="NAME", nargs="?", default=None,
                  help="the mesh to let go of (default: the current one)"),)),)),
    Command("list", "your durable meshes: state, age, keep-alive left", parsed=False),
    Command("stop", "stop the current mesh (NAME: that mesh, from any kernel; --all: every "
                    "mesh of this kernel)", (
        ("", (arg("name", metavar="NAME", nargs="?", default=None,
                  help="the mesh to stop (default: the current one)"),
              arg("--all", action="store_true", help="stop every mesh of the kernel"))),)),
)

_BY_NAME = {c.name: c for c in COMMANDS}
#: ``%mesh spawn`` options that go to the Slurm launcher (its ``Slurm:`` line)
SLURM_OPTIONS: tuple[str, ...] = tuple(
    a.flags[0] for label, line in _BY_NAME["spawn"].lines if label == "Slurm:" for a in line)
_HELP_COLUMN = 45
_WIDTH = 100


def command(name: str) -> Command:
    """The command called ``name`` (``"spawn"``, ``"%%mesh"``).

    Raises
    ------
    KeyError
        If there is no such command.
    """
    return _BY_NAME[name]


def usage_text() -> str:
    """``%mesh help``: every command's usage, with what it does."""
    out = []
    for c in COMMANDS:
        lines = c.usage_lines()
        column = max(_HELP_COLUMN, len(lines[0]) + 2)
        if len(lines) > 1 or column + len(c.help) > _WIDTH and column > _HELP_COLUMN:
            out.extend(lines)  # the help on a line of its own
            lines, column = [""], _HELP_COLUMN
        helps = textwrap.wrap(c.help, _WIDTH - column) or [""]
        out.append(f"{lines[0]:<{column}}{helps[0]}")
        out.extend(f"{'':<{column}}{h}" for h in helps[1:])
    out.append("%mesh help COMMAND (or %mesh COMMAND --help): one command's arguments")
    return "\n".join(out)
