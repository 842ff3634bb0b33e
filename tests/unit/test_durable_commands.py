"""Durable-mesh input without a kernel: durations (``--keep-alive 1h``), the new
``%mesh`` commands' arguments, and the ``%mesh list`` table."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from IPython.core.error import UsageError

from monarch_kernel.kernel.commands import command, usage_text
from monarch_kernel.kernel.meshlist import MeshTable, fmt_duration
from monarch_kernel.util.numbers import parse_duration


@pytest.mark.parametrize("text, seconds", [
    ("30s", 30.0), ("10m", 600.0), ("1h", 3600.0), ("2d", 172800.0), ("1.5h", 5400.0),
    ("90", 90.0), (" 2D ", 172800.0), (45, 45.0), (0.5, 0.5),
])
def test_durations_in_seconds(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["0", "0s", "-1h", "nan", "nanh", "inf", "infd", "1w", "h",
                                  "", "1e12d", "abc", True, None, [1]])
def test_bad_durations_are_refused_in_one_sentence(text):
    with pytest.raises(ValueError) as e:
        parse_duration(text, "--keep-alive")
    msg = str(e.value)
    assert msg.startswith("--keep-alive must be a positive duration")
    assert "30s, 10m, 1h, 2d" in msg and "\n" not in msg


def test_zero_is_allowed_when_asked():
    assert parse_duration("0s", above=False) == 0.0


def test_spawn_takes_detach_and_a_keep_alive_duration():
    a = command("spawn").parse(["4", "--name", "train", "--detach", "--keep-alive", "10m"])
    assert a.detach and a.keep_alive == 600.0 and a.name == "train"
    a = command("spawn").parse(["4"])
    assert not a.detach and a.keep_alive is None and a.name is None


@pytest.mark.parametrize("bad", ["1w", "0", "-5m", "nan", "soon"])
def test_a_bad_keep_alive_is_one_usage_line(bad):
    with pytest.raises(UsageError) as e:
        command("spawn").parse(["4", "--name", "t", "--detach", f"--keep-alive={bad}"])
    msg = str(e.value)
    assert "--keep-alive" in msg and "30s, 10m, 1h, 2d" in msg and "\n" not in msg
    assert len(msg) < 300


def test_attach_detach_list_stop_arguments():
    a = command("attach").parse(["train", "--steal"])
    assert a.name == "train" and a.steal and a.timeout == 30.0
    assert command("detach").parse([]).name is None
    assert command("stop").parse(["train"]).name == "train"
    assert command("stop").parse(["--all"]).all
    with pytest.raises(UsageError, match="attach"):
        command("attach").parse([])
    text = usage_text()
    for line in ("%mesh attach NAME [--steal]", "%mesh detach [NAME]", "%mesh list",
                 "%mesh stop [NAME] [--all]", "[--detach] [--keep-alive TIME]"):
        assert line in text, (line, text)


@pytest.mark.parametrize("seconds, text", [
    (None, ""), (-3, "0s"), (0, "0s"), (42, "42s"), (125, "2m 05s"), (600, "10m"),
    (3599, "59m"), (3900, "1h 05m"), (90000, "1d 01h"),
])
def test_fmt_duration(seconds, text):
    assert fmt_duration(seconds) == text


@dataclass
class Info:
    name: str
    shape: dict
    state: str
    age_s: float
    attached_to: str | None
    keep_alive_left_s: float | None
    launcher: str = "local"
    slurm_job: str | None = None
    job_state: str | None = None


def test_mesh_table_rows_in_words():
    infos = [Info("train", {"hosts": 1, "procs": 4}, "detached", 125, None, 3000),
             Info("eval", {"hosts": 2, "procs": 2}, "attached", 4000, "123@node1", 3600,
                  "slurm", "77"),
             Info("mine", {"hosts": 1, "procs": 1}, "attached", 5, "9@here", 3600)]
    t = MeshTable(infos, here={"mine"})
    rows = {r["name"]: r for r in t.rows}
    assert rows["train"] == {"name": "train", "shape": "1 host x 4 procs", "state": "detached",
                             "age": "2m 05s", "attached": "-", "keep_alive": "50m",
                             "launcher": "local"}
    assert rows["eval"]["attached"] == "123@node1" and rows["eval"]["keep_alive"] == ""
    assert rows["eval"]["launcher"] == "slurm (job 77)"
    assert rows["mine"]["attached"] == "this kernel (9@here)"
    text = repr(t)
    for word in ("durable meshes", "name", "keep-alive left", "train", "detached", "50m"):
        assert word in text
    assert "<table>" in t._repr_html_() and "train" in t._repr_html_()
    plain = t.plain().splitlines()
    assert plain[0].split()[:3] == ["name", "shape", "state"] and len(plain) == 4


def test_mesh_table_shows_the_slurm_job_state():
    """A Slurm mesh's row says its job's state (RUNNING, or PENDING while it waits)."""
    infos = [Info("a", {"procs": 2}, "detached", 5, None, 60, "slurm", "77", "RUNNING"),
             Info("b", {"procs": 2}, "detached", 5, None, 60, "slurm", "78", "PENDING"),
             Info("c", {"procs": 2}, "detached", 5, None, 60, "slurm", "79")]
    rows = {r["name"]: r["launcher"] for r in MeshTable(infos).rows}
    assert rows == {"a": "slurm (job 77, RUNNING)", "b": "slurm (job 78, PENDING)",
                    "c": "slurm (job 79)"}
    assert "PENDING" in MeshTable(infos).plain() and "RUNNING" in repr(MeshTable(infos))


def test_empty_mesh_table_says_how_to_make_one():
    t = MeshTable([])
    assert "no durable meshes" in repr(t) and "--detach" in repr(t)
    assert t.plain() == repr(t) and "no durable meshes" in t._repr_html_()
