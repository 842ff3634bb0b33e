"""The dashboard through a real monarch kernel, read from the frontend side (comm messages).

A frontend knows a widget only from IOPub ``comm_open`` (its whole state) and
``comm_msg`` ``update`` messages (changed traits). :class:`WidgetMirror`
rebuilds every model's state from those messages, as JupyterLab does, and
the test reads the dashboard's figures there.
"""

from __future__ import annotations

import os
import queue
import signal
import time
from typing import Any

from monarch_kernel.testing.kernel import KernelSession

BUSY = """%%mesh --ranks 1
import time
t0 = time.time()
while time.time() - t0 < 3:
    pass
"""


class WidgetMirror:
    """Widget models as a frontend sees them, kept up to date from IOPub."""

    def __init__(self, ks: KernelSession) -> None:
        self.ks = ks
        self.models: dict[str, dict[str, Any]] = {}
        self.closed: set[str] = set()
        #: (arrival time, model id, changed state) of every update
        self.updates: list[tuple[float, str, dict[str, Any]]] = []

    def _apply(self, msg: dict[str, Any]) -> None:
        kind, c = msg["msg_type"], msg["content"]
        if kind == "comm_open" and c.get("target_name") == "jupyter.widget":
            self.models[c["comm_id"]] = dict(c["data"]["state"])
        elif kind == "comm_msg" and c["comm_id"] in self.models:
            data = c["data"]
            if data.get("method") == "update":
                self.models[c["comm_id"]].update(data["state"])
                self.updates.append((time.monotonic(), c["comm_id"], data["state"]))
        elif kind == "comm_close":
            self.closed.add(c["comm_id"])

    def pump(self, seconds: float) -> None:
        """Apply every IOPub message that arrives within ``seconds``."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            try:
                msg = self.ks.kc.get_iopub_msg(timeout=min(left, 0.05))
            except queue.Empty:
                continue
            self._apply(msg)

    def execute(self, code: str, timeout: float = 60) -> dict[str, Any]:
        """Run ``code``, applying IOPub messages meanwhile; returns the execute_reply
        (with ``outputs``: the IOPub messages of this execution)."""
        kc = self.ks.kc
        msg_id = kc.execute(code)
        deadline = time.monotonic() + timeout
        reply, idle, outputs = None, False, []
        while not (reply and idle):
            assert time.monotonic() < deadline, f"{code[:40]!r} did not finish in {timeout} s"
            if reply is None:
                try:
                    rep = kc.get_shell_msg(timeout=0.01)
                except queue.Empty:
                    pass
                else:
                    if rep["parent_header"].get("msg_id") == msg_id:
                        reply = rep
                        reply["arrived"] = time.monotonic()
            try:
                msg = kc.get_iopub_msg(timeout=0.05)
            except queue.Empty:
                continue
            self._apply(msg)
            if msg["parent_header"].get("msg_id") == msg_id:
                if msg["msg_type"] == "status":
                    idle = msg["content"]["execution_state"] == "idle"
                else:
                    outputs.append(msg)
        reply["outputs"] = outputs
        return reply

    def view(self, dash_id: str) -> str:
        """The HTML the dashboard ``dash_id`` shows now (its one HTML child's value)."""
        (child,) = self.models[dash_id]["children"]
        return self.models[child.removeprefix("IPY_MODEL_")]["value"]

    def dashboards(self) -> list[str]:
        """Model ids of open dashboards (VBox models with a ``figures`` trait)."""
        return [i for i, s in self.models.items() if "figures" in s and i not in self.closed]

    def find(self, *classes: str) -> dict[str, Any]:
        """The one open model whose ``_dom_classes`` include all of ``classes``."""
        hits = [s for i, s in self.models.items() if i not in self.closed
                and set(classes) <= set(s.get("_dom_classes", ()))]
        assert len(hits) == 1, (classes, len(hits))
        return hits[0]


WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def _ranks(figures: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The snapshot's rank rows by rank (as a string)."""
    return {str(f["rank"]): f for f in figures["ranks"]}


def _ok(reply: dict[str, Any]) -> dict[str, Any]:
    assert reply["content"]["status"] == "ok", reply["content"]
    return reply


def _dashboard_threads(w: WidgetMirror, expect: int | None = None) -> list[str]:
    """Names of the kernel's dashboard threads (waits up to 5 s for ``expect`` of them)."""
    deadline = time.monotonic() + 5
    while True:
        reply = _ok(w.execute(
            "import threading\nsorted(t.name for t in threading.enumerate() "
            "if t.name.startswith('monarch-dashboard'))"))
        results = [m for m in reply["outputs"] if m["msg_type"] == "execute_result"]
        names = eval(results[0]["content"]["data"]["text/plain"])  # a list literal
        if expect is None or len(names) == expect or time.monotonic() > deadline:
            return names
        time.sleep(0.2)


def test_dashboard_live_through_the_kernel(kernel: KernelSession):
    w = WidgetMirror(kernel)
    for code, says in (("%mesh dashboard", "no mesh is running"),
                       ("%mesh spawn 4 --telemetry-interval -1", "telemetry-interval")):
        reply = w.execute(code)
        assert reply["content"]["status"] == "error" and says in reply["content"]["evalue"]
    _ok(w.execute("%mesh spawn 4"))
    reply = w.execute("%mesh dashboard --interval 0")
    assert reply["content"]["status"] == "error" and "positive" in reply["content"]["evalue"]
    reply = _ok(w.execute("dash = %mesh dashboard\ndash"))
    # shown with a display id, and with a static copy (HTML and text) next to the widget
    (shown,) = [m for m in reply["outputs"] if m["msg_type"] == "display_data"]
    display_id = shown["content"]["transient"]["display_id"]
    data = shown["content"]["data"]
    assert WIDGET_VIEW in data and 'class="monarch-dashboard-view"' in data["text/html"]
    assert "4 procs" in data["text/plain"] and "live" not in data["text/plain"]
    (dash_id,) = w.dashboards()
    assert data[WIDGET_VIEW]["model_id"] == dash_id
    w.pump(2.5)  # a couple of idle refreshes: every rank reports
    ranks = _ranks(w.models[dash_id]["figures"])
    assert sorted(ranks) == ["0", "1", "2", "3"]
    assert all(ranks[r]["state"] == "idle" and ranks[r]["rss"] > 0 for r in ranks)
    assert w.models[dash_id]["figures"]["shape"] == "1 host x 4 procs"

    # rank 1 busy for 3 s: its CPU rises well above the idle ranks' (relative: a loaded
    # machine gives the busy rank less than a core), and the updates arrive while the
    # kernel is busy running that cell
    n0 = len(w.updates)
    t_start = time.monotonic()
    reply = _ok(w.execute(BUSY))
    while_busy = [u for u in w.updates[n0:]
                  if u[1] == dash_id and "figures" in u[2] and t_start < u[0] < reply["arrived"]]
    assert len(while_busy) >= 2, "no dashboard updates while the kernel ran the cell"
    w.pump(1.5)  # the sample that covers the end of the loop
    figs = [_ranks(u[2]["figures"]) for u in w.updates[n0:]
            if u[1] == dash_id and "figures" in u[2]]
    assert len(figs) >= 3, len(figs)
    peak = {r: max((f[r]["cpu"] or 0.0) for f in figs) for r in ("0", "1", "2", "3")}
    idle_peak = max(peak[r] for r in ("0", "2", "3"))
    assert peak["1"] > max(3 * idle_peak, 5.0), peak
    assert any(f["1"]["state"] == "running cell" for f in figs)
    assert "running cell" in "".join(
        u[2]["value"] for u in w.updates[n0:] if "value" in u[2])  # drawn, too

    # the timeline: rank 2 takes longer than the others on a cell of every rank
    _ok(w.execute("%%mesh\nimport time\ntime.sleep(2.0 if rank == 2 else 0.1)"))
    w.pump(1.5)
    tl = w.models[dash_id]["figures"]["timeline"]
    assert [e["label"].split(" ")[0] for e in tl[-2:]] == ["Cell", "Cell"], tl
    busy, slow = tl[-2], tl[-1]
    assert list(busy["ranks"]) == ["1"] and busy["ranks"]["1"] >= 2.5
    assert slow["slowest"] == 2 and slow["straggler"], slow
    assert slow["ranks"]["2"] >= 1.9 and max(slow["ranks"][r] for r in "013") < 1.9
    assert 'class="mk-tl mk-slow" data-rank="2"' in w.view(dash_id)

    # kill rank 3: the widget shows it dead (within the 10 s the loop waits; the delay is
    # printed, not asserted: it depends on the machine's load)
    pid3 = _ranks(w.models[dash_id]["figures"])["3"]["pid"]
    n1 = len(w.updates)
    os.kill(pid3, signal.SIGKILL)
    t_kill = time.monotonic()
    seen_dead = None
    while seen_dead is None and time.monotonic() - t_kill < 10:
        w.pump(0.05)
        for t, mid, state in w.updates[n1:]:
            if mid == dash_id and "figures" in state and _ranks(state["figures"])["3"]["dead"]:
                seen_dead = t
                break
    assert seen_dead is not None, "rank 3 never shown dead"
    delay = seen_dead - t_kill
    print(f"rank 3 shown dead {delay:.3f} s after SIGKILL")
    f3 = _ranks(w.models[dash_id]["figures"])["3"]
    assert f3["state"] == "dead (killed by SIGKILL)"
    assert 'class="mk-row mk-r3 mk-dead"' in w.view(dash_id)

    # %mesh status: the same figures as a table, HTML and text
    reply = _ok(w.execute("%mesh status"))
    data = next(m for m in reply["outputs"] if m["msg_type"] == "execute_result")["content"]["data"]
    assert "<th>cpu</th>" in data["text/html"] and "<th>gpu mem</th>" in data["text/html"]
    text = data["text/plain"]
    assert "rss" in text and "threads" in text and "dead (killed by SIGKILL)" in text
    assert text.count("no GPU") >= 3 or "%" in text.split("gpu")[-1]  # GPU hosts show figures

    # a second dashboard closed from the frontend side, the first from Python
    _ok(w.execute("dash2 = %mesh dashboard --interval 0.5\ndash2"))
    (dash2_id,) = [i for i in w.dashboards() if i != dash_id]
    assert len(_dashboard_threads(w, 2)) == 2
    msg = kernel.kc.session.msg("comm_close", {"comm_id": dash2_id, "data": {}})
    kernel.kc.shell_channel.send(msg)
    reply = _ok(w.execute("dash.close()"))
    assert dash_id in w.closed
    # closed: its output keeps the last state as static HTML, no widget view
    (upd,) = [m for m in reply["outputs"] if m["msg_type"] == "update_display_data"
              and m["content"]["transient"]["display_id"] == display_id]
    assert WIDGET_VIEW not in upd["content"]["data"]
    assert 'data-status="closed"' in upd["content"]["data"]["text/html"]
    assert _dashboard_threads(w, 0) == []

    # a third one ends with its mesh
    reply = _ok(w.execute("dash3 = %mesh dashboard\ndash3"))
    (shown,) = [m for m in reply["outputs"] if m["msg_type"] == "display_data"]
    display_id3 = shown["content"]["transient"]["display_id"]
    assert len(_dashboard_threads(w, 1)) == 1
    reply = _ok(w.execute("%mesh stop"))
    assert _dashboard_threads(w, 0) == []
    # the mesh stopped: the output becomes the static last state (figures, "stopped")
    (upd,) = [m for m in reply["outputs"] if m["msg_type"] == "update_display_data"
              and m["content"]["transient"]["display_id"] == display_id3]
    data = upd["content"]["data"]
    assert WIDGET_VIEW not in data
    assert 'data-status="stopped"' in data["text/html"] and "mk-row mk-r0" in data["text/html"]
    assert "mesh stopped" in data["text/plain"] and "live" not in data["text/plain"]
    assert "mk-tl" in data["text/html"]  # the timeline is kept too


def test_kernel_shutdown_keeps_the_dashboard_in_the_output(kernel: KernelSession):
    w = WidgetMirror(kernel)
    _ok(w.execute("%mesh spawn 2"))
    reply = _ok(w.execute("%mesh dashboard"))
    (shown,) = [m for m in reply["outputs"] if m["msg_type"] == "display_data"]
    display_id = shown["content"]["transient"]["display_id"]
    _ok(w.execute("%%mesh\nx = 1"))
    w.pump(1.5)
    kernel.kc.shutdown()  # shutdown_request: the kernel stops its meshes, then exits
    deadline = time.monotonic() + 30
    upd = None
    while upd is None and time.monotonic() < deadline:
        try:
            msg = kernel.kc.get_iopub_msg(timeout=0.5)
        except queue.Empty:
            continue
        if (msg["msg_type"] == "update_display_data"
                and msg["content"]["transient"].get("display_id") == display_id
                and WIDGET_VIEW not in msg["content"]["data"]):
            upd = msg
    assert upd is not None, "no static dashboard in the output at kernel shutdown"
    html_text = upd["content"]["data"]["text/html"]
    assert 'data-status="stopped"' in html_text and "2 procs" in html_text
    assert "mk-row mk-r1" in html_text and "cell" in html_text  # rows and the timeline
