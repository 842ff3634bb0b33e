"""USS in telemetry records comes from psutil (``memory_full_info``); where it
may not be read, the record says None instead of failing."""

from __future__ import annotations

import os
import subprocess
import sys

import psutil
import pytest

from monarch_kernel.worker.telemetry import Sampler


def test_uss_is_psutils_figure_for_a_child_process():
    child = subprocess.Popen([sys.executable, "-c",
                              "import sys; print('ready', flush=True); sys.stdin.read()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        # sampled once the interpreter is up (a child caught between fork and exec
        # has almost no private memory yet, and grows by megabytes in the meantime)
        assert child.stdout.readline().strip() == "ready"
        rec = Sampler(child.pid, gpu=False).sample()
        uss = psutil.Process(child.pid).memory_full_info().uss
        assert rec["uss"] is not None and 0 < rec["uss"] <= rec["rss"]
        # same figure, give or take what the idle child touched in between
        assert abs(rec["uss"] - uss) <= max(uss // 10, 1 << 20)
    finally:
        child.stdin.close()
        child.wait(timeout=30)
        child.stdout.close()


def test_uss_not_permitted_gives_none_and_the_rest_of_the_record(monkeypatch):
    s = Sampler(os.getpid(), gpu=False)

    def denied():
        raise psutil.AccessDenied(os.getpid())

    monkeypatch.setattr(s.proc, "memory_full_info", denied)
    rec = s.sample()
    assert rec["uss"] is None
    assert rec["rss"] > 0 and rec["threads"] >= 1


@pytest.mark.skipif(os.geteuid() == 0, reason="root may read every process's smaps_rollup")
def test_uss_of_another_users_process_is_none():
    other = next((p for p in psutil.process_iter(["uids"])
                  if p.info["uids"] and p.info["uids"].real != os.getuid()), None)
    if other is None:
        pytest.skip("no process of another user on this machine")
    assert Sampler(other.pid, gpu=False).sample()["uss"] is None
