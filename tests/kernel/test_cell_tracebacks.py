"""Through the real kernel: tracebacks from ``%%mesh`` cells name the cell as the
notebook shows it (``Cell In[N]``, N its execution count, as IPython names its own
cells) with line numbers as in the editor (the ``%%mesh`` line is line 1)."""

from __future__ import annotations

import re

import pytest


@pytest.fixture(scope="module")
def ks(shared_kernel):
    r = shared_kernel.execute("%mesh spawn 2")
    assert r.status == "ok", r.error_text()
    return shared_kernel


def count(r) -> int:
    return r.reply["content"]["execution_count"]


def test_error_on_line_3_names_the_cell_and_the_editor_line(ks):
    r = ks.execute("%%mesh\nx = rank\nraise ValueError(f'bad {x}')\n")
    assert r.status == "error"
    text = r.error_text()
    n = count(r)
    assert f"Cell In[{n}], line 3" in text, text
    assert "raise ValueError(f'bad {x}')" in text  # the source line, from the rank's linecache
    assert "mesh-cell" not in text and 'File "<' not in text, text


def test_error_in_a_function_of_an_earlier_cell(ks):
    r1 = ks.execute("%%mesh\ndef scale(a):\n    b = a - a\n    return 1 / b\n")
    assert r1.status == "ok", r1.error_text()
    r2 = ks.execute("%%mesh\ny = 3\nscale(y)")
    assert r2.status == "error"
    text = r2.error_text()
    assert re.search(rf"Cell In\[{count(r2)}\], line 3\n\s+scale\(y\)", text), text
    assert re.search(rf"Cell In\[{count(r1)}\], line 4, in scale\(\)\n\s+return 1 / b",
                     text), text
    assert count(r1) != count(r2)


def test_blank_lines_and_options_above_the_body_count_too(ks):
    r = ks.execute("\n%%mesh --ranks 0\n\n1 / 0\n")
    assert r.status == "error"
    assert f"Cell In[{count(r)}], line 4" in r.error_text(), r.error_text()


def test_syntax_error_names_the_editor_line(ks):
    r = ks.execute("%%mesh\nx = 1\ny = (\n")
    assert r.status == "error"
    text = r.error_text()
    assert f"Cell In[{count(r)}], line 3" in text, text
    assert "SyntaxError" in text


def test_magic_called_from_code_names_the_calling_cell(ks):
    r = ks.execute("x = 1\nget_ipython().run_cell_magic('mesh', '', 'y = 2\\n1 / 0')")
    assert r.status == "error"
    # no %%mesh line above the body here: lines are the body's
    assert f"Cell In[{count(r)}], line 2" in r.error_text(), r.error_text()
