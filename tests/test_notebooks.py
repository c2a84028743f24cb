"""Every notebook in notebooks/ is stored without outputs and runs top to bottom in a real kernel.

Each notebook is executed by nbclient with an ipykernel from this interpreter (jupyter_client
replaces the ``python3`` kernelspec's ``python`` with ``sys.executable``); any error fails it,
except in cells tagged ``raises-exception`` (01 shows the automatic diagnosis of a failing cell),
which must show one. The notebooks assert their own outcomes (the OOM really raised, the collapse
really happened, the 2-process training reported expert shares), so running them tests the
reproductions they show, not only the notebook files.

Why the notebooks run concurrently, each in its own runner process: they are independent, and
most of their wall time on a shared 2-core machine is spent waiting for a CPU (kernel start-up,
importing torch, DeepSpeed and Lightning, the 2-rank training of 04); run one after the other
they take about as long as the rest of the suite together.
"""

from __future__ import annotations

import os
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
