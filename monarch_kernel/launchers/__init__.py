"""Launchers: how worker processes are started (see :mod:`.base`)."""

from __future__ import annotations

from monarch_kernel.launchers.base import Launcher, LaunchSpec, Placement
from monarch_kernel.launchers.local import LocalLauncher
from monarch_kernel.launchers.slurm import SlurmLauncher

__all__ = ["LaunchSpec", "Launcher", "LocalLauncher", "Placement", "SlurmLauncher", "get_launcher"]


def get_launcher(name: str | Launcher, **options: object) -> Launcher:
    """A launcher instance by name (``"local"``, ``"slurm"``), by import path
    (``"package.module:ClassName"``, for launchers outside this package), or
    as given.

    Raises
    ------
    ValueError
        For an unknown launcher name, or an import path that names no Launcher.
    """
    if isinstance(name, Launcher):
        return name
    if name == "local":
        return LocalLauncher(**options)
    if name == "slurm":
        return SlurmLauncher(**options)
    if isinstance(name, str) and ":" in name:
        import importlib

        module, _, attr = name.partition(":")
        try:
            cls = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"cannot load launcher {name!r}: {e}") from None
        if not (isinstance(cls, type) and issubclass(cls, Launcher)):
            raise ValueError(f"{name!r} is not a Launcher subclass")
        return cls(**options)
    raise ValueError(f"unknown launcher {name!r}; use 'local', 'slurm' or 'module:Class'")
