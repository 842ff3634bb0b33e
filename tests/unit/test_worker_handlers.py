"""The worker's handler registry, and features plugging in from above."""

from __future__ import annotations

import subprocess
import sys

import pytest

from monarch_kernel.worker import handlers


def _ok(worker: object, content: object) -> str:
    return "ok"


def _other(worker: object, content: object) -> str:
    return "other"


def test_a_type_has_one_handler_and_says_its_thread() -> None:
    handlers.register_request("test-only-request", _ok)
    handlers.register_request("test-only-request", _ok)  # the same again: fine
    h = handlers.lookup("test-only-request")
    assert h is not None and h.thread is handlers.Thread.MAIN and h.fn is _ok
    with pytest.raises(ValueError, match="registered already"):
        handlers.register_io("test-only-request", _other)
    assert handlers.lookup("no-such-type") is None


def test_the_rank_side_features_register_their_messages() -> None:
    from monarch_kernel import plugins  # noqa: F401 - what python -m monarch_kernel worker loads

    io = {"heartbeat", "interrupt", "shm_done", "call", "calls", "keys", "free", "debug_input"}
    main = {"execute", "push", "pull", "stop", "spawn_actor", "stop_actor", "ref", "setup"}
    for t in io:
        assert handlers.lookup(t).thread is handlers.Thread.IO, t
    for t in main:
        assert handlers.lookup(t).thread is handlers.Thread.MAIN, t


def test_the_worker_core_imports_no_feature() -> None:
    code = ("import sys, monarch_kernel.worker.worker\n"
            "bad = sorted(m for m in sys.modules if m.startswith(tuple(\n"
            "    'monarch_kernel.' + p for p in ('actor', 'tensors', 'debug', 'ui', 'kernel',\n"
            "                                    'mesh.procmesh', 'mesh.supervision',\n"
            "                                    'mesh.dist_setup'))))\n"
            "print(bad)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_the_worker_module_is_not_a_program() -> None:
    out = subprocess.run([sys.executable, "-m", "monarch_kernel.worker.worker"],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode != 0
    assert "python -m monarch_kernel worker" in out.stderr


def test_features_load_on_the_first_message_that_needs_them() -> None:
    # a worker that only runs cells never imports the actor layer; the first actor
    # message loads it (and the tensor store, which keeps .rref() results)
    code = ("import sys\n"
            "from monarch_kernel import plugins\n"
            "from monarch_kernel.worker import handlers\n"
            "before = [m for m in ('monarch_kernel.actor.host', 'monarch_kernel.tensors.store',\n"
            "                      'monarch_kernel.mesh.dist_setup') if m in sys.modules]\n"
            "h = handlers.lookup('spawn_actor')\n"
            "after = [m for m in ('monarch_kernel.actor.host', 'monarch_kernel.actor.peers',\n"
            "                     'monarch_kernel.tensors.store') if m in sys.modules]\n"
            "dist = 'monarch_kernel.mesh.dist_setup' in sys.modules\n"
            "print(before, h.thread.name, after, dist)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.split("\n")[0] == (
        "[] MAIN ['monarch_kernel.actor.host', 'monarch_kernel.actor.peers', "
        "'monarch_kernel.tensors.store'] False"), out.stdout + out.stderr
