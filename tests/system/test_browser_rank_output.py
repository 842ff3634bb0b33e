"""Per-rank output of a 4-rank %%mesh cell in a real browser, with the JupyterLab extension.

JupyterLab 4 and Notebook 7 (``jupyter notebook``), each started by the test on 127.0.0.1
(random port and token, private settings), with the extension ``monarch-kernel-jupyterlab``
installed as pip or CI installs it: found in ``sys.prefix/share/jupyter/labextensions`` (a
wheel puts it there; scripts/setup.sh links the build there for an editable install). On a
machine where it is only built in the tree (``bash extensions/build.sh``) the test links that
build into a private JUPYTER_PATH instead. Headless Debian Chromium driven by Playwright runs
a notebook on the "monarch" kernel and checks: the extension announced itself (the output is
the rank renderer's, not "[r]" stream text), the 4 ranks' lines have 4 different colours, the
line all ranks printed is shown once and expands to one line per rank, tqdm bars are ordered
by rank, and the filter shows one rank only. Screenshots go to tests/artifacts/rank_output/
(git-ignored; MONARCH_TEST_ARTIFACTS=DIR: DIR/rank_output/).

Skipped, saying why, when Chromium, Playwright, JupyterLab (or, for its half, Notebook 7) is
missing or the extension is neither installed nor built, except under CI=true, where a
missing extension is a failure (.ci/run builds it first).
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
from test_browser_dashboard import (
    CHROMIUM,
    CHROMIUM_ARGS,
    JupyterLab,
    _dismiss_dialogs,
    _free_port,
    _run_all,
)

ROOT = Path(__file__).resolve().parents[2]
NAME = "monarch-kernel-jupyterlab"
INSTALLED = Path(sys.prefix, "share", "jupyter", "labextensions", NAME)
BUILT = ROOT / "extensions" / "monarch-jupyterlab" / "labextension"
ARTIFACTS = Path(os.environ.get("MONARCH_TEST_ARTIFACTS", ROOT / "tests" / "artifacts")) \
    / "rank_output"

CELLS = [
    "%mesh spawn 4",
    "%%mesh\n"
    "import sys, time\n"
    "from tqdm import tqdm\n"
    "print('the same line on every rank')\n"
    "for step in range(3):\n"
    "    print(f'rank {rank} step {step} loss {1.0 / (rank + step + 1):.3f}')\n"
    "if rank == 2:\n"
    "    print('rank 2 warns on stderr', file=sys.stderr)\n"
    "time.sleep(0.5 + 0.1 * (3 - rank))  # rank 3 starts its bar first\n"
    "for _ in tqdm(range(20), desc=f'rank {rank}', mininterval=0, ncols=60):\n"
    "    time.sleep(0.02 * (rank + 1))\n"
    "print('done')\n",
]


def _missing() -> str | None:
    if not Path(CHROMIUM).exists():
        return f"{CHROMIUM} is missing (apt-get install -y chromium)"
    for mod in ("jupyterlab", "playwright", "tqdm"):
        if importlib.util.find_spec(mod) is None:
            return f"{mod} is not installed (pip install -e '.[test]')"
    if not (INSTALLED / "package.json").exists() and not (BUILT / "package.json").exists():
        if os.environ.get("CI") == "true":
            return None  # (the test fails, saying so)
        return f"the extension is neither installed ({INSTALLED}) nor built ({BUILT})"
    return None


pytestmark = [pytest.mark.skipif(_missing() is not None, reason=_missing() or ""),
              pytest.mark.timeout(400)]


def _extension_env(tmp: Path) -> dict[str, str]:
    """Environment for the server: the installed extension, else the in-tree build."""
    if (INSTALLED / "package.json").exists():
        return {}
    assert (BUILT / "package.json").exists(), \
        f"{NAME} is not installed in {INSTALLED}: run bash extensions/build.sh, then setup.sh"
    data = tmp / "jupyter-data"
    dest = data / "labextensions" / NAME
    dest.parent.mkdir(parents=True)
    dest.symlink_to(BUILT)
    path = os.environ.get("JUPYTER_PATH")
    return {"JUPYTER_PATH": str(data) + (os.pathsep + path if path else "")}


class Server(JupyterLab):
    """JupyterLab (``app="jupyterlab"``) or Notebook 7 (``app="notebook"``) in a private
    directory, with the extension; stopped, with its kernels, by ``stop()``."""

    def __init__(self, tmp: Path, app: str) -> None:
        self.port, self.token = _free_port(), secrets.token_hex(16)
        self.base = f"http://127.0.0.1:{self.port}"
        self.work = tmp / "work"
        self.work.mkdir()
        settings = tmp / "settings" / "@jupyterlab" / "apputils-extension"
        settings.mkdir(parents=True)
        (settings / "notification.jupyterlab-settings").write_text(
            json.dumps({"fetchNews": "false", "checkForUpdates": False}))
        env = dict(os.environ,
                   JUPYTERLAB_SETTINGS_DIR=str(tmp / "settings"),
                   JUPYTERLAB_WORKSPACES_DIR=str(tmp / "workspaces"),
                   JUPYTER_RUNTIME_DIR=str(tmp / "runtime"),
                   JUPYTER_CONFIG_DIR=str(tmp / "config"),
                   **_extension_env(tmp))
        self.log = open(tmp / "jupyterlab.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", app, "--no-browser", "--allow-root",
             "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={self.port}",
             "--ServerApp.port_retries=0", f"--IdentityProvider.token={self.token}",
             f"--ServerApp.root_dir={self.work}"],
            env=env, cwd=self.work, stdin=subprocess.DEVNULL, stdout=self.log,
            stderr=subprocess.STDOUT)
        self.tmp = tmp


def _notebook(path: Path) -> None:
    nb = {
        "nbformat": 4, "nbformat_minor": 5,
        "metadata": {"kernelspec": {"name": "monarch", "display_name": "Monarch (mesh)",
                                    "language": "python"}},
        "cells": [{"cell_type": "code", "id": f"c{i}", "metadata": {}, "execution_count": None,
                   "outputs": [], "source": src} for i, src in enumerate(CELLS)],
    }
    path.write_text(json.dumps(nb))


def _visible_ranks(page) -> list[str]:
    """data-ranks of the rank renderer's rows that are displayed."""
    return page.eval_on_selector_all(
        ".jp-monarch-rs-body > .jp-monarch-rs-line, .jp-monarch-rs-body > .jp-monarch-rs-bar",
        "els => els.filter(e => e.offsetParent !== null).map(e => e.dataset.ranks)")


@pytest.mark.parametrize("app", ["jupyterlab", "notebook"])
def test_rank_output_colours_and_filter_in_browser(tmp_path: Path, app: str):
    if app == "notebook" and importlib.util.find_spec("notebook") is None:
        pytest.skip("Notebook 7 is not installed (pip install notebook, in the test extra)")
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    lab = Server(tmp_path, app)
    left: list[int] = []
    console: list[str] = []
    try:
        lab.wait_ready()
        _notebook(lab.work / "ranks.ipynb")
        url = "lab/tree" if app == "jupyterlab" else "notebooks"
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True,
                                         args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1300, "height": 1100})
            page.on("console", lambda m: console.append(f"{m.type}: {m.text}"))
            try:
                page.goto(f"{lab.base}/{url}/ranks.ipynb?token={lab.token}")
                page.wait_for_selector('.jp-Notebook-ExecutionIndicator[data-status="idle"], '
                                       '.jp-NotebookKernelStatus, .jp-Notebook',
                                       timeout=90_000)
                _dismiss_dialogs(page)
                # the kernel has answered kernel_info (the extension announces then)
                page.wait_for_function(
                    "() => { const e = document.querySelector("
                    "'.jp-Notebook-ExecutionIndicator'); return !e || "
                    "e.dataset.status === 'idle'; }", timeout=90_000)
                page.wait_for_timeout(500)
                _run_all(page)
                page.wait_for_selector(".jp-monarch-rs-bar.jp-mod-done >> nth=3", timeout=90_000)
                page.wait_for_selector('.jp-monarch-rs-line[data-ranks="0,1,2,3"] >> '
                                       'text=done', timeout=30_000)
                out = page.locator(".jp-monarch-rankstream").first
                out.scroll_into_view_if_needed()
                shot = ARTIFACTS / f"{app}-rank-output.png"
                page.screenshot(path=str(shot), full_page=True)
                print(f"screenshot: {shot}")

                # no "[r]" stream text: the renderer drew the output
                streams = page.locator(".jp-OutputArea-output[data-mime-type*='stdout'], "
                                       ".jp-OutputArea-output[data-mime-type*='stderr']")
                assert not [t for t in streams.all_inner_texts() if "step 0" in t], \
                    "rank output came as plain streams: the extension did not announce itself"
                colours = page.eval_on_selector_all(
                    ".jp-monarch-rs-body > .jp-monarch-rs-line[data-rank]",
                    "els => els.map(e => [e.dataset.rank, getComputedStyle(e).borderLeftColor])")
                by_rank: dict[str, set[str]] = {}
                for rank, colour in colours:
                    by_rank.setdefault(rank, set()).add(colour)
                print("colours by rank:", by_rank)
                assert sorted(by_rank) == ["0", "1", "2", "3"], by_rank
                assert all(len(c) == 1 for c in by_rank.values()), by_rank
                assert len({c for cs in by_rank.values() for c in cs}) == 4, by_rank
                assert page.locator(".jp-monarch-rs-line.jp-mod-stderr[data-rank='2']").count() == 1
                # tqdm bars: one per rank, ordered by rank (rank 3 drew first)
                bars = page.eval_on_selector_all(".jp-monarch-rs-bar",
                                                 "els => els.map(e => e.dataset.rank)")
                assert bars == ["0", "1", "2", "3"], bars
                # the line every rank printed: once, expandable to one line per rank
                folded = page.locator(".jp-monarch-rs-line.jp-mod-folded",
                                      has_text="the same line on every rank").first
                assert folded.locator(".jp-monarch-rs-tag").first.inner_text() == "[0-3]"
                folded.locator(".jp-monarch-rs-folded-head").click()
                assert folded.locator(".jp-monarch-rs-expanded > .jp-monarch-rs-line").count() == 4
                assert folded.locator(".jp-monarch-rs-expanded").is_visible()

                # the filter: rank 2 only, in every display of the cell
                page.locator(".jp-monarch-rs-toolbar .jp-monarch-rs-chip[data-rank='2']") \
                    .first.click()
                page.wait_for_function(
                    "document.querySelector('.jp-monarch-rankstream').dataset.filter === '2'")
                shown = _visible_ranks(page)
                print("visible with rank 2 only:", shown)
                assert shown and all("2" in r.split(",") for r in shown), shown
                assert "0" not in shown and "3" not in shown
                assert folded.locator(".jp-monarch-rs-expanded > .jp-monarch-rs-line:visible") \
                    .count() == 1
                out.scroll_into_view_if_needed()
                shot = ARTIFACTS / f"{app}-rank-output-filtered.png"
                page.screenshot(path=str(shot), full_page=True)
                print(f"screenshot: {shot}")
                page.locator(".jp-monarch-rs-toolbar .jp-monarch-rs-chip[data-rank='all']") \
                    .first.click()
                assert len(_visible_ranks(page)) > len(shown)
            except BaseException:
                page.screenshot(path=str(ARTIFACTS / f"{app}-failure.png"), full_page=True)
                (ARTIFACTS / f"{app}-console.txt").write_text("\n".join(console))
                raise
            finally:
                browser.close()
    finally:
        left = lab.stop()
    assert not left, f"processes left behind: {left}"
    errors = [c for c in console if c.startswith("error") and "monarch" in c.lower()]
    assert not errors, errors
