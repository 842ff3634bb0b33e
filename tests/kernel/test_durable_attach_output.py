"""What ``%mesh attach`` shows of a cell that ran while no kernel was attached:
a cell that finished while detached shows every line once and its result; the
messages of a mesh stopped from a shell and of a lost mesh name what to do.

Real kernels (jupyter_client), a registry of the test's own, every mesh stopped
at the end (helpers of ``test_durable_kernel``).
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator

import pytest
from test_durable_kernel import (
    LINES,
    cleanup,
    cli,
    end_kernel,
    lines_of,
    ok,
    start_long_cell,
    stream_text,
)

from monarch_kernel.testing.kernel import KernelSession, wait_for

pytestmark = pytest.mark.timeout(600)


@pytest.fixture
def registry(tmp_path, monkeypatch) -> Iterator[str]:
    """A registry directory of this test's own (the kernels inherit the variable)."""
    path = tmp_path / "meshes"
    monkeypatch.setenv("MONARCH_MESH_REGISTRY", str(path))
    yield str(path)

SHORT_CELL = """%%mesh
import time
for i in range(15):
    print(f"short line {i}", flush=True)
    time.sleep(0.1)
open(f"{_dir}/ended-{rank}", "w").close()
f"result {rank}"
"""


def test_a_cell_that_finished_while_detached_shows_its_lines_and_result(registry, tmp_path):
    k1 = KernelSession()
    k2: KernelSession | None = None
    with cleanup(registry, "t"):
        try:
            ok(k1.execute("%mesh spawn 4 --name t --detach", timeout=120))
            ok(k1.execute(f"%%mesh\n_dir = {str(tmp_path)!r}"))
            msg_id = k1.kc.execute(SHORT_CELL)
            seen: list[dict] = []
            deadline = time.monotonic() + 60
            while "short line 13" not in stream_text(seen) and time.monotonic() < deadline:
                with contextlib.suppress(Exception):
                    m = k1.kc.get_iopub_msg(timeout=0.2)
                    if m["parent_header"].get("msg_id") == msg_id:
                        seen.append(m)
            end_kernel(k1, "sigkill")
            wait_for(lambda: len(list(tmp_path.glob("ended-*"))) == 4, 30,
                     what="the cell ended on every rank")
            k2 = KernelSession()
            r = ok(k2.execute("%mesh attach t", timeout=120))
            text = r.stream()
            shown = [int(n) for n in re.findall(r"short line (\d+)", text)]
            assert sorted(set(shown)) == list(range(15)), text
            assert len(shown) == len(set(shown)), f"lines shown twice: {text}"
            res = r.result_text() + text
            assert "result 0" in res and "result 3" in res, (r.result_text(), text)
        finally:
            for ks in {id(k): k for k in (k1, k2) if k is not None}.values():
                with contextlib.suppress(Exception):
                    ks.shutdown()


def test_get_or_spawn_says_one_line_and_a_lost_mesh_says_what_to_do(registry):
    k = KernelSession()
    with cleanup(registry, "g"):
        try:
            ok(k.execute("%mesh spawn 4 --name g --detach", timeout=120))
            ok(k.execute("%mesh detach"))
            r = k.execute("%%mesh\nx = 1")
            assert r.status == "error" and "%mesh attach g" in r.error_text(), r.error_text()

            r = ok(k.execute("%mesh spawn 4 --name g --detach", timeout=120))
            lines = [ln for ln in r.stream().splitlines() if ln.strip()]
            assert len(lines) == 1 and "alive already" in lines[0], r.stream()

            stop = cli("meshes", "stop", "g")
            assert stop.returncode == 0, stop.stderr

            told: list[str] = []

            def said() -> bool:  # (said once: the kernel then forgets the mesh)
                r = k.execute("%%mesh\nx = 2")
                told.append("" if r.status == "ok" else r.error_text())
                return "was stopped by pid" in told[-1] or "no mesh is running" in told[-1]
            wait_for(said, 20, what="the kernel told")
            text = told[-1]
            assert "was stopped by pid" in text, told
            assert "from outside this kernel" in text and "--steal" not in text, text
            assert "taken over" not in text, text
        finally:
            with contextlib.suppress(Exception):
                k.shutdown()


RUNNING_CELL = """%%mesh
import time
for i in range(120):
    print(f"same line {i}", flush=True)
    time.sleep(0.05)
"""


def test_replayed_output_folds_like_live_output(registry):
    k1 = KernelSession()
    k2: KernelSession | None = None
    with cleanup(registry, "f"):
        try:
            ok(k1.execute("%mesh spawn 4 --name f --detach", timeout=120))
            msg_id = k1.kc.execute(RUNNING_CELL)
            seen: list[dict] = []
            deadline = time.monotonic() + 60
            while "same line 3" not in stream_text(seen) and time.monotonic() < deadline:
                with contextlib.suppress(Exception):
                    m = k1.kc.get_iopub_msg(timeout=0.2)
                    if m["parent_header"].get("msg_id") == msg_id:
                        seen.append(m)
            end_kernel(k1, "sigkill")
            time.sleep(3)  # (lines printed while no kernel is attached)
            k2 = KernelSession()
            r = ok(k2.execute("%mesh attach f", timeout=120))
            text = r.stream()
            # the replay (lines 0-39 at least: printed before the attach) is folded
            # and in order, as live output is; every rank's every line shown once
            folded = [int(n) for n in re.findall(r"^\[0-3\] same line (\d+)", text, re.M)]
            assert folded[:40] == list(range(40)), f"replay not folded: {text[:2000]}"
            per_rank: dict[int, list[int]] = {r: [] for r in range(4)}
            for tag, n in re.findall(r"^\[([0-9, -]+)\] same line (\d+)", text, re.M):
                for part in tag.split(","):
                    lo, _, hi = part.strip().partition("-")
                    for rk in range(int(lo), int(hi or lo) + 1):
                        per_rank[rk].append(int(n))
            for rk, got in per_rank.items():
                assert got == list(range(120)), f"rank {rk}: {got}\n{text}"
        finally:
            for ks in {id(k): k for k in (k1, k2) if k is not None}.values():
                with contextlib.suppress(Exception):
                    ks.shutdown()


def test_attach_after_an_interrupted_attach_replays_only_what_was_not_shown(registry):
    k1 = KernelSession()
    k2: KernelSession | None = None
    with cleanup(registry, "again"):
        try:
            ok(k1.execute("%mesh spawn 4 --name again --detach", timeout=120))
            start_long_cell(k1, until=5)
            end_kernel(k1, "sigkill")
            k2 = KernelSession()
            msg_id = k2.kc.execute("%mesh attach again")
            seen: list[dict] = []
            deadline = time.monotonic() + 60
            while max(lines_of(stream_text(seen)).get(0) or [0]) < 60:
                assert time.monotonic() < deadline, stream_text(seen)[-500:]
                with contextlib.suppress(Exception):
                    m = k2.kc.get_iopub_msg(timeout=0.2)
                    if m["parent_header"].get("msg_id") == msg_id:
                        seen.append(m)
            k2.interrupt()
            deadline = time.monotonic() + 30
            while True:
                assert time.monotonic() < deadline, "no idle after the interrupt"
                try:
                    m = k2.kc.get_iopub_msg(timeout=0.2)
                except Exception:  # noqa: BLE001 - queue.Empty
                    continue
                if m["parent_header"].get("msg_id") != msg_id:
                    continue
                if m["msg_type"] == "status" and m["content"]["execution_state"] == "idle":
                    break
                seen.append(m)
            k2.sync_shell()
            first = lines_of(stream_text(seen))
            assert "detached again" in stream_text(seen), stream_text(seen)[-800:]
            r = ok(k2.execute("%mesh attach again", timeout=120))
            second = lines_of(r.stream())
            for rank in range(4):
                a, b = first.get(rank, []), second.get(rank, [])
                assert not set(a) & set(b), f"rank {rank}: shown again: {sorted(set(a) & set(b))}"
                assert sorted(a + b) == list(range(LINES)), f"rank {rank}: lines lost"
            assert "done 0" in r.result_text() + r.stream()
        finally:
            for ks in {id(k): k for k in (k1, k2) if k is not None}.values():
                with contextlib.suppress(Exception):
                    ks.shutdown()


def test_a_killed_attaching_kernel_leaves_no_socket_directory(registry, monkeypatch):
    base = tempfile.mkdtemp(prefix="mkt-", dir="/tmp")  # (short: socket paths are bounded)
    monkeypatch.setenv("TMPDIR", base)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    k1 = KernelSession()
    k2: KernelSession | None = None
    try:
        with cleanup(registry, "sock"):
            try:
                ok(k1.execute("%mesh spawn 2 --name sock --detach", timeout=120))
                ok(k1.execute("%mesh detach"))
                k2 = KernelSession()
                ok(k2.execute("%mesh attach sock", timeout=120))
                pid = k2.pid
                made = glob.glob(os.path.join(base, f"mk-{pid}-*"))
                assert made, os.listdir(base)
                end_kernel(k2, "sigkill")
                wait_for(lambda: not any(os.path.exists(d) for d in made), 10,
                         what="the killed kernel's socket directory removed")
            finally:
                for ks in {id(k): k for k in (k1, k2) if k is not None}.values():
                    with contextlib.suppress(Exception):
                        ks.shutdown()
    finally:
        shutil.rmtree(base, ignore_errors=True)
