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
            "callbacks": {event: list(cbs) for event, cbs in shell.events.callbacks.items()},
            "transformers": list(shell.input_transformers_cleanup)}


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
    assert "DS_BUILD_OPS=0 does not skip compilation" in row and "<b>Fix</b>" in row
    # the summary first, the problems next, the checks that passed folded away
    assert html.index("troubleshooter doctor: ") < html.index("DS_BUILD_OPS") < html.index("<details")
    assert "Host RAM" in html.split("<details")[1]
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
    assert "first thing to do:" in panel_text and "walkthrough: Out of memory (host RAM)" in panel_text
    panel = ext.state_of(shell).panels[-1]
    assert panel.walkthrough is None
    panel.button.click()
    assert panel.walkthrough is not None and panel.walkthrough.title == "Out of memory (host RAM)"
    assert panel.walkthrough in panel.children and panel.button.disabled


def test_unknown_errors_get_no_panel(shell):
    with capture_output() as cap:
        result = shell.run_cell("1 / 0")
    assert isinstance(result.error_in_exec, ZeroDivisionError)
    assert panels_in(cap.outputs) == []
    assert "ZeroDivisionError" in cap.stdout


def test_troubleshoot_cell_magic_diagnoses_opens_walkthrough_and_reraises(shell):
    with capture_output() as cap:
        result = shell.run_cell("%%troubleshoot\n" + OOM_CELL, store_history=True)
    assert result.error_in_exec is shell.user_ns["RAISED"]
    assert "bytearray(1 << 62)" in clean(cap.stdout) and "MemoryError" in clean(cap.stdout)
    [panel_text] = panels_in(cap.outputs)  # the full panel once; the automatic one is not repeated
    assert "1. Confirm it:" in panel_text  # every fix step, numbered
    panel = ext.state_of(shell).panels[-1]
    assert panel.full and panel.walkthrough is not None  # opened without a click


def _traceback(shell, cell: str) -> tuple[int, str]:
    with capture_output() as cap:
        result = shell.run_cell(cell, store_history=True)
    return result.execution_count, clean(cap.stdout)


def test_troubleshoot_leaves_the_traceback_exactly_as_ipython_prints_it(shell):
    """Same code with and without the magic: the same frames and lines, the right Cell In[n], no
    frame of the extension. The magic line is blanked (line numbers stay the cell's own), so the
    plain cell has a line of its own there too."""
    shell.colors = "nocolor"
    code = "def allocate():\n    return bytearray(1 << 62)\nallocate()\n"
    plain_n, plain = _traceback(shell, "pass\n" + code)  # one line in place of the magic line
    magic_n, magic = _traceback(shell, "%%troubleshoot\n" + code)
    assert f"Cell In[{plain_n}], line 4" in plain and f"Cell In[{magic_n}], line 4" in magic
    assert magic.replace(f"In[{magic_n}]", "In[N]") == plain.replace(f"In[{plain_n}]", "In[N]")
    assert "exec(compile" not in magic and "troubleshooter" not in magic.split("MemoryError")[0]


def test_the_walkthrough_patches_the_config_the_failing_cell_used(shell):
    shell.user_ns["my_ds"] = {"train_micro_batch_size_per_gpu": 6, "zero_optimization": {"stage": 2}}
    with capture_output():
        shell.run_cell("%%troubleshoot\nconfig = my_ds\n" + OOM_CELL, store_history=True)
    walk = ext.state_of(shell).panels[-1].walkthrough
    assert walk.context.config_label in ("config", "my_ds") and walk.context.config["zero_optimization"]["stage"] == 2
    assert "Your config" in walk.header.value
    walk.go(3)  # micro-batch down: a diff of the user's own dict
    assert f"a/{walk.context.config_label}" in walk.patch_view.value


def test_the_walkthrough_patches_the_strategy_config_of_the_failing_cell(shell):
    """A real ZeroMoEStrategy used by the failing cell: the walkthrough works on its config. (A
    Trainer holding it cannot be built in an interactive shell: Lightning refuses strategies that
    launch processes there, so the strategy object is what a notebook holds.)"""
    from lightning_zeromoe import ZeroMoEStrategy

    strategy = ZeroMoEStrategy(ep_size=1, config={"train_micro_batch_size_per_gpu": 4,
                                                  "zero_optimization": {"stage": 3}})
    shell.user_ns["strategy"] = strategy
    shell.user_ns["unrelated"] = {"train_batch_size": 8}  # held by the notebook, not used by the cell
    with capture_output():
        shell.run_cell("%%troubleshoot\nassert strategy\n" + OOM_CELL, store_history=True)
    walk = ext.state_of(shell).panels[-1].walkthrough
    # before setup, strategy.config is empty and user_config holds what the user wrote
    assert walk.context.config_label == "strategy.user_config"
    assert walk.context.config is strategy.user_config
    walk.go(3)
    assert "a/strategy.user_config" in walk.patch_view.value
    strategy.config = {**strategy.user_config, "train_batch_size": 4}  # what setup leaves there
    with capture_output():
        shell.run_cell("%%troubleshoot\nassert strategy\n" + OOM_CELL, store_history=True)
    assert ext.state_of(shell).panels[-1].walkthrough.context.config_label == "strategy.config"


def test_without_a_config_the_walkthrough_says_it_shows_an_example(shell):
    from troubleshooter.walkthroughs.context import config_in

    for name in [n for n in shell.user_ns if config_in({n: shell.user_ns[n]})]:  # left by other tests
        del shell.user_ns[name]
    with capture_output():
        shell.run_cell("%%troubleshoot\n" + OOM_CELL, store_history=True)
    walk = ext.state_of(shell).panels[-1].walkthrough
    assert not walk.context.has_config and "example" in walk.header.value


def test_troubleshoot_cell_magic_returns_the_last_value_when_nothing_fails(shell):
    with capture_output():
        result = shell.run_cell("%%troubleshoot\na = 20\na + 22")
    assert result.success and result.result == 42 and shell.user_ns["a"] == 20
