"""The mesh sidebar (extensions/monarch-jupyterlab, src/sidebar.ts) in a real browser.

JupyterLab (started here, as tests/system/test_browser_dashboard.py does) with the
built extension, a notebook on the monarch kernel, headless Chromium driven by
Playwright: the sidebar lists the mesh and its ranks' states while a cell runs
("running cell In[2]"), docks the mesh's dashboard in the main area, its
restart button restarts a rank (a new pid, idle again), and a rank paused in pdb
shows where ("paused at Cell In[3], line 4") with a Debug button that goes to
its prompt in the running cell; after a kernel restart it follows the new kernel. Screenshots go to
``tests/artifacts/sidebar/`` (git-ignored; ``MONARCH_TEST_ARTIFACTS`` moves it).

The extension is taken from the build in this checkout
(``extensions/monarch-jupyterlab/labextension``, made by ``bash extensions/build.sh``),
put first on ``JUPYTER_PATH`` as ``scripts/labextensions.sh`` links it into a venv;
else from the environment's ``share/jupyter/labextensions``. Skipped, saying why,
when neither exists or Chromium, JupyterLab or Playwright is missing.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from system.test_browser_dashboard import CHROMIUM, CHROMIUM_ARGS, JupyterLab, _missing

ROOT = Path(__file__).resolve().parents[2]
EXT_NAME = "monarch-kernel-jupyterlab"
BUILD = ROOT / "extensions" / "monarch-jupyterlab" / "labextension"
INSTALLED = Path(sys.prefix, "share", "jupyter", "labextensions", EXT_NAME)
ARTIFACTS = Path(os.environ.get("MONARCH_TEST_ARTIFACTS", ROOT / "tests" / "artifacts")) / "sidebar"

CELLS = [
    "%mesh spawn 4",
    "%%mesh\nimport time\nt0 = time.time()\nwhile time.time() - t0 < 15:\n    sum(range(10000))",
    "%%mesh --ranks 2\nx = 1\nbreakpoint()\nx += 1\nprint('went on', x)",
]


def _why_skip() -> str | None:
    missing = _missing()
    if missing:
        return missing
    if not (BUILD / "package.json").exists() and not (INSTALLED / "package.json").exists():
        return f"the extension is not built ({BUILD}); run  bash extensions/build.sh"
    return None


pytestmark = pytest.mark.skipif(_why_skip() is not None, reason=_why_skip() or "")


def _notebook(path: Path) -> None:
    nb = {
        "nbformat": 4, "nbformat_minor": 5,
        "metadata": {"kernelspec": {"name": "monarch", "display_name": "Monarch (mesh)",
                                    "language": "python"}},
        "cells": [{"cell_type": "code", "id": f"c{i}", "metadata": {}, "execution_count": None,
                   "outputs": [], "source": src} for i, src in enumerate(CELLS)],
    }
    path.write_text(json.dumps(nb))


def _ranks(page) -> dict[int, dict[str, str]]:
    """rank -> {kind, pid, text} as the sidebar shows them."""
    rows = page.eval_on_selector_all(
        "#monarch-mesh-sidebar .mk-sb-rank",
        "els => els.map(e => [e.dataset.rank, e.dataset.kind, e.dataset.pid,"
        " e.querySelector('.mk-sb-state-text').textContent])")
    return {int(r): {"kind": k, "pid": p, "text": t} for r, k, p, t in rows}


def test_sidebar_lists_states_docks_dashboard_and_restarts_a_rank(tmp_path, monkeypatch):
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    lab = JupyterLab(tmp_path)  # (with this checkout's build of the extension, if any)
    left: list[int] = []
    console: list[str] = []
    try:
        lab.wait_ready()
        _notebook(lab.work / "sidebar.ipynb")
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True,
                                         args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1500, "height": 950})
            page.on("console", lambda m: console.append(f"{m.type}: {m.text}")
                    if m.type == "error" else None)
            try:
                page.goto(f"{lab.base}/lab/tree/sidebar.ipynb?token={lab.token}")
                page.wait_for_selector('.jp-Notebook-ExecutionIndicator[data-status="idle"]',
                                       timeout=90_000)
                tab = page.locator('.lm-TabBar-tab[data-id="monarch-mesh-sidebar"]')
                tab.wait_for(timeout=30_000)
                tab.click()
                page.wait_for_function(
                    "document.querySelector('#monarch-mesh-sidebar .mk-sb-kernel')"
                    "?.dataset.kernel === 'monarch'", timeout=30_000)
                page.get_by_text("No mesh is running").wait_for(timeout=30_000)

                # run the cells: the sidebar shows the mesh, its host and 4 running ranks
                page.locator(".jp-Cell").first.click()
                page.keyboard.press("Shift+Enter")  # %mesh spawn 4
                page.wait_for_selector("#monarch-mesh-sidebar .mk-sb-rank >> nth=3",
                                       timeout=90_000)
                page.wait_for_function(
                    "document.querySelector('.jp-Notebook-ExecutionIndicator')"
                    ".dataset.status === 'idle'", timeout=60_000)
                page.keyboard.press("Shift+Enter")  # the busy cell (In[2])
                page.wait_for_function(
                    "[...document.querySelectorAll('#monarch-mesh-sidebar .mk-sb-rank')]"
                    ".filter(e => e.dataset.kind === 'running').length === 4", timeout=60_000)
                page.wait_for_timeout(1500)  # CPU figures of the busy ranks
                ranks = _ranks(page)
                assert all(r["text"] == "running cell In[2]" for r in ranks.values()), ranks
                side = page.locator("#monarch-mesh-sidebar")
                assert "1 host x 4 procs" in side.inner_text()
                assert side.locator(".mk-sb-host").count() == 1
                page.screenshot(path=str(ARTIFACTS / "sidebar-running.png"))

                # the docked dashboard follows the same state
                side.locator(".mk-sb-dashboard").click()
                page.wait_for_selector(".mk-dashboard .mk-db-rank >> nth=3", timeout=20_000)
                assert "running cell In[2]" in page.locator(".mk-dashboard").inner_text()
                page.screenshot(path=str(ARTIFACTS / "sidebar-dashboard.png"))

                # the cell ends: idle; restart rank 1 from its button -> a new process
                page.wait_for_function(
                    "[...document.querySelectorAll('#monarch-mesh-sidebar .mk-sb-rank')]"
                    ".every(e => e.dataset.kind === 'idle')", timeout=60_000)
                old_pid = _ranks(page)[1]["pid"]
                side.locator('.mk-sb-rank[data-rank="1"] .mk-sb-restart').click()
                page.locator(".jp-Dialog .jp-mod-accept").click(timeout=10_000)
                page.wait_for_function(
                    "(old) => { const e = document.querySelector("
                    "'#monarch-mesh-sidebar .mk-sb-rank[data-rank=\"1\"]');"
                    " return e && e.dataset.pid && e.dataset.pid !== old"
                    " && e.dataset.kind === 'idle'; }", arg=old_pid, timeout=90_000)
                page.get_by_text("restarted rank 1 of mesh 'mesh'").wait_for(timeout=30_000)
                page.screenshot(path=str(ARTIFACTS / "sidebar-restarted.png"))
                assert _ranks(page)[1]["pid"] != old_pid

                # a rank paused in pdb: "paused at Cell In[3], line 4"; Debug goes to its prompt
                page.locator(".jp-Cell").nth(2).locator(".cm-content").click()
                page.keyboard.press("Shift+Enter")
                page.wait_for_function(
                    "document.querySelector('#monarch-mesh-sidebar .mk-sb-rank[data-rank=\"2\"]')"
                    "?.dataset.kind === 'paused'", timeout=60_000)
                assert _ranks(page)[2]["text"] == "paused at Cell In[3], line 4", _ranks(page)
                page.screenshot(path=str(ARTIFACTS / "sidebar-paused.png"))
                side.locator('.mk-sb-rank[data-rank="2"] .mk-sb-debug').click()
                page.wait_for_function("document.activeElement?.classList"
                                       ".contains('jp-Stdin-input')", timeout=20_000)
                page.keyboard.type("c")
                page.keyboard.press("Enter")
                page.get_by_text("went on 2").wait_for(timeout=30_000)  # (rank 2's output)
                page.wait_for_function(
                    "document.querySelector('#monarch-mesh-sidebar .mk-sb-rank[data-rank=\"2\"]')"
                    "?.dataset.kind === 'idle'", timeout=30_000)

                # a kernel restart: the sidebar connects to the new kernel (no mesh there)
                page.get_by_role("menuitem", name="Kernel", exact=True).click()
                page.locator(".lm-Menu-itemLabel", has_text="Restart Kernel…").first.click()
                page.locator(".jp-Dialog .jp-mod-accept").click(timeout=10_000)
                page.get_by_text("No mesh is running").wait_for(timeout=60_000)
                assert side.locator(".mk-sb-rank").count() == 0
            except BaseException:
                page.screenshot(path=str(ARTIFACTS / "sidebar-failure.png"))
                raise
            finally:
                browser.close()
    finally:
        left = lab.stop()
    assert not left, f"processes left behind: {left}"
    errors = [c for c in console if "monarch" in c.lower() or "sidebar" in c.lower()]
    assert not errors, errors
