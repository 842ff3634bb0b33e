"""Command line of monarch_kernel.

::

    python -m monarch_kernel install [--user | --sys-prefix | --prefix P]
                                     [--name NAME] [--display-name D]
    python -m monarch_kernel worker ...      # one mesh worker (started by launchers)
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


COMMANDS = {"install": _install, "worker": _worker}


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
