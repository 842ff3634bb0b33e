"""The ``kernel`` and ``shared_kernel`` fixtures of monarch_kernel.testing.plugin
in a user's test file (a pytest of its own, pytester): a real monarch kernel
that spawns a mesh, shut down afterwards with its workers."""

from __future__ import annotations

import pytest

_USER_TESTS = '''
def test_a_cell_on_the_mesh(kernel):
    r = kernel.execute("%mesh spawn 2", timeout=120)
    assert r.status == "ok", r.error_text()
    r = kernel.execute("%%mesh\\nimport os\\nprint('hello', 6 * 7, os.getpid())", timeout=60)
    assert r.status == "ok", r.error_text()
    assert r.stream().count("hello 42") == 2, r.stream()  # one line from each rank


def test_shared_kernel_is_one_for_the_module(shared_kernel, request):
    assert shared_kernel is request.getfixturevalue("shared_kernel")
    assert shared_kernel.execute("1 + 1").result_text() == "2"
'''


def test_a_user_test_file_gets_kernels_from_the_plugin(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_user=_USER_TESTS)
    result = pytester.runpytest_subprocess("-p", "monarch_kernel.testing.plugin",
                                           "-p", "no:cacheprovider", timeout=280)
    result.assert_outcomes(passed=2)
