"""The kernel side of JupyterLab's mesh sidebar: comm target ``monarch.mesh``
(monarch_kernel/kernel/sidebar.py), driven from a jupyter_client test client as
the sidebar drives it: state messages arrive (also while a cell runs), a
restart action restarts the rank (its pid changes), bad actions get error
replies and the kernel carries on."""

from __future__ import annotations

import queue
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest

from monarch_kernel.testing.kernel import KernelSession


class SidebarComm:
    """A comm to ``monarch.mesh`` opened from the test client."""

    def __init__(self, ks: KernelSession) -> None:
        self.ks = ks
        self.id = uuid.uuid4().hex
        self.seen: list[dict[str, Any]] = []
        self._send("comm_open", {"comm_id": self.id, "target_name": "monarch.mesh", "data": {}})

    def _send(self, msg_type: str, content: dict[str, Any]) -> None:
        kc = self.ks.kc
        kc.shell_channel.send(kc.session.msg(msg_type, content))

    def action(self, **data: Any) -> str:
        rid = uuid.uuid4().hex[:8]
        self._send("comm_msg", {"comm_id": self.id, "data": {**data, "id": rid}})
        return rid

    def send_raw(self, data: Any) -> None:
        self._send("comm_msg", {"comm_id": self.id, "data": data})

    def close(self) -> None:
        self._send("comm_close", {"comm_id": self.id, "data": {}})

    def wait(self, pred: Callable[[dict[str, Any]], bool], timeout: float = 60,
             what: str = "a message") -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                msg = self.ks.kc.get_iopub_msg(timeout=0.2)
            except queue.Empty:
                continue
            if msg["msg_type"] == "comm_close" and msg["content"].get("comm_id") == self.id:
                raise AssertionError("the kernel closed the sidebar's comm")
            if msg["msg_type"] != "comm_msg" or msg["content"].get("comm_id") != self.id:
                continue
            data = msg["content"]["data"]
            self.seen.append(data)
            if pred(data):
                return data
        raise AssertionError(f"no {what} within {timeout} s; last: {self.seen[-3:]}")

    def state(self, pred: Callable[[dict[str, Any]], bool] = lambda s: True,
              timeout: float = 60) -> dict[str, Any]:
        return self.wait(lambda d: d.get("type") == "state" and pred(d), timeout, "state")

    def reply(self, rid: str, timeout: float = 120) -> dict[str, Any]:
        return self.wait(lambda d: d.get("type") == "reply" and d.get("id") == rid, timeout,
                         f"reply {rid}")


def ranks_of(state: dict[str, Any], mesh: str = "mesh") -> dict[int, dict[str, Any]]:
    for m in state["meshes"]:
        if m["name"] == mesh:
            return {r["rank"]: r for h in m["hosts"] for r in h["ranks"]}
    return {}


@pytest.fixture
def ks(kernel):
    r = kernel.execute("%mesh spawn 4")
    assert r.status == "ok", r.error_text()
    return kernel


def test_state_restart_and_bad_actions(ks):
    side = SidebarComm(ks)
    st = side.state(lambda s: len(ranks_of(s)) == 4 and all(
        r["kind"] == "idle" and r["cpu"] is not None for r in ranks_of(s).values()))
    m = st["meshes"][0]
    assert m["shape"] == {"hosts": 1, "procs": 4} and m["current"] and m["status"] == "live"
    assert len(m["hosts"]) == 1 and [r["rank"] for r in m["hosts"][0]["ranks"]] == [0, 1, 2, 3]
    rows = ranks_of(st)
    assert all(r["rss"] > 0 and r["pid"] for r in rows.values())
    old_pid = rows[2]["pid"]

    # while a cell runs: the ranks it runs on say so, with the cell's execution count
    msg_id = ks.kc.execute("%%mesh --ranks 1,2\nimport time\ntime.sleep(4)")
    st = side.state(lambda s: ranks_of(s)[1]["kind"] == "running", timeout=30)
    rows = ranks_of(st)
    assert rows[1]["text"].startswith("running cell In[") and rows[2]["kind"] == "running"
    assert rows[0]["kind"] == "idle" and rows[3]["kind"] == "idle"
    ks.wait_idle(msg_id, timeout=60)

    # restart rank 2: a fresh process
    rid = side.action(action="restart", mesh="mesh", rank=2)
    rep = side.reply(rid)
    assert rep["ok"], rep
    assert "restarted rank 2" in rep["message"]
    st = side.state(lambda s: ranks_of(s)[2]["pid"] not in (None, old_pid)
                    and ranks_of(s)[2]["kind"] == "idle")
    r = ks.execute("%%mesh\nrank")
    assert r.status == "ok", r.error_text()

    # bad requests: an error reply each, the kernel and the comm carry on
    for data, words in [
        ({"action": "restart", "mesh": "nope", "rank": 0}, "no running mesh named 'nope'"),
        ({"action": "restart", "mesh": "mesh", "rank": 9}, "has no rank 9"),
        ({"action": "restart", "mesh": "mesh", "rank": "1"}, "must be a rank number"),
        ({"action": "restart", "mesh": "mesh", "rank": True}, "must be a rank number"),
        ({"action": "restart", "mesh": "mesh"}, "must be a rank number"),
        ({"action": "format_disk"}, "unknown action 'format_disk'"),
        ({"action": "stop", "mesh": ["mesh"]}, "must be a mesh's name"),
    ]:
        rep = side.reply(side.action(**data))
        assert not rep["ok"] and words in rep["error"], (data, rep)
    side.send_raw(["not", "an", "object"])
    side.send_raw(None)
    side.state()  # still sending
    r = ks.execute("%%mesh\nrank * 2")
    assert r.status == "ok" and "6" in r.result_text(), r.error_text()

    # stop the mesh: it leaves the state; stopping it again is an error
    rep = side.reply(side.action(action="stop", mesh="mesh"))
    assert rep["ok"] and "stopped" in rep["message"], rep
    side.state(lambda s: not s["meshes"])
    rep = side.reply(side.action(action="stop", mesh="mesh"))
    assert not rep["ok"] and "no running mesh named 'mesh'" in rep["error"]
    side.close()


def test_dead_and_paused_ranks(ks):
    side = SidebarComm(ks)
    side.state(lambda s: len(ranks_of(s)) == 4)
    r = ks.execute("%%mesh --ranks 3\nimport os\nos._exit(7)")
    assert r.status == "error"
    st = side.state(lambda s: ranks_of(s)[3]["kind"] == "dead")
    assert ranks_of(st)[3]["text"] == "dead (exit code 7)" and ranks_of(st)[3]["exitcode"] == 7
    # a background thread paused in pdb (the cell ended): paused at the cell's line
    r = ks.execute("%%mesh --ranks 1\nimport threading\ndef bg():\n    x = 1\n    breakpoint()\n"
                   "    x += 1\nthreading.Thread(target=bg).start()")
    assert r.status == "ok", r.error_text()
    n = r.reply["content"]["execution_count"]
    st = side.state(lambda s: ranks_of(s)[1]["kind"] == "paused")
    row = ranks_of(st)[1]
    assert row["text"] == f"paused at Cell In[{n}], line 6" and row["function"] == "bg"
    assert row["debug_in_cell"] is False
    # an actor endpoint running: "in endpoint ACTOR.NAME" (the worker's telemetry says so)
    r = ks.execute("from monarch_kernel import Actor, endpoint\n"
                   "class Slow(Actor):\n"
                   "    @endpoint\n"
                   "    def crunch(self, s):\n"
                   "        import time\n"
                   "        time.sleep(s)\n"
                   "        return s\n"
                   "slow = mesh.slice(procs=slice(0, 1)).spawn('slow', Slow)")
    assert r.status == "ok", r.error_text()
    msg_id = ks.kc.execute("slow.crunch.call(4).get()")
    st = side.state(lambda s: ranks_of(s)[0]["kind"] == "endpoint", timeout=30)
    assert ranks_of(st)[0]["text"] == "in endpoint slow.crunch", ranks_of(st)[0]
    ks.wait_idle(msg_id, timeout=60)
    side.close()
    r = ks.execute("%mesh stop")
    assert r.status == "ok", r.error_text()
