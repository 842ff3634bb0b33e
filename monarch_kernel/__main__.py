"""Command line of monarch_kernel.

::

    python -m monarch_kernel install [--user | --sys-prefix | --prefix P]
                                     [--name NAME] [--display-name D]
    python -m monarch_kernel worker ...      # one mesh worker (started by launchers)
    python -m monarch_kernel meshes list [--plain]   # your durable meshes (spawn --detach)
    python -m monarch_kernel meshes stop NAME        # end the durable mesh NAME
"""

from __future__ import annotations

import argparse
import sys

from monarch_kernel import plugins  # noqa: F401 - the rank-side features register their handlers
from monarch_kernel.worker import worker as worker_main


def _install(argv: list[str]) -> int:
    from monarch_kernel.kernel.kernelspec import DISPLAY_NAME, KERNEL_NAME, install

    p = argparse.ArgumentParser(
        prog="python -m monarch_kernel install",
        description="Install the Jupyter kernelspec of the Monarch kernel.",
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument("--user", action="store_true", help="install for the current user only")
    where.add_argument(
        "--sys-prefix",
        action="store_true",
        help="install into this Python environment (sys.prefix), e.g. a venv",
    )
    where.add_argument(
        "--prefix", metavar="P", default=None, help="install under P/share/jupyter/kernels"
    )
    p.add_argument("--name", default=KERNEL_NAME, help=f"kernelspec name (default: {KERNEL_NAME})")
    p.add_argument(
        "--display-name",
        default=DISPLAY_NAME,
        help=f"name shown in the kernel picker (default: {DISPLAY_NAME!r})",
    )
    a = p.parse_args(argv)
    try:
        dest = install(
            user=a.user,
            prefix=a.prefix,
            sys_prefix=a.sys_prefix,
            name=a.name,
            display_name=a.display_name,
        )
    except OSError as e:
        print(
            f"error: could not install the kernelspec: {e}\nhint: use --user or --sys-prefix",
            file=sys.stderr,
        )
        return 1
    print(f"Installed kernelspec {a.name} ({a.display_name!r}) in {dest}")
    return 0


def _worker(argv: list[str]) -> int:
    """One mesh worker: it serves with the rank-side features that ``plugins`` loaded."""
    return int(worker_main.main(argv) or 0)


def _meshes(argv: list[str]) -> int:
    """``meshes list`` / ``meshes stop NAME``: the user's durable meshes from a terminal.

    Exit status 0 when done, 1 when it could not be done (no mesh of that name, the
    registry cannot be read, the ranks would not stop), 2 for bad arguments.
    """
    # (imported here: the worker, which this module also starts, needs none of it)
    from monarch_kernel.errors import MonarchError, NoMeshError
    from monarch_kernel.kernel.meshlist import MeshTable
    from monarch_kernel.mesh import registry
    from monarch_kernel.mesh.procmesh import stop_mesh

    p = argparse.ArgumentParser(
        prog="python -m monarch_kernel meshes",
        description="List or stop your durable meshes (%mesh spawn N --name NAME --detach).",
    )
    sub = p.add_subparsers(dest="action", metavar="list|stop")
    ls = sub.add_parser("list", help="name, shape, state, age, attached to, keep-alive left")
    ls.add_argument("--plain", action="store_true", help="columns of plain text, no boxes")
    st = sub.add_parser("stop", help="end the mesh NAME (attached to a kernel or not)")
    st.add_argument("name", metavar="NAME")
    st.add_argument("--timeout", type=float, default=10.0,
                    help="seconds the ranks may take to exit (default: 10)")
    try:
        a = p.parse_args(argv)
    except SystemExit as e:  # (argparse: 2 for bad arguments, 0 for --help)
        return int(e.code or 0)
    if a.action is None:
        p.print_usage(sys.stderr)
        print("error: say what to do: list, or stop NAME", file=sys.stderr)
        return 2
    if a.action == "list":
        try:
            table = MeshTable(registry.list_meshes())
        except (OSError, MonarchError) as e:
            print(f"error: cannot read the mesh registry: {e}", file=sys.stderr)
            return 1
        print(table.plain() if a.plain else repr(table))
        return 0
    if not (a.timeout > 0 and a.timeout < 1e9):
        print(f"error: --timeout must be a positive number of seconds, not {a.timeout!r}",
              file=sys.stderr)
        return 2
    try:
        stop_mesh(a.name, timeout=a.timeout, force=True)
    except NoMeshError:
        print(f"error: no mesh named {a.name!r} is running for this user; "
              "`python -m monarch_kernel meshes list` shows the meshes there are",
              file=sys.stderr)
        return 1
    except (OSError, MonarchError, TimeoutError) as e:
        print(f"error: could not stop mesh {a.name!r}: {e}", file=sys.stderr)
        return 1
    print(f"mesh {a.name!r} stopped")
    return 0


COMMANDS = {"install": _install, "worker": _worker, "meshes": _meshes}


def main(argv: list[str] | None = None) -> int:
    """Run the command line.

    Parameters
    ----------
    argv : list of str or None
        Arguments after the program name; ``sys.argv[1:]`` when None.

    Returns
    -------
    int
        Exit status.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    usage = __doc__.strip().replace("::\n\n", "")
    if argv and argv[0] in ("-h", "--help"):
        print(usage)
        return 0
    if not argv or argv[0] not in COMMANDS:
        print(usage, file=sys.stderr)
        if argv:
            print(f"\nunknown command: {argv[0]}", file=sys.stderr)
        return 2
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
