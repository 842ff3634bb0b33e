"""Exceptions from ranks arrive whole (type, message, traceback, cause, group
members), and values that cannot be sent are named with the part that fails."""

from __future__ import annotations

import builtins
import os
import pickle
import signal
import sys
import textwrap
import threading
import time
import traceback

import cloudpickle
import pytest

from monarch_kernel import Actor, current_rank, endpoint
from monarch_kernel.errors import (
    ActorError,
    MeshFailure,
    RemoteError,
    RemoteFailure,
    SerializationError,
    remote_exception,
)
from monarch_kernel.mesh.shape import MISSING, Shape, ValueMesh
from monarch_kernel.wire import exctree
from monarch_kernel.wire.serialize import find_unpicklable, load_failure

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # (actors defined here)

#: exception groups are built in from Python 3.11
ExceptionGroup = getattr(builtins, "ExceptionGroup", None)
BaseExceptionGroup = getattr(builtins, "BaseExceptionGroup", None)
groups = pytest.mark.skipif(ExceptionGroup is None, reason="no exception groups before 3.11")


def _own(x: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(x), x))


def arrive(e: BaseException, base: type[RemoteError] = RemoteError) -> RemoteError:
    """``e`` described as a rank does, pickled, and rebuilt as the controller does."""
    tree = pickle.loads(pickle.dumps(exctree.describe(e, _own), protocol=5))
    return remote_exception([RemoteFailure(2, None, tree["type"], tree["message"],
                                           tree["traceback"], None, tree)], base)


def raised(fn):
    try:
        fn()
    except BaseException as e:  # noqa: BLE001
        return e
    raise AssertionError("did not raise")


class ShardCorrupt(Exception):
    def __init__(self, shard, why):
        super().__init__(f"shard {shard}: {why}")
        self.shard = shard


def test_memory_error_arrives_as_memory_error():
    err = arrive(MemoryError("out of it"))
    assert isinstance(err, MemoryError) and isinstance(err, RemoteError)
    assert err.ranks == [2] and "out of it" in str(err)
    assert err.remote_type == "MemoryError"


@groups
def test_nested_groups_keep_their_members_and_each_leafs_traceback():
    def leaf():
        raise ValueError("leaf1")

    def fail():
        inner = raised(leaf)
        raise ExceptionGroup("outer", [ExceptionGroup("inner", [inner, KeyError("k")]),
                                       TypeError("t")])

    e = raised(fail)
    err = arrive(e, ActorError)
    assert isinstance(err, ExceptionGroup) and isinstance(err, ActorError)
    inner, t = err.exceptions
    assert isinstance(inner, ExceptionGroup) and isinstance(t, TypeError)
    v, k = inner.exceptions
    assert isinstance(v, ValueError) and isinstance(v, ActorError) and isinstance(k, KeyError)
    assert v.remote_traceback.endswith("ValueError: leaf1\n")
    # the whole text shows every member
    for text in ("ExceptionGroup: outer", "ExceptionGroup: inner", "ValueError: leaf1",
                 "KeyError: 'k'", "TypeError: t"):
        assert text in err.remote_traceback
    match, rest = err.split(ValueError)  # (what ``except* ValueError`` does)
    assert isinstance(match.exceptions[0].exceptions[0], ValueError)  # (structure kept)
    assert isinstance(rest.exceptions[0].exceptions[0], KeyError)


@groups
def test_base_exception_group_with_keyboard_interrupt():
    err = arrive(BaseExceptionGroup("b", [KeyboardInterrupt(), ValueError(1)]))
    assert isinstance(err, BaseExceptionGroup)
    assert isinstance(err.exceptions[0], KeyboardInterrupt)


def test_required_init_arguments_rebuilt_without_calling_init():
    err = arrive(ShardCorrupt(3, "bad crc"))
    assert isinstance(err, ShardCorrupt) and err.shard == 3
    assert "shard 3: bad crc" in str(err)


def test_class_unknown_here_arrives_as_remote_error_naming_it():
    node = exctree.describe(ShardCorrupt(3, "bad crc"), _own)
    node["exc"] = node["cls"] = None  # as where the class cannot be had
    node["module"] = "no_such_module_here"
    node["type"] = "no_such_module_here.ShardCorrupt"
    err = remote_exception([RemoteFailure(0, None, node["type"], node["message"],
                                          node["traceback"], None, node)])
    assert type(err) is RemoteError
    assert err.remote_type == "no_such_module_here.ShardCorrupt"
    assert "shard 3: bad crc" in str(err)
    assert "ShardCorrupt" in "\n".join(err._render_traceback_())


def test_cause_and_context_chains_are_kept():
    def fail():
        try:
            1 / 0  # noqa: B018
        except ZeroDivisionError as z:
            raise RuntimeError("wrapped") from z

    err = arrive(raised(fail))
    assert isinstance(err, RuntimeError)
    assert isinstance(err.__cause__, ZeroDivisionError)
    assert "direct cause" in err.remote_traceback

    def fail2():
        try:
            {}["x"]
        except KeyError:
            raise OSError(2, "gone", "/f") from None

    err = arrive(raised(fail2))
    assert isinstance(err, FileNotFoundError) and err.filename == "/f" and err.errno == 2
    assert err.__cause__ is None and err.__suppress_context__


def test_a_broken_description_still_gives_the_text():
    node = exctree.describe(ValueError("x"), _own)
    node["exc"] = object()  # (no unpack: as a part that fails to unpickle)
    err = remote_exception([RemoteFailure(0, None, "ValueError", "x", "tb", None, node)])
    assert isinstance(err, ValueError) and "x" in str(err)


@groups
def test_remote_error_pickles_again():
    err = arrive(MemoryError("m"))
    back = pickle.loads(pickle.dumps(err))
    assert isinstance(back, MemoryError) and isinstance(back, RemoteError)
    g = arrive(ExceptionGroup("g", [ValueError(1)]))
    back = pickle.loads(pickle.dumps(g))
    assert isinstance(back, ExceptionGroup) and isinstance(back.exceptions[0], ValueError)


def test_find_unpicklable_closure_global_and_containers():
    def make():
        lk = threading.Lock()

        def f():
            return lk
        return f

    f = make()
    path, kind, reason = find_unpicklable(f, "f")
    assert path == "f.__closure__[0].cell_contents" and kind == "_thread.lock"
    assert "_thread.lock" in reason

    class Holder:
        def __init__(self):
            self.items = [1, {"lock": threading.Lock()}]

    path, kind, _ = find_unpicklable({"h": Holder()}, "cfg")
    assert path == "cfg['h'].items[1]['lock']" and kind == "_thread.lock"
    assert find_unpicklable({"a": [1, 2]}, "ok") is None


def test_find_unpicklable_follows_globals():
    ns: dict = {}
    exec("import threading\nLK = threading.Lock()\ndef g():\n    return LK\n", ns)
    ns["g"].__module__ = "__main__"  # (pickled by value, as a notebook's function)
    found = find_unpicklable(ns["g"], "g")
    assert found is not None and found[0] == "g.__globals__['LK']"


def test_load_failure_names_the_class_of_a_missing_module(tmp_path):
    (tmp_path / "kernel_only_mod.py").write_text("class Net:\n    pass\n")
    sys.path.insert(0, str(tmp_path))
    try:
        import kernel_only_mod

        payload = pickle.dumps(kernel_only_mod.Net(), protocol=5)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("kernel_only_mod", None)
    try:
        pickle.loads(payload)
    except ModuleNotFoundError as e:
        text = load_failure(e, payload, "on the ranks")
    assert "class kernel_only_mod.Net" in text and "on the ranks" in text
    e2 = AttributeError("Can't get attribute 'Net' on <module '__main__' (built-in)>")
    assert "class Net is not defined on the ranks" in load_failure(e2, b"", "on the ranks")


def test_missing_is_one_value_that_pickles_as_itself():
    assert pickle.loads(pickle.dumps(MISSING)) is MISSING and not MISSING
    vm = ValueMesh(Shape({"procs": 3}, [0, 1, 2]), [1, MISSING, 3])
    assert vm.missing == [1] and "<missing>" in repr(vm)


# ------------------------------------------------------------ through real workers
def test_cells_raising_awkward_exceptions(local_mesh):
    with pytest.raises(MemoryError) as info:
        local_mesh.exec("raise MemoryError('big')")
    assert isinstance(info.value, RemoteError) and "big" in str(info.value)
    code = textwrap.dedent("""\
        class ShardCorrupt(Exception):
            def __init__(self, shard, why):
                super().__init__(f"shard {shard}: {why}")
                self.shard = shard
        raise ShardCorrupt(rank, "bad crc")
        """)
    with pytest.raises(RemoteError) as info:
        local_mesh.exec(code)
    err = info.value
    assert type(err).__name__ == "ShardCorrupt" and "bad crc" in str(err)
    assert "raise ShardCorrupt" in err.remote_traceback
    if ExceptionGroup is not None:
        with pytest.raises(ExceptionGroup) as info:
            local_mesh.exec("raise ExceptionGroup('g', [ExceptionGroup('h', [ValueError(1)])])")
        assert isinstance(info.value.exceptions[0].exceptions[0], ValueError)


def test_class_only_the_workers_can_import(local_mesh, tmp_path):
    (tmp_path / "worker_only_errors.py").write_text(
        "class Boom(Exception):\n    def __init__(self, a, b):\n        super().__init__(a)\n")
    code = (f"import sys; sys.path.insert(0, {str(tmp_path)!r})\n"
            "import worker_only_errors\nraise worker_only_errors.Boom('kaboom', 2)")
    with pytest.raises(RemoteError) as info:
        local_mesh.exec(code)
    err = info.value
    assert err.remote_type == "worker_only_errors.Boom" and "kaboom" in str(err)
    assert "worker_only_errors" not in sys.modules


class Trainer(Actor):
    @endpoint
    def step(self):
        r = current_rank().rank
        if r == 1:
            time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGKILL)
        return r * 10

    @endpoint
    def grp(self):
        raise ExceptionGroup("bad", [ValueError("v"), KeyError("k")])


def test_rank_death_during_an_endpoint_call_keeps_the_other_answers(local_mesh):
    t = local_mesh.spawn("trainer", Trainer)
    if ExceptionGroup is not None:
        with pytest.raises(ExceptionGroup) as info:
            t.grp.call().get(timeout=30)
        assert isinstance(info.value, ActorError)
    t0 = time.monotonic()
    with pytest.raises(MeshFailure) as info:
        t.step.call().get(timeout=60)
    assert time.monotonic() - t0 < 30
    err = info.value
    assert "trainer.step()" in str(err) and "rank 1" in str(err) and "SIGKILL" in str(err)
    assert err.endpoint == "trainer.step" and err.rank == 1 and err.cancelled == []
    assert err.partial.values() == [0, MISSING, 20, 30] and err.partial.missing == [1]


def test_push_of_a_lock_names_the_part(local_mesh):
    lk = threading.Lock()

    def f():
        return lk

    with pytest.raises(SerializationError) as info:
        local_mesh.push(f=f)
    msg = str(info.value)
    assert "'f'" in msg and "f.__closure__[0].cell_contents -> _thread.lock" in msg
    assert info.value.__cause__ is None and info.value.__suppress_context__
    assert info.value._render_traceback_() == [f"\x1b[1;31mSerializationError\x1b[0m: {msg}"]


def test_push_of_a_class_the_ranks_cannot_import(local_mesh, tmp_path):
    (tmp_path / "kernel_side_mod.py").write_text("class Net:\n    pass\n")
    sys.path.insert(0, str(tmp_path))
    try:
        import kernel_side_mod

        with pytest.raises(SerializationError) as info:
            local_mesh.push(model=kernel_side_mod.Net(), ok=3)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("kernel_side_mod", None)
    msg = str(info.value)
    assert "cannot load 'model'" in msg and "class kernel_side_mod.Net" in msg
    local_mesh.push(ok=4)  # the mesh is fine
    assert local_mesh.exec("ok").values() == [4] * len(local_mesh.ranks)


def test_endpoint_arguments_that_cannot_be_pickled_are_named(local_mesh):
    t = local_mesh.spawn("trainer2", Trainer)
    with pytest.raises(SerializationError) as info:
        t.step.call(cfg={"lock": threading.Lock()})
    msg = str(info.value)
    assert "trainer2.step()" in msg and "kwargs['cfg']['lock'] -> _thread.lock" in msg, msg
    assert info.value.__cause__ is None


# ------------------------------------------------------ names users see
def _plain(lines: list[str]) -> str:
    import re

    return re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(lines))


def test_public_errors_are_named_by_the_package_not_an_internal_module():
    import monarch_kernel
    from monarch_kernel.actor.cycles import WaitCycleError

    for name in ("SerializationError", "RemoteError", "MeshFailure", "WaitCycleError",
                 "SpawnInterrupted", "CollectiveAborted", "NoMeshError"):
        cls = getattr(monarch_kernel, name)
        assert cls.__module__ == "monarch_kernel", name
        assert exctree.type_name(cls) == f"monarch_kernel.{name}"
        assert pickle.loads(pickle.dumps(cls)) is cls  # (found where it says it lives)
    assert _own(WaitCycleError("w")) == "monarch_kernel.WaitCycleError: w\n"
    err = arrive(SerializationError("cannot load x"))
    assert isinstance(err, SerializationError) and isinstance(err, RemoteError)
    text = _plain(err._render_traceback_())
    assert "rank 2 raised monarch_kernel.SerializationError" in text, text
    assert "monarch_kernel.errors" not in text


def test_rebuilt_class_says_it_stands_for_the_remote_one():
    err = arrive(ShardCorrupt(3, "bad crc"))
    cls = type(err)
    assert cls.__name__ == "ShardCorrupt" and cls.__qualname__ == ShardCorrupt.__qualname__
    assert repr(cls) == f"<remote class '{__name__}.ShardCorrupt'>"
    mro = [repr(c) for c in cls.__mro__]
    assert mro[:4] == [f"<remote class '{__name__}.ShardCorrupt'>",
                       "<class 'monarch_kernel.RemoteError'>",
                       "<class 'monarch_kernel.MonarchError'>",
                       f"<class '{__name__}.ShardCorrupt'>"], mro
    # both excepts still work, and it still pickles as itself
    for kind in (ShardCorrupt, RemoteError):
        try:
            raise err
        except kind as caught:
            assert caught is err
    again = pickle.loads(pickle.dumps(err))
    assert type(again) is cls and again.shard == 3


def test_collective_aborted_names_the_ranks_once():
    from monarch_kernel import CollectiveAborted

    text = ("rank 1 quit the debugger while ranks 0, 2 waited for it in a collective "
            "(dist.barrier); their calls were aborted. ")
    fails = [RemoteFailure(r, CollectiveAborted(text), "monarch_kernel.CollectiveAborted",
                           text, f"monarch_kernel.CollectiveAborted: {text}\n")
             for r in (0, 2)]
    err = remote_exception(fails)
    assert isinstance(err, CollectiveAborted) and isinstance(err, RuntimeError)
    assert type(err).__name__ == "CollectiveAborted"  # (what a notebook's error names)
    assert str(err) == text  # no "ranks 0, 2: " in front of it
    assert err.ranks == [0, 2]


def test_reply_that_cannot_be_decoded_is_one_error_for_all_ranks(local_mesh, tmp_path):
    (tmp_path / "worker_only_values.py").write_text("class Thing:\n    pass\n")
    code = (f"import sys; sys.path.insert(0, {str(tmp_path)!r})\n"
            "import worker_only_values\nworker_only_values.Thing()")
    with pytest.raises(SerializationError) as info:
        local_mesh.exec(code)
    err = info.value
    assert isinstance(err, RemoteError) and err.ranks == sorted(local_mesh.ranks), err.ranks
    assert not getattr(err, "others", ()), [str(o) for o in err.others]  # grouped
    text = _plain(err._render_traceback_())
    assert text.startswith("ranks ") and \
        "raised monarch_kernel.SerializationError" in text, text
    assert "monarch_kernel.errors" not in text and "worker_only_values" in text, text
    assert local_mesh.exec("1").values() == [1] * len(local_mesh.ranks)  # the mesh is fine


class SelfCaller(Actor):
    @endpoint
    def remember(self, handle):
        self.me = handle

    @endpoint
    def ping(self):
        return 1

    @endpoint
    def call_self(self):
        return self.me.slice(procs=current_rank().rank).ping.call_one().get(timeout=5)


def test_wait_cycle_error_shows_the_users_frames_and_its_public_name(local_mesh):
    from monarch_kernel import WaitCycleError

    a = local_mesh.slice(procs=slice(0, 1)).spawn("selfcaller", SelfCaller)
    try:
        a.remember.call(a).get(timeout=30)
        with pytest.raises(WaitCycleError) as info:
            a.slice(procs=0).call_self.call_one().get(timeout=30)
    finally:
        a.stop()
    tb = info.value.remote_traceback
    assert "monarch_kernel.WaitCycleError: " in tb, tb
    assert "in call_self" in tb, tb  # the endpoint's own line
    assert "monarch_kernel/actor" not in tb.replace("\\", "/"), tb  # no internal frames
    assert "monarch_kernel.actor.cycles" not in _plain(info.value._render_traceback_())
