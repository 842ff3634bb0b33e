"""A rank printing many short lines reaches the notebook in few stream messages.

5 MB printed as 100-byte lines used to come as one iopub stream message per
64 lines (775 messages); rank output is now written in batches of whatever
complete lines are ready. The tests count messages (no timings) and check
that the text, tags and each rank's order are as before.
"""

from __future__ import annotations

import re

import pytest

from monarch_kernel.testing.kernel import KernelSession

pytestmark = pytest.mark.timeout(300)

LINES = 50_000  # 100 bytes each with the end: 5 MB


@pytest.fixture(scope="module")
def k2():
    ks = KernelSession()
    try:
        r = ks.execute("%mesh spawn 2")
        assert r.status == "ok", r.error_text()
        yield ks
    finally:
        ks.shutdown()


def _streams(r) -> list[dict]:
    return [m["content"] for _, m in r.messages if m["msg_type"] == "stream"]


def test_five_megabytes_of_short_lines_come_in_few_messages(k2):
    code = ("%%mesh --ranks 0\nimport sys\n"
            f"for i in range({LINES}): sys.stdout.write(f'line {{i:08d}} '.ljust(99, 'x') + '\\n')")
    r = k2.execute(code, timeout=300)
    assert r.status == "ok", r.error_text()
    msgs = _streams(r)
    expected = "".join(f"[0] {f'line {i:08d} '.ljust(99, 'x')}\n" for i in range(LINES))
    assert "".join(m["text"] for m in msgs if m["name"] == "stdout") == expected
    assert len(msgs) <= len(expected) // 65536 + 8, len(msgs)


def test_two_ranks_printing_lines_keep_tags_and_order(k2):
    code = ("%%mesh\nimport sys\n"
            "for i in range(20_000):\n"
            "    print(f'r{rank} {i}')\n"
            "    if i % 5000 == 0: print('epoch', i, file=sys.stderr)")
    r = k2.execute(code, timeout=300)
    assert r.status == "ok", r.error_text()
    msgs = _streams(r)
    out = "".join(m["text"] for m in msgs if m["name"] == "stdout")
    seen: dict[int, list[str]] = {0: [], 1: []}
    for line in out.splitlines():
        m = re.fullmatch(r"\[(\d)\] (.*)", line)
        assert m, line
        seen[int(m.group(1))].append(m.group(2))
    assert seen == {rank: [f"r{rank} {i}" for i in range(20_000)] for rank in (0, 1)}
    err = "".join(m["text"] for m in msgs if m["name"] == "stderr").splitlines()
    epochs = [line for line in err if "epoch" in line]
    assert len(epochs) in range(4, 9), err  # folded ([0-1] epoch 0) or one per rank
    assert len(msgs) < 200, len(msgs)
