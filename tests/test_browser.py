"""The Jupyter assistant as users see it: JupyterLab in headless Chromium, driven by Playwright.

One JupyterLab server (127.0.0.1, a temporary root, workspace, settings and a random token) and
one browser serve the whole module. The tests open the project's notebooks and a fresh one, run
their cells, click the buttons, and assert on the rendered DOM and on computed styles: widgets
render, diffs and tables are left-aligned, figures appear as images, buttons are not cut, the
traceback of a ``%%troubleshoot`` cell is IPython's own with the panel below it.

Playwright cannot download browsers here, so it drives the system Chromium (Debian's
``chromium`` package, installed by ``scripts/setup.sh test``). Screenshots go to a directory
printed at the end of the module; the README's two (the panel, a walkthrough step) are copied
into ``docs/images/`` only with ``ZEROMOE_WRITE_SCREENSHOTS=1`` (a test run leaves the checkout
as it was).

One CUDA error is raised as text (a ``RuntimeError`` with torch's CUDA OOM message): there is no
GPU here, and the panel reads the numbers from the message text only.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import nbformat
import pytest
from playwright.sync_api import Page, expect, sync_playwright
from support.jobs import free_port

REPO = Path(__file__).resolve().parents[1]
IMAGES = REPO / "docs" / "images"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or "/usr/bin/chromium"
VIEWPORT = {"width": 1400, "height": 1000}
START_TIMEOUT = 120  # s: JupyterLab's first start on a busy 2-core machine
RUN_TIMEOUT = 600  # s: a notebook's cells (the OOM ladder runs child processes; slow on a busy machine)

#: A CUDA OOM message as torch 2.x prints it (the text is what the panel reads).
CUDA_OOM = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.15 GiB of which "
            "1.50 GiB is free. Of the allocated memory 75.10 GiB is allocated by PyTorch, and 1.90 GiB is reserved "
            "by PyTorch but unallocated.")

FRESH_CELLS = [
    ("%load_ext troubleshooter", []),
    ("cfg = {'train_batch_size': 32, 'train_micro_batch_size_per_gpu': 2, 'gradient_accumulation_steps': 4,\n"
     "       'zero_optimization': {'stage': 3, 'overlap_com': True}}\n%ds_lint cfg --world-size 2", []),
    ("%doctor --only env,host,layout", []),
    ("buffer = bytearray(1 << 62)", ["raises-exception"]),
    ("%%troubleshoot\nfor step in range(2):\n    buffer = bytearray(1 << 62)", ["raises-exception"]),
    (f"raise RuntimeError({CUDA_OOM!r})", ["raises-exception"]),
]


def _write_settings(settings: Path) -> None:
    """No news or update pop-ups; every cell rendered (no windowing), so the DOM holds them all."""
    for plugin, values in {
        "@jupyterlab/apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
        "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none"},
        # No autosave: a saved notebook would come back with its outputs when the next test opens
        # another one, and its panels would match that test's locators.
        "@jupyterlab/docmanager-extension/plugin": {"autosave": False},
    }.items():
        path = settings / f"{plugin}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))


class Lab:
    """The running server and the browser page, with helpers to open and run notebooks."""

    def __init__(self, base: str, token: str, root: Path, page: Page, shots: Path) -> None:
        self.base, self.token, self.root, self.page, self.shots = base, token, root, page, shots

    def open(self, name: str) -> None:
        """Open a notebook in a fresh kernel (the previous notebook's kernel is shut down first)."""
        self.page.evaluate("() => { const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;"
                           " return w && w.sessionContext ? w.sessionContext.shutdown() : null; }")
        # ?reset: a fresh layout, so the notebooks earlier tests opened are not reopened beside it.
        self.page.goto(f"{self.base}/lab/tree/{name}?reset&token={self.token}")
        self.page.wait_for_function(
            "() => { const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;"
            " return w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel"
            " && w.sessionContext.session.kernel.status === 'idle' && w.content.widgets.length > 0; }",
            timeout=START_TIMEOUT * 1000)

    def run_all(self) -> None:
        """Run every cell (cells tagged raises-exception do not stop the run); wait until all are done.

        A cell that fails untagged stops JupyterLab's run there (the cells after it are never run):
        that is reported, with the failed cell's output, once the kernel has stayed idle with cells
        left unrun for 10 s (between two cells it is idle for milliseconds), instead of waiting out
        the timeout."""
        self.page.evaluate("() => { window.tshIdle = null;"  # not awaited: the wait below decides
                           " window.jupyterapp.commands.execute('notebook:run-all-cells'); }")
        state = self.page.wait_for_function(
            "() => { const w = window.jupyterapp.shell.currentWidget;"
            " const code = w.content.widgets.filter(c => c.model.type === 'code');"
            " const next = code.findIndex(c => c.model.executionCount === null);"
            " if (w.sessionContext.session.kernel.status !== 'idle' || next === 0"
            "     || code.some(c => c.node.querySelector('.jp-InputPrompt').textContent.includes('*'))) {"
            "   window.tshIdle = null; return false; }"
            " if (next < 0) return 'done';"
            " const key = next + ':' + code[next - 1].model.executionCount;"
            " if (!window.tshIdle || window.tshIdle.key !== key) {"
            "   window.tshIdle = {key, since: Date.now()}; return false; }"
            " if (Date.now() - window.tshIdle.since < 10000) return false;"
            " return 'stopped after cell ' + (next - 1) + ':\\n' + code[next - 1].node.innerText; }",
            timeout=RUN_TIMEOUT * 1000, polling=500).json_value()
        assert state == "done", f"the notebook did not run to the end; it {state}"

    def cell(self, index: int):
        return self.page.locator(".jp-Notebook .jp-Cell").nth(index)

    def shot(self, locator, name: str, readme: bool = False) -> Path:
        """Screenshot one element; the window is made tall enough for all of it, then put back."""
        height = int(locator.evaluate("e => e.getBoundingClientRect().height"))
        self.page.set_viewport_size({"width": VIEWPORT["width"], "height": max(VIEWPORT["height"], height + 400)})
        locator.scroll_into_view_if_needed()
        path = self.shots / name
        locator.screenshot(path=str(path))
        self.page.set_viewport_size(VIEWPORT)
        if readme and os.environ.get("ZEROMOE_WRITE_SCREENSHOTS") == "1":
            IMAGES.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, IMAGES / name)
        return path

    def style(self, locator, prop: str) -> str:
        return locator.evaluate(f"e => getComputedStyle(e).getPropertyValue('{prop}')")


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """One JupyterLab server and one headless Chromium for the module; both stopped at the end."""
    home = tmp_path_factory.mktemp("lab")
    root = home / "root"
    root.mkdir()
    for name in ("01_doctor.ipynb", "02_out_of_memory.ipynb", "03_router_collapse.ipynb"):
        shutil.copyfile(REPO / "notebooks" / name, root / name)
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(src, metadata={"tags": tags} if tags else {}) for src, tags in FRESH_CELLS]
    nbformat.write(nb, root / "fresh.ipynb")
    _write_settings(home / "settings")
    shots = Path(os.environ.get("BROWSER_SCREENSHOTS") or tempfile.mkdtemp(prefix="troubleshooter-screens-"))
    shots.mkdir(parents=True, exist_ok=True)
    token, port = secrets.token_hex(16), free_port()
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(home / "config"), "JUPYTER_RUNTIME_DIR": str(home / "runtime"),
           "JUPYTERLAB_WORKSPACES_DIR": str(home / "workspaces"), "JUPYTERLAB_SETTINGS_DIR": str(home / "settings"),
           "IPYTHONDIR": str(home / "ipython"), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
    log = open(home / "server.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}",
         "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
         "--ServerApp.allow_root=True", "--LabApp.expose_app_in_browser=True",
         "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"],
        env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=str(root))
    base = f"http://127.0.0.1:{port}"
    pw = browser = None
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            try:
                with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=5) as reply:
                    if reply.status == 200:
                        break
            except OSError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"JupyterLab did not start:\n{(home / 'server.log').read_text()[-4000:]}")
            time.sleep(0.5)
        pw = sync_playwright().start()
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-dev-shm-usage"])
        page = browser.new_page(viewport=VIEWPORT)
        page.set_default_timeout(60_000)
        yield Lab(base, token, root, page, shots)
    finally:
        if browser is not None:
            browser.close()
        if pw is not None:
            pw.stop()
        server.terminate()  # the server shuts its kernels down on SIGTERM
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=10)
        log.close()
        written = "written" if os.environ.get("ZEROMOE_WRITE_SCREENSHOTS") == "1" else "ZEROMOE_WRITE_SCREENSHOTS=1 writes them"
        print(f"\nbrowser screenshots: {shots}  (README copies in {IMAGES}: {written})")


@pytest.fixture(autouse=True)
def page_after_each_test(lab, request):
    """The whole window after every test (to see what a failure looked like)."""
    yield
    lab.page.screenshot(path=str(lab.shots / f"{request.node.name}.png"))


def _outputs(cell) -> list:
    return cell.locator(".jp-OutputArea-output").all()


def test_fresh_notebook_lint_doctor_panels_and_walkthrough(lab):
    lab.open("fresh.ipynb")
    lab.run_all()
    page = lab.page

    # %ds_lint: the diff is a left-aligned <pre> whose JSON indentation survives
    lint = lab.cell(1).locator(".troubleshooter-lint")
    diff = lint.locator("pre.tsh-diff").first
    assert lab.style(diff, "text-align") == "left"
    assert lab.style(diff.locator("xpath=ancestor::td[1]"), "text-align") == "left"
    diffs = "\n".join(d.inner_text() for d in lint.locator("pre.tsh-diff").all())
    assert '+    "overlap_comm": true' in diffs and '-    "overlap_com": true' in diffs  # indentation kept
    header = lint.locator("th").first
    assert float(lab.style(header, "padding-left").rstrip("px")) >= 6  # headers do not run together
    lab.shot(lint, "lint.png")

    # %doctor: summary first, problems (if any) next, passed checks folded away
    doctor = lab.cell(2).locator(".troubleshooter-doctor")
    assert doctor.locator("b").first.inner_text().startswith("troubleshooter doctor: ")
    passed = doctor.locator("details.tsh-passed")
    assert passed.count() == 1 and not passed.get_attribute("open")
    assert not passed.locator("table").is_visible()
    passed.locator("summary").click()
    expect(passed.locator("table")).to_be_visible()
    assert lab.style(passed.locator("td").first, "text-align") == "left"

    # automatic panel after a host-RAM error: right family, words not slugs, no "matched:" repeat
    auto = lab.cell(3)
    outputs = _outputs(auto)
    assert "MemoryError" in outputs[0].inner_text()
    panel = auto.locator(".troubleshooter-panel")
    panel.wait_for()
    text = panel.inner_text()
    assert "Host (CPU) memory exhausted" in text and "matched:" not in text.lower()
    button = panel.locator("button")
    assert button.inner_text().strip() == "Open the walkthrough: Out of memory (host RAM)"
    assert button.evaluate("b => b.scrollWidth <= b.clientWidth"), "the button label is cut"
    content = panel.locator(".widget-html-content").first
    line = float(lab.style(content, "line-height").rstrip("px"))
    font = float(lab.style(content, "font-size").rstrip("px"))
    assert line < 1.7 * font, f"double-spaced text: line-height {line}px for {font}px type"
    cause = panel.locator("details.tsh-cause")
    assert not cause.locator("div").is_visible()
    cause.locator("summary").click()
    expect(cause.locator("div")).to_be_visible()
    assert "OOM killer" in cause.inner_text()
    lab.shot(panel, "panel.png", readme=True)
    button.click()
    walk = auto.locator(".troubleshooter-walkthrough")
    walk.wait_for()
    expect(walk).to_contain_text("Host RAM ran out.")
    assert "Host RAM ran out." in walk.inner_text() and "A GPU allocation failed" not in walk.inner_text()

    # %%troubleshoot: IPython's own traceback (its Cell In[n], no frame of ours), the panel below it
    magic = lab.cell(4)
    number = magic.locator(".jp-InputPrompt").inner_text().strip().strip("[]:")
    trace = magic.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']").inner_text()
    assert f"Cell In[{number}], line 3" in trace and "exec(compile" not in trace and "troubleshooter" not in trace
    kinds = [o.evaluate("o => o.querySelector('.troubleshooter-panel') ? 'panel' : o.dataset.mimeType")
             for o in _outputs(magic)]
    assert kinds.index("application/vnd.jupyter.stderr") < kinds.index("panel"), kinds
    walk = magic.locator(".troubleshooter-walkthrough")
    walk.wait_for()
    assert "Your config: cfg" in walk.inner_text()  # the config %ds_lint read, not an example
    for n in (2, 3, 4):  # a click goes to the kernel and back: wait for the step it shows
        walk.locator("button", has_text="Next").click()
        expect(walk).to_contain_text(f"Step {n} of 5")
    expect(walk).to_contain_text("Step 4 of 5: Micro-batch down")
    assert '+  "train_micro_batch_size_per_gpu": 1' in walk.locator("pre.tsh-diff").inner_text()
    for b in walk.locator("button").all():
        assert b.evaluate("b => b.scrollWidth <= b.clientWidth"), f"cut label: {b.inner_text()}"

    # a CUDA OOM message: the panel says what its numbers mean
    cuda = lab.cell(5).locator(".troubleshooter-panel")
    cuda.wait_for()
    assert "the cache could not have served it" in cuda.inner_text() and "75.10 GiB" in cuda.inner_text()
    assert page.locator(".jp-Notebook").count() == 1


def _no_raw_figure(lab: Lab) -> None:
    text = lab.page.locator(".jp-Notebook").inner_text()
    assert "<Figure size" not in text and "<matplotlib" not in text


@pytest.mark.parametrize("name", ["02_out_of_memory.ipynb", "03_router_collapse.ipynb"])
def test_notebook_renders_plots_and_its_walkthrough(lab, name):
    lab.open(name)
    lab.run_all()
    _no_raw_figure(lab)
    images = lab.page.locator(".jp-RenderedImage img")
    assert images.count() >= 1 and images.first.evaluate("i => i.naturalWidth") > 100
    for cell in lab.page.locator(".jp-RenderedHTMLCommon .tsh table td").all()[:5]:
        assert lab.style(cell, "text-align") == "left"
    walk = lab.page.locator(".troubleshooter-walkthrough")
    walk.wait_for()
    tried = walk.locator(".troubleshooter-try")
    if name.startswith("02"):  # the notebook tried steps 2 and 3, then moved on to step 4
        expect(walk).to_contain_text("Step 4 of 5: ZeRO stage up")
        walk.locator("button", has_text="Back").click()
        expect(walk).to_contain_text("Step 3 of 5: Activation checkpointing")
        tried.locator("img.tsh-figure").wait_for()
        expect(tried).to_contain_text("fits")
        for b in walk.locator("button").all():
            assert b.evaluate("b => b.scrollWidth <= b.clientWidth"), f"cut label: {b.inner_text()}"
        lab.shot(walk, "walkthrough-step.png", readme=True)
        walk.locator("button", has_text="Back").click()
        # the halved micro-batch: measured without and under the limit, does not fit, names the next rung
        expect(walk).to_contain_text("Step 2 of 5: Micro-batch down")
        expect(tried).to_contain_text("out of memory; next: activation checkpointing")
        assert "the same within 1e-3" in tried.inner_text()
    else:
        # Try it shows each expert's load before and after (the per-expert bar chart)
        tried.locator("img.tsh-figure").wait_for()
        assert tried.locator("img.tsh-figure").evaluate("i => i.naturalWidth") > 400
        # the load heatmaps: each window's PNG next to the CSV logs, and the windows over time
        assert images.count() >= 4
        # Next: aux-loss-free bias balancing; its Try it (clicked here) shows the bias balancer
        # fixing the reproduction: collapsed before, under 50% after, the task loss beside it
        walk.locator("button", has_text="Next").click()
        expect(walk).to_contain_text("Step 3 of 6: Aux-loss-free bias balancing")
        expect(walk).to_contain_text("ExpertBiasBalancer(update_rate=1e-3)")
        walk.locator("button", has_text="Try it").click()
        expect(tried).to_contain_text("bias balancing (rate 0.005)")
        tried.locator("img.tsh-figure").wait_for()
        assert tried.locator("img.tsh-figure").evaluate("i => i.naturalWidth") > 600  # bars, busiest, task loss
        row = tried.locator("tr", has_text="max share of one expert (last step)").locator("td").all_inner_texts()
        assert float(row[1]) > 0.5 > float(row[2]), row
        half = tried.locator("tr", has_text="max share of one expert (last 20 steps)").locator("td").all_inner_texts()
        assert float(half[2]) < 0.5, half
        assert tried.locator("tr", has_text="task loss (last step)").count() == 1
        lab.shot(walk, "walkthrough-bias-balancing.png")
    text = tried.inner_text()
    assert "- vs -" not in text and "OUT OF MEMORY" not in text
    lab.shot(lab.page.locator(".jp-NotebookPanel"), name.replace(".ipynb", ".png"))


def test_notebook_01_runs_with_its_panels(lab):
    lab.open("01_doctor.ipynb")
    lab.run_all()
    assert lab.page.locator(".troubleshooter-panel").count() == 2
    assert lab.page.locator(".troubleshooter-walkthrough").count() >= 1
    diff = lab.page.locator(".troubleshooter-lint pre.tsh-diff").first
    assert lab.style(diff, "text-align") == "left"
