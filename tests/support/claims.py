"""tests/jobs/claims_job.py, run at most once per pytest session and shared by the tests that
read it (tests/test_knowledge_claims.py, tests/test_own_errors.py): its start-up (deepspeed,
transformers, a process group) is the expensive part."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from functools import lru_cache
from pathlib import Path

JOB = Path(__file__).resolve().parents[1] / "jobs" / "claims_job.py"


@lru_cache(maxsize=1)
def claims() -> dict:
    out = Path(tempfile.mkdtemp(prefix="claims-"))
    proc = subprocess.run([sys.executable, str(JOB), str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {"out": out, **json.loads(proc.stdout.strip().splitlines()[-1])}
