"""What a user is told about durable meshes outside a kernel: the spawn usage
names ``--detach`` and ``--keep-alive``; ``attach()`` on a busy mesh raises
``MeshBusyError`` from the API (no frames of the library's insides) with a
hint for a script and for a notebook; ``meshes stop`` of an unknown name
points at the command line's own ``meshes list``."""

from __future__ import annotations

import os
import subprocess
import sys
import traceback
import uuid

import pytest

import monarch_kernel as mk
from monarch_kernel.kernel.commands import command
from monarch_kernel.mesh import registry

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def reg(tmp_path, monkeypatch):
    """A registry directory of the test's own."""
    d = tmp_path / "reg"
    monkeypatch.setenv(registry.ENV, str(d))
    return d


def test_spawn_usage_in_errors_names_detach_and_keep_alive():
    usage = command("spawn").usage()
    assert "[--detach]" in usage and "[--keep-alive TIME]" in usage, usage
    with pytest.raises(Exception) as e:
        command("spawn").parse(["4", "--bogus"])
    assert "--detach" in str(e.value) and "--keep-alive" in str(e.value), str(e.value)


def test_attach_to_a_busy_mesh_raises_from_the_api_with_both_hints(reg):
    name = f"t-{uuid.uuid4().hex[:8]}"
    m = mk.spawn_procs(2, name=name, detach=True, timeout=60)
    try:
        with pytest.raises(mk.MeshBusyError) as e:
            mk.attach(name, timeout=30)
        msg = str(e.value)
        assert f"monarch_kernel.attach({name!r}, steal=True)" in msg, msg
        assert f"%mesh attach {name} --steal" in msg, msg
        files = [os.path.basename(f.filename) for f in traceback.extract_tb(e.value.__traceback__)]
        assert "durable.py" not in files, files
        assert files.count("procmesh.py") <= 1, files  # (the API's raise only)
        assert e.value.__cause__ is None and e.value.__suppress_context__
    finally:
        m.stop()


def test_meshes_stop_of_an_unknown_name_points_at_meshes_list(reg):
    r = subprocess.run([sys.executable, "-m", "monarch_kernel", "meshes", "stop", "nosuch"],
                       capture_output=True, text=True, timeout=60, check=False,
                       env=dict(os.environ))
    assert r.returncode == 1, r
    assert "python -m monarch_kernel meshes list" in r.stderr, r.stderr
    assert "spawn_procs" not in r.stderr and "%mesh" not in r.stderr, r.stderr
