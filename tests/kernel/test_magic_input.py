"""Bad input to the magics, through the real kernel.

Each bad line gives a ``UsageError`` whose message is ONE line (no
traceback, no usage dump) that says what to do, and the kernel stays usable:
the next cell works, and the running mesh is the same (a typo must not stop
it). tests/kernel/test_kernel_mesh.py checks a few of these for their error name
only; here every one is checked for being one clear line.
"""

from __future__ import annotations

import re

import pytest

from monarch_kernel.testing.kernel import KernelSession, worker_pids

pytestmark = pytest.mark.timeout(300)


def assert_one_line(r, *hints: str) -> str:
    """``r`` failed with a one-line UsageError matching every regex in ``hints``."""
    assert r.status == "error", r.stream()
    content = r.reply["content"]
    text = r.error_text()
    assert content["ename"] == "UsageError", text
    evalue = content["evalue"].strip()
    assert "\n" not in evalue and len(evalue) < 300, evalue
    assert "Traceback" not in text and "File " not in text, text
    for h in hints:
        assert re.search(h, evalue), (h, evalue)
    return evalue


@pytest.fixture(scope="module")
def k4():
    ks = KernelSession()
    try:
        r = ks.execute("%mesh spawn 4")
        assert r.status == "ok", r.error_text()
        ks.pids = sorted(worker_pids(ks.pid))  # type: ignore[attr-defined]
        assert len(ks.pids) == 4  # type: ignore[attr-defined]
        yield ks
    finally:
        ks.shutdown()


def _still_usable(ks) -> None:
    r = ks.execute("6 * 7")
    assert r.status == "ok" and r.result_text() == "42"


NO_MESH = ["%%mesh\nrank", "%%mesh --ranks 0\nrank", "%mesh pull x", "%mesh push x",
           "%mesh status", "%mesh restart 0", "%mesh stop", "%mesh dashboard"]


def test_every_command_before_any_spawn_says_to_spawn(kernel):
    kernel.execute("x = 1")
    for line in NO_MESH:
        r = kernel.execute(line)
        assert_one_line(r, r"%mesh spawn \d")
    _still_usable(kernel)
    r = kernel.execute("%mesh spawn 1")
    assert r.status == "ok", r.error_text()
    assert kernel.execute("%%mesh\nrank + 5").result_text().endswith("5")


BAD = [
    # unknown commands and options
    ("%mesh frobnicate", r"unknown command 'frobnicate'; use one of .*spawn"),
    ("%mesh spawn 2 --frobnicate", r"unrecognized arguments: --frobnicate\. Usage: %mesh spawn N"),
    ("%%mesh --bogus\nrank", r"^%%mesh: unrecognized arguments: --bogus\. Usage: %%mesh \["),
    ("%mesh stop --now", r"unrecognized arguments: --now\. Usage: %mesh stop"),
    ("%mesh status --verbose", r"unexpected arguments '--verbose'\. Usage: %mesh status"),
    ("%mesh dashboard --layout diagonal", r"invalid choice: 'diagonal'.*Usage: %mesh dashboard"),
    ("%mesh dashboard --interval 0", r"must be a positive number of seconds"),
    ("%mesh spawn 4 --partition gpu", r"need --launcher slurm"),
    ('%mesh spawn "4', r"cannot parse"),
    # sizes
    ("%mesh spawn", r"required: size\. Usage: %mesh spawn"),
    ("%mesh spawn 0", r"positive integers.*N \(e\.g\. 4\)"),
    ("%mesh spawn -1", r"positive integers"),
    ("%mesh spawn abc", r"not a mesh size; write N"),
    ("%mesh spawn 1.5", r"not a mesh size; write N"),
    ("%mesh spawn 2x0", r"positive integers"),
    ("%mesh spawn 100000", r"more than the 1024 .*spawn fewer ranks"),
    ("%mesh spawn 1000x1000", r"more than the 1024"),
    ("%mesh spawn 99999999999999999999999", r"more than the 1024"),
    # other spawn options
    ("%mesh spawn 4 --dist mpi", r"invalid choice: 'mpi' \(choose from 'gloo', 'nccl', 'none'\)"),
    ("%mesh spawn 4 --launcher nosuch", r"unknown launcher 'nosuch'; use 'local'"),
    ("%mesh spawn 4 --heartbeat 0", r"--heartbeat: must be a positive number of seconds"),
    ("%mesh spawn 4 --heartbeat nan", r"--heartbeat: must be a positive number of seconds"),
    ("%mesh spawn 4 --timeout -5", r"--timeout: must be a positive number of seconds"),
    ("%mesh spawn 4 --heartbeat abc", r"invalid float value: 'abc'"),
    ("%mesh spawn 4 --name 1bad", r"not a Python identifier"),
    ("%mesh spawn 4 --max-restarts -1", r"0 or more"),
    ("%mesh spawn 4 --telemetry-interval -1", r"0 \(off\) or more"),
    # rank specs
    ("%%mesh --ranks 9\nrank", r"rank 9 does not exist: this mesh has ranks 0 to 3"),
    ("%%mesh --ranks 3:1\nrank", r"is empty; write START:STOP"),
    ("%%mesh --ranks -1\nrank", r"rank -1 does not exist"),
    ("%%mesh --ranks abc\nrank", r"use a rank \(2\), a list \(1,3\) or a range"),
    ("%%mesh --ranks 0:99\nrank", r"does not exist|ranks 0 to 3"),
    ("%%mesh --timeout -1\nrank", r"positive number of seconds"),
    ("%%mesh --timeout abc\nrank", r"invalid float value: 'abc'\. Usage: %%mesh"),
    ("%mesh restart 9", r"rank 9 does not exist"),
    ("%mesh restart", r"required: ranks\. Usage: %mesh restart RANKS"),
    ("%mesh restart abc", r"bad rank spec 'abc'"),
    # names
    ("%mesh pull undefined_name", r"name 'undefined_name' is not defined; define undefined_name "
                                  r"on the ranks first"),
    ("%mesh pull", r"name the variable to fetch"),
    ("%mesh pull --bogus", r"not a variable name"),
    ("%mesh push undefined_name", r"not defined in the notebook; define it first"),
    ("%mesh push", r"name the variables to copy"),
    ("%mesh debug --wait -1", r"0 or more seconds"),
]


@pytest.mark.parametrize("line,hint", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_one_clear_line(k4, line, hint):
    assert_one_line(k4.execute(line), hint)
    _still_usable(k4)


def test_the_mesh_survived_all_of_it(k4):
    """After every bad line above, the very same 4 workers still run cells."""
    assert sorted(worker_pids(k4.pid)) == k4.pids
    r = k4.execute("%%mesh\nrank * 3")
    assert r.status == "ok", r.error_text()
    assert all(f"  {3 * i}\n" in r.result_text() + "\n" for i in range(4)), r.result_text()
    r = k4.execute("%%mesh --ranks 1:3\nrank")
    assert r.status == "ok", r.error_text()


def test_pull_of_a_name_defined_on_some_ranks_only(k4):
    r = k4.execute("%%mesh --ranks 0\nonly_on_zero = 5")
    assert r.status == "ok", r.error_text()
    evalue = assert_one_line(k4.execute("%mesh pull only_on_zero"), r"define only_on_zero")
    assert "ranks 1-3" in evalue  # names the ranks that lack it
    assert k4.execute("%mesh pull rank").status == "ok"
