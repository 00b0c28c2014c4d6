"""The course as a learner meets it: JupyterLab in a real (headless) Chromium.

Starts ``jupyter lab`` on a free loopback port over a scratch copy of the
notebooks (so autosave never touches the repository), drives Debian's
Chromium through Playwright, runs every cell, and checks in the page itself.
Screenshots go to ``test-artifacts/``. Without Chromium or Playwright the tests
are skipped with the reason, never silently.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import playwright.sync_api as playwright_api  # pinned in the test extra; only the browser is the system's
import pytest

from llmsys.course.runner import REPO
from llmsys.core.dist import free_port

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ARTIFACTS = REPO / "test-artifacts"
# A chapter with a widget, a matplotlib figure and the ledger table.
CHAPTER = os.environ.get("LLMSYS_BROWSER_NOTEBOOK", "notebooks/00_foundations.ipynb")

pytestmark = [
    pytest.mark.skipif(CHROMIUM is None, reason="no system Chromium: apt-get install chromium"),
    pytest.mark.timeout(600),
]


@pytest.fixture(scope="module")
def lab_server(tmp_path_factory):
    """JupyterLab on 127.0.0.1 with a token, serving a scratch copy of the course."""
    root = tmp_path_factory.mktemp("course")
    for folder in ("notebooks", "labs"):
        shutil.copytree(REPO / folder, root / folder)
    port, token = free_port(), secrets.token_hex(16)
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(root / ".jupyter"), "JUPYTER_RUNTIME_DIR": str(root / ".runtime")}
    # No "official Jupyter news?" pop-up over the screenshots, and every cell kept
    # in the page (JupyterLab otherwise renders only the cells in view).
    settings = root / ".settings" / "@jupyterlab"
    for plugin, value in {"apputils-extension/notification": '{"fetchNews": "false"}',
                          "notebook-extension/tracker": '{"windowingMode": "none"}'}.items():
        path = settings / f"{plugin}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(value)
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root", "--ip=127.0.0.1", f"--port={port}",
         f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
         f"--LabApp.workspaces_dir={root / '.workspaces'}", f"--LabApp.user_settings_dir={root / '.settings'}", "--ServerApp.disable_check_xsrf=True"],
        env=env, stdout=subprocess.DEVNULL, stderr=open(root / "server.log", "wb"), start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_for(f"{base}/api/status?token={token}", server, root / "server.log")
        yield base, token
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()


def _wait_for(url: str, server: subprocess.Popen, log: Path, timeout: float = 90) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"jupyter lab exited early:\n{log.read_text()[-2000:]}")
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"jupyter lab did not answer on {url} within {timeout} s")


@pytest.fixture(scope="module")
def browser():
    with playwright_api.sync_playwright() as p:
        chromium = p.chromium.launch(
            executable_path=CHROMIUM, headless=True,
            args=["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"])
        yield chromium
        chromium.close()


def open_notebook(browser, lab_server, path: str):
    base, token = lab_server
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    context.grant_permissions(["clipboard-read", "clipboard-write"], origin=base)
    page = context.new_page()
    page.set_default_timeout(60_000)
    # A workspace of its own, so only this notebook is open in the page.
    workspace = Path(path).stem
    page.goto(f"{base}/lab/workspaces/{workspace}/tree/{path}?token={token}")
    page.locator(".jp-NotebookPanel .jp-Cell").first.wait_for()
    # A fresh JupyterLab may ask which kernel to start (the notebook's own is
    # preselected) before the kernel reports idle; answer whichever comes first.
    select = page.get_by_role("button", name="Select Kernel")
    idle = page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").first
    select.or_(idle).wait_for(state="attached", timeout=120_000)
    if select.count():
        select.click()
    idle.wait_for(state="attached", timeout=120_000)
    page.wait_for_timeout(1000)
    return page


def run_all(page, timeout_s: float = 400) -> None:
    """Run > Run All Cells, then wait until no cell is queued or running."""
    # Started once some code cell shows a number or a star in its prompt. On a loaded machine a
    # menu click can be lost, so the command is given again when nothing has started.
    started = page.locator(".jp-CodeCell .jp-InputArea-prompt").filter(has_text=re.compile(r"\[(\d+|\*)\]")).first
    for attempt in range(3):
        page.get_by_role("menuitem", name="Run", exact=True).click()
        page.get_by_role("menuitem", name="Run All Cells", exact=True).click()
        try:
            started.wait_for(state="attached", timeout=60_000)
            break
        except playwright_api.TimeoutError:
            if attempt == 2:
                raise
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        busy = page.locator(".jp-InputArea-prompt", has_text="[*]").count()
        if busy == 0 and page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").count():
            return
        page.wait_for_timeout(1000)
    raise TimeoutError(f"cells still running after {timeout_s} s")


def error_outputs(page) -> list[str]:
    errors = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']")
    texts = [errors.nth(i).inner_text() for i in range(errors.count())]
    # tqdm writes progress bars to stderr; only tracebacks are errors.
    return [t for t in texts if "Traceback" in t or "Error" in t.splitlines()[0] if t]


def screenshot(page, name: str) -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=False)
    return path


def test_chapter_runs_in_jupyterlab(browser, lab_server):
    page = open_notebook(browser, lab_server, CHAPTER)
    with screenshot_on_failure(page, "chapter"):
        check_chapter(page)


def test_lab_solved_through_the_page(browser, lab_server):
    page = open_notebook(browser, lab_server, "labs/lab00_warmup.ipynb")
    with screenshot_on_failure(page, "lab00"):
        solve_lab(page)


@contextlib.contextmanager
def screenshot_on_failure(page, name: str):
    try:
        yield
    except BaseException:
        screenshot(page, f"failed-{name}")
        raise


def check_chapter(page):
    run_all(page)
    screenshot(page, "chapter-run-all")
    assert error_outputs(page) == []

    # The running ledger renders as an HTML table.
    ledger = page.locator("table.llmsys-ledger")
    assert ledger.count() >= 1 and ledger.first.locator("tbody tr").count() > 0

    # At least one matplotlib figure renders as an image.
    assert page.locator(".jp-RenderedImage img").count() >= 1

    # An ipywidgets slider renders and responds: moving it changes its output.
    slider = page.locator(".widget-slider").first
    slider.scroll_into_view_if_needed()
    output = page.locator(".widget-output").first
    before = output.inner_text()
    handle = slider.locator(".noUi-handle, .ui-slider-handle").first
    handle.focus()
    for _ in range(3):
        page.keyboard.press("ArrowRight")
    page.wait_for_function("([el, before]) => el.innerText !== before", arg=[output.element_handle(), before], timeout=30_000)
    screenshot(page, "chapter-widget-moved")


def solve_lab(page):
    solution = _solution_cells()
    stubs = page.locator(".jp-CodeCell", has_text="raise NotImplementedError")
    assert stubs.count() == len(solution)
    for code in solution:
        # Paste, as a student would: typing would let the editor re-indent each line.
        page.evaluate("text => navigator.clipboard.writeText(text)", code)
        page.locator(".jp-CodeCell", has_text="raise NotImplementedError").first.locator(".cm-content").click()
        page.keyboard.press("Control+A")
        page.keyboard.press("Control+V")
        page.keyboard.press("Escape")
    assert stubs.count() == 0
    run_all(page, timeout_s=120)
    screenshot(page, "lab00-solved")
    assert error_outputs(page) == []
    # Every code cell ran (Run All stops at the first error).
    prompts = page.locator(".jp-CodeCell .jp-InputArea-prompt")
    assert all(prompts.nth(i).inner_text().strip("[]: ").isdigit() for i in range(prompts.count()))


def _solution_cells() -> list[str]:
    """The source of each solution cell of lab00, as a student would type it."""
    import nbformat

    nb = nbformat.read(REPO / "solutions" / "lab00_warmup.ipynb", as_version=4)
    markers = re.compile(r"^[ \t]*### (BEGIN|END) SOLUTION[ \t]*\n?", re.M)
    return [markers.sub("", c.source) for c in nb.cells if c.cell_type == "code" and "### BEGIN SOLUTION" in c.source]
