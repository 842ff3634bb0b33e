"""The dashboard in a real browser: JupyterLab + headless Chromium (Playwright).

Starts JupyterLab on 127.0.0.1 (random port, random token, private settings),
drives Debian's Chromium (no browser download) and checks, in the light theme
with notebooks/03_dashboard.ipynb: the dashboard's 4 rank rows update while the
training cell runs; when the notebook stops the mesh the output becomes the
static last state; saved and reloaded, the page shows that snapshot with its
figures (no "model not found"). In the dark and the light theme, with a
notebook of its own: a live dashboard with a straggler and a dead rank; saved
while live and re-opened with a new kernel (the widget's model is gone), the
output shows the snapshot kept at save; nbconvert's HTML shows it too. Text contrast of the
dashboard is measured in both themes (WCAG ratio of each text element's computed
colour against its composited background) and must be at least 4.5.

Screenshots and the measured figures go to ``tests/artifacts/browser_dashboard/``
(git-ignored; ``MK_ARTIFACTS`` overrides). The extension parts need the built
extension (``bash extensions/build.sh``): JupyterLab finds it through a private
``JUPYTER_PATH``. Skipped, saying why, only when Chromium, JupyterLab or
Playwright is missing.

Runs its own ``sync_playwright()``: keep pytest-playwright out of the same run
(``-p no:playwright``) if it is installed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "03_dashboard.ipynb"
LABEXT = ROOT / "extensions" / "monarch-jupyterlab" / "labextension"
ARTIFACTS = Path(os.environ.get("MK_ARTIFACTS", ROOT / "tests" / "artifacts")) / "browser_dashboard"
MIN_CONTRAST = 4.5
#: the live widget as the extension's renderer shows it (its static copy hidden)
LIVE_VIEW = ('.jp-MonarchDashboard[data-showing="live"] .jp-MonarchDashboard-live '
             ".monarch-dashboard-view")
#: a dashboard with a straggler (rank 1) and, last, a dead rank (rank 1 exits)
LIVE_CELLS = [
    "%mesh spawn 2",
    "dash = %mesh dashboard\ndash",
    "%%mesh\nimport time\ntime.sleep(0.1 if rank == 0 else 1.5)",
    "%%mesh --ranks 1\nimport os\nos._exit(3)",
]
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--disable-dev-shm-usage"]


def _missing() -> str | None:
    if not Path(CHROMIUM).exists():
        return f"{CHROMIUM} is missing (apt-get install -y chromium)"
    for mod, pip in (("jupyterlab", "jupyterlab"), ("playwright", "playwright")):
        if importlib.util.find_spec(mod) is None:
            return f"{mod} is not installed (pip install {pip})"
    return None


pytestmark = pytest.mark.skipif(_missing() is not None, reason=_missing() or "")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _api(base: str, token: str, path: str, method: str = "GET") -> object:
    req = urllib.request.Request(f"{base}{path}", method=method,
                                 headers={"Authorization": f"token {token}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        body = r.read()
    return json.loads(body) if body else None


class JupyterLab:
    """A JupyterLab server in a private directory, stopped (with its kernels) by stop()."""

    def __init__(self, tmp: Path, theme: str | None = None) -> None:
        self.port, self.token = _free_port(), secrets.token_hex(16)
        self.base = f"http://127.0.0.1:{self.port}"
        self.work = tmp / "work"
        self.work.mkdir()
        settings = tmp / "settings" / "@jupyterlab" / "apputils-extension"
        settings.mkdir(parents=True)
        (settings / "notification.jupyterlab-settings").write_text(
            json.dumps({"fetchNews": "false", "checkForUpdates": False}))
        if theme:
            (settings / "themes.jupyterlab-settings").write_text(json.dumps({"theme": theme}))
        jpath = tmp / "jupyter-path"
        if (LABEXT / "package.json").exists():  # the extension as built in this checkout
            (jpath / "labextensions").mkdir(parents=True)
            (jpath / "labextensions" / "monarch-kernel-jupyterlab").symlink_to(LABEXT)
        env = dict(os.environ,
                   JUPYTER_PATH=os.pathsep.join(
                       [str(jpath)] + [p for p in os.environ.get("JUPYTER_PATH", "").split(
                           os.pathsep) if p]),
                   JUPYTERLAB_SETTINGS_DIR=str(tmp / "settings"),
                   JUPYTERLAB_WORKSPACES_DIR=str(tmp / "workspaces"),
                   JUPYTER_RUNTIME_DIR=str(tmp / "runtime"),
                   JUPYTER_CONFIG_DIR=str(tmp / "config"))
        self.log = open(tmp / "jupyterlab.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root",
             "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={self.port}",
             "--ServerApp.port_retries=0", f"--IdentityProvider.token={self.token}",
             f"--ServerApp.root_dir={self.work}"],
            env=env, cwd=self.work, stdin=subprocess.DEVNULL, stdout=self.log,
            stderr=subprocess.STDOUT)
        self.tmp = tmp

    def wait_ready(self, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError("JupyterLab exited:\n" + (self.tmp / "jupyterlab.log")
                                   .read_text(errors="replace")[-3000:])
            try:
                _api(self.base, self.token, "/api/status")
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"JupyterLab did not answer within {timeout} s") from None
                time.sleep(0.3)

    def stop(self) -> list[int]:
        """Shut every kernel down, then the server; returns the pids of processes
        (kernels, workers) that were still alive afterwards, after killing them."""
        try:
            procs = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            procs = []
        try:
            for k in _api(self.base, self.token, "/api/kernels"):  # type: ignore[union-attr]
                _api(self.base, self.token, f"/api/kernels/{k['id']}", "DELETE")
        except OSError:
            pass
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()
        _, alive = psutil.wait_procs(procs, timeout=15)
        for p in alive:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        return [p.pid for p in alive]


def _cpu_readouts(page) -> dict[int, float]:
    """rank -> CPU % as the rendered dashboard shows it (the figure next to the bar)."""
    out = {}
    for r in range(4):
        loc = page.locator(f".jp-OutputArea .mk-row.mk-r{r} .mk-cpu .mk-fig >> visible=true")
        if loc.count() < 1:
            continue
        m = re.match(r"([\d.]+)%", loc.first.inner_text().strip())
        if m:
            out[r] = float(m.group(1))
    return out


CONTRAST_JS = """(root) => {
  const parse = c => {
    const m = c && c.match(/rgba?\\(([^)]+)\\)/);
    if (!m) return null;
    const p = m[1].split(/[\\s,\\/]+/).filter(Boolean).map(Number);
    return [p[0], p[1], p[2], p.length > 3 ? p[3] : 1];
  };
  const over = (fg, bg) => [0, 1, 2].map(i => fg[i] * fg[3] + bg[i] * (1 - fg[3])).concat([1]);
  const background = el => {
    const layers = [];
    for (let e = el; e; e = e.parentElement) {
      const c = parse(getComputedStyle(e).backgroundColor);
      if (c && c[3] > 0) { layers.push(c); if (c[3] >= 1) break; }
    }
    let bg = [255, 255, 255, 1];
    for (let i = layers.length - 1; i >= 0; i--) bg = over(layers[i], bg);
    return bg;
  };
  const lum = c => {
    const f = v => {
      v /= 255;
      return v <= 0.03928 ? v / 12.92 : Math.pow((v + 0.055) / 1.055, 2.4);
    };
    return 0.2126 * f(c[0]) + 0.7152 * f(c[1]) + 0.0722 * f(c[2]);
  };
  const out = [], seen = new Set();
  const walk = document.createTreeWalker(root, NodeFilter.SHOW_TEXT);
  while (walk.nextNode()) {
    const t = walk.currentNode, el = t.parentElement;
    if (!t.textContent.trim() || !el || seen.has(el) || el.closest('svg')) continue;
    seen.add(el);
    if (!el.getClientRects().length) continue;  // not shown
    const cs = getComputedStyle(el);
    const bg = background(el), fg = over(parse(cs.color), bg);
    const a = lum(fg), b = lum(bg);
    out.push({text: t.textContent.trim().slice(0, 40), color: cs.color,
              background: 'rgb(' + bg.slice(0, 3).map(Math.round).join(',') + ')',
              ratio: Math.round((Math.max(a, b) + 0.05) / (Math.min(a, b) + 0.05) * 100) / 100});
  }
  return out;
}"""


def _contrast(page, selector: str, name: str, report: dict) -> float:
    """The lowest text contrast inside the first ``selector``; every element's figures go
    to ``report[name]``."""
    rows = page.locator(f"{selector} >> visible=true").first.evaluate(CONTRAST_JS)
    assert rows, f"no text measured in {selector}"
    worst = min(rows, key=lambda r: r["ratio"])
    report[name] = {"min": worst["ratio"], "worst": worst, "elements": len(rows),
                    "all": rows}
    print(f"contrast {name}: min {worst['ratio']} over {len(rows)} text elements "
          f"(worst: {worst})")
    return float(worst["ratio"])


def _wait_idle(page, timeout: float = 90_000) -> None:
    """The notebook in front is idle (a tab behind it has an indicator of its own)."""
    page.locator('.jp-Notebook-ExecutionIndicator[data-status="idle"] >> visible=true') \
        .first.wait_for(timeout=timeout)


def _save(page) -> None:
    page.locator(".jp-Notebook").first.click(position={"x": 5, "y": 5})
    page.keyboard.press("Control+s")
    page.wait_for_function(
        "!document.querySelector('.jp-mod-dirty')", timeout=20_000)
    page.wait_for_timeout(500)


def _dismiss_dialogs(page) -> None:
    """Accept any modal dialog JupyterLab opened (e.g. a kernel choice on a slow
    start); its text is printed so a failure says what it was."""
    for _ in range(3):
        dialog = page.locator(".jp-Dialog")
        if dialog.count() == 0:
            return
        print("JupyterLab dialog:", dialog.first.inner_text()[:300].replace("\n", " | "))
        accept = page.locator(".jp-Dialog .jp-mod-accept")
        if accept.count():
            accept.first.click()
        else:
            page.keyboard.press("Escape")
        # wait for it to go before looking again: a kernel dialog still closing was
        # accepted three times, each starting a kernel that shut the one before down
        # while Run All went to it (a failure under the full suite's load)
        try:
            dialog.first.wait_for(state="detached", timeout=10_000)
        except Exception as e:  # noqa: BLE001 - still there: the next turn looks again
            print("the dialog is still open:", type(e).__name__)
        page.wait_for_timeout(500)


def _run_all(page, tries: int = 3) -> None:
    """Run > Run All Cells, again if no cell started (a click while the page settles)."""
    started = ("[...document.querySelectorAll('.jp-InputArea-prompt')]"
               ".some(e => /\\[(\\*|\\d+)\\]/.test(e.innerText))")
    for i in range(tries):
        try:
            _dismiss_dialogs(page)
            page.get_by_role("menuitem", name="Run", exact=True).click(timeout=10_000)
            page.get_by_text("Run All Cells", exact=True).click(timeout=10_000)
            page.wait_for_function(started, timeout=15_000)
            return
        except Exception:
            if i == tries - 1:
                raise
            page.keyboard.press("Escape")


def _launch(pw):
    return pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)


def _no_model_errors(page) -> None:
    text = "\n".join(page.locator(".jp-Notebook").all_text_contents())  # every open notebook
    assert "model not found" not in text and "Error displaying widget" not in text


def test_dashboard_notebook_in_chromium(tmp_path: Path):
    """Light theme: live figures, frozen at mesh stop, kept through save and reload."""
    from playwright.sync_api import sync_playwright

    out = ARTIFACTS
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {}
    lab = JupyterLab(tmp_path)
    left: list[int] = []
    console: list[str] = []
    try:
        lab.wait_ready()
        shutil.copy(NOTEBOOK, lab.work / NOTEBOOK.name)
        with sync_playwright() as pw:
            browser = _launch(pw)
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                page.on("console", lambda m: console.append(f"{m.type}: {m.text}")
                        if m.type == "error" else None)
                page.goto(f"{lab.base}/lab/tree/{NOTEBOOK.name}?token={lab.token}")
                _wait_idle(page)
                _run_all(page)
                page.wait_for_function(
                    "document.querySelectorAll('.jp-OutputArea .mk-row').length >= 4",
                    timeout=90_000)
                # while the training cell runs every rank's CPU readout goes above 0
                deadline = time.monotonic() + 90
                cpu: dict[int, float] = {}
                while time.monotonic() < deadline:
                    cpu = _cpu_readouts(page)
                    if len(cpu) == 4 and all(v > 0 for v in cpu.values()):
                        break
                    page.wait_for_timeout(250)
                page.wait_for_timeout(1500)  # a little history in the sparklines
                page.locator(".monarch-dashboard-view >> visible=true").first \
                    .scroll_into_view_if_needed()
                page.screenshot(path=str(out / "light-live.png"))
                assert len(cpu) == 4 and all(v > 0 for v in cpu.values()), cpu
                text = page.locator(".monarch-dashboard-view >> visible=true").first.inner_text()
                assert "1 host x 4 procs" in text and "r0" in text and "r3" in text
                assert "{" not in text and "total" in text
                assert page.locator(".jp-OutputArea .mk-total").count() >= 1
                if page.locator(".jp-OutputArea .mk-gpu").count() == 0:
                    assert "gpu" not in text.lower()  # CPU host: no empty GPU columns
                _contrast(page, ".monarch-dashboard-view", "light live", report)
                # the notebook runs to its end: the status table, then the mesh stops and
                # the output becomes the static last state
                page.get_by_text("mesh 'mesh' stopped (4 ranks)").wait_for(timeout=120_000)
                page.wait_for_selector(
                    '.jp-OutputArea .monarch-dashboard-view[data-status="stopped"]',
                    timeout=15_000)
                _wait_idle(page)
                frozen = page.locator('.monarch-dashboard-view[data-status="stopped"]').first
                assert frozen.locator(".mk-row").count() == 4
                assert "mesh stopped" in frozen.inner_text()
                assert frozen.locator(".mk-tl").count() >= 4  # the training cell's timeline
                page.screenshot(path=str(out / "light-stopped.png"))
                _save(page)
                page.reload()
                _wait_idle(page)
                kept = page.locator('.jp-OutputArea .monarch-dashboard-view'
                                    '[data-status="stopped"]')
                kept.first.wait_for(timeout=30_000)
                assert kept.first.locator(".mk-row").count() == 4
                assert re.search(r"\d+(\.\d+)?%", kept.first.locator(".mk-cpu").first
                                 .inner_text())
                _no_model_errors(page)
                kept.first.scroll_into_view_if_needed()
                page.screenshot(path=str(out / "light-reloaded.png"))
                assert _contrast(page, '.monarch-dashboard-view[data-status="stopped"]',
                                 "light snapshot", report) >= MIN_CONTRAST
                assert report["light live"]["min"] >= MIN_CONTRAST, report["light live"]
            except BaseException:
                page.screenshot(path=str(out / "light-failure.png"))
                print(f"failure screenshot: {out / 'light-failure.png'}")
                raise
            finally:
                browser.close()
    finally:
        left = lab.stop()
        (out / "contrast-light-notebook.json").write_text(json.dumps(report, indent=1))
    assert not left, f"processes left behind: {left}"
    widget_errors = [c for c in console if "widget" in c.lower() or "figures" in c]
    assert not widget_errors, widget_errors
    saved = json.loads((lab.work / NOTEBOOK.name).read_text())
    html_out = [o for c in saved["cells"] for o in c.get("outputs", ())
                if "monarch-dashboard-view" in str(o.get("data", {}).get("text/html", ""))]
    assert html_out, "the saved notebook holds no dashboard snapshot"
    _check_nbconvert(lab.work / NOTEBOOK.name, out / "03_dashboard.html", 4)


def _check_nbconvert(nb: Path, dest: Path, rows: int) -> None:
    """nbconvert's HTML export shows the dashboard snapshot, not a widget placeholder."""
    proc = subprocess.run(
        [sys.executable, "-m", "nbconvert", "--to", "html", "--output", dest.stem,
         "--output-dir", str(dest.parent), str(nb)],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    page = dest.read_text()
    assert "monarch-dashboard-view" in page, "no dashboard in nbconvert's HTML"
    assert page.count('class="mk-row mk-r') >= rows
    assert "model not found" not in page


def _notebook(cells: list[str]) -> dict:
    return {
        "nbformat": 4, "nbformat_minor": 5,
        "metadata": {"kernelspec": {"display_name": "Monarch (mesh)", "language": "python",
                                    "name": "monarch"}},
        "cells": [{"cell_type": "code", "id": f"c{i}", "metadata": {}, "execution_count": None,
                   "outputs": [], "source": src} for i, src in enumerate(cells)],
    }


@pytest.mark.skipif(not (LABEXT / "package.json").exists(),
                    reason="the JupyterLab extension is not built (bash extensions/build.sh)")
@pytest.mark.parametrize("theme", ["JupyterLab Dark", "JupyterLab Light"])
def test_saved_while_live_and_contrast(tmp_path: Path, theme: str):
    """Both themes: contrast of a live dashboard with a straggler and a dead rank (the
    error colour); saved while live and re-opened with a new kernel (the widget's model
    is gone), the output shows the snapshot kept at save."""
    from playwright.sync_api import sync_playwright

    out = ARTIFACTS
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {}
    tag = theme.split()[-1].lower()  # dark, light
    lab = JupyterLab(tmp_path, theme=theme)
    left: list[int] = []
    try:
        lab.wait_ready()
        (lab.work / "live.ipynb").write_text(json.dumps(_notebook(LIVE_CELLS)))
        with sync_playwright() as pw:
            browser = _launch(pw)
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                page.goto(f"{lab.base}/lab/tree/live.ipynb?token={lab.token}")
                _wait_idle(page)
                shown = page.evaluate("document.body.dataset.jpThemeName")
                assert shown == theme, shown
                _run_all(page)
                live = page.locator(LIVE_VIEW)
                live.first.wait_for(timeout=90_000)
                # the straggler: rank 1 took 1.5 s where rank 0 took 0.1 s
                page.wait_for_selector('.mk-tl.mk-slow[data-rank="1"]', timeout=60_000)
                # rank 1 exits: the header names it in the error colour, its row too
                page.wait_for_selector(".monarch-dashboard-view .mk-dead-ranks",
                                       timeout=60_000)
                _wait_idle(page)
                live.first.scroll_into_view_if_needed()
                page.screenshot(path=str(out / f"{tag}-live-dead-rank.png"))
                assert _contrast(page, LIVE_VIEW, f"{tag} live", report) \
                    >= MIN_CONTRAST, report[f"{tag} live"]["worst"]
                _save(page)
                # re-opened elsewhere: a copy of the saved file, with a new kernel (the
                # widget's model does not exist there)
                shutil.copy(lab.work / "live.ipynb", lab.work / "copy.ipynb")
                page.goto(f"{lab.base}/lab/tree/copy.ipynb?token={lab.token}")
                _wait_idle(page)
                kept = page.locator('.jp-MonarchDashboard[data-showing="snapshot"] '
                                    '.monarch-dashboard-view[data-status="saved"] >> visible=true')
                kept.first.wait_for(timeout=30_000)
                page.wait_for_timeout(3000)  # the widget manager gave up on the model
                assert page.locator('.jp-MonarchDashboard[data-showing="live"] >> visible=true'
                                    ).count() == 0
                assert kept.first.locator(".mk-row").count() == 2
                assert "saved while live" in kept.first.inner_text()
                _no_model_errors(page)
                kept.first.scroll_into_view_if_needed()
                page.screenshot(path=str(out / f"{tag}-saved-while-live-reopened.png"))
                assert _contrast(page, ".monarch-dashboard-view", f"{tag} snapshot", report) \
                    >= MIN_CONTRAST, report[f"{tag} snapshot"]["worst"]
            except BaseException:
                page.screenshot(path=str(out / f"{tag}-live-failure.png"))
                print(f"failure screenshot: {out / f'{tag}-live-failure.png'}")
                raise
            finally:
                browser.close()
    finally:
        left = lab.stop()
        (out / f"contrast-{tag}-live.json").write_text(json.dumps(report, indent=1))
    assert not left, f"processes left behind: {left}"
    _check_nbconvert(lab.work / "copy.ipynb", out / f"saved-while-live-{tag}.html", 2)
