"""Run tests/jobs/deepspeed_errors.py once per test session and share its records.

The job imports deepspeed and triggers real errors and calls (about 20 s), so test_explain.py and
test_doctor.py read one run instead of starting deepspeed twice.
"""

from __future__ import annotations

import json
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

JOB = Path(__file__).resolve().parents[1] / "jobs" / "deepspeed_errors.py"


@lru_cache(maxsize=1)
def records() -> dict[str, dict]:
    """case -> the JSON record the job printed for it."""
    proc = subprocess.run([sys.executable, str(JOB)], capture_output=True, text=True, timeout=300,
                          cwd=JOB.parents[2])
    found = {r["case"]: r for r in (json.loads(line) for line in proc.stdout.splitlines()
                                    if line.startswith('{"case"'))}
    assert found, proc.stderr[-3000:]
    return found
