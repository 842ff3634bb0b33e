"""Install the Jupyter kernelspec of the Monarch kernel.

The kernelspec is a folder holding ``kernel.json`` and the logos; Jupyter
front ends (JupyterLab, nbclient, ``jupyter console``) find it by name
(``monarch`` by default) and start the kernel with the command in its
``argv``::

    python -Xfrozen_modules=off -m monarch_kernel.kernel -f {connection_file}

``-Xfrozen_modules=off`` is what ipykernel's own kernelspec passes on
CPython: with frozen standard modules, debugpy (which ipykernel imports at
start) writes a "frozen modules" warning to the kernel's stderr, and that
reaches the notebook as a stream message.

This module imports nothing from the rest of ``monarch_kernel``, so the
kernelspec can be installed before (or without) the mesh machinery being
importable. Modelled on ``ipykernel/kernelspec.py``.
"""

from __future__ import annotations

import json
import platform
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from jupyter_client.kernelspec import KernelSpecManager

__all__ = [
    "DISPLAY_NAME",
    "KERNEL_NAME",
    "RESOURCES",
    "get_kernel_dict",
    "install",
    "write_kernel_spec",
]

#: Default kernelspec name, as in ``jupyter kernelspec list``.
KERNEL_NAME = "monarch"
#: Default name shown in the front end's kernel picker.
DISPLAY_NAME = "Monarch (mesh)"
#: Folder with the logos (``logo-32x32.png``, ``logo-64x64.png``).
RESOURCES = Path(__file__).parent / "resources"


def get_kernel_dict(
    display_name: str = DISPLAY_NAME, executable: str | None = None
) -> dict[str, Any]:
    """Build the content of ``kernel.json``.

    Parameters
    ----------
    display_name : str
        Name shown in the front end's kernel picker.
    executable : str or None
        Python interpreter that runs the kernel; ``sys.executable`` when None,
        so the kernel runs in the environment it was installed from.

    Returns
    -------
    dict
        ``argv``, ``display_name``, ``language``, ``interrupt_mode`` and
        ``metadata``, as in the Jupyter kernelspec format.
    """
    return {
        "argv": [
            executable or sys.executable,
            *(["-Xfrozen_modules=off"] if platform.python_implementation() == "CPython" else []),
            "-m",
            "monarch_kernel.kernel",
            "-f",
            "{connection_file}",
        ],
        "display_name": display_name,
        "language": "python",
        # SIGINT to the kernel process; the kernel forwards the interrupt to its ranks.
        "interrupt_mode": "signal",
        "metadata": {"debugger": False},
    }


def write_kernel_spec(path: str | Path | None = None, display_name: str = DISPLAY_NAME) -> str:
    """Write a kernelspec folder (``kernel.json`` plus logos).

    Parameters
    ----------
    path : str, Path or None
        Folder to create; it must not exist yet. A fresh temporary folder
        when None.
    display_name : str
        Name shown in the front end's kernel picker.

    Returns
    -------
    str
        The folder written.
    """
    if path is None:
        path = Path(tempfile.mkdtemp(suffix="_kernels")) / KERNEL_NAME
    path = Path(path)
    path.mkdir(parents=True)
    for logo in sorted(RESOURCES.glob("logo-*.png")):
        shutil.copyfile(logo, path / logo.name)
    with open(path / "kernel.json", "w") as f:
        json.dump(get_kernel_dict(display_name), f, indent=1)
    return str(path)


def install(
    user: bool = False,
    prefix: str | None = None,
    sys_prefix: bool = False,
    name: str = KERNEL_NAME,
    display_name: str = DISPLAY_NAME,
) -> str:
    """Install the Monarch kernelspec so Jupyter can start the kernel.

    Parameters
    ----------
    user : bool
        Install for the current user only (``~/.local/share/jupyter/kernels``).
    prefix : str or None
        Install under ``PREFIX/share/jupyter/kernels``.
    sys_prefix : bool
        Install into the running environment (``sys.prefix``), e.g. a
        virtual environment; same as ``prefix=sys.prefix``.
    name : str
        Kernelspec name (``jupyter kernelspec list`` shows it; nbclient's
        ``kernel_name``).
    display_name : str
        Name shown in the front end's kernel picker.

    Returns
    -------
    str
        The folder the kernelspec was installed to.

    Raises
    ------
    ValueError
        If more than one of ``user``, ``prefix`` and ``sys_prefix`` is given.
    OSError
        If the destination is not writable (a system-wide install without
        the rights to it; use ``user=True`` or ``sys_prefix=True``).
    """
    if sum([bool(user), prefix is not None, bool(sys_prefix)]) > 1:
        raise ValueError("give at most one of user, prefix and sys_prefix")
    if sys_prefix:
        prefix = sys.prefix
    tmp = Path(tempfile.mkdtemp(suffix="_kernels"))
    try:
        src = write_kernel_spec(tmp / name, display_name=display_name)
        return KernelSpecManager().install_kernel_spec(
            src, kernel_name=name, user=user, prefix=prefix
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
