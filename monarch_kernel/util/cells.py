"""How code of notebook cells is named on the ranks, and how its places are shown.

A ``%%mesh`` cell runs on the ranks under a file name that carries the
execution count the notebook shows, ``<Cell In[3]>`` (a name in angle
brackets, as Python names code that has no file: pdb and :mod:`linecache`
take it as it is). The ranks register the cell's lines under that name as
the editor shows them, the ``%%mesh`` line included, and compile the cell so
that its line numbers are the editor's. Tracebacks then name the cell as
IPython names its own (``Cell In[3], line 3, in f()``, see
:func:`rewrite_traceback`), and so do the debugger's "paused at" messages
(:func:`location`).

A cell run again under the same execution count (a frontend's execution
that is not stored in the history keeps the count) gets a name of its own,
``<Cell In[3]#2>``, shown as ``Cell In[3]`` all the same.
"""

from __future__ import annotations

import re

__all__ = ["cell_filename", "cell_label", "location", "rewrite_traceback"]

_NAME = re.compile(r"<Cell (In\[\d+\])(?:#\d+)?>")
_FRAME = re.compile(r'^(\s*)File "<Cell (In\[\d+\])(?:#\d+)?>", line (\d+)(?:, in (.+))?$',
                    re.MULTILINE)


def cell_filename(count: int, serial: int = 1) -> str:
    """The file name of cell ``In[count]`` on the ranks: ``"<Cell In[3]>"``, or
    ``"<Cell In[3]#2>"`` for its ``serial``-th run under that count (``serial``
    > 1)."""
    return f"<Cell In[{count}]>" if serial <= 1 else f"<Cell In[{count}]#{serial}>"


def cell_label(filename: str) -> str | None:
    """``"Cell In[3]"`` for a file name made by :func:`cell_filename`, else None."""
    m = _NAME.fullmatch(filename)
    return f"Cell {m.group(1)}" if m else None


def location(filename: str, lineno: int) -> str:
    """A place in code as people read it: ``"Cell In[3], line 4"`` in a cell,
    ``"path/to/file.py:4"`` elsewhere."""
    label = cell_label(filename)
    return f"{label}, line {lineno}" if label else f"{filename}:{lineno}"


def _frame(m: re.Match[str]) -> str:
    indent, cell, lineno, name = m.groups()
    text = f"{indent}Cell {cell}, line {lineno}"
    if name and name != "<module>":
        text += f", in {name}()"
    return text


def rewrite_traceback(text: str) -> str:
    """Python's traceback ``text`` with the frames of cells named as IPython names
    them: ``File "<Cell In[3]>", line 4, in f`` becomes ``Cell In[3], line 4, in
    f()``, and a frame at the top level of a cell reads ``Cell In[3], line 4``.
    Other lines are left as they are."""
    if "<Cell In[" not in text:
        return text
    return _FRAME.sub(_frame, text)
