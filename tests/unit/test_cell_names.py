"""How cells are named on the ranks and shown in tracebacks (util/cells)."""

from __future__ import annotations

import traceback

from monarch_kernel.util.cells import cell_filename, cell_label, location, rewrite_traceback
from monarch_kernel.worker.worker import Worker


def test_names_and_labels():
    assert cell_filename(3) == "<Cell In[3]>"
    assert cell_filename(3, 2) == "<Cell In[3]#2>"
    assert cell_label("<Cell In[3]>") == cell_label("<Cell In[3]#2>") == "Cell In[3]"
    assert cell_label("<mesh-cell-3>") is None and cell_label("x.py") is None
    assert location("<Cell In[12]>", 4) == "Cell In[12], line 4"
    assert location("/a/b.py", 4) == "/a/b.py:4"


def test_rewrite_traceback_as_ipython_names_cells():
    text = ('Traceback (most recent call last):\n'
            '  File "<Cell In[5]>", line 2, in <module>\n    f(0)\n'
            '  File "<Cell In[4]#2>", line 4, in f\n    return 1/b\n'
            '  File "/lib/x.py", line 9, in g\n    pass\n'
            '  File "<Cell In[6]>", line 3\n    y = (\n        ^\n'
            'ZeroDivisionError: division by zero\n')
    out = rewrite_traceback(text)
    assert "  Cell In[5], line 2\n    f(0)\n" in out
    assert "  Cell In[4], line 4, in f()\n    return 1/b\n" in out
    assert '  File "/lib/x.py", line 9, in g\n' in out  # other files as Python writes them
    assert "  Cell In[6], line 3\n" in out  # a SyntaxError's place
    assert rewrite_traceback(out) == out
    assert rewrite_traceback("no cells here") == "no cells here"


def test_run_cell_counts_lines_as_the_editor_and_keeps_its_source():
    w = Worker.__new__(Worker)  # only run_cell's state: a namespace
    w.namespace = {"__name__": "__main__"}
    w.loop = None
    try:
        w.run_cell("a = 1\nb = 1 / 0\n", "<Cell In[7]>", prefix="%%mesh --ranks 0\n")
    except ZeroDivisionError as e:
        frames = traceback.extract_tb(e.__traceback__)
    last = frames[-1]
    assert (last.filename, last.lineno, last.line) == ("<Cell In[7]>", 3, "b = 1 / 0")
    import linecache
    assert linecache.getlines("<Cell In[7]>")[0] == "%%mesh --ranks 0\n"
