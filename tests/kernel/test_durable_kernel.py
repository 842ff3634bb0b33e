"""Durable meshes through real kernels (jupyter_client): ``%mesh spawn --detach``
survives a SIGKILLed kernel, a ``restart_kernel`` and a clean shutdown; ``%mesh
attach`` in a new kernel finds the same processes with their state and actors,
shows the output the ranks printed meanwhile and follows the running cell to its
end; a second attach is refused (``--steal`` takes over); get-or-spawn; the
``%mesh`` and ``meshes`` command-line input errors.

Every test uses a registry of its own (``MONARCH_MESH_REGISTRY``, inherited by
the kernels it starts) and stops its meshes in ``finally`` through
``python -m monarch_kernel meshes stop``, then checks that no worker is left.
The attach times measured are printed (``-s`` shows them).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import psutil
import pytest

from monarch_kernel.testing.kernel import KernelSession, wait_for, worker_pids

pytestmark = pytest.mark.timeout(600)

#: lines the long cell prints on each rank (one every 50 ms: 10 s)
LINES = 200

LONG_CELL = f"""%%mesh
import time
for i in range({LINES}):
    print(f"r{{rank}} line {{i}}", flush=True)
    time.sleep(0.05)
f"done {{rank}}"
"""

COUNTER = """
from monarch_kernel import Actor, endpoint

class Counter(Actor):
    def __init__(self):
        self.n = 0

    @endpoint
    def add(self, k):
        self.n += k
        return self.n

counters = train.spawn("counter", Counter)
print("actor", list(counters.add.call(5).get(timeout=30).values()))
"""

LINE = re.compile(r"r(\d) line (\d+)\b")


@pytest.fixture
def registry(tmp_path, monkeypatch) -> Iterator[str]:
    """A registry directory of this test's own (the kernels inherit the variable)."""
    path = tmp_path / "meshes"
    monkeypatch.setenv("MONARCH_MESH_REGISTRY", str(path))
    yield str(path)


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """``python -m monarch_kernel ARGS`` with this test's environment."""
    return subprocess.run([sys.executable, "-m", "monarch_kernel", *args], capture_output=True,
                          text=True, timeout=timeout, check=False, env=dict(os.environ))


def workers(registry: str) -> list[int]:
    """Pids of the live worker processes started under this test's registry (every
    kernel of the test, and so every worker, inherits ``MONARCH_MESH_REGISTRY``;
    a detached mesh's workers name no controller pid)."""
    return [p for p in worker_pids() if _env(p).get("MONARCH_MESH_REGISTRY") == registry]


def _env(pid: int) -> dict[str, str]:
    try:
        return psutil.Process(pid).environ()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return {}


def _leftovers(registry: str) -> list[int]:
    """This test's workers and mesh guardians still alive."""
    out = []
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        cmd = " ".join(p.info.get("cmdline") or [])
        if (("monarch_kernel worker" in cmd or "launchers/guard.py" in cmd)
                and p.info.get("status") != psutil.STATUS_ZOMBIE
                and _env(p.info["pid"]).get("MONARCH_MESH_REGISTRY") == registry):
            out.append(p.info["pid"])
    return out


@contextlib.contextmanager
def cleanup(registry: str, *names: str) -> Iterator[None]:
    """Stops meshes ``names`` at the end (whatever happened) and checks that no
    worker or guardian of this test is left."""
    failed = False
    try:
        yield
    except BaseException:
        failed = True
        raise
    finally:
        for name in names:
            cli("meshes", "stop", name)
        try:
            wait_for(lambda: not _leftovers(registry), timeout=20, what="every worker gone")
        except TimeoutError:
            left = _leftovers(registry)
            for p in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p, signal.SIGKILL)
            if not failed:  # (else the test's own error is the one to see)
                raise AssertionError(f"processes left behind: {left}") from None


def ok(r: Any) -> Any:
    assert r.status == "ok", r.error_text() or r.stream()
    return r


def pull(ks: KernelSession, name: str) -> list:
    r = ok(ks.execute(f"_pulled = %mesh pull {name}\nprint(sorted(_pulled.values()))"))
    return eval(r.stream("stdout").strip().splitlines()[-1])  # noqa: S307 - our own output


def lines_of(text: str) -> dict[int, list[int]]:
    """``{rank: [line numbers in the order seen]}`` of the long cell's output."""
    out: dict[int, list[int]] = {}
    for m in LINE.finditer(text):
        out.setdefault(int(m.group(1)), []).append(int(m.group(2)))
    return out


def stream_text(msgs: list[dict]) -> str:
    return "".join(m["content"].get("text", "") for m in msgs if m["msg_type"] == "stream")


def start_long_cell(ks: KernelSession, until: int = 40, timeout: float = 60) -> list[dict]:
    """Send the long cell without waiting for it; the iopub messages it produced
    until rank 0 printed line ``until``."""
    msg_id = ks.kc.execute(LONG_CELL)
    seen: list[dict] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            msg = ks.kc.get_iopub_msg(timeout=0.2)
        except Exception:  # noqa: BLE001 - queue.Empty
            continue
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        seen.append(msg)
        got = lines_of(stream_text(seen)).get(0, [])
        if got and max(got) >= until:
            return seen
    raise TimeoutError(f"the long cell did not print line {until} within {timeout} s")


def end_kernel(ks: KernelSession, how: str) -> KernelSession | None:
    """End kernel ``ks`` ``how`` (sigkill, restart, shutdown); the kernel that runs
    afterwards (the restarted one), else None."""
    if how == "sigkill":
        pid = ks.pid
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not psutil.pid_exists(pid) or
                 psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, 10, what="kernel dead")
        with contextlib.suppress(Exception):
            ks.kc.stop_channels()
        with contextlib.suppress(Exception):
            ks.km.shutdown_kernel(now=True)
        return None
    if how == "restart":
        ks.km.restart_kernel(now=False)
        ks.kc.wait_for_ready(timeout=60)
        return ks
    ks.shutdown()
    return None


@pytest.mark.parametrize("how", ["sigkill", "restart", "shutdown"])
def test_attach_after_the_kernel_ended_finds_state_actors_and_the_running_cell(registry, how):
    k1 = KernelSession()
    k2: KernelSession | None = None
    with cleanup(registry, "train"):
        try:
            r = ok(k1.execute("%mesh spawn 4 --name train --detach --keep-alive 10m", timeout=120))
            assert "detached" in r.stream(), r.stream()
            ok(k1.execute("%%mesh\nimport os\nstate = rank * 10 + 1\npid = os.getpid()"))
            pids = pull(k1, "pid")
            assert sorted(pids) == sorted(workers(registry)) and len(pids) == 4
            r = ok(k1.execute(COUNTER, timeout=60))
            assert "actor [5, 5, 5, 5]" in r.stream(), r.stream()
            before = stream_text(start_long_cell(k1))

            k2 = end_kernel(k1, how)
            assert sorted(workers(registry)) == sorted(pids), "the workers must live on"
            if k2 is None:
                k2 = KernelSession()

            seen: list[tuple[float, dict]] = []
            t0 = time.monotonic()
            r = k2.execute("%mesh attach train", timeout=120,
                           on_message=lambda m: seen.append((time.monotonic(), m)))
            ok(r)
            text = r.stream()
            attached_at = next(t for t, m in seen if m["msg_type"] == "stream"
                               and "attached to mesh 'train'" in m["content"].get("text", ""))
            print(f"\n[{how}] attach seen in the notebook after {attached_at - t0:.2f} s "
                  f"(cell idle after {time.monotonic() - t0:.2f} s, following the cell; "
                  f"{sum(map(len, lines_of(text).values()))} lines shown, "
                  f"following: {'following what' in text})")
            assert attached_at - t0 < 15, "attach took too long"
            after = lines_of(text)
            first = lines_of(before)
            for rank in range(4):
                got = after.get(rank, [])
                assert len(got) == len(set(got)), f"rank {rank}: lines shown twice: {got}"
                assert set(first.get(rank, [])) | set(got) == set(range(LINES)), \
                    f"rank {rank}: lines lost: {sorted(set(range(LINES)) - set(got))}; " \
                f"the attach showed: {text[:300]!r} ... {text[-300:]!r}"
                assert got == sorted(got), f"rank {rank}: lines out of order"
            assert "done 0" in r.result_text() + text, (r.result_text(), text[-500:])

            assert sorted(pull(k2, "pid")) == sorted(pids)
            assert pull(k2, "state") == [1, 11, 21, 31]
            r = ok(k2.execute('counters = train.actors("counter")\n'
                              "print('actor', list(counters.add.call(1).get(timeout=30)"
                              ".values()))", timeout=60))
            assert "actor [6, 6, 6, 6]" in r.stream(), r.stream()
            r = ok(k2.execute("%mesh status"))
            assert str(pids[0]) in r.result_text()
            ok(k2.execute("%mesh stop train"))
            wait_for(lambda: not workers(registry), 20, what="workers gone after stop")
            r = ok(k2.execute("%mesh list"))
            assert "train" not in r.result_text()
        finally:
            for ks in {id(k): k for k in (k1, k2) if k is not None}.values():
                with contextlib.suppress(Exception):
                    ks.shutdown()


def test_second_attach_refused_steal_takes_over_and_the_first_is_told(registry):
    k1 = KernelSession()
    k2 = KernelSession()
    with cleanup(registry, "shared"):
        try:
            ok(k1.execute("%mesh spawn 4 --name shared --detach", timeout=120))
            pids = sorted(workers(registry))
            r = k2.execute("%mesh attach shared")
            assert r.status == "error" and r.reply["content"]["ename"] == "UsageError"
            evalue = r.reply["content"]["evalue"]
            assert "--steal" in evalue and str(k1.pid) in evalue, evalue
            r = k2.execute("%mesh spawn 4 --name shared --detach")  # (get-or-spawn: busy too)
            assert r.status == "error" and "--steal" in r.reply["content"]["evalue"], r.stream()
            t0 = time.monotonic()
            r = ok(k2.execute("%mesh attach shared --steal", timeout=60))
            took = time.monotonic() - t0
            print(f"\nattach --steal (nothing running), execute_request to idle: {took:.2f} s")
            assert took < 15
            assert sorted(pull(k2, "rank")) == [0, 1, 2, 3]
            assert sorted(workers(registry)) == pids
            r = k1.execute("%mesh status")
            assert r.status == "error", r.result_text()
            assert "taken over" in r.error_text(), r.error_text()
            r = ok(k2.execute("%mesh list"))
            assert "shared" in r.result_text() and "this kernel" in r.result_text()

            # detach and attach again with nothing running: the attach time alone
            ok(k2.execute("%mesh detach"))
            t0 = time.monotonic()
            r = ok(k2.execute("%mesh attach shared", timeout=60))
            took = time.monotonic() - t0
            print(f"attach (4 local ranks, nothing running), execute_request to idle: "
                  f"{took:.2f} s")
            assert took < 15
        finally:
            k1.shutdown()
            k2.shutdown()


def test_get_or_spawn_makes_no_second_set_of_processes(registry):
    k1 = KernelSession()
    k2: KernelSession | None = None
    with cleanup(registry, "gos"):
        try:
            ok(k1.execute("%mesh spawn 4 --name gos --detach", timeout=120))
            pids = sorted(workers(registry))
            r = ok(k1.execute("%mesh spawn 4 --name gos --detach"))
            assert "attached to this kernel already" in r.stream(), r.stream()
            assert sorted(workers(registry)) == pids
            ok(k1.execute("%mesh detach"))
            k1.shutdown()
            k2 = KernelSession()
            r = ok(k2.execute("%mesh spawn 4 --name gos --detach", timeout=120))
            assert "alive already: attached to it instead of spawning" in r.stream(), r.stream()
            assert len(workers(registry)) == 4, "a second set of workers was started"
            assert sorted(workers(registry)) == pids
            assert sorted(pull(k2, "rank")) == [0, 1, 2, 3]
        finally:
            k1.shutdown()
            if k2 is not None:
                k2.shutdown()


def test_plain_meshes_still_end_with_their_kernel(registry):
    k = KernelSession()
    try:
        ok(k.execute("%mesh spawn 2", timeout=120))
        r = ok(k.execute("%mesh list"))
        assert "no durable meshes" in r.result_text()
    finally:
        k.shutdown()
    wait_for(lambda: not workers(registry), 10, what="workers of a plain mesh gone")


def _usage_error(r: Any, *hints: str) -> str:
    assert r.status == "error", r.stream()
    content = r.reply["content"]
    assert content["ename"] == "UsageError", r.error_text()
    evalue = content["evalue"].strip()
    assert "\n" not in evalue and len(evalue) < 300, evalue
    for h in hints:
        assert re.search(h, evalue), (h, evalue)
    return evalue


def test_magic_input_errors_leave_the_running_mesh_alone(registry):
    k = KernelSession()
    with cleanup(registry):
        try:
            ok(k.execute("%mesh spawn 2", timeout=120))
            pids = sorted(workers(registry))
            bad = [
                ("%mesh spawn 2 --name mesh --detach --keep-alive 1w", r"--keep-alive.*30s"),
                ("%mesh spawn 2 --name mesh --detach --keep-alive 0", r"positive duration"),
                ("%mesh spawn 2 --name mesh --detach --keep-alive nan", r"positive duration"),
                ("%mesh spawn 2 --name mesh --detach --keep-alive=-1h", r"positive duration"),
                ("%mesh spawn 2 --detach", r"--detach needs --name"),
                ("%mesh spawn 2 --name mesh --keep-alive 1h", r"add --detach"),
                ("%mesh attach", r"attach"),
                ("%mesh attach nosuch", r"no mesh named 'nosuch'"),
                ("%mesh stop nosuch", r"nosuch"),
                ("%mesh detach", r"without --detach"),
                ("%mesh detach other", r"no mesh named 'other'"),
                ("%mesh list extra", r"unexpected arguments"),
                ("%mesh stop mesh --all", r"not both"),
            ]
            for line, hint in bad:
                _usage_error(k.execute(line), hint)
                assert sorted(workers(registry)) == pids, f"{line!r} touched the mesh"
            assert sorted(pull(k, "rank")) == [0, 1]
        finally:
            k.shutdown()


def test_command_line_list_and_stop(registry):
    r = cli("meshes", "list")
    assert r.returncode == 0 and "no durable meshes" in r.stdout, r.stderr
    r = cli("meshes", "stop", "nosuch")
    assert r.returncode == 1 and "nosuch" in r.stderr and "Traceback" not in r.stderr
    r = cli("meshes")
    assert r.returncode == 2 and "list" in r.stderr
    r = cli("meshes", "frob")
    assert r.returncode == 2
    k = KernelSession()
    with cleanup(registry, "cli"):
        try:
            ok(k.execute("%mesh spawn 2 --name cli --detach --keep-alive 30m", timeout=120))
            ok(k.execute("%mesh detach"))
            r = cli("meshes", "list", "--plain")
            assert r.returncode == 0, r.stderr
            row = next(ln for ln in r.stdout.splitlines() if ln.startswith("cli "))
            assert "detached" in row and "1 host x 2 procs" in row and "local" in row, row
            assert re.search(r"\b(29|30)m\b", row), row
            r = cli("meshes", "stop", "cli")
            assert r.returncode == 0 and "stopped" in r.stdout, r.stderr
            wait_for(lambda: not workers(registry), 20, what="workers gone after meshes stop")
            assert "no durable meshes" in cli("meshes", "list").stdout
        finally:
            k.shutdown()


def test_interrupt_while_following_leaves_the_ranks_running_and_detaches(registry):
    k1 = KernelSession()
    k2: KernelSession | None = None
    with cleanup(registry, "follow"):
        try:
            ok(k1.execute("%mesh spawn 4 --name follow --detach", timeout=120))
            pids = sorted(workers(registry))
            start_long_cell(k1, until=5)
            end_kernel(k1, "sigkill")
            k2 = KernelSession()
            msg_id = k2.kc.execute("%mesh attach follow")
            seen: list[dict] = []
            deadline = time.monotonic() + 60
            while not lines_of(stream_text(seen)).get(0) or \
                    max(lines_of(stream_text(seen))[0]) < 60:
                assert time.monotonic() < deadline, stream_text(seen)[-500:]
                with contextlib.suppress(Exception):
                    msg = k2.kc.get_iopub_msg(timeout=0.2)
                    if msg["parent_header"].get("msg_id") == msg_id:
                        seen.append(msg)
            k2.interrupt()
            deadline = time.monotonic() + 30
            while True:
                assert time.monotonic() < deadline, "no idle after the interrupt"
                try:
                    msg = k2.kc.get_iopub_msg(timeout=0.2)
                except Exception:  # noqa: BLE001 - queue.Empty
                    continue
                if msg["parent_header"].get("msg_id") != msg_id:
                    continue
                if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                    break
                seen.append(msg)
            k2.sync_shell()
            said = [ln for ln in stream_text(seen).splitlines() if "keep running" in ln]
            assert len(said) == 1 and "detached again" in said[0], stream_text(seen)[-800:]
            r = ok(k2.execute("%mesh list"))
            assert re.search(r"follow\s.*detached", r.result_text()), r.result_text()
            assert sorted(workers(registry)) == pids, "the ranks must keep running"
            r = ok(k2.execute("%mesh attach follow", timeout=60))
            got = lines_of(r.stream())
            assert got.get(0) and got[0][-1] == LINES - 1, r.stream()[-500:]
            assert "done 0" in r.result_text() + r.stream()
        finally:
            k1.shutdown()
            if k2 is not None:
                k2.shutdown()


def test_a_rank_paused_in_pdb_while_detached_is_listed_and_served_after_attach(registry):
    k1 = KernelSession()
    k2: KernelSession | None = None
    with cleanup(registry, "dbg"):
        try:
            ok(k1.execute("%mesh spawn 2 --name dbg --detach", timeout=120))
            ok(k1.execute('job = dbg.run("x = 5\\nif rank == 1:\\n    breakpoint()\\n'
                          'print(\'after\', x)\\nx * 2")'))
            wait_for(lambda: "paused" in k1.execute("%mesh status").result_text(), 30,
                     what="rank 1 paused")
            end_kernel(k1, "sigkill")
            k2 = KernelSession()
            prompts: list[str] = []
            answers = ["p x * 7", "c"]

            def answer(prompt: str) -> str:
                prompts.append(prompt)
                return answers.pop(0) if answers else "c"

            r = ok(k2.execute("%mesh attach dbg", timeout=60, on_input=answer))
            text = r.stream()
            assert "rank 1 is paused in pdb at" in text, text
            assert prompts[:2] == ["(Pdb rank 1) ", "(Pdb rank 1) "], prompts
            assert "35" in text and "[1] after 5" in text, text
            assert "10" in r.result_text(), r.result_text()
            # the dashboard and the status table work on the attached mesh
            r = ok(k2.execute("%mesh status"))
            assert "idle" in r.result_text(), r.result_text()
            ok(k2.execute("d = %mesh dashboard --interval 0.5"))
            ok(k2.execute("d.close()"))
        finally:
            k1.shutdown()
            if k2 is not None:
                k2.shutdown()


def test_the_stop_button_still_interrupts_a_durable_meshs_cell(registry):
    k = KernelSession()
    with cleanup(registry, "stopme"):
        try:
            ok(k.execute("%mesh spawn 2 --name stopme --detach", timeout=120))
            msg_id = k.kc.execute("%%mesh\nwhile True:\n    pass")
            time.sleep(1.5)
            k.interrupt()  # (no shutdown follows: the ranks are interrupted as for any mesh)
            deadline = time.monotonic() + 20
            while True:
                assert time.monotonic() < deadline, "the cell was not interrupted"
                try:
                    rep = k.kc.get_shell_msg(timeout=1)
                except Exception:  # noqa: BLE001 - queue.Empty
                    continue
                if rep["parent_header"]["msg_id"] == msg_id:
                    break
            assert rep["content"]["status"] == "error"
            k.wait_idle(msg_id)
            r = ok(k.execute("%%mesh\nrank + 100"))
            assert "101" in r.result_text()
        finally:
            k.execute("%mesh stop stopme")
            k.shutdown()
