"""A real kernel sends %%mesh rank output as application/vnd.monarch.rankstream+json only
after a frontend announced that it renders it (a comm to monarch.rankstream, opened from
the client as the JupyterLab extension opens it), and plain "[r]" streams otherwise; the
bundle's text/plain is exactly the stream text."""

from __future__ import annotations

import queue
import time
import uuid

import pytest

from monarch_kernel.kernel.rankstream import COMM_TARGET, MIME
from monarch_kernel.testing.kernel import KernelSession

pytestmark = pytest.mark.timeout(240)

CELL = (
    "%%mesh\n"
    "import sys\n"
    "print('same on every rank')\n"
    "print(f'rank {rank} says hi')\n"
    "if rank == 2:\n"
    "    print('trouble on 2', file=sys.stderr)\n"
)


@pytest.fixture(scope="module")
def k4():
    ks = KernelSession()
    try:
        r = ks.execute("%mesh spawn 4")
        assert r.status == "ok", r.error_text()
        yield ks
    finally:
        ks.shutdown()


def _comm(ks: KernelSession, msg_type: str, content: dict) -> str:
    msg = ks.kc.session.msg(msg_type, content)
    ks.kc.shell_channel.send(msg)
    return msg["header"]["msg_id"]


def _open_comm(ks: KernelSession, data: dict) -> tuple[str, dict]:
    """Open a comm to monarch.rankstream; return its id and the kernel's first message on it."""
    comm_id = uuid.uuid4().hex
    _comm(ks, "comm_open", {"comm_id": comm_id, "target_name": COMM_TARGET, "data": data})
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            msg = ks.kc.get_iopub_msg(timeout=0.2)
        except queue.Empty:
            continue
        if msg["msg_type"] in ("comm_msg", "comm_close") and \
                msg["content"].get("comm_id") == comm_id:
            return comm_id, msg
    raise TimeoutError("the kernel did not answer the comm_open within 30 s")


def _displays(r) -> list[dict]:
    return [m for _, m in r.messages if m["msg_type"] in ("display_data", "update_display_data")]


def _per_rank(text: str) -> list[tuple[int, str]]:
    """ "[0-2, 5] x" lines -> sorted (rank, "x") pairs (folding depends on timing)."""
    out = []
    for line in text.splitlines():
        tag, _, rest = line[1:].partition("] ")
        for part in tag.split(","):
            lo, _, hi = part.strip().partition("-")
            out += [(r, rest) for r in range(int(lo), int(hi or lo) + 1)]
    return sorted(out)


def test_plain_streams_until_announced_then_mime_bundle_then_plain_again(k4):
    before = k4.execute(CELL, timeout=60)
    assert before.status == "ok", before.error_text()
    assert not _displays(before)
    out, err = before.stream("stdout"), before.stream("stderr")
    assert {(r, "same on every rank") for r in range(4)} <= set(_per_rank(out))
    assert err == "[2] trouble on 2\n"

    comm_id, reply = _open_comm(k4, {"mimetypes": [MIME]})
    try:
        assert reply["msg_type"] == "comm_msg"
        assert reply["content"]["data"] == {"mime": MIME, "version": 1}
        after = k4.execute(CELL, timeout=60)
        r = k4.execute("print('controller')")
    finally:
        _comm(k4, "comm_close", {"comm_id": comm_id, "data": {}})
        k4.sync_shell()
    assert after.status == "ok", after.error_text()
    assert after.stream() == ""  # no "[r]" stream text: it all went to the bundle
    shown = _displays(after)
    assert shown and all(MIME in m["content"]["data"] for m in shown)
    assert all(m["content"]["transient"]["display_id"].startswith("monarch-rankstream-")
               for m in shown)
    last: dict[str, dict] = {}
    for m in shown:
        last[m["content"]["transient"]["display_id"]] = m["content"]["data"]
    plain = "".join(d["text/plain"] for d in last.values())
    # the fallback holds the lines the streams held (folding and order across streams aside)
    assert _per_rank(plain) == _per_rank(out + err)
    lines = [e for d in last.values() for e in d[MIME]["lines"]]
    assert sorted(r for e in lines if e["text"] == "same on every rank" for r in e["ranks"]) \
        == [0, 1, 2, 3]
    assert {"ranks": [2], "stream": "stderr", "text": "trouble on 2"} in lines
    assert {"ranks": [3], "stream": "stdout", "text": "rank 3 says hi"} in lines
    assert all(d[MIME]["ranks"] == [0, 1, 2, 3] for d in last.values())

    # an ordinary (controller) cell's print stays a stream
    assert r.stream("stdout") == "controller\n" and not _displays(r)

    again = k4.execute(CELL, timeout=60)  # the comm is closed: plain streams again
    assert not _displays(again)
    assert _per_rank(again.stream("stdout")) == _per_rank(out)
    assert again.stream("stderr") == err


def test_progress_bars_one_display_ordered_by_rank(k4):
    comm_id, _ = _open_comm(k4, {})
    try:
        r = k4.execute(
            "%%mesh\nimport sys, time\n"
            "time.sleep(0.05 * (3 - rank))\n"  # rank 3 draws first
            "for i in range(1, 6):\n"
            "    sys.stderr.write(f'\\r{i * 20}%|'); sys.stderr.flush(); time.sleep(0.05)\n"
            "sys.stderr.write('\\n')\n", timeout=60)
        assert r.status == "ok", r.error_text()
        bars = [m["content"]["data"] for m in _displays(r)
                if "progress" in m["content"]["data"][MIME]]
        assert bars, [m["content"]["data"] for m in _displays(r)]
        assert len({m["content"]["transient"]["display_id"] for m in _displays(r)
                    if "progress" in m["content"]["data"][MIME]}) == 1
        final = bars[-1]
        assert [b["rank"] for b in final[MIME]["progress"]] == [0, 1, 2, 3]
        assert all(b["text"] == "100%|" for b in final[MIME]["progress"])
        assert final["text/plain"] == "".join(f"[{r}] 100%|\n" for r in range(4))
    finally:
        _comm(k4, "comm_close", {"comm_id": comm_id, "data": {}})
        k4.sync_shell()


def test_a_frontend_that_renders_other_types_is_refused(k4):
    comm_id, reply = _open_comm(k4, {"mimetypes": ["text/x-other"]})
    assert reply["msg_type"] == "comm_close"
    r = k4.execute("%%mesh\nprint('x')", timeout=60)
    assert _per_rank(r.stream("stdout")) == [(i, "x") for i in range(4)] and not _displays(r)
