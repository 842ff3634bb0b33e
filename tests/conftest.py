"""The test suite's groups and fixtures.

Groups, one directory each, each test marked with its directory's name (so
``pytest -m unit`` runs one group, ``pytest -m "not system"`` leaves one out):

unit
    No kernel, no Slurm, no namespaces, no browser: pure functions, and real
    worker processes whose controller is the test process.
kernel
    A real monarch kernel through ``jupyter_client``, and notebooks run by nbclient.
system
    What needs more than a user's shell: Slurm, network namespaces, a browser,
    root, a GPU. These skip, saying why, where the machine lacks it.

The fixtures (``local_mesh``, ``kernel``, ``shared_kernel``) come from the
library's own pytest plugin, :mod:`monarch_kernel.testing.plugin`, the same one
that a user of the library gets once it is installed. Helpers that serve more
than one group (``wire_attack_helpers``) lie in this directory, which is on
``sys.path`` (``pythonpath`` in pyproject.toml).
"""

from __future__ import annotations

from pathlib import Path

import pytest

# The library's plugin is named here too so that a checkout whose install predates its
# entry point has the fixtures (pytest loads it once either way); pytester tests the plugin.
pytest_plugins = ["monarch_kernel.testing.plugin", "pytester"]

GROUPS = ("unit", "kernel", "system")
_HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test with the group of the directory it lies in (tests/GROUP/...)."""
    for item in items:
        try:
            rel = item.path.resolve().relative_to(_HERE)
        except ValueError:  # not under tests/ (e.g. a pytester run)
            continue
        if len(rel.parts) > 1 and rel.parts[0] in GROUPS:
            item.add_marker(getattr(pytest.mark, rel.parts[0]))
