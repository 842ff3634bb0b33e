"""Rich display from ranks: ``display(...)`` and matplotlib figures on a worker.

A worker has no IPython shell, so ``IPython.display.display`` would only
print a repr. When (and only when) user code imports IPython's display
functions, this module replaces ``display``, ``update_display``,
``publish_display_data`` and ``clear_output`` in
``IPython.core.display_functions`` (a post-import hook, so workers that
never display anything never import IPython). Each call becomes a
``display`` message to the controller, which publishes it in the notebook
as ``display_data`` tagged with the rank (metadata ``monarch_rank``).

Matplotlib: workers use the backend ``module://monarch_kernel.worker.display``
unless ``MPLBACKEND`` is set; its ``show()`` displays every open figure as
PNG and closes it.
"""

from __future__ import annotations

import base64
import importlib.abc
import importlib.util
import io
import os
import sys
import uuid
from typing import Any, Protocol

__all__ = ["clear_output", "display", "install", "publish_display_data", "update_display"]

_TARGET = "IPython.core.display_functions"


class DisplaySink(Protocol):
    """Where displays go: the worker of this process."""

    def send(self, type: str, content: Any = None, parent: str | None = None) -> None:
        """Send a message to the controller (any thread)."""

    def output_parent(self) -> str | None:
        """The request the calling thread's output is credited to."""


_sink: DisplaySink | None = None


def _send(content: dict[str, Any]) -> None:
    w = _sink
    if w is None:
        return
    w.send("display", content, w.output_parent())


def _format(obj: Any, include: Any = None, exclude: Any = None) -> tuple[dict, dict]:
    mod = type(obj).__module__
    if mod.startswith("matplotlib") and type(obj).__name__ == "Figure":
        buf = io.BytesIO()
        obj.savefig(buf, format="png", bbox_inches="tight")
        return ({"image/png": base64.b64encode(buf.getvalue()).decode("ascii"),
                 "text/plain": repr(obj)}, {})
    from IPython.core.formatters import DisplayFormatter

    global _formatter
    if _formatter is None:
        _formatter = DisplayFormatter()
    return _formatter.format(obj, include=include, exclude=exclude)


_formatter: Any = None


def publish_display_data(data: dict, metadata: dict | None = None, source: Any = None, *,
                         transient: dict | None = None, **kwargs: Any) -> None:
    """Send a display to the controller (replaces IPython's on workers)."""
    _send({"data": data, "metadata": metadata or {}, "transient": transient or {},
           "update": bool(kwargs.get("update", False))})


def display(*objs: Any, include: Any = None, exclude: Any = None, metadata: dict | None = None,
            transient: dict | None = None, display_id: Any = None, raw: bool = False,
            clear: bool = False, **kwargs: Any) -> Any:
    """IPython's ``display`` for a worker: each object goes to the notebook."""
    if clear:
        clear_output(wait=True)
    if display_id is True:
        display_id = uuid.uuid4().hex
    if display_id:
        transient = dict(transient or {}, display_id=display_id)
    for obj in objs:
        md: dict[str, Any]
        if raw:
            data, md = obj, {}
        else:
            data, md = _format(obj, include, exclude)
        if metadata:
            md = dict(md, **metadata)
        publish_display_data(data, md, transient=transient, update=kwargs.get("update", False))
    if display_id:
        from IPython.core.display_functions import DisplayHandle

        return DisplayHandle(display_id)
    return None


def update_display(obj: Any, *, display_id: str, **kwargs: Any) -> None:
    """Update a display made with ``display_id`` (on the same rank)."""
    kwargs["update"] = True
    display(obj, display_id=display_id, **kwargs)


def clear_output(wait: bool = False) -> None:
    """Clear the cell's output (as IPython's ``clear_output``)."""
    _send({"clear": True, "wait": bool(wait)})


def _patch(module: Any) -> None:
    for name in ("display", "update_display", "publish_display_data", "clear_output"):
        setattr(module, name, globals()[name])
    for other in ("IPython.display", "IPython.core.display"):  # imported before the patch
        m = sys.modules.get(other)
        if m is not None:
            for name in ("display", "update_display", "publish_display_data", "clear_output"):
                if hasattr(m, name):
                    setattr(m, name, globals()[name])


class _PostImportHook(importlib.abc.MetaPathFinder):
    """Runs :func:`_patch` right after IPython's display module is executed."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != _TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        original = loader.exec_module

        def exec_module(module: Any) -> None:
            original(module)
            _patch(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install(sink: DisplaySink) -> None:
    """Route IPython display calls and matplotlib's ``show()`` to ``sink`` (the
    worker of this process), as ``display`` messages of the request that the
    displaying thread serves."""
    global _sink
    _sink = sink
    os.environ.setdefault("MPLBACKEND", "module://monarch_kernel.worker.display")
    if _TARGET in sys.modules:
        _patch(sys.modules[_TARGET])
    else:
        sys.meta_path.insert(0, _PostImportHook())


# ---------------------------------------------------------------- matplotlib backend
def _backend_module() -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    return FigureCanvasAgg


def __getattr__(name: str) -> Any:
    # matplotlib imports this module as a backend and asks for FigureCanvas
    if name == "FigureCanvas":
        return _backend_module()
    if name == "FigureManager":
        from matplotlib.backend_bases import FigureManagerBase

        return FigureManagerBase
    raise AttributeError(name)


def show(*args: Any, **kwargs: Any) -> None:
    """matplotlib backend ``show()``: display every open figure, then close it."""
    import matplotlib.pyplot as plt
    from matplotlib._pylab_helpers import Gcf

    for manager in Gcf.get_all_fig_managers():
        display(manager.canvas.figure)
    plt.close("all")
