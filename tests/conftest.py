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


def _ds_shm_buffers() -> set[str]:
    from troubleshooter.doctor.host import DEEPSPEED_SHM_BUFFERS  # import-light, unlike lightning_zeromoe.engine

    shm = Path("/dev/shm")
    return {p.name for p in shm.glob(DEEPSPEED_SHM_BUFFERS)} if shm.is_dir() else set()


def _fail_on_new_buffers(before: set[str], after_what: str) -> None:
    left = sorted(_ds_shm_buffers() - before)
    if left:
        pytest.fail(f"/dev/shm holds {len(left)} new DeepSpeed all-reduce buffer(s) after {after_what}: {left}; "
                    "the run that made it must call lightning_zeromoe.engine.processes.release_cpu_allreduce_buffer "
                    "once its process groups exist", pytrace=False)


@pytest.fixture(scope="session", autouse=True)
def no_deepspeed_buffer_left_by_the_session():
    """As below, for the session and its module and session fixtures (which run reproductions and launches)."""
    before = _ds_shm_buffers()
    yield
    _fail_on_new_buffers(before, "the test session (a module or session fixture, or a test)")


@pytest.fixture(autouse=True)
def no_deepspeed_buffer_left_in_dev_shm():
    """A test after which a new DeepSpeed CPU all-reduce buffer is left in ``/dev/shm`` fails: DeepSpeed makes one
    (69 MB) per rank when every rank is on one host and never removes it, so each run that does not release it
    (``release_cpu_allreduce_buffer``) keeps 69 MB of the machine's memory until a reboot."""
    before = _ds_shm_buffers()
    yield
    _fail_on_new_buffers(before, "this test")
