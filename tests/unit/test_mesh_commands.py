"""The %mesh commands' one definition (monarch_kernel.kernel.commands): parsing,
one-line errors with the usage, help generated from it, defaults shared with
spawn_procs and ProcMesh. No kernel: the parsers are driven directly."""

from __future__ import annotations

import inspect

import pytest
from IPython.core.error import UsageError

from monarch_kernel.kernel.commands import CELL, COMMANDS, SLURM_OPTIONS, command, usage_text
from monarch_kernel.mesh.procmesh import ProcMesh, spawn_procs


def _defaults(fn):
    return {n: p.default for n, p in inspect.signature(fn).parameters.items()}


def test_spawn_defaults_are_spawn_procs_defaults():
    a = command("spawn").parse(["4"])
    d = _defaults(spawn_procs)
    for name in ("launcher", "bind", "heartbeat", "timeout", "telemetry_interval", "restart",
                 "max_restarts"):
        assert getattr(a, name) == d[name], name
    assert a.dist == "none" and d["dist"] is None and a.size == "4" and a.name is None  # ("mesh")
    assert command("restart").parse(["1"]).timeout == _defaults(ProcMesh.restart)["timeout"]
    dash = command("dashboard").parse([])
    assert (dash.interval, dash.history, dash.layout) == tuple(
        _defaults(ProcMesh.dashboard)[k] for k in ("interval", "history", "layout"))


@pytest.mark.parametrize("name,argv,text", [
    ("spawn", [], "%mesh spawn: the following arguments are required: size. "
                  "Usage: %mesh spawn N|HxP [--dist gloo|nccl|none]"),
    ("spawn", ["4", "--frobnicate"], "unrecognized arguments: --frobnicate. Usage: %mesh spawn N"),
    ("spawn", ["4", "--dist", "mpi"], "invalid choice: 'mpi' (choose from 'gloo', 'nccl', 'none')"),
    ("spawn", ["4", "--heartbeat", "abc"], "invalid float value: 'abc'"),
    ("%%mesh", ["--bogus"],
     "%%mesh: unrecognized arguments: --bogus. Usage: %%mesh [--ranks SPEC]"),
    ("restart", [], "required: ranks. Usage: %mesh restart RANKS"),
    ("stop", ["--now"], "Usage: %mesh stop [NAME] [--all]"),
])
def test_bad_arguments_give_one_line_with_the_usage(name, argv, text):
    with pytest.raises(UsageError) as ei:
        command(name).parse(argv)
    msg = str(ei.value)
    assert text in msg and "\n" not in msg and len(msg) < 300, msg


def test_help_lists_every_command_once_with_its_usage_and_help():
    text = usage_text()
    for c in COMMANDS:
        assert text.count(c.usage_lines()[0]) == 1, c.name
        assert c.help.split()[0] in text
    assert "x = %mesh pull NAME" in text and "r = %mesh ref NAME" in text
    assert "%mesh show REF|NAME" in text and "%%mesh [--ranks SPEC] [--timeout SECONDS]" in text
    assert all(len(line) <= 100 for line in text.splitlines()), text


def test_one_commands_help_names_each_argument_and_default():
    text = command("spawn").help_text()
    for opt in ("--dist", "--heartbeat", "--telemetry-interval", *SLURM_OPTIONS):
        assert opt in text, opt
    assert "(default: 120.0)" in text and "(default: never)" in text


def test_slurm_options_are_the_spawn_commands_slurm_line():
    assert SLURM_OPTIONS == ("--partition", "--time", "--account", "--gpus-per-node", "--nodes",
                             "--sbatch")
    a = command("spawn").parse(["2x2", "--launcher", "slurm", "--nodes", "2"])
    assert a.nodes == 2 and a.partition is None
    assert CELL.parse(["--ranks", "0:2", "--timeout", "3"]).timeout == 3.0


@pytest.fixture
def shell():
    """An IPython shell (no kernel) with the %mesh magics, and no mesh."""
    from IPython.core.interactiveshell import InteractiveShell

    from monarch_kernel.kernel.magics import MeshMagics

    sh = InteractiveShell.instance()
    sh.register_magics(MeshMagics(sh))
    yield sh
    InteractiveShell.clear_instance()


def test_the_magic_prints_the_generated_help(shell, capsys):
    shell.run_line_magic("mesh", "help")
    assert capsys.readouterr().out.strip() == usage_text()
    for line in ("help spawn", "spawn --help", "spawn -h"):
        shell.run_line_magic("mesh", line)
        assert capsys.readouterr().out.strip() == command("spawn").help_text(), line
    shell.run_line_magic("mesh", "help nosuch")  # a typo: said, then the list
    assert capsys.readouterr().out.strip() == (
        f"unknown command 'nosuch'; the commands are:\n{usage_text()}")


def test_the_magic_names_its_commands_for_an_unknown_one(shell):
    with pytest.raises(UsageError, match=r"unknown command 'frobnicate'; use one of spawn, "
                                         r"push, pull, .*stop \(see  %mesh help\)"):
        shell.run_line_magic("mesh", "frobnicate")
    with pytest.raises(UsageError, match=r"^%mesh spawn: unrecognized arguments: --x\. Usage"):
        shell.run_line_magic("mesh", "spawn 2 --x")
