import sys
from pathlib import Path

import pytest

# tests/ on sys.path: test modules and job scripts import the shared helpers as ``support.*``.
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def export_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One 2-rank launch of ``tests/jobs/export_job.py`` for every family it trains (the tiny MoE,
    Mixtral, the variants), read by ``test_checkpoint.py`` and ``test_export_safety.py``:
    ``<dir>/<family>/``. Tests that could damage a checkpoint copy it first."""
    from support.jobs import run_job

    out = tmp_path_factory.mktemp("export_runs")
    run_job("export_job.py", "--family", "tiny", "mixtral", "variants", "--out", str(out), timeout=1500)
    return out
