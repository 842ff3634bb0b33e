"""The wheel carries the prebuilt JupyterLab extension, and installing it needs no Node.

Builds a wheel of a copy of the project (pyproject.toml's [tool.setuptools.data-files] take
the files extensions/build.sh wrote to extensions/monarch-jupyterlab/labextension/), checks
that share/jupyter/labextensions/monarch-kernel-jupyterlab/ is inside, then pip-installs it
into a throw-away prefix with node, npm and jlpm replaced by failing shims on PATH and asks
`jupyter labextension list` about that prefix.

Skips where the extension has not been built (no Node here), except in CI (CI=true), where
.ci/run builds it first and a missing build is a failure.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXT_SRC = ROOT / "extensions" / "monarch-jupyterlab"
BUILT = EXT_SRC / "labextension"
NAME = "monarch-kernel-jupyterlab"

if not (BUILT / "package.json").exists():
    if os.environ.get("CI") == "true":
        pytest.fail(f"{BUILT} is missing: .ci/run runs extensions/build.sh before the tests")
    pytest.skip(f"extension not built ({BUILT}); run bash extensions/build.sh",
                allow_module_level=True)


def _copy_project(dest: Path) -> None:
    """Copy what a wheel build reads (no .venv, node_modules or build output)."""
    dest.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, dest / name)
    shutil.copytree(ROOT / "monarch_kernel", dest / "monarch_kernel",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    ext = dest / "extensions" / "monarch-jupyterlab"
    ext.mkdir(parents=True)
    shutil.copy2(EXT_SRC / "install.json", ext / "install.json")
    shutil.copytree(BUILT, ext / "labextension", ignore=shutil.ignore_patterns("install.json"))


def test_wheel_ships_prebuilt_extension_and_installs_without_node(tmp_path):
    src = tmp_path / "src"
    _copy_project(src)
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "--disable-pip-version-check", "-w", str(wheels), str(src)],
        check=True, timeout=300)
    (wheel,) = wheels.glob("monarch_kernel-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
    prefix = f"monarch_kernel-0.1.0.data/data/share/jupyter/labextensions/{NAME}/"
    shipped = sorted(n[len(prefix):] for n in names if n.startswith(prefix))
    assert "package.json" in shipped and "install.json" in shipped, shipped
    static = sorted(p.name for p in (BUILT / "static").iterdir())
    assert [f"static/{s}" for s in static] == [s for s in shipped if s.startswith("static/")]
    assert any(s.startswith("static/remoteEntry.") for s in shipped), shipped

    # Install with every Node tool replaced by a shim that fails (and leaves a mark).
    shims = tmp_path / "shims"
    shims.mkdir()
    called = tmp_path / "called"
    for tool in ("node", "nodejs", "npm", "npx", "yarn", "jlpm"):
        shim = shims / tool
        shim.write_text(f"#!/bin/sh\necho {tool} >> {called}\nexit 99\n")
        shim.chmod(0o755)
    env = dict(os.environ, PATH=f"{shims}:{Path(sys.executable).parent}:/usr/bin:/bin")
    target = tmp_path / "prefix"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
         "--disable-pip-version-check", "--prefix", str(target), str(wheel)],
        check=True, env=env, timeout=300)
    assert not called.exists(), f"pip install called {called.read_text()}"
    installed = target / "share" / "jupyter" / "labextensions" / NAME
    meta = json.loads((installed / "package.json").read_text())
    assert meta["name"] == NAME
    assert json.loads((installed / "install.json").read_text())["packageName"] == "monarch-kernel"
    assert sorted(p.name for p in (installed / "static").iterdir()) == static

    # JupyterLab finds it there, enabled, as a prebuilt (python) extension. (Its "is a
    # rebuild needed?" probes call jlpm and fail quietly without Node: not checked here.)
    called.unlink(missing_ok=True)
    listing = subprocess.run(
        [sys.executable, "-m", "jupyterlab.labextensions", "list"],
        env=dict(env, JUPYTER_PATH=str(target / "share" / "jupyter")),
        capture_output=True, text=True, timeout=120)
    out = re.sub(r"\x1b\[[0-9;]*m", "", listing.stdout + listing.stderr)
    assert f"{NAME} v{meta['version']} enabled OK (python, monarch-kernel)" in out, out
