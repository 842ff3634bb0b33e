"""Distributed tensors in the real monarch kernel: %mesh ref, %mesh show, handles in cells."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def k22(shared_kernel):
    r = shared_kernel.execute("%mesh spawn 2x2 --dist gloo", timeout=180)
    assert r.status == "ok", r.error_text()
    assert "4 ranks (2 hosts x 2 procs) ready" in r.stream(), r.stream()
    r = shared_kernel.execute("%%mesh\ntorch.set_num_threads(1)\nx = torch.arange(4.) + rank")
    assert r.status == "ok", r.error_text()
    return shared_kernel


def test_device_mesh_in_cells_has_the_mesh_dims(k22):
    r = k22.execute("%%mesh\n(device_mesh.mesh_dim_names, tuple(device_mesh.shape), "
                    "device_mesh['procs'].mesh.tolist())")
    assert r.status == "ok", r.error_text()
    text = r.result_text()
    assert text.count("(('hosts', 'procs'), (2, 2), [0, 1])") == 2, text
    assert text.count("(('hosts', 'procs'), (2, 2), [2, 3])") == 2, text


def test_ref_show_and_handles_in_cells(k22):
    r = k22.execute("r = %mesh ref x\nr")
    assert r.status == "ok", r.error_text()
    assert "<Ref 'x' on {'hosts': 2, 'procs': 2}>" in r.result_text()
    r = k22.execute("%mesh show r")
    assert r.status == "ok", r.error_text()
    [res] = [m for _, m in r.messages if m["msg_type"] == "execute_result"]
    text, page = res["content"]["data"]["text/plain"], res["content"]["data"]["text/html"]
    assert "x on {'hosts': 2, 'procs': 2}" in text
    assert "Tensor  4      float32  cpu     [3, 4, 5, 6]" in text, text
    assert "<table>" in page and "float32" in page
    # a handle named in a cell is the rank's own value (the very object: nothing moved)
    r = k22.execute("%%mesh\n(r is x, float(r.sum()))")
    assert r.status == "ok", r.error_text()
    assert "(True, 6.0)" in r.result_text() and "(True, 18.0)" in r.result_text()
    r = k22.execute("s = r.reduce('procs', 'sum')\n"
                    "print(s.fetch(hosts=1, procs=0).tolist())")
    assert r.status == "ok", r.error_text()
    assert r.stream().strip() == "[5.0, 7.0, 9.0, 11.0]"
    r = k22.execute("%%mesh --ranks 2\ns.tolist()")
    assert r.status == "ok", r.error_text()
    assert "[5.0, 7.0, 9.0, 11.0]" in r.result_text()
    r = k22.execute("%mesh show x --values 2")  # a rank variable by name
    assert r.status == "ok", r.error_text()
    assert "[0, 1, ...]" in r.result_text()


def test_a_handle_on_other_ranks_is_refused_in_a_cell(k22):
    r = k22.execute("r0 = mesh.ref('x').slice(hosts=0)")
    assert r.status == "ok", r.error_text()
    r = k22.execute("%%mesh\nr0")
    assert r.status == "error"
    assert "also runs on ranks 2, 3" in r.error_text()
    r = k22.execute("%%mesh --ranks 0:2\nfloat(r0.sum())")
    assert r.status == "ok", r.error_text()


@pytest.mark.parametrize("line, message", [
    ("%mesh ref", "%mesh ref: name one variable"),
    ("%mesh ref nosuch", "name 'nosuch' is not defined; define nosuch on the ranks first"),
    ("%mesh show nosuch", "name 'nosuch' is not defined on the ranks"),
    ("%mesh show 3x", "neither a handle nor a variable name"),
])
def test_usage_errors_are_one_line(k22, line, message):
    r = k22.execute(line)
    assert r.status == "error"
    text = r.error_text()
    assert "UsageError" in text and message in text, text
    assert "Traceback" not in text


def test_help_lists_ref_and_show(k22):
    out = k22.execute("%mesh help").stream()
    assert "r = %mesh ref NAME" in out and "%mesh show REF|NAME" in out


COUNT = """\
import monarch_kernel.wire.serialize as _S
_moved, _dumps, _loads = [0], _S.dumps, _S.loads
def _counting_dumps(obj):
    payload, buffers = _dumps(obj)
    _moved[0] += len(payload) + sum(memoryview(b).nbytes for b in buffers)
    return payload, buffers
def _counting_loads(payload, buffers=()):
    _moved[0] += memoryview(payload).nbytes + sum(memoryview(b).nbytes for b in buffers)
    return _loads(payload, buffers)
_S.dumps, _S.loads = _counting_dumps, _counting_loads
"""


def test_a_handle_in_a_cell_moves_no_bytes(k22):
    r = k22.execute("%%mesh\nbig = torch.ones(1 << 18) * rank  # 1 MiB per rank")
    assert r.status == "ok", r.error_text()
    r = k22.execute("big_r = %mesh ref big\n" + COUNT)  # the kernel counts what it (un)pickles
    assert r.status == "ok", r.error_text()
    try:
        r = k22.execute("%%mesh\n(big_r is big, float(big_r.sum()))")
        assert r.status == "ok", r.error_text()
        assert "(True, 786432.0)" in r.result_text()
        moved = int(k22.execute("print(_moved[0]); _moved[0] = 0").stream())
        assert moved < 16_000, moved  # the cell, the handle's id, the small results
        k22.execute("_ = big_r.gather(); del _")
        assert int(k22.execute("print(_moved[0])").stream()) > 4 << 20  # data does count
    finally:
        k22.execute("_S.dumps, _S.loads = _dumps, _loads")
