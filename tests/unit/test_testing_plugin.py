"""monarch_kernel.testing.plugin, the pytest plugin a user of the library gets:
a test file of theirs that uses ``local_mesh`` runs in a pytest of its own
(pytester) and passes, leaving no worker behind."""

from __future__ import annotations

import pytest


_USER_TESTS = '''
import os

import pytest


def test_default_mesh_has_four_ranks_run_elsewhere(local_mesh):
    pids = local_mesh.exec("import os; os.getpid()", timeout=60).values()
    assert len(pids) == 4 and os.getpid() not in pids


@pytest.mark.parametrize("local_mesh", [2, {"hosts": 1, "procs": 3}], indirect=True)
def test_a_mesh_of_the_size_asked_for(local_mesh):
    assert local_mesh.world_size == len(local_mesh.exec("1", timeout=60).values())
    assert local_mesh.world_size in (2, 3)
'''


def test_a_user_test_file_gets_local_mesh_from_the_plugin(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_user=_USER_TESTS)
    result = pytester.runpytest_subprocess("-p", "monarch_kernel.testing.plugin",
                                           "-p", "no:cacheprovider", timeout=240)
    result.assert_outcomes(passed=3)


def test_the_plugin_lists_its_fixtures(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_nothing="def test_nothing():\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "monarch_kernel.testing.plugin",
                                           "-p", "no:cacheprovider", "--fixtures", timeout=120)
    result.stdout.fnmatch_lines(["*fixtures defined from monarch_kernel.testing.plugin*"])
    for name in ("local_mesh", "kernel", "shared_kernel [[]module scope[]]",
                 "monarch_kernel_name [[]session scope[]]"):
        result.stdout.fnmatch_lines([f"{name} -- *plugin.py*"])
