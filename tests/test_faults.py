"""Timeouts reach every process group, and a rank that raises brings the whole job down.

One real 2-rank launch with ``ZeroMoEStrategy(timeout=60 s)``; rank 1 raises at step 3.
"""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

from support.jobs import JOBS, run

TIMEOUT = 60  # seconds; generous because two ranks start on two busy cores
MARGIN = 45  # teardown, process exit, a loaded machine


@pytest.fixture(scope="module")
def fault_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("fault")
    cmd = [sys.executable, str(JOBS / "fault.py"), "--out", str(out), "--timeout", str(TIMEOUT), "--fail-step", "3"]
    proc = run(cmd, timeout=TIMEOUT * 5)
    return proc, out, time.time()


def test_every_group_gets_the_strategy_timeout(fault_run):
    """World, expert-parallel and expert-data-parallel groups all carry timeout=60 s."""
    _, out, _ = fault_run
    for rank in (0, 1):
        timeouts = json.loads((out / f"timeouts{rank}.json").read_text())
        fresh = timeouts.pop("fresh_new_group")
        assert fresh == 1800.0, "torch's new_group default (gloo: 30 min) is what DeepSpeed's groups start with"
        assert any(k.startswith("expert_parallel/") for k in timeouts)
        assert any(k.startswith("expert_data_parallel/") for k in timeouts)
        assert set(timeouts.values()) == {float(TIMEOUT)}, timeouts


def test_injected_failure_stops_every_rank_within_timeout(fault_run):
    proc, out, finished = fault_run
    assert proc.returncode != 0
    assert "InjectedFault: injected failure on rank 1 at step 3" in proc.stderr, proc.stderr[-3000:]
    failed_at = float((out / "failed_at").read_text())
    assert finished - failed_at < TIMEOUT + MARGIN, f"took {finished - failed_at:.0f} s after the failure"
    for rank in (0, 1):
        pid = int((out / f"pid{rank}").read_text())
        assert not _alive(pid), f"rank {rank} (pid {pid}) is still running"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
