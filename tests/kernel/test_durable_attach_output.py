"""What ``%mesh attach`` shows of a cell that ran while no kernel was attached:
a cell that finished while detached shows every line once and its result; the
messages of a mesh stopped from a shell and of a lost mesh name what to do.

Real kernels (jupyter_client), a registry of the test's own, every mesh stopped
at the end (helpers of ``test_durable_kernel``).
"""

from __future__ import annotations

import contextlib
import re
import time

import pytest
from test_durable_kernel import cleanup, cli, end_kernel, ok, registry, stream_text  # noqa: F401

from monarch_kernel.testing.kernel import KernelSession, wait_for

pytestmark = pytest.mark.timeout(600)

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
