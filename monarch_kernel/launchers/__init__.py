"""Launchers: how worker processes are started (see :mod:`.base`)."""

from __future__ import annotations

from .base import Launcher, LaunchSpec, Placement
from .local import LocalLauncher

__all__ = ["Launcher", "LaunchSpec", "Placement", "LocalLauncher", "get_launcher"]


def get_launcher(name: str | Launcher, **options: object) -> Launcher:
    """A launcher instance by name (``"local"``, ``"slurm"``) or as given.

    Raises
    ------
    ValueError
        For an unknown launcher name.
    """
    if isinstance(name, Launcher):
        return name
    if name == "local":
        return LocalLauncher(**options)
    if name == "slurm":
        from .slurm import SlurmLauncher

        return SlurmLauncher(**options)
    raise ValueError(f"unknown launcher {name!r}; use 'local' or 'slurm'")
