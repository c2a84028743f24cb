"""Every notebook in notebooks/ is stored without outputs and runs top to bottom in a real kernel.

Each notebook is executed by nbclient with an ipykernel from this interpreter (jupyter_client
replaces the ``python3`` kernelspec's ``python`` with ``sys.executable``); any error fails it,
except in cells tagged ``raises-exception`` (01 shows the automatic diagnosis of a failing cell),
which must show one. The notebooks are tutorials and hold no asserts: they print what they found,
and this test reads the executed notebooks' outputs and checks them (the OOM really raised and a
rung fitted, the collapse really happened and the remedies removed it, the 2-process training
reported expert shares that add up to 1), so running them tests the reproductions they show, not
only the notebook files.

Why the notebooks run concurrently, each in its own runner process: they are independent, and
most of their wall time on a shared 2-core machine is spent waiting for a CPU (kernel start-up,
importing torch, DeepSpeed and Lightning, the 2-rank training of 04); run one after the other
they take about as long as the rest of the suite together.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
EXPECTED = {"01_doctor.ipynb", "02_out_of_memory.ipynb", "03_router_collapse.ipynb", "04_train_with_zeromoe.ipynb"}
TIMEOUT = 900
#: Notebooks that must show a plot (as an image, not a repr).
PLOTS = {"02_out_of_memory.ipynb", "03_router_collapse.ipynb", "04_train_with_zeromoe.ipynb"}

#: Executes one notebook (argv: source, destination) and saves it with its outputs; exit 1 on error.
RUNNER = """
import sys, time, nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError
from pathlib import Path
src, dst = Path(sys.argv[1]), Path(sys.argv[2])
nb = nbformat.read(src, as_version=4)
start = time.perf_counter()
try:
    NotebookClient(nb, timeout=%d, kernel_name="python3", allow_errors=False,
                   resources={"metadata": {"path": str(src.parent)}}).execute()
    code = 0
except CellExecutionError as err:
    print(str(err)[-6000:], file=sys.stderr)
    code = 1
nb.metadata["executed_seconds"] = time.perf_counter() - start
nbformat.write(nb, dst)
sys.exit(code)
""" % TIMEOUT


def test_all_notebooks_are_present_and_stored_without_outputs():
    assert EXPECTED <= {p.name for p in NOTEBOOKS}
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert cell.outputs == [] and cell.execution_count is None, f"{path.name} has stored outputs"


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    """Start every notebook at once; return {name: (exit status, stderr, executed notebook)}."""
    out = tmp_path_factory.mktemp("notebooks")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    procs = {p.name: subprocess.Popen([sys.executable, "-c", RUNNER, str(p), str(out / p.name)], env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for p in NOTEBOOKS}
    results = {}
    start = time.perf_counter()
    for name, proc in procs.items():
        try:
            _, err = proc.communicate(timeout=TIMEOUT + 60)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        done = out / name
        results[name] = (proc.returncode, err, nbformat.read(done, as_version=4) if done.exists() else None)
    print(f"\nall notebooks: {time.perf_counter() - start:.1f} s wall")
    return results


@pytest.mark.parametrize("name", [p.name for p in NOTEBOOKS])
def test_notebook_runs_top_to_bottom(executed, name):
    code, err, nb = executed[name]
    assert code == 0 and nb is not None, f"{name} failed:\n{err[-6000:]}"
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    tagged = [c for c in nb.cells if "raises-exception" in c.get("metadata", {}).get("tags", [])]
    # Only the tagged cells may show an error, and each of them must (they demonstrate a failure).
    assert len(errors) == len(tagged), [e.get("ename") for e in errors]
    print(f"{name}: {nb.metadata['executed_seconds']:.1f} s")
    shown = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
             if o.output_type in ("execute_result", "display_data")]
    raw = [o.data["text/plain"] for o in shown if set(o.data) == {"text/plain"}
           and o.data["text/plain"].startswith(("<Figure size", "<matplotlib."))]
    assert not raw, f"{name} shows a figure as text: {raw}"
    if name in PLOTS:
        assert any("image/png" in o.data for o in shown), f"{name} shows no plot"
    if name == "01_doctor.ipynb":
        shown = [o for c in tagged for o in c.outputs if o.output_type == "display_data"]
        assert any("troubleshooter: Host (CPU) memory exhausted" in o.data.get("text/plain", "") for o in shown)
    if name == "04_train_with_zeromoe.ipynb":
        text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
        assert "expert share of routed tokens" in text and "ZeRO-3 + expert parallelism (ep_size=2)" in text
    OUTCOMES[name](nb)


def _shown(nb, marker: str) -> str:
    """What the one code cell whose source holds ``marker`` printed and returned, as text."""
    cells = [c for c in nb.cells if c.cell_type == "code" and marker in c.source]
    assert len(cells) == 1, f"{len(cells)} cells hold {marker!r}"
    return "\n".join(o.get("text", "") if o.output_type == "stream" else o.get("data", {}).get("text/plain", "")
                     for o in cells[0].outputs)


def _value(text: str, label: str):
    """The Python literal printed after ``label`` on its line (print writes floats exactly: repr)."""
    found = re.search(re.escape(label) + r" (.+)$", text, re.MULTILINE)
    assert found, f"no {label!r} in:\n{text}"
    return ast.literal_eval(found.group(1))


def _doctor_outcome(nb) -> None:
    # The walkthrough opened from the panel works on the config %ds_lint read, not an example.
    text = _shown(nb, "state_of(get_ipython())")
    assert re.search(r"^the walkthrough works on: seed_config$", text, re.MULTILINE), text
    # Unloading removed the magics it added.
    assert _shown(nb, "%unload_ext troubleshooter").strip() == "False"


def _oom_outcome(nb) -> None:
    text = _shown(nb, "result.fitted.name")
    assert _value(text, "the unchanged step ran out of memory:") is True  # the unchanged step really ran out
    assert re.search(r"^fits at: \S", text, re.MULTILINE), text  # some rung fits


def _collapse_outcome(nb) -> None:
    text = _shown(nb, "result.bias_balanced.max_share")
    assert _value(text, "without a remedy, one expert takes more than half of the tokens:") is True
    assert re.search(r"^with the fix, the busiest expert stays under \d+%: True$", text, re.MULTILINE), text
    assert _value(text, "bias balancing alone, the busiest expert over the second half of training:") < 0.5
    text = _shown(nb, "second_half = {name")
    assert _value(text, "without a remedy, the busiest expert at its peak:") > 0.5  # one expert takes over half
    assert _value(text, "with bias balancing, the busiest expert over the last 20 steps:") < 0.5
    means = _value(text, "second-half means:")
    assert means["bias_balancing"] < means["no_remedy"], means


def _training_outcome(nb) -> None:
    cell = next(c for c in nb.cells if c.cell_type == "code" and "shares = {}" in c.source)
    value = [o for o in cell.outputs if o.output_type == "execute_result"]
    assert len(value) == 1, cell.outputs
    shares = ast.literal_eval(value[0].data["text/plain"])  # the cell's value: {layer: [share per expert]}
    assert shares, "the demo reported no expert shares"
    for layer, s in shares.items():
        assert abs(sum(s) - 1) < 0.01, (layer, s)


#: What each notebook must have shown, read from its executed outputs.
OUTCOMES = {"01_doctor.ipynb": _doctor_outcome, "02_out_of_memory.ipynb": _oom_outcome,
            "03_router_collapse.ipynb": _collapse_outcome, "04_train_with_zeromoe.ipynb": _training_outcome}
