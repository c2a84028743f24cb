"""``%load_ext troubleshooter`` in a real IPython shell: every magic, the automatic diagnosis of a
failed cell, and ``%unload_ext`` leaving the shell exactly as it was.

The errors raised in cells are real: ``bytearray(1 << 62)`` asks the allocator for 4 EiB and
Python raises ``MemoryError`` (knowledge entry ``cpu-oom``), with no heavy import needed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell
from IPython.core.magic import Magics, line_magic, magics_class
from IPython.utils.capture import capture_output

from troubleshooter import ipython as ext
from troubleshooter.explain import clean

HEAVY = ("torch", "deepspeed", "lightning", "transformers")
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
#: A cell that raises a real MemoryError and keeps the exception object, to compare identities.
OOM_CELL = textwrap.dedent("""
    def allocate():
        global RAISED
        try:
            return bytearray(1 << 62)
        except MemoryError as err:
            RAISED = err
            raise
    allocate()
""")


def snapshot(shell: InteractiveShell) -> dict:
    """Everything the extension may touch: the magic tables, the registry, the event callbacks."""
    manager = shell.magics_manager
    return {"magics": {kind: dict(table) for kind, table in manager.magics.items()},
            "registry": dict(manager.registry),
            "callbacks": {event: list(cbs) for event, cbs in shell.events.callbacks.items()}}


def ipython() -> InteractiveShell:
    """The shell, with IPython's own lazily loaded %load_ext / %unload_ext already materialised
    (using them the first time registers ExtensionMagics: IPython's change, not ours)."""
    sh = InteractiveShell.instance()
    with capture_output():  # "not loaded" is printed when it is not
        sh.run_line_magic("unload_ext", "troubleshooter")
    return sh


@pytest.fixture
def shell():
    sh = ipython()
    before = snapshot(sh)
    sh.run_line_magic("load_ext", "troubleshooter")
    yield sh
    sh.run_line_magic("unload_ext", "troubleshooter")
    assert snapshot(sh) == before


def panels_in(outputs) -> list[str]:
    """The plain-text form of every diagnosis panel among captured display outputs."""
    return [o.data["text/plain"] for o in outputs
            if WIDGET_MIME in o.data and o.data.get("text/plain", "").startswith("troubleshooter:")]


def test_import_and_load_pull_in_nothing_heavy():
    code = textwrap.dedent(f"""
        import sys, time, json
        import troubleshooter
        light = [m for m in ("IPython", "ipywidgets") if m in sys.modules]
        from IPython.core.interactiveshell import InteractiveShell
        shell = InteractiveShell.instance()
        start = time.perf_counter()
        shell.run_line_magic("load_ext", "troubleshooter")
        took = time.perf_counter() - start
        print(json.dumps({{"on_import": light, "seconds": took,
                          "heavy": [m for m in {HEAVY!r} + ("ipywidgets",) if m in sys.modules],
                          "magics": sorted(shell.magics_manager.magics["line"])}}))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["on_import"] == [], "import troubleshooter must not load IPython or ipywidgets"
    assert out["heavy"] == [], f"%load_ext imported {out['heavy']}"
    assert {"doctor", "ds_lint"} <= set(out["magics"])
    print(f"%load_ext troubleshooter took {out['seconds']:.3f} s")


def test_unload_restores_a_shadowed_magic_and_removes_everything_else():
    sh = ipython()

    @magics_class
    class Other(Magics):
        @line_magic
        def doctor(self, line):
            return "the other doctor"

    sh.register_magics(Other)
    before = snapshot(sh)
    sh.run_line_magic("load_ext", "troubleshooter")
    assert sh.magics_manager.magics["line"]["doctor"].__self__.__class__ is ext.TroubleshooterMagics
    assert "troubleshoot" in sh.magics_manager.magics["cell"]
    assert len(sh.events.callbacks["post_run_cell"]) == len(before["callbacks"]["post_run_cell"]) + 1
    sh.run_line_magic("unload_ext", "troubleshooter")
    assert snapshot(sh) == before
    assert sh.run_line_magic("doctor", "") == "the other doctor"
    del sh.magics_manager.magics["line"]["doctor"]
    del sh.magics_manager.registry["Other"]


def test_doctor_magic_shows_a_table_with_the_fix_of_each_problem(shell, monkeypatch):
    monkeypatch.setenv("DS_BUILD_OPS", "0")  # a real misconception the env checks flag (warn)
    with capture_output() as cap:
        shell.run_line_magic("doctor", "--only env,host")
    [out] = cap.outputs
    html = out.data["text/html"]
    assert "troubleshooter doctor" in html and "Host RAM" in html
    row = html.split("DS_BUILD_OPS / DS_BUILD_*")[1].split("</tr>")[0]
    assert "DS_BUILD_OPS=0 does not skip compilation" in row and "<b>fix</b>" in row
    assert "ds-build-ops-meaning" in row
    assert "[WARN] DS_BUILD_OPS" in out.data["text/plain"]


def test_doctor_magic_rejects_bad_options(shell):
    with pytest.raises(UsageError, match="unknown check family"):
        shell.run_line_magic("doctor", "--only nonsense")


def test_ds_lint_on_a_dict_in_the_namespace_shows_findings_and_diffs(shell):
    shell.user_ns["cfg"] = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 2,
                            "gradient_accumulation_steps": 4,
                            "zero_optimization": {"stage": 3, "overlap_com": True}}
    with capture_output() as cap:
        shell.run_line_magic("ds_lint", "cfg --world-size 2")
    [out] = cap.outputs
    plain, html = out.data["text/plain"], out.data["text/html"]
    assert plain.startswith("cfg: ")
    assert "unknown-config-key" in plain and "batch-arithmetic" in plain
    # the merge patch of the misspelled key, shown as a diff of the user's own config
    assert '-    "overlap_com": true' in plain and '+    "overlap_comm": true' in plain
    assert '+  "train_micro_batch_size_per_gpu": 4' in plain
    assert "troubleshooter-diff" in html


def test_ds_lint_on_a_path_and_on_a_missing_file(shell, tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}}))
    with capture_output() as cap:
        shell.run_line_magic("ds_lint", str(path))
    assert cap.outputs[0].data["text/plain"] == f"{path}: no problems found"
    with pytest.raises(UsageError, match="nope.json"):
        shell.run_line_magic("ds_lint", str(tmp_path / "nope.json"))


def test_failed_cell_gets_a_diagnosis_panel_and_keeps_its_exception(shell):
    with capture_output() as cap:
        result = shell.run_cell(OOM_CELL)
    assert not result.success
    assert result.error_in_exec is shell.user_ns["RAISED"]  # the very object raised, not a copy
    shown = clean(cap.stdout)  # IPython colours its traceback
    assert "bytearray(1 << 62)" in shown and "RAISED = err" in shown and "MemoryError" in shown
    [panel_text] = panels_in(cap.outputs)
    assert "Host (CPU) memory exhausted [cpu-oom]" in panel_text
    assert "first fix:" in panel_text and "walkthrough: oom" in panel_text
    panel = ext.state_of(shell).panels[-1]
    assert panel.walkthrough is None
    panel.button.click()
    assert panel.walkthrough is not None and panel.walkthrough.title == "Out of memory"
    assert panel.walkthrough in panel.children and panel.button.disabled


def test_unknown_errors_get_no_panel(shell):
    with capture_output() as cap:
        result = shell.run_cell("1 / 0")
    assert isinstance(result.error_in_exec, ZeroDivisionError)
    assert panels_in(cap.outputs) == []
    assert "ZeroDivisionError" in cap.stdout


def test_troubleshoot_cell_magic_diagnoses_opens_walkthrough_and_reraises(shell):
    with capture_output() as cap:
        result = shell.run_cell("%%troubleshoot\n" + OOM_CELL)
    assert result.error_in_exec is shell.user_ns["RAISED"]
    assert "bytearray(1 << 62)" in clean(cap.stdout) and "MemoryError" in clean(cap.stdout)
    [panel_text] = panels_in(cap.outputs)  # the full panel once; the automatic one is not repeated
    assert "1. Confirm it:" in panel_text  # every fix step, numbered
    panel = ext.state_of(shell).panels[-1]
    assert panel.full and panel.walkthrough is not None  # opened without a click


def test_troubleshoot_cell_magic_returns_the_last_value_when_nothing_fails(shell):
    with capture_output():
        result = shell.run_cell("%%troubleshoot\na = 20\na + 22")
    assert result.success and result.result == 42 and shell.user_ns["a"] == 20
