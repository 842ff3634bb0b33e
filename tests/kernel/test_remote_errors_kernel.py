"""Through the real kernel: what a notebook shows of exceptions raised on ranks
(awkward types, groups, chains), of a rank that dies during an endpoint call,
and of values that cannot be pushed."""

from __future__ import annotations

import sys
import textwrap

import pytest

groups = pytest.mark.skipif(sys.version_info < (3, 11), reason="no exception groups before 3.11")


@pytest.fixture(scope="module")
def ks(shared_kernel):
    r = shared_kernel.execute("%mesh spawn 4")
    assert r.status == "ok", r.error_text()
    return shared_kernel


def cell_error(ks, code, timeout=60):
    r = ks.execute(code, timeout=timeout)
    assert r.status == "error", r.stream()
    return r.error()["ename"], r.error_text()


def test_memory_error(ks):
    ename, text = cell_error(ks, "%%mesh\nraise MemoryError('out of it')")
    assert ename == "MemoryError", text
    assert "out of it" in text and "is not safe" not in text
    assert "raise MemoryError('out of it')" in text  # the rank's traceback


@groups
def test_nested_exception_group(ks):
    code = textwrap.dedent("""\
        %%mesh
        def leaf():
            raise ValueError(f'leaf of rank {rank}')
        try:
            leaf()
        except ValueError as e:
            inner = e
        raise ExceptionGroup('outer', [ExceptionGroup('inner', [inner, KeyError('k')]),
                                       TypeError('t')])
        """)
    ename, text = cell_error(ks, code)
    assert ename == "ExceptionGroup", text
    for part in ("ExceptionGroup: outer", "ExceptionGroup: inner", "leaf of rank 2",
                 "KeyError: 'k'", "TypeError: t", "in leaf"):
        assert part in text, text
    assert "takes exactly 2 arguments" not in text
    assert "monarch_kernel" not in text  # shown as the ranks formatted it, no package frames


def test_exception_with_required_init_arguments_defined_in_a_cell(ks):
    code = textwrap.dedent("""\
        %%mesh
        class ShardCorrupt(Exception):
            def __init__(self, shard, why):
                super().__init__(f'shard {shard}: {why}')
                self.shard = shard
        raise ShardCorrupt(rank, 'bad crc')
        """)
    ename, text = cell_error(ks, code)
    assert ename == "ShardCorrupt", text
    assert "bad crc" in text and "missing 1 required positional argument" not in text
    assert "cannot unpickle" not in text
    # the notebook can read what the rank set on it
    r = ks.execute(textwrap.dedent("""\
        from monarch_kernel.errors import RemoteError
        try:
            mesh.exec("raise ShardCorrupt(rank, 'again')")
        except RemoteError as e:
            print(type(e).__name__, e.shard, sorted(e.ranks))
        """))
    assert r.status == "ok", r.error_text()
    assert "ShardCorrupt 0 [0]" in r.stream(), r.stream()


def test_cause_chain(ks):
    code = textwrap.dedent("""\
        %%mesh
        try:
            1 / 0
        except ZeroDivisionError as e:
            raise RuntimeError('wrapped') from e
        """)
    ename, text = cell_error(ks, code)
    assert ename == "RuntimeError"
    assert "ZeroDivisionError: division by zero" in text and "direct cause" in text


ACTORS = textwrap.dedent("""\
    import os, signal, time
    from monarch_kernel import Actor, endpoint, current_rank
    from monarch_kernel.errors import MeshFailure
    from monarch_kernel.mesh.shape import MISSING

    class Trainer(Actor):
        @endpoint
        def grp(self):
            raise ExceptionGroup('bad step', [ValueError(f'nan on rank {current_rank().rank}')])

        @endpoint
        def step(self):
            r = current_rank().rank
            if r == 1:
                time.sleep(0.5)  # the others have answered
                os.kill(os.getpid(), signal.SIGKILL)
            return r * 10

    trainer = mesh.spawn('trainer', Trainer)
    """)


@pytest.fixture(scope="module")
def trainer(ks):
    r = ks.execute(ACTORS, timeout=60)
    assert r.status == "ok", r.error_text()
    return ks


@groups
def test_endpoint_raising_a_group(trainer):
    ks = trainer
    ename, text = cell_error(ks, "trainer.grp.call().get(timeout=30)")
    assert ename == "ExceptionGroup", text
    assert "bad step" in text and "nan on rank 3" in text and "actor trainer" in text
    r = ks.execute(textwrap.dedent("""\
        try:
            trainer.grp.call().get(timeout=30)
        except* ValueError as eg:
            print('caught', len(eg.exceptions))
        """), timeout=60)
    assert r.status == "ok", r.error_text()
    assert "caught 1" in r.stream()


def test_rank_killed_during_an_endpoint_call(trainer):
    ks = trainer
    r = ks.execute(textwrap.dedent("""\
        try:
            trainer.step.call().get(timeout=60)
        except MeshFailure as e:
            err = e
        print('MSG', err)
        print('PARTIAL', err.partial.values(), err.partial.missing, err.cancelled)
        """), timeout=90)
    assert r.status == "ok", r.error_text()
    out = r.stream()
    assert "trainer.step()" in out and "rank 1" in out and "SIGKILL" in out, out
    assert "PARTIAL [0, <missing>, 20, 30] [1] []" in out, out
    r = ks.execute("%mesh restart 1", timeout=120)
    assert r.status == "ok", r.error_text()


def test_push_of_a_function_holding_a_lock(ks):
    code = textwrap.dedent("""\
        import threading
        def make():
            lock = threading.Lock()
            def f():
                with lock:
                    return 1
            return f
        f = make()
        %mesh push f
        """)
    ename, text = cell_error(ks, code)
    assert ename == "SerializationError"
    assert "'f'" in text and "f.__closure__[0].cell_contents -> _thread.lock" in text, text
    assert "monarch_kernel" not in text and "File " not in text, text
    assert len(text.splitlines()) <= 4, text


def test_push_of_a_value_whose_class_the_ranks_cannot_load(ks, tmp_path):
    (tmp_path / "notebook_side_model.py").write_text("class Net:\n    pass\n")
    code = textwrap.dedent(f"""\
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        import notebook_side_model
        model = notebook_side_model.Net()
        sys.path.remove({str(tmp_path)!r})
        %mesh push model
        """)
    ename, text = cell_error(ks, code)
    assert "cannot load 'model'" in text and "class notebook_side_model.Net" in text, text
    assert "monarch_kernel/" not in text, text
